"""Model loading: one code path for a hub id, a local diffusers folder, a single file and the
built-in tiny model (which is written as a diffusers folder first and then loaded like one)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ConfigError, ModelConfig
from .tiny_model import BUILTIN_PREFIX, TINY_SDXL, tiny_sdxl_folder, tiny_sdxl_path

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline

SINGLE_FILE_SUFFIXES = (".safetensors",)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, decided from `model.id` alone (no weights touched)."""

    kind: str  # "builtin", "folder", "single_file" or "hub"
    location: str

    def describe(self) -> str:
        names = {"builtin": "built-in model", "folder": "diffusers folder", "single_file": "single file",
                 "hub": "hub id"}
        return f"{names[self.kind]} {self.location}"


def resolve_source(model_id: str, key: str = "model.id") -> ModelSource:
    """Classify `model.id`; a path that looks local but does not exist is a config error."""
    if model_id.startswith(BUILTIN_PREFIX):
        if model_id != TINY_SDXL:
            raise ConfigError(f"{key} = {model_id!r}: unknown built-in model; the only one is {TINY_SDXL!r}")
        return ModelSource("builtin", model_id)
    path = Path(model_id).expanduser()
    if path.is_dir():
        return ModelSource("folder", str(path))
    if path.is_file():
        if path.suffix.lower() not in SINGLE_FILE_SUFFIXES:
            raise ConfigError(
                f"{key} = {model_id!r}: only .safetensors single files are loaded "
                "(pickled .ckpt files can run code; convert them first)"
            )
        return ModelSource("single_file", str(path))
    if path.is_absolute() or model_id.startswith((".", "~")) or path.suffix.lower() in SINGLE_FILE_SUFFIXES:
        raise ConfigError(f"{key} = {model_id!r}: no such file or folder")
    if model_id.count("/") != 1:
        raise ConfigError(f"{key} = {model_id!r}: neither a local path nor a hub id like 'org/name'")
    return ModelSource("hub", model_id)


def check_model(model: ModelConfig) -> None:
    """Everything about `model.id` (and `model.config_dir`) that can be known without loading a
    weight, so that a wrong model is one line at pre-flight rather than a traceback after the
    latent cache is built."""
    source = resolve_source(model.id)
    if source.kind == "folder":
        require_pipeline_folder(Path(source.location), "model.id")
    elif source.kind == "single_file":
        _require_sdxl_single_file(Path(source.location))
        if model.config_dir:
            require_pipeline_folder(Path(model.config_dir), "model.config_dir")
    elif source.kind == "hub" and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source.location, "model_index.json"), str):
            raise ConfigError(f"model.id = {model.id!r}: not in the local Hugging Face cache, and HF_HUB_OFFLINE "
                              "is set; download it first (hf download " + model.id + ") or unset HF_HUB_OFFLINE")


def load_pipeline(model: ModelConfig, torch_dtype=None) -> StableDiffusionXLPipeline:
    """Load the SDXL pipeline (UNet, VAE, both text encoders, tokenizers, scheduler)."""
    from diffusers import StableDiffusionXLPipeline

    source = resolve_source(model.id)
    if source.kind == "builtin":
        pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_path(), torch_dtype=torch_dtype)
    elif source.kind == "folder":
        require_pipeline_folder(Path(source.location), "model.id")
        pipe = StableDiffusionXLPipeline.from_pretrained(source.location, torch_dtype=torch_dtype)
    elif source.kind == "single_file":
        pipe = _load_single_file(source.location, model.config_dir, torch_dtype)
    else:
        try:
            pipe = StableDiffusionXLPipeline.from_pretrained(source.location, torch_dtype=torch_dtype)
        except OSError as exc:  # not on the hub, no network, no access: diffusers says which
            raise ConfigError(f"model.id = {model.id!r}: cannot load it from the hub: {exc}") from None
    if model.vae:
        pipe.vae = load_vae(model.vae, model.config_dir, torch_dtype)
    return pipe


