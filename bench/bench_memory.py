"""The memory plan against what runs measure, and the plan of the configurations other trainers
publish figures for.

    python bench/bench_memory.py                 # every section below (about an hour on 2 cores)
    python bench/bench_memory.py --sections tiny gpu
    python bench/bench_memory.py --smoke         # one tiny run: checks the code path

Sections (each a results file):
- `memory_tiny`: real runs of the built-in tiny model on the CPU (`train_sdxl.py`, 3 steps, memory_check
  "warn"): the planned peak against the tracked tensor peak, DoRA/LoRA/full, with and without
  gradient checkpointing and EMA.
- `memory_full_cpu`: full-size SDXL with random weights (bench/sdxl_arch.py) at 128² on the CPU:
  DoRA rank 16 and LoRA rank 16 (fp32), DoRA on an fp8, an int8 and an NF4 base, a full fine-tune of the
  UNet with bf16 weights and Adafactor with and without fused backward; the trainer's own steps
  (`start_run`, `forward_backward`, `optimizer_step`), planned against tracked.
- `memory_gpu`: the rows of bench/results/gpu_sdxl.json (measured on a GPU with
  `torch.cuda.max_memory_allocated`) against their CUDA plans, made here.
- `memory_anchors`: CUDA plans at 1024² for the configurations kohya sd-scripts, OneTrainer and
  the diffusers example publish memory figures for, and for this trainer's own recommendations.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, ROOT, bench_args, run_train_sdxl, write_results

SDXL = "stabilityai/stable-diffusion-xl-base-1.0"  # not downloaded: planned with SDXL base 1.0's shapes
SECTIONS = ("tiny", "full_cpu", "gpu", "anchors")
LABELS = {"dora": "DoRA", "lora": "LoRA"}
TINY_CASES = {
    "DoRA rank 4 (quickstart)": {},
    "DoRA, gradient checkpointing": {"model": {"use_gradient_checkpointing": True}},
    "DoRA, EMA": {"model": {"use_ema": True, "ema_device": "same"}, "training": {"ema_update_every": 1}},
    "LoRA rank 8": {"adapter": {"type": "lora", "rank": 8, "alpha": 8}},
    "LoRA rank 8, gradient checkpointing": {"adapter": {"type": "lora", "rank": 8, "alpha": 8},
                                            "model": {"use_gradient_checkpointing": True}},
    "full fine-tune": {"adapter": {"type": "none"}, "model": {"train_text_encoder_1": False},
                       "training": {"lr_text_encoder_1": None}},
    "full fine-tune, gradient checkpointing, EMA": {
        "adapter": {"type": "none"}, "model": {"train_text_encoder_1": False, "use_gradient_checkpointing": True,
                                               "use_ema": True, "ema_device": "same"},
        "training": {"lr_text_encoder_1": None, "ema_update_every": 1}},
}


FULL_FINE_TUNE = {"adapter": {"type": "none"}, "model": {"weights_dtype": "bf16", "use_gradient_checkpointing": True},
                  "training": {"mixed_precision": "bf16"}}
FULL_CPU_CASES = {  # changes to a DoRA rank 16 run of the UNet, fp32, AdamW
    "DoRA rank 16, fp32": {},
    "LoRA rank 16, fp32": {"adapter": {"type": "lora", "rank": 16, "alpha": 16}},
    "DoRA rank 16, fp32, fp8 base": {"model": {"base_quantization": "float8_e4m3fn"}},
    "DoRA rank 16, fp32, int8 base": {"model": {"base_quantization": "int8"}},
    "DoRA rank 16, fp32, NF4 base": {"model": {"base_quantization": "nf4"}},
    "full fine-tune, bf16 weights, Adafactor, checkpointing": {
        **FULL_FINE_TUNE, "optimizer": {"type": "adafactor"}},
    "full fine-tune, bf16 weights, Adafactor, checkpointing, fused backward": {
        **FULL_FINE_TUNE, "optimizer": {"type": "adafactor", "fused_backward": True}},
}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))


def tiny_rows(smoke: bool) -> list[dict[str, Any]]:
    """Real CPU runs of the quickstart config with each change, planned and measured (the tracked
    tensor bytes, not the process's RSS: --smoke runs its one in this process)."""
    rows = []
    for name, changes in list(TINY_CASES.items())[:1 if smoke else None]:
        with tempfile.TemporaryDirectory() as folder:
            config = json.loads((ROOT / "configs" / "quickstart.json").read_text())
            for section, values in changes.items():
                config[section].update(values)
            config["run"]["output_root"] = folder
            # No LR warmup: the EMA starts when it ends (and is updated every step in the EMA cases).
            config["training"].update(num_steps=3, log_every=1, memory_check="warn", lr_warmup_steps=0)
            config["training"]["tensorboard"]["base_dir"] = f"{folder}/tb"
            config["eval"] = {"live": {"enabled": False}, "final": {"enabled": False}}
            config["data"]["image_dir"] = str(ROOT / "data" / "images")
            for cache in ("latent_cache", "text_cache"):
                config["data"].setdefault(cache, {})["cache_dir"] = f"{folder}/{cache}"
            path = Path(folder) / "config.json"
            path.write_text(json.dumps(config))
            run_train_sdxl(name, ["--config", str(path)], in_process=smoke)
            memory = json.loads((Path(folder) / "quickstart" / "run_summary.json").read_text())["memory"]
        rows.append({"run": name, "planned_MB": memory["planned_peak_bytes"] / 1e6,
                     "measured_MB": memory["measured_peak_bytes"] / 1e6,
                     "measured_over_planned": memory["measured_over_planned"]})
    return rows


def full_cpu_rows() -> list[dict[str, Any]]:
    """Full-size SDXL, 128², on the CPU: two trainer steps per case, tracked and planned."""
    import torch

    from bench.gpu_sdxl import build_pipeline, latent_batch
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.memory.plan import StepShape, plan_memory
    from sdxl_trainer.planning import RunPlan
    from sdxl_trainer.run import forward_backward, optimizer_step, start_run

    torch.set_num_threads(2)
    rows = []
    for name, changes in FULL_CPU_CASES.items():
        config = {"model": {"id": "builtin:tiny-sdxl", "train_text_encoder_1": False, "attention": "sdpa"},
                  "adapter": {"type": "dora", "rank": 16, "alpha": 16}, "run": {"name": "memory"},
                  "training": {"num_steps": 10, "lr_unet": 1e-5, "seed": 1, "tensorboard": {"enabled": False}},
                  "optimizer": {"type": "adamw"}, "eval": {"live": {"enabled": False}, "final": {"enabled": False}},
                  "data": {"text_cache": {"enabled": False}}}
        for section, values in changes.items():
            config[section] = {**config[section], **values}
        start = time.perf_counter()
        planned = plan_memory(validate_config({**config, "model": {**config["model"], "id": SDXL}}),
                              StepShape(1, 128, 128), "cpu")
        plan_seconds = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as folder:
            config["run"]["output_root"] = folder
            run = start_run(validate_config(config), RunPlan(None, 10, [], "", memory=planned),
                            build_pipeline(False, torch.device("cpu")))
            run.progress.disable = True
            for _ in range(2):
                forward_backward(run, latent_batch(1, 16))
                optimizer_step(run)
            run.memory.stop()
            measured = run.memory.run_peak
            del run
            gc.collect()
        rows.append({"run": f"{name}, SDXL, 128², batch 1", "planned_GB": planned.peak / 1e9,
                     "measured_GB": measured / 1e9, "measured_over_planned": measured / planned.peak,
                     "plan_seconds": plan_seconds})
        print(rows[-1], flush=True)
    return rows


def gpu_rows() -> list[dict[str, Any]]:
    """bench/results/gpu_sdxl.json's measured peaks against their CUDA plans."""
    from bench.gpu_sdxl import step_config
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.memory.plan import StepShape
    from sdxl_trainer.memory.preflight import cached_plan

    measured = json.loads((RESULTS / "gpu_sdxl.json").read_text())
    rows = []
    for row in measured["rows"]:
        if row["peak_memory_GB"] is None:
            continue
        mode, rank = ("dora", int(row["mode"].split()[-1])) if row["mode"].startswith("DoRA") else ("none", 4)
        settings = argparse.Namespace(text_encoder=False, rank=rank, optimizer="adamw8bit")
        config = step_config(mode, settings)
        config["model"].update(id=SDXL, use_gradient_checkpointing=row["grad_ckpt"] == "on")
        start = time.perf_counter()
        plan = cached_plan(validate_config(config), StepShape(row["batch"], 1024, 1024), "cuda")
        rows.append({"run": f"{row['mode']}, batch {row['batch']}, checkpointing {row['grad_ckpt']}",
                     "planned_GB": plan.peak / 1e9, "measured_GB": row["peak_memory_GB"],
                     "measured_over_planned": row["peak_memory_GB"] * 1e9 / plan.peak,
                     "plan_seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    return rows


# What other trainers publish, and the settings of ours that express the same recipe (1024², batch 1).
ANCHORS = (
    ("kohya sd-scripts: LoRA dim 8, UNet only, cached latents and text, 8-bit AdamW, checkpointing", "8 GB",
     {"adapter": {"type": "lora", "rank": 8, "alpha": 8}, "optimizer": {"type": "adamw8bit"}}),
    ("kohya sd-scripts: full fine-tune, Adafactor, checkpointing (here with fp32 master weights)", "24 GB",
     {"adapter": {"type": "none"}, "optimizer": {"type": "adafactor"}}),
    ("kohya's full fine-tune as close as this trainer gets with bf16 weights (AdamW, stochastic rounding)", "24 GB",
     {"adapter": {"type": "none"}, "optimizer": {"type": "adamw"}, "model": {"weights_dtype": "bf16"}}),
    ("OneTrainer SDXL LoRA preset (rank 16, 8-bit AdamW, checkpointing)", "about 8 GB",
     {"adapter": {"type": "lora", "rank": 16, "alpha": 16}, "optimizer": {"type": "adamw8bit"}}),
    ("diffusers train_text_to_image_lora_sdxl.py (rank 4 attention, fp16, AdamW, no checkpointing, no text cache)",
     "under 16 GB",
     {"adapter": {"type": "lora", "rank": 4, "alpha": 4, "targets": "attn"}, "optimizer": {"type": "adamw"},
      "training": {"mixed_precision": "fp16"}, "model": {"use_gradient_checkpointing": False},
      "data": {"text_cache": {"enabled": False}}}),
    ("this trainer: DoRA rank 16, CLIP-L trained, 8-bit AdamW, checkpointing", "",
     {"adapter": {"type": "dora", "rank": 16, "alpha": 16}, "model": {"train_text_encoder_1": True},
      "training": {"lr_text_encoder_1": 5e-5}}),
    ("this trainer: DoRA rank 32, CLIP-L trained, 8-bit AdamW, checkpointing", "",
     {"adapter": {"type": "dora", "rank": 32, "alpha": 32}, "model": {"train_text_encoder_1": True},
      "training": {"lr_text_encoder_1": 5e-5}}),
    ("this trainer: full fine-tune, fp32 master weights, 8-bit AdamW, checkpointing", "",
     {"adapter": {"type": "none"}}),
    ("this trainer: full fine-tune, fp32 master weights, 8-bit AdamW, checkpointing, fused backward", "",
     {"adapter": {"type": "none"}, "optimizer": {"type": "adamw8bit", "fused_backward": True}}),
    ("this trainer: full fine-tune, fp32 master weights, Adafactor, checkpointing, fused backward", "",
     {"adapter": {"type": "none"}, "optimizer": {"type": "adafactor", "fused_backward": True}}),
    ("this trainer: full fine-tune, bf16 weights, Adafactor with stochastic rounding, checkpointing, fused backward",
     "10 GB (kohya #1259, bf16 weights)",
     {"adapter": {"type": "none"}, "optimizer": {"type": "adafactor", "fused_backward": True},
      "model": {"weights_dtype": "bf16"}}),
    ("this trainer: full fine-tune, bf16 weights, AdamW with stochastic rounding, checkpointing, fused backward",
     "", {"adapter": {"type": "none"}, "optimizer": {"type": "adamw", "fused_backward": True},
          "model": {"weights_dtype": "bf16"}}),
)


def anchor_rows() -> list[dict[str, Any]]:
    """CUDA plans for the recipes in ANCHORS, at 1024², batch 1, bf16 unless the recipe says."""
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.memory.plan import StepShape
    from sdxl_trainer.memory.preflight import cached_plan

    rows = []
    for name, published, changes in ANCHORS:
        config = {"model": {"id": SDXL, "train_text_encoder_1": False, "use_gradient_checkpointing": True},
                  "run": {"name": "plan"},
                  "adapter": {"type": "lora"}, "optimizer": {"type": "adamw8bit"},
                  "training": {"num_steps": 1, "mixed_precision": "bf16", "lr_unet": 1e-4},
                  "data": {"text_cache": {"enabled": True}}}
        for section, values in changes.items():
            config.setdefault(section, {}).update(values)
        start = time.perf_counter()
        plan = cached_plan(validate_config(config), StepShape(1, 1024, 1024), "cuda")
        rows.append({"recipe": name, "published": published, "planned_GB": plan.peak / 1e9,
                     "weights_GB": plan.weight_bytes / 1e9, "activations_GB": plan.activations / 1e9,
                     "plan_seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = bench_args(__doc__.splitlines()[0], argv, options)
    if args.smoke:
        write_results("memory_smoke", tiny_rows(smoke=True), "one tiny run (smoke test)", args.results_dir)
        return 0
    notes = {
        "tiny": "The built-in tiny model on the CPU, 3 steps of the quickstart config (batch 2, 96x64, no LR "
                "warmup) with each change; planned: the pre-flight's plan; measured: the tensor bytes tracked "
                "during the run.",
        "full_cpu": "Full-size SDXL (random weights), one 128x128 image, both text encoders live; adapters: fp32 "
                    "compute, AdamW, the base in fp32 or quantized; full fine-tunes: the UNet's weights in bf16, bf16 "
                    "autocast, Adafactor (stochastic rounding), gradient checkpointing; two trainer steps on the CPU; "
                    "plan_seconds: the plan's time on this CPU.",
        "gpu": "Measured: torch.cuda.max_memory_allocated on an H200 (bench/results/gpu_sdxl.json); planned: the "
               "CUDA plan of the same configuration made on this CPU; plan_seconds: the plan's time on this CPU, "
               "while other jobs ran.",
        "anchors": "CUDA plans, 1024x1024, batch 1, bf16 autocast, the text cache on (bigG off the GPU during steps) "
                   "unless the recipe says otherwise; published: the figure the other project gives.",
    }
    builders = {"tiny": lambda: tiny_rows(False), "full_cpu": full_cpu_rows, "gpu": gpu_rows, "anchors": anchor_rows}
    for section in args.sections:
        write_results(f"memory_{section}", builders[section](), notes[section], args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
