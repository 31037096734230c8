"""Fine-tune Stable Diffusion XL from one JSON config.

    python train_sdxl.py                        # reads ./config.json
    python train_sdxl.py --config configs/quickstart.json --set training.num_steps=20

The run goes: validate the config → plan the data → load SDXL → attach adapters (DoRA/LoRA) or
unfreeze weights (full fine-tune) → train → save outputs (see README "Outputs").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import secrets
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdxl_trainer.config import UNBUILT, Config, ConfigError, load_config, unbuilt_options

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_sdxl.py", description="Fine-tune SDXL (DoRA, LoRA or full) from a JSON config."
    )
    parser.add_argument("--config", default="config.json", help="config file (default: ./config.json)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set training.num_steps=20 (repeatable; JSON values)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan; load no weights")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        if args.print_config:
            print(json.dumps(config.resolved(), indent=2))
            return EXIT_OK
        check_inputs(config)
        plan = plan_run(config)
        plan.command = ["--config", args.config, *[part for item in args.set for part in ("--set", item)]]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if os.environ.get("RANK", "0") == "0":  # one report, however many processes `accelerate launch` starts
        print(plan.preflight)
    if args.dry_run:
        return EXIT_OK
    return train(config, plan)


@dataclass
class RunPlan:
    """Everything decided before any model is loaded."""

    data: Any  # dataset.DatasetPlan
    total_steps: int
    prompts: list  # eval prompts (empty when eval is off)
    preflight: str  # the report printed at the start and logged to TensorBoard
    resume: tuple[Path, dict] | None = None  # (folder with the weights, trainer state) to continue from
    command: list[str] = field(default_factory=list)  # the arguments of this run, for the resume hint


def plan_run(config: Config) -> RunPlan:
    import dataset
    from sdxl_trainer.checkpointing import check_compatible, load_state, resolve_resume, soft_settings
    from sdxl_trainer.evaluator import eval_prompts

    prompts = eval_prompts(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun
    data_plan = dataset.plan_dataset(config.data, config.training.batch_size, world_size)
    if not data_plan.scan.images:
        raise ConfigError(f"data.image_dir = {config.data.image_dir!r}: no readable images found")
    total_steps = count_steps(config, data_plan.batches_per_epoch)
    preflight = describe_plan(config, data_plan, total_steps)
    if config.data.latent_cache.enabled:
        preflight += f"\nlatent cache: {cache_status(config, data_plan)}"
    if prompts:
        preflight += f"\neval: {len(prompts)} prompt(s), sampler {config.eval.sampler_name} ({config.eval.scheduler})"
    resume = None
    found = resolve_resume(config)
    if found:
        folder, state_path = found
        state = load_state(state_path)
        warnings = check_compatible(state, config, soft_settings(config, data_plan, total_steps))
        position = state["position"]
        preflight += (f"\nresume: from {folder} at step {position['step']} (epoch {position['epoch']}, "
                      f"batch {position['batches_in_epoch']} of it)")
        preflight += "".join(f"\n  warning: {warning}" for warning in warnings)
        resume = (folder, state)
    return RunPlan(data_plan, total_steps, prompts, preflight, resume)


def check_inputs(config: Config) -> None:
    """Problems that need no model weights: unbuilt options, missing paths and packages."""
    from sdxl_trainer.attention import check_attention
    from sdxl_trainer.distributed import check_launch
    from sdxl_trainer.export import check_export
    from sdxl_trainer.models import resolve_source

    unbuilt = unbuilt_options(config)
    if unbuilt:
        details = "; ".join(f"{key} ({UNBUILT[key][1]})" for key in unbuilt)
        raise ConfigError(f"not implemented yet: {details}")
    check_attention(config.model.attention)
    check_launch(config, os.environ)
    resolve_source(config.model.id)
    check_export(config)
    if config.model.vae:
        resolve_source(config.model.vae, key="model.vae")
    if not Path(config.data.image_dir).is_dir():
        raise ConfigError(f"data.image_dir = {config.data.image_dir!r}: no such folder")


def count_steps(config: Config, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: `num_steps`, `num_epochs`, or whichever comes first."""
    training = config.training
    limits = []
    if training.num_steps:
        limits.append(training.num_steps)
    if training.num_epochs:
        limits.append(max(1, training.num_epochs * batches_per_epoch // training.grad_accum_steps))
    return min(limits)


def describe_plan(config: Config, data_plan, total_steps: int) -> str:
    mode = "full fine-tune" if config.adapter.type == "none" else (
        f"{config.adapter.type.upper()} rank {config.adapter.rank} alpha {config.adapter.alpha:g}"
    )
    trained = ["unet"] + [
        name for name, on in (("text_encoder", config.model.train_text_encoder_1),
                              ("text_encoder_2", config.model.train_text_encoder_2)) if on
    ]
    steps_per_epoch = data_plan.batches_per_epoch / config.training.grad_accum_steps
    sizes = sorted(set(data_plan.batch_sizes.values()))
    per_process = "/".join(str(size) for size in sizes)
    global_batch = "/".join(str(size * data_plan.world_size * config.training.grad_accum_steps) for size in sizes)
    return "\n".join([
        f"run {config.run.name}: {mode} of {', '.join(trained)} on {config.model.id}",
        data_plan.report(),
        f"steps: {total_steps} optimizer steps ({steps_per_epoch:g} per epoch); global batch {global_batch} = "
        f"{per_process} per process x {data_plan.world_size} process(es) x {config.training.grad_accum_steps} "
        "accumulation",
        f"output: {config.output_dir}",
    ])


def make_latent_cache(config: Config, vae_id: str):
    from sdxl_trainer.latent_cache import LatentCache

    cache = config.data.latent_cache
    dtype = cache.dtype if cache.dtype != "auto" else {"no": "fp32"}.get(config.precision, config.precision)
    return LatentCache(cache.cache_dir, vae_id, dtype, cache.latents)


def cache_status(config: Config, data_plan) -> str:
    """Hits and misses, known before loading any model when the VAE's weight file is local."""
    import dataset
    from sdxl_trainer.latent_cache import vae_fingerprint_from_files
    from sdxl_trainer.models import vae_weight_files

    found = vae_weight_files(config.model)
    if found is None:
        return "hits and misses are counted once the VAE is loaded"
    cache = make_latent_cache(config, vae_fingerprint_from_files(*found))
    views = dataset.cache_views(data_plan, config.data)
    # Presence only: every entry is read and checked once, when training builds the cache.
    misses = sum(not cache.path(key).is_file() for _, key, _ in views)
    return f"{len(views) - misses} hits, {misses} misses (to encode before training) in {cache.cache_dir}"


# -------------------------------------------------------------------------------- training
def train(config: Config, plan: RunPlan) -> int:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, gather_object, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    import dataset
    from sdxl_trainer import distributed, outputs
    from sdxl_trainer.checkpointing import Position, rng_state, save_state, set_rng_state, soft_settings
    from sdxl_trainer.diffusion import sample_draws
    from sdxl_trainer.ema import EMA
    from sdxl_trainer.evaluator import Evaluator, live_eval_due, make_validation, validation_batches
    from sdxl_trainer.export import ExportError, export_after_training
    from sdxl_trainer.lr_schedule import make_lr_scheduler, schedule_settings
    from sdxl_trainer.nan_guard import ABORT, OK, SKIP, NaNGuard, non_finite_report
    from sdxl_trainer.optimizers import make_optimizer
    from sdxl_trainer.outputs import NonFiniteWeightsError
    from sdxl_trainer.precision import plan_precision

    training, data_plan, total_steps = config.training, plan.data, plan.total_steps
    has_accelerator = torch.cuda.is_available() or torch.backends.mps.is_available()
    # On a machine without GPUs, `accelerate launch` runs CPU processes that talk over gloo.
    # Casting follows the precision plan (training.mixed_precision), never accelerate's setting:
    # both at once would autocast twice, and FSDP would upcast bf16 weights to fp32.
    # The main process alone writes checkpoints and renders eval images while the others wait: a
    # full fine-tune's checkpoint can take longer than the collectives' default timeout.
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=training.distributed_timeout_minutes))
    accelerator = Accelerator(gradient_accumulation_steps=training.grad_accum_steps, cpu=not has_accelerator,
                              mixed_precision="no", kwargs_handlers=[timeout])
    launched_with = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched_with not in ("no", config.precision):
        accelerator.print(f"note: accelerate's mixed_precision={launched_with} is ignored; the precision is "
                          f"training.mixed_precision ({config.precision})")
    device = accelerator.device
    # Resuming keeps the interrupted run's seed: the data order and augmentation depend on it.
    seed = plan.resume[1]["seed"] if plan.resume else training.seed or secrets.randbelow(2**31 - 1) + 1
    set_seed(seed)
    accelerator.print(f"seed: {seed}"
                      + ("" if training.seed or plan.resume else " (drawn at random; set training.seed to repeat)"))
    precision = plan_precision(config, device.type)
    accelerator.print(precision.table())

    pipe, noise_scheduler, cache, trainable = setup_models(config, plan, precision, accelerator)
    optimizer = make_optimizer(config.optimizer, trainable.param_groups(), device.type,
                               bf16_weights=precision.components["unet"].trained == "bf16")
    lr_scheduler = make_lr_scheduler(optimizer, training, total_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.uses_grad_scaler)
    # Under FSDP this shards the UNet in place and points the optimizer at the slices.
    *modules, optimizer, lr_scheduler = accelerator.prepare(*trainable.modules.values(), optimizer, lr_scheduler)
    position, ema, state = Position(), None, plan.resume[1] if plan.resume else None
    if state:
        distributed.load_optimizer_state(accelerator, modules[0], optimizer, state["optimizer"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        scaler.load_state_dict(state["scaler"])
        position = Position(**state["position"])
        if state["ema"] is not None:
            ema = EMA(list(trainable.named_parameters()), config.model.ema_decay, config.model.ema_device)
            ema.load_state_dict(state["ema"])
    # Forward through the prepared modules (DDP wrappers under several processes): that is
    # what synchronises the gradients. Saving and eval use the pipeline (gathered under FSDP).
    forward = dict(zip(trainable.modules, modules, strict=True))
    unet = forward["unet"]
    if config.model.use_torch_compile:
        unet = torch.compile(unet, **config.model.torch_compile_kwargs)
    text_encoders = [forward.get(name, getattr(pipe, name)) for name in ("text_encoder", "text_encoder_2")]
    autocast = torch.autocast(device.type, dtype=precision.torch_dtype(precision.compute),
                              enabled=precision.compute != "fp32")
    warmup_steps = schedule_settings(training).warmup_steps  # EMA starts when warmup ends
    guard = NaNGuard(training.nan_policy if not training.detect_anomaly else "abort", training.max_nan_skips,
                     precision.uses_grad_scaler, consecutive=state["nan_skips"] if state else 0)
    soft = soft_settings(config, data_plan, total_steps)

    def checkpoint(step: int) -> Path | None:
        """Every process hands over its RNG state (and under FSDP its slices of the weights and the
        optimizer state); the main process writes the checkpoint."""
        distributed.check_finite_everywhere(accelerator, trainable)
        rng_states = gather_object([rng_state()])
        optimizer_state = distributed.optimizer_state(accelerator, modules[0], optimizer)
        full = distributed.gather_pipeline(accelerator, pipe, trainable)
        folder = None
        if accelerator.is_main_process:
            def write_state(path: Path) -> None:
                save_state(path, config, soft, position, optimizer_state, lr_scheduler, scaler, ema,
                           guard.consecutive, seed, rng_states)
            folder = outputs.save_checkpoint(config, full, trainable.on(full), step, write_state)
        accelerator.wait_for_everyone()
        return folder

    accelerator.print(trainable.describe())
    trained_params = list(trainable.parameters())  # built once: the step loop needs it every step
    sharded = distributed.is_sharded(accelerator)  # FSDP: each process holds a slice of the weights
    if sharded:
        accelerator.print(distributed.describe_sharding(accelerator, trainable))

    sampler = data_plan.sampler(seed, rank=accelerator.process_index)
    loader = DataLoader(
        dataset.ImageCaptionDataset(data_plan.scan.images, data_plan.targets, config.data, seed, cache),
        batch_sampler=sampler, collate_fn=dataset.collate, num_workers=config.data.num_workers,
        # Its own generator: starting an epoch must not draw from the training RNG (exact resume).
        generator=torch.Generator().manual_seed(seed),
    )
    writer = outputs.open_tensorboard(config, plan.preflight + "\n" + precision.table()) \
        if accelerator.is_main_process else None
    evaluator = None
    if plan.prompts and accelerator.is_main_process:
        validation = None
        if config.eval.live.enabled:
            batches = validation_batches(data_plan, config, seed, cache)
            validation = make_validation(batches, noise_scheduler.config.num_train_timesteps, seed)
        def eval_loss(eval_pipe, batch: dict, **draws):
            return diffusion_loss(eval_pipe, noise_scheduler, batch, device, **draws)
        evaluator = Evaluator(config, plan.prompts, validation, eval_loss, trainable.group_names, writer)

    started = time.time()
    logged_losses, window_paths, window_timesteps, loss_warnings, rank_checks = [], [], [], [], 0
    stop = StopRequest()
    if state:  # from here on every process draws what it would have drawn next
        set_rng_state(state["rng"][accelerator.process_index % len(state["rng"])])
    progress = tqdm(total=total_steps, initial=position.step, desc="training", disable=not accelerator.is_main_process)
    try:
        while position.step < total_steps:
            sampler.set_epoch(position.epoch, start=position.batches_in_epoch)
            epoch_losses = []
            for batch in loader:
                # One micro-batch: forward and backward (gradients add up over grad_accum_steps).
                position.batches_in_epoch += 1
                height, width = batch["target_sizes"][0].tolist()
                latent_shape = (len(batch["keys"]), pipe.unet.config.in_channels, height // 8, width // 8)
                noise, timesteps, posterior_noise = sample_draws(
                    batch["keys"], seed, noise_scheduler.config.num_train_timesteps, latent_shape, training.noise_offset
                )
                window_paths += batch["paths"]
                window_timesteps += timesteps.tolist()
                min_sigma = training.min_sigma if position.step >= training.min_sigma_warmup_steps else None
                with accelerator.accumulate(*modules), autocast:
                    loss = diffusion_loss(pipe, noise_scheduler, batch, device, noise=noise, timesteps=timesteps,
                                          posterior_noise=posterior_noise, snr_gamma=training.snr_gamma,
                                          min_sigma=min_sigma, unet=unet, text_encoders=text_encoders)
                    accelerator.backward(scaler.scale(loss))
                epoch_losses.append(loss.detach())
                if not accelerator.sync_gradients:
                    continue

                # One optimizer step: unscale, clip, check for NaN/Inf, step.
                scaler.unscale_(optimizer)
                if training.max_grad_norm:
                    grad_norm = torch.nn.utils.clip_grad_norm_(trained_params, training.max_grad_norm)
                else:  # the norm alone (logging, NaN check): no multiply-by-one over every gradient
                    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in trained_params if p.grad is not None])
                grad_norm = distributed.plain_tensor(grad_norm)
                verdict = guard.check(loss, grad_norm, position.step + 1, window_paths, accelerator)
                if verdict == ABORT:
                    reason = "the loss or the gradients became NaN/Inf"
                    print(non_finite_report(position.step + 1, loss, window_paths, window_timesteps,
                                            list(trainable.named_parameters()), reason), file=sys.stderr)
                    return finish(config, "aborted: non-finite loss or gradients", position, started, seed,
                                  data_plan, evaluator, guard, writer, EXIT_FAILED)
                if verdict == SKIP:
                    print(f"warning: non-finite loss or gradients at step {position.step + 1}; step skipped "
                          f"({guard.consecutive} in a row, at most {training.max_nan_skips})", file=sys.stderr)
                else:
                    scaler.step(optimizer)  # the scaler itself skips steps whose fp16 gradients overflowed
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                window_paths, window_timesteps = [], []
                if verdict == SKIP:
                    continue
                lr_scheduler.step()
                position.step += 1
                progress.update(1)
                logged_losses.append(loss.detach())
                step = position.step

                if config.model.use_ema and step >= warmup_steps and step % training.ema_update_every == 0:
                    if ema is None:
                        ema = EMA(list(trainable.named_parameters()), config.model.ema_decay, config.model.ema_device)
                    else:
                        ema.update()
                if verdict == OK and (step % training.log_every == 0 or step == total_steps):
                    mean_loss = torch.stack(logged_losses).float().mean().item()
                    logged_losses.clear()
                    progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}")
                    if writer:
                        outputs.log_step(writer, step, mean_loss, lr_scheduler.get_last_lr(),
                                         trainable.group_names, float(grad_norm), scaler, training.tensorboard)
                if accelerator.num_processes > 1 and not sharded and step % training.log_every == 0:
                    check_ranks_agree(accelerator, trainable, step)
                    rank_checks += 1
                if plan.prompts and live_eval_due(config, step):
                    with ema.swapped_in() if ema and evaluator and config.eval.use_ema else contextlib.nullcontext():
                        full = distributed.gather_pipeline(accelerator, pipe, trainable, device)
                        if evaluator:
                            evaluator.live(full, step)
                    del full  # under FSDP a whole copy of the trained weights
                stopping = stop.agreed(accelerator)
                if stopping or (step % training.checkpoint_every == 0 and step < total_steps):
                    folder = checkpoint(step)
                    if stopping:
                        if accelerator.is_main_process:
                            print(f"\ninterrupted: checkpoint saved at step {step}. "
                                  + resume_command(plan.command, folder, accelerator.num_processes))
                            finish(config, f"interrupted at step {step}", position, started, seed, data_plan,
                                   evaluator, guard, writer, EXIT_INTERRUPTED)
                        return EXIT_INTERRUPTED
                if step >= total_steps:
                    break
            else:
                report_epoch(position.epoch, epoch_losses, position.step, warmup_steps, writer, loss_warnings)
                position.epoch += 1
                position.batches_in_epoch = 0
    except NonFiniteWeightsError as exc:
        accelerator.print(f"error: {exc}; training stopped; they were not saved", file=sys.stderr)
        return finish(config, "aborted: non-finite weights", position, started, seed, data_plan, evaluator, guard,
                      writer, EXIT_FAILED)
    finally:
        progress.close()
        stop.restore()

    accelerator.wait_for_everyone()
    if rank_checks:
        accelerator.print(f"{accelerator.num_processes} processes held identical weights at all {rank_checks} checks")
    final_rng = gather_object([rng_state()])
    if ema is not None:
        ema.copy_to()  # the final weights are the averaged ones
        accelerator.print("final weights: EMA of the trained weights")
    try:
        distributed.check_finite_everywhere(accelerator, trainable)
        optimizer_state = distributed.optimizer_state(accelerator, modules[0], optimizer)
        pipe = distributed.gather_pipeline(accelerator, pipe, trainable)
        if not accelerator.is_main_process:
            return EXIT_OK
        trainable = trainable.on(pipe)
        outputs.save_final(config, pipe, trainable)
        export_after_training(config, pipe, trainable)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return finish(config, "failed: export", position, started, seed, data_plan, evaluator, guard, writer,
                      EXIT_FAILED)
    except NonFiniteWeightsError as exc:
        accelerator.print(f"error: {exc}; nothing was saved", file=sys.stderr)
        return finish(config, "aborted: non-finite weights", position, started, seed, data_plan, evaluator, guard,
                      writer, EXIT_FAILED)
    save_state(config.state_path, config, soft, position, optimizer_state, lr_scheduler, scaler, ema,
               guard.consecutive, seed, final_rng)
    invalid = evaluator.final(pipe.to(device), position.step) if evaluator else 0
    if invalid:
        print(f"error: {invalid} final eval image(s) are invalid (see above)", file=sys.stderr)
        return finish(config, f"failed: {invalid} invalid final eval image(s)", position, started, seed, data_plan,
                      evaluator, guard, writer, EXIT_FAILED)
    return finish(config, "completed", position, started, seed, data_plan, evaluator, guard, writer, EXIT_OK)


