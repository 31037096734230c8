"""Fine-tune Stable Diffusion XL from one JSON config.

    python train_sdxl.py                        # reads ./config.json
    python train_sdxl.py --config configs/quickstart.json --set training.num_steps=20

The run goes: validate the config → plan the data → load SDXL → attach adapters (DoRA/LoRA) or
unfreeze weights (full fine-tune) → train → save outputs (see README "Outputs").
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdxl_trainer.config import UNBUILT, Config, ConfigError, load_config, unbuilt_options

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


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
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
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


def plan_run(config: Config) -> RunPlan:
    import dataset
    from sdxl_trainer.evaluator import eval_prompts

    prompts = eval_prompts(config)
    data_plan = dataset.plan_dataset(config.data, config.training.batch_size)
    if not data_plan.scan.images:
        raise ConfigError(f"data.image_dir = {config.data.image_dir!r}: no readable images found")
    total_steps = count_steps(config, data_plan.batches_per_epoch)
    preflight = describe_plan(config, data_plan, total_steps)
    if config.data.latent_cache.enabled:
        preflight += f"\nlatent cache: {cache_status(config, data_plan)}"
    if prompts:
        preflight += f"\neval: {len(prompts)} prompt(s), sampler {config.eval.sampler_name} ({config.eval.scheduler})"
    return RunPlan(data_plan, total_steps, prompts, preflight)


def check_inputs(config: Config) -> None:
    """Problems that need no model weights: unbuilt options, missing paths."""
    from sdxl_trainer.models import resolve_source

    unbuilt = unbuilt_options(config)
    if unbuilt:
        details = "; ".join(f"{key} ({UNBUILT[key][1]})" for key in unbuilt)
        raise ConfigError(f"not implemented yet: {details}")
    resolve_source(config.model.id)
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
    return "\n".join([
        f"run {config.run.name}: {mode} of {', '.join(trained)} on {config.model.id}",
        data_plan.report(),
        f"steps: {total_steps} optimizer steps ({steps_per_epoch:g} per epoch, "
        f"grad accumulation {config.training.grad_accum_steps})",
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
    misses = len(cache.missing(key for _, key, _ in views))
    return f"{len(views) - misses} hits, {misses} misses (to encode before training) in {cache.cache_dir}"


# -------------------------------------------------------------------------------- training
def train(config: Config, plan: RunPlan) -> int:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    import dataset
    from sdxl_trainer import outputs
    from sdxl_trainer.diffusion import make_noise_scheduler
    from sdxl_trainer.evaluator import Evaluator, make_validation, validation_batches
    from sdxl_trainer.latent_cache import vae_fingerprint
    from sdxl_trainer.models import load_pipeline
    from sdxl_trainer.optimizers import make_optimizer
    from sdxl_trainer.training_setup import prepare_trainable

    training, data_plan, total_steps = config.training, plan.data, plan.total_steps
    accelerator = Accelerator(gradient_accumulation_steps=training.grad_accum_steps)
    seed = training.seed or secrets.randbelow(2**31 - 1) + 1
    set_seed(seed)
    print(f"seed: {seed}{'' if training.seed else ' (drawn at random; set training.seed to repeat)'}")

    pipe = load_pipeline(config.model)
    pipe.to(accelerator.device)
    noise_scheduler = make_noise_scheduler(
        pipe.scheduler.config, training.prediction_type, training.zero_terminal_snr
    )
    cache = None
    if config.data.latent_cache.enabled:
        cache = make_latent_cache(config, vae_fingerprint(pipe.vae.state_dict().values()))
        hits, built = dataset.build_latent_cache(data_plan, config.data, cache, pipe.vae, accelerator.device)
        print(f"latent cache: {hits} hits, {built} encoded now")
    trainable = prepare_trainable(pipe, config)
    optimizer = make_optimizer(config.optimizer, trainable.param_groups())
    lr_scheduler = make_lr_scheduler(optimizer, training.lr_warmup_steps, total_steps)
    modules = accelerator.prepare(*trainable.modules.values())
    optimizer, lr_scheduler = accelerator.prepare(optimizer, lr_scheduler)
    print(trainable.describe())

    sampler = data_plan.sampler(seed)
    loader = DataLoader(
        dataset.ImageCaptionDataset(data_plan.scan.images, data_plan.targets, config.data, seed, cache),
        batch_sampler=sampler, collate_fn=dataset.collate, num_workers=config.data.num_workers,
        persistent_workers=False,
    )
    writer = outputs.open_tensorboard(config, plan.preflight) if accelerator.is_main_process else None
    evaluator = None
    if plan.prompts and accelerator.is_main_process:
        validation = None
        if config.eval.live.enabled:
            batches = validation_batches(data_plan, config, seed, cache)
            validation = make_validation(batches, noise_scheduler.config.num_train_timesteps, seed)
        loss_fn = functools.partial(diffusion_loss, pipe, noise_scheduler, device=accelerator.device)
        evaluator = Evaluator(config, pipe, plan.prompts, validation, loss_fn, list(modules), writer)
    output_dir = config.output_dir

    global_step, epoch, logged_losses = 0, 0, []
    started = time.time()
    progress = tqdm(total=total_steps, desc="training", disable=not accelerator.is_main_process)
    while global_step < total_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(*modules):
                loss = diffusion_loss(pipe, noise_scheduler, batch, accelerator.device, training.noise_offset)
                if not torch.isfinite(loss):
                    return abort_non_finite(loss, batch, global_step, config)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    max_norm = training.max_grad_norm or math.inf
                    grad_norm = accelerator.clip_grad_norm_(trainable.parameters(), max_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            logged_losses.append(loss.detach())
            if not accelerator.sync_gradients:
                continue
            global_step += 1
            progress.update(1)
            if global_step % training.log_every == 0 or global_step == total_steps:
                mean_loss = torch.stack(logged_losses).mean().item()
                logged_losses.clear()
                progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}")
                if writer:
                    outputs.log_scalars(writer, global_step, mean_loss, lr_scheduler.get_last_lr(),
                                        trainable.group_names, float(grad_norm), training.tensorboard)
            if evaluator and evaluator.due(global_step):
                evaluator.live(global_step)
            if global_step % training.checkpoint_every == 0 and global_step < total_steps:
                outputs.save_checkpoint(config, pipe, trainable, global_step)
            if global_step >= total_steps:
                break
        epoch += 1
    progress.close()

    if not accelerator.is_main_process:
        return EXIT_OK
    outputs.save_final(config, pipe, trainable)
    invalid = evaluator.final(global_step) if evaluator else 0
    status = "completed" if not invalid else f"failed: {invalid} invalid final eval image(s)"
    outputs.write_summary(config, {
        "status": status, "steps": global_step, "epochs_started": epoch,
        "seconds": round(time.time() - started, 1), "seed": seed,
        "images": len(data_plan.scan.images),
        "skipped_files": [{"path": str(p), "reason": r} for p, r in data_plan.scan.skipped],
        "eval": evaluator.results if evaluator else [],
        "invalid_eval_images": evaluator.invalid_images if evaluator else [],
    })
    if writer:
        writer.close()
    print(f"{'done' if not invalid else 'error'}: {global_step} steps in {time.time() - started:.0f} s; "
          f"outputs in {output_dir}" + (f"; {invalid} final eval image(s) are invalid (see above)" if invalid else ""))
    return EXIT_OK if not invalid else EXIT_FAILED


def diffusion_loss(pipe, noise_scheduler, batch: dict, device, noise_offset: float = 0.0,
                   noise=None, timesteps=None, generator=None):
    """The SDXL denoising loss of one batch (fp32 MSE between the UNet output and its target).

    `noise`, `timesteps` and the `generator` of the VAE's posterior sample can be fixed by the
    caller: the validation loss and the learning tests use the same draws every time.
    """
    import torch
    import torch.nn.functional as F

    from sdxl_trainer.conditioning import add_time_ids, encode_prompts
    from sdxl_trainer.diffusion import sample_noise, sample_timesteps, training_target

    vae = pipe.vae
    if "latents" in batch:  # from the latent cache: the VAE encoder never runs
        latents = batch["latents"].to(device, torch.float32)
    else:
        with torch.no_grad():
            pixels = batch["pixel_values"].to(device, dtype=vae.dtype)
            latents = vae.encode(pixels).latent_dist.sample(generator=generator)
    # One scaling factor, read from the VAE's own config, for encoding here and decoding at eval.
    latents = latents * vae.config.scaling_factor
    prompt_embeds, pooled_embeds = encode_prompts(
        batch["captions"], [pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2], device
    )
    time_ids = add_time_ids(batch["original_sizes"], batch["crops_top_left"], batch["target_sizes"]).to(device)
    if noise is None:
        noise = sample_noise(latents, noise_offset)
    if timesteps is None:
        timesteps = sample_timesteps(noise_scheduler, latents.shape[0], device)
    noise, timesteps = noise.to(device), timesteps.to(device)
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    target = training_target(noise_scheduler, latents, noise, timesteps)
    prediction = pipe.unet(
        noisy_latents, timesteps, encoder_hidden_states=prompt_embeds,
        added_cond_kwargs={"text_embeds": pooled_embeds, "time_ids": time_ids},
    ).sample
    return F.mse_loss(prediction.float(), target.float())


def make_lr_scheduler(optimizer, warmup_steps: int, total_steps: int):
    """Constant LR after a linear warmup (the original tool's `lr_warmup_steps`)."""
    from diffusers.optimization import get_scheduler

    return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup_steps,
                         num_training_steps=total_steps)


def abort_non_finite(loss, batch: dict, step: int, config: Config) -> int:
    """Stop on a NaN/Inf loss with what is needed to find the cause; nothing is saved."""
    print(
        f"error: the loss became {loss.item()} at step {step + 1}; nothing was saved.\n"
        f"  files in the batch: {', '.join(batch['paths'])}\n"
        f"  precision: {config.precision}; see README 'Black images and NaN' for causes",
        file=sys.stderr,
    )
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
