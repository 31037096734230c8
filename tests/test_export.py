"""Exports judged by the loaders that read them: diffusers (`load_lora_weights`, `fuse_lora`,
`from_single_file`) and LyCORIS's own DoRA module.

The reference is always the trained model's merged weights as peft computes them. Adapters are
attached by the trainer's own code (UNet targets "all", so convolutions with conv rank 2 ≠ rank 4,
and both text encoders).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import converttosdxl
from sdxl_trainer.config import ConfigError, validate_config
from sdxl_trainer.export import ExportError, check_export, export_after_training, merged_copy
from sdxl_trainer.formats.kohya_format import adapter_layers, kohya_module_name, merged_weight
from sdxl_trainer.formats.sgm_keys import KeyMapError
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.training_setup import Trainable, prepare_trainable
from tests.helpers import tiny_config, train_here, write_config
from tests.test_converter import SDXL_UNET

COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")
KOHYA_KEY = re.compile(r"^lora_(unet|te1|te2)_[a-z0-9_]+\.(lora_down\.weight|lora_up\.weight|alpha|dora_scale)$")
KOHYA_PARTS = ("lora_down.weight", "lora_up.weight", "alpha", "dora_scale")
ADAPTER = {"rank": 4, "alpha": 8, "targets": "all", "conv_rank": 2, "conv_alpha": 3}
BOTH_TEXT_ENCODERS = {"train_text_encoder_1": True, "train_text_encoder_2": True}


def _config(tmp_path: Path, kind: str, **export):
    return validate_config(tiny_config(
        tmp_path,
        model=BOTH_TEXT_ENCODERS,
        adapter={"type": kind, **ADAPTER},
        training={"lr_text_encoder_2": 1e-3},
        export={"save_single_file": False, "adapter_formats": ["diffusers", "kohya"], **export},
    ))


def _stand_in_for_training(trainable: Trainable) -> None:
    """Seeded random adapter values in place of training. peft starts lora_B at 0 and the DoRA
    magnitude at ‖W‖, where a dropped or mis-scaled factor would go unnoticed; what a format
    has to carry does not depend on how the values came about."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainable.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif "lora_magnitude_vector" in name:
                parameter.mul_(1 + 0.2 * torch.rand(parameter.shape, generator=generator))


def _adapted(tmp_path: Path, kind: str) -> SimpleNamespace:
    """A pipeline with a LoRA or DoRA adapter, its two adapter files and peft's merged weights."""
    config = _config(tmp_path, kind)
    pipe = load_pipeline(config.model)
    trainable = prepare_trainable(pipe, config)
    _stand_in_for_training(trainable)
    diffusers_file, kohya_file = export_after_training(config, pipe, trainable)
    merged = {name: merged_copy(module).state_dict() for name, module in trainable.modules.items()}
    return SimpleNamespace(config=config, pipe=pipe, trainable=trainable, diffusers_file=diffusers_file,
                           kohya_file=kohya_file, merged=merged)


