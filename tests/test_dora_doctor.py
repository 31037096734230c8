"""debug_dora_weights.py and fix_dora_weights.py on adapters the trainer wrote from the tiny model.

Every kind of damage is found in exactly the module that has it; after the repair the debugger
reports clean, undamaged modules are bit-identical, the file loads (diffusers for the peft format,
the trainer's own loader for both) and renders real images; scanning a large file needs little
memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import debug_dora_weights
import fix_dora_weights
from sdxl_trainer.doctor import checks
from sdxl_trainer.doctor.base_weights import BaseWeights
from sdxl_trainer.doctor.repairs import RepairOptions
from sdxl_trainer.doctor.report import analyse_file
from sdxl_trainer.doctor.rewrite import plan_repairs, write_repaired
from sdxl_trainer.eval.image_checks import check_image
from sdxl_trainer.formats.adapter_files import (
    KOHYA,
    PEFT,
    AdapterFile,
    AdapterFileError,
    AdapterModule,
    adapter_files,
    detect_format,
    load_adapter_into,
    merged_weight,
    split_key,
)
from sdxl_trainer.formats.kohya_format import kohya_module_name
from sdxl_trainer.formats.safetensors_stream import StreamWriter, TensorSpec
from tests.helpers import ROOT, run_cli, tiny_config, train_here, write_config

TINY = "builtin:tiny-sdxl"
RUN_NAME = "test_run"
# Modules the damage goes into (diffusers names); one of them is a convolution.
NAN_MODULE = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
INF_MODULE = "unet.down_blocks.0.resnets.0.conv1"
ZERO_MAGNITUDE_MODULE = "unet.mid_block.attentions.0.proj_in"
FP16_MODULE = "unet.up_blocks.0.attentions.0.transformer_blocks.0.ff.net.2"
NAMES_MODULE = "text_encoder.text_model.encoder.layers.1.self_attn.v_proj"
ONE_D_MODULE = "unet.down_blocks.2.attentions.1.proj_out"
LEFTOVER_MODULE = "unet.up_blocks.1.attentions.1.transformer_blocks.0.attn2.to_k"
ZERO_ROW_MODULE = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k"


@pytest.fixture(scope="module")
def run_output(tmp_path_factory: pytest.TempPathFactory, tiny_sdxl_dir: Path) -> Path:
    """A DoRA run through the CLI on every UNet target (convolutions too): 2 steps, a checkpoint
    after the first, adapters in both formats."""
    tmp = tmp_path_factory.mktemp("dora_doctor")
    config = tiny_config(
        tmp, adapter={"targets": "all"},
        training={"num_steps": 2, "checkpoint_every": 1, "output_dir": str(tmp / "output")},
        export={"adapter_formats": ["diffusers", "kohya"]},
    )
    result = train_here("--config", str(write_config(tmp / "config.json", config)))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "output"


def adapter_path(run_output: Path, file_format: str) -> Path:
    return run_output / ("pytorch_lora_weights.safetensors" if file_format == PEFT else f"{RUN_NAME}_kohya.safetensors")


def file_name(file_format: str, module: str, tiny_sdxl_dir: Path) -> str:
    """The module's name in a file of `file_format`."""
    if file_format == PEFT:
        return module
    component, path = module.split(".", 1)
    return kohya_module_name(component, path, json.loads((tiny_sdxl_dir / "unet" / "config.json").read_text()))


