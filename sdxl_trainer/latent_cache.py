"""Content-addressed VAE latent cache: one `.safetensors` file per image, bucket, crop and flip.

The file name is a hash of everything the entry depends on: the image's bytes, the target size,
the crop, the flip, the loss mask (stored beside the latent, on the latent grid), the colour
transparency is composited onto (images with transparency only), the VAE's weights and the dtype it
computes in, the storage dtype and what is stored (distribution or mode). An edited image or mask,
another background colour or another VAE is therefore a miss, never a stale hit. Entries are checked when read (finite,
expected shape) and rebuilt when damaged; every write is atomic.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .atomic import atomic_path

if TYPE_CHECKING:
    import torch

CACHE_FORMAT = 1
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class LatentKey:
    """Everything about one training view of an image that its latent depends on."""

    image_sha256: str
    width: int
    height: int
    crop_top: int
    crop_left: int
    flip: bool
    mask: str = ""  # the view's loss mask ("alpha", or the mask file's sha256); "" = none
    background: str = ""  # "r,g,b" that transparency is composited onto; "" = an opaque image


# Fields named in every entry's hash; the others only when set, so that entries of opaque images
# without a mask keep the names they had before those fields existed.
_KEY_FIELDS = [name for name in LatentKey.__dataclass_fields__ if name not in ("mask", "background")]


def vae_fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """Identity of a VAE from its weights alone: the sorted hashes of every tensor's fp32 bytes.

    Names and storage dtype do not matter, so the same VAE read from a diffusers folder, a
    single file or a loaded module (fp16 on disk, fp32 in memory) has the same fingerprint.
    """
    import torch

    digests = sorted(
        hashlib.sha256(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()
        for tensor in tensors
    )
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:32]


def vae_fingerprint_from_files(weight_files: list[Path], prefix: str = "") -> str:
    """The same fingerprint, read tensor by tensor from safetensors files (no model is built)."""
    from safetensors import safe_open

    def tensors() -> Iterator[torch.Tensor]:
        for path in weight_files:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.startswith(prefix):
                        yield handle.get_tensor(name)

    return vae_fingerprint(tensors())


def load_checked_entry(path: Path, shapes: dict[str, tuple[int | None, ...]],
                       dtype: str) -> dict[str, torch.Tensor] | None:
    """A cache entry's tensors if it holds exactly `shapes` (None: any size), in `dtype` ("fp32",
    "fp16" or "bf16"), all finite; None when it is missing or anything else (a damaged entry is
    deleted, to be rebuilt). The latent cache and the text cache read their entries through here."""
    import torch
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        tensors = load_file(path)
    except Exception:  # any unreadable entry is a miss that gets rebuilt
        tensors = None
    valid = (
        tensors is not None
        and set(tensors) == set(shapes)
        and all(fits(tuple(t.shape), shapes[name]) and t.dtype == getattr(torch, DTYPES[dtype])
                and bool(torch.isfinite(t).all()) for name, t in tensors.items())
    )
    if not valid:
        path.unlink(missing_ok=True)
        return None
    return tensors


def fits(shape: tuple[int, ...], wanted: tuple[int | None, ...]) -> bool:
    """Whether a tensor's shape is the wanted one, where None stands for any size."""
    return len(shape) == len(wanted) and all(want in (None, size) for want, size in zip(wanted, shape, strict=True))


def save_entry(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, about: dict[str, Any]) -> None:
    """Write a cache entry atomically, in `dtype`, its bytes a function of its content alone (the
    latent cache and the text cache write through here): safetensors writes a metadata of several
    keys in a random order, so `about` goes in as one sorted JSON value."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"sdxl_trainer": json.dumps(about, sort_keys=True)})


class LatentCache:
    """Reads and writes cached latents under `cache_dir` for one VAE, the dtype it encodes in, a
    storage dtype and a storage mode."""

    def __init__(self, cache_dir: str | Path, vae_id: str, dtype: str, stored: str, vae_dtype: str):
        self.cache_dir = Path(cache_dir)
        self.vae_id = vae_id
        self.dtype = dtype  # "fp32", "fp16" or "bf16"
        self.stored = stored  # "sample": mean and std; "mode": mean only
        self.vae_dtype = vae_dtype  # what the VAE computes in: another dtype, other latents

    def path(self, key: LatentKey) -> Path:
        """The entry's file: named by the sha256 of the key's fields and the cache's settings as
        sorted JSON (a pre-flight computes 100k of these, hence no `dataclasses.asdict`)."""
        fields = {name: getattr(key, name) for name in _KEY_FIELDS}
        fields.update(vae=self.vae_id, dtype=self.dtype, stored=self.stored, format=CACHE_FORMAT)
        if key.mask:  # entries without a mask keep the names they had before masks existed
            fields["mask"] = key.mask
        if key.background:
            fields["background"] = key.background
        if self.vae_dtype != "fp32":  # likewise fp32 entries, the only ones before this key (docs/formats.md)
            fields["vae_dtype"] = self.vae_dtype
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.safetensors"

    def load(self, key: LatentKey) -> dict[str, torch.Tensor] | None:
        """The cached tensors, or None when missing or damaged (a damaged entry is deleted)."""
        grid = (key.height // 8, key.width // 8)
        shapes = {"mean": (4, *grid)} | ({"std": (4, *grid)} if self.stored == "sample" else {}) | (
            {"mask": (1, *grid)} if key.mask else {})
        return load_checked_entry(self.path(key), shapes, self.dtype)

    def save(self, key: LatentKey, mean: torch.Tensor, std: torch.Tensor | None,
             mask: torch.Tensor | None = None) -> None:
        """Store one view's latent distribution (the mean alone in "mode"), and its loss mask."""
        import torch

        dtype = getattr(torch, DTYPES[self.dtype])
        tensors = {"mean": mean}
        if self.stored == "sample":
            tensors["std"] = std
        if key.mask:
            tensors["mask"] = mask
        save_entry(self.path(key), tensors, dtype, {"format": CACHE_FORMAT, "vae": self.vae_id})

    def missing(self, keys: Iterable[LatentKey]) -> list[LatentKey]:
        return [key for key in keys if self.load(key) is None]


def sample_latents(entry: dict[str, torch.Tensor], generator: torch.Generator | None) -> torch.Tensor:
    """A latent from a cached entry: mean + std·noise for stored distributions, else the mean."""
    import torch

    mean = entry["mean"].float()
    if "std" not in entry:
        return mean
    noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32)
    return mean + entry["std"].float() * noise
