"""Atomic file and folder writes: a crash or Ctrl-C never leaves a half-written file behind.

Everything is written to a temporary name in the destination's own folder (so the final rename
stays on one filesystem) and renamed into place only once it is complete. A write that fails
(a full disk, above all) removes its temporary file and raises `OutputWriteError`: one line
naming the destination, the reason and the free space left.

A kill leaves the temporary file behind. Its name says who wrote it (`.<name>.<pid>-<host>.<random>.tmp`,
the host as a hash of its name), so that a start can remove the temps of writers that are gone from
folders other runs share (the caches, the single-file folder) while leaving those still being written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# mkstemp/mkdtemp create private (0600/0700) entries; finished outputs get the usual permissions.
_UMASK = os.umask(0)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK

# OS errors of a write that the user must fix outside the trainer (space, quota, a read-only or
# failing disk); other OS errors (a missing input, say) are not write failures.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}
# How torch.save and safetensors report a failed write: without an errno, only in the message.
_WRITE_FAILURE_TEXTS = ("No space left on device", "PytorchStreamWriter", "inline_container", "iostream error",
                        "unexpected pos")
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# A temp of `atomic_path` or `atomic_dir`: the writer's pid and host, then tempfile's random part.
TEMP_NAME = re.compile(r"^\..+\.(\d+)-([0-9a-f]{8})\.[a-z0-9_]+\.tmp$")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust (safetensors) words an OS error


class OutputWriteError(Exception):
    """A file or folder could not be written; the previous version at that path is intact."""

    def __init__(self, destination: Path, reason: str, free: str) -> None:
        super().__init__(f"cannot write {destination}: {reason} ({free})")
        self.reason, self.free = reason, free


@contextlib.contextmanager
def reported_write_failures(destination: str | os.PathLike[str]) -> Iterator[None]:
    """Turn a failed write of `destination` into an OutputWriteError; anything else (a bug, a
    signal) propagates as it is."""
    try:
        yield
    except OutputWriteError as exc:  # from a file inside this folder's temp copy: name the folder
        raise OutputWriteError(Path(destination), exc.reason, exc.free) from exc.__cause__
    except Exception as exc:
        code = _errno_of(exc)
        if code in _WRITE_ERRNOS:
            reason = os.strerror(code)  # the OS's own words
        elif any(text in str(exc) for text in _WRITE_FAILURE_TEXTS):
            reason = "No space left on device" if "No space left" in str(exc) else "the write failed"
        else:
            raise
        raise OutputWriteError(Path(destination), reason, _free_space(Path(destination))) from exc


def _free_space(destination: Path) -> str:
    try:
        return f"{shutil.disk_usage(destination.parent).free / 2**20:,.0f} MiB free there"
    except OSError:
        return "free space unknown"


@contextlib.contextmanager
def _making_temp(destination: Path) -> Iterator[None]:
    """Creating the destination's folder and temp as an OutputWriteError: a folder path through
    a file (a typo), no permission, a full disk."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTDIR):
            reason = f"a part of its folder path {destination.parent} is a file, not a folder"
        else:
            reason = exc.strerror or str(exc)
        raise OutputWriteError(destination, reason, _free_space(destination)) from exc


def _errno_of(exc: Exception) -> int | None:
    """The OS error number of a failed write: an OSError's, or the one Rust (safetensors) quotes."""
    if isinstance(exc, OSError):
        return exc.errno
    found = _OS_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def atomic_path(destination: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary file path; on success it replaces `destination` in one rename."""
    destination = Path(destination)
    with _making_temp(destination):
        destination.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(destination), suffix=".tmp", dir=destination.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with reported_write_failures(destination):
            yield tmp
            _fsync_file(tmp)
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, destination)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(destination: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces `destination` (an old one is removed).

    Between removing the old folder and renaming the new one there is a moment with neither;
    the old folder is first renamed aside so that it is only deleted once the new one is in place.
    """
    destination = Path(destination)
    with _making_temp(destination):
        destination.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(destination), suffix=".tmp", dir=destination.parent))
    try:
        with reported_write_failures(destination):
            yield tmp
            os.chmod(tmp, 0o777 & ~_UMASK)
            old = None
            if destination.exists():
                old = destination.with_name(f".{destination.name}.old-{os.getpid()}")
                os.replace(destination, old)
            os.replace(tmp, destination)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text(destination: str | os.PathLike[str], text: str) -> None:
    """Write a UTF-8 text file atomically."""
    with atomic_path(destination) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(destination: str | os.PathLike[str], data: Any) -> None:
    """Write pretty-printed JSON atomically."""
    write_text(destination, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _temp_prefix(destination: Path) -> str:
    return f".{destination.name}.{os.getpid()}-{HOST}."


def remove_dead_temps(folder: str | os.PathLike[str], depth: int = 0, of: str | None = None) -> list[Path]:
    """Remove the temps in `folder` (and its subfolders, `depth` levels down) whose writer is gone:
    a process of this machine that no longer exists. Others stay: a live writer's, another machine's
    (whose processes cannot be seen from here) and names this module did not make. `of`: only the
    temps of that file name. Returns what was removed."""
    removed = []
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:  # no such folder (nothing cached yet), or unreadable: nothing to clean
        return removed
    for entry in entries:
        if of is not None and not entry.name.startswith(f".{of}."):
            continue
        match = TEMP_NAME.match(entry.name)
        if match and match.group(2) == HOST and not _process_exists(int(match.group(1))):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                Path(entry.path).unlink(missing_ok=True)
            removed.append(Path(entry.path))
        elif depth and not match and entry.is_dir(follow_symlinks=False):
            removed += remove_dead_temps(entry.path, depth - 1)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
