"""A training run as plain data, and the functions that move it forward.

`start_run` loads everything and returns a `Run`. The loop in `train_sdxl.py` then calls, per
micro-batch, `forward_backward`; when the gradients are complete, `optimizer_step` (unscale,
clip, NaN verdict, step) and `after_step` (EMA, logging, rank check, live eval); at the end,
`save_outputs`. `finish` writes the run summary whichever way the run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import secrets
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, gather, gather_object, set_seed
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import checkpointing, export
from .adapter_kinds import ADAPTER_KINDS
from .adapters import Patterns, load_adapter_weights, weight_file_name
from .atomic import OutputWriteError
from .attention import set_attention
from .checkpointing import (
    Position,
    TrainerSnapshot,
    choose_resume,
    list_checkpoints,
    prune_checkpoints,
    rng_state,
    set_aside_newer,
    set_rng_state,
)
from .config import Config, ConfigError, DataConfig
from .data import ImageCaptionDataset, build_latent_cache, collate
from .diffusion import (
    DrawSettings,
    LossModels,
    LossSettings,
    denoising_step,
    describe_schedule,
    diffusion_loss,
    sample_draws,
    training_noise_scheduler,
)
from .distributed import (
    check_finite_everywhere,
    describe_sharding,
    gather_pipeline,
    is_sharded,
    load_optimizer_state,
    optimizer_state,
    plain_tensor,
)
from .ema import EMA
from .embeddings import attach_tokens, set_training
from .eval.evaluator import Evaluator, live_eval_due, make_validation, validation_batches
from .eval.samplers import check_eval_sampler
from .export import ExportError
from .finite import NonFiniteWeightsError
from .fused_backward import FusedBackward
from .init_adapter import InitAdapter, load_init_adapter, read_init_adapter, saved_patterns
from .long_prompts import length_report, local_tokenizer
from .lr_schedule import make_lr_scheduler, schedule_settings
from .memory.watch import OVER_PLAN, PeakWatch
from .models import load_pipeline
from .nan_guard import ABORT, OK, SKIP, NaNGuard, non_finite_report
from .notify import end_event, notify
from .optimizers import apply_configured_settings, averaged_weights, is_schedule_free, make_optimizer, step_sizes
from .output_folder import OutputLock, remove_leftovers
from .output_preservation import training_loss
from .outputs import log_memory, log_step, open_tensorboard, save_final, write_summary
from .planning import RunPlan, loaded_vae_cache, settle_resume
from .precision import ENCODERS, audit, cast_trained_parameters, place_pipeline, plan_precision
from .stop_request import EXIT_INTERRUPTED, StopRequest
from .text_cache import prepare_text_cache
from .trackers import open_run_log
from .training_setup import prepare_trainable

if TYPE_CHECKING:  # names in type hints only
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline

    from .latent_cache import LatentCache
    from .precision import PrecisionPlan
    from .text_cache import StandIns
    from .training_setup import Trainable

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


@dataclass
class Tally:
    """Bookkeeping between optimizer steps, log lines and epochs."""
    batch_paths: list[str] = field(default_factory=list)  # files since the last optimizer step (NaN report)
    batch_timesteps: list[int] = field(default_factory=list)
    step_losses: list[torch.Tensor] = field(default_factory=list)  # each micro-batch's, since the last step
    logged_losses: list[torch.Tensor] = field(default_factory=list)  # since the last log line
    epoch_losses: list[torch.Tensor] = field(default_factory=list)
    rank_checks: int = 0
    loss_warned: bool = False
    invalid_final_images: int = 0


@dataclass
class Run:
    """What a run holds while it trains."""
    config: Config
    plan: RunPlan
    accelerator: Accelerator
    pipe: StableDiffusionXLPipeline  # what is saved and evaluated (gathered first under FSDP)
    noise_scheduler: DDPMScheduler
    trainable: Trainable
    prepared: list[torch.nn.Module]  # the trained modules as accelerate prepared them (DDP/FSDP)
    models: LossModels  # what the loss runs forward: the prepared (and compiled) modules
    optimizer: Any
    lr_scheduler: Any
    scaler: torch.amp.GradScaler
    autocast: torch.autocast
    guard: NaNGuard
    seed: int
    loader: Any = None
    sampler: Any = None
    position: Position = field(default_factory=Position)
    ema: EMA | None = None
    writer: Any = None  # TensorBoard, main process only
    evaluator: Evaluator | None = None  # main process only
    progress: Any = None  # the tqdm bar (disabled on other processes than the main one)
    started: float = field(default_factory=time.time)
    tally: Tally = field(default_factory=Tally)
    trained_params: list[torch.nn.Parameter] = field(default_factory=list)  # built once, used every step
    warmup_steps: int = 0  # of the LR schedule; EMA starts when it ends
    lock: OutputLock | None = None  # the output folder's, held by the main process
    stop: StopRequest | None = None  # Ctrl-C / SIGTERM, from the first step to the end
    first_step: int = 0  # where this session started (a resume starts later than 0)
    earlier_seconds: float = 0.0  # training time of the sessions before a resume
    memory: PeakWatch | None = None  # the measured peak, beside the plan (when there is one)
    fused: FusedBackward | None = None  # optimizer.fused_backward: steps taken inside backward

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def total_steps(self) -> int:
        return self.plan.total_steps


class StepResult(NamedTuple):
    verdict: str  # nan_guard's OK, SKIP, ABORT or SCALER
    grad_norm: torch.Tensor


# ------------------------------------------------------------------------------------ start
def start_run(config: Config, plan: RunPlan, pipe: StableDiffusionXLPipeline | None = None) -> Run:
    """Lock the output folder, then seed, precision plan, models, optimizer and data; continue from
    `plan.resume` if set. A start that fails or is interrupted releases the lock again.

    `pipe` replaces the model `config.model` names, and a plan without data (`plan.data` None)
    opens no data loader: the caller feeds its own batches (the full-size GPU benchmark does both).
    """
    accelerator = make_accelerator(config)
    lock = claim_output_folder(config, plan, accelerator)
    try:
        run = assemble_run(config, plan, accelerator, pipe, lock)
    except BaseException:
        if lock:
            lock.release()
        raise
    if accelerator.is_main_process:
        notify(config, "start", f"resumed at step {run.first_step}" if run.first_step else "started",
               total_steps=run.total_steps, output_dir=str(config.output_dir))
    return run


def assemble_run(config: Config, plan: RunPlan, accelerator: Accelerator,
                 pipe: StableDiffusionXLPipeline | None, lock: OutputLock | None) -> Run:
    """Everything `start_run` does once the output folder is locked."""
    state = plan.resume.snapshot if plan.resume else None
    seed = choose_seed(config, state, accelerator)
    set_seed(seed)
    precision = plan_precision(config, accelerator.device.type)
    accelerator.print(precision.table())

    if pipe is None:
        pipe = load_base_pipeline(config, plan, accelerator)
    noise_scheduler, cache, trainable = setup_models(config, plan, precision, accelerator, pipe)
    stand_ins = prepare_text_cache(config, plan.data, plan.prompts, accelerator, pipe, seed, precision)
    warmup_steps = schedule_settings(config.training).warmup_steps
    optimizer = make_optimizer(config.optimizer, trainable.param_groups(), accelerator.device.type,
                               precision.components["unet"].trained == "bf16", warmup_steps)
    lr_scheduler = make_lr_scheduler(optimizer, config.training, plan.total_steps, is_schedule_free(optimizer))
    scaler = torch.amp.GradScaler(accelerator.device.type, enabled=precision.uses_grad_scaler)
    prepared, optimizer, lr_scheduler = prepare_training(accelerator, config, trainable, optimizer, lr_scheduler)
    if is_schedule_free(optimizer):
        optimizer.train()  # it steps only in train mode; a resumed state says so again
    restored = Restored(Position())
    if state:
        restored = restore_training_state(state, config, accelerator, trainable, prepared, optimizer, lr_scheduler,
                                          scaler)
    accelerator.print(trainable.describe())
    if is_sharded(accelerator):
        accelerator.print(describe_sharding(accelerator, trainable))
    sampler, loader = open_data(plan, config.data, seed, accelerator.process_index, cache)
    run = Run(
        config=config, plan=plan, accelerator=accelerator, pipe=pipe, noise_scheduler=noise_scheduler,
        trainable=trainable, prepared=prepared, models=loss_models(config, pipe, trainable, prepared, stand_ins),
        optimizer=optimizer, lr_scheduler=lr_scheduler, scaler=scaler, autocast=precision.autocast(),
        guard=make_guard(config, precision.uses_grad_scaler, state), seed=seed, loader=loader, sampler=sampler,
        position=restored.position, ema=restored.ema,
        writer=open_writer(config, plan, precision) if accelerator.is_main_process else None,
        trained_params=list(trainable.parameters()), warmup_steps=warmup_steps, lock=lock,
        first_step=restored.position.step, earlier_seconds=restored.seconds,
        fused=FusedBackward(optimizer, trainable.named_parameters(), accelerator.num_processes)
        if config.optimizer.fused_backward else None,
    )
    if accelerator.is_main_process:  # made from the run: its validation loss runs the run's models
        run.evaluator = make_evaluator(run, cache, stand_ins)
    if state:  # from here on every process draws what it would have drawn next
        set_rng_state(state.rng[accelerator.process_index % len(state.rng)])
    run.stop, run.memory = StopRequest(), watch_memory(plan, pipe, accelerator.device)
    if plan.prompts and not state and config.eval.live.enabled and config.eval.live.at_start:
        live_eval(run, 0)  # the "before" picture, before the progress bar starts
    run.progress = tqdm(total=plan.total_steps, initial=run.position.step, desc="training",
                        disable=not accelerator.is_main_process)
    return run


def prepare_training(accelerator: Accelerator, config: Config, trainable: Trainable, optimizer: Any,
                     lr_scheduler: Any) -> tuple[list[torch.nn.Module], Any, Any]:
    """accelerate's preparation: under DDP the trained modules are wrapped (its reducer averages the
    gradients); under FSDP the UNet is sharded in place and the optimizer pointed at the slices.
    With fused backward the modules are not wrapped: its hooks average each gradient themselves,
    and DDP's bucket buffers would hold a second copy of every gradient (fused_backward.py)."""
    if not config.optimizer.fused_backward:
        *prepared, optimizer, lr_scheduler = accelerator.prepare(*trainable.modules.values(), optimizer,
                                                                 lr_scheduler)
        return prepared, optimizer, lr_scheduler
    prepared = [accelerator.prepare_model(module, evaluation_mode=True) for module in trainable.modules.values()]
    optimizer, lr_scheduler = accelerator.prepare(optimizer, lr_scheduler)
    return prepared, optimizer, lr_scheduler


