"""The SDXL single-file ("sgm") key map: diffusers/transformers state-dict keys → Stability keys.

ComfyUI, A1111-family UIs and diffusers' `from_single_file` load SDXL as one file in the layout of
Stability's `sgm` code. This module turns the four state dicts of a diffusers pipeline (UNet, VAE,
CLIP-L text encoder, OpenCLIP-bigG text encoder) into that layout, as docs/formats.md,
'Single-file checkpoints (SGM keys)' describes it.

The map is a *plan*: a list of output tensors, each with its sgm key, the source keys it is built
from, the transform and the resulting shape and dtype. A plan is computed from tensor shapes and
dtypes alone (a safetensors header, or a model on the `meta` device), so a writer can emit the
file header before reading any data, and tests can check full-size SDXL without its weights.

Block numbering is derived from the models' configs (number of blocks, layers per block, which
blocks have attention or samplers), not hard-coded to SDXL's sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
# transformers ≥ 5.6 saves CLIPTextModel without `text_model.`; the sgm key needs it, or diffusers
# refuses the file and ComfyUI drops CLIP-L (docs/formats.md, 'Single-file checkpoints (SGM keys)').
TE1_PREFIX = "conditioner.embedders.0.transformer.text_model."
TE2_PREFIX = "conditioner.embedders.1.model."

POSITION_IDS_KEY = TE1_PREFIX + "embeddings.position_ids"
LOGIT_SCALE_KEY = TE2_PREFIX + "logit_scale"
# ComfyUI's markers for a v-prediction (and zero-terminal-SNR) model: empty tensors, presence is all.
V_PRED_KEY = "v_pred"
ZTSNR_KEY = "ztsnr"

# ln(100), CLIP's clamped temperature, as sd_xl_base_1.0 stores it (fp16 rounding: 4.6055). The
# same value in every file dtype, so fp16 and fp32 exports agree. No loader uses it for inference.
LOGIT_SCALE = 4.60546875

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})

# Inside a UNet resnet the sgm names differ; every sub-module must be in this table.
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
_VAE_RESNET = {
    "norm1": "norm1",
    "conv1": "conv1",
    "norm2": "norm2",
    "conv2": "conv2",
    "conv_shortcut": "nin_shortcut",
}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
# sgm builds these VAE attention projections as 1×1 convolutions: their weights are 4-D.
_VAE_CONV_ATTENTION_WEIGHTS = ("q.weight", "k.weight", "v.weight", "proj_out.weight")

# CLIP (transformers) → OpenCLIP (sgm) names for the second text encoder, outside the q/k/v fusion.
_TE2_TOP = {
    "embeddings.token_embedding.weight": "token_embedding.weight",
    "embeddings.position_embedding.weight": "positional_embedding",
    "final_layer_norm.weight": "ln_final.weight",
    "final_layer_norm.bias": "ln_final.bias",
}
_TE2_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}
_CLIP_LAYER_MODULES = (*_TE2_LAYER, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


class KeyMapError(ValueError):
    """The weights or configs do not fit the SDXL single-file layout (unknown key, wrong shape)."""


@dataclass(frozen=True)
class TensorInfo:
    """Shape and safetensors dtype name ("F32", "F16", "BF16", "I64", ...) of one source tensor."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class PlanEntry:
    """One tensor of the output file and how to build it.

    transform: "copy", "reshape4d" (append two 1-sized dims), "transpose" (2-D), "concat" (along
    dim 0, sources in order), or for constants without sources "arange" (0…n-1) and "full" (`value`).
    """

    key: str
    component: str | None
    sources: tuple[str, ...]
    transform: str
    shape: tuple[int, ...]
    dtype: str
    value: float = 0.0


