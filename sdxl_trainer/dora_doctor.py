"""Find and repair damaged LoRA/DoRA adapter weights: the logic of debug_dora_weights.py and
fix_dora_weights.py.

Seed 000: DoRA weights trained in fp16 went NaN/Inf and every image came out black. Files from
elsewhere bring more damage: zero-norm rows (DoRA divides by the row norm: 0/0, peft#2049), a 1-D
`dora_scale` (ComfyUI rejects it), peft key names left in kohya files.

DoRA in one line (FORMATS.md §3.4): W' = m · V/‖V‖ with V = W + ΔW and ΔW = (alpha/r)·up@down,
the norm taken per output row (peft, LyCORIS >= 3.2) or per input column (older LyCORIS); m is
peft's magnitude or kohya's `dora_scale`. LoRA is W' = W + ΔW.

`analyse_file` checks a file module by module. `plan_repairs` decides what to do with every
module, and `write_repaired` writes the repaired copy (never over the original unless asked),
re-reads and verifies it, and only then renames it into place.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .adapter_files import (
    KOHYA,
    PEFT,
    AdapterFile,
    AdapterFileError,
    AdapterModule,
    canonical_key,
    channel_norms,
    find_layer,
    kohya_name_map,
    merged_weight,
)
from .atomic import atomic_path

if TYPE_CHECKING:
    import argparse

    import torch

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

EXIT_CLEAN, EXIT_PROBLEMS, EXIT_UNREADABLE = 0, 1, 2


class DoctorError(Exception):
    """Bad usage or a base model that does not load (exit code 2)."""


class VerificationError(RuntimeError):
    """A repaired file failed its check after writing; it was not put in place."""


# What the scripts report in one line with exit code 2 (the message names the path).
INPUT_ERRORS = (DoctorError, AdapterFileError)


@dataclass
class Finding:
    kind: str
    detail: str


@dataclass
class TensorStats:
    """NaN/Inf counts, then min/max/mean/std of the finite values (None when there are none)."""

    nan: int
    inf: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorStats:
        import torch

        values = tensor.detach().float().flatten()
        nan = inf = 0
        if _non_finite(values):
            finite = torch.isfinite(values)
            nan = int(torch.isnan(values).sum())
            inf = values.numel() - int(finite.sum()) - nan
            values = values[finite]
        if not values.numel():
            return cls(nan, inf, None, None, None, None)
        std, mean = torch.std_mean(values, correction=0)
        low, high = torch.aminmax(values)
        return cls(nan, inf, float(low), float(high), float(mean), float(std))


@dataclass
class ModuleReport:
    label: str
    file_name: str
    component: str
    kind: str  # "DoRA" or "LoRA"
    rank: int | None
    alpha: float | None
    dtypes: list[str]
    shapes: dict[str, list[int]]
    stats: dict[str, TensorStats]
    ratio: tuple[float, float] | None  # min and max of m/‖W‖ (with the base model)
    findings: list[Finding]


@dataclass
class FileReport:
    path: Path
    format: str
    format_reason: str
    base_model: str | None
    modules: list[ModuleReport]
    notes: list[str]

    @property
    def damaged(self) -> list[ModuleReport]:
        return [module for module in self.modules if module.findings]

    def counts(self) -> dict[str, int]:
        """Finding kind → number of modules with it."""
        counts: dict[str, int] = {}
        for module in self.damaged:
            for kind in dict.fromkeys(finding.kind for finding in module.findings):
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def verdict(self) -> str:
        dora = sum(module.kind == "DoRA" for module in self.modules)
        if not self.damaged:
            norms = (f"row norms and m/‖W‖ fine against {self.base_model}" if self.base_model
                     else "row norms not checked (needs --base_model)")
            return (f"clean: {len(self.modules)} modules ({dora} DoRA), every value finite, no zero magnitude, "
                    f"no fp16 overflow, shapes and names as the format wants; {norms}")
        kinds = ", ".join(f"{kind} {count}" for kind, count in self.counts().items())
        return f"PROBLEMS: {len(self.damaged)} of {len(self.modules)} modules damaged ({kinds})"

    def to_json(self) -> dict[str, Any]:
        modules = []
        for module in self.modules:
            entry = {**module.__dict__, "stats": {role: stats.__dict__ for role, stats in module.stats.items()},
                     "findings": [finding.__dict__ for finding in module.findings]}
            modules.append(entry)
        return {"path": str(self.path), "format": self.format, "format_reason": self.format_reason,
                "base_model": self.base_model, "notes": self.notes, "verdict": self.verdict(),
                "damaged_modules": len(self.damaged), "finding_counts": self.counts(), "modules": modules}


class BaseModel:
    """The base model's weights (--base_model), looked up per adapter module."""

    def __init__(self, model_id: str, config_dir: str | None = None) -> None:
        from .config import ConfigError, ModelConfig
        from .models import load_pipeline

        self.model_id = model_id
        try:
            self.pipe = load_pipeline(ModelConfig(id=model_id, config_dir=config_dir))
        except (ConfigError, OSError, ValueError) as error:
            raise DoctorError(f"--base_model {model_id}: cannot load it ({error})") from error
        self._kohya_names: dict[str, tuple[str, str]] | None = None

    def open(self, path: Path) -> AdapterFile:
        """The adapter file, with kohya module names resolved through this model's layers."""
        adapter = AdapterFile(path)
        if adapter.format == KOHYA:
            if self._kohya_names is None:
                self._kohya_names = kohya_name_map(self.pipe)
            adapter.name_map = self._kohya_names
        return adapter

    def weight(self, module: AdapterModule) -> torch.Tensor | None:
        layer = find_layer(self.pipe, module)
        return None if layer is None or not hasattr(layer, "weight") else layer.weight.detach()


