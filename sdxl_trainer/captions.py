"""Captions: reading an image's caption from where its folder says (a same-stem text file, the
folder's `metadata.jsonl`, or the file name), and augmenting it each epoch (dropout to the empty
prompt, shuffling its parts)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

from .config import ConfigError, FolderOptions, not_utf8

METADATA_FILE = "metadata.jsonl"

CaptionReader = Callable[[Path], tuple[str, str | None]]


def caption_reader(folder: FolderOptions, max_bytes: int) -> CaptionReader:
    """A function giving each image of `folder` its caption ("" when it has none) and the problem
    that makes the image unusable, if any: a caption over `max_bytes` is one (`data.max_caption_bytes`)."""
    if folder.caption_source == "metadata":
        return MetadataCaptions(Path(folder.image_dir), max_bytes)
    if folder.caption_source == "filename":
        return lambda path: (path.stem.replace("_", " ").strip(), None)
    return lambda path: read_caption_file(path.with_suffix(folder.caption_extension), max_bytes)


class MetadataCaptions:
    """The captions of a folder's `metadata.jsonl`, which also knows the lines that name no image."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self.entries = read_metadata_lines(root / METADATA_FILE)

    def __call__(self, path: Path) -> tuple[str, str | None]:
        text = self.entries.get(path.relative_to(self.root).as_posix(), ("", 0))[0]
        size = len(text.encode())
        if size > self.max_bytes:
            return "", too_long(f"the caption in {METADATA_FILE}", size, self.max_bytes)
        return text, None

    def unmatched(self, images: Iterable[Path]) -> list[str]:
        """A warning for each line whose file_name is none of `images` (a typo, or a deleted file)."""
        names = {path.relative_to(self.root).as_posix() for path in images}
        return [f"{self.root / METADATA_FILE}, line {line}: no image {name!r} in {self.root}; the line is not used"
                for name, (_, line) in self.entries.items() if name not in names]


def too_long(what: str, size: int, max_bytes: int) -> str:
    return f"{what} is too long: {size:,} bytes is over data.max_caption_bytes={max_bytes}"


def read_caption_file(caption_path: Path, max_bytes: int) -> tuple[str, str | None]:
    """The text of a caption file ("" when missing), or a problem that makes its image unusable.
    An over-long file is not read at all (shuffling and tokenizing 100 MB would stall the run)."""
    try:
        size = caption_path.stat().st_size
    except FileNotFoundError:
        return "", None
    if size > max_bytes:
        return "", too_long(f"caption {caption_path.name}", size, max_bytes)
    try:
        return caption_path.read_text(encoding="utf-8-sig").strip(), None  # a BOM (Notepad) is no caption text
    except UnicodeDecodeError:
        return "", f"caption {caption_path.name} is not UTF-8 text"
    except OSError as exc:  # unreadable (permissions), or a folder by that name
        return "", f"caption {caption_path.name} cannot be read ({exc.strerror})"


def read_metadata(path: Path) -> dict[str, str]:
    """`metadata.jsonl` as {file_name: text}; a line that is not such an object is a ConfigError
    naming the file and the line (the whole folder's captions depend on it)."""
    return {name: text for name, (text, _) in read_metadata_lines(path).items()}


def read_metadata_lines(path: Path) -> dict[str, tuple[str, int]]:
    """`read_metadata` with the number of the line each caption is on."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (caption_source is \"metadata\")")
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    captions = {}
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8-sig")  # a BOM (Notepad) is not JSON
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}, line {number}: not UTF-8 text ({not_utf8(exc)})") from None
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}, line {number}: not JSON ({exc.msg})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str):
            raise ConfigError(f"{path}, line {number}: needs a \"file_name\" string")
        text = entry.get("text", "")
        if not isinstance(text, str):
            raise ConfigError(f"{path}, line {number}: \"text\" must be a string")
        captions[Path(entry["file_name"]).as_posix()] = (text.strip(), number)
    return captions


def augment_caption(caption: str, options: FolderOptions, rng: random.Random, seed: int = 0) -> str:
    """Caption dropout (whole caption → empty, the unconditional prompt) and part shuffling
    that keeps the first `keep_tokens` parts in place; with `caption_shuffle_variants` the order
    is one of that many fixed ones, drawn from the run's `seed` (the text cache holds them)."""
    if rng.random() < options.caption_dropout_prob:
        return ""
    if shuffle_applies(caption, options) and rng.random() < options.caption_shuffle_prob:
        if options.caption_shuffle_variants:
            return caption_variant(caption, options, seed, rng.randrange(options.caption_shuffle_variants))
        return shuffle_parts(caption, options, rng)
    return caption


def caption_parts(caption: str, options: FolderOptions) -> list[str]:
    return [part.strip() for part in caption.split(options.caption_shuffle_separator) if part.strip()]


def shuffle_applies(caption: str, options: FolderOptions) -> bool:
    """Whether the caption has enough parts to be shuffled."""
    return len(caption_parts(caption, options)) >= max(2, options.caption_shuffle_min_tokens)


def shuffle_parts(caption: str, options: FolderOptions, rng: random.Random) -> str:
    parts = caption_parts(caption, options)
    head, tail = parts[: options.keep_tokens], parts[options.keep_tokens :]
    rng.shuffle(tail)
    return f"{options.caption_shuffle_separator} ".join(head + tail)


def caption_variant(caption: str, options: FolderOptions, seed: int, variant: int) -> str:
    """The `variant`-th fixed order of a caption's parts: from the seed and the caption alone, so
    every image, epoch and process (and a resumed run) draws the same text."""
    return shuffle_parts(caption, options, random.Random(f"{seed}-variant-{variant}-{caption}"))


def possible_captions(captions: Iterable[tuple[str, FolderOptions]], seed: int) -> set[str]:
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
