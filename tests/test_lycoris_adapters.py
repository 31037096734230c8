"""LoKr and LoHa: trained through peft, exported in LyCORIS's key format, judged by LyCORIS's own
modules (its merge of our file must equal peft's merged weight), named as ComfyUI's SDXL key map
names them, merged exactly into the single file, resumed bit-exactly, and read by the doctor.
(LoKr under DDP with EMA and live eval is in tests/test_multiprocess.py, sharing that module's launch.)"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import debug_dora_weights
import fix_dora_weights
import train_sdxl
from sdxl_trainer.adapter_kinds import PEFT_WEIGHT_NAME
from sdxl_trainer.adapters import load_adapter_weights
from sdxl_trainer.config import validate_config
from sdxl_trainer.formats.kohya_format import adapter_layers, kohya_module_name
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.training_setup import prepare_trainable
from tests.helpers import tiny_config, write_config
from tests.test_export import _config_only_copy, _from_single_file

SETTINGS = {"rank": 4, "alpha": 8, "targets": "all", "conv_rank": 2, "conv_alpha": 3}


def lycoris_config(tmp_path: Path, kind: str, **training) -> dict:
    config = tiny_config(tmp_path, adapter={"type": kind, **SETTINGS},
                         training={"num_steps": 3, "lr_text_encoder_2": 1e-3, **training},
                         export={"save_single_file": True, "merge_adapter": True, "half_precision": False,
                                 "adapter_formats": ["diffusers", "kohya"]})
    config["model"]["train_text_encoder_2"] = True
    return config


@pytest.fixture(scope="module", params=["lokr", "loha"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            tiny_sdxl_dir: Path) -> SimpleNamespace:
    """A 3-step run of each kind on UNet (attention, MLP and convolutions) and both text encoders,
    and its adapters rebuilt in peft from the peft file."""
    kind = request.param
    tmp_path = tmp_path_factory.mktemp(kind)
    config = lycoris_config(tmp_path, kind)
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))]) == 0
    output = tmp_path / "out" / "test_run"
    pipe = load_pipeline(validate_config(config).model)
    trainable = prepare_trainable(pipe, validate_config(config))
    tensors = load_file(output / PEFT_WEIGHT_NAME)
    for name, module in trainable.modules.items():
        load_adapter_weights(module, name, tensors)
    return SimpleNamespace(kind=kind, tmp_path=tmp_path, output=output, trainable=trainable,
                           kohya=load_file(output / "test_run_kohya.safetensors"))


def peft_layers(trained: SimpleNamespace):
    unet_config = trained.trainable.modules["unet"].config
    for component, module in trained.trainable.modules.items():
        for path, layer in adapter_layers(module):
            yield kohya_module_name(component, path, unet_config), layer


@pytest.mark.slow
def test_lycoris_applies_our_file_as_peft_merged_weights(trained: SimpleNamespace) -> None:
    """Each module of our file, loaded by LyCORIS's own LokrModule/LohaModule and run forward,
    gives the output of the layer with peft's merged weight. (The forward, not LyCORIS 4.1.3's
    `get_merged_weight`, behind `merge_to`, which multiplies the scale in twice for LoKr and LoHa
    alike, as checked here; its forward and ComfyUI apply it once.)"""
    lokr, loha = pytest.importorskip("lycoris.modules.lokr"), pytest.importorskip("lycoris.modules.loha")
    checked, changed, full_kron, scaled_twice = set(), 0, 0, 0
    inputs = torch.Generator().manual_seed(0)
    for name, layer in peft_layers(trained):
        base = layer.get_base_layer()
        with torch.no_grad():
            expected = base.weight.float() + layer.get_delta_weight("default").float()
        part = {key.removeprefix(name + "."): value for key, value in trained.kohya.items()
                if key.startswith(name + ".")}
        with torch.no_grad():
            if trained.kind == "lokr":
                full_kron += "lokr_w1" in part and "lokr_w2" in part
                judge = lokr.LokrModule.make_module_from_state_dict(
                    name, copy.deepcopy(base), part.get("lokr_w1"), part.get("lokr_w1_a"), part.get("lokr_w1_b"),
                    part.get("lokr_w2"), part.get("lokr_w2_a"), part.get("lokr_w2_b"), None, None, part["alpha"], None)
            else:
                judge = loha.LohaModule.make_module_from_state_dict(
                    name, copy.deepcopy(base), part["hada_w1_a"], part["hada_w1_b"], part["hada_w2_a"],
                    part["hada_w2_b"], None, None, part["alpha"], None)
            judge.apply_to()  # the copy of the base layer now runs LyCORIS's forward
            x = torch.randn(2, *([base.in_channels, 8, 8] if isinstance(base, torch.nn.Conv2d)
                                 else [base.in_features]), generator=inputs)
            got = judge.org_module[0](x)
            want = base._conv_forward(x, expected, base.bias) if isinstance(base, torch.nn.Conv2d) else \
                torch.nn.functional.linear(x, expected, base.bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda text, name=name: f"{name}: {text}")
        changed += not torch.equal(expected, base.weight.float())
        with torch.no_grad():  # LyCORIS's merge: base + scale · (peft's delta, already scaled once)
            merged = judge.get_merged_weight(shape=base.weight.shape)[0]
        torch.testing.assert_close(merged - base.weight, judge.scale * (expected - base.weight), rtol=1e-5, atol=1e-6)
        scaled_twice += judge.scale != 1 and not torch.equal(expected, base.weight.float())
        checked.add((name.split("_")[1], type(base)))
    assert {("unet", torch.nn.Linear), ("unet", torch.nn.Conv2d), ("te1", torch.nn.Linear),
            ("te2", torch.nn.Linear)} <= checked
    assert changed > len(list(peft_layers(trained))) // 2  # trained: most updates moved off zero
    assert scaled_twice > len(list(peft_layers(trained))) // 4  # the double scale is visible (scale 1.5 or 2)
    if trained.kind == "lokr":  # both ways of storing the scale are covered
        assert 0 < full_kron < len(list(peft_layers(trained)))


@pytest.mark.slow
def test_key_names_are_the_ones_comfyuis_sdxl_key_map_gives(trained: SimpleNamespace) -> None:
    """ComfyUI (comfy/lora.py `model_lora_keys_unet/clip`) maps `lora_unet_<sgm path with _>`,
    `lora_te1_text_model_…` (CLIP-L) and `lora_te2_text_model_…` (bigG); per module it reads
    `lokr_w1`|`lokr_w1_a`+`lokr_w1_b`, `lokr_w2`|`lokr_w2_a`+`lokr_w2_b` or the four `hada_*`,
    and `alpha`."""
    modules = {key.rsplit(".", 1)[0] for key in trained.kohya}
    for pinned in ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                   "lora_unet_input_blocks_7_1_transformer_blocks_1_ff_net_2",
                   "lora_unet_input_blocks_1_0_in_layers_2", "lora_unet_input_blocks_1_0_emb_layers_1",
                   "lora_unet_input_blocks_3_0_op", "lora_unet_middle_block_1_proj_in",
                   "lora_unet_output_blocks_0_0_skip_connection", "lora_unet_output_blocks_2_2_conv",
                   "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
                   "lora_te1_text_model_encoder_layers_1_mlp_fc2",
                   "lora_te2_text_model_encoder_layers_0_self_attn_out_proj"):
        assert pinned in modules, pinned
    parts = {key.rsplit(".", 1)[1] for key in trained.kohya}
    if trained.kind == "loha":
        assert parts == {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}
    else:
        assert parts <= {"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"}
    assert len(modules) == len(list(peft_layers(trained)))


@pytest.mark.slow
def test_the_merged_single_file_is_the_base_plus_pefts_deltas(trained: SimpleNamespace, tiny_sdxl_dir: Path) -> None:
    config_dir = _config_only_copy(tiny_sdxl_dir, trained.tmp_path / "config-only")
    single = _from_single_file(trained.tmp_path / "out" / "safetensors" / "test_run.safetensors", config_dir)
    compared = 0
    for component, module in trained.trainable.modules.items():
        weights = getattr(single, component).state_dict()
        for path, layer in adapter_layers(module):
            with torch.no_grad():
                expected = layer.get_base_layer().weight.float() + layer.get_delta_weight("default").float()
            key = f"{path}.weight" if component == "unet" or f"{path}.weight" in weights else \
                f"{path.removeprefix('text_model.')}.weight"
            assert torch.equal(weights[key].float(), expected), f"{component}.{path}"
            compared += 1
    assert compared == len(list(peft_layers(trained)))


@pytest.mark.slow
def test_lycoris_kohya_loader_finds_no_clip_l_module_under_current_transformers(trained: SimpleNamespace) -> None:
    """LyCORIS's kohya loader (`create_network_from_weights`, as kohya's scripts call it) looks the
    file's names up in the text encoders' module paths. transformers >= 5.6 (the pinned 5.23) has no
    `text_model.` level in CLIP-L, so no `lora_te1_text_model_…` module is found, silently; bigG
    keeps the level and loads completely. Renaming the keys to `lora_te1_…` finds them all."""
    kohya = pytest.importorskip("lycoris.kohya")
    pipe = load_pipeline(validate_config(lycoris_config(trained.tmp_path, trained.kind)).model)
    assert not any(name.startswith("text_model") for name, _ in pipe.text_encoder.named_modules())

    def loaded(weights: dict[str, torch.Tensor]) -> dict[str, int]:
        with torch.no_grad():  # the UNet goes by kohya's own sgm-named model: left out here
            encoders = [pipe.text_encoder, pipe.text_encoder_2]
            network, _ = kohya.create_network_from_weights(1.0, None, pipe.vae, encoders, torch.nn.Module(),
                                                           weights_sd=dict(weights))
        names = [module.lora_name for module in network.text_encoder_loras]
        return {prefix: sum(name.startswith(prefix) for name in names) for prefix in ("lora_te1_", "lora_te2_")}

    in_file = {prefix: len({key.split(".")[0] for key in trained.kohya if key.startswith(prefix)})
               for prefix in ("lora_te1_", "lora_te2_")}
    assert in_file["lora_te1_"] > 0 and in_file["lora_te2_"] > 0
    assert loaded(trained.kohya) == {"lora_te1_": 0, "lora_te2_": in_file["lora_te2_"]}
    renamed = {key.replace("lora_te1_text_model_", "lora_te1_", 1): value for key, value in trained.kohya.items()}
    assert loaded(renamed) == in_file


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "precision"), [("lokr", "no"), ("lokr", "bf16"), ("loha", "fp16")])
def test_a_lycoris_run_resumes_bit_exactly(tmp_path: Path, tiny_sdxl_dir: Path, kind: str, precision: str) -> None:
    """Also under mixed precision, where the resumed fp32 adapter must pass the precision audit
    (LoKr/LoHa tensors were once audited as frozen bf16/fp16 weights) and the grad scaler resumes."""
    straight = lycoris_config(tmp_path / "straight", kind, num_steps=6, checkpoint_every=3, mixed_precision=precision)
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "s.json", straight))]) == 0
    first = lycoris_config(tmp_path / "split", kind, num_steps=3, checkpoint_every=3, mixed_precision=precision)
    path = write_config(tmp_path / "p.json", first)
    assert train_sdxl.main(["--config", str(path)]) == 0
    output = tmp_path / "split" / "out" / "test_run"
    assert train_sdxl.main(["--config", str(path), "--set", "training.num_steps=6",
                            "--set", f"training.resume_from={output}"]) == 0
    expected = load_file(tmp_path / "straight" / "out" / "test_run" / PEFT_WEIGHT_NAME)
    got = load_file(output / PEFT_WEIGHT_NAME)
    assert expected.keys() == got.keys() and all(torch.equal(expected[key], got[key]) for key in expected)


@pytest.mark.slow
def test_the_doctor_reads_checks_and_repairs_lycoris_files(trained: SimpleNamespace, tmp_path: Path) -> None:
    path = trained.output / "test_run_kohya.safetensors"
    report = tmp_path / "report.json"
    assert debug_dora_weights.main(["--weights_path", str(path), "--json", str(report)]) == 0
    modules = json.loads(report.read_text())["files"][0]["modules"]
    assert {module["kind"] for module in modules} == {"LoKr" if trained.kind == "lokr" else "LoHa"}
    assert not any(module["findings"] for module in modules)
    broken = dict(trained.kohya)
    victim = next(key for key in broken if key.endswith((".lokr_w2", ".lokr_w2_b", ".hada_w2_b")))
    broken[victim] = broken[victim].clone()
    broken[victim].view(-1)[0] = float("nan")
    save_file(broken, tmp_path / "broken.safetensors")
    assert debug_dora_weights.main(["--weights_path", str(tmp_path / "broken.safetensors"),
                                    "--json", str(report)]) == 1
    damaged = [module for module in json.loads(report.read_text())["files"][0]["modules"] if module["findings"]]
    assert [module["file_name"] for module in damaged] == [victim.rsplit(".", 1)[0]]
    assert fix_dora_weights.main(["--weights_path", str(tmp_path / "broken.safetensors"),
                                  "--output", str(tmp_path / "fixed.safetensors")]) == 0
    fixed = load_file(tmp_path / "fixed.safetensors")
    module = victim.rsplit(".", 1)[0]
    assert all(not fixed[key].any() for key in fixed if key.startswith(module + ".") and not key.endswith("alpha"))
    assert all(torch.equal(fixed[key], trained.kohya[key]) for key in fixed if not key.startswith(module + "."))


# ------------------------------------------------------------- LyCORIS's LoKr loader, full size
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")


def full_size_shapes() -> list[tuple[int, ...]]:
    """The weight shapes of every module full-size SDXL gets a LoKr on (targets `all`, both text
    encoders), built on the meta device."""
    from bench.sdxl_arch import sdxl_modules
    from sdxl_trainer.adapters import text_encoder_target_modules, unet_target_modules

    shapes = set()
    for component, module in sdxl_modules("meta").items():
        if component != "vae":
            names = (unet_target_modules(module, "all") if component == "unet"
                     else text_encoder_target_modules(module, "all"))
            shapes |= {tuple(module.get_submodule(name).weight.shape) for name in names}
    return sorted(shapes)


def lycoris_loads(layer) -> bool:
    """Whether LyCORIS's loader (get_module + make_module, as its kohya loader calls them) rebuilds
    this peft LoKr layer's kohya tensors into factors of the same shapes."""
    from lycoris.modules import get_module, make_module

    from sdxl_trainer.formats.kohya_format import _lokr_tensors

    state = {key: torch.zeros(tensor.shape) for key, tensor in _lokr_tensors("m", layer).items()}
    try:
        kind, params = get_module(state, "m")
        rebuilt = make_module(kind, params, "m", layer.get_base_layer())
    except (RuntimeError, AttributeError):  # a copy into a factor of another shape, or a missing factor
        return False
    held = {part: tuple(getattr(rebuilt, part).shape) for part in LOKR_PARTS
            if isinstance(getattr(rebuilt, part, None), torch.nn.Parameter)}
    return held == {part: tuple(state[f"m.{part}"].shape) for part in LOKR_PARTS if f"m.{part}" in state}


