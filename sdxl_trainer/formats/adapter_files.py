"""Adapter files, whichever tool wrote them: which format a file is, its modules read one at a
time, and merging one into a loaded pipeline (the trainer's own loader, for both formats).

- diffusers/peft (`pytorch_lora_weights.safetensors`): keys `<component>.<module>.lora_A.weight`,
  `.lora_B.weight` and, for DoRA, `.lora_magnitude_vector.weight` ([out] for Linear,
  [1, out, 1, 1] for Conv2d). Alpha lives only in the `lora_adapter_metadata` JSON; without it
  diffusers takes alpha = rank.
- kohya/LyCORIS (`<run>_kohya.safetensors`; ComfyUI, A1111): keys
  `lora_<unet|te1|te2>_<module path with _>.lora_down.weight`, `.lora_up.weight`, a 0-dim
  `.alpha` and, for DoRA, `.dora_scale` on the output axis ([out, 1], [out, 1, 1, 1]) or, from
  LyCORIS before 3.2, the input axis ([1, in], [1, in, 1, 1]).
- LyCORIS's LoKr (`.lokr_w1` or `.lokr_w1_a`/`_b`, `.lokr_w2` or `.lokr_w2_a`/`_b`) and LoHa
  (`.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`), with `.alpha`, under either kind of
  module name (peft's `peft_adapter_weights.safetensors` uses the same tensor names).

docs/formats.md has both in full ("Adapter files: diffusers/peft", "Adapter files: kohya/LyCORIS").

Each format's spellings are recognised in the other too, so a kohya file with leftover peft names
still reads; `canonical_key` is the spelling the format should use. Files are read tensor by
tensor, so a multi-GB adapter needs memory for about one module at a time.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..adapter_kinds import ALGORITHMS, DIFFUSERS_WEIGHT_NAME, WEIGHT_FILES, module_algorithm
from .kohya_format import PREFIXES, kohya_module_name
from .kohya_format import merged_weight as kohya_merged_weight
from .tensor_reader import TensorReader

if TYPE_CHECKING:
    import torch
    from diffusers import StableDiffusionXLPipeline

PEFT = "diffusers/peft"
KOHYA = "kohya/LyCORIS"
KOHYA_SUFFIX = "_kohya.safetensors"
COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
# kohya prefix → component; `lora_te_` is the single text encoder of SD 1.x files.
KOHYA_PREFIXES = {**{prefix: component for component, prefix in PREFIXES.items()}, "lora_te_": "text_encoder"}
# Key suffix → the role of the tensor in its module, in both formats' spellings.
ROLES = {
    ".lora_down.weight": "down", ".lora_A.weight": "down",
    ".lora_up.weight": "up", ".lora_B.weight": "up",
    ".alpha": "alpha",
    ".dora_scale": "magnitude", ".lora_magnitude_vector.weight": "magnitude", ".lora_magnitude_vector": "magnitude",
}
# LyCORIS's algorithms name their factors alike in both formats (adapter_kinds: `file_roles`).
_LYCORIS_ROLES = [role for name, kind in ALGORITHMS.items() if name != "lora" for role in kind.file_roles]
_LYCORIS_SUFFIXES = {role: f".{role}" for role in _LYCORIS_ROLES}
ROLES |= {suffix: role for role, suffix in _LYCORIS_SUFFIXES.items()}
CANONICAL_SUFFIXES = {
    PEFT: {"down": ".lora_A.weight", "up": ".lora_B.weight", "alpha": ".alpha",
           "magnitude": ".lora_magnitude_vector.weight", **_LYCORIS_SUFFIXES},
    KOHYA: {"down": ".lora_down.weight", "up": ".lora_up.weight", "alpha": ".alpha", "magnitude": ".dora_scale",
            **_LYCORIS_SUFFIXES},
}


class AdapterFileError(ValueError):
    """The path is not a readable adapter file (or folder holding one); the message says why."""


@dataclass
class AdapterModule:
    """One adapted layer as stored: LoRA factors, alpha and (DoRA) magnitude, with their keys."""

    file_name: str  # the module's name in the file, in the format's spelling
    file_format: str  # PEFT or KOHYA
    component: str  # unet, text_encoder or text_encoder_2
    name: str | None  # module path in diffusers naming (`text_model.` kept for the text encoders)
    tensors: dict[str, torch.Tensor]  # role (down, up, alpha, magnitude) → tensor
    keys: dict[str, str]  # role → key in the file
    alpha: float  # the effective alpha: every format's scale is alpha / rank
    config_rank: int | None = None  # peft's r for a peft-format LoKr module, whose scale is alpha/r always

    @property
    def label(self) -> str:
        return f"{self.component}.{self.name}" if self.name else self.file_name

    @property
    def down(self) -> torch.Tensor:
        return self.tensors["down"]

    @property
    def up(self) -> torch.Tensor:
        return self.tensors["up"]

    @property
    def magnitude(self) -> torch.Tensor | None:
        return self.tensors.get("magnitude")

    @property
    def algorithm(self) -> str:
        """lora (DoRA included), lokr or loha, from the tensors' roles."""
        return module_algorithm(self.tensors)

    @property
    def factor_roles(self) -> list[str]:
        """The roles of the tensors whose product is the update (all but alpha and magnitude)."""
        return [role for role in self.tensors if role not in ("alpha", "magnitude")]

    @property
    def rank(self) -> int | None:
        """LoRA's and LoHa's inner dimension; LoKr's where a factor is decomposed, else None
        (the loaders then use scale 1)."""
        if self.algorithm == "lora":
            return self.down.shape[0]
        if self.algorithm == "loha":
            inner = self.tensors.get("hada_w1_b")
            return None if inner is None else inner.shape[0]
        if self.config_rank is not None:
            return self.config_rank
        decomposed = self.tensors.get("lokr_w1_b", self.tensors.get("lokr_w2_b"))
        return None if decomposed is None else decomposed.shape[0]

    @property
    def scale(self) -> float:
        return 1.0 if self.rank is None else self.alpha / self.rank

    @property
    def out_features(self) -> int:
        if self.algorithm == "lora":
            return self.up.shape[0]
        return self.flat_delta().shape[0]

    @property
    def in_features(self) -> int:
        return self.down.shape[1] if self.algorithm == "lora" else self.flat_delta()[0].numel()

    def flat_delta(self) -> torch.Tensor:
        """The update as [out, in·kernel] without the scale, in fp32."""
        import torch

        factors = {role: tensor.float() for role, tensor in self.tensors.items()}
        if self.algorithm == "lora":
            return factors["up"].flatten(1) @ factors["down"].flatten(1)
        if self.algorithm == "loha":
            if "hada_t1" in factors:
                raise AdapterFileError(f"{self.label}: LoHa with Tucker factors (hada_t1) is not supported")
            return ((factors["hada_w1_a"] @ factors["hada_w1_b"]) * (factors["hada_w2_a"] @ factors["hada_w2_b"]))
        if "lokr_t2" in factors:
            raise AdapterFileError(f"{self.label}: LoKr with a Tucker factor (lokr_t2) is not supported")
        w1 = factors["lokr_w1"] if "lokr_w1" in factors else factors["lokr_w1_a"] @ factors["lokr_w1_b"]
        w2 = factors["lokr_w2"] if "lokr_w2" in factors else factors["lokr_w2_a"] @ factors["lokr_w2_b"]
        if w2.dim() == 4:  # a full convolution factor: [b, d, kh, kw] with the kernel last
            w1 = w1[:, :, None, None]
        kron = torch.kron(w1, w2)
        return kron.reshape(kron.shape[0], -1)

    def delta(self, shape: tuple[int, ...] | torch.Size | None = None) -> torch.Tensor:
        """ΔW = scale·(the factors' product) in fp32, shaped like the layer's weight: `shape`, or
        the shape the factors give (LoRA's weight shape; LoKr's and LoHa's [out, in·kernel])."""
        flat = self.flat_delta()
        if shape is None:
            shape = (self.out_features, *self.down.shape[1:]) if self.algorithm == "lora" else flat.shape
        return (flat * self.scale).reshape(shape)

    @property
    def is_conv(self) -> bool:
        """Whether the adapted layer is a convolution: LoRA's factors are 4-D then; LoKr's or LoHa's
        (whose factors may be flattened) a 4-D factor or DoRA magnitude tells."""
        if self.algorithm == "lora":
            return self.down.dim() == 4
        return any(tensor.dim() == 4 for tensor in self.tensors.values())

    def output_magnitude_shape(self) -> tuple[int, ...]:
        """The shape this format stores an output-axis DoRA magnitude in: peft [out] or [1, out, 1, 1],
        kohya/LyCORIS [out, 1] or [out, 1, 1, 1]."""
        out = self.out_features
        if self.file_format == PEFT:
            return (1, out, 1, 1) if self.is_conv else (out,)
        return (out, 1, 1, 1) if self.is_conv else (out, 1)

    def magnitude_layout(self) -> tuple[str, tuple[int, ...]] | None:
        """The axis of the DoRA magnitude ("output": one value per output channel, "input": per
        input channel, LyCORIS's legacy DoRA) and the shape this format stores it in; None when
        its size fits neither axis. The axis comes from the number of values, as ComfyUI does."""
        magnitude = self.magnitude
        if magnitude is None:
            return None
        out, size = self.out_features, magnitude.numel()
        if size == out and self.file_format == PEFT:
            return "output", self.output_magnitude_shape()
        # When in == out only the shape tells the axes apart: [1, n] is LyCORIS's input axis.
        if size == out and (size != self.in_features or magnitude.dim() == 1 or magnitude.shape[0] == out):
            return "output", self.output_magnitude_shape()
        if size == self.in_features and self.file_format == KOHYA:
            return "input", (1, size, 1, 1) if self.is_conv else (1, size)
        return None


