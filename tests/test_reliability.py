"""A run under kill -9, signals, a full disk and a second run on the same folder: it owns its
output folder (a lock), cleans up what an interrupted run left, honours a stop during the final
save, refuses plans and inputs that cannot work in one line (exit 2), and reports a failed write
in one line (exit 1) with the earlier checkpoints intact."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import train_sdxl
from sdxl_trainer.atomic import HOST, TEMP_NAME
from sdxl_trainer.checkpointing import list_checkpoints, load_state, prune_checkpoints
from sdxl_trainer.config import ConfigError, load_config
from sdxl_trainer.output_folder import LEFTOVER, OutputLock, remove_leftovers
from sdxl_trainer.planning import plan_run
from tests.helpers import DATA_DIR, ROOT, run_cli, tiny_config, write_config
from tests.test_preemptible import STEPS, Job
from tests.test_resume import final_weights


def leftovers(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if LEFTOVER.match(path.name)]


def test_a_second_run_on_the_same_folder_is_refused_until_the_first_releases_it(tmp_path: Path) -> None:
    first = OutputLock(tmp_path)
    assert first.acquire() is None
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()} on "):
        OutputLock(tmp_path).acquire()
    first.release()
    second = OutputLock(tmp_path)
    assert second.acquire() is None  # released cleanly: nothing to report
    second.handle.close()  # what a kill -9 does: the kernel drops the lock, the file stays
    third = OutputLock(tmp_path)
    note = third.acquire()
    assert note is not None and f"pid {os.getpid()}" in note and "ended without releasing" in note
    third.release()
    assert not (tmp_path / ".trainer.lock").exists()


def test_start_up_removes_only_the_leftovers_of_interrupted_writes(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path / "c.json", tiny_config(tmp_path)), [])
    out = config.output_dir
    stale_files = [out / ".trainer_state.pt.k2j3.tmp", out / ".pytorch_lora_weights.safetensors.x.tmp",
                   out / "eval" / "live" / ".grid.png.k.tmp"]
    stale_folders = [out / "checkpoints" / ".checkpoint-6.ab12.tmp", out / "checkpoints" / ".checkpoint-2.deleting",
                     out / ".pipeline-q1", out / ".merged-z9", out / ".lora-77", out / "unet" / ".unet.old-123"]
    kept = [out / "checkpoints" / "checkpoint-4" / "trainer_state.pt", out / "notes.txt", out / ".hidden_by_user",
            out / "eval" / "live" / "step_2" / "grid.png", out / "run_summary.json"]
    for folder in stale_folders:
        (folder / "part").mkdir(parents=True)
    for path in stale_files + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    assert sorted(remove_leftovers(config)) == sorted(stale_files + stale_folders)
    assert all(path.exists() for path in kept) and not leftovers(out)


def start_writing(destination: Path, writers: list[subprocess.Popen]) -> tuple[subprocess.Popen, Path]:
    """A process in the middle of an atomic write of `destination`, and its temp."""
    code = ("import sys, time\nfrom sdxl_trainer.atomic import atomic_path\nwith atomic_path(sys.argv[1]) as tmp:\n"
            "    tmp.write_bytes(b'part')\n    print(tmp, flush=True)\n    time.sleep(600)")
    process = subprocess.Popen([sys.executable, "-c", code, str(destination)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    writers.append(process)
    return process, Path(process.stdout.readline().strip())


def test_a_start_removes_the_temps_of_dead_writers_in_the_caches_and_the_single_file_folder(
        tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """Caches and the single file's folder are shared between runs: a start removes the temps whose
    writer was killed, and keeps those still being written, another machine's and unknown names."""
    config = tiny_config(tmp_path, training={"num_steps": 1})
    config["data"]["scan_cache_dir"] = str(tmp_path / "scan")
    folders = [tmp_path / "latents" / "ab", tmp_path / "text" / "cd", tmp_path / "scan",
               tmp_path / "out" / "safetensors"]
    writers: list[subprocess.Popen] = []
    try:
        dead, kept = [], []
        for folder in folders:
            killed, temp = start_writing(folder / "entry.safetensors", writers)
            killed.kill()
            killed.wait()
            dead.append(temp)
            kept.append(start_writing(folder / "other.safetensors", writers)[1])
            kept.append(temp.with_name(temp.name.replace(HOST, "0" * 8 if HOST != "0" * 8 else "1" * 8)))
            kept.append(folder / ".entry.safetensors.k2j3h4g5.tmp")
            for path in kept[-2:]:
                path.write_bytes(b"part")
        assert all(TEMP_NAME.match(path.name) for path in dead) and all(path.exists() for path in dead)
        assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))]) == 0
        assert [path for path in dead if path.exists()] == []
        assert [path for path in kept if not path.exists()] == []
        assert list((tmp_path / "latents").glob("*/*.safetensors")) and list((tmp_path / "scan").glob("*.json"))
    finally:
        for process in writers:
            process.kill()
            process.wait()


