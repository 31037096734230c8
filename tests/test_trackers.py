"""Trackers beside TensorBoard (wandb offline, mlflow's local file store) and run.notify's webhook."""

from __future__ import annotations

import errno
import json
import random
import re
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import train_sdxl
from sdxl_trainer.atomic import OutputWriteError
from sdxl_trainer.checkpointing import load_state
from sdxl_trainer.config import ConfigError, load_config, validate_config
from sdxl_trainer.notify import end_event, notify
from sdxl_trainer.trackers import RunLog, Tracker, check_trackers, flat
from tests.helpers import ROOT, tiny_config, write_config


# ------------------------------------------------------------------------------- helpers
class Hook:
    """A webhook on 127.0.0.1 that records every JSON body posted to it; `delay` seconds before it answers."""

    def __init__(self, delay: float = 0.0) -> None:
        self.bodies: list[dict[str, Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                hook.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                time.sleep(delay)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:  # no request lines in the test output
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook() -> Any:
    server = Hook()
    yield server
    server.close()


def wandb_records(run_file: Path) -> list[Any]:
    """The records of an offline run's `.wandb` file. wandb 0.31 reads these in its Go core only, so
    this reads the format itself: a 7-byte header (`:W&B`, magic, version), then LevelDB's log format
    (32 KiB blocks of chunks: CRC32C, length, type FULL/FIRST/MIDDLE/LAST) of Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a chunk header is padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run(folder: Path) -> dict[str, Any]:
    """One offline run folder: its id, config and history rows ({step: {key: value}})."""
    (run_file,) = folder.glob("*.wandb")
    found: dict[str, Any] = {"history": {}, "config": {}}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["id"] = record.run.run_id
            found["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            found["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:  # a media value comes as items with nested keys [name, field]
                *parents, last = item.nested_key or [item.key]
                node = row
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[last] = json.loads(item.value_json)
            found["history"].setdefault(row.pop("_step"), {}).update(row)
    return found


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


# ------------------------------------------------------------------------------ no training
def minimal(notify: dict[str, Any] | None = None, trackers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"run": {"name": "r", "notify": notify}, "model": {"train_text_encoder_1": False},
            "training": {"num_steps": 1, "trackers": trackers or []}}


def test_trackers_are_checked_at_config_and_preflight_time(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for trackers, message in (([{"type": "tensorboard"}], "training.trackers.0.type = \"tensorboard\": TensorBoard "
                                                          "is on by default and set by training.tensorboard"),
                              ([{"type": "wandb"}, {"type": "wandb"}], "lists wandb more than once"),
                              ([{"type": "mlflow", "offline": True}], "offline applies to wandb and comet_ml"),
                              ([{"type": "comet_ml", "dir": "c"}], "dir applies to wandb, mlflow and aim"),
                              ([{"type": "mlflow", "entity": "me"}], "entity applies to wandb (its entity) and "
                                                                     "comet_ml (its workspace); mlflow has none"),
                              ([{"type": "aim", "entity": "me"}], "aim has none")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_config(minimal(trackers=trackers))
    with pytest.raises(ConfigError, match=re.escape("run.notify needs exactly one of url and url_env")):
        validate_config(minimal(notify={"format": "json"}))
    # aim is not installed here: one line naming the pip command, exit 2, nothing loaded or written.
    config = tiny_config(tmp_path, training={"trackers": [{"type": "wandb", "offline": True},
                                                          {"type": "aim", "dir": str(tmp_path / "aim")}]})
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))]) == 2
    err = capsys.readouterr().err
    assert err == ("error: training.trackers[1]: aim is not installed: pip install aim "
                   "(or pip install -r requirements-trackers.txt)\n")
    assert not (tmp_path / "out").exists() and not (tmp_path / "aim").exists()


def test_the_offline_preset_validates_and_its_trackers_are_installed() -> None:
    config = load_config(ROOT / "configs" / "trackers_offline.json")
    check_trackers(config)
    quickstart = load_config(ROOT / "configs" / "quickstart.json")
    assert [(t.type, t.offline) for t in config.training.trackers] == [("wandb", True), ("mlflow", False)]
    assert config.training.trackers[1].dir and config.training.tensorboard.enabled
    assert config.training.model_dump(exclude={"trackers"}) == quickstart.training.model_dump(exclude={"trackers"})
    assert config.model == quickstart.model and config.data == quickstart.data and config.eval == quickstart.eval


def test_flat_config_keys() -> None:
    assert flat({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": "[1, 2]", "d": None}


class Drawing(Tracker):
    """A tracker library that draws from the global RNGs as it logs (as mlflow's experiment and run names do)."""

    kind = "drawing"

    def __init__(self) -> None:
        self.draws: list[float] = []
        self.run_id = "d1"

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.draws += [random.random(), float(np.random.rand()), float(torch.rand(()))]


def test_tracker_calls_leave_the_training_rngs_alone() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    tracker = Drawing()
    RunLog(None, [tracker]).add_scalar("train/loss", 0.5, 1)
    assert tracker.draws == list(expected)  # the tracker drew...
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected  # ...and it was undone


class Failing(Tracker):
    kind = "failing"

    def __init__(self) -> None:
        self.calls = 0

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.calls += 1
        raise OSError("server gone")


def test_a_tracker_failing_mid_run_is_one_warning_and_dropped(capsys: pytest.CaptureFixture) -> None:
    failing, drawing = Failing(), Drawing()
    log = RunLog(None, [failing, drawing])
    for step in (1, 2):
        log.add_scalar("train/loss", 0.5, step)
    assert failing.calls == 1 and len(drawing.draws) == 6 and log.run_ids() == {"drawing": drawing.run_id}
    assert capsys.readouterr().err == ("warning: training.trackers: failing failed (OSError: server gone); it gets "
                                       "nothing more from this run\n")


def test_the_webhook_gets_discord_and_plain_json_bodies(tmp_path: Path, hook: Hook,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    config = validate_config(minimal(notify={"url": hook.url, "format": "discord"}))
    notify(config, "completed", "completed", steps=3, seconds=1.5, output_dir="/o")
    monkeypatch.setenv("HOOK_URL", hook.url)
    config.run.notify = {"url_env": "HOOK_URL"}  # auto: not a discord.com URL, so plain JSON
    notify(config, "nan_stop", "aborted: non-finite loss or gradients", steps=2)
    assert hook.bodies == [
        {"content": "sdxl-trainer run 'r': completed (steps 3, seconds 1.5, output dir /o)"},
        {"event": "nan_stop", "run": "r", "status": "aborted: non-finite loss or gradients", "steps": 2,
         "message": "sdxl-trainer run 'r': aborted: non-finite loss or gradients (steps 2)"},
    ]


def test_a_failing_or_slow_webhook_is_one_warning_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    slow = Hook(delay=3.0)
    try:
        config = validate_config(minimal(notify={"url": slow.url, "timeout_seconds": 0.5}))
        notify(config, "start", "started")
        assert slow.bodies  # it arrived; the answer did not come in time
    finally:
        slow.close()
    config.run.notify = {"url": slow.url}  # closed now: connection refused
    notify(config, "error", "failed: RuntimeError: boom")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("warning: run.notify: the ") for line in lines)
    assert "start notification to 127.0.0.1 failed" in lines[0] and "timed out" in lines[0]
    assert "error notification to 127.0.0.1 failed" in lines[1] and lines[1].endswith("; the run goes on")


def test_how_a_run_ended_names_the_event() -> None:
    assert end_event("completed", 0) == "completed"
    assert end_event("interrupted at step 3", 130) == "interrupted"
    assert end_event("aborted: non-finite loss or gradients", 1) == "nan_stop"
    assert end_event("aborted: non-finite weights", 1) == "nan_stop"
    assert end_event("failed: export", 1) == "error"


# ---------------------------------------------------------------------------------- training
def tracked_config(tmp_path: Path, hook_url: str, **training: Any) -> dict[str, Any]:
    """Four steps, a checkpoint at 2, every step logged, eval images at 0, 2 and 4; TensorBoard,
    wandb offline and mlflow's file store, and the webhook."""
    config = tiny_config(tmp_path, training={
        "log_every": 1, "checkpoint_every": 2, "tensorboard": {"base_dir": str(tmp_path / "tb")},
        "trackers": [{"type": "wandb", "offline": True, "dir": str(tmp_path / "wandb"), "tags": ["test"]},
                     {"type": "mlflow", "dir": str(tmp_path / "mlruns"), "project": "tests"}], **training},
        eval={"prompts_path": str(ROOT / "tests" / "eval_prompts.three.json"), "num_inference_steps": 2,
              "judge": "shapes",  # accuracy tags that are both a metric and a folder of more
              "live": {"enabled": True, "at_start": True, "every_n_steps": 2, "max_batches": 1}})
    config["run"]["notify"] = {"url": hook_url}
    return config


@pytest.mark.slow
def test_trackers_get_what_tensorboard_gets_and_a_resume_continues_their_runs(
        tmp_path: Path, tiny_sdxl_dir: Path, hook: Hook, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # set by the trainer too; restored after the test
    first = tracked_config(tmp_path / "first", hook.url)
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "first.json", first))]) == 0
    output = tmp_path / "first" / "out" / "test_run"
    ids = load_state(output / "trainer_state.pt").snapshot.tracker_runs
    assert set(ids) == {"wandb", "mlflow"}

    tensorboard = tensorboard_scalars(tmp_path / "first" / "tb" / "test_run")
    assert {"train/loss", "train/grad_norm", "lr/unet", "lr/text_encoder", "val/loss"} <= set(tensorboard)
    assert any(other.startswith(f"{tag}/") for tag in tensorboard for other in tensorboard)  # the judge's accuracy
    (folder,) = (tmp_path / "first" / "wandb" / "wandb").glob("offline-run-*")
    wandb = wandb_run(folder)
    assert wandb["id"] == ids["wandb"] and sorted(wandb["history"]) == [0, 1, 2, 3, 4]
    client = MlflowClient((tmp_path / "first" / "mlruns").resolve().as_uri())
    mlflow_run = client.get_run(ids["mlflow"])
    for tag, values in tensorboard.items():  # TensorBoard stores float32; the trackers keep the float64 logged
        assert {step: np.float32(row[tag]) for step, row in wandb["history"].items() if tag in row} == values, tag
        history = client.get_metric_history(ids["mlflow"], tag.replace("/", "."))
        assert {m.step: np.float32(m.value) for m in history} == values, tag
    assert wandb["config"]["training"]["num_steps"] == 4 and wandb["config"]["run"]["name"] == "test_run"
    assert mlflow_run.data.params["training.num_steps"] == "4" and mlflow_run.data.params["run.name"] == "test_run"
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "test_run"
    # The eval images of steps 0, 2 and 4 and their text, in both.
    assert all(wandb["history"][step]["eval/live/0"]["_type"] == "images/separated" for step in (0, 2, 4))
    assert all(wandb["history"][step]["eval/live"]["_type"] == "html-file" for step in (0, 2, 4))
    assert wandb["history"][0]["run/preflight"]["_type"] == "html-file"
    images = [a.path for a in client.list_artifacts(ids["mlflow"], "images") if a.path.endswith(".png")]
    assert sorted(re.search(r"/eval~live~0\+step\+(\d+)\+", path).group(1) for path in images) == ["0", "2", "4"]
    assert {a.path for a in client.list_artifacts(ids["mlflow"], "eval/live")} == {
        f"eval/live/step_{step:06d}.md" for step in (0, 2, 4)}

    # Resume from the checkpoint at step 2: the same tracker runs go on at step 3, and the weights
    # are bit-identical to the first run's.
    second = tracked_config(tmp_path / "second", hook.url, resume_from=str(output / "checkpoints" / "checkpoint-2"))
    for tracker in second["training"]["trackers"]:
        tracker["dir"] = tracker["dir"].replace("second", "first")
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "second.json", second))]) == 0
    resumed_output = tmp_path / "second" / "out" / "test_run"
    assert load_state(resumed_output / "trainer_state.pt").snapshot.tracker_runs == ids
    (resumed,) = [f for f in (tmp_path / "first" / "wandb" / "wandb").glob("offline-run-*") if f != folder]
    resumed_wandb = wandb_run(resumed)
    assert resumed_wandb["id"] == ids["wandb"] and sorted(resumed_wandb["history"]) == [3, 4]
    resumed_tensorboard = tensorboard_scalars(tmp_path / "second" / "tb" / "test_run")
    assert {step: np.float32(row["train/loss"]) for step, row in resumed_wandb["history"].items()} \
        == resumed_tensorboard["train/loss"] == {step: tensorboard["train/loss"][step] for step in (3, 4)}
    losses = [(m.step, np.float32(m.value)) for m in client.get_metric_history(ids["mlflow"], "train.loss")]
    assert sorted(losses) == sorted([*tensorboard["train/loss"].items(), *resumed_tensorboard["train/loss"].items()])
    assert [r.info.run_id for r in client.search_runs([mlflow_run.info.experiment_id])] == [ids["mlflow"]]
    first_weights = load_file(output / "pytorch_lora_weights.safetensors")
    second_weights = load_file(resumed_output / "pytorch_lora_weights.safetensors")
    assert first_weights.keys() == second_weights.keys()
    assert all(torch.equal(first_weights[key], second_weights[key]) for key in first_weights)

    assert [(body["event"], body["status"]) for body in hook.bodies] == [
        ("start", "started"), ("completed", "completed"), ("start", "resumed at step 2"), ("completed", "completed")]
    assert hook.bodies[1]["steps"] == 4 and hook.bodies[1]["output_dir"] == str(output)
    assert hook.bodies[1]["seconds"] > 0 and hook.bodies[0]["total_steps"] == 4


