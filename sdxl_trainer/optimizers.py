"""The optimizers users choose by name: 8-bit AdamW (bitsandbytes), AdamW, Adafactor, Prodigy,
schedule-free AdamW, Lion and 8-bit Lion (bitsandbytes) and CAME, each from its authors' package.

`optimizer.args` passes further keyword arguments, checked against the constructor. Schedule-free
AdamW keeps two sets of weights: the ones it trains (train mode) and their average (eval mode),
which is what eval images and the final outputs must use (`averaged_weights`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from typing import Any

from .config import ConfigError, OptimizerConfig, closest

# optimizer.type → (module, class, the pip package that provides it)
CLASSES = {
    "adamw": ("torch.optim", "AdamW", "torch"),
    "adamw8bit": ("bitsandbytes.optim", "AdamW8bit", "bitsandbytes"),
    "adafactor": ("transformers.optimization", "Adafactor", "transformers"),
    "prodigy": ("prodigyopt", "Prodigy", "prodigyopt"),
    "adamw_schedulefree": ("schedulefree", "AdamWScheduleFree", "schedulefree"),
    "lion": ("bitsandbytes.optim", "Lion", "bitsandbytes"),
    "lion8bit": ("bitsandbytes.optim", "Lion8bit", "bitsandbytes"),
    "came": ("came_pytorch", "CAME", "came-pytorch"),
}
ADAM_LIKE = {"adamw", "adamw8bit", "prodigy", "adamw_schedulefree"}
SET_BY_THE_TRAINER = {"self", "params", "lr"}  # the param groups carry training.lr_*
# Prodigy's authors' advice for diffusion models: without the bias correction its steps are up to
# 6.6x Adam's at the same rate, still 1.5x at step 600 (docs/training.md). optimizer.args overrides.
PRODIGY_SETTINGS = {"use_bias_correction": True, "safeguard_warmup": True}


def optimizer_class(kind: str) -> type:
    """The optimizer class; a missing package is a ConfigError with the command that installs it."""
    import importlib

    module, name, package = CLASSES[kind]
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        raise ConfigError(f'optimizer.type "{kind}" needs the package {package}: pip install {package} '
                          "(or pip install -r requirements-optimizers.txt)") from None


def check_optimizer(optimizer: OptimizerConfig) -> None:
    """The package is installed and every `optimizer.args` key is an argument of the constructor."""
    accepted = inspect.signature(optimizer_class(optimizer.type).__init__).parameters
    for key in optimizer.args:
        if key in SET_BY_THE_TRAINER:
            raise ConfigError(f"optimizer.args.{key} is set by the trainer (learning rates: training.lr_*)")
        if key not in accepted:
            match = closest(key, [name for name in accepted if name not in SET_BY_THE_TRAINER])
            raise ConfigError(f"optimizer.args.{key}: not an argument of {optimizer.type}"
                              + (f' (did you mean "{match}"?)' if match else "")
                              + f"; it takes {', '.join(n for n in accepted if n not in SET_BY_THE_TRAINER)}")
        default, value = accepted[key].default, optimizer.args[key]
        if not fits_default(value, default):
            raise ConfigError(f"optimizer.args.{key} = {json.dumps(value)}: must be {kind_of(default)}, as "
                              f"{optimizer.type}'s default {default!r} is")


def fits_default(value: Any, default: Any) -> bool:
    """Whether a JSON value has the type of a constructor argument's default (a truthy string
    would otherwise switch on a boolean option). A default of None or none at all says nothing."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(default) and all(
            fits_default(item, expected) for item, expected in zip(value, default, strict=True))
    return True


def kind_of(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, (tuple, list)):
        return f"a list of {len(default)}: " + ", ".join(kind_of(item) for item in default)
    return {int: "an integer", float: "a number", str: "a string"}.get(type(default), "any value")


def make_optimizer(optimizer: OptimizerConfig, param_groups: list[dict[str, Any]], device: str = "cpu",
                   bf16_weights: bool = False, warmup_steps: int = 0):
    """Build the optimizer over param groups that each carry their own `lr`.

    bf16 weights get AdamW or Adafactor with stochastic rounding; 8-bit AdamW falls back to AdamW on
    Apple MPS, where bitsandbytes has no kernels (the fallback is printed). `warmup_steps` goes to the
    optimizer that warms up itself (schedule-free).
    """
    if bf16_weights and optimizer.type == "adamw":
        from .bf16_adamw import StochasticRoundingAdamW

        return StochasticRoundingAdamW(
            param_groups, betas=optimizer.betas, eps=optimizer.eps, weight_decay=optimizer.weight_decay
        )
    kind = optimizer.type
    if kind in ("adamw8bit", "lion8bit") and device == "mps":
        kind = "adamw" if kind == "adamw8bit" else "lion"
        print(f'warning: bitsandbytes has no 8-bit optimizers for Apple MPS; using optimizer.type "{kind}" instead')
    settings = own_defaults(optimizer, kind, warmup_steps)
    if kind == "came":  # it refuses to be built without a default rate; every group brings its own
        settings["lr"] = param_groups[0]["lr"]
    if bf16_weights:  # the config allows only AdamW (above) and Adafactor with bf16 weights
        from .bf16_adafactor import StochasticRoundingAdafactor

        return StochasticRoundingAdafactor(param_groups, **(settings | optimizer.args))
    return optimizer_class(kind)(param_groups, **(settings | optimizer.args))


