"""What happens when the loss or the gradients stop being finite (`training.nan_policy`).

The check costs one host sync per optimizer step (the loss and the total gradient norm together),
never one per parameter. `abort` (and `detect_anomaly`) stops with a report and saves nothing;
`skip` drops the step — no optimizer update, optimizer state untouched — up to `max_nan_skips`
steps in a row. In fp16 runs, non-finite gradients with a finite loss are the grad scaler's
business (it skips the step and lowers its scale), not a NaN event. The loss checked is the mean
of the step's micro-batch losses, so a NaN in any of them counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

OK, SKIP, ABORT, SCALER = "ok", "skip", "abort", "scaler"


@dataclass
class NaNGuard:
    policy: str  # "abort" or "skip"
    max_skips: int
    grad_scaler: bool
    consecutive: int = 0
    events: list[dict] = field(default_factory=list)

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int, paths: list[str],
              accelerator=None) -> str:
        """The verdict for this step; under several processes all ranks reach the same one."""
        import torch

        finite = torch.stack([torch.isfinite(loss.detach().float()), torch.isfinite(grad_norm.float())]).float()
        if accelerator is not None and accelerator.num_processes > 1:
            finite = accelerator.reduce(finite, reduction="sum") / accelerator.num_processes
        loss_ok, grads_ok = (finite == 1.0).tolist()
        if loss_ok and grads_ok:
            self.consecutive = 0
            return OK
        if loss_ok and self.grad_scaler:
            return SCALER
        self.events.append({"step": step, "loss": float(loss.detach()), "grad_norm": float(grad_norm), "files": paths})
        self.consecutive += 1
        if self.policy == "skip" and self.consecutive <= self.max_skips:
            return SKIP
        return ABORT


def non_finite_report(step: int, loss: torch.Tensor, paths: list[str], timesteps: list[int],
                      named_parameters: list[tuple[str, torch.nn.Parameter]], reason: str) -> str:
    """A report that says where to look: the batch, the timesteps, the tensors that broke."""
    from .finite import non_finite_names

    bad_values = non_finite_names(named_parameters)
    bad_grads = non_finite_names((name, p.grad) for name, p in named_parameters if p.grad is not None)

    def listing(names: list[str]) -> str:
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") or "none"

    return "\n".join([
        f"error: {reason} at step {step} (loss {float(loss.detach())}); nothing non-finite was saved.",
        f"  files in the batch: {', '.join(paths)}",
        f"  timesteps: {timesteps}",
        f"  non-finite weights: {listing(bad_values)}",
        f"  non-finite gradients: {listing(bad_grads)}",
        "  likely causes: fp16 with DoRA, a learning rate far too high, a broken image or latent; "
        "see docs/troubleshooting.md, 'Black images and NaN'",
    ])
