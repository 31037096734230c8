"""A quantized frozen base (`model.base_quantization`): memory planned and measured, and the step
time, against the full-precision base.

    OMP_NUM_THREADS=1 python bench/bench_quantized_base.py --sections tiny anchors   # about 15 min on 2 cores
    OMP_NUM_THREADS=1 python bench/bench_quantized_base.py --sections block            # about 3 min
    python bench/bench_quantized_base.py --sections learning                          # about 15 min
    python bench/bench_quantized_base.py --smoke      # the tiny section, full precision and fp8, 1 step

Sections (each a results file):
- `quantized_base_tiny`: the built-in tiny model on the CPU, the quickstart's DoRA rank 4 (UNet
  only, batch 2 at 64², fp32, AdamW) with each base: the planned peak against the tensor bytes
  tracked during two real trainer steps, and the step time (the fastest of 8, the bases' steps
  interleaved) as a ratio to the full-precision base.
- `quantized_base_block`: one full-width SDXL transformer block (bench/bench_dora.py's 32×32 level:
  1280 channels, 1024 tokens, cross-attention to a 77 × 2048 context) under the trainer's fast DoRA
  rank 16, fp32 compute, on each base: CPU time of forward + backward, the bases taking turns.
- `quantized_base_anchors`: CUDA plans at 1024², batch 1, bf16 autocast, gradient checkpointing,
  cached latents and text, 8-bit AdamW, DoRA rank 16 on the UNet, for each base (target: 6 GB).
- `quantized_base_learning`: the learning benchmark's quickstart run (bench/bench_learning.py: the
  quickstart teaching the pretrained tiny model a new shape, its steps, the shapes judge) on the
  full-precision base, an fp8 one and an NF4 one, concept and prior accuracy side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import QUICKSTART, bench_args, write_results

SDXL = "stabilityai/stable-diffusion-xl-base-1.0"  # not downloaded: planned with SDXL base 1.0's shapes
BASES = ("none", "float8_e4m3fn", "int8", "nf4")
SECTIONS = ("tiny", "block", "anchors", "learning")
TIMED_ROUNDS = 8
BLOCK_RANK, BLOCK_REPEATS = 16, 5


def tiny_config(base: str, folder: str) -> dict[str, Any]:
    return {"model": {"id": "builtin:tiny-sdxl", "train_text_encoder_1": False, "attention": "sdpa",
                      "use_gradient_checkpointing": False, "base_quantization": base},
            "adapter": {"type": "dora", "rank": 4, "alpha": 4}, "run": {"name": "quantized", "output_root": folder},
            "training": {"num_steps": 20, "lr_unet": 1e-3, "seed": 1, "tensorboard": {"enabled": False}},
            "optimizer": {"type": "adamw"}, "eval": {"live": {"enabled": False}, "final": {"enabled": False}},
            "data": {"text_cache": {"enabled": False}}}


@contextlib.contextmanager
def tiny_run(base: str, planned=None) -> Iterator[Any]:
    """The trainer's run on the tiny model (with the memory watch when `planned` is given)."""
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.planning import RunPlan
    from sdxl_trainer.run import start_run

    with tempfile.TemporaryDirectory() as folder:
        run = start_run(validate_config(tiny_config(base, folder)), RunPlan(None, 20, [], "", memory=planned))
        run.progress.disable = True
        yield run
        del run
        gc.collect()


def trainer_step(run: Any) -> float:
    """One trainer step (forward, backward, optimizer) on a batch of 2 at 64²; its seconds."""
    from bench.gpu_sdxl import latent_batch
    from sdxl_trainer.run import forward_backward, optimizer_step

    start = time.perf_counter()
    forward_backward(run, latent_batch(2, 8))
    optimizer_step(run)
    return time.perf_counter() - start


def tracked_peak(base: str, planned, steps: int) -> int:
    with tiny_run(base, planned) as run:
        for _ in range(steps):
            trainer_step(run)
        run.memory.stop()
        return run.memory.run_peak


def step_times(bases: tuple[str, ...], rounds: int) -> dict[str, float]:
    """The fastest step of each base, the bases' steps interleaved round by round (so that load
    from other jobs falls on all of them alike), after one warm-up step each."""
    with contextlib.ExitStack() as stack:
        runs = {base: stack.enter_context(tiny_run(base)) for base in bases}
        times: dict[str, list[float]] = {base: [] for base in bases}
        for round_ in range(rounds + 1):
            for base, run in runs.items():
                seconds = trainer_step(run)
                if round_:
                    times[base].append(seconds)
    return {base: min(values) for base, values in times.items()}


def tiny_rows(smoke: bool) -> list[dict[str, Any]]:
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.memory.plan import StepShape, plan_memory

    bases = ("none", "float8_e4m3fn") if smoke else BASES
    fastest = step_times(bases, 1 if smoke else TIMED_ROUNDS)
    rows = []
    for base in bases:
        with tempfile.TemporaryDirectory() as folder:
            planned = plan_memory(validate_config(tiny_config(base, folder)), StepShape(2, 64, 64), "cpu")
        measured = tracked_peak(base, planned, 1 if smoke else 2)
        rows.append({"base": base, "planned_MB": planned.peak / 1e6, "measured_MB": measured / 1e6,
                     "measured_over_planned": measured / planned.peak, "unet_weights_MB":
                     sum(planned.weights["unet"].values()) / 1e6, "step_s": fastest[base],
                     "step_vs_full_precision": fastest[base] / fastest["none"]})
        print(rows[-1], flush=True)
    return rows