def loss_models(config: Config, pipe: StableDiffusionXLPipeline, trainable: Trainable,
                prepared: list[torch.nn.Module], stand_ins: StandIns) -> LossModels:
    """What the loss runs forward: the prepared modules (DDP wrappers under several processes: that
    is what synchronises the gradients, unless fused backward's hooks do), the compiled UNet, the
    text cache's stand-ins for frozen encoders. Saving and eval use the pipeline (gathered under FSDP)."""
    forward = dict(zip(trainable.modules, prepared, strict=True))
    unet = forward.get("unet", pipe.unet)  # textual inversion alone trains no UNet
    if config.model.use_torch_compile:
        unet = torch.compile(unet, **config.model.torch_compile_kwargs)
    text_encoders = [forward.get(name, stand_ins.loss.get(name, getattr(pipe, name))) for name in ENCODERS]
    return LossModels(pipe, unet, text_encoders, config.data.max_token_length)


def make_guard(config: Config, grad_scaler: bool, state: TrainerSnapshot | None) -> NaNGuard:
    """`training.nan_policy` (abort under `detect_anomaly`); a resume continues its count of skips."""
    training = config.training
    return NaNGuard(training.nan_policy if not training.detect_anomaly else "abort", training.max_nan_skips,
                    grad_scaler, consecutive=state.nan_skips if state else 0)


