"""Start-up: wall time and peak RSS of `train_sdxl.py --help` and `--dry-run` (quickstart config),
beside the interpreter and `import torch` alone.

    python bench/bench_startup.py

Each command is a fresh interpreter, best of N runs taken in turn. The dry run writes nothing:
its latent cache folder is a temporary one (all misses), and the built-in tiny model's folder is
read where it already is (SDXL_TRAINER_CACHE, default ~/.cache/sdxl_trainer).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, bench_args, run_measured, write_results


def main(argv: list[str] | None = None) -> None:
    args = bench_args(__doc__.splitlines()[0], argv)
    repeats = 1 if args.smoke else 3
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        dry_run = [str(ROOT / "train_sdxl.py"), "--dry-run", "--config", str(ROOT / "configs" / "quickstart.json"),
                   "--set", f"data.latent_cache.cache_dir={tmp}"]
        commands = {
            "python -c pass": ["-c", "pass"],
            "python -c 'import torch'": ["-c", "import torch"],
            "train_sdxl.py --help": [str(ROOT / "train_sdxl.py"), "--help"],
            "train_sdxl.py --dry-run (quickstart)": dry_run,
            "train_sdxl.py --dry-run, eval off": [*dry_run, "--set", "eval.live.enabled=false",
                                                  "--set", "eval.final.enabled=false"],
        }
        if args.smoke:  # each code path once
            commands = {name: command for name, command in commands.items() if name.startswith("train_sdxl.py")
                        and "eval off" not in name}
        best: dict[str, tuple[float, int]] = {}
        for _ in range(repeats):
            for name, command in commands.items():
                seconds, peak = run_measured(command)
                best[name] = min(best.get(name, (seconds, peak)), (seconds, peak))
    rows = [{"command": name, "seconds": seconds, "peak_rss_MB": peak / 1e6} for name, (seconds, peak) in best.items()]
    notes = (f"Best of {repeats} runs of each command, in a fresh interpreter each (bench/peak_rss.py, which "
             "reads the process's own VmHWM). The dry run decodes the 18 sample images and hashes them, "
             "and with eval on it validates the eval sampler, which imports diffusers and scipy.")
    write_results("startup", rows, notes, args.results_dir)


if __name__ == "__main__":
    main()
