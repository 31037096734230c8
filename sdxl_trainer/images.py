"""Reading one image file: checking that it decodes, and loading it as 8-bit RGB pixels.

Every format quirk (EXIF orientation, transparency, 16-bit and float modes, CMYK, palettes) is
handled here, so the rest of the data pipeline only ever sees plain RGB images.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

# EXIF orientations 5-8 turn the image by 90 degrees: width and height swap.
_ROTATED_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION = 0x0112
_SIXTEEN_BIT_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
UNREADABLE = "cannot open the file"  # the problem of a file this user may not read
_PIL_LIMIT = threading.Lock()  # PIL's limit is a global: lifted and restored by one open at a time


@contextmanager
def open_image(source: Path | BinaryIO) -> Iterator[Image.Image]:
    """`Image.open` without PIL's own decompression-bomb limit, which would refuse (or warn about)
    an image that `data.max_image_pixels` allows: that setting guards instead, checked from the
    header before any decode (`check_image`); only images that passed it are loaded for training.
    The limit is restored as soon as the header is read, so other code keeps it."""
    with _PIL_LIMIT:
        limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            image = Image.open(source)
        finally:
            Image.MAX_IMAGE_PIXELS = limit
    with image:
        yield image


class ImageCheck(NamedTuple):
    """What inspecting a file found, kept apart from the pixel limit so that a scan cache can judge
    it again under another `data.max_image_pixels`: the stored size, whether EXIF orientation turns
    it by 90 degrees, the sha256 of its bytes (None: over the limit, so never decoded) and whether
    it has transparency (its pixels then depend on `data.background_color`), or the reason it cannot
    be used whatever the limit. A tuple: a cache builds 100k of them at each start."""

    width: int = 0
    height: int = 0
    turned: bool = False
    sha256: str | None = None
    problem: str | None = None
    alpha: bool = False

    def verdict(self, max_pixels: int) -> tuple[int, int, str, bool] | str | None:
        """`inspect_image`'s answer under `max_pixels`; None when that needs a decode not yet done."""
        if self.problem is not None:
            return self.problem
        if self.width * self.height > max_pixels:
            return f"too large: {self.width}x{self.height} is over data.max_image_pixels={max_pixels}"
        if self.sha256 is None:
            return None
        width, height = (self.height, self.width) if self.turned else (self.width, self.height)
        return width, height, self.sha256, self.alpha


def check_image(path: Path, max_pixels: int) -> ImageCheck:
    """Read, hash and decode one file (not decoded when over `max_pixels`).

    Every byte of the image data is decoded, so that a corrupt or truncated file is found before
    training; a JPEG is decoded at 1/8 scale (libjpeg's DCT scaling still entropy-decodes the whole
    stream, and fails on a truncated one as the full decode does, in half the time).
    """
    try:
        content = path.read_bytes()
    except OSError as exc:  # permissions: not a verdict on the file, so a scan cache does not keep it
        return ImageCheck(problem=f"{UNREADABLE} ({exc.strerror})")
    if not content:
        return ImageCheck(problem="empty file (0 bytes)")
    try:
        with open_image(io.BytesIO(content)) as image:
            width, height = image.size
            if width * height > max_pixels:
                return ImageCheck(width, height)
            turned = image.getexif().get(_EXIF_ORIENTATION) in _ROTATED_ORIENTATIONS
            alpha = has_alpha(image)
            image.draft(image.mode, (max(1, width // 8), max(1, height // 8)))  # JPEG only; others ignore it
            image.load()  # a truncated or corrupt file fails here
    except UnidentifiedImageError:  # its message names the in-memory buffer, not the file
        return ImageCheck(problem="not an image (PIL recognises no image format in it)")
    except (OSError, SyntaxError, ValueError) as exc:
        return ImageCheck(problem=f"cannot read image: {exc}")
    return ImageCheck(width, height, turned, hashlib.sha256(content).hexdigest(), alpha=alpha)


def has_alpha(image: Image.Image) -> bool:
    """Whether the image has transparency, which `load_rgb` composites onto the background colour."""
    return image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info


def inspect_image(path: Path, max_pixels: int) -> tuple[int, int, str, bool] | str:
    """(width, height as displayed, sha256 of the bytes, has transparency), or the reason the image
    cannot be used."""
    verdict = check_image(path, max_pixels).verdict(max_pixels)
    assert verdict is not None  # check_image decodes whatever is within the limit
    return verdict


def _gray_to_8_bit(image: Image.Image) -> Image.Image | None:
    """16-bit or float grayscale as 8-bit "L", scaled (PIL's own convert clips every value above
    255, or above 1.0, to white); None for any other mode."""
    if image.mode in _SIXTEEN_BIT_MODES:
        values = np.asarray(image, dtype=np.float64)
        if image.mode != "I" or values.max() > 255:
            values = values / 257.0
        return Image.fromarray(np.clip(values.round(), 0, 255).astype(np.uint8), "L")
    if image.mode == "F":
        values = np.clip(np.asarray(image, dtype=np.float64), 0.0, 1.0) * 255.0
        return Image.fromarray(values.round().astype(np.uint8), "L")
    return None


def load_rgb(path: Path, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Open an image as 8-bit RGB with EXIF orientation applied.

    Transparency (RGBA, LA, palette with a transparent colour) is composited onto `background`
    rather than dropped (dropping it turns transparent areas into whatever colour they hide);
    16-bit grayscale is scaled down rather than clipped; CMYK and grayscale are converted.
    """
    with open_image(path) as opened:
        image = ImageOps.exif_transpose(opened)
        gray = _gray_to_8_bit(image)
        if gray is not None:
            return gray.convert("RGB")
        if has_alpha(image):
            rgba = image.convert("RGBA")
            canvas = Image.new("RGBA", rgba.size, (*background, 255))
            return Image.alpha_composite(canvas, rgba).convert("RGB")
        return image.convert("RGB")


def load_mask(path: Path, alpha: bool) -> Image.Image | None:
    """A loss mask as 8-bit grayscale with EXIF orientation applied: the alpha channel of the image
    at `path` (None when it has none: fully opaque), or the mask file at `path`."""
    with open_image(path) as opened:
        image = ImageOps.exif_transpose(opened)
        if not alpha:
            gray = _gray_to_8_bit(image)
            return gray if gray is not None else image.convert("L")
        if has_alpha(image):
            return image.convert("RGBA").getchannel("A")
        return None


def mask_to_latent_grid(mask: Image.Image | None, width: int, height: int) -> torch.Tensor:
    """A view's mask [1, height/8, width/8] in [0, 1]: the share of each latent pixel's 8x8 image
    pixels that is trained (all ones without a mask)."""
    if mask is None:
        return torch.ones(1, height // 8, width // 8)
    pixels = torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)[None, None]
    return torch.nn.functional.avg_pool2d(pixels, 8)[0]


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB image → float16 tensor in [-1, 1], channels first (float16 halves the RAM)."""
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
    return pixels.to(torch.float16)
