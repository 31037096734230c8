"""Write a .safetensors file one tensor at a time, so peak memory stays near the largest tensor.

`safetensors.torch.save_file` needs every tensor in memory at once (about 7 GB for an fp16 SDXL).
The format is simple enough to stream: an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range, plus a `__metadata__` str→str map) padded with spaces to an
8-byte boundary, then the raw little-endian bytes of the tensors in header order. Because the
header comes first, every shape and dtype must be known before the first byte of data.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """What the header promises for one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * TORCH_DTYPES[self.dtype].itemsize


def header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """The length prefix plus the padded JSON header for tensors stored back to back in order."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("safetensors metadata must map str to str")
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for spec in specs:
        if spec.name in header:
            raise ValueError(f"duplicate tensor name {spec.name!r}")
        end = offset + spec.nbytes
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


class StreamWriter:
    """Writes the header on creation, then takes tensors in exactly the header's order.

    Leaving the `with` block normally checks that every promised tensor was written; after an
    exception the file is just closed (the caller writes to a temporary path and discards it).
    """

    def __init__(self, handle: BinaryIO, specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors stores little-endian data; this machine is big-endian")
        self._handle = handle
        self._specs = list(specs)
        self._written = 0
        handle.write(header_bytes(self._specs, metadata))

    def write(self, tensor: torch.Tensor) -> None:
        """Append the next tensor; its dtype and shape must equal the header's."""
        if self._written == len(self._specs):
            raise ValueError("more tensors than the header announced")
        spec = self._specs[self._written]
        if DTYPE_NAMES.get(tensor.dtype) != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{spec.name}: header says {spec.dtype} {list(spec.shape)}, "
                f"got {tensor.dtype} {list(tensor.shape)}"
            )
        # A byte view, so bf16 (which numpy lacks) is written like any other dtype; no copy is made
        # for a contiguous CPU tensor.
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._handle.write(memoryview(data))
        self._written += 1

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None and self._written != len(self._specs):
            raise ValueError(f"only {self._written} of {len(self._specs)} tensors were written")
