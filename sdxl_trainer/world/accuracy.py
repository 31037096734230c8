"""Prompt accuracy: the fraction of eval images whose judged content is what their prompt says,
per prompt group, and the same for each part of it (the background colour, the shapes' colours,
the shapes' kinds). Prompts outside the world's grammar are not counted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from ..eval.eval_prompts import EvalPrompt
from .judge import judge, scene_content
from .scenes import parse_caption

PARTS = ("background", "colours", "kinds")


@dataclass
class GroupAccuracy:
    group: str
    correct: int = 0  # every part right
    judged: int = 0
    parts: Counter = field(default_factory=Counter)  # part → images with that part right

    @property
    def accuracy(self) -> float:
        return self.correct / self.judged

    def part_accuracy(self, part: str) -> float:
        return self.parts[part] / self.judged

    def describe(self) -> str:
        parts = ", ".join(f"{part} {100 * self.part_accuracy(part):.0f}%" for part in PARTS)
        return f"{self.group or 'all'} {self.correct}/{self.judged} ({100 * self.accuracy:.0f}%; {parts})"


def prompt_accuracy(prompts: Sequence[EvalPrompt], images: Sequence[Path | Image.Image]) -> list[GroupAccuracy]:
    """One entry per group (in the order groups first appear) of the prompts the grammar reads."""
    groups: dict[str, GroupAccuracy] = {}
    for prompt, image in zip(prompts, images, strict=True):
        scene = parse_caption(prompt.prompt)
        if scene is None:
            continue
        picture = Image.open(image) if isinstance(image, Path) else image
        (background, shapes), (wanted_background, wanted_shapes) = judge(picture).content(), scene_content(scene)
        right = {"background": background == wanted_background,
                 "colours": Counter(c for _, c in shapes.elements()) == Counter(c for _, c in wanted_shapes.elements()),
                 "kinds": Counter(k for k, _ in shapes.elements()) == Counter(k for k, _ in wanted_shapes.elements())}
        tally = groups.setdefault(prompt.group, GroupAccuracy(prompt.group))
        tally.judged += 1
        tally.correct += int(background == wanted_background and shapes == wanted_shapes)
        tally.parts.update(part for part, ok in right.items() if ok)
    return list(groups.values())