def watch_memory(plan: RunPlan, pipe: StableDiffusionXLPipeline, device: torch.device) -> PeakWatch | None:
    """The measured peak beside the plan, from here on (None when no plan was made)."""
    if plan.memory is None:
        return None
    components = [getattr(pipe, name) for name in ("unet", "vae", *ENCODERS)]
    return PeakWatch(device, [t for module in components for t in [*module.parameters(), *module.buffers()]])


def choose_seed(config: Config, state: TrainerSnapshot | None, accelerator: Accelerator) -> int:
    """The configured seed, or one drawn at random and said; a resume keeps the interrupted run's
    seed (the data order and augmentation depend on it)."""
    seed = state.seed if state else config.training.seed or secrets.randbelow(2**31 - 1) + 1
    accelerator.print(f"seed: {seed}"
                      + ("" if config.training.seed or state else " (drawn at random; set training.seed to repeat)"))
    return seed


def claim_output_folder(config: Config, plan: RunPlan, accelerator: Accelerator) -> OutputLock | None:
    """The main process locks the output folder, removes what interrupted writes left there, chooses
    the checkpoint to resume from (under the lock: the pre-flight's may be gone since), sets aside
    the newer checkpoints of the run it branches off and prunes checkpoints beyond the limit (a
    kill between writing one and pruning leaves one too many); every process then continues from
    that choice. A folder in use by another run stops every process
    with a ConfigError, a completed run with RunComplete."""
    lock, refusal, choice = None, None, None
    if accelerator.is_main_process:
        lock = OutputLock(config.output_dir)
        try:
            note = lock.acquire()
            removed = remove_leftovers(config)
            choice = choose_resume(config, plan.total_steps)
        except ConfigError as exc:
            if lock.handle:
                lock.release()
            lock, refusal = None, str(exc)
        else:
            if note:
                print(f"note: {note}")
            abandoned, moved = set_aside_newer(config, choice)
            if abandoned:
                print(f"resume: what the run saved after this resume's step ({', '.join(moved)}) is moved to "
                      f"{abandoned}; `latest` continues this run")
            removed += prune_checkpoints(config.output_dir / "checkpoints", config.training.checkpoints_total_limit,
                                         keep=choice.folder)
            if removed:
                print(f"cleaned up {len(removed)} leftover(s) of an interrupted run: "
                      + ", ".join(path.name for path in removed[:3]) + (" …" if len(removed) > 3 else ""))
    if accelerator.num_processes > 1:  # the state stays behind: each process reads it from the file
        refusal, choice = broadcast_object_list([refusal, choice and dataclasses.replace(choice, saved=None)])
    if refusal:
        raise ConfigError(refusal)
    try:
        for line in settle_resume(plan, choice, config):
            accelerator.print(line)
    except BaseException:
        if lock:
            lock.release()
        raise
    return lock