def setup_models(config: Config, plan: RunPlan, precision, accelerator):
    """Load SDXL in the planned dtypes, cache latents, attach adapters (or unfreeze), audit.
    Where files are written (a hub download, the built-in model, the latent cache) the first
    process of each machine goes first and the others on it then find them done: caches are
    usually local disks, and on a shared one the writes are atomic and identical."""
    from safetensors.torch import load_file

    import dataset
    from sdxl_trainer.adapters import DIFFUSERS_WEIGHT_NAME, load_adapter_weights
    from sdxl_trainer.attention import set_attention
    from sdxl_trainer.diffusion import make_noise_scheduler
    from sdxl_trainer.latent_cache import vae_fingerprint
    from sdxl_trainer.models import load_pipeline
    from sdxl_trainer.precision import audit, cast_trained_parameters, place_pipeline
    from sdxl_trainer.training_setup import prepare_trainable

    device = accelerator.device
    resume_folder = plan.resume[0] if plan.resume else None
    with accelerator.local_main_process_first():
        if resume_folder and config.adapter.type == "none":  # a full fine-tune continues from its pipeline
            pipe = load_pipeline(config.model.model_copy(update={"id": str(resume_folder), "vae": None}))
        else:
            pipe = load_pipeline(config.model)
    place_pipeline(pipe, precision, device)
    accelerator.print(f"attention: {set_attention(pipe.unet, config.model.attention, device.type)}")
    noise_scheduler = make_noise_scheduler(
        pipe.scheduler.config, config.training.prediction_type, config.training.zero_terminal_snr
    )
    # The saved pipeline (and the single file's v_pred/ztsnr markers) must say what was trained.
    pipe.scheduler = pipe.scheduler.__class__.from_config(
        pipe.scheduler.config, prediction_type=noise_scheduler.config.prediction_type,
        rescale_betas_zero_snr=config.training.zero_terminal_snr,
    )
    cache = None
    if config.data.latent_cache.enabled:
        cache = make_latent_cache(config, vae_fingerprint(pipe.vae.state_dict().values()))
        with accelerator.local_main_process_first():
            hits, built = dataset.build_latent_cache(plan.data, config.data, cache, pipe.vae, device)
        accelerator.print(f"latent cache: {hits} hits, {built} encoded now")
    trainable = prepare_trainable(pipe, config)
    if resume_folder and trainable.is_adapter:
        tensors = load_file(resume_folder / DIFFUSERS_WEIGHT_NAME)
        for name, module in trainable.modules.items():
            load_adapter_weights(module, name, tensors)
    cast_trained_parameters(trainable.modules, precision)
    audit(pipe, precision, adapter=trainable.is_adapter)
    return pipe, noise_scheduler, cache, trainable


