"""Worker of tests/test_fused_backward.py's two-process test, in a module of its own so that the
spawned processes import torch and the hooks only (not the test module's imports)."""

from __future__ import annotations

from pathlib import Path

import torch

from sdxl_trainer.fused_backward import FusedBackward


class TwoBranches(torch.nn.Module):
    """Two same-shaped branches: backward reaches the one computed last first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, a_first: bool) -> torch.Tensor:
        outputs = (self.a(x), self.b(x)) if a_first else (self.b(x), self.a(x))
        return sum(outputs).square().sum()


def two_process_worker(rank: int, port: int, folder: Path) -> None:
    """One of two gloo processes: a step in the same order (averaged), a later step in another
    order, then a first step whose order differs between the processes."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(rank)  # different weights in each process: the hooks start both from rank 0's
    model = TwoBranches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + rank))  # each process its own batch
    errors = []
    hooks = FusedBackward(optimizer, model.named_parameters(), processes=2)
    start = {name: param.detach().clone() for name, param in model.named_parameters()}
    model(x, a_first=True).backward()
    hooks.finish_step()
    after = {name: param.detach().clone() for name, param in model.named_parameters()}
    model(x, a_first=False).backward()
    try:
        hooks.finish_step()
    except RuntimeError as exc:
        errors.append(str(exc))
    hooks.remove()
    hooks = FusedBackward(optimizer, model.named_parameters(), processes=2)
    model(x, a_first=rank == 0).backward()
    try:
        hooks.finish_step()
    except RuntimeError as exc:
        errors.append(str(exc))
    torch.save({"start": start, "after": after, "x": x, "errors": errors}, folder / f"rank{rank}.pt")
    # Both processes finish their collectives before either tears its group down. Under load, a run
    # once aborted rank 1 in gloo ("terminate called without an active exception"); rank 0, which
    # hosts the store, leaving while rank 1 still used the group is the likely cause.
    dist.barrier()
    dist.destroy_process_group()
