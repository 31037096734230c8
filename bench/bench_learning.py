"""The learning benchmark: how fast each method teaches the pretrained tiny SDXL a new concept, and
what it costs the prior.

    python bench/bench_learning.py            # about an hour on 2 CPU cores
    python bench/bench_learning.py --smoke    # seconds: checks the code path only

Every run is the quickstart (`configs/quickstart.json`: 18 images of a *cross*, a shape and a word
the model has never seen) with one thing changed, at its number of steps and batch size. The
shapes judge reads the eval images: concept accuracy over the 16 "concept" prompts (before the
first step, then at every sixth of the steps) and, at the end, prior accuracy over the 32 "prior"
prompts (scenes of the shapes the model knew). Learning rates are each method's usual choice for
this model (say, what a user would set), not tuned per method to win.

Writes bench/results/learning.{json,md}, docs/images/learning_grid.png (rows: the model before
training, then each method at the end; columns: the first concept prompts) and
docs/images/quickstart.png (the quickstart's concept prompts before, a third of the way, at the end).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import QUICKSTART, ROOT, bench_args, train_quickstart, write_results

EVALS = 6  # live evals after the one at step 0
DOCS_IMAGES = ROOT / "docs" / "images"
GRID_COLUMNS = 8
REG = ROOT / "data" / "reg"  # 18 known-shape images (data/generate_sample_images.py)

TOKEN = "<shapes>"
# configs/textual_inversion.json's token and rates; the text encoders' own weights stay frozen.
TI = {"textual_inversion.tokens": [{"token": TOKEN, "vectors": 2, "init_word": "shape"}],
      "textual_inversion.lr": 5e-3, "data.caption_prefix": f"{TOKEN},"}

# name → config overrides (JSON values), applied on top of the quickstart.
RUNS: dict[str, dict[str, Any]] = {
    "DoRA rank 8 (quickstart)": {},
    "LoRA rank 8": {"adapter.type": "lora"},
    "LoKr": {"adapter.type": "lokr"},
    "LoHa rank 8": {"adapter.type": "loha"},
    "full fine-tune": {"adapter.type": "none", "training.lr_unet": 1e-4, "export.save_single_file": False},
    "DoRA + prior preservation": {"training.prior_loss_weight": 1.0},  # the reg subset is added in main()
    "DoRA + output preservation": {"training.output_preservation": {"trigger": "cross", "classes": ["square"]}},
    "DoRA, Prodigy": {"optimizer.type": "prodigy", "training.lr_unet": 1.0},
    "DoRA rank 16": {"adapter.rank": 16, "adapter.alpha": 16},
    "LoRA rank 16": {"adapter.type": "lora", "adapter.rank": 16, "adapter.alpha": 16},
    # A new token before every caption and every concept prompt (main() writes those prompts), its
    # vectors in both text encoders trained alone, or with the DoRA adapter for the first half.
    "textual inversion": {**TI, "textual_inversion.train_adapter": False},
    "pivotal tuning (DoRA rank 8)": {**TI, "textual_inversion.train_adapter": True,
                                     "textual_inversion.train_fraction": 0.5},
}


SMOKE_RUNS = ("DoRA rank 8 (quickstart)", "pivotal tuning (DoRA rank 8)")


def smoke_prompts(folder: Path) -> Path:
    """--smoke: the quickstart's first concept prompt and first prior prompt (one of each group
    the rows report), written to `folder`."""
    prompts = json.loads((ROOT / "data" / "eval_prompts.quickstart.json").read_text(encoding="utf-8"))
    firsts = [next(prompt for prompt in prompts if prompt["group"] == group) for group in ("concept", "prior")]
    path = folder / "eval_prompts.smoke.json"
    path.write_text(json.dumps(firsts), encoding="utf-8")
    return path


def token_prompts(prompts_path: Path, folder: Path) -> Path:
    """The prompts of `prompts_path` with the new token before each concept prompt, written to `folder`."""
    prompts = json.loads(prompts_path.read_text(encoding="utf-8"))
    for prompt in prompts:
        if prompt["group"] == "concept":
            prompt["prompt"] = f"{TOKEN}, {prompt['prompt']}"
    path = folder / f"token_{prompts_path.name}"
    path.write_text(json.dumps(prompts), encoding="utf-8")
    return path


def without_image_dir(folder: Path, config_path: Path) -> Path:
    """`config_path` without `data.image_dir`, written to `folder`: a run with `data.subsets`
    names each subset's folder instead (setting both is a config error)."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["data"].pop("image_dir", None)
    path = folder / "quickstart_subsets.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def eval_every(steps: int) -> int:
    """The live-eval interval of a run of `steps`: EVALS evals after the one at step 0."""
    return max(1, steps // EVALS)


def train(name: str, overrides: dict[str, Any], work: Path, steps: int, smoke: bool,
          config: Path = QUICKSTART) -> dict[str, Any]:
    """One run of `config` (the quickstart's) with `overrides` (--smoke: in this process); the eval
    entries of its run summary."""
    settings = {"run.output_root": str(work / "runs"), "run.name": "run" + "".join(c for c in name if c.isalnum()),
                "training.num_steps": steps, "training.checkpoint_every": 10**6,
                "training.tensorboard.enabled": False, "eval.live.every_n_steps": eval_every(steps),
                "eval.live.at_start": True, "data.latent_cache.cache_dir": str(work / "latents"),
                "data.text_cache.cache_dir": str(work / "text"), "data.scan_cache_dir": str(work / "scan"),
                "export.save_single_file": False, **overrides}
    if "data.subsets" in overrides:
        config = without_image_dir(work, config)
    train_quickstart(name, settings, in_process=smoke, config=config)
    output = work / "runs" / settings["run.name"]
    return {"evals": json.loads((output / "run_summary.json").read_text())["eval"], "output": output}


def row_of(name: str, evals: list[dict[str, Any]]) -> dict[str, Any]:
    live = [entry for entry in evals if entry["tag"] == "live"]
    final = next(entry for entry in evals if entry["tag"] == "final")
    row: dict[str, Any] = {"method": name}
    for entry in live:
        row[f"concept@{entry['step']}"] = entry["accuracy"]["concept"]["all"]
    concept, prior = final["accuracy"]["concept"], final["accuracy"]["prior"]
    row |= {"concept_final": concept["all"], "concept_kinds": concept["kinds"], "concept_colours": concept["colours"],
            "prior_final": prior["all"], "prior_kinds": prior["kinds"], "prior_colours": prior["colours"]}
    return row


def grid(rows: list[tuple[str, list[Path]]], out: Path) -> None:
    """One row of images per method (a label is in the README's table, not in the picture)."""
    size, gap = 128, 4
    pictures = [[np.asarray(Image.open(path).convert("RGB").resize((size, size))) for path in paths[:GRID_COLUMNS]]
                for _, paths in rows]
    height = len(pictures) * (size + gap) - gap
    canvas = np.full((height, GRID_COLUMNS * (size + gap) - gap, 3), 255, dtype=np.uint8)
    for r, row in enumerate(pictures):
        for c, picture in enumerate(row):
            canvas[r * (size + gap):r * (size + gap) + size, c * (size + gap):c * (size + gap) + size] = picture
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).quantize(256).save(out, optimize=True)  # a palette keeps the PNG small


