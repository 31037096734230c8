"""How one image becomes one training view of its target size: scaled to cover it, cropped
(center, or random each epoch) and optionally mirrored. The crop corner goes into SDXL's size
conditioning, so the plan is computed first and applied to the pixels separately."""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageOps

from .scan import ImageRecord


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
