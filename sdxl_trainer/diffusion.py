"""Noise, timesteps and training targets (DDPM forward process, epsilon or v-prediction)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from diffusers import DDPMScheduler


def make_noise_scheduler(
    scheduler_config: dict[str, Any], prediction_type: str | None, zero_terminal_snr: bool
) -> DDPMScheduler:
    """A DDPM scheduler with the base model's beta schedule, for noising during training."""
    from diffusers import DDPMScheduler

    overrides: dict[str, Any] = {"rescale_betas_zero_snr": zero_terminal_snr}
    if prediction_type is not None:
        overrides["prediction_type"] = prediction_type
    return DDPMScheduler.from_config(scheduler_config, **overrides)


def sample_noise(latents: torch.Tensor, noise_offset: float, generator=None) -> torch.Tensor:
    """Gaussian noise, plus offset noise (one random value per image and channel) when set."""
    import torch

    noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
    if noise_offset:
        offset = torch.randn(
            (latents.shape[0], latents.shape[1], 1, 1), generator=generator,
            device=latents.device, dtype=latents.dtype,
        )
        noise = noise + noise_offset * offset
    return noise


def sample_timesteps(scheduler: DDPMScheduler, batch_size: int, device, generator=None) -> torch.Tensor:
    """Uniform training timesteps in [0, num_train_timesteps)."""
    import torch

    high = scheduler.config.num_train_timesteps
    return torch.randint(0, high, (batch_size,), generator=generator, device=device).long()


def training_target(
    scheduler: DDPMScheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """What the UNet should predict: the noise (epsilon) or the velocity (v-prediction)."""
    prediction_type = scheduler.config.prediction_type
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unsupported prediction type {prediction_type!r}")