def eval_images(folder: Path) -> list[Path]:
    return sorted(path for path in folder.glob("*.png") if path.name[:2].isdigit())


def main(argv: list[str] | None = None) -> None:
    args = bench_args(__doc__.splitlines()[0], argv)
    # --smoke: the quickstart's row and one with a new token (the only other code path)
    runs = {name: RUNS[name] for name in SMOKE_RUNS} if args.smoke else RUNS
    quickstart = json.loads(QUICKSTART.read_text(encoding="utf-8"))
    steps = 4 if args.smoke else quickstart["training"]["num_steps"]
    rows, pictures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        every = 2 if args.smoke else eval_every(steps)
        smoke = {"eval.num_inference_steps": 1, "eval.live.every_n_steps": every,
                 "eval.prompts_path": str(smoke_prompts(work))} if args.smoke else {}
        for name, overrides in runs.items():
            if name.startswith("DoRA + prior"):
                overrides = {**overrides, "data.subsets": [{"image_dir": str(ROOT / "data" / "images")},
                                                           {"image_dir": str(REG), "is_reg": True}]}
            settings = {**overrides, **smoke}
            if "textual_inversion.tokens" in overrides:
                prompts = Path(smoke.get("eval.prompts_path", ROOT / "data" / "eval_prompts.quickstart.json"))
                settings["eval.prompts_path"] = str(token_prompts(prompts, work))
            result = train(name, settings, work, steps, args.smoke)
            rows.append(row_of(name, result["evals"]))
            if not pictures:
                live = result["output"] / "eval" / "live"
                pictures.append(("before", eval_images(live / "step_0")))
                during = [(f"step {step}", eval_images(live / f"step_{step}"))
                          for step in (0, steps // 3 // every * every)]
                grid([*during, ("end", eval_images(result["output"] / "eval" / "final"))],
                     args.results_dir / "quickstart_grid.png" if args.smoke else DOCS_IMAGES / "quickstart.png")
            pictures.append((name, eval_images(result["output"] / "eval" / "final")))
            print(f"{name}: {rows[-1]}", flush=True)
        grid(pictures, args.results_dir / "learning_grid.png" if args.smoke else DOCS_IMAGES / "learning_grid.png")
    batch = quickstart["data"]["bucket"]["batch_size"]
    notes = (f"{steps} steps, batch {batch}, the quickstart's data and eval settings; concept accuracy over 16 "
             "prompts, prior accuracy over 32 (the shapes judge). Rows of docs/images/learning_grid.png: before, then "
             + ", ".join(runs) + ".")
    write_results("learning", rows, notes, args.results_dir)


if __name__ == "__main__":
    main()