def rewrite(source: Path, destination: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy an adapter file with `edit` applied to its tensors (in place), metadata kept."""
    with safe_open(str(source), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(source)
    edit(tensors)
    save_file(tensors, destination, metadata=metadata)
    return destination


def key_of(tensors: dict[str, torch.Tensor], module: str, role: str) -> str:
    return next(key for key in tensors if split_key(key) == (module, role))


def debug(*args: str, json_path: Path | None = None) -> tuple[int, dict]:
    """Run debug_dora_weights.py in-process; (exit code, {file name: finding kinds} of the first file)."""
    extra = ["--json", str(json_path)] if json_path else []
    code = debug_dora_weights.main(["--weights_path", *args, *extra])
    if not json_path:
        return code, {}
    report = json.loads(json_path.read_text())["files"][0]
    found = {module["file_name"]: {finding["kind"] for finding in module["findings"]}
             for module in report["modules"] if module["findings"]}
    return code, found


def generate(pipe) -> torch.Tensor:
    image = pipe("tok, a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images[0]
    return torch.from_numpy(image)


def tiny_pipeline(folder: Path):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(folder)


def with_diffusers_lora(folder: Path, adapter: Path):
    """The pipeline at `folder` with `adapter` loaded by diffusers and fused (peft's DoRA forward
    on unfused convolutions is slow)."""
    pipe = tiny_pipeline(folder)
    pipe.load_lora_weights(adapter.parent, weight_name=adapter.name)
    pipe.fuse_lora(lora_scale=1.0)
    return pipe


def module_count(path: Path) -> int:
    with AdapterFile(path) as adapter:
        return len(adapter.groups)


def module_keys(path: Path, damaged: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of the modules not in `damaged`."""
    with AdapterFile(path) as adapter:
        return {key: adapter.reader.get(key) for name, keys in adapter.groups.items() if name not in damaged
                for key in keys.values()}


# --- clean files ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("file_format", [PEFT, KOHYA])
def test_clean_adapters_are_reported_clean(run_output: Path, tmp_path: Path, file_format: str) -> None:
    path = adapter_path(run_output, file_format)
    assert detect_format(path) == file_format
    code, found = debug(str(path), "--base_model", TINY, json_path=tmp_path / "report.json")
    assert (code, found) == (0, {})
    report = json.loads((tmp_path / "report.json").read_text())["files"][0]
    assert report["format"] == file_format and report["verdict"].startswith("clean")
    assert {module["kind"] for module in report["modules"]} == {"DoRA"}
    assert len(report["modules"]) == module_count(path)


@pytest.mark.slow
def test_own_loader_merges_both_formats_as_diffusers_does(run_output: Path, tiny_sdxl_dir: Path) -> None:
    judge = with_diffusers_lora(tiny_sdxl_dir, adapter_path(run_output, PEFT))
    judge.unload_lora_weights()  # the fused weights stay; the layers are plain again
    for file_format in (PEFT, KOHYA):
        pipe = tiny_pipeline(tiny_sdxl_dir)
        assert load_adapter_into(pipe, adapter_path(run_output, file_format)) == module_count(
            adapter_path(run_output, PEFT))
        for component in ("unet", "text_encoder"):
            ours, theirs = getattr(pipe, component).state_dict(), getattr(judge, component).state_dict()
            for key, value in ours.items():
                torch.testing.assert_close(value, theirs[key], rtol=0, atol=1e-6, msg=f"{file_format} {key}")


def test_magnitude_layouts_follow_the_format() -> None:
    """Which dora_scale shapes each format wants, which are repairable, and LyCORIS's legacy
    input axis ([1, in]), which is valid and merged on the input columns."""
    down, up = torch.randn(4, 80), torch.randn(64, 4) * 0.1

    def layout(file_format: str, magnitude: torch.Tensor):
        name = "lora_unet_x" if file_format == KOHYA else "unet.x"
        module = AdapterModule(name, file_format, "unet", "x", {"down": down, "up": up, "magnitude": magnitude},
                               {}, alpha=4.0)
        return module, module.magnitude_layout()

    assert layout(KOHYA, torch.ones(64, 1))[1] == ("output", (64, 1))
    assert layout(KOHYA, torch.ones(64))[1] == ("output", (64, 1))  # 1-D: repairable
    assert layout(KOHYA, torch.ones(1, 64))[1] == ("output", (64, 1))  # wrongly oriented
    assert layout(KOHYA, torch.ones(1, 80))[1] == ("input", (1, 80))
    assert layout(PEFT, torch.ones(64))[1] == ("output", (64,))
    assert layout(PEFT, torch.ones(1, 80))[1] is None  # peft has no input-axis DoRA
    assert layout(KOHYA, torch.ones(7))[1] is None

    weight = torch.randn(64, 80)
    module, _ = layout(KOHYA, torch.rand(1, 80) + 0.5)
    adapted = weight + up @ down
    expected = adapted * module.magnitude / adapted.norm(dim=0, keepdim=True)
    torch.testing.assert_close(merged_weight(weight, module), expected)


def test_a_peft_magnitude_of_no_axis_is_rebuilt_in_pefts_shape_and_diffusers_loads_it(
        tmp_path: Path, tiny_sdxl_dir: Path, capsys) -> None:
    """A peft DoRA magnitude of the wrong length (a Linear's and a convolution's) is rebuilt as ‖W‖
    in peft's shape, [out] and [1, out, 1, 1], not kohya's, so that diffusers loads the repaired file."""
    from sdxl_trainer.adapters import save_diffusers_adapter
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.models import load_pipeline
    from sdxl_trainer.training_setup import prepare_trainable

    config = validate_config(tiny_config(tmp_path, adapter={"type": "dora", "rank": 2, "alpha": 2, "targets": "all"}))
    pipe = load_pipeline(config.model)
    written = save_diffusers_adapter(tmp_path / "adapter", prepare_trainable(pipe, config).modules)
    damaged = (NAN_MODULE, INF_MODULE)  # a Linear and a convolution
    rewrite(written, tmp_path / "cut.safetensors", lambda tensors: tensors.update(
        {key_of(tensors, module, "magnitude"): tensors[key_of(tensors, module, "magnitude")].flatten()[:-3].clone()
         for module in damaged}))
    fixed = tmp_path / "fixed.safetensors"
    assert fix_dora_weights.main(["--weights_path", str(tmp_path / "cut.safetensors"), "--base_model", TINY,
                                  "--output", str(fixed)]) == 0
    tensors, judge = load_file(fixed), tiny_pipeline(tiny_sdxl_dir)
    for module in damaged:
        weight = judge.unet.get_submodule(module.removeprefix("unet.")).weight.detach()
        magnitude = tensors[key_of(tensors, module, "magnitude")]
        assert tuple(magnitude.shape) == ((weight.shape[0],) if weight.dim() == 2 else (1, weight.shape[0], 1, 1))
        torch.testing.assert_close(magnitude.flatten(), weight.flatten(1).norm(dim=1))
    assert debug(str(fixed))[0] == 0
    judge.load_lora_weights(fixed.parent, weight_name=fixed.name)
    capsys.readouterr()
    blocked = fixed / "out"  # an output path under a file (a typo): one line, exit 2, not 1 (problems found)
    for main, option in ((fix_dora_weights.main, "--output"), (debug_dora_weights.main, "--json")):
        assert main(["--weights_path", str(tmp_path / "cut.safetensors"), option, f"{blocked}.x"]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"{fixed} is a file, not a folder" in error


# --- every kind of damage, in one file per format ------------------------------------------------


@pytest.fixture(scope="module")
def base_with_zero_row(tiny_sdxl_dir: Path, tmp_path_factory) -> Path:
    """The tiny model with output row 0 of ZERO_ROW_MODULE all zero (a pruned channel, peft#2049)."""
    pipe = tiny_pipeline(tiny_sdxl_dir)
    with torch.no_grad():
        pipe.unet.get_submodule(ZERO_ROW_MODULE.removeprefix("unet.")).weight[0].zero_()
    folder = tmp_path_factory.mktemp("base_with_zero_row")
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[PEFT, KOHYA])
def damaged(request, run_output: Path, tiny_sdxl_dir: Path, tmp_path_factory) -> tuple[Path, dict[str, set[str]]]:
    """The trainer's adapter in fp16 with damage of each kind in its own module, and the expected
    findings (file name → kinds) against `base_with_zero_row`."""
    file_format = request.param
    names = {module: file_name(file_format, module, tiny_sdxl_dir) for module in (
        NAN_MODULE, INF_MODULE, ZERO_MAGNITUDE_MODULE, FP16_MODULE, NAMES_MODULE, ONE_D_MODULE, LEFTOVER_MODULE,
        ZERO_ROW_MODULE)}
    expected = {
        names[NAN_MODULE]: {checks.NON_FINITE},
        names[INF_MODULE]: {checks.NON_FINITE},
        names[ZERO_MAGNITUDE_MODULE]: {checks.ZERO_MAGNITUDE},
        names[FP16_MODULE]: {checks.FP16_OVERFLOW},
        names[NAMES_MODULE]: {checks.NAMES},
        names[ZERO_ROW_MODULE]: {checks.ZERO_NORM},  # only visible with the base weights
    }

    def damage(tensors: dict[str, torch.Tensor]) -> None:
        for key in tensors:
            tensors[key] = tensors[key].half()  # as an fp16 training run saves it
        tensors[key_of(tensors, names[NAN_MODULE], "up")][0, :2] = float("nan")
        tensors[key_of(tensors, names[INF_MODULE], "down")][1, 0, 1, 1] = float("inf")
        tensors[key_of(tensors, names[ZERO_MAGNITUDE_MODULE], "magnitude")].zero_()
        tensors[key_of(tensors, names[FP16_MODULE], "up")][0, 0] = 30000.0  # finite in fp16, Inf once multiplied
        tensors[key_of(tensors, names[ZERO_ROW_MODULE], "up")][0].zero_()  # W+ΔW row 0 = 0 on that base: 0/0
        if file_format == PEFT:  # the spelling diffusers does not load into the text encoders
            key = key_of(tensors, names[NAMES_MODULE], "magnitude")
            tensors[key.removesuffix(".weight")] = tensors.pop(key)
            return
        key = key_of(tensors, names[ONE_D_MODULE], "magnitude")
        tensors[key] = tensors[key].flatten()  # ComfyUI rejects a 1-D dora_scale
        leftover = names[LEFTOVER_MODULE]  # peft's spellings, as diffusers' kohya converter leaves them
        for suffix, peft_suffix in ((".lora_down.weight", ".lora_A.weight"), (".lora_up.weight", ".lora_B.weight"),
                                    (".dora_scale", ".lora_magnitude_vector")):
            tensors[leftover + peft_suffix] = tensors.pop(leftover + suffix)
        tensors[leftover + ".lora_magnitude_vector"] = tensors[leftover + ".lora_magnitude_vector"].flatten()
        te_name = names[NAMES_MODULE]  # CLIP-L without `text_model_`: ComfyUI ignores it
        for key in [key for key in tensors if key.startswith(te_name + ".")]:
            tensors[key.replace("lora_te1_text_model_", "lora_te1_")] = tensors.pop(key)
        expected[names[ONE_D_MODULE]] = {checks.SHAPE}
        expected[leftover] = {checks.NAMES, checks.SHAPE}

    folder = tmp_path_factory.mktemp(f"damaged-{file_format.split('/')[0]}")
    return rewrite(adapter_path(run_output, file_format), folder / "adapter.safetensors", damage), expected


@pytest.mark.slow
def test_each_kind_of_damage_is_found_in_exactly_its_module(damaged, base_with_zero_row: Path, tmp_path: Path) -> None:
    path, expected = damaged
    base = str(base_with_zero_row)
    assert debug(str(path), "--base_model", base, json_path=tmp_path / "with_base.json") == (1, expected)
    without_base = {name: kinds for name, kinds in expected.items() if kinds != {checks.ZERO_NORM}}
    assert debug(str(path), json_path=tmp_path / "without_base.json") == (1, without_base)


@pytest.mark.slow
def test_repaired_adapter_is_clean_loads_and_renders(damaged, base_with_zero_row: Path, tiny_sdxl_dir: Path,
                                                     capsys) -> None:
    path, expected = damaged
    file_format, base = detect_format(path), str(base_with_zero_row)
    assert fix_dora_weights.main(["--weights_path", str(path), "--base_model", base]) == 0
    fixed = path.with_name("adapter_fixed.safetensors")
    assert "re-read and verified" in capsys.readouterr().out
    assert debug(str(fixed), "--base_model", base) == (0, {})

    before, after = module_keys(path, set(expected)), module_keys(fixed, set(expected))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)  # bit for bit

    if file_format == KOHYA:
        repaired, original = load_file(fixed), load_file(path)
        leftover = file_name(KOHYA, LEFTOVER_MODULE, tiny_sdxl_dir)
        assert torch.equal(repaired[leftover + ".lora_down.weight"], original[leftover + ".lora_A.weight"])
        assert repaired[leftover + ".dora_scale"].shape == (64, 1)
        assert repaired[file_name(KOHYA, ONE_D_MODULE, tiny_sdxl_dir) + ".dora_scale"].dim() == 2

    # The trainer's own loader: the NaN module falls back to the base weight, the zero row stays
    # zero, and the images are real.
    reference, pipe = tiny_pipeline(base_with_zero_row), tiny_pipeline(base_with_zero_row)
    assert load_adapter_into(pipe, fixed) == module_count(path)
    nan_layer = NAN_MODULE.removeprefix("unet.")
    torch.testing.assert_close(pipe.unet.get_submodule(nan_layer).weight,
                               reference.unet.get_submodule(nan_layer).weight,
                               rtol=1e-3, atol=1e-5)  # the magnitude ‖W‖ is stored in fp16
    zero_row = pipe.unet.get_submodule(ZERO_ROW_MODULE.removeprefix("unet.")).weight[0]
    assert torch.equal(zero_row, torch.zeros_like(zero_row))
    assert check_image(generate(pipe)) is None

    if file_format == PEFT:  # diffusers is the judge of the peft format; the damage was real
        assert check_image(generate(with_diffusers_lora(base_with_zero_row, path))).startswith("contains NaN")
        assert check_image(generate(with_diffusers_lora(base_with_zero_row, fixed))) is None


