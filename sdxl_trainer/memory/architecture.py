"""The model a memory plan traces: SDXL's components built from their config files alone, on fake
tensors (no weight is read, no memory is taken), for every kind of `model.id`.

A diffusers folder and the built-in model give their own `config.json` files; a hub id gives them
from the local Hugging Face cache (a plan needs no download, only what `model_index.json` and the
components' configs say); a single file, or a hub model not in the cache, is planned with SDXL
base 1.0's shapes, which every SDXL checkpoint shares. Tokenizers are always the built-in model's:
prompts are padded to 77 tokens, so the ids do not change what a step costs.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffusers import StableDiffusionXLPipeline

    from ..config import ModelConfig

COMPONENT_FILES = {"unet": "unet/config.json", "vae": "vae/config.json",
                   "text_encoder": "text_encoder/config.json", "text_encoder_2": "text_encoder_2/config.json"}


class PlanSkipped(Exception):
    """The plan cannot be made (unreadable configs, a component it does not know): the reason."""


@dataclass
class Architecture:
    """What a fake pipeline is built from: each component's config, where they came from (said in
    the plan), and the built-in model's tokenizers and scheduler."""

    configs: dict[str, dict[str, Any]]
    source: str
    parts: dict[str, Any]  # tokenizer, tokenizer_2, scheduler


def read_architecture(model: ModelConfig) -> Architecture:
    """The architecture of `model.id`, read from its files once per process (the plan cache's key,
    the plan and the re-plans of the remedies all need it)."""
    return _architecture(model.id)


@functools.lru_cache(maxsize=4)
def _architecture(model_id: str) -> Architecture:
    from diffusers import EulerDiscreteScheduler

    from ..config import ModelConfig
    from ..tiny_model import build_tiny_tokenizers, tiny_sdxl_path

    configs, source = component_configs(ModelConfig(id=model_id))
    tokenizer, tokenizer_2 = build_tiny_tokenizers()
    scheduler = EulerDiscreteScheduler.from_pretrained(tiny_sdxl_path(), subfolder="scheduler")
    return Architecture(configs, source, {"tokenizer": tokenizer, "tokenizer_2": tokenizer_2, "scheduler": scheduler})


def component_configs(model: ModelConfig) -> tuple[dict[str, dict[str, Any]], str]:
    """Each component's config, and where they came from."""
    from ..models import resolve_source
    from ..sdxl_base import CLIP_BIGG, CLIP_L, UNET, VAE
    from ..tiny_model import tiny_sdxl_path

    source = resolve_source(model.id)
    base = {"unet": dict(UNET), "vae": dict(VAE), "text_encoder": {**CLIP_L, "vocab_size": 49408},
            "text_encoder_2": {**CLIP_BIGG, "vocab_size": 49408}}
    if source.kind == "single_file":
        return base, "SDXL base 1.0's shapes (a single file)"
    if source.kind == "hub":
        files = _hub_config_files(source.location)
        if files is None:
            return base, f"SDXL base 1.0's shapes ({model.id} is not in the local Hugging Face cache)"
        where = f"the config files of {model.id} in the Hugging Face cache"
    else:
        folder = tiny_sdxl_path() if source.kind == "builtin" else Path(source.location)
        files = {name: folder / relative for name, relative in COMPONENT_FILES.items()}
        where = f"the config files in {folder}"
    return {name: _read_config(path) for name, path in files.items()}, where


def _hub_config_files(repo: str) -> dict[str, Path] | None:
    from huggingface_hub import try_to_load_from_cache

    found = {name: try_to_load_from_cache(repo, relative) for name, relative in COMPONENT_FILES.items()}
    if not all(isinstance(path, str) for path in found.values()):
        return None
    return {name: Path(path) for name, path in found.items()}


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanSkipped(f"cannot read {path}: {exc}") from None


def meta_pipeline(architecture: Architecture) -> StableDiffusionXLPipeline:
    """SDXL's components from their configs on the meta device: shapes and dtypes, no memory."""
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    configs = architecture.configs
    try:
        with torch.device("meta"):
            components = {
                "unet": UNet2DConditionModel.from_config(_public(configs["unet"])),
                "vae": AutoencoderKL.from_config(_public(configs["vae"])),
                "text_encoder": CLIPTextModel(CLIPTextConfig(**_public(configs["text_encoder"]))),
                "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**_public(configs["text_encoder_2"]))),
            }
    except (TypeError, ValueError, KeyError) as exc:
        raise PlanSkipped(f"a component the planner does not know ({architecture.source}): {exc}") from None
    return StableDiffusionXLPipeline(**components, **architecture.parts)


def make_fake(module: torch.nn.Module) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor of the same shape and dtype
    (call inside a FakeTensorMode). Done in place, not with `Module.to`: fake parameters cannot be
    converted by it (it swaps them, which their fake mode's weak references forbid)."""
    made: dict[int, torch.Tensor] = {}  # a tensor shared by several layers stays shared

    def fake(tensor: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(tensor) not in made:
            empty = torch.empty(tensor.shape, dtype=tensor.dtype)
            made[id(tensor)] = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad) if parameter else empty
        return made[id(tensor)]

    for layer in module.modules():
        for name, param in layer._parameters.items():
            if param is not None:
                layer._parameters[name] = fake(param, parameter=True)
        for name, buffer in layer._buffers.items():
            if buffer is not None:
                layer._buffers[name] = fake(buffer, parameter=False)


def _public(config: dict[str, Any]) -> dict[str, Any]:
    """A config without the bookkeeping keys (`_class_name`, `_diffusers_version`, …) and the
    transformers fields that are not architecture (dtype, architectures)."""
    return {key: value for key, value in config.items()
            if not key.startswith("_") and key not in ("architectures", "torch_dtype", "dtype", "transformers_version")}
