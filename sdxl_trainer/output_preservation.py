"""Differential output preservation: teach a new word without changing what the model draws for the
words it could take over, and without regularization images.

A fine-tune on images of a new concept ("a red cross, blue background") also moves what the model
draws for nearby words: the tiny model reads the unseen word "cross" almost as it reads "square", and
after the quickstart its squares grow arms. Prior preservation answers with regularization images,
which take half of every epoch. Here, as in ai-toolkit's differential output preservation, each step
reads the batch's captions that hold the trigger once more with it replaced by a class word ("a red
square, blue background"), on the same noisy latents and timesteps, and adds the mean squared
difference between the adapted model's prediction for them and the base model's, which is the same
model with its adapters off (run without gradients). The class word cycles through
`training.output_preservation.classes` by step, so a resumed run reads the same words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from .config import OutputPreservationConfig
from .diffusion import DenoisingStep, LossModels, conditioning


def preserved_caption(caption: str, trigger: str, word: str) -> str | None:
    """The caption with every whole-word `trigger` replaced by `word`; None when it holds none."""
    pattern = re.compile(rf"(?<!\w){re.escape(trigger)}(?!\w)")
    return pattern.sub(word, caption) if pattern.search(caption) else None


def class_word(settings: OutputPreservationConfig, step: int) -> str:
    """The class word of an optimizer step: the classes in turn."""
    return settings.classes[step % len(settings.classes)]


def preserved_texts(texts: Iterable[str], settings: OutputPreservationConfig) -> set[str]:
    """Every caption text the preservation can read, for the text cache: each text holding the
    trigger, with each class word."""
    if not settings.trigger:
        return set()
    variants = (preserved_caption(text, settings.trigger, word) for text in texts for word in settings.classes)
    return {variant for variant in variants if variant is not None}


@contextmanager
def adapters_off(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Run `modules` as the base model: every peft adapter layer in them off. peft's switch also
    changes its weights' requires_grad; each weight gets its own flag back afterwards."""
    layers = [layer for module in modules for layer in module.modules() if isinstance(layer, BaseTunerLayer)]
    flags = [(parameter, parameter.requires_grad) for layer in layers for parameter in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for parameter, flag in flags:
            parameter.requires_grad_(flag)


def training_loss(models: LossModels, batch: dict, step: DenoisingStep, preservation: OutputPreservationConfig,
                  optimizer_step: int, adapted: list[torch.nn.Module]) -> torch.Tensor:
    """The loss a training step backpropagates: the denoising `step`'s, plus, with output
    preservation on, each preserved sample's mean squared difference from the base model's
    prediction (unweighted, as ai-toolkit's), summed and divided by the batch size. A caption
    without the trigger is read as it is and counts zero, so every process of a DDP run runs the
    same passes whatever its captions (a DDP module's forward broadcasts its buffers to the others)."""
    if not preservation.trigger:
        return step.loss
    word = class_word(preservation, optimizer_step)
    preserved = [preserved_caption(caption, preservation.trigger, word) for caption in batch["captions"]]
    captions = [caption if kept is None else kept for caption, kept in zip(batch["captions"], preserved, strict=True)]
    device, noisy, timesteps = step.noisy_latents.device, step.noisy_latents, step.timesteps
    counts = torch.tensor([float(kept is not None) for kept in preserved], device=device)
    classes = dict(batch, captions=captions)  # the same images and size ids, read with the class word
    with torch.no_grad(), adapters_off(adapted):
        target = models.unet(noisy, timesteps, **conditioning(models, classes, device)).sample.float()
    prediction = models.unet(noisy, timesteps, **conditioning(models, classes, device)).sample.float()
    per_sample = (prediction - target).square().mean(dim=tuple(range(1, prediction.dim())))
    return step.loss + preservation.weight * (per_sample * counts).sum() / len(captions)
