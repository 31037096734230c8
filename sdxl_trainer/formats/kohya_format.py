"""Adapters in the kohya/LyCORIS file format, the one ComfyUI, A1111-family UIs and kohya tools
load (docs/formats.md, 'Adapter files: kohya/LyCORIS').

Each adapted layer becomes a group of tensors named `lora_<unet|te1|te2>_<module path with _>`:
- LoRA/DoRA: `lora_down.weight` (peft's lora_A), `lora_up.weight` (lora_B), a 0-dim `alpha` (so
  that kohya's scale alpha/r equals peft's) and, for DoRA, `dora_scale` (peft's magnitude) on the
  output axis, which LyCORIS >= 3.2 merges exactly as peft does;
- LoKr: `lokr_w1` or `lokr_w1_a`/`lokr_w1_b`, `lokr_w2` or `lokr_w2_a`/`lokr_w2_b`, `alpha`:
  ΔW = kron(w1, w2)·alpha/r. The loaders take r from a decomposed factor; with neither decomposed
  they use scale 1, so there peft's alpha/r is multiplied into `lokr_w2`;
- LoHa: `hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`, `alpha`:
  ΔW = (w1_a@w1_b)⊙(w2_a@w2_b)·alpha/r, r = the rows of `hada_w1_b`.
"""

from __future__ import annotations

import collections
import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..adapter_kinds import kind_of_peft_config
from ..atomic import atomic_path
from .sgm_keys import unet_sgm_key

if TYPE_CHECKING:
    import os

    import torch

PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
ADAPTER = "default"  # the name peft gives the one adapter that `add_adapter` attaches


def kohya_module_name(component: str, module_path: str, unet_config: Mapping[str, Any]) -> str:
    """The kohya name of one adapted module (`component` is unet, text_encoder or text_encoder_2).

    UNet modules go by their sgm path (`down_blocks.1.attentions.0.proj_in` →
    `lora_unet_input_blocks_4_1_proj_in`) because kohya trains SDXL on an sgm-named UNet. Text
    encoder names always carry `text_model`, which transformers >= 5.6 leaves out of CLIP-L
    module paths; without it ComfyUI recognises none of them (docs/formats.md, 'Adapter files:
    kohya/LyCORIS', 'Module names').
    """
    if component not in PREFIXES:
        raise ValueError(f"unknown component {component!r}; expected one of {', '.join(PREFIXES)}")
    if component == "unet":
        path = unet_sgm_key(module_path + ".weight", unet_config).removesuffix(".weight")
    else:
        path = "text_model." + module_path.removeprefix("text_model.")
    return PREFIXES[component] + path.replace(".", "_")


def save_kohya_adapter(
    path: str | os.PathLike[str], components: dict[str, torch.nn.Module], metadata: Mapping[str, str]
) -> Path:
    """Write the peft adapters of `components` (unet/text_encoder/text_encoder_2 → module) as one
    kohya/LyCORIS `.safetensors` file, atomically. `metadata` is added to the `ss_*` and
    `modelspec.*` keys computed here and wins over them."""
    from safetensors.torch import save_file

    unet_config = components["unet"].config if "unet" in components else {}
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for component, module in components.items():
        layer_tensors = LAYER_TENSORS[kind_of_peft_config(module.peft_config[ADAPTER]).algorithm]
        for module_path, layer in adapter_layers(module):
            name = kohya_module_name(component, module_path, unet_config)
            tensors.update({key: tensor.detach().float().cpu().contiguous()
                            for key, tensor in layer_tensors(name, layer).items()})
            layers.append(layer)
    if not layers:
        raise ValueError("no adapter layers to save")
    destination = Path(path)
    file_metadata = {**_metadata(next(iter(components.values())), layers, destination.stem), **metadata}
    with atomic_path(destination) as tmp:
        save_file(tensors, str(tmp), metadata=file_metadata)
    return destination


