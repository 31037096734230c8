"""The training samples: one view of one image per (sample index, epoch), either rendered from
the image file or read from the latent cache, and filling that cache before training.

Both paths plan the view the same way (`plan_crop`, `latent_key`), so the latents the cache holds
are exactly the views training asks for.
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from .atomic import remove_dead_temps
from .captions import augment_caption
from .config import DataConfig
from .crops import CropPlan, plan_crop, render_view
from .data_plan import DatasetPlan, Sample
from .images import load_mask, load_rgb, mask_to_latent_grid, to_tensor
from .latent_cache import LatentCache, LatentKey, sample_latents
from .scan import ALPHA_MASK, ImageRecord


def latent_key(record: ImageRecord, target: tuple[int, int], crop: CropPlan, data: DataConfig) -> LatentKey:
    """The cache key of one view: the image's content (and its mask's), its target size, the crop
    and, for an image with transparency, the colour it is composited onto."""
    width, height = target
    background = ",".join(map(str, data.background_color)) if record.alpha else ""
    return LatentKey(record.sha256, width, height, crop.top, crop.left, crop.flip, record.mask, background)


def view_pixels(record: ImageRecord, target: tuple[int, int], crop: CropPlan, data: DataConfig) -> torch.Tensor:
    """One view's pixels: the image decoded, scaled, cropped and mirrored as planned."""
    width, height = target
    return to_tensor(render_view(load_rgb(record.path, data.background_color), crop, width, height))


def view_mask(record: ImageRecord, target: tuple[int, int], crop: CropPlan) -> torch.Tensor:
    """One view's loss mask on the latent grid: the mask scaled, cropped and mirrored as the
    image is (all ones for an image without a mask)."""
    width, height = target
    mask = load_mask(record.mask_path, record.mask == ALPHA_MASK) if record.mask else None
    return mask_to_latent_grid(None if mask is None else render_view(mask, crop, width, height), width, height)


class ImageCaptionDataset(Dataset):
    """Indexed by (sample index, epoch) so that augmentation is deterministic per epoch (and a
    resumed run sees exactly the samples it would have seen). With a latent cache it returns
    latents sampled from the cached distribution and never decodes the image. When any sample
    has a mask, every sample carries one (all ones where it has none), so batches stack."""

    def __init__(self, samples: list[Sample], data: DataConfig, seed: int, cache: LatentCache | None = None):
        self.samples = samples
        self.data = data
        self.seed = seed
        self.cache = cache
        self.masked = any(sample.record.mask for sample in samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        index, epoch = key
        record, folder = self.samples[index].record, self.samples[index].folder
        width, height = target = self.samples[index].target
        rng = random.Random(f"{self.seed}-{epoch}-{index}")
        flip = self.data.random_flip and rng.random() < 0.5
        crop = plan_crop(record, width, height, flip, rng if self.data.crop == "random" else None)
        sample = {
            "caption": augment_caption(record.caption, folder, rng, self.seed),
            "original_size": torch.tensor([record.height, record.width]),
            "crop_top_left": torch.tensor([crop.top, crop.left]),
            "target_size": torch.tensor([height, width]),
            "loss_weight": torch.tensor(self.samples[index].loss_weight),
            "path": str(record.path),
            "key": (index, epoch),
        }
        if self.cache is None:
            sample["pixel_values"] = view_pixels(record, target, crop, self.data)
        else:
            entry = self.cache.load(latent_key(record, target, crop, self.data))
            if entry is None:
                raise RuntimeError(f"latent cache entry for {record.path} vanished during training")
            generator = torch.Generator().manual_seed(rng.getrandbits(63))
            sample["latents"] = sample_latents(entry, generator)
            if "mask" in entry:
                sample["mask"] = entry["mask"].float()
        if self.masked and "mask" not in sample:
            sample["mask"] = view_mask(record, target, crop)
        return sample


def collate(samples: list[dict]) -> dict:
    """Samples of one bucket → one batch: tensors stacked, captions, paths and keys as lists."""
    batch = {
        "captions": [s["caption"] for s in samples],
        "original_sizes": torch.stack([s["original_size"] for s in samples]),
        "crops_top_left": torch.stack([s["crop_top_left"] for s in samples]),
        "target_sizes": torch.stack([s["target_size"] for s in samples]),
        "loss_weights": torch.stack([s["loss_weight"] for s in samples]),
        "paths": [s["path"] for s in samples],
        "keys": [s["key"] for s in samples],
    }
    for name, stacked in (("pixel_values", "pixel_values"), ("latents", "latents"), ("mask", "masks")):
        if name in samples[0]:
            batch[stacked] = torch.stack([s[name] for s in samples])
    return batch


def cache_views(plan: DatasetPlan, data: DataConfig) -> list[tuple[Sample, LatentKey, CropPlan]]:
    """Every view training and validation can ask for: each image at its bucket, center crop, and
    mirrored too when `random_flip` is on (validation views are never mirrored). One view per key."""
    views = {}
    for sample in plan.samples:
        for flip in (False, True) if data.random_flip else (False,):
            crop = plan_crop(sample.record, *sample.target, flip, rng=None)
            views.setdefault(latent_key(sample.record, sample.target, crop, data), (sample, crop))
    for sample in plan.validation:
        crop = plan_crop(sample.record, *sample.target, flip=False, rng=None)
        views.setdefault(latent_key(sample.record, sample.target, crop, data), (sample, crop))
    return [(sample, key, crop) for key, (sample, crop) in views.items()]


def build_latent_cache(plan: DatasetPlan, data: DataConfig, cache: LatentCache, vae, device) -> tuple[int, int]:
    """Encode the views missing from the cache, with their masks. Returns (hits, built). The VAE
    runs here and nowhere else in a cached run.

    One view at a time: a VAE's output for an image differs in its last bits with its batch-mates,
    so batches would make an entry depend on which other entries were missing when it was built (a
    kill during the build, a deleted entry, another machine filling a shared cache). Alone, its
    bytes depend on its key only, and a resume is exact whatever happened to the cache. First the
    temps of writers killed mid-entry go."""
    remove_dead_temps(cache.cache_dir, depth=1)
    views = cache_views(plan, data)
    absent = set(cache.missing(key for _, key, _ in views))
    missing = [view for view in views if view[1] in absent]
    for sample, key, crop in tqdm(missing, desc="caching latents", disable=not missing):
        pixels = view_pixels(sample.record, sample.target, crop, data)[None].to(device, dtype=vae.dtype)
        with torch.no_grad():
            distribution = vae.encode(pixels).latent_dist
        mask = view_mask(sample.record, sample.target, crop) if key.mask else None
        cache.save(key, distribution.mean[0], distribution.std[0], mask)
    return len(views) - len(missing), len(missing)
