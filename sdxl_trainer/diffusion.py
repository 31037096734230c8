"""The training loss: latents, conditioning, noise and timesteps (the DDPM forward process), the
target (epsilon or v-prediction), the loss function and its weighting.

The recipes of `training.*` beyond plain MSE on uniform timesteps:
- timesteps `uniform`, `logit_normal` (t = min + (max − min)·sigmoid(mean + std·z), as
  OneTrainer and SD3 draw them) or `sigmoid` (the same with mean 0 and std `sigmoid_scale`, kohya's),
  within [`min_timestep`, `max_timestep`);
- noise: offset noise (optionally of random strength in [0, offset), as kohya's
  `noise_offset_random_strength`), multires/pyramid noise (kohya's `multires_noise_*`: octaves
  i = 0 … iterations − 1 of noise upsampled from a random 1/r^i of the size, r in [2, 4), weighted
  discount^i, then divided by its std),
  input perturbation (Ning et al. 2023: the UNet input is noised with noise + γ·ξ, the target keeps
  the noise);
- loss `l2`, `huber` (pseudo-Huber c²(√(1 + (r/c)²) − 1): r²/2 for small residuals, c·|r| for
  large) or `smooth_l1` (c(√(1 + (r/c)²) − 1)), with c constant or scheduled by timestep as kohya's
  `huber_schedule` (`exponential`: c^(t/T); `snr`: (1 − c)/(1 + σ_t)² + c); kohya's pseudo-Huber
  is twice ours, which no optimizer but plain SGD notices;
- weights: min-SNR and `debiased_estimation` (1/√SNR, v-prediction 1/(SNR + 1), SNR capped at
  1000), which multiply, and each sample's own weight (its subset's `loss_weight`, times
  `prior_loss_weight` for regularization images);
- masked loss: a mask on the latent grid weights the elementwise loss, normalised by its area,
  with `unmasked_weight` left to the masked-out part.
Every draw comes from the image's own generator, seeded by (seed, image, epoch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionXLPipeline

    from .config import TrainingConfig


def make_noise_scheduler(
    scheduler_config: dict[str, Any], prediction_type: str | None, zero_terminal_snr: bool | None
) -> DDPMScheduler:
    """A DDPM scheduler with the base model's beta schedule, for noising during training. `None`
    keeps the base scheduler's own prediction type or zero-terminal-SNR setting: a ZTSNR base
    trains on its own schedule unless the config says otherwise."""
    from diffusers import DDPMScheduler

    overrides = {key: value for key, value in (("prediction_type", prediction_type),
                                               ("rescale_betas_zero_snr", zero_terminal_snr)) if value is not None}
    return DDPMScheduler.from_config(scheduler_config, **overrides)


def training_noise_scheduler(scheduler_config: dict[str, Any], training: TrainingConfig) -> DDPMScheduler:
    """The noise scheduler `training.*` asks for on this base model; a loss weighting that would
    be infinite on it is a config error (the config alone cannot tell where it inherits)."""
    from .config import ConfigError

    scheduler = make_noise_scheduler(scheduler_config, training.prediction_type, training.zero_terminal_snr)
    problem = training.schedule_problem(scheduler.config.prediction_type, scheduler.config.rescale_betas_zero_snr)
    if problem:
        raise ConfigError(f"training.debiased_estimation {problem} (the schedule is the base model's: "
                          "training.prediction_type or training.zero_terminal_snr is null)")
    return scheduler


def describe_schedule(scheduler: DDPMScheduler) -> str:
    """The noise schedule trained, as the start of a run prints it."""
    zero_snr = ", zero terminal SNR" if scheduler.config.rescale_betas_zero_snr else ""
    return f"noise schedule: {scheduler.config.prediction_type}{zero_snr}"


def sample_noise(shape: tuple[int, ...], noise_offset: float, generator=None,
                 random_strength: bool = False) -> torch.Tensor:
    """Gaussian noise of `shape` (one image, or a batch), plus offset noise when set: one extra
    random value per image and channel, constant over height and width (its strength drawn in
    [0, noise_offset) with `random_strength`)."""
    import torch

    noise = torch.randn(shape, generator=generator)
    if noise_offset:
        strength = noise_offset * torch.rand(1, generator=generator).item() if random_strength else noise_offset
        noise = noise + strength * torch.randn((*shape[:-2], 1, 1), generator=generator)
    return noise


def multires_noise(noise: torch.Tensor, iterations: int, discount: float, generator=None) -> torch.Tensor:
    """One image's noise [c, h, w] plus `iterations` octaves of noise upsampled (bilinear) to full
    size, the i-th (i = 0, 1, …) at a random 1/r^i of the size (r in [2, 4)) weighted discount^i —
    octave 0 is a second full-size noise at weight 1, as in kohya's `pyramid_noise_like`; divided
    by its standard deviation, so it has unit variance again (kohya's divides by the batch's)."""
    import torch

    channels, height, width = noise.shape
    noise = noise.clone()
    for octave in range(iterations):
        scale = (2 + 2 * torch.rand(1, generator=generator).item()) ** octave
        small_h, small_w = max(1, int(height / scale)), max(1, int(width / scale))
        coarse = torch.randn((1, channels, small_h, small_w), generator=generator)
        noise += torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear")[0] * discount**octave
        if small_h == 1 or small_w == 1:
            break
    return noise / noise.std()


@dataclass(frozen=True)
class DrawSettings:
    """What each image's timestep and noise are drawn from (`training.*`)."""

    num_train_timesteps: int = 1000
    min_timestep: int = 0
    max_timestep: int | None = None  # exclusive; None = num_train_timesteps
    timestep_sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    sigmoid_scale: float = 1.0
    noise_offset: float = 0.0
    noise_offset_random_strength: bool = False
    multires_noise_iterations: int = 0
    multires_noise_discount: float = 0.3
    ip_noise_gamma: float = 0.0

    @classmethod
    def of(cls, training: TrainingConfig, num_train_timesteps: int) -> DrawSettings:
        names = [name for name in cls.__dataclass_fields__ if name != "num_train_timesteps"]
        return cls(num_train_timesteps, **{name: getattr(training, name) for name in names})


