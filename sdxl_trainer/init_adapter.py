"""Start a run's adapter from an existing one (`adapter.init_from`), as kohya's `--network_weights`,
OneTrainer's `lora_model_name` and SimpleTuner's `--init_lora` do.

The file is any adapter this trainer reads (adapter_files.py: diffusers/peft or kohya/LyCORIS;
LoRA, DoRA, LoKr, LoHa), or an output or checkpoint folder of this trainer. At a fresh start it is
read twice: by the pre-flight, against the model built on the meta device (no weight is loaded, so
a mismatch is one line before anything is loaded or written), and once the model is loaded, when
its tensors go into the adapter peft attached. A resume never reads it: the checkpoint holds the
adapter, so a resumed run continues exactly as if it had not stopped.

What must agree, and what is only said (docs/training.md, "Start from an existing adapter"):
- the kind must be the config's, and so must the file's most common rank and alpha of Linear layers
  (adapter.rank, alpha) and of convolutions (conv_rank, conv_alpha); modules of other ranks or alphas
  (kohya's dynamic resizing, extract_adapter.py's error target) keep theirs, attached through peft's
  rank_pattern and alpha_pattern, and are counted in one line;
- each module of the file on a layer of this model must fit that layer (else it is an adapter for
  another model) and be one the config trains (`adapter.targets`, `model.train_text_encoder_*`);
- modules on no layer of this model (other names, CLIP-L's last layer, which SDXL never runs) are
  left out and listed, unless none is left (an adapter for another model);
- layers the config trains that the file lacks start as a new adapter does (a no-op), and are listed.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ConfigError

if TYPE_CHECKING:
    import torch
    from diffusers import StableDiffusionXLPipeline

    from .adapters import Patterns
    from .config import AdapterConfig, Config
    from .formats.adapter_files import AdapterModule
    from .training_setup import Trainable

KEY = "adapter.init_from"
ADAPTER = "default"  # the name peft gives the one adapter that `add_adapter` attaches
PRESETS = ("attn", "attn-mlp", "all")
# peft's container of each LoRA role; LoKr's and LoHa's roles are their peft attribute names.
PEFT_CONTAINERS = {"down": "lora_A", "up": "lora_B", "magnitude": "lora_magnitude_vector"}


@dataclass
class InitAdapter:
    """An adapter file read for a run: its modules by the layer each adapts."""

    path: Path
    modules: dict[str, AdapterModule]  # layer_key → the file's module for that layer
    lines: list[str]  # what the pre-flight says about it
    patterns: Patterns  # the modules whose rank or alpha is not the config's, as peft attaches them


def layer_key(component: str, path: str) -> str:
    """A layer's name in every format and transformers version: CLIP paths with `text_model.`."""
    if component != "unet":
        path = "text_model." + path.removeprefix("text_model.")
    return f"{component}.{path}"


def preflight_lines(config: Config, resuming: bool) -> list[str]:
    """What the pre-flight says about `adapter.init_from`, checked against the model built on the
    meta device; a ConfigError for a file this run cannot start from."""
    from .memory.architecture import PlanSkipped, meta_pipeline, read_architecture

    if not config.adapter.init_from:
        return []
    if resuming:
        return [f"init: {KEY} is not read: the run continues from its checkpoint's adapter"]
    try:
        pipe = meta_pipeline(read_architecture(config.model))
    except PlanSkipped as exc:
        return [f"init: {config.adapter.init_from} is checked once the model is loaded ({exc})"]
    return read_init_adapter(config, pipe).lines


