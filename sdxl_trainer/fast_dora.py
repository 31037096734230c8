"""DoRA at LoRA's speed: peft's DoRA function for Linear and Conv2d layers, with less work per step.

For a layer with weight W, bias b, adapter A (r × in), B (out × r), scaling s and magnitude m,
peft's DoRA (peft/tuners/lora/dora.py) computes

    n = ‖W + s·BA‖ per output channel (detached from the graph: DoRA paper §4.3),   k = m / n,
    out = result + (k − 1) ⊙ (result − b) + k ⊙ s·B(Ax)      (result = Wx + b, the base layer's output)

by pushing an identity matrix the size of the input through A and B to rebuild BA, forming W + s·BA,
and rescaling in five elementwise passes over the output, each kept for backward. Here the same
function takes one of two forms:

- large layers, or any layer under autocast or in 16-bit (`branch_forward`): out = k ⊙ (result − b
  + s·B(Ax)) + b, one add and one fused multiply-add (`lerp`) over the output, keeping only their sum
  for backward, and n from `weight_norm`'s factored form, which never forms W + s·BA;
- small fp32 Linear layers (`merged_forward`), where per-op overhead outweighs the arithmetic: one
  matmul with the rescaled weight k ⊙ (W + s·BA), whose row norms give n.

n is fp32 (fp64 for an fp64 layer) even under autocast, so the fp16 overflow that turned DoRA
adapters into NaN cannot happen. Autograd differentiates both forms: the same parameters get the
same gradients as with peft, to float rounding.

Only the variant's `forward` changes: peft's layers, parameters, state-dict keys, initialisation,
merging and unmerging stay peft's, so saving, loading, exports, EMA and DDP see the same model.
Layers where peft's DoRA takes another path (adapter dropout, bitsandbytes-quantized or offloaded
weights) keep peft's forward. An fp8 base layer (quantized_base.py) is fused: its `weight` is the
upcast weight its forward uses, so the norm here reads exactly that.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from peft.tuners.lora import variants
from peft.tuners.lora.layer import LoraLayer

from .device_types import autocast_device_type
from .quantized_base import is_upcast_layer

# Linear layers with at most this many weights use `merged_forward` in fp32: measured on the tiny
# model's CPU step (bench/bench_dora.py), where its few ops beat the branch form's many small ones.
# SDXL's smallest adapted layer has 320 × 320 weights, far above it.
MERGED_MAX_WEIGHTS = 1 << 15


def weight_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """‖W + s·BA‖ per row of W (out × in), for A (r × in) and B (out × r), without forming W + s·BA:
    ‖W_i‖² + s·B_i·(2·(WAᵀ)_i + s·(B·AAᵀ)_i), one read of W and out × r work."""
    cross = torch.addmm(weight @ lora_A.t(), lora_B, lora_A @ lora_A.t(), beta=2, alpha=scaling)
    squared = torch.linalg.vector_norm(weight, dim=1).square_()
    squared.add_(torch.linalg.vecdot(lora_B, cross), alpha=scaling)
    return squared.clamp_(min=0).sqrt_()


def dora_forward(module: LoraLayer, adapter: str, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """The layer's output `result` with the DoRA adapter applied: what peft's DoRA variant returns."""
    base, lora_A, lora_B = module.base_layer, module.lora_A[adapter], module.lora_B[adapter]
    magnitude, scaling = module.lora_magnitude_vector[adapter].weight, module.scaling[adapter]
    weight = base.weight
    # (under autocast a Linear's result is 16-bit, so this is fp32 compute only)
    if result.dtype == torch.float32 and weight.dim() == 2 and weight.numel() <= MERGED_MAX_WEIGHTS:
        return merged_forward(x, weight, base.bias, lora_A.weight, lora_B.weight, magnitude, scaling)
    return branch_forward(x, result, base, lora_A, lora_B, magnitude, scaling)


def merged_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                   lora_B: torch.Tensor, magnitude: torch.Tensor, scaling: float) -> torch.Tensor:
    """x·(k ⊙ (W + s·BA))ᵀ + b for a Linear layer (fp32 only: in 16 bits the small s·BA would be
    rounded away inside W + s·BA, where peft keeps it in its own branch)."""
    merged = torch.addmm(weight, lora_B, lora_A, alpha=scaling)
    scale = magnitude / torch.linalg.vector_norm(merged.detach(), dim=1)
    return torch.nn.functional.linear(x, merged * scale.unsqueeze(1), bias)


def branch_forward(x: torch.Tensor, result: torch.Tensor, base: torch.nn.Module, lora_A: torch.nn.Module,
                   lora_B: torch.nn.Module, magnitude: torch.Tensor, scaling: float) -> torch.Tensor:
    """k ⊙ (result − b + s·B(Ax)) + b, in fp32 (fp64 for an fp64 layer) as peft's; the layer casts
    it back to its output dtype."""
    dtype = torch.float64 if result.dtype == torch.float64 else torch.float32
    weight, down, up, bias = base.weight.detach(), lora_A.weight.detach(), lora_B.weight.detach(), base.bias
    if result.dim() == 4:  # Conv2d: a filter per row; magnitude (1, C, 1, 1) against outputs (N, C, H, W)
        weight, down, up = weight.flatten(1), down.flatten(1), up.flatten(1)
        bias = None if bias is None else bias.view(-1, 1, 1)
    autocast = autocast_device_type(x.device)
    with torch.autocast(autocast, enabled=False) if _autocast_on(autocast) else contextlib.nullcontext():
        norm = weight_norm(_as(weight, dtype), _as(down, dtype), _as(up, dtype), scaling)
    scale = _as(magnitude / norm.view(magnitude.shape), dtype)
    return _Rescale.apply(_as(result, dtype), lora_B(lora_A(x)), scale, None if bias is None else _as(bias, dtype),
                          scaling)


class _Rescale(torch.autograd.Function):
    """k ⊙ (result + s·lora − b) + b, for the output-sized `result` and `lora` and the per-channel
    `scale` k and `bias` b. Autograd's own ops would allocate three output-sized gradient buffers;
    this backward allocates one, for the product that k's gradient sums, and reuses it for the
    gradient of result and lora."""

    @staticmethod
    def forward(ctx: Any, result: torch.Tensor, lora: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                scaling: float) -> torch.Tensor:
        unscaled = torch.add(result, lora, alpha=scaling)
        ctx.save_for_backward(unscaled, scale, bias)
        ctx.scaling = scaling
        return unscaled * scale if bias is None else torch.lerp(bias, unscaled, scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        unscaled, scale, bias = ctx.saved_tensors
        grad_scale = None
        if ctx.needs_input_grad[2]:
            product = (unscaled * grad) if bias is None else torch.sub(unscaled, bias).mul_(grad)
            grad_scale = product.sum_to_size(scale.shape)
            # the product is dead once summed: the gradient below can take its memory
            grad_unscaled = torch.mul(grad, scale, out=product) if product.numel() > scale.numel() else grad * scale
        else:
            grad_unscaled = grad * scale
        grad_lora = grad_unscaled if ctx.scaling == 1 else grad_unscaled * ctx.scaling
        return grad_unscaled, grad_lora, grad_scale, None, None


def _autocast_on(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)` without a dispatch when it already is (this runs for every layer)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


class FastDoraLinearVariant(variants.DoraLinearVariant):
    """peft's DoRA for nn.Linear with `dora_forward` (initialisation and merging are peft's)."""

    @staticmethod
    def forward(module: LoraLayer, active_adapter: str, x: torch.Tensor, result: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:
        return dora_forward(module, active_adapter, x, result)


class FastDoraConv2dVariant(variants.DoraConv2dVariant):
    """peft's DoRA for nn.Conv2d with `dora_forward` (initialisation and merging are peft's)."""

    @staticmethod
    def forward(module: LoraLayer, active_adapter: str, x: torch.Tensor, result: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:
        return dora_forward(module, active_adapter, x, result)


FAST_VARIANTS: dict[type, type] = {
    variants.DoraLinearVariant: FastDoraLinearVariant,
    variants.DoraConv2dVariant: FastDoraConv2dVariant,
}


def fusable(layer: LoraLayer, adapter: str) -> bool:
    """Whether `dora_forward` is peft's function for this layer: peft takes another path with
    adapter dropout, dequantizes bitsandbytes weights, may offload to a GPU, and folds a lora_B bias
    into its norm; grouped convolutions have a B of another shape."""
    base = layer.base_layer
    return (
        isinstance(layer.lora_dropout[adapter], torch.nn.Identity)
        and not layer.ephemeral_gpu_offload
        and not getattr(layer, "fan_in_fan_out", False)
        and (is_upcast_layer(base) or (type(base) in (torch.nn.Linear, torch.nn.Conv2d)
                                        and type(base.weight) is torch.nn.Parameter))
        and layer.lora_B[adapter].bias is None
        and getattr(base, "groups", 1) == 1
    )


def use_fast_dora(module: torch.nn.Module) -> int:
    """Give every peft DoRA Linear/Conv2d layer of `module` that `fusable` accepts the fast forward;
    returns how many got it."""
    count = 0
    for layer in module.modules():
        if isinstance(layer, LoraLayer):
            for adapter, variant in layer.lora_variant.items():
                if type(variant) in FAST_VARIANTS and fusable(layer, adapter):
                    layer.lora_variant[adapter] = FAST_VARIANTS[type(variant)]()
                    count += 1
    return count