@pytest.fixture(scope="module")
def lora(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    return _adapted(tmp_path_factory.mktemp("lora"), "lora")


@pytest.fixture(scope="module")
def dora(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    return _adapted(tmp_path_factory.mktemp("dora"), "dora")


def _from_pretrained(folder: Path):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(folder)


def _fuse(pipe, adapter_file: Path):
    """`pipe` with `adapter_file` loaded by diffusers and fused at strength 1."""
    pipe.load_lora_weights(str(adapter_file))
    pipe.fuse_lora(lora_scale=1.0)
    pipe.unload_lora_weights()
    return pipe


def _differences(pipe, expected: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Max abs difference per component between the pipeline's weights and `expected`; every
    tensor must be present and none left on the meta device."""
    found = {}
    for name, tensors in expected.items():
        got = getattr(pipe, name).state_dict()
        assert got.keys() == tensors.keys(), name
        assert not [key for key, tensor in got.items() if tensor.is_meta], f"{name}: tensors left on meta"
        found[name] = max((got[key].float() - tensor.float()).abs().max().item() for key, tensor in tensors.items())
    return found


# --- diffusers/peft format ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_peft_file_fuses_in_diffusers_to_the_trained_merged_weights_exactly(
    kind: str, request: pytest.FixtureRequest, tiny_sdxl_dir: Path
) -> None:
    run = request.getfixturevalue(kind)
    pipe = _fuse(_from_pretrained(tiny_sdxl_dir), run.diffusers_file)
    assert _differences(pipe, run.merged) == {"unet": 0.0, "text_encoder": 0.0, "text_encoder_2": 0.0}
    # Not vacuous: every adapted weight differs from its base weight.
    for name, module in run.trainable.modules.items():
        unchanged = [path for path, layer in adapter_layers(module)
                     if torch.equal(run.merged[name][f"{path}.weight"], layer.get_base_layer().weight)]
        assert not unchanged, f"{name}: {unchanged[:3]}"


# --- kohya/LyCORIS format ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("component", "path", "name"),
    [
        ("unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
         "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"),
        ("unet", "down_blocks.2.attentions.1.transformer_blocks.3.attn2.to_out.0",
         "lora_unet_input_blocks_8_1_transformer_blocks_3_attn2_to_out_0"),
        ("unet", "up_blocks.0.attentions.2.proj_in", "lora_unet_output_blocks_2_1_proj_in"),
        ("unet", "mid_block.attentions.0.transformer_blocks.9.ff.net.0.proj",
         "lora_unet_middle_block_1_transformer_blocks_9_ff_net_0_proj"),
        ("unet", "down_blocks.0.resnets.1.conv1", "lora_unet_input_blocks_2_0_in_layers_2"),
        ("unet", "down_blocks.1.resnets.0.conv_shortcut", "lora_unet_input_blocks_4_0_skip_connection"),
        ("unet", "up_blocks.2.resnets.2.time_emb_proj", "lora_unet_output_blocks_8_0_emb_layers_1"),
        ("unet", "mid_block.resnets.1.conv2", "lora_unet_middle_block_2_out_layers_3"),
        ("unet", "down_blocks.0.downsamplers.0.conv", "lora_unet_input_blocks_3_0_op"),
        ("unet", "up_blocks.1.upsamplers.0.conv", "lora_unet_output_blocks_5_2_conv"),
        # transformers >= 5.6 drops `text_model.` from CLIP-L paths; ComfyUI needs it.
        ("text_encoder", "encoder.layers.11.self_attn.q_proj",
         "lora_te1_text_model_encoder_layers_11_self_attn_q_proj"),
        ("text_encoder", "text_model.encoder.layers.0.mlp.fc1", "lora_te1_text_model_encoder_layers_0_mlp_fc1"),
        ("text_encoder_2", "text_model.encoder.layers.31.self_attn.out_proj",
         "lora_te2_text_model_encoder_layers_31_self_attn_out_proj"),
    ],
)
def test_kohya_names_are_full_size_sdxl_sgm_names(component: str, path: str, name: str) -> None:
    assert kohya_module_name(component, path, SDXL_UNET) == name


def test_kohya_names_refuse_what_has_no_sgm_name() -> None:
    with pytest.raises(KeyMapError):
        kohya_module_name("unet", "down_blocks.9.resnets.0.conv1", SDXL_UNET)
    with pytest.raises(ValueError, match="unknown component"):
        kohya_module_name("vae", "encoder.conv_in", SDXL_UNET)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_kohya_file_holds_every_adapted_module_with_kohya_shapes_and_metadata(
    kind: str, request: pytest.FixtureRequest
) -> None:
    run = request.getfixturevalue(kind)
    assert run.kohya_file == run.config.output_dir / "test_run_kohya.safetensors"
    with safe_open(str(run.kohya_file), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        metadata = handle.metadata()
    assert [key for key in tensors if not KOHYA_KEY.fullmatch(key)] == []
    unet_config = run.trainable.modules["unet"].config
    expected_keys = set()
    for component, module in run.trainable.modules.items():
        for path, layer in adapter_layers(module):
            name = kohya_module_name(component, path, unet_config)
            base = layer.get_base_layer().weight
            is_conv = base.dim() == 4
            down, up, alpha = (tensors[f"{name}.{part}"] for part in KOHYA_PARTS[:3])
            rank = 2 if is_conv else 4
            assert down.shape == (rank, *base.shape[1:])
            assert up.shape == ((base.shape[0], rank, 1, 1) if is_conv else (base.shape[0], rank))
            assert torch.equal(down, layer.lora_A["default"].weight) and torch.equal(up, layer.lora_B["default"].weight)
            assert alpha.shape == () and alpha.dtype == torch.float32 and alpha.item() == (3.0 if is_conv else 8.0)
            expected_keys |= {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"}
            if kind == "dora":
                scale = tensors[f"{name}.dora_scale"]
                assert scale.shape == ((base.shape[0], 1, 1, 1) if is_conv else (base.shape[0], 1))  # never 1-D
                assert torch.equal(scale.flatten(), layer.lora_magnitude_vector["default"].weight.flatten())
                expected_keys.add(f"{name}.dora_scale")
    assert tensors.keys() == expected_keys
    assert {key.split("_")[1] for key in tensors} == {"unet", "te1", "te2"}
    assert all(key.startswith(("lora_unet_", "lora_te1_text_model_", "lora_te2_text_model_")) for key in tensors)

    assert all(isinstance(value, str) for value in metadata.values())
    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    assert (metadata["ss_network_dim"], metadata["ss_network_alpha"]) == ("4", "8")
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert metadata["modelspec.title"] == "test_run"
    network_args = json.loads(metadata["ss_network_args"])
    assert (network_args["conv_dim"], network_args["conv_alpha"]) == ("2", "3")
    if kind == "dora":
        assert metadata["ss_network_module"] == "lycoris.kohya"
        assert {key: network_args[key] for key in ("algo", "dora_wd", "wd_on_output")} == {
            "algo": "lora", "dora_wd": "True", "wd_on_output": "True"}
    else:
        assert metadata["ss_network_module"] == "networks.lora"
        assert "dora_wd" not in network_args


def test_kohya_lora_fuses_in_diffusers_to_the_trained_merged_weights_exactly(
    lora: SimpleNamespace, tiny_sdxl_dir: Path
) -> None:
    """diffusers converts the sgm names back itself: a name it cannot place would leave that
    module unmerged and show up here."""
    pipe = _fuse(_from_pretrained(tiny_sdxl_dir), lora.kohya_file)
    assert _differences(pipe, lora.merged) == {"unet": 0.0, "text_encoder": 0.0, "text_encoder_2": 0.0}


def _kohya_modules(run: SimpleNamespace):
    """(kohya name, base layer, the file's tensors for it, peft's merged weight) of every adapted
    module."""
    with safe_open(str(run.kohya_file), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    unet_config = run.trainable.modules["unet"].config
    for component, module in run.trainable.modules.items():
        for path, layer in adapter_layers(module):
            name = kohya_module_name(component, path, unet_config)
            parts = [tensors[f"{name}.{part}"] for part in KOHYA_PARTS]
            yield name, layer.get_base_layer(), parts, run.merged[component][f"{path}.weight"]


def test_kohya_dora_factors_reproduce_the_trained_merged_weights_exactly(dora: SimpleNamespace) -> None:
    """The output-axis formula of peft and LyCORIS >= 3.2 on the file's tensors, bit for bit."""
    checked = []
    for name, base, (down, up, alpha, dora_scale), expected in _kohya_modules(dora):
        assert torch.equal(merged_weight(base.weight.detach(), down, up, alpha, dora_scale), expected), name
        checked.append(type(base))
    assert {torch.nn.Linear, torch.nn.Conv2d} <= set(checked)


def test_kohya_dora_merges_in_lycoris_to_the_trained_weights(dora: SimpleNamespace) -> None:
    """LyCORIS's own module is the judge. It adds float32 eps (1.2e-7) to the norm, which peft
    does not, so the result differs by a relative 1e-7 or so: rtol 1e-6, no absolute slack."""
    locon = pytest.importorskip("lycoris.modules.locon")
    for name, base, (down, up, alpha, dora_scale), expected in _kohya_modules(dora):
        with torch.no_grad():  # LyCORIS copies dora_scale into a parameter in place
            module = locon.LoConModule.make_module_from_state_dict(
                name, copy.deepcopy(base), up, down, None, alpha, dora_scale
            )
            assert module.wd_on_out, "LyCORIS should read this file as output-axis DoRA"
            module.apply_to()
            got = module.get_merged_weight()[0]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, msg=name)


def test_merged_weight_refuses_a_dora_scale_off_the_output_axis() -> None:
    weight, down, up = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    for wrong in (torch.ones(6), torch.ones(1, 5)):
        with pytest.raises(ValueError, match="output axis"):
            merged_weight(weight, down, up, 2.0, wrong)


# --- single files ------------------------------------------------------------------------------


def _config_only_copy(pipeline_dir: Path, destination: Path) -> Path:
    """The weight-free pipeline folder that `from_single_file(config=...)` needs offline."""
    shutil.copytree(pipeline_dir, destination, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"))
    return destination


def _from_single_file(path: Path, config_dir: Path):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_single_file(str(path), config=str(config_dir), local_files_only=True)


def _state_dicts(pipe, dtype: torch.dtype = torch.float32) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of every weight of the four models, in `dtype`."""
    return {
        name: {key: value.to(dtype, copy=True) for key, value in getattr(pipe, name).state_dict().items()}
        for name in COMPONENTS
    }


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[key], b[key]) for key in a)


@pytest.fixture(scope="module")
def latent_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One latent cache for the runs below (it is content-addressed, so sharing is safe)."""
    return tmp_path_factory.mktemp("latents")


def _train(tmp_path: Path, latent_cache: Path, **sections) -> Path:
    """Run train_sdxl.py on the tiny model for 2 steps; return the output folder."""
    config = tiny_config(tmp_path, **sections)
    config["training"]["num_steps"] = 2
    config["data"]["latent_cache"]["cache_dir"] = str(latent_cache)
    result = train_here("--config", str(write_config(tmp_path / "config.json", config)))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "out" / "test_run"


@pytest.mark.slow
def test_dora_run_on_a_single_file_base_exports_adapters_and_the_merged_single_file(
    tmp_path: Path, tiny_sdxl_dir: Path, latent_cache: Path
) -> None:
    """Issue #7 items 2-4 end to end: the base is a single file loaded offline with a weight-free
    config folder, and the exported single file is that base with the trained DoRA merged."""
    base_file = converttosdxl.convert(tiny_sdxl_dir, tmp_path / "base.safetensors")
    config_dir = _config_only_copy(tiny_sdxl_dir, tmp_path / "config-only")
    output = _train(
        tmp_path, latent_cache,
        model={"id": str(base_file), "config_dir": str(config_dir)},
        export={"save_single_file": True, "adapter_formats": ["diffusers", "kohya"], "half_precision": False},
    )
    assert (output / "pytorch_lora_weights.safetensors").is_file()
    assert (output / "test_run_kohya.safetensors").is_file()
    assert not [p for p in output.rglob("*") if p.name.startswith(".")], "temporary files left behind"
    # The trained merged weights, by the route proven exact above.
    pipe = _from_single_file(base_file, config_dir)
    base = _state_dicts(pipe)
    expected = _state_dicts(_fuse(pipe, output / "pytorch_lora_weights.safetensors"))
    assert _changed(expected["unet"], base["unet"]) and _changed(expected["text_encoder"], base["text_encoder"])
    checkpoint = tmp_path / "out" / "safetensors" / "test_run.safetensors"
    assert checkpoint.is_file(), "no single file exported"
    single = _from_single_file(checkpoint, config_dir)
    assert _differences(single, expected) == dict.fromkeys(COMPONENTS, 0.0)
    with safe_open(checkpoint, "pt") as reader:  # titled after the run, not the temporary folder
        assert reader.metadata()["modelspec.title"] == "test_run"


@pytest.mark.slow
def test_full_run_exports_its_pipeline_as_a_half_precision_single_file(
    tmp_path: Path, tiny_sdxl_dir: Path, latent_cache: Path
) -> None:
    checkpoint = tmp_path / "elsewhere" / "full.safetensors"
    output = _train(tmp_path, latent_cache, adapter={"type": "none"}, training={"lr_unet": 1e-4}, export={
        "save_single_file": True, "half_precision": True, "checkpoint_path": str(checkpoint),
    })
    # diffusers loads an fp16 file into fp32 modules: the values are the trained ones rounded to fp16.
    assert checkpoint.is_file(), "no single file exported"
    expected = _state_dicts(_from_pretrained(output), torch.float16)
    single = _from_single_file(checkpoint, _config_only_copy(tiny_sdxl_dir, tmp_path / "config-only"))
    assert _differences(single, expected) == dict.fromkeys(COMPONENTS, 0.0)


# --- external converter scripts ----------------------------------------------------------------

RECORDING_CONVERTER = """
import json, sys
from pathlib import Path

args = sys.argv[1:]
model_path = Path(args[args.index("--model_path") + 1])
record = {"argv": args, "model_path_holds": sorted(p.name for p in model_path.iterdir())}
Path(__file__).with_suffix(".json").write_text(json.dumps(record))
if "--fail" in args:
    sys.exit("converter exploded")  # exit code 1, message on stderr
Path(args[args.index("--checkpoint_path") + 1]).write_bytes(b"a single file")
"""


def _recording_converter(tmp_path: Path) -> Path:
    script = tmp_path / "my_converter.py"
    script.write_text(RECORDING_CONVERTER, encoding="utf-8")
    return script


def test_external_converter_gets_the_merged_pipeline_and_the_diffusers_command_line(
    lora: SimpleNamespace, tmp_path: Path
) -> None:
    script = _recording_converter(tmp_path)
    config = _config(tmp_path, "lora", save_single_file=True, converter_script=str(script),
                     adapter_formats=["kohya"], extra_args=["--flag", "value"])
    written = export_after_training(config, lora.pipe, lora.trainable)
    checkpoint = config.checkpoint_path
    assert written == [config.output_dir / "test_run_kohya.safetensors", checkpoint]
    assert checkpoint.read_bytes() == b"a single file"
    record = json.loads(script.with_suffix(".json").read_text())
    model_path = Path(record["argv"][1])
    assert record["argv"] == ["--model_path", str(model_path), "--checkpoint_path", str(checkpoint),
                              "--half", "--use_safetensors", "--flag", "value"]
    assert {"model_index.json", "unet", "vae", "text_encoder", "text_encoder_2"} <= set(record["model_path_holds"])
    # A folder named after the run (converters title the file after it) inside a temporary one.
    assert model_path.name == "test_run" and model_path.parent.parent == config.output_dir
    assert not model_path.parent.exists(), "the merged folder is temporary"


def test_failing_external_converter_is_an_error_naming_it(tmp_path: Path) -> None:
    script = _recording_converter(tmp_path)
    config = validate_config(tiny_config(tmp_path, adapter={"type": "none"}, export={
        "save_single_file": True, "converter_script": str(script), "extra_args": ["--fail"],
        "half_precision": False, "use_safetensors": False,
    }))
    config.output_dir.mkdir(parents=True)
    with pytest.raises(ExportError, match="exit code 1") as error:
        export_after_training(config, None, Trainable({}, {}, "none"))
    assert str(script) in str(error.value) and "converter exploded" in str(error.value)
    record = json.loads(script.with_suffix(".json").read_text())
    assert record["argv"] == ["--model_path", str(config.output_dir), "--checkpoint_path",
                              str(config.checkpoint_path), "--fail"]


def test_adapter_run_without_merging_writes_no_single_file(lora: SimpleNamespace, tmp_path: Path, capsys) -> None:
    config = _config(tmp_path, "lora", save_single_file=True, merge_adapter=False)
    written = export_after_training(config, lora.pipe, lora.trainable)
    assert [path.name for path in written] == ["pytorch_lora_weights.safetensors", "test_run_kohya.safetensors"]
    assert not config.checkpoint_path.exists()
    assert "merge_adapter is false" in capsys.readouterr().out


def test_export_settings_that_cannot_work_are_config_errors(tmp_path: Path) -> None:
    own = validate_config(tiny_config(tmp_path, export={"save_single_file": True, "extra_args": ["--x"]}))
    with pytest.raises(ConfigError, match=r"export\.extra_args"):
        check_export(own)
    missing = validate_config(tiny_config(tmp_path, export={
        "save_single_file": True, "converter_script": str(tmp_path / "nope.py")}))
    with pytest.raises(ConfigError, match="no such file"):
        check_export(missing)
