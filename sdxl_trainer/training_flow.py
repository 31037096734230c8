"""One training forward step, opened up for looking at (the logic of `demo_training_flow.py`).

For a sample of the training data at a chosen timestep: the image as training sees it (bucket
resize, crop, flip, normalisation), the noised latents x_t (the training draws of that image,
noise offset included, at that timestep), the UNet's estimate of the clean image x0, the loss
training computes there, and per-token cross-attention heatmaps. Everything comes from the code
training runs (loading, precision policy, data, draws), and the step itself is training's own
`diffusion.denoising_step` (conditioning, autocast, mask, subset and timestep weights), under no_grad.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .config import Config
from .eval.sigma_schedules import ZERO_SNR_LAST_ALPHA_BAR

if TYPE_CHECKING:
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline

    from .data_plan import DatasetPlan
    from .latent_cache import LatentCache
    from .precision import PrecisionPlan


@dataclass
class FlowModels:
    """What the forward step needs: the pipeline placed as training places it, and the noise scheduler."""

    config: Config
    pipe: StableDiffusionXLPipeline
    scheduler: DDPMScheduler
    device: torch.device
    precision: PrecisionPlan  # its autocast is the one training computes the loss under


@dataclass
class FlowResult:
    """One forward step at one timestep, as pictures in [0, 1] (height, width, 3) and numbers."""

    timestep: int
    input_image: Any  # np.ndarray
    noisy_image: Any
    predicted_image: Any
    loss: float  # the loss training computes for this sample at this timestep (its weights applied)
    sample_loss: float  # the same before its subset's and its timestep's weight
    tokens: list[str]  # the caption's tokens, start and end tokens included
    heatmaps: torch.Tensor  # [tokens, height, width] in [0, 1]
    predicted_latents: torch.Tensor = field(repr=False)
    clean_image: Any = field(default=None, repr=False)  # the clean latents decoded: what x0 should look like

    def x0_psnr(self) -> float:
        """PSNR (dB) of the decoded x0 estimate against the decoded clean latents."""
        error = float(((self.predicted_image - self.clean_image) ** 2).mean())
        return 10 * math.log10(1.0 / max(error, 1e-12))


def heat_inside(heatmap: torch.Tensor, mask: Any) -> float:
    """The fraction of a token's heat (a [h, w] map) that falls inside `mask` (a boolean image of
    any size that is a multiple of the map's): where the model looks when it reads the token."""
    height, width = heatmap.shape
    weights = torch.as_tensor(mask, dtype=torch.float32)[None, None]
    inside = torch.nn.functional.adaptive_avg_pool2d(weights, (height, width))[0, 0]
    return float((heatmap * inside).sum() / heatmap.sum().clamp(min=1e-12))


def load_flow_models(config: Config, adapter: str | Path | None = None, device: str | None = None) -> FlowModels:
    """The model as training loads it: `model.*`, with the trained adapter merged in (`adapter`:
    a run's output folder or file), placed by the precision policy on the GPU if there is one, and
    the new tokens of textual inversion / pivotal tuning added (with the run's vectors when given)."""
    from .diffusion import training_noise_scheduler
    from .embeddings import attach_tokens, load_embedding_files
    from .formats.adapter_files import adapter_files, load_adapter_into
    from .models import load_pipeline
    from .precision import place_pipeline, plan_precision

    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pipe = load_pipeline(config.model)
    folder = None if adapter is None else Path(adapter) if Path(adapter).is_dir() else Path(adapter).parent
    # textual inversion alone writes embedding files only, no adapter file
    inversion_only = config.textual_inversion.tokens and not config.textual_inversion.train_adapter
    if adapter is not None and not inversion_only:  # the diffusers/peft file where a folder holds both formats
        found = adapter_files(adapter)[0][0]
        load_adapter_into(pipe, found)
        folder = found.parent  # a checkpoint's, where the output folder has no final adapter
    precision = plan_precision(config, target.type)
    place_pipeline(pipe, precision, target)
    tokens = attach_tokens(pipe, config, None)  # after placing, as training attaches them
    if tokens and folder is not None:
        load_embedding_files(tokens, folder, "--adapter")
    scheduler = training_noise_scheduler(pipe.scheduler.config, config.training)
    return FlowModels(config, pipe, scheduler, target, precision)


