"""What a run decides before it loads any model: the inputs are there, the data plan, the number
of steps, the eval prompts, where a resume starts, and the pre-flight report that says so."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import UNBUILT, Config, ConfigError, unbuilt_options
from .optimizers import PRODIGY_SETTINGS
from .precision import cached_encoders

if TYPE_CHECKING:
    import torch

    from .checkpointing import Resume, ResumeChoice
    from .data_plan import DatasetPlan
    from .eval.eval_prompts import EvalPrompt
    from .latent_cache import LatentCache
    from .memory.plan import MemoryPlan


@dataclass
class RunPlan:
    """Everything decided before any model is loaded."""

    data: DatasetPlan
    total_steps: int
    prompts: list[EvalPrompt]  # eval prompts (empty when eval is off)
    preflight: str  # the report printed at the start and logged to TensorBoard
    soft: dict[str, Any] = field(default_factory=dict)  # settings a resume may change (saved in every state)
    resume: Resume | None = None  # where a resumed run continues from
    command: list[str] = field(default_factory=list)  # the arguments of this run, for the resume hint
    memory: MemoryPlan | None = None  # the memory plan, when one was made (training.memory_check)


def check_inputs(config: Config) -> None:
    """Problems that need no model weights: unbuilt options, missing paths and packages."""
    from .attention import check_attention
    from .distributed import check_launch
    from .export import check_export
    from .models import check_model, resolve_source
    from .optimizers import check_optimizer
    from .quantized_base import check_quantization
    from .trackers import check_trackers

    unbuilt = unbuilt_options(config)
    if unbuilt:
        details = "; ".join(f"{key} ({UNBUILT[key][1]})" for key in unbuilt)
        raise ConfigError(f"not implemented yet: {details}")
    check_attention(config.model.attention)
    check_launch(config, os.environ)
    check_model(config.model)
    check_optimizer(config.optimizer)
    check_quantization(config)
    check_export(config)
    check_trackers(config)
    if config.model.vae:
        resolve_source(config.model.vae, key="model.vae")
    check_folders(config)
    check_output_folders(config)


def check_folders(config: Config) -> None:
    """Every image, mask and validation folder is there (named by its key)."""
    data = config.data
    keys = [(f"data.subsets[{i}]." if data.subsets else "data.", folder) for i, folder in enumerate(data.folders())]
    paths = [(prefix + name, getattr(folder, name)) for prefix, folder in keys for name in ("image_dir", "mask_dir")]
    for key, path in [*paths, ("data.validation_dir", data.validation_dir)]:
        if path and not Path(path).is_dir():
            raise ConfigError(f"{key} = {path!r}: no such folder")


def output_folders(config: Config) -> list[tuple[str, Path]]:
    """(key, folder) of every folder the run writes into, by the key that places it."""
    training, data = config.training, config.data
    folders = [("training.output_dir" if training.output_dir else "run.output_root", config.output_dir)]
    if training.state_path:
        folders.append(("training.state_path", config.state_path.parent))
    if config.export.save_single_file:
        key = "export.checkpoint_path" if config.export.checkpoint_path else "run.checkpoint_root"
        folders.append((key, config.checkpoint_path.parent))
    if training.tensorboard.enabled:
        key = "training.tensorboard.log_dir" if training.tensorboard.log_dir else "training.tensorboard.base_dir"
        folders.append((key, config.tensorboard_dir))
    if data.latent_cache.enabled:
        folders.append(("data.latent_cache.cache_dir", Path(data.latent_cache.cache_dir)))
    if cached_encoders(config):
        folders.append(("data.text_cache.cache_dir", Path(data.text_cache.cache_dir)))
    return folders


def check_output_folders(config: Config) -> None:
    """Every folder the run writes is a folder, or can be created: a file in its place or an
    unwritable parent is one line naming the key now, not a traceback once the models are loaded."""
    for key, folder in output_folders(config):
        existing = folder
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            where = "is a file" if existing == folder else f"cannot be created: {existing} is a file"
            raise ConfigError(f"{key}: {folder} {where}, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            what = "cannot be written" if existing == folder else f"cannot be created in {existing}"
            raise ConfigError(f"{key}: {folder} {what} (permission denied)")


def plan_data(config: Config, world_size: int = 1) -> DatasetPlan:
    """The data plan training runs on: its split seed and prior-loss weight, so that the demo (which
    plans with it too) offers the images training trains on, in training's order."""
    from .data_plan import EpochSettings, plan_dataset

    settings = EpochSettings(config.training.prior_loss_weight, split_seed=config.training.seed or 0)
    return plan_dataset(config.data, config.training.batch_size, world_size, settings)