def adapter_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """(module path, peft adapter layer: LoRA, LoKr or LoHa) of every adapted layer of `module`."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, layer) for name, layer in module.named_modules() if isinstance(layer, BaseTunerLayer)]


def _scalar(value: float) -> torch.Tensor:
    import torch

    return torch.tensor(float(value))


def _lokr_tensors(name: str, layer: Any) -> dict[str, torch.Tensor]:
    """peft's factors under LyCORIS's names; alpha/r folded into a full `lokr_w2` where nothing
    is decomposed (the loaders then apply no scale)."""
    if layer.lokr_t2:
        raise ValueError(f"{name}: LoKr's Tucker-decomposed convolutions (use_effective_conv2d) are not exported")
    tensors = {f"{name}.{part}": getattr(layer, part)[ADAPTER] for part in
               ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
               if ADAPTER in getattr(layer, part)}
    if ADAPTER in layer.lokr_w1 and ADAPTER in layer.lokr_w2:
        tensors[f"{name}.lokr_w2"] = tensors[f"{name}.lokr_w2"] * layer.scaling[ADAPTER]
        tensors[f"{name}.alpha"] = _scalar(1.0)
    else:
        tensors[f"{name}.alpha"] = _scalar(layer.alpha[ADAPTER])
    return tensors


def _loha_tensors(name: str, layer: Any) -> dict[str, torch.Tensor]:
    tensors = {f"{name}.{part}": getattr(layer, part)[ADAPTER]
               for part in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}
    tensors[f"{name}.alpha"] = _scalar(layer.alpha[ADAPTER])
    return tensors


def _lora_tensors(name: str, layer: Any) -> dict[str, torch.Tensor]:
    import torch

    tensors = {
        f"{name}.lora_down.weight": layer.lora_A[ADAPTER].weight,
        f"{name}.lora_up.weight": layer.lora_B[ADAPTER].weight,
        f"{name}.alpha": torch.tensor(float(layer.lora_alpha[ADAPTER])),
    }
    if layer.use_dora[ADAPTER]:
        # peft stores [out] (Linear) or [1, out, 1, 1] (Conv2d). The loaders take the axis from the
        # shape: [out, 1] / [out, 1, 1, 1] is the output axis; a 1-D scale breaks ComfyUI. (The up
        # matrix has the base weight's layout; a quantized base weight may be stored packed.)
        up = layer.lora_B[ADAPTER].weight
        magnitude = layer.lora_magnitude_vector[ADAPTER].weight
        tensors[f"{name}.dora_scale"] = magnitude.reshape(up.shape[0], *[1] * (up.dim() - 1))
    return tensors


# The genuinely new code of each algorithm (adapter_kinds.AdapterKind.algorithm): its peft layer's
# tensors under their kohya/LyCORIS names.
LAYER_TENSORS = {"lora": _lora_tensors, "lokr": _lokr_tensors, "loha": _loha_tensors}


def _metadata(module: torch.nn.Module, layers: list[Any], title: str) -> dict[str, str]:
    """kohya's `ss_*` keys (A1111 reads `ss_base_model_version` to file the LoRA under SDXL) and
    modelspec, all strings. DoRA (with its output axis), LoKr and LoHa are declared as LyCORIS's."""
    import torch

    config = module.peft_config[ADAPTER]
    kind = kind_of_peft_config(config)
    alpha = getattr(config, kind.alpha_field)
    network_args = kind.kohya_network_args(config)
    convs = [layer for layer in layers if isinstance(layer.get_base_layer(), torch.nn.Conv2d)]
    if convs:
        # the most common: convolutions may keep ranks of their own (adapter.init_from, peft's rank_pattern)
        conv_rank, conv_alpha = collections.Counter((layer.r[ADAPTER], getattr(layer, kind.alpha_field)[ADAPTER])
                                                    for layer in convs).most_common(1)[0][0]
        network_args["conv_dim"], network_args["conv_alpha"] = str(conv_rank), f"{conv_alpha:g}"
    metadata = {
        "ss_network_module": "lycoris.kohya" if network_args.get("algo") else "networks.lora",
        "ss_network_dim": str(config.r),
        "ss_network_alpha": f"{alpha:g}",
        "ss_base_model_version": "sdxl_base_v1-0",
        "ss_v2": "False",
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "stable-diffusion-xl-v1-base/lora",
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.title": title,
        "modelspec.date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if network_args:
        metadata["ss_network_args"] = json.dumps(network_args)
    return metadata


def merged_weight(
    base_weight: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    alpha: float | torch.Tensor,
    dora_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight one module of a kohya file stands for, at strength 1.

    LoRA: W + (alpha/r)·up@down. DoRA: V·(dora_scale/‖V‖_row) with V = W + ΔW, the output-axis
    formula of peft and LyCORIS >= 3.2 (LyCORIS adds 1.2e-7 to the norm, peft does not; this
    follows peft). Current ComfyUI divides by ‖W‖_row instead (docs/formats.md, 'DoRA').
    """
    rank = down.shape[0]
    delta = (up.flatten(1) @ down.flatten(1)).reshape(base_weight.shape) * (float(alpha) / rank)
    merged = base_weight + delta
    if dora_scale is None:
        return merged
    out = base_weight.shape[0]
    if dora_scale.shape != (out, *[1] * (base_weight.dim() - 1)):
        raise ValueError(
            f"dora_scale has shape {list(dora_scale.shape)}; the output axis needs "
            f"{[out, *[1] * (base_weight.dim() - 1)]} for a weight of shape {list(base_weight.shape)}"
        )
    norm = merged.flatten(1).norm(dim=1).reshape(dora_scale.shape)
    return merged * (dora_scale / norm)

