"""Eval images during and after training (`eval.live`, `eval.final`).

Each prompt is rendered with the configured sampler and its own seed, checked before it is saved
(an image of NaN is written as `…_INVALID.png` and reported, never passed off as a result), and
saved with a grid and TensorBoard entries. Evaluation borrows the training pipeline: afterwards
every train/eval flag, every weight and dtype, the scheduler and the global RNG streams are as
they were, so a run with eval trains exactly like one without.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from ..atomic import atomic_dir
from ..module_modes import eval_mode
from .comfyui_sampling import comfyui_latents, eval_backend
from .eval_prompts import EvalPrompt
from .image_checks import LIKELY_CAUSES, check_image
from .samplers import check_eval_sampler, make_eval_scheduler

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline

    from ..config import EvalConfig

GRID_NAME = "grid.png"
INVALID_SUFFIX = "_INVALID"
_GRID_BACKGROUND = (40, 40, 40)  # not black, so that a black image still shows where it is
_INVALID_FRAME = (255, 0, 0)


class InvalidImage(NamedTuple):
    path: Path
    reason: str


@dataclass(frozen=True)
class EvalResult:
    """What one evaluation wrote; `invalid` is for the error count and the run summary."""

    folder: Path
    images: list[Path]  # one per prompt, in prompt order, invalid ones included
    grid: Path
    invalid: list[InvalidImage]

    def summary(self) -> dict[str, Any]:
        """JSON-ready, for run_summary.json."""
        return {
            "folder": str(self.folder),
            "images": len(self.images),
            "invalid": [{"path": str(path), "reason": reason} for path, reason in self.invalid],
        }


def run_evaluation(
    pipe: StableDiffusionXLPipeline,
    eval_config: EvalConfig,
    prompts: list[EvalPrompt],
    folder: str | Path,
    *,
    tag: str,
    step: int,
    writer=None,
    max_batches: int | None = None,
) -> EvalResult:
    """Render the first `max_batches` prompts (all when None) into `folder`, replaced as a whole.

    `tag` ("live" or "final") names the TensorBoard entries `eval/<tag>/<index>` (images) and
    `eval/<tag>` (a text table); `writer` is a TensorBoard SummaryWriter or None.
    """
    import torch

    check_eval_sampler(eval_config)
    comfyui = eval_backend(eval_config) == "kdiffusion"
    prompts = prompts[:max_batches]
    if not prompts:
        raise ValueError("no eval prompts to render")
    base_scheduler_config = pipe.scheduler.config
    images = []
    with _pipeline_state_kept(pipe), global_rng_kept(pipe.device), torch.inference_mode():
        vae = fp32_vae(pipe.vae)
        for batch in prompt_batches(prompts, batch_size(eval_config)):
            # A fresh scheduler per image, and the prompt's seed also in the global CPU generator (which
            # e.g. DPMSolverSDEScheduler draws its noise seed from): each image depends on its seed only.
            if not comfyui:
                pipe.scheduler = make_eval_scheduler(base_scheduler_config, eval_config.sampler_name,
                                                     eval_config.scheduler)
            torch.random.default_generator.manual_seed(batch[0].seed)
            latents = comfyui_latents(pipe, eval_config, batch) if comfyui else _diffusers_latents(
                pipe, eval_config, batch[0])
            images += [decode_latents(pipe, vae, row) for row in latents.split(1)]

    reasons = [check_image(image) for image in images]
    pictures = [_to_uint8(image) for image in images]
    names = [_file_name(index, prompt.prompt, reasons[index]) for index, prompt in enumerate(prompts)]
    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        for name, picture in zip(names, pictures, strict=True):
            Image.fromarray(picture).save(tmp / name)
        _grid(pictures, reasons).save(tmp / GRID_NAME)
    paths = [folder / name for name in names]

    where = f"eval/{tag} step {step}"
    if writer is not None:
        for index, picture in enumerate(pictures):
            writer.add_image(f"eval/{tag}/{index}", picture, step, dataformats="HWC")
        writer.add_text(f"eval/{tag}", _markdown(where, eval_config, prompts, reasons), step)
    invalid = [InvalidImage(path, reason) for path, reason in zip(paths, reasons, strict=True) if reason]
    if invalid:
        _report_invalid(where, prompts, reasons, paths)
    return EvalResult(folder=folder, images=paths, grid=folder / GRID_NAME, invalid=invalid)


def batch_size(eval_config: EvalConfig) -> int:
    """Prompts sampled in one UNet call: eval.batch_size on the kdiffusion backend; the diffusers
    backend renders one at a time."""
    return eval_config.batch_size if eval_backend(eval_config) == "kdiffusion" else 1


def largest_batch(eval_config: EvalConfig, prompts: list[EvalPrompt]) -> int:
    """The most prompts eval samples in one UNet call (for the memory plan)."""
    return max((len(batch) for batch in prompt_batches(prompts, batch_size(eval_config))), default=1)


def prompt_batches(prompts: list[EvalPrompt], size: int) -> list[list[EvalPrompt]]:
    """Consecutive prompts of one size, up to `size` at a time; a prompt read past 77 tokens alone
    (its chunks can number differently from its neighbours')."""
    from ..long_prompts import CHUNK_TOKENS

    batches: list[list[EvalPrompt]] = []
    for prompt in prompts:
        last = batches[-1] if batches else None
        if (last and len(last) < size and prompt.max_tokens == last[0].max_tokens == CHUNK_TOKENS
                and (prompt.height, prompt.width) == (last[0].height, last[0].width)):
            last.append(prompt)
        else:
            batches.append([prompt])
    return batches


def _diffusers_latents(pipe: StableDiffusionXLPipeline, eval_config: EvalConfig,
                       prompt: EvalPrompt) -> torch.Tensor:
    """One prompt's final latents from the diffusers pipeline and its (eval) scheduler; a prompt
    read past 77 tokens is encoded in chunks, as in training (`data.max_token_length`)."""
    import torch

    from ..conditioning import pipeline_prompt_embeds
    from ..long_prompts import CHUNK_TOKENS

    if prompt.max_tokens == CHUNK_TOKENS:
        # None: SDXL's zero embedding for "no negative"
        text = {"prompt": prompt.prompt, "negative_prompt": prompt.negative_prompt or None}
    else:
        text = pipeline_prompt_embeds(pipe, prompt.prompt, prompt.negative_prompt, prompt.max_tokens)
    return pipe(
        **text,
        width=prompt.width,
        height=prompt.height,
        num_inference_steps=eval_config.num_inference_steps,
        guidance_scale=eval_config.cfg_scale,
        generator=torch.Generator().manual_seed(prompt.seed),  # on the CPU: the same noise on every device
        output_type="latent",
    ).images


def decode_latents(pipe: StableDiffusionXLPipeline, vae: AutoencoderKL, latents: torch.Tensor) -> np.ndarray:
    """One image as floats in [0, 1] (height, width, 3), NaN kept. The latents are decoded here
    rather than by the pipeline, which decodes in the VAE's own dtype (and on MPS casts the VAE
    to the latents' fp16)."""
    import torch

    # The scaling factor from the VAE's own config, the one training encodes with: a hard-coded
    # factor of another VAE corrupts the latents (docs/design.md, 'The original tool's NaN post-mortems').
    decoded = vae.decode(latents.to(vae.device, torch.float32) / vae.config.scaling_factor).sample
    return pipe.image_processor.postprocess(decoded, output_type="np")[0]  # clamps to [0, 1]; NaN stays NaN


def fp32_vae(vae: AutoencoderKL) -> AutoencoderKL:
    """The VAE to decode with: itself in fp32, else an fp32 copy (an fp16 VAE overflows to NaN;
    docs/design.md, 'Precision policy'); a copy leaves the training pipeline's VAE untouched."""
    import torch

    return vae if vae.dtype == torch.float32 else copy.deepcopy(vae).float()


@contextlib.contextmanager
def _pipeline_state_kept(pipe: StableDiffusionXLPipeline) -> Iterator[None]:
    """Every module in eval mode for the duration (each gets its own flags back), and the
    pipeline's scheduler restored."""
    import torch

    modules = [module for module in pipe.components.values() if isinstance(module, torch.nn.Module)]
    scheduler = pipe.scheduler
    try:
        with eval_mode(modules):
            yield
    finally:
        pipe.scheduler = scheduler


@contextlib.contextmanager
def global_rng_kept(device: torch.device) -> Iterator[None]:
    """Images use their own generators; whatever else draws from the global torch, numpy or
    Python RNG during eval is undone, so training's random stream (and exact resume) is unchanged."""
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _to_uint8(image: np.ndarray) -> np.ndarray:
    """8-bit pixels as any viewer would show them: NaN becomes black."""
    clean = np.nan_to_num(image, nan=0.0, posinf=1.0, neginf=0.0).clip(0.0, 1.0)
    return (clean * 255).round().astype(np.uint8)


def _file_name(index: int, prompt: str, reason: str | None) -> str:
    """`03_a-red-circle.png`: the index keeps prompt order, the slug says which prompt it is."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40].rstrip("-") or "prompt"
    return f"{index:02d}_{slug}{INVALID_SUFFIX if reason else ''}.png"


def _grid(pictures: list[np.ndarray], reasons: list[str | None]) -> Image.Image:
    """All images in one picture, in prompt order; invalid ones framed in red."""
    columns = math.ceil(math.sqrt(len(pictures)))
    rows = math.ceil(len(pictures) / columns)
    cell_width = max(picture.shape[1] for picture in pictures)
    cell_height = max(picture.shape[0] for picture in pictures)
    grid = Image.new("RGB", (columns * cell_width, rows * cell_height), _GRID_BACKGROUND)
    draw = ImageDraw.Draw(grid)
    for index, (picture, reason) in enumerate(zip(pictures, reasons, strict=True)):
        x, y = index % columns * cell_width, index // columns * cell_height
        grid.paste(Image.fromarray(picture), (x, y))
        if reason:
            height, width = picture.shape[:2]
            draw.rectangle((x, y, x + width - 1, y + height - 1), outline=_INVALID_FRAME, width=max(1, width // 32))
    return grid


def _markdown(where: str, eval_config: EvalConfig, prompts: list[EvalPrompt], reasons: list[str | None]) -> str:
    """The TensorBoard text entry: the settings, then one table row per image."""
    invalid = sum(reason is not None for reason in reasons)
    lines = [
        f"**{where}**: {len(prompts)} images, {invalid} invalid; sampler {eval_config.sampler_name} "
        f"({eval_config.scheduler}), {eval_config.num_inference_steps} steps, cfg {eval_config.cfg_scale:g}",
        "",
        "| # | prompt | negative prompt | seed | size | result |",
        "|---|---|---|---|---|---|",
    ]
    for index, (prompt, reason) in enumerate(zip(prompts, reasons, strict=True)):
        cells = [str(index), prompt.prompt, prompt.negative_prompt, str(prompt.seed),
                 f"{prompt.width}x{prompt.height}", f"**INVALID**: {reason}" if reason else "ok"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def _report_invalid(where: str, prompts: list[EvalPrompt], reasons: list[str | None], paths: list[Path]) -> None:
    """One error per invalid image, then the likely causes once; tqdm.write keeps progress bars intact."""
    from tqdm.auto import tqdm

    for index, (prompt, reason, path) in enumerate(zip(prompts, reasons, paths, strict=True)):
        if reason:
            tqdm.write(
                f"error: {where}: image {index} ({prompt.prompt[:40]!r}, seed {prompt.seed}, "
                f"{prompt.width}x{prompt.height}) is invalid: {reason}; saved as {path}",
                file=sys.stderr,
            )
    causes = "".join(f"\n  - {cause}" for cause in LIKELY_CAUSES)
    tqdm.write(f"error: {where}: {sum(map(bool, reasons))} invalid eval image(s); likely causes:{causes}",
               file=sys.stderr)
