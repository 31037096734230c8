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


def snr(scheduler: DDPMScheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ᾱ/(1-ᾱ) of each timestep (1/σ² in the k-diffusion view)."""
    alphas_cumprod = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alphas_cumprod / (1.0 - alphas_cumprod)


def loss_weights(
    scheduler: DDPMScheduler, timesteps: torch.Tensor, snr_gamma: float | None, min_sigma: float | None
) -> torch.Tensor | None:
    """Per-sample loss weights, or None for a plain mean.

    Min-SNR (Hang et al. 2023): weight = min(SNR, γ)/SNR for epsilon targets and
    min(SNR, γ)/(SNR + 1) for v-prediction. `min_sigma` clamps σ from below in this weighting
    only — SNR is capped at 1/min_sigma² — and never changes the timesteps that are trained.
    """
    if snr_gamma is None:
        return None
    import torch

    ratio = snr(scheduler, timesteps)
    if min_sigma is not None:
        ratio = torch.clamp(ratio, max=1.0 / min_sigma**2)
    clipped = torch.clamp(ratio, max=snr_gamma)
    if scheduler.config.prediction_type == "v_prediction":
        return clipped / (ratio + 1.0)
    # Zero-terminal-SNR schedules have SNR = 0 at the last step; keep its weight finite.
    return clipped / ratio.clamp(min=1e-8)


def sample_draws(keys: list[tuple[int, int]], seed: int, num_train_timesteps: int, latent_shape: tuple[int, ...],
                 noise_offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noise, timesteps, posterior noise) for a batch, each sample from its own generator seeded
    by (seed, image, epoch).

    The draws of an image never depend on which other images share its batch, how many processes
    split the global batch, or whether the run was resumed: one process with batch 4 and two with
    batch 2 train on exactly the same noise.
    """
    import hashlib

    import torch

    noises, timesteps, posteriors = [], [], []
    channels = latent_shape[1]
    for index, epoch in keys:
        digest = hashlib.sha256(f"{seed}-{index}-{epoch}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        timesteps.append(torch.randint(0, num_train_timesteps, (1,), generator=generator))
        noise = torch.randn(latent_shape[1:], generator=generator)
        if noise_offset:
            noise = noise + noise_offset * torch.randn((channels, 1, 1), generator=generator)
        noises.append(noise)
        posteriors.append(torch.randn(latent_shape[1:], generator=generator))
    return torch.stack(noises), torch.cat(timesteps), torch.stack(posteriors)
