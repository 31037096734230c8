"""The training samples: one view of one image per (image index, epoch), either rendered from
the image file or read from the latent cache, and filling that cache before training.

Both paths plan the view the same way (`plan_crop`, `latent_key`), so the latents the cache holds
are exactly the views training asks for.
"""

from __future__ import annotations

import random
from collections import defaultdict

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from .captions import augment_caption
from .config import DataConfig
from .crops import CropPlan, plan_crop, render_view
from .data_plan import DatasetPlan
from .images import load_rgb, to_tensor
from .latent_cache import LatentCache, LatentKey, sample_latents
from .scan import ImageRecord


def latent_key(record: ImageRecord, target: tuple[int, int], crop: CropPlan) -> LatentKey:
    """The cache key of one view: the image's content, its target size and the crop."""
    width, height = target
    return LatentKey(record.sha256, width, height, crop.top, crop.left, crop.flip)


def view_pixels(record: ImageRecord, target: tuple[int, int], crop: CropPlan, data: DataConfig) -> torch.Tensor:
    """One view's pixels: the image decoded, scaled, cropped and mirrored as planned."""
    width, height = target
    return to_tensor(render_view(load_rgb(record.path, data.background_color), crop, width, height))


class ImageCaptionDataset(Dataset):
    """Indexed by (image index, epoch) so that augmentation is deterministic per epoch (and a
    resumed run sees exactly the samples it would have seen). With a latent cache it returns
    latents sampled from the cached distribution and never decodes the image."""

    def __init__(self, records: list[ImageRecord], targets: list[tuple[int, int]], data: DataConfig, seed: int,
                 cache: LatentCache | None = None):
        self.records = records
        self.targets = targets
        self.data = data
        self.seed = seed
        self.cache = cache

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        index, epoch = key
        record = self.records[index]
        width, height = self.targets[index]
        rng = random.Random(f"{self.seed}-{epoch}-{index}")
        flip = self.data.random_flip and rng.random() < 0.5
        crop = plan_crop(record, width, height, flip, rng if self.data.crop == "random" else None)
        sample = {
            "caption": augment_caption(record.caption, self.data, rng, self.seed),
            "original_size": torch.tensor([record.height, record.width]),
            "crop_top_left": torch.tensor([crop.top, crop.left]),
            "target_size": torch.tensor([height, width]),
            "path": str(record.path),
            "key": (index, epoch),
        }
        if self.cache is None:
            sample["pixel_values"] = view_pixels(record, (width, height), crop, self.data)
        else:
            entry = self.cache.load(latent_key(record, (width, height), crop))
            if entry is None:
                raise RuntimeError(f"latent cache entry for {record.path} vanished during training")
            generator = torch.Generator().manual_seed(rng.getrandbits(63))
            sample["latents"] = sample_latents(entry, generator)
        return sample


def collate(samples: list[dict]) -> dict:
    """Samples of one bucket → one batch: tensors stacked, captions, paths and keys as lists."""
    batch = {
        "captions": [s["caption"] for s in samples],
        "original_sizes": torch.stack([s["original_size"] for s in samples]),
        "crops_top_left": torch.stack([s["crop_top_left"] for s in samples]),
        "target_sizes": torch.stack([s["target_size"] for s in samples]),
        "paths": [s["path"] for s in samples],
        "keys": [s["key"] for s in samples],
    }
    for name in ("pixel_values", "latents"):
        if name in samples[0]:
            batch[name] = torch.stack([s[name] for s in samples])
    return batch


def cache_views(plan: DatasetPlan, data: DataConfig) -> list[tuple[int, LatentKey, CropPlan]]:
    """Every view training can ask for: each image at its bucket, center crop, and mirrored too
    when `random_flip` is on."""
    views = []
    for index, (record, (width, height)) in enumerate(zip(plan.scan.images, plan.targets, strict=True)):
        for flip in (False, True) if data.random_flip else (False,):
            crop = plan_crop(record, width, height, flip, rng=None)
            views.append((index, latent_key(record, (width, height), crop), crop))
    return views


def build_latent_cache(plan: DatasetPlan, data: DataConfig, cache: LatentCache, vae, device) -> tuple[int, int]:
    """Encode the views missing from the cache, in batches of `build_batch_size` per bucket.
    Returns (hits, built). The VAE runs here and nowhere else in a cached run."""
    views = cache_views(plan, data)
    absent = set(cache.missing(key for _, key, _ in views))
    missing = [view for view in views if view[1] in absent]
    by_size: dict[tuple[int, int], list] = defaultdict(list)
    for view in missing:
        by_size[plan.targets[view[0]]].append(view)
    batch_size = data.latent_cache.build_batch_size
    with tqdm(total=len(missing), desc="caching latents", disable=not missing) as progress:
        for target, group in sorted(by_size.items()):
            for start in range(0, len(group), batch_size):
                chunk = group[start : start + batch_size]
                pixels = torch.stack([
                    view_pixels(plan.scan.images[index], target, crop, data) for index, _, crop in chunk
                ]).to(device, dtype=vae.dtype)
                with torch.no_grad():
                    distribution = vae.encode(pixels).latent_dist
                for row, (_, key, _) in enumerate(chunk):
                    cache.save(key, distribution.mean[row], distribution.std[row])
                progress.update(len(chunk))
    return len(views) - len(missing), len(missing)
