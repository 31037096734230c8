"""What debug_dora_weights.py and fix_dora_weights.py share on the command line: the input options,
the exit codes, loading --base_model, and bad input as one line on stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..formats.adapter_files import AdapterFileError
from .base_weights import BaseWeights

if TYPE_CHECKING:
    import argparse

EXIT_CLEAN, EXIT_PROBLEMS, EXIT_UNREADABLE = 0, 1, 2


class DoctorError(Exception):
    """Bad usage or a base model that does not load (exit code 2)."""


# What the scripts report in one line with exit code 2 (the message names the path).
INPUT_ERRORS = (DoctorError, AdapterFileError)


def make_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser both scripts start from: the first paragraph of `doc` describes the script, the
    rest is the epilog; then the input options they share."""
    import argparse

    description, epilog = doc.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights_path", required=True,
                        help="a checkpoint or output folder of this trainer, pytorch_lora_weights.safetensors "
                        "or a kohya/LyCORIS .safetensors file")
    parser.add_argument("--base_model", default=None,
                        help="the base model (same sources as model.id: hub id, diffusers folder, single file, "
                        "builtin:tiny-sdxl); enables the checks and repairs that need the base weights")
    parser.add_argument("--base_config_dir", default=None,
                        help="config folder for a single-file --base_model (as model.config_dir)")
    return parser


def run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a script's command: bad input and a failed write (a full disk, an output path through
    a file) are one line on stderr (naming the path) and exit code 2, never 1 (problems found)."""
    from ..atomic import OutputWriteError

    try:
        return command(args)
    except (*INPUT_ERRORS, OutputWriteError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNREADABLE
    except KeyboardInterrupt:
        print("interrupted; no file was changed", file=sys.stderr)
        return 130


def load_base(args: argparse.Namespace) -> BaseWeights | None:
    """The --base_model's weights, or None without one; a model that does not load is a DoctorError."""
    if not args.base_model:
        return None
    from ..config import ConfigError

    print(f"loading base model {args.base_model} …")
    try:
        return BaseWeights(args.base_model, args.base_config_dir)
    except (ConfigError, OSError, ValueError) as error:
        raise DoctorError(f"--base_model {args.base_model}: cannot load it ({error})") from error