def open_adapter(path: Path, base: BaseModel | None) -> AdapterFile:
    return base.open(path) if base else AdapterFile(path)


# --- checks ------------------------------------------------------------------------------------


def check_module(module: AdapterModule, base: BaseModel | None) -> list[Finding]:
    """Everything wrong with one module; the base model enables the norm and ratio checks."""
    problem = _unusable(module, base)
    if problem:
        return [Finding(UNUSABLE, problem)]
    findings = []
    renamed = _renames(module)
    if renamed:
        findings.append(Finding(NAMES, "; ".join(f"{old} should be {new}" for old, new in renamed.items())))
    counts = {role: _non_finite(module.tensors[role]) for role in ("down", "up", "alpha") if role in module.tensors}
    broken = {role: count for role, count in counts.items() if count}
    if broken:
        findings.append(Finding(NON_FINITE, ", ".join(
            f"{role} holds {count} NaN/Inf of {module.tensors[role].numel()}" for role, count in broken.items())))
    else:
        reach = _update_reach(module)
        if reach > FP16_LIMIT:
            findings.append(Finding(FP16_OVERFLOW, f"factors or update reach {reach:.3g}, near float16's "
                                    f"maximum {FP16_MAX:g} (Inf in fp16 inference)"))
    if module.magnitude is not None:
        base_weight = base.weight(module) if base else None
        findings += _check_magnitude(module, None if broken else base_weight)
    return findings


def _unusable(module: AdapterModule, base: BaseModel | None) -> str | None:
    """Why no loader can use this module at all, if so."""
    missing = [role for role in ("down", "up") if role not in module.tensors]
    if missing:
        return f"no {' and no '.join(missing)} tensor"
    down, up = module.down, module.up
    if down.dim() not in (2, 4) or up.dim() != down.dim() or up.shape[1] != down.shape[0]:
        return f"down {list(down.shape)} and up {list(up.shape)} do not form a LoRA pair"
    if base is None:
        return None
    weight = base.weight(module)
    if weight is None:
        return f"the base model {base.model_id} has no layer {module.name or module.file_name}"
    if tuple(weight.shape) != (module.out_features, *down.shape[1:]):
        return f"update {[module.out_features, *down.shape[1:]]} does not fit the base weight {list(weight.shape)}"
    return None


