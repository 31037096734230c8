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
that couple tensors (Prodigy's and schedule-free's per-group running values), FSDP (each process
holds a slice of a gradient, reduce-scattered after this hook would fire), and
`training.nan_policy: "skip"`.

Several processes (`accelerate launch --multi_gpu`): the trained modules are not wrapped in DDP
(its reducer keeps bucket buffers as large as all the gradients for the life of the model, which
is the memory this option exists to save). The hook does DDP's averaging itself, per tensor:
the gradient is divided by the number of processes and summed across them (`all_reduce`), which
is what DDP's default communication hook computes per bucket, so the averaged gradient is DDP's
(bit for bit with two processes; the tests check it). Then its norm is checked and the tensor
stepped. The hooks meet the all-reduce in autograd's order, which is the same on every process for
the same graph: the collectives pair up tensor by tensor. A graph that depended on the data (a
tensor used in one process's step and not in another's, or reached in another order) would pair
different tensors' gradients; the trainer's graph does not, and `finish_step` checks it: the order
of the first step is compared across the processes, and every later step must repeat it. The
processes start from the main process's weights (broadcast here, as DDP's constructor does). Each
all-reduce blocks its tensor's step (the step needs the average), so unlike DDP the communication
does not overlap the rest of backward.

The NaN policy: each (averaged) gradient's norm is checked before its tensor is stepped (one host
sync per tensor). The first non-finite one stops all further stepping in this step; the step's
verdict is then "abort", and nothing is saved. Every process sees the same averaged gradients, so
every process stops at the same tensor. The tensors stepped before it keep their update, which is
why "skip" (which promises an untouched model) is refused.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

import torch


class FusedBackward:
    """Hooks that step each trained tensor when its gradient is complete (see the module docstring);
    `processes` above 1: each gradient is first averaged across the processes."""

    def __init__(self, optimizer, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 processes: int = 1) -> None:
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds it
        self.names = {param: name for name, param in named_parameters}
        # A group's index, not the group itself: loading a state replaces the optimizer's group dicts.
        self.group_index = {param: index for index, group in enumerate(self.optimizer.param_groups)
                            for param in group["params"]}
        self.processes = processes
        self.squared_norms: list[float] = []
        self.non_finite: str | None = None  # the first tensor whose gradient was not finite, this step
        self.order: list[str] = []  # the tensors whose hooks ran this step, in that order
        self.first_order: int | None = None  # a checksum of the first step's order (several processes)
        if processes > 1:
            for param in self.group_index:
                torch.distributed.broadcast(param.detach(), src=0)
        self.handles = [param.register_post_accumulate_grad_hook(self.step_tensor) for param in self.group_index]

    def step_tensor(self, param: torch.nn.Parameter) -> None:
        """One tensor's optimizer step, then its gradient is freed; nothing once a gradient was non-finite."""
        name = self.names.get(param, "a trained tensor")
        self.order.append(name)
        if self.processes > 1:  # DDP's average: each process's gradient over the number of processes, summed
            param.grad.div_(self.processes)
            torch.distributed.all_reduce(param.grad)
        norm = float(torch.linalg.vector_norm(param.grad.detach()))  # the one host sync per tensor
        if self.non_finite is None and not math.isfinite(norm):
            self.non_finite = name
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
        if self.processes > 1:
            self.check_order()
        total = math.nan if self.non_finite is not None else math.sqrt(sum(self.squared_norms))
        first_non_finite = self.non_finite
        self.squared_norms, self.non_finite, self.order = [], None, []
        return torch.tensor(total, device=next(iter(self.group_index)).device), first_non_finite

    def check_order(self) -> None:
        """Raise when the gradients did not meet the all-reduce in the same order in every process
        (the first step's order, compared across them; each later step, against the first)."""
        checksum = zlib.crc32("\n".join(self.order).encode())
        if self.first_order is None:
            everyone: list[int | None] = [None] * self.processes
            torch.distributed.all_gather_object(everyone, checksum)
            if len(set(everyone)) > 1:
                raise RuntimeError("fused backward: the processes' backward passes reached the trained tensors in "
                                   "different orders, so their gradients were averaged with the wrong partners")
            self.first_order = checksum
        elif checksum != self.first_order:
            raise RuntimeError("fused backward: this step's backward pass reached the trained tensors in another "
                               "order than the first step's, which the all-reduce across processes relies on")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
