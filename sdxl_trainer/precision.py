"""The precision policy: decided once from the config and the device, printed as a table, and
audited after setup.

Rules, each from a post-mortem in the original tool's documents (docs/design.md, 'Precision
policy' and 'The original tool's NaN post-mortems'):
- The VAE runs in fp32 (an fp16 VAE overflows in its GroupNorms and decodes black images),
  unless `model.vae_fp16_safe` says the configured VAE was made for fp16.
- Trained parameters keep fp32 master weights (adapters, or fully trained modules), except a
  full fine-tune with `weights_dtype: "bf16"`, whose optimizer rounds stochastically.
- fp16 compute uses a grad scaler; the loss is always computed in fp32.
- Apple MPS never runs fp16 (it produces NaN and black images): it falls back to fp32.
- After setup every parameter and buffer is checked against the plan: a layer created after the
  cast (an fp32 `conv_in` created after `.half()` crashed the original tool) is caught with a
  clear message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .adapter_kinds import ADAPTER_KINDS

if TYPE_CHECKING:
    import torch

    from .config import Config

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ENCODERS = ("text_encoder", "text_encoder_2")

MPS_FP16_REFUSAL = (
    "fp16 on Apple MPS produces NaN during denoising and black images; "
    "training falls back to fp32"
)
FP16_DORA_WARNING = (
    "fp16 with DoRA is the known cause of NaN adapter weights and black images; bf16 (if the device "
    "supports it) or fp32 is safer. NaN losses are caught and nothing non-finite is saved."
)


@dataclass(frozen=True)
class ComponentPlan:
    storage: str  # dtype of the frozen weights ("fp32", "bf16", "fp16")
    trained: str | None  # dtype of trained parameters, None when the component is frozen
    quantized: str | None = None  # `model.base_quantization` of its base layers, None when not quantized

    @property
    def stored(self) -> str:
        """The table's weights column: e.g. `fp8+bf16` (the quantized layers, then the rest)."""
        short = {"float8_e4m3fn": "fp8"}.get(self.quantized, self.quantized)
        return f"{short}+{self.storage}" if self.quantized else self.storage


@dataclass(frozen=True)
class PrecisionPlan:
    device: str  # "cuda", "mps" or "cpu"
    compute: str  # autocast dtype, "fp32" means no autocast
    components: dict[str, ComponentPlan]
    warnings: tuple[str, ...] = ()
    cached: tuple[str, ...] = ()  # text encoders whose outputs come from the text cache (off the device)
    live_tokens: bool = False  # textual inversion: the cached encoders stay, for captions with new tokens

    @property
    def uses_grad_scaler(self) -> bool:
        return self.compute == "fp16"

    def autocast(self) -> torch.autocast:
        """The compute precision's autocast region (none for fp32)."""
        import torch

        return torch.autocast(self.device, dtype=self.torch_dtype(self.compute), enabled=self.compute != "fp32")

    def torch_dtype(self, name: str) -> torch.dtype:
        import torch

        return getattr(torch, DTYPE_NAMES[name])

    def table(self) -> str:
        lines = [f"precision: compute {self.compute} on {self.device}"
                 + (" with a grad scaler" if self.uses_grad_scaler else "") + "; loss in fp32",
                 "  component        weights   trained  compute  during steps"]
        for name, plan in self.components.items():
            compute = "fp32" if name == "vae" else self.compute
            place = "cpu (text cache)" if name in self.cached else self.device
            if name in self.cached and self.live_tokens:
                place = f"{self.device} (text cache; captions with new tokens live)"
            lines.append(f"  {name:<16} {plan.stored:<9} {plan.trained or '-':<8} {compute:<8} {place}")
        return "\n".join(lines + [f"  warning: {warning}" for warning in self.warnings])


def cached_encoders(config: Config) -> tuple[str, ...]:
    """The frozen encoders whose outputs this run reads from the text cache: none when the cache is
    off, or when caption shuffle draws a new order every epoch (those texts cannot be listed)."""
    data = config.data
    if not data.text_cache.enabled or data.shuffles_without_variants():
        return ()
    trained = (config.model.train_text_encoder_1, config.model.train_text_encoder_2)
    return tuple(name for name, is_trained in zip(ENCODERS, trained, strict=True) if not is_trained)


def bf16_supported(device: str) -> bool:
    import torch

    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device in ("cpu", "mps")


def plan_precision(config: Config, device: str, bf16_ok: bool | None = None) -> PrecisionPlan:
    """The plan for this config on this device type ("cuda", "mps", "cpu").

    `bf16_ok` overrides the device probe (for tests and for planning another machine's run).
    """
    warnings = []
    compute = config.precision
    if compute == "fp16" and device == "mps":
        warnings.append(MPS_FP16_REFUSAL)
        compute = "fp32"
    if compute == "bf16" and not (bf16_supported(device) if bf16_ok is None else bf16_ok):
        warnings.append(f"bf16 is not supported on this {device} device; training falls back to fp32")
        compute = "fp32"
    if compute == "no":
        compute = "fp32"
    kind = ADAPTER_KINDS.get(config.adapter.type)
    if compute == "fp16" and kind and kind.fp16_nan_risk:
        warnings.append(FP16_DORA_WARNING)

    from .quantized_base import quantized_components

    full = config.adapter.type == "none"
    quantized = quantized_components(config)
    trained_dtype = config.model.weights_dtype if full else "fp32"
    trained = {"unet": True, "text_encoder": config.model.train_text_encoder_1,
               "text_encoder_2": config.model.train_text_encoder_2}
    components = {}
    for name, is_trained in trained.items():
        if is_trained and full:
            components[name] = ComponentPlan(trained_dtype, trained_dtype)
        else:
            components[name] = ComponentPlan(compute, "fp32" if is_trained else None,
                                             config.model.base_quantization if name in quantized else None)
    components["vae"] = ComponentPlan(vae_dtype(config, compute), None)
    return PrecisionPlan(device, compute, components, tuple(warnings), cached_encoders(config),
                         bool(config.textual_inversion.tokens))


