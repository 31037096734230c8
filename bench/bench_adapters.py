"""The adapter tools' benchmark: adapters extracted from a full fine-tune of the pretrained tiny SDXL,
and a rank-32 DoRA resized to 8 against one trained at 8.

    python bench/bench_adapters.py            # about 4 minutes on 2 CPU cores
    python bench/bench_adapters.py --smoke    # a minute: checks the code path only

Three quickstart runs (`configs/quickstart.json`, 150 steps, the cross concept): a full fine-tune
(UNet and CLIP-L, the learning benchmark's learning rates) and DoRA at rank 8 and at rank 32. From
the full fine-tune, extract_adapter's code extracts LoRA and DoRA at ranks 4, 8, 16 and 32 (every
UNet layer, convolutions included, and CLIP-L's attention and MLP); the rank-32 DoRA is resized to 8.
For each: the merged weights' relative error ‖W_merged − W_target‖/‖W_target‖ over all adapted
layers together (the target is the full fine-tune, or for the resize the rank-32 DoRA) and the
part of the update the rank misses. The shapes judge reads eval images of the models marked in
`judged`: concept accuracy over the 16 concept prompts, prior accuracy over the first 16 prior
prompts, at the quickstart's eval settings but 10 sampling steps (each image depends on its prompt's seed only).

Writes bench/results/adapters.{json,md}.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, bench_args, train_quickstart, write_results

RANKS = (4, 8, 16, 32)
JUDGED_RANKS = (8, 32)
STEPS = 150
PROMPTS_PER_GROUP = 16
EVAL_STEPS = 10  # the quickstart's sampler at half its steps: 8 judged models fit the time
FULL = {"adapter.type": "none", "training.lr_unet": 1e-4, "training.lr_text_encoder_1": 5e-5}
DORA_8 = {"adapter.rank": 8, "adapter.alpha": 8}
DORA_32 = {"adapter.rank": 32, "adapter.alpha": 32}


def train(name: str, overrides: dict[str, Any], work: Path, steps: int, smoke: bool) -> Path:
    """One quickstart run with `overrides` and no eval (--smoke: in this process); its output folder."""
    settings = {"run.output_root": str(work / "runs"), "run.name": name, "training.num_steps": steps,
                "training.checkpoint_every": 10**6, "training.tensorboard.enabled": False,
                "eval.live.enabled": False, "eval.final.enabled": False, "export.save_single_file": False,
                "data.latent_cache.cache_dir": str(work / "latents"), "data.text_cache.cache_dir": str(work / "text"),
                "data.scan_cache_dir": str(work / "scan"), **overrides}
    train_quickstart(name, settings, in_process=smoke)
    return work / "runs" / name


class Judge:
    """Renders a model's eval images and reads them with the shapes judge."""

    def __init__(self, work: Path, smoke: bool) -> None:
        from sdxl_trainer.config import load_config
        from sdxl_trainer.eval.evaluator import eval_prompts

        self.config = load_config(ROOT / "configs" / "quickstart.json",
                                  [f"eval.num_inference_steps={1 if smoke else EVAL_STEPS}"])
        prompts = eval_prompts(self.config)
        count = 1 if smoke else PROMPTS_PER_GROUP
        self.prompts = [prompt for group in ("concept", "prior")
                        for prompt in [p for p in prompts if p.group == group][:count]]
        self.work = work
        self.renders = 0

    def accuracy(self, pipe) -> dict[str, float]:
        from sdxl_trainer.eval.evaluation import run_evaluation
        from sdxl_trainer.world.accuracy import prompt_accuracy

        pipe.set_progress_bar_config(disable=True)
        self.renders += 1
        result = run_evaluation(pipe, self.config.eval, self.prompts, self.work / f"eval{self.renders}",
                                tag="final", step=0)
        return {group.group: group.accuracy for group in prompt_accuracy(self.prompts, result.images)}


def with_adapter(base, path: Path):
    """A copy of the base pipeline with the adapter file merged (the trainer's own loader)."""
    from sdxl_trainer.formats.adapter_files import load_adapter_into

    pipe = copy.deepcopy(base)
    load_adapter_into(pipe, path)
    return pipe


def row(model: str, rank: int | None, errors: list | None, seconds: float | None,
        accuracy: dict[str, float] | None) -> dict[str, Any]:
    from sdxl_trainer.lowrank import overall

    weight, update = overall(errors) if errors else (None, None)
    return {"model": model, "rank": rank, "merged_weight_error": weight, "update_error": update,
            "seconds": seconds, "concept": (accuracy or {}).get("concept"), "prior": (accuracy or {}).get("prior")}


