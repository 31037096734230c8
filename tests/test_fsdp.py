"""Full fine-tuning sharded with FSDP2 over two CPU processes, launched with the example
accelerate config of docs/multi-gpu.md (`configs/accelerate_fsdp.yaml`) through
`tests/fsdp_on_cpu.py`: the whole weights are gathered for saving and eval, the result equals one
process with the same global batch, and resume is exact (also from a one-process checkpoint)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdxl_trainer.config import ConfigError, load_config
from sdxl_trainer.distributed import check_launch
from tests.helpers import ROOT, accelerate_launch_runs, run_cli, tiny_config, train_args, train_here, write_config

UNET_FILE = Path("unet") / "diffusion_pytorch_model.safetensors"
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


FSDP_LAUNCH = ["--config_file", str(ROOT / "configs" / "accelerate_fsdp.yaml"), "--num_processes", "2"]
ON_CPU = (str(ROOT / "tests" / "fsdp_on_cpu.py"),)


def full_config(tmp_path: Path, per_process_batch: int, **training) -> dict:
    config = tiny_config(tmp_path, adapter={"type": "none"},
                         training={"num_steps": 4, "log_every": 1, "checkpoint_every": 2, "lr_unet": 1e-4, **training},
                         # eps 1e-5: Adam's step for a near-zero gradient then follows the gradient instead of
                         # amplifying its rounding, so shards vs one process compare to ~1e-7, not ~1e-4.
                         optimizer={"type": "adamw", "eps": 1e-5})
    config["model"].update({"train_text_encoder_1": False, "use_gradient_checkpointing": True})
    config["data"]["bucket"]["batch_size"] = per_process_batch
    return config


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory, tiny_sdxl_dir: Path) -> Path:
    tmp_path = tmp_path_factory.mktemp("one")
    result = train_here("--config", str(write_config(tmp_path / "c.json", full_config(tmp_path, 2))))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "out" / "test_run"


@pytest.fixture(scope="module")
def fsdp_launch(tmp_path_factory: pytest.TempPathFactory,
                one_process_run: Path) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The module's FSDP runs one after another in one launch (one launch's imports): a 4-step run
    with eval and a single file, its resume from step 2, the one-process run's resume from step 2
    (with ACCELERATE_MIXED_PRECISION=bf16, the one variable `--mixed_precision bf16` would change
    in the processes), and a bf16 run. Each run's output folder and result."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("fsdp", "resumed", "from_one", "bf16")}
    config = full_config(folders["fsdp"], per_process_batch=1)
    config["eval"] = {"num_inference_steps": 2, "prompts_path": str(ROOT / "tests" / "eval_prompts.three.json"),
                      "width": 64, "height": 64, "live": {"enabled": True, "every_n_steps": 2, "max_batches": 1},
                      "final": {"enabled": True, "max_batches": 2}}
    config["export"]["save_single_file"] = True
    checkpoint = folders["fsdp"] / "out" / "test_run" / "checkpoints" / "checkpoint-2"
    configs = {"fsdp": config, "resumed": full_config(folders["resumed"], 1, resume_from=str(checkpoint)),
               "from_one": full_config(folders["from_one"], 1,
                                       resume_from=str(one_process_run / "checkpoints" / "checkpoint-2")),
               "bf16": full_config(folders["bf16"], 1, num_steps=2, mixed_precision="bf16")}
    configs["bf16"]["model"]["weights_dtype"] = "bf16"
    runs = {name: train_args(write_config(folders[name] / "c.json", value)) for name, value in configs.items()}
    results = accelerate_launch_runs(FSDP_LAUNCH, runs, folders["fsdp"] / "results", target=ON_CPU,
                                     env={"from_one": {"ACCELERATE_MIXED_PRECISION": "bf16"}})
    return {name: (folders[name] / "out" / "test_run", results[name]) for name in runs}


@pytest.fixture(scope="module")
def fsdp_run(fsdp_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> Path:
    output, result = fsdp_launch["fsdp"]
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("completed: 4 steps") == 1
    assert "FSDP: each of 2 processes holds 1.55M of the 3.09M trained parameters (50%)" in result.stdout
    return output


@pytest.mark.slow
def test_fsdp_saves_whole_weights_and_one_set_of_outputs(fsdp_run: Path, tiny_sdxl_dir: Path) -> None:
    base = load_file(tiny_sdxl_dir / UNET_FILE)
    for folder in (fsdp_run, fsdp_run / "checkpoints" / "checkpoint-2"):
        saved = load_file(folder / UNET_FILE)
        assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in base.items()}
    assert (fsdp_run.parent / "safetensors" / "test_run.safetensors").is_file()
    for folder, count in (("live/step_2", 1), ("live/step_4", 1), ("final", 2)):
        assert len(list((fsdp_run / "eval" / folder).glob("0*.png"))) == count, folder
    assert json.loads((fsdp_run / "run_summary.json").read_text())["status"] == "completed"
    assert len(list((fsdp_run.parent.parent / "tb" / "test_run").glob("events.*"))) == 1


@pytest.mark.slow
def test_fsdp_matches_one_process_with_the_same_global_batch(fsdp_run: Path, one_process_run: Path,
                                                               tiny_sdxl_dir: Path) -> None:
    sharded, single = load_file(fsdp_run / UNET_FILE), load_file(one_process_run / UNET_FILE)
    base = load_file(tiny_sdxl_dir / UNET_FILE)
    assert max((single[key] - base[key]).abs().max().item() for key in base) > 1e-4, "the UNet must have trained"
    # Same samples and noise; only the summation order of the gradients differs (measured: 4.8e-7).
    for key in single:
        torch.testing.assert_close(sharded[key], single[key], rtol=0, atol=2e-6)


@pytest.mark.slow
def test_fsdp_resume_reaches_the_uninterrupted_weights(
        fsdp_run: Path, fsdp_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    output, result = fsdp_launch["resumed"]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "at step 2" in result.stdout
    straight, again = load_file(fsdp_run / UNET_FILE), load_file(output / UNET_FILE)
    assert all(torch.equal(straight[key], again[key]) for key in straight)


@pytest.mark.slow
def test_one_process_checkpoint_continues_under_fsdp(
        one_process_run: Path, fsdp_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    """The optimizer state saved without sharding (keyed by position) is resharded by name. The
    run also asks accelerate for bf16 (ACCELERATE_MIXED_PRECISION, what `accelerate launch
    --mixed_precision bf16` sets): ignored (fp32 is configured), or the weights would differ by
    bf16 rounding (~1e-3), far beyond the tolerance."""
    output, result = fsdp_launch["from_one"]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "accelerate's mixed_precision=bf16 is ignored" in result.stdout
    single, continued = load_file(one_process_run / UNET_FILE), load_file(output / UNET_FILE)
    for key in single:
        torch.testing.assert_close(continued[key], single[key], rtol=0, atol=2e-6)


@pytest.mark.slow
def test_fsdp_checkpoint_continues_in_one_process(fsdp_run: Path, one_process_run: Path, tmp_path: Path) -> None:
    """The gathered optimizer state (keyed by name) loads into an unsharded optimizer."""
    config = full_config(tmp_path, 2, resume_from=str(fsdp_run / "checkpoints" / "checkpoint-2"))
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-3000:]
    single, continued = load_file(one_process_run / UNET_FILE), load_file(tmp_path / "out" / "test_run" / UNET_FILE)
    for key in single:
        torch.testing.assert_close(continued[key], single[key], rtol=0, atol=2e-6)


@pytest.mark.slow
def test_fsdp_trains_bf16_weights_with_stochastic_rounding(
        fsdp_launch: dict[str, tuple[Path, subprocess.CompletedProcess]], tiny_sdxl_dir: Path) -> None:
    output, result = fsdp_launch["bf16"]
    assert result.returncode == 0, result.stderr[-4000:]
    trained, base = load_file(output / UNET_FILE), load_file(tiny_sdxl_dir / UNET_FILE)
    assert {tensor.dtype for tensor in trained.values()} == {torch.bfloat16}
    assert all(torch.isfinite(tensor).all() for tensor in trained.values())
    # lr 1e-4 is far below bf16's spacing for most weights: round-to-nearest would leave them all
    # unchanged; stochastic rounding moves a good share of them.
    changed = sum((trained[key] != base[key].bfloat16()).sum().item() for key in base)
    assert changed > 0.1 * sum(tensor.numel() for tensor in base.values())


@pytest.mark.parametrize(("settings", "environ", "named"), [
    ({"adapter": {"type": "dora"}}, FSDP_ENV, "adapter.type"),
    ({"model": {"train_text_encoder_1": True}}, FSDP_ENV, "model.train_text_encoder_1"),
    ({"model": {"use_ema": True}}, FSDP_ENV, "model.use_ema"),
    ({"training": {"mixed_precision": "fp16"}}, FSDP_ENV, "training.mixed_precision"),
    ({"optimizer": {"type": "adamw8bit"}}, FSDP_ENV, "optimizer.type"),
    ({}, {**FSDP_ENV, "FSDP_VERSION": "1"}, "fsdp_version: 2"),
    ({}, {"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed is not supported"),
])
def test_fsdp_refuses_what_it_does_not_support(tmp_path: Path, settings: dict, environ: dict, named: str) -> None:
    config = full_config(tmp_path, 1)
    for section, values in settings.items():
        config[section].update(values)
    with pytest.raises(ConfigError, match=named):
        check_launch(load_config(write_config(tmp_path / "c.json", config)), environ)


def test_fsdp_accepts_a_full_fine_tune_and_plain_launches_accept_adapters(tmp_path: Path) -> None:
    check_launch(load_config(write_config(tmp_path / "full.json", full_config(tmp_path, 1))), FSDP_ENV)
    check_launch(load_config(write_config(tmp_path / "dora.json", tiny_config(tmp_path))), {})


@pytest.mark.slow
def test_unsupported_fsdp_launch_stops_before_loading_with_exit_2(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "c.json", tiny_config(tmp_path))  # DoRA
    result = run_cli("train_sdxl.py", "--config", str(config_path), env=FSDP_ENV)
    assert result.returncode == 2
    assert "under FSDP: adapter.type" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
