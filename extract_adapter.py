"""Extract a LoRA or DoRA adapter from a full fine-tune and its base model, by the SVD of each layer's update.

    python extract_adapter.py --base builtin:tiny-sdxl --tuned .output/my_full_run --rank 16 --dora \\
        --out my_dora.safetensors
    python extract_adapter.py --base base.safetensors --tuned tuned.safetensors --config-dir sdxl_configs/ \\
        --rank 64 --error-target 0.2 --svd lowrank --out extracted/

The models are read as model.id reads them: this trainer's output folder of a full fine-tune, a
diffusers folder, an SDXL single file (with --config-dir, offline) or builtin:tiny-sdxl. Every
changed layer among --targets (convolutions too with "all") gets a module of --rank, or with
--error-target (or --dynamic) the lowest rank that meets it, at most --rank. DoRA's magnitude is
set so that the merged weight's channel norms equal the tuned model's exactly.

The report gives, per layer and overall, the merged weight's relative error against the tuned
weight (‖W_merged − W_tuned‖ / ‖W_tuned‖) and the part of the update the rank misses. Changes no
adapter can carry (biases, norms, embeddings) are listed as lost.

--out FILE.safetensors writes one file (--format kohya: ComfyUI, A1111/Forge, LyCORIS, diffusers;
--format diffusers: peft's format); --out FOLDER writes both, as a training run's output folder.
Files are written atomically; bad input is one line and exit code 2, with nothing written.
See docs/adapters.md.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from sdxl_trainer.lowrank import LowRankError, add_rank_options, print_report, rank_choice, run_tool


def main(argv: list[str] | None = None) -> int:
    description, epilog = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="extract_adapter.py", description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the base model the fine-tune started from")
    parser.add_argument("--tuned", required=True, help="the fully fine-tuned model")
    parser.add_argument("--config-dir", default=None,
                        help="a diffusers config folder for single-file models (as model.config_dir)")
    parser.add_argument("--out", required=True, help="a .safetensors file, or a folder for both formats")
    parser.add_argument("--format", choices=("kohya", "diffusers"), default="kohya",
                        help="the format of a .safetensors --out (default kohya)")
    parser.add_argument("--dora", action="store_true", help="a DoRA adapter (default: LoRA)")
    parser.add_argument("--targets", choices=("attn", "attn-mlp", "all"), default="all",
                        help="the layers adapted, as adapter.targets (default all: attention, MLP, convolutions)")
    parser.add_argument("--error-target", type=float, default=None,
                        help="per layer the lowest rank (at most --rank) whose update error ‖ΔW − ΔW_r‖/‖ΔW‖ is "
                        "at most this (kohya's sv_fro with √(1 − E²))")
    add_rank_options(parser)
    return run_tool(extract, parser.parse_args(argv), (LowRankError,))


def extract(args: argparse.Namespace) -> None:
    from sdxl_trainer.adapter_extraction import ExtractOptions, load_models, write_adapter
    from sdxl_trainer.adapter_extraction import extract as extract_layers

    if args.error_target is not None:
        if args.dynamic is not None:
            raise LowRankError("--error-target and --dynamic exclude each other")
        if not 0 <= args.error_target < 1:
            raise LowRankError(f"--error-target {args.error_target:g}: must be in [0, 1)")
        args.dynamic, args.dynamic_param = "sv_fro", math.sqrt(1 - args.error_target**2)
    options = ExtractOptions(rank_choice(args), args.dora, args.targets)
    out = Path(args.out)
    as_file = out.suffix == ".safetensors"
    if out.exists() and out.is_dir() == as_file:
        raise LowRankError(f"--out {out}: is a {'folder' if as_file else 'file'}; name a .safetensors file or a folder")
    base, tuned = load_models({"--base": args.base, "--tuned": args.tuned}, args.config_dir)
    extraction = extract_layers(base, tuned, options)
    del tuned
    print_report([layer.error for layer in extraction.layers], per_layer=not args.quiet)
    if extraction.lost:
        worst = max(extraction.lost, key=extraction.lost.get)
        print(f"lost: {len(extraction.lost)} changed tensor(s) no adapter carries (biases, norms, embeddings, "
              f"layers outside --targets); the largest change is {worst} ({extraction.lost[worst]:.2e} of its norm)")
    formats = (args.format,) if as_file else ("diffusers", "kohya")
    for path in write_adapter(base, extraction, out, formats):
        print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
