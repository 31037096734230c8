"""Data pipeline benchmark: image decode + bucket + crop throughput with 0 and 2 loader workers,
and an epoch's data work with the latent cache versus without (VAE encoding every batch).

    python bench/bench_data.py

The VAE is the full-size SDXL architecture (random weights) so that the encode cost the cache
saves is the real one; images are generated photographs-sized JPEGs.
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
from bench.common import write_results
from sdxl_trainer.config import DataConfig
from sdxl_trainer.latent_cache import LatentCache

IMAGES = 16
SIZE = 256  # bucket area 256x256 keeps the full-size VAE affordable on a CPU


def make_images(folder: Path) -> None:
    rng = np.random.default_rng(0)
    sizes = [(1024, 768), (768, 1024), (900, 900), (1200, 700)]
    for index in range(IMAGES):
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


def main() -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(  # SDXL's VAE architecture
        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4, sample_size=1024,
        scaling_factor=0.13025,
    ).eval()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        folder.mkdir()
        make_images(folder)
        config = DataConfig(image_dir=str(folder), size=SIZE, bucket={"divisible_by": 64, "batch_size": 2},
                            latent_cache={"cache_dir": str(Path(tmp) / "cache"), "build_batch_size": 2})
        start = time.perf_counter()
        plan = dataset.plan_dataset(config, batch_size=1)
        scan_seconds = time.perf_counter() - start
        plain = dataset.ImageCaptionDataset(plan.scan.images, plan.targets, config, seed=0)
        rows = []
        for workers in (0, 2):
            seconds = epoch(plain, plan, workers)
            rows.append({"measure": f"decode+bucket+crop, {workers} workers", "seconds": seconds,
                         "images_per_s": IMAGES / seconds, "ratio": None})
        rows.append({"measure": "pre-flight scan (decode check + sha256)", "seconds": scan_seconds,
                     "images_per_s": IMAGES / scan_seconds, "ratio": None})
        uncached = epoch(plain, plan, 0, vae)
        cache = LatentCache(config.latent_cache.cache_dir, "bench-vae", "fp32", "sample")
        start = time.perf_counter()
        dataset.build_latent_cache(plan, config, cache, vae, "cpu")
        build = time.perf_counter() - start
        cached = epoch(dataset.ImageCaptionDataset(plan.scan.images, plan.targets, config, seed=0, cache=cache),
                       plan, 0)
        entry_bytes = np.mean([p.stat().st_size for p in Path(config.latent_cache.cache_dir).rglob("*.safetensors")])
        rows += [
            {"measure": "epoch data work without cache (decode + VAE encode)", "seconds": uncached,
             "images_per_s": IMAGES / uncached, "ratio": 1.0},
            {"measure": "epoch data work with cache (read + sample latents)", "seconds": cached,
             "images_per_s": IMAGES / cached, "ratio": cached / uncached},
            {"measure": "one-time cache build", "seconds": build, "images_per_s": IMAGES / build,
             "ratio": build / uncached},
        ]
        for row in rows:
            row["ratio"] = "" if row["ratio"] is None else f"{row['ratio']:.4f}"
    write_results("data", rows, notes=f"{IMAGES} JPEG images (700-1200 px), buckets of area {SIZE}², "
                  f"full-size SDXL VAE architecture in fp32 on the CPU; a cached entry (mean + std, fp32) "
                  f"is {entry_bytes / 1024:.0f} KiB on average.")


if __name__ == "__main__":
    main()