def report_epoch(epoch: int, losses: list, step: int, warmup_steps: int, writer, warned: list) -> None:
    """Per-epoch loss min/mean/max, and (once) a warning when the loss stays at the level of
    predicting nothing (a mean of 1.0 or more: the target has unit variance) after warmup."""
    import torch

    if not losses:
        return
    values = torch.stack(losses).float()
    low, mean, high = values.min().item(), values.mean().item(), values.max().item()
    if writer:
        for name, value in (("min", low), ("mean", mean), ("max", high)):
            writer.add_scalar(f"epoch/loss_{name}", value, step)
    if step > warmup_steps and mean >= 1.0 and not warned:
        warned.append(epoch)
        print(f"warning: epoch {epoch} mean loss {mean:.3f} is still at the level of predicting nothing; check "
              "the learning rate, the data and the precision (seed post-mortems: wrong VAE scaling, fp16)",
              file=sys.stderr)


def finish(config: Config, status: str, position, started: float, seed: int, data_plan,
           evaluator, guard, writer, code: int) -> int:
    """Write run_summary.json, close TensorBoard and say where things are (main process only)."""
    from accelerate import PartialState

    from sdxl_trainer import outputs

    if not PartialState().is_main_process:
        return code
    outputs.write_summary(config, {
        "status": status, "steps": position.step, "epoch": position.epoch,
        "checkpoints": [str(path) for path in outputs.list_checkpoints(config.output_dir / "checkpoints")],
        "seconds": round(time.time() - started, 1), "seed": seed,
        "images": len(data_plan.scan.images),
        "skipped_files": [{"path": str(p), "reason": r} for p, r in data_plan.scan.skipped],
        "nan_events": guard.events,
        "eval": evaluator.results if evaluator else [],
        "invalid_eval_images": evaluator.invalid_images if evaluator else [],
    })
    if writer:
        writer.close()
    print(f"{status}: {position.step} steps in {time.time() - started:.0f} s; outputs in {config.output_dir}")
    return code