def flow_seed(config: Config) -> int:
    """`training.seed`; where it is null or 0 training draws one at random, and the page shows seed 0's
    draws instead (it says so: `seed_note`)."""
    return config.training.seed or 0


def seed_note(config: Config) -> str:
    """What the page says about whose draws it shows, where training's seed is not known in advance."""
    if config.training.seed:
        return ""
    return ("training.seed is null or 0, so training draws a random seed: the flip, crop, caption, timestep and "
            "noise shown are seed 0's, not the run's (set training.seed to see a run's own)")


def pick_samples(models: FlowModels, count: int) -> list[dict]:
    """The first `count` images of training's data plan (its validation split held out, in its order),
    each as training renders it at epoch 0 (bucket, crop, flip and caption transforms from the same
    code and seed). With the latent cache on, their latents are training's too: the dataset samples
    them from the cached distributions as it does in training, and the pixels stay, to be shown."""
    from .data import ImageCaptionDataset
    from .planning import plan_data

    config = models.config
    plan = plan_data(config)
    keys = [(index, 0) for index in range(min(count, len(plan.samples)))]
    samples = [ImageCaptionDataset(plan.samples, config.data, flow_seed(config))[key] for key in keys]
    if not config.data.latent_cache.enabled:
        return samples
    cached = ImageCaptionDataset(plan.samples, config.data, flow_seed(config), latent_cache(models, plan, len(keys)))
    return [{**sample, **cached[key]} for sample, key in zip(samples, keys, strict=True)]


def latent_cache(models: FlowModels, plan: DatasetPlan, count: int) -> LatentCache:
    """Training's latent cache for this VAE, holding the views of the plan's first `count` samples
    (those missing are encoded and stored as training stores them)."""
    from .data import build_latent_cache
    from .planning import loaded_vae_cache

    vae = models.pipe.vae
    cache = loaded_vae_cache(models.config, vae)
    build_latent_cache(replace(plan, samples=plan.samples[:count], validation=[]), models.config.data, cache, vae,
                       models.device)
    return cache


def predicted_original(scheduler: DDPMScheduler, noisy: torch.Tensor, output: torch.Tensor,
                       timestep: int) -> torch.Tensor:
    """x0 from the UNet's output: (x_t − √(1−ᾱ)·ε)/√ᾱ for epsilon, √ᾱ·x_t − √(1−ᾱ)·v for
    v-prediction. Zero-terminal SNR has ᾱ = 0 at the last timestep, where an epsilon model cannot
    say anything about x0: ᾱ is held at ComfyUI's tiny value there instead of dividing by zero."""
    alpha_bar = float(scheduler.alphas_cumprod[timestep])
    if scheduler.config.prediction_type == "v_prediction":
        return alpha_bar**0.5 * noisy - (1 - alpha_bar) ** 0.5 * output
    alpha_bar = max(alpha_bar, ZERO_SNR_LAST_ALPHA_BAR)
    return (noisy - (1 - alpha_bar) ** 0.5 * output) / alpha_bar**0.5


class CrossAttentionCapture:
    """An attention processor for `attn2` (cross-attention) layers that records the attention of
    every image position to every token (averaged over heads) and hands the computation itself to
    the layer's own processor, so the UNet's output is the one without capture."""

    def __init__(self, inner: Any, records: list[torch.Tensor]) -> None:
        self.inner, self.records = inner, records

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        query = attn.head_to_batch_dim(attn.to_q(hidden_states))
        key = attn.head_to_batch_dim(attn.to_k(encoder_hidden_states))
        probs = attn.get_attention_scores(query, key, None)  # [batch·heads, positions, tokens]
        self.records.append(probs.reshape(hidden_states.shape[0], attn.heads, *probs.shape[1:]).mean(1).float())
        return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs)


