"""Trainer state for exact resume: what `trainer_state.pt` holds, where a resume starts from, and
whether the run being resumed is compatible with the current config.

Resuming restores the optimizer, grad scaler, EMA, LR schedule, every RNG stream and the position
in the data (epoch and batches done in it; the order of an epoch is a function of the seed and the
epoch), so stopping at step k and resuming gives the same weights at step N as a run that never
stopped. The file holds only tensors and plain Python values, so it loads with
`torch.load(weights_only=True)` and can never run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import outputs
from .adapter_kinds import ADAPTER_KINDS
from .atomic import atomic_dir, atomic_path
from .config import Config, ConfigError
from .lr_schedule import schedule_settings

if TYPE_CHECKING:
    from diffusers import StableDiffusionXLPipeline

    from .training_setup import Trainable

STATE_FILE = "trainer_state.pt"
STATE_FORMAT = 1
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class Position:
    """Where training stands: optimizer steps done, and the epoch and batches done in it."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0


# ------------------------------------------------------------------------ what must match
def identity(config: Config) -> dict[str, Any]:
    """Settings a resumed run must share with the run it continues (the weights depend on them)."""
    adapter = config.adapter
    # The kind's own options and LoRA+ only where they apply: states saved before these keys still match.
    own_options = [*ADAPTER_KINDS[adapter.type].own_options] if adapter.type in ADAPTER_KINDS else []
    if adapter.loraplus_lr_ratio:
        own_options.append("loraplus_lr_ratio")
    return {
        "model.id": config.model.id, "model.vae": config.model.vae,
        "model.train_text_encoder_1": config.model.train_text_encoder_1,
        "model.train_text_encoder_2": config.model.train_text_encoder_2,
        "model.weights_dtype": config.model.weights_dtype, "model.use_ema": config.model.use_ema,
        "adapter.type": adapter.type, "adapter.rank": adapter.rank, "adapter.alpha": adapter.alpha,
        "adapter.targets": adapter.targets, "adapter.conv_rank": adapter.conv_rank,
        "adapter.conv_alpha": adapter.conv_alpha, "precision": config.precision,
        "optimizer.type": config.optimizer.type,
    } | {f"adapter.{key}": getattr(adapter, key) for key in own_options} | inversion_identity(config) \
        | quantization_settings(config)


def inversion_identity(config: Config) -> dict[str, Any]:
    """The new tokens and whether the adapter trains with them (nothing without textual inversion,
    so that states saved before these keys still match)."""
    inversion = config.textual_inversion
    if not inversion.tokens:
        return {}
    return {"textual_inversion.tokens": [new.model_dump() for new in inversion.tokens],
            "textual_inversion.train_adapter": inversion.train_adapter}


def quantization_settings(config: Config) -> dict[str, Any]:
    """The quantized base's keys, where it is on (states saved before them still match)."""
    if config.model.base_quantization == "none":
        return {}
    return {"model.base_quantization": config.model.base_quantization,
            "model.base_quantization_text_encoders": config.model.base_quantization_text_encoders}


def soft_settings(config: Config, data_plan, total_steps: int) -> dict[str, Any]:
    """Settings that may change on resume, each with what the change means."""
    images = sorted(f"{s.record.sha256}:{s.record.caption}" + (f":{s.record.mask}" if s.record.mask else "")
                    + (f":{s.loss_weight:g}" if s.loss_weight != 1.0 else "") for s in data_plan.samples)
    return {
        "dataset": hashlib.sha256("\n".join(images).encode()).hexdigest()[:16],
        "batch_sizes": sorted(f"{w}x{h}:{n}" for (w, h), n in data_plan.batch_sizes.items()),
        "grad_accum_steps": config.training.grad_accum_steps,
        "total_steps": total_steps,
        "lr_scheduler": schedule_settings(config.training).model_dump(),
    }


SOFT_CHANGE_EFFECTS = {
    "dataset": "the images or captions changed: the epoch order and the data position no longer match "
               "the interrupted run; training continues on the new data",
    "batch_sizes": "the batch sizes changed: the position in the epoch is kept in batches, so some images "
                   "are seen twice or skipped in this epoch",
    "grad_accum_steps": "the gradient accumulation changed: the effective batch size differs from here on",
    "total_steps": "the run length changed: the LR schedule follows the new length from here on",
    "lr_scheduler": "the LR schedule changed: the learning rate follows the new schedule from here on",
}


