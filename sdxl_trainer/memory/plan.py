"""The memory plan: what a run needs on its device, known before a weight is loaded.

The plan runs the trainer's own setup on the meta device (shapes and dtypes, no memory, no
arithmetic), then the optimizer's first step (which creates its state) and the forward and
backward pass of a later step, and counts the live tensor bytes as they come and go
(`tracker.LiveBytes`). What it runs is what training runs: the precision plan's casts, peft's
adapters (or the unfrozen weights), gradient checkpointing, the optimizer's own state, the EMA
copy, the loss of a batch of the bucket with the largest step; then eval's largest UNet call (the CFG
batch of its largest batch of prompts) and one fp32 VAE decode. The peak is the largest number of
bytes alive at once.

Meta tensors have no autocast and no fused attention kernels, so `DeviceRules` does what the
device would do: it casts the inputs of the layers autocast runs in bf16/fp16 (and, on CUDA, those
it runs in fp32: GroupNorm, LayerNorm, softmax), keeping the casts of trained weights for the
autocast region as autocast does, and runs attention as the fused kernel does (output and
log-sum-exp, no score matrix) where the device would use one. Components kept off the device
during steps (the text cache's encoders, an EMA on the CPU) are not counted on a GPU. What the
tracer cannot see is added as documented constants (`CUDA_WORKSPACE_BYTES`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from .tracker import LiveBytes

if TYPE_CHECKING:
    from diffusers import StableDiffusionXLPipeline

    from ..config import Config
    from ..precision import PrecisionPlan
    from ..training_setup import Trainable

# cuBLAS and cuBLASLt workspaces, taken from the caching allocator on the first matmul of each
# stream (torch's default on Hopper: 32 MiB for cuBLAS, 1 MiB for cuBLASLt), which the tracer
# does not see.
CUDA_WORKSPACE_BYTES = 33 * 2**20
FLASH_BACKEND = 1  # torch._fused_sdp_choice's number for the flash kernel (CPU's flash_attention_for_cpu)
F = torch.nn.functional
CAPTION = "a photo of a red circle on a blue background"


@dataclass(frozen=True)
class StepShape:
    """One step of a run to plan: a batch of one bucket, and the largest eval image."""

    batch: int
    height: int  # pixels
    width: int
    eval_size: tuple[int, int] | None = None  # (height, width) of the largest eval image; None: no eval
    ddp: bool = False  # several processes under DDP (not FSDP): its reducer's gradient buckets
    eval_batch: int = 1  # the most prompts eval samples in one UNet call (eval.batch_size on kdiffusion)

    @classmethod
    def candidates(cls, data_plan, prompts, ddp: bool = False, eval_batch: int = 1) -> list[StepShape]:
        """The steps that can need the most memory: the bucket with the most pixels per step
        (batch x area; per_resolution_batch_sizes can give a smaller bucket the larger step), and
        the largest bucket when it differs (attention grows faster than its area)."""
        sizes = [(prompt.height, prompt.width) for prompt in prompts]
        largest_eval = max(sizes, key=lambda size: (size[0] * size[1], size)) if sizes else None
        steps = {(data_plan.batch_sizes[(width, height)], height, width) for width, height in set(data_plan.targets)}
        most_pixels = max(steps, key=lambda step: (step[0] * step[1] * step[2], step[2], step[1]))
        largest = max(steps, key=lambda step: (step[1] * step[2], step[2], step[1], step[0]))
        return [cls(*step, largest_eval, ddp, eval_batch) for step in dict.fromkeys((most_pixels, largest))]


@dataclass
class MemoryPlan:
    """Bytes on the device, by what holds them; `train_peak` and `eval_peak` include everything
    alive at that moment (weights, state and the step's activations)."""

    device: str
    shape: StepShape
    source: str  # where the layer shapes came from
    weights: dict[str, dict[str, int]] = field(default_factory=dict)  # component -> dtype -> bytes
    off_device: dict[str, int] = field(default_factory=dict)  # components kept off the device during steps
    trained: int = 0  # trained parameters beyond the weights (adapters; 0 for a full fine-tune)
    gradients: int = 0
    ddp_buckets: int = 0  # DDP's copy of the gradients, beside them (see `_ddp_buckets`)
    optimizer_state: int = 0
    ema: int = 0
    train_peak: int = 0
    eval_peak: int = 0
    workspace: int = 0  # what the device takes beside the traced tensors (CUDA: cuBLAS workspaces)

    @property
    def weight_bytes(self) -> int:
        return sum(sum(by_dtype.values()) for by_dtype in self.weights.values())

    @property
    def activations(self) -> int:
        """What the training peak holds beyond weights, trained parameters, gradients, optimizer
        state and EMA: the activations saved for backward and the temporaries of the moment."""
        held = self.weight_bytes + self.trained + self.gradients + self.ddp_buckets + self.optimizer_state + self.ema
        return self.train_peak - held

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.eval_peak) + self.workspace

    @property
    def peak_step(self) -> str:
        return "a training step (backward)" if self.train_peak >= self.eval_peak else "eval (UNet and VAE decode)"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peak": self.peak, "activations": self.activations}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MemoryPlan:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        shape = values.pop("shape")
        shape["eval_size"] = tuple(shape["eval_size"]) if shape["eval_size"] else None
        return cls(shape=StepShape(**shape), **values)


