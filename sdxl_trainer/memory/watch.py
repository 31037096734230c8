"""The measured peak beside the plan, per log step and over the run.

CUDA: the caching allocator's own statistics (`max_memory_allocated`, what the plan predicts,
and `max_memory_reserved`, what the driver gave it). CPU: torch keeps no statistics, so the
tensor bytes are counted as the plan counts them (`tracker.LiveBytes`, active from the first step
to the end of the run), beside the process's resident-set high-water mark (`VmHWM`, which also
holds Python, libraries and the data loader).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .tracker import LiveBytes

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

OVER_PLAN = 1.10  # a measured peak this much above the plan is worth a warning


def proc_bytes(path: str, field: str) -> int | None:
    """A `kB` field of a Linux /proc file in bytes (`/proc/self/status` VmHWM: the process's peak
    resident memory; `/proc/meminfo` MemAvailable); None where there is no such file."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakWatch:
    """Peaks since the last `take()` and over the whole run, for one device."""

    def __init__(self, device: torch.device, tensors: Iterable[torch.Tensor]) -> None:
        self.device = device
        self.live = LiveBytes(device.type) if device.type == "cpu" else None
        self.run_peak = 0
        if self.live is not None:
            self.live.track(tensors)
            self.live.__enter__()
        elif device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def take(self) -> dict[str, int]:
        """The peaks since the last call (bytes), and a fresh start for the next ones."""
        if self.device.type == "cuda":
            peaks = {"allocated": torch.cuda.max_memory_allocated(self.device),
                     "reserved": torch.cuda.max_memory_reserved(self.device)}
            torch.cuda.reset_peak_memory_stats(self.device)
            self.run_peak = max(self.run_peak, peaks["allocated"])
            return peaks
        if self.live is None:
            return {}
        peaks = {"tracked": self.live.peak}
        rss = proc_bytes("/proc/self/status", "VmHWM")
        if rss is not None:
            peaks["rss_high_water_mark"] = rss
        self.run_peak = max(self.run_peak, self.live.peak)
        self.live.reset_peak()
        return peaks

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not counted: the copies that writes make (checkpoints, exports), which the plan leaves out.
        The peak reached before stays in the run's peak."""
        if self.device.type == "cuda":
            self.run_peak = max(self.run_peak, torch.cuda.max_memory_allocated(self.device))
        elif self.live is not None:
            self.run_peak = max(self.run_peak, self.live.peak)
            self.live.__exit__(None, None, None)
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            elif self.live is not None:
                self.live.__enter__()

    def stop(self) -> None:
        """Stop counting (the end of the run); the run's peak stays readable."""
        if self.live is not None:
            self.take()
            self.live.__exit__(None, None, None)
            self.live = None
