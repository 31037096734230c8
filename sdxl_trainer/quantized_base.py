"""A quantized frozen base under adapters (`model.base_quantization`): the base weights of the UNet
(and, on request, the text encoders) are stored in fewer bits, so that SDXL adapter training fits
6-8 GB GPUs (docs/memory.md, 'Smaller GPUs: a quantized base').

- `float8_e4m3fn` (kohya's `--fp8_base`) and `int8` (one fp32 scale per output channel, absmax /
  127, round to nearest: bitsandbytes' vector-wise scheme), for every Linear and Conv2d: torch
  stores them (`UpcastLayer`) and each layer dequantizes its weight to the compute dtype when it
  runs (fp8 exactly: every fp8 value is a bf16/fp16/fp32 value). The layer's `weight` attribute
  is that dequantized weight, so whatever reads it (peft's DoRA, the fast DoRA norm) reads the
  weight the forward uses; backward dequantizes again instead of keeping a compute-dtype copy.
  (bitsandbytes' own Linear8bitLt is not used: under peft's DoRA on the CPU it loses its scales
  after the first step, and on the CPU it trains by dequantizing anyway.)
- `nf4`: bitsandbytes' `Linear4bit` (4-bit NormalFloat, blocks of 64, double-quantized absmax)
  for every Linear layer; peft wraps it with its own LoRA/DoRA layer, which dequantizes for the
  DoRA norm. Convolutions stay in the compute dtype (bitsandbytes has no 4-bit convolution).

The quantization is deterministic (round to nearest), so a resumed run rebuilds the same base.
On the meta device (the memory plan) NF4 layers are stand-ins holding their packed bytes, since
bitsandbytes quantizes only real tensors.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch

from .config import ConfigError
from .device_types import autocast_device_type, run_device_type

if TYPE_CHECKING:
    from .config import Config

FP8 = "float8_e4m3fn"
UPCAST_FORMATS = (FP8, "int8")  # stored by torch, dequantized by this module
BITSANDBYTES_DEVICES = ("cpu", "cuda")  # where bitsandbytes' NF4 kernels run (not MPS)
NF4_BLOCK = 64  # weights per absmax (bitsandbytes' default blocksize)
NF4_NESTED_BLOCK = 256  # absmax values per second-level scale (compress_statistics)


def quantized_components(config: Config) -> tuple[str, ...]:
    """The components whose base weights this run quantizes."""
    model = config.model
    if model.base_quantization == "none":
        return ()
    return ("unet", "text_encoder", "text_encoder_2") if model.base_quantization_text_encoders else ("unet",)


def check_quantization(config: Config, device_type: str | None = None) -> None:
    """Refuse, before any weight is loaded, what cannot hold: a full fine-tune of a quantized
    component, a device the format does not run on (`device_type`, by default the run's), a
    format the installed library lacks."""
    form = config.model.base_quantization
    if form == "none":
        return
    device_type = device_type or run_device_type()
    key = "model.base_quantization"
    fully_trained = {"unet": True, "text_encoder": config.model.train_text_encoder_1,
                     "text_encoder_2": config.model.train_text_encoder_2}
    if config.adapter.type == "none":
        trained = [name for name in quantized_components(config) if fully_trained[name]]
        raise ConfigError(f'{key} = "{form}": quantizes frozen base weights under adapters, but adapter.type is '
                          f'"none" (a full fine-tune of {", ".join(trained)}); pick an adapter or "none" here')
    if form == FP8 and device_type == "mps":
        raise ConfigError(f'{key} = "{form}": Apple MPS has no float8 tensors; use "none" on this device')
    if form == "nf4":
        if device_type not in BITSANDBYTES_DEVICES:
            raise ConfigError(f'{key} = "{form}": bitsandbytes runs it on {" and ".join(BITSANDBYTES_DEVICES)}, '
                              f'not on {device_type}; use "none" on this device')
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as error:
            raise ConfigError(f'{key} = "{form}": needs bitsandbytes, which does not import here ({error}); '
                              "pip install bitsandbytes, or use float8_e4m3fn") from None


def quantize_components(pipe: Any, names: tuple[str, ...], form: str, device) -> int:
    """Quantize the Linear (fp8, int8: and Conv2d) layers of these components of `pipe` in place, on
    `device`; returns how many layers were quantized. Call it after the storage cast and before
    adapters are attached, so that peft wraps the quantized layers."""
    count = 0
    for name in names:
        count += quantize_module(getattr(pipe, name), form, torch.device(device))
    return count


def quantize_module(module: torch.nn.Module, form: str, device: torch.device) -> int:
    """Replace the Linear (fp8, int8: and Conv2d) layers of `module` with their quantized form."""
    chosen = [(name, layer) for name, layer in module.named_modules()
              if type(layer) is torch.nn.Linear or (form in UPCAST_FORMATS and type(layer) is torch.nn.Conv2d)]
    for name, layer in chosen:
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, quantized_layer(layer, form, device))
    return len(chosen)


def quantized_layer(layer: torch.nn.Module, form: str, device: torch.device) -> torch.nn.Module:
    if form in UPCAST_FORMATS:
        return UpcastLayer.convert(layer, form, device)
    if device.type == "meta":
        return Nf4PlanStandIn.convert(layer)
    return _bitsandbytes_nf4(layer, device)


def _bitsandbytes_nf4(layer: torch.nn.Linear, device: torch.device) -> torch.nn.Module:
    """bitsandbytes' Linear4bit for `layer`, quantized on `device` (it quantizes when moved there)."""
    import bitsandbytes as bnb

    weight = layer.weight.detach()
    bias = layer.bias is not None
    quantized = _nf4_linear_class()(layer.in_features, layer.out_features, bias=bias, compute_dtype=weight.dtype,
                                  quant_type="nf4", compress_statistics=True, device="meta")
    quantized.weight = bnb.nn.Params4bit(weight.to("cpu", copy=True), requires_grad=False, quant_type="nf4",
                                         compress_statistics=True, blocksize=NF4_BLOCK)
    if bias:
        quantized.bias = torch.nn.Parameter(layer.bias.detach().to("cpu"), requires_grad=False)
    # On CPUs with AVX512-BF16, bitsandbytes repacks the weight for a faster path when the layer
    # runs without gradients (eval). That path fails for layers narrower than a block (the tiny
    # model's 32-wide ones) and computes otherwise than training does: keep the one path.
    quantized.support_avx512bf16_for_cpu = False
    return quantized.to(device).requires_grad_(False).train(layer.training)


@functools.cache
def _nf4_linear_class() -> type:
    import bitsandbytes as bnb

    class Nf4Linear(bnb.nn.Linear4bit):
        """bitsandbytes' Linear4bit, computing in autocast's dtype as a Linear does under autocast
        (bitsandbytes returns the input's dtype, which mixes dtypes in the next GroupNorm)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.to(_compute_dtype(x, self.compute_dtype)))

    return Nf4Linear


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest with one fp32 scale per output channel (absmax / 127, bitsandbytes'
    vector-wise scheme): the int8 values and the scales, shaped to broadcast over the weight."""
    rows = weight.detach().float().flatten(1)
    scale = rows.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float32).tiny).div_(127)
    values = torch.round(rows / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    shape = (-1,) + (1,) * (weight.dim() - 1)
    return values.view_as(weight), scale.view(shape)


class _UpcastForward(torch.autograd.Function):
    """The layer's function with its frozen weight dequantized for the moment: backward
    dequantizes again rather than keeping the compute-dtype copy (which autograd would keep)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: UpcastLayer, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.layer, ctx.input_shape = layer, x.shape
        return layer.apply_weight(x, layer.dequantize(x.dtype), bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        layer = ctx.layer
        weight = layer.dequantize(grad.dtype)
        if isinstance(layer, torch.nn.Conv2d):
            return torch.nn.grad.conv2d_input(ctx.input_shape, weight, grad, layer.stride, layer.padding,
                                              layer.dilation, layer.groups), None, None
        return grad @ weight, None, None


class UpcastLayer:
    """Mixin for a Linear or Conv2d whose weight is stored quantized (the buffer `weight_quantized`,
    with the per-channel `weight_scale` for int8) and read as `weight`, dequantized to
    `compute_dtype` (the dtype the weight had before). One built by its class's constructor is a
    plain layer: peft builds a Conv2d's adapter layers as `type(base_layer)(...)`."""

    compute_dtype: torch.dtype

    @property
    def weight(self) -> torch.Tensor:
        if "weight_quantized" in self._buffers:
            return self.dequantize(self.compute_dtype)
        if "weight" in self._parameters:
            return self._parameters["weight"]
        raise AttributeError("weight")  # (while the constructor registers it)

    @property
    def is_plain(self) -> bool:
        return "weight" in self._parameters

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the forward uses, in `dtype`: fp8 upcast exactly, int8 times its scale."""
        stored, scale = self._buffers["weight_quantized"], self._buffers.get("weight_scale")
        if scale is None:
            return stored.to(dtype)
        return (stored.to(torch.float32) * scale).to(dtype)

    @classmethod
    def convert(cls, layer: torch.nn.Module, form: str, device: torch.device) -> torch.nn.Module:
        """`layer` itself, now quantized (same hooks, names, flags and bias)."""
        weight = layer._parameters.pop("weight").detach()
        layer.__class__ = UpcastLinear if isinstance(layer, torch.nn.Linear) else UpcastConv2d
        layer.compute_dtype = weight.dtype
        if form == FP8:
            layer.register_buffer("weight_quantized", weight.to(torch.float8_e4m3fn))
        else:
            values, scale = quantize_int8(weight)
            layer.register_buffer("weight_quantized", values)
            layer.register_buffer("weight_scale", scale)
        return layer.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_plain:
            return self.plain_forward(x)
        dtype = _compute_dtype(x, self.compute_dtype)
        return _UpcastForward.apply(x.to(dtype), self, _cast(self.bias, dtype))


class UpcastLinear(UpcastLayer, torch.nn.Linear):
    """An nn.Linear with a quantized weight (peft sees an nn.Linear and wraps it as one)."""

    plain_forward = torch.nn.Linear.forward

    def apply_weight(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)


class UpcastConv2d(UpcastLayer, torch.nn.Conv2d):
    """An nn.Conv2d with a quantized weight."""

    plain_forward = torch.nn.Conv2d.forward

    def apply_weight(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._conv_forward(x, weight, bias)


class Nf4PlanStandIn(UpcastLinear):
    """The memory plan's NF4 Linear on the meta device (bitsandbytes quantizes only real tensors):
    a uint8 buffer of the bytes bitsandbytes stores (`packed_bytes`), dequantized to the compute
    dtype for the matmul as bitsandbytes does, and again in backward."""

    @classmethod
    def convert(cls, layer: torch.nn.Module) -> torch.nn.Module:
        weight = layer._parameters.pop("weight").detach()
        layer.__class__ = cls
        layer.compute_dtype, layer.weight_shape = weight.dtype, weight.shape
        layer.register_buffer("weight_quantized", torch.empty(packed_bytes(weight.numel()), dtype=torch.uint8,
                                                              device="meta"))
        return layer

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.weight_shape, dtype=dtype, device="meta")


def packed_bytes(weights: int) -> int:
    """Bytes bitsandbytes stores for an NF4 weight of `weights` numbers: half a byte a weight, a
    uint8 absmax a block of 64, and an fp32 scale a block of 256 absmax values (plus their mean)."""
    blocks = math.ceil(weights / NF4_BLOCK)
    return math.ceil(weights / 2) + blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + 4


def is_upcast_layer(layer: torch.nn.Module) -> bool:
    """Whether `layer` is an fp8/int8 layer (fast DoRA computes with its dequantized `weight`)."""
    return type(layer) in (UpcastLinear, UpcastConv2d) and not layer.is_plain


def quantized_tensor_ids(module: torch.nn.Module) -> dict[int, torch.dtype]:
    """The stored quantized weights of `module` and their scales, with the dtype each has."""
    layers = [layer for layer in module.modules() if isinstance(layer, UpcastLayer) and not layer.is_plain]
    return {id(tensor): tensor.dtype for layer in layers for tensor in layer.buffers(recurse=False)}


def _compute_dtype(x: torch.Tensor, stored_as: torch.dtype) -> torch.dtype:
    """The dtype the layer computes in: autocast's where autocast runs this layer, else the dtype
    the weight had before it was quantized (as a plain layer in that dtype would)."""
    device_type = autocast_device_type(x.device)
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return stored_as


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


def full_precision_pipeline(config: Config, pipe: Any, trained: dict[str, torch.nn.Module]) -> tuple[Any, dict]:
    """The base model re-read from `model.id` in full precision on the CPU, with copies of the
    trained adapters attached to the same layers: what the merged single file merges into (a
    quantized base merged into would bake its rounding error into every weight)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from .models import load_pipeline

    base = load_pipeline(config.model)
    base.scheduler = pipe.scheduler  # says what was trained (prediction type, zero terminal SNR)
    copies = {}
    for name, module in trained.items():
        fresh = getattr(base, name)
        fresh.add_adapter(module.peft_config["default"])
        state = {key: tensor.detach().to("cpu", torch.float32)
                 for key, tensor in get_peft_model_state_dict(module).items()}
        result = set_peft_model_state_dict(fresh, state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{name}: the full-precision base does not take adapter keys {result.unexpected_keys[:3]}")
        copies[name] = fresh
    return base, copies