class DeviceRules(TorchFunctionMode):
    """What autocast and the attention kernels of `device` ("cuda" or "cpu") do, for a trace on
    meta tensors. The autocast region is torch's own (`torch.autocast("cpu")`, which meta tensors
    ignore): its state is read here, and gradient checkpointing restores it for the recompute."""

    LOWER: ClassVar = frozenset({
        F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose2d, torch.matmul, torch.Tensor.matmul,
        torch.Tensor.__matmul__, torch.bmm, torch.baddbmm, torch.mm, torch.addmm, torch.einsum, F.prelu})
    CUDA_FP32: ClassVar = frozenset({F.group_norm, F.layer_norm, F.softmax, F.log_softmax, torch.softmax,
                                     torch.Tensor.softmax})

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.cast_weights: dict[int, torch.Tensor] = {}  # autocast's cache: trained weights cast once per region
        self.in_backward = False
        self.handled = self.LOWER | {torch.Tensor.backward, F.scaled_dot_product_attention} | (
            self.CUDA_FP32 if device == "cuda" else frozenset())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.handled:  # most calls: shape reads, views, elementwise ops
            return func(*args, **kwargs)
        if func is torch.Tensor.backward:  # a scalar loss's: the engine runs with this mode active, so
            self.cast_weights.clear()       # that gradient checkpointing's recomputes follow the rules too
            loss = args[0]
            self.in_backward = True
            try:
                with self:
                    _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                                         accumulate_grad=True)
            finally:
                self.in_backward = False
            return None
        if not torch.is_autocast_enabled("cpu"):
            self.cast_weights.clear()
        elif func in self.LOWER:
            args, kwargs = self._cast((args, kwargs), torch.get_autocast_dtype("cpu"))
        elif func in self.CUDA_FP32:
            args, kwargs = self._cast((args, kwargs), torch.float32)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _cast(self, tree, dtype: torch.dtype):
        def cast(value):
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()) or value.dtype == dtype:
                return value
            # Autocast keeps its casts until its region ends; each recompute is a region of its own,
            # over before the backward pass goes on, so during backward nothing is kept.
            if value.is_leaf and value.requires_grad and not self.in_backward:
                key = id(value)
                if key not in self.cast_weights:
                    self.cast_weights[key] = value.to(dtype)
                return self.cast_weights[key]
            return value.to(dtype)
        return tree_map(cast, tree)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        """The fused kernel where the device takes one (it keeps the output and the log-sum-exp for
        backward), else the plain computation with its score matrix."""
        if torch.is_autocast_enabled("cpu"):
            query, key, value = self._cast((query, key, value), torch.get_autocast_dtype("cpu"))
        if self._fused(query, attn_mask, dropout_p):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)

    def _fused(self, query: torch.Tensor, attn_mask, dropout_p: float) -> bool:
        if self.device == "cuda":
            return query.dim() == 4
        probe = torch.zeros((1,) * query.dim(), dtype=query.dtype)  # the CPU's own choice, on a real tensor
        mask = None if attn_mask is None else torch.zeros((1,) * attn_mask.dim(), dtype=attn_mask.dtype)
        return torch._fused_sdp_choice(probe, probe, probe, mask, dropout_p) == FLASH_BACKEND


class PlannedCachedEncoder:
    """The text cache's stand-in during a plan: embeddings of the cached shapes and dtype, made
    on the spot (the cache holds one per caption; a batch moves them to the device)."""

    def __init__(self, encoder: torch.nn.Module, dtype: torch.dtype, length: int) -> None:
        self.hidden_size = encoder.config.hidden_size
        self.pooled_size = getattr(encoder.config, "projection_dim", None) if hasattr(encoder, "text_projection") \
            else None
        self.dtype, self.length = dtype, length

    def cached_outputs(self, captions: list[str], device) -> tuple[torch.Tensor, torch.Tensor | None]:
        count = len(captions)
        hidden = torch.zeros(count, self.length, self.hidden_size, dtype=self.dtype, device=device)
        pooled = torch.zeros(count, self.pooled_size, dtype=self.dtype, device=device) if self.pooled_size else None
        return hidden, pooled


