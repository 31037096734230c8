"""What to do with one damaged module: restore it from an earlier checkpoint, zero a broken update,
reset a broken magnitude, make zero-norm channels safe, clamp outliers, or remove it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..formats.adapter_files import AdapterModule, channel_norms
from .base_weights import BaseWeights, open_adapter
from .checks import (
    FP16_LIMIT,
    NORM_FLOOR,
    RATIO_LIMIT,
    RESTORABLE,
    UNUSABLE,
    Finding,
    check_module,
    outliers,
    renames,
    update_reach,
    zero_magnitude,
    zero_norm_channels,
)
from .report import analyse_file

if TYPE_CHECKING:
    import torch


@dataclass
class RepairOptions:
    base: BaseWeights | None = None
    earlier: Earlier | None = None
    clamp_outliers: bool = False
    magnitude_from: str = "base"  # "base": ‖W‖; "adapted": ‖W+ΔW‖ (peft's initial magnitude)


@dataclass
class Repair:
    """What was done to one module: the repaired module (None: removed), the actions in words
    and the findings that remain."""

    module: AdapterModule | None
    actions: list[str]
    remaining: list[Finding] = field(default_factory=list)


class Earlier:
    """An earlier checkpoint (--from-checkpoint): its healthy modules replace broken ones."""

    def __init__(self, path: Path, base: BaseWeights | None) -> None:
        self.path = path
        self.healthy = {module.file_name for module in analyse_file(path, base).modules
                        if not {finding.kind for finding in module.findings} & RESTORABLE}
        self.adapter = open_adapter(path, base)

    def replacement(self, module: AdapterModule) -> AdapterModule | None:
        """The earlier copy of `module` if it is healthy and has the same tensors and shapes."""
        if module.file_name not in self.healthy:
            return None
        earlier = self.adapter.module(module.file_name)
        if earlier.tensors.keys() != module.tensors.keys():
            return None
        same = all(earlier.tensors[role].numel() == tensor.numel() and
                   (role == "magnitude" or earlier.tensors[role].shape == tensor.shape)
                   for role, tensor in module.tensors.items())
        return earlier if same else None


def repair_module(module: AdapterModule, options: RepairOptions) -> Repair:
    """Repair one module; an undamaged module comes back untouched (the same tensors).

    In order: restore from an earlier checkpoint; drop what no loader can use; canonical key names
    and magnitude shape; broken factors zeroed (the module falls back to the base weight); broken
    magnitudes reset to a norm of the base weight; zero-norm channels made safe; outliers clamped.
    Where a DoRA repair needs the base weights and no --base_model was given, the module is
    removed instead: loaders then keep the base weight.
    """
    base = options.base
    findings = check_module(module, base)
    if not findings:
        return Repair(module, [])
    kinds = {finding.kind for finding in findings}
    dtypes = {role: tensor.dtype for role, tensor in module.tensors.items()}
    actions = []
    if options.earlier and kinds & RESTORABLE:
        earlier = options.earlier.replacement(module)
        if earlier is not None:
            module.tensors, module.alpha = dict(earlier.tensors), earlier.alpha
            actions.append(f"restored from {options.earlier.path}")
            kinds = {finding.kind for finding in check_module(module, base)}
    if UNUSABLE in kinds:
        return Repair(None, [*actions, "removed: no loader can use it"])
    renamed = renames(module)
    if renamed:
        module.keys = {role: renamed.get(key, key) for role, key in module.keys.items()}
        actions.append(f"renamed {len(renamed)} key(s) to the {module.file_format} spelling")
    module.tensors = {role: tensor.float() for role, tensor in module.tensors.items()}
    try:
        for step in (_shape_magnitude, _zero_broken_update, _reset_magnitude, _fix_zero_norms, _clamp_outliers):
            action = step(module, options)
            if action:
                actions.append(action)
    except _Removed as removed:
        return Repair(None, [*actions, f"removed: {removed}"])
    module.tensors = {role: tensor.to(dtypes[role]).contiguous() for role, tensor in module.tensors.items()}
    return Repair(module, actions, check_module(module, base))


class _Removed(Exception):
    """Only removing the module is safe (loaders then keep the base weight); the message says why."""


NEEDS_BASE = "its DoRA magnitude needs the base weight's norms (pass --base_model to keep the module)"


def _shape_magnitude(module: AdapterModule, options: RepairOptions) -> str | None:
    """A magnitude in the wrong shape is reshaped; one that fits no axis is rebuilt as ‖W‖."""
    magnitude = module.magnitude
    if magnitude is None:
        return None
    layout = module.magnitude_layout()
    if layout is None:
        if options.base is None:
            raise _Removed(NEEDS_BASE)
        shape = module.output_magnitude_shape()
        module.tensors["magnitude"] = channel_norms(_base_weight(module, options), "output").reshape(shape)
        return f"magnitude {list(magnitude.shape)} rebuilt as ‖W‖ on the output axis {list(shape)}"
    if tuple(magnitude.shape) == layout[1]:
        return None
    module.tensors["magnitude"] = magnitude.reshape(layout[1])
    return f"magnitude reshaped from {list(magnitude.shape)} to {list(layout[1])} ({layout[0]} axis)"


def _zero_broken_update(module: AdapterModule, options: RepairOptions) -> str | None:
    """NaN/Inf or fp16-overflowing factors: ΔW := 0, and for DoRA m := ‖W‖, so W' = W exactly."""
    import torch

    factors = [module.tensors[role] for role in [*module.factor_roles, "alpha"] if role in module.tensors]
    if all(torch.isfinite(tensor).all() for tensor in factors) and update_reach(module) <= FP16_LIMIT:
        return None
    if module.magnitude is not None and options.base is None:
        raise _Removed(NEEDS_BASE)
    for role in module.factor_roles:  # every factor: each product (kron, ⊙, @) is then 0
        module.tensors[role] = torch.zeros_like(module.tensors[role])
    if not math.isfinite(module.alpha):
        module.alpha = float(module.rank or 1)
        module.tensors["alpha"] = torch.tensor(module.alpha)
    if module.magnitude is None:
        return "update zeroed (NaN/Inf or beyond fp16): the module falls back to the base weight"
    axis, shape = _layout(module)
    module.tensors["magnitude"] = channel_norms(_base_weight(module, options), axis).reshape(shape)
    return "update zeroed and magnitude set to ‖W‖: the module falls back to the base weight"


