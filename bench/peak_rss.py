"""Run a Python script (or `-c CODE`) as __main__ and write its peak RSS (VmHWM, KiB) to a file.

    python bench/peak_rss.py REPORT_FILE script.py [args...]
    python bench/peak_rss.py REPORT_FILE -c "code" [args...]

This wrapper imports nothing beyond the standard library's runpy, so the peak it reports is the
program's own. Used by bench.common.run_measured.
"""

from __future__ import annotations

import runpy
import sys


def _hwm_kib() -> str:
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(line.split()[1] for line in handle if line.startswith("VmHWM:"))


def main() -> None:
    report, program, *args = sys.argv[1:]
    try:
        if program == "-c":
            sys.argv = ["-c", *args[1:]]
            exec(compile(args[0], "<bench>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = [program, *args]
            runpy.run_path(program, run_name="__main__")
    finally:
        with open(report, "w", encoding="ascii") as handle:
            handle.write(_hwm_kib())


if __name__ == "__main__":
    main()