def make_accelerator(config: Config) -> Accelerator:
    """One process, or one of those `accelerate launch` started (gloo on the CPU without GPUs)."""
    has_accelerator = torch.cuda.is_available() or torch.backends.mps.is_available()
    # Casting follows the precision plan (training.mixed_precision), never accelerate's setting:
    # both at once would autocast twice, and FSDP would upcast bf16 weights to fp32.
    # The main process alone writes checkpoints and renders eval images while the others wait: a
    # full fine-tune's checkpoint can take longer than the collectives' default timeout.
    timeout = datetime.timedelta(minutes=config.training.distributed_timeout_minutes)
    accelerator = Accelerator(gradient_accumulation_steps=config.training.grad_accum_steps, cpu=not has_accelerator,
                              mixed_precision="no", kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    launched_with = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched_with not in ("no", config.precision):
        accelerator.print(f"note: accelerate's mixed_precision={launched_with} is ignored; the precision is "
                          f"training.mixed_precision ({config.precision})")
    return accelerator


def load_base_pipeline(config: Config, plan: RunPlan, accelerator: Accelerator) -> StableDiffusionXLPipeline:
    """The model to train: `model.id`, or a full fine-tune's own pipeline when it resumes. The
    first process of each machine loads first: it writes what is written (a hub download, the
    built-in model), and the others on that machine then find it done."""
    with accelerator.local_main_process_first():
        if plan.resume and config.adapter.type == "none":  # a full fine-tune continues from its pipeline
            return load_pipeline(config.model.model_copy(update={"id": str(plan.resume.folder), "vae": None}))
        return load_pipeline(config.model)


def setup_models(config: Config, plan: RunPlan, precision: PrecisionPlan, accelerator: Accelerator,
                 pipe: StableDiffusionXLPipeline) -> tuple[DDPMScheduler, LatentCache | None, Trainable]:
    """Place SDXL in the planned dtypes, cache latents, attach adapters (or unfreeze), audit.
    The latent cache is built by the first process of each machine, as the model is loaded:
    caches are usually local disks, and on a shared one the writes are atomic and identical."""
    device = accelerator.device
    resume_folder = plan.resume.folder if plan.resume else None
    place_pipeline(pipe, precision, device)
    accelerator.print(f"attention: {set_attention(pipe.unet, config.model.attention, device.type)}")
    if plan.data is not None and local_tokenizer(config.model) is None:  # not counted in the pre-flight
        accelerator.print(length_report(pipe.tokenizer, config.data.max_token_length, plan.data, plan.prompts))
    noise_scheduler = training_noise_scheduler(pipe.scheduler.config, config.training)
    accelerator.print(describe_schedule(noise_scheduler))
    # The saved pipeline (and the single file's v_pred/ztsnr markers) must say what was trained.
    pipe.scheduler = pipe.scheduler.__class__.from_config(
        pipe.scheduler.config, prediction_type=noise_scheduler.config.prediction_type,
        rescale_betas_zero_snr=noise_scheduler.config.rescale_betas_zero_snr,
    )
    if plan.prompts:  # now that the schedule is known: can the eval sampler follow it?
        check_eval_sampler(config.eval, pipe.scheduler.config)
    cache = None
    if config.data.latent_cache.enabled and plan.data is not None:
        cache = loaded_vae_cache(config, pipe.vae)
        with accelerator.local_main_process_first():
            hits, built = build_latent_cache(plan.data, config.data, cache, pipe.vae, device)
        accelerator.print(f"latent cache: {hits} hits, {built} encoded now")
    # `adapter.init_from` is read at a fresh start only: a resume continues from its checkpoint.
    init = read_init_adapter(config, pipe) if config.adapter.init_from and not resume_folder else None
    trainable = prepare_trainable(pipe, config, adapter_patterns(config, init, resume_folder))
    # peft creates adapters in the dtype of the layer they wrap (bf16/fp16 here): they get their fp32
    # master dtype before a resume or `adapter.init_from` loads the saved weights, which would
    # otherwise be rounded to it.
    cast_trained_parameters(trainable.modules, precision)
    if init:
        accelerator.print(f"init: {load_init_adapter(init, trainable)} modules loaded from {init.path}")
    if resume_folder and trainable.modules and trainable.is_adapter:
        tensors = load_file(resume_folder / weight_file_name(config.adapter.type))
        for name, module in trainable.modules.items():
            load_adapter_weights(module, name, tensors)
    audited = audit(pipe, precision, adapter=trainable.is_adapter)
    accelerator.print(f"precision audit: {audited['checked']} tensors as planned, "
                      f"{audited['trained']} of them trained")
    trainable.tokens = attach_tokens(pipe, config, resume_folder)
    return noise_scheduler, cache, trainable


def adapter_patterns(config: Config, init: InitAdapter | None, resume_folder: Path | None) -> Patterns:
    """The modules whose rank or alpha is not the config's: those of `adapter.init_from` at a fresh
    start; at a resume those its checkpoint's adapter file was saved with (its metadata), so that
    the run continues on exactly the adapter it stopped with, without reading `init_from` again."""
    if init:
        return init.patterns
    if not resume_folder or config.adapter.type not in ADAPTER_KINDS:
        return {}
    weights = resume_folder / weight_file_name(config.adapter.type)
    return saved_patterns(weights) if weights.is_file() else {}  # none: textual inversion alone


class Restored(NamedTuple):
    """What a resume brings back besides the optimizer's, schedule's and scaler's own state."""
    position: Position
    seconds: float = 0.0  # training time of the sessions before
    ema: EMA | None = None


def restore_training_state(state: TrainerSnapshot, config: Config, accelerator: Accelerator, trainable: Trainable,
                           prepared: list[torch.nn.Module], optimizer: Any, lr_scheduler: Any,
                           scaler: torch.amp.GradScaler) -> Restored:
    """Optimizer, LR schedule and grad scaler of the run being resumed (in place; the config's
    learning rates and optimizer settings win), and its data position, time and EMA."""
    configured = [dict(group) for group in optimizer.param_groups]
    load_optimizer_state(accelerator, next(iter(prepared), None), optimizer, state.optimizer)
    lr_scheduler.load_state_dict(state.lr_scheduler)
    for change in apply_configured_settings(optimizer, lr_scheduler, configured, config.optimizer,
                                            trainable.group_names):
        accelerator.print(f"resume: the config changes {change} (the config's value is used)")
    scaler.load_state_dict(state.scaler)
    ema = None
    if state.ema is not None:
        ema = EMA(list(trainable.named_parameters()), config.model.ema_decay, config.model.ema_device)
        ema.load_state_dict(state.ema)
    return Restored(Position(**vars(state.position)), state.seconds, ema)


def open_data(plan: RunPlan, data: DataConfig, seed: int, rank: int,
              cache: LatentCache | None) -> tuple[Any, DataLoader | None]:
    """This process's batch sampler and batches, in an order fixed by the seed and the epoch (none
    for a plan without data: its caller feeds its own batches)."""
    if plan.data is None:
        return None, None
    sampler = plan.data.sampler(seed, rank=rank)
    loader = DataLoader(
        ImageCaptionDataset(plan.data.samples, data, seed, cache),
        batch_sampler=sampler, collate_fn=collate, num_workers=data.num_workers,
        # Its own generator: starting an epoch must not draw from the training RNG (exact resume).
        generator=torch.Generator().manual_seed(seed),
    )
    return sampler, loader


def open_writer(config: Config, plan: RunPlan, precision: PrecisionPlan):
    """TensorBoard and the trackers (continuing the resumed run's tracker runs), or None."""
    preflight = plan.preflight + "\n" + precision.table()
    resumed = plan.resume.snapshot.tracker_runs if plan.resume else {}
    return open_run_log(config, open_tensorboard(config, preflight), resumed, preflight)


def make_evaluator(run: Run, cache: LatentCache | None, stand_ins: StandIns) -> Evaluator | None:
    """Eval images and the validation loss (main process; None when eval is off)."""
    if not run.plan.prompts:
        return None
    validation = None
    if run.config.eval.live.enabled:
        batches = validation_batches(run.plan.data, run.config, run.seed, cache)
        validation = make_validation(batches, run.noise_scheduler.config.num_train_timesteps, run.seed)

    def eval_loss(pipe: StableDiffusionXLPipeline, batch: dict, draws) -> torch.Tensor:
        models = LossModels.of(pipe, stand_ins.loss, run.config.data.max_token_length)
        return diffusion_loss(models, run.noise_scheduler, batch, draws, run.device)

    return Evaluator(run.config, run.plan.prompts, validation, eval_loss, list(run.trainable.modules), run.writer,
                     stand_ins.eval)


# ------------------------------------------------------------------------------------- steps
def epoch_batches(run: Run) -> Iterator[dict]:
    """The batches of the current epoch not trained yet (all of them, unless resuming mid-epoch)."""
    run.sampler.set_epoch(run.position.epoch, start=run.position.batches_in_epoch)
    run.tally.epoch_losses = []
    yield from run.loader


def forward_backward(run: Run, batch: dict) -> torch.Tensor:
    """One micro-batch: the loss on its per-image draws, and its gradients (which add up over
    `grad_accum_steps` micro-batches)."""
    training, tally = run.config.training, run.tally
    set_training(run.trainable.tokens, run.position.step, run.plan.total_steps)
    run.position.batches_in_epoch += 1
    height, width = batch["target_sizes"][0].tolist()
    latent_shape = (len(batch["keys"]), run.pipe.unet.config.in_channels, height // 8, width // 8)
    draws = sample_draws(batch["keys"], run.seed, latent_shape,
                         DrawSettings.of(training, run.noise_scheduler.config.num_train_timesteps))
    tally.batch_paths += batch["paths"]
    tally.batch_timesteps += draws.timesteps.tolist()
    settings = LossSettings.of(training, min_sigma_on=run.position.step >= training.min_sigma_warmup_steps)
    with run.accelerator.accumulate(*run.prepared), run.autocast:
        step = denoising_step(run.models, run.noise_scheduler, batch, draws, run.device, settings)
        loss = training_loss(run.models, batch, step, training.output_preservation, run.position.step,
                             list(run.trainable.modules.values()))
        if not loss.requires_grad:
            loss = loss + zero_gradient_term(run.trainable)
        run.accelerator.backward(run.scaler.scale(loss))
    tally.step_losses.append(loss.detach())
    tally.epoch_losses.append(loss.detach())
    return loss


def zero_gradient_term(trainable: Trainable) -> torch.Tensor:
    """0 × every trained weight, for a loss that none of them took part in: textual inversion alone
    on a batch whose captions were all dropped (SDXL's embedding of an empty caption is zero, so the
    new rows are never read). Backward then gives each weight its true gradient, zero, and the step
    goes on as any other, instead of failing for want of a graph."""
    return sum(parameter.sum() for parameter in trainable.parameters()) * 0.0


def optimizer_step(run: Run) -> StepResult:
    """Unscale, clip, check for NaN/Inf, step. A skipped or aborted step changes no weight and
    does not count; otherwise the LR schedule and the position advance. The loss checked and
    logged is the mean over the step's micro-batches: a NaN in any of them is a NaN event, not
    (under fp16) a grad-scaler overflow."""
    training, tally = run.config.training, run.tally
    loss = torch.stack(tally.step_losses).float().mean()
    first_non_finite = None
    if run.fused:  # the tensors were stepped during backward, each after its gradient was checked
        grad_norm, first_non_finite = run.fused.finish_step()
    else:
        run.scaler.unscale_(run.optimizer)
        if training.max_grad_norm:
            grad_norm = torch.nn.utils.clip_grad_norm_(run.trained_params, training.max_grad_norm)
        else:  # the norm alone (logging, NaN check): no multiply-by-one over every gradient
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in run.trained_params if p.grad is not None])
        grad_norm = plain_tensor(grad_norm)
    verdict = run.guard.check(loss, grad_norm, run.position.step + 1, tally.batch_paths, run.accelerator)
    if verdict == ABORT:
        reason = "the loss or the gradients became NaN/Inf"
        if first_non_finite:
            reason += f" (fused backward: first at {first_non_finite}; the tensors stepped before it were updated)"
        print(non_finite_report(run.position.step + 1, loss, tally.batch_paths, tally.batch_timesteps,
                                list(run.trainable.named_parameters()), reason), file=sys.stderr)
        return StepResult(verdict, grad_norm)
    if verdict == SKIP:
        print(f"warning: non-finite loss or gradients at step {run.position.step + 1}; step skipped "
              f"({run.guard.consecutive} in a row, at most {training.max_nan_skips})", file=sys.stderr)
    elif not run.fused:
        run.scaler.step(run.optimizer)  # the scaler itself skips steps whose fp16 gradients overflowed
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    tally.batch_paths, tally.batch_timesteps, tally.step_losses = [], [], []
    if verdict != SKIP:
        run.lr_scheduler.step()
        run.position.step += 1
        tally.logged_losses.append(loss.detach())
        run.progress.update(1)
    return StepResult(verdict, grad_norm)


