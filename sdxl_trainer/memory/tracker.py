"""Live tensor bytes and their peak, counted per storage as tensors are created and freed.

The same counter serves the plan (a training step traced on fake tensors, which allocate
nothing) and the measurement on the CPU (a real step, where torch keeps no allocator statistics),
so the two are counted alike: every storage an operator returns is counted once, from the moment
it appears until its last tensor is gone. Views share their base's storage and cost nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


class LiveBytes(TorchDispatchMode):
    """While active (`with LiveBytes("cpu") as live:`), counts the bytes of every storage created
    on `device_type` by an operator; `track` adds tensors that existed before (the weights).
    `current` is what is alive now, `peak` the most that was alive at once since `reset_peak`."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def track(self, tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
                self._count(tensor.untyped_storage())
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            # a meta tensor read as a number (`.item()`, `bool()`, `float()`: Prodigy's step reads
            # its estimates, `if p.any()`): a plan needs a number, not its value
            return False if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most operators: one tensor, no tree to walk
            if out.device.type == self.device_type:
                self._count(out.untyped_storage())
                self.peak = max(self.peak, self.current)
        else:
            self.track(tree_leaves(out))
        return out

    def _bytes(self, storage: torch.UntypedStorage) -> int:
        size = storage.nbytes()
        if self.device_type == "cuda":
            return -(-size // CUDA_BLOCK) * CUDA_BLOCK
        return size

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        size = self._bytes(storage)
        known = self._sizes.get(key)
        if known is not None and self._refs[key]() is storage:
            self.current += size - known  # a storage resized in place (`resize_`)
            self._sizes[key] = size
            return
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self.current += size

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)
