"""The judge: reads a rendered image and says which shapes of which colours it shows.

Deterministic image analysis, no learned weights, so a judge's verdict never drifts with training:
1. the background is a colour with an optional vertical gradient: fit it per channel as a linear
   function of the row over the image's border pixels;
2. pixels far from that fit are foreground; its connected parts larger than MIN_AREA of the image
   are the shapes (smaller specks are ignored);
3. a part's colour is the palette colour nearest its median pixel;
4. its kind comes from two numbers of its mask: the fill of its bounding box (square ≈ 1,
   circle ≈ π/4, triangle ≈ ½) and its solidity (area over convex-hull area: a cross is far from
   convex, the others are convex).

`prompt_matches` is what "prompt accuracy" counts: the judged shapes (kind and colour, as a
multiset) and background colour equal the scene's. Not judged: whether the background is a
gradient, and the shapes' order, positions and sizes ("a red circle and a blue square, black
gradient background" is right drawn as a blue square left of a red circle on plain black).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .scenes import PALETTE, Scene

MIN_AREA = 0.015  # of the image: smaller foreground parts are noise, not shapes
FOREGROUND_DISTANCE = 60.0  # RGB distance (0-255 units) from the fitted background


@dataclass(frozen=True)
class JudgedShape:
    kind: str
    colour: str
    area: float  # fraction of the image
    fill: float
    solidity: float


@dataclass(frozen=True)
class Verdict:
    background: str
    shapes: tuple[JudgedShape, ...]

    def content(self) -> tuple[str, Counter]:
        return self.background, Counter((shape.kind, shape.colour) for shape in self.shapes)


def judge(image: Image.Image | np.ndarray) -> Verdict:
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float64)
    fitted = _fit_background(pixels)
    background = nearest_colour(fitted[0, 0])  # a gradient is brightest, its own colour, at the top
    foreground = np.linalg.norm(pixels - fitted, axis=-1) > FOREGROUND_DISTANCE
    shapes = []
    for mask in _parts(foreground):
        area = mask.mean()
        if area < MIN_AREA:
            continue
        colour = nearest_colour(np.median(pixels[mask], axis=0))
        fill, solidity = _fill_and_solidity(mask)
        shapes.append(JudgedShape(_kind(fill, solidity), colour, float(area), fill, solidity))
    return Verdict(background, tuple(shapes))


def scene_content(scene: Scene) -> tuple[str, Counter]:
    return scene.background, Counter((shape.kind, shape.colour) for shape in scene.shapes)


def prompt_matches(image: Image.Image | np.ndarray, scene: Scene) -> bool:
    return judge(image).content() == scene_content(scene)


def nearest_colour(rgb: np.ndarray) -> str:
    names = sorted(PALETTE)
    distances = [np.linalg.norm(np.asarray(PALETTE[name], dtype=np.float64) - rgb) for name in names]
    return names[int(np.argmin(distances))]


def _fit_background(pixels: np.ndarray) -> np.ndarray:
    """Per channel, a + b·row fitted by least squares to the border pixels, as a full image."""
    height, width, _ = pixels.shape
    rows = np.arange(height, dtype=np.float64)
    border = np.zeros((height, width), dtype=bool)
    border[:2, :] = border[-2:, :] = border[:, :2] = border[:, -2:] = True
    row_index = np.broadcast_to(rows[:, None], (height, width))[border]
    design = np.stack([np.ones_like(row_index), row_index], axis=1)
    # A robust fit: refit without the border pixels far from the first fit (a shape touching the edge).
    keep = np.ones(len(row_index), dtype=bool)
    values = pixels[border]
    for _ in range(2):
        coefficients, *_ = np.linalg.lstsq(design[keep], values[keep], rcond=None)
        residual = np.linalg.norm(values - design @ coefficients, axis=-1)
        keep = residual < max(FOREGROUND_DISTANCE / 2, np.percentile(residual, 60))
    column = np.stack([np.ones(height), rows], axis=1) @ coefficients
    return np.broadcast_to(column[:, None, :], (height, width, 3))


def _parts(mask: np.ndarray) -> list[np.ndarray]:
    from scipy import ndimage

    labels, count = ndimage.label(mask)
    return [labels == index for index in range(1, count + 1)]


def _fill_and_solidity(mask: np.ndarray) -> tuple[float, float]:
    from scipy.spatial import ConvexHull, QhullError

    ys, xs = np.nonzero(mask)
    area = float(len(xs))
    box = (xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)
    # The hull of the pixels' corners, so a filled square has solidity 1.
    corners = np.concatenate([np.stack([xs + dx, ys + dy], axis=1) for dx in (0, 1) for dy in (0, 1)])
    try:
        hull_area = ConvexHull(corners).volume
    except QhullError:
        hull_area = area
    return area / box, min(1.0, area / hull_area)


def _kind(fill: float, solidity: float) -> str:
    if solidity < 0.8:
        return "cross"
    if fill > 0.89:
        return "square"
    if fill > 0.66:
        return "circle"
    return "triangle"
