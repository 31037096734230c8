"""Finding the training images: every image file in `data.image_dir` with its caption, checked
once before any model is loaded, and the ones that cannot be used with their reason."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .captions import read_caption
from .config import DataConfig
from .scan_cache import inspect_images

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp"}


@dataclass(frozen=True)
class ImageRecord:
    """One usable image: its file, caption and size as displayed (EXIF orientation applied)."""

    path: Path
    caption: str
    width: int
    height: int
    sha256: str  # of the file's bytes: the latent cache is keyed by content, not by name


@dataclass
class ScanReport:
    """The usable images, the skipped files with their reason, and the images without caption."""

    images: list[ImageRecord] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)


def scan_images(data: DataConfig) -> ScanReport:
    """Find the images and their same-stem `.txt` captions, decoding each image once so that a
    corrupt or truncated file is skipped now, with its reason, instead of failing hours later."""
    folder = Path(data.image_dir)
    pattern = "**/*" if data.recursive else "*"
    candidates = sorted(p for p in folder.glob(pattern) if p.suffix.lower() in IMAGE_EXTENSIONS)
    paths = [p for p in candidates if p.is_file()]
    report = ScanReport()
    report.skipped += [(p, f"broken symbolic link (to {os.readlink(p)})") for p in candidates
                       if p.is_symlink() and not p.exists()]
    cache_dir = Path(data.scan_cache_dir) if data.scan_cache_dir else None
    checks = inspect_images(paths, data.max_image_pixels, cache_dir, max(1, data.num_workers))
    for path, result in zip(paths, checks, strict=True):
        if isinstance(result, str):
            report.skipped.append((path, result))
            continue
        width, height, digest = result
        caption, problem = read_caption(path)
        if problem:
            report.skipped.append((path, problem))
            continue
        if not caption:
            report.missing_captions.append(path)
        report.images.append(ImageRecord(path, caption, width, height, digest))
    return report
