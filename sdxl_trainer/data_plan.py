"""The pre-flight data plan: what the data stage will do (usable and skipped images, how an epoch
is composed from the subsets, their repeats and regularization images, the held-out validation
images, the bucket of each sample, batches per epoch, how much the images are scaled and
cropped), decided and reported before any model is loaded."""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from dataclasses import dataclass, field

from .bucket_sampler import BucketBatchSampler
from .buckets import batch_sizes_per_bucket, merge_small_buckets, target_sizes
from .config import DataConfig, SubsetConfig
from .crops import plan_crop
from .scan import ALPHA_MASK, ImageRecord, ScanReport, scan_images


@dataclass(frozen=True)
class Sample:
    """One entry of an epoch: an image, the size it is trained at, its folder's caption and mask
    settings, and its weight in the loss. An image with repeats is several entries."""

    record: ImageRecord
    target: tuple[int, int]
    folder: SubsetConfig
    loss_weight: float = 1.0


@dataclass
class DatasetPlan:
    """What the data stage will do, decided before any model is loaded."""

    scan: ScanReport
    samples: list[Sample]  # one epoch, in a fixed order (the sampler shuffles it per epoch)
    batch_sizes: dict[tuple[int, int], int]
    drop_last: bool
    notes: list[str] = field(default_factory=list)
    world_size: int = 1
    validation: list[Sample] = field(default_factory=list)  # held out: never in `samples`
    composition: list[str] = field(default_factory=list)  # how an epoch is made, one line per folder
    folders: list[SubsetConfig] = field(default_factory=list)  # data.folders()

    @property
    def targets(self) -> list[tuple[int, int]]:
        return [sample.target for sample in self.samples]

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
        """(resolution, samples per epoch, batch size, batches, samples dropped) per bucket."""
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
        unique = {id(sample.record): sample for sample in self.samples}.values()
        for sample in unique:
            record, (width, height) = sample.record, sample.target
            crop = plan_crop(record, width, height, flip=False, rng=None)
            scale = crop.resized_width / record.width
            if scale > 1.0:
                upscaled += 1
                largest = max(largest, scale)
            cropped.append(1.0 - width * height / (crop.resized_width * crop.resized_height))
        return upscaled, largest, sum(cropped) / max(1, len(cropped)), max(cropped, default=0.0)

    def summary(self) -> dict:
        """The epoch's composition for run_summary.json: samples per epoch, held-out images, and
        per folder its images (each counted once) and how often it is seen."""
        seen = Counter(sample.record.subset for sample in self.samples)
        images = Counter(record.subset for record in self.scan.images)
        return {
            "samples_per_epoch": len(self.samples), "validation_images": len(self.validation),
            "folders": [{"image_dir": folder.image_dir, "images": images[index], "repeats": folder.repeats,
                         "is_reg": folder.is_reg, "samples_per_epoch": seen[index]}
                        for index, folder in enumerate(self.folders)],
        }

    def report(self) -> str:
        scan = self.scan
        lines = [f"images: {len(scan.images) + len(scan.validation)} usable, {len(scan.skipped)} skipped, "
                 f"{len(scan.missing_captions)} without caption (trained with an empty caption)"]
        lines += [f"  skipped {path}: {reason}" for path, reason in scan.skipped]
        lines += [f"  warning: {warning}" for warning in scan.warnings[:10]]
        if len(scan.warnings) > 10:
            lines.append(f"  … and {len(scan.warnings) - 10} more such warnings")
        lines += [f"  no caption: {path}" for path in scan.missing_captions[:10]]
        if len(scan.missing_captions) > 10:
            lines.append(f"  … and {len(scan.missing_captions) - 10} more without caption")
        lines += [f"  {line}" for line in self.composition]
        lines.append("  bucket     samples  batch  batches  dropped")
        for resolution, images, size, batches, dropped in self.bucket_rows():
            lines.append(f"  {resolution:<10} {images:>7} {size:>6} {batches:>8} {dropped:>8}")
        lines += [f"  {note}" for note in self.notes]
        upscaled, largest, mean_crop, max_crop = self.scaling_stats()
        lines.append(f"  upscaled: {upscaled} image(s)" + (f" (up to {largest:.2f}x)" if upscaled else "")
                     + f"; cropped away: {mean_crop:.0%} on average, {max_crop:.0%} at most")
        return "\n".join(lines)


def held_out(records: list[ImageRecord], fraction: float, seed: int) -> set[int]:
    """Indices of the `fraction` of `records` kept for validation: those whose content hashes
    first under `seed`, so the choice depends on each image alone (adding images moves few, and
    two copies of one image always land on the same side)."""
    if not fraction or not records:
        return set()
    count = min(max(1, round(fraction * len(records))), len(records) - 1)  # one image is left to train on
    order = sorted(range(len(records)),
                   key=lambda i: hashlib.sha256(f"{seed}-{records[i].sha256}".encode()).hexdigest())
    return set(order[:count])


