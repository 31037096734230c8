"""The memory plan in the pre-flight: made (or read from its cache) for the device the run will use,
described, set against the device's free memory, and, when it does not fit, the changes that
would make it fit, each with the saving a new plan computes for it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..atomic import OutputWriteError, write_json
from ..config import Config, ConfigError
from ..device_types import run_device_type
from ..distributed import fsdp_requested, local_device_index
from .plan import MemoryPlan, StepShape, plan_memory
from .watch import proc_bytes

if TYPE_CHECKING:
    from ..planning import RunPlan

PLAN_FORMAT = 3  # bump when the planner counts differently: cached plans are then made again


def size(count: int) -> str:
    """Bytes as GB (or MB below one GB: the tiny model's plans are a few tens of MB)."""
    return f"{count / 1e9:.2f} GB" if abs(count) >= 1e9 else f"{count / 1e6:.1f} MB"


@dataclass
class Remedy:
    """A change that would make a run fit, as config overrides, with its planned peak."""

    what: str
    changes: dict[str, Any]  # dotted config key -> value
    peak: int = 0


def free_memory(device: str) -> int | None:
    """Bytes free on the device now (CUDA: what the driver reports for this process's GPU, not
    cuda:0 for every process of a launch; CPU: MemAvailable)."""
    import torch

    if device == "cuda":
        return torch.cuda.mem_get_info(local_device_index(os.environ, torch.cuda.device_count()))[0]
    if device == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    return proc_bytes("/proc/meminfo", "MemAvailable")


def memory_preflight(config: Config, plan: RunPlan, dry_run: bool) -> tuple[MemoryPlan | None, str]:
    """The plan and its pre-flight lines; raises ConfigError when it does not fit and
    `training.memory_check` is "refuse"."""
    from ..eval.evaluation import largest_batch
    from .architecture import PlanSkipped

    check, device = config.training.memory_check, run_device_type()
    if check == "off" or (check == "auto" and device == "cpu" and not dry_run):
        return None, ""
    shapes = StepShape.candidates(plan.data, plan.prompts, plan.data.world_size > 1 and not fsdp_requested(os.environ),
                                  largest_batch(config.eval, plan.prompts))
    try:
        memory = max((cached_plan(config, shape, device) for shape in shapes), key=lambda planned: planned.peak)
    except PlanSkipped as exc:
        return None, f"memory plan: skipped ({exc}); the run itself is unaffected"
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:  # an operation the trace cannot run
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"memory plan: skipped (the trace failed: {reason}); the run itself is unaffected"
    shape = memory.shape
    lines = [describe(memory, config)]
    if dry_run:  # the other gradient-checkpointing setting, planned too (a second trace, once)
        other = not config.model.use_gradient_checkpointing
        flipped = cached_plan(_with_changes(config, {"model.use_gradient_checkpointing": other}), shape, device)
        lines.append(f"  with gradient checkpointing {'on' if other else 'off'}: activations "
                     f"{size(flipped.activations)}, peak {size(flipped.peak)}")
    if plan.data.world_size > 1:
        lines.append("  note: this is every process's peak (under DDP with its gradient buckets); under FSDP the "
                     "sharded weights, gradients and optimizer state are not divided among the processes in this plan")
    free = free_memory(device)
    if free is not None and memory.peak > free:
        remedies = ways_to_fit(config, shape, device, memory)
        message = (f"the planned peak of {size(memory.peak)} does not fit the {size(free)} free on this {device} "
                   "device; what would make it fit:" + "".join(
                       f"\n    - {remedy.what}: saves {size(memory.peak - remedy.peak)} (peak {size(remedy.peak)})"
                       for remedy in remedies))
        if check == "refuse":
            raise ConfigError(f"training.memory_check: {message}")
        lines.append(f"  warning: {message}")
    elif free is not None:
        lines.append(f"  fits: {size(free)} free on this {device} device")
    return memory, "\n".join(lines)


def describe(memory: MemoryPlan, config: Config) -> str:
    """The plan in a few lines: the peak and where it is reached, then what holds the memory."""
    shape = memory.shape
    weights = ", ".join(f"{name} {size(sum(by_dtype.values()))} "
                        f"{'/'.join(dtype for dtype in by_dtype if dtype != 'int64')}"
                        for name, by_dtype in memory.weights.items())
    lines = [f"memory plan ({memory.device}; batch {shape.batch} at {shape.width}x{shape.height}; shapes from "
             f"{memory.source}): peak {size(memory.peak)} in {memory.peak_step}",
             f"  weights {size(memory.weight_bytes)} ({weights})"]
    if memory.off_device:
        lines.append("  off the device during steps (text cache): " + ", ".join(
            f"{name} {size(count)}" for name, count in memory.off_device.items()))
    checkpointing = "on" if config.model.use_gradient_checkpointing else "off"
    buckets = f", DDP's gradient buckets {size(memory.ddp_buckets)}" if memory.ddp_buckets else ""
    lines.append(f"  trained {size(memory.trained)}, gradients {size(memory.gradients)}{buckets}, optimizer "
                 f"state {size(memory.optimizer_state)} ({config.optimizer.type}), EMA {size(memory.ema)}")
    lines.append(f"  activations and temporaries at the training peak {size(memory.activations)} "
                 f"(gradient checkpointing {checkpointing})")
    if shape.eval_size:
        lines.append(f"  eval peak {size(memory.eval_peak)} (UNet on the CFG batch of {2 * shape.eval_batch} at "
                     f"{shape.eval_size[1]}x{shape.eval_size[0]}, fp32 VAE decode)")
    if memory.workspace:
        lines.append(f"  cuBLAS workspaces {size(memory.workspace)}; the CUDA context (about 0.5 GB) is "
                     "outside torch's allocator and not in the plan")
    return "\n".join(lines)


def ways_to_fit(config: Config, shape: StepShape, device: str, memory: MemoryPlan) -> list[Remedy]:
    """The changes that lower the peak, each planned anew; most saving first."""
    remedies = []
    model, adapter = config.model, config.adapter
    if not model.use_gradient_checkpointing:
        remedies.append(Remedy("gradient checkpointing (model.use_gradient_checkpointing)",
                               {"model.use_gradient_checkpointing": True}))
    if shape.batch > 1:
        key = "data.bucket.batch_size" if config.data.bucket.enabled else "training.batch_size"
        remedies.append(Remedy(f"batch 1 with {shape.batch}x gradient accumulation ({key}=1, "
                               f"training.grad_accum_steps={shape.batch * config.training.grad_accum_steps})",
                               {"training.grad_accum_steps": shape.batch * config.training.grad_accum_steps}))
    if config.optimizer.type not in ("adamw8bit", "lion8bit", "adafactor"):
        remedies += [Remedy('8-bit AdamW (optimizer.type "adamw8bit")', {"optimizer.type": "adamw8bit"}),
                     Remedy('Adafactor (optimizer.type "adafactor")', {"optimizer.type": "adafactor"})]
    if fused_backward_fits(config):
        changes = {"optimizer.fused_backward": True, "training.max_grad_norm": None}
        without_clipping = "; without training.max_grad_norm" if config.training.max_grad_norm else ""
        remedies.append(Remedy(f"fused backward (optimizer.fused_backward{without_clipping})", changes))
    remedies += quantized_base_remedies(config, device)
    if not config.data.text_cache.enabled:
        remedies.append(Remedy("the text cache (data.text_cache.enabled)", {"data.text_cache.enabled": True}))
    for key in ("train_text_encoder_1", "train_text_encoder_2"):
        if getattr(model, key):
            remedies.append(Remedy(f"not training {key.removeprefix('train_')} (model.{key}=false)",
                                   {f"model.{key}": False}))
    if adapter.type != "none" and adapter.rank > 1:
        remedies.append(Remedy(f"rank {adapter.rank // 2} (adapter.rank)", {"adapter.rank": adapter.rank // 2}))
    for remedy in remedies:
        changed = _with_changes(config, remedy.changes)
        batch = 1 if "training.grad_accum_steps" in remedy.changes else shape.batch
        remedy.peak = cached_plan(changed, dataclasses.replace(shape, batch=batch), device).peak
    return sorted((r for r in remedies if r.peak < memory.peak), key=lambda r: r.peak)


def fused_backward_fits(config: Config) -> bool:
    """Whether fused backward is worth proposing: a full fine-tune (an adapter's gradients are small)
    whose other settings allow it, clipping aside (the proposal removes it)."""
    from ..config import FUSABLE_OPTIMIZERS

    training = config.training
    return (config.adapter.type == "none" and not config.optimizer.fused_backward
            and config.optimizer.type in FUSABLE_OPTIMIZERS and training.grad_accum_steps == 1
            and config.precision != "fp16" and training.nan_policy == "abort")


def quantized_base_remedies(config: Config, device: str) -> list[Remedy]:
    """An fp8 and an NF4 frozen base for an adapter run on a full-precision one, each where this
    device and the installed libraries run it (quantized_base.check_quantization decides)."""
    from ..quantized_base import FP8, check_quantization

    if config.adapter.type == "none" or config.model.base_quantization != "none":
        return []
    remedies = []
    for form, what in ((FP8, "an fp8 base"), ("nf4", "an NF4 base")):
        changes = {"model.base_quantization": form}
        try:
            check_quantization(_with_changes(config, changes), device)
        except ConfigError:
            continue
        remedies.append(Remedy(f'{what} under the adapter (model.base_quantization "{form}")', changes))
    return remedies


def _with_changes(config: Config, changes: dict[str, Any]) -> Config:
    from ..config import validate_config

    # The keys the user set, not every default: a default can contradict a set key (data.image_dir
    # beside data.subsets) and validation would refuse the config.
    data = config.model_dump(mode="json", by_alias=True, exclude_unset=True)
    for key, value in changes.items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    for index in (1, 2):
        if changes.get(f"model.train_text_encoder_{index}") is False:
            data.setdefault("training", {})[f"lr_text_encoder_{index}"] = None
    return validate_config(data)


def cached_plan(config: Config, shape: StepShape, device: str) -> MemoryPlan:
    """The plan, read from the cache when these inputs were planned before (a full-size plan
    traces for tens of seconds)."""
    from ..tiny_model import default_cache_dir

    path = default_cache_dir() / "memory_plans" / f"{plan_key(config, shape, device)}.json"
    try:
        return MemoryPlan.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    memory = plan_memory(config, shape, device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, memory.to_json())
    except (OSError, OutputWriteError):  # a read-only cache: the plan is still good
        pass
    return memory


def plan_key(config: Config, shape: StepShape, device: str) -> str:
    """What a plan depends on: the model's architecture, the training setup (what is trained, and
    output preservation's extra UNet passes), the shape, the device and the library versions that
    decide what a step allocates."""
    import diffusers
    import peft
    import torch

    from .architecture import read_architecture

    resolved = config.resolved()
    inputs = {
        "format": PLAN_FORMAT, "device": device, "shape": dataclasses.astuple(shape),
        "architecture": read_architecture(config.model).configs, "model": resolved["model"],
        "adapter": resolved["adapter"], "optimizer": resolved["optimizer"],
        "training": {key: resolved["training"][key]
                     for key in ("mixed_precision", "prediction_type", "output_preservation")},
        "trained": config.trained_components(), "textual_inversion": resolved["textual_inversion"],
        "text_cache": [config.data.text_cache.enabled, config.data.shuffles_without_variants()],
        "versions": [torch.__version__, diffusers.__version__, peft.__version__],
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:24]
