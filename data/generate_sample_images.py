"""Regenerate the sample dataset in data/images (procedural shapes; nothing is downloaded).

    python data/generate_sample_images.py

The images are committed; this script documents how they were made and rebuilds them exactly.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
    "orange": (250, 140, 30), "purple": (140, 60, 190), "white": (245, 245, 245), "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "ring")
SIZES = ((192, 128), (128, 192), (160, 160), (224, 128), (128, 224), (176, 144))


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], color) -> None:
    left, top, right, bottom = box
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    elif shape == "triangle":
        draw.polygon([((left + right) // 2, top), (right, bottom), (left, bottom)], fill=color)
    else:
        draw.ellipse(box, outline=color, width=max(3, (right - left) // 8))


def make_image(index: int, rng: random.Random) -> tuple[Image.Image, str]:
    width, height = SIZES[index % len(SIZES)]
    background, foreground = rng.sample(sorted(COLORS), 2)
    shape = SHAPES[index % len(SHAPES)]
    image = Image.new("RGB", (width, height), COLORS[background])
    draw = ImageDraw.Draw(image)
    if index % 3 == 0:  # some images get stripes behind the shape
        for x in range(0, width, 16):
            draw.rectangle((x, 0, x + 7, height), fill=tuple(c // 2 + 60 for c in COLORS[background]))
    side = min(width, height) * rng.randint(45, 70) // 100
    left = rng.randint(4, width - side - 4)
    top = rng.randint(4, height - side - 4)
    draw_shape(draw, shape, (left, top, left + side, top + side), COLORS[foreground])
    stripes = ", stripes" if index % 3 == 0 else ""
    caption = f"tok, a {foreground} {shape}, {background} background{stripes}, small pattern"
    return image, caption


def main() -> None:
    folder = Path(__file__).parent / "images"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    for index in range(18):
        image, caption = make_image(index, rng)
        image.save(folder / f"shape_{index:02d}.png", optimize=True)
        (folder / f"shape_{index:02d}.txt").write_text(caption + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
