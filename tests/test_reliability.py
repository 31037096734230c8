"""A run under kill -9, signals, a full disk and a second run on the same folder: it owns its
output folder (a lock), cleans up what an interrupted run left, honours a stop during the final
save, refuses plans and inputs that cannot work in one line (exit 2), and reports a failed write
in one line (exit 1) with the earlier checkpoints intact."""

from __future__ import annotations

import errno
import json
import os
import random
import re
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
from tests.helpers import DATA_DIR, NO_MEMORY_PLAN, ROOT, tiny_config, train_here, write_config
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


def test_beside_a_state_file_kept_elsewhere_only_its_own_dead_temps_are_removed(tmp_path: Path) -> None:
    """That folder is not under the run's lock: another run may be writing its state there, and the
    user's own hidden entries that look like leftovers stay."""
    states = tmp_path / "states"
    config = load_config(write_config(tmp_path / "c.json", tiny_config(
        tmp_path, training={"state_path": str(states / "a.pt")})), [])
    users = states / ".lora-experiments" / "notes.txt"
    users.parent.mkdir(parents=True)
    users.write_text("mine")
    writers: list[subprocess.Popen] = []
    try:
        temps = []
        for name in ("a.pt", "b.pt"):  # this run's state and another run's, their writers killed
            killed, temp = start_writing(states / name, writers)
            killed.kill()
            killed.wait()
            temps.append(temp)
        live = start_writing(states / "b.pt", writers)[1]  # another run writing its state now
        assert remove_leftovers(config) == [temps[0]]
        assert users.exists() and temps[1].exists() and live.exists() and not temps[0].exists()
    finally:
        for process in writers:
            process.kill()
            process.wait()


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_checkpoint_is_chosen_once_the_lock_is_held(tmp_path: Path, tiny_sdxl_dir: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The pre-flight's choice is only shown: a checkpoint pruned before the lock is taken (another
    run on the folder) no longer crashes the start, which resumes from what is there under the lock."""
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, training={"num_steps": 6, "checkpoint_every": 2}))
    assert train_sdxl.main(["--config", str(path)]) == 0
    checkpoints = tmp_path / "out" / "test_run" / "checkpoints"
    (checkpoints.parent / "run_summary.json").unlink()  # not completed (else `latest` takes its final state)
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


@pytest.mark.slow
def test_kill_9_at_random_moments_leaves_nothing_behind_and_the_weights_exact(
        tmp_path: Path, tiny_sdxl_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """Killed at random moments (mid-step, mid-checkpoint, mid-export), the next start cleans up
    before writing anything, keeps at most `checkpoints_total_limit`, and the run ends bit-identical
    to one that was never killed. A kill is also simulated at the worst places (a temp folder and
    an extra old checkpoint, as a kill between writing a checkpoint and pruning leaves them)."""
    steps = 12  # the last kill comes after step 8 and a moment: a run to finish after it, unkilled
    settings = {"num_steps": steps, "checkpoint_every": 2, "checkpoints_total_limit": 2, "log_every": 1}
    straight = tiny_config(tmp_path / "straight", training=settings)
    assert train_here("--config", str(write_config(tmp_path / "s.json", straight))).returncode == 0
    job_config = tiny_config(tmp_path / "job", training=settings)
    job_config["data"] = straight["data"]  # the straight run's caches: the job's starts encode nothing
    path = write_config(tmp_path / "job.json", job_config)
    out = tmp_path / "job" / "out" / "test_run"
    chance = random.Random(11)
    for attempt in range(3):
        job = Job(path, steps=steps)
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
    job = Job(path, steps=steps)
    job.wait_for(lambda: "seed: " in "".join(job.stdout), "the start-up")
    assert not leftovers(out) and len(list_checkpoints(out / "checkpoints")) <= 2
    assert job.finish() == 0, "".join(job.stderr)[-3000:]
    assert "cleaned up" in "".join(job.stdout)
    expected, got = final_weights(tmp_path / "straight" / "out" / "test_run"), final_weights(out)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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

    four = ["--set", "data.bucket.batch_size=4", *NO_MEMORY_PLAN]
    assert train_sdxl.main(["--config", str(path), "--dry-run", *four]) == 0
    report = capsys.readouterr().out
    buckets = ("64x64", "96x64", "64x96")
    counts = [int(line.split()[1]) for line in report.splitlines() if line.strip().startswith(buckets)]
    held = {4 for count in counts if count >= 4} | {count % 4 for count in counts if count % 4}
    assert len(held) > 1  # batches of 4, and the smaller last batch of a bucket
    assert f"global batch {'/'.join(str(size) for size in sorted(held))} = " in report


@pytest.mark.slow
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


@pytest.mark.slow
def test_bad_paths_and_files_are_one_line_naming_the_key_or_file(
        tmp_path: Path, tiny_sdxl_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """A cache, TensorBoard or output folder that is a file, a run.name with NUL, and a config or
    metadata.jsonl that is not UTF-8: exit 2 and one line each, from the dry run, nothing written."""
    (tmp_path / "a_file").write_text("x")
    afile = tmp_path / "a_file"
    images = tmp_path / "images"
    shutil.copytree(DATA_DIR, images)
    (images / "metadata.jsonl").write_bytes(b'{"file_name": "a.png", "text": "ok"}\n{"file_name": "b.png", '
                                            b'"text": "caf\xe9"}\n')
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path))
    cases = {
        ("data.text_cache.cache_dir", str(afile)): f"error: data.text_cache.cache_dir: {afile} is a file, not a folder",
        ("data.latent_cache.cache_dir", str(afile)):
            f"error: data.latent_cache.cache_dir: {afile} is a file, not a folder",
        ("training.tensorboard.base_dir", str(afile)): f"error: training.tensorboard.base_dir: {afile / 'test_run'} "
                                                      f"cannot be created: {afile} is a file, not a folder",
        ("run.output_root", str(afile / "deeper")): f"error: run.output_root: {afile / 'deeper' / 'test_run'} cannot "
                                                   f"be created: {afile} is a file, not a folder",
        ("run.name", "a\u0000b"): 'run.name = "a\\u0000b": contains a NUL character',
        ("data.image_dir", str(images)): None,  # with caption_source metadata, below
    }
    for (key, value), message in cases.items():
        overrides = ["--set", f"{key}={json.dumps(value)}"]
        if message is None:
            overrides += ["--set", "data.caption_source=metadata"]
            message = f"error: {images / 'metadata.jsonl'}, line 2: not UTF-8 text (byte 0xe9 at offset 35)"
        assert train_sdxl.main(["--config", str(path), "--dry-run", *overrides]) == 2, key
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(path.read_text().replace('"test_run"', '"caf\u00e9"').encode("latin-1"))
    assert train_sdxl.main(["--config", str(latin1), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {latin1}: not UTF-8 text (byte 0xe9 at offset ")
    assert not (tmp_path / "out").exists() and not (tmp_path / "latents").exists()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be created")
def test_an_output_folder_that_cannot_be_created_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Refused by the pre-flight where the parent is not writable; as root (who may write
    anywhere by permissions) by the start, before any model is loaded: exit 2, one line."""
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, run={"name": "x", "output_root": "/proc/no/out"}))
    assert train_sdxl.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "/proc/no/out/x" in err, err
    assert ("cannot be created in /proc (permission denied)" in err if os.geteuid() else
            "error: cannot create the output folder /proc/no/out/x: No such file or directory" in err), err