def check_compatible(saved: SavedState, config: Config, soft: dict[str, Any]) -> list[str]:
    """Raise a ConfigError naming every setting that differs from the saved run and would
    change what the weights mean; return warnings for the settings that may change (those the
    saved run recorded: a state saved before a setting was recorded does not warn about it)."""
    current = identity(config)
    differences = [f"{key}: {saved.identity.get(key)!r} then, {value!r} now"
                   for key, value in current.items() if saved.identity.get(key) != value]
    if differences:
        raise ConfigError("cannot resume: the run differs in " + "; ".join(differences))
    return [f"{key} changed: {SOFT_CHANGE_EFFECTS[key]}" for key, value in soft.items()
            if key in saved.soft and saved.soft[key] != value]


# ------------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                         saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------- save / load
@dataclass
class TrainerSnapshot:
    """The live training state a checkpoint saves beside the weights, taken at one step."""

    position: Position
    seed: int
    optimizer: dict[str, Any]  # the whole optimizer's state (gathered under FSDP)
    lr_scheduler: dict[str, Any]
    scaler: dict[str, Any]
    ema: dict[str, Any] | None
    nan_skips: int  # consecutive skipped steps (NaN policy "skip")
    rng: list[dict[str, Any]]  # one `rng_state()` per process
    seconds: float = 0.0  # training time so far, over every session of the run
    tracker_runs: dict[str, str] = field(default_factory=dict)  # tracker type -> its run's id, which a resume continues


def save_state(path: Path, config: Config, soft: dict[str, Any], snapshot: TrainerSnapshot) -> None:
    """Write the trainer state atomically."""
    import torch

    position = snapshot.position
    state = {
        "format": STATE_FORMAT,
        "identity": identity(config),
        "soft": soft,
        "config": json.dumps(config.resolved()),
        "position": {"step": position.step, "epoch": position.epoch, "batches_in_epoch": position.batches_in_epoch},
        "seed": snapshot.seed,
        "optimizer": snapshot.optimizer,
        "lr_scheduler": snapshot.lr_scheduler,
        "scaler": snapshot.scaler,
        "ema": snapshot.ema,
        "nan_skips": snapshot.nan_skips,
        "rng": snapshot.rng,
        "seconds": snapshot.seconds,
        "tracker_runs": snapshot.tracker_runs,
    }
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


@dataclass
class SavedState:
    """A trainer state read back: the snapshot saved, and the settings it was saved under (what a
    resume checks against the current config)."""

    snapshot: TrainerSnapshot
    identity: dict[str, Any]
    soft: dict[str, Any]


@dataclass
class Resume:
    """Where a resumed run continues from: the folder with the weights, and the snapshot of its state."""

    folder: Path
    snapshot: TrainerSnapshot