def plan_memory(config: Config, shape: StepShape, device: str) -> MemoryPlan:
    """The plan for `config` at `shape` on a device of type `device` ("cuda", "cpu", "mps")."""
    from ..precision import audit, cast_trained_parameters, place_pipeline, plan_precision
    from ..training_setup import prepare_trainable
    from .architecture import PlanSkipped, meta_pipeline, read_architecture

    if not config.trained_components():
        raise PlanSkipped("textual inversion alone trains only its new embeddings, which the planner does not trace")
    architecture = read_architecture(config.model)
    precision = plan_precision(config, device, bf16_ok=True if device == "cuda" else None)
    traced = dataclasses.replace(precision, device="cpu")  # autocast("cpu") marks the region
    pipe = meta_pipeline(architecture)
    place_pipeline(pipe, traced, "meta")
    trainable = prepare_trainable(pipe, config)
    cast_trained_parameters(trainable.modules, traced)
    audit(pipe, traced, adapter=trainable.is_adapter)
    plan = MemoryPlan(device, shape, architecture.source)
    on_device = _count_weights(pipe, precision, plan)
    live = LiveBytes("meta")
    live.track(tensor for name in on_device for tensor in _tensors(getattr(pipe, name)))
    with live, DeviceRules("cuda" if device == "cuda" else "cpu"):
        buckets = _ddp_buckets(config, shape, trainable)
        plan.ddp_buckets = sum(bucket.nbytes for bucket in buckets)
        _trace_training(config, pipe, trainable, traced, plan, live)
        if shape.eval_size:
            _trace_eval(pipe, traced, shape, live)
            plan.eval_peak = live.peak
        del buckets
    plan.workspace = CUDA_WORKSPACE_BYTES if device == "cuda" else 0
    return plan


def _ddp_buckets(config: Config, shape: StepShape, trainable: Trainable) -> list[torch.Tensor]:
    """DDP's reducer (several processes): flat buckets as large as all the trained tensors (one per
    dtype here; torch cuts them into ~25 MB pieces), allocated when accelerate wraps the model and
    kept for its life, beside the gradients (accelerate's default `gradient_as_bucket_view=False`).
    Fused backward wraps nothing (it averages each gradient in its hook): none."""
    if not shape.ddp or config.optimizer.fused_backward:
        return []
    numel: dict[torch.dtype, int] = {}
    for param in trainable.parameters():
        numel[param.dtype] = numel.get(param.dtype, 0) + param.numel()
    return [torch.empty(count, dtype=dtype, device="meta") for dtype, count in numel.items()]


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _count_weights(pipe: StableDiffusionXLPipeline, precision: PrecisionPlan, plan: MemoryPlan) -> list[str]:
    """Weights by component and dtype, and the trained parameters an adapter adds; returns the
    components on the device during steps (the text cache's encoders are elsewhere on a GPU)."""
    from ..precision import adapter_tensor_ids

    on_device = []
    for name in precision.components:
        module = getattr(pipe, name)
        adapter = adapter_tensor_ids(module)
        by_dtype: dict[str, int] = {}
        for tensor in _tensors(module):
            if id(tensor) in adapter:
                plan.trained += tensor.numel() * tensor.element_size()
                continue
            dtype = str(tensor.dtype).removeprefix("torch.")
            by_dtype[dtype] = by_dtype.get(dtype, 0) + tensor.numel() * tensor.element_size()
        if name in precision.cached and precision.device != "cpu":
            plan.off_device[name] = sum(by_dtype.values())
        else:
            plan.weights[name] = by_dtype
            on_device.append(name)
    return on_device