def test_the_lokr_load_check_predicts_lycoris_on_every_full_size_sdxl_layer() -> None:
    """peft's LoKr factors of each full-size SDXL layer shape go through LyCORIS's own loader; the
    shape-only check (lycoris_compat) predicts peft's factors and LyCORIS's verdict exactly. At
    the default factor -1 one shape fails, up_blocks.1.resnets.0.conv1's 640 x 1920 x 3 x 3, below
    rank 24; factors 4, 8 and 16 load everywhere; 32 (above the square root of 320, 640 and 768)
    fails widely."""
    pytest.importorskip("lycoris")
    from peft import inject_adapter_in_model

    from sdxl_trainer.adapters import peft_config
    from sdxl_trainer.config import AdapterConfig
    from sdxl_trainer.formats.lycoris_compat import lycoris_rebuilt_parts, peft_lokr_parts

    shapes = full_size_shapes()
    assert len(shapes) == 35 and (640, 1920, 3, 3) in shapes
    failing = {}
    for factor, rank, both in itertools.product((-1, 4, 8, 16, 32), (4, 16, 64), (False, True)):
        adapter = AdapterConfig(type="lokr", rank=rank, alpha=rank, lokr_factor=factor, lokr_decompose_both=both)
        holder = torch.nn.ModuleDict({f"m{i}": torch.nn.Linear(shape[1], shape[0], device="meta") if len(shape) == 2
                                      else torch.nn.Conv2d(shape[1], shape[0], shape[2:], device="meta")
                                      for i, shape in enumerate(shapes)})
        inject_adapter_in_model(peft_config(adapter, holder, list(holder)), holder)
        failing[factor, rank, both] = set()
        for shape, layer in zip(shapes, holder.values(), strict=True):
            trained = {part: tuple(getattr(layer, part)["default"].shape) for part in LOKR_PARTS
                       if "default" in getattr(layer, part)}
            assert peft_lokr_parts(shape, rank, factor, both) == trained, (factor, rank, both, shape)
            with torch.no_grad():
                loads = lycoris_loads(layer)
            assert (lycoris_rebuilt_parts(shape, trained) == trained) == loads, (factor, rank, both, shape)
            if not loads:
                failing[factor, rank, both].add(shape)
    assert failing[-1, 16, False] == failing[-1, 4, True] == {(640, 1920, 3, 3)}
    assert not failing[-1, 64, False]  # rank >= 48: the large factor is stored whole, and recognised
    assert not any(failing[factor, rank, both] for factor, rank, both in failing if factor in (4, 8, 16))
    assert len(failing[32, 16, False]) > 20


