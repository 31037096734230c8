"""The one finiteness check of trained weights: NaN/Inf weights are never written."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .training_setup import Trainable


class NonFiniteWeightsError(RuntimeError):
    """Trained weights hold NaN/Inf: they are never written."""

    @classmethod
    def for_tensors(cls, names: list[str]) -> NonFiniteWeightsError:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return cls(f"{len(names)} trained tensor(s) hold NaN/Inf: {shown}")


def non_finite_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding any NaN/Inf."""
    import torch

    return [name for name, tensor in named_tensors if not torch.isfinite(tensor.detach()).all()]


def check_finite(trainable: Trainable) -> None:
    """Raise NonFiniteWeightsError naming every trained tensor that holds NaN/Inf."""
    bad = non_finite_names(trainable.named_parameters())
    if bad:
        raise NonFiniteWeightsError.for_tensors(bad)
