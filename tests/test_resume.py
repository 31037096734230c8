"""Checkpoints and exact resume: stop anywhere, resume, and get the same weights; a crash while
writing never costs the previous checkpoint; Ctrl-C saves and says how to continue."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_sdxl
from sdxl_trainer.checkpointing import Position, load_state
from tests.helpers import NO_MEMORY_PLAN, ROOT, run_cli, tiny_config, train_here, write_config


def resumable_config(tmp_path: Path, adapter_type: str, **training) -> dict:
    """Buckets, caption dropout and shuffle, EMA, gradient accumulation and SGDR restarts."""
    config = tiny_config(
        tmp_path, adapter={"type": adapter_type},
        model={"use_ema": True, "ema_decay": 0.8},
        training={"num_steps": 8, "checkpoint_every": 3, "grad_accum_steps": 2, "ema_update_every": 2,
                  "lr_unet": 1e-3 if adapter_type != "none" else 1e-4,
                  "lr_scheduler": {"type": "cosine_restarts", "warmup_steps": 2, "min_factor": 0.2,
                                   "cycle_steps": 2, "cycle_mult": 2.0}, **training},
    )
    config["data"].update({"caption_dropout_prob": 0.3, "caption_shuffle_prob": 0.5, "random_flip": True})
    return config


def final_weights(output: Path) -> dict[str, torch.Tensor]:
    files = [output / "pytorch_lora_weights.safetensors"] if (output / "pytorch_lora_weights.safetensors").exists() \
        else sorted(output.glob("*/*.safetensors"))
    weights = {}
    for path in files:
        weights.update({f"{path.parent.name}/{key}": value for key, value in load_file(path).items()})
    return weights


def optimizer_tensors(state_path: Path) -> dict[str, torch.Tensor]:
    state = load_state(state_path).snapshot.optimizer["state"]
    return {f"{index}/{name}": value for index, entry in state.items() for name, value in entry.items()
            if isinstance(value, torch.Tensor)}


@pytest.mark.slow
@pytest.mark.parametrize("adapter_type", ["dora", "none"])
def test_stop_and_resume_gives_bit_identical_weights(tmp_path: Path, tiny_sdxl_dir: Path, adapter_type: str) -> None:
    """The straight run trains in this process; DoRA's resume starts a fresh interpreter, as a resume
    does in real life (nothing carried over in memory), the full fine-tune's resumes here."""
    straight = resumable_config(tmp_path / "straight", adapter_type)
    result = train_here("--config", str(write_config(tmp_path / "straight.json", straight)))
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = tmp_path / "straight" / "out" / "test_run" / "checkpoints" / "checkpoint-3"
    position = load_state(checkpoint / "trainer_state.pt").snapshot.position
    assert position == Position(step=3, epoch=0, batches_in_epoch=6)  # inside the first epoch of 9 batches

    resumed = resumable_config(tmp_path / "resumed", adapter_type, resume_from=str(checkpoint))
    args = ("--config", str(write_config(tmp_path / "resumed.json", resumed)))
    result = run_cli("train_sdxl.py", *args) if adapter_type == "dora" else train_here(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resume: from" in result.stdout and "at step 3 (epoch 0, batch 6 of it)" in result.stdout

    first = final_weights(tmp_path / "straight" / "out" / "test_run")
    second = final_weights(tmp_path / "resumed" / "out" / "test_run")
    assert first.keys() == second.keys() and len(first) > 10
    assert [key for key in first if not torch.equal(first[key], second[key])] == []
    first_opt = optimizer_tensors(tmp_path / "straight" / "out" / "test_run" / "trainer_state.pt")
    second_opt = optimizer_tensors(tmp_path / "resumed" / "out" / "test_run" / "trainer_state.pt")
    assert first_opt.keys() == second_opt.keys() and first_opt
    assert all(torch.equal(first_opt[key], second_opt[key]) for key in first_opt)


@pytest.mark.slow
def test_a_crash_while_writing_keeps_the_previous_checkpoint(tmp_path: Path, tiny_sdxl_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import train_sdxl
    from sdxl_trainer import outputs

    config = tiny_config(tmp_path, training={"num_steps": 6, "checkpoint_every": 2})
    path = write_config(tmp_path / "c.json", config)
    real_save = outputs.save_weights
    calls = []

    def crash_on_second_checkpoint(folder, pipe, trainable):
        calls.append(folder)
        real_save(folder, pipe, trainable)
        if len(calls) == 2:
            raise OSError("disk full (injected while writing checkpoint-4)")

    monkeypatch.setattr(outputs, "save_weights", crash_on_second_checkpoint)
    with pytest.raises(OSError, match="disk full"):
        train_sdxl.main(["--config", str(path)])
    checkpoints = tmp_path / "out" / "test_run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-2"]  # no half-written checkpoint-4
    assert load_state(checkpoints / "checkpoint-2" / "trainer_state.pt").snapshot.position.step == 2

    monkeypatch.setattr(outputs, "save_weights", real_save)
    assert train_sdxl.main(["--config", str(path), "--set", "training.resume_from=latest"]) == 0
    summary = json.loads((tmp_path / "out" / "test_run" / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_loadable_checkpoints(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """Each start is a process of its own, killed at another point of the write cycle."""
    from tests.test_preemptible import Job

    config = tiny_config(tmp_path, training={"num_steps": 400, "checkpoint_every": 1, "checkpoints_total_limit": 3})
    path = write_config(tmp_path / "c.json", config)
    checkpoints = tmp_path / "out" / "test_run" / "checkpoints"
    for delay in (0.0, 0.3, 0.7):  # killed at different points of the write cycle
        start_count = len(list(checkpoints.glob("checkpoint-*"))) if checkpoints.exists() else 0
        job = Job(path)  # resumes from the latest checkpoint, or starts the run while there is none
        job.wait_for(lambda start_count=start_count: checkpoints.exists()
                     and len(list(checkpoints.glob("checkpoint-*"))) > start_count, "a new checkpoint")
        time.sleep(delay)
        job.kill()
        for checkpoint in checkpoints.glob("checkpoint-*"):
            step = load_state(checkpoint / "trainer_state.pt").snapshot.position.step
            assert step == int(checkpoint.name.split("-")[1])
            assert load_file(checkpoint / "pytorch_lora_weights.safetensors")
    latest = max(int(p.name.split("-")[1]) for p in checkpoints.glob("checkpoint-*"))
    result = train_here("--config", str(path), "--set", "training.resume_from=latest",
                        "--set", f"training.num_steps={latest + 2}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {latest} " in result.stdout


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_prints_a_working_resume_command(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """The interrupted run is a process of its own; the command it prints is run as written (its
    interpreter and script checked, its arguments given to `train_sdxl.main` here)."""
    from tests.test_preemptible import STEPS, Job

    config = tiny_config(tmp_path, training={"num_steps": STEPS, "checkpoint_every": 1000})
    job = Job(write_config(tmp_path / "c.json", config), latest=False)
    job.wait_for(lambda: job.steps_done() >= 1, "the first step")  # well into training
    job.process.send_signal(signal.SIGINT)
    assert job.finish() == 130, "".join(job.stderr)[-3000:]
    stdout, stderr = "".join(job.stdout), "".join(job.stderr)
    assert "SIGINT: finishing this step" in stderr
    command = shlex.split(stdout.split("Resume with:\n")[1].strip().splitlines()[0])
    step = int(stdout.split("checkpoint saved at step ")[1].split(".")[0])
    assert 0 < step < STEPS
    assert command[:2] == [sys.executable, str(ROOT / "train_sdxl.py")]
    resumed = train_here(*command[2:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step} " in resumed.stdout
    summary = json.loads((tmp_path / "out" / "test_run" / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS


def test_a_repeated_signal_is_one_request_and_a_later_press_exits_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdxl_trainer.stop_request import StopRequest

    stop = StopRequest()
    try:
        for _ in range(2):  # a launcher passing on the signal it got: the same stop, twice
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
        monkeypatch.setattr(StopRequest, "REPEAT_WINDOW_S", 0.0)  # now "seconds later"
        with pytest.raises(SystemExit) as exited:
            os.kill(os.getpid(), signal.SIGINT)
        assert exited.value.code == 130
        assert signal.getsignal(signal.SIGINT) is stop.previous[signal.SIGINT]  # handlers given back
    finally:
        stop.restore()


@pytest.mark.slow
def test_resume_refuses_another_rank_and_warns_about_another_length(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """A longer run resumed from a shorter one's checkpoint-2 is the straight longer run: with a
    warmup of 1 step both schedules' first two factors are 0 and 1, and from the first step after
    the resume the rate is the new schedule's (not the one the checkpoint was saved with)."""
    config = tiny_config(tmp_path, training={"num_steps": 4, "checkpoint_every": 2,
                                             "lr_scheduler": {"type": "linear_decay", "warmup_steps": 1}})
    path = write_config(tmp_path / "c.json", config)
    assert train_here("--config", str(path)).returncode == 0
    straight = train_here("--config", str(path), "--set", "training.num_steps=8", "--set", "run.name=straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    checkpoint = tmp_path / "out" / "test_run" / "checkpoints" / "checkpoint-2"

    other_rank = train_here("--config", str(path), "--set", f"training.resume_from={checkpoint}",
                         "--set", "adapter.rank=8")
    assert other_rank.returncode == 2
    assert "cannot resume: the run differs in adapter.rank: 4 then, 8 now" in other_rank.stderr

    longer = []
    for name in ("longer", "again"):
        result = train_here("--config", str(path), "--set", f"training.resume_from={checkpoint}",
                         "--set", "training.num_steps=8", "--set", f"run.name={name}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "total_steps changed: the run length changed: the LR schedule follows the new length" in result.stdout
        longer.append(load_state(tmp_path / "out" / name / "trainer_state.pt").snapshot)
    # Deterministically the new schedule: after 8 of 8 steps linear decay reaches min_factor 0.
    assert longer[0].lr_scheduler["_last_lr"] == [pytest.approx(0.0), pytest.approx(0.0)]
    assert longer[0].lr_scheduler["last_epoch"] == 8
    first = load_file(tmp_path / "out" / "longer" / "pytorch_lora_weights.safetensors")
    second = load_file(tmp_path / "out" / "again" / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(first[key], second[key]) for key in first)
    eight = load_file(tmp_path / "out" / "straight" / "pytorch_lora_weights.safetensors")
    assert [key for key in first if not torch.equal(first[key], eight[key])] == []

    other_schedule = train_here("--config", str(path), "--set", f"training.resume_from={checkpoint}", "--set",
                                'training.lr_scheduler={"type": "cosine_decay"}', "--dry-run", *NO_MEMORY_PLAN)
    assert other_schedule.returncode == 0, other_schedule.stderr[-3000:]
    assert "warning: lr_scheduler changed: the LR schedule changed" in other_schedule.stdout


@pytest.mark.slow
def test_a_changed_learning_rate_and_weight_decay_apply_on_resume(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """Users lower the rate mid-run to tame a divergence: the config's values win over the
    checkpoint's, the start says so, and the weights differ from a resume without the change."""
    schedule = {"type": "linear_decay", "min_factor": 0.5}

    def run(name: str, weight_decay: float = 0.01, **training) -> subprocess.CompletedProcess:
        config = tiny_config(tmp_path / name, adapter={"type": "lora"}, model={"train_text_encoder_1": False},
                             optimizer={"type": "adamw", "weight_decay": weight_decay},
                             training={"num_steps": 4, "checkpoint_every": 2, "lr_scheduler": schedule, **training})
        result = train_here("--config", str(write_config(tmp_path / f"{name}.json", config)))
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    run("straight")
    checkpoint = str(tmp_path / "straight" / "out" / "test_run" / "checkpoints" / "checkpoint-2")
    unchanged = run("unchanged", resume_from=checkpoint)
    assert "resume: the config changes" not in unchanged.stdout
    lowered = run("lowered", weight_decay=0.1, resume_from=checkpoint, lr_unet=2e-4)
    assert "resume: the config changes unet learning rate: 0.001 → 0.0002" in lowered.stdout
    assert "resume: the config changes unet weight_decay: 0.01 → 0.1" in lowered.stdout
    state = load_state(tmp_path / "lowered" / "out" / "test_run" / "trainer_state.pt").snapshot
    (group,) = state.optimizer["param_groups"]
    # After step 4 of 4 the linear decay is at its floor: the factor 0.5 times the new base rate.
    assert group["initial_lr"] == 2e-4 and group["lr"] == pytest.approx(1e-4) and group["weight_decay"] == 0.1
    assert state.lr_scheduler["base_lrs"] == [2e-4]
    straight = final_weights(tmp_path / "straight" / "out" / "test_run")
    same, low = (final_weights(tmp_path / name / "out" / "test_run") for name in ("unchanged", "lowered"))
    assert all(torch.equal(same[key], straight[key]) for key in same)
    assert [key for key in same if not torch.equal(same[key], low[key])]


def finished_run(tmp_path: Path, **training) -> Path:
    """A config resuming from `latest`, after a run of it that completed (checkpoints every 2 steps)."""
    config = tiny_config(tmp_path, training={"checkpoint_every": 2, "resume_from": "latest", **training})
    path = write_config(tmp_path / "c.json", config)
    assert train_sdxl.main(["--config", str(path)]) == 0
    return path


@pytest.mark.slow
def test_latest_on_a_completed_run_says_so_and_touches_nothing(tmp_path: Path, tiny_sdxl_dir: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    path = finished_run(tmp_path, num_steps=4)
    files = [file for file in sorted(tmp_path.rglob("*")) if file.is_file()]
    before = {file: (file.stat().st_mtime_ns, file.read_bytes()) for file in files}
    assert any(file.name == "pytorch_lora_weights.safetensors" for file in files) and len(files) > 20
    capsys.readouterr()
    assert train_sdxl.main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"resume: latest: the run in {tmp_path / 'out' / 'test_run'} completed all 4 steps; "
                     "nothing to do") == 1
    assert "seed: " not in out  # stopped before loading anything
    after = [file for file in sorted(tmp_path.rglob("*")) if file.is_file()]
    assert after == files and {file: (file.stat().st_mtime_ns, file.read_bytes()) for file in after} == before


@pytest.mark.slow
@pytest.mark.parametrize("ema", [False, True])
def test_latest_with_more_steps_continues_a_completed_run_from_its_last_step(
        tmp_path: Path, tiny_sdxl_dir: Path, capsys: pytest.CaptureFixture, ema: bool) -> None:
    """"Raise training.num_steps to train on" continues from step 4, not from an older checkpoint or
    step 0: from the output folder's final state, or with EMA (whose average is the output) from the
    checkpoint the last step saved; that output folder is then refused as a resume source, naming
    the checkpoint. The result is a straight 6-step run's (the constant schedule does not depend on
    the length)."""
    settings = {"model": {"use_ema": ema, "ema_decay": 0.5},
                "training": {"num_steps": 4, "checkpoint_every": 100, "ema_update_every": 1}}
    straight = tiny_config(tmp_path / "straight", **settings)
    straight["training"]["num_steps"] = 6
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "straight.json", straight))]) == 0
    path = write_config(tmp_path / "job.json", tiny_config(tmp_path / "job", **settings))
    assert train_sdxl.main(["--config", str(path)]) == 0
    out = tmp_path / "job" / "out" / "test_run"
    final_checkpoint = out / "checkpoints" / "checkpoint-4"
    assert final_checkpoint.is_dir() == ema
    capsys.readouterr()
    longer = ["--config", str(path), "--set", "training.resume_from=latest", "--set", "training.num_steps=6"]
    assert train_sdxl.main(longer) == 0
    assert f"resume: from {final_checkpoint if ema else out} at step 4 " in capsys.readouterr().out
    expected, got = final_weights(tmp_path / "straight" / "out" / "test_run"), final_weights(out)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    if ema:
        assert train_sdxl.main(["--config", str(path), "--set", f"training.resume_from={out}",
                                "--set", "training.num_steps=8"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: training.resume_from = {str(out)!r}: an output folder holds the EMA of the trained weights "
            f"(model.use_ema), not the weights training continues from; resume from {out / 'checkpoints'}"
            "/checkpoint-6")


@pytest.mark.slow
def test_a_resume_from_an_older_checkpoint_sets_the_abandoned_run_aside(tmp_path: Path, tiny_sdxl_dir: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """Resumed from checkpoint-2 (a lower rate, to tame a divergence) and stopped at step 3: a later
    `latest` continues this run from step 3, not the abandoned run's checkpoint-6, which is kept
    in checkpoints/abandoned-from-step-2/ with that run's final state."""
    path = finished_run(tmp_path, num_steps=8)
    checkpoints = tmp_path / "out" / "test_run" / "checkpoints"
    branch = ["--config", str(path), "--set", f"training.resume_from={checkpoints / 'checkpoint-2'}",
              "--set", "training.lr_unet=1e-4", "--set", "training.num_steps=3"]
    capsys.readouterr()
    assert train_sdxl.main(branch) == 0
    abandoned = checkpoints / "abandoned-from-step-2"
    assert (f"resume: what the run saved after this resume's step (checkpoint-4, checkpoint-6, trainer_state.pt) is "
            f"moved to {abandoned}; `latest` continues this run") in capsys.readouterr().out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["abandoned-from-step-2", "checkpoint-2"]
    assert sorted(p.name for p in abandoned.iterdir()) == ["checkpoint-4", "checkpoint-6", "trainer_state.pt"]
    assert load_state(abandoned / "trainer_state.pt").snapshot.position.step == 8
    assert train_sdxl.main(["--config", str(path), "--set", "training.lr_unet=1e-4", "--dry-run", *NO_MEMORY_PLAN]) == 0
    assert f"resume: from {checkpoints.parent} at step 3 " in capsys.readouterr().out


@pytest.mark.slow
def test_latest_passes_over_a_damaged_newest_checkpoint(tmp_path: Path, tiny_sdxl_dir: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """The completed run's final state comes first (a longer run continues from it), then the
    checkpoints, newest first."""
    path = finished_run(tmp_path, num_steps=6)
    checkpoints = tmp_path / "out" / "test_run" / "checkpoints"
    final = checkpoints.parent / "pytorch_lora_weights.safetensors"
    final.write_bytes(final.read_bytes()[:-100])
    state, weights = checkpoints / "checkpoint-4" / "trainer_state.pt", checkpoints / "checkpoint-4" / (
        "pytorch_lora_weights.safetensors")
    intact = state.read_bytes()
    state.write_bytes(intact[: len(intact) // 2])
    longer = ["--config", str(path), "--set", "training.num_steps=8"]
    capsys.readouterr()
    assert train_sdxl.main([*longer, "--dry-run", *NO_MEMORY_PLAN]) == 0
    out = capsys.readouterr().out
    assert f"resume: from {checkpoints / 'checkpoint-2'} at step 2" in out
    assert f"warning: the final state in {checkpoints.parent} is damaged (training.resume_from: {final}: " in out
    assert f"warning: checkpoint-4 is damaged ({state}: not a readable trainer state" in out
    state.write_bytes(intact)
    weights.write_bytes(weights.read_bytes()[:-100])
    assert train_sdxl.main(longer) == 0
    out = capsys.readouterr().out
    assert f"resume: from {checkpoints / 'checkpoint-2'} at step 2" in out
    assert f"warning: checkpoint-4 is damaged (training.resume_from: {weights}: truncated: " in out
    assert json.loads((checkpoints.parent / "run_summary.json").read_text())["steps"] == 8
    for checkpoint in checkpoints.glob("checkpoint-*"):  # none intact: one line naming each, nothing started
        (checkpoint / "trainer_state.pt").write_bytes(b"")
    (checkpoints.parent / "trainer_state.pt").write_bytes(b"")  # the final state too
    assert train_sdxl.main([*longer, "--set", "training.num_steps=10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: training.resume_from = 'latest': no intact checkpoint: checkpoint-6 is damaged (")
    assert "checkpoint-4 is damaged" in err and "checkpoint-2 is damaged" in err and len(err.splitlines()) == 1