def extracted_rows(base, tuned, judge: Judge, work: Path, ranks: tuple[int, ...]) -> list[dict[str, Any]]:
    """LoRA and DoRA extracted from the full fine-tune at each rank (and one with the randomized SVD)."""
    from sdxl_trainer.adapter_extraction import ExtractOptions, extract, write_adapter
    from sdxl_trainer.lowrank import RankChoice

    rows = []
    cases = [(rank, dora, "exact") for rank in ranks for dora in (False, True)] + [(ranks[-1], True, "lowrank")]
    for rank, dora, svd in cases:
        start = time.perf_counter()
        extraction = extract(base, tuned, ExtractOptions(RankChoice(rank, svd=svd), dora=dora))
        seconds = time.perf_counter() - start
        accuracy = None
        if svd == "exact" and rank in JUDGED_RANKS:
            [path] = write_adapter(base, extraction, work / f"extracted_{rank}_{dora}.safetensors", ("kohya",))
            accuracy = judge.accuracy(with_adapter(base, path))
        name = f"{'DoRA' if dora else 'LoRA'} extracted" + (", --svd lowrank" if svd == "lowrank" else "")
        rows.append(row(name, rank, [layer.error for layer in extraction.layers], seconds, accuracy))
        print(rows[-1], flush=True)
    return rows


def resize_rows(base, judge: Judge, dora_8: Path, dora_32: Path, work: Path) -> list[dict[str, Any]]:
    """The trained rank-8 and rank-32 DoRAs, and the rank-32 one resized to 8."""
    from sdxl_trainer.adapter_kinds import DIFFUSERS_WEIGHT_NAME
    from sdxl_trainer.adapter_resizing import resize, write_resized
    from sdxl_trainer.lowrank import RankChoice

    dora_8, dora_32 = dora_8 / DIFFUSERS_WEIGHT_NAME, dora_32 / DIFFUSERS_WEIGHT_NAME
    start = time.perf_counter()
    resized = resize(dora_32, RankChoice(8), base)
    seconds = time.perf_counter() - start
    path = write_resized(resized, work / "dora_32_to_8.safetensors")
    return [row("DoRA trained at rank 32", 32, None, None, judge.accuracy(with_adapter(base, dora_32))),
            row("DoRA trained at rank 8", 8, None, None, judge.accuracy(with_adapter(base, dora_8))),
            row("DoRA rank 32 resized to 8", 8, resized.errors, seconds, judge.accuracy(with_adapter(base, path)))]


def main(argv: list[str] | None = None) -> None:
    from sdxl_trainer.config import ModelConfig
    from sdxl_trainer.models import load_pipeline

    args = bench_args(__doc__.splitlines()[0], argv)
    steps, ranks = (2, (4, 8)) if args.smoke else (STEPS, RANKS)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        full = train("full", FULL, work, steps, args.smoke)
        dora_8, dora_32 = (train(name, overrides, work, steps, args.smoke)
                           for name, overrides in (("dora8", DORA_8), ("dora32", DORA_32)))
        print(f"trained in {time.perf_counter() - start:.0f} s", flush=True)
        base, tuned = load_pipeline(ModelConfig(id="builtin:tiny-sdxl")), load_pipeline(ModelConfig(id=str(full)))
        judge = Judge(work, args.smoke)
        rows = [row("full fine-tune", None, None, None, judge.accuracy(tuned))]
        rows += extracted_rows(base, tuned, judge, work, ranks)
        rows += resize_rows(base, judge, dora_8, dora_32, work)
    notes = (f"{steps} steps of the quickstart each. merged_weight_error: ‖W_merged − W_target‖ / ‖W_target‖ over "
             "every adapted layer (target: the full fine-tune; for the resize, the rank-32 DoRA); update_error: "
             "the part of the update the rank misses, ‖ΔW − ΔW_r‖ / ‖ΔW‖; seconds: the extraction or resize "
             f"alone (all layers, one thread); concept / prior: the shapes judge on {len(judge.prompts) // 2} "
             f"prompts each, {EVAL_STEPS} sampling steps (blank: not judged).")
    write_results("adapters" + ("_smoke" if args.smoke else ""), rows, notes, args.results_dir)


if __name__ == "__main__":
    main()
