"""Low-rank approximation of weight updates, shared by extract_adapter.py (a full fine-tune → an
adapter) and resize_adapter.py (an adapter → a lower rank): the SVD of one layer's update, the
rank kept (fixed, or kohya's dynamic methods by name), the factors, the DoRA magnitude, and the
report of how far each merged weight lies from the weight it stands for (docs/adapters.md).

By Eckart–Young, keeping the k largest singular values gives the best rank-k approximation of an
update in the Frobenius norm. The factors are split evenly (up = U·√S, down = √S·Vᵀ), with
alpha = rank, so the loaders' scale alpha/rank is 1.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    import torch

DYNAMIC_METHODS = ("sv_ratio", "sv_fro", "sv_cumulative")
SVD_METHODS = ("exact", "lowrank")
LOWRANK_OVERSAMPLING = 8  # extra columns for torch.svd_lowrank, as its documentation advises
LOWRANK_ITERATIONS = 2  # subspace iterations: the error is within a fraction of a percent of the exact SVD's
EXIT_BAD_INPUT = 2


class LowRankError(ValueError):
    """Bad input to a low-rank tool (a file, a model, a rank): one line, exit code 2."""


@dataclass(frozen=True)
class RankChoice:
    """How many singular values a layer keeps: `rank`, or with `dynamic` the fewest that meet the
    method's `param` (kohya's resize_lora.py semantics), at most `rank`."""

    rank: int
    dynamic: str | None = None
    param: float = 0.0
    svd: str = "exact"

    def check(self) -> None:
        if self.rank < 1:
            raise LowRankError(f"--rank {self.rank}: must be at least 1")
        if self.dynamic is not None and self.dynamic not in DYNAMIC_METHODS:
            raise LowRankError(f"--dynamic {self.dynamic}: unknown; expected one of {', '.join(DYNAMIC_METHODS)}")
        if self.dynamic == "sv_ratio" and self.param < 1:
            raise LowRankError(f"--dynamic-param {self.param:g}: sv_ratio needs a ratio of at least 1")
        if self.dynamic in ("sv_fro", "sv_cumulative") and not 0 < self.param <= 1:
            raise LowRankError(f"--dynamic-param {self.param:g}: {self.dynamic} needs a fraction in (0, 1]")
        if self.dynamic == "sv_cumulative" and self.svd == "lowrank":
            raise LowRankError("--dynamic sv_cumulative needs every singular value: use --svd exact")

    def keep(self, singular: torch.Tensor, total_energy: float) -> int:
        """The rank to keep, from the singular values (descending) and ‖ΔW‖²_F (which the low-rank
        SVD cannot sum from the values it finds)."""
        import torch

        count = len(singular)
        if self.dynamic is None or count == 0:
            return min(self.rank, max(count, 1))
        if total_energy == 0:  # a zero update (a layer that never trained): nothing to keep but the minimum
            return 1
        if self.dynamic == "sv_ratio":
            kept = int(torch.sum(singular > singular[0] / self.param))
        else:
            values = singular.double() ** (2 if self.dynamic == "sv_fro" else 1)
            total = total_energy if self.dynamic == "sv_fro" else float(values.sum())
            target = self.param**2 if self.dynamic == "sv_fro" else self.param
            reached = torch.cumsum(values, 0) / total >= target * (1 - 1e-12)
            kept = int(torch.nonzero(reached)[0]) + 1 if bool(reached.any()) else count
        return max(1, min(kept, self.rank, count))


@dataclass
class Factors:
    """A rank-r update ΔW ≈ up @ down (scale 1), the singular values it keeps and the energy it
    leaves out (‖ΔW − up@down‖²_F)."""

    up: torch.Tensor  # [out, r]
    down: torch.Tensor  # [r, in·kernel]
    singular: torch.Tensor
    residual_energy: float
    total_energy: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def delta_error(self) -> float:
        """‖ΔW − up@down‖ / ‖ΔW‖: how much of the update the factors miss."""
        return math.sqrt(max(self.residual_energy, 0.0) / self.total_energy) if self.total_energy else 0.0


def max_rank(shape: tuple[int, ...] | torch.Size) -> int:
    """The largest rank a layer's update can have: min(out, in·kernel)."""
    return min(shape[0], math.prod(shape[1:]))


def factorize(flat: torch.Tensor, choice: RankChoice) -> Factors:
    """The best rank-k factors of an update `flat` ([out, in·kernel], fp32), k from `choice`."""
    import torch

    flat = flat.float()
    total = float(flat.double().square().sum())
    if choice.svd == "lowrank" and choice.rank + LOWRANK_OVERSAMPLING < max_rank(flat.shape):
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(0)  # the same file for the same inputs
        u, s, v = torch.svd_lowrank(flat, q=choice.rank + LOWRANK_OVERSAMPLING, niter=LOWRANK_ITERATIONS)
        torch.random.set_rng_state(generator_state)
        vh = v.T
    else:
        u, s, vh = torch.linalg.svd(flat, full_matrices=False)
    return _split(u, s, vh, choice.keep(s, total), total)


def factorize_product(up: torch.Tensor, down: torch.Tensor, choice: RankChoice) -> Factors:
    """The best rank-k factors of up @ down without forming it: QR of both factors, then the SVD
    of the small r×r core (exact, whichever `choice.svd`)."""
    import torch

    q_up, r_up = torch.linalg.qr(up.double())
    q_down, r_down = torch.linalg.qr(down.double().T)
    u, s, vh = torch.linalg.svd(r_up @ r_down.T)
    total = float(s.square().sum())
    return _split((q_up @ u).float(), s.float(), (vh @ q_down.T).float(), choice.keep(s, total), total)