def sample_timestep(settings: DrawSettings, generator) -> torch.Tensor:
    """One timestep in [min_timestep, max_timestep), shape [1]."""
    import torch

    low, high = settings.min_timestep, settings.max_timestep or settings.num_train_timesteps
    if settings.timestep_sampling == "uniform":
        return torch.randint(low, high, (1,), generator=generator)
    mean, std = (settings.logit_mean, settings.logit_std) if settings.timestep_sampling == "logit_normal" \
        else (0.0, settings.sigmoid_scale)
    fraction = torch.sigmoid(mean + std * torch.randn(1, generator=generator))
    return (low + (fraction * (high - low)).long()).clamp(max=high - 1)


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


@dataclass(frozen=True)
class LossSettings:
    """The loss function and its weighting (`training.*`)."""

    snr_gamma: float | None = None
    min_sigma: float | None = None
    loss_type: str = "l2"
    huber_c: float = 0.1
    huber_schedule: str = "snr"
    debiased_estimation: bool = False
    unmasked_weight: float = 0.0

    @classmethod
    def of(cls, training: TrainingConfig, min_sigma_on: bool = True) -> LossSettings:
        """`min_sigma_on`: false until `min_sigma_warmup_steps` have passed."""
        return cls(training.snr_gamma, training.min_sigma if min_sigma_on else None, training.loss_type,
                   training.huber_c, training.huber_schedule, training.debiased_estimation,
                   training.unmasked_weight)


def loss_weights(scheduler: DDPMScheduler, timesteps: torch.Tensor, settings: LossSettings) -> torch.Tensor | None:
    """Per-sample loss weights, or None for a plain mean.

    Min-SNR (Hang et al. 2023): weight = min(SNR, γ)/SNR for epsilon targets and
    min(SNR, γ)/(SNR + 1) for v-prediction. `min_sigma` clamps σ from below in this weighting
    only — SNR is capped at 1/min_sigma² — and never changes the timesteps that are trained.
    Debiased estimation multiplies by 1/√SNR (v-prediction: 1/(SNR + 1)), SNR capped at 1000.
    """
    if settings.snr_gamma is None and not settings.debiased_estimation:
        return None
    import torch

    ratio = snr(scheduler, timesteps)
    v_prediction = scheduler.config.prediction_type == "v_prediction"
    weights = torch.ones_like(ratio)
    if settings.debiased_estimation:
        capped = ratio.clamp(max=1000.0)
        weights = 1.0 / (capped + 1.0) if v_prediction else 1.0 / capped.sqrt()
    if settings.snr_gamma is None:
        return weights
    if settings.min_sigma is not None:
        ratio = torch.clamp(ratio, max=1.0 / settings.min_sigma**2)
    if v_prediction:
        return weights * torch.clamp(ratio, max=settings.snr_gamma) / (ratio + 1.0)
    # min(SNR, γ)/SNR, written so that zero-terminal SNR's last step (SNR = 0) gets its limit, 1.
    return weights * torch.where(ratio < settings.snr_gamma, 1.0, settings.snr_gamma / ratio)