def _renames(module: AdapterModule) -> dict[str, str]:
    """Keys not spelled as the format wants → their canonical spelling."""
    wanted = {key: canonical_key(module.file_format, module.file_name, role) for role, key in module.keys.items()}
    return {key: new for key, new in wanted.items() if key != new}


def _non_finite(tensor: torch.Tensor) -> int:
    """How many values are NaN/Inf; one quick pass when none is (only then is the sum finite)."""
    import torch

    if math.isfinite(float(tensor.sum(dtype=torch.float32))):  # overflow only sends it the slow way
        return 0
    return int((~torch.isfinite(tensor)).sum())


def _update_reach(module: AdapterModule) -> float:
    """The largest factor value or the bound s·max‖up_i‖·max‖down_j‖ on any entry of ΔW."""
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
    zero = _zero_magnitude(magnitude, base_norm)
    if zero.any():
        findings.append(Finding(ZERO_MAGNITUDE, f"{int(zero.sum())} {channels} are below {NORM_FLOOR:.2g} "
                                "(zero or underflowing: the channel's output is switched off)"))
    huge = magnitude.abs() > FP16_LIMIT
    if huge.any():
        findings.append(Finding(FP16_OVERFLOW, f"{int(huge.sum())} {channels} exceed {FP16_LIMIT:g}, "
                                f"near float16's maximum {FP16_MAX:g}"))
    if base_weight is None:
        return findings
    adapted_norm = channel_norms(base_weight.float() + module.delta(), axis)
    zero_norm = _zero_norm_channels(magnitude, base_norm, adapted_norm)
    if zero_norm.any():
        rows = ", ".join(str(index) for index in zero_norm.nonzero().flatten()[:8].tolist())
        findings.append(Finding(ZERO_NORM, f"{int(zero_norm.sum())} {channels} (e.g. {rows}) have a zero or "
                                "underflowing norm of W or W+ΔW: DoRA divides by it (0/0 = NaN)"))
    outliers = _outliers(magnitude, base_norm)
    if outliers.any():
        ratio = magnitude / base_norm
        findings.append(Finding(OUTLIER, f"{int(outliers.sum())} {channels} have m/‖W‖ outside "
                                f"[{1 / RATIO_LIMIT:g}, {RATIO_LIMIT:g}] (from {float(ratio[outliers].min()):.3g} "
                                f"to {float(ratio[outliers].max()):.3g})"))
    return findings


def _zero_magnitude(magnitude: torch.Tensor, base_norm: torch.Tensor | None) -> torch.Tensor:
    """Finite magnitudes below the floor, except where the base row is zero too (nothing to scale)."""
    zero = magnitude.abs() < NORM_FLOOR
    return zero if base_norm is None else zero & (base_norm >= NORM_FLOOR)


def _zero_norm_channels(magnitude: torch.Tensor, base_norm: torch.Tensor, adapted_norm: torch.Tensor) -> torch.Tensor:
    """Channels where DoRA's division is unsafe: W+ΔW underflows, or the base row is zero and the
    channel is not neutralised (m = 0 over a finite, non-zero W+ΔW)."""
    tiny_adapted = adapted_norm < NORM_FLOOR
    neutral = (magnitude == 0) & ~tiny_adapted
    return tiny_adapted | ((base_norm < NORM_FLOOR) & ~neutral)


def _outliers(magnitude: torch.Tensor, base_norm: torch.Tensor) -> torch.Tensor:
    import torch

    valid = torch.isfinite(magnitude) & (magnitude.abs() >= NORM_FLOOR) & (base_norm >= NORM_FLOOR)
    ratio = magnitude / base_norm.clamp_min(NORM_FLOOR)
    return valid & ((ratio > RATIO_LIMIT) | (ratio < 1 / RATIO_LIMIT))


