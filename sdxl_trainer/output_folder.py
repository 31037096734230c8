"""A run owns its output folder while it trains: a lock keeps a second run out, and what an
earlier run killed mid-write left behind (temp files and folders) is removed before anything new
is written.

The lock is `fcntl.flock` on `<output_dir>/.trainer.lock`: the kernel releases it when the
process ends however it ends (kill -9 included), so a lock nobody holds is stale by definition;
the file's text (pid, host, start time, command) only serves to name the running run.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from .atomic import remove_dead_temps
from .config import Config, ConfigError

LOCK_NAME = ".trainer.lock"
# The temporary names of every atomic write (atomic.py, outputs.save_pipeline, the exports) and
# of checkpoints being deleted: none of them is ever a finished output.
LEFTOVER = re.compile(r"^\.(.+\.tmp|.+\.old-\d+|pipeline-.+|merged-.+|lora-.+|checkpoint-.+)$")


class OutputLock:
    """Held for the whole run by the main process; `release` (or the process's end) frees it."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_NAME
        self.handle = None

    def acquire(self) -> str | None:
        """Take the lock, or raise ConfigError naming the run that holds it. Returns a note when
        an earlier run ended without releasing it (killed), else None."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # what the pre-flight cannot know (a read-only or special file system)
            raise ConfigError(f"cannot create the output folder {self.path.parent}: {exc.strerror}") from None
        while True:
            handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (open for as long as the run holds the lock)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = describe_holder(handle.read())
                handle.close()
                raise ConfigError(f"{self.path.parent} is in use by another run ({holder}); wait for it to end, "
                                  "or give this run another run.name or training.output_dir") from None
            # The file may have been released and removed between open and flock: lock the one in place.
            if os.path.exists(self.path) and os.path.samestat(os.fstat(handle.fileno()), os.stat(self.path)):
                break
            handle.close()
        handle.seek(0)
        previous = handle.read()
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": datetime.datetime.now().isoformat(timespec="seconds"),
                                 "command": [sys.executable, *sys.argv]}))
        handle.flush()
        self.handle = handle
        if previous.strip():
            return f"an earlier run ({describe_holder(previous)}) ended without releasing {self.path}; taking over"
        return None

    def release(self) -> None:
        if self.handle is None:
            return
        self.path.unlink(missing_ok=True)  # unlinked while still locked: a waiting run re-checks the inode
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None


def describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "unknown process"


def remove_leftovers(config: Config) -> list[Path]:
    """Delete the temp files and folders of interrupted writes in the output folder; only call this
    while holding the lock. In the folders this lock does not cover (the single file's, a state
    file's kept elsewhere), which other runs and the user may share, only the temps whose writer is
    gone, and beside the state file only its own. Returns what was removed."""
    removed = remove_dead_temps(config.checkpoint_path.parent)
    if config.state_path.parent != config.output_dir:
        removed += remove_dead_temps(config.state_path.parent, of=config.state_path.name)
    if config.output_dir.is_dir():
        removed += _remove_matching(config.output_dir)
    return removed


def _remove_matching(folder: Path) -> list[Path]:
    removed = []
    for entry in sorted(folder.iterdir()):
        if LEFTOVER.match(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
        elif entry.is_dir() and not entry.is_symlink():
            removed += _remove_matching(entry)
    return removed
