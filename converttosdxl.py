"""Convert a diffusers SDXL pipeline folder into one single-file SDXL checkpoint (.safetensors).

The output uses Stability's "sgm" layout, which ComfyUI, A1111-family UIs and diffusers'
`from_single_file` load. The command line is that of diffusers' own
`scripts/convert_diffusers_to_original_sdxl.py`, so existing configs and habits keep working:

    python converttosdxl.py --model_path <diffusers folder> --checkpoint_path <out.safetensors> [--half]

Memory stays near the largest single tensor plus a bounded read window (about 1.1 GB peak for
full-size SDXL). Nothing is written unless every tensor is finite (see --allow-nonfinite), and the
file only appears, complete and verified, at the very end. This file is the command line; the
conversion itself is `sdxl_trainer/formats/converter.py`, which the export after training also uses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sdxl_trainer.atomic import OutputWriteError
from sdxl_trainer.formats.converter import ConversionError, NonFiniteError, convert

# `import converttosdxl` keeps working for code that calls the converter in-process.
__all__ = ["ConversionError", "NonFiniteError", "convert", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert a diffusers SDXL pipeline folder to a single-file SDXL checkpoint "
        "(ComfyUI / A1111 / from_single_file)."
    )
    parser.add_argument("--model_path", required=True, help="the diffusers pipeline folder to convert")
    parser.add_argument("--checkpoint_path", required=True, help="the .safetensors file to write")
    parser.add_argument("--half", action="store_true", help="store floating-point weights as float16")
    parser.add_argument(
        "--use_safetensors",
        action="store_true",
        help="accepted for compatibility with diffusers' script; the output is always safetensors",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint_path")
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="write the file even if some weights are NaN/Inf (they are listed as warnings)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (0 ok, 1 non-finite weights, 2 usage or a failed write)."""
    args = _parser().parse_args(argv)
    if args.checkpoint_path.lower().endswith(".ckpt"):
        print(
            f"warning: {args.checkpoint_path} will be a safetensors file despite its .ckpt name; "
            "tools that pick the format from the name will try to unpickle it",
            file=sys.stderr,
        )
    try:
        convert(
            args.model_path,
            args.checkpoint_path,
            half=args.half,
            overwrite=args.overwrite,
            allow_nonfinite=args.allow_nonfinite,
        )
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except (OutputWriteError, OSError) as error:  # a full disk, an output path through a file
        print(f"error: {error}", file=sys.stderr)
        return ConversionError.exit_code
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