def analyse_module(module: AdapterModule, base: BaseModel | None) -> ModuleReport:
    findings = check_module(module, base)
    usable = not any(finding.kind == UNUSABLE for finding in findings)
    ratio = None
    base_weight = base.weight(module) if base and usable else None
    layout = module.magnitude_layout() if usable else None
    if base_weight is not None and layout is not None:
        norms = channel_norms(base_weight, layout[0])
        values = (module.magnitude.float().flatten() / norms)[norms >= NORM_FLOOR]
        values = values[values.isfinite()]
        if values.numel():
            ratio = (float(values.min()), float(values.max()))
    rank = module.rank if "down" in module.tensors else None
    return ModuleReport(
        label=module.label, file_name=module.file_name, component=module.component,
        kind="DoRA" if module.magnitude is not None else "LoRA", rank=rank,
        alpha=module.alpha if rank and math.isfinite(module.alpha) else None,
        dtypes=sorted({str(tensor.dtype).removeprefix("torch.") for tensor in module.tensors.values()}),
        shapes={role: list(tensor.shape) for role, tensor in module.tensors.items()},
        stats={role: TensorStats.of(tensor) for role, tensor in module.tensors.items() if role != "alpha"},
        ratio=ratio, findings=findings,
    )


def analyse_file(path: Path, base: BaseModel | None) -> FileReport:
    """Read `path` module by module and check every one."""
    with open_adapter(path, base) as adapter:
        modules = [analyse_module(module, base) for module in adapter.modules()]
        notes = _notes(adapter)
    return FileReport(path, adapter.format, adapter.format_reason, base.model_id if base else None, modules, notes)


def _notes(adapter: AdapterFile) -> list[str]:
    notes = []
    if adapter.format == PEFT:
        if "lora_adapter_metadata" in adapter.metadata:
            notes.append("alpha from lora_adapter_metadata")
        else:
            notes.append("no lora_adapter_metadata: alpha = rank, as diffusers assumes")
    if adapter.other_keys:
        shown = ", ".join(adapter.other_keys[:3])
        notes.append(f"{len(adapter.other_keys)} key(s) of no LoRA/DoRA role are not checked and are kept as "
                     f"they are (e.g. {shown})")
    return notes


# --- repairs -----------------------------------------------------------------------------------


@dataclass
class RepairOptions:
    base: BaseModel | None = None
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

    def __init__(self, path: Path, base: BaseModel | None) -> None:
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
    renamed = _renames(module)
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
        shape = (module.out_features, *[1] * (module.down.dim() - 1))
        module.tensors["magnitude"] = channel_norms(_base_weight(module, options), "output").reshape(shape)
        return f"magnitude {list(magnitude.shape)} rebuilt as ‖W‖ on the output axis {list(shape)}"
    if tuple(magnitude.shape) == layout[1]:
        return None
    module.tensors["magnitude"] = magnitude.reshape(layout[1])
    return f"magnitude reshaped from {list(magnitude.shape)} to {list(layout[1])} ({layout[0]} axis)"


