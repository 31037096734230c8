"""The same script under `accelerate launch` with two CPU processes (gloo): it finishes, the ranks
agree, the result equals one process with the same global batch, only one set of outputs is
written, and a 2-process resume reaches the 2-process result. Also the 2-process runs of other
modules' subjects (each optimizer; LoKr with EMA and live eval), here to share this module's launch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    ROOT,
    accelerate_launch,
    accelerate_launch_runs,
    cpu_launch_args,
    forked_launch,
    free_port,
    tiny_config,
    train_args,
    train_here,
    write_config,
)
from tests.test_lycoris_adapters import lycoris_config
from tests.test_optimizers import NEW_OPTIMIZERS, optimizer_config
from tests.test_output_preservation import KEPT

pytestmark = pytest.mark.slow  # every test here trains (make test-fast leaves them out)

PROMPTS = str(ROOT / "tests" / "eval_prompts.three.json")


LAUNCH_TWO = cpu_launch_args(2)


def launch_two(config_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Two processes training as `accelerate launch LAUNCH_TWO` starts them (forked: helpers.forked_launch)."""
    return forked_launch(config_path, *overrides)


def config_for(tmp_path: Path, per_process_batch: int, **training) -> dict:
    config = tiny_config(tmp_path, training={"num_steps": 6, "log_every": 1, "checkpoint_every": 3, **training})
    config["data"]["bucket"]["batch_size"] = per_process_batch
    config["data"].update({"caption_dropout_prob": 0.2, "random_flip": True})
    return config


def optimizer_run_config(tmp_path: Path, kind: str) -> dict:
    """4 steps of `kind`; schedule-free also switches to its averaged weights for a live eval and back."""
    config = optimizer_config(tmp_path, kind, num_steps=4, log_every=1)
    if kind == "adamw_schedulefree":
        config["eval"] = {"num_inference_steps": 2, "prompts_path": PROMPTS, "width": 64, "height": 64,
                          "live": {"enabled": True, "every_n_steps": 2, "max_batches": 1}}
    return config


def lokr_ema_config(tmp_path: Path) -> dict:
    config = lycoris_config(tmp_path, "lokr", num_steps=4, log_every=1, ema_update_every=1)
    config["model"] |= {"use_ema": True, "ema_decay": 0.5}
    config["eval"] = {"num_inference_steps": 2, "prompts_path": PROMPTS, "width": 64, "height": 64,
                      "live": {"enabled": True, "every_n_steps": 2, "max_batches": 1}}
    config["export"] = {"save_single_file": False, "adapter_formats": ["diffusers"]}
    return config


def ddp_config(tmp_path: Path, fused: bool, **training) -> dict:
    """`two_process_run`'s config (DoRA on the UNet and CLIP-L, AdamW, a final eval), with or
    without fused backward."""
    config = config_for(tmp_path, per_process_batch=1, **training)
    config["eval"] = {"num_inference_steps": 2, "prompts_path": PROMPTS, "width": 64, "height": 64,
                      "final": {"enabled": True, "max_batches": 2}}
    config["optimizer"]["fused_backward"] = fused
    return config


@pytest.fixture(scope="module")
def two_process_launch(tmp_path_factory: pytest.TempPathFactory,
                       tiny_sdxl_dir: Path) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The 2-process runs that need no launch of their own, one after another in the same two
    processes (forked from this one, as `accelerate launch` starts them: helpers.launch_forked):
    a 6-step run, its resume from the checkpoint at step 3, their
    twins with fused backward, each optimizer's run, the LoKr run and one with output preservation.
    Each run's folder and result."""
    names = ("ddp", "resumed", "fused", "fused_resumed", *NEW_OPTIMIZERS, "lokr", "preserved")
    folders = {name: tmp_path_factory.mktemp(name) for name in names}
    straight = ddp_config(folders["ddp"], fused=False)
    checkpoint = folders["ddp"] / "out" / "test_run" / "checkpoints" / "checkpoint-3"
    fused_checkpoint = folders["fused"] / "out" / "test_run" / "checkpoints" / "checkpoint-3"
    configs = {"ddp": straight, "resumed": config_for(folders["resumed"], 1, resume_from=str(checkpoint)),
               "fused": ddp_config(folders["fused"], fused=True),
               "fused_resumed": ddp_config(folders["fused_resumed"], fused=True, resume_from=str(fused_checkpoint)),
               **{kind: optimizer_run_config(folders[kind], kind) for kind in NEW_OPTIMIZERS},
               "lokr": lokr_ema_config(folders["lokr"]),
               "preserved": config_for(folders["preserved"], 1, num_steps=4, output_preservation=KEPT)}
    runs = {name: train_args(write_config(folders[name] / "c.json", config)) for name, config in configs.items()}
    results = accelerate_launch_runs(LAUNCH_TWO, runs, folders["ddp"] / "results", forked=True)
    return {name: (folders[name], results[name]) for name in runs}