def build_plan(
    sources: Mapping[str, Mapping[str, TensorInfo]],
    unet_config: Mapping[str, Any],
    vae_config: Mapping[str, Any],
    *,
    half: bool = False,
    v_prediction: bool = False,
    zero_terminal_snr: bool = False,
) -> list[PlanEntry]:
    """The complete list of output tensors for one SDXL pipeline.

    `sources` maps each of COMPONENTS to its state-dict keys with shapes and dtypes. `half` casts
    floating tensors to fp16. The optional `position_ids` and `logit_scale` are always included,
    as in sd_xl_base_1.0 and ComfyUI's saves. `v_prediction`/`zero_terminal_snr` add ComfyUI's
    markers.
    Raises KeyMapError for a key that has no sgm name, or a config that does not match the weights.
    """
    missing = [name for name in COMPONENTS if name not in sources]
    if missing:
        raise KeyMapError(f"missing components: {', '.join(missing)}")
    rules = {
        "unet": (UNET_PREFIX, _unet_rules(sources["unet"], unet_config)),
        "vae": (VAE_PREFIX, _vae_rules(sources["vae"], vae_config)),
        "text_encoder": (TE1_PREFIX, _te1_rules(sources["text_encoder"])),
        "text_encoder_2": (TE2_PREFIX, _te2_rules(sources["text_encoder_2"])),
    }
    plan: list[PlanEntry] = []
    for component, (prefix, component_rules) in rules.items():
        for name, (source_keys, transform) in sorted(component_rules.items()):
            plan.append(_entry(prefix + name, component, source_keys, transform, sources[component], half))
    by_key = {entry.key: entry for entry in plan}
    positions = by_key[TE1_PREFIX + "embeddings.position_embedding.weight"].shape[0]
    plan.append(PlanEntry(POSITION_IDS_KEY, None, (), "arange", (1, positions), "I64"))
    te2_dtype = by_key[TE2_PREFIX + "token_embedding.weight"].dtype
    plan.append(PlanEntry(LOGIT_SCALE_KEY, None, (), "full", (), te2_dtype, LOGIT_SCALE))
    if v_prediction:
        plan.append(PlanEntry(V_PRED_KEY, None, (), "full", (0,), "F32"))
        if zero_terminal_snr:
            plan.append(PlanEntry(ZTSNR_KEY, None, (), "full", (0,), "F32"))
    return plan


