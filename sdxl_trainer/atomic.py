"""Atomic file and folder writes: a crash or Ctrl-C never leaves a half-written file behind.

Everything is written to a temporary name in the destination's own folder (so the final rename
stays on one filesystem) and renamed into place only once it is complete. A write that fails
(a full disk, above all) removes its temporary file and raises `OutputWriteError`: one line
naming the destination, the reason and the free space left.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
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
        try:
            free = f"{shutil.disk_usage(Path(destination).parent).free / 2**20:,.0f} MiB free there"
        except OSError:
            free = "free space unknown"
        raise OutputWriteError(Path(destination), reason, free) from exc


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
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent)
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
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent))
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
