"""The pretrained built-in tiny SDXL's prompt accuracy by guidance scale and sampling steps.

    python bench/bench_pretrained.py            # about 3 minutes on 2 CPU cores
    python bench/bench_pretrained.py --smoke    # seconds: checks the code path only

The 64 held-out world prompts of data/eval_prompts.world.json (scenes never in the pretraining
data), rendered at 128² with the quickstart's sampler (euler, normal schedule) at each guidance
scale of CFG_SCALES and each step count of STEPS, read by the shapes judge. Each kind's column
counts the prompts naming that kind whose image shows every shape of it the prompt names. Writes
bench/results/pretrained.{json,md}.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import QUICKSTART, ROOT, bench_args, write_results
from sdxl_trainer.config import load_config
from sdxl_trainer.eval.eval_prompts import EvalPrompt, load_prompts
from sdxl_trainer.eval.evaluation import run_evaluation
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.world.accuracy import prompt_accuracy
from sdxl_trainer.world.judge import judge
from sdxl_trainer.world.scenes import PRETRAINED_SHAPES, parse_caption

PROMPTS = ROOT / "data" / "eval_prompts.world.json"
CFG_SCALES = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
STEPS = (10, 20)


def kinds_right(prompts: list[EvalPrompt], images: list[Path]) -> dict[str, str]:
    """Per known kind: "right / prompts naming it" (right = the image shows each shape of that kind
    the prompt names, in number)."""
    right, named = Counter(), Counter()
    for prompt, image in zip(prompts, images, strict=True):
        wanted = Counter(shape.kind for shape in parse_caption(prompt.prompt).shapes)
        shown = Counter(shape.kind for shape in judge(Image.open(image)).shapes)
        for kind, count in wanted.items():
            named[kind] += 1
            right[kind] += int(shown[kind] >= count)
    return {kind: f"{right[kind]} / {named[kind]}" for kind in PRETRAINED_SHAPES if named[kind]}


def main(argv: list[str] | None = None) -> None:
    args = bench_args(__doc__.splitlines()[0], argv)
    scales, step_counts = ((2.0,), (1,)) if args.smoke else (CFG_SCALES, STEPS)
    prompts = load_prompts(PROMPTS, 128, 128)[:2 if args.smoke else None]
    pipeline, rows = None, []
    for steps in step_counts:
        for scale in scales:
            config = load_config(QUICKSTART, [f"eval.cfg_scale={scale}", f"eval.num_inference_steps={steps}"])
            pipeline = pipeline or load_pipeline(config.model)
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                result = run_evaluation(pipeline, config.eval, prompts, Path(tmp), tag="world", step=0)
                (world,) = prompt_accuracy(prompts, result.images)
                row: dict[str, Any] = {"cfg": scale, "steps": steps,
                                       "prompts_right": f"{world.correct} / {world.judged}", "accuracy": world.accuracy,
                                       "backgrounds": world.part_accuracy("background"),
                                       "colours": world.part_accuracy("colours"), **kinds_right(prompts, result.images)}
            rows.append(row | {"seconds": time.perf_counter() - start})
            print(row, flush=True)
    notes = (f"{len(prompts)} held-out world prompts at 128², euler, normal schedule; accuracy, backgrounds and "
             "colours as fractions of the prompts; a kind's column: prompts naming it whose image shows it.")
    write_results("pretrained", rows, notes, args.results_dir)


if __name__ == "__main__":
    main()
