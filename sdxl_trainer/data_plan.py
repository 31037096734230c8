"""The pre-flight data plan: what the data stage will do (usable and skipped images, the bucket
of each image, batches per epoch, how much the images are scaled and cropped), decided and
reported before any model is loaded."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

from .bucket_sampler import BucketBatchSampler
from .buckets import batch_sizes_per_bucket, merge_small_buckets, target_sizes
from .config import DataConfig
from .crops import plan_crop
from .scan import ScanReport, scan_images


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

    @functools.cached_property
    def epoch_batches(self) -> list[list[int]]:
        """One epoch's global batches (their number and sizes are the same in every epoch)."""
        return self.sampler(seed=0).batches(epoch=0)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches)

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
