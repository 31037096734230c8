"""What a run evaluates and when: live eval images and the validation loss every
`eval.live.every_n_steps`, final images after the last step, and the counts the run summary and
the exit code need. Rendering itself is in `evaluation.py`, the loss in `validation.py`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Config
from .eval_prompts import EvalPrompt, load_prompts
from .evaluation import run_evaluation
from .validation import ValidationSet, make_validation_set, validation_loss

if TYPE_CHECKING:
    import torch
    from diffusers import StableDiffusionXLPipeline

    from ..data_plan import DatasetPlan

VALIDATION_BATCHES = 4  # of the training data, when no images are held out
HELD_OUT_BATCHES = 8


def eval_prompts(config: Config) -> list[EvalPrompt]:
    """The eval prompts, checked at config time (a ConfigError names the file and the entry)."""
    from ..config import ConfigError
    from .samplers import check_eval_sampler

    evaluation = config.eval
    if not (evaluation.live.enabled or evaluation.final.enabled):
        return []
    if not evaluation.prompts_path:
        raise ConfigError("eval.prompts_path is required when eval.live or eval.final is enabled")
    check_eval_sampler(evaluation)
    prompts = load_prompts(evaluation.prompts_path, evaluation.width, evaluation.height)
    if evaluation.judge == "shapes":
        _require_judged_prompts(prompts, evaluation.prompts_path)
    return [replace(prompt, max_tokens=config.data.max_token_length) for prompt in prompts]


def _require_judged_prompts(prompts: list[EvalPrompt], path: str) -> None:
    """eval.judge "shapes" counts only prompts in the world's grammar: with none, every eval would
    print and log no accuracy at all, without a word."""
    from ..config import ConfigError
    from ..world.scenes import parse_caption

    if not any(parse_caption(prompt.prompt) for prompt in prompts):
        raise ConfigError(f'eval.judge = "shapes": none of the {len(prompts)} prompts of eval.prompts_path = '
                          f"{path!r} is in the world-of-shapes grammar (like \"a red circle, blue background\", "
                          "a trigger word before it allowed), so nothing would be judged")


def live_eval_due(config: Config, step: int) -> bool:
    live = config.eval.live
    return live.enabled and step % live.every_n_steps == 0


class Evaluator:
    """Runs on the main process. Each call takes the pipeline to evaluate: the training one, or
    under FSDP a copy holding the gathered full weights."""

    def __init__(self, config: Config, prompts: list[EvalPrompt], validation: ValidationSet | None,
                 loss_fn: Callable[..., torch.Tensor], trained_names: list[str], writer=None,
                 stand_ins: dict[str, torch.nn.Module] | None = None):
        self.config = config
        self.prompts = prompts
        self.validation = validation
        self.loss_fn = loss_fn  # loss_fn(pipe, batch, draws)
        self.trained_names = trained_names
        self.writer = writer
        self.stand_ins = stand_ins or {}  # recorded outputs of the cached encoders, which are off the device
        self.results: list[dict[str, Any]] = []

    def live(self, pipe: StableDiffusionXLPipeline, step: int) -> None:
        """Eval images (first `max_batches` prompts) and the validation loss at this step."""
        folder = self.config.output_dir / "eval" / "live" / f"step_{step}"
        self._render(pipe, folder, "live", step, self.config.eval.live.max_batches)
        if self.validation is not None:
            modules = [getattr(pipe, name) for name in self.trained_names]
            loss = validation_loss(modules, functools.partial(self.loss_fn, pipe), self.validation)
            if self.writer:
                self.writer.add_scalar("val/loss", loss, step)

    def final(self, pipe: StableDiffusionXLPipeline, step: int, device=None) -> int:
        """Final eval images, the pipeline moved to `device` first (the cached encoders stay where
        they are); returns how many are invalid (a non-zero count fails the run)."""
        if not self.config.eval.final.enabled:
            return 0
        result = self._render(pipe, self.config.output_dir / "eval" / "final", "final", step,
                              self.config.eval.final.max_batches, device)
        return len(result.invalid)

    @property
    def invalid_images(self) -> list[dict[str, str]]:
        return [image for result in self.results for image in result["invalid"]]

    def _render(self, pipe: StableDiffusionXLPipeline, folder: Path, tag: str, step: int, max_batches: int | None,
                device=None):
        from ..models import with_components

        if self.stand_ins:
            pipe = with_components(pipe, **self.stand_ins)
        if device is not None:
            pipe = pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        result = run_evaluation(pipe, self.config.eval, self.prompts, folder, tag=tag, step=step,
                                writer=self.writer, max_batches=max_batches)
        summary = {"tag": tag, "step": step, **result.summary()}
        if self.writer:
            self.writer.add_scalar(f"eval/{tag}_invalid_images", len(result.invalid), step)
        if self.config.eval.judge == "shapes":
            summary["accuracy"] = self._judge(result.images, tag, step)
        self.results.append(summary)
        return result

    def _judge(self, images: list[Path], tag: str, step: int) -> dict[str, dict[str, float]]:
        """Prompt accuracy per group and per part of the prompt, printed and logged as
        `eval/<tag>/accuracy/<group>` (every part right) and `…/<group>/<part>`."""
        from ..world.accuracy import PARTS, prompt_accuracy

        groups = prompt_accuracy(self.prompts[:len(images)], images)
        if groups:
            print(f"eval/{tag} step {step}: prompt accuracy (shapes judge): "
                  + ", ".join(group.describe() for group in groups), flush=True)
        for group in groups:
            if self.writer:
                name = group.group or "all"
                self.writer.add_scalar(f"eval/{tag}/accuracy/{name}", group.accuracy, step)
                for part in PARTS:
                    self.writer.add_scalar(f"eval/{tag}/accuracy/{name}/{part}", group.part_accuracy(part), step)
        return {group.group or "all": {"all": group.accuracy, **{part: group.part_accuracy(part) for part in PARTS}}
                for group in groups}


def make_validation(batches: list[dict], num_train_timesteps: int, seed: int) -> ValidationSet:
    """Noise and timesteps fixed once for the validation batches (latents are 1/8 of the image)."""
    shapes = []
    for batch in batches:
        height, width = batch["target_sizes"][0].tolist()
        shapes.append((len(batch["captions"]), 4, height // 8, width // 8))
    return make_validation_set(batches, shapes, num_train_timesteps, seed)


def validation_batches(data_plan: DatasetPlan, config: Config, seed: int, cache) -> list[dict]:
    """The held-out images (at most `HELD_OUT_BATCHES` batches of one bucket each) or, without
    any, the first few batches of the training data; without augmentation, always the same."""
    from ..bucket_sampler import BucketBatchSampler
    from ..data import ImageCaptionDataset, collate
    from ..data_plan import Sample

    if data_plan.validation:
        samples = data_plan.validation
        batches = BucketBatchSampler([s.target for s in samples], data_plan.batch_sizes, False, seed).batches(epoch=0)
        chosen = batches[:HELD_OUT_BATCHES]
    else:
        samples = data_plan.samples
        chosen = data_plan.sampler(seed).batches(epoch=0)[:VALIDATION_BATCHES]
    unaugmented = {id(s.folder): s.folder.model_copy(update={"caption_dropout_prob": 0.0, "caption_shuffle_prob": 0.0})
                   for s in samples}
    plain = [Sample(s.record, s.target, unaugmented[id(s.folder)], s.loss_weight) for s in samples]
    items = ImageCaptionDataset(plain, config.data.model_copy(update={"random_flip": False, "crop": "center"}),
                                seed, cache)
    return [collate([items[(index, 0)] for index in batch]) for batch in chosen]