# --- the seed's commands, options and errors -----------------------------------------------------


@pytest.mark.slow
def test_seed_commands_run_unchanged_on_a_trainer_checkpoint(run_output: Path, tiny_sdxl_dir: Path,
                                                             tmp_path: Path) -> None:
    """The original tool's two repair commands for fp16 DoRA black images, word for word, on a
    checkpoint folder the trainer wrote (renamed to their step 250) whose DoRA weights went NaN as
    in an fp16 run (docs/design.md, 'The original tool's NaN post-mortems')."""
    checkpoint = tmp_path / "output" / "checkpoints" / "checkpoint-250"
    shutil.copytree(run_output / "checkpoints" / "checkpoint-1", checkpoint)
    assert debug(str(checkpoint)) == (0, {})
    weights = checkpoint / "pytorch_lora_weights.safetensors"
    rewrite(weights, weights, lambda tensors: tensors[NAN_MODULE + ".lora_B.weight"].fill_(float("nan")))
    modules = module_count(weights)

    found = run_cli("debug_dora_weights.py", "--weights_path", "./output/checkpoints/checkpoint-250", cwd=tmp_path)
    assert found.returncode == 1, found.stdout[-2000:] + found.stderr[-2000:]
    assert f"verdict: PROBLEMS: 1 of {modules} modules damaged" in found.stdout
    assert f"{NAN_MODULE}: non-finite factors" in found.stdout
    fixed = run_cli("fix_dora_weights.py", "--weights_path", "./output/checkpoints/checkpoint-250", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]
    assert "removed: its DoRA magnitude needs the base weight's norms" in fixed.stdout

    output = checkpoint / "pytorch_lora_weights_fixed.safetensors"
    assert debug(str(output)) == (0, {})
    with warnings.catch_warnings():  # no "missing keys" or "target modules" complaints either
        warnings.simplefilter("error", RuntimeWarning)
        pipe = with_diffusers_lora(tiny_sdxl_dir, output)
    assert check_image(generate(pipe)) is None