def plan_run(config: Config) -> RunPlan:
    """The data plan, the step count, the eval prompts and the resume point, with the report."""
    from .buckets import unmatched_batch_sizes
    from .checkpointing import choose_resume, soft_settings
    from .ema import ema_warning
    from .embeddings import inversion_report
    from .eval.evaluator import eval_prompts
    from .formats.lycoris_compat import lokr_load_warning
    from .init_adapter import preflight_lines
    from .long_prompts import length_report, local_tokenizer
    from .text_cache import text_cache_status
    from .training_setup import check_targets

    prompts = eval_prompts(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun
    data_plan = plan_data(config, world_size)
    if not data_plan.samples:
        folders = ", ".join(folder.image_dir for folder in config.data.folders() if not folder.is_reg)
        key = "data.subsets" if config.data.subsets else "data.image_dir"
        raise no_images(key, folders, data_plan.scan.skipped)
    held_out = config.data.validation_dir
    if held_out and not data_plan.validation:  # else val/loss would quietly be measured on training images
        raise no_images("data.validation_dir", held_out,
                        [(path, why) for path, why in data_plan.scan.skipped if Path(held_out) in path.parents])
    check_batches(config, data_plan)
    check_targets(config)
    total_steps = count_steps(config, data_plan.batches_per_epoch)
    preflight = describe_plan(config, data_plan, total_steps)
    for warning in (lokr_load_warning(config), ema_warning(config, total_steps)):
        if warning:
            preflight += f"\n  warning: {warning}"
    unmatched = unmatched_batch_sizes(config.data, data_plan.batch_sizes)
    if unmatched:
        preflight += (f"\n  warning: data.bucket.per_resolution_batch_sizes: {', '.join(unmatched)} "
                      "name(s) no bucket of this run, so they set no batch size")
    tokenizer = local_tokenizer(config.model)
    preflight += "\n" + (length_report(tokenizer, config.data.max_token_length, data_plan, prompts) if tokenizer
                         else "captions: their tokens are counted once the model is loaded")
    if config.textual_inversion.tokens:
        preflight += "\n" + inversion_report(config, data_plan, tokenizer)
    if config.data.latent_cache.enabled:
        preflight += f"\nlatent cache: {cache_status(config, data_plan)}"
    if prompts:
        preflight += f"\neval: {len(prompts)} prompt(s), sampler {config.eval.sampler_name} ({config.eval.scheduler})"
    if data_plan.validation and not (prompts and config.eval.live.enabled):
        preflight += "\n  note: the held-out images give val/loss only at live evals (eval.live.enabled)"
    soft = soft_settings(config, data_plan, total_steps)
    choice = choose_resume(config, total_steps)
    resume, said = adopt(choice, config, soft)
    preflight += "".join(f"\n{line}" for line in [*said, *preflight_lines(config, resuming=resume is not None)])
    if config.data.text_cache.enabled:  # a resumed run keeps its seed, and the shuffle variants drawn from it
        seed = resume.snapshot.seed if resume else config.training.seed or None  # 0 too: drawn at the start
        preflight += f"\ntext cache: {text_cache_status(config, data_plan, seed)}"
    return RunPlan(data_plan, total_steps, prompts, preflight, soft, resume)


def no_images(key: str, folders: str, skipped: list[tuple[Path, str]]) -> ConfigError:
    """The error for folders that hold no usable image, with why the first few files were skipped."""
    why = "".join(f"; {path.name}: {reason}" for path, reason in skipped[:3]) + (
        f"; and {len(skipped) - 3} more skipped" if len(skipped) > 3 else "")
    return ConfigError(f"{key}: no readable images found in {folders}{why}")


def adopt(choice: ResumeChoice, config: Config, soft: dict[str, Any]) -> tuple[Resume | None, list[str]]:
    """The resume a choice makes, and the lines that say so (the state is read here when another
    process chose); a run that differs in what the weights mean is a ConfigError."""
    from .checkpointing import Resume, check_compatible, load_state

    if choice.complete:
        return None, [choice.complete]
    passed_over = [f"  warning: {skipped}; it is passed over" for skipped in choice.skipped]
    if choice.folder is None:
        new_run = f"resume: latest: no checkpoint in {config.output_dir / 'checkpoints'} yet; starting a new run"
        return None, passed_over + ([new_run] if config.training.resume_from == "latest" else [])
    saved = choice.saved or load_state(choice.state_path)
    warnings = check_compatible(saved, config, soft)
    position = saved.snapshot.position
    where = (f"resume: from {choice.folder} at step {position.step} (epoch {position.epoch}, "
             f"batch {position.batches_in_epoch} of it)")
    return Resume(choice.folder, saved.snapshot), [where, *passed_over, *(f"  warning: {w}" for w in warnings)]


def settle_resume(plan: RunPlan, choice: ResumeChoice, config: Config) -> list[str]:
    """Take the choice made under the output folder's lock where it differs from the pre-flight's
    (another run saved or pruned checkpoints in between); the lines that say so. RunComplete when
    that run has completed."""
    from .checkpointing import RunComplete

    if choice.complete:
        raise RunComplete(choice.complete)
    if choice.folder == (plan.resume.folder if plan.resume else None):
        return []
    plan.resume, said = adopt(choice, config, plan.soft)
    return ["resume: the checkpoints changed since the pre-flight (another run on this folder?); now:", *said]


def check_batches(config: Config, data_plan: DatasetPlan) -> None:
    """Refuse a plan that cannot make a batch: every bucket dropped, or fewer images than one
    global batch (it would wait for a batch forever, or pad one image out to a whole batch)."""
    key = "data.bucket.batch_size" if config.data.bucket.enabled else "training.batch_size"
    smallest = min(data_plan.batch_sizes[target] for target in set(data_plan.targets)) * data_plan.world_size
    images = len(data_plan.samples)
    processes = f" ({data_plan.world_size} processes)" if data_plan.world_size > 1 else ""
    if data_plan.batches_per_epoch == 0:
        buckets = ", ".join(f"{resolution} ({count} images, batch {size})"
                            for resolution, count, size, _, _ in data_plan.bucket_rows())
        raise ConfigError(f"data.bucket.drop_last: every bucket is smaller than its batch and is dropped: "
                          f"{buckets}; set data.bucket.drop_last=false, or lower {key} "
                          "(or data.bucket.per_resolution_batch_sizes)")
    if images < smallest:
        raise ConfigError(f"{key}: {images} usable image(s) are fewer than one global batch of {smallest}"
                          f"{processes}; lower {key} to at most {images // data_plan.world_size or 1}")


def count_steps(config: Config, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: `num_steps`, `num_epochs`, or whichever comes first."""
    training = config.training
    limits = []
    if training.num_steps:
        limits.append(training.num_steps)
    if training.num_epochs:
        limits.append(max(1, training.num_epochs * batches_per_epoch // training.grad_accum_steps))
    return min(limits)


def describe_plan(config: Config, data_plan: DatasetPlan, total_steps: int) -> str:
    mode = "full fine-tune" if config.adapter.type == "none" else (
        f"{config.adapter.type.upper()} rank {config.adapter.rank} alpha {config.adapter.alpha:g}"
    )
    trained = list(config.trained_components())
    if not trained:  # textual inversion alone: no adapter, only the new tokens' vectors
        mode, trained = "textual inversion", ["the new tokens' embeddings"]
    steps_per_epoch = data_plan.batches_per_epoch / config.training.grad_accum_steps
    # What batches hold: a bucket with fewer images than its batch size makes smaller batches.
    sizes = sorted({len(batch) // data_plan.world_size for batch in data_plan.epoch_batches})
    per_process = "/".join(str(size) for size in sizes)
    global_batch = "/".join(str(size * data_plan.world_size * config.training.grad_accum_steps) for size in sizes)
    return "\n".join([
        f"run {config.run.name}: {mode} of {', '.join(trained)} on {config.model.id}",
        data_plan.report(),
        f"steps: {total_steps} optimizer steps ({steps_per_epoch:g} per epoch); global batch {global_batch} = "
        f"{per_process} per process x {data_plan.world_size} process(es) x {config.training.grad_accum_steps} "
        "accumulation",
        describe_recipe(config),
        describe_optimizer(config),
        f"output: {config.output_dir}",
    ])


def describe_optimizer(config: Config) -> str:
    """The optimizer, its extra arguments, LoRA+, and a warning for Prodigy with Adam-sized rates."""
    optimizer, training = config.optimizer, config.training
    shown = (PRODIGY_SETTINGS if optimizer.type == "prodigy" else {}) | optimizer.args  # the trainer's, then the user's
    line = f"optimizer: {optimizer.type}" + "".join(f", {key}={value}" for key, value in shown.items())
    if optimizer.fused_backward:
        line += "; fused backward: each tensor is stepped in backward and its gradient freed"
    if config.adapter.loraplus_lr_ratio:
        line += f"; LoRA+: B matrices at {config.adapter.loraplus_lr_ratio:g}x the learning rate"
    rates = [rate for rate in (training.lr_unet, training.lr_text_encoder_1, training.lr_text_encoder_2) if rate]
    if optimizer.type == "prodigy" and min(rates) < 0.1:
        line += (f"\n  warning: Prodigy's learning rates multiply its own step size; {min(rates):g} makes its steps "
                 f"{1 / min(rates):,.0f} times smaller (use 1.0; optimizer.args.d_coef scales its steps)")
    return line


def describe_recipe(config: Config) -> str:
    """The loss, timestep and noise settings in one line."""
    training = config.training
    loss = training.loss_type
    if loss != "l2":
        loss += f" (c {training.huber_c:g}, {training.huber_schedule} schedule)"
    weights = [f"min-SNR {training.snr_gamma:g}"] if training.snr_gamma else []
    weights += ["debiased estimation"] if training.debiased_estimation else []
    timesteps = {"uniform": "uniform", "sigmoid": f"sigmoid (scale {training.sigmoid_scale:g})",
                 "logit_normal": f"logit-normal (mean {training.logit_mean:g}, std {training.logit_std:g})",
                 }[training.timestep_sampling] + f" in [{training.min_timestep}, {training.max_timestep})"
    noise = []
    if training.noise_offset:
        noise.append(f"offset {training.noise_offset:g}" + (" (random strength)"
                                                            if training.noise_offset_random_strength else ""))
    if training.multires_noise_iterations:
        noise.append(f"multires {training.multires_noise_iterations} x {training.multires_noise_discount:g}")
    if training.ip_noise_gamma:
        noise.append(f"input perturbation {training.ip_noise_gamma:g}")
    kept = training.output_preservation
    preservation = (f"\noutput preservation: captions holding {kept.trigger!r} read again as "
                    f"{' / '.join(map(repr, kept.classes))} (in turn), pulled to the base model's prediction "
                    f"(weight {kept.weight:g})") if kept.trigger else ""
    return (f"loss: {loss}" + (f", weighted by {' and '.join(weights)}" if weights else "")
            + f"; timesteps {timesteps}; noise: {', '.join(noise) or 'plain'}" + preservation)


def make_latent_cache(config: Config, vae_id: str, vae_dtype: str) -> LatentCache:
    """The run's latent cache for the VAE whose weights have the fingerprint `vae_id`, computing in
    `vae_dtype`."""
    from .latent_cache import LatentCache

    cache = config.data.latent_cache
    dtype = cache.dtype if cache.dtype != "auto" else {"no": "fp32"}.get(config.precision, config.precision)
    return LatentCache(cache.cache_dir, vae_id, dtype, cache.latents, vae_dtype)


def loaded_vae_cache(config: Config, vae: torch.nn.Module) -> LatentCache:
    """The run's latent cache for a loaded VAE: its weights' fingerprint and its dtype."""
    from .latent_cache import vae_fingerprint
    from .precision import dtype_name

    return make_latent_cache(config, vae_fingerprint(vae.state_dict().values()), dtype_name(vae.dtype))


def cache_status(config: Config, data_plan: DatasetPlan) -> str:
    """Hits and misses, known before loading any model when the VAE's weight file is local."""
    from .data import cache_views
    from .latent_cache import vae_fingerprint_from_files
    from .models import vae_weight_files
    from .precision import vae_dtype

    found = vae_weight_files(config.model)
    if found is None:
        return "hits and misses are counted once the VAE is loaded"
    # The VAE's dtype as planned for the configured precision (the device may still change it).
    cache = make_latent_cache(config, vae_fingerprint_from_files(*found), vae_dtype(config, config.precision))
    views = cache_views(data_plan, config.data)
    # Presence only: every entry is read and checked once, when training builds the cache.
    misses = sum(not cache.path(key).is_file() for _, key, _ in views)
    return f"{len(views) - misses} hits, {misses} misses (to encode before training) in {cache.cache_dir}"
