"""DoRA against LoRA against frozen weights, per training step: SDXL's real layer shapes and the
tiny model's whole step, with peft's own DoRA forward (before) and sdxl_trainer/fast_dora.py's (after).

    python bench/bench_dora.py            # about 8 minutes on 2 cores
    python bench/bench_dora.py --smoke    # seconds: only checks that every code path runs

Layer shapes (random weights, one sample, forward + backward, the input needing its gradient as
inside a UNet whose earlier layers train): one full-width SDXL transformer block (self-attention,
cross-attention to the 77 × 2048 text context, GEGLU feed-forward) at the 32×32 latent level (1280
channels, 1024 tokens) and the 64×64 level (640 channels, 4096 tokens), adapters of rank 16 and 32
on to_q/to_k/to_v/to_out.0/ff.net.0.proj/ff.net.2; a 3×3 resnet convolution (1280 channels, 32×32);
and the 32×32 block under torch.compile. The tiny model's step is the quickstart's (DoRA or LoRA
rank 4 on the UNet's and CLIP-L's attention and MLP layers, the trainer's own setup, loss and AdamW,
fp32, batch 2 of 8×8 latents).

Modes run in turn within every repetition (the order alternating), so load from other processes
hits all alike; vs_LoRA is the median over repetitions of each step's time over the LoRA step of
the same repetition. Times are the process's CPU time with torch on one thread: on a shared
machine, wall time also counts the time other processes hold the core, and a second thread makes
every small op wait for the busier core; both swamp the differences measured here.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, bench_args, write_results

MODES = ("frozen", "LoRA", "DoRA (peft)", "DoRA")
BLOCK_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


def adapted(base, mode: str, rank: int, targets: list[str]):
    """A copy of `base` with `mode`'s adapter on `targets` (B random, as after some training)."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    from sdxl_trainer.fast_dora import use_fast_dora

    module = copy.deepcopy(base)
    if mode == "frozen":
        return module
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, use_dora=mode != "LoRA", target_modules=targets),
                            module)
    for name, param in module.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=1e-3)
    if mode == "DoRA":
        use_fast_dora(module)
    return module


def interleaved(steps: dict[str, Callable[[], None]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """CPU seconds of each step, the steps taking turns (in alternating order) `repeats` times."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(warmup + repeats):
        for name in list(steps) if index % 2 == 0 else list(steps)[::-1]:
            start = time.process_time()
            steps[name]()
            if index >= warmup:
                seconds[name].append(time.process_time() - start)
    return seconds


def rows_of(case: str, rank: int | str, compiled: str, seconds: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One row per mode: median milliseconds, and per-repetition ratios to LoRA and to frozen."""

    def ratio(mode: str, other: str) -> float | None:
        if other not in seconds:
            return None
        return statistics.median(a / b for a, b in zip(seconds[mode], seconds[other], strict=True))

    return [{"case": case, "rank": rank, "compiled": compiled, "mode": mode,
             "ms_per_step": statistics.median(times) * 1e3, "vs_LoRA": ratio(mode, "LoRA"),
             "vs_frozen": ratio(mode, "frozen")} for mode, times in seconds.items()]


def backward_step(module, inputs: tuple) -> Callable[[], None]:
    """Forward + backward of `module` on `inputs` (the first needing its gradient), gradients freed."""

    def step() -> None:
        module(*inputs).float().square().mean().backward()
        module.zero_grad(set_to_none=True)
        inputs[0].grad = None
    return step


def layer_steps(base, make_input: Callable[[], tuple], ranks: tuple[int, ...], targets: list[str],
                compiled: bool = False) -> dict[tuple[int, str], Callable[[], None]]:
    """Forward + backward of `base` under each mode and rank (frozen once), keyed (rank, mode)."""
    import torch

    inputs = make_input()
    steps = {}
    for rank in ranks:
        for mode in MODES:
            if (mode == "frozen" and rank != ranks[0]) or (compiled and mode == "DoRA (peft)"):
                continue  # frozen weights have no rank; peft's DoRA is timed without compile
            module = adapted(base, mode, rank, targets)
            steps[rank, mode] = backward_step(torch.compile(module) if compiled else module, inputs)
    return steps


def layer_rows(case: str, steps: dict[tuple[int, str], Callable[[], None]], repeats: int, warmup: int,
               compiled: str = "no") -> list[dict[str, Any]]:
    """All ranks and modes of one case timed together, reported per rank (frozen with each)."""
    seconds = interleaved({f"{rank}|{mode}": step for (rank, mode), step in steps.items()}, repeats, warmup)
    rows = []
    for rank in dict.fromkeys(rank for rank, _ in steps):
        of_rank = {mode: seconds[f"{r}|{mode}"] for r, mode in steps if r == rank or mode == "frozen"}
        rows += rows_of(case, rank, compiled, of_rank)
    return rows


def block_case(width: int, tokens: int, smoke: bool):
    """SDXL's transformer block at one latent level (64-dim heads), its input and text context."""
    import torch
    from diffusers.models.attention import BasicTransformerBlock

    context = 32 if smoke else 2048
    block = BasicTransformerBlock(width, width // 64, 64, cross_attention_dim=context, activation_fn="geglu")
    block.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)

    def make_input() -> tuple:
        hidden = torch.randn(1, tokens, width, generator=generator).requires_grad_()
        return hidden, None, torch.randn(1, 77, context, generator=generator)

    return block, make_input


def conv_case(channels: int, side: int):
    import torch

    conv = torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1)).requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    return conv, lambda: (torch.randn(1, channels, side, side, generator=generator).requires_grad_(),)