@pytest.fixture(scope="module")
def two_process_run(two_process_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> Path:
    tmp_path, result = two_process_launch["ddp"]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 processes held identical weights at all 6 checks" in result.stdout  # after every step
    assert result.stdout.count("completed: 6 steps") == 1
    assert "global batch 2 = 1 per process x 2 process(es) x 1 accumulation" in result.stdout
    return tmp_path


def test_two_processes_write_one_set_of_outputs(two_process_run: Path) -> None:
    assert [p.name for p in (two_process_run / "out").iterdir()] == ["test_run"]
    assert len(list((two_process_run / "tb" / "test_run").glob("events.*"))) == 1
    final = two_process_run / "out" / "test_run" / "eval" / "final"
    assert sorted(p.name for p in final.glob("*.png")) == [
        "00_tok-a-red-circle-blue-background.png", "01_tok-a-yellow-triangle-purple-background.png", "grid.png"]
    summary = json.loads((two_process_run / "out" / "test_run" / "run_summary.json").read_text())
    assert summary["status"] == "completed"


def test_two_processes_match_one_process_with_the_same_global_batch(two_process_run: Path, tmp_path: Path) -> None:
    single = config_for(tmp_path, per_process_batch=2)
    result = train_here("--config", str(write_config(tmp_path / "c.json", single)))
    assert result.returncode == 0, result.stderr[-3000:]
    two = load_file(two_process_run / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    one = load_file(tmp_path / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    assert two.keys() == one.keys()
    moved = [key for key in one if "lora_B" in key and one[key].abs().max() > 0]
    assert moved, "the adapter must have trained"
    # Same samples, same noise; only the summation order of the gradients differs (per-rank means
    # averaged vs one mean). Adam's normalised steps of ~lr=1e-3 carry that rounding into the
    # weights: the measured worst case after 6 steps is ~1.2e-5, against ~6e-3 of movement.
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-3, atol=5e-5)


def test_two_process_resume_reaches_the_uninterrupted_weights(
        two_process_run: Path, two_process_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    tmp_path, result = two_process_launch["resumed"]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resume: from" in result.stdout and "at step 3" in result.stdout
    straight = load_file(two_process_run / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    again = load_file(tmp_path / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(straight[key], again[key]) for key in straight)


@pytest.mark.parametrize("kind", NEW_OPTIMIZERS)
def test_two_processes_stay_identical(
        kind: str, two_process_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    """Under DDP every rank must hold the same weights (checked every step). Schedule-free switches
    every process to its averaged weights for a live eval and back; Prodigy's estimate of the step
    size comes from the all-reduced gradients, so it is the same on every rank."""
    result = two_process_launch[kind][1]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 processes held identical weights at all 4 checks" in result.stdout


def test_lokr_with_ema_and_live_eval_keeps_two_processes_identical(
        two_process_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    """DDP, EMA and eval treat a LoKr adapter as they treat LoRA: every rank holds the same weights
    at every step, the live eval renders valid images, and the final weights are the EMA's."""
    tmp_path, result = two_process_launch["lokr"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 processes held identical weights at all 4 checks" in result.stdout
    assert "final weights: EMA of the trained weights" in result.stdout
    output = tmp_path / "out" / "test_run"
    assert sorted(p.name for p in (output / "eval" / "live" / "step_2").iterdir())[-1] == "grid.png"
    assert not list(output.rglob("*_INVALID.png"))


def test_output_preservation_keeps_two_processes_identical(
        two_process_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    """The preservation pass runs the DDP-wrapped UNet a second and third time in a step (once
    without gradients, its adapters off): each rank's gradient from it must still be all-reduced,
    or the ranks, each with its own image, would drift apart."""
    result = two_process_launch["preserved"][1]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "output preservation: captions holding 'cross'" in result.stdout
    assert "2 processes held identical weights at all 4 checks" in result.stdout


def test_ctrl_c_under_accelerate_launch_saves_a_checkpoint_that_two_processes_resume(tmp_path: Path,
                                                                                      tiny_sdxl_dir: Path) -> None:
    """Ctrl-C in a terminal signals the launcher's process group; the launcher passes it on to
    the training processes, which agree on the step, save one checkpoint and exit."""
    config_path = write_config(tmp_path / "c.json", config_for(tmp_path, per_process_batch=1, num_steps=400,
                                                                checkpoint_every=1000))
    command = [sys.executable, "-m", "accelerate.commands.launch", *LAUNCH_TWO, "--main_process_port",
               str(free_port()), str(ROOT / "train_sdxl.py"), "--config", str(config_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not list((tmp_path / "tb" / "test_run").glob("events.*")):
        time.sleep(0.1)
    time.sleep(3.0)  # well into training
    os.killpg(launcher.pid, signal.SIGINT)
    stdout, stderr = launcher.communicate(timeout=300)
    assert stdout.count("interrupted: checkpoint saved at step ") == 1, stderr[-4000:]
    step = int(stdout.split("checkpoint saved at step ")[1].split(".")[0])
    assert 0 < step < 400
    hint = stdout.split("Resume with the same `accelerate launch` options (2 processes) and:\n")[1].splitlines()[0]
    assert f"training.resume_from={tmp_path / 'out' / 'test_run' / 'checkpoints' / f'checkpoint-{step}'}" in hint

    resumed = launch_two(config_path, f"training.resume_from={hint.split('training.resume_from=')[1]}",
                         f"training.num_steps={step + 2}")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"at step {step} " in resumed.stdout and f"completed: {step + 2} steps" in resumed.stdout


def test_the_wait_timeout_reaches_the_process_group(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """While the main process loads the model and encodes the latents, the other waits at a
    barrier for longer than 0.6 s: the run fails with torch's timeout message naming 600ms (the
    wait itself, or the start-up rendezvous if the processes start far apart)."""
    config = config_for(tmp_path, per_process_batch=1, distributed_timeout_minutes=0.01)
    # Launched for real: forked processes, with nothing left to import, are through the loading in 0.6 s.
    result = accelerate_launch(LAUNCH_TWO, write_config(tmp_path / "c.json", config))
    assert result.returncode != 0
    assert re.search(r"(?i)(timed out|timeout)\b[^\n]*\b600ms", result.stderr), result.stderr[-3000:]


@pytest.mark.parametrize("log_every", [100, 1], ids=["at-the-checkpoint", "at-the-rank-check"])
def test_non_finite_weights_stop_both_processes_and_nothing_is_saved(tmp_path: Path, tiny_sdxl_dir: Path,
                                                                     log_every: int) -> None:
    """NaN in the second process's weights after step 2 (finite gradients): both processes stop
    together at step 2 (a 30 s wait timeout would show a process left waiting), found by the check
    before the checkpoint or, first, by the rank checksum (as NaN, not as "different weights"); the
    main process does not save its own, finite, copy."""
    config = config_for(tmp_path, per_process_batch=1, checkpoint_every=2, log_every=log_every,
                        distributed_timeout_minutes=0.5)
    result = forked_launch(write_config(tmp_path / "c.json", config),
                           target=(str(ROOT / "tests" / "nan_weights_after_step_2.py"),))
    assert result.returncode != 0
    assert "Timed out" not in result.stderr
    assert "trained tensor(s) hold NaN/Inf: unet." in result.stderr
    assert "training stopped; they were not saved" in result.stderr
    output = tmp_path / "out" / "test_run"
    assert not (output / "checkpoints").exists() and not (output / "pytorch_lora_weights.safetensors").exists()
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["status"] == "aborted: non-finite weights" and summary["steps"] == 2


# ------------------------------------------------------------------------- fused backward
@pytest.fixture(scope="module")
def fused_two_process_run(two_process_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> Path:
    tmp_path, result = two_process_launch["fused"]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 processes held identical weights at all 6 checks" in result.stdout  # after every step
    assert "fused backward: each tensor is stepped in backward" in result.stdout
    return tmp_path / "out" / "test_run"


def test_fused_backward_under_ddp_equals_ddp_bit_for_bit(fused_two_process_run: Path, two_process_run: Path) -> None:
    """Each gradient averaged in its hook (halved, summed across the two processes) is DDP's bucket
    average, and AdamW's step of it the ordinary step: `two_process_run`'s weights, bit for bit."""
    fused = load_file(fused_two_process_run / "pytorch_lora_weights.safetensors")
    ordinary = load_file(two_process_run / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    assert fused.keys() == ordinary.keys()
    assert any("lora_B" in key and ordinary[key].abs().max() > 0 for key in ordinary)  # it trained
    assert [key for key in fused if not torch.equal(fused[key], ordinary[key])] == []


def test_fused_backward_under_ddp_resumes_bit_for_bit(
        fused_two_process_run: Path, two_process_launch: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    tmp_path, result = two_process_launch["fused_resumed"]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "at step 3" in result.stdout
    straight = load_file(fused_two_process_run / "pytorch_lora_weights.safetensors")
    again = load_file(tmp_path / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    assert straight.keys() == again.keys()
    assert [key for key in straight if not torch.equal(straight[key], again[key])] == []


def test_a_non_finite_gradient_in_one_process_stops_both_under_fused_backward(tmp_path: Path,
                                                                              tiny_sdxl_dir: Path) -> None:
    """NaN in the second process's gradients at step 2 (its loss finite): the averaged gradient
    both processes see is NaN, so both stop at the same tensor, and nothing is saved."""
    config = ddp_config(tmp_path, fused=True, checkpoint_every=2, distributed_timeout_minutes=0.5)
    result = forked_launch(write_config(tmp_path / "c.json", config),
                           target=(str(ROOT / "tests" / "nan_gradient_on_rank_1.py"),))
    assert result.returncode != 0
    assert "Timed out" not in result.stderr
    reports = re.findall(r"fused backward: first at (\S+);[^\n]* at step (\d+) ", result.stderr)
    assert len(reports) == 2 and reports[0] == reports[1], result.stderr[-4000:]  # both processes, one tensor
    assert reports[0][1] == "2"
    output = tmp_path / "out" / "test_run"
    assert not (output / "checkpoints").exists() and not (output / "pytorch_lora_weights.safetensors").exists()
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["status"] == "aborted: non-finite loss or gradients" and summary["steps"] == 1