def after_step(run: Run, result: StepResult) -> None:
    """What follows an optimizer step: EMA, logging, the rank check and live eval, as due."""
    config, step, tally = run.config, run.position.step, run.tally
    training = config.training
    if config.model.use_ema and step >= run.warmup_steps and step % training.ema_update_every == 0:
        if run.ema is None:
            run.ema = EMA(list(run.trainable.named_parameters()), config.model.ema_decay, config.model.ema_device)
        else:
            run.ema.update()
    if result.verdict == OK and (step % training.log_every == 0 or step == run.total_steps):
        mean_loss = torch.stack(tally.logged_losses).float().mean().item()
        tally.logged_losses.clear()
        rates = step_sizes(run.optimizer)
        run.progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{rates[0]:.2e}")
        peaks = run.memory.take() if run.memory else {}
        if run.writer:
            log_step(run.writer, step, mean_loss, rates, run.trainable.group_names,
                     float(result.grad_norm), run.scaler, training.tensorboard)
            log_memory(run.writer, step, peaks, run.plan.memory)
    if run.accelerator.num_processes > 1 and not is_sharded(run.accelerator) and step % training.log_every == 0:
        check_ranks_agree(run, step)
        tally.rank_checks += 1
    if run.plan.prompts and live_eval_due(config, step):
        live_eval(run, step)


