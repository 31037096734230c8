"""Images + captions, aspect-ratio buckets and caption augmentation.

Every image is assigned a target size before training: the bucket nearest its aspect ratio
(or, without buckets, its own size with the longest side capped at `data.size`). It is scaled to
cover that size and center-cropped; the original size and the crop's top-left corner are kept for
SDXL's size conditioning. Batches only ever hold images of one target size.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import random
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import Dataset, Sampler
from tqdm.auto import tqdm

from sdxl_trainer.config import DataConfig
from sdxl_trainer.latent_cache import LatentCache, LatentKey, sample_latents

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp"}
# EXIF orientations 5-8 turn the image by 90 degrees: width and height swap.
_ROTATED_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION = 0x0112
_SIXTEEN_BIT_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}


@dataclass(frozen=True)
class ImageRecord:
    """One usable image: its file, caption and size as displayed (EXIF orientation applied)."""

    path: Path
    caption: str
    width: int
    height: int
    sha256: str  # of the file's bytes: the latent cache is keyed by content, not by name


@dataclass
class ScanReport:
    images: list[ImageRecord] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)


def scan_images(data: DataConfig) -> ScanReport:
    """Find the images and their same-stem `.txt` captions, decoding each image once so that a
    corrupt or truncated file is skipped now, with its reason, instead of failing hours later."""
    folder = Path(data.image_dir)
    pattern = "**/*" if data.recursive else "*"
    paths = sorted(p for p in folder.glob(pattern) if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    report = ScanReport()
    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:  # PIL decodes without holding the GIL
        for path, result in zip(paths, pool.map(lambda p: _inspect(p, data.max_image_pixels), paths), strict=True):
            if isinstance(result, str):
                report.skipped.append((path, result))
                continue
            width, height, digest = result
            caption, problem = read_caption(path)
            if problem:
                report.skipped.append((path, problem))
                continue
            if not caption:
                report.missing_captions.append(path)
            report.images.append(ImageRecord(path, caption, width, height, digest))
    return report


def _inspect(path: Path, max_pixels: int) -> tuple[int, int, str] | str:
    """(width, height as displayed, sha256 of the bytes), or the reason the image cannot be used."""
    content = path.read_bytes()
    if not content:
        return "empty file (0 bytes)"
    try:
        with Image.open(io.BytesIO(content)) as image:
            width, height = image.size
            if width * height > max_pixels:
                return f"too large: {width}x{height} is over data.max_image_pixels={max_pixels}"
            if image.getexif().get(_EXIF_ORIENTATION) in _ROTATED_ORIENTATIONS:
                width, height = height, width
            image.load()  # a truncated or corrupt file fails here
    except Image.DecompressionBombError:
        return "too large: refused as a possible decompression bomb"
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        return f"cannot read image: {exc}"
    return width, height, hashlib.sha256(content).hexdigest()


def read_caption(image_path: Path) -> tuple[str, str | None]:
    """The caption next to an image ("" when missing), or a problem that makes it unusable."""
    caption_path = image_path.with_suffix(".txt")
    if not caption_path.is_file():
        return "", None
    try:
        return caption_path.read_text(encoding="utf-8").strip(), None
    except UnicodeDecodeError:
        return "", f"caption {caption_path.name} is not UTF-8 text"


# ------------------------------------------------------------------------------------ buckets
def bucket_resolutions(data: DataConfig) -> list[tuple[int, int]]:
    """The configured bucket list, or one generated as sd-scripts does: every width from
    size/4 to 2·size in steps of `divisible_by`, with the tallest height within size² area."""
    bucket = data.bucket
    if bucket.resolutions:
        return sorted({(int(w), int(h)) for w, h in bucket.resolutions})
    step = bucket.divisible_by
    max_area = data.size * data.size
    smallest = max(step, data.size // 4 // step * step)
    largest = data.size * 2
    resolutions = set()
    for width in range(smallest, largest + 1, step):
        height = min(largest, max_area // width // step * step)
        if height >= smallest:
            resolutions.update({(width, height), (height, width)})
    return sorted(resolutions)


def nearest_bucket(width: int, height: int, resolutions: list[tuple[int, int]]) -> tuple[int, int]:
    """The resolution whose aspect ratio is nearest (in log space) to the image's."""
    aspect = math.log(width / height)
    return min(resolutions, key=lambda res: (abs(math.log(res[0] / res[1]) - aspect), -res[0] * res[1]))


