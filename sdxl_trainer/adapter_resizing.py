"""A LoRA or DoRA adapter file at a lower rank (resize_adapter.py), in the format it came in.

Each module's update ΔW = scale·up@down is cut to its best rank-r approximation (the SVD of the
product, through the QR of both factors: lowrank.factorize_product), fixed or by kohya's dynamic
methods. The output has alpha = rank (scale 1) in every resized module; with a fixed --rank, a
module already at or below it (a file's lower-rank convolutions, say) is kept as it is.

DoRA: the magnitude is kept. The merged weight m·V/‖V‖ (V = W + ΔW) has channel norms m whatever
the update is, so keeping m makes the resized adapter's merged weight match the original's norms
exactly, and the base model is not needed; recomputing m from the norms of the original merged
weight would give m again. Of the direction, V_r = W + ΔW_r is the best rank-r approximation of V
(W is fixed), which is what the rank limits.

Without the base model only the update's error can be reported (‖ΔW − ΔW_r‖ / ‖ΔW‖); with it, the
merged weight's error against the original adapter's merged weight as well, and every module is
checked against the model's layer shapes.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from .adapter_kinds import WEIGHT_FILES
from .atomic import atomic_path
from .finite import non_finite_names
from .formats.adapter_files import (
    PEFT,
    AdapterFile,
    AdapterModule,
    adapter_files,
    find_layer,
    kohya_name_map,
    merged_weight,
)
from .lowrank import LayerError, LowRankError, RankChoice, factorize_product, layer_error

if TYPE_CHECKING:
    import torch
    from diffusers import StableDiffusionXLPipeline


class ResizeError(LowRankError):
    """The adapter cannot be resized as asked (another model's, not LoRA/DoRA, rank not lower)."""


@dataclass
class Resized:
    """The resized modules (in file order) with their errors, the file's other tensors and metadata,
    and how many modules were already at or below a fixed --rank (kept as they are)."""

    modules: list[AdapterModule]
    errors: list[LayerError]
    other: dict[str, torch.Tensor]
    metadata: dict[str, str]
    file_format: str
    kept: int = 0


@functools.lru_cache(maxsize=1)
def sdxl_layout() -> SimpleNamespace:
    """SDXL's UNet and text encoders on the meta device (no weights): the layers an SDXL adapter
    may name, when no base model is given. Built once per process (seconds: 3.5 B parameters'
    modules, though no memory)."""
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from .sdxl_base import CLIP_BIGG, CLIP_L, UNET

    with torch.device("meta"):
        return SimpleNamespace(unet=UNet2DConditionModel(**UNET),
                               text_encoder=CLIPTextModel(CLIPTextConfig(**CLIP_L)),
                               text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_BIGG)))


def input_file(path: str | Path) -> Path:
    """The one adapter file `path` names: a file, or a folder of this trainer, whose diffusers/peft
    file is read where it holds both formats (as adapter.init_from reads it)."""
    files, _ = adapter_files(path)
    peft = [file for file in files if file.name in WEIGHT_FILES]
    if len(files) > 1 and len(peft) == 1:
        return peft[0]
    if len(files) > 1:
        raise ResizeError(f"{path}: holds {len(files)} adapter files ({', '.join(f.name for f in files)}): "
                          "pass one of them")
    return files[0]


def resize(path: Path, choice: RankChoice, base: StableDiffusionXLPipeline | None) -> Resized:
    """Every module of the file at `path` resized; `base` (optional) checks shapes and gives the
    merged-weight errors."""
    model = base if base is not None else sdxl_layout()
    with AdapterFile(path, kohya_name_map(model)) as adapter:
        if any(key.startswith("lora_te_") for key in adapter.reader.keys):
            raise ResizeError(f"{path}: an SD 1.x adapter (lora_te_ keys, one text encoder), not SDXL's")
        modules, errors, kept = [], [], 0
        for module in adapter.modules():
            _check_finite(path, module)
            weight = _layer_weight(path, model, module, base is not None)
            if choice.dynamic is None and (module.rank or 0) <= choice.rank:
                modules.append(module)
                errors.append(_kept_error(module, weight))
                kept += 1
                continue
            resized, error = _resize_module(module, choice, weight)
            modules.append(resized)
            errors.append(error)
        if kept == len(modules):
            top = max(module.rank or 0 for module in modules)
            raise ResizeError(f"--rank {choice.rank} lowers no module of {path} (its highest rank is {top}): "
                              "resizing only lowers ranks")
        other = {key: adapter.reader.get(key) for key in adapter.other_keys}
        metadata = _metadata(adapter.format, adapter.metadata, modules)
        return Resized(modules, errors, other, metadata, adapter.format, kept)


def _check_finite(path: Path, module: AdapterModule) -> None:
    """A module holding NaN/Inf is refused: its resized factors and kept magnitude would be too."""
    bad = non_finite_names(module.tensors.items())
    if bad:
        raise ResizeError(f"{path}: {module.label} holds NaN/Inf in its {', '.join(bad)}: repair the file with "
                          "fix_dora_weights.py first")


