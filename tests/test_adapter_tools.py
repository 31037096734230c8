"""extract_adapter.py and resize_adapter.py, judged by the loaders that read their files: diffusers
(`load_lora_weights`, `fuse_lora`) and LyCORIS's own DoRA module.

The "fine-tune" is the tiny SDXL with a known update added to every target layer (no training):
rank 3 on the UNet's Linear layers, rank 2 on its convolutions and on CLIP-L's layers, CLIP-bigG
unchanged, and one bias changed (which no adapter carries). The best rank-k approximation of that
update is computed here by a plain SVD, independently of the code under test.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import extract_adapter
import resize_adapter
from sdxl_trainer.adapter_extraction import ExtractError, ExtractOptions, extract, target_layers, write_adapter
from sdxl_trainer.config import ModelConfig
from sdxl_trainer.formats.kohya_format import kohya_module_name
from sdxl_trainer.lowrank import RankChoice, factorize, factorize_product
from sdxl_trainer.models import load_pipeline
from tests.helpers import run_cli

TINY = ModelConfig(id="builtin:tiny-sdxl")
CHANGED = ("unet", "text_encoder")
LOST_BIAS = "unet.conv_in.bias"


def _update_rank(component: str, layer: torch.nn.Module) -> int:
    return 3 if component == "unet" and isinstance(layer, torch.nn.Linear) else 2


def _fine_tune(pipe) -> None:
    """Add a seeded update of known rank to every target layer of the UNet and CLIP-L."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for component in CHANGED:
            module = getattr(pipe, component)
            for name in target_layers(module, component, "all"):
                weight = module.get_submodule(name).weight
                rank = _update_rank(component, module.get_submodule(name))
                up = torch.randn(weight.shape[0], rank, generator=generator)
                down = torch.randn(rank, weight[0].numel(), generator=generator)
                delta = (up @ down).reshape(weight.shape)
                weight.add_(delta * (0.05 * weight.norm() / delta.norm()))
        pipe.unet.conv_in.bias.add_(0.01)