@pytest.mark.slow
def test_the_preflight_warns_where_lycoris_cannot_load_the_lokr_file(tmp_path: Path, tiny_sdxl_dir: Path,
                                                                      capsys) -> None:
    from bench.sdxl_arch import sdxl_modules
    from sdxl_trainer.formats.lycoris_compat import lokr_load_warning

    full_size = tmp_path / "sdxl"  # full-size SDXL's component configs: all the check reads
    for name, module in sdxl_modules("meta").items():
        if name != "vae":
            (module.save_config if name == "unet" else module.config.save_pretrained)(full_size / name)

    def warning(model_id: str, **adapter) -> str | None:
        config = tiny_config(tmp_path, adapter={"type": "lokr", **adapter}, model={"id": model_id},
                             export={"adapter_formats": ["diffusers", "kohya"]})
        return lokr_load_warning(validate_config(config))

    said = warning(str(full_size), targets="all")
    assert said is not None and said.startswith(
        "LyCORIS 4.1.3 cannot load 1 of the 860 LoKr modules at adapter.lokr_factor -1 "
        "(unet.up_blocks.1.resnets.0.conv1 640x1920x3x3;")
    assert said.endswith("adapter.lokr_factor 8 avoids it")
    assert warning(str(full_size), targets="all", lokr_factor=8) is None
    assert warning(str(full_size)) is None  # attn-mlp: no convolution adapted
    # the tiny model: its 64-wide layers at factor 8 and above come out transposed
    config = lycoris_config(tmp_path, "lokr")
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config)), "--dry-run"]) == 0
    assert "LyCORIS" not in capsys.readouterr().out
    assert train_sdxl.main(["--config", str(tmp_path / "c.json"), "--dry-run",
                            "--set", "adapter.lokr_factor=16"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "LyCORIS" in line)
    assert line.startswith("  warning: LyCORIS 4.1.3 cannot load ") and line.endswith("adapter.lokr_factor 4 avoids it")


# ------------------------------------------------------------- LyCORIS's DoRA on LoKr and LoHa
def _lycoris_dora_file(path: Path, pipe) -> dict[str, torch.Tensor]:
    """A kohya file of LyCORIS's `dora_wd` modules on the tiny model: LoHa on a Linear and a
    convolution (flattened factors, dora_scale [out, 1, 1, 1]), LoKr with full factors on a Linear.
    Returns each module's merged weight by LyCORIS's own DoRA step (`weight_decompose`)."""
    from lycoris.functional.general import weight_decompose

    from sdxl_trainer.formats.adapter_files import kohya_name_map

    names = {value: key for key, value in kohya_name_map(pipe).items() if key.startswith("lora_unet_")}
    generator = torch.Generator().manual_seed(0)
    tensors, expected = {}, {}
    for kind, layer in (("loha", "mid_block.attentions.0.transformer_blocks.0.attn1.to_q"),
                        ("loha", "mid_block.resnets.0.conv1"),
                        ("lokr", "mid_block.attentions.0.transformer_blocks.0.attn1.to_k")):
        name, weight = names[("unet", layer)], pipe.unet.get_submodule(layer).weight.detach()
        out, inner = weight.shape[0], weight[0].numel()
        if kind == "loha":
            w1a, w1b, w2a, w2b = (0.1 * torch.randn(shape, generator=generator)
                                  for shape in ((out, 2), (2, inner), (out, 2), (2, inner)))
            part = {"hada_w1_a": w1a, "hada_w1_b": w1b, "hada_w2_a": w2a, "hada_w2_b": w2b, "alpha": torch.tensor(1.0)}
            delta = (w1a @ w1b) * (w2a @ w2b) * 0.5
        else:
            w1, w2 = 0.1 * torch.randn(2, 2, generator=generator), 0.1 * torch.randn(out // 2, inner // 2,
                                                                                        generator=generator)
            part, delta = {"lokr_w1": w1, "lokr_w2": w2}, torch.kron(w1, w2)
        part["dora_scale"] = weight.flatten(1).norm(dim=1).reshape(out, *[1] * (weight.dim() - 1)) * 1.5
        tensors |= {f"{name}.{role}": value for role, value in part.items()}
        expected[layer] = weight_decompose(weight + delta.reshape(weight.shape), part["dora_scale"], 1, True)
    save_file(tensors, path)
    return expected


def test_lycoris_dora_on_lokr_and_loha_merges_as_lycoris_and_the_tools_read_it(tmp_path: Path,
                                                                              tiny_sdxl_dir: Path) -> None:
    """LyCORIS's DoRA on LoKr and LoHa (dora_scale beside lokr_*/hada_*): the trainer's merge is
    LyCORIS's, the doctor reads and checks it, and adapter.init_from refuses it in one line."""
    from sdxl_trainer.config import ConfigError, ModelConfig
    from sdxl_trainer.formats.adapter_files import load_adapter_into
    from sdxl_trainer.init_adapter import read_init_adapter

    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    path = tmp_path / "dora_lycoris.safetensors"
    expected = _lycoris_dora_file(path, pipe)
    assert load_adapter_into(pipe, path) == 3
    for layer, weight in expected.items():
        torch.testing.assert_close(pipe.unet.get_submodule(layer).weight, weight, rtol=1e-5, atol=1e-6)
    for argv in ([], ["--base_model", "builtin:tiny-sdxl"]):
        assert debug_dora_weights.main(["--weights_path", str(path), *argv]) == 0
        assert fix_dora_weights.main(["--weights_path", str(path), "--dry-run", *argv]) == 0
    config = validate_config(tiny_config(tmp_path, adapter={"type": "loha", "rank": 2, "alpha": 1,
                                                            "init_from": str(path)}))
    with pytest.raises(ConfigError, match=r"(loha|lokr) module with a DoRA magnitude .*cannot train on$"):
        read_init_adapter(config, load_pipeline(config.model))
