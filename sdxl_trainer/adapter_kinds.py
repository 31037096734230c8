"""Every adapter kind's facts in one table (`ADAPTER_KINDS`): what peft builds for it, which file
its weights go to, how its modules are stored and checked, and which `adapter.*` options it reads.

The config schema (`adapter.type`), attaching (adapters.py), both file formats (adapters.py,
kohya_format.py, adapter_files.py), resume (checkpointing.py), the precision plan and the doctor
read their per-kind facts from here, so a new kind is one entry plus the code that is genuinely
new: how its layer's tensors go into a kohya file (kohya_format.py) and how a file's module of it
multiplies out (adapter_files.py, `AdapterModule.flat_delta`). Where a tool cannot load a kind
exactly, the check lives beside the tool's code (lycoris_compat.py: which LoKr files LyCORIS
4.1.3 cannot load) and docs/exports.md says so.

This module imports nothing of the package, so that the config schema can build on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
PEFT_WEIGHT_NAME = "peft_adapter_weights.safetensors"


@dataclass(frozen=True)
class AdapterKind:
    """One value of `adapter.type` and everything the trainer needs to know about it."""

    name: str  # the `adapter.type` value
    label: str  # how reports name it
    summary: str  # its words in the schema's description of `adapter.type`
    algorithm: str  # peft's type and LyCORIS's `algo`: files tell modules apart by it (DoRA is LoRA + magnitude)
    magnitude: bool  # each module carries DoRA's magnitude (peft `lora_magnitude_vector`, kohya `dora_scale`)
    peft_config: str  # the peft config class that builds it
    alpha_field: str  # the alpha option of that config, and the attribute of peft's layer holding it
    peft_options: Callable[[Any], dict[str, Any]]  # its own options of that config, from `adapter.*`
    weight_file: str  # the diffusers/peft-format file: diffusers' name where diffusers loads the kind
    file_roles: tuple[str, ...]  # its factors' roles in an adapter file (adapter_files.ROLES), alpha aside
    required_roles: tuple[tuple[str, ...], ...]  # the factors a usable module needs, each one of these roles
    kohya_network_args: Callable[[Any], dict[str, str]]  # `ss_network_args` of the kohya file, from the peft config
    own_options: tuple[str, ...] = ()  # `adapter.*` keys only this kind reads (a resume must keep them)
    input_dropout: bool = False  # takes `adapter.dropout` (LoRA's input dropout)
    b_matrices: bool = False  # has LoRA's B matrices, which LoRA+ (`adapter.loraplus_lr_ratio`) speeds up
    fp16_nan_risk: bool = False  # fp16 compute is the known cause of its NaN weights: the precision plan warns


def _lora_options(dora: bool) -> Callable[[Any], dict[str, Any]]:
    def options(adapter: Any) -> dict[str, Any]:
        return {"lora_dropout": adapter.dropout, "use_dora": dora, "init_lora_weights": True}
    return options


def _lokr_options(adapter: Any) -> dict[str, Any]:
    return {"init_weights": True, "decompose_factor": adapter.lokr_factor,
            "decompose_both": adapter.lokr_decompose_both}


def _lokr_network_args(config: Any) -> dict[str, str]:
    return {"algo": "lokr", "factor": str(config.decompose_factor), "decompose_both": str(config.decompose_both)}


LORA_ROLES = ("down", "up")
LORA_REQUIRED = (("down",), ("up",))
ADAPTER_KINDS: dict[str, AdapterKind] = {kind.name: kind for kind in (
    AdapterKind(
        name="dora", label="DoRA", summary="`dora`", algorithm="lora", magnitude=True,
        peft_config="LoraConfig", alpha_field="lora_alpha", peft_options=_lora_options(dora=True),
        weight_file=DIFFUSERS_WEIGHT_NAME, file_roles=LORA_ROLES, required_roles=LORA_REQUIRED,
        kohya_network_args=lambda config: {"algo": "lora", "dora_wd": "True", "wd_on_output": "True"},
        input_dropout=True, b_matrices=True, fp16_nan_risk=True),
    AdapterKind(
        name="lora", label="LoRA", summary="`lora`", algorithm="lora", magnitude=False,
        peft_config="LoraConfig", alpha_field="lora_alpha", peft_options=_lora_options(dora=False),
        weight_file=DIFFUSERS_WEIGHT_NAME, file_roles=LORA_ROLES, required_roles=LORA_REQUIRED,
        kohya_network_args=lambda config: {}, input_dropout=True, b_matrices=True),
    AdapterKind(
        name="lokr", label="LoKr", summary="LyCORIS's `lokr` (Kronecker product)", algorithm="lokr",
        magnitude=False, peft_config="LoKrConfig", alpha_field="alpha", peft_options=_lokr_options,
        weight_file=PEFT_WEIGHT_NAME,
        file_roles=("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
        required_roles=(("lokr_w1", "lokr_w1_b"), ("lokr_w2", "lokr_w2_b")),
        kohya_network_args=_lokr_network_args, own_options=("lokr_factor", "lokr_decompose_both")),
    AdapterKind(
        name="loha", label="LoHa", summary="`loha` (Hadamard product)", algorithm="loha", magnitude=False,
        peft_config="LoHaConfig", alpha_field="alpha", peft_options=lambda adapter: {"init_weights": True},
        weight_file=PEFT_WEIGHT_NAME,
        file_roles=("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
        required_roles=(("hada_w1_a",), ("hada_w1_b",), ("hada_w2_a",), ("hada_w2_b",)),
        kohya_network_args=lambda config: {"algo": "loha"}),
)}
WEIGHT_FILES = tuple(dict.fromkeys(kind.weight_file for kind in ADAPTER_KINDS.values()))  # diffusers' first
FULL_FINE_TUNE = "none"  # the `adapter.type` that trains the weights themselves: no adapter, no entry
ADAPTER_TYPES = (*ADAPTER_KINDS, FULL_FINE_TUNE)
ALGORITHMS = {kind.algorithm: kind for kind in ADAPTER_KINDS.values() if not kind.magnitude}  # lora, lokr, loha


def kind_of_peft_config(config: Any) -> AdapterKind:
    """The kind a peft config (of an attached adapter) builds."""
    algorithm = config.peft_type.value.lower()
    magnitude = bool(getattr(config, "use_dora", False))
    return next(kind for kind in ADAPTER_KINDS.values() if (kind.algorithm, kind.magnitude) == (algorithm, magnitude))


def kind_of_module(algorithm: str, has_magnitude: bool) -> AdapterKind:
    """The kind of a module read from a file: its algorithm, and for LoRA whether it has a magnitude."""
    wanted = (algorithm, has_magnitude)
    return next((kind for kind in ADAPTER_KINDS.values() if (kind.algorithm, kind.magnitude) == wanted),
                ALGORITHMS[algorithm])


def module_algorithm(roles: Iterable[str]) -> str:
    """The algorithm of a file's module from its tensors' roles: LoRA's (DoRA's) unless a
    LyCORIS algorithm's factor is among them."""
    roles = set(roles)
    return next((name for name, kind in ALGORITHMS.items() if name != "lora" and roles & set(kind.file_roles)), "lora")
