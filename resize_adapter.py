"""Resize a LoRA or DoRA adapter file to a lower rank, DoRA's magnitude kept.

    python resize_adapter.py my_dora_r32.safetensors --rank 8 --out my_dora_r8.safetensors
    python resize_adapter.py .output/my_run --rank 32 --dynamic sv_fro --dynamic-param 0.9 \\
        --base builtin:tiny-sdxl --out smaller.safetensors

IN is a diffusers/peft or kohya/LyCORIS file for SDXL, or a folder of this trainer (where it
holds both formats, its diffusers/peft file is read); the output is in the same format, with
alpha = rank in every resized module. Each module keeps its best rank-r approximation (the SVD
of up@down), r = --rank, or with --dynamic (kohya's resize_lora.py methods by name) the fewest
singular values that meet --dynamic-param, at most --rank. With a fixed --rank, modules already
at or below it (say lower-rank convolutions) are kept as they are.

DoRA: the magnitude is kept, because the merged weight's channel norms are the magnitude whatever
the update: the resized adapter's merged weight has exactly the original's norms.

The report gives per module and overall the rank and the part of the update the new rank misses;
with --base (the model the adapter is for), also the merged weight's relative error against the
original adapter's merged weight, and every module is checked against that model's layers.
The output is written atomically; bad input is one line and exit code 2, with nothing written.
See docs/adapters.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sdxl_trainer.lowrank import LowRankError, add_rank_options, print_report, rank_choice, run_tool


def main(argv: list[str] | None = None) -> int:
    from sdxl_trainer.formats.adapter_files import AdapterFileError

    description, epilog = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="resize_adapter.py", description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", metavar="IN", help="the adapter file, or a trainer folder (its diffusers/peft file)")
    parser.add_argument("--out", required=True, help="the resized adapter, a .safetensors file")
    parser.add_argument("--base", default=None,
                        help="the base model (as model.id); enables the merged-weight error and the shape checks")
    parser.add_argument("--config-dir", default=None, help="a diffusers config folder for a single-file --base")
    add_rank_options(parser)
    return run_tool(resize, parser.parse_args(argv), (LowRankError, AdapterFileError))


def resize(args: argparse.Namespace) -> None:
    from sdxl_trainer.adapter_extraction import load_models
    from sdxl_trainer.adapter_resizing import ResizeError, input_file, write_resized
    from sdxl_trainer.adapter_resizing import resize as resize_modules

    choice = rank_choice(args)
    out = Path(args.out)
    if out.suffix != ".safetensors" or out.is_dir():
        raise ResizeError(f"--out {out}: must be a .safetensors file")
    path = input_file(args.input)
    if out.resolve() == path.resolve():
        raise ResizeError(f"--out {out}: is the input file; write the resized adapter elsewhere")
    base = load_models({"--base": args.base}, args.config_dir)[0] if args.base else None
    resized = resize_modules(path, choice, base)
    print(f"{path}: {resized.file_format}, {len(resized.modules)} modules")
    if resized.kept:
        print(f"{resized.kept} module(s) already at or below rank {choice.rank}: kept as they are")
    print_report(resized.errors, per_layer=not args.quiet)
    print(f"wrote {write_resized(resized, out)}")


if __name__ == "__main__":
    raise SystemExit(main())
