"""Data pipeline benchmark: image decode + bucket + crop throughput with 0 and 2 loader workers,
an epoch's data work with the latent cache versus without (VAE encoding every batch), and the
latent cache's read throughput against reading the same bytes raw.

    python bench/bench_data.py

The VAE is the full-size SDXL architecture (random weights) so that the encode cost the cache
saves is the real one; images are generated photograph-sized JPEGs.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dataset
from bench.common import bench_args, best_of, write_results
from bench.sdxl_arch import VAE
from sdxl_trainer.config import DataConfig
from sdxl_trainer.latent_cache import LatentCache, LatentKey

SIZE = 256  # bucket area 256x256 keeps the full-size VAE affordable on a CPU
CACHE_ENTRIES = 64  # entries of a 1024x1024 SDXL image (128x128 latents) for the read benchmark


def make_images(folder: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    sizes = [(1024, 768), (768, 1024), (900, 900), (1200, 700)]
    for index in range(count):
        width, height = sizes[index % len(sizes)]
        noise = rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)
        image = Image.fromarray(noise).resize((width, height), Image.Resampling.BICUBIC)
        image.save(folder / f"img_{index:03d}.jpg", quality=90)
        (folder / f"img_{index:03d}.txt").write_text("tok, noise", encoding="utf-8")


def epoch(items: dataset.ImageCaptionDataset, plan: dataset.DatasetPlan, workers: int, vae=None) -> float:
    """Seconds for one epoch of batches (and VAE encodes when `vae` is given)."""
    loader = torch.utils.data.DataLoader(items, batch_sampler=plan.sampler(seed=0), collate_fn=dataset.collate,
                                         num_workers=workers)
    start = time.perf_counter()
    for batch in loader:
        if vae is not None:
            with torch.no_grad():
                vae.encode(batch["pixel_values"].float()).latent_dist.sample()
    return time.perf_counter() - start


def cache_read_rows(folder: Path, entries: int) -> list[dict]:
    """LatentCache.load (parse, dtype/shape/finite checks) against reading the same files' bytes,
    for SDXL-sized entries in fp32 and bf16, all in the page cache."""
    rows = []
    generator = torch.Generator().manual_seed(0)
    for dtype in ("fp32", "bf16"):
        cache = LatentCache(folder / dtype, "bench-vae", dtype, "sample", "fp32")
        keys = [LatentKey(f"{index:064x}", 1024, 1024, 0, 0, False) for index in range(entries)]
        for key in keys:
            cache.save(key, torch.randn(4, 128, 128, generator=generator), torch.rand(4, 128, 128, generator=generator))
        paths = [cache.path(key) for key in keys]
        total = sum(path.stat().st_size for path in paths)
        raw = best_of(lambda paths=paths: [path.read_bytes() for path in paths], 5)
        load = best_of(lambda cache=cache, keys=keys: [cache.load(key) for key in keys], 5)
        for measure, seconds in ((f"raw read of the same files ({dtype})", raw),
                                 (f"latent cache read, LatentCache.load ({dtype})", load)):
            rows.append({"measure": measure, "seconds": seconds, "images_per_s": entries / seconds,
                         "MB_per_s": total / seconds / 1e6, "ratio": seconds / raw})
    return rows


def main(argv: list[str] | None = None) -> None:
    from diffusers import AutoencoderKL

    args = bench_args(__doc__.splitlines()[0], argv)
    images, entries = (4, 4) if args.smoke else (16, CACHE_ENTRIES)
    torch.manual_seed(0)
    # --smoke: the same architecture at a fraction of the width (the real one takes a minute here).
    vae = AutoencoderKL(**{**VAE, **({"block_out_channels": (32, 32, 64, 64)} if args.smoke else {})}).eval()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        folder.mkdir()
        make_images(folder, images)
        config = DataConfig(image_dir=str(folder), size=SIZE, bucket={"divisible_by": 64, "batch_size": 2},
                            latent_cache={"cache_dir": str(Path(tmp) / "cache")})
        start = time.perf_counter()
        plan = dataset.plan_dataset(config, batch_size=1)
        scan_seconds = time.perf_counter() - start
        plain = dataset.ImageCaptionDataset(plan.samples, config, seed=0)
        rows = []
        for workers in (0, 2):
            seconds = best_of(lambda workers=workers: epoch(plain, plan, workers), 3)
            rows.append({"measure": f"decode+bucket+crop, {workers} workers", "seconds": seconds,
                         "images_per_s": images / seconds, "MB_per_s": None, "ratio": None})
        rows.append({"measure": "pre-flight scan (decode check + sha256)", "seconds": scan_seconds,
                     "images_per_s": images / scan_seconds, "MB_per_s": None, "ratio": None})
        uncached = epoch(plain, plan, 0, vae)
        cache = LatentCache(config.latent_cache.cache_dir, "bench-vae", "fp32", "sample", "fp32")
        start = time.perf_counter()
        dataset.build_latent_cache(plan, config, cache, vae, "cpu")
        build = time.perf_counter() - start
        cached = epoch(dataset.ImageCaptionDataset(plan.samples, config, seed=0, cache=cache),
                       plan, 0)
        entry_bytes = np.mean([p.stat().st_size for p in Path(config.latent_cache.cache_dir).rglob("*.safetensors")])
        rows += [
            {"measure": "epoch data work without cache (decode + VAE encode)", "seconds": uncached,
             "images_per_s": images / uncached, "MB_per_s": None, "ratio": 1.0},
            {"measure": "epoch data work with cache (read + sample latents)", "seconds": cached,
             "images_per_s": images / cached, "MB_per_s": None, "ratio": cached / uncached},
            {"measure": "one-time cache build", "seconds": build, "images_per_s": images / build, "MB_per_s": None,
             "ratio": build / uncached},
        ]
        rows += cache_read_rows(Path(tmp) / "read", entries)
    write_results("data", rows, notes=(
        f"{images} JPEG images (700-1200 px), buckets of area {SIZE}², the SDXL VAE architecture "
        f"{'at toy widths (--smoke)' if args.smoke else 'at full size'} in fp32 on the CPU; decode rows: best of 3 "
        f"epochs, worker start-up included; a cached entry at that size (mean + std, fp32) is "
        f"{entry_bytes / 1024:.0f} KiB. Cache read: "
        f"{entries} entries of a 1024² image (4×128×128 mean + std: 512 KiB in fp32, 256 KiB in bf16), best of 5, "
        "files in the page cache; ratio = time / the raw read of the same bytes. Ratios of the epoch rows are to the "
        "epoch without cache."), results_dir=args.results_dir)


if __name__ == "__main__":
    main()