def _layer_weight(path: Path, model: object, module: AdapterModule, real: bool) -> torch.Tensor | None:
    """The base weight of the module's layer (None without a base model); a module of no SDXL
    layer, or of another shape, or not LoRA/DoRA, is refused."""
    if module.algorithm != "lora":
        raise ResizeError(f"{path}: {module.label} is {module.algorithm}, not LoRA/DoRA: only those are resized")
    if "down" not in module.tensors or "up" not in module.tensors:
        raise ResizeError(f"{path}: {module.label} lacks its lora_down or lora_up tensor")
    layer = find_layer(model, module)
    if layer is None or not hasattr(layer, "weight"):
        raise ResizeError(f"{path}: {module.label} is no layer of SDXL" + (" (of --base)" if real else "")
                          + ": an adapter for another model")
    shape = tuple(layer.weight.shape)
    if real and (shape[0] != module.out_features or math.prod(shape[1:]) != module.down.flatten(1).shape[1]):
        raise ResizeError(f"{path}: {module.label} adapts a weight of another shape than --base's {list(shape)}")
    return layer.weight.detach() if real else None


def _kept_error(module: AdapterModule, weight: torch.Tensor | None) -> LayerError:
    """The error record of a module kept as it is: nothing is lost."""
    delta = module.delta()
    target = float(merged_weight(weight, module).double().square().sum()) if weight is not None else math.nan
    shape = tuple(weight.shape) if weight is not None else (module.out_features, module.in_features)
    return LayerError(module.label, shape, module.rank or 0, 0.0 if weight is not None else math.nan, target, 0.0,
                      float(delta.double().square().sum()))


def _resize_module(module: AdapterModule, choice: RankChoice,
                   weight: torch.Tensor | None) -> tuple[AdapterModule, LayerError]:
    up, down = module.up.float().flatten(1) * module.scale, module.down.float().flatten(1)
    factors = factorize_product(up, down, choice)
    tensors = dict(module.tensors)
    tensors["down"] = factors.down.reshape(factors.rank, *module.down.shape[1:]).to(module.down.dtype)
    tensors["up"] = factors.up.reshape(module.up.shape[0], factors.rank, *module.up.shape[2:]).to(module.up.dtype)
    if "alpha" in tensors:
        tensors["alpha"] = tensors["alpha"].new_tensor(float(factors.rank))
    resized = AdapterModule(module.file_name, module.file_format, module.component, module.name, tensors,
                            module.keys, alpha=float(factors.rank))
    if weight is None:
        return resized, layer_error(module.label, None, None, factors)
    merged, target = merged_weight(weight, resized), merged_weight(weight, module)
    return resized, layer_error(module.label, merged, target, factors)


def _metadata(file_format: str, metadata: dict[str, str], modules: list[AdapterModule]) -> dict[str, str]:
    """The file's metadata with the new ranks: peft's LoraConfig (r, lora_alpha = r, rank_pattern
    and alpha_pattern for modules of another rank), or kohya's ss_network_dim/alpha."""
    ranks = [module.down.shape[0] for module in modules]
    common = collections.Counter(ranks).most_common(1)[0][0]
    if file_format != PEFT:
        updated = {**metadata, "ss_network_dim": str(common), "ss_network_alpha": str(common)}
        if "ss_network_args" in metadata:
            args = json.loads(metadata["ss_network_args"])
            convs = [module.down.shape[0] for module in modules if module.down.dim() == 4]
            if convs and "conv_dim" in args:
                args |= {"conv_dim": str(convs[0]), "conv_alpha": str(convs[0])}
            updated["ss_network_args"] = json.dumps(args)
        return updated
    if "lora_adapter_metadata" not in metadata:
        return metadata  # diffusers then takes each rank from the shapes and alpha = rank: scale 1, as written
    config = json.loads(metadata["lora_adapter_metadata"])
    for component in {module.component for module in modules}:
        mine = [module for module in modules if module.component == component]
        default = collections.Counter(module.down.shape[0] for module in mine).most_common(1)[0][0]
        ranks = {_pattern_key(module): module.down.shape[0] for module in mine if module.down.shape[0] != default}
        alphas = {_pattern_key(module): module.alpha for module in mine if module.alpha != default}
        config |= {f"{component}.r": default, f"{component}.lora_alpha": default, f"{component}.use_rslora": False,
                   f"{component}.rank_pattern": ranks, f"{component}.alpha_pattern": alphas}
    return {**metadata, "lora_adapter_metadata": json.dumps(config)}


def _pattern_key(module: AdapterModule) -> str:
    """The module's key in peft's rank_pattern and alpha_pattern."""
    return re.escape((module.name or "").removeprefix("text_model."))


def write_resized(resized: Resized, destination: Path) -> Path:
    """The resized adapter as one .safetensors file, keys in the input's order and spelling, atomically."""
    from safetensors.torch import save_file

    tensors = {module.keys[role]: tensor.contiguous() for module in resized.modules
               for role, tensor in module.tensors.items()}
    tensors |= {key: tensor.contiguous() for key, tensor in resized.other.items()}
    bad = non_finite_names(tensors.items())
    if bad:
        raise ResizeError(f"the resized adapter would hold NaN/Inf in {', '.join(bad[:5])}: nothing written")
    with atomic_path(destination) as tmp:
        save_file(tensors, str(tmp), metadata=resized.metadata)
    return destination