def live_eval(run: Run, step: int) -> None:
    """Live eval images and validation loss, with the weights eval should see (every process
    calls it: under FSDP gathering the weights is collective)."""
    use_ema = run.ema and run.evaluator and run.config.eval.use_ema
    with (averaged_weights(run.optimizer, run.trained_params),
          run.ema.swapped_in() if use_ema else contextlib.nullcontext()):
        full = gather_pipeline(run.accelerator, run.pipe, run.trainable, run.device)
        if run.evaluator:
            run.evaluator.live(full, step)
    del full  # under FSDP a whole copy of the trained weights


def check_ranks_agree(run: Run, step: int) -> None:
    """Under several processes, every rank must hold the same trained weights after a step (DDP's
    promise): compare a checksum of them across ranks, cheaply, every `log_every` steps."""
    params = run.trained_params
    checksum = torch.stack([sum(p.detach().double().sum() for p in params),
                            sum(p.detach().double().pow(2).sum() for p in params)]).to(run.device)
    sums = gather(checksum[None]).cpu()
    if not torch.isfinite(sums).all():  # NaN is never equal to itself: say what really happened
        check_finite_everywhere(run.accelerator, run.trainable)
    if not torch.equal(sums, sums[:1].expand_as(sums)):
        raise RuntimeError(f"processes hold different weights at step {step}: {sums.tolist()}")


def end_epoch(run: Run) -> None:
    """Per-epoch loss min/mean/max, and (once) a warning when the loss stays at the level of
    predicting nothing (a mean of 1.0 or more: the target has unit variance) after warmup. The
    non-finite losses of skipped steps are left out: they would make every statistic NaN."""
    losses, position = run.tally.epoch_losses, run.position
    values = torch.stack(losses).float() if losses else torch.empty(0)
    values = values[torch.isfinite(values)]
    if values.numel():
        low, mean, high = values.min().item(), values.mean().item(), values.max().item()
        if run.writer:
            for name, value in (("min", low), ("mean", mean), ("max", high)):
                run.writer.add_scalar(f"epoch/loss_{name}", value, position.step)
        if position.step > run.warmup_steps and mean >= 1.0 and not run.tally.loss_warned:
            run.tally.loss_warned = True
            print(f"warning: epoch {position.epoch} mean loss {mean:.3f} is still at the level of predicting "
                  "nothing; check the learning rate, the data and the precision (the original tool's black images "
                  "came from a wrong VAE scaling and fp16: docs/design.md)", file=sys.stderr)
    position.epoch += 1
    position.batches_in_epoch = 0


