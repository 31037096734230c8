"""Training step cost on the built-in tiny SDXL: the trainer against a bare PyTorch loop, and
DoRA against LoRA against full fine-tuning.

    python bench/bench_step.py

"Trainer" is the real `train_sdxl.train()`, unchanged: its step time is the interval between
consecutive optimizer steps, taken from torch's global optimizer step hook, so everything the loop
does per step is in it (data loading from the latent cache, the per-sample draws, accelerate's
wrappers, the NaN guard, the gradient norm, the LR schedule, logging, the progress bar). "Bare" is
the same step written directly with diffusers, peft and torch: same model files, same adapters,
same data loader over the same latent cache, same AdamW, fp32. Inside the same hook, right after
each trainer step, one bare step runs (outside the trainer's interval), so the two alternate step
by step and load from other processes hits both alike.

Peak memory per mode comes from a fresh process per mode: its RSS high-water mark (VmHWM) from
the first forward pass (the model loaded, the latent cache complete) to the end of training, above
its RSS at that forward pass: gradients, optimizer state, activations, the final save.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, bench_args, proc_status_kib, quiet_env, reset_peak_rss, write_results

RANK = 4
MODES = ("dora", "lora", "none")
MODE_NAMES = {"dora": f"DoRA rank {RANK}", "lora": f"LoRA rank {RANK}", "none": "full"}


def trainer_config(tmp: Path, adapter_type: str, steps: int) -> dict[str, Any]:
    """The quickstart's settings (DoRA rank 4 on the UNet and CLIP-L, AdamW, fp32, batch 2) with one
    64×64 bucket, so every step has the same shape, no text cache, and no eval or export work after
    training."""
    return {
        "model": {"id": "builtin:tiny-sdxl", "train_text_encoder_1": True, "use_gradient_checkpointing": False},
        "adapter": {"type": adapter_type, "rank": RANK, "alpha": RANK, "targets": "attn-mlp"},
        "run": {"name": "bench", "output_root": str(tmp / "out")},
        "training": {"num_steps": steps, "lr_unet": 1e-4, "lr_text_encoder_1": 1e-4, "seed": 42,
                     "log_every": 10, "checkpoint_every": 10**6,
                     "tensorboard": {"enabled": True, "base_dir": str(tmp / "tb")}},
        "data": {"image_dir": str(ROOT / "data" / "images"), "size": 64, "num_workers": 0,
                 "bucket": {"resolutions": [[64, 64]], "divisible_by": 32, "batch_size": 2},
                 "latent_cache": {"cache_dir": str(tmp / "latents")},
                 # Both encoders run live, as in the bare loop (bench_text_cache.py measures the cache).
                 "text_cache": {"enabled": False}},
        "optimizer": {"type": "adamw", "weight_decay": 0.01},
        "export": {"save_single_file": False, "adapter_formats": ["diffusers"]},
    }


class StepClock:
    """Step times from torch's global optimizer step hook, with a bare step run inside every hook.

    The trainer's step time is the interval from leaving one hook to entering the next: all the
    work `train()` does between two optimizer steps. Each hook then runs and times one bare step,
    so the two alternate step by step and any change in machine load hits both alike.
    """

    def __init__(self, bare: BareLoop | None = None, timer=time.perf_counter) -> None:
        self.bare = bare
        self.timer = timer  # wall time; time.process_time leaves out what other processes take
        self.trainer: list[float] = []
        self.bare_seconds: list[float] = []
        self.optimizer = None
        self._left: float | None = None

    def __enter__(self) -> StepClock:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _record(self, optimizer, args, kwargs) -> None:
        if self.bare is not None and optimizer is self.bare.optimizer:
            return
        entered = self.timer()
        if self._left is not None:
            self.trainer.append(entered - self._left)
        self.optimizer = optimizer
        if self.bare is not None:
            self.bare_seconds.append(self.bare.timed_step())
        self._left = self.timer()

    def sizes(self) -> dict[str, float]:
        """Trainable parameters and optimizer state of the trainer's optimizer."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = [t for s in self.optimizer.state.values() for t in s.values() if hasattr(t, "nbytes")]
        return {"trainable_params_M": sum(p.numel() for p in params) / 1e6,
                "optimizer_state_MB": sum(t.nbytes for t in state) / 1e6}


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """The trainer prints its plan, a progress bar and warnings: keep the benchmark's output readable."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def run_trainer(config_data: dict[str, Any], clock: StepClock) -> None:
    """One real training run, start to finish (its steps land in `clock`)."""
    import train_sdxl
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.planning import plan_run

    config = validate_config(config_data)
    with silenced():
        code = train_sdxl.train(config, plan_run(config))
    if code != 0:
        raise RuntimeError(f"train() returned {code}")


class BareLoop:
    """The step written directly: tokenize, both text encoders, noise, UNet, MSE, backward, AdamW."""

    def __init__(self, config_data: dict[str, Any]):
        import torch
        from diffusers import DDPMScheduler, StableDiffusionXLPipeline
        from peft import LoraConfig

        from sdxl_trainer.adapters import text_encoder_target_modules, unet_target_modules
        from sdxl_trainer.config import validate_config
        from sdxl_trainer.data import ImageCaptionDataset, collate
        from sdxl_trainer.data_plan import plan_dataset
        from sdxl_trainer.planning import loaded_vae_cache
        from sdxl_trainer.tiny_model import tiny_sdxl_path

        config = validate_config(config_data)
        with silenced():
            self.pipe = pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_path())
        for module in (pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
            module.requires_grad_(False).eval()
        # The same adapted layers as the trainer's (its module selection, setup only); like the
        # trainer, no adapter on CLIP-L's last layer, whose output SDXL never reads.
        last = f"layers.{pipe.text_encoder.config.num_hidden_layers - 1}."
        te_names = [n for n in text_encoder_target_modules(pipe.text_encoder, "attn-mlp") if last not in n]
        for module, names in ((pipe.unet, unet_target_modules(pipe.unet, "attn-mlp")), (pipe.text_encoder, te_names)):
            module.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, use_dora=config.adapter.type == "dora",
                                          target_modules=names))
            module.train()
        params = [p for m in (pipe.unet, pipe.text_encoder) for p in m.parameters() if p.requires_grad]
        self.trainable_params = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
        self.scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
        # The trainer's own data loader over its latent cache (built by the trainer's first run).
        plan = plan_dataset(config.data, 1)
        cache = loaded_vae_cache(config, pipe.vae)
        self.loader = torch.utils.data.DataLoader(
            ImageCaptionDataset(plan.samples, config.data, 42, cache),
            batch_sampler=plan.sampler(42), collate_fn=collate, num_workers=0)
        self.batches = self._forever()

    def _forever(self) -> Iterator[dict]:
        while True:
            yield from self.loader

    def timed_step(self) -> float:
        """Seconds for one step, fetching its batch included (as in the trainer's interval)."""
        start = time.perf_counter()
        self.step(next(self.batches))
        return time.perf_counter() - start

    def step(self, batch: dict) -> None:
        import torch

        pipe = self.pipe
        latents = batch["latents"] * pipe.vae.config.scaling_factor
        states, pooled = [], None
        for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
            ids = tokenizer(batch["captions"], padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            output = encoder(ids, output_hidden_states=True)
            states.append(output.hidden_states[-2])
            pooled = getattr(output, "text_embeds", None)
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, self.scheduler.config.num_train_timesteps, (latents.shape[0],))
        time_ids = torch.cat([batch["original_sizes"], batch["crops_top_left"], batch["target_sizes"]], 1).float()
        prediction = pipe.unet(self.scheduler.add_noise(latents, noise, timesteps), timesteps,
                               encoder_hidden_states=torch.cat(states, -1),
                               added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
        torch.nn.functional.mse_loss(prediction.float(), noise).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def loader_seconds(bare: BareLoop, batches: int) -> float:
    """Seconds per batch of the data loader alone (latent cache read + sample + collate)."""
    start = time.perf_counter()
    for _ in range(batches):
        next(bare.batches)
    return (time.perf_counter() - start) / batches


def memory_probe(mode: str, steps: int, workdir: Path) -> dict[str, float]:
    """In this (fresh) process: train `steps` steps in `workdir`, whose latent cache is complete (so
    the first forward pass is the first step's); the RSS peak above the RSS at that forward."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    baseline: list[int] = []

    def first_forward(module, args) -> None:
        if not baseline:
            baseline.append(proc_status_kib("VmRSS"))
            reset_peak_rss()

    torch.set_num_threads(1)
    handle = register_module_forward_pre_hook(first_forward)
    try:
        with StepClock() as clock:
            run_trainer(trainer_config(workdir, mode, steps), clock)
    finally:
        handle.remove()
    return {"peak_rss_above_loaded_MB": (proc_status_kib("VmHWM") - baseline[0]) * 1024 / 1e6, **clock.sizes()}


def measure_memory(mode: str, steps: int, workdir: Path) -> dict[str, float]:
    """`memory_probe` in a fresh interpreter (a high-water mark cannot be shared between modes)."""
    command = [sys.executable, str(Path(__file__)), "--memory-probe", mode, "--steps", str(steps), "--workdir",
               str(workdir)]
    output = subprocess.run(command, env=quiet_env(), capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--memory-probe", choices=MODES, help=argparse.SUPPRESS)  # the child of measure_memory
        parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)  # ... and its folder
        parser.add_argument("--steps", type=int, default=None, help="optimizer steps per training run")

    args = bench_args(__doc__.splitlines()[0], argv, options)
    rounds, steps, warmup = (1, 2, 1) if args.smoke else (3, 40, 5)
    steps = args.steps or steps
    if args.memory_probe:
        print(json.dumps(memory_probe(args.memory_probe, steps, args.workdir)))
        return
    import torch

    torch.set_num_threads(1)  # the tiny model gains nothing from threads; one is steadier on a shared machine
    modes = MODES[:1] if args.smoke else MODES  # --smoke: the code path once
    trainer: dict[str, list[float]] = {mode: [] for mode in modes}
    bare_steps: dict[str, list[float]] = {mode: [] for mode in modes}
    sizes: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run_trainer(trainer_config(Path(tmp), "dora", 1), StepClock())  # builds the latent cache once
        bare = BareLoop(trainer_config(Path(tmp), "dora", 1))
        for _ in range(warmup):
            bare.timed_step()
        for round_index in range(rounds):
            for mode in modes if round_index % 2 == 0 else modes[::-1]:
                with StepClock(bare) as clock:
                    run_trainer(trainer_config(Path(tmp), mode, steps + warmup), clock)
                trainer[mode] += clock.trainer[warmup:]
                bare_steps[mode] += clock.bare_seconds[warmup + 1:]
                sizes[mode] = clock.sizes()
        loading = min(loader_seconds(bare, 2 if args.smoke else 9) for _ in range(1 if args.smoke else 3))
        memory = {mode: measure_memory(mode, steps, Path(tmp)) for mode in modes}

    # Each trainer step against the bare step run right after it: the median of the ratios (robust to
    # load spikes), and the ratio of the totals (which also counts work done every N steps: logging).
    vs_bare = {mode: statistics.median(t / b for t, b in zip(trainer[mode], bare_steps[mode], strict=True))
               for mode in modes}
    vs_bare_total = {mode: sum(trainer[mode]) / sum(bare_steps[mode]) for mode in modes}
    all_bare = [seconds for mode in modes for seconds in bare_steps[mode]]
    rows = [{"step": f"bare loop, DoRA rank {RANK} (diffusers + peft + torch, same loader)",
             "ms_per_step": statistics.median(all_bare) * 1e3, "vs_bare": 1.0, "vs_bare_total": 1.0, "vs_DoRA": None,
             "trainable_params_M": bare.trainable_params / 1e6, "optimizer_state_MB": None, "peak_rss_MB": None}]
    for mode in modes:
        rows.append({
            "step": f"train_sdxl.train(), {MODE_NAMES[mode]}",
            "ms_per_step": statistics.median(trainer[mode]) * 1e3, "vs_bare": vs_bare[mode],
            "vs_bare_total": vs_bare_total[mode], "vs_DoRA": vs_bare[mode] / vs_bare["dora"],
            "trainable_params_M": sizes[mode]["trainable_params_M"],
            "optimizer_state_MB": sizes[mode]["optimizer_state_MB"],
            "peak_rss_MB": memory[mode]["peak_rss_above_loaded_MB"],
        })
    rows.append({"step": "data loader alone (latent cache → batch)", "ms_per_step": loading * 1e3,
                 "vs_bare": loading / statistics.median(all_bare), "vs_bare_total": None, "vs_DoRA": None,
                 "trainable_params_M": None, "optimizer_state_MB": None, "peak_rss_MB": None})
    notes = (
        f"Built-in tiny SDXL, UNet + CLIP-L trained, adapters rank {RANK} on attn-mlp, batch 2 of 64×64 "
        f"(8×8 latents) from the latent cache, AdamW, fp32, torch on 1 thread. {rounds} training runs per mode "
        f"of {steps} timed steps after {warmup} warm-up steps, modes in alternating order; one bare step runs "
        "right after each trainer step (inside torch's optimizer step hook, outside the trainer's timing). "
        "ms_per_step: median over all steps; vs_bare: the median of the ratios of each trainer step to its "
        "bare step; vs_bare_total: total trainer time over total bare time of the same steps (includes the "
        "work done every 10 steps: logging); vs_DoRA: vs_bare over DoRA's vs_bare. optimizer_state_MB: "
        "AdamW's state tensors, exact. peak_rss_MB: a fresh process per mode, its RSS high-water mark (VmHWM) "
        "from the first forward pass to the end of train() above its RSS at that first forward pass: "
        "gradients, optimizer state, activations, the final save, and the one-time allocations of a first "
        "step, which all modes share (RSS, not live tensors: glibc keeps freed memory)."
    )
    write_results("step", rows, notes, args.results_dir, extra={"steps_ms": {
        **{mode: [t * 1e3 for t in trainer[mode]] for mode in modes}, "bare": [t * 1e3 for t in all_bare]}})


if __name__ == "__main__":
    main()
