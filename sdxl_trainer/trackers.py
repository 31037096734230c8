"""Experiment trackers beside TensorBoard (`training.trackers`): wandb, mlflow, comet_ml, aim.

The run logs through one object, `RunLog`, with the SummaryWriter calls it always made
(`add_scalar`, `add_image`, `add_text`); RunLog hands each to TensorBoard, unchanged, and to every
tracker. The trackers start, log scalars and take the config through accelerate's tracker classes;
images, texts and the end status go to the libraries directly, where accelerate's wrappers lack them
(MLflowTracker has no `log_images`, none logs text, and `finish` takes no status). Each tracker's run
id is kept in the trainer state, so a resume continues the same tracker run. No tracker call may
draw from the global RNGs training uses (mlflow does): that would change the training and break
exact resume.
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .atomic import OutputWriteError, reported_write_failures
from .config import Config, ConfigError, TrackerConfig

# tracker type -> (module it imports, the pip package that provides it)
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny"),
            "comet_ml": ("comet_ml", "comet_ml"), "aim": ("aim", "aim")}
MLFLOW_NAME = re.compile(r"[^/\w.\- :]")  # the characters mlflow refuses in metric and param names
FINISHED, INTERRUPTED = 0, 130


def check_trackers(config: Config) -> None:
    """Every tracker the config names is installed (pre-flight: before any model loads)."""
    for index, tracker in enumerate(config.training.trackers):
        module, package = PACKAGES[tracker.type]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"training.trackers[{index}]: {tracker.type} is not installed: pip install {package} "
                              "(or pip install -r requirements-trackers.txt)")


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Whatever a tracker library draws from the global Python, numpy or torch RNG is undone."""
    import torch

    from .eval.evaluation import global_rng_kept

    with global_rng_kept(torch.device("cpu")):
        yield


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as `{"training.num_steps": 4, ...}` (lists as JSON), for flat key stores."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return out


def metric_name(tag: str) -> str:
    """An mlflow metric name for a TensorBoard tag: `/` becomes `.`, as mlflow's file store keeps a
    metric in a file at its name's path, and `eval/live/accuracy/concept` is a metric and, for
    `eval/live/accuracy/concept/kinds`, a folder."""
    return MLFLOW_NAME.sub("_", tag.replace("/", "."))


class Tracker:
    """One tracker's run. A subclass's `__init__(settings, name, resume_id)` starts it (continuing
    the run `resume_id` when given) and sets `tracker` and `run_id`."""

    kind = ""
    tracker: Any  # accelerate's tracker object
    run_id: str

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.tracker.log(values, step=step)

    def image(self, tag: str, picture: Any, step: int) -> None:
        self.tracker.log_images({tag: [picture]}, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        raise NotImplementedError

    def config(self, resolved: dict[str, Any]) -> None:
        self.tracker.store_init_configuration(resolved)

    def close(self, code: int) -> None:
        self.tracker.finish()


class WandB(Tracker):
    kind = "wandb"

    def __init__(self, settings: TrackerConfig, name: str, resume_id: str | None) -> None:
        from accelerate.tracking import WandBTracker

        if settings.dir:
            Path(settings.dir).mkdir(parents=True, exist_ok=True)
        self.tracker = WandBTracker(
            settings.project, name=name, entity=settings.entity, tags=settings.tags or None, dir=settings.dir,
            mode="offline" if settings.offline else None, id=resume_id, resume="allow" if resume_id else None)
        self.tracker.start()
        self.run_id = self.tracker.run.id

    def text(self, tag: str, text: str, step: int) -> None:
        import wandb

        self.tracker.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self, code: int) -> None:
        self.tracker.run.finish(exit_code=code)