def channel_norms(weight: torch.Tensor, axis: str) -> torch.Tensor:
    """The L2 norm of every output row ("output") or input column ("input") of a weight, in fp32."""
    weight = weight.float()
    if axis == "input":
        weight = weight.transpose(0, 1)
    return weight.flatten(1).norm(dim=1)


def merged_weight(base_weight: torch.Tensor, module: AdapterModule) -> torch.Tensor:
    """The weight the module stands for at strength 1, in fp32: W + ΔW; with a DoRA magnitude
    (LoRA's, or LyCORIS's `dora_wd` on LoKr and LoHa, its `weight_decompose`) V·m/‖V‖ with
    V = W + ΔW, the norm on the magnitude's axis (peft, LyCORIS)."""
    base, magnitude, layout = base_weight.float(), module.magnitude, module.magnitude_layout()
    lora = module.algorithm == "lora"
    if magnitude is None:
        if lora:
            return kohya_merged_weight(base, module.down.float(), module.up.float(), module.alpha)
        return base + module.delta(base.shape)
    if layout is None:
        raise AdapterFileError(f"{module.label}: a DoRA magnitude of shape {list(magnitude.shape)} fits no "
                               f"axis of a weight of shape {list(base.shape)}")
    if lora and layout[0] == "output":
        dora_scale = magnitude.float().reshape(base.shape[0], *[1] * (base.dim() - 1))
        return kohya_merged_weight(base, module.down.float(), module.up.float(), module.alpha, dora_scale)
    adapted = base + module.delta(base.shape)
    ones = [1] * (base.dim() - 2)
    shape = (-1, 1, *ones) if layout[0] == "output" else (1, -1, *ones)
    return adapted * (magnitude.float().reshape(shape) / channel_norms(adapted, layout[0]).reshape(shape))


