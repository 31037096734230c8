"""What a run writes besides checkpoints: weights (adapter file or pipeline folder), TensorBoard
scalars and `run_summary.json`. Every write is atomic."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .adapters import save_diffusers_adapter
from .atomic import reported_write_failures, write_json
from .config import Config, TensorBoardConfig
from .finite import check_finite

if TYPE_CHECKING:
    from diffusers import StableDiffusionXLPipeline

    from .training_setup import Trainable

def save_weights(folder: Path, pipe: StableDiffusionXLPipeline, trainable: Trainable) -> None:
    """Adapter runs: `pytorch_lora_weights.safetensors`; full runs: a diffusers pipeline folder;
    new tokens (textual inversion): their embedding files."""
    from .embeddings import save_embedding_files

    check_finite(trainable)
    if trainable.is_adapter:
        if trainable.modules:  # none in textual inversion alone
            save_diffusers_adapter(folder, trainable.modules)
    else:
        save_pipeline(folder, pipe)
    if trainable.tokens:
        save_embedding_files(trainable.tokens, folder)


def save_pipeline(folder: Path, pipe: StableDiffusionXLPipeline) -> None:
    """`save_pretrained` into a temporary folder, then move each part into place; the folder
    may already hold other outputs (checkpoints, eval images) that stay untouched."""
    folder.mkdir(parents=True, exist_ok=True)
    with reported_write_failures(folder), tempfile.TemporaryDirectory(prefix=".pipeline-", dir=folder) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        entries = sorted(Path(tmp).iterdir(), key=lambda p: p.name == "model_index.json")
        for entry in entries:  # model_index.json last: the folder loads only once all parts are in
            destination = folder / entry.name
            if destination.is_dir():
                old = Path(tmp) / f".old-{entry.name}"
                os.replace(destination, old)
            os.replace(entry, destination)


def save_final(config: Config, pipe: StableDiffusionXLPipeline, trainable: Trainable) -> None:
    """Full runs: the pipeline folder; adapter files are written by export.export_after_training."""
    check_finite(trainable)
    if not trainable.is_adapter:
        save_pipeline(config.output_dir, pipe)


def write_summary(config: Config, summary: dict[str, Any]) -> None:
    write_json(config.output_dir / "run_summary.json", summary)


def open_tensorboard(config: Config, preflight: str):
    """A TensorBoard writer for the run, or None when disabled; the config and the pre-flight
    report go in as text, flushed at once: a full disk is an OutputWriteError now, before the
    first step, not an error from TensorBoard's writer thread later."""
    if not config.training.tensorboard.enabled:
        return None
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    quiet_writer_threads()
    with reported_write_failures(config.tensorboard_dir):
        writer = SummaryWriter(log_dir=str(config.tensorboard_dir))
        writer.add_text("run/config", "```json\n" + json.dumps(config.resolved(), indent=2) + "\n```", 0)
        writer.add_text("run/preflight", "```\n" + preflight + "\n```", 0)
        # The HParams tab: this run's main settings beside its loss, comparable across runs.
        for summary in hparams(run_hparams(config), {"train/loss": float("nan")}):
            writer.file_writer.add_summary(summary)
        writer.flush()
    return writer


def quiet_writer_threads() -> None:
    """TensorBoard's writer thread hands its error (a full disk) to the main thread, which raises it
    at the next write or flush and reports it in one line; the thread's own traceback on the way
    out would only repeat it. Other threads' errors are printed as before."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not type(args.thread).__module__.startswith("tensorboard."):
            previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def run_hparams(config: Config) -> dict[str, Any]:
    training, adapter = config.training, config.adapter
    return {
        "adapter": adapter.type, "rank": adapter.rank, "alpha": adapter.alpha, "precision": config.precision,
        "lr_unet": training.lr_unet, "lr_text_encoder_1": training.lr_text_encoder_1 or 0.0,
        "optimizer": config.optimizer.type, "grad_accum_steps": training.grad_accum_steps,
        "batch_size": config.data.bucket.batch_size if config.data.bucket.enabled else training.batch_size,
        "snr_gamma": training.snr_gamma or 0.0, "noise_offset": training.noise_offset,
        "lr_schedule": training.lr_scheduler.type if training.lr_scheduler else "constant",
    }


def log_memory(writer, step: int, peaks: dict[str, int], plan) -> None:
    """The measured peaks since the last log step, in GB, and the planned peak beside them."""
    for name, value in peaks.items():
        writer.add_scalar(f"memory/{name}_GB", value / 1e9, step)
    if plan is not None and peaks:
        writer.add_scalar("memory/planned_GB", plan.peak / 1e9, step)


def log_step(writer, step: int, loss: float, learning_rates: list[float], group_names: list[str],
             grad_norm: float, scaler, tensorboard: TensorBoardConfig) -> None:
    """The per-step scalars: loss, learning rate per component, gradient norm, AMP scale."""
    writer.add_scalar("train/loss", loss, step)
    for name, lr in zip(group_names, learning_rates, strict=True):
        writer.add_scalar(f"lr/{name}", lr, step)
    if tensorboard.log_grad_norm:
        writer.add_scalar("train/grad_norm", grad_norm, step)
    if tensorboard.log_scaler and scaler.is_enabled():
        writer.add_scalar("train/amp_scale", scaler.get_scale(), step)
