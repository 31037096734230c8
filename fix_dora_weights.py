"""Repair damaged LoRA/DoRA adapter weights into a new file, module by module.

    python fix_dora_weights.py --weights_path ./output/checkpoints/checkpoint-250
    python fix_dora_weights.py --weights_path my_lora.safetensors --base_model builtin:tiny-sdxl

Writes <name>_fixed.safetensors next to the input (or --output); the original is only replaced
with --in-place, which keeps <name>.bak.safetensors. NaN/Inf or fp16-overflowing factors: the
module's update is zeroed (it falls back to the base weight). NaN/Inf or zero DoRA magnitudes:
reset to the base weight's norm (needs --base_model; without it such modules are removed, and
loaders keep the base weight). Zero-norm rows are made safe, dora_scale reshaped, leftover key
names renamed; --from-checkpoint brings broken modules back from an earlier good checkpoint.
The output is re-read and verified before it is renamed into place. Exit code: 0 repaired (or
nothing to repair), 1 problems left, 2 unreadable input or a failed write (one line naming it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdxl_trainer.doctor.base_weights import BaseWeights
from sdxl_trainer.doctor.checks import OUTLIER
from sdxl_trainer.doctor.cli import EXIT_CLEAN, EXIT_PROBLEMS, DoctorError, load_base, make_parser, run
from sdxl_trainer.doctor.repairs import Earlier, RepairOptions
from sdxl_trainer.doctor.rewrite import VerificationError, plan_repairs, write_repaired


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("fix_dora_weights.py", __doc__)
    parser.add_argument("--output", default=None, help="where to write the repaired file")
    parser.add_argument("--in-place", action="store_true",
                        help="replace the input file, keeping the original as <name>.bak.safetensors")
    parser.add_argument("--from-checkpoint", default=None, metavar="EARLIER",
                        help="an earlier checkpoint (folder or file) whose healthy modules replace broken ones")
    parser.add_argument("--clamp-outliers", action="store_true",
                        help="clamp DoRA magnitudes to within 10x of the base weight's norm (needs --base_model)")
    parser.add_argument("--magnitude-from", choices=("base", "adapted"), default="base",
                        help="reset broken magnitudes to the norm of the base weight W (default) or of W+ΔW")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    return run(fix, parser.parse_args(argv))


def fix(args: argparse.Namespace) -> int:
    """Plan, print, write and verify the repair of every adapter file the path names."""
    from sdxl_trainer.formats.adapter_files import adapter_files

    files, how = adapter_files(args.weights_path)
    if args.output and len(files) > 1:
        raise DoctorError(f"--output names one file, but {args.weights_path} holds {len(files)} "
                          "adapter files: pass one of them as --weights_path")
    if args.in_place and args.output:
        raise DoctorError("--in-place and --output exclude each other")
    base = load_base(args)
    earlier = adapter_files(args.from_checkpoint)[0] if args.from_checkpoint else []
    print(f"reading {how}")
    codes = [fix_file(path, args, base, earlier) for path in files]
    return max(codes)


def fix_file(path: Path, args: argparse.Namespace, base: BaseWeights | None, earlier: list[Path]) -> int:
    from sdxl_trainer.formats.adapter_files import PEFT, detect_format

    file_format = detect_format(path)
    earlier_file = next((candidate for candidate in earlier if detect_format(candidate) == file_format), None)
    if earlier and earlier_file is None:
        raise DoctorError(f"--from-checkpoint {args.from_checkpoint}: no {file_format} adapter file")
    restore = Earlier(earlier_file, base) if earlier_file else None
    options = RepairOptions(base, restore, args.clamp_outliers, args.magnitude_from)
    plan = plan_repairs(path, options)
    print(f"\n{path}: {plan.format}, {plan.unchanged + len(plan.repairs)} modules")
    for name, repair in plan.repairs.items():
        if repair.actions:
            print(f"  {name if repair.module is None else repair.module.label}: {'; '.join(repair.actions)}")
    for name, finding in plan.remaining:
        clamp = " (--clamp-outliers clamps it)" if finding.kind == OUTLIER else ""
        print(f"  left as it is: {name}: {finding.kind}: {finding.detail}{clamp}")
    if not plan.changed:
        print("nothing to repair, nothing written" + (": the problems above remain" if plan.remaining else ""))
        return EXIT_PROBLEMS if plan.remaining else EXIT_CLEAN
    if plan.unchanged + len(plan.repairs) == len(plan.removed):
        print("every module is broken: nothing usable is left. Restore an earlier checkpoint (--from-checkpoint) "
              'or train again with training.mixed_precision "bf16" or "no"')
        return EXIT_PROBLEMS

    destination = path if args.in_place else Path(args.output or path.with_name(path.stem + "_fixed.safetensors"))
    if destination.resolve() == path.resolve() and not args.in_place:
        raise DoctorError(f"--output {destination} is the input file: use --in-place, which keeps a backup")
    backup = path.with_name(path.stem + ".bak.safetensors") if args.in_place else None
    if backup is not None and backup.exists():
        raise DoctorError(f"{backup} exists (an earlier backup): move it away before another --in-place")
    summary = (f"{plan.changed - len(plan.removed)} repaired, {len(plan.removed)} removed, "
               f"{len(plan.repairs) - plan.changed + plan.unchanged} unchanged bit for bit")
    if args.dry_run:
        print(f"dry run: would write {destination} ({summary})")
        return EXIT_PROBLEMS if plan.remaining else EXIT_CLEAN
    try:
        write_repaired(plan, destination, options, backup)
    except VerificationError as error:
        print(f"error: the repaired file failed its check ({error}); nothing was written", file=sys.stderr)
        return EXIT_PROBLEMS
    left = " but those above" if plan.remaining else ""
    print(f"wrote {destination} ({summary}); re-read and verified: finite, loadable, no findings left{left}")
    if backup:
        print(f"the original is kept as {backup}")
    elif plan.format == PEFT:
        print(f"load it with pipe.load_lora_weights({str(destination.parent)!r}, weight_name={destination.name!r})")
    return EXIT_PROBLEMS if plan.remaining else EXIT_CLEAN


if __name__ == "__main__":
    sys.exit(main())
