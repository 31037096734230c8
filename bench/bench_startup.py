"""Start-up: wall time and peak RSS of `train_sdxl.py --help` and `--dry-run` (quickstart config),
beside the interpreter and `import torch` alone; and the pre-flight at 1k and 10k photo-sized
JPEGs (`--images` for other counts, 100k included), cold (empty scan cache, 1 and 2 workers) and warm.

    python bench/bench_startup.py                              # about 3 minutes on 2 cores
    python bench/bench_startup.py --images 1000 10000 100000   # adds 100k: about 20 minutes more

Each command is a fresh interpreter, best of N runs taken in turn (a cold pre-flight runs once:
each needs its own empty scan cache, and takes minutes at 100k). The dry runs write nothing that
stays: their latent cache and scan cache folders are temporary ones, and the built-in tiny model's
folder is read where it already is (SDXL_TRAINER_CACHE, default ~/.cache/sdxl_trainer).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, bench_args, measured_here, run_measured, write_results

POOL = 300  # distinct photos; the image folders are hard links to them, in turn
EVAL_OFF = ["--set", "eval.live.enabled=false", "--set", "eval.final.enabled=false"]


def photo_jpeg(seed: int, width: int = 1024, height: int = 768) -> bytes:
    """A photo-like JPEG (quality 90, about 450 KB at 1024x768): smooth colour regions, mid-scale
    texture and sensor-like noise, so that its entropy-coded stream is as long as a photo's."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (height // 32, width // 32, 3), dtype=np.uint8))
    texture = Image.fromarray(rng.integers(0, 256, (height // 4, width // 4, 3), dtype=np.uint8))
    pixels = (0.6 * np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), np.float32)
              + 0.25 * np.asarray(texture.resize((width, height), Image.Resampling.BILINEAR), np.float32)
              + rng.normal(20, 20, (height, width, 1)).astype(np.float32))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def image_folder(root: Path, count: int, pool: list[Path]) -> Path:
    """`count` images (hard links to the pool's photos, in turn), each with its own caption."""
    folder = root / f"images_{count}"
    folder.mkdir()
    for index in range(count):
        name = folder / f"img_{index:06d}"
        os.link(pool[index % len(pool)], name.with_suffix(".jpg"))
        name.with_suffix(".txt").write_text(f"tok, a photo, number {index}", encoding="utf-8")
    return folder


def preflight_rows(root: Path, dry_run: list[str], counts: list[int], repeats: int, pool_size: int,
                   measure: Callable[[list[str]], tuple[float, int]] = run_measured) -> list[dict]:
    """Cold (a new, empty scan cache) with 1 and 2 workers, then warm (the 2-worker run's cache),
    each measured by `measure` (a fresh interpreter; --smoke: `measured_here`, this one)."""
    (root / "pool").mkdir()
    pool = [root / "pool" / f"photo_{seed:03d}.jpg" for seed in range(pool_size)]
    for seed, path in enumerate(pool):
        path.write_bytes(photo_jpeg(seed))
    rows = []
    for count in counts:
        folder = image_folder(root, count, pool)
        command = [*dry_run, *EVAL_OFF, "--set", f"data.image_dir={folder}"]
        measured = {}
        for workers in (1, 2):
            cache = root / f"scan_{count}_{workers}"
            measured[workers] = measure([*command, "--set", f"data.scan_cache_dir={cache}",
                                              "--set", f"data.num_workers={workers}"])
        warm = min(measure([*command, "--set", f"data.scan_cache_dir={root / f'scan_{count}_2'}"])
                   for _ in range(repeats))
        for workers, (seconds, peak) in measured.items():
            rows.append({"images": count, "scan_cache": "cold", "workers": workers, "seconds": seconds,
                         "scan_images_per_s": count / max(seconds - warm[0], 1e-9), "peak_rss_MB": peak / 1e6})
        rows.append({"images": count, "scan_cache": "warm", "workers": 2, "seconds": warm[0],
                     "scan_images_per_s": None, "peak_rss_MB": warm[1] / 1e6})
        shutil.rmtree(folder)
    return rows


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images", type=int, nargs="+", default=[1000, 10000],
                        help="image counts of the pre-flight rows (default 1000 10000; 100000 takes minutes)")


def main(argv: list[str] | None = None) -> None:
    args = bench_args(__doc__.splitlines()[0], argv, add_options)
    repeats = 1 if args.smoke else 3
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        dry_run = [str(ROOT / "train_sdxl.py"), "--dry-run", "--config", str(ROOT / "configs" / "quickstart.json"),
                   "--set", f"data.latent_cache.cache_dir={tmp}/latents", "--set", f"data.scan_cache_dir={tmp}/scan"]
        commands = {
            "python -c pass": ["-c", "pass"],
            "python -c 'import torch'": ["-c", "import torch"],
            "train_sdxl.py --help": [str(ROOT / "train_sdxl.py"), "--help"],
            "train_sdxl.py --dry-run (quickstart)": dry_run,
            "train_sdxl.py --dry-run, eval off": [*dry_run, *EVAL_OFF],
        }
        if args.smoke:  # each code path once
            commands = {name: command for name, command in commands.items() if name.startswith("train_sdxl.py")
                        and "eval off" not in name}
        best: dict[str, tuple[float, int]] = {}
        for _ in range(repeats):
            for name, command in commands.items():
                seconds, peak = run_measured(command)
                best[name] = min(best.get(name, (seconds, peak)), (seconds, peak))
        counts = [12] if args.smoke else args.images
        # --smoke: the pre-flight rows in this interpreter (the start-up rows above are fresh ones)
        preflight = preflight_rows(Path(tmp), dry_run, counts, repeats, pool_size=3 if args.smoke else POOL,
                                   measure=measured_here if args.smoke else run_measured)
    rows = [{"command": name, "seconds": seconds, "peak_rss_MB": peak / 1e6} for name, (seconds, peak) in best.items()]
    notes = (f"Best of {repeats} runs of each command, in a fresh interpreter each (bench/peak_rss.py, which "
             "reads the process's own VmHWM). The dry run checks the 18 sample images (from its scan cache "
             "after the first run), and with eval on it validates the eval sampler, which imports diffusers "
             "and scipy.")
    write_results("startup", rows, notes, args.results_dir)
    where = " (--smoke: every run in the benchmark's own interpreter)" if args.smoke else ""
    notes = ("`train_sdxl.py --dry-run` (quickstart, eval off) over generated 1024x768 photo-like JPEGs of "
             f"about 450 KB (quality 90) with a caption each: {3 if args.smoke else POOL} distinct photos, the "
             "folders hard links to them in turn (every file is still read, hashed and decoded; all of them are in "
             "the page cache, so disk reads are not measured). Cold: a new, empty scan cache, once each; warm: the "
             f"2-worker run's cache, best of {repeats}{where}. scan_images_per_s: images / (cold seconds - warm "
             "seconds), the rate of the inspection alone.")
    write_results("preflight", preflight, notes, args.results_dir)


if __name__ == "__main__":
    main()