@pytest.mark.slow
def test_a_nan_stop_is_told_to_the_webhook_and_ends_the_tracker_run_as_failed(
        tmp_path: Path, tiny_sdxl_dir: Path, hook: Hook, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from tests.test_training_core import poisoned

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    poisoned(monkeypatch, "shape_")  # every batch: the first step aborts
    config = tiny_config(tmp_path, training={"num_steps": 2, "trackers": [
        {"type": "mlflow", "dir": str(tmp_path / "mlruns")}]})
    config["run"]["notify"] = {"url": hook.url}
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))]) == 1
    assert [(body["event"], body["status"], body.get("steps")) for body in hook.bodies] == [
        ("start", "started", None), ("nan_stop", "aborted: non-finite loss or gradients", 0)]
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("sdxl-trainer").experiment_id])
    assert run.info.status == "FAILED" and run.data.params["training.num_steps"] == "2"


class Closing(Tracker):
    kind = "closing"

    def __init__(self) -> None:
        self.run_id, self.codes = "c1", []

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def text(self, tag: str, text: str, step: int) -> None:
        pass

    def close(self, code: int) -> None:
        self.codes.append(code)


def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard's event file cannot be written from now on (a full disk)."""
    from tensorboard.summary.writer import record_writer

    def write(self: Any, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # TensorBoard's writer thread
def test_a_full_disk_under_tensorboard_is_an_output_write_error_and_the_trackers_still_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.tensorboard import SummaryWriter

    tracker = Closing()
    log = RunLog(SummaryWriter(log_dir=str(tmp_path / "tb")), [tracker])
    full_disk(monkeypatch)
    with pytest.raises(OutputWriteError, match=f"cannot write {tmp_path / 'tb'}: No space left on device"):
        for step in range(1000):  # the writer thread's error comes back at a later call
            log.add_scalar("train/loss", 0.5, step)
            log.add_text("t", "x", step)
    log.close(1)  # the broken writer is not closed again; the tracker's run ends as failed
    assert tracker.codes == [1]


@pytest.mark.slow
def test_a_full_disk_under_tensorboard_mid_run_ends_in_one_line_and_tells_the_webhook(
        tmp_path: Path, tiny_sdxl_dir: Path, hook: Hook, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    import sdxl_trainer.run as run_module

    log_step = run_module.log_step

    def filling(*args: Any, **kwargs: Any) -> None:  # the disk fills up once training has started
        full_disk(monkeypatch)
        log_step(*args, **kwargs)

    monkeypatch.setattr(run_module, "log_step", filling)
    config = tiny_config(tmp_path, training={"num_steps": 3, "log_every": 1})
    config["run"]["notify"] = {"url": hook.url}
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))]) == 1
    assert "error: cannot write " in capsys.readouterr().err
    assert [(body["event"], body["status"]) for body in hook.bodies] == [
        ("start", "started"), ("error", "failed: could not write the outputs")]


@pytest.mark.parametrize("store", ["none", "plain path"])
def test_mlflow_starts_with_mlflow_skinny_without_a_store_or_with_a_plain_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str) -> None:
    """mlflow 3's own default store is SQLite, which mlflow-skinny cannot open, and a plain path is
    a file store only with MLFLOW_ALLOW_FILE_STORE: both start now, as file stores."""
    from mlflow.tracking import MlflowClient

    from sdxl_trainer.trackers import start_tracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    tracker = {"type": "mlflow"} if store == "none" else {"type": "mlflow", "tracking_uri": "./store"}
    config = validate_config(tiny_config(tmp_path, training={"trackers": [tracker]}))
    started = start_tracker(config, 0, None, "preflight")
    started.close(0)
    folder = config.output_dir / "mlruns" if store == "none" else tmp_path / "store"
    assert MlflowClient(folder.as_uri()).get_run(started.run_id).info.status == "FINISHED"