def _zero_broken_update(module: AdapterModule, options: RepairOptions) -> str | None:
    """NaN/Inf or fp16-overflowing factors: ΔW := 0, and for DoRA m := ‖W‖, so W' = W exactly."""
    import torch

    factors = [module.tensors[role] for role in ("down", "up", "alpha") if role in module.tensors]
    if all(torch.isfinite(tensor).all() for tensor in factors) and _update_reach(module) <= FP16_LIMIT:
        return None
    if module.magnitude is not None and options.base is None:
        raise _Removed(NEEDS_BASE)
    module.tensors["down"] = torch.zeros_like(module.down)
    module.tensors["up"] = torch.zeros_like(module.up)
    if not math.isfinite(module.alpha):
        module.alpha = float(module.rank)
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
    bad = ~torch.isfinite(magnitude) | _zero_magnitude(magnitude, base_norm) | (magnitude.abs() > FP16_LIMIT)
    if not bad.any():
        return None
    if base_weight is None:
        raise _Removed(NEEDS_BASE)
    adapted = options.magnitude_from == "adapted"
    norms = channel_norms(base_weight.float() + module.delta(), axis) if adapted else base_norm
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
    adapted_norm = channel_norms(base_weight.float() + module.delta(), axis)
    zero_norm = _zero_norm_channels(magnitude, base_norm, adapted_norm)
    if not zero_norm.any():
        return None
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
    outliers = _outliers(magnitude, base_norm)
    if not outliers.any():
        return None
    clamped = magnitude.clamp(min=base_norm / RATIO_LIMIT, max=base_norm * RATIO_LIMIT)
    module.tensors["magnitude"] = magnitude.where(~outliers, clamped).reshape(shape)
    return f"magnitude of {int(outliers.sum())} outlier channel(s) clamped to within {RATIO_LIMIT:g}x of ‖W‖"


def _layout(module: AdapterModule) -> tuple[str, tuple[int, ...]]:
    layout = module.magnitude_layout()
    assert layout is not None, "the magnitude was rebuilt in a valid shape before"
    return layout


def _base_weight(module: AdapterModule, options: RepairOptions) -> torch.Tensor:
    assert options.base is not None
    weight = options.base.weight(module)
    assert weight is not None, "unusable modules were removed before"
    return weight


# --- whole files -------------------------------------------------------------------------------


@dataclass
class FileRepair:
    """The plan for one file: every module's repair, in file order (tensors not kept)."""

    path: Path
    format: str
    repairs: dict[str, Repair]  # file name → repair, damaged modules only
    unchanged: int
    specs: list[Any]  # safetensors_stream.TensorSpec of the output, in order
    metadata: dict[str, str]

    @property
    def changed(self) -> int:
        return sum(bool(repair.actions) for repair in self.repairs.values())

    @property
    def removed(self) -> list[str]:
        return [name for name, repair in self.repairs.items() if repair.module is None]

    @property
    def remaining(self) -> list[tuple[str, Finding]]:
        return [(name, finding) for name, repair in self.repairs.items() for finding in repair.remaining]


def plan_repairs(path: Path, options: RepairOptions) -> FileRepair:
    """Run every repair once, keeping only the actions and the output's tensor layout."""
    from .safetensors_stream import DTYPE_NAMES, TensorSpec

    repairs, specs, unchanged, kept = {}, [], 0, []
    with open_adapter(path, options.base) as adapter:
        for module in adapter.modules():
            repair = repair_module(module, options)
            if repair.actions or repair.remaining:
                repairs[module.file_name] = repair
            else:
                unchanged += 1
            if repair.module is None:
                continue
            specs += [TensorSpec(repair.module.keys[role], DTYPE_NAMES[tensor.dtype], tuple(tensor.shape))
                      for role, tensor in repair.module.tensors.items()]
            repair.module = _without_tensors(repair.module)
            kept.append(repair.module)
        specs += [TensorSpec(key, adapter.reader.dtypes[key], adapter.reader.shapes[key]) for key in adapter.other_keys]
        metadata = adapter.metadata
        removed = any(repair.module is None for repair in repairs.values())
        if removed and adapter.format == PEFT and "lora_adapter_metadata" in metadata:
            metadata = _with_targets(metadata, kept)
        return FileRepair(path, adapter.format, repairs, unchanged, specs, metadata)


def _without_tensors(module: AdapterModule) -> AdapterModule:
    return AdapterModule(module.file_name, module.file_format, module.component, module.name, {}, module.keys,
                         module.alpha)


