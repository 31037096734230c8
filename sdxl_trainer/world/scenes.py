"""The world of shapes: procedural scenes with captions and ground truth, deterministic from a seed.

A scene is a background (one palette colour, optionally a gradient) with one or two shapes, each
of one kind, one palette colour, a size and a position. `render` draws it at any size (the same
scene at 64² and 128² shows the same picture) with anti-aliased edges, and returns each shape's
mask beside the image; `caption` writes it in the small grammar the built-in tiny SDXL was
pretrained on:

    a red circle, blue background
    a green square and a white triangle, black gradient background

The pretrained model knows PRETRAINED_SHAPES; NEW_SHAPES are kinds it has never seen (the
quickstart teaches one of them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "black": (20, 20, 20),
    "white": (245, 245, 245),
}
PRETRAINED_SHAPES = ("circle", "square", "triangle")
NEW_SHAPES = ("cross",)
SHAPES = PRETRAINED_SHAPES + NEW_SHAPES
PATTERNS = ("plain", "gradient")
GRADIENT_DARKEST = 0.6  # a gradient background goes from its colour to this fraction of it
_SUPERSAMPLE = 4  # shapes are drawn at 4× and averaged down: anti-aliased edges


@dataclass(frozen=True)
class Shape:
    """One shape; centre and size are fractions of the image side, so a scene has no pixel size."""

    kind: str
    colour: str
    centre: tuple[float, float]
    size: float


@dataclass(frozen=True)
class Scene:
    background: str
    pattern: str = "plain"
    shapes: tuple[Shape, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class WorldSettings:
    """Which scenes `sample_scene` draws."""

    shapes: tuple[str, ...] = PRETRAINED_SHAPES
    two_shape_fraction: float = 0.3
    gradient_fraction: float = 0.3


def sample_scene(rng: random.Random, settings: WorldSettings = WorldSettings()) -> Scene:
    """One random scene: its shapes never overlap and differ in colour from each other and the background."""
    background = rng.choice(sorted(PALETTE))
    pattern = "gradient" if rng.random() < settings.gradient_fraction else "plain"
    count = 2 if rng.random() < settings.two_shape_fraction else 1
    colours = rng.sample([c for c in sorted(PALETTE) if c != background], count)
    if count == 1:
        size = rng.uniform(0.38, 0.6)
        centre = (rng.uniform(size / 2 + 0.06, 1 - size / 2 - 0.06), rng.uniform(size / 2 + 0.06, 1 - size / 2 - 0.06))
        shapes = (Shape(rng.choice(settings.shapes), colours[0], centre, size),)
    else:
        sizes = (rng.uniform(0.3, 0.4), rng.uniform(0.3, 0.4))
        # Side by side in the left and right halves, each free to move vertically.
        shapes = tuple(
            Shape(rng.choice(settings.shapes), colour,
                  (0.25 + 0.5 * i + rng.uniform(-0.03, 0.03), rng.uniform(s / 2 + 0.06, 1 - s / 2 - 0.06)), s)
            for i, (colour, s) in enumerate(zip(colours, sizes, strict=True))
        )
    return Scene(background, pattern, shapes)


def scene_for_seed(seed: int, settings: WorldSettings = WorldSettings()) -> Scene:
    return sample_scene(random.Random(seed), settings)


def caption(scene: Scene) -> str:
    """The scene in the world's grammar; shapes named left to right."""
    ordered = sorted(scene.shapes, key=lambda shape: shape.centre[0])
    things = " and ".join(f"a {shape.colour} {shape.kind}" for shape in ordered)
    pattern = " gradient" if scene.pattern == "gradient" else ""
    return f"{things}, {scene.background}{pattern} background"


def parse_caption(text: str) -> Scene | None:
    """The scene a caption in the world's grammar describes (positions and sizes are not in a
    caption: they come out as the image centre and 0.5); None for any other text. Words before
    the first "a " (a trigger word like "tok,") are ignored."""
    start = text.find("a ")
    things, _, background = text[start:].strip().rpartition(", ") if start >= 0 else ("", "", "")
    words = background.split()
    if not words or words[-1] != "background" or words[0] not in PALETTE or len(words) > 3:
        return None
    pattern = "gradient" if words[1:-1] == ["gradient"] else "plain"
    if len(words) == 3 and pattern == "plain":
        return None
    shapes = []
    for thing in things.split(" and "):
        parts = thing.split()
        if len(parts) != 3 or parts[0] != "a" or parts[1] not in PALETTE or parts[2] not in SHAPES:
            return None
        shapes.append(Shape(parts[2], parts[1], (0.5, 0.5), 0.5))
    return Scene(words[0], pattern, tuple(shapes))


def render(scene: Scene, width: int, height: int | None = None) -> tuple[Image.Image, list[np.ndarray]]:
    """The scene as an RGB image and one boolean mask per shape (a pixel belongs to a shape when
    the shape covers at least half of it)."""
    height = height or width
    big_w, big_h = width * _SUPERSAMPLE, height * _SUPERSAMPLE
    canvas = np.asarray(_background(scene, big_w, big_h), dtype=np.float32)
    masks = []
    for shape in scene.shapes:
        coverage = Image.new("L", (big_w, big_h), 0)
        _draw(ImageDraw.Draw(coverage), shape, big_w, big_h)
        alpha = np.asarray(coverage, dtype=np.float32)[..., None] / 255.0
        canvas = canvas * (1 - alpha) + np.asarray(PALETTE[shape.colour], dtype=np.float32) * alpha
        small = _downsample(alpha[..., 0], width, height)
        masks.append(small >= 0.5)
    image = _downsample(canvas, width, height)
    return Image.fromarray(np.clip(np.rint(image), 0, 255).astype(np.uint8), "RGB"), masks


def _background(scene: Scene, width: int, height: int) -> np.ndarray:
    colour = np.asarray(PALETTE[scene.background], dtype=np.float32)
    if scene.pattern == "plain":
        return np.broadcast_to(colour, (height, width, 3)).copy()
    # Brightest at the top, GRADIENT_DARKEST at the bottom.
    ramp = np.linspace(1.0, GRADIENT_DARKEST, height, dtype=np.float32)[:, None, None]
    return np.broadcast_to(colour * ramp, (height, width, 3)).copy()


def _draw(draw: ImageDraw.ImageDraw, shape: Shape, width: int, height: int) -> None:
    side = shape.size * min(width, height)
    cx, cy = shape.centre[0] * width, shape.centre[1] * height
    left, top, right, bottom = cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2
    if shape.kind == "circle":
        draw.ellipse((left, top, right, bottom), fill=255)
    elif shape.kind == "square":
        inset = side * 0.06  # a square as tall as the circle looks larger; keep areas comparable
        draw.rectangle((left + inset, top + inset, right - inset, bottom - inset), fill=255)
    elif shape.kind == "triangle":
        draw.polygon([(cx, top), (right, bottom), (left, bottom)], fill=255)
    elif shape.kind == "cross":
        arm = side / 3
        draw.rectangle((left, cy - arm / 2, right, cy + arm / 2), fill=255)
        draw.rectangle((cx - arm / 2, top, cx + arm / 2, bottom), fill=255)
    else:
        raise ValueError(f"unknown shape kind {shape.kind!r}; the world has {', '.join(SHAPES)}")


def _downsample(array: np.ndarray, width: int, height: int) -> np.ndarray:
    """Average each _SUPERSAMPLE² block (exact box filter, no resampling library in between)."""
    s = _SUPERSAMPLE
    blocks = array.reshape(height, s, width, s, *array.shape[2:])
    return blocks.mean(axis=(1, 3))
