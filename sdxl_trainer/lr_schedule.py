"""The learning-rate factor per optimizer step (the original tool's `lr_scheduler` block and its
legacy `lr_warmup_steps`), applied to every param group through torch's LambdaLR.

Warmup goes linearly from 0 to 1 over `warmup_steps`; after it the factor stays 1 (`constant`),
falls linearly (`linear_decay`) or along a half cosine (`cosine_decay`) to `min_factor` at the last
step, or runs SGDR cycles (`cosine_restarts`): cycle i lasts cycle_steps · cycle_mult^i steps and
falls from 1 to `min_factor` along a half cosine.
"""

from __future__ import annotations

import math

from .config import LRSchedulerConfig, TrainingConfig


def schedule_settings(training: TrainingConfig) -> LRSchedulerConfig:
    """The `lr_scheduler` block, or the legacy constant schedule with `lr_warmup_steps`."""
    return training.lr_scheduler or LRSchedulerConfig(type="constant", warmup_steps=training.lr_warmup_steps)


def lr_factor(step: int, schedule: LRSchedulerConfig, total_steps: int) -> float:
    """The factor for optimizer step `step` (0-based) of a run of `total_steps` steps."""
    if step < schedule.warmup_steps:
        return step / schedule.warmup_steps
    if schedule.type == "constant":
        return 1.0
    low = schedule.min_factor
    elapsed = step - schedule.warmup_steps
    if schedule.type == "cosine_restarts":
        length = float(schedule.cycle_steps)
        while elapsed >= length:
            elapsed -= length
            length *= schedule.cycle_mult
        progress = elapsed / length
    else:
        progress = min(1.0, elapsed / max(1, total_steps - schedule.warmup_steps))
    if schedule.type == "linear_decay":
        return 1.0 - (1.0 - low) * progress
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_lr_scheduler(optimizer, training: TrainingConfig, total_steps: int, optimizer_warms_up: bool = False):
    """A LambdaLR whose factor follows the configured schedule (its state resumes exactly);
    without the warmup when the optimizer does it itself (schedule-free)."""
    from torch.optim.lr_scheduler import LambdaLR

    schedule = schedule_settings(training)
    if optimizer_warms_up:
        schedule = schedule.model_copy(update={"warmup_steps": 0})
    return LambdaLR(optimizer, lambda step: lr_factor(step, schedule, total_steps))