@pytest.fixture(scope="module")
def models(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    base = load_pipeline(TINY)
    clean, tuned = copy.deepcopy(base), copy.deepcopy(base)
    _fine_tune(tuned)
    folder = tmp_path_factory.mktemp("tuned") / "my_full_run"
    tuned.save_pretrained(folder)
    return SimpleNamespace(base=base, clean=clean, tuned=tuned, folder=folder)


def _weights(pipe) -> dict[str, dict[str, torch.Tensor]]:
    return {component: {key: value.clone() for key, value in getattr(pipe, component).state_dict().items()}
            for component in ("unet", "text_encoder", "text_encoder_2")}


def _fused(models: SimpleNamespace, adapter_file: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The tiny model's weights with `adapter_file` loaded by diffusers and fused at strength 1."""
    pipe = copy.deepcopy(models.clean)
    pipe.load_lora_weights(str(adapter_file))
    pipe.fuse_lora(lora_scale=1.0)
    pipe.unload_lora_weights()
    return _weights(pipe)


def _best_approximation(base: torch.Tensor, tuned: torch.Tensor, rank: int) -> torch.Tensor:
    """W_base + the best rank-`rank` approximation of the update, by a plain SVD."""
    u, s, vh = torch.linalg.svd((tuned - base).double().flatten(1), full_matrices=False)
    return base + ((u[:, :rank] * s[:rank]) @ vh[:rank]).reshape(base.shape).float()


def _dora(base: torch.Tensor, delta_weight: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """peft's DoRA merge: m · V / ‖V‖ per output channel."""
    norms = delta_weight.flatten(1).norm(dim=1)
    return delta_weight * (magnitude / norms).reshape(base.shape[0], *[1] * (base.dim() - 1))


def _check_fused(fused, models: SimpleNamespace, expected_weight) -> int:
    """Every target layer of the fused model equals `expected_weight(component, name)`; everything
    else equals the base (the lost bias included). Returns the layers checked."""
    base = _weights(models.base)
    checked = 0
    for component, tensors in fused.items():
        module = getattr(models.base, component)
        targets = {f"{name}.weight": name for name in target_layers(module, component, "all")}
        for key, tensor in tensors.items():
            if component in CHANGED and key in targets:
                torch.testing.assert_close(tensor, expected_weight(component, targets[key]), rtol=1e-5, atol=2e-6,
                                           msg=f"{component}.{key}")
                checked += 1
            else:
                assert torch.equal(tensor, base[component][key]), f"{component}.{key}"
    return checked


def _layer_pair(models: SimpleNamespace, component: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (getattr(models.base, component).get_submodule(name).weight.detach(),
            getattr(models.tuned, component).get_submodule(name).weight.detach())


# --- the low-rank arithmetic -----------------------------------------------------------------


@pytest.mark.parametrize(("dynamic", "param", "cap", "kept"), [
    (None, 0.0, 3, 3), (None, 0.0, 9, 4), ("sv_ratio", 3.0, 4, 2), ("sv_fro", 0.9, 4, 2),
    ("sv_cumulative", 0.9, 4, 3), ("sv_cumulative", 0.9, 2, 2), ("sv_fro", 1.0, 4, 4)])
def test_dynamic_ranks_follow_kohyas_methods(dynamic: str | None, param: float, cap: int, kept: int) -> None:
    """Singular values 4, 2, 1, 0.5: energy fractions .753/.941/.988/1, sums .533/.8/.933/1."""
    singular = torch.tensor([4.0, 2.0, 1.0, 0.5])
    assert RankChoice(cap, dynamic, param).keep(singular, float(singular.square().sum())) == kept


@pytest.mark.parametrize(("dynamic", "param"), [("sv_ratio", 10.0), ("sv_fro", 0.9), ("sv_cumulative", 0.9)])
def test_a_zero_update_keeps_rank_1_under_every_dynamic_method(dynamic: str, param: float) -> None:
    """A layer that never trained (lora_up all zero) has nothing to keep: rank 1, not --rank."""
    factors = factorize_product(torch.zeros(64, 16), torch.randn(16, 32), RankChoice(16, dynamic, param))
    assert factors.rank == 1 and not factors.up.any()


def test_factors_are_the_best_approximation_and_the_randomized_svd_finds_an_exact_rank() -> None:
    generator = torch.Generator().manual_seed(1)
    matrix = torch.randn(40, 60, generator=generator)
    singular = torch.linalg.svdvals(matrix.double())
    factors = factorize(matrix, RankChoice(5))
    torch.testing.assert_close(factors.up @ factors.down, _best_approximation(torch.zeros_like(matrix), matrix, 5),
                               rtol=1e-4, atol=1e-4)
    assert factors.delta_error == pytest.approx(math.sqrt(float(singular[5:].square().sum() / singular.square().sum())))
    low_rank = torch.randn(40, 3, generator=generator) @ torch.randn(3, 60, generator=generator)
    randomized = factorize(low_rank, RankChoice(3, svd="lowrank"))
    torch.testing.assert_close(randomized.up @ randomized.down, low_rank, rtol=1e-4, atol=1e-4)
    product = factorize_product(factors.up, factors.down, RankChoice(2))
    torch.testing.assert_close(product.up @ product.down, _best_approximation(torch.zeros_like(matrix), matrix, 2),
                               rtol=1e-4, atol=1e-4)


# --- extraction ------------------------------------------------------------------------------


def test_extracted_ranks_by_error_target_load_in_diffusers_as_the_tuned_weights(
        models: SimpleNamespace, tmp_path: Path) -> None:
    """At a tight error target each layer gets its update's own rank (3 or 2: a per-layer rank
    pattern in both formats), and both files fuse in diffusers to the tuned weights."""
    choice = RankChoice(8, "sv_fro", math.sqrt(1 - 0.01**2))
    extraction = extract(models.base, models.tuned, ExtractOptions(choice))
    assert {(layer.component, layer.factors.rank) for layer in extraction.layers} == {
        ("unet", 3), ("unet", 2), ("text_encoder", 2)}
    for layer in extraction.layers:
        module = getattr(models.base, layer.component).get_submodule(layer.name)
        assert layer.factors.rank == _update_rank(layer.component, module), layer.name
        assert layer.error.weight_error < 1e-5, layer.name
    assert list(extraction.lost) == [LOST_BIAS]
    files = write_adapter(models.base, extraction, tmp_path / "extracted", ("diffusers", "kohya"))
    assert [path.name for path in files] == ["pytorch_lora_weights.safetensors", "extracted_kohya.safetensors"]
    assert not hasattr(models.base.unet, "peft_config"), "the adapter must be taken off the base again"
    for path in files:
        checked = _check_fused(_fused(models, path), models,
                               lambda component, name: _layer_pair(models, component, name)[1])
        assert checked == len(extraction.layers)


@pytest.mark.parametrize("file_format", ["diffusers", "kohya"])
def test_extracted_lora_fuses_in_diffusers_to_base_plus_the_best_rank_approximation(
        models: SimpleNamespace, tmp_path: Path, file_format: str) -> None:
    extraction = extract(models.base, models.tuned, ExtractOptions(RankChoice(1)))
    assert all(layer.error.weight_error > 1e-4 for layer in extraction.layers), "rank 1 misses part of every update"
    [path] = write_adapter(models.base, extraction, tmp_path / "lora.safetensors", (file_format,))
    checked = _check_fused(_fused(models, path), models,
                           lambda component, name: _best_approximation(*_layer_pair(models, component, name), 1))
    assert checked == len(extraction.layers)


@pytest.fixture(scope="module")
def dora(models: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    extraction = extract(models.base, models.tuned, ExtractOptions(RankChoice(1), dora=True))
    files = write_adapter(models.base, extraction, tmp_path_factory.mktemp("dora") / "dora", ("diffusers", "kohya"))
    return SimpleNamespace(extraction=extraction, diffusers_file=files[0], kohya_file=files[1])


def _expected_dora(models: SimpleNamespace, component: str, name: str) -> torch.Tensor:
    base, tuned = _layer_pair(models, component, name)
    return _dora(base, _best_approximation(base, tuned, 1), tuned.flatten(1).norm(dim=1))


def test_extracted_dora_fuses_in_diffusers_with_the_tuned_models_norms_exactly(
        models: SimpleNamespace, dora: SimpleNamespace) -> None:
    fused = _fused(models, dora.diffusers_file)
    checked = _check_fused(fused, models, lambda component, name: _expected_dora(models, component, name))
    assert checked == len(dora.extraction.layers)
    for layer in dora.extraction.layers:
        tuned = _layer_pair(models, layer.component, layer.name)[1]
        torch.testing.assert_close(fused[layer.component][f"{layer.name}.weight"].flatten(1).norm(dim=1),
                                   tuned.flatten(1).norm(dim=1), rtol=1e-6, atol=0)


def test_extracted_dora_merges_in_lycoris_as_in_diffusers(models: SimpleNamespace, dora: SimpleNamespace) -> None:
    """LyCORIS's own module reads the kohya file. It adds 1.2e-7 to the norm and merges in another
    order, so weights agree to rtol 1e-5, and near zero to atol 5e-7 (a few float32 steps at the
    weights' scale: the pretrained weights have entries near 1, where one step is 1.2e-7)."""
    locon = pytest.importorskip("lycoris.modules.locon")
    with safe_open(str(dora.kohya_file), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    kinds = set()
    for layer in dora.extraction.layers:
        module = getattr(models.base, layer.component)
        name = kohya_module_name(layer.component, layer.name, models.base.unet.config)
        parts = [tensors[f"{name}.{part}"] for part in ("lora_up.weight", "lora_down.weight")]
        with torch.no_grad():
            lycoris = locon.LoConModule.make_module_from_state_dict(
                name, copy.deepcopy(module.get_submodule(layer.name)), *parts, None, tensors[f"{name}.alpha"],
                tensors[f"{name}.dora_scale"])
            lycoris.apply_to()
            got = lycoris.get_merged_weight()[0]
        torch.testing.assert_close(got, _expected_dora(models, layer.component, layer.name), rtol=1e-5, atol=5e-7)
        kinds.add(type(module.get_submodule(layer.name)))
    assert kinds == {torch.nn.Linear, torch.nn.Conv2d}


def test_models_that_are_no_base_and_fine_tune_are_refused(models: SimpleNamespace) -> None:
    options = ExtractOptions(RankChoice(2))
    with pytest.raises(ExtractError, match="nothing to extract"):
        extract(models.base, models.base, options)
    other = SimpleNamespace(unet=copy.deepcopy(models.tuned.unet), text_encoder=models.tuned.text_encoder,
                            text_encoder_2=models.tuned.text_encoder_2)
    other.unet.conv_out = torch.nn.Conv2d(32, 8, 3, padding=1)
    with pytest.raises(ExtractError, match=r"conv_out\.weight has shape"):
        extract(models.base, other, options)
    with torch.no_grad():
        for parameter in other.unet.parameters():
            parameter.copy_(torch.randn_like(parameter) * parameter.std())
    other.unet.conv_out = copy.deepcopy(models.base.unet.conv_out)
    with pytest.raises(ExtractError, match="not a fine-tune of this base"):
        extract(models.base, other, options)
    with pytest.raises(ExtractError, match="--rank 40 is above the rank of"):
        extract(models.base, models.tuned, ExtractOptions(RankChoice(40)))
    other.unet = copy.deepcopy(models.tuned.unet)
    with torch.no_grad():
        other.unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q.weight[0, 0] = math.nan
    for svd in ("exact", "lowrank"):
        with pytest.raises(ExtractError, match=r"^--tuned: unet\.down_blocks\.1\..*to_q\.weight holds NaN/Inf"):
            extract(models.base, other, ExtractOptions(RankChoice(2, svd=svd)))


# --- resizing --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank3(models: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """LoRA and DoRA files of rank 3 that hold the update exactly."""
    folder = tmp_path_factory.mktemp("rank3")
    files = {}
    for kind in ("lora", "dora"):
        extraction = extract(models.base, models.tuned, ExtractOptions(RankChoice(3), dora=kind == "dora"))
        files[kind] = write_adapter(models.base, extraction, folder / kind, ("diffusers", "kohya"))
    return SimpleNamespace(lora=files["lora"], dora=files["dora"])


@pytest.mark.parametrize("which", [0, 1], ids=["diffusers", "kohya"])
def test_resized_lora_fuses_in_diffusers_to_the_best_lower_rank_approximation(
        models: SimpleNamespace, rank3: SimpleNamespace, tmp_path: Path, which: int,
        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "resized.safetensors"
    assert resize_adapter.main([str(rank3.lora[which]), "--rank", "1", "--out", str(out), "--quiet"]) == 0
    assert "overall: 275 layers, rank 1–1" in capsys.readouterr().out
    _check_fused(_fused(models, out), models,
                 lambda component, name: _best_approximation(*_layer_pair(models, component, name), 1))


def test_resized_dora_keeps_the_magnitude_and_the_merged_norms(
        models: SimpleNamespace, rank3: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Given a trainer's folder holding both formats (docs/adapters.md's example), its diffusers file."""
    out = tmp_path / "dora_r1.safetensors"
    assert resize_adapter.main([str(rank3.dora[0].parent), "--rank", "1", "--out", str(out), "--quiet",
                                "--base", "builtin:tiny-sdxl"]) == 0
    assert f"{rank3.dora[0]}: diffusers/peft, 275 modules" in capsys.readouterr().out
    with safe_open(str(rank3.dora[0]), framework="pt") as before, safe_open(str(out), framework="pt") as after:
        magnitudes = [key for key in before.keys() if "lora_magnitude_vector" in key]  # noqa: SIM118
        assert len(magnitudes) == 275
        assert all(torch.equal(before.get_tensor(key), after.get_tensor(key)) for key in magnitudes)
    fused = _fused(models, out)
    _check_fused(fused, models, lambda component, name: _expected_dora(models, component, name))


def test_dynamic_resize_keeps_each_modules_own_rank_and_loads_with_the_rank_pattern(
        models: SimpleNamespace, rank3: SimpleNamespace, tmp_path: Path) -> None:
    """sv_fro at 0.99999 drops the third (zero) singular value of the rank-2 updates only."""
    for which in (0, 1):
        out = tmp_path / f"dynamic{which}.safetensors"
        assert resize_adapter.main([str(rank3.lora[which]), "--rank", "3", "--dynamic", "sv_fro",
                                    "--dynamic-param", "0.99999", "--out", str(out), "--quiet"]) == 0
        with safe_open(str(out), framework="pt") as handle:
            ranks = {handle.get_tensor(key).shape[0] for key in handle.keys()  # noqa: SIM118
                     if key.endswith(("lora_down.weight", "lora_A.weight"))}
        assert ranks == {2, 3}
        _check_fused(_fused(models, out), models,
                     lambda component, name: _layer_pair(models, component, name)[1])


@pytest.mark.parametrize("which", [0, 1], ids=["diffusers", "kohya"])
def test_modules_already_at_or_below_the_rank_are_kept_as_they_are(
        models: SimpleNamespace, rank3: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture,
        which: int) -> None:
    """A file whose convolutions have rank 1 (alpha 0.5), resized to 2: the convolutions are kept bit
    for bit (peft: their rank and alpha in the patterns), every other module is cut to rank 2."""
    with safe_open(str(rank3.lora[which]), framework="pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()  # noqa: SIM118
    down_suffix, up_suffix = (".lora_A.weight", ".lora_B.weight") if which == 0 else (".lora_down.weight",
                                                                                      ".lora_up.weight")
    convs = {key.removesuffix(down_suffix) for key, value in tensors.items()
             if key.endswith(down_suffix) and value.dim() == 4}
    for name in convs:
        tensors[name + down_suffix] = tensors[name + down_suffix][:1].clone()
        tensors[name + up_suffix] = tensors[name + up_suffix][:, :1].clone()
        if which == 1:
            tensors[f"{name}.alpha"] = torch.tensor(0.5)
    if which == 0:
        config = json.loads(metadata["lora_adapter_metadata"])
        patterns = dict.fromkeys((re.escape(name.removeprefix("unet.")) for name in convs), 1)
        config |= {"unet.rank_pattern": patterns, "unet.alpha_pattern": dict.fromkeys(patterns, 0.5)}
        metadata["lora_adapter_metadata"] = json.dumps(config)
    mixed, out = tmp_path / "mixed.safetensors", tmp_path / "resized.safetensors"
    save_file(tensors, str(mixed), metadata=metadata)
    assert resize_adapter.main([str(mixed), "--rank", "2", "--out", str(out), "--quiet"]) == 0
    assert f"{len(convs)} module(s) already at or below rank 2: kept as they are" in capsys.readouterr().out
    with safe_open(str(out), framework="pt") as handle:
        resized = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    kept = [key for key in tensors if key.removesuffix(down_suffix).removesuffix(up_suffix).removesuffix(".alpha")
            in convs]
    assert len(kept) == (2 + which) * len(convs) and all(torch.equal(resized[key], tensors[key]) for key in kept)

    def expected(component: str, name: str) -> torch.Tensor:
        base, tuned = _layer_pair(models, component, name)
        if base.dim() == 2:
            return _best_approximation(base, tuned, 2)
        module = f"unet.{name}" if which == 0 else kohya_module_name(component, name, models.base.unet.config)
        up, down = tensors[module + up_suffix], tensors[module + down_suffix]
        return base + 0.5 * (up.flatten(1) @ down.flatten(1)).reshape(base.shape)

    _check_fused(_fused(models, out), models, expected)


# --- the command lines and bad input ---------------------------------------------------------


def test_both_tools_explain_themselves() -> None:
    for script, words in (("extract_adapter.py", ("torch.svd_lowrank", "--error-target", "--dora")),
                          ("resize_adapter.py", ("sv_fro", "sv_cumulative", "magnitude"))):
        result = run_cli(script, "--help")
        assert result.returncode == 0, result.stderr
        assert all(word in result.stdout for word in words), script


def test_extract_command_line_reads_an_output_folder_and_writes_a_dora_that_diffusers_loads(
        models: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "my_dora.safetensors"
    assert extract_adapter.main(["--base", "builtin:tiny-sdxl", "--tuned", str(models.folder), "--rank", "1",
                                 "--dora", "--format", "diffusers", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "overall: 275 layers, rank 1–1" in printed and "unet.down_blocks.0.resnets.0.conv1 " in printed
    assert "lost: 1 changed tensor(s)" in printed and LOST_BIAS in printed
    _check_fused(_fused(models, out), models,
                 lambda component, name: _expected_dora(models, component, name))


def test_extract_reads_sdxl_single_files_with_a_config_folder(
        models: SimpleNamespace, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    """The tuned model as one SDXL .safetensors file (this trainer's converter, exact in fp32): the
    same factors as from the pipeline in memory."""
    import shutil

    from sdxl_trainer.adapter_extraction import load_models
    from sdxl_trainer.formats.converter import convert

    single = convert(models.folder, tmp_path / "tuned.safetensors")
    configs = shutil.copytree(tiny_sdxl_dir, tmp_path / "configs",
                              ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"))
    [tuned] = load_models({"--tuned": str(single)}, str(configs))
    options = ExtractOptions(RankChoice(1))
    expected = extract(models.base, models.tuned, options).layers
    got = extract(models.base, tuned, options).layers
    assert [(layer.component, layer.name) for layer in got] == [(layer.component, layer.name) for layer in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert torch.equal(mine.factors.up, theirs.factors.up) and torch.equal(mine.factors.down, theirs.factors.down)


def _refused(main, argv: list[str], capsys: pytest.CaptureFixture, folder: Path, words: str) -> None:
    before = sorted(folder.rglob("*"))
    assert main(argv) == 2
    errors = capsys.readouterr().err  # besides the loaders' progress bars
    lines = [line for line in errors.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in errors, errors
    assert sorted(folder.rglob("*")) == before, "nothing may be written"


def test_bad_extract_input_is_one_line_and_exit_2(models: SimpleNamespace, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "out.safetensors")
    sd15 = tmp_path / "sd15.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 4, 3, 3)}, str(sd15))
    for argv, words in (
        (["--tuned", str(models.folder), "--rank", "64"], "--rank 64 is above the rank of"),
        (["--tuned", "builtin:tiny-sdxl", "--rank", "2"], "nothing to extract"),
        (["--tuned", str(sd15), "--rank", "2"], "not an SDXL checkpoint"),
        (["--tuned", str(tmp_path), "--rank", "2"], "not a diffusers pipeline folder"),
        (["--tuned", str(models.folder), "--rank", "2", "--error-target", "1.5"], "--error-target 1.5"),
    ):
        _refused(extract_adapter.main, ["--base", "builtin:tiny-sdxl", *argv, "--out", out], capsys, tmp_path, words)


def _damaged(path: Path, folder: Path, suffix: str) -> Path:
    """A copy of the adapter file with a NaN in the first UNet tensor whose key ends in `suffix`."""
    with safe_open(str(path), framework="pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()  # noqa: SIM118
    key = next(key for key in tensors if key.startswith("lora_unet_") and key.endswith(suffix))
    tensors[key].view(-1)[0] = float("nan")
    damaged = folder / f"nan_{suffix}.safetensors"
    save_file(tensors, str(damaged), metadata=metadata)
    return damaged


def test_bad_resize_input_is_one_line_and_exit_2(rank3: SimpleNamespace, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    kohya = rank3.dora[1]
    truncated, other, sd15, mixed = (tmp_path / f"{name}.safetensors" for name in ("cut", "other", "sd15", "mixed"))
    truncated.write_bytes(kohya.read_bytes()[:-1000])
    save_file({"model.diffusion_model.out.2.weight": torch.zeros(4, 4)}, str(other))
    pair = {"lora_down.weight": torch.zeros(2, 320), "lora_up.weight": torch.zeros(320, 2), "alpha": torch.tensor(2.0)}
    save_file({f"lora_te_text_model_encoder_layers_0_mlp_fc1.{key}": value for key, value in pair.items()}, str(sd15))
    save_file({f"lora_unet_down_blocks_0_attentions_0_proj_in.{key}": value for key, value in pair.items()}, str(mixed))
    nan_magnitude, nan_up = _damaged(kohya, tmp_path, "dora_scale"), _damaged(kohya, tmp_path, "lora_up.weight")
    out = str(tmp_path / "out.safetensors")
    for argv, words in (
        ([str(nan_magnitude), "--rank", "2"], "NaN/Inf in its magnitude: repair the file with fix_dora_weights.py"),
        ([str(nan_up), "--rank", "2"], "holds NaN/Inf in its up"),
        ([str(other), "--rank", "2"], "not an adapter file"),
        ([str(truncated), "--rank", "2"], "not a readable safetensors file"),
        ([str(sd15), "--rank", "1"], "an SD 1.x adapter"),
        ([str(mixed), "--rank", "1"], "is no layer of SDXL"),
        ([str(kohya), "--rank", "3"], "--rank 3 lowers no module of"),
        ([str(kohya), "--rank", "2", "--dynamic", "sv_fro"], "--dynamic and --dynamic-param go together"),
    ):
        _refused(resize_adapter.main, [*argv, "--out", out], capsys, tmp_path, words)
    blocked = str(tmp_path / "cut.safetensors" / "out.safetensors")  # under a file: a typo
    _refused(resize_adapter.main, [str(kohya), "--rank", "2", "--quiet", "--out", blocked], capsys, tmp_path,
             "cut.safetensors is a file, not a folder")
