"""DoRA / LoRA / LoKr / LoHa adapters through peft: which modules get them, attaching, and saving
them in the diffusers/peft format that `pipe.load_lora_weights` loads exactly (docs/formats.md,
'Adapter files: diffusers/peft'). diffusers loads no LoKr or LoHa adapter, so theirs is written
under another name (adapter_kinds.PEFT_WEIGHT_NAME) in the same layout, for peft (and resuming) to load."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .adapter_kinds import ADAPTER_KINDS, DIFFUSERS_WEIGHT_NAME, kind_of_peft_config
from .atomic import FILE_MODE, reported_write_failures
from .config import AdapterConfig

if TYPE_CHECKING:
    import torch

ATTENTION_PROJECTIONS = re.compile(r".*attentions\.\d+\.transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)")
TRANSFORMER_LINEARS = re.compile(r".*attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\..+)")
RESNET_AND_SAMPLERS = re.compile(
    r".*(resnets\.\d+\.(conv1|conv2|conv_shortcut|time_emb_proj)|downsamplers\.0\.conv|upsamplers\.0\.conv)"
)
TEXT_ATTENTION = re.compile(r".*self_attn\.(q_proj|k_proj|v_proj|out_proj)")
TEXT_MLP = re.compile(r".*mlp\.(fc1|fc2)")


def weight_file_name(adapter_type: str) -> str:
    """The adapter file of a run (and of each checkpoint): diffusers' name where diffusers loads it."""
    return ADAPTER_KINDS[adapter_type].weight_file


def unet_target_modules(unet: torch.nn.Module, targets: str | list[str]) -> list[str]:
    """Names of the UNet's Linear/Conv2d modules selected by `adapter.targets`."""
    import torch

    chosen = []
    for name, module in unet.named_modules():
        if not isinstance(module, torch.nn.Linear | torch.nn.Conv2d):
            continue
        if isinstance(targets, list):
            selected = any(re.fullmatch(pattern, name) for pattern in targets)
        elif targets == "attn":
            selected = bool(ATTENTION_PROJECTIONS.fullmatch(name))
        else:
            selected = bool(TRANSFORMER_LINEARS.fullmatch(name)) and isinstance(module, torch.nn.Linear)
            if targets == "all":
                selected = selected or bool(RESNET_AND_SAMPLERS.fullmatch(name))
        if selected:
            chosen.append(name)
    return chosen


def text_encoder_target_modules(text_encoder: torch.nn.Module, targets: str | list[str]) -> list[str]:
    """Attention projections, plus the MLP for `attn-mlp`/`all` (the usual kohya TE target set)."""
    import torch

    with_mlp = targets != "attn"
    return [
        name
        for name, module in text_encoder.named_modules()
        if isinstance(module, torch.nn.Linear)
        and (TEXT_ATTENTION.fullmatch(name) or (with_mlp and TEXT_MLP.fullmatch(name)))
    ]


# component → peft's "rank_pattern" and "alpha_pattern" (module-name pattern → value) for modules
# whose rank or alpha is not the config's: those of a file of several ranks (`adapter.init_from`).
Patterns = dict[str, dict[str, dict[str, float]]]
PATTERN_FIELDS = ("rank_pattern", "alpha_pattern")


def peft_config(adapter: AdapterConfig, module: torch.nn.Module, names: list[str],
                patterns: dict[str, dict[str, float]] | None = None):
    """The peft config of the kind (`AdapterKind.peft_config`: LoraConfig, LoKrConfig, LoHaConfig)
    for exactly these modules, with conv rank/alpha where configured and the modules' own ranks and
    alphas of `patterns` (this component's). Every kind starts as a no-op (one factor zero), as LoRA does."""
    import peft
    import torch

    kind = ADAPTER_KINDS[adapter.type]
    convs = [name for name in names if isinstance(module.get_submodule(name), torch.nn.Conv2d)]
    rank_pattern = {re.escape(name): adapter.conv_rank for name in convs} if adapter.conv_rank else {}
    alpha_pattern = {re.escape(name): adapter.conv_alpha for name in convs} if adapter.conv_alpha else {}
    patterns = patterns or {}
    return getattr(peft, kind.peft_config)(
        r=adapter.rank, target_modules=names, rank_pattern=rank_pattern | patterns.get("rank_pattern", {}),
        alpha_pattern=alpha_pattern | patterns.get("alpha_pattern", {}),
        **{kind.alpha_field: adapter.alpha}, **kind.peft_options(adapter))


