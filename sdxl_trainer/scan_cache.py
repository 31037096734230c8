"""The scan cache: what inspecting each image found, kept between runs so that a start decodes
only the files it has not seen (decoding 100k photos takes from minutes to an hour).

One JSON file per image folder, under `data.scan_cache_dir`, maps each file's absolute path to its
size, mtime and inode when inspected and the `ImageCheck` found then. A file whose size, mtime or
inode differs is inspected again, so an edit is never answered from the cache. The pixel limit is
applied anew on each start, never cached, and so is a file this user may not read (permissions
change). A damaged or unreadable cache file is ignored (and replaced). The file is rewritten only
when something had to be inspected.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import os
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from .atomic import OutputWriteError, remove_dead_temps, write_text
from .images import UNREADABLE, ImageCheck, check_image

FORMAT = "sdxl-trainer scan cache 2"  # 2: whether each image has transparency
# One list per field (columns parse faster than 100k small lists), each value of the listed types.
_COLUMNS = {"path": {str}, "size": {int}, "mtime_ns": {int}, "inode": {int}, "width": {int}, "height": {int},
            "turned": {bool}, "sha256": {str, type(None)}, "problem": {str, type(None)}, "alpha": {bool}}
Stamp = tuple[int, int, int]  # size, mtime_ns, inode: what must not change for an entry to hold
_STAMP_FIELDS = ("size", "mtime_ns", "inode")
SAVE_EVERY_S = 60.0  # during a long first scan, so that a kill (not only a Ctrl-C) keeps most of it
Verdict = tuple[int, int, str, bool] | str  # images.inspect_image's answer


def inspect_images(paths: list[Path], max_pixels: int, cache_dir: Path | None, workers: int) -> list[Verdict]:
    """`images.inspect_image` of every path, in order: from the cache where the file is unchanged,
    else inspected by `workers` threads behind a progress bar. Threads, not processes: PIL's decoders
    and hashlib release the GIL, and a thread starts at once (processes were no faster:
    docs/performance.md, 'Pre-flight start-up')."""
    with gc_paused():
        keys = [os.path.abspath(path) for path in paths]
        cache_file = cache_path(keys, cache_dir)
        if cache_file:  # the temps of scans killed while saving
            remove_dead_temps(cache_file.parent)
        known = load(cache_file) if cache_file else {}
        stamps = [_stamp(key) for key in keys]
        checks = [_hit(known.get(key), stamp) for key, stamp in zip(keys, stamps, strict=True)]
        verdicts = [check.verdict(max_pixels) if check is not None else None for check in checks]
    todo = [index for index, verdict in enumerate(verdicts) if verdict is None]
    # Entries of files this scan does not ask about stay: another folder's scan may share the file.
    asked = set(keys)
    others = {key: entry for key, entry in known.items() if key not in asked} if todo else {}
    saved = time.monotonic()
    try:
        for index, check in zip(todo, inspect_parallel([paths[i] for i in todo], max_pixels, workers), strict=True):
            checks[index], verdicts[index] = check, check.verdict(max_pixels)
            if cache_file and time.monotonic() - saved > SAVE_EVERY_S:  # a kill loses a minute at most
                _save(cache_file, keys, stamps, checks, others)
                saved = time.monotonic()
    finally:  # what was inspected is kept, also when a Ctrl-C or an unreadable file stops the scan
        if cache_file and todo:
            _save(cache_file, keys, stamps, checks, others)
    return verdicts  # type: ignore[return-value]  # no None is left: each was inspected above


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while a warm start builds its 100k-entry lists: each full collection
    walks torch's objects too, which made that 2.5 times slower. Nothing built here is a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def inspect_parallel(paths: list[Path], max_pixels: int, workers: int) -> Iterator[ImageCheck]:
    """`images.check_image` of each path, in order, `workers` at a time; a progress bar when there are any."""
    if not paths:
        return
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="scan")
    try:
        with tqdm(total=len(paths), desc=f"inspecting {len(paths)} new or changed images", unit="img") as bar:
            for check in pool.map(check_image, paths, itertools.repeat(max_pixels)):
                bar.update()
                yield check
    finally:  # a stop (Ctrl-C) cancels the queued files instead of inspecting them all first
        pool.shutdown(wait=True, cancel_futures=True)


def cache_path(keys: list[str], cache_dir: Path | None) -> Path | None:
    """The cache file of the folder that the images at these absolute paths are in (None: no cache,
    or no images)."""
    if cache_dir is None or not keys:
        return None
    folder = os.path.commonpath({os.path.dirname(key) for key in keys})
    return cache_dir / f"{hashlib.sha256(folder.encode()).hexdigest()[:16]}.json"


def load(cache_file: Path) -> dict[str, tuple[Stamp, ImageCheck]]:
    """The cache's entries by absolute path; none when the file is missing, unreadable or damaged."""
    try:
        data = json.loads(cache_file.read_bytes())
        columns = data["columns"] if isinstance(data, dict) and data.get("format") == FORMAT else {}
        if set(columns) != set(_COLUMNS) or not all(set(map(type, columns[name])) <= types
                                                    for name, types in _COLUMNS.items()):
            return {}
        stamps = zip(columns["size"], columns["mtime_ns"], columns["inode"], strict=True)
        checks = itertools.starmap(ImageCheck, zip(*(columns[name] for name in ImageCheck._fields), strict=True))
        return dict(zip(columns["path"], zip(stamps, checks, strict=True), strict=True))
    except (OSError, ValueError, TypeError, KeyError):  # missing or damaged: start anew
        return {}


def _save(cache_file: Path, keys: list[str], stamps: list[Stamp], checks: list[ImageCheck | None],
          others: dict[str, tuple[Stamp, ImageCheck]]) -> None:
    """The entries of the files inspected so far, and `others`, written atomically."""
    known = [(key, stamp, check) for key, stamp, check in zip(keys, stamps, checks, strict=True)
             if check is not None and not (check.problem or "").startswith(UNREADABLE)]
    known += [(key, stamp, check) for key, (stamp, check) in others.items()]
    columns = {"path": [key for key, _, _ in known],
               **{name: [stamp[index] for _, stamp, _ in known] for index, name in enumerate(_STAMP_FIELDS)},
               **{name: [getattr(check, name) for _, _, check in known] for name in ImageCheck._fields}}
    try:
        write_text(cache_file, json.dumps({"format": FORMAT, "columns": columns}, separators=(",", ":")))
    except (OutputWriteError, OSError) as exc:  # costs a rescan at the next start, not this run
        warnings.warn(f"scan cache not saved: {exc}", stacklevel=3)


def _stamp(key: str) -> Stamp:
    status = os.stat(key)
    return status.st_size, status.st_mtime_ns, status.st_ino


def _hit(entry: tuple[Stamp, ImageCheck] | None, stamp: Stamp) -> ImageCheck | None:
    return entry[1] if entry is not None and entry[0] == stamp else None
