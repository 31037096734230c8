"""The training loss: latents, conditioning, noise and timesteps (the DDPM forward process), the
target (epsilon or v-prediction) and its weighting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionXLPipeline


def make_noise_scheduler(
    scheduler_config: dict[str, Any], prediction_type: str | None, zero_terminal_snr: bool
) -> DDPMScheduler:
    """A DDPM scheduler with the base model's beta schedule, for noising during training."""
    from diffusers import DDPMScheduler

    overrides: dict[str, Any] = {"rescale_betas_zero_snr": zero_terminal_snr}
    if prediction_type is not None:
        overrides["prediction_type"] = prediction_type
    return DDPMScheduler.from_config(scheduler_config, **overrides)


def sample_noise(shape: tuple[int, ...], noise_offset: float, generator=None) -> torch.Tensor:
    """Gaussian noise of `shape` (one image, or a batch), plus offset noise when set: one extra
    random value per image and channel, constant over height and width."""
    import torch

    noise = torch.randn(shape, generator=generator)
    if noise_offset:
        noise = noise + noise_offset * torch.randn((*shape[:-2], 1, 1), generator=generator)
    return noise


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


@dataclass
class Draws:
    """The random values one batch's loss uses: the noise, the timesteps, and the noise of the VAE
    posterior sample (used only when the batch holds pixels rather than cached latents)."""

    noise: torch.Tensor
    timesteps: torch.Tensor
    posterior_noise: torch.Tensor


def sample_draws(keys: list[tuple[int, int]], seed: int, num_train_timesteps: int, latent_shape: tuple[int, ...],
                 noise_offset: float) -> Draws:
    """The draws of a batch, each sample from its own generator seeded by (seed, image, epoch).

    The draws of an image never depend on which other images share its batch, how many processes
    split the global batch, or whether the run was resumed: one process with batch 4 and two with
    batch 2 train on exactly the same noise.
    """
    import hashlib

    import torch

    noises, timesteps, posteriors = [], [], []
    for index, epoch in keys:
        digest = hashlib.sha256(f"{seed}-{index}-{epoch}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        timesteps.append(torch.randint(0, num_train_timesteps, (1,), generator=generator))
        noises.append(sample_noise(latent_shape[1:], noise_offset, generator))
        posteriors.append(torch.randn(latent_shape[1:], generator=generator))
    return Draws(torch.stack(noises), torch.cat(timesteps), torch.stack(posteriors))


@dataclass
class LossModels:
    """What one loss runs: the pipeline (its VAE, tokenizers and config) and the UNet and text
    encoders to call, which in training are the distributed or compiled wrappers of the
    pipeline's own modules."""

    pipe: StableDiffusionXLPipeline
    unet: torch.nn.Module
    text_encoders: list[torch.nn.Module]

    @classmethod
    def of(cls, pipe: StableDiffusionXLPipeline) -> LossModels:
        """The pipeline's own modules, unwrapped (validation loss, tests, benchmarks)."""
        return cls(pipe, pipe.unet, [pipe.text_encoder, pipe.text_encoder_2])


def scaled_latents(vae: AutoencoderKL, batch: dict, posterior_noise: torch.Tensor, device) -> torch.Tensor:
    """The batch's latents times the VAE's own scaling factor (the one eval decodes with): from the
    latent cache, or encoded now in fp32 without autocast and sampled with `posterior_noise`."""
    import torch

    if "latents" in batch:  # from the latent cache: the VAE encoder never runs
        latents = batch["latents"].to(device, torch.float32)
    else:
        with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=False):
            posterior = vae.encode(batch["pixel_values"].to(device, dtype=vae.dtype)).latent_dist
            noise = posterior_noise.to(device, posterior.mean.dtype)
            latents = (posterior.mean + posterior.std * noise).float()
    return latents * vae.config.scaling_factor


def conditioning(models: LossModels, batch: dict, device) -> dict[str, torch.Tensor]:
    """The UNet's conditioning inputs: both encoders' text embeddings and SDXL's size ids."""
    from .conditioning import add_time_ids, encode_prompts

    pipe = models.pipe
    prompt_embeds, pooled_embeds = encode_prompts(
        batch["captions"], [pipe.tokenizer, pipe.tokenizer_2], models.text_encoders, device,
        zero_empty=pipe.config.force_zeros_for_empty_prompt,
    )
    time_ids = add_time_ids(batch["original_sizes"], batch["crops_top_left"], batch["target_sizes"]).to(device)
    return {"encoder_hidden_states": prompt_embeds,
            "added_cond_kwargs": {"text_embeds": pooled_embeds, "time_ids": time_ids}}


def diffusion_loss(models: LossModels, scheduler: DDPMScheduler, batch: dict, draws: Draws, device,
                   snr_gamma: float | None = None, min_sigma: float | None = None) -> torch.Tensor:
    """The SDXL denoising loss of one batch: the UNet's prediction from the noised latents against
    its target (noise or velocity), squared error in fp32, optionally min-SNR weighted."""
    latents = scaled_latents(models.pipe.vae, batch, draws.posterior_noise, device)
    noise, timesteps = draws.noise.to(device), draws.timesteps.to(device)
    noisy_latents = scheduler.add_noise(latents, noise, timesteps)
    target = training_target(scheduler, latents, noise, timesteps)
    prediction = models.unet(noisy_latents, timesteps, **conditioning(models, batch, device)).sample
    per_sample = (prediction.float() - target.float()).pow(2).mean(dim=(1, 2, 3))
    weights = loss_weights(scheduler, timesteps, snr_gamma, min_sigma)
    return (per_sample * weights).mean() if weights is not None else per_sample.mean()