def test_the_checkpoint_is_chosen_once_the_lock_is_held(tmp_path: Path, tiny_sdxl_dir: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The pre-flight's choice is only shown: a checkpoint pruned before the lock is taken (another
    run on the folder) no longer crashes the start, which resumes from what is there under the lock."""
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, training={"num_steps": 6, "checkpoint_every": 2}))
    assert train_sdxl.main(["--config", str(path)]) == 0
    checkpoints = tmp_path / "out" / "test_run" / "checkpoints"
    config = load_config(path, ["training.resume_from=latest", "training.num_steps=8"])
    plan = plan_run(config)
    assert plan.resume.folder == checkpoints / "checkpoint-4"
    shutil.rmtree(checkpoints / "checkpoint-4")
    capsys.readouterr()
    assert train_sdxl.train(config, plan) == 0
    out = capsys.readouterr().out
    assert "resume: the checkpoints changed since the pre-flight (another run on this folder?); now:\n" \
           f"resume: from {checkpoints / 'checkpoint-2'} at step 2" in out
    assert json.loads((checkpoints.parent / "run_summary.json").read_text())["steps"] == 8


def test_pruning_keeps_the_limit_and_never_the_checkpoint_being_resumed(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
    pruned = prune_checkpoints(tmp_path, 2, keep=tmp_path / "checkpoint-2")
    assert [p.name for p in pruned] == ["checkpoint-4", "checkpoint-6"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-8"]
    assert prune_checkpoints(tmp_path, None) == []
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["checkpoint-2"]
    assert not leftovers(tmp_path)  # renamed aside, then deleted


def test_kill_9_at_random_moments_leaves_nothing_behind_and_the_weights_exact(
        tmp_path: Path, tiny_sdxl_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """Killed at random moments (mid-step, mid-checkpoint, mid-export), the next start cleans up
    before writing anything, keeps at most `checkpoints_total_limit`, and the run ends bit-identical
    to one that was never killed. A kill is also simulated at the worst places (a temp folder and
    an extra old checkpoint, as a kill between writing a checkpoint and pruning leaves them)."""
    settings = {"num_steps": STEPS, "checkpoint_every": 2, "checkpoints_total_limit": 2, "log_every": 1}
    straight = tiny_config(tmp_path / "straight", training=settings)
    assert run_cli("train_sdxl.py", "--config", str(write_config(tmp_path / "s.json", straight))).returncode == 0
    path = write_config(tmp_path / "job.json", tiny_config(tmp_path / "job", training=settings))
    out = tmp_path / "job" / "out" / "test_run"
    chance = random.Random(11)
    for attempt in range(3):
        job = Job(path)
        job.wait_for(lambda job=job: "seed: " in "".join(job.stdout), "the start-up")
        assert not leftovers(out), f"start {attempt}: {leftovers(out)}"
        assert len(list_checkpoints(out / "checkpoints")) <= 2
        if attempt == 0:  # meanwhile, a second run on the same folder is turned away, the first unharmed
            capsys.readouterr()
            assert train_sdxl.main(["--config", str(path)]) == 2
            assert f"is in use by another run (pid {job.process.pid} on " in capsys.readouterr().err
        job.wait_for(lambda job=job, goal=2 + 3 * attempt: job.steps_done() >= goal, "training")
        time.sleep(chance.uniform(0.0, 0.4))  # a step takes about 0.2 s here
        job.kill()
        checkpoints = list_checkpoints(out / "checkpoints")
        if checkpoints:  # the worst moments, for sure: mid-write and between a write and the pruning
            shutil.copytree(checkpoints[-1], out / "checkpoints" / "checkpoint-1")
            (out / "checkpoints" / ".checkpoint-99.x1.tmp").mkdir()
            (out / ".trainer_state.pt.y2.tmp").write_bytes(b"partial")
    job = Job(path)
    job.wait_for(lambda: "seed: " in "".join(job.stdout), "the start-up")
    assert not leftovers(out) and len(list_checkpoints(out / "checkpoints")) <= 2
    assert job.finish() == 0, "".join(job.stderr)[-3000:]
    assert "cleaned up" in "".join(job.stdout)
    expected, got = final_weights(tmp_path / "straight" / "out" / "test_run"), final_weights(out)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_stop_during_the_final_save_checkpoints_and_the_resume_finishes_it(
        tmp_path: Path, tiny_sdxl_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """SIGTERM arrives while the exports are written (with EMA on, so the checkpoint must hold the
    trained weights, not the averaged ones): the export finishes, a checkpoint of the last step is
    saved, run_summary.json says so, exit 130; resuming from it gives a straight run's outputs."""
    import sdxl_trainer.export as export

    settings = {"training": {"num_steps": 4, "checkpoint_every": 100},
                "model": {**tiny_config(tmp_path)["model"], "use_ema": True, "ema_decay": 0.5}}
    straight = write_config(tmp_path / "s.json", tiny_config(tmp_path / "straight", **settings))
    assert train_sdxl.main(["--config", str(straight)]) == 0
    path = write_config(tmp_path / "job.json", tiny_config(tmp_path / "job", **settings))
    real_export = export.export_after_training

    def export_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only takes note: this write completes
        return real_export(*args, **kwargs)

    monkeypatch.setattr(export, "export_after_training", export_interrupted)
    capsys.readouterr()
    assert train_sdxl.main(["--config", str(path)]) == 130
    said = capsys.readouterr()
    assert "Traceback" not in said.err and "SIGTERM: finishing the write in progress" in said.err
    assert "interrupted during the final save, before the trainer state" in said.out
    out = tmp_path / "job" / "out" / "test_run"
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "interrupted during the final save at step 4"
    checkpoint = out / "checkpoints" / "checkpoint-4"
    assert summary["checkpoints"] == [str(checkpoint)] and summary["seconds"] > 0
    state = load_state(checkpoint / "trainer_state.pt").snapshot
    assert state.position.step == 4 and 0 < state.seconds <= summary["seconds"]

    monkeypatch.setattr(export, "export_after_training", real_export)
    assert train_sdxl.main(["--config", str(path), "--set", f"training.resume_from={checkpoint}"]) == 0
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    assert closing.startswith("completed: 4 steps in ") and "(0 steps in " in closing and "since the resume" in closing
    assert json.loads((out / "run_summary.json").read_text())["seconds"] >= state.seconds  # both sessions
    expected, got = final_weights(tmp_path / "straight" / "out" / "test_run"), final_weights(out)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoint(
        tmp_path: Path, tiny_sdxl_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The disk fills while the second checkpoint's trainer state is written (torch.save's own
    error, which has no errno): exit 1 with one line naming the checkpoint and the free space, the
    first checkpoint intact, no temp file left; then while the final adapter file is written."""
    real_save = torch.save
    saves = []

    def save_until_full(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 3:  # checkpoint-2 and the run's state are written; checkpoint-4's fails
            Path(path).write_bytes(b"half a file")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1024 vs 960")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, training={"num_steps": 6, "checkpoint_every": 2}))
    assert train_sdxl.main(["--config", str(path)]) == 1
    err = capsys.readouterr().err
    out = tmp_path / "out" / "test_run"
    line = err[err.index("error: "):].splitlines()[0]  # after tqdm's last \r-rewritten bar
    assert line.startswith(f"error: cannot write {out / 'checkpoints' / 'checkpoint-4'}: the write failed (")
    assert "MiB free there); earlier checkpoints are intact" in line and "Traceback" not in err
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["checkpoint-2"]
    assert load_state(out / "checkpoints" / "checkpoint-2" / "trainer_state.pt").snapshot.position.step == 2
    assert not leftovers(out)
    assert json.loads((out / "run_summary.json").read_text())["status"] == "failed: could not write the outputs"

    import safetensors.torch

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", real_save)
    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    assert train_sdxl.main(["--config", str(path), "--set", "run.name=final", "--set", "training.num_steps=2"]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot write {tmp_path / 'out' / 'final'}" in err and "No space left on device" in err
    assert "Traceback" not in err and not leftovers(tmp_path / "out" / "final")


def test_plans_without_a_full_batch_are_refused_and_the_batch_reported_is_what_batches_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path))
    dropped = ["--set", "data.bucket.batch_size=64", "--set", "data.bucket.drop_last=true"]
    assert train_sdxl.main(["--config", str(path), "--dry-run", *dropped]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.bucket.drop_last: every bucket is smaller than its batch and is dropped: ")
    assert "64x64 (" in err and "batch 64)" in err and "set data.bucket.drop_last=false" in err
    assert train_sdxl.main(["--config", str(path), "--dry-run", "--set", "data.bucket.batch_size=64"]) == 2
    assert "18 usable image(s) are fewer than one global batch of 64" in capsys.readouterr().err

    assert train_sdxl.main(["--config", str(path), "--dry-run", "--set", "data.bucket.batch_size=4"]) == 0
    report = capsys.readouterr().out
    buckets = ("64x64", "96x64", "64x96")
    counts = [int(line.split()[1]) for line in report.splitlines() if line.strip().startswith(buckets)]
    held = {4 for count in counts if count >= 4} | {count % 4 for count in counts if count % 4}
    assert len(held) > 1  # batches of 4, and the smaller last batch of a bucket
    assert f"global batch {'/'.join(str(size) for size in sorted(held))} = " in report


def test_model_and_resume_inputs_are_checked_at_pre_flight_in_one_line(
        tmp_path: Path, tiny_sdxl_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each is exit 2 and one line from the dry run, before any model or latent is loaded."""
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, training={"num_steps": 2, "checkpoint_every": 1}))
    sd15 = tmp_path / "sd15.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2),
               "cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.zeros(2)}, sd15)
    (tmp_path / "not_a_pipeline").mkdir()
    assert train_sdxl.main(["--config", str(path)]) == 0
    checkpoint = tmp_path / "out" / "test_run" / "checkpoints" / "checkpoint-1"
    weights = checkpoint / "pytorch_lora_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    capsys.readouterr()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cases = {
        ("--set", f"training.resume_from={checkpoint}"):
            f"error: training.resume_from: {weights}: truncated: ",
        ("--set", "model.id=someone/not-downloaded"):
            "error: model.id = 'someone/not-downloaded': not in the local Hugging Face cache",
        ("--set", f"model.id={tmp_path / 'not_a_pipeline'}"):
            "not a diffusers pipeline folder (no model_index.json)",
        ("--set", f"model.id={sd15}"): "not an SDXL checkpoint (an SD 1.x/2.x checkpoint: ",
        ("--set", f"model.id={sd15}", "--set", f"model.config_dir={tiny_sdxl_dir}"): "not an SDXL checkpoint",
    }
    for overrides, message in cases.items():
        assert train_sdxl.main(["--config", str(path), "--dry-run", *overrides]) == 2, overrides
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_damaged_inputs_are_named_plainly(tmp_path: Path) -> None:
    """A 0-byte trainer state, a text file named .jpg and a dangling symlink, each with its reason."""
    from sdxl_trainer.scan import scan_images

    empty = tmp_path / "trainer_state.pt"
    empty.touch()
    with pytest.raises(ConfigError, match=r"empty file \(0 bytes; its write was interrupted\)"):
        load_state(empty)
    images = tmp_path / "images"
    shutil.copytree(DATA_DIR, images)
    (images / "notes.jpg").write_text("not a picture")
    (images / "gone.png").symlink_to(images / "deleted.png")
    config = load_config(write_config(tmp_path / "c.json", tiny_config(tmp_path, data={
        **tiny_config(tmp_path)["data"], "image_dir": str(images)})), [])
    skipped = dict(scan_images(config.data).skipped)
    assert skipped == {images / "gone.png": f"broken symbolic link (to {images / 'deleted.png'})",
                       images / "notes.jpg": "not an image (PIL recognises no image format in it)"}
