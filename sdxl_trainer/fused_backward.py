"""Fused backward (`optimizer.fused_backward`): each trained tensor is stepped inside the backward
pass, as soon as its gradient is complete, and that gradient is freed at once.

Without it, every gradient lives until the optimizer steps after backward: for a full fine-tune
of SDXL's UNet that is 2.6 billion numbers (10.3 GB in fp32, 5.1 GB in bf16) on top of the
activations. With it, only the gradients of the tensors whose step is pending are alive.

The step of one tensor is the optimizer's own `step()` over a param group narrowed to that tensor
(the group's learning rate and settings, the optimizer's state for that tensor), so every
optimizer whose update of a tensor depends on that tensor alone gives the same update as its
ordinary step. What cannot hold is refused by the config: several micro-batches per step (the
gradient is not complete until the last), global-norm clipping (the norm is known only after the
last gradient), fp16's grad scaler (it decides after all gradients whether to step), optimizers
that couple tensors (Prodigy's and schedule-free's per-group running values), several processes
(DDP averages a gradient after this hook has seen it), and `training.nan_policy: "skip"`.

The NaN policy: each gradient's norm is checked before its tensor is stepped (one host sync per
tensor). The first non-finite one stops all further stepping in this step; the step's verdict is
then "abort", and nothing is saved. The tensors stepped before it keep their update, which is
why "skip" (which promises an untouched model) is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class FusedBackward:
    """Hooks that step each trained tensor when its gradient is complete (see the module docstring)."""

    def __init__(self, optimizer, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds it
        self.names = {param: name for name, param in named_parameters}
        # A group's index, not the group itself: loading a state replaces the optimizer's group dicts.
        self.group_index = {param: index for index, group in enumerate(self.optimizer.param_groups)
                            for param in group["params"]}
        self.squared_norms: list[float] = []
        self.non_finite: str | None = None  # the first tensor whose gradient was not finite, this step
        self.handles = [param.register_post_accumulate_grad_hook(self.step_tensor) for param in self.group_index]

    def step_tensor(self, param: torch.nn.Parameter) -> None:
        """One tensor's optimizer step, then its gradient is freed; nothing once a gradient was non-finite."""
        norm = float(torch.linalg.vector_norm(param.grad.detach()))  # the one host sync per tensor
        if self.non_finite is None and not math.isfinite(norm):
            self.non_finite = self.names.get(param, "a trained tensor")
        if self.non_finite is not None:
            param.grad = None
            return
        self.squared_norms.append(norm * norm)
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [{**groups[self.group_index[param]], "params": [param]}]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups
        param.grad = None

    def finish_step(self) -> tuple[torch.Tensor, str | None]:
        """The step's total gradient norm (the 2-norm of the tensors' norms, as `clip_grad_norm_`
        computes it; NaN if a gradient was not finite) and the first tensor whose gradient was not
        finite; ready for the next step."""
        total = math.nan if self.non_finite is not None else math.sqrt(sum(self.squared_norms))
        first_non_finite = self.non_finite
        self.squared_norms, self.non_finite = [], None
        return torch.tensor(total, device=next(iter(self.group_index)).device), first_non_finite

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
