"""Images + captions, aspect-ratio buckets and caption augmentation.

Every image is assigned a target size before training: the bucket nearest its aspect ratio
(or, without buckets, its own size with the longest side capped at `data.size`). It is scaled to
cover that size and center-cropped; the original size and the crop's top-left corner are kept for
SDXL's size conditioning. Batches only ever hold images of one target size.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import Dataset, Sampler

from sdxl_trainer.config import DataConfig

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp"}
# EXIF orientations 5-8 turn the image by 90 degrees: width and height swap.
_ROTATED_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class ImageRecord:
    """One usable image: its file, caption and size as displayed (EXIF orientation applied)."""

    path: Path
    caption: str
    width: int
    height: int


@dataclass
class ScanReport:
    images: list[ImageRecord] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)


def scan_images(image_dir: str | Path) -> ScanReport:
    """Find images and their same-stem `.txt` captions; unreadable files are skipped with a reason."""
    folder = Path(image_dir)
    report = ScanReport()
    for path in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS):
        try:
            with Image.open(path) as image:
                width, height = image.size
                if image.getexif().get(_EXIF_ORIENTATION) in _ROTATED_ORIENTATIONS:
                    width, height = height, width
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
            report.skipped.append((path, f"cannot read image: {exc}"))
            continue
        caption_path = path.with_suffix(".txt")
        caption = caption_path.read_text(encoding="utf-8").strip() if caption_path.is_file() else ""
        if not caption:
            report.missing_captions.append(path)
        report.images.append(ImageRecord(path, caption, width, height))
    return report


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
def load_rgb(path: Path) -> Image.Image:
    """Open an image as RGB with EXIF orientation applied; transparency goes onto white."""
    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened)
        has_alpha = image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info)
        if has_alpha:
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return image.convert("RGB")


def resize_and_crop(image: Image.Image, width: int, height: int, flip: bool = False) -> tuple[Image.Image, int, int]:
    """Scale to cover (width, height), center-crop, optionally mirror; returns the crop's
    (top, left) in the scaled image, measured from the right edge when mirrored (as kohya does)."""
    scale = max(width / image.width, height / image.height)
    resized_w = max(width, round(image.width * scale))
    resized_h = max(height, round(image.height * scale))
    image = image.resize((resized_w, resized_h), Image.Resampling.LANCZOS)
    left = (resized_w - width) // 2
    top = (resized_h - height) // 2
    image = image.crop((left, top, left + width, top + height))
    if flip:
        return ImageOps.mirror(image), top, resized_w - left - width
    return image, top, left


class ImageCaptionDataset(Dataset):
    """Indexed by (image index, epoch) so that augmentation is deterministic per epoch."""

    def __init__(self, records: list[ImageRecord], targets: list[tuple[int, int]], data: DataConfig, seed: int):
        self.records = records
        self.targets = targets
        self.data = data
        self.seed = seed

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        index, epoch = key
        record = self.records[index]
        width, height = self.targets[index]
        rng = random.Random(f"{self.seed}-{epoch}-{index}")
        flip = self.data.random_flip and rng.random() < 0.5
        image, top, left = resize_and_crop(load_rgb(record.path), width, height, flip)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
        return {
            "pixel_values": pixels.to(torch.float16),
            "caption": augment_caption(record.caption, self.data, rng),
            "original_size": torch.tensor([record.height, record.width]),
            "crop_top_left": torch.tensor([top, left]),
            "target_size": torch.tensor([height, width]),
            "path": str(record.path),
        }


def collate(samples: list[dict]) -> dict:
    return {
        "pixel_values": torch.stack([s["pixel_values"] for s in samples]),
        "captions": [s["caption"] for s in samples],
        "original_sizes": torch.stack([s["original_size"] for s in samples]),
        "crops_top_left": torch.stack([s["crop_top_left"] for s in samples]),
        "target_sizes": torch.stack([s["target_size"] for s in samples]),
        "paths": [s["path"] for s in samples],
    }


# ------------------------------------------------------------------------------------ sampler
class BucketBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of one target size each, shuffled deterministically from (seed, epoch)."""

    def __init__(self, targets: list[tuple[int, int]], batch_sizes: dict[tuple[int, int], int],
                 drop_last: bool, seed: int):
        self.buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, target in enumerate(targets):
            self.buckets[target].append(index)
        self.batch_sizes = batch_sizes
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self, epoch: int) -> list[list[int]]:
        """Every batch of one epoch, in training order."""
        rng = random.Random(f"{self.seed}-buckets-{epoch}")
        batches = []
        for target in sorted(self.buckets):
            indices = list(self.buckets[target])
            rng.shuffle(indices)
            size = self.batch_sizes[target]
            for start in range(0, len(indices), size):
                batch = indices[start : start + size]
                if len(batch) == size or not self.drop_last:
                    batches.append(batch)
        rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.batches(self.epoch):
            yield [(index, self.epoch) for index in batch]

    def __len__(self) -> int:
        return len(self.batches(self.epoch))


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

    def sampler(self, seed: int) -> BucketBatchSampler:
        return BucketBatchSampler(self.targets, self.batch_sizes, self.drop_last, seed)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.sampler(seed=0))

    def bucket_rows(self) -> list[tuple[str, int, int, int, int]]:
        """(resolution, images, batch size, batches, images dropped) per bucket."""
        counts: dict[tuple[int, int], int] = defaultdict(int)
        for target in self.targets:
            counts[target] += 1
        rows = []
        for (width, height), images in sorted(counts.items()):
            size = self.batch_sizes[(width, height)]
            full, rest = divmod(images, size)
            batches = full if self.drop_last else full + bool(rest)
            rows.append((f"{width}x{height}", images, size, batches, rest if self.drop_last else 0))
        return rows

    def report(self) -> str:
        lines = [
            f"images: {len(self.scan.images)} found, {len(self.scan.skipped)} skipped, "
            f"{len(self.scan.missing_captions)} without caption"
        ]
        lines += [f"  skipped {path}: {reason}" for path, reason in self.scan.skipped]
        lines.append("  bucket      images  batch  batches  dropped")
        for resolution, images, size, batches, dropped in self.bucket_rows():
            lines.append(f"  {resolution:<10} {images:>7} {size:>6} {batches:>8} {dropped:>8}")
        return "\n".join(lines)


def plan_dataset(data: DataConfig, batch_size: int) -> DatasetPlan:
    """Scan the images and assign every one its bucket; `batch_size` applies without buckets."""
    scan = scan_images(data.image_dir)
    targets = target_sizes(scan.images, data)
    default_batch = data.bucket.batch_size if data.bucket.enabled else batch_size
    drop_last = data.bucket.drop_last if data.bucket.enabled else False
    return DatasetPlan(scan, targets, batch_sizes_per_bucket(targets, data, default_batch), drop_last)