class TinyStep:
    """The quickstart's training step on the built-in tiny SDXL through the trainer's own setup
    (`prepare_trainable`, `diffusion_loss`, `make_optimizer`); "DoRA (peft)" puts peft's forward back."""

    def __init__(self, mode: str, tmp: Path) -> None:
        import torch
        from peft.tuners.lora.layer import LoraLayer

        from sdxl_trainer.config import validate_config
        from sdxl_trainer.diffusion import Draws, LossModels, make_noise_scheduler
        from sdxl_trainer.fast_dora import FAST_VARIANTS
        from sdxl_trainer.models import load_pipeline
        from sdxl_trainer.optimizers import make_optimizer
        from sdxl_trainer.training_setup import prepare_trainable

        config = validate_config({
            "model": {"id": "builtin:tiny-sdxl", "train_text_encoder_1": True, "use_gradient_checkpointing": False},
            "adapter": {"type": "lora" if mode == "LoRA" else "dora", "rank": 4, "alpha": 4, "targets": "attn-mlp"},
            "run": {"name": "bench", "output_root": str(tmp)},
            "training": {"num_steps": 150, "lr_unet": 1e-3, "lr_text_encoder_1": 5e-4, "seed": 42},
            "data": {"image_dir": str(ROOT / "data" / "images"), "size": 64},
            "optimizer": {"type": "adamw", "weight_decay": 0.01},
        })
        self.pipe = load_pipeline(config.model)
        torch.manual_seed(0)
        trainable = prepare_trainable(self.pipe, config)
        if mode == "DoRA (peft)":
            peft_variants = {fast: peft for peft, fast in FAST_VARIANTS.items()}
            for layer in (m for module in trainable.modules.values() for m in module.modules()):
                if isinstance(layer, LoraLayer):
                    for adapter, variant in layer.lora_variant.items():
                        layer.lora_variant[adapter] = peft_variants[type(variant)]()
        self.models = LossModels.of(self.pipe)
        self.scheduler = make_noise_scheduler(self.pipe.scheduler.config, None, False)
        self.optimizer = make_optimizer(config.optimizer, trainable.param_groups())
        generator = torch.Generator().manual_seed(0)
        sizes = torch.tensor([[64, 64], [64, 64]])
        self.batch = {"latents": torch.randn(2, 4, 8, 8, generator=generator),
                      "captions": ["a photo of a red circle", "a blue square on a green background"],
                      "original_sizes": sizes, "crops_top_left": torch.zeros(2, 2, dtype=torch.long),
                      "target_sizes": sizes}
        self.draws = Draws(torch.randn(2, 4, 8, 8, generator=generator), torch.tensor([250, 650]),
                           torch.zeros(2, 4, 8, 8))

    def __call__(self) -> None:
        from sdxl_trainer.diffusion import diffusion_loss

        diffusion_loss(self.models, self.scheduler, self.batch, self.draws, "cpu").backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")

    args = bench_args(__doc__.splitlines()[0], argv, options)
    import tempfile

    import torch

    torch.set_num_threads(1)
    smoke = args.smoke
    ranks = (4,) if smoke else (16, 32)
    repeats, warmup = (1, 0) if smoke else (5, 1)  # the 64×64 level: 2 fewer
    levels = [("32×32", 64, 16)] if smoke else [("32×32", 1280, 1024), ("64×64", 640, 4096)]
    rows: list[dict[str, Any]] = []
    for level, width, tokens in levels:
        block, make_input = block_case(width, tokens, smoke)
        case = f"transformer block, {level} level ({width} ch, {tokens} tokens)"
        rows += layer_rows(case, layer_steps(block, make_input, ranks, BLOCK_TARGETS), repeats if level == "32×32"
                           else max(1, repeats - 2), warmup)
    channels, side = (16, 8) if smoke else (1280, 32)
    conv, make_input = conv_case(channels, side)
    rows += layer_rows(f"resnet conv 3×3 ({channels} ch, {side}×{side})",
                       layer_steps(conv, make_input, ranks[:1], ["0"]), repeats, warmup)
    if not (smoke or args.no_compile):
        block, make_input = block_case(*levels[0][1:], smoke)
        rows += layer_rows(f"transformer block, {levels[0][0]} level, torch.compile",
                           layer_steps(block, make_input, ranks[:1], BLOCK_TARGETS, compiled=True),
                           repeats, warmup + 1, compiled="yes")
    tiny_repeats, tiny_warmup = (2, 0) if smoke else (40, 5)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = {mode: TinyStep(mode, Path(tmp)) for mode in MODES[1:]}
        rows += rows_of("tiny model, whole training step", 4, "no", interleaved(tiny, tiny_repeats, tiny_warmup))
    notes = ("ms_per_step: CPU milliseconds (torch on 1 thread), median over repetitions; vs_LoRA, "
             "vs_frozen: median over repetitions of the step's time over the other mode's in the same "
             "repetition. DoRA (peft): peft's own DoRA forward; DoRA: sdxl_trainer/fast_dora.py (the trainer's). "
             f"{repeats} repetitions after {warmup} warm-up (64×64 level: {max(1, repeats - 2)}; the tiny "
             f"model: {tiny_repeats} after {tiny_warmup}); torch.compile: default mode, compiled in an extra "
             "warm-up repetition.")
    write_results("dora", rows, notes, args.results_dir)


if __name__ == "__main__":
    main()
