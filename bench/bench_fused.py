"""Fused backward (`optimizer.fused_backward`) against the ordinary step: time and tracked peak.

    python bench/bench_fused.py            # about 5 minutes on 2 cores
    python bench/bench_fused.py --smoke    # seconds: checks the code path

Two modules, each trained in full (forward, backward, optimizer step) with AdamW and Adafactor as
the trainer builds them (`make_optimizer`), ordinary and fused steps alternating so that other
load hits both alike:
- the built-in tiny SDXL's UNet, on a batch of 2 latents of 12x8 (the quickstart's 96x64 bucket);
- one full-width SDXL transformer block (a `BasicTransformerBlock` of the UNet's 1280-wide stage:
  width 1280, 20 heads, cross-attention to 77 tokens of 2048), on the 32x32 = 1024 tokens that
  stage sees at 1024x1024.
Time: the median of the per-step ratios fused / ordinary. Peak: the most tensor bytes alive at
once during one more step, counted as the memory plan counts them (every storage an operator
creates), weights and optimizer state included.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_args, write_results


def tiny_unet() -> tuple[Any, Callable[[], Any]]:
    import torch
    from diffusers import UNet2DConditionModel

    from sdxl_trainer.tiny_model import tiny_sdxl_path

    unet = UNet2DConditionModel.from_pretrained(tiny_sdxl_path() / "unet")
    config = unet.config
    generator = torch.Generator().manual_seed(0)

    def loss() -> torch.Tensor:
        sample = torch.randn(2, config.in_channels, 12, 8, generator=generator)
        context = torch.randn(2, 77, config.cross_attention_dim, generator=generator)
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        conditions = {"text_embeds": torch.randn(2, pooled, generator=generator),
                      "time_ids": torch.tensor([[96.0, 64.0, 0.0, 0.0, 96.0, 64.0]] * 2)}
        out = unet(sample, torch.tensor([500, 500]), context, added_cond_kwargs=conditions).sample
        return out.float().square().mean()

    return unet, loss


def sdxl_block(tokens: int = 1024) -> tuple[Any, Callable[[], Any]]:
    import torch
    from diffusers.models.attention import BasicTransformerBlock

    torch.manual_seed(0)
    block = BasicTransformerBlock(1280, 20, 64, cross_attention_dim=2048)
    generator = torch.Generator().manual_seed(0)

    def loss() -> torch.Tensor:
        hidden = torch.randn(1, tokens, 1280, generator=generator)
        context = torch.randn(1, 77, 2048, generator=generator)
        return block(hidden, encoder_hidden_states=context).square().mean()

    return block, loss


def measure(build: Callable[[], tuple[Any, Callable[[], Any]]], kind: str, steps: int) -> dict[str, Any]:
    """Ordinary and fused steps of two identical copies, alternating; time ratios and peaks."""
    from sdxl_trainer.config import OptimizerConfig
    from sdxl_trainer.fused_backward import FusedBackward
    from sdxl_trainer.memory.tracker import LiveBytes
    from sdxl_trainer.optimizers import make_optimizer

    runs = {}
    for mode in ("ordinary", "fused"):
        module, loss = build()
        optimizer = make_optimizer(OptimizerConfig(type=kind), [{"params": list(module.parameters()), "lr": 1e-5}])
        fused = FusedBackward(optimizer, module.named_parameters()) if mode == "fused" else None
        runs[mode] = {"module": module, "loss": loss, "optimizer": optimizer, "fused": fused, "times": [], "peak": 0}

    def step(run: dict[str, Any]) -> None:
        run["loss"]().backward()
        if run["fused"]:
            run["fused"].finish_step()
        else:
            run["optimizer"].step()
            run["optimizer"].zero_grad(set_to_none=True)

    for index in range(steps + 1):  # the first step creates the optimizer state: not timed
        for run in runs.values():
            start = time.perf_counter()
            step(run)
            if index:
                run["times"].append(time.perf_counter() - start)
    for run in runs.values():  # one more step, its bytes counted (the counting slows it: not timed)
        live = LiveBytes("cpu")
        live.track([*run["module"].parameters(), *_state(run["optimizer"])])
        with live:
            step(run)
        run["peak"] = live.peak
    ratios = [f / o for f, o in zip(runs["fused"]["times"], runs["ordinary"]["times"], strict=True)]
    return {"optimizer": kind, "ordinary_s": statistics.median(runs["ordinary"]["times"]),
            "fused_s": statistics.median(runs["fused"]["times"]), "time_ratio": statistics.median(ratios),
            "ordinary_peak_MB": runs["ordinary"]["peak"] / 1e6, "fused_peak_MB": runs["fused"]["peak"] / 1e6,
            "saved_MB": (runs["ordinary"]["peak"] - runs["fused"]["peak"]) / 1e6}


def _state(optimizer) -> list[Any]:
    import torch

    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def main(argv: list[str] | None = None) -> int:
    args = bench_args(__doc__.splitlines()[0], argv)
    modules = {"tiny SDXL UNet (batch 2, 12x8 latents)": tiny_unet,
               "one SDXL transformer block, width 1280, 1024 tokens": sdxl_block}
    if args.smoke:
        modules = {"one SDXL transformer block, 16 tokens": lambda: sdxl_block(16)}
    steps = 1 if args.smoke else 6
    rows = []
    for name, build in modules.items():
        for kind in ("adamw", "adafactor"):
            rows.append({"module": name, **measure(build, kind, steps)})
            print(rows[-1], flush=True)
    notes = ("fp32 weights, one process; ordinary and fused steps alternate; times: medians of "
             f"{steps} steps after the first; time_ratio: the median of the per-step ratios fused / ordinary; "
             "peaks: tensor bytes alive at once during a step (weights and optimizer state included).")
    write_results("fused", rows, notes, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
