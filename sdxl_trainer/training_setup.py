"""What is trained: adapters (DoRA/LoRA/LoKr/LoHa) or full weights, per component, with their
learning rates (LoRA+: the B matrices in a group of their own at a multiple of the rate)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .adapters import attach_adapter, text_encoder_target_modules, unet_target_modules
from .config import Config, ConfigError

if TYPE_CHECKING:
    import torch
    from diffusers import StableDiffusionXLPipeline

    from .adapters import Patterns
    from .embeddings import TokenSet


@dataclass
class Trainable:
    """The components being trained (unet, text_encoder, text_encoder_2) and their settings."""

    modules: dict[str, torch.nn.Module]
    learning_rates: dict[str, float]
    adapter_type: str  # an `adapter.type`: a kind of adapter_kinds.ADAPTER_KINDS, or "none"
    loraplus_ratio: float | None = None  # LoRA+: the B matrices' learning rate multiple
    tokens: TokenSet | None = None  # textual inversion: the new rows of both embedding tables

    @property
    def is_adapter(self) -> bool:
        return self.adapter_type != "none"

    @property
    def group_names(self) -> list[str]:
        """The optimizer's param groups, in order (a component, and with LoRA+ `<component>_lora_B`)."""
        return [group["name"] for group in self.param_groups()]

    def param_groups(self) -> list[dict[str, Any]]:
        groups = []
        rows = {id(p) for p in self.tokens.parameters()} if self.tokens else set()
        for name, module in self.modules.items():
            trained = [(key, p) for key, p in module.named_parameters() if p.requires_grad and id(p) not in rows]
            is_b = [self.loraplus_ratio is not None and ".lora_B." in f".{key}" for key, _ in trained]
            groups.append({"name": name, "lr": self.learning_rates[name],
                           "params": [p for (_, p), b in zip(trained, is_b, strict=True) if not b]})
            if any(is_b):
                groups.append({"name": f"{name}_lora_B", "lr": self.learning_rates[name] * self.loraplus_ratio,
                               "params": [p for (_, p), b in zip(trained, is_b, strict=True) if b]})
        if self.tokens:
            groups.append({"name": "embeddings", "lr": self.tokens.settings.lr, "params": self.tokens.parameters()})
        return groups

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for group in self.param_groups():
            yield from group["params"]

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        rows = {id(p) for p in self.tokens.parameters()} if self.tokens else set()
        for name, module in self.modules.items():
            for param_name, param in module.named_parameters():
                if param.requires_grad and id(param) not in rows:
                    yield f"{name}.{param_name}", param
        if self.tokens:
            for name, table in self.tokens.tables.items():
                yield f"embeddings.{name}", table.new

    def on(self, pipe: StableDiffusionXLPipeline) -> Trainable:
        """The same training setup over another pipeline's components (e.g. gathered full copies)."""
        return Trainable({name: getattr(pipe, name) for name in self.modules}, self.learning_rates,
                         self.adapter_type, self.loraplus_ratio, self.tokens)

    def describe(self) -> str:
        parts = []
        for name, module in self.modules.items():
            count = sum(p.numel() for p in module.parameters() if p.requires_grad)
            parts.append(f"{name} {count / 1e6:.2f}M parameters at lr {self.learning_rates[name]:g}")
        if self.tokens:
            count = sum(p.numel() for p in self.tokens.parameters())
            parts.append(f"new token embeddings {count} parameters at lr {self.tokens.settings.lr:g}")
        return "trainable: " + "; ".join(parts)


def adapter_targets(pipe: StableDiffusionXLPipeline, config: Config) -> dict[str, list[str]]:
    """The modules that get adapters, per trained component (before any is attached)."""
    targets = {}
    for name in config.trained_components():
        module = getattr(pipe, name)
        found = (unet_target_modules(module, config.adapter.targets) if name == "unet"
                 else text_encoder_target_modules(module, config.adapter.targets))
        targets[name] = [target for target in found if not target.startswith(unused_prefixes(name, module))]
        if not targets[name]:  # only a list of patterns can select nothing (a preset always selects)
            raise ConfigError(f"adapter.targets: {json.dumps(config.adapter.targets)} selects no module of the {name}: "
                              "each pattern must match a Linear or Conv2d module's whole name (re.fullmatch), "
                              'e.g. ".*to_q" rather than "to_q"')
    return targets


def check_targets(config: Config) -> None:
    """The pre-flight's check that a list of patterns in `adapter.targets` selects modules (a
    ConfigError naming the key otherwise), on the model built on the meta device: before any weight
    is loaded, and in a dry run."""
    from .memory.architecture import PlanSkipped, meta_pipeline, read_architecture

    if config.adapter.type == "none" or not isinstance(config.adapter.targets, list):
        return
    try:
        pipe = meta_pipeline(read_architecture(config.model))
    except PlanSkipped:
        return  # checked by prepare_trainable once the model is loaded
    adapter_targets(pipe, config)


def prepare_trainable(pipe: StableDiffusionXLPipeline, config: Config, patterns: Patterns | None = None) -> Trainable:
    """Freeze everything, then attach adapters to (or unfreeze) the components the config trains
    (with `patterns`, modules keep ranks and alphas of their own: adapters.Patterns)."""
    model = config.model
    wanted = config.trained_components()
    targets = adapter_targets(pipe, config) if config.adapter.type != "none" else {}

    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        getattr(pipe, name).requires_grad_(False).eval()

    modules = {}
    for name in wanted:
        module = getattr(pipe, name)
        if config.adapter.type == "none":
            unused = unused_prefixes(name, module)
            module.requires_grad_(True)
            for param_name, param in module.named_parameters():
                if param_name.startswith(unused):
                    param.requires_grad_(False)
        else:
            attach_adapter(module, config.adapter, targets[name], (patterns or {}).get(name))
        if model.use_gradient_checkpointing:
            if name == "unet":
                module.enable_gradient_checkpointing()
            else:
                module.gradient_checkpointing_enable()
        module.train()
        modules[name] = module
    return Trainable(modules, wanted, config.adapter.type, config.adapter.loraplus_lr_ratio)


def unused_prefixes(name: str, module: torch.nn.Module) -> tuple[str, ...]:
    """Parameters SDXL never uses, so they get no gradient and are not trained: CLIP-L's last
    layer and final norm (SDXL reads its penultimate hidden state and no pooled output). Training
    them would waste memory, and under DDP an unused parameter is an error."""
    if name != "text_encoder":
        return ()
    last = module.config.num_hidden_layers - 1
    prefixes = []
    for candidate in ("text_model.", ""):
        if any(key.startswith(f"{candidate}encoder.layers.{last}.") for key, _ in module.named_parameters()):
            prefixes += [f"{candidate}encoder.layers.{last}.", f"{candidate}final_layer_norm."]
    return tuple(prefixes)
