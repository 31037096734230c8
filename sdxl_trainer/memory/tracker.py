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
from torch.utils._pytree import tree_flatten, tree_leaves

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this
PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
UNCACHEABLE = object()  # an operator call whose outputs cannot be made from their layout alone
NEW, IN_PLACE = "new", "in place"
MAX_LAYOUTS = 200_000  # calls remembered by this process (then forgotten, and learnt again)


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
        out = self._run(func, args, kwargs or {})
        if isinstance(out, torch.Tensor):  # most operators: one tensor, no tree to walk
            if out.device.type == self.device_type:
                self._count(out.untyped_storage())
                self.peak = max(self.peak, self.current)
        else:
            self.track(tree_leaves(out))
        return out

    def _run(self, func, args, kwargs):
        """`func`'s outputs. On meta tensors, the layout of an operator's outputs follows from its
        inputs' layouts alone: a call like one that ran before (an operator that makes new
        tensors, or a pointwise one that writes its first input in place) gets empty tensors of
        the layout it gave then (or that input back). Meta kernels are Python code of about a
        millisecond a call, and a plan makes thousands of the same calls (every layer's optimizer
        step, the repeated blocks of the UNet), as do the re-plans of the pre-flight's remedies."""
        key = _call_key(func, args, kwargs) if self.device_type == "meta" else None
        if key is None:
            return func(*args, **kwargs)
        layout = _LAYOUTS.get(key)
        if layout is None:
            out = func(*args, **kwargs)
            if len(_LAYOUTS) >= MAX_LAYOUTS:
                _LAYOUTS.clear()
            _LAYOUTS[key] = IN_PLACE if _KINDS[func] == IN_PLACE else _layout_of(out)
            return out
        if layout is IN_PLACE:
            return args[0]
        if layout is UNCACHEABLE:
            return func(*args, **kwargs)
        tensors = tuple(torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in
                        layout[1])
        return tensors if layout[0] else tensors[0]

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


# A layout depends on the operator and its inputs alone, so every plan in the process shares them.
_LAYOUTS: dict[tuple, Any] = {}  # call key -> UNCACHEABLE, IN_PLACE or (a tuple?, outputs' layouts)
_KINDS: dict[Any, str | None] = {}  # operator -> NEW, IN_PLACE or None (its calls are always run)


def _kind(func) -> str | None:
    """NEW for an operator that only makes new tensors (nothing written in place, no output a view
    of an input, every output a tensor); IN_PLACE for a pointwise one that writes its first input
    and returns it (its layout unchanged); else None."""
    if func not in _KINDS:
        schema = func._schema
        arguments, returns = schema.arguments, schema.returns
        new = bool(returns) and not schema.is_mutable and all(argument.alias_info is None for argument in arguments) \
            and all(value.alias_info is None and isinstance(value.type, torch.TensorType) for value in returns)
        first = arguments[0].alias_info if arguments else None
        in_place = (torch.Tag.pointwise in func.tags and torch.Tag.inplace_view not in func.tags
                    and first is not None and first.is_write and len(returns) == 1 and returns[0].alias_info is not None
                    and all(argument.alias_info is None for argument in arguments[1:]))
        _KINDS[func] = NEW if new else IN_PLACE if in_place else None
    return _KINDS[func]


def _call_key(func, args, kwargs) -> tuple | None:
    """A call's operator and its inputs' layouts and plain values; None when its outputs cannot be
    taken from an earlier call's (an operator that views, or writes other than pointwise in place;
    a tensor not on meta; an input that is not a plain value)."""
    if _kind(func) is None or (_KINDS[func] == IN_PLACE and not args):
        return None
    leaves, spec = tree_flatten((args, kwargs))
    key: list[Any] = [func, spec, torch.get_default_dtype()]  # a factory call without a dtype makes the default
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type != "meta":
                return None
            key.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.storage_offset(), leaf.layout))
        elif isinstance(leaf, PLAIN):
            key.append((type(leaf), leaf))
        else:
            return None
    return tuple(key)


def _layout_of(out) -> Any:
    """(whether a tuple, each output's (shape, stride, dtype)), or UNCACHEABLE when an empty meta
    tensor of that layout would not be the same: not on meta, a storage larger than the layout
    needs, or one shared by two outputs."""
    tensors = out if isinstance(out, tuple) else (out,)
    storages: list[torch.UntypedStorage] = []
    layouts = []
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta" or tensor.layout != torch.strided:
            return UNCACHEABLE
        made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        storage = tensor.untyped_storage()
        if tensor.storage_offset() or storage.nbytes() != made.untyped_storage().nbytes() or any(
                storage._cdata == other._cdata for other in storages):
            return UNCACHEABLE
        storages.append(storage)
        layouts.append((tuple(tensor.shape), tensor.stride(), tensor.dtype))
    return isinstance(out, tuple), tuple(layouts)