def read_init_adapter(config: Config, pipe: StableDiffusionXLPipeline) -> InitAdapter:
    """Read the file of `adapter.init_from` against `pipe` (before adapters are attached). A file
    that is no adapter, is damaged, is for another model or differs from the config is a ConfigError."""
    from .formats.adapter_files import KOHYA, AdapterFile, AdapterFileError, adapter_files, kohya_name_map
    from .formats.safetensors_header import read_header
    from .training_setup import adapter_targets

    try:
        path = adapter_files(config.adapter.init_from)[0][0]
        try:
            read_header(path)
        except ValueError as exc:  # a truncated file: safetensors may map it without noticing
            raise AdapterFileError(f"{path}: {exc}") from None
        with AdapterFile(path) as adapter:
            if adapter.format == KOHYA:
                adapter.name_map = kohya_name_map(pipe)
            modules, file_format = list(adapter.modules()), adapter.format
    except AdapterFileError as exc:
        raise ConfigError(f"{KEY}: {exc}") from None
    layers = model_layers(pipe)
    matched, left_out = _match(path, modules, layers)
    own = _check_settings(path, matched, layers, config.adapter)
    targets = adapter_targets(pipe, config)
    trained = [layer_key(component, name) for component, names in targets.items() for name in names]
    trained_set = set(trained)
    outside = [key for key in matched if key not in trained_set]
    if outside:
        raise ConfigError(_outside_message(path, outside, list(matched), pipe, config))
    if config.adapter.type == "lokr":
        _check_lokr_factors(path, matched, layers, config.adapter, own)
    counts = Counter(key.split(".", 1)[0] for key in matched)
    lines = [f"init: the adapter starts from {path} ({file_format}, {len(matched)} modules: "
             + ", ".join(f"{component} {count}" for component, count in counts.items()) + ")"]
    if left_out:
        lines.append(f"  warning: the file's modules on no layer this model has or runs are left out "
                     f"({_count(left_out)}): {_names(left_out)}")
    if own:
        ranks, alphas = _values(rank for rank, _ in own.values()), _values(alpha for _, alpha in own.values())
        lines.append(f"  note: {_count(list(own))} keep{'s' if len(own) == 1 else ''} the file's own rank and alpha, "
                     f"not the config's (peft's rank_pattern and alpha_pattern): ranks {ranks}; alphas {alphas}")
    lacking = [key for key in trained if key not in matched]
    if lacking:
        lines.append(f"  note: the file lacks {_count(lacking)} this run adapts; they start as a new adapter "
                     f"does (a no-op): {_names(lacking)}")
    return InitAdapter(path, matched, lines, _patterns(own, targets))


def saved_patterns(path: Path) -> Patterns:
    """The rank and alpha patterns a run's adapter file was saved with (peft's config, which
    `save_diffusers_adapter` writes into its metadata): a resumed run attaches exactly the adapter
    its checkpoint holds, whatever `adapter.init_from` says now. Empty for a file without them."""
    from safetensors import safe_open

    from .adapters import PATTERN_FIELDS
    from .formats.adapter_files import peft_configs

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return {component: {field: config.get(field) or {} for field in PATTERN_FIELDS}
            for component, config in peft_configs(metadata).items()}


def model_layers(pipe: StableDiffusionXLPipeline) -> dict[str, tuple[int, ...]]:
    """layer_key → weight shape of every Linear/Conv2d of the UNet and both text encoders that a
    run may adapt (CLIP-L's last layer, which SDXL never runs, left out)."""
    import torch

    from .training_setup import unused_prefixes

    layers = {}
    for component in ("unet", "text_encoder", "text_encoder_2"):
        model = getattr(pipe, component)
        unused = unused_prefixes(component, model)
        for path, layer in model.named_modules():
            if isinstance(layer, torch.nn.Linear | torch.nn.Conv2d) and not path.startswith(unused):
                layers[layer_key(component, path)] = tuple(layer.weight.shape)
    return layers


def _match(path: Path, modules: list[AdapterModule],
           layers: dict[str, tuple[int, ...]]) -> tuple[dict[str, AdapterModule], list[str]]:
    """The file's modules by the layer each adapts, and the file's names of those on no layer of
    this model. A damaged module, one that does not fit its layer, or no module on any layer is an error."""
    from .doctor.checks import MAGNITUDE_NON_FINITE, NON_FINITE, UNUSABLE, check_module

    matched, left_out = {}, []
    for module in modules:
        key = layer_key(module.component, module.name) if module.name else None
        if key not in layers:
            left_out.append(module.file_name)
            continue
        damage = [finding.detail for finding in check_module(module, None)
                  if finding.kind in (UNUSABLE, NON_FINITE, MAGNITUDE_NON_FINITE)]
        if module.magnitude is not None and module.algorithm != "lora":
            raise ConfigError(f"{KEY}: {path}: {_named(module)}: a {module.algorithm} module with a DoRA magnitude "
                              "(LyCORIS's dora_wd), which this trainer cannot train on")
        if module.magnitude is not None and (module.magnitude_layout() or ("",))[0] != "output":
            damage.append("a DoRA magnitude on the input axis (LyCORIS before 3.2), which cannot be continued as "
                          "the output-axis DoRA this trainer trains")
        if damage:
            raise ConfigError(f"{KEY}: {path}: {_named(module)}: {damage[0]} (debug_dora_weights.py and "
                              "fix_dora_weights.py check and repair the file)")
        update = _update_shape(module)
        if update != _flat(layers[key]) or (module.algorithm == "lora" and module.down.dim() != len(layers[key])):
            raise ConfigError(f"{KEY}: {path}: {_named(module)} is an update of {update[0]} x {update[1]} for a layer "
                              f"of shape {list(layers[key])} in this model: an adapter for another model")
        matched[key] = module
    if not matched:
        sd1 = " (lora_te_ keys are SD 1.x's)" if any(m.file_name.startswith("lora_te_") for m in modules) else ""
        raise ConfigError(f"{KEY}: {path}: none of its {len(modules)} modules is a layer of this model "
                          f"(e.g. {modules[0].label}){sd1}: an adapter for another model")
    return matched, left_out


