"""A .safetensors file's header, read without torch and without loading a tensor: the pre-flight
uses it to tell, in a second, whether a file is complete and what it holds.

The format: an 8-byte little-endian header length, the JSON header (each tensor's dtype, shape
and byte range `data_offsets` relative to the end of the header), then the tensor bytes. A
complete file ends exactly where the last tensor's bytes end.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def read_header(path: Path) -> dict[str, dict]:
    """The tensor entries of the header (`__metadata__` left out); ValueError says what is wrong
    with a file that is not a complete safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError("not a safetensors file (no valid header)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (unreadable header)")
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if size < 8 + length + end:
        raise ValueError(f"truncated: {size} bytes, the header promises {8 + length + end}")
    return header
