"""Ctrl-C and SIGTERM: before training, stop at once; during training, finish the step, save a
checkpoint; either way exit 130."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator


EXIT_INTERRUPTED = 130
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StartupStop:
    """Ctrl-C / SIGTERM from the process's start to the first step, when there is nothing to save:
    both raise KeyboardInterrupt at once (SIGTERM would otherwise end the process without a word
    and leave the output folder's lock file behind), so every `finally` and the lock's release run
    and the caller says so in one line. `signal` names the first one; an interrupted import can turn
    the KeyboardInterrupt into another error (a RecursionError was seen), which counts as the same
    stop. A repeat within `StopRequest.REPEAT_WINDOW_S` counts once, so the clean-up is not itself
    interrupted."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.at = 0.0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and time.monotonic() - self.at < StopRequest.REPEAT_WINDOW_S:
            return
        self.signal, self.at = self.signal or signal.Signals(signum).name, time.monotonic()
        raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class StopRequest:
    """Ctrl-C / SIGTERM: the first finishes the current optimizer step (or, during the final save,
    the write in progress), saves a checkpoint and exits; a second one exits at once (every write
    is atomic, so nothing is left half-written; the next start removes the temp files).

    A repeat within `REPEAT_WINDOW_S` is the same request, not a second press: `accelerate launch`
    passes on the signal it got, and a cluster scheduler may signal the launcher and every
    process at once, so one stop can arrive twice within milliseconds."""

    REPEAT_WINDOW_S = 2.0

    def __init__(self) -> None:
        self.requested = False
        self.requested_at = 0.0
        self.action = "finishing this step and saving a checkpoint"  # what the first signal leads to
        self.pid = os.getpid()
        self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self.pid:  # a forked DataLoader worker: the main process answers for the run
            return
        if self.requested:
            if time.monotonic() - self.requested_at < self.REPEAT_WINDOW_S:
                return
            self.restore()
            print(f"\n{signal.Signals(signum).name} again: exiting at once, without a checkpoint of this step",
                  file=sys.stderr)
            raise SystemExit(EXIT_INTERRUPTED)  # unwinds (temp files are removed) and prints no traceback
        self.requested, self.requested_at = True, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: {self.action} (press Ctrl-C again to exit at once)",
              file=sys.stderr)

    def agreed(self, accelerator: Accelerator) -> bool:
        """Whether any process was asked to stop (they must all checkpoint at the same step)."""
        if accelerator.num_processes == 1:
            return self.requested
        import torch

        flag = torch.tensor([float(self.requested)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
