"""A quantized frozen base under adapters (`model.base_quantization`, sdxl_trainer/quantized_base.py):
the storage is what it says, the forward computes with exactly the rounded weights, DoRA reads the
weight the forward uses, only adapters train, the exports keep their format, bad combinations are
refused before loading, and a resumed run is bit-exact."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdxl_trainer.adapters import attach_adapter, save_diffusers_adapter, unet_target_modules
from sdxl_trainer.config import AdapterConfig, Config, ConfigError
from sdxl_trainer.formats.kohya_format import save_kohya_adapter
from sdxl_trainer.quantized_base import (
    UpcastLayer,
    check_quantization,
    full_precision_pipeline,
    quantize_int8,
    quantize_module,
)
from tests.helpers import run_cli, tiny_config, train_here, write_config

CPU = torch.device("cpu")
DORA = AdapterConfig(type="dora", rank=4, alpha=4, targets="all")


def tiny_unet(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder, subfolder="unet", torch_dtype=dtype).requires_grad_(False)


def unet_inputs(unet: torch.nn.Module, batch: int = 2) -> dict:
    generator = torch.Generator().manual_seed(0)
    config = unet.config
    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    return {"sample": torch.randn(batch, config.in_channels, 8, 8, generator=generator),
            "timestep": torch.tensor([10, 500]),
            "encoder_hidden_states": torch.randn(batch, 77, config.cross_attention_dim, generator=generator),
            "added_cond_kwargs": {"text_embeds": torch.randn(batch, pooled, generator=generator),
                                  "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * batch)}}


def rounded_reference(unet: torch.nn.Module, form: str) -> torch.nn.Module:
    """A plain copy of `unet` whose Linear/Conv2d weights are rounded as `form` stores them and
    turned back into ordinary weights of the same dtype."""
    reference = copy.deepcopy(unet)
    for layer in reference.modules():
        if type(layer) in (torch.nn.Linear, torch.nn.Conv2d):
            weight = layer.weight.data
            if form == "float8_e4m3fn":
                layer.weight.data = weight.to(torch.float8_e4m3fn).to(weight.dtype)
            else:
                values, scale = quantize_int8(weight)
                layer.weight.data = (values.float() * scale).to(weight.dtype)
    return reference


def test_fp8_storage_is_one_byte_a_weight(tiny_sdxl_dir: Path) -> None:
    unet = tiny_unet(tiny_sdxl_dir, torch.bfloat16)
    layers = {name: layer.weight.numel() for name, layer in unet.named_modules()
              if type(layer) in (torch.nn.Linear, torch.nn.Conv2d)}
    assert quantize_module(unet, "float8_e4m3fn", CPU) == len(layers) > 50
    stored = {name: layer.weight_quantized for name, layer in unet.named_modules() if isinstance(layer, UpcastLayer)}
    assert stored.keys() == layers.keys()
    assert {tensor.dtype for tensor in stored.values()} == {torch.float8_e4m3fn}
    assert sum(t.untyped_storage().nbytes() for t in stored.values()) == sum(layers.values())
    # no full-precision copy is left behind: the weights are buffers, the rest (biases, norms) bf16
    assert all(not name.endswith(".weight") or "norm" in name for name, _ in unet.named_parameters())
    assert unet.dtype == torch.bfloat16
    assert unet.state_dict()["conv_in.weight_quantized"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("form", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_forward_uses_exactly_the_rounded_weights(tiny_sdxl_dir: Path, form: str, autocast: bool) -> None:
    unet = tiny_unet(tiny_sdxl_dir)
    reference = rounded_reference(unet, form)
    quantize_module(unet, form, CPU)
    inputs = unet_inputs(unet)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, expected = unet(**inputs).sample, reference(**inputs).sample
        unrounded = tiny_unet(tiny_sdxl_dir)(**inputs).sample
    assert torch.equal(got, expected)
    assert not torch.equal(got, unrounded)  # the rounding is real: the full-precision base differs


def test_int8_rounding_is_to_nearest_per_output_channel() -> None:
    weight = torch.tensor([[0.5, -1.0, 0.25], [2.0, 1.0, -0.01]])
    values, scale = quantize_int8(weight)
    assert torch.equal(scale.flatten(), torch.tensor([1.0, 2.0]) / 127)
    assert values.tolist() == [[64, -127, 32], [127, 64, -1]]  # 63.5 rounds half to even: 64


def test_the_gradient_through_a_quantized_layer_is_that_of_the_rounded_layer() -> None:
    torch.manual_seed(0)
    for layer, x in ((torch.nn.Linear(24, 16), torch.randn(5, 24)),
                     (torch.nn.Conv2d(6, 8, 3, padding=1, stride=2), torch.randn(2, 6, 9, 9))):
        reference = copy.deepcopy(layer).requires_grad_(False)
        reference.weight.data = reference.weight.data.to(torch.float8_e4m3fn).float()
        holder = torch.nn.ModuleDict({"layer": layer.requires_grad_(False)})
        quantize_module(holder, "float8_e4m3fn", CPU)
        inputs = [x.clone().requires_grad_(True) for _ in range(2)]
        for module, tensor in ((holder["layer"], inputs[0]), (reference, inputs[1])):
            module(tensor).square().sum().backward()
        torch.testing.assert_close(inputs[0].grad, inputs[1].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["float8_e4m3fn", "int8"])
def test_dora_reads_the_dequantized_weight_on_the_fast_path(tiny_sdxl_dir: Path, form: str) -> None:
    """The magnitude starts as the norm of the dequantized weight, the fast DoRA forward is the one
    peft computes over a plain layer holding that weight, and only adapter tensors train."""
    unet = tiny_unet(tiny_sdxl_dir)
    reference = rounded_reference(unet, form)
    quantize_module(unet, form, CPU)
    names = unet_target_modules(unet, "all")
    torch.manual_seed(1)
    attach_adapter(unet, DORA, names)
    torch.manual_seed(1)
    attach_adapter(reference, DORA, names)
    layer = unet.get_submodule("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    assert type(layer.lora_variant["default"]).__name__ == "FastDoraLinearVariant"
    dequantized = layer.base_layer.dequantize(torch.float32)
    magnitude = layer.lora_magnitude_vector["default"].weight
    assert torch.equal(magnitude, torch.linalg.vector_norm(dequantized, dim=1))
    for module in (unet, reference):  # the same non-zero up matrices in both
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.data = torch.full_like(param, 0.01)
    inputs = unet_inputs(unet)
    with torch.no_grad():
        torch.testing.assert_close(unet(**inputs).sample, reference(**inputs).sample, rtol=1e-4, atol=1e-5)
    trained = {name for name, param in unet.named_parameters() if param.requires_grad}
    assert trained and all(".lora_" in name for name in trained)


def test_training_changes_only_the_adapter_and_leaves_the_base_bit_identical(tiny_sdxl_dir: Path) -> None:
    unet = tiny_unet(tiny_sdxl_dir)
    quantize_module(unet, "float8_e4m3fn", CPU)
    attach_adapter(unet, DORA, unet_target_modules(unet, "all"))
    frozen = {name: tensor.clone() for name, tensor in unet.state_dict().items() if ".lora_" not in name}
    adapter = {name: param.detach().clone() for name, param in unet.named_parameters() if param.requires_grad}
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            unet(**unet_inputs(unet)).sample.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    after = unet.state_dict()
    assert all(torch.equal(after[name].view(torch.uint8) if after[name].dtype == torch.float8_e4m3fn
                           else after[name], frozen[name].view(torch.uint8)
                           if frozen[name].dtype == torch.float8_e4m3fn else frozen[name]) for name in frozen)
    changed = [name for name, param in unet.named_parameters() if param.requires_grad
               and not torch.equal(param, adapter[name])]
    assert len(changed) > len(adapter) // 2


def test_nf4_layers_are_bitsandbytes_and_dora_reads_their_dequantized_weight(tiny_sdxl_dir: Path) -> None:
    import bitsandbytes as bnb

    unet = tiny_unet(tiny_sdxl_dir)
    quantize_module(unet, "nf4", CPU)
    linear = unet.get_submodule("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    assert isinstance(linear, bnb.nn.Linear4bit) and linear.weight.dtype == torch.uint8
    assert linear.weight.numel() == linear.in_features * linear.out_features // 2  # half a byte a weight
    assert type(unet.conv_in) is torch.nn.Conv2d  # no 4-bit convolution
    attach_adapter(unet, DORA, unet_target_modules(unet, "attn"))
    layer = unet.get_submodule("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    dequantized = bnb.functional.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state)
    assert torch.equal(layer.lora_magnitude_vector["default"].weight, torch.linalg.vector_norm(dequantized, dim=1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unet(**unet_inputs(unet)).sample.float().mean().backward()
    assert layer.lora_A["default"].weight.grad is not None


@pytest.mark.parametrize("form", ["float8_e4m3fn", "nf4"])
def test_adapter_exports_have_the_same_format_as_over_a_full_precision_base(tiny_sdxl_dir: Path, tmp_path: Path,
                                                                           form: str) -> None:
    files = {}
    for name, quantized in (("plain", None), ("quantized", form)):
        unet = tiny_unet(tiny_sdxl_dir)
        if quantized:
            quantize_module(unet, quantized, CPU)
        attach_adapter(unet, DORA, unet_target_modules(unet, "attn-mlp"))
        folder = tmp_path / name
        diffusers_file = save_diffusers_adapter(folder, {"unet": unet})
        kohya_file = save_kohya_adapter(folder / "kohya.safetensors", {"unet": unet}, {})
        files[name] = [{key: (tensor.shape, tensor.dtype) for key, tensor in load_file(path).items()}
                       for path in (diffusers_file, kohya_file)]
    assert files["plain"] == files["quantized"] and len(files["plain"][1]) > 50


def test_the_merged_file_merges_into_the_full_precision_base(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    from sdxl_trainer.models import load_pipeline

    config = Config.model_validate(tiny_config(tmp_path, model={"base_quantization": "float8_e4m3fn"}))
    pipe = load_pipeline(config.model)
    conv = "down_blocks.0.resnets.0.conv1"
    original = pipe.unet.get_submodule(conv).weight.detach().clone()
    quantize_module(pipe.unet, "float8_e4m3fn", CPU)
    attach_adapter(pipe.unet, DORA, unet_target_modules(pipe.unet, "all"))
    pipe.unet.get_submodule(conv).lora_B["default"].weight.data.fill_(0.5)
    base, trained = full_precision_pipeline(config, pipe, {"unet": pipe.unet})
    fresh = trained["unet"].get_submodule(conv)
    assert torch.equal(fresh.base_layer.weight, original) and fresh.base_layer.weight.dtype == torch.float32
    assert not torch.equal(original.to(torch.float8_e4m3fn).float(), original)
    assert torch.equal(fresh.lora_B["default"].weight, torch.full_like(fresh.lora_B["default"].weight, 0.5))
    assert base.scheduler is pipe.scheduler


def refusal(tmp_path: Path, device: str = "cpu", **model) -> str:
    config = Config.model_validate(tiny_config(tmp_path, model=model))
    with pytest.raises(ConfigError) as error:
        check_quantization(config, device)
    return str(error.value)


def test_what_cannot_hold_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = Config.model_validate(tiny_config(tmp_path, model={"base_quantization": "int8"},
                                             adapter={"type": "none"}))
    with pytest.raises(ConfigError, match=r'adapter.type is "none" \(a full fine-tune of unet'):
        check_quantization(full, "cuda")
    assert "MPS has no float8" in refusal(tmp_path, "mps", base_quantization="float8_e4m3fn")
    assert "not on mps" in refusal(tmp_path, "mps", base_quantization="nf4")
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # as if it were not installed
    assert "needs bitsandbytes" in refusal(tmp_path, "cuda", base_quantization="nf4")
    check_quantization(Config.model_validate(tiny_config(tmp_path, model={"base_quantization": "int8"})), "mps")
    check_quantization(Config.model_validate(tiny_config(tmp_path)), "mps")  # "none" runs anywhere


def test_a_full_fine_tune_of_a_quantized_base_is_one_line_before_loading(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, adapter={"type": "none"}, model={"base_quantization": "float8_e4m3fn"})
    result = run_cli("train_sdxl.py", "--config", str(write_config(tmp_path / "config.json", config)))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "model.base_quantization" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_resume_over_an_fp8_base_is_bit_exact(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    def config(folder: str, **training) -> Path:
        model = {"base_quantization": "float8_e4m3fn", "train_text_encoder_1": False}
        values = tiny_config(tmp_path / folder, model=model,
                             training={"num_steps": 4, "checkpoint_every": 2, "mixed_precision": "bf16", **training})
        return write_config(tmp_path / f"{folder}.json", values)

    assert train_here("--config", str(config("straight"))).returncode == 0
    checkpoint = tmp_path / "straight" / "out" / "test_run" / "checkpoints" / "checkpoint-2"
    result = train_here("--config", str(config("resumed", resume_from=str(checkpoint))))
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = (load_file(tmp_path / name / "out" / "test_run" / "pytorch_lora_weights.safetensors")
                     for name in ("straight", "resumed"))
    assert first.keys() == second.keys() and len(first) > 10
    assert [key for key in first if not torch.equal(first[key], second[key])] == []