def test_unreadable_images_and_captions_are_skipped_with_their_reason(tmp_path: Path) -> None:
    """A caption that cannot be read (a folder by its name; chmod 000 where not root) and an image
    that cannot be read (chmod 000) are skipped with the reason, the rest of the folder used; an
    unreadable image is not kept in the scan cache (it is read again once its permissions change)."""
    from sdxl_trainer.scan import scan_images

    images = tmp_path / "images"
    shutil.copytree(DATA_DIR, images)
    first, second = sorted(images.glob("*.png"))[:2]
    first.with_suffix(".txt").unlink()
    first.with_suffix(".txt").mkdir()
    config = load_config(write_config(tmp_path / "c.json", tiny_config(tmp_path, data={
        **tiny_config(tmp_path)["data"], "image_dir": str(images), "scan_cache_dir": str(tmp_path / "scan")})), [])
    report = scan_images(config.data)
    assert dict(report.skipped) == {first: f"caption {first.stem}.txt cannot be read (Is a directory)"}
    assert len(report.images) == 17
    if os.geteuid() == 0:
        pytest.skip("chmod 000 does not stop root from reading: the permission case needs another user")
    second.chmod(0)
    second.with_suffix(".txt").chmod(0)
    third = sorted(images.glob("*.png"))[2]
    third.with_suffix(".txt").chmod(0)
    skipped = dict(scan_images(config.data).skipped)
    assert skipped[second] == "cannot open the file (Permission denied)"
    assert skipped[third] == f"caption {third.stem}.txt cannot be read (Permission denied)"
    second.chmod(0o644)
    assert second not in dict(scan_images(config.data).skipped)


