"""Run every CPU benchmark and write bench/results/<name>.json and <name>.md for each.

    python bench/run_all.py            # the tables of docs/performance.md (over an hour on 2 cores)
    python bench/run_all.py --smoke    # seconds per benchmark: only checks that each still runs

Each benchmark runs in its own interpreter, so that one's threads, memory and imports cannot
colour the next (--smoke runs them all in this one, to save the start-ups). The built-in tiny
model is read from, or built on first use in, SDXL_TRAINER_CACHE (default ~/.cache/sdxl_trainer),
as the quickstart does; everything else goes to temporary folders that are removed afterwards.
The GPU benchmark (bench/gpu_sdxl.py) is not run here: it needs a CUDA machine; nor are the memory,
adapter, quantized-base and seed benchmarks (bench/bench_memory.py, bench/bench_adapters.py: 4 minutes,
three training runs; bench/bench_quantized_base.py; bench/bench_seeds.py: the quickstart at five
seeds), which are run on their own. --smoke runs
their smoke modes too (the GPU one on the CPU), so that it checks every benchmark's code path.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BENCH, bench_args, quiet_env

BENCHMARKS = ("bench_step", "bench_text_cache", "bench_dora", "bench_data", "bench_convert", "bench_startup",
              "bench_pretrained", "bench_learning", "bench_fused")
# --smoke only (each with its own options): on the CPU the GPU benchmark's MFU needs a stated peak,
# and its profile runs too; the seed benchmark gets an override, so that the smoke run goes through
# its --set path.
SMOKE_ONLY = {"bench_memory": [], "bench_adapters": [], "bench_quantized_base": [],
              "bench_seeds": ["--set", "eval.cfg_scale=2"], "gpu_sdxl": ["--peak-tflops", "1", "--profile"]}


def main(argv: list[str] | None = None) -> int:
    args = bench_args(__doc__.splitlines()[0], argv)
    started, load = time.perf_counter(), os.getloadavg()[0]
    benchmarks = {name: [] for name in BENCHMARKS} | (SMOKE_ONLY if args.smoke else {})
    for name, extra in benchmarks.items():
        start = time.perf_counter()
        options = ["--results-dir", str(args.results_dir), *extra]
        if args.smoke:
            with contextlib.redirect_stdout(io.StringIO()):
                importlib.import_module(f"bench.{name}").main([*options, "--smoke"])
        else:
            subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *options], env=quiet_env(), check=True,
                           stdout=subprocess.DEVNULL)
        table = name.removeprefix("bench_") + ("_smoke" if name in SMOKE_ONLY else "")
        print(f"{name}: {time.perf_counter() - start:.0f} s -> {args.results_dir / table}.md",
              flush=True)
    print(f"all benchmarks: {time.perf_counter() - started:.0f} s; load average {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