def capped_size(width: int, height: int, size: int, divisible_by: int) -> tuple[int, int]:
    """Without buckets: the image's own size with the longest side capped at `size`, rounded
    down to multiples of `divisible_by` (the VAE and UNet need that)."""
    scale = min(1.0, size / max(width, height))
    return (
        max(divisible_by, int(width * scale) // divisible_by * divisible_by),
        max(divisible_by, int(height * scale) // divisible_by * divisible_by),
    )


def target_sizes(records: list[ImageRecord], data: DataConfig) -> list[tuple[int, int]]:
    """The (width, height) every image is trained at."""
    if data.bucket.enabled:
        resolutions = bucket_resolutions(data)
        return [nearest_bucket(r.width, r.height, resolutions) for r in records]
    return [capped_size(r.width, r.height, data.size, data.bucket.divisible_by) for r in records]


# ----------------------------------------------------------------------------------- captions
def augment_caption(caption: str, data: DataConfig, rng: random.Random) -> str:
    """Caption dropout (whole caption → empty, the unconditional prompt) and part shuffling
    that keeps the first `keep_tokens` parts in place."""
    if rng.random() < data.caption_dropout_prob:
        return ""
    separator = data.caption_shuffle_separator
    parts = [part.strip() for part in caption.split(separator) if part.strip()]
    if len(parts) >= max(2, data.caption_shuffle_min_tokens) and rng.random() < data.caption_shuffle_prob:
        head, tail = parts[: data.keep_tokens], parts[data.keep_tokens :]
        rng.shuffle(tail)
        return f"{separator} ".join(head + tail)
    return caption


# ------------------------------------------------------------------------------------ dataset
def load_rgb(path: Path, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Open an image as 8-bit RGB with EXIF orientation applied.

    Transparency (RGBA, LA, palette with a transparent colour) is composited onto `background`
    rather than dropped (dropping it turns transparent areas into whatever colour they hide);
    16-bit grayscale is scaled down rather than clipped; CMYK and grayscale are converted.
    """
    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened)
        if image.mode in _SIXTEEN_BIT_MODES:
            values = np.asarray(image, dtype=np.float64)
            if image.mode != "I" or values.max() > 255:
                values = values / 257.0
            return Image.fromarray(np.clip(values.round(), 0, 255).astype(np.uint8), "L").convert("RGB")
        if image.mode == "F":
            values = np.clip(np.asarray(image, dtype=np.float64), 0.0, 1.0) * 255.0
            return Image.fromarray(values.round().astype(np.uint8), "L").convert("RGB")
        has_alpha = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
        if has_alpha:
            rgba = image.convert("RGBA")
            canvas = Image.new("RGBA", rgba.size, (*background, 255))
            return Image.alpha_composite(canvas, rgba).convert("RGB")
        return image.convert("RGB")


@dataclass(frozen=True)
class CropPlan:
    """How one image becomes one training view: scaled to cover the target, cropped, mirrored."""

    resized_width: int
    resized_height: int
    top: int
    crop_left: int  # where the crop starts in the scaled image, before mirroring
    left: int  # what SDXL's size conditioning receives: measured from the right edge when mirrored (as kohya)
    flip: bool


def plan_crop(record: ImageRecord, width: int, height: int, flip: bool, rng: random.Random | None) -> CropPlan:
    """A center crop, or a random one when `rng` is given."""
    scale = max(width / record.width, height / record.height)
    resized_w = max(width, round(record.width * scale))
    resized_h = max(height, round(record.height * scale))
    if rng is None:
        crop_left, top = (resized_w - width) // 2, (resized_h - height) // 2
    else:
        crop_left, top = rng.randint(0, resized_w - width), rng.randint(0, resized_h - height)
    left = resized_w - crop_left - width if flip else crop_left
    return CropPlan(resized_w, resized_h, top, crop_left, left, flip)


def render_view(image: Image.Image, crop: CropPlan, width: int, height: int) -> Image.Image:
    """Apply a crop plan to the decoded image."""
    image = image.resize((crop.resized_width, crop.resized_height), Image.Resampling.LANCZOS)
    image = image.crop((crop.crop_left, crop.top, crop.crop_left + width, crop.top + height))
    return ImageOps.mirror(image) if crop.flip else image


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB image → float16 tensor in [-1, 1], channels first (float16 halves the RAM)."""
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
    return pixels.to(torch.float16)


def latent_key(record: ImageRecord, target: tuple[int, int], crop: CropPlan) -> LatentKey:
    width, height = target
    return LatentKey(record.sha256, width, height, crop.top, crop.left, crop.flip)


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
            "caption": augment_caption(record.caption, self.data, rng),
            "original_size": torch.tensor([record.height, record.width]),
            "crop_top_left": torch.tensor([crop.top, crop.left]),
            "target_size": torch.tensor([height, width]),
            "path": str(record.path),
            "key": (index, epoch),
        }
        if self.cache is None:
            image = load_rgb(record.path, self.data.background_color)
            sample["pixel_values"] = to_tensor(render_view(image, crop, width, height))
        else:
            entry = self.cache.load(latent_key(record, (width, height), crop))
            if entry is None:
                raise RuntimeError(f"latent cache entry for {record.path} vanished during training")
            generator = torch.Generator().manual_seed(rng.getrandbits(63))
            sample["latents"] = sample_latents(entry, generator)
        return sample


def collate(samples: list[dict]) -> dict:
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


# ------------------------------------------------------------------------------------ sampler
class BucketBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of one target size each, shuffled deterministically from (seed, epoch).

    With several processes every step draws one *global* batch of `batch size × processes`
    images from one bucket and each process takes its slice, so all ranks always hold the same
    bucket (no shape mismatch, no hang) and the global batch is the same however many processes
    share it. A global batch that comes up short is filled up with images of the same bucket
    (from the start of its shuffled list), unless `drop_last` drops it.
    """

    def __init__(self, targets: list[tuple[int, int]], batch_sizes: dict[tuple[int, int], int],
                 drop_last: bool, seed: int, world_size: int = 1, rank: int = 0):
        self.buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, target in enumerate(targets):
            self.buckets[target].append(index)
        self.batch_sizes = batch_sizes
        self.drop_last = drop_last
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch to iterate next, from its `start`-th batch (resuming mid-epoch)."""
        self.epoch = epoch
        self.start = start

    def batches(self, epoch: int) -> list[list[int]]:
        """Every global batch of one epoch, in training order."""
        rng = random.Random(f"{self.seed}-buckets-{epoch}")
        batches = []
        for target in sorted(self.buckets):
            indices = list(self.buckets[target])
            rng.shuffle(indices)
            size = self.batch_sizes[target] * self.world_size
            for start in range(0, len(indices), size):
                batch = indices[start : start + size]
                if len(batch) < size and self.drop_last:
                    continue
                if len(batch) < size and self.world_size > 1:  # every rank needs a full share
                    batch += [indices[i % len(indices)] for i in range(size - len(batch))]
                batches.append(batch)
        rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.batches(self.epoch)[self.start :]:
            share = len(batch) // self.world_size
            yield [(index, self.epoch) for index in batch[self.rank * share : (self.rank + 1) * share]]

    def __len__(self) -> int:
        return len(self.batches(self.epoch)) - self.start


def batch_sizes_per_bucket(targets: list[tuple[int, int]], data: DataConfig, batch_size: int) -> dict:
    """`per_resolution_batch_sizes` ("WxH": n) where given, else the default batch size."""
    overrides = data.bucket.per_resolution_batch_sizes
    return {target: overrides.get(f"{target[0]}x{target[1]}", batch_size) for target in set(targets)}


# ---------------------------------------------------------------------------------- pre-flight
@dataclass
class DatasetPlan:
    """What the data stage will do, decided before any model is loaded."""

    scan: ScanReport
    targets: list[tuple[int, int]]
    batch_sizes: dict[tuple[int, int], int]
    drop_last: bool
    notes: list[str] = field(default_factory=list)

    world_size: int = 1

    def sampler(self, seed: int, rank: int = 0) -> BucketBatchSampler:
        return BucketBatchSampler(self.targets, self.batch_sizes, self.drop_last, seed, self.world_size, rank)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.sampler(seed=0).batches(epoch=0))

    def bucket_rows(self) -> list[tuple[str, int, int, int, int]]:
        """(resolution, images, batch size, batches, images dropped) per bucket."""
        rows = []
        for (width, height), images in sorted(Counter(self.targets).items()):
            size = self.batch_sizes[(width, height)] * self.world_size
            full, rest = divmod(images, size)
            batches = full if self.drop_last else full + bool(rest)
            rows.append((f"{width}x{height}", images, size, batches, rest if self.drop_last else 0))
        return rows

    def scaling_stats(self) -> tuple[int, float, float, float]:
        """(images upscaled, largest upscale factor, mean and largest share of the scaled image
        cropped away): how much the buckets change the images."""
        upscaled, largest, cropped = 0, 1.0, []
        for record, (width, height) in zip(self.scan.images, self.targets, strict=True):
            crop = plan_crop(record, width, height, flip=False, rng=None)
            scale = crop.resized_width / record.width
            if scale > 1.0:
                upscaled += 1
                largest = max(largest, scale)
            cropped.append(1.0 - width * height / (crop.resized_width * crop.resized_height))
        return upscaled, largest, sum(cropped) / max(1, len(cropped)), max(cropped, default=0.0)

    def report(self) -> str:
        scan = self.scan
        lines = [f"images: {len(scan.images)} usable, {len(scan.skipped)} skipped, "
                 f"{len(scan.missing_captions)} without caption (trained with an empty caption)"]
        lines += [f"  skipped {path}: {reason}" for path, reason in scan.skipped]
        lines += [f"  no caption: {path}" for path in scan.missing_captions[:10]]
        if len(scan.missing_captions) > 10:
            lines.append(f"  … and {len(scan.missing_captions) - 10} more without caption")
        lines.append("  bucket      images  batch  batches  dropped")
        for resolution, images, size, batches, dropped in self.bucket_rows():
            lines.append(f"  {resolution:<10} {images:>7} {size:>6} {batches:>8} {dropped:>8}")
        lines += [f"  {note}" for note in self.notes]
        upscaled, largest, mean_crop, max_crop = self.scaling_stats()
        lines.append(f"  upscaled: {upscaled} image(s)" + (f" (up to {largest:.2f}x)" if upscaled else "")
                     + f"; cropped away: {mean_crop:.0%} on average, {max_crop:.0%} at most")
        return "\n".join(lines)


def plan_dataset(data: DataConfig, batch_size: int, world_size: int = 1) -> DatasetPlan:
    """Scan the images and assign every one its bucket; `batch_size` applies without buckets and
    is per process: a step takes `batch size × world_size` images from one bucket."""
    scan = scan_images(data)
    targets = target_sizes(scan.images, data)
    default_batch = data.bucket.batch_size if data.bucket.enabled else batch_size
    drop_last = data.bucket.drop_last if data.bucket.enabled else False
    batch_sizes = batch_sizes_per_bucket(targets, data, default_batch)
    notes = merge_small_buckets(targets, batch_sizes, world_size) if drop_last else []
    return DatasetPlan(scan, targets, batch_sizes, drop_last, notes, world_size)


def merge_small_buckets(targets: list[tuple[int, int]], batch_sizes: dict[tuple[int, int], int],
                        world_size: int = 1) -> list[str]:
    """With drop_last, a bucket smaller than its (global) batch size would lose all its images:
    move them (in place) to the bucket nearest in aspect ratio that fills a batch; say so."""
    counts = Counter(targets)
    notes = []
    global_size = {bucket: size * world_size for bucket, size in batch_sizes.items()}
    for small in sorted(b for b in counts if counts[b] < global_size[b]):
        label = (f"bucket {small[0]}x{small[1]}: {counts[small]} image(s), "
                 f"fewer than its batch size {global_size[small]}")
        full = [b for b in counts if b != small and counts[b] >= global_size[b]]
        if not full:
            notes.append(f"{label}: dropped (no other bucket to merge into)")
            continue
        aspect = math.log(small[0] / small[1])
        nearest = min(full, key=lambda b: abs(math.log(b[0] / b[1]) - aspect))
        for index, target in enumerate(targets):
            if target == small:
                targets[index] = nearest
        counts[nearest] += counts.pop(small)
        notes.append(f"{label}: merged into {nearest[0]}x{nearest[1]}")
    return notes


# -------------------------------------------------------------------------------- latent cache
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
        for (width, height), group in sorted(by_size.items()):
            for start in range(0, len(group), batch_size):
                chunk = group[start : start + batch_size]
                pixels = torch.stack([
                    to_tensor(render_view(load_rgb(plan.scan.images[index].path, data.background_color),
                                          crop, width, height))
                    for index, _, crop in chunk
                ]).to(device, dtype=vae.dtype)
                with torch.no_grad():
                    distribution = vae.encode(pixels).latent_dist
                for row, (_, key, _) in enumerate(chunk):
                    cache.save(key, distribution.mean[row], distribution.std[row])
                progress.update(len(chunk))
    return len(views) - len(missing), len(missing)
