"""Exponential moving average of the trained parameters (adapters only, in adapter runs).

ema ← decay·ema + (1 − decay)·weight, every `ema_update_every` optimizer steps once warmup is
over. The averaged copy lives on the CPU (`ema_device: "cpu"`) or beside the weights; `swapped_in`
puts it into the model temporarily (eval) and `copy_to` for good (the final export).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import Config

# The pre-flight warns where, at the end of the run, more than this share of the EMA is still the
# weights it started from (the first update step's): the final weights then hardly hold the training.
START_SHARE_WARNED = 0.5


class EMA:
    def __init__(self, named_parameters: list[tuple[str, torch.nn.Parameter]], decay: float, device: str):
        import torch

        self.decay = decay
        self.parameters = [param for _, param in named_parameters]
        self.names = [name for name, _ in named_parameters]
        self.device = device
        self.shadow = [
            param.detach().to(param.device if device == "same" else "cpu", torch.float32, copy=True)
            for param in self.parameters
        ]

    def update(self) -> None:
        import torch

        with torch.no_grad():
            for shadow, param in zip(self.shadow, self.parameters, strict=True):
                shadow.lerp_(param.detach().to(shadow.device, torch.float32), 1.0 - self.decay)

    def copy_to(self) -> None:
        import torch

        with torch.no_grad():
            for shadow, param in zip(self.shadow, self.parameters, strict=True):
                param.copy_(shadow.to(param.device, param.dtype))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights in the model for the duration of the block, the trained ones after."""
        backup = [param.detach().clone() for param in self.parameters]
        self.copy_to()
        try:
            yield
        finally:
            import torch

            with torch.no_grad():
                for saved, param in zip(backup, self.parameters, strict=True):
                    param.copy_(saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: shadow.cpu() for name, shadow in zip(self.names, self.shadow, strict=True)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for index, name in enumerate(self.names):
            self.shadow[index] = state[name].to(self.shadow[index].device, self.shadow[index].dtype)


def ema_warning(config: Config, total_steps: int) -> str:
    """A pre-flight warning where `model.use_ema` would give final weights that are mostly (or
    entirely) not the EMA of the training: the EMA forms at the first multiple of
    `ema_update_every` after the LR warmup (the weights of that step), and keeps decay^n of them
    after n updates. "" when the EMA averages the run."""
    from .lr_schedule import schedule_settings

    if not config.model.use_ema:
        return ""
    every, decay = config.training.ema_update_every, config.model.ema_decay
    warmup = schedule_settings(config.training).warmup_steps
    start = every * max(1, -(-warmup // every))  # the first step >= warmup that updates (run.after_step)
    if start > total_steps:
        return (f"model.use_ema: the EMA forms at step {start} (the first multiple of training.ema_update_every "
                f"{every} at or after the LR warmup's {warmup} steps), after this run's {total_steps} steps: the "
                "final weights are the trained ones")
    updates = total_steps // every - start // every
    share = decay ** updates
    if share <= START_SHARE_WARNED:
        return ""
    plural = "s" if updates != 1 else ""
    return (f"model.use_ema: the final EMA is still {share:.1%} the weights of step {start} ({updates} update{plural}, "
            f"one every {every} steps, model.ema_decay {decay:g}): lower model.ema_decay or "
            "training.ema_update_every for an average of the training")
