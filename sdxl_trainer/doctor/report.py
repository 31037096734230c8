"""A file's modules analysed one by one into a report: statistics per tensor, the m/‖W‖ ratio and
the findings; what debug_dora_weights.py prints and writes as JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..adapter_kinds import kind_of_module
from ..formats.adapter_files import PEFT, AdapterFile, AdapterModule, channel_norms
from .base_weights import BaseWeights, open_adapter
from .checks import NORM_FLOOR, UNUSABLE, Finding, check_module, non_finite

if TYPE_CHECKING:
    import torch


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
        if non_finite(values):
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


def analyse_module(module: AdapterModule, base: BaseWeights | None) -> ModuleReport:
    """The module's findings, with what the table shows: shapes, dtypes, statistics and m/‖W‖."""
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
    rank = module.rank if usable or "down" in module.tensors else None
    kind = kind_of_module(module.algorithm, module.magnitude is not None).label
    return ModuleReport(
        label=module.label, file_name=module.file_name, component=module.component, kind=kind, rank=rank,
        alpha=module.alpha if rank and math.isfinite(module.alpha) else None,
        dtypes=sorted({str(tensor.dtype).removeprefix("torch.") for tensor in module.tensors.values()}),
        shapes={role: list(tensor.shape) for role, tensor in module.tensors.items()},
        stats={role: TensorStats.of(tensor) for role, tensor in module.tensors.items() if role != "alpha"},
        ratio=ratio, findings=findings,
    )


def analyse_file(path: Path, base: BaseWeights | None) -> FileReport:
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
