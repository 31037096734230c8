"""Helpers for the benchmarks: timing, memory high-water marks, child processes, and writing
results as JSON plus a markdown table."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdxl_trainer.atomic import write_json, write_text

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"


def best_of(function: Callable[[], Any], repeats: int = 3) -> float:
    """The fastest of `repeats` wall-clock runs, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_args(description: str, argv: list[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The command line every benchmark shares: `--smoke` (seconds, for the tests) and `--results-dir`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="a tiny run that only checks the code path works")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help=f"where results go (default {RESULTS})")
    if extra:
        extra(parser)
    return parser.parse_args(argv)


def quiet_env() -> dict[str, str]:
    """Environment for child processes: offline, no library chatter, the repo importable."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error",
            "PYTHONPATH": str(ROOT)}


def proc_status_kib(field: str) -> int:
    """A `/proc/self/status` value in KiB (VmRSS: resident now, VmHWM: the resident high-water mark)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS (Linux ≥ 4.0), so a later VmHWM is the peak of what follows."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


def run_measured(args: list[str], cwd: Path = ROOT) -> tuple[float, int]:
    """Run `python <args>` in a fresh interpreter; return (wall seconds, the child's peak RSS in bytes).

    The peak comes from the child's own VmHWM (bench/peak_rss.py reads it at exit). getrusage's
    ru_maxrss is no good here: subprocess starts children with vfork, and the kernel then carries
    the parent's high-water mark into the child's.
    """
    with tempfile.TemporaryDirectory() as tmp:
        report, log = Path(tmp) / "peak.txt", Path(tmp) / "log.txt"
        command = [sys.executable, str(BENCH / "peak_rss.py"), str(report), *args]
        start = time.perf_counter()
        with open(log, "wb") as output:
            code = subprocess.call(command, cwd=cwd, env=quiet_env(), stdout=output, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - start
        if code != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({code}):\n{log.read_text(errors='replace')[-3000:]}")
        return seconds, int(report.read_text()) * 1024


def measured_here(args: list[str]) -> tuple[float, int]:
    """`run_measured(["train_sdxl.py", *ARGS])`'s numbers from a run in this interpreter (smoke
    runs, which measure nothing of a fresh process): wall seconds, and this process's RSS
    high-water mark from the start of the run, in bytes."""
    reset_peak_rss()
    start = time.perf_counter()
    result = train_sdxl_here(args[1:])
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return seconds, proc_status_kib("VmHWM") * 1024


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(), "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def write_results(name: str, rows: list[dict[str, Any]], notes: str = "", results_dir: Path = RESULTS,
                  extra: dict[str, Any] | None = None) -> Path:
    """<results_dir>/<name>.json and <name>.md: one row per measurement (plus `extra` in the JSON)."""
    data = {"benchmark": name, "machine": machine(), "rows": rows, "notes": notes, **(extra or {})}
    write_json(results_dir / f"{name}.json", data)
    about = data["machine"]
    columns = list(rows[0])
    lines = [f"### {name}", "", f"Machine: {about['cpu_count']} CPU cores, torch {about['torch']}"
             + (f", {about['cuda']}" if about["cuda"] else "")
             + f"; load average at the end {about['load_average'][0]:g}", ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    if notes:
        lines += ["", notes]
    write_text(results_dir / f"{name}.md", "\n".join(lines) + "\n")
    print(json.dumps(data, indent=2))
    return results_dir / f"{name}.md"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def train_sdxl_here(args: list[str]) -> subprocess.CompletedProcess:
    """`train_sdxl.py ARGS` in this interpreter, its output captured: what a fresh interpreter's run
    gives, without paying its imports again (the tests' `train_here` is this too)."""
    import train_sdxl

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = train_sdxl.main(args)
    return subprocess.CompletedProcess(["train_sdxl.py", *args], code, stdout.getvalue(), stderr.getvalue())


def run_train_sdxl(name: str, args: list[str], in_process: bool = False) -> None:
    """`train_sdxl.py ARGS` in a fresh interpreter, or with `in_process` in this one (for smoke runs,
    which measure nothing of the process); a failure raises with the end of its stderr."""
    if in_process:
        result = train_sdxl_here(args)
    else:
        result = subprocess.run([sys.executable, str(ROOT / "train_sdxl.py"), *args], cwd=ROOT, env=quiet_env(),
                                capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: train_sdxl.py failed:\n{result.stderr[-3000:]}")


QUICKSTART = ROOT / "configs" / "quickstart.json"


def train_quickstart(name: str, settings: dict[str, Any], in_process: bool = False, config: Path = QUICKSTART) -> None:
    """`train_sdxl.py` on `config` (the quickstart's) with `settings` as `--set` overrides (in a
    fresh interpreter unless `in_process`: see run_train_sdxl)."""
    args = ["--config", str(config)]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    run_train_sdxl(name, args, in_process)
