"""Switching modules to eval mode for a while without losing their own train/eval flags."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def eval_mode(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Every module in eval() for the duration; then each submodule gets its own `.training` flag
    back (a frozen submodule inside a training UNet stays in eval)."""
    flags = [(sub, sub.training) for module in modules for sub in module.modules()]
    try:
        for module in modules:
            module.eval()
        yield
    finally:
        for sub, training in flags:
            sub.training = training
