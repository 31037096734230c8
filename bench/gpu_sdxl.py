"""Full-size SDXL training step on a CUDA GPU: random weights (no download), bf16, 1024² images
(128×128 latents), DoRA rank 32 and full fine-tuning, batch 1 and a larger batch, gradient
checkpointing off and on. Measures it/s, images/s, peak VRAM and model-FLOPs utilisation (MFU).

    python bench/gpu_sdxl.py                        # on a CUDA machine
    python bench/gpu_sdxl.py --batch-sizes 1 8      # other batch sizes
    python bench/gpu_sdxl.py --smoke                # CPU, the tiny model, seconds: checks the code path
    python bench/gpu_sdxl.py --modes dora lora none --profile   # where each step's time goes

The step is the trainer's own: `start_run` sets up the run (precision plan and casts, peft DoRA or
unfrozen weights, optimizer, accelerate), then each step calls the functions `train()` calls:
`forward_backward` (per-image draws, both text encoders, the loss) and `optimizer_step` (gradient
norm, NaN guard, optimizer step, zero_grad, LR schedule). Data loading is not in it (latents are
given).

FLOPs per step are counted by torch.utils.flop_counter.FlopCounterMode on one real forward and
backward pass of the same model (matmuls, convolutions and PyTorch SDPA attention), with gradient
checkpointing off, so MFU counts model FLOPs, not recomputation. Attention is PyTorch SDPA (which
picks FlashAttention kernels itself), because the counter cannot see inside the flash_attn package.
MFU = FLOPs per step × steps per second / the GPU's dense bf16 peak (table below, or --peak-tflops).

`--profile` runs the timed steps once more under torch.profiler and adds, per configuration, the
GPU's busy time per step (the union of its kernels' intervals, against the unprofiled step time)
and the kernels and aten ops launched per step; the ops that took longest go to a text file beside
the table (gpu_sdxl_profile.txt). A step that launches many small kernels leaves the GPU waiting
on Python.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_args, proc_status_kib, write_results
from sdxl_trainer.atomic import write_text

# Dense (no sparsity) bf16 tensor-core peaks from the vendor datasheets, in TFLOPS; the first name
# contained in torch.cuda.get_device_name() wins.
PEAK_BF16_TFLOPS = (
    ("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0),
)
CAPTION = "a photo of a red circle on a blue background"


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 4 (smoke: 1 2)")
    parser.add_argument("--steps", type=int, help="timed steps per configuration (default 10; smoke 1)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 3; smoke 0)")
    parser.add_argument("--rank", type=int, help="DoRA rank (default 32; smoke 4)")
    parser.add_argument("--modes", nargs="+", choices=("dora", "lora", "none"), default=["dora", "none"],
                        help="dora, lora and/or none (full fine-tune)")
    parser.add_argument("--optimizer", choices=("adamw8bit", "adamw", "adafactor"),
                        help="default: adamw8bit, the trainer's default (smoke: adamw)")
    parser.add_argument("--text-encoder", action="store_true", help="also train CLIP-L (default: UNet only)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the UNet (model.use_torch_compile)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the timed steps: GPU busy time, kernels per step, the top ops")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, if not in the table")


def peak_tflops(device_name: str | None, given: float | None) -> float | None:
    if given:
        return given
    return next((peak for name, peak in PEAK_BF16_TFLOPS if device_name and name in device_name), None)


def build_pipeline(smoke: bool, device):
    """The SDXL pipeline: the built-in tiny one (--smoke) or the full-size architecture with random
    weights created on the device. Tokenizers and scheduler come from the tiny model (the tokens'
    ids differ from CLIP's, the cost of a step does not: prompts are padded to 77 tokens)."""
    from diffusers import StableDiffusionXLPipeline

    from bench.sdxl_arch import sdxl_modules
    from sdxl_trainer.tiny_model import build_tiny_sdxl_pipeline

    tiny = build_tiny_sdxl_pipeline()
    if smoke:
        return tiny
    return StableDiffusionXLPipeline(**{**tiny.components, **sdxl_modules(device, tokenizer=tiny.tokenizer)})


def step_config(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark's training config: bf16, 8-bit AdamW by default, checkpointing switched later."""
    return {
        "model": {"id": "builtin:tiny-sdxl", "train_text_encoder_1": args.text_encoder,
                  "use_gradient_checkpointing": False, "attention": "sdpa",
                  "use_torch_compile": args.compile},
        "adapter": {"type": mode, "rank": args.rank, "alpha": args.rank},
        "run": {"name": "gpu_sdxl"},
        "training": {"num_steps": 10**6, "mixed_precision": "bf16", "lr_unet": 1e-5, "seed": 1,
                     "lr_text_encoder_1": 1e-5 if args.text_encoder else None,
                     "tensorboard": {"enabled": False}},
        "optimizer": {"type": args.optimizer},
        "eval": {"live": {"enabled": False}, "final": {"enabled": False}},
        "data": {"text_cache": {"enabled": False}},  # its own batches: both encoders run live, as before
    }


class TrainerStep:
    """The trainer's own step on a given pipeline: `start_run` sets it up (precision plan, casts,
    peft DoRA or unfrozen weights, optimizer, accelerate), and each call runs `forward_backward`
    and `optimizer_step` from sdxl_trainer/run.py, exactly what `train()` runs per step."""

    def __init__(self, pipe, mode: str, args: argparse.Namespace) -> None:
        from sdxl_trainer.config import validate_config
        from sdxl_trainer.planning import RunPlan
        from sdxl_trainer.run import start_run

        # The run's output folder holds only its lock; one of its own, so that two benchmarks at once
        # (the test suite's workers) never share one, and nothing is left in the project's .output.
        self.output_root = tempfile.TemporaryDirectory(prefix="gpu_sdxl-")
        settings = step_config(mode, args)
        settings["run"]["output_root"] = self.output_root.name
        config = validate_config(settings)
        # No data plan: the benchmark feeds its own batches of latents.
        self.run = start_run(config, RunPlan(data=None, total_steps=10**6, prompts=[], preflight=""), pipe)
        self.run.progress.disable = True
        self.device = self.run.device
        self.optimizer = self.run.optimizer

    def checkpointing(self, on: bool) -> None:
        """Gradient checkpointing on or off, with the calls prepare_trainable uses."""
        for name, module in self.run.trainable.modules.items():
            if name == "unet":
                module.enable_gradient_checkpointing() if on else module.disable_gradient_checkpointing()
            else:
                module.gradient_checkpointing_enable() if on else module.gradient_checkpointing_disable()

    def forward_backward(self, batch: dict[str, Any]):
        """The loss of one batch (its per-image draws, as in training) and its gradients."""
        from sdxl_trainer.run import forward_backward

        return forward_backward(self.run, batch)

    def __call__(self, batch: dict[str, Any]) -> None:
        from sdxl_trainer.nan_guard import OK
        from sdxl_trainer.run import optimizer_step

        self.forward_backward(batch)
        result = optimizer_step(self.run)
        if result.verdict != OK:
            raise RuntimeError(f"non-finite loss or gradients at step {self.run.position.step + 1}")


def latent_batch(size: int, latent_side: int) -> dict[str, Any]:
    """A batch as the data loader delivers it from the latent cache (on the CPU)."""
    import torch

    side = torch.tensor([[latent_side * 8, latent_side * 8]] * size)
    return {"latents": torch.randn(size, 4, latent_side, latent_side), "captions": [CAPTION] * size,
            "original_sizes": side, "crops_top_left": torch.zeros(size, 2, dtype=torch.long),
            "target_sizes": side, "paths": [f"image_{i}.png" for i in range(size)],
            "keys": [(i, 0) for i in range(size)]}


def count_flops(step: TrainerStep, batch: dict[str, Any]) -> float:
    """FLOPs of one forward and backward pass, counted by PyTorch's FLOP counter (the optimizer's
    elementwise update is not model FLOPs); the gradients are then dropped."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step.forward_backward(batch)
    step.optimizer.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step: TrainerStep, batch: dict[str, Any], warmup: int, steps: int) -> dict[str, float]:
    """Seconds per step over `steps` steps after `warmup`, and the peak memory meanwhile (CUDA: the
    allocator's peak, weights and optimizer state included; CPU: the process's RSS high-water mark)."""
    import torch

    for _ in range(warmup):
        step(batch)
    synchronize(step.device)
    if step.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(step.device)
    start = time.perf_counter()
    for _ in range(steps):
        step(batch)
    synchronize(step.device)
    seconds = (time.perf_counter() - start) / steps
    if step.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(step.device)
        reserved = torch.cuda.max_memory_reserved(step.device)
        requested = torch.cuda.memory_stats(step.device).get("requested_bytes.all.peak", peak)
    else:
        peak = reserved = requested = proc_status_kib("VmHWM") * 1024
    return {"seconds": seconds, "peak_memory_GB": peak / 1e9, "peak_requested_GB": requested / 1e9,
            "peak_reserved_GB": reserved / 1e9}


def profile_steps(step: TrainerStep, batch: dict[str, Any], steps: int) -> tuple[dict[str, float], str]:
    """`steps` steps under torch.profiler: per step, the GPU's busy time (the union of its kernels'
    intervals, so overlapping streams count once), kernels launched and aten ops called; and the
    table of the ops with the most device time (CPU time on the CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if step.device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step(batch)
        synchronize(step.device)
    events = profiler.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    busy_us, reach = 0.0, float("-inf")
    for start, end in kernels:
        busy_us += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    aten = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::"))
    sort = "self_device_time_total" if kernels else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)
    return {"gpu_busy_ms_per_step": busy_us / 1e3 / steps, "kernels_per_step": len(kernels) / steps,
            "aten_ops_per_step": aten / steps}, table


def run_mode(mode: str, args: argparse.Namespace, device, peak: float | None,
             profiles: list[str]) -> list[dict[str, Any]]:
    """Every batch size with checkpointing off, then on, for one training mode (one model build)."""
    import torch

    pipe = build_pipeline(args.smoke, device)
    step = TrainerStep(pipe, mode, args)
    latent_side = 8 if args.smoke else 128
    label = {"dora": f"DoRA rank {args.rank}", "lora": f"LoRA rank {args.rank}"}.get(mode, "full")
    rows, flops = [], {}
    for checkpointing in (False, True):
        step.checkpointing(checkpointing)
        for size in args.batch_sizes:
            row: dict[str, Any] = {"mode": label, "batch": size, "grad_ckpt": "on" if checkpointing else "off",
                                   "it_per_s": None, "images_per_s": None, "peak_memory_GB": None,
                                   "peak_requested_GB": None, "peak_reserved_GB": None,
                                   "TFLOP_per_step": None, "achieved_TFLOPS": None, "MFU_percent": None, "status": "ok"}
            batch = latent_batch(size, latent_side)
            try:
                measured = measure(step, batch, args.warmup, args.steps)
                if size not in flops:  # model FLOPs: counted without recomputation when that fits
                    flops[size] = (count_flops(step, batch), checkpointing)
            except torch.cuda.OutOfMemoryError:
                measured = None
            if measured is None or size not in flops:  # out of memory (the traceback's tensors are gone now)
                row["status"] = "out of memory"
                rows.append(row)
                step.optimizer.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            count, with_recompute = flops[size]
            achieved = count / measured["seconds"] / 1e12
            if args.profile:
                counts, table = profile_steps(step, batch, args.steps)
                busy = counts["gpu_busy_ms_per_step"]
                row.update(counts, gpu_busy_percent=100 * busy / 1e3 / measured["seconds"] if busy else None)
                profiles.append(f"## {label}, batch {size}, checkpointing {row['grad_ckpt']}\n\n{table}\n")
            row.update({"it_per_s": 1 / measured["seconds"], "images_per_s": size / measured["seconds"],
                        "peak_memory_GB": measured["peak_memory_GB"],
                        "peak_requested_GB": measured["peak_requested_GB"],
                        "peak_reserved_GB": measured["peak_reserved_GB"], "TFLOP_per_step": count / 1e12,
                        "achieved_TFLOPS": achieved, "MFU_percent": 100 * achieved / peak if peak else None})
            if with_recompute:
                row["status"] = "FLOPs include recomputation"
            rows.append(row)
            print(row, flush=True)
    del step, pipe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    args = bench_args(__doc__.splitlines()[0], argv, options)
    smoke = args.smoke
    args.batch_sizes = args.batch_sizes or ([1, 2] if smoke else [1, 4])
    args.steps = args.steps or (1 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (0 if smoke else 3)
    args.rank = args.rank or (4 if smoke else 32)
    args.optimizer = args.optimizer or ("adamw" if smoke else "adamw8bit")
    if not smoke and not torch.cuda.is_available():
        print("error: bench/gpu_sdxl.py needs a CUDA GPU (use --smoke to check it on the CPU)", file=sys.stderr)
        return 2
    if smoke:  # one thread: with two on a busy 2-core machine every small op can wait on a descheduled one
        torch.set_num_threads(1)
    device = torch.device("cpu" if smoke else "cuda")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_tflops(device_name, args.peak_tflops)
    torch.manual_seed(0)
    profiles: list[str] = []
    rows = [row for mode in args.modes for row in run_mode(mode, args, device, peak, profiles)]
    what = "the built-in tiny SDXL on the CPU, 64² images (smoke test, not a measurement)" if smoke else (
        "full-size SDXL (UNet 2.6 B parameters, CLIP-L, bigG) with random weights, 1024² images")
    notes = (
        f"{what}; bf16 autocast (trained weights fp32), optimizer {args.optimizer}, UNet"
        f"{' + CLIP-L' if args.text_encoder else ''} trained, attention: PyTorch SDPA. {args.steps} timed steps "
        f"after {args.warmup} warm-up steps. peak_memory_GB: torch.cuda.max_memory_allocated over the timed steps "
        "(weights, optimizer state and activations; CPU: the process's RSS high-water mark); peak_requested_GB: the "
        "peak of the bytes asked for (before the allocator rounds them up to its blocks); peak_reserved_GB: "
        "torch.cuda.max_memory_reserved (what the caching allocator held). TFLOP_per_step: "
        "FlopCounterMode on one step with checkpointing off (model FLOPs, used for the checkpointed rows too). "
        f"MFU against {f'{peak:g} TFLOPS dense bf16' if peak else 'no known peak (pass --peak-tflops)'}."
    )
    name = "gpu_sdxl" + ("_compiled" if args.compile else "") + ("_smoke" if smoke else "")
    if args.compile:
        notes += " The UNet is compiled (torch.compile, default mode); the warm-up steps compile it."
    if args.profile:
        notes += (" gpu_busy_percent: the GPU's busy time (profiled) against the unprofiled step time; "
                  f"the ops that took longest are in {name}_profile.txt.")
    write_results(name, rows, notes, args.results_dir, extra={"device": device_name or "cpu", "peak_tflops": peak})
    if args.profile:
        write_text(args.results_dir / f"{name}_profile.txt", "\n".join(profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
