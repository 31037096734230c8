"""Captions: reading an image's same-stem `.txt` file, and augmenting the caption each epoch
(dropout to the empty prompt, shuffling its parts)."""

from __future__ import annotations

import random
from collections.abc import Iterable
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


def augment_caption(caption: str, data: DataConfig, rng: random.Random, seed: int = 0) -> str:
    """Caption dropout (whole caption → empty, the unconditional prompt) and part shuffling
    that keeps the first `keep_tokens` parts in place; with `caption_shuffle_variants` the order
    is one of that many fixed ones, drawn from the run's `seed` (the text cache holds them)."""
    if rng.random() < data.caption_dropout_prob:
        return ""
    if shuffle_applies(caption, data) and rng.random() < data.caption_shuffle_prob:
        if data.caption_shuffle_variants:
            return caption_variant(caption, data, seed, rng.randrange(data.caption_shuffle_variants))
        return shuffle_parts(caption, data, rng)
    return caption


def caption_parts(caption: str, data: DataConfig) -> list[str]:
    return [part.strip() for part in caption.split(data.caption_shuffle_separator) if part.strip()]


def shuffle_applies(caption: str, data: DataConfig) -> bool:
    """Whether the caption has enough parts to be shuffled."""
    return len(caption_parts(caption, data)) >= max(2, data.caption_shuffle_min_tokens)


def shuffle_parts(caption: str, data: DataConfig, rng: random.Random) -> str:
    parts = caption_parts(caption, data)
    head, tail = parts[: data.keep_tokens], parts[data.keep_tokens :]
    rng.shuffle(tail)
    return f"{data.caption_shuffle_separator} ".join(head + tail)


def caption_variant(caption: str, data: DataConfig, seed: int, variant: int) -> str:
    """The `variant`-th fixed order of a caption's parts: from the seed and the caption alone, so
    every image, epoch and process (and a resumed run) draws the same text."""
    return shuffle_parts(caption, data, random.Random(f"{seed}-variant-{variant}-{caption}"))


def possible_captions(captions: Iterable[tuple[str, DataConfig]], seed: int) -> set[str]:
    """Every caption text a run can train or validate on, from each image's (caption, caption
    options): the caption itself (validation uses it unaugmented), the empty caption when dropout
    is on, and its `caption_shuffle_variants` orders when shuffle is on. A shuffle without
    variants has no such list (ValueError)."""
    texts = set()
    for caption, options in captions:
        texts.add(caption)
        if options.caption_dropout_prob > 0:
            texts.add("")
        if options.caption_shuffle_prob > 0 and shuffle_applies(caption, options):
            if not options.caption_shuffle_variants:
                raise ValueError("caption shuffle without caption_shuffle_variants draws a new order every epoch")
            texts.update(caption_variant(caption, options, seed, variant)
                         for variant in range(options.caption_shuffle_variants))
    return texts
