"""Validation loss: the same few batches, noise and timesteps at every live eval, so `val/loss`
is a smooth curve that shows whether the run still learns (the training loss is too noisy)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..diffusion import Draws
from ..module_modes import eval_mode

if TYPE_CHECKING:
    import torch

# Spread over the schedule so that every noise level counts.
_TIMESTEP_FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass
class ValidationSet:
    batches: list[dict]
    draws: list[Draws]


def make_validation_set(batches: list[dict], latent_shapes: list[tuple[int, ...]], num_train_timesteps: int,
                        seed: int) -> ValidationSet:
    """Fix the draws of each batch once, from `seed` (never from the global RNG)."""
    import torch

    draws = []
    for index, shape in enumerate(latent_shapes):
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed + index))
        count = shape[0]
        fractions = [_TIMESTEP_FRACTIONS[(index + i) % len(_TIMESTEP_FRACTIONS)] for i in range(count)]
        timesteps = torch.tensor([int(f * num_train_timesteps) for f in fractions])
        # The VAE posterior sample, when the latents are not cached.
        posterior_noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1000 + index))
        draws.append(Draws(noise, timesteps, posterior_noise))
    return ValidationSet(batches, draws)


def validation_loss(modules: list[torch.nn.Module], loss_fn: Callable[[dict, Draws], torch.Tensor],
                    validation: ValidationSet) -> float:
    """Mean loss over the fixed batches, in eval mode, without gradients; modes are restored."""
    import torch

    losses = []
    with eval_mode(modules), torch.no_grad():
        for batch, draws in zip(validation.batches, validation.draws, strict=True):
            losses.append(loss_fn(batch, draws).item())
    return sum(losses) / len(losses)