# ------------------------------------------------------------------------------ saving
def checkpoint_due(run: Run) -> bool:
    """Every `checkpoint_every` steps before the last; at the last step only when the output folder
    cannot be resumed from (EMA or schedule-free outputs are averages): a longer run continues from it."""
    step = run.position.step
    if step == run.total_steps:
        return not checkpointing.outputs_resumable(run.config)
    return step % run.config.training.checkpoint_every == 0


def take_snapshot(run: Run) -> TrainerSnapshot:
    """The trainer state to save; every process must call this (the RNG states are gathered from
    all of them, and under FSDP the optimizer state too)."""
    rng_states = gather_object([rng_state()])
    whole_optimizer = optimizer_state(run.accelerator, next(iter(run.prepared), None), run.optimizer)
    return TrainerSnapshot(
        Position(**vars(run.position)), run.seed, whole_optimizer, run.lr_scheduler.state_dict(),
        run.scaler.state_dict(), run.ema.state_dict() if run.ema is not None else None,
        run.guard.consecutive, rng_states, seconds=run.earlier_seconds + time.time() - run.started,
        tracker_runs=run.writer.run_ids() if run.writer else {},
    )


def save_checkpoint(run: Run) -> Path | None:
    """Every process hands over its RNG state (and under FSDP its slices of the weights and the
    optimizer state); the main process writes the checkpoint and returns its folder."""
    accelerator, config = run.accelerator, run.config
    check_finite_everywhere(accelerator, run.trainable)
    snapshot = take_snapshot(run)
    full = gather_pipeline(accelerator, run.pipe, run.trainable)
    folder = None
    if accelerator.is_main_process:
        def write_state(path: Path) -> None:
            checkpointing.save_state(path, config, run.plan.soft, snapshot)

        with run.memory.paused() if run.memory else contextlib.nullcontext():  # not in the memory plan
            folder = checkpointing.save_checkpoint(config, full, run.trainable.on(full), run.position.step,
                                                   write_state)
    accelerator.wait_for_everyone()
    return folder


