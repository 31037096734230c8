"""What counts as damage in one adapter module: the thresholds, the kinds of finding, and the
tests the report and the repairs share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..adapter_kinds import ALGORITHMS
from ..formats.adapter_files import KOHYA, AdapterFileError, AdapterModule, canonical_key, channel_norms

if TYPE_CHECKING:
    import torch

    from .base_weights import BaseWeights

# Below float16's smallest normal number (2^-14 ≈ 6.1e-5) a norm or magnitude is zero or underflows
# once the model runs in fp16, and m/‖V‖ becomes 0/0 or overflows.
NORM_FLOOR = 2.0**-14
FP16_MAX = 65504.0
# Within a factor 16 of float16's largest value: one more multiply-add in fp16 gives Inf. Trained
# SDXL weights and updates stay below ~10, so values this large are damage in any dtype.
FP16_LIMIT = FP16_MAX / 16
# Training moves a DoRA magnitude by percents of the base row norm, never by this factor.
RATIO_LIMIT = 10.0

# Finding kinds.
NON_FINITE = "non-finite factors"
MAGNITUDE_NON_FINITE = "non-finite magnitude"
ZERO_MAGNITUDE = "zero magnitude"
ZERO_NORM = "zero-norm row"
OUTLIER = "magnitude outlier"
FP16_OVERFLOW = "fp16 overflow"
SHAPE = "dora_scale shape"
NAMES = "leftover names"
UNUSABLE = "unusable module"
# Damage an earlier checkpoint's copy of the module can replace (shape and names are rewritten,
# a zero-norm row is the base model's).
RESTORABLE = {NON_FINITE, MAGNITUDE_NON_FINITE, ZERO_MAGNITUDE, OUTLIER, FP16_OVERFLOW, UNUSABLE}


@dataclass
class Finding:
    """One problem of a module: its kind (one of the kinds above) and what exactly, in words."""

    kind: str
    detail: str


def check_module(module: AdapterModule, base: BaseWeights | None) -> list[Finding]:
    """Everything wrong with one module; the base model enables the norm and ratio checks."""
    problem = _unusable(module, base)
    if problem:
        return [Finding(UNUSABLE, problem)]
    findings = []
    renamed = renames(module)
    if renamed:
        findings.append(Finding(NAMES, "; ".join(f"{old} should be {new}" for old, new in renamed.items())))
    counts = {role: non_finite(module.tensors[role]) for role in [*module.factor_roles, "alpha"]
              if role in module.tensors}
    broken = {role: count for role, count in counts.items() if count}
    if broken:
        findings.append(Finding(NON_FINITE, ", ".join(
            f"{role} holds {count} NaN/Inf of {module.tensors[role].numel()}" for role, count in broken.items())))
    else:
        reach = update_reach(module)
        if reach > FP16_LIMIT:
            findings.append(Finding(FP16_OVERFLOW, f"factors or update reach {reach:.3g}, near float16's "
                                    f"maximum {FP16_MAX:g} (Inf in fp16 inference)"))
    if module.magnitude is not None:
        base_weight = base.weight(module) if base else None
        findings += _check_magnitude(module, None if broken else base_weight)
    return findings


def _unusable(module: AdapterModule, base: BaseWeights | None) -> str | None:
    """Why no loader can use this module at all, if so."""
    required = ALGORITHMS[module.algorithm].required_roles
    missing = [role for role in required if not any(part in module.tensors for part in role)]
    if missing:
        return f"no {' and no '.join(' or '.join(role) for role in missing)} tensor"
    if module.algorithm == "lora":
        down, up = module.down, module.up
        if down.dim() not in (2, 4) or up.dim() != down.dim() or up.shape[1] != down.shape[0]:
            return f"down {list(down.shape)} and up {list(up.shape)} do not form a LoRA pair"
        update = [module.out_features, *down.shape[1:]]
    else:
        try:
            update = list(module.flat_delta().shape)
        except (RuntimeError, AdapterFileError) as exc:
            return f"its {module.algorithm} factors do not multiply: {exc}"
    if base is None:
        return None
    weight = base.weight(module)
    if weight is None:
        return f"the base model {base.model_id} has no layer {module.name or module.file_name}"
    fits = tuple(weight.shape) == tuple(update) if module.algorithm == "lora" else (
        weight.shape[0] == update[0] and weight[0].numel() == update[1])
    if not fits:
        return f"update {update} does not fit the base weight {list(weight.shape)}"
    return None


def renames(module: AdapterModule) -> dict[str, str]:
    """Keys not spelled as the format wants → their canonical spelling."""
    wanted = {key: canonical_key(module.file_format, module.file_name, role) for role, key in module.keys.items()}
    return {key: new for key, new in wanted.items() if key != new}


def non_finite(tensor: torch.Tensor) -> int:
    """How many values are NaN/Inf; one quick pass when none is (only then is the sum finite)."""
    import torch

    if math.isfinite(float(tensor.sum(dtype=torch.float32))):  # overflow only sends it the slow way
        return 0
    return int((~torch.isfinite(tensor)).sum())


def update_reach(module: AdapterModule) -> float:
    """The largest factor value or the bound s·max‖up_i‖·max‖down_j‖ on any entry of ΔW (LoKr,
    LoHa: the largest entry of ΔW itself, which is one layer's size)."""
    if module.algorithm != "lora":
        largest_factor = max(float(module.tensors[role].float().abs().max()) for role in module.factor_roles)
        return max(largest_factor, float((module.flat_delta() * module.scale).abs().max()))
    down, up = module.down.float().flatten(1), module.up.float().flatten(1)
    bound = abs(module.scale) * float(up.norm(dim=1).max()) * float(down.norm(dim=0).max())
    return max(float(down.abs().max()), float(up.abs().max()), bound)


def _check_magnitude(module: AdapterModule, base_weight: torch.Tensor | None) -> list[Finding]:
    import torch

    layout = module.magnitude_layout()
    stored = module.magnitude
    assert stored is not None
    channels = f"of {stored.numel()} channels"
    if layout is None:
        return [Finding(SHAPE, f"{list(stored.shape)} fits neither the {module.out_features} output "
                        f"nor the {module.in_features} input channels")]
    axis, shape = layout
    findings = []
    if tuple(stored.shape) != shape:
        why = "1-D: ComfyUI rejects it" if stored.dim() == 1 and module.file_format == KOHYA else "wrongly oriented"
        findings.append(Finding(SHAPE, f"{list(stored.shape)} is {why}; the {axis} axis wants {list(shape)}"))
    magnitude = stored.float().flatten()
    bad = ~torch.isfinite(magnitude)
    if bad.any():
        findings.append(Finding(MAGNITUDE_NON_FINITE, f"{int(bad.sum())} {channels} are NaN/Inf"))
    base_norm = channel_norms(base_weight, axis) if base_weight is not None else None
    zero = zero_magnitude(magnitude, base_norm)
    if zero.any():
        findings.append(Finding(ZERO_MAGNITUDE, f"{int(zero.sum())} {channels} are below {NORM_FLOOR:.2g} "
                                "(zero or underflowing: the channel's output is switched off)"))
    huge = magnitude.abs() > FP16_LIMIT
    if huge.any():
        findings.append(Finding(FP16_OVERFLOW, f"{int(huge.sum())} {channels} exceed {FP16_LIMIT:g}, "
                                f"near float16's maximum {FP16_MAX:g}"))
    if base_weight is None:
        return findings
    adapted_norm = channel_norms(base_weight.float() + module.delta(base_weight.shape), axis)
    zero_norm = zero_norm_channels(magnitude, base_norm, adapted_norm)
    if zero_norm.any():
        rows = ", ".join(str(index) for index in zero_norm.nonzero().flatten()[:8].tolist())
        findings.append(Finding(ZERO_NORM, f"{int(zero_norm.sum())} {channels} (e.g. {rows}) have a zero or "
                                "underflowing norm of W or W+ΔW: DoRA divides by it (0/0 = NaN)"))
    outlying = outliers(magnitude, base_norm)
    if outlying.any():
        ratio = magnitude / base_norm
        findings.append(Finding(OUTLIER, f"{int(outlying.sum())} {channels} have m/‖W‖ outside "
                                f"[{1 / RATIO_LIMIT:g}, {RATIO_LIMIT:g}] (from {float(ratio[outlying].min()):.3g} "
                                f"to {float(ratio[outlying].max()):.3g})"))
    return findings


def zero_magnitude(magnitude: torch.Tensor, base_norm: torch.Tensor | None) -> torch.Tensor:
    """Finite magnitudes below the floor, except where the base row is zero too (nothing to scale)."""
    zero = magnitude.abs() < NORM_FLOOR
    return zero if base_norm is None else zero & (base_norm >= NORM_FLOOR)


def zero_norm_channels(magnitude: torch.Tensor, base_norm: torch.Tensor, adapted_norm: torch.Tensor) -> torch.Tensor:
    """Channels where DoRA's division is unsafe: W+ΔW underflows, or the base row is zero and the
    channel is not neutralised (m = 0 over a finite, non-zero W+ΔW)."""
    tiny_adapted = adapted_norm < NORM_FLOOR
    neutral = (magnitude == 0) & ~tiny_adapted
    return tiny_adapted | ((base_norm < NORM_FLOOR) & ~neutral)


def outliers(magnitude: torch.Tensor, base_norm: torch.Tensor) -> torch.Tensor:
    """Usable magnitudes more than RATIO_LIMIT times larger or smaller than the base row's norm."""
    import torch

    valid = torch.isfinite(magnitude) & (magnitude.abs() >= NORM_FLOOR) & (base_norm >= NORM_FLOOR)
    ratio = magnitude / base_norm.clamp_min(NORM_FLOOR)
    return valid & ((ratio > RATIO_LIMIT) | (ratio < 1 / RATIO_LIMIT))