def block_rows(smoke: bool) -> list[dict[str, Any]]:
    """The step time of one SDXL transformer block under fast DoRA, per base, as a ratio to the
    full-precision base's step in the same repetition (median over repetitions)."""
    import copy
    import statistics

    import torch

    from bench.bench_dora import BLOCK_TARGETS, adapted, backward_step, block_case, interleaved
    from sdxl_trainer.quantized_base import quantize_module

    torch.set_num_threads(1)
    width, tokens = (64, 16) if smoke else (1280, 1024)
    block, make_input = block_case(width, tokens, smoke)
    inputs = make_input()
    steps, quantized = {}, {}
    for base in BASES:
        stored = copy.deepcopy(block)
        quantized[base] = 0 if base == "none" else quantize_module(stored, base, torch.device("cpu"))
        steps[base] = backward_step(adapted(stored, "DoRA", BLOCK_RANK, BLOCK_TARGETS), inputs)
    seconds = interleaved(steps, 1 if smoke else BLOCK_REPEATS, 0 if smoke else 1)
    rows = [{"base": base, "case": f"transformer block ({width} ch, {tokens} tokens), DoRA rank {BLOCK_RANK}",
             "quantized_layers": quantized[base], "ms_per_step": statistics.median(times) * 1e3,
             "vs_full_precision": statistics.median(a / b for a, b in zip(times, seconds["none"], strict=True))}
            for base, times in seconds.items()]
    for row in rows:
        print(row, flush=True)
    return rows


def anchor_rows() -> list[dict[str, Any]]:
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.memory.plan import StepShape
    from sdxl_trainer.memory.preflight import cached_plan

    rows = []
    for base in BASES:
        config = {"model": {"id": SDXL, "train_text_encoder_1": False, "use_gradient_checkpointing": True,
                            "base_quantization": base},
                  "run": {"name": "plan"}, "adapter": {"type": "dora", "rank": 16, "alpha": 16},
                  "optimizer": {"type": "adamw8bit"},
                  "training": {"num_steps": 1, "mixed_precision": "bf16", "lr_unet": 1e-4},
                  "data": {"text_cache": {"enabled": True}}}
        start = time.perf_counter()
        plan = cached_plan(validate_config(config), StepShape(1, 1024, 1024), "cuda")
        rows.append({"base": base, "planned_GB": plan.peak / 1e9, "weights_GB": plan.weight_bytes / 1e9,
                     "unet_weights_GB": sum(plan.weights["unet"].values()) / 1e9,
                     "activations_GB": plan.activations / 1e9, "peak_step": plan.peak_step,
                     "plan_seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    return rows


def learning_rows(bases: list[str]) -> list[dict[str, Any]]:
    """The learning benchmark's quickstart run on each base (its own runs, side by side)."""
    from bench.bench_learning import row_of, train

    quickstart = json.loads(QUICKSTART.read_text(encoding="utf-8"))
    steps, rank = quickstart["training"]["num_steps"], quickstart["adapter"]["rank"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for base in bases:
            result = train(f"quickstart {base}", {"model.base_quantization": base}, Path(tmp), steps, smoke=False)
            rows.append({"base": base} | row_of(f"DoRA rank {rank}, {base} base", result["evals"]))
            print(rows[-1], flush=True)
    return rows


NOTES = {
    "tiny": "The built-in tiny model on the CPU (OMP_NUM_THREADS=1): DoRA rank 4 on the UNet, batch 2 at 64x64, fp32, "
            "AdamW, no checkpointing; planned: the plan's peak; measured: the tensor bytes tracked during two trainer "
            "steps; step_s: the fastest of 8 trainer steps (forward, backward, optimizer), without the memory watch, "
            "the four bases' steps interleaved round by round, on a 2-core machine shared with other jobs.",
    "block": "CPU milliseconds (torch on 1 thread) of forward + backward of one SDXL transformer block at the 32x32 "
             "level (1280 channels, 1024 tokens, 77 x 2048 text context; random weights), fast DoRA rank 16 on "
             "to_q/to_k/to_v/to_out.0/ff.net.0.proj/ff.net.2, fp32 compute, median over 5 repetitions after 1 warm-up, "
             "the four bases taking turns in alternating order; vs_full_precision: the median over repetitions of the "
             "step's time over the full-precision step of the same repetition.",
    "anchors": "CUDA plans, SDXL at 1024x1024, batch 1, bf16 autocast, gradient checkpointing, cached latents and text "
               "(bigG off the GPU during steps), 8-bit AdamW, DoRA rank 16 on the UNet (attn-mlp), eval off; "
               "plan_seconds: the plan's time on this 2-core CPU while other jobs ran.",
    "learning": "The quickstart (configs/quickstart.json: DoRA rank 8 on every UNet layer, text encoders frozen, "
                "fp32, 600 steps, batch 2 at 128x128) with model.base_quantization set, the learning benchmark's eval "
                "(bench/bench_learning.py): concept accuracy over 16 prompts at each live eval and at the end, prior "
                "accuracy over 32.",
}


def main(argv: list[str] | None = None) -> int:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
        parser.add_argument("--learning-bases", nargs="+", choices=BASES, default=["none", "float8_e4m3fn", "nf4"])

    args = bench_args(__doc__.splitlines()[0], argv, options)
    if args.smoke:
        write_results("quantized_base_smoke", tiny_rows(smoke=True), "one tiny step (smoke test)", args.results_dir)
        write_results("quantized_base_block_smoke", block_rows(smoke=True), "one small block step (smoke test)",
                      args.results_dir)
        return 0
    builders = {"tiny": lambda: tiny_rows(False), "block": lambda: block_rows(False), "anchors": anchor_rows,
                "learning": lambda: learning_rows(args.learning_bases)}
    for section in args.sections:
        write_results(f"quantized_base_{section}", builders[section](), NOTES[section], args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
