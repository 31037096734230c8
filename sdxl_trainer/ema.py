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