def _reset_magnitude(module: AdapterModule, options: RepairOptions) -> str | None:
    """NaN/Inf, zero or fp16-overflowing magnitudes → the norm of the base weight (or, with
    --magnitude-from adapted, of W+ΔW), channel by channel."""
    import torch

    if module.magnitude is None:
        return None
    axis, shape = _layout(module)
    magnitude = module.magnitude.flatten()
    base_weight = _base_weight(module, options) if options.base else None
    base_norm = channel_norms(base_weight, axis) if base_weight is not None else None
    bad = ~torch.isfinite(magnitude) | zero_magnitude(magnitude, base_norm) | (magnitude.abs() > FP16_LIMIT)
    if not bad.any():
        return None
    if base_weight is None:
        raise _Removed(NEEDS_BASE)
    adapted = options.magnitude_from == "adapted"
    norms = channel_norms(base_weight + module.delta(base_weight.shape), axis) if adapted else base_norm
    module.tensors["magnitude"] = torch.where(bad, norms, magnitude).reshape(shape)
    return f"magnitude of {int(bad.sum())} channel(s) reset to ‖{'W+ΔW' if adapted else 'W'}‖"


def _fix_zero_norms(module: AdapterModule, options: RepairOptions) -> str | None:
    """Channels whose W or W+ΔW has a zero norm get the base row back: where W's row is non-zero,
    that row of the update is dropped and m = ‖W‖; where W's row is zero, m = 0 and, if the update
    row is zero too, it gets a unit-norm direction so that no loader computes 0/0. Either way
    W' equals the base row, in every loader (peft, LyCORIS, ComfyUI)."""
    if module.magnitude is None or options.base is None:
        return None
    axis, shape = _layout(module)
    base_weight = _base_weight(module, options)
    magnitude = module.magnitude.flatten().clone()
    base_norm = channel_norms(base_weight, axis)
    adapted_norm = channel_norms(base_weight.float() + module.delta(base_weight.shape), axis)
    zero_norm = zero_norm_channels(magnitude, base_norm, adapted_norm)
    if not zero_norm.any():
        return None
    if module.algorithm != "lora":
        raise _Removed(f"zero-norm channels of a {module.algorithm} module's DoRA have no row-by-row repair")
    part, along = ("up", 0) if axis == "output" else ("down", 1)
    factor = module.tensors[part].clone()
    for channel in zero_norm.nonzero().flatten().tolist():
        if base_norm[channel] >= NORM_FLOOR:
            factor.select(along, channel).zero_()
            magnitude[channel] = base_norm[channel]
            continue
        magnitude[channel] = 0.0
        if adapted_norm[channel] >= NORM_FLOOR:
            continue
        row, length = _unit_direction(module)
        if axis == "input" or length == 0.0:
            raise _Removed("a zero base row whose update is zero too has no safe DoRA form")
        factor[channel].zero_()
        factor[channel].view(-1)[row] = 1.0 / length
    module.tensors[part] = factor
    module.tensors["magnitude"] = magnitude.reshape(shape)
    return f"{int(zero_norm.sum())} zero-norm channel(s) given back their base row"


def _unit_direction(module: AdapterModule) -> tuple[int, float]:
    """The rank index whose down row is longest, and scale·‖that row‖: an up row of 1/that
    picks a unit-norm update direction. 0.0 when none is long enough to stay within fp16."""
    norms = module.down.flatten(1).norm(dim=1)
    row = int(norms.argmax())
    length = abs(module.scale) * float(norms[row])
    return row, length if length * FP16_LIMIT > 2 else 0.0


def _clamp_outliers(module: AdapterModule, options: RepairOptions) -> str | None:
    """With --clamp-outliers: m into [‖W‖/RATIO_LIMIT, RATIO_LIMIT·‖W‖]."""
    if module.magnitude is None or options.base is None or not options.clamp_outliers:
        return None
    axis, shape = _layout(module)
    base_norm = channel_norms(_base_weight(module, options), axis)
    magnitude = module.magnitude.flatten()
    outlying = outliers(magnitude, base_norm)
    if not outlying.any():
        return None
    # A hair inside the limits: m = 10·‖W‖ computed in float can read back as 10.000001·‖W‖.
    inside = 1.0 - 1e-6
    clamped = magnitude.clamp(min=base_norm / (RATIO_LIMIT * inside), max=base_norm * RATIO_LIMIT * inside)
    module.tensors["magnitude"] = magnitude.where(~outlying, clamped).reshape(shape)
    return f"magnitude of {int(outlying.sum())} outlier channel(s) clamped to within {RATIO_LIMIT:g}x of ‖W‖"


def _layout(module: AdapterModule) -> tuple[str, tuple[int, ...]]:
    layout = module.magnitude_layout()
    assert layout is not None, "the magnitude was rebuilt in a valid shape before"
    return layout


def _base_weight(module: AdapterModule, options: RepairOptions) -> torch.Tensor:
    assert options.base is not None
    weight = options.base.weight(module)
    assert weight is not None, "unusable modules were removed before"
    return weight
