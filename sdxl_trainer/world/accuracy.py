"""Prompt accuracy: the fraction of eval images whose judged content is what their prompt says,
per prompt group. Prompts outside the world's grammar are not counted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from ..eval_prompts import EvalPrompt
from .judge import judge, scene_content
from .scenes import parse_caption


@dataclass(frozen=True)
class GroupAccuracy:
    group: str
    correct: int
    judged: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.judged

    def describe(self) -> str:
        return f"{self.group or 'all'} {self.correct}/{self.judged} ({100 * self.accuracy:.0f}%)"


def prompt_accuracy(prompts: Sequence[EvalPrompt], images: Sequence[Path | Image.Image]) -> list[GroupAccuracy]:
    """One entry per group (in the order groups first appear) of the prompts the grammar reads."""
    counts: dict[str, list[int]] = {}
    for prompt, image in zip(prompts, images, strict=True):
        scene = parse_caption(prompt.prompt)
        if scene is None:
            continue
        picture = Image.open(image) if isinstance(image, Path) else image
        correct = judge(picture).content() == scene_content(scene)
        tally = counts.setdefault(prompt.group, [0, 0])
        tally[0] += int(correct)
        tally[1] += 1
    return [GroupAccuracy(group, correct, judged) for group, (correct, judged) in counts.items()]