def _trace_training(config: Config, pipe: StableDiffusionXLPipeline, trainable: Trainable, traced: PrecisionPlan,
                    plan: MemoryPlan, live: LiveBytes) -> None:
    """The optimizer's first step, on gradients of zeros (it creates the optimizer's state, and its
    temporaries are those of every step), then the forward and backward pass of a later step,
    which has that state, the gradients and the EMA alive beside its activations."""
    from ..diffusion import DrawSettings, LossModels, LossSettings, denoising_step, make_noise_scheduler, sample_draws
    from ..ema import EMA
    from ..fused_backward import FusedBackward
    from ..optimizers import is_schedule_free, make_optimizer
    from ..output_preservation import training_loss
    from ..precision import ENCODERS

    params = list(trainable.parameters())
    optimizer = make_optimizer(config.optimizer, trainable.param_groups(), plan.device,
                               traced.components["unet"].trained == "bf16")
    if is_schedule_free(optimizer):
        optimizer.train()  # as the trainer does: it steps only in train mode
    if plan.device == "cuda":  # torch's optimizers default to their multi-tensor (foreach) form on CUDA
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None:
                group["foreach"] = True
    fused = FusedBackward(optimizer, trainable.named_parameters()) \
        if config.optimizer.fused_backward else None
    sizes = [param.numel() * param.element_size() for param in params]
    if fused:  # one gradient at a time, each stepped and freed before the next exists
        for param in params:
            param.grad = torch.zeros_like(param)
            fused.step_tensor(param)
        fused.finish_step()
        plan.gradients = max(sizes)
    else:
        for param in params:
            param.grad = torch.zeros_like(param)
        plan.gradients = sum(sizes)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    plan.optimizer_state = _state_bytes(optimizer)
    ema = None
    if config.model.use_ema and (config.model.ema_device == "same" or plan.device == "cpu"):
        before = live.current
        ema = EMA(list(trainable.named_parameters()), config.model.ema_decay, "same")
        plan.ema = live.current - before
    scheduler = make_noise_scheduler(pipe.scheduler.config, config.training.prediction_type,
                                     config.training.zero_terminal_snr)
    length = pipe.tokenizer.model_max_length
    encoders = [PlannedCachedEncoder(getattr(pipe, name), traced.torch_dtype(traced.compute), length)
                if name in traced.cached else getattr(pipe, name) for name in ENCODERS]
    batch = _batch(plan.shape, pipe)
    draws = sample_draws(batch["keys"], 1, tuple(batch["latents"].shape),
                         DrawSettings.of(config.training, scheduler.config.num_train_timesteps))
    models = LossModels(pipe, pipe.unet, encoders)
    with traced.autocast():  # output preservation's two more UNet passes are part of the step
        step = denoising_step(models, scheduler, batch, draws, "meta", LossSettings.of(config.training, True))
        loss = training_loss(models, batch, step, config.training.output_preservation, 0,
                             list(trainable.modules.values()))
    loss.backward()  # with fused backward, each tensor's step and its gradient's release happen in here
    if fused:
        fused.finish_step()
        fused.remove()
    torch.nn.utils.get_total_norm([param.grad for param in params if param.grad is not None])
    plan.train_peak = live.peak
    del loss, ema


def _batch(shape: StepShape, pipe: StableDiffusionXLPipeline) -> dict[str, Any]:
    """A batch as the device sees it: fp32 latents (from the latent cache), captions, size ids."""
    sizes = torch.tensor([[shape.height, shape.width]] * shape.batch)
    latent_shape = (shape.batch, pipe.unet.config.in_channels, shape.height // 8, shape.width // 8)
    return {"latents": torch.zeros(latent_shape, device="meta"), "captions": [CAPTION] * shape.batch,
            "original_sizes": sizes, "crops_top_left": torch.zeros(shape.batch, 2, dtype=torch.long),
            "target_sizes": sizes, "keys": [(index, 0) for index in range(shape.batch)]}


def _state_bytes(optimizer) -> int:
    """The optimizer's own tensors (moments, factored statistics, 8-bit blocks), each storage once."""
    storages = {id(value.untyped_storage()): value.untyped_storage().nbytes()
                for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)}
    return sum(storages.values())


def _trace_eval(pipe: StableDiffusionXLPipeline, traced: PrecisionPlan, shape: StepShape, live: LiveBytes) -> None:
    """Eval's largest UNet call at the largest eval size: the CFG batch (each prompt of the largest
    eval batch and its negative), then the fp32 VAE decode of one image, with the training state
    still alive."""
    from ..conditioning import add_time_ids
    from ..eval.evaluation import fp32_vae

    height, width = shape.eval_size
    cfg_batch = 2 * shape.eval_batch
    live.reset_peak()
    unet, vae = pipe.unet, pipe.vae
    latents = torch.zeros(cfg_batch, unet.config.in_channels, height // 8, width // 8, device="meta")
    sizes = torch.tensor([[height, width]] * cfg_batch)
    text = torch.zeros(cfg_batch, pipe.tokenizer.model_max_length, unet.config.cross_attention_dim,
                       dtype=traced.torch_dtype(traced.compute), device="meta")
    pooled = torch.zeros(cfg_batch, pipe.text_encoder_2.config.projection_dim, dtype=text.dtype, device="meta")
    time_ids = add_time_ids(sizes, torch.zeros(cfg_batch, 2, dtype=torch.long), sizes).to("meta")
    with torch.no_grad():
        with traced.autocast():
            noise = unet(latents, torch.full((cfg_batch,), 999, device="meta"), encoder_hidden_states=text,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
        del noise
        image = fp32_vae(vae).decode(latents[:1] / vae.config.scaling_factor).sample
        del image