def load_state(path: Path) -> SavedState:
    """Read a trainer state (never running code from it); a missing, empty, truncated or foreign
    file is a ConfigError naming it."""
    import torch

    if path.is_file() and path.stat().st_size == 0:
        raise ConfigError(f"{path}: empty file (0 bytes; its write was interrupted): resume from an earlier checkpoint")
    try:
        # Memory-mapped: every process of a multi-GPU run reads the same file, and a full fine-tune's
        # optimizer state is twice the model; mapped, they share one copy in the page cache.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ConfigError(f"training.resume_state_path: {path} does not exist") from None
    except Exception as exc:  # a truncated or foreign file: say which, never run anything from it
        raise ConfigError(f"{path}: not a readable trainer state ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ConfigError(f"{path}: not a trainer state of this version")
    snapshot = TrainerSnapshot(
        Position(**state["position"]), state["seed"], state["optimizer"], state["lr_scheduler"], state["scaler"],
        state["ema"], state["nan_skips"], state["rng"],
        seconds=state.get("seconds", 0.0),  # absent in states written before it was saved
        tracker_runs=state.get("tracker_runs", {}),  # likewise
    )
    return SavedState(snapshot, state["identity"], state["soft"])


# --------------------------------------------------------------------------- where from
class RunComplete(Exception):
    """`resume_from: latest` found a run that completed every step: nothing to do (exit 0)."""


@dataclass
class ResumeChoice:
    """Where a start continues from. The pre-flight shows one; the run makes its own under the
    output folder's lock (checkpoints may have changed in between) and keeps that one."""

    folder: Path | None = None  # the weights; None: a new run
    state_path: Path | None = None
    saved: SavedState | None = None  # what `state_path` holds (not sent between processes)
    skipped: list[str] = field(default_factory=list)  # damaged newer checkpoints passed over, and why
    complete: str = ""  # `latest` of a completed run: what says so (then there is nothing to do)


def choose_resume(config: Config, total_steps: int) -> ResumeChoice:
    """Where to resume from: `resume_from` is None (a new run), an output or checkpoint folder, or
    "latest": nothing to do when the run completed `total_steps`; its final state when it completed
    fewer steps (newer than every checkpoint); else the newest intact checkpoint of this run (a
    damaged newer one is passed over and named), or a new run while there is none (one command
    serves every start of a preemptible job). `resume_state_path` defaults to
    `<folder>/trainer_state.pt`. The answer depends only on the files, never on the process's rank.
    """
    resume_from = config.training.resume_from
    if resume_from is None:
        return ResumeChoice()
    if resume_from != "latest":
        folder = Path(resume_from)
        if not folder.is_dir():
            raise ConfigError(f"training.resume_from = {resume_from!r}: no such folder")
        check_not_averaged(config, folder)
        return read_checkpoint(config, folder)
    checkpoints = list_checkpoints(config.output_dir / "checkpoints")
    finished = finished_run(config, checkpoints)
    if finished:
        check_compatible(finished, config, finished.soft)
    if finished and finished.snapshot.position.step >= total_steps:
        return ResumeChoice(complete=f"resume: latest: the run in {config.output_dir} completed all "
                                     f"{finished.snapshot.position.step} steps; nothing to do (raise "
                                     "training.num_steps to train on, or set another run.name for a new run)")
    skipped = []
    if finished and finished.snapshot.position.step > checkpoint_step(checkpoints):  # continue a completed run
        check_outputs_resumable(config, finished.snapshot.position.step, checkpoints)
        try:
            check_resume_weights(config.output_dir, config)
            return ResumeChoice(config.output_dir, config.state_path, finished)
        except ConfigError as exc:
            skipped.append(f"the final state in {config.output_dir} is damaged ({exc})")
    for folder in reversed(checkpoints):
        try:
            return replace(read_checkpoint(config, folder), skipped=skipped)
        except ConfigError as exc:
            skipped.append(f"{folder.name} is damaged ({exc})")
    if skipped:
        raise ConfigError("training.resume_from = 'latest': no intact checkpoint: " + "; ".join(skipped))
    return ResumeChoice()  # nothing saved yet (a first start, or killed before the first checkpoint)


def read_checkpoint(config: Config, folder: Path) -> ResumeChoice:
    """A checkpoint's trainer state, read, and its weights checked complete (ConfigError if not)."""
    state = Path(config.training.resume_state_path) if config.training.resume_state_path else folder / STATE_FILE
    if not state.is_file():
        raise ConfigError(f"training.resume_from = {str(folder)!r}: no {state.name} (set training.resume_state_path)")
    saved = load_state(state)
    check_resume_weights(folder, config)
    return ResumeChoice(folder, state, saved)


def finished_run(config: Config, checkpoints: list[Path]) -> SavedState | None:
    """The final trainer state of the run in the output folder when it completed (its summary
    says so, at that state's step) and no checkpoint is newer; else None."""
    try:
        summary = json.loads((config.output_dir / "run_summary.json").read_text(encoding="utf-8"))
        saved = load_state(config.state_path)
    except (OSError, ValueError, ConfigError):  # no finished run there (or not readable as one)
        return None
    step = saved.snapshot.position.step
    completed = isinstance(summary, dict) and summary.get("status") == "completed" and summary.get("steps") == step
    return saved if completed and checkpoint_step(checkpoints) <= step else None


def check_outputs_resumable(config: Config, step: int, checkpoints: list[Path]) -> None:
    """A longer run continues a completed one from its final state, exactly: from the output folder
    when it holds the trained weights, else from the checkpoint its last step saved, which is then
    the newest. A run saved before that checkpoint was written has none: a ConfigError naming the
    newest checkpoint, never a silent start from scratch over the outputs."""
    if outputs_resumable(config):
        return
    why = averaged_outputs(config) or "no diffusers adapter file among export.adapter_formats"
    where = f"resume from {checkpoints[-1]}" if checkpoints else "there is no checkpoint to resume from"
    raise ConfigError(f"training.resume_from = 'latest': the run in {config.output_dir} completed {step} steps, but "
                      f"its outputs are not its trained weights ({why}) and it saved no checkpoint of step {step}: "
                      f"{where}, or set another run.name for a new run")


def averaged_outputs(config: Config) -> str:
    """What the final outputs hold instead of the trained weights ("" when they are those): the
    EMA, or schedule-free's averaged weights. Training cannot continue exactly from either."""
    if config.model.use_ema:
        return "the EMA of the trained weights (model.use_ema)"
    if config.optimizer.type == "adamw_schedulefree":
        return "schedule-free's averaged weights"
    return ""


def outputs_resumable(config: Config) -> bool:
    """Whether the output folder holds the trained weights as a resume reads them. When not, the
    last step saves a checkpoint too (run.checkpoint_due), so that a longer run continues exactly."""
    readable = config.adapter.type == "none" or "diffusers" in config.export.adapter_formats
    return readable and not averaged_outputs(config)


def check_not_averaged(config: Config, folder: Path) -> None:
    """An output folder (any folder but a checkpoint) of a run with EMA or schedule-free holds the
    averaged weights: resuming from it would train on from them, not from the trained weights.
    ConfigError naming the checkpoint to resume from."""
    what = averaged_outputs(config)
    if not what or CHECKPOINT_NAME.match(folder.name):
        return
    checkpoints = list_checkpoints(folder / "checkpoints")
    where = f"resume from {checkpoints[-1]}" if checkpoints else "it has no checkpoint to resume from"
    raise ConfigError(f"training.resume_from = {str(folder)!r}: an output folder holds {what}, not the weights "
                      f"training continues from; {where}")


def checkpoint_step(checkpoints: list[Path]) -> int:
    """The step of the newest of `checkpoints` (0 when there is none)."""
    return int(CHECKPOINT_NAME.match(checkpoints[-1].name).group(1)) if checkpoints else 0


def check_resume_weights(folder: Path, config: Config) -> None:
    """The weights a resume loads are there and complete: a truncated file is found at pre-flight,
    not after the latent cache is built."""
    from .adapters import weight_file_name
    from .formats.safetensors_header import read_header
    from .models import require_pipeline_folder

    inversion = config.textual_inversion
    if inversion.tokens and not inversion.train_adapter:
        return  # textual inversion alone: the embedding files, checked as they are read
    if config.adapter.type == "none":
        require_pipeline_folder(folder, "training.resume_from")
        return
    weights = folder / weight_file_name(config.adapter.type)
    if not weights.is_file():
        raise ConfigError(f"training.resume_from = {str(folder)!r}: no {weights.name} in it")
    try:
        read_header(weights)
    except ValueError as exc:
        raise ConfigError(f"training.resume_from: {weights}: {exc}; resume from an earlier checkpoint") from None


# ------------------------------------------------------------------------ checkpoint folders
def save_checkpoint(config: Config, pipe: StableDiffusionXLPipeline, trainable: Trainable, step: int,
                    write_state: Callable[[Path], None]) -> Path:
    """Write `checkpoints/checkpoint-<step>/` (weights and trainer state) as one atomic folder,
    refresh the run's own state file, then delete the oldest checkpoints beyond the limit."""
    root = config.output_dir / "checkpoints"
    destination = root / f"checkpoint-{step}"
    with atomic_dir(destination) as tmp:
        outputs.save_weights(tmp, pipe, trainable)
        write_state(tmp / STATE_FILE)
    write_state(config.state_path)
    prune_checkpoints(root, config.training.checkpoints_total_limit)
    return destination


def prune_checkpoints(root: Path, limit: int | None, keep: Path | None = None) -> list[Path]:
    """Delete the oldest checkpoints beyond `limit`, never `keep` (the one a resume reads).
    Each is renamed to a hidden name first: a kill during the deletion leaves a leftover that the
    next start removes (output_folder.remove_leftovers), never a half-deleted folder that looks
    complete."""
    if not limit:
        return []
    checkpoints = list_checkpoints(root)
    excess = len(checkpoints) - limit
    candidates = [path for path in checkpoints if keep is None or path.resolve() != keep.resolve()]
    pruned = candidates[:max(0, excess)]
    for old in pruned:
        doomed = old.with_name(f".{old.name}.deleting")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return pruned


def set_aside_newer(config: Config, choice: ResumeChoice) -> tuple[Path | None, list[str]]:
    """A resume from step k abandons what this output folder saved beyond k: the checkpoints (and
    final trainer state) of the run it branches off. They move into
    `checkpoints/abandoned-from-step-<k>/`, which `latest` and pruning never look into, so that a
    later `latest` continues this run, not that one; nothing is deleted. Returns that folder and
    the names of what went there (None and [] when nothing was newer)."""
    if choice.saved is None:
        return None, []
    step = choice.saved.snapshot.position.step
    root = config.output_dir / "checkpoints"
    newer = [path for path in list_checkpoints(root) if checkpoint_step([path]) > step]
    state_is_newer = config.state_path.is_file() and config.state_path != choice.state_path and step < saved_step(
        config.state_path)
    if not newer and not state_is_newer:
        return None, []
    folder = root / f"abandoned-from-step-{step}"
    copies = 1
    while folder.exists():
        copies += 1
        folder = root / f"abandoned-from-step-{step}-{copies}"
    folder.mkdir(parents=True)
    for path in newer:
        os.replace(path, folder / path.name)
    if state_is_newer:
        shutil.move(config.state_path, folder / STATE_FILE)
    return folder, [path.name for path in newer] + ([STATE_FILE] if state_is_newer else [])


def saved_step(path: Path) -> int:
    """The step of a trainer state (-1 when it cannot be read: nothing to set aside)."""
    try:
        return load_state(path).snapshot.position.step
    except ConfigError:
        return -1


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_NAME.match(p.name))]
    return [path for _, path in sorted(found)]