class MLflow(Tracker):
    kind = "mlflow"

    def __init__(self, settings: TrackerConfig, name: str, resume_id: str | None) -> None:
        import mlflow
        from accelerate.tracking import MLflowTracker

        uri = mlflow_uri(settings)
        if uri.startswith("file:"):  # mlflow 3 keeps its file store only on request (no SQL in -skinny)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        self.tracker = MLflowTracker(settings.project, run_id=resume_id, run_name=name,
                                     tags={tag: "" for tag in settings.tags} or None)
        self.tracker.start()
        self.run_id = self.tracker.active_run.info.run_id

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.tracker.log({metric_name(key): value for key, value in values.items()}, step=step)

    def image(self, tag: str, picture: Any, step: int) -> None:
        import mlflow

        mlflow.log_image(picture, key=MLFLOW_NAME.sub("_", tag), step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        import mlflow

        mlflow.log_text(text, f"{tag}/step_{step:06d}.md")

    def config(self, resolved: dict[str, Any]) -> None:
        params = {MLFLOW_NAME.sub("_", key): value for key, value in flat(resolved).items()}
        self.tracker.store_init_configuration(params)

    def close(self, code: int) -> None:
        import mlflow

        mlflow.end_run(status="FINISHED" if code == FINISHED else "KILLED" if code == INTERRUPTED else "FAILED")


def mlflow_uri(settings: TrackerConfig) -> str:
    """The tracking URI: `dir`'s file store, else `tracking_uri` or MLFLOW_TRACKING_URI, where a
    path without a scheme is a file store there (a drive letter is no scheme)."""
    if settings.dir:
        return Path(settings.dir).resolve().as_uri()
    uri = settings.tracking_uri or os.environ["MLFLOW_TRACKING_URI"]  # with_default_store set dir otherwise
    return uri if len(urlparse(uri).scheme) > 1 else Path(uri).resolve().as_uri()


def with_default_store(settings: TrackerConfig, config: Config) -> TrackerConfig:
    """mlflow with no store named anywhere logs to a file store in the run's output folder: mlflow
    3's own default is an SQLite store, which mlflow-skinny cannot open."""
    named = settings.dir or settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if settings.type != "mlflow" or named:
        return settings
    return settings.model_copy(update={"dir": str(config.output_dir / "mlruns")})


class CometML(Tracker):
    kind = "comet_ml"

    def __init__(self, settings: TrackerConfig, name: str, resume_id: str | None) -> None:
        from accelerate.tracking import CometMLTracker

        self.tracker = CometMLTracker(settings.project, workspace=settings.entity, online=not settings.offline,
                                      experiment_key=resume_id, mode="get" if resume_id else "create")
        self.tracker.start()
        self.tracker.writer.set_name(name)
        self.tracker.writer.add_tags(settings.tags)
        self.run_id = self.tracker.writer.get_key()

    def image(self, tag: str, picture: Any, step: int) -> None:
        self.tracker.writer.log_image(picture, name=tag, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.tracker.writer.log_text(text, step=step, metadata={"tag": tag})

    def config(self, resolved: dict[str, Any]) -> None:
        self.tracker.store_init_configuration(flat(resolved))


class Aim(Tracker):
    kind = "aim"

    def __init__(self, settings: TrackerConfig, name: str, resume_id: str | None) -> None:
        from accelerate.tracking import AimTracker

        self.tracker = AimTracker(name, logging_dir=settings.dir or ".", experiment=settings.project,
                                  run_hash=resume_id)
        self.tracker.start()
        for tag in settings.tags:
            self.tracker.writer.add_tag(tag)
        self.run_id = self.tracker.writer.hash

    def image(self, tag: str, picture: Any, step: int) -> None:
        self.tracker.log_images({tag: picture}, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        import aim

        self.tracker.writer.track(aim.Text(text), name=tag, step=step)


KINDS: dict[str, type[Tracker]] = {kind.kind: kind for kind in (WandB, MLflow, CometML, Aim)}


class RunLog:
    """What the run logs, in SummaryWriter's calls: to TensorBoard (None when off) and each tracker.
    A tracker that fails mid-run is one warning line and gets nothing more; the run goes on. A
    TensorBoard write that fails (a full disk) is an OutputWriteError, which ends the run."""

    def __init__(self, tensorboard: Any, trackers: list[Tracker]) -> None:
        self.tensorboard, self.trackers = tensorboard, trackers

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._to_tensorboard("add_scalar", tag, value, step)
        self._each("scalars", {tag: value}, step)

    def add_image(self, tag: str, picture: Any, step: int, dataformats: str = "HWC") -> None:
        self._to_tensorboard("add_image", tag, picture, step, dataformats=dataformats)
        self._each("image", tag, picture, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._to_tensorboard("add_text", tag, text, step)
        self._each("text", tag, text, step)

    def run_ids(self) -> dict[str, str]:
        """Each tracker's run id, for the trainer state (a resume continues these runs)."""
        return {tracker.kind: tracker.run_id for tracker in self.trackers}

    def close(self, code: int = FINISHED) -> None:
        """TensorBoard closed; each tracker's run ended with the run's exit code as its status, even
        when closing TensorBoard fails."""
        try:
            self._to_tensorboard("close")
        finally:
            self._each("close", code)

    def _to_tensorboard(self, method: str, *args: Any, **kwargs: Any) -> None:
        """One SummaryWriter call; a failed write is an OutputWriteError naming the TensorBoard
        folder, and the writer, broken now, gets nothing more (closing it would fail again)."""
        if not self.tensorboard:
            return
        writer = self.tensorboard
        try:
            with reported_write_failures(writer.get_logdir()):
                getattr(writer, method)(*args, **kwargs)
        except OutputWriteError:
            self.tensorboard = None
            raise

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                with rng_kept():
                    getattr(tracker, method)(*args)
            except Exception as exc:  # a tracker's server or disk: training goes on without it
                self.trackers.remove(tracker)
                print(f"warning: training.trackers: {tracker.kind} failed ({type(exc).__name__}: {exc}); it gets "
                      "nothing more from this run", file=sys.stderr)


def start_tracker(config: Config, index: int, resume_id: str | None, preflight: str) -> Tracker:
    """Start (or, given its saved id, continue) one tracker's run; a new run gets the resolved config
    and the pre-flight report once. A saved run the tracker cannot continue (its store was moved) is
    a warning and a new run; a tracker that cannot start is a ConfigError."""
    settings = with_default_store(config.training.trackers[index], config)
    kind, name = KINDS[settings.type], settings.run_name or config.run.name

    def begin(run_id: str | None) -> Tracker:
        with rng_kept():
            tracker = kind(settings, name, run_id)
            if run_id is None:
                tracker.config(config.resolved())
                tracker.text("run/preflight", preflight, 0)
        return tracker

    if resume_id:
        try:
            return begin(resume_id)
        except Exception as exc:
            print(f"warning: training.trackers[{index}]: {settings.type} cannot continue run {resume_id} "
                  f"({type(exc).__name__}: {exc}); it starts a new run", file=sys.stderr)
    try:
        return begin(None)
    except Exception as exc:
        raise ConfigError(f"training.trackers[{index}]: {settings.type} could not start: "
                          f"{type(exc).__name__}: {exc}") from None


def open_run_log(config: Config, tensorboard: Any, resume_ids: dict[str, str], preflight: str) -> RunLog | None:
    """The run's log: TensorBoard's writer (None when off) and the configured trackers, None when neither."""
    trackers = [start_tracker(config, index, resume_ids.get(settings.type), preflight)
                for index, settings in enumerate(config.training.trackers)]
    return RunLog(tensorboard, trackers) if tensorboard is not None or trackers else None