@contextlib.contextmanager
def capture_cross_attention(unet: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record the cross-attention maps of one forward; every processor is restored afterwards."""
    original = unet.attn_processors
    records: list[torch.Tensor] = []
    unet.set_attn_processor({name: CrossAttentionCapture(processor, records) if ".attn2." in name else processor
                             for name, processor in original.items()})
    try:
        yield records
    finally:
        unet.set_attn_processor(original)


def token_heatmaps(records: list[torch.Tensor], latent_size: tuple[int, int], token_count: int) -> torch.Tensor:
    """[tokens, h, w] at the latent size: the layers of the highest resolution averaged, each
    token's map scaled to [0, 1] (the start token, which takes most attention, is left out of the
    common scale and gets its own)."""
    height, width = latent_size
    finest = max(record.shape[1] for record in records)
    maps = torch.stack([record[0] for record in records if record.shape[1] == finest]).mean(0)  # [pos, tokens]
    grid = maps[:, :token_count].T.reshape(token_count, *attention_grid(latent_size, finest))
    grid = torch.nn.functional.interpolate(grid[None], size=(height, width), mode="bilinear")[0]
    words = grid[1:]
    normalised = torch.cat([grid[:1] / grid[:1].max().clamp(min=1e-12), words / words.max().clamp(min=1e-12)])
    return normalised.clamp(0, 1)


def attention_grid(latent_size: tuple[int, int], positions: int) -> tuple[int, int]:
    """The (h, w) of an attention layer with `positions` image positions: each stride-2 conv of the
    UNet rounds an odd side up, so a 17-latent side gives 9, then 5 (not 17 // 2, 17 // 4)."""
    height, width = latent_size
    scale = 1
    while math.ceil(height / scale) * math.ceil(width / scale) > positions:
        scale *= 2
    return math.ceil(height / scale), math.ceil(width / scale)


def caption_tokens(pipe: StableDiffusionXLPipeline, caption: str) -> list[str]:
    """The caption's tokens as CLIP-L's tokenizer splits it, up to and including the end token."""
    tokenizer = pipe.tokenizer
    ids = tokenizer(caption, truncation=True, max_length=tokenizer.model_max_length).input_ids
    return [tokenizer.convert_ids_to_tokens(token).replace("</w>", "") for token in ids]


def forward_at(models: FlowModels, sample: dict, timestep: int) -> FlowResult:
    """The training step for `sample` at `timestep` (`diffusion.denoising_step`: the same draws,
    conditioning, autocast, mask and weights as training), without gradients, with what it shows."""
    from .data import collate
    from .diffusion import DrawSettings, LossModels, LossSettings, denoising_step, sample_draws
    from .eval.evaluation import decode_latents, fp32_vae

    config, pipe, scheduler, device = models.config, models.pipe, models.scheduler, models.device
    batch = collate([sample])
    height, width = batch["target_sizes"][0].tolist()
    draws = sample_draws(batch["keys"], flow_seed(config), (1, pipe.unet.config.in_channels, height // 8,
                         width // 8), DrawSettings.of(config.training, scheduler.config.num_train_timesteps))
    draws.timesteps = torch.tensor([timestep])
    with torch.no_grad():
        with models.precision.autocast(), capture_cross_attention(pipe.unet) as records:
            step = denoising_step(LossModels.of(pipe), scheduler, batch, draws, device,
                                  LossSettings.of(config.training))
        x0 = predicted_original(scheduler, step.noisy_latents, step.prediction.float(), timestep)
        tokens = caption_tokens(pipe, batch["captions"][0])
        vae = fp32_vae(pipe.vae)  # decoded as eval decodes: fp32, the VAE's own scaling factor
        picture = (batch["pixel_values"][0] / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).numpy()
        heatmaps = token_heatmaps(records, (height // 8, width // 8), len(tokens)).cpu()
        return FlowResult(timestep, picture, decode_latents(pipe, vae, step.noisy_latents),
                          decode_latents(pipe, vae, x0), float(step.loss), float(step.sample_losses[0]), tokens,
                          heatmaps, x0, decode_latents(pipe, vae, step.latents))