def load_vae(vae_id: str, config_dir: str | None, torch_dtype=None) -> AutoencoderKL:
    """Load a replacement VAE from a folder (a VAE folder or a pipeline folder), a file or the hub."""
    from diffusers import AutoencoderKL

    source = resolve_source(vae_id, key="model.vae")
    if source.kind == "builtin":
        return AutoencoderKL.from_pretrained(tiny_sdxl_path(), subfolder="vae", torch_dtype=torch_dtype)
    if source.kind == "folder":
        folder = Path(source.location)
        subfolder = "vae" if (folder / "vae" / "config.json").is_file() else None
        if subfolder is None and not (folder / "config.json").is_file():
            raise ConfigError(f"model.vae = {vae_id!r}: no config.json in the folder or in its vae/ subfolder")
        return AutoencoderKL.from_pretrained(folder, subfolder=subfolder, torch_dtype=torch_dtype)
    if source.kind == "single_file":
        kwargs = {"config": config_dir, "subfolder": "vae", "local_files_only": True} if config_dir else {}
        return AutoencoderKL.from_single_file(source.location, torch_dtype=torch_dtype, **kwargs)
    return AutoencoderKL.from_pretrained(source.location, torch_dtype=torch_dtype)


def _load_single_file(path: str, config_dir: str | None, torch_dtype) -> StableDiffusionXLPipeline:
    from diffusers import StableDiffusionXLPipeline

    if config_dir is None:
        # diffusers fetches the configs that a single file lacks from the hub.
        return StableDiffusionXLPipeline.from_single_file(path, torch_dtype=torch_dtype)
    require_pipeline_folder(Path(config_dir), "model.config_dir")
    pipe = StableDiffusionXLPipeline.from_single_file(
        path, config=config_dir, local_files_only=True, torch_dtype=torch_dtype
    )
    _require_no_meta_tensors(pipe, path)
    return pipe


def require_pipeline_folder(folder: Path, key: str) -> None:
    if not (folder / "model_index.json").is_file():
        raise ConfigError(f"{key} = {str(folder)!r}: not a diffusers pipeline folder (no model_index.json)")
    missing = [name for name in ("unet", "vae", "text_encoder", "text_encoder_2", "scheduler")
               if not (folder / name).is_dir()]
    if missing:
        raise ConfigError(f"{key} = {str(folder)!r}: missing component folder(s) {', '.join(missing)}")


def _require_sdxl_single_file(path: Path) -> None:
    """An SDXL checkpoint in the original (SGM) layout holds the UNet and both text encoders,
    the second (OpenCLIP bigG) under `conditioner.embedders.1.`."""
    from .formats.safetensors_header import read_header
    from .formats.sgm_keys import TE2_PREFIX

    try:
        names = read_header(path).keys()
    except ValueError as exc:
        raise ConfigError(f"model.id = {str(path)!r}: {exc}") from None
    has_unet = any(name.startswith("model.diffusion_model.") for name in names)
    if not (has_unet and any(name.startswith(TE2_PREFIX) for name in names)):
        found = "an SD 1.x/2.x checkpoint" if has_unet else "no Stable Diffusion UNet"
        raise ConfigError(f"model.id = {str(path)!r}: not an SDXL checkpoint ({found}: no UNet under "
                          f"model.diffusion_model. with the bigG text encoder under {TE2_PREFIX})")


def _require_no_meta_tensors(pipe: StableDiffusionXLPipeline, path: str) -> None:
    """diffusers leaves tensors missing from a single file on `meta` without an error: refuse."""
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, name)
        empty = [key for key, tensor in module.state_dict().items() if tensor.device.type == "meta"]
        if empty:
            raise ConfigError(
                f"model.id = {path!r}: the file lacks {len(empty)} {name} tensor(s), e.g. {empty[0]}"
            )


def vae_weight_files(model: ModelConfig) -> tuple[list[Path], str] | None:
    """The safetensors file(s) holding the VAE's weights and the key prefix of its tensors, found
    without loading anything; None where that needs a download (hub ids) or a build."""
    vae_id = model.vae or model.id
    source = resolve_source(vae_id, key="model.vae" if model.vae else "model.id")
    if source.kind == "hub":
        return None
    if source.kind == "single_file":
        return [Path(source.location)], "" if model.vae else "first_stage_model."
    folder = tiny_sdxl_folder() if source.kind == "builtin" else Path(source.location)
    for candidate in (folder / "vae" / "diffusion_pytorch_model.safetensors",
                      folder / "diffusion_pytorch_model.safetensors"):
        if candidate.is_file():
            return [candidate], ""
    return None


def with_components(pipe: StableDiffusionXLPipeline, **components) -> StableDiffusionXLPipeline:
    """A new pipeline sharing `pipe`'s components and settings, with `components` replaced."""
    return type(pipe)(**{**pipe.components, **components},
                      force_zeros_for_empty_prompt=pipe.config.force_zeros_for_empty_prompt)
