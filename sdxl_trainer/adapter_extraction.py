"""A LoRA or DoRA adapter extracted from a full fine-tune (extract_adapter.py): per adapted layer,
the SVD of the update ΔW = W_tuned − W_base keeps the rank asked for (lowrank.py), and the
factors are written by the trainer's own exporters (adapters.save_diffusers_adapter,
kohya_format.save_kohya_adapter), so the files are those a training run writes.

DoRA: the magnitude is the tuned weight's norm per output channel. DoRA's merged weight is
m·V/‖V‖ with V = W_base + ΔW_r, whose channel norms are m whatever V is, so they equal the tuned
model's exactly; only the direction is approximated.

Changes a LoRA cannot carry (biases, norms, embeddings, layers outside the targets) are counted
and their size reported: they are lost.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .formats.adapter_files import COMPONENTS
from .formats.kohya_format import merged_weight
from .lowrank import Factors, LayerError, LowRankError, RankChoice, dora_magnitude, factorize, layer_error, max_rank

if TYPE_CHECKING:
    import torch
    from diffusers import StableDiffusionXLPipeline

TARGETS = ("attn", "attn-mlp", "all")
FORMATS = ("kohya", "diffusers")
# Above this ‖W_tuned − W_base‖ / ‖W_base‖ over the adapted layers the two models are not a base
# and its fine-tune (two unrelated models of one architecture give about √2).
UNRELATED_CHANGE = 1.0


class ExtractError(LowRankError):
    """The models cannot give an adapter (other architectures, unrelated, identical, rank too high)."""


@dataclass(frozen=True)
class ExtractOptions:
    rank: RankChoice
    dora: bool = False
    targets: str = "all"  # as adapter.targets: attn, attn-mlp or all (convolutions too)


@dataclass
class ExtractedLayer:
    component: str
    name: str  # the module path in the component
    factors: Factors
    magnitude: torch.Tensor | None  # DoRA: [out]
    error: LayerError


@dataclass
class Extraction:
    layers: list[ExtractedLayer]
    dora: bool
    lost: dict[str, float] = field(default_factory=dict)  # changed tensor outside the adapter → ‖Δ‖ / ‖W‖
    unchanged: int = 0  # target layers whose weight did not change (no module)


def load_models(models: dict[str, str], config_dir: str | None) -> list[StableDiffusionXLPipeline]:
    """The models (option → `model.id`: a diffusers folder, single file, hub id or builtin:tiny-sdxl),
    each checked before any is loaded, so that a wrong one is reported at once."""
    from .config import ModelConfig
    from .models import check_model, load_pipeline

    configs = {option: ModelConfig(id=model_id, config_dir=config_dir) for option, model_id in models.items()}
    for option, model in configs.items():
        with _named(option, model.id):
            check_model(model)
    pipes = []
    for option, model in configs.items():
        print(f"loading {option} {model.id} …", flush=True)
        with _named(option, model.id):
            pipes.append(load_pipeline(model))
    return pipes


@contextlib.contextmanager
def _named(option: str, model_id: str) -> Iterator[None]:
    """A model that does not load as an ExtractError naming the option."""
    from .config import ConfigError

    try:
        yield
    except ConfigError as error:  # names the path and what is wrong with it
        message = str(error).replace("model.id =", option).replace("model.config_dir =", "--config-dir")
        raise ExtractError(message) from None
    except (OSError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ExtractError(f"{option} {model_id}: cannot load it as an SDXL model ({message})") from error


def target_layers(module: torch.nn.Module, component: str, targets: str) -> list[str]:
    """The layers an adapter may hold: adapter.targets' selection (text encoders: attention, plus
    the MLP unless `attn`)."""
    from .adapters import text_encoder_target_modules, unet_target_modules

    if component == "unet":
        return unet_target_modules(module, targets)
    return text_encoder_target_modules(module, targets)


def extract(base: StableDiffusionXLPipeline, tuned: StableDiffusionXLPipeline, options: ExtractOptions) -> Extraction:
    """Every changed target layer's factors, magnitude (DoRA) and error; the models are unchanged.
    The models are compared whole (cheap) before any SVD (minutes for SDXL)."""
    import torch

    extraction, changed = Extraction([], options.dora), []
    change = total = 0.0
    with torch.no_grad():
        for component in COMPONENTS:
            base_module, tuned_module = getattr(base, component), getattr(tuned, component)
            tuned_state = _same_architecture(component, base_module.state_dict(), tuned_module.state_dict())
            names = target_layers(base_module, component, options.targets)
            for name in names:
                weight, target = base_module.get_submodule(name).weight, tuned_state[f"{name}.weight"]
                _check_finite(f"{component}.{name}.weight", weight, target)
                if torch.equal(weight, target):
                    extraction.unchanged += 1
                    continue
                if options.rank.rank > max_rank(weight.shape) and options.rank.dynamic is None:
                    raise ExtractError(f"--rank {options.rank.rank} is above the rank of {component}.{name} (at most "
                                       f"{max_rank(weight.shape)} for its shape {list(weight.shape)}): lower --rank, "
                                       "or pick the targets with --targets")
                changed.append((component, name, weight, target))
                change += float((target.double() - weight.double()).square().sum())
                total += float(weight.double().square().sum())
            adapted = {f"{name}.weight" for name in names}
            extraction.lost |= _lost_changes(component, base_module.state_dict(), tuned_state, adapted)
        if not changed:
            raise ExtractError("the tuned model's target layers equal the base's: nothing to extract")
        if change > UNRELATED_CHANGE**2 * total:
            raise ExtractError(f"the tuned model differs from the base by {(change / total) ** 0.5:.2f} of its "
                               "weights' norm: not a fine-tune of this base (pass the model it was trained from)")
        extraction.layers = [_extract_layer(*layer, options) for layer in changed]
    return extraction


def _check_finite(label: str, weight: torch.Tensor, target: torch.Tensor) -> None:
    """A NaN/Inf weight is refused before any SVD (which fails on it) or the models' comparison
    (for which NaN compares as no change)."""
    from .finite import non_finite_names

    bad = non_finite_names([("--base", weight), ("--tuned", target)])
    if bad:
        raise ExtractError(f"{' and '.join(bad)}: {label} holds NaN/Inf: no adapter can be extracted from it")


def _same_architecture(component: str, base: dict[str, torch.Tensor],
                       tuned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for key, tensor in base.items():
        if key not in tuned:
            raise ExtractError(f"the tuned model's {component} has no {key}: not the base's architecture")
        if tuned[key].shape != tensor.shape:
            raise ExtractError(f"{component}.{key} has shape {list(tuned[key].shape)} in the tuned model and "
                               f"{list(tensor.shape)} in the base: not the base's architecture")
    extra = sorted(set(tuned) - set(base))
    if extra:
        raise ExtractError(f"the tuned model's {component} has {extra[0]}, which the base lacks: not its architecture")
    return tuned


def _extract_layer(component: str, name: str, weight: torch.Tensor, target: torch.Tensor,
                   options: ExtractOptions) -> ExtractedLayer:
    label = f"{component}.{name}"
    base, tuned = weight.float(), target.float()
    factors = factorize((tuned - base).flatten(1), options.rank)
    magnitude = dora_magnitude(tuned) if options.dora else None
    scale = None if magnitude is None else magnitude.reshape(base.shape[0], *[1] * (base.dim() - 1))
    merged = merged_weight(base, factors.down, factors.up, factors.rank, scale)
    return ExtractedLayer(component, name, factors, magnitude, layer_error(label, merged, tuned, factors))


def _lost_changes(component: str, base: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor],
                  adapted: set[str]) -> dict[str, float]:
    """The changed tensors no adapter module carries, with their relative change."""
    import torch

    lost = {}
    for key, tensor in base.items():
        if key not in adapted and tensor.is_floating_point() and not torch.equal(tensor, tuned[key]):
            norm = float(tensor.double().norm())
            lost[f"{component}.{key}"] = float((tuned[key].double() - tensor.double()).norm()) / (norm or 1.0)
    return lost


def write_adapter(pipe: StableDiffusionXLPipeline, extraction: Extraction, destination: Path,
                  formats: tuple[str, ...]) -> list[Path]:
    """Write the extraction with the trainer's exporters: a `.safetensors` destination is one file in
    `formats[0]`; a folder gets the files of an output folder (`pytorch_lora_weights.safetensors`,
    `<folder name>_kohya.safetensors`). The adapter is attached to `pipe`'s base modules for the
    write and removed again."""
    from .export import remove_adapter
    from .formats.kohya_format import save_kohya_adapter

    modules = _attach(pipe, extraction)
    try:
        written = []
        for file_format in formats:
            if file_format == "kohya":
                path = destination if destination.suffix == ".safetensors" else (
                    destination / f"{destination.name}_kohya.safetensors")
                written.append(save_kohya_adapter(path, modules, {"modelspec.title": path.stem}))
            else:
                written.append(_save_diffusers(destination, modules))
        return written
    finally:
        for module in modules.values():
            remove_adapter(module, merge=False)


def _save_diffusers(destination: Path, modules: dict[str, torch.nn.Module]) -> Path:
    from .adapters import save_diffusers_adapter

    if destination.suffix != ".safetensors":
        return save_diffusers_adapter(destination, modules)
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".extract-", dir=destination.parent) as tmp:
        os.replace(save_diffusers_adapter(tmp, modules), destination)
    return destination


def _attach(pipe: StableDiffusionXLPipeline, extraction: Extraction) -> dict[str, torch.nn.Module]:
    """peft LoRA/DoRA adapters on the pipeline's modules, holding the extracted factors (alpha =
    rank per layer; layers of another rank than the most common one through rank_pattern)."""
    import collections

    import torch
    from peft import LoraConfig

    modules = {}
    for component in COMPONENTS:
        layers = [layer for layer in extraction.layers if layer.component == component]
        if not layers:
            continue
        common = collections.Counter(layer.factors.rank for layer in layers).most_common(1)[0][0]
        pattern = {re.escape(layer.name): layer.factors.rank for layer in layers if layer.factors.rank != common}
        module = getattr(pipe, component)
        module.add_adapter(LoraConfig(r=common, lora_alpha=common, target_modules=[layer.name for layer in layers],
                                      rank_pattern=pattern, alpha_pattern=pattern, use_dora=extraction.dora))
        with torch.no_grad():
            for layer in layers:
                adapter = module.get_submodule(layer.name)
                for parameter, value in ((adapter.lora_A["default"].weight, layer.factors.down),
                                         (adapter.lora_B["default"].weight, layer.factors.up)):
                    parameter.copy_(value.reshape(parameter.shape))
                if layer.magnitude is not None:
                    magnitude = adapter.lora_magnitude_vector["default"].weight
                    magnitude.copy_(layer.magnitude.reshape(magnitude.shape))
        modules[component] = module
    return modules
