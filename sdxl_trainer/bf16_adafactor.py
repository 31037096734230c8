"""Adafactor for bf16 weights with stochastic rounding (full fine-tunes with `weights_dtype: "bf16"`
and `optimizer.type: "adafactor"`): kohya's low-memory SDXL full fine-tune.

transformers' Adafactor already computes a bf16 tensor's update in fp32, but writes the result back
rounded to nearest, which loses every update smaller than half a bf16 spacing (bf16_adamw.py says
why that stalls a fine-tune). Here each tensor is stepped alone on an fp32 copy of its weight and
gradient, by Adafactor's own `step()`, and the copy is rounded back stochastically. The factored
second moments stay in fp32 (they are small: a row and a column per matrix), so a bf16 SDXL UNet
with this optimizer holds about 2 bytes per weight plus its gradients, which fused backward frees
one at a time.

Only one tensor is copied at a time, so the extra memory is the largest tensor's fp32 copy.
"""

from __future__ import annotations

import torch
from transformers.optimization import Adafactor

from .bf16_adamw import keep_fp32_state, stochastic_round_to_bf16


class StochasticRoundingAdafactor(Adafactor):
    """Adafactor whose bf16 tensors are updated in fp32 and rounded back stochastically."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        groups = self.param_groups
        try:
            for group in groups:
                for param in group["params"]:
                    if param.grad is not None:
                        self.param_groups = [{**group, "params": [param]}]
                        self._step_in_fp32(param)
        finally:
            self.param_groups = groups
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        keep_fp32_state(self, state_dict)

    def _step_in_fp32(self, param: torch.nn.Parameter) -> None:
        """Adafactor's step of one tensor on fp32 copies (the state is keyed by the parameter, so it
        is the tensor's own), then the weight rounded back to its storage dtype."""
        stored, grad = param.data, param.grad
        if stored.dtype != torch.bfloat16:
            super().step()
            return
        param.data = stored.float()  # the data first: a gradient must match its parameter's dtype
        param.grad = grad.float()
        try:
            super().step()
            rounded = stochastic_round_to_bf16(param.data)
        finally:
            param.data = stored
            param.grad = grad
        stored.copy_(rounded)
