"""A whole file repaired: the plan (every module's repair, the output's tensor layout), then the
repaired copy streamed to a temporary file, re-read and verified, and only then renamed into place
(never over the original unless asked)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import atomic_path
from ..formats.adapter_files import PEFT, AdapterFile, AdapterModule, merged_weight
from .base_weights import BaseWeights, open_adapter
from .checks import Finding, check_module
from .repairs import Repair, RepairOptions, repair_module

if TYPE_CHECKING:
    import torch

    from ..formats.safetensors_stream import TensorSpec


class VerificationError(RuntimeError):
    """A repaired file failed its check after writing; it was not put in place."""


@dataclass
class FileRepair:
    """The plan for one file: every module's repair, in file order (tensors not kept)."""

    path: Path
    format: str
    repairs: dict[str, Repair]  # file name → repair, damaged modules only
    unchanged: int
    specs: list[TensorSpec]  # the output's tensors, in order
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
    from ..formats.safetensors_stream import DTYPE_NAMES, TensorSpec

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
    from ..formats.safetensors_stream import StreamWriter

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


def verify(path: Path, plan: FileRepair, base: BaseWeights | None) -> None:
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
