"""Read tensors by name from safetensors files, one at a time, with bounded memory.

safe_open maps a whole file into memory, and every page read stays in the process's resident set
until the mapping is closed: reading all of SDXL through open handles would show ~14 GB resident.
So the reader closes its files after every REOPEN_BYTES read and opens them again on demand,
which keeps the resident set near one tensor plus REOPEN_BYTES.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class TensorReader:
    """The tensors of one safetensors file, or of the shards of one model (a key may be stored in
    only one of them). Headers are read on creation; tensors are read on request.

    `error` is the exception raised, with a message naming the file, for a file that is not
    readable safetensors, so that each caller reports it in its own terms.
    """

    REOPEN_BYTES = 64 << 20  # measured (bench/bench_convert.py): 512 MiB kept ~3x the largest tensor resident

    def __init__(self, paths: Sequence[Path], error: type[Exception] = ValueError) -> None:
        self._error = error
        self._handles: dict[Path, Any] = {}
        self._bytes_read = 0
        self._file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}  # safetensors dtype names: "F32", "BF16", …
        self.metadata: dict[str, str] = {}
        for path in paths:
            handle = self._handle(path)
            self.metadata.update(handle.metadata() or {})
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not dicts)
                if key in self._file_of:
                    raise error(f"{path.parent}: {key} is stored in more than one shard")
                tensor_slice = handle.get_slice(key)
                self.shapes[key] = tuple(tensor_slice.get_shape())
                self.dtypes[key] = tensor_slice.get_dtype()
                self._file_of[key] = path
        self.close()

    @property
    def keys(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self.shapes)

    def get(self, key: str) -> torch.Tensor:
        tensor = self._handle(self._file_of[key]).get_tensor(key)  # a copy, not a view of the mapping
        self._bytes_read += tensor.nbytes
        if self._bytes_read >= self.REOPEN_BYTES:
            self.close()
        return tensor

    def close(self) -> None:
        """Unmap every file; the next read opens its file again."""
        self._handles.clear()
        self._bytes_read = 0

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (OSError, SafetensorError) as error:
                raise self._error(f"{path}: not a readable safetensors file ({error})") from error
        return self._handles[path]