@dataclass(frozen=True)
class EpochSettings:
    """What composes an epoch besides the images: the loss weight of regularization images and
    the seed that picks the held-out validation images."""

    prior_loss_weight: float = 1.0
    split_seed: int = 0


def compose_epoch(scan: ScanReport, targets: dict[int, tuple[int, int]], data: DataConfig,
                  settings: EpochSettings) -> tuple[list[Sample], list[Sample], list[str]]:
    """(the epoch's samples, the validation samples, one report line per folder). Training images
    come `repeats` times; regularization images fill as many places as there are training
    samples, cycling through them (the same ones every epoch, so every epoch has the same batches)."""
    folders = data.folders()
    trainable = [i for i, r in enumerate(scan.images) if not folders[r.subset].is_reg]
    validation_indices = {trainable[i] for i in held_out([scan.images[i] for i in trainable],
                                                         data.validation_split, settings.split_seed)}
    samples, regularization, lines = [], [], []
    for subset, folder in enumerate(folders):
        indices = [i for i, r in enumerate(scan.images) if r.subset == subset and i not in validation_indices]
        entries = [Sample(scan.images[i], targets[i], folder, folder.loss_weight * (
            settings.prior_loss_weight if folder.is_reg else 1.0)) for _ in range(folder.repeats) for i in indices]
        (regularization if folder.is_reg else samples).extend(entries)
        lines += describe_folder(folder, len(indices), subset, len(folders))
    if regularization:
        used = min(len(regularization), len(samples))
        lines.append(f"regularization: {len(samples)} of each epoch's {2 * len(samples)} samples, cycling through "
                     f"{len(regularization)} (with repeats)"
                     + (f"; {len(regularization) - used} never used (more than the training samples)"
                        if used < len(regularization) else ""))
        samples += [regularization[i % len(regularization)] for i in range(len(samples))]
    validation = [Sample(scan.images[i], targets[i], folders[scan.images[i].subset])
                  for i in sorted(validation_indices)]
    if validation:
        lines.append(f"validation: {len(validation)} image(s) held out (data.validation_split "
                     f"{data.validation_split:g}), never trained on")
    return samples, validation, lines


def describe_folder(folder: SubsetConfig, images: int, subset: int, count: int) -> list[str]:
    """One line on one folder: images, repeats, captions and masks (only what is not the default);
    none for a single plain folder (the image count says it all)."""
    parts = [f"{images} image(s)" + (f" x {folder.repeats} repeats = {images * folder.repeats} per epoch"
                                     if folder.repeats > 1 else "")]
    if folder.caption_source != "txt" or folder.caption_extension != ".txt":
        parts.append("captions from " + {"metadata": "metadata.jsonl", "filename": "file names"}.get(
            folder.caption_source, f"*{folder.caption_extension} files"))
    if folder.alpha_mask or folder.mask_dir:
        parts.append(f"masks: {ALPHA_MASK if folder.alpha_mask else folder.mask_dir}")
    if folder.loss_weight != 1.0:
        parts.append(f"loss weight {folder.loss_weight:g}")
    if count == 1 and len(parts) == 1:
        return []
    name = f"subset {subset + 1} {folder.image_dir}" + (" (regularization)" if folder.is_reg else "")
    return [f"{name}: " + "; ".join(parts)]


def plan_dataset(data: DataConfig, batch_size: int, world_size: int = 1,
                 settings: EpochSettings | None = None) -> DatasetPlan:
    """Scan the images, compose an epoch and assign every sample its bucket; `batch_size` applies
    without buckets and is per process: a step takes `batch size × world_size` samples from one
    bucket."""
    scan = scan_images(data)
    records = scan.images + scan.validation
    targets = dict(enumerate(target_sizes(records, data)))
    samples, validation, composition = compose_epoch(scan, targets, data, settings or EpochSettings())
    validation += [Sample(record, targets[len(scan.images) + i], data.validation_folder())
                   for i, record in enumerate(scan.validation)]
    if scan.validation:
        composition.append(f"validation: {len(scan.validation)} image(s) in data.validation_dir "
                           f"{data.validation_dir}, never trained on")
    default_batch = data.bucket.batch_size if data.bucket.enabled else batch_size
    drop_last = data.bucket.drop_last if data.bucket.enabled else False
    sample_targets = [sample.target for sample in samples]
    batch_sizes = batch_sizes_per_bucket(sample_targets + [s.target for s in validation], data, default_batch)
    notes = merge_small_buckets(sample_targets, batch_sizes, world_size) if drop_last else []
    samples = [Sample(s.record, target, s.folder, s.loss_weight) for s, target in zip(samples, sample_targets,
                                                                                         strict=True)]
    return DatasetPlan(scan, samples, batch_sizes, drop_last, notes, world_size, validation, composition,
                       data.folders())
