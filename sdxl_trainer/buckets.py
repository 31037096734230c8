"""Aspect-ratio buckets: the size every image is trained at, and the batch size of each bucket.

Each image goes to the bucket nearest its aspect ratio (or, without buckets, keeps its own size
with the longest side capped at `data.size`). Batches only ever hold images of one size.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from .config import DataConfig
from .scan import ImageRecord


def bucket_resolutions(data: DataConfig) -> list[tuple[int, int]]:
    """The configured bucket list, or one generated as sd-scripts does: the square bucket, and every
    width from size/4 to 2·size in steps of `divisible_by` with the tallest height within size² area."""
    bucket = data.bucket
    if bucket.resolutions:
        return sorted({(int(w), int(h)) for w, h in bucket.resolutions})
    step = bucket.divisible_by
    max_area = data.size * data.size
    smallest = max(step, data.size // 4 // step * step)
    largest = data.size * 2
    square = data.size // step * step  # in the loop too when size is a multiple of step
    resolutions = {(square, square)}
    for width in range(smallest, largest + 1, step):
        height = min(largest, max_area // width // step * step)
        if height >= smallest:
            resolutions.update({(width, height), (height, width)})
    return sorted(resolutions)


def _log_aspect(width: int, height: int) -> float:
    """Aspect ratios are compared in log space, so that 2:1 and 1:2 are equally far from 1:1."""
    return math.log(width / height)


def nearest_bucket(width: int, height: int, resolutions: list[tuple[int, int]]) -> tuple[int, int]:
    """The resolution whose aspect ratio is nearest to the image's (the larger one on a tie)."""
    aspect = _log_aspect(width, height)
    return min(resolutions, key=lambda res: (abs(_log_aspect(*res) - aspect), -res[0] * res[1]))


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


def batch_sizes_per_bucket(targets: list[tuple[int, int]], data: DataConfig, batch_size: int) -> dict:
    """`per_resolution_batch_sizes` ("WxH": n) where given, else the default batch size."""
    overrides = data.bucket.per_resolution_batch_sizes
    return {target: overrides.get(f"{target[0]}x{target[1]}", batch_size) for target in set(targets)}


def unmatched_batch_sizes(data: DataConfig, targets: Iterable[tuple[int, int]]) -> list[str]:
    """The `per_resolution_batch_sizes` keys that name none of the run's buckets (a typo, or a
    bucket of another `data.size`): not the listed or generated buckets, nor without buckets one of
    the images' sizes (`targets`). Not an error: a listed bucket may just have no images."""
    known = set(bucket_resolutions(data)) if data.bucket.enabled else set(targets)
    return [key for key in data.bucket.per_resolution_batch_sizes
            if tuple(int(side) for side in key.split("x")) not in known]


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
        aspect = _log_aspect(*small)
        nearest = min(full, key=lambda b: abs(_log_aspect(*b) - aspect))
        for index, target in enumerate(targets):
            if target == small:
                targets[index] = nearest
        counts[nearest] += counts.pop(small)
        notes.append(f"{label}: merged into {nearest[0]}x{nearest[1]}")
    return notes