def huber_c(scheduler: DDPMScheduler, timesteps: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """The Huber threshold c of each sample: constant, or kohya's schedules (large for early,
    noisy timesteps, so those count as MSE; small late ones, robust to outliers)."""
    import torch

    if settings.huber_schedule == "exponential":
        decay = -math.log(settings.huber_c) / scheduler.config.num_train_timesteps
        return torch.exp(-decay * timesteps.float())
    if settings.huber_schedule == "snr":
        alphas_cumprod = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
        sigmas = ((1.0 - alphas_cumprod) / alphas_cumprod) ** 0.5
        return (1.0 - settings.huber_c) / (1.0 + sigmas) ** 2 + settings.huber_c
    return torch.full(timesteps.shape, settings.huber_c, device=timesteps.device)


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: str,
                    threshold: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over each sample of the elementwise loss, in fp32: r² (`l2`), c²(√(1 + (r/c)²) − 1)
    (`huber`) or c(√(1 + (r/c)²) − 1) (`smooth_l1`), with r the residual and c `threshold`. With a
    `mask` [batch, 1, h, w] the mean is weighted by it: the masked-out part adds nothing, and a
    sample's loss is divided by its mask's area (a small subject counts as much as a large one)."""
    residual = prediction.float() - target.float()
    if loss_type == "l2":
        elementwise = residual.pow(2)
    else:
        c = threshold.float().view(-1, *[1] * (residual.dim() - 1))
        squared = (residual / c) ** 2
        bend = squared / ((1.0 + squared).sqrt() + 1.0)  # √(1 + x) − 1 without cancellation for small x
        elementwise = c * c * bend if loss_type == "huber" else c * bend
    dims = tuple(range(1, residual.dim()))
    if mask is None:
        return elementwise.mean(dim=dims)
    weights = mask.float().expand_as(elementwise)
    return (elementwise * weights).sum(dim=dims) / weights.sum(dim=dims).clamp(min=1e-6)


@dataclass
class Draws:
    """The random values one batch's loss uses: the noise, the timesteps, the noise of the VAE
    posterior sample (used only when the batch holds pixels rather than cached latents) and, with
    input perturbation, the noise the input is noised with (the target keeps `noise`)."""

    noise: torch.Tensor
    timesteps: torch.Tensor
    posterior_noise: torch.Tensor
    input_noise: torch.Tensor | None = None


def sample_draws(keys: list[tuple[int, int]], seed: int, latent_shape: tuple[int, ...],
                 settings: DrawSettings) -> Draws:
    """The draws of a batch, each sample from its own generator seeded by (seed, image, epoch).

    The draws of an image never depend on which other images share its batch, how many processes
    split the global batch, or whether the run was resumed: one process with batch 4 and two with
    batch 2 train on exactly the same noise. Each option's draws come after the ones of the plain
    recipe, so turning one on changes no other image's draws.
    """
    import hashlib

    import torch

    noises, timesteps, posteriors, perturbed = [], [], [], []
    for index, epoch in keys:
        digest = hashlib.sha256(f"{seed}-{index}-{epoch}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        timesteps.append(sample_timestep(settings, generator))
        noise = sample_noise(latent_shape[1:], settings.noise_offset, generator, settings.noise_offset_random_strength)
        posteriors.append(torch.randn(latent_shape[1:], generator=generator))
        if settings.multires_noise_iterations:
            noise = multires_noise(noise, settings.multires_noise_iterations, settings.multires_noise_discount,
                                   generator)
        noises.append(noise)
        if settings.ip_noise_gamma:
            perturbed.append(noise + settings.ip_noise_gamma * torch.randn(noise.shape, generator=generator))
    return Draws(torch.stack(noises), torch.cat(timesteps), torch.stack(posteriors),
                 torch.stack(perturbed) if perturbed else None)


@dataclass
class LossModels:
    """What one loss runs: the pipeline (its VAE, tokenizers and config) and the UNet and text
    encoders to call, which in training are the distributed or compiled wrappers of the
    pipeline's own modules."""

    pipe: StableDiffusionXLPipeline
    unet: torch.nn.Module
    text_encoders: list  # modules, or the text cache's CachedEncoder for the encoders it holds
    max_tokens: int = 75  # data.max_token_length

    @classmethod
    def of(cls, pipe: StableDiffusionXLPipeline, cached: dict | None = None, max_tokens: int = 75) -> LossModels:
        """The pipeline's own modules, unwrapped (validation loss, tests, benchmarks); `cached`: the
        text cache's stand-ins for the encoders it holds, by name."""
        cached = cached or {}
        names = ("text_encoder", "text_encoder_2")
        return cls(pipe, pipe.unet, [cached.get(name, getattr(pipe, name)) for name in names], max_tokens)


def scaled_latents(vae: AutoencoderKL, batch: dict, posterior_noise: torch.Tensor, device) -> torch.Tensor:
    """The batch's latents times the VAE's own scaling factor (the one eval decodes with): from the
    latent cache, or encoded now in fp32 without autocast and sampled with `posterior_noise`."""
    import torch

    from .device_types import autocast_device_type

    if "latents" in batch:  # from the latent cache: the VAE encoder never runs
        latents = batch["latents"].to(device, torch.float32)
    else:
        with torch.no_grad(), torch.autocast(autocast_device_type(device), enabled=False):
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
        zero_empty=pipe.config.force_zeros_for_empty_prompt, max_tokens=models.max_tokens,
    )
    time_ids = add_time_ids(batch["original_sizes"], batch["crops_top_left"], batch["target_sizes"]).to(device)
    return {"encoder_hidden_states": prompt_embeds,
            "added_cond_kwargs": {"text_embeds": pooled_embeds, "time_ids": time_ids}}


