"""The `kdiffusion` eval backend: SDXL sampled the way ComfyUI's KSampler does it, so an eval
image matches what users render in ComfyUI with the same sampler, schedule, steps, CFG and seed.

What ComfyUI does, and this module with it:
- sigmas from the model's discrete sigma table with ComfyUI's schedules (`sigma_schedules.py`);
  `dpm_2` and `dpm_2_ancestral` get one sigma more, the second to last left out;
- the UNet gets x / √(σ² + 1) and, as its timestep, the index of the nearest table entry;
  its output becomes the denoised estimate: x - σ·ε (epsilon) or x/(σ²+1) - v·σ/√(σ²+1)
  (v-prediction);
- classifier-free guidance on one batch of [negative, positive], applied to the denoised
  estimates (equal to applying it to ε or v); at CFG 1 only the positive pass runs;
- the starting latents: `torch.randn` from a CPU generator seeded with the prompt's seed, times
  √(1 + σ₀²) when sampling starts at the model's σ_max (ComfyUI's full-denoise noise scaling),
  else times σ₀; the samplers' own noise as ComfyUI draws it on the CPU (`sample_rows`).
Prompt embeddings and SDXL's size conditioning come from the pipeline's own `encode_prompt` and
`_get_add_time_ids`, as in the diffusers backend.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..config import ConfigError, closest
from .kdiffusion_samplers import ANCESTRAL_SAMPLERS, DISCARD_PENULTIMATE_SIGMA, SAMPLERS, Denoiser, sample
from .sigma_schedules import SCHEDULE_NAMES, SigmaTable, make_sigmas

if TYPE_CHECKING:
    from diffusers import StableDiffusionXLPipeline

    from ..config import EvalConfig
    from .eval_prompts import EvalPrompt

# The diffusers backend's short names for two of ComfyUI's samplers.
ALIASES = {"euler_a": "euler_ancestral", "dpm_2_a": "dpm_2_ancestral"}


def eval_backend(eval_config: EvalConfig) -> str:
    """`kdiffusion` or `diffusers`; `auto` picks the ComfyUI-exact path whenever both the sampler
    and the schedule are names ComfyUI has."""
    if eval_config.backend != "auto":
        return eval_config.backend
    sampler = ALIASES.get(eval_config.sampler_name, eval_config.sampler_name)
    return "kdiffusion" if sampler in SAMPLERS and eval_config.scheduler in SCHEDULE_NAMES else "diffusers"


def check_comfyui_sampler(sampler_name: str, schedule: str, steps: int) -> None:
    """Config-time check of a kdiffusion-backend choice."""
    for key, kind, name, valid in (("sampler_name", "sampler", ALIASES.get(sampler_name, sampler_name), SAMPLERS),
                                   ("scheduler", "schedule", schedule, SCHEDULE_NAMES)):
        if name not in valid:
            match = closest(name, valid)
            raise ConfigError(f'eval.{key} = "{name}": not a {kind} of eval.backend "kdiffusion"'
                              + (f' (did you mean "{match}"?)' if match else "") + f"; valid: {', '.join(valid)}")
    if schedule == "kl_optimal" and steps < 2:
        raise ConfigError('eval.scheduler = "kl_optimal" needs eval.num_inference_steps >= 2 '
                          "(one step divides by zero, in ComfyUI too)")


def sampling_sigmas(sampler_name: str, schedule: str, table: SigmaTable, steps: int) -> torch.Tensor:
    """The sigmas ComfyUI's KSampler runs `sampler_name` over."""
    sampler = ALIASES.get(sampler_name, sampler_name)
    if sampler in DISCARD_PENULTIMATE_SIGMA:
        sigmas = make_sigmas(schedule, table, steps + 1)
        return torch.cat([sigmas[:-2], sigmas[-1:]])
    return make_sigmas(schedule, table, steps)


def scaled_input(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The UNet's input, x / √(σ² + 1): unit variance at every noise level (divided, as ComfyUI
    does, not multiplied by the reciprocal)."""
    return x / (sigma**2 + 1) ** 0.5


def denoised_estimate(prediction_type: str, model_output: torch.Tensor, x: torch.Tensor,
                      sigma: torch.Tensor) -> torch.Tensor:
    """The model's estimate of the clean latents from its epsilon or v output."""
    if prediction_type == "epsilon":
        return x - model_output * sigma
    if prediction_type == "v_prediction":
        return x / (sigma**2 + 1) - model_output * sigma / (sigma**2 + 1) ** 0.5
    raise ValueError(f"prediction type {prediction_type!r} is not supported by the kdiffusion eval backend")