def build_tensor(entry: PlanEntry, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Build one output tensor from its source tensors (in `entry.sources` order), contiguous and
    in the entry's dtype."""
    import torch

    from .safetensors_stream import TORCH_DTYPES

    dtype = TORCH_DTYPES[entry.dtype]
    if entry.transform == "arange":
        return torch.arange(entry.shape[-1], dtype=dtype).reshape(entry.shape)
    if entry.transform == "full":
        return torch.full(entry.shape, entry.value, dtype=dtype)
    if entry.transform == "concat":
        result = torch.cat(list(tensors))
    elif entry.transform == "transpose":
        result = tensors[0].t()
    else:  # "copy" and "reshape4d"
        result = tensors[0].reshape(entry.shape)
    return result.to(dtype).contiguous()


def _entry(
    key: str,
    component: str,
    source_keys: tuple[str, ...],
    transform: str,
    infos: Mapping[str, TensorInfo],
    half: bool,
) -> PlanEntry:
    parts = [infos[name] for name in source_keys]
    first = parts[0]
    if transform in ("reshape4d", "transpose") and len(first.shape) != 2:
        raise KeyMapError(f"{component}: {source_keys[0]} should be 2-D, has shape {list(first.shape)}")
    if transform == "reshape4d":
        shape = (*first.shape, 1, 1)
    elif transform == "transpose":
        shape = first.shape[::-1]
    elif transform == "concat":
        if any(p.shape[1:] != first.shape[1:] or p.dtype != first.dtype for p in parts):
            found = ", ".join(
                f"{name} {list(p.shape)} {p.dtype}" for name, p in zip(source_keys, parts, strict=True)
            )
            raise KeyMapError(f"{component}: cannot concatenate {found}")
        shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    else:
        shape = first.shape
    dtype = "F16" if half and first.dtype in FLOAT_DTYPES else first.dtype
    return PlanEntry(key, component, source_keys, transform, tuple(shape), dtype)


def unet_sgm_key(key: str, unet_config: Mapping[str, Any]) -> str:
    """The sgm key of one diffusers UNet key, e.g. `down_blocks.1.resnets.0.conv1.weight` →
    `input_blocks.4.0.in_layers.2.weight`. kohya LoRA files name UNet modules this way.
    Raises KeyMapError for a key outside the SDXL layout."""
    return _map_key("unet", key, _unet_blocks(unet_config))[1]


# --- block tables ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Block:
    """Where one diffusers module goes: its sgm prefix and, for resnets and VAE attention, the
    renames of its sub-modules (None: sub-module names are the same on both sides)."""

    sgm_prefix: str
    renames: Mapping[str, str] | None = None


def _per_block(value: int | Sequence[int], count: int) -> list[int]:
    return [value] * count if isinstance(value, int) else list(value)


def _unet_blocks(config: Mapping[str, Any]) -> dict[str, _Block]:
    """diffusers module prefix → sgm module prefix for every module of this UNet's topology.

    sgm numbers its blocks consecutively: input_blocks.0 is conv_in, then per down level one entry
    per layer (resnet `.0`, attention `.1`) and one for the downsampler (`.0.op`) unless it is the
    last level; output_blocks have one entry per up layer, the upsampler sits in the level's last
    entry after the resnet (and the attention, if any).
    """
    down_types = list(config["down_block_types"])
    up_types = list(config["up_block_types"])
    if config.get("addition_embed_type") != "text_time":
        raise KeyMapError("unet: not an SDXL UNet (addition_embed_type is not 'text_time')")
    if config.get("mid_block_type", "UNetMidBlock2DCrossAttn") != "UNetMidBlock2DCrossAttn":
        raise KeyMapError(f"unet: mid_block_type {config['mid_block_type']!r} is not SDXL's")
    for block_type in down_types:
        if block_type not in ("DownBlock2D", "CrossAttnDownBlock2D"):
            raise KeyMapError(f"unet: down block type {block_type!r} is not used by SDXL")
    for block_type in up_types:
        if block_type not in ("UpBlock2D", "CrossAttnUpBlock2D"):
            raise KeyMapError(f"unet: up block type {block_type!r} is not used by SDXL")
    if len(up_types) != len(down_types):
        raise KeyMapError("unet: config.json has different numbers of down and up blocks")
    layers = _per_block(config["layers_per_block"], len(down_types))

    blocks = {
        "conv_in.": _Block("input_blocks.0.0."),
        "time_embedding.linear_1.": _Block("time_embed.0."),
        "time_embedding.linear_2.": _Block("time_embed.2."),
        "add_embedding.linear_1.": _Block("label_emb.0.0."),
        "add_embedding.linear_2.": _Block("label_emb.0.2."),
        "mid_block.resnets.0.": _Block("middle_block.0.", _UNET_RESNET),
        "mid_block.attentions.0.": _Block("middle_block.1."),
        "mid_block.resnets.1.": _Block("middle_block.2.", _UNET_RESNET),
        "conv_norm_out.": _Block("out.0."),
        "conv_out.": _Block("out.2."),
    }
    index = 1
    for i, block_type in enumerate(down_types):
        for j in range(layers[i]):
            blocks[f"down_blocks.{i}.resnets.{j}."] = _Block(f"input_blocks.{index}.0.", _UNET_RESNET)
            if block_type.startswith("CrossAttn"):
                blocks[f"down_blocks.{i}.attentions.{j}."] = _Block(f"input_blocks.{index}.1.")
            index += 1
        if i < len(down_types) - 1:
            blocks[f"down_blocks.{i}.downsamplers.0.conv."] = _Block(f"input_blocks.{index}.0.op.")
            index += 1

    index = 0
    for i, (block_type, block_layers) in enumerate(zip(up_types, reversed(layers), strict=True)):
        has_attention = block_type.startswith("CrossAttn")
        for j in range(block_layers + 1):  # an up level has one layer more than its down level
            blocks[f"up_blocks.{i}.resnets.{j}."] = _Block(f"output_blocks.{index}.0.", _UNET_RESNET)
            if has_attention:
                blocks[f"up_blocks.{i}.attentions.{j}."] = _Block(f"output_blocks.{index}.1.")
            index += 1
        if i < len(up_types) - 1:
            slot = 2 if has_attention else 1
            blocks[f"up_blocks.{i}.upsamplers.0."] = _Block(f"output_blocks.{index - 1}.{slot}.")
    return blocks


def _vae_blocks(config: Mapping[str, Any]) -> dict[str, _Block]:
    """diffusers module prefix → sgm module prefix for every module of this VAE's topology.

    sgm numbers decoder levels from the lowest resolution up, diffusers from the top down, so the
    decoder level index is reversed.
    """
    levels = len(config["block_out_channels"])
    layers = config["layers_per_block"]
    blocks = {
        "encoder.conv_in.": _Block("encoder.conv_in."),
        "encoder.conv_norm_out.": _Block("encoder.norm_out."),
        "encoder.conv_out.": _Block("encoder.conv_out."),
        "decoder.conv_in.": _Block("decoder.conv_in."),
        "decoder.conv_norm_out.": _Block("decoder.norm_out."),
        "decoder.conv_out.": _Block("decoder.conv_out."),
    }
    if config.get("use_quant_conv", True):
        blocks["quant_conv."] = _Block("quant_conv.")
    if config.get("use_post_quant_conv", True):
        blocks["post_quant_conv."] = _Block("post_quant_conv.")
    for part in ("encoder", "decoder"):
        for k in range(2):
            blocks[f"{part}.mid_block.resnets.{k}."] = _Block(f"{part}.mid.block_{k + 1}.", _VAE_RESNET)
        if config.get("mid_block_add_attention", True):
            blocks[f"{part}.mid_block.attentions.0."] = _Block(f"{part}.mid.attn_1.", _VAE_ATTENTION)
    for i in range(levels):
        for j in range(layers):
            blocks[f"encoder.down_blocks.{i}.resnets.{j}."] = _Block(
                f"encoder.down.{i}.block.{j}.", _VAE_RESNET
            )
        if i < levels - 1:
            blocks[f"encoder.down_blocks.{i}.downsamplers.0."] = _Block(f"encoder.down.{i}.downsample.")
        level = levels - 1 - i
        for j in range(layers + 1):
            blocks[f"decoder.up_blocks.{i}.resnets.{j}."] = _Block(
                f"decoder.up.{level}.block.{j}.", _VAE_RESNET
            )
        if i < levels - 1:
            blocks[f"decoder.up_blocks.{i}.upsamplers.0."] = _Block(f"decoder.up.{level}.upsample.")
    return blocks


def _map_by_blocks(component: str, keys: Sequence[str], blocks: Mapping[str, _Block]) -> dict[str, str]:
    """Map every key through the block table; every key must fit and every block must be used
    (a block without tensors means the config does not describe these weights)."""
    mapped: dict[str, str] = {}
    used: set[str] = set()
    for key in keys:
        prefix, mapped[key] = _map_key(component, key, blocks)
        used.add(prefix)
    unused = [prefix for prefix in blocks if prefix not in used]
    if unused:
        raise KeyMapError(
            f"{component}: its config.json describes {unused[0].rstrip('.')} but the weights have no such "
            f"tensors ({len(unused)} modules missing)"
        )
    return mapped


def _map_key(component: str, key: str, blocks: Mapping[str, _Block]) -> tuple[str, str]:
    """(the block prefix that holds `key`, its sgm key)."""
    parts = key.split(".")
    prefix = next((p for p in (".".join(parts[:n]) + "." for n in range(1, len(parts))) if p in blocks), None)
    if prefix is None:
        raise KeyMapError(f"{component}: {key} has no place in the SDXL single-file layout")
    block = blocks[prefix]
    rest = key[len(prefix):]
    if block.renames is not None:
        rest = _rename_head(component, key, rest, block.renames)
    return prefix, block.sgm_prefix + rest


def _rename_head(component: str, key: str, rest: str, renames: Mapping[str, str]) -> str:
    for old, new in renames.items():
        if rest.startswith(old + "."):
            return new + rest[len(old):]
    raise KeyMapError(f"{component}: {key} has no place in the SDXL single-file layout")


# sgm key (without prefix) → (source keys, transform). The block tables give every module its own
# sgm prefix, so no two source keys can meet at one sgm key.
Rules = dict[str, tuple[tuple[str, ...], str]]


def _unet_rules(infos: Mapping[str, TensorInfo], config: Mapping[str, Any]) -> Rules:
    mapped = _map_by_blocks("unet", list(infos), _unet_blocks(config))
    return {sgm: ((key,), "copy") for key, sgm in mapped.items()}


def _vae_rules(infos: Mapping[str, TensorInfo], config: Mapping[str, Any]) -> Rules:
    rules: Rules = {}
    for key, sgm in _map_by_blocks("vae", list(infos), _vae_blocks(config)).items():
        is_conv_attention = ".mid.attn_1." in sgm and sgm.endswith(_VAE_CONV_ATTENTION_WEIGHTS)
        rules[sgm] = ((key,), "reshape4d" if is_conv_attention else "copy")
    return rules


def _clip_names(component: str, infos: Mapping[str, TensorInfo]) -> dict[str, str]:
    """CLIP tensor name (without `text_model.`, which transformers ≥ 5.6 drops for CLIPTextModel)
    → source key, checked to be exactly the set SDXL uses. Completeness matters: diffusers does
    not complain about a missing text-encoder tensor, it silently leaves it unloaded."""
    projection = ("text_projection.weight",) if component == "text_encoder_2" else ()
    names: dict[str, str] = {}
    for key in infos:
        name = key.removeprefix("text_model.")
        if name == "embeddings.position_ids":  # a constant buffer; the plan writes the canonical one
            continue
        parts = name.split(".")
        is_layer_tensor = (
            parts[:2] == ["encoder", "layers"]
            and len(parts) >= 5
            and parts[2].isdigit()
            and ".".join(parts[3:-1]) in _CLIP_LAYER_MODULES
            and parts[-1] in ("weight", "bias")
        )
        if not (is_layer_tensor or name in _TE2_TOP or name in projection):
            raise KeyMapError(f"{component}: {key} has no place in the SDXL single-file layout")
        if name in names:
            raise KeyMapError(f"{component}: {names[name]} and {key} are the same tensor")
        names[name] = key
    layers = 1 + max((int(n.split(".")[2]) for n in names if n.startswith("encoder.layers.")), default=-1)
    expected = {*_TE2_TOP, *projection} | {
        f"encoder.layers.{i}.{module}.{kind}"
        for i in range(layers)
        for module in _CLIP_LAYER_MODULES
        for kind in ("weight", "bias")
    }
    missing = sorted(expected - names.keys())
    if missing:
        raise KeyMapError(f"{component}: {len(missing)} tensor(s) missing, e.g. {missing[0]}")
    return names


def _te1_rules(infos: Mapping[str, TensorInfo]) -> Rules:
    """CLIP-L keeps transformers' names under its prefix."""
    return {name: ((key,), "copy") for name, key in _clip_names("text_encoder", infos).items()}


def _te2_rules(infos: Mapping[str, TensorInfo]) -> Rules:
    """OpenCLIP-bigG names: q/k/v fused into one in_proj (order q, k, v), text_projection stored
    transposed (OpenCLIP multiplies `x @ P`, transformers' Linear computes `x @ W.T`)."""
    rules: Rules = {}
    for name, key in _clip_names("text_encoder_2", infos).items():
        if name == "text_projection.weight":
            rules["text_projection"] = ((key,), "transpose")
        elif name in _TE2_TOP:
            rules[_TE2_TOP[name]] = ((key,), "copy")
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            resblock = f"transformer.resblocks.{layer}."
            if module in _TE2_LAYER:
                rules[f"{resblock}{_TE2_LAYER[module]}.{kind}"] = ((key,), "copy")
            elif module == "self_attn.q_proj":  # k and v join q's entry (all three are present)
                fused = tuple(key.replace(".q_proj.", f".{p}_proj.") for p in "qkv")
                rules[f"{resblock}attn.in_proj_{kind}"] = (fused, "concat")
    return rules
