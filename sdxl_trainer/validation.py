"""Validation loss: the same few batches, noise and timesteps at every live eval, so `val/loss`
is a smooth curve that shows whether the run still learns (the training loss is too noisy)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Spread over the schedule so that every noise level counts.
_TIMESTEP_FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass
class ValidationSet:
    batches: list[dict]
    noises: list[torch.Tensor]
    timesteps: list[torch.Tensor]
    seeds: list[int]


def make_validation_set(batches: list[dict], latent_shapes: list[tuple[int, ...]], num_train_timesteps: int,
                        seed: int) -> ValidationSet:
    """Fix noise and timesteps for each batch once, from `seed` (never from the global RNG)."""
    import torch

    noises, timesteps, seeds = [], [], []
    for index, shape in enumerate(latent_shapes):
        generator = torch.Generator().manual_seed(seed + index)
        noises.append(torch.randn(shape, generator=generator))
        count = shape[0]
        fractions = [_TIMESTEP_FRACTIONS[(index + i) % len(_TIMESTEP_FRACTIONS)] for i in range(count)]
        timesteps.append(torch.tensor([int(f * num_train_timesteps) for f in fractions]))
        seeds.append(seed + 1000 + index)
    return ValidationSet(batches, noises, timesteps, seeds)


def validation_loss(modules: list[torch.nn.Module], loss_fn: Callable[..., torch.Tensor],
                    validation: ValidationSet) -> float:
    """Mean loss over the fixed batches, in eval mode, without gradients; modes are restored."""
    import torch

    losses = []
    with _eval_mode(modules), torch.no_grad():
        for batch, noise, timesteps, seed in zip(validation.batches, validation.noises, validation.timesteps,
                                                 validation.seeds, strict=True):
            generator = torch.Generator().manual_seed(seed)  # the VAE posterior sample, when uncached
            losses.append(loss_fn(batch, noise=noise, timesteps=timesteps, generator=generator).item())
    return sum(losses) / len(losses)


@contextlib.contextmanager
def _eval_mode(modules: list[torch.nn.Module]) -> Iterator[None]:
    flags = [(sub, sub.training) for module in modules for sub in module.modules()]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for sub, training in flags:
            sub.training = training