def own_defaults(optimizer: OptimizerConfig, kind: str, warmup_steps: int) -> dict[str, Any]:
    """The keyword arguments this trainer sets for `kind` from the `optimizer` block."""
    settings: dict[str, Any] = {"weight_decay": optimizer.weight_decay}
    if kind in ADAM_LIKE:
        settings |= {"betas": optimizer.betas, "eps": optimizer.eps}
    if kind in ("lion", "lion8bit") and "betas" in optimizer.model_fields_set:
        settings["betas"] = optimizer.betas  # else Lion's own (0.9, 0.99): Adam's 0.999 is wrong for it
    if kind == "prodigy":
        settings |= PRODIGY_SETTINGS
    if kind == "adamw_schedulefree":
        settings["warmup_steps"] = warmup_steps
    if kind == "adafactor":  # fixed learning rates from the config, not Adafactor's relative step sizes
        settings |= {"scale_parameter": False, "relative_step": False, "warmup_init": False}
    return settings


def apply_configured_settings(optimizer: Any, scheduler: Any, configured: list[dict[str, Any]],
                              config: OptimizerConfig, names: list[str]) -> list[str]:
    """On resume, the config's learning rates and optimizer settings replace the checkpoint's.

    A restored optimizer state brings back the `lr`, `weight_decay`, betas… it was saved with, and
    the LR schedule its base rates; users lower a rate mid-run to tame a divergence, so what the
    config says now wins. `configured` are the param groups as built from the config (before the
    state was loaded). Only the keys the config sets are taken: an optimizer's own running values
    in its groups (Prodigy's d, schedule-free's weight sum) stay as restored. Every group's rate is
    then the schedule's for the step resumed at: a changed run length or schedule counts from the
    first step on (unchanged, it is the restored rate, computed alike). Returns one line per change,
    "name key: old → new".
    """
    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the LambdaLR
    keys = set(own_defaults(config, config.type, 0)) | set(config.args)
    keys.discard("warmup_steps")  # schedule-free's: restored with its own running values
    changes = []
    for index, (group, fresh, name) in enumerate(zip(optimizer.param_groups, configured, names, strict=True)):
        for key in sorted(keys & group.keys()):
            if group[key] != fresh[key]:
                changes.append(f"{name} {key}: {group[key]} → {fresh[key]}")
                group[key] = fresh[key]
        old_base, new_base = scheduler.base_lrs[index], fresh["initial_lr"]
        if old_base != new_base:
            changes.append(f"{name} learning rate: {old_base:g} → {new_base:g}")
            scheduler.base_lrs[index] = group["initial_lr"] = new_base
        group["lr"] = new_base * scheduler.lr_lambdas[index](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return changes


def step_sizes(optimizer: Any) -> list[float]:
    """Each param group's learning rate as the optimizer steps with it, for the progress bar and
    `lr/<component>`: Prodigy's rate multiplies its own estimated step size d, so its is d x rate
    (its estimate starts at d0 = 1e-6 and grows); every other optimizer's is the rate."""
    return [group["lr"] * group["d"] if "d_coef" in group else group["lr"] for group in optimizer.param_groups]


def is_schedule_free(optimizer: Any) -> bool:
    return hasattr(getattr(optimizer, "optimizer", optimizer), "eval") and \
        "ScheduleFree" in type(getattr(optimizer, "optimizer", optimizer)).__name__


@contextlib.contextmanager
def averaged_weights(optimizer: Any, parameters: list) -> Iterator[None]:
    """A schedule-free optimizer's averaged (eval-mode) weights in the model for the block; the
    training weights come back exactly afterwards (switching modes is a lerp, not exact in
    floats). Every process must enter it alike. Other optimizers: nothing happens."""
    if not is_schedule_free(optimizer):
        yield
        return
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    training_weights = [param.detach().clone() for param in parameters]
    inner.eval()
    try:
        yield
    finally:
        inner.train()
        with torch.no_grad():
            for param, saved in zip(parameters, training_weights, strict=True):
                param.copy_(saved)
