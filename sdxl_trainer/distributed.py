"""What changes when `accelerate launch` shards the weights (FSDP) instead of copying them (DDP).

Under DDP every process holds the whole model, so the main process saves and evaluates its own
copy. Under FSDP (version 2) each process holds a slice of every trained weight and of the
optimizer state; the slices are gathered (all processes take part) into full tensors on the main
process, which then saves and evaluates a plain copy. Everything else (the training loop, the data
sharding, the NaN guard) is the same code for one process, DDP and FSDP.

Supported under FSDP: full fine-tuning of the UNet, bf16 or fp32, AdamW (fp32 or bf16 weights).
Other combinations are refused before any model is loaded, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from diffusers import StableDiffusionXLPipeline

    from .training_setup import Trainable

FSDP_HELP = "see docs/multi-gpu.md, 'Full fine-tuning sharded with FSDP'"


def check_launch(config: Config, environ: Mapping[str, str]) -> None:
    """Refuse, before loading anything, a sharded launch (set by `accelerate launch` in the
    environment) that this trainer does not support, naming what to change."""
    if environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError("DeepSpeed is not supported: use FSDP (fsdp_version: 2) for sharded full fine-tuning, "
                          f"or plain data parallel (accelerate launch --multi_gpu); {FSDP_HELP}")
    if not fsdp_requested(environ):
        return
    if environ.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(f"FSDP version {environ.get('FSDP_VERSION', '1')} is not supported: set fsdp_version: 2 "
                          f"in the accelerate config (or --fsdp_version 2); {FSDP_HELP}")
    refusals = {
        "adapter.type": (config.adapter.type != "none",
                         "FSDP is for full fine-tuning (adapter.type \"none\"); adapters are small: train them "
                         "with plain data parallel (accelerate launch --multi_gpu)"),
        "model.train_text_encoder_1": (config.model.train_text_encoder_1, "FSDP trains the UNet only"),
        "model.train_text_encoder_2": (config.model.train_text_encoder_2, "FSDP trains the UNet only"),
        "model.use_ema": (config.model.use_ema, "EMA of sharded weights is not built"),
        "model.use_torch_compile": (config.model.use_torch_compile,
                                    "compile through accelerate's dynamo_backend setting instead"),
        "training.mixed_precision": (config.precision == "fp16",
                                     "fp16 needs a grad scaler that agrees across shards; use bf16"),
        "optimizer.fused_backward": (config.optimizer.fused_backward,
                                     "each process holds a slice of a gradient, complete only after the "
                                     "reduce-scatter that follows the hook; use plain data parallel "
                                     "(accelerate launch --multi_gpu) or one process"),
        "optimizer.type": (config.optimizer.type != "adamw",
                           "only adamw is known to step sharded tensors (8-bit AdamW and Adafactor cannot; CAME, "
                           "Lion, Prodigy and schedule-free AdamW are untested with them); use adamw"),
    }
    wrong = [f"{key} ({reason})" for key, (refused, reason) in refusals.items() if refused]
    if wrong:
        raise ConfigError(f"under FSDP: {'; '.join(wrong)}; {FSDP_HELP}")


def fsdp_requested(environ: Mapping[str, str]) -> bool:
    """Whether `accelerate launch` was asked for FSDP (before the Accelerator exists)."""
    return environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def local_device_index(environ: Mapping[str, str], device_count: int) -> int:
    """This process's GPU before the Accelerator exists, as accelerate picks it (PartialState.
    set_device): LOCAL_RANK modulo the visible devices; 0 for a single process."""
    return int(environ.get("LOCAL_RANK", 0)) % max(device_count, 1)


def is_sharded(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type.value == "FSDP"


def describe_sharding(accelerator: Accelerator, trainable: Trainable) -> str:
    """What each process holds of the trained weights (and so of their gradients and optimizer
    state), counted from the shards themselves: proof that the weights really are split."""
    local = sum(local_tensor(p).numel() for p in trainable.parameters())
    total = sum(p.numel() for p in trainable.parameters())
    return (f"FSDP: each of {accelerator.num_processes} processes holds {local / 1e6:.2f}M of the "
            f"{total / 1e6:.2f}M trained parameters ({local / total:.0%}), their gradients and optimizer state")


def check_finite_everywhere(accelerator: Accelerator, trainable: Trainable) -> None:
    """Raise NonFiniteWeightsError in every process when a trained weight holds NaN/Inf in any.
    Each process checks what it holds (a whole copy under DDP, its slices under FSDP); together
    they stop instead of waiting for a main process that refused to save."""
    from accelerate.utils import gather_object

    from .finite import NonFiniteWeightsError, non_finite_names

    bad = non_finite_names((name, local_tensor(param)) for name, param in trainable.named_parameters())
    if accelerator.num_processes > 1:
        bad = sorted({name for names in gather_object([bad]) for name in names})
    if bad:
        raise NonFiniteWeightsError.for_tensors(bad)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's slice of a sharded tensor (sharing its storage); any other tensor as is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded result (a DTensor, e.g. the gradient norm under FSDP) as an ordinary tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def optimizer_state(accelerator: Accelerator, model: torch.nn.Module | None, optimizer) -> dict[str, Any]:
    """The optimizer state to save: under FSDP gathered whole (every process must call this);
    otherwise the main process's own, which is the whole state."""
    if not is_sharded(accelerator):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer.optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(accelerator: Accelerator, model: torch.nn.Module | None, optimizer,
                         state: dict[str, Any]) -> None:
    """Restore a saved (whole) optimizer state; under FSDP each process keeps its own slice."""
    if not is_sharded(accelerator):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer.optimizer, keyed_by_name(state, model),
                             options=StateDictOptions(full_state_dict=True))


def keyed_by_name(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """An optimizer state saved without sharding keys parameters by position; the sharded
    loader wants their names (as it saves them), so a run can move from one GPU to FSDP."""
    if all(isinstance(key, str) for group in state["param_groups"] for key in group["params"]):
        return state
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                         for group in state["param_groups"]],
    }


def gather_pipeline(accelerator: Accelerator, pipe: StableDiffusionXLPipeline, trainable: Trainable,
                    device: str | torch.device = "cpu") -> StableDiffusionXLPipeline | None:
    """The pipeline with whole trained weights, to save or evaluate on the main process.

    Without sharding that is `pipe` itself. Under FSDP every process must call this: the trained
    components' slices are gathered, and the main process gets a new pipeline sharing the frozen
    components and holding plain copies of the trained ones on `device` (the CPU is enough for
    saving; eval wants the training device). Other processes get None.
    """
    if not is_sharded(accelerator):
        return pipe
    from accelerate import init_empty_weights
    from torch.distributed.fsdp import FSDPModule

    from .models import with_components

    states = {name: accelerator.get_state_dict(module) for name, module in trainable.modules.items()}
    if not accelerator.is_main_process:
        return None
    plain = {}
    for name, sharded in trainable.modules.items():
        cls = next(c for c in type(sharded).__mro__ if not issubclass(c, FSDPModule))  # fully_shard's subclass
        with init_empty_weights(include_buffers=False):
            module = cls.from_config(sharded.config)
        module.load_state_dict(states[name], assign=True)
        trained = {param_name for param_name, param in sharded.named_parameters() if param.requires_grad}
        for param_name, param in module.named_parameters():
            param.requires_grad_(param_name in trained)
        plain[name] = module.to(device).eval()
    return with_components(pipe, **plain)
