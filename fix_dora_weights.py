"""Repair damaged DoRA/LoRA adapter weights into a new file.

    python fix_dora_weights.py --weights_path ./output/checkpoints/checkpoint-250

Not implemented yet (planned): this script exits with code 1 and says so.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fix_dora_weights.py", description=__doc__.splitlines()[0])
    parser.add_argument("--weights_path", required=True, help="checkpoint folder, output folder or adapter file")
    parser.parse_args(argv)
    print("fix_dora_weights.py: not implemented yet (planned); nothing was read or written", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