def sample_losses(scheduler: DDPMScheduler, prediction: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor,
                  settings: LossSettings, batch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's loss before and after its weights: the configured loss (masked where the batch
    has `masks`), then times each sample's `loss_weights` and its timestep's weight."""
    batch = batch or {}
    device = prediction.device
    threshold = huber_c(scheduler, timesteps, settings) if settings.loss_type != "l2" else None
    mask = batch.get("masks")
    if mask is not None:  # the unmasked part keeps `unmasked_weight`
        mask = settings.unmasked_weight + (1.0 - settings.unmasked_weight) * mask.to(device)
    per_sample = per_sample_loss(prediction, target, settings.loss_type, threshold, mask)
    weighted = per_sample
    if "loss_weights" in batch:  # subsets' and regularization weights (a weight of 1 changes no bit)
        weighted = weighted * batch["loss_weights"].to(device).float()
    weights = loss_weights(scheduler, timesteps, settings)
    return per_sample, weighted * weights if weights is not None else weighted


def weighted_loss(scheduler: DDPMScheduler, prediction: torch.Tensor, target: torch.Tensor,
                  timesteps: torch.Tensor, settings: LossSettings, batch: dict | None = None) -> torch.Tensor:
    """The batch's loss from the UNet's prediction: the mean of the weighted `sample_losses`."""
    return sample_losses(scheduler, prediction, target, timesteps, settings, batch)[1].mean()


def noised_input_and_target(scheduler: DDPMScheduler, latents: torch.Tensor, draws: Draws,
                            device) -> tuple[torch.Tensor, torch.Tensor]:
    """The UNet's noised input and what it should predict. With input perturbation the input is
    noised with `draws.input_noise`; the target always comes from `draws.noise`."""
    noise, timesteps = draws.noise.to(device), draws.timesteps.to(device)
    input_noise = noise if draws.input_noise is None else draws.input_noise.to(device)
    return scheduler.add_noise(latents, input_noise, timesteps), training_target(scheduler, latents, noise, timesteps)


@dataclass
class DenoisingStep:
    """One batch's denoising step and its pieces: `loss` is what training backpropagates; the
    training-flow demo shows the rest, so it shows the step training takes, not a copy of it."""

    latents: torch.Tensor  # the clean latents, scaled by the VAE's factor
    noisy_latents: torch.Tensor  # x_t, the UNet's input
    timesteps: torch.Tensor
    prediction: torch.Tensor  # the UNet's output
    target: torch.Tensor  # noise or velocity
    sample_losses: torch.Tensor  # each sample's loss (masked), before any weight
    weighted_losses: torch.Tensor  # ... times its subset's and its timestep's weight
    loss: torch.Tensor  # their mean


def denoising_step(models: LossModels, scheduler: DDPMScheduler, batch: dict, draws: Draws, device,
                   settings: LossSettings | None = None) -> DenoisingStep:
    """The SDXL denoising step of one batch: the UNet's prediction from the noised latents against
    its target (noise or velocity) in fp32, with the configured loss function and weights."""
    settings = settings or LossSettings()
    latents = scaled_latents(models.pipe.vae, batch, draws.posterior_noise, device)
    timesteps = draws.timesteps.to(device)
    noisy_latents, target = noised_input_and_target(scheduler, latents, draws, device)
    prediction = models.unet(noisy_latents, timesteps, **conditioning(models, batch, device)).sample
    per_sample, weighted = sample_losses(scheduler, prediction, target, timesteps, settings, batch)
    return DenoisingStep(latents, noisy_latents, timesteps, prediction, target, per_sample, weighted, weighted.mean())


def diffusion_loss(models: LossModels, scheduler: DDPMScheduler, batch: dict, draws: Draws, device,
                   settings: LossSettings | None = None) -> torch.Tensor:
    """The loss of one batch's `denoising_step` (training, validation loss, tests, benchmarks)."""
    return denoising_step(models, scheduler, batch, draws, device, settings).loss