def attach_adapter(module: torch.nn.Module, adapter: AdapterConfig, names: list[str],
                   patterns: dict[str, dict[str, float]] | None = None) -> None:
    """Add a peft adapter to `module` (a diffusers UNet or a transformers CLIP encoder); DoRA layers
    get the faster forward of the same function (fast_dora.py)."""
    from .fast_dora import use_fast_dora

    if not names:
        raise ValueError("adapter.targets selects no module")
    module.add_adapter(peft_config(adapter, module, names, patterns))
    use_fast_dora(module)


def adapter_state_dict(module: torch.nn.Module, component: str) -> dict[str, torch.Tensor]:
    """The adapter tensors of one component under the key names diffusers loads exactly.

    Two verified pitfalls (docs/formats.md, 'Adapter files: diffusers/peft'): CLIP-L keys must keep
    the `text_model.` prefix that transformers >= 5.6 no longer puts in state dicts, and DoRA
    magnitudes load into the text encoders only when spelled `lora_magnitude_vector.weight`.
    """
    from peft import get_peft_model_state_dict

    return {
        file_key(key, component): tensor.detach().float().cpu().contiguous()
        for key, tensor in get_peft_model_state_dict(module).items()
    }


def file_key(peft_key: str, component: str) -> str:
    """The name a peft adapter tensor gets in the diffusers file (below its component prefix)."""
    if component != "unet" and not peft_key.startswith("text_model."):
        peft_key = "text_model." + peft_key
    if peft_key.endswith("lora_magnitude_vector"):
        peft_key += ".weight"
    return peft_key


def load_adapter_weights(module: torch.nn.Module, component: str, tensors: dict[str, torch.Tensor]) -> None:
    """Put the tensors of a saved `pytorch_lora_weights.safetensors` back into the adapter
    attached to `module` (resuming); every adapter tensor must be in the file, exactly."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    state = {}
    for key, current in get_peft_model_state_dict(module).items():
        name = f"{component}.{file_key(key, component)}"
        if name not in tensors:
            raise ValueError(f"the adapter file has no {name}: it was trained with other targets")
        if tensors[name].shape != current.shape:
            raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}, the adapter {tuple(current.shape)}")
        state[key] = tensors[name].to(current.dtype)
    result = set_peft_model_state_dict(module, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"unexpected adapter keys: {result.unexpected_keys[:3]}")


def adapter_metadata(module: torch.nn.Module) -> dict[str, Any]:
    """The peft LoraConfig as a dict: diffusers stores it so alpha survives the round trip."""
    config = module.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    return config


def save_diffusers_adapter(output_dir: str | os.PathLike[str], components: dict[str, torch.nn.Module]) -> Path:
    """Write `pytorch_lora_weights.safetensors` (+ `lora_adapter_metadata`) atomically for the
    components that carry an adapter; `components` maps unet/text_encoder/text_encoder_2 to modules.
    Kinds diffusers does not load (LoKr, LoHa) go to their `AdapterKind.weight_file` instead, the same layout."""
    from diffusers import StableDiffusionXLPipeline

    layers = {f"{name}_lora_layers": adapter_state_dict(module, name) for name, module in components.items()}
    metadata = {f"{name}_lora_adapter_metadata": adapter_metadata(module) for name, module in components.items()}
    kind = kind_of_peft_config(next(iter(components.values())).peft_config["default"])
    destination = Path(output_dir) / kind.weight_file
    destination.parent.mkdir(parents=True, exist_ok=True)
    with (reported_write_failures(destination),
          tempfile.TemporaryDirectory(prefix=".lora-", dir=destination.parent) as tmp):
        StableDiffusionXLPipeline.save_lora_weights(
            tmp, weight_name=DIFFUSERS_WEIGHT_NAME, safe_serialization=True, **layers, **metadata
        )
        os.chmod(Path(tmp) / DIFFUSERS_WEIGHT_NAME, FILE_MODE)  # as any other output, not private
        os.replace(Path(tmp) / DIFFUSERS_WEIGHT_NAME, destination)
    return destination