def _split(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int, total: float) -> Factors:
    root = s[:rank].sqrt()
    kept = float(s[:rank].double().square().sum())
    return Factors(up=(u[:, :rank] * root).contiguous(), down=(root[:, None] * vh[:rank]).contiguous(),
                   singular=s[:rank].clone(), residual_energy=total - kept, total_energy=total)


def dora_magnitude(target: torch.Tensor) -> torch.Tensor:
    """peft's DoRA magnitude for a merged weight equal in norm to `target`: the L2 norm of each
    output channel (peft's `get_weight_norm`: dim 1 of a Linear, dims 1–3 of a Conv2d), shape [out]."""
    return target.float().flatten(1).norm(dim=1)


@dataclass
class LayerError:
    """One layer's result: its rank and how far its merged weight lies from the weight it stands for."""

    label: str
    shape: tuple[int, ...]
    rank: int
    error_energy: float  # ‖W_merged − W_target‖²
    target_energy: float  # ‖W_target‖²
    delta_error: float  # ‖ΔW − ΔW_r‖ / ‖ΔW‖ (before any DoRA rescaling)
    delta_energy: float  # ‖ΔW‖²

    @property
    def weight_error(self) -> float:
        return math.sqrt(self.error_energy / self.target_energy) if self.target_energy else 0.0


def layer_error(label: str, merged: torch.Tensor | None, target: torch.Tensor | None, factors: Factors) -> LayerError:
    """The error record of one layer; without weights (a resize with no base model) only the
    update's error is known, and the weight error is reported as nan."""
    if merged is None or target is None:
        error, norm = math.nan, math.nan
    else:
        error, norm = float((merged.double() - target.double()).square().sum()), float(target.double().square().sum())
    shape = (factors.up.shape[0], factors.down.shape[1]) if target is None else tuple(target.shape)
    return LayerError(label, shape, factors.rank, error, norm, factors.delta_error, factors.total_energy)


def overall(errors: list[LayerError]) -> tuple[float, float]:
    """(weight error, update error) over all layers together: the root of the summed squared
    errors over the root of the summed squared norms."""
    target = sum(error.target_energy for error in errors)
    weight = math.sqrt(sum(error.error_energy for error in errors) / target) if target else math.nan
    delta_total = sum(error.delta_energy for error in errors)
    missed = sum(error.delta_error**2 * error.delta_energy for error in errors)
    return weight, math.sqrt(missed / delta_total) if delta_total else 0.0


def print_report(errors: list[LayerError], per_layer: bool = True) -> None:
    """Per layer (unless `per_layer` is false) and overall: rank, the merged weight's relative error
    against the weight it stands for, and the update's."""
    if per_layer:
        print(f"{'layer':<72} {'shape':>16} {'rank':>5} {'weight err':>11} {'update err':>11}")
        for error in errors:
            shape = "×".join(str(size) for size in error.shape)
            print(f"{error.label:<72} {shape:>16} {error.rank:>5} {_number(error.weight_error):>11} "
                  f"{_number(error.delta_error):>11}")
    weight, delta = overall(errors)
    ranks = [error.rank for error in errors]
    merged = "n/a (needs the base model)" if math.isnan(weight) else _number(weight)
    print(f"overall: {len(errors)} layers, rank {min(ranks)}–{max(ranks)} (mean {sum(ranks) / len(ranks):.1f}); "
          f"merged-weight relative error {merged}, update relative error {_number(delta)}")


def _number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3e}"


def add_rank_options(parser: argparse.ArgumentParser) -> None:
    """The rank options both tools share."""
    parser.add_argument("--rank", type=int, required=True,
                        help="the rank of every layer; with --dynamic or --error-target, the most a layer keeps")
    parser.add_argument("--dynamic", choices=DYNAMIC_METHODS, default=None,
                        help="choose each layer's rank as kohya's resize_lora.py does: sv_ratio keeps the singular "
                        "values above the largest / PARAM; sv_fro the fewest whose Frobenius norm reaches PARAM of "
                        "the update's; sv_cumulative the fewest whose sum reaches PARAM of the sum")
    parser.add_argument("--dynamic-param", type=float, default=None, help="the dynamic method's target")
    parser.add_argument("--svd", choices=SVD_METHODS, default="exact",
                        help="exact: torch.linalg.svd (default); lowrank: torch.svd_lowrank, randomized with "
                        f"{LOWRANK_ITERATIONS} subspace iterations, several times faster on SDXL's large layers and "
                        "within a fraction of a percent of the exact error")
    parser.add_argument("--quiet", action="store_true", help="print the overall error only, not every layer's")


def rank_choice(args: argparse.Namespace) -> RankChoice:
    if (args.dynamic is None) != (args.dynamic_param is None):
        raise LowRankError("--dynamic and --dynamic-param go together")
    choice = RankChoice(args.rank, args.dynamic, args.dynamic_param or 0.0, args.svd)
    choice.check()
    return choice


def run_tool(command: Callable[[argparse.Namespace], None], args: argparse.Namespace,
             input_errors: tuple[type[Exception], ...]) -> int:
    """Run a tool: bad input (`input_errors`) and a failed write (a full disk, an output path
    through a file) are one line on stderr and exit code 2; nothing is written then, since every
    file is written atomically at the end."""
    from .atomic import OutputWriteError

    try:
        command(args)
    except (*input_errors, OutputWriteError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0