def test_a_huge_caption_is_skipped_and_huge_repeats_are_refused(tmp_path: Path) -> None:
    """A 100 MB caption file (sparse: nothing is written) is skipped with its reason, unread, as an
    over-large image is; `repeats` of 1e12 is one line naming the key instead of a pre-flight that
    never ends."""
    from sdxl_trainer.scan import scan_images

    images = tmp_path / "images"
    shutil.copytree(DATA_DIR, images)
    huge = sorted(images.glob("*.txt"))[0]
    with huge.open("r+b") as handle:
        handle.truncate(100 * 2**20)
    config = load_config(write_config(tmp_path / "c.json", tiny_config(tmp_path, data={
        **tiny_config(tmp_path)["data"], "image_dir": str(images), "caption_shuffle_prob": 0.5})), [])
    report = scan_images(config.data)
    assert dict(report.skipped) == {huge.with_suffix(".png"): f"caption {huge.name} is too long: 104,857,600 bytes "
                                                              "is over data.max_caption_bytes=65536"}
    assert len(report.images) == 17
    raised = load_config(write_config(tmp_path / "r.json", tiny_config(tmp_path, data={
        **tiny_config(tmp_path)["data"], "image_dir": str(images), "max_caption_bytes": 200 * 2**20})), [])
    assert not scan_images(raised.data).skipped  # the limit is the user's to raise

    subsets = {"image_dir": str(DATA_DIR)}
    for repeats, accepted in ((10_000, True), (10_001, False), (1e12, False)):
        config = tiny_config(tmp_path)
        del config["data"]["image_dir"]
        config["data"]["subsets"] = [{**subsets, "repeats": repeats}]
        path = write_config(tmp_path / "s.json", config)
        if accepted:
            assert load_config(path, []).data.folders()[0].repeats == repeats
            continue
        with pytest.raises(ConfigError, match=r"data\.subsets\.0\.repeats = .*: must be at most 10,000: "):
            load_config(path, [])


@pytest.mark.slow
def test_metadata_lines_for_missing_images_are_warned_and_unusable_masks_give_their_reasons(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A metadata.jsonl line naming no image is a warning naming the line (not silence); when every
    image is skipped (here: every mask the wrong size) the error says why, not only "no readable images"."""
    from PIL import Image

    images = tmp_path / "images"
    shutil.copytree(DATA_DIR, images)
    names = sorted(path.name for path in images.glob("*.png"))
    lines = [json.dumps({"file_name": name, "text": "a cross"}) for name in names]
    lines.insert(2, json.dumps({"file_name": "shape_99.png", "text": "a typo"}))
    (images / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path))
    overrides = ["--set", f"data.image_dir={images}", "--set", "data.caption_source=metadata"]
    assert train_sdxl.main(["--config", str(path), "--dry-run", *overrides, *NO_MEMORY_PLAN]) == 0
    report = capsys.readouterr().out
    assert (f"  warning: {images / 'metadata.jsonl'}, line 3: no image 'shape_99.png' in {images}; the line is not "
            "used") in report
    assert report.count("warning: ") == 1 and "images: 18 usable, 0 skipped" in report

    masks = tmp_path / "masks"
    masks.mkdir()
    for name in names:
        Image.new("L", (32, 32), 255).save(masks / name)
    assert train_sdxl.main(["--config", str(path), "--dry-run", "--set", f"data.mask_dir={masks}"]) == 2
    err = capsys.readouterr().err.strip()
    err = err[err.index("error: "):]  # after the scan's progress bar
    first = Image.open(images / names[0]).size
    assert err.startswith(f"error: data.image_dir: no readable images found in {DATA_DIR}; {names[0]}: mask "
                          f"{masks / names[0]} is 32x32, the image {first[0]}x{first[1]}; "), err
    assert err.endswith("; and 15 more skipped") and len(err.splitlines()) == 1


def started_lines(job: Job) -> list[str]:
    """What a process said on stderr, without progress bars and `-X importtime`'s lines."""
    text = "".join(job.stderr).replace("\r", "\n")
    return [line for line in text.splitlines()
            if line.strip() and not line.startswith("import time:") and "it/s]" not in line and "s/it]" not in line
            and not line.startswith("[transformers]")]


@pytest.mark.slow
def test_a_signal_before_the_first_step_is_one_line_exit_130_and_releases_the_lock(
        tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """Ctrl-C while the config's imports run (pydantic: they came before any handler), and SIGTERM
    once the output folder is locked (the model loading and cache building): one line each, exit
    130, no lock file, no temp file left."""
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path))
    job = Job(path, python_options=("-X", "importtime"))
    job.wait_for(lambda: re.search(r"\| +pydantic", "".join(job.stderr)), "the import of pydantic")
    job.process.send_signal(signal.SIGINT)
    assert job.finish() == 130
    assert started_lines(job) == ["SIGINT: interrupted before training started; nothing was trained"], job.stderr

    job = Job(path)
    job.wait_for(lambda: "seed: " in "".join(job.stdout), "the lock")  # taken just before the seed is said
    out = tmp_path / "out" / "test_run"
    assert (out / ".trainer.lock").is_file()
    job.process.send_signal(signal.SIGTERM)
    assert job.finish() == 130
    assert started_lines(job)[-1] == "SIGTERM: interrupted before training started; nothing was trained"
    assert "Traceback" not in "".join(job.stderr)
    assert not (out / ".trainer.lock").exists() and not list(tmp_path.rglob("*.tmp"))