def _with_targets(metadata: dict[str, str], kept: list[AdapterModule]) -> dict[str, str]:
    """peft metadata whose `target_modules` name exactly the modules left in the file. peft stores
    them as suffixes (`to_q`) that would still match a removed module; diffusers would then give
    it a freshly initialised adapter (the same base weight) and warn about the difference."""
    config = json.loads(metadata["lora_adapter_metadata"])
    for component in {module.component for module in kept}:
        # CLIP-L's peft paths lack `text_model.`; peft also matches a target as a path suffix.
        config[f"{component}.target_modules"] = sorted(
            (module.name or "").removeprefix("text_model.") for module in kept if module.component == component)
    return {**metadata, "lora_adapter_metadata": json.dumps(config)}


def write_repaired(plan: FileRepair, destination: Path, options: RepairOptions, backup: Path | None) -> None:
    """Write the repaired file next to `destination`, verify it, then rename it into place (after
    copying the original to `backup` for --in-place)."""
    from .safetensors_stream import StreamWriter

    with atomic_path(destination) as tmp:
        with open_adapter(plan.path, options.base) as adapter, tmp.open("wb") as handle, \
                StreamWriter(handle, plan.specs, plan.metadata) as writer:
            for tensor in _output_tensors(adapter, plan, options):
                writer.write(tensor)
        verify(tmp, plan, options.base)
        if backup is not None:
            with atomic_path(backup) as copy:
                shutil.copyfile(plan.path, copy)


def _output_tensors(adapter: AdapterFile, plan: FileRepair, options: RepairOptions) -> Iterator[torch.Tensor]:
    for name in adapter.groups:
        module = adapter.module(name)
        if name in plan.repairs:
            repaired = repair_module(module, options).module  # the same result as when planned
            if repaired is None:
                continue
            module = repaired
        yield from module.tensors.values()
    for key in adapter.other_keys:
        yield adapter.reader.get(key)


def verify(path: Path, plan: FileRepair, base: BaseModel | None) -> None:
    """The written file must read back, hold only finite values, have no findings beyond those the
    plan could not repair, and (with the base model) merge into finite weights."""
    import torch

    expected = {(name, finding.kind) for name, finding in plan.remaining}
    with open_adapter(path, base) as adapter:
        for module in adapter.modules():
            for finding in check_module(module, base):
                if (module.file_name, finding.kind) not in expected:
                    raise VerificationError(f"{module.label}: {finding.kind}: {finding.detail}")
            if not all(torch.isfinite(tensor).all() for tensor in module.tensors.values()):
                raise VerificationError(f"{module.label} holds NaN/Inf")
            weight = base.weight(module) if base else None
            if weight is not None and not torch.isfinite(merged_weight(weight, module)).all():
                raise VerificationError(f"{module.label} merges into NaN/Inf")


# --- command lines -----------------------------------------------------------------------------


def make_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser both scripts start from: the first paragraph of `doc` describes the script, the
    rest is the epilog; then the input options they share."""
    import argparse

    description, epilog = doc.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights_path", required=True,
                        help="a checkpoint or output folder of this trainer, pytorch_lora_weights.safetensors "
                        "or a kohya/LyCORIS .safetensors file")
    parser.add_argument("--base_model", default=None,
                        help="the base model (same sources as model.id: hub id, diffusers folder, single file, "
                        "builtin:tiny-sdxl); enables the checks and repairs that need the base weights")
    parser.add_argument("--base_config_dir", default=None,
                        help="config folder for a single-file --base_model (as model.config_dir)")
    return parser


def run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a script's command: bad input is one line on stderr (naming the path) and exit code 2."""
    try:
        return command(args)
    except INPUT_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNREADABLE
    except KeyboardInterrupt:
        print("interrupted; no file was changed", file=sys.stderr)
        return 130


def load_base(args: argparse.Namespace) -> BaseModel | None:
    if not args.base_model:
        return None
    print(f"loading base model {args.base_model} …")
    return BaseModel(args.base_model, args.base_config_dir)
