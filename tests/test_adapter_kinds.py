"""The table of adapter kinds (sdxl_trainer/adapter_kinds.py): it covers every `adapter.type` the
config schema accepts, and each entry's facts are what peft builds, the files hold and the readers
and the doctor find."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch

from sdxl_trainer.adapter_kinds import ADAPTER_KINDS, FULL_FINE_TUNE, kind_of_module, kind_of_peft_config
from sdxl_trainer.adapters import attach_adapter, save_diffusers_adapter, text_encoder_target_modules
from sdxl_trainer.config import AdapterConfig
from sdxl_trainer.doctor.checks import check_module
from sdxl_trainer.formats.adapter_files import AdapterFile, split_key
from sdxl_trainer.formats.kohya_format import save_kohya_adapter
from tests.helpers import ROOT


def test_the_table_covers_every_adapter_type_the_schema_accepts() -> None:
    schema = json.loads((ROOT / "config.schema.json").read_text(encoding="utf-8"))
    accepted = schema["$defs"]["AdapterConfig"]["properties"]["type"]["enum"]
    assert set(accepted) == {*ADAPTER_KINDS, FULL_FINE_TUNE}
    assert set(typing.get_args(AdapterConfig.model_fields["type"].annotation)) == set(accepted)
    for name, kind in ADAPTER_KINDS.items():
        assert kind.name == name
        assert set(kind.own_options) <= set(AdapterConfig.model_fields)
        assert AdapterConfig(type=name).type == name


@pytest.mark.parametrize("name", list(ADAPTER_KINDS))
def test_each_kinds_facts_are_what_peft_builds_and_the_files_hold(name: str, tmp_path: Path) -> None:
    """A real peft adapter of the kind on a small CLIP text encoder, written in both formats and
    read back: the kind is recognised from peft's config and from the file, the file name and
    the kohya `algo` are the table's, every tensor has one of the kind's roles, and the doctor
    finds every factor the kind requires."""
    from transformers import CLIPTextConfig, CLIPTextModel

    kind = ADAPTER_KINDS[name]
    encoder = CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, vocab_size=100, projection_dim=32))
    adapter = AdapterConfig(type=name, rank=2, alpha=4)
    attach_adapter(encoder, adapter, text_encoder_target_modules(encoder, "attn-mlp"))
    with torch.no_grad():  # every factor non-zero, so that none reads as missing or empty
        for parameter in encoder.parameters():
            if parameter.requires_grad:
                parameter.add_(0.01)
    assert kind_of_peft_config(encoder.peft_config["default"]) is kind

    assert save_diffusers_adapter(tmp_path, {"text_encoder": encoder}).name == kind.weight_file
    kohya = save_kohya_adapter(tmp_path / "k_kohya.safetensors", {"text_encoder": encoder}, {})
    for path in (tmp_path / kind.weight_file, kohya):
        with AdapterFile(path) as file:
            modules = list(file.modules())
            network_args = json.loads(file.metadata.get("ss_network_args", "{}"))
        assert len(modules) == 6  # q, k, v, out, fc1, fc2
        for module in modules:
            assert module.algorithm == kind.algorithm
            assert kind_of_module(module.algorithm, module.magnitude is not None) is kind
            assert set(module.factor_roles) <= set(kind.file_roles)
            assert check_module(module, None) == []
        if path == kohya:
            assert network_args.get("algo") == (None if kind.name == "lora" else kind.algorithm)
    with AdapterFile(kohya) as file:
        roles = {split_key(key)[1] for key in file.reader.keys}
    assert roles - {"alpha", "magnitude"} <= set(kind.file_roles)
    assert ("magnitude" in roles) == kind.magnitude