class StopRequest:
    """Ctrl-C / SIGTERM: the first finishes the current optimizer step, saves a checkpoint and exits;
    a second one exits at once (every write is atomic, so nothing is left half-written).

    A repeat within `REPEAT_WINDOW_S` is the same request, not a second press: `accelerate launch`
    passes on the signal it got, and a cluster scheduler may signal the launcher and every
    process at once, so one stop can arrive twice within milliseconds."""

    REPEAT_WINDOW_S = 2.0

    def __init__(self):
        self.requested = False
        self.requested_at = 0.0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            if time.monotonic() - self.requested_at < self.REPEAT_WINDOW_S:
                return
            self.restore()
            raise KeyboardInterrupt
        self.requested, self.requested_at = True, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint "
              "(press Ctrl-C again to exit at once)", file=sys.stderr)

    def agreed(self, accelerator) -> bool:
        """Whether any process was asked to stop (they must all checkpoint at the same step)."""
        if accelerator.num_processes == 1:
            return self.requested
        import torch

        flag = torch.tensor([float(self.requested)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def check_ranks_agree(accelerator, trainable, step: int) -> None:
    """Under several processes, every rank must hold the same trained weights after a step (DDP's
    promise): compare a checksum of them across ranks, cheaply, every `log_every` steps."""
    import torch
    from accelerate.utils import gather

    from sdxl_trainer import distributed

    params = list(trainable.parameters())
    checksum = torch.stack([sum(p.detach().double().sum() for p in params),
                            sum(p.detach().double().pow(2).sum() for p in params)]).to(accelerator.device)
    sums = gather(checksum[None]).cpu()
    if not torch.isfinite(sums).all():  # NaN is never equal to itself: say what really happened
        distributed.check_finite_everywhere(accelerator, trainable)
    if not torch.equal(sums, sums[:1].expand_as(sums)):
        raise RuntimeError(f"processes hold different weights at step {step}: {sums.tolist()}")


def resume_command(command: list[str], checkpoint: Path, processes: int) -> str:
    """How to continue this run from `checkpoint`: the exact command for one process; under
    `accelerate launch` (whose options this process cannot see) the script part of it."""
    script = sys.argv[0] if sys.argv[0].endswith(".py") else "train_sdxl.py"
    arguments = [*command, "--set", f"training.resume_from={checkpoint}"]
    if processes > 1:
        return (f"Resume with the same `accelerate launch` options ({processes} processes) and:\n  "
                + shlex.join([script, *arguments]))
    return "Resume with:\n  " + shlex.join([sys.executable, script, *arguments])


def diffusion_loss(pipe, noise_scheduler, batch: dict, device, noise_offset: float = 0.0,
                   noise=None, timesteps=None, generator=None, snr_gamma: float | None = None,
                   min_sigma: float | None = None, unet=None, text_encoders=None, posterior_noise=None):
    """The SDXL denoising loss of one batch: the UNet's prediction against its target (noise or
    velocity), squared error in fp32, optionally min-SNR weighted.

    `noise`, `timesteps` and the `generator` of the VAE's posterior sample can be fixed by the
    caller: the validation loss and the learning tests use the same draws every time; training
    passes per-sample draws (`sample_draws`), including the `posterior_noise` of the VAE sample.
    `unet` and `text_encoders` are the modules to run forward: the distributed (DDP) or compiled
    wrappers of the pipeline's own modules when there are any.
    """
    import torch

    from sdxl_trainer.conditioning import add_time_ids, encode_prompts
    from sdxl_trainer.diffusion import loss_weights, sample_noise, sample_timesteps, training_target

    vae = pipe.vae
    if "latents" in batch:  # from the latent cache: the VAE encoder never runs
        latents = batch["latents"].to(device, torch.float32)
    else:
        with torch.no_grad(), torch.autocast(device.type if hasattr(device, "type") else str(device),
                                             enabled=False):
            pixels = batch["pixel_values"].to(device, dtype=vae.dtype)
            posterior = vae.encode(pixels).latent_dist
            if posterior_noise is not None:
                latents = (posterior.mean + posterior.std * posterior_noise.to(device, posterior.mean.dtype)).float()
            else:
                latents = posterior.sample(generator=generator).float()
    # One scaling factor, read from the VAE's own config, for encoding here and decoding at eval.
    latents = latents * vae.config.scaling_factor
    prompt_embeds, pooled_embeds = encode_prompts(
        batch["captions"], [pipe.tokenizer, pipe.tokenizer_2],
        text_encoders or [pipe.text_encoder, pipe.text_encoder_2], device,
        zero_empty=pipe.config.force_zeros_for_empty_prompt,
    )
    time_ids = add_time_ids(batch["original_sizes"], batch["crops_top_left"], batch["target_sizes"]).to(device)
    if noise is None:
        noise = sample_noise(latents, noise_offset)
    if timesteps is None:
        timesteps = sample_timesteps(noise_scheduler, latents.shape[0], device)
    noise, timesteps = noise.to(device), timesteps.to(device)
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    target = training_target(noise_scheduler, latents, noise, timesteps)
    prediction = (unet if unet is not None else pipe.unet)(
        noisy_latents, timesteps, encoder_hidden_states=prompt_embeds,
        added_cond_kwargs={"text_embeds": pooled_embeds, "time_ids": time_ids},
    ).sample
    per_sample = (prediction.float() - target.float()).pow(2).mean(dim=(1, 2, 3))
    weights = loss_weights(noise_scheduler, timesteps, snr_gamma, min_sigma)
    return (per_sample * weights).mean() if weights is not None else per_sample.mean()


if __name__ == "__main__":
    sys.exit(main())