@pytest.mark.slow
def test_from_checkpoint_restores_broken_modules(run_output: Path, tmp_path: Path) -> None:
    earlier = run_output / "checkpoints" / "checkpoint-1"
    nan_key = NAN_MODULE + ".lora_B.weight"
    path = rewrite(adapter_path(run_output, PEFT), tmp_path / "final.safetensors",
                   lambda tensors: tensors[nan_key].fill_(float("nan")))
    assert fix_dora_weights.main(["--weights_path", str(path), "--from-checkpoint", str(earlier)]) == 0
    fixed = load_file(tmp_path / "final_fixed.safetensors")
    good = load_file(earlier / "pytorch_lora_weights.safetensors")
    for role in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector.weight"):
        assert torch.equal(fixed[f"{NAN_MODULE}.{role}"], good[f"{NAN_MODULE}.{role}"])


@pytest.mark.slow
def test_dry_run_writes_nothing_and_in_place_keeps_a_backup(run_output: Path, tmp_path: Path, capsys) -> None:
    path = rewrite(adapter_path(run_output, KOHYA), tmp_path / "my_lora.safetensors",
                   lambda tensors: tensors.update({key: t.flatten() for key, t in tensors.items()
                                                   if key.endswith(".dora_scale")}))
    original = path.read_bytes()
    assert fix_dora_weights.main(["--weights_path", str(path), "--dry-run"]) == 0
    assert "dry run: would write" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_lora.safetensors"]

    assert fix_dora_weights.main(["--weights_path", str(path), "--in-place"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_lora.bak.safetensors", "my_lora.safetensors"]
    assert (tmp_path / "my_lora.bak.safetensors").read_bytes() == original
    assert debug(str(path)) == (0, {})
    assert fix_dora_weights.main(["--weights_path", str(path), "--in-place"]) == 0  # clean: nothing to do
    assert "nothing to repair" in capsys.readouterr().out


@pytest.mark.slow
def test_magnitude_outliers_are_clamped_only_when_asked(run_output: Path, tmp_path: Path) -> None:
    key = ZERO_MAGNITUDE_MODULE + ".lora_magnitude_vector.weight"
    path = rewrite(adapter_path(run_output, PEFT), tmp_path / "a.safetensors", lambda tensors: tensors[key].mul_(50))
    base = BaseWeights(TINY)
    report = analyse_file(path, base)
    assert [(module.label, [f.kind for f in module.findings]) for module in report.damaged] == [
        (ZERO_MAGNITUDE_MODULE, [checks.OUTLIER])]
    assert not analyse_file(path, None).damaged  # it takes the base norms to see it

    plan = plan_repairs(path, RepairOptions(base))
    assert (plan.changed, [finding.kind for _, finding in plan.remaining]) == (0, [checks.OUTLIER])
    options = RepairOptions(base, clamp_outliers=True)
    plan = plan_repairs(path, options)
    assert (plan.changed, plan.remaining) == (1, [])
    write_repaired(plan, tmp_path / "fixed.safetensors", options, backup=None)
    assert not analyse_file(tmp_path / "fixed.safetensors", base).damaged


@pytest.mark.slow
def test_unreadable_input_exits_2_with_one_line(tmp_path: Path, tiny_sdxl_dir: Path, capsys) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "model.ckpt").write_bytes(b"pickle")
    save_file({"lora_unet_x.oft_blocks": torch.zeros(2, 2)}, tmp_path / "oft.safetensors")  # LyCORIS's OFT
    for path in (tmp_path / "missing", tmp_path / "junk.safetensors", tmp_path / "model.ckpt", tmp_path,
                 tmp_path / "oft.safetensors", tiny_sdxl_dir / "unet" / "diffusion_pytorch_model.safetensors"):
        for main in (debug_dora_weights.main, fix_dora_weights.main):
            assert main(["--weights_path", str(path)]) == 2
            error = capsys.readouterr().err.strip()
            assert error.startswith("error: ") and str(path) in error and "\n" not in error


@pytest.mark.slow
def test_folders_resolve_to_the_trainer_files(run_output: Path, tmp_path: Path) -> None:
    files, _ = adapter_files(run_output)
    assert [p.name for p in files] == ["pytorch_lora_weights.safetensors", f"{RUN_NAME}_kohya.safetensors"]
    interrupted = tmp_path / "run"  # no final files yet: the newest checkpoint is used
    shutil.copytree(run_output / "checkpoints", interrupted / "checkpoints")
    files, how = adapter_files(interrupted)
    assert files == [interrupted / "checkpoints" / "checkpoint-1" / "pytorch_lora_weights.safetensors"]
    assert "newest checkpoint" in how
    with pytest.raises(AdapterFileError, match="no adapter file"):
        adapter_files(tmp_path / "run" / "checkpoints")


# --- memory ----------------------------------------------------------------------------------------


def write_sdxl_sized_dora(path: Path, rank: int) -> int:
    """A kohya DoRA file with full-size SDXL UNet transformer modules (722, sgm names, fp16 random
    factors), streamed to disk; returns its size in bytes."""
    modules = []
    for block, width, depth in (("input_blocks_4_1", 640, 2), ("input_blocks_5_1", 640, 2),
                                ("input_blocks_7_1", 1280, 10), ("input_blocks_8_1", 1280, 10),
                                ("middle_block_1", 1280, 10), *[(f"output_blocks_{i}_1", 1280, 10) for i in (0, 1, 2)],
                                *[(f"output_blocks_{i}_1", 640, 2) for i in (3, 4, 5)]):
        prefix = f"lora_unet_{block}_"
        modules += [(prefix + "proj_in", width, width), (prefix + "proj_out", width, width)]
        for index in range(depth):
            inner = f"{prefix}transformer_blocks_{index}_"
            modules += [(inner + f"attn1_{name}", width, width) for name in ("to_q", "to_k", "to_v", "to_out_0")]
            modules += [(inner + "attn2_to_q", width, width), (inner + "attn2_to_k", 2048, width),
                        (inner + "attn2_to_v", 2048, width), (inner + "attn2_to_out_0", width, width),
                        (inner + "ff_net_0_proj", width, 8 * width), (inner + "ff_net_2", 4 * width, width)]
    specs = []
    for name, fan_in, fan_out in modules:
        specs += [TensorSpec(f"{name}.lora_down.weight", "F16", (rank, fan_in)),
                  TensorSpec(f"{name}.lora_up.weight", "F16", (fan_out, rank)),
                  TensorSpec(f"{name}.alpha", "F16", ()), TensorSpec(f"{name}.dora_scale", "F16", (fan_out, 1))]
    # One block of random values, sliced for every tensor: the scan reads real data, the test
    # does not spend its time drawing 170 million random numbers.
    pool = torch.randn(max(spec.nbytes for spec in specs) // 2, generator=torch.Generator().manual_seed(0))
    pool = (pool * 0.02).half()
    with path.open("wb") as handle, StreamWriter(handle, specs, {}) as writer:
        for spec in specs:
            if spec.name.endswith(".alpha"):
                writer.write(torch.tensor(float(rank), dtype=torch.float16))
                continue
            values = pool[: spec.nbytes // 2].reshape(spec.shape)
            writer.write(values + 1 if spec.name.endswith(".dora_scale") else values)
    assert len(modules) == 722
    return path.stat().st_size


# Runs a script and reports its peak resident set (VmHWM). The kernel's ru_maxrss of a child
# would include the test process it was forked from, which is larger than what is measured.
MEASURE = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    code = exit.code
with open("/proc/self/status") as status:
    print("peak kB", next(line.split()[1] for line in status if line.startswith("VmHWM:")))
sys.exit(code)
"""


def peak_rss_bytes(*args: str) -> tuple[int, int, str]:
    """Run the debugger in a fresh interpreter: (exit code, its peak resident set in bytes, output)."""
    result = subprocess.run([sys.executable, "-c", MEASURE, str(ROOT / "debug_dora_weights.py"), *args],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    peak_kb = int(result.stdout.rsplit("peak kB ", 1)[1])
    return result.returncode, peak_kb * 1024, result.stdout


@pytest.mark.slow
def test_scanning_a_large_file_needs_far_less_memory_than_its_size(run_output: Path, tmp_path: Path) -> None:
    big = tmp_path / "sdxl_dora_rank64.safetensors"
    size = write_sdxl_sized_dora(big, rank=64)
    code, baseline, _ = peak_rss_bytes("--weights_path", str(adapter_path(run_output, KOHYA)))
    assert code == 0
    code, peak, output = peak_rss_bytes("--weights_path", str(big), "--problems-only")
    assert code == 0, output[-2000:]
    assert "verdict: clean: 722 modules" in output
    print(f"file {size / 1e6:.0f} MB; peak RSS {peak / 1e6:.0f} MB, baseline {baseline / 1e6:.0f} MB "
          f"(the same script on a 1 MB file), scan {(peak - baseline) / 1e6:.0f} MB")
    assert 300e6 < size < 600e6
    assert peak - baseline < 0.5 * size
