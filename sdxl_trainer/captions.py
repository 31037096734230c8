"""Captions: reading an image's same-stem `.txt` file, and augmenting the caption each epoch
(dropout to the empty prompt, shuffling its parts)."""

from __future__ import annotations

import random
from pathlib import Path

from .config import DataConfig


def read_caption(image_path: Path) -> tuple[str, str | None]:
    """The caption next to an image ("" when missing), or a problem that makes it unusable."""
    caption_path = image_path.with_suffix(".txt")
    if not caption_path.is_file():
        return "", None
    try:
        return caption_path.read_text(encoding="utf-8").strip(), None
    except UnicodeDecodeError:
        return "", f"caption {caption_path.name} is not UTF-8 text"


def augment_caption(caption: str, data: DataConfig, rng: random.Random) -> str:
    """Caption dropout (whole caption → empty, the unconditional prompt) and part shuffling
    that keeps the first `keep_tokens` parts in place."""
    if rng.random() < data.caption_dropout_prob:
        return ""
    separator = data.caption_shuffle_separator
    parts = [part.strip() for part in caption.split(separator) if part.strip()]
    if len(parts) >= max(2, data.caption_shuffle_min_tokens) and rng.random() < data.caption_shuffle_prob:
        head, tail = parts[: data.keep_tokens], parts[data.keep_tokens :]
        rng.shuffle(tail)
        return f"{separator} ".join(head + tail)
    return caption
