"""The optimizers users choose by name: 8-bit AdamW (bitsandbytes), AdamW and Adafactor."""

from __future__ import annotations

from typing import Any

from .config import OptimizerConfig


def make_optimizer(optimizer: OptimizerConfig, param_groups: list[dict[str, Any]], device: str = "cpu",
                   bf16_weights: bool = False):
    """Build the optimizer over param groups that each carry their own `lr`.

    bf16 weights get AdamW with stochastic rounding; 8-bit AdamW falls back to AdamW on Apple MPS,
    where bitsandbytes has no kernels (the fallback is printed).
    """
    import torch

    if bf16_weights:
        from .bf16_adamw import StochasticRoundingAdamW

        return StochasticRoundingAdamW(
            param_groups, betas=optimizer.betas, eps=optimizer.eps, weight_decay=optimizer.weight_decay
        )
    kind = optimizer.type
    if kind == "adamw8bit" and device == "mps":
        print('warning: bitsandbytes has no 8-bit AdamW for Apple MPS; using optimizer.type "adamw" instead')
        kind = "adamw"
    if kind == "adamw":
        return torch.optim.AdamW(
            param_groups, betas=optimizer.betas, eps=optimizer.eps, weight_decay=optimizer.weight_decay
        )
    if kind == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as exc:
            raise RuntimeError(
                'optimizer.type "adamw8bit" needs bitsandbytes: pip install bitsandbytes '
                '(or set optimizer.type to "adamw")'
            ) from exc
        return bnb.optim.AdamW8bit(
            param_groups, betas=optimizer.betas, eps=optimizer.eps, weight_decay=optimizer.weight_decay
        )
    from transformers.optimization import Adafactor

    # Fixed learning rates from the config, not Adafactor's own relative step sizes.
    return Adafactor(
        param_groups, scale_parameter=False, relative_step=False, warmup_init=False,
        weight_decay=optimizer.weight_decay,
    )