def starting_noise_scale(sigma_start: float, table: SigmaTable) -> float:
    """ComfyUI scales the starting noise by √(1 + σ₀²) when it starts at σ_max (full denoise)."""
    at_max = math.isclose(table.sigma_max, sigma_start, rel_tol=1e-5) or sigma_start > table.sigma_max
    return math.sqrt(1.0 + sigma_start**2) if at_max else sigma_start


def prompt_embeds(pipe: StableDiffusionXLPipeline, prompt: EvalPrompt, guided: bool) -> tuple[torch.Tensor, ...]:
    """(positive, negative, pooled, negative pooled) of one prompt; one read past 77 tokens is
    encoded in chunks as ComfyUI encodes a long prompt (long_prompts.py)."""
    from ..conditioning import pipeline_prompt_embeds
    from ..long_prompts import CHUNK_TOKENS

    if prompt.max_tokens == CHUNK_TOKENS:
        return pipe.encode_prompt(prompt.prompt, device=pipe.unet.device, num_images_per_prompt=1,
                                  do_classifier_free_guidance=guided,
                                  negative_prompt=prompt.negative_prompt or None)  # None: SDXL's zero embedding
    return tuple(pipeline_prompt_embeds(pipe, prompt.prompt, prompt.negative_prompt, prompt.max_tokens).values())


def comfyui_latents(pipe: StableDiffusionXLPipeline, eval_config: EvalConfig,
                    prompts: list[EvalPrompt]) -> torch.Tensor:
    """The final latents (undecoded) of prompts of one size and token length, sampled together as
    ComfyUI samples each: one row per prompt, its noise from its own seed."""
    unet, device = pipe.unet, pipe.unet.device
    table = SigmaTable.from_scheduler_config(pipe.scheduler.config)
    prediction_type = pipe.scheduler.config.get("prediction_type", "epsilon")
    guided = eval_config.cfg_scale != 1.0
    positive, negative, pooled, negative_pooled = (
        torch.cat(parts) if parts[0] is not None else None
        for parts in zip(*(prompt_embeds(pipe, prompt, guided) for prompt in prompts), strict=True))
    size = (prompts[0].height, prompts[0].width)
    time_ids = pipe._get_add_time_ids(size, (0, 0), size, dtype=positive.dtype,
                                      text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim).to(device)
    context, pooled = (torch.cat([negative, positive]), torch.cat([negative_pooled, pooled])) if guided \
        else (positive, pooled)
    time_ids = time_ids.repeat(len(context), 1)

    def denoise(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        batch = torch.cat([x] * (len(context) // len(x)))
        timestep = table.timestep(sigma.cpu()).float().to(device).expand(len(batch))
        output = unet(scaled_input(batch, sigma).to(unet.dtype), timestep, encoder_hidden_states=context,
                      added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample.float()
        denoised = denoised_estimate(prediction_type, output, batch, sigma)
        if not guided:
            return denoised
        uncond, cond = denoised.chunk(2)
        return uncond + (cond - uncond) * eval_config.cfg_scale

    sigmas = sampling_sigmas(eval_config.sampler_name, eval_config.scheduler, table,
                             eval_config.num_inference_steps).to(device)
    shape = (1, unet.config.in_channels, size[0] // pipe.vae_scale_factor, size[1] // pipe.vae_scale_factor)
    return sample_rows(ALIASES.get(eval_config.sampler_name, eval_config.sampler_name), denoise, sigmas, table,
                       shape, [prompt.seed for prompt in prompts])


def sample_rows(sampler: str, denoise: Denoiser, sigmas: torch.Tensor, table: SigmaTable,
                shape: tuple[int, ...], seeds: list[int]) -> torch.Tensor:
    """One row of `shape` per seed, sampled as ComfyUI's KSampler samples that seed. Its starting
    noise is drawn on the CPU from the seed (the same on every device). The ancestral samplers'
    own noise comes from seed + 1, as ComfyUI draws it on the CPU since its fix for issue 9819:
    drawn from the seed itself, it repeats the starting noise, and the first step adds that noise
    to itself instead of fresh noise. The SDE samplers' Brownian tree is built from the seed."""
    noise = torch.cat([torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for seed in seeds])
    x = noise.to(sigmas.device) * starting_noise_scale(float(sigmas[0]), table)
    sampler_seeds = [seed + 1 for seed in seeds] if sampler in ANCESTRAL_SAMPLERS else seeds
    return sample(sampler, denoise, x, sigmas, sampler_seeds)