def interrupt(run: Run) -> int:
    """A stop was requested: checkpoint this step, say how to continue, exit 130."""
    folder = save_checkpoint(run)
    if run.accelerator.is_main_process:
        step = run.position.step
        print(f"\ninterrupted: checkpoint saved at step {step}. "
              + resume_command(run.plan.command, folder, run.accelerator.num_processes))
        finish(run, f"interrupted at step {step}", EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


def resume_command(command: list[str], checkpoint: Path, processes: int) -> str:
    """How to continue this run from `checkpoint`: the exact command for one process; under
    `accelerate launch` (whose options this process cannot see) the script part of it."""
    script = sys.argv[0] if sys.argv[0].endswith(".py") else "train_sdxl.py"
    arguments = [*command, "--set", f"training.resume_from={checkpoint}"]
    if processes > 1:
        return (f"Resume with the same `accelerate launch` options ({processes} processes) and:\n  "
                + shlex.join([script, *arguments]))
    return "Resume with:\n  " + shlex.join([sys.executable, script, *arguments])


def save_outputs(run: Run) -> int:
    """After the last step: the final weights (EMA's when on), the exports, the trainer state, and
    the final eval images; the exit code says whether all of it worked. A stop requested during
    these writes is honoured between them: the write in progress finishes, a checkpoint of the
    last step is saved, and the resume command finishes the job."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    if run.tally.rank_checks:
        accelerator.print(f"{accelerator.num_processes} processes held identical weights at all "
                          f"{run.tally.rank_checks} checks")
    if run.stop.agreed(accelerator):  # asked during the last step
        return interrupt(run)
    run.stop.action = "finishing the write in progress, then saving a checkpoint"
    snapshot = take_snapshot(run)
    try:
        with (averaged_weights(run.optimizer, run.trained_params),
              run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext()):
            if run.ema is not None:
                accelerator.print("final weights: EMA of the trained weights")
            check_finite_everywhere(accelerator, run.trainable)
            pipe = gather_pipeline(accelerator, run.pipe, run.trainable)
            if not accelerator.is_main_process:
                return EXIT_OK
            pending = None
            for upcoming in final_writes(run, pipe, snapshot):
                if run.stop.requested:
                    pending = upcoming
                    break
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return finish(run, "failed: export", EXIT_FAILED)
    except NonFiniteWeightsError as exc:
        accelerator.print(f"error: {exc}; nothing was saved", file=sys.stderr)
        return finish(run, "aborted: non-finite weights", EXIT_FAILED)
    if pending:
        return interrupt_final(run, pipe, snapshot, pending)
    invalid = run.tally.invalid_final_images
    if invalid:
        print(f"error: {invalid} final eval image(s) are invalid (see above)", file=sys.stderr)
        return finish(run, f"failed: {invalid} invalid final eval image(s)", EXIT_FAILED)
    return finish(run, "completed", EXIT_OK)


def final_writes(run: Run, pipe: StableDiffusionXLPipeline, snapshot: TrainerSnapshot) -> Iterator[str]:
    """The final outputs, one write at a time: it names each write before starting it, so the
    caller can stop between two."""
    config, trainable = run.config, run.trainable.on(pipe)
    writing = run.memory.paused if run.memory else contextlib.nullcontext
    yield "final weights"
    with writing():
        save_final(config, pipe, trainable)
    yield "exports"
    with writing():
        export.export_after_training(config, pipe, trainable)
    yield "trainer state"
    with writing():
        checkpointing.save_state(config.state_path, config, run.plan.soft, snapshot)
    if run.evaluator and config.eval.final.enabled:  # live eval alone makes an evaluator too
        yield "final eval"
        run.tally.invalid_final_images = run.evaluator.final(pipe, run.position.step, run.device)
    yield "run summary"  # a stop during the last write is honoured too, as the message promised


def interrupt_final(run: Run, pipe: StableDiffusionXLPipeline, snapshot: TrainerSnapshot, pending: str) -> int:
    """A stop during the final writes (main process; the others have left): a checkpoint of the
    last step, from the trained (not EMA) weights, which the main process holds unless they are
    sharded; resuming from it redoes the final writes."""
    config, step = run.config, run.position.step
    said = f"interrupted during the final save, before the {pending}"
    status = f"interrupted during the final save at step {step}"
    if run.ema is not None and is_sharded(run.accelerator):  # `pipe` holds the gathered EMA weights
        checkpoints = checkpointing.list_checkpoints(config.output_dir / "checkpoints")
        print(f"\n{said}; the trained weights are sharded and were not saved: the last checkpoint is "
              f"{checkpoints[-1] if checkpoints else 'none'}", file=sys.stderr)
        return finish(run, status, EXIT_INTERRUPTED)

    def write_state(path: Path) -> None:
        checkpointing.save_state(path, config, run.plan.soft, snapshot)

    # Unsharded, `pipe` is the training pipeline, the EMA swapped out again by now.
    folder = checkpointing.save_checkpoint(config, pipe, run.trainable.on(pipe), step, write_state)
    print(f"\n{said}; the final save resumes from {folder}, at step {step}. "
          + resume_command(run.plan.command, folder, run.accelerator.num_processes))
    return finish(run, status, EXIT_INTERRUPTED)


def memory_summary(run: Run) -> dict[str, Any] | None:
    """Planned and measured peak (bytes) and their ratio; a warning when the measured one is more
    than 10 % above the plan."""
    if run.memory is None:
        return None
    run.memory.stop()
    planned, measured = run.plan.memory.peak, run.memory.run_peak
    ratio = measured / planned if planned else None
    if ratio and ratio > OVER_PLAN:
        print(f"warning: the measured peak ({measured / 1e9:.2f} GB) is {ratio:.2f}x the memory plan "
              f"({planned / 1e9:.2f} GB); please report it with the pre-flight's memory plan", file=sys.stderr)
    return {"planned_peak_bytes": planned, "measured_peak_bytes": measured,
            "measured_over_planned": round(ratio, 4) if ratio else None,
            "measured": "torch.cuda.max_memory_allocated" if run.device.type == "cuda" else "tensor bytes tracked"}


def finish(run: Run, status: str, code: int) -> int:
    """Write run_summary.json, close TensorBoard and the trackers, tell run.notify and say where
    things are (main process only)."""
    if not run.accelerator.is_main_process:
        return code
    config, evaluator, data_plan = run.config, run.evaluator, run.plan.data
    session = time.time() - run.started
    summary = {
        "status": status, "steps": run.position.step, "epoch": run.position.epoch,
        "checkpoints": [str(path) for path in list_checkpoints(config.output_dir / "checkpoints")],
        "seconds": round(run.earlier_seconds + session, 1), "seed": run.seed,
        "images": len(data_plan.scan.images), "data": data_plan.summary(),
        "skipped_files": [{"path": str(p), "reason": r} for p, r in data_plan.scan.skipped],
        "nan_events": run.guard.events,
        "eval": evaluator.results if evaluator else [],
        "invalid_eval_images": evaluator.invalid_images if evaluator else [],
        "memory": memory_summary(run),
    }
    try:
        write_summary(config, summary)
    except OutputWriteError as exc:  # a full disk: the status line below still says how it ended
        print(f"error: {exc}", file=sys.stderr)
    if run.writer:
        try:
            run.writer.close(code)
        except OutputWriteError as exc:  # TensorBoard's last events: the trackers were closed all the same
            print(f"error: {exc}", file=sys.stderr)
    if run.lock:
        run.lock.release()
    notify(config, end_event(status, code), status, steps=run.position.step, seconds=summary["seconds"],
           output_dir=str(config.output_dir))
    steps, resumed = run.position.step, run.first_step > 0
    this_session = f" ({steps - run.first_step} steps in {session:.0f} s since the resume)" if resumed else ""
    print(f"{status}: {steps} steps in {run.earlier_seconds + session:.0f} s{this_session}; "
          f"outputs in {config.output_dir}")
    return code
