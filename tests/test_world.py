"""The world of shapes and its judge: scenes are deterministic, captions round-trip through the
grammar, masks match what is drawn, and the judge reads held-out ground-truth images at the
accuracy the README states (≥ 98 %), at the tiny model's size and at 128²."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from sdxl_trainer.eval.eval_prompts import EvalPrompt
from sdxl_trainer.world.accuracy import prompt_accuracy
from sdxl_trainer.world.judge import judge, prompt_matches, scene_content
from sdxl_trainer.world.scenes import (
    PALETTE,
    SHAPES,
    Scene,
    Shape,
    WorldSettings,
    caption,
    parse_caption,
    render,
    scene_for_seed,
)

ALL_SHAPES = WorldSettings(shapes=SHAPES)
HELD_OUT = range(10**6, 10**6 + 300)


def test_a_seed_gives_the_same_scene_and_the_same_pixels() -> None:
    first, second = scene_for_seed(5, ALL_SHAPES), scene_for_seed(5, ALL_SHAPES)
    assert first == second and first != scene_for_seed(6, ALL_SHAPES)
    assert np.array_equal(np.asarray(render(first, 64)[0]), np.asarray(render(second, 64)[0]))


def test_scenes_keep_their_promises() -> None:
    for seed in range(500):
        scene = scene_for_seed(seed, ALL_SHAPES)
        colours = [shape.colour for shape in scene.shapes]
        assert 1 <= len(scene.shapes) <= 2 and scene.background not in colours and len(set(colours)) == len(colours)
        _, masks = render(scene, 64)
        assert not (len(masks) == 2 and (masks[0] & masks[1]).any())  # shapes never overlap


def test_masks_cover_the_drawn_pixels_in_the_shape_colour() -> None:
    scene = Scene("blue", "plain", (Shape("triangle", "yellow", (0.5, 0.5), 0.6),))
    image, (mask,) = render(scene, 128)
    pixels = np.asarray(image).astype(int)
    distance = np.abs(pixels - PALETTE["yellow"]).sum(-1)
    # At least half covered (the mask) is at most half way from yellow to blue (510 apart), and the rest beyond.
    assert (distance[mask] <= 256).all() and (distance[~mask] >= 254).all()
    # A triangle fills half its bounding box.
    assert 0.47 < mask.sum() / (0.6 * 128) ** 2 < 0.53


def test_the_same_scene_at_two_sizes_is_the_same_picture() -> None:
    scene = scene_for_seed(11, ALL_SHAPES)
    small = np.asarray(render(scene, 64)[0], dtype=float)
    large = np.asarray(render(scene, 128)[0], dtype=float).reshape(64, 2, 64, 2, 3).mean((1, 3))
    assert np.abs(small - large).mean() < 2.0


def test_captions_follow_the_grammar_and_parse_back() -> None:
    scene = Scene("black", "gradient", (Shape("square", "green", (0.7, 0.5), 0.3),
                                        Shape("circle", "white", (0.3, 0.5), 0.3)))
    assert caption(scene) == "a white circle and a green square, black gradient background"
    for seed in range(300):
        scene = scene_for_seed(seed, ALL_SHAPES)
        assert scene_content(parse_caption(caption(scene))) == scene_content(scene)
        assert parse_caption("tok, " + caption(scene)) is not None
    for text in ("a photo of a cat", "a red circle, blue", "a red circle, striped background", "a pink circle, "
                 "blue background", "a red hexagon, blue background", ""):
        assert parse_caption(text) is None, text


@pytest.mark.parametrize("size", [64, 128])
def test_the_judge_reads_held_out_images_at_98_percent_or_better(size: int) -> None:
    correct = sum(prompt_matches(render(scene, size)[0], scene)
                  for scene in (scene_for_seed(seed, ALL_SHAPES) for seed in HELD_OUT))
    assert correct / len(HELD_OUT) >= 0.98, correct


def test_the_judge_names_kind_colour_and_background() -> None:
    scene = Scene("white", "gradient", (Shape("cross", "red", (0.3, 0.4), 0.35),
                                        Shape("circle", "black", (0.72, 0.6), 0.35)))
    verdict = judge(render(scene, 128)[0])
    assert verdict.background == "white"
    assert verdict.content()[1] == Counter({("cross", "red"): 1, ("circle", "black"): 1})
    # A wrong colour, a wrong kind or a missing shape is not a match.
    assert not prompt_matches(render(scene, 128)[0], parse_caption("a red cross, white background"))
    assert not prompt_matches(render(scene, 128)[0],
                              parse_caption("a red square and a black circle, white background"))


def test_a_flat_image_has_no_shapes_and_noise_matches_nothing() -> None:
    assert judge(render(Scene("green"), 64)[0]).shapes == ()
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert not prompt_matches(noise, parse_caption("a red circle, blue background"))


def test_prompt_accuracy_counts_per_group_and_skips_other_prompts() -> None:
    scenes = [scene_for_seed(seed, ALL_SHAPES) for seed in range(4)]
    images = [render(scene, 64)[0] for scene in scenes]
    prompts = [EvalPrompt(caption(scenes[0]), "", 0, 64, 64, "a"), EvalPrompt(caption(scenes[2]), "", 0, 64, 64, "a"),
               EvalPrompt(caption(scenes[2]), "", 0, 64, 64, "b"), EvalPrompt("a photo of a cat", "", 0, 64, 64, "b")]
    groups = prompt_accuracy(prompts, images)
    assert [(g.group, g.correct, g.judged) for g in groups] == [("a", 1, 2), ("b", 1, 1)]
    # Scene 2 drawn for scene 0's prompt: each part is right only where the two scenes agree.
    wrong = {"background": scenes[0].background == scenes[2].background,
             "colours": sorted(s.colour for s in scenes[0].shapes) == sorted(s.colour for s in scenes[2].shapes),
             "kinds": sorted(s.kind for s in scenes[0].shapes) == sorted(s.kind for s in scenes[2].shapes)}
    swapped = prompt_accuracy([prompts[0]], [images[2]])[0]
    assert {part: swapped.part_accuracy(part) == 1.0 for part in wrong} == wrong and swapped.correct == 0
