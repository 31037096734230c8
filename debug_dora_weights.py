"""Analyse LoRA/DoRA adapter weights: NaN/Inf, zero or underflowing norms, fp16 overflow,
magnitude outliers, badly shaped dora_scale and leftover key names, module by module.

    python debug_dora_weights.py --weights_path ./output/checkpoints/checkpoint-250
    python debug_dora_weights.py --weights_path my_lora.safetensors --base_model builtin:tiny-sdxl

--weights_path takes a checkpoint or output folder of this trainer, a diffusers/peft
pytorch_lora_weights.safetensors or a kohya/LyCORIS file. Exit code: 0 clean, 1 problems found,
2 unreadable input or a failed write (--json: a full disk, a path through a file). Repair what it
finds with fix_dora_weights.py.
"""

from __future__ import annotations

import argparse
import sys

from sdxl_trainer.doctor.cli import EXIT_CLEAN, EXIT_PROBLEMS, load_base, make_parser, run
from sdxl_trainer.doctor.report import FileReport, ModuleReport, analyse_file


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("debug_dora_weights.py", __doc__)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the full report as JSON")
    parser.add_argument("--problems-only", action="store_true", help="list only damaged modules in the table")
    return run(debug, parser.parse_args(argv))


def debug(args: argparse.Namespace) -> int:
    """Print the table, the findings and a verdict for every adapter file the path names."""
    from sdxl_trainer.atomic import write_json
    from sdxl_trainer.formats.adapter_files import adapter_files

    files, how = adapter_files(args.weights_path)
    base = load_base(args)
    print(f"reading {how}")
    reports = [analyse_file(path, base) for path in files]
    for report in reports:
        print_report(report, args.problems_only)
    code = EXIT_PROBLEMS if any(report.damaged for report in reports) else EXIT_CLEAN
    if code:
        with_base = f" --base_model {args.base_model}" if base else ""
        hint = "" if base else " (with --base_model it also checks norms and keeps DoRA modules it repairs)"
        print(f"repair: python fix_dora_weights.py --weights_path {args.weights_path}{with_base}{hint}")
    if args.json:
        write_json(args.json, {"files": [report.to_json() for report in reports], "exit_code": code})
        print(f"full report: {args.json}")
    return code


def print_report(report: FileReport, problems_only: bool) -> None:
    print(f"\n{report.path} ({report.path.stat().st_size / 1e6:.1f} MB)")
    print(f"format: {report.format} ({report.format_reason})")
    for note in report.notes:
        print(f"note: {note}")
    print(f"base model: {report.base_model or 'not given'}")
    shown = report.damaged if problems_only else report.modules
    if shown:
        print("\n" + table(shown, with_ratio=report.base_model is not None))
    if report.damaged:
        print("\nfindings:")
        for module in report.damaged:
            for finding in module.findings:
                print(f"  {module.label}: {finding.kind}: {finding.detail}")
    print(f"\nverdict: {report.verdict()}")


def table(modules: list[ModuleReport], with_ratio: bool) -> str:
    """One aligned row per module: shapes, dtype, NaN/Inf and min/max/mean/std per tensor."""
    header = ["module", "type", "rank", "alpha", "dtype", "down", "up", "magnitude", "NaN", "Inf",
              "down min/max/mean/std", "up min/max/mean/std", "magnitude min/max/mean/std"]
    header += ["m/‖W‖ min..max"] if with_ratio else []
    rows = [header]
    for module in modules:
        stats = module.stats
        row = [module.label, module.kind, number(module.rank), number(module.alpha), ",".join(module.dtypes)]
        row += ["x".join(map(str, module.shapes[role])) if role in module.shapes else "-"
                for role in ("down", "up", "magnitude")]
        row += [str(sum(s.nan for s in stats.values())), str(sum(s.inf for s in stats.values()))]
        row += ["/".join(number(v) for v in (s.min, s.max, s.mean, s.std)) if (s := stats.get(role)) else "-"
                for role in ("down", "up", "magnitude")]
        if with_ratio:
            row.append(f"{module.ratio[0]:.3g}..{module.ratio[1]:.3g}" if module.ratio else "-")
        rows.append(row)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


if __name__ == "__main__":
    sys.exit(main())