class AdapterFile:
    """An adapter .safetensors file opened for reading: its format, metadata and modules.

    `name_map` (from `kohya_name_map`) gives kohya modules their diffusers names; without it a
    kohya module is known only by its file name. It may be set after opening, once the format
    is known.
    """

    def __init__(self, path: str | Path, name_map: dict[str, tuple[str, str]] | None = None) -> None:
        self.path = Path(path)
        self.reader = TensorReader([self.path], AdapterFileError)
        self.format, self.format_reason = _detect(self.reader.keys, self.path)
        self.groups, self.other_keys = _group(self.format, self.reader.keys, self.path)
        if not self.groups:
            raise AdapterFileError(f"{self.path}: no LoRA (lora_down/lora_up, lora_A/lora_B), LoKr (lokr_*) or "
                                   "LoHa (hada_*) modules; other LyCORIS algorithms are not supported")
        self.name_map = name_map or {}
        self._peft_configs = peft_configs(self.reader.metadata) if self.format == PEFT else {}

    def __enter__(self) -> AdapterFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.reader.close()

    @property
    def metadata(self) -> dict[str, str]:
        return self.reader.metadata

    def modules(self) -> Iterator[AdapterModule]:
        """Every module, read from disk one at a time, in file order."""
        for canonical in self.groups:
            yield self.module(canonical)

    def module(self, canonical: str) -> AdapterModule:
        keys = self.groups[canonical]
        tensors = {role: self.reader.get(key) for role, key in keys.items()}
        if self.format == PEFT:
            component, name = canonical.split(".", 1)
        else:
            component = next(c for prefix, c in KOHYA_PREFIXES.items() if canonical.startswith(prefix))
            component, name = self.name_map.get(canonical, (component, None))
        module = AdapterModule(canonical, self.format, component, name, tensors, keys, alpha=math.nan)
        if module.algorithm == "lokr" and self.format == PEFT:
            module.config_rank = int(self._pattern_value(module, "r", "rank_pattern", module.rank or 1))
        if "down" in tensors or module.algorithm != "lora":
            module.alpha = self._alpha(module)
        return module

    def _pattern_value(self, module: AdapterModule, key: str, patterns: str, default: float) -> float:
        """A peft config value for this module: `key`, overridden by the first matching pattern."""
        config = self._peft_configs.get(module.component) or {}
        value = float(config.get(key, default))
        for pattern, override in (config.get(patterns) or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", module.name or ""):
                return float(override)
        return value

    def _alpha(self, module: AdapterModule) -> float:
        """kohya: the `alpha` tensor (absent or 0 means alpha = rank). peft: the LoraConfig in the
        metadata, with alpha_pattern and rsLoRA (scale alpha/√r) as peft applies them."""
        rank = float(module.rank or 1)
        if "alpha" in module.tensors:
            alpha = float(module.tensors["alpha"])
            return alpha if alpha != 0 else rank
        config = self._peft_configs.get(module.component)
        if not config:
            return rank
        alpha = self._pattern_value(module, "lora_alpha" if "lora_alpha" in config else "alpha", "alpha_pattern", rank)
        return alpha * math.sqrt(rank) if config.get("use_rslora") else alpha


def canonical_module_name(file_format: str, name: str) -> str:
    """The module name the format should use. kohya: `lora_<unet|te1|te2>_` + the path with `_`
    for `.` and, for the text encoders, `text_model_` (ComfyUI needs it: docs/formats.md, "Module
    names"); a peft-named module (`unet.down_blocks.0…`) is turned into its kohya name."""
    if file_format == PEFT:
        return name
    component, _, path = name.partition(".")
    if component in PREFIXES:
        name = PREFIXES[component] + path
    name = name.replace(".", "_")
    for prefix in (PREFIXES["text_encoder"], PREFIXES["text_encoder_2"]):
        if name.startswith(prefix) and not name.startswith(prefix + "text_model_"):
            name = prefix + "text_model_" + name.removeprefix(prefix)
    return name


def canonical_key(file_format: str, module_name: str, role: str) -> str:
    return canonical_module_name(file_format, module_name) + CANONICAL_SUFFIXES[file_format][role]


def split_key(key: str) -> tuple[str, str] | None:
    """(module name, role) of an adapter tensor key, or None for a key of no known role."""
    for suffix, role in ROLES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def detect_format(path: str | Path) -> str:
    """PEFT or KOHYA, from the tensor names alone (see `AdapterFile.format_reason` for why)."""
    with AdapterFile(path) as adapter:
        return adapter.format


def adapter_files(path: str | Path) -> tuple[list[Path], str]:
    """The adapter file(s) that `path` names, and how they were found.

    A file is itself. A folder of this trainer (an output folder or `checkpoints/checkpoint-<step>`)
    gives the files the trainer writes there: `pytorch_lora_weights.safetensors` and
    `<run>_kohya.safetensors`; an output folder without them gives its newest checkpoint's.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".safetensors":
            raise AdapterFileError(f"{path}: not a .safetensors file (pickled .ckpt/.bin/.pt files can run code)")
        return [path], "the file given"
    if not path.is_dir():
        raise AdapterFileError(f"{path}: no such file or folder")
    found = _trainer_files(path)
    if found:
        return found, f"the trainer's adapter file(s) in folder {path}"
    from ..checkpointing import list_checkpoints

    for checkpoint in reversed(list_checkpoints(path / "checkpoints")):
        found = _trainer_files(checkpoint)
        if found:
            return found, f"no final adapter in {path}: its newest checkpoint {checkpoint.name}"
    raise AdapterFileError(
        f"{path}: no adapter file in this folder or its checkpoints/ (expected {DIFFUSERS_WEIGHT_NAME} "
        f"or <run>{KOHYA_SUFFIX}); pass the .safetensors file itself"
    )


def kohya_name_map(pipe: StableDiffusionXLPipeline) -> dict[str, tuple[str, str]]:
    """kohya module name → (component, diffusers module path) for every Linear/Conv2d of the
    pipeline. UNet modules are listed under their sgm name (kohya's) and their diffusers name
    (`lora_unet_down_blocks_…`, which ComfyUI and diffusers also accept)."""
    import torch

    names = {}
    for component in COMPONENTS:
        model = getattr(pipe, component)
        for path, layer in model.named_modules():
            if not isinstance(layer, torch.nn.Linear | torch.nn.Conv2d):
                continue
            name = path if component == "unet" or path.startswith("text_model.") else "text_model." + path
            try:
                names[kohya_module_name(component, path, pipe.unet.config)] = (component, name)
            except ValueError:
                continue  # a layer outside the SDXL layout has no kohya name
            if component == "unet":
                names["lora_unet_" + path.replace(".", "_")] = (component, name)
    return names


def find_layer(pipe: StableDiffusionXLPipeline, module: AdapterModule) -> torch.nn.Module | None:
    """The pipeline layer a module adapts; None when the pipeline has no such layer. CLIP-L's
    paths lack `text_model.` in transformers >= 5.6, so both spellings are tried."""
    if module.name is None:
        return None
    model = getattr(pipe, module.component)
    for path in (module.name, module.name.removeprefix("text_model.")):
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    return None


def load_adapter_into(pipe: StableDiffusionXLPipeline, path: str | Path) -> int:
    """Merge the adapter file at `path` (either format) into the pipeline's weights, W ← W', and
    return the number of modules merged. Every module must match a layer of the pipeline."""
    import torch

    name_map = kohya_name_map(pipe) if detect_format(path) == KOHYA else None
    count = 0
    with AdapterFile(path, name_map) as adapter:
        for module in adapter.modules():
            layer = find_layer(pipe, module)
            if layer is None or not hasattr(layer, "weight"):
                raise AdapterFileError(f"{path}: module {module.label} is not a layer of this model")
            if module.algorithm == "lora" and ("down" not in module.tensors or "up" not in module.tensors):
                raise AdapterFileError(f"{path}: module {module.label} lacks its lora_down or lora_up tensor")
            with torch.no_grad():
                layer.weight.copy_(merged_weight(layer.weight, module).to(layer.weight.dtype))
            count += 1
    return count


def _trainer_files(folder: Path) -> list[Path]:
    peft = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    return peft + sorted(folder.glob("*" + KOHYA_SUFFIX))


def _detect(keys: list[str], path: Path) -> tuple[str, str]:
    kohya = sum(key.startswith(tuple(KOHYA_PREFIXES)) for key in keys)
    peft = sum(key.split(".", 1)[0] in COMPONENTS and split_key(key) is not None for key in keys)
    if kohya:
        leftovers = f"; {peft} key(s) carry peft module names" if peft else ""
        return KOHYA, f"{kohya} of {len(keys)} keys start with lora_unet_/lora_te1_/lora_te2_{leftovers}"
    if peft:
        return PEFT, f"{peft} of {len(keys)} keys are <unet|text_encoder|text_encoder_2>.<module>.lora_A/lora_B/…"
    raise AdapterFileError(
        f"{path}: no LoRA/DoRA keys (neither lora_unet_…/lora_te…_ nor unet./text_encoder….lora_A/lora_B): "
        "not an adapter file (a full model checkpoint?)"
    )


def _group(file_format: str, keys: list[str], path: Path) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Module name (canonical) → {role: key}, in file order, and the keys of no known role."""
    groups: dict[str, dict[str, str]] = {}
    other = []
    for key in keys:
        parts = split_key(key)
        if parts is None or not _is_module_name(file_format, parts[0]):
            other.append(key)
            continue
        roles = groups.setdefault(canonical_module_name(file_format, parts[0]), {})
        if parts[1] in roles:
            raise AdapterFileError(f"{path}: {roles[parts[1]]} and {key} are the same tensor of one module")
        roles[parts[1]] = key
    return groups, other


def _is_module_name(file_format: str, name: str) -> bool:
    in_component = name.split(".", 1)[0] in COMPONENTS
    return in_component if file_format == PEFT else in_component or name.startswith(tuple(KOHYA_PREFIXES))


def peft_configs(metadata: dict[str, str]) -> dict[str, dict[str, Any]]:
    """component → its LoraConfig as diffusers stores it (`lora_adapter_metadata`, keys prefixed
    `unet.`, `text_encoder.`, …); empty without metadata."""
    try:
        flat = json.loads(metadata.get("lora_adapter_metadata", "{}"))
    except json.JSONDecodeError:
        return {}
    configs: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        component, _, field = key.rpartition(".")
        configs.setdefault(component, {})[field] = value
    return configs