def _update_shape(module: AdapterModule) -> tuple[int, int]:
    """(out, in x kernel) of the module's update."""
    if module.algorithm == "lora":
        return module.out_features, module.down[0].numel()
    return tuple(module.flat_delta().shape)


def _flat(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def _float32(value: float) -> float:
    """`value` as stored in fp32: alphas are compared as the files hold them."""
    import numpy as np

    return float(np.float32(value))


def _shown(value: float) -> str:
    import numpy as np

    return np.format_float_positional(np.float32(value), trim="-")


def _check_settings(path: Path, modules: dict[str, AdapterModule], layers: dict[str, tuple[int, ...]],
                    adapter: AdapterConfig) -> dict[str, tuple[int, float]]:
    """Kind, and the most common rank and alpha of Linear layers and of convolutions, against
    `adapter.*`: one ConfigError naming every difference, both values each. Returns the modules
    of another rank or alpha, which keep the file's: layer_key → (rank, alpha)."""
    from .adapter_kinds import kind_of_module

    kinds = sorted({kind_of_module(m.algorithm, m.magnitude is not None).name for m in modules.values()})
    differences = [] if kinds == [adapter.type] else [
        f"adapter.type is {json.dumps(adapter.type)}, the file's " + " and ".join(json.dumps(kind) for kind in kinds)]
    own = {}
    for conv in (False, True):
        group = {key: m for key, m in modules.items() if (len(layers[key]) == 4) == conv and m.rank is not None}
        wanted = _wanted(adapter, conv)
        for setting, value, said in wanted:
            found = Counter(m.rank if setting.endswith("rank") else _float32(m.alpha) for m in group.values())
            if found and found[_float32(value)] < max(found.values()):
                differences.append(f"{setting} is {said}, the file's {_most_common(found)}")
        (_, rank, _), (_, alpha, _) = wanted
        own |= {key: (m.rank, m.alpha) for key, m in group.items()
                if m.rank != rank or _float32(m.alpha) != _float32(alpha)}
    if differences:
        raise ConfigError(f"{KEY}: {path} does not match the config: " + "; ".join(differences))
    return own


def _most_common(found: Counter) -> str:
    """The most common value(s) of a file's ranks or alphas, and all of them where they differ."""
    most = max(found.values())
    common = " or ".join(_shown(value) for value in sorted(found) if found[value] == most)
    return common if len(found) == 1 else f"most common {common} (of {_values(found)})"


def _values(values: Iterable[float]) -> str:
    return ", ".join(_shown(value) for value in sorted(set(values)))


def _patterns(own: dict[str, tuple[int, float]], targets: dict[str, list[str]]) -> Patterns:
    """The modules of their own rank and alpha as peft's rank_pattern and alpha_pattern of each
    component (its module names, escaped as `adapters.peft_config` does those of convolutions)."""
    patterns = {}
    for component, names in targets.items():
        mine = {re.escape(name): own[layer_key(component, name)] for name in names
                if layer_key(component, name) in own}
        if mine:
            patterns[component] = {"rank_pattern": {name: rank for name, (rank, _) in mine.items()},
                                   "alpha_pattern": {name: alpha for name, (_, alpha) in mine.items()}}
    return patterns


def _wanted(adapter: AdapterConfig, conv: bool) -> list[tuple[str, float, str]]:
    """(key, value, how the config says it) of the rank and alpha of Linear layers or convolutions."""
    if not conv:
        return [("adapter.rank", adapter.rank, str(adapter.rank)),
                ("adapter.alpha", adapter.alpha, _shown(adapter.alpha))]
    rank = adapter.conv_rank or adapter.rank
    alpha = adapter.conv_alpha or adapter.alpha
    return [("adapter.conv_rank", rank, str(adapter.conv_rank) if adapter.conv_rank else f"unset (= rank {rank})"),
            ("adapter.conv_alpha", alpha, _shown(alpha) if adapter.conv_alpha else f"unset (= alpha {_shown(alpha)})")]


def trained_layers(trainable: Trainable) -> dict[str, Any]:
    """layer_key → the peft adapter layer attached to it, for every layer this run adapts."""
    from .formats.kohya_format import adapter_layers

    return {layer_key(component, path): layer for component, module in trainable.modules.items()
            for path, layer in adapter_layers(module)}


def load_init_adapter(init: InitAdapter, trainable: Trainable) -> int:
    """Put the file's tensors into the adapter attached for this run (once its parameters have their
    master dtype), after checking that it holds the same tensors; returns how many modules."""
    import torch

    trained = trained_layers(trainable)
    pairs = list(_pairs(init, trained))  # every module checked before any is changed
    with torch.no_grad():
        for parameter, value in pairs:
            parameter.copy_(value)
    return len(init.modules)


def _outside_message(path: Path, outside: list[str], matched: list[str], pipe: StableDiffusionXLPipeline,
                     config: Config) -> str:
    """The one line for the file's modules on layers of the model that the config does not train."""
    from .adapters import unet_target_modules

    untrained = sorted({key.split(".", 1)[0] for key in outside} - set(config.trained_components()))
    if untrained:
        switch = {"text_encoder": "model.train_text_encoder_1", "text_encoder_2": "model.train_text_encoder_2"}
        said = "; ".join(f"{switch[component]} is false, the file adapts {component}" for component in untrained)
        return f"{KEY}: {path} does not match the config: {said}"
    in_unet = {key.removeprefix("unet.") for key in matched if key.startswith("unet.")}
    preset = next((name for name in PRESETS if set(unet_target_modules(pipe.unet, name)) == in_unet), None)
    said = f'the file\'s "{preset}"' if preset else f"which leaves out {_count(outside)} of the file: {_names(outside)}"
    return f"{KEY}: {path} does not match the config: adapter.targets is {json.dumps(config.adapter.targets)}, {said}"


def _check_lokr_factors(path: Path, modules: dict[str, AdapterModule], layers: dict[str, tuple[int, ...]],
                        adapter: AdapterConfig, own: dict[str, tuple[int, float]]) -> None:
    """LoKr's factor shapes are set by `adapter.lokr_factor` and `lokr_decompose_both`: the file's
    must be those peft makes of them (lycoris_compat.peft_lokr_parts, checked against peft)."""
    from .formats.lycoris_compat import peft_lokr_parts

    for key, module in modules.items():
        weight = layers[key]
        rank = own[key][0] if key in own else (adapter.conv_rank or adapter.rank) if len(weight) == 4 else adapter.rank
        wanted = peft_lokr_parts(weight, rank, adapter.lokr_factor, adapter.lokr_decompose_both)
        held = {role: tuple(tensor.shape) for role, tensor in module.tensors.items() if role != "alpha"}
        if held != wanted:
            raise ConfigError(f"{KEY}: {path}: {_named(module)} holds {_shapes(held)}; adapter.lokr_factor "
                              f"{adapter.lokr_factor} and adapter.lokr_decompose_both "
                              f"{json.dumps(adapter.lokr_decompose_both)} make {_shapes(wanted)}")


def _shapes(shapes: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{role} {list(shape)}" for role, shape in sorted(shapes.items()))


def _pairs(init: InitAdapter, trained: dict[str, Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, the file's value for it) for every tensor of every module of the file; a
    ConfigError where the file's module and this run's adapter hold different tensors."""
    for key, module in init.modules.items():
        layer = trained[key]
        held = _held(layer)
        roles = [role for role in module.tensors if role != "alpha"]
        if set(roles) != set(held):
            raise ConfigError(f"{KEY}: {init.path}: {module.label} holds {', '.join(sorted(roles))}; this run's "
                              f"adapter holds {', '.join(sorted(held))}")
        for role in roles:
            value = _value(module, role, layer)
            if value.numel() != held[role].numel() or (role != "magnitude" and value.shape != held[role].shape):
                raise ConfigError(f"{KEY}: {init.path}: {module.label} {role} has shape {list(value.shape)}, "
                                  f"this run's adapter {list(held[role].shape)}")
            yield held[role], value.reshape(held[role].shape).to(held[role].dtype)


def _held(layer: Any) -> dict[str, torch.Tensor]:
    """role → parameter of the tensors the peft layer holds for its adapter."""
    import torch

    from .formats.adapter_files import ROLES

    held = {}
    for role in set(ROLES.values()) - {"alpha"}:
        container = getattr(layer, PEFT_CONTAINERS.get(role, role), None)
        if isinstance(container, torch.nn.ModuleDict | torch.nn.ParameterDict) and ADAPTER in container:
            item = container[ADAPTER]
            held[role] = item if isinstance(item, torch.nn.Parameter) else item.weight
    return held


def _value(module: AdapterModule, role: str, layer: Any) -> torch.Tensor:
    """The file's tensor of `role` as peft holds it: LoKr's scale taken out of `lokr_w2` again where
    the file folded it in (no factor decomposed: the loaders apply scale 1)."""
    tensor = module.tensors[role]
    if role == "lokr_w2" and module.rank is None and layer.scaling[ADAPTER] != module.scale:
        return tensor.float() * module.scale / layer.scaling[ADAPTER]
    return tensor


def _named(module: AdapterModule) -> str:
    """The module as the file names it, and as the model does where that differs."""
    return module.label if module.label == module.file_name else f"{module.file_name} ({module.label})"


def _count(keys: list[str]) -> str:
    return f"{len(keys)} module{'s' if len(keys) != 1 else ''}"


def _names(keys: list[str], shown: int = 3) -> str:
    return ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")
