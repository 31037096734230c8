"""Finding the training images: every image file of each folder (`data.image_dir`, or each of
`data.subsets`, and `data.validation_dir`) with its caption and mask, checked once before any
model is loaded, and the ones that cannot be used with their reason."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .captions import MetadataCaptions, caption_reader
from .config import DataConfig, FolderOptions
from .scan_cache import inspect_images

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp"}
ALPHA_MASK = "alpha"  # ImageRecord.mask of an image whose alpha channel is its mask


@dataclass(frozen=True)
class ImageRecord:
    """One usable image: its file, caption and size as displayed (EXIF orientation applied)."""

    path: Path
    caption: str
    width: int
    height: int
    sha256: str  # of the file's bytes: the latent cache is keyed by content, not by name
    subset: int = 0  # index into data.folders(); validation_dir images are in subset 0's place
    mask: str = ""  # "" = no mask, ALPHA_MASK, or the sha256 of the mask file (the latent cache key)
    mask_path: Path | None = None  # the mask file, or the image itself for an alpha mask
    alpha: bool = False  # has transparency: its pixels depend on data.background_color


@dataclass
class ScanReport:
    """The usable images, the skipped files with their reason, and the images without caption."""

    images: list[ImageRecord] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # e.g. metadata.jsonl lines that name no image
    validation: list[ImageRecord] = field(default_factory=list)  # from data.validation_dir


def inspect_files(paths: list[Path], data: DataConfig) -> list[tuple[int, int, str] | str]:
    """`images.inspect_image` of every path: from the scan cache where the file is unchanged, else
    decoded now by `data.num_workers` threads (at least one)."""
    cache_dir = Path(data.scan_cache_dir) if data.scan_cache_dir else None
    return inspect_images(paths, data.max_image_pixels, cache_dir, max(1, data.num_workers))


def find_images(folder: Path, recursive: bool) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The image files of a folder, sorted, and its broken symbolic links with their reason."""
    pattern = "**/*" if recursive else "*"
    # Sorted by parts, the order of Path's own comparison, at a fraction of its cost (100k files).
    candidates = sorted((p for p in folder.glob(pattern) if p.suffix.lower() in IMAGE_EXTENSIONS),
                        key=lambda p: p.parts)
    broken = [(p, f"broken symbolic link (to {os.readlink(p)})") for p in candidates
              if p.is_symlink() and not p.exists()]
    return [p for p in candidates if p.is_file()], broken


def mask_file(image: Path, folder: FolderOptions) -> Path | None:
    """The mask of an image: same relative path and stem under `mask_dir`, any image extension."""
    relative = image.relative_to(folder.image_dir)
    for extension in sorted(IMAGE_EXTENSIONS):
        candidate = Path(folder.mask_dir) / relative.with_suffix(extension)
        if candidate.is_file():
            return candidate
    return None


def scan_folder(folder: FolderOptions, subset: int, data: DataConfig, report: ScanReport) -> list[ImageRecord]:
    """The usable images of one folder; skipped files and missing captions go into `report`."""
    # First: a metadata.jsonl that cannot be used stops the scan before any image is decoded.
    read_caption = caption_reader(folder, data.max_caption_bytes)
    paths, broken = find_images(Path(folder.image_dir), folder.recursive)
    report.skipped += broken
    if isinstance(read_caption, MetadataCaptions):
        report.warnings += read_caption.unmatched(paths + [path for path, _ in broken])
    masks = {path: mask_file(path, folder) for path in paths} if folder.mask_dir else {}
    mask_paths = [mask for mask in masks.values() if mask is not None]
    results = inspect_files(paths + mask_paths, data)
    checked = dict(zip(paths + mask_paths, results, strict=True))
    records = []
    for path in paths:
        problem, mask, mask_path = None, ALPHA_MASK if folder.alpha_mask else "", path if folder.alpha_mask else None
        result = checked[path]
        if isinstance(result, str):
            problem = result
        elif folder.mask_dir:
            mask_path = masks[path]
            problem, mask = check_mask(mask_path, checked.get(mask_path), result, folder)
        caption, caption_problem = read_caption(path)
        problem = problem or caption_problem
        if problem:
            report.skipped.append((path, problem))
            continue
        if not caption:
            report.missing_captions.append(path)
        if folder.caption_prefix:
            caption = f"{folder.caption_prefix} {caption}".strip()
        width, height, digest, alpha = result
        records.append(ImageRecord(path, caption, width, height, digest, subset, mask, mask_path, alpha))
    return records


def check_mask(mask_path: Path | None, result, image: tuple[int, int, str],
               folder: FolderOptions) -> tuple[str | None, str]:
    """(problem or None, the mask's sha256) for an image's mask file."""
    if mask_path is None:
        return f"no mask for it in {folder.mask_dir} (same name, any image extension)", ""
    if isinstance(result, str):
        return f"mask {mask_path}: {result}", ""
    if result[:2] != image[:2]:
        return f"mask {mask_path} is {result[0]}x{result[1]}, the image {image[0]}x{image[1]}", ""
    return None, result[2]


def scan_images(data: DataConfig) -> ScanReport:
    """Find the images of every folder with their captions (and masks), decoding each file once
    so that a corrupt or truncated one is skipped now, with its reason, instead of failing hours
    later."""
    report = ScanReport()
    for subset, folder in enumerate(data.folders()):
        report.images += scan_folder(folder, subset, data, report)
    held_out = data.validation_folder()
    if held_out is not None:
        report.validation = scan_folder(held_out, 0, data, report)
    return report