@pytest.mark.slow
def test_ctrl_c_with_data_loader_workers_is_said_once(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group, the DataLoader's forked workers too:
    the main process alone answers it."""
    config = tiny_config(tmp_path, training={"num_steps": STEPS, "checkpoint_every": 100, "log_every": 1})
    config["data"]["num_workers"] = 2
    job = Job(write_config(tmp_path / "c.json", config), own_group=True)
    job.wait_for(lambda: job.steps_done() >= 1, "the first step")
    os.killpg(job.process.pid, signal.SIGINT)
    assert job.finish() == 130
    err = "".join(job.stderr)
    assert err.count("SIGINT: finishing this step and saving a checkpoint") == 1, err[-3000:]
    assert "interrupted: checkpoint saved at step " in "".join(job.stdout)


@pytest.mark.slow
def test_a_stop_during_the_last_final_write_saves_a_checkpoint_as_it_says(
        tmp_path: Path, tiny_sdxl_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """SIGTERM while the trainer state (the last final write without a final eval) is written: the
    message says "then saving a checkpoint", so a checkpoint is saved and the exit is 130, not 0; the
    write named next is the run summary (not a final eval that is off)."""
    import sdxl_trainer.checkpointing as checkpointing

    # Live eval alone (never due here) makes an evaluator, but no final eval follows the trainer state.
    live_only = {"prompts_path": str(ROOT / "tests" / "eval_prompts.three.json"),
                 "live": {"enabled": True, "every_n_steps": 100}}
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, training={"num_steps": 2, "checkpoint_every": 100},
                                                         eval=live_only))
    out = tmp_path / "out" / "test_run"
    real_save_state = checkpointing.save_state

    signalled = []

    def state_interrupted(where, *args, **kwargs):
        if Path(where) == out / "trainer_state.pt" and not signalled:  # once: the checkpoint writes it again
            signalled.append(where)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save_state(where, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "save_state", state_interrupted)
    capsys.readouterr()
    assert train_sdxl.main(["--config", str(path)]) == 130
    said = capsys.readouterr()
    assert "SIGTERM: finishing the write in progress, then saving a checkpoint" in said.err
    assert "interrupted during the final save, before the run summary" in said.out
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["checkpoint-2"]
    assert json.loads((out / "run_summary.json").read_text())["status"] == "interrupted during the final save at step 2"


@pytest.mark.slow
def test_a_full_disk_before_the_first_step_is_one_line_with_the_os_reason(
        tmp_path: Path, tiny_sdxl_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The disk fills while the latent cache, the text cache or the TensorBoard folder is written:
    exit 1, one line naming the file with the OS's reason, no lock file and no temp file left.
    safetensors writes from Rust, so its write is replaced by one that fails as it does on a full
    disk; TensorBoard's files are opened on /dev/full, where the kernel itself answers ENOSPC."""
    import io

    import safetensors.torch
    from safetensors import SafetensorError

    real_save_file, real_open = safetensors.torch.save_file, io.open
    full = {"where": None}

    def save_file_until_full(tensors, filename, *args, **kwargs):
        if full["where"] is not None and Path(filename).is_relative_to(full["where"]):
            Path(filename).write_bytes(b"half an entry")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save_file(tensors, filename, *args, **kwargs)

    def open_on_a_full_disk(file, *args, **kwargs):
        name = "" if isinstance(file, int) else os.fsdecode(file)  # TensorBoard passes bytes
        if full["where"] is not None and name.startswith(str(full["where"])):
            file = "/dev/full"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file_until_full)
    monkeypatch.setattr(io, "open", open_on_a_full_disk)
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path))
    for name, where in (("latents", tmp_path / "latents"), ("text", tmp_path / "text"),
                        ("tensorboard", tmp_path / "tb" / "tensorboard")):
        if name == "tensorboard" and not Path("/dev/full").exists():
            continue
        full["where"] = where
        capsys.readouterr()
        assert train_sdxl.main(["--config", str(path), "--set", f"run.name={name}"]) == 1, name
        err = capsys.readouterr().err
        line = err[err.index("error: "):].strip()
        assert line.startswith(f"error: cannot write {where}") and "Traceback" not in err, err[-3000:]
        assert line.endswith(" MiB free there)") and ": No space left on device (" in line and "\n" not in line, line
        assert not (tmp_path / "out" / name / ".trainer.lock").exists()
        assert not list(tmp_path.rglob("*.tmp"))