def vae_dtype(config: Config, compute: str) -> str:
    """The dtype the VAE is stored and runs in: fp32, or fp16 for a VAE made for it (`model.vae_fp16_safe`)."""
    return "fp16" if compute == "fp16" and config.model.vae_fp16_safe else "fp32"


def dtype_name(dtype: torch.dtype) -> str:
    """"fp32", "bf16" or "fp16" for a torch dtype."""
    import torch

    return next(name for name, attribute in DTYPE_NAMES.items() if getattr(torch, attribute) == dtype)


def place_pipeline(pipe, plan: PrecisionPlan, device) -> None:
    """Cast every component's weights to its planned storage dtype, quantize the planned base
    layers (before the move: a full-precision copy never reaches the device), move it there."""
    from diffusers.utils import logging as diffusers_logging

    from .quantized_base import quantize_components

    verbosity = diffusers_logging.get_verbosity()
    # diffusers warns about "modules that should be kept in float32" on every cast, even when the
    # list is empty; the audit below is the real check.
    diffusers_logging.set_verbosity_error()
    try:
        for name, component in plan.components.items():
            module = getattr(pipe, name)
            if module.dtype != plan.torch_dtype(component.storage):
                module.to(plan.torch_dtype(component.storage))
        quantized = tuple(name for name, component in plan.components.items() if component.quantized)
        if quantized:
            quantize_components(pipe, quantized, plan.components[quantized[0]].quantized, device)
        # (diffusers also warns that fp16 pipelines cannot run on the CPU: our CPU fp16 runs
        # autocast; frozen fp16 weights are only multiplied inside autocast regions.)
        pipe.to(device)
    finally:
        diffusers_logging.set_verbosity(verbosity)


def cast_trained_parameters(modules: dict[str, torch.nn.Module], plan: PrecisionPlan) -> None:
    """Give trained parameters (adapters created after the storage cast) their master dtype."""
    for name, module in modules.items():
        dtype = plan.torch_dtype(plan.components[name].trained)
        for param in module.parameters():
            if param.requires_grad:
                param.data = param.data.to(dtype)


class PrecisionAuditError(RuntimeError):
    """A parameter or buffer whose dtype disagrees with the plan."""


def adapter_tensor_ids(module: torch.nn.Module) -> set[int]:
    """The tensors (by `id`) of the peft adapters attached to `module`: the parameters and buffers
    held under each tuner layer's `adapter_layer_names` (LoRA's `lora_A`/`lora_B`/DoRA magnitudes,
    LoKr's `lokr_*`, LoHa's `hada_*`, and whatever kind peft adds), found by what the layer is,
    not by a name prefix."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = set()
    for layer in module.modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        for attribute in layer.adapter_layer_names:
            holder = getattr(layer, attribute, None)
            if isinstance(holder, torch.nn.Module):
                found.update(id(tensor) for tensor in [*holder.parameters(), *holder.buffers()])
    return found


def audit(pipe, plan: PrecisionPlan, adapter: bool) -> dict[str, int]:
    """Check every floating-point parameter and buffer against the plan; name what disagrees.

    Trained tensors are the adapter's (those of peft's tuner layers, `adapter_tensor_ids`) in
    adapter runs, and the parameters that require gradients of trained components in full runs;
    quantized base weights keep their own dtype (quantized_base.py); everything else must be in its
    component's storage dtype. Returns how many tensors were checked and how many were trained.
    """
    from .quantized_base import quantized_tensor_ids

    problems, counts = [], {"checked": 0, "trained": 0}
    for name, component in plan.components.items():
        module = getattr(pipe, name)
        storage = plan.torch_dtype(component.storage)
        adapter_ids = adapter_tensor_ids(module) if adapter else set()
        quantized_ids = quantized_tensor_ids(module)
        for tensor_name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            if adapter:
                trained = id(tensor) in adapter_ids
            else:
                trained = getattr(tensor, "requires_grad", False) and component.trained is not None
            counts["checked"] += 1
            counts["trained"] += bool(trained)
            expected = plan.torch_dtype(component.trained) if trained else storage
            expected = quantized_ids.get(id(tensor), expected)
            if tensor.dtype != expected:
                problems.append(f"{name}.{tensor_name} is {str(tensor.dtype).removeprefix('torch.')}, "
                                f"planned {str(expected).removeprefix('torch.')}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise PrecisionAuditError(
            f"precision audit failed ({len(problems)} tensor(s)): {shown}. A layer created or loaded after "
            "the dtype cast keeps its own dtype and breaks mixed precision."
        )
    return counts
