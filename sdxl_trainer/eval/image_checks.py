"""Is a rendered image real? NaN anywhere in sampling ends up as an all-black PNG once it is cast
to 8 bits (NaN becomes 0), and a script that does not look reports success (docs/design.md,
'The original tool's NaN post-mortems').

The check runs on the decoded float image, before the 8-bit conversion hides the NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Thresholds, in the [0, 1] range of a float image:
RANGE_TOLERANCE = 1e-3  # float rounding; beyond it the caller passed something that is not a 0..1 image
BLACK_LEVEL = 0.5 / 255  # every pixel below this is 0 in the 8-bit file: all black
FLAT_SPREAD = 1.0 / 255  # max - min below one 8-bit step: one single colour, no picture

# What produced images like these in the original tool (docs/design.md, 'The original tool's NaN
# post-mortems').
LIKELY_CAUSES = (
    "NaN/Inf in the weights, typically adapters (DoRA) trained in fp16: train with "
    'training.mixed_precision "no" or "bf16"; debug_dora_weights.py analyses adapter weights',
    "a VAE decoding in fp16 overflows (the SDXL VAE needs fp32 unless it is an fp16-fixed VAE)",
    "fp16 on Apple MPS produces NaN during denoising: use fp32 on MPS",
    "a VAE that does not match the model, or latents scaled with another VAE's scaling factor",
)


def check_image(image: np.ndarray | torch.Tensor) -> str | None:
    """None when `image` (floats, expected in 0..1, any shape) is a plausible picture, else why not:
    "contains NaN/Inf", "out of range", "all black" or "constant", with the measured values."""
    values = _as_numpy(image)
    finite = np.isfinite(values)
    if not finite.all():
        return f"contains NaN/Inf ({values.size - int(finite.sum())} of {values.size} values)"
    low, high = float(values.min()), float(values.max())
    if low < -RANGE_TOLERANCE or high > 1 + RANGE_TOLERANCE:
        return f"out of range (values {low:.3g} to {high:.3g}, expected 0 to 1)"
    if high < BLACK_LEVEL:
        return "all black"
    if high - low < FLAT_SPREAD:
        return f"constant (every value {low:.3f})"
    return None


def _as_numpy(image: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(image, np.ndarray):
        return image
    return image.detach().float().cpu().numpy()
