"""Regenerate the sample dataset in data/images: the quickstart's new concept (nothing is downloaded).

    python data/generate_sample_images.py

Eighteen world-of-shapes images of a *cross*, a shape and a word the pretrained built-in tiny SDXL
has never seen, on the world's backgrounds, with captions in its grammar ("a red cross, blue
background"), at the pretrained model's size, 128² (where its 8× VAE can draw a cross's arms), and
at 192×128 and 128×192, so the quickstart fills three aspect buckets.

It also writes data/reg, eighteen regularization images for prior preservation (one shape the
model knows on each, from seeds the pretraining data and the eval prompts never use), which
configs/quickstart_prior_preservation.json trains beside the crosses; and the eval prompts:
data/eval_prompts.quickstart.json (group "concept": new scenes of crosses, though a caption the
grammar can only vary by colour and background, so 7 of the 16 are also training captions;
group "prior": scenes of the shapes the model knew, which training should not forget) and
data/eval_prompts.world.json (held-out scenes of the pretraining world, for the pretrained
model's own prompt accuracy). The files are committed; this script documents how they were made
and rebuilds them exactly.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdxl_trainer.atomic import write_json
from sdxl_trainer.world.scenes import WorldSettings, caption, render, sample_scene, scene_for_seed

SIZES = ((192, 128), (128, 192), (128, 128))
IMAGES = 18
CONCEPT = WorldSettings(shapes=("cross",), two_shape_fraction=0.0)
SEED = 2024
CONCEPT_PROMPTS, PRIOR_PROMPTS, WORLD_PROMPTS = 16, 32, 64
HELD_OUT = 10**6  # world scenes from this seed on were never in the pretraining data
REG_SEEDS = range(2 * 10**6, 2 * 10**6 + IMAGES)  # known shapes, never in pretraining or eval


def main() -> None:
    folder = Path(__file__).parent / "images"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    for index in range(IMAGES):
        scene = sample_scene(rng, CONCEPT)
        image, _ = render(scene, *SIZES[index % len(SIZES)])
        image.save(folder / f"shape_{index:02d}.png", optimize=True)
        (folder / f"shape_{index:02d}.txt").write_text(caption(scene) + "\n", encoding="utf-8")
    reg = folder.parent / "reg"
    reg.mkdir(exist_ok=True)
    for seed in REG_SEEDS:
        scene = scene_for_seed(seed, WorldSettings(two_shape_fraction=0.0))
        render(scene, 128)[0].save(reg / f"reg_{seed}.png", optimize=True)
        (reg / f"reg_{seed}.txt").write_text(caption(scene) + "\n", encoding="utf-8")
    concept = [sample_scene(rng, CONCEPT) for _ in range(CONCEPT_PROMPTS)]
    prior = [scene_for_seed(HELD_OUT + index) for index in range(WORLD_PROMPTS)]
    entries = [{"prompt": caption(scene), "seed": index, "group": "concept"} for index, scene in enumerate(concept)]
    entries += [{"prompt": caption(scene), "seed": 100 + index, "group": "prior"}
                for index, scene in enumerate(prior[:PRIOR_PROMPTS])]
    write_json(folder.parent / "eval_prompts.quickstart.json", entries)
    write_json(folder.parent / "eval_prompts.world.json",
               [{"prompt": caption(scene), "seed": index, "group": "world"} for index, scene in enumerate(prior)])


if __name__ == "__main__":
    main()
