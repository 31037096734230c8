"""The config schema: the single source of truth for every option of a run.

Validation, defaults, `config.schema.json` and the option tables of docs/configuration.md all
come from the pydantic models below (see `schema_docs.py`). Key names follow the original tool's
README so existing configs load unchanged (docs/design.md, 'Config compatibility with the original
tool').
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .adapter_kinds import ADAPTER_KINDS, ADAPTER_TYPES, FULL_FINE_TUNE

BUCKET_KEY = re.compile(r"^(\d+)x(\d+)$")
# The key of each trained component's learning rate.
RATE_KEYS = {"unet": "training.lr_unet", "text_encoder": "training.lr_text_encoder_1",
             "text_encoder_2": "training.lr_text_encoder_2"}
MAX_REPEATS = 10_000  # subset repeats: an epoch is a list of every image times its repeats

SAMPLER_NAMES = (
    "euler", "euler_ancestral", "euler_a", "heun", "lms", "dpm_2", "dpm_2_ancestral", "dpm_2_a",
    "dpmpp_2s_ancestral", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2m_sde_heun", "dpmpp_sde", "dpmpp_3m_sde",
    "ddim", "ddpm", "unipc", "deis", "pndm",
)


class ConfigError(Exception):
    """A config that cannot be used; the message names the file and the dotted key."""


class Section(BaseModel):
    """Base of every config block: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


PositiveInt = Annotated[int, Field(ge=1)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]


# --------------------------------------------------------------------------------------- model
class ModelConfig(Section):
    id: str = Field(
        "stabilityai/stable-diffusion-xl-base-1.0",
        description="Base model: hub id, local diffusers folder, single-file SDXL `.safetensors`, "
        "or `builtin:tiny-sdxl` (a small SDXL-architecture model shipped with the trainer, pretrained on a world "
        "of coloured shapes, for the quickstart, tests and benchmarks).",
    )
    config_dir: str | None = Field(
        None,
        description="Local diffusers folder with only configs, tokenizers and scheduler; used to "
        "load a single-file checkpoint without hub access.",
    )
    vae: str | None = Field(None, description="Replacement VAE: folder, hub id or single file.")
    vae_fp16_safe: bool = Field(
        False, description="The VAE was made to run in fp16 (e.g. sdxl-vae-fp16-fix): store it in fp16 in fp16 runs. "
        "Otherwise the VAE always runs in fp32."
    )
    use_ema: bool = Field(False, description="Keep an exponential moving average of the trained weights.")
    ema_decay: float = Field(0.9999, gt=0.0, lt=1.0, description="EMA decay, in (0, 1).")
    ema_device: Literal["cpu", "same"] = Field("cpu", description="Where EMA weights live.")
    use_bf16: bool = Field(False, description='Legacy switch: same as `training.mixed_precision: "bf16"`.')
    use_gradient_checkpointing: bool = Field(
        True, description="Gradient checkpointing on the UNet (and trained text encoders)."
    )
    train_text_encoder_1: bool = Field(
        True, description="Train CLIP-L (full weights in full mode, adapters in adapter mode)."
    )
    train_text_encoder_2: bool = Field(False, description="Train OpenCLIP-bigG, as above.")
    use_torch_compile: bool = Field(False, description="`torch.compile` the UNet.")
    torch_compile_kwargs: dict[str, Any] = Field(
        default_factory=dict, description='Keyword arguments for `torch.compile`, e.g. `{"mode": "max-autotune"}`.'
    )
    attention: Literal["auto", "sdpa", "flash", "xformers"] = Field(
        "auto",
        description="Attention backend. `auto`: FlashAttention when installed and supported, else "
        "PyTorch SDPA. Naming `flash` or `xformers` makes a missing package an error.",
    )
    weights_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Storage dtype of fully trained weights; `bf16` (with `optimizer.type` `adamw` or `adafactor`) "
        "rounds each optimizer step's result stochastically, so updates smaller than bf16's spacing are kept on "
        "average (docs/memory.md).",
    )
    base_quantization: Literal["none", "float8_e4m3fn", "int8", "nf4"] = Field(
        "none",
        description="Adapter runs: store the frozen base weights of the UNet in fewer bits to fit smaller GPUs "
        "(docs/memory.md, 'Smaller GPUs: a quantized base'). `float8_e4m3fn`: torch's fp8, 1 byte a weight, upcast "
        "to the compute dtype layer by layer (Linear and Conv2d); `int8` (LLM.int8) and `nf4` (4-bit NormalFloat, "
        "about 0.56 byte a weight): bitsandbytes' Linear layers. Refused with a full fine-tune.",
    )
    base_quantization_text_encoders: bool = Field(
        False, description="Quantize the text encoders as `model.base_quantization` says too (their base weights; "
        "refused when one is fully fine-tuned).",
    )


# ------------------------------------------------------------------------------------- adapter
_KIND_WORDS = [kind.summary for kind in ADAPTER_KINDS.values()]


class AdapterConfig(Section):
    type: Literal[ADAPTER_TYPES] = Field(  # the kinds of adapter_kinds.ADAPTER_KINDS, and "none"
        "dora", description=f"Adapter kind: {', '.join(_KIND_WORDS[:-1])} and {_KIND_WORDS[-1]}, or "
        f'`"{FULL_FINE_TUNE}"` = full fine-tune of the selected components.'
    )
    rank: PositiveInt = Field(16, description="Adapter rank.")
    alpha: float = Field(16.0, gt=0.0, description="Adapter alpha (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Adapter dropout.")
    targets: Literal["attn", "attn-mlp", "all"] | list[str] = Field(
        "attn-mlp",
        description="UNet modules that get adapters: `attn` = to_q/to_k/to_v/to_out.0; `attn-mlp` = "
        "every Linear in the transformer blocks incl. proj_in/proj_out; `all` adds the ResNet and "
        "sampler convolutions; or a list of UNet module-name patterns (regular expressions, each matching a "
        "whole name: `.*to_q`, not `to_q`). Trained text encoders get their attention projections "
        "(q/k/v/out_proj), plus their MLP (fc1/fc2) unless `attn`; a list of patterns does not apply to them "
        "(they get both).",
    )
    conv_rank: PositiveInt | None = Field(None, description="Rank for convolution targets (default: rank).")
    conv_alpha: float | None = Field(None, gt=0.0, description="Alpha for convolution targets (default: alpha).")
    loraplus_lr_ratio: float | None = Field(
        None, gt=0.0, description="LoRA+ (Hayou et al. 2024): the B (up) matrices train at this many times the "
        "learning rate (e.g. 16); LoRA and DoRA only.")
    lokr_factor: int = Field(
        -1, description="LoKr: split each dimension n into f x n/f for the Kronecker factors (LyCORIS's `factor`); "
        "-1 = as square as possible.")
    lokr_decompose_both: bool = Field(
        False, description="LoKr: factor the small Kronecker matrix into two rank-`rank` matrices too (LyCORIS's "
        "`decompose_both`); the large one always is, where `rank` is below half its size.")
    init_from: str | None = Field(
        None, description="Start the adapter from this file or folder instead of from zero: a diffusers/peft or "
        "kohya/LyCORIS `.safetensors` file (LoRA, DoRA, LoKr or LoHa), or an output or checkpoint folder of this "
        "trainer. Its kind, targets and most common rank and alpha must match `adapter.*` (the pre-flight names any "
        "difference); modules of other ranks or alphas (kohya's dynamic resizing) keep the file's. Read only when a "
        "run starts, not when it resumes.")

    @model_validator(mode="after")
    def _dropout_is_lora_only(self) -> AdapterConfig:
        kind = ADAPTER_KINDS.get(self.type)
        if self.loraplus_lr_ratio and not (kind and kind.b_matrices):
            raise _KeyError("adapter.loraplus_lr_ratio", f"applies to LoRA's B matrices; {self.type} has none")
        if kind and not kind.input_dropout and self.dropout:
            raise _KeyError("adapter.dropout", f"is LoRA's input dropout; {self.type} has none (set 0)")
        if self.lokr_factor == 0 or self.lokr_factor < -1:
            raise _KeyError("adapter.lokr_factor", f"must be -1 or a positive integer, not {self.lokr_factor}")
        if self.init_from and self.type == FULL_FINE_TUNE:
            raise _KeyError("adapter.init_from", f'starts an adapter; adapter.type "{FULL_FINE_TUNE}" (a full '
                            "fine-tune) has none")
        return self

    @field_validator("targets")
    @classmethod
    def _patterns_compile(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("the list of target patterns is empty")
            for pattern in value:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(f"{pattern!r} is not a valid regular expression: {exc}") from None
        return value


# ----------------------------------------------------------------------------------------- run
class NotifyConfig(Section):
    url: str | None = Field(None, description="Webhook called when the run starts and ends (completed, NaN stop, "
                            "error, interrupted). It is logged with the config: for a secret URL use `url_env`.")
    url_env: str | None = Field(None, description="Name of an environment variable holding the webhook URL.")
    format: Literal["auto", "discord", "json"] = Field(
        "auto", description='`discord`: `{"content": message}`; `json`: a plain JSON object (event, run, status, '
        "steps, seconds, output_dir, message); `auto`: `discord` for discord.com webhook URLs, else `json`.")
    timeout_seconds: float = Field(10.0, gt=0.0, le=300.0, description="How long one call may take; a failed or "
                                   "slow call is one warning line and the run goes on.")

    @model_validator(mode="after")
    def _one_url(self) -> NotifyConfig:
        if (self.url is None) == (self.url_env is None):
            raise _KeyError("run.notify", "needs exactly one of url and url_env")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise _KeyError("run.notify.url", f"= {self.url!r}: must be an http:// or https:// URL")
        return self


class RunConfig(Section):
    name: str = Field(..., min_length=1, description="Name of the run (e.g. `new_beginning_v_0_0_4`).")
    output_root: str = Field(".output", description="Base folder of run outputs.")
    checkpoint_root: str | None = Field(
        None, description="Base folder of single-file checkpoints (default `<output_root>/safetensors`)."
    )
    notify: NotifyConfig | None = Field(None, description="A webhook told when the run starts and ends.")

    @field_validator("name")
    @classmethod
    def _name_is_a_file_name(cls, value: str) -> str:
        if "/" in value or "\\" in value or value in {".", ".."}:
            raise ValueError("must be a plain name (it becomes a folder and a file name), not a path")
        if "\0" in value:
            raise ValueError("contains a NUL character, which no file name can hold")
        return value


# ------------------------------------------------------------------------------------ training
TRACKER_TYPES = ("wandb", "mlflow", "comet_ml", "aim")


class TrackerConfig(Section):
    type: Literal[TRACKER_TYPES] = Field(  # type: ignore[valid-type]
        ..., description="`wandb`, `mlflow`, `comet_ml` or `aim` (an optional extra: requirements-trackers.txt); "
        "TensorBoard is `training.tensorboard`.")
    project: str = Field("sdxl-trainer", description="wandb/comet project, mlflow experiment, aim experiment.")
    run_name: str | None = Field(None, description="Name of the tracker's run (default `run.name`).")
    entity: str | None = Field(None, description="wandb entity (user or team), comet workspace.")
    tags: list[str] = Field(default_factory=list, description="Tags of the tracker's run.")
    offline: bool = Field(False, description="wandb and comet_ml: log to local files only (`wandb sync` uploads "
                          "them later).")
    dir: str | None = Field(None, description="Local folder: wandb's files (default `./wandb`), mlflow's file "
                            "store (tracking URI `file:<dir>`), aim's repository (default `.`); not comet_ml.")
    tracking_uri: str | None = Field(None, description="mlflow: the tracking server or store, a URI (`http://…`, "
                                     "`file:…`) or a folder path (a file store there); default "
                                     "`MLFLOW_TRACKING_URI`, else a file store in `<output folder>/mlruns` "
                                     "(mlflow 3's own default, SQLite, needs the full mlflow package).")

    @field_validator("type", mode="before")
    @classmethod
    def _tensorboard_has_its_block(cls, value: Any) -> Any:
        if value == "tensorboard":
            raise ValueError("TensorBoard is on by default and set by training.tensorboard, not listed here")
        return value

    @model_validator(mode="after")
    def _settings_that_apply(self) -> TrackerConfig:
        if self.offline and self.type not in ("wandb", "comet_ml"):
            raise ValueError(f"offline applies to wandb and comet_ml; {self.type} logs where dir or tracking_uri say")
        if self.tracking_uri and (self.type != "mlflow" or self.dir):
            raise ValueError("tracking_uri is mlflow's, and replaces dir (set one of them)")
        if self.dir and self.type == "comet_ml":
            raise ValueError("dir applies to wandb, mlflow and aim; comet_ml keeps its offline files where "
                             "COMET_OFFLINE_DIRECTORY says")
        if self.entity and self.type not in ("wandb", "comet_ml"):
            raise ValueError(f"entity applies to wandb (its entity) and comet_ml (its workspace); {self.type} has none")
        return self


class LRSchedulerConfig(Section):
    type: Literal["constant", "linear_decay", "cosine_decay", "cosine_restarts"] = Field(
        "constant", description="Shape of the LR factor after warmup."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup 0 → 1 over these steps.")
    min_factor: float = Field(0.0, ge=0.0, le=1.0, description="Lowest factor the decays reach.")
    cycle_steps: PositiveInt | None = Field(None, description="`cosine_restarts`: length of the first cycle.")
    cycle_mult: float = Field(1.0, ge=1.0, description="`cosine_restarts`: each cycle is this much longer.")

    @model_validator(mode="after")
    def _restarts_need_cycle(self) -> LRSchedulerConfig:
        if self.type == "cosine_restarts" and self.cycle_steps is None:
            raise ValueError("cycle_steps is required when type is cosine_restarts")
        return self


class TensorBoardConfig(Section):
    enabled: bool = Field(True, description="Write TensorBoard event files.")
    base_dir: str = Field("./logs/tensorboard", description="Base folder of TensorBoard runs.")
    log_dir: str | None = Field(None, description="Fixed log folder (default `{base_dir}/{run.name}`).")
    log_grad_norm: bool = Field(True, description="Log the gradient norm.")
    log_scaler: bool = Field(True, description="Log the AMP grad-scaler scale.")


class OutputPreservationConfig(Section):
    trigger: str | None = Field(
        None, description="The word of the new concept in the captions (e.g. `cross`, or a trigger word); null = off.")
    classes: list[str] = Field(
        default_factory=list, description="Words the model already knows that the trigger must not take over (e.g. "
        "`square`): each step, the captions holding the trigger are read once more with it replaced by one of "
        "these (in turn), and the adapted model's prediction for them is pulled to the base model's.")
    weight: float = Field(1.0, gt=0.0, description="Weight of that preservation loss beside the training loss.")

    @model_validator(mode="after")
    def _both_or_neither(self) -> OutputPreservationConfig:
        if self.trigger is not None and not self.trigger.strip():
            raise _KeyError("training.output_preservation.trigger", "is empty: name the word, or use null (off)")
        if bool(self.trigger) != bool(self.classes):
            missing = "classes" if self.trigger else "trigger"
            raise _KeyError(f"training.output_preservation.{missing}", "is missing: set both trigger and classes "
                            "(or neither: off)")
        if self.trigger in self.classes:
            raise _KeyError("training.output_preservation.classes", f"holds the trigger {self.trigger!r} itself")
        return self


class TrainingConfig(Section):
    output_dir: str = Field("", description="Run output folder (derived from `run` when empty).")
    num_steps: PositiveInt | None = Field(None, description="Stop after this many optimizer steps.")
    num_epochs: PositiveInt | None = Field(None, description="Stop after this many epochs.")
    batch_size: PositiveInt = Field(1, description="Batch size when bucketing is off.")
    grad_accum_steps: PositiveInt = Field(1, description="Micro-batches per optimizer step.")
    lr_unet: float = Field(1e-4, gt=0.0, description="UNet learning rate.")
    lr_text_encoder_1: float | None = Field(
        None, gt=0.0, description="CLIP-L learning rate; required when it is trained."
    )
    lr_text_encoder_2: float | None = Field(
        None, gt=0.0, description="OpenCLIP-bigG learning rate; required when it is trained."
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="Compute precision (fp16 is the known cause of NaN/black images with DoRA and on MPS)."
    )
    seed: int | None = Field(None, ge=0, description="Fixes all RNGs; `null` or `0` = a random seed, logged.")
    noise_offset: float = Field(0.0, ge=0.0, description="Offset-noise strength (e.g. 0.1).")
    noise_offset_random_strength: bool = Field(
        False, description="Draw each image's offset strength uniformly in [0, `noise_offset`) (kohya's option).")
    multires_noise_iterations: int = Field(
        0, ge=0, description="Multires (pyramid) noise octaves added to the noise (kohya's; e.g. 6); 0 = off.")
    multires_noise_discount: float = Field(
        0.3, gt=0.0, le=1.0, description="Weight of octave i: discount^i; the sum is renormalised to unit variance.")
    ip_noise_gamma: float = Field(
        0.0, ge=0.0, description="Input perturbation: the UNet input is noised with noise + gamma·ξ, the target "
        "keeps the noise (e.g. 0.1); 0 = off.")
    timestep_sampling: Literal["uniform", "logit_normal", "sigmoid"] = Field(
        "uniform", description="Timestep distribution: `uniform`; `logit_normal`: sigmoid(mean + std·z) of the "
        "range; `sigmoid`: the same with mean 0 and std `sigmoid_scale`.")
    logit_mean: float = Field(0.0, description="`logit_normal` timesteps: mean (0 = centred on the middle timestep).")
    logit_std: float = Field(1.0, gt=0.0, description="`logit_normal` timesteps: std.")
    sigmoid_scale: float = Field(1.0, gt=0.0, description="`sigmoid` timesteps: scale of the normal.")
    min_timestep: int = Field(0, ge=0, lt=1000, description="Smallest timestep trained.")
    max_timestep: int = Field(1000, gt=0, le=1000, description="Timesteps are below this (exclusive).")
    loss_type: Literal["l2", "huber", "smooth_l1"] = Field(
        "l2", description="`l2` (MSE), `huber` (pseudo-Huber: r²/2 near 0, c·|r| far out) or `smooth_l1` "
        "(r²/(2c) near 0, |r| far out).")
    huber_c: float = Field(0.1, gt=0.0, le=1.0, description="Huber/smooth-L1 threshold c (its value at the last "
                           "timestep under a schedule).")
    huber_schedule: Literal["constant", "exponential", "snr"] = Field(
        "snr", description="c per timestep as kohya defines it: `constant`; `exponential`: c^(t/T); `snr`: "
        "(1 − c)/(1 + σ_t)² + c.")
    debiased_estimation: bool = Field(
        False, description="Weight the loss by 1/√SNR (v-prediction: 1/(SNR + 1)), SNR capped at 1000 (kohya's).")
    min_sigma: float | None = Field(
        None, gt=0.0, description="Clamp small sigmas in the loss weighting only (never the timesteps)."
    )
    min_sigma_warmup_steps: int = Field(0, ge=0, description="Steps before `min_sigma` applies.")
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        None, description="Training target; `null` = the base model's scheduler's own `prediction_type`."
    )
    zero_terminal_snr: bool | None = Field(
        None, description="Rescale betas to zero terminal SNR (for v-prediction); `null` = the base model's "
        "scheduler's own setting (`rescale_betas_zero_snr`).")
    snr_gamma: float | None = Field(None, gt=0.0, description="Min-SNR loss weighting gamma (e.g. 5.0).")
    max_grad_norm: float | None = Field(None, gt=0.0, description="Gradient clipping per optimizer step.")
    detect_anomaly: bool = Field(False, description="Abort as soon as loss or gradients are NaN/Inf.")
    nan_policy: Literal["abort", "skip"] = Field(
        "abort", description="On a non-finite loss/gradient: abort with a report, or skip the step."
    )
    max_nan_skips: PositiveInt = Field(10, description="Consecutive skipped steps before aborting.")
    memory_check: Literal["auto", "warn", "refuse", "off"] = Field(
        "auto", description="The memory plan against the device's free memory: `warn` or `refuse` when the "
        "planned peak does not fit (with what would make it fit), `off` = no plan. `auto` = `warn` on a GPU; on the "
        "CPU, where tracing the plan takes seconds and RAM is rarely the limit, the plan is made by `--dry-run` "
        "only. With a plan, every log step records the measured peak beside it (docs/memory.md).")
    prior_loss_weight: float = Field(
        1.0, ge=0.0, description="Weight of regularization images (`data.subsets[].is_reg`) in the loss.")
    unmasked_weight: float = Field(
        0.0, ge=0.0, le=1.0, description="Masked loss: the weight of the masked-out part (0 = ignored; e.g. 0.1 "
        "keeps some of the background, as OneTrainer's option of this name).")
    output_preservation: OutputPreservationConfig = Field(
        default_factory=OutputPreservationConfig, description="Keep what the base model draws for the words a new "
        "concept could take over, without regularization images (ai-toolkit's differential output preservation; "
        "adapters only; docs/training.md).")

    @model_validator(mode="after")
    def _recipes_that_can_work(self) -> TrainingConfig:
        if self.min_timestep >= self.max_timestep:
            raise _KeyError("training.min_timestep", f"({self.min_timestep}) must be below training.max_timestep "
                            f"({self.max_timestep})")
        problem = self.schedule_problem(self.prediction_type, self.zero_terminal_snr)
        if problem:
            raise _KeyError("training.debiased_estimation", problem)
        return self

    def schedule_problem(self, prediction_type: str | None, zero_terminal_snr: bool | None) -> str | None:
        """Why the loss weighting is infinite on this noise schedule, if it is. Checked with the
        config's own values, then again with the base model's where they are null (run.py)."""
        if self.debiased_estimation and zero_terminal_snr and prediction_type == "epsilon":
            return ("weighs by 1/sqrt(SNR), infinite at zero-terminal SNR's last timestep with an epsilon target; "
                    "use v-prediction or turn one off")
        return None

    lr_warmup_steps: int = Field(0, ge=0, description="Legacy linear warmup (used when `lr_scheduler` is absent).")
    lr_scheduler: LRSchedulerConfig | None = Field(None, description="LR factor schedule.")
    ema_update_every: PositiveInt = Field(10, description="EMA update interval in steps (after warmup).")
    log_every: PositiveInt = Field(10, description="Logging interval in steps.")
    checkpoint_every: PositiveInt = Field(500, description="Checkpoint interval in steps.")
    checkpoints_total_limit: PositiveInt | None = Field(None, description="Keep only the newest N checkpoints.")
    resume_from: str | None = Field(
        None, description='Earlier output or checkpoint folder (or `"latest"`) to continue from.'
    )
    resume_state_path: str | None = Field(
        None, description="Trainer state file (default `<resume_from>/trainer_state.pt`)."
    )
    state_path: str | None = Field(
        None, description="Where this run writes its trainer state (default `<output_dir>/trainer_state.pt`)."
    )
    distributed_timeout_minutes: float = Field(
        60.0, gt=0.0,
        description="Several processes: how long one waits for the others (while the main process alone "
        "checkpoints, exports or evaluates) before the run fails. PyTorch's NCCL default is 10.",
    )
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard logging.")
    trackers: list[TrackerConfig] = Field(
        default_factory=list, description="Experiment trackers beside TensorBoard; each gets every scalar, image "
        "and text TensorBoard gets, and the resolved config once (docs/training.md, 'Trackers beside TensorBoard').")

    @field_validator("trackers")
    @classmethod
    def _one_of_each(cls, value: list[TrackerConfig]) -> list[TrackerConfig]:
        types = [tracker.type for tracker in value]
        repeated = sorted({kind for kind in types if types.count(kind) > 1})
        if repeated:
            raise ValueError(f"lists {', '.join(repeated)} more than once (one run per tracker)")
        return value


# ---------------------------------------------------------------------------------------- data
class BucketConfig(Section):
    enabled: bool = Field(True, description="Aspect-ratio buckets; batches never mix buckets.")
    resolutions: list[tuple[PositiveInt, PositiveInt]] | None = Field(
        None,
        description="Bucket resolutions `[[w, h], …]`; `null` = generated from `data.size` "
        "(same area, both orientations, multiples of `divisible_by`, always the square one; `data.size` must be at "
        "least `divisible_by`).",
    )
    divisible_by: PositiveInt = Field(64, description="Bucket sides are multiples of this.")
    batch_size: PositiveInt = Field(1, description="Batch size per bucket.")
    drop_last: bool = Field(False, description="Drop each bucket's incomplete last batch.")
    per_resolution_batch_sizes: dict[str, PositiveInt] = Field(
        default_factory=dict, description='Batch size per bucket, e.g. `{"832x1216": 2}`.'
    )

    @field_validator("per_resolution_batch_sizes")
    @classmethod
    def _keys_are_resolutions(cls, value: dict[str, int]) -> dict[str, int]:
        for key in value:
            if not BUCKET_KEY.match(key):
                raise ValueError(f'key {key!r} is not a resolution like "832x1216"')
        return value

    @model_validator(mode="after")
    def _resolutions_divisible(self) -> BucketConfig:
        for width, height in self.resolutions or []:
            if width % self.divisible_by or height % self.divisible_by:
                raise ValueError(
                    f"resolution [{width}, {height}] is not a multiple of divisible_by={self.divisible_by}"
                )
        return self


class LatentCacheConfig(Section):
    enabled: bool = Field(True, description="Cache VAE latents on disk; training then never runs the VAE encoder.")
    cache_dir: str = Field("./cache/latents", description="Cache folder.")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="Storage dtype; `auto` follows the precision policy."
    )
    build_batch_size: PositiveInt = Field(
        1, description="Ignored, accepted so that older configs load: the cache encodes one view at a time, so that "
        "an entry's bytes depend on its key alone (a VAE's output shifts in the last bits with its batch-mates, "
        "which broke exact resume after a kill during the build).",
    )
    latents: Literal["sample", "mode"] = Field(
        "sample",
        description="`sample`: store the VAE's latent distribution (mean and std) and draw a new sample "
        "every epoch; `mode`: store and always use the mean.",
    )


class TextCacheConfig(Section):
    enabled: bool = Field(
        True, description="Cache the outputs of the frozen text encoders on disk (every caption text the run can "
        "produce); those encoders then leave the training device. A trained encoder always runs live."
    )
    cache_dir: str = Field("./cache/text", description="Cache folder.")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="Storage dtype; `auto` follows the precision policy (the dtype the encoders compute in)."
    )


MASK_KEYS = ("alpha_mask", "mask_dir")  # a folder's mask source: one of them, or neither


class FolderOptions(Section):
    """What a folder of training images is and how its captions and masks are read: the keys a
    subset shares with `data` (a subset's unset keys take `data`'s values)."""

    image_dir: str = Field("./data/images", description="Folder of images (PNG/JPG/WebP).")
    recursive: bool = Field(False, description="Also read images in sub-folders of `image_dir`.")
    caption_source: Literal["txt", "metadata", "filename"] = Field(
        "txt", description="Where captions come from: a same-stem text file (`caption_extension`); "
        "`metadata`: `image_dir/metadata.jsonl`, one JSON object per line with `file_name` (relative to "
        "`image_dir`) and `text` (the Hugging Face imagefolder convention); `filename`: the file's name "
        "without extension, underscores as spaces.")
    caption_extension: str = Field(
        ".txt", pattern=r"^\.[A-Za-z0-9_.-]+$", description="Extension of the caption files (e.g. `.caption`).")
    caption_prefix: str = Field(
        "", description="Text put before every caption of the folder, with a space (kohya's `caption_prefix`): "
        "a trigger word, or a textual inversion token (`textual_inversion.tokens`) for captions that lack it.")
    caption_dropout_prob: Probability = Field(0.0, description="Probability of dropping the whole caption.")
    caption_shuffle_prob: Probability = Field(0.0, description="Probability of shuffling the caption's parts.")
    caption_shuffle_separator: str = Field(",", min_length=1, description="Separator that splits a caption.")
    caption_shuffle_min_tokens: int = Field(2, ge=0, description="Minimum number of parts before shuffling applies.")
    keep_tokens: int = Field(0, ge=0, description="Leading parts never shuffled (trigger words).")
    caption_shuffle_variants: PositiveInt | None = Field(
        None, description="A shuffled caption is one of this many fixed orders per caption, drawn from the seed "
        "(the same with the text cache on or off); `null`: a new order every epoch, which the text cache cannot hold "
        "(the encoders then run live)."
    )
    alpha_mask: bool = Field(
        False, description="Masked loss: the image's alpha channel weights the loss (opaque = trained; "
        "an image without alpha counts as fully opaque).")
    mask_dir: str = Field(
        "", description="Masked loss: a folder of grayscale masks named like the images (same relative path "
        "and stem, any image extension; white = trained, black = ignored), each the size of its image.")

    @model_validator(mode="after")
    def _one_mask_source(self) -> FolderOptions:
        if self.alpha_mask and self.mask_dir:
            raise ValueError("alpha_mask and mask_dir are two mask sources; set one")
        return self


class SubsetConfig(FolderOptions):
    """One folder of a multi-folder dataset (kohya's `[[datasets.subsets]]`, OneTrainer's concepts)."""

    image_dir: str = Field(..., description="Folder of this subset's images.")
    repeats: PositiveInt = Field(
        1, description=f"How many times each image is seen per epoch (at most {MAX_REPEATS:,}: for longer "
        "training raise `training.num_steps` or `num_epochs`).", json_schema_extra={"maximum": MAX_REPEATS})
    is_reg: bool = Field(
        False, description="Regularization (class) images for prior preservation: each epoch draws as many as "
        "there are training images, cycling through them; their loss is weighted by `training.prior_loss_weight`.")
    loss_weight: float = Field(1.0, gt=0.0, description="Weight of this subset's images in the loss.")

    @field_validator("repeats")
    @classmethod
    def _repeats_fit_an_epoch(cls, value: int) -> int:
        if value > MAX_REPEATS:  # each repeat is a copy of the folder's images in every epoch's list
            raise ValueError(f"must be at most {MAX_REPEATS:,}: an epoch holds each image this many times; "
                             "for longer training raise training.num_steps or training.num_epochs")
        return value


class DataConfig(FolderOptions):
    size: PositiveInt = Field(
        1024, description="Target size: bucket area is `size²`; without buckets the longest side."
    )
    random_flip: bool = Field(False, description="Horizontal flip augmentation.")
    crop: Literal["center", "random"] = Field(
        "center", description="Where images are cropped to their bucket: the center, or a new random place each epoch."
    )
    background_color: tuple[int, int, int] = Field(
        (255, 255, 255), description="RGB colour that transparent pixels are composited onto."
    )
    max_image_pixels: PositiveInt = Field(
        100_000_000, description="Images with more pixels are skipped (protects against decompression bombs); "
        "it replaces PIL's own limit (179 MP), so it may be set above that.")
    max_caption_bytes: PositiveInt = Field(
        65_536, description="Captions longer than this (in UTF-8 bytes) are skipped with their image: CLIP reads "
        "77 tokens (a few hundred characters), and a huge file (a wrong one) would stall the pre-flight."
    )
    max_token_length: Literal[75, 150, 225] = Field(
        75, description="Caption tokens each text encoder reads: 75 (CLIP's 77 with its start and end token; a "
        "longer caption is cut there, as the SDXL pipeline cuts it), or 150 / 225, encoded in 75-token chunks as "
        "kohya's `--max_token_length` and ComfyUI encode long prompts (docs/data.md). The same "
        "for the eval prompts; the pre-flight counts the captions cut.")
    num_workers: int = Field(2, ge=0, description="Data-loader worker processes.")
    scan_cache_dir: str = Field(
        "./cache/scan", description="Scan cache folder: each image's size and decode check, kept so that a start "
        "decodes only new or changed images (a changed size, mtime or inode is checked again; the first scan "
        "decodes with `num_workers` threads, at least 1). Empty: no cache, every start decodes every image."
    )
    bucket: BucketConfig = Field(default_factory=BucketConfig, description="Aspect-ratio buckets.")
    latent_cache: LatentCacheConfig = Field(default_factory=LatentCacheConfig, description="VAE latent cache.")
    text_cache: TextCacheConfig = Field(default_factory=TextCacheConfig, description="Text-encoder output cache.")
    subsets: list[SubsetConfig] = Field(
        default_factory=list, description="Several folders, each with its own repeats, captions and masks, "
        "or regularization images; a subset's unset keys take the values of `data` (the mask keys together: a "
        "subset that sets `alpha_mask` or `mask_dir` takes neither from `data`). Empty: `data.image_dir` "
        "is the one folder.")
    validation_split: float = Field(
        0.0, ge=0.0, le=0.5, description="Fraction of the training images held out for `val/loss` and never "
        "trained on, the same images in every run with the same `training.seed`; 0 = `val/loss` is computed "
        "on training images.")
    validation_dir: str = Field(
        "", description="A folder of held-out images (captions and masks read as `data` says) for `val/loss`; "
        "instead of `validation_split`.")

    @field_validator("background_color")
    @classmethod
    def _rgb(cls, value: tuple[int, int, int]) -> tuple[int, int, int]:
        if not all(0 <= channel <= 255 for channel in value):
            raise ValueError("each channel must be in 0..255")
        return value

    @model_validator(mode="after")
    def _cache_needs_fixed_crops(self) -> DataConfig:
        if self.latent_cache.enabled and self.crop == "random":
            raise _KeyError(
                "data.crop", 'is "random" but data.latent_cache.enabled is true: cached latents need a fixed '
                'crop (use "center", or turn the cache off)'
            )
        return self

    @model_validator(mode="after")
    def _generated_buckets_fit(self) -> DataConfig:
        if self.bucket.enabled and not self.bucket.resolutions and self.size < self.bucket.divisible_by:
            raise _KeyError("data.size", f"is {self.size}, below data.bucket.divisible_by "
                            f"({self.bucket.divisible_by}): no bucket side fits it; raise data.size or list "
                            "data.bucket.resolutions")
        return self

    @model_validator(mode="after")
    def _one_source_of_images(self) -> DataConfig:
        if self.subsets and "image_dir" in self.model_fields_set:
            raise _KeyError("data.image_dir", "is set together with data.subsets; give each subset its image_dir")
        if self.subsets and all(subset.is_reg for subset in self.subsets):
            raise _KeyError("data.subsets", "holds only regularization subsets (is_reg); add the training images")
        if self.validation_split and self.validation_dir:
            raise _KeyError("data.validation_split", "and data.validation_dir are two validation sets; set one")
        return self

    def folders(self) -> list[SubsetConfig]:
        """The subsets with every unset key taken from `data`; without subsets, `data` itself as one."""
        shared = self._folder_options()
        if not self.subsets:
            return [SubsetConfig(**shared)]
        return [SubsetConfig(**{**self._inherited(shared, subset), **subset.model_dump(exclude_unset=True)})
                for subset in self.subsets]

    @staticmethod
    def _inherited(shared: dict[str, Any], subset: SubsetConfig) -> dict[str, Any]:
        """`data`'s keys a subset takes: the mask keys go together, so a subset that names its own mask
        source (or none) does not also take `data`'s, which would be two sources."""
        if subset.model_fields_set & set(MASK_KEYS):
            return {name: value for name, value in shared.items() if name not in MASK_KEYS}
        return shared

    def shuffles_without_variants(self) -> bool:
        """Whether some folder shuffles captions into a new order every epoch (no fixed variants):
        those texts cannot be listed, so the text cache is off."""
        return any(folder.caption_shuffle_prob > 0 and not folder.caption_shuffle_variants
                   for folder in self.folders())

    def validation_folder(self) -> SubsetConfig | None:
        """`validation_dir` read with `data`'s caption and mask settings, or None."""
        if not self.validation_dir:
            return None
        return SubsetConfig(**{**self._folder_options(), "image_dir": self.validation_dir})

    def _folder_options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FolderOptions.model_fields}


# ----------------------------------------------------------------------------------- optimizer
# The optimizers whose update of a tensor reads that tensor's gradient and state alone
# (`optimizer.fused_backward` steps one tensor at a time).
FUSABLE_OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "lion", "lion8bit", "came")


class OptimizerConfig(Section):
    type: Literal[
        "adamw8bit", "adamw", "adafactor", "prodigy", "adamw_schedulefree", "lion", "lion8bit", "came"
    ] = Field(
        "adamw8bit", description="8-bit AdamW (bitsandbytes), AdamW, Adafactor, Prodigy (`prodigyopt`; the "
        "learning rates are multipliers of its own step size: use 1.0 for every trained part; bias correction and "
        "the warmup safeguard on), schedule-free AdamW (`schedulefree`; "
        "constant LR schedule, eval and exports use its averaged weights), Lion or 8-bit Lion (bitsandbytes), "
        "or CAME (`came-pytorch`)."
    )
    weight_decay: float = Field(0.01, ge=0.0, description="Weight decay.")
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="Adam betas (Lion: its own (0.9, 0.99) unless set; CAME: not used).")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon (not used by Lion and CAME).")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Further keyword arguments of the optimizer's constructor, checked "
        'against it (e.g. `{"d_coef": 0.5}` for Prodigy).')
    fused_backward: bool = Field(
        False, description="Step each trained tensor inside the backward pass as soon as its gradient is complete, "
        "and free that gradient (saves the memory of all gradients: 5-10 GB for a full SDXL UNet). For AdamW, 8-bit "
        "AdamW, Adafactor, Lion and CAME, on one process or several (DDP; not FSDP), with "
        "`training.grad_accum_steps` 1, no "
        "`training.max_grad_norm`, bf16 or fp32, and `training.nan_policy` \"abort\" (docs/memory.md).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError("each beta must be in [0, 1)")
        return value


# -------------------------------------------------------------------------------------- export
class ExportConfig(Section):
    save_single_file: bool = Field(True, description="Also write a single-file SDXL checkpoint (ComfyUI/A1111).")
    checkpoint_path: str = Field("", description="Where (derived from `run.name` when empty).")
    converter_script: str = Field("./converttosdxl.py", description="The converter script (same CLI as diffusers').")
    half_precision: bool = Field(True, description="Converter: write fp16.")
    use_safetensors: bool = Field(True, description="Converter: write safetensors.")
    extra_args: list[str] = Field(default_factory=list, description="Converter: extra arguments.")
    adapter_formats: list[Literal["diffusers", "kohya"]] = Field(
        default_factory=lambda: ["diffusers", "kohya"],
        description="Adapter files: diffusers/peft (`pytorch_lora_weights.safetensors`) and kohya/ComfyUI.",
    )
    merge_adapter: bool = Field(
        True, description="Adapter runs: the single file holds the base with the adapter merged."
    )


# ---------------------------------------------------------------------------------------- eval
class LiveEvalConfig(Section):
    enabled: bool = Field(False, description="Render eval prompts during training.")
    every_n_steps: PositiveInt = Field(500, description="Live eval interval in steps.")
    at_start: bool = Field(False, description="Also render before the first step (step 0, the model as loaded); "
                           "not on resume.")
    max_batches: PositiveInt | None = Field(None, description="Render only the first N prompts.")


class FinalEvalConfig(Section):
    enabled: bool = Field(False, description="Render eval prompts after the last step.")
    max_batches: PositiveInt | None = Field(None, description="Render only the first N prompts.")


class EvalConfig(Section):
    backend: Literal["auto", "kdiffusion", "diffusers"] = Field(
        "auto",
        description="`kdiffusion`: ComfyUI's samplers and schedules, computed as ComfyUI computes them (same sigmas, "
        "timesteps and noise for a seed); `diffusers`: diffusers schedulers (their sigmas differ from ComfyUI's for "
        "most schedules); `auto`: `kdiffusion` when `sampler_name` and `scheduler` are both ComfyUI names.",
    )
    sampler_name: Literal[SAMPLER_NAMES] = Field("euler", description="Sampler, by its k-diffusion/ComfyUI name.")  # type: ignore[valid-type]
    scheduler: str = Field(
        "normal",
        description="Sigma schedule by its ComfyUI name (`normal`, `karras`, `exponential`, `sgm_uniform`, `simple`, "
        "`ddim_uniform`, `beta`, `kl_optimal`), or (diffusers backend) a diffusers scheduler class name.",
    )
    num_inference_steps: PositiveInt = Field(30, description="Sampling steps.")
    cfg_scale: float = Field(7.0, ge=0.0, description="Classifier-free guidance scale.")
    prompts_path: str | None = Field(None, description="JSON list of `{prompt, negative_prompt, seed, height, width}`.")
    height: PositiveInt = Field(1024, description="Default height.")
    width: PositiveInt = Field(1024, description="Default width.")
    use_ema: bool = Field(False, description="Render with EMA weights swapped in (needs `model.use_ema`).")
    batch_size: PositiveInt = Field(
        1, description="Prompts sampled together, in one UNet call per step (consecutive prompts of one size; the "
        "`kdiffusion` backend, the `diffusers` backend renders one at a time). 1: each image depends on its seed "
        "alone, bit for bit; more is faster (4x at 16 for the tiny model on one CPU thread), and an image can then "
        "differ in its last bits with the prompts beside it.")
    judge: Literal["none", "shapes"] = Field(
        "none", description="`shapes`: read every eval image whose prompt is in the world-of-shapes grammar (`a red "
        "circle, blue background`) with the shapes judge and report the fraction that shows what its prompt says "
        "(the shapes' kinds and colours and the background colour; not the gradient nor the shapes' order), "
        "per prompt `group` (printed, in TensorBoard and run_summary.json); for `builtin:tiny-sdxl`. A prompts file "
        "with no prompt in the grammar is a config error.")
    live: LiveEvalConfig = Field(default_factory=LiveEvalConfig, description="Evaluation during training.")
    final: FinalEvalConfig = Field(default_factory=FinalEvalConfig, description="Evaluation after training.")


# --------------------------------------------------------------------------- textual inversion
class NewTokenConfig(Section):
    token: str = Field(
        ..., min_length=1, description="The new word as captions and prompts write it, e.g. `<sks>`: one word "
        "(no spaces) the tokenizers do not already know as one token.")
    vectors: int = Field(1, ge=1, le=16, description="Embedding vectors it stands for (diffusers adds "
                         "`<sks>`, `<sks>_1`, …; a caption's `<sks>` reads all of them).")
    init_word: str = Field(..., description="A word whose token embeddings the vectors start from (cycled "
                           "when it has fewer tokens than `vectors`), e.g. the concept's class: `dog`.")

    @field_validator("token")
    @classmethod
    def _one_word(cls, value: str) -> str:
        if value != value.strip() or any(char.isspace() for char in value):
            raise ValueError("must be one word, without spaces")
        return value


class TextualInversionConfig(Section):
    tokens: list[NewTokenConfig] = Field(
        default_factory=list, description="New tokens whose embeddings train in both text encoders (CLIP-L and "
        "bigG); only their rows of the embedding tables train. Empty: no textual inversion.")
    train_adapter: bool = Field(
        False, description="Pivotal tuning: the adapter (`adapter`) trains with the embeddings. False: "
        "textual inversion alone, everything else frozen.")
    lr: float = Field(1e-3, gt=0.0, description="Learning rate of the new embeddings.")
    train_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="Fraction of the optimizer steps during which the embeddings train "
        "(diffusers' pivotal tuning: `train_text_encoder_ti_frac`); afterwards they stay as they are.")

    @model_validator(mode="after")
    def _distinct(self) -> TextualInversionConfig:
        names = [new.token for new in self.tokens]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise _KeyError("textual_inversion.tokens", f"names {repeated[0]!r} twice")
        return self


# ---------------------------------------------------------------------------------------- root
class Config(Section):
    """A whole run. Only `run.name` and a stop condition are required."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    schema_path: str | None = Field(
        None, alias="$schema", description="Path of `config.schema.json`, so editors validate the file."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model and what is trained.")
    adapter: AdapterConfig = Field(default_factory=AdapterConfig, description="DoRA / LoRA / full fine-tune.")
    run: RunConfig = Field(..., description="Run name and output roots.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="The training loop.")
    data: DataConfig = Field(default_factory=DataConfig, description="Images, captions, buckets, latent cache.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="Files written after training.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Sample images during and after training.")
    textual_inversion: TextualInversionConfig = Field(
        default_factory=TextualInversionConfig, description="New words: textual inversion and pivotal tuning "
        "(docs/training.md).")

    @model_validator(mode="after")
    def _no_contradictions(self) -> Config:
        training, model = self.training, self.model
        if training.num_steps is None and training.num_epochs is None:
            raise _KeyError(
                "training.num_steps", "is missing: set training.num_steps or training.num_epochs (or both)"
            )
        if model.use_bf16 and training.mixed_precision == "fp16":
            raise _KeyError(
                "model.use_bf16", 'is true but training.mixed_precision is "fp16"; keep one of them'
            )
        if training.min_sigma is not None and training.snr_gamma is None:
            raise _KeyError(
                "training.min_sigma", "only changes the min-SNR loss weighting: set training.snr_gamma too"
            )
        if model.weights_dtype == "bf16":
            if self.adapter.type != "none":
                raise _KeyError(
                    "model.weights_dtype", '"bf16" is for full fine-tunes (adapter.type "none"); adapters '
                    "always keep fp32 weights"
                )
            if self.optimizer.type not in ("adamw", "adafactor"):
                raise _KeyError(
                    "model.weights_dtype", '"bf16" trains with AdamW or Adafactor and stochastic rounding: set '
                    'optimizer.type to "adamw" or "adafactor"'
                )
        schedule = training.lr_scheduler
        if self.optimizer.type == "adamw_schedulefree" and schedule is not None and schedule.type != "constant":
            raise _KeyError(
                "training.lr_scheduler.type", f'is "{schedule.type}", but schedule-free AdamW replaces the decay '
                'with its averaging: use "constant" (its warmup_steps warm up the optimizer)'
            )
        for index in (1, 2):
            if getattr(model, f"train_text_encoder_{index}") and getattr(training, f"lr_text_encoder_{index}") is None:
                raise _KeyError(
                    f"training.lr_text_encoder_{index}",
                    f"must be set because model.train_text_encoder_{index} is true "
                    f"(or set model.train_text_encoder_{index} to false)",
                )
        if self.eval.use_ema and not model.use_ema:
            raise _KeyError("eval.use_ema", "renders with the EMA weights, but model.use_ema is false: no EMA is kept "
                            "(set model.use_ema to true, or eval.use_ema to false)")
        self._check_textual_inversion()
        self._check_prodigy_rates()
        preservation = training.output_preservation
        trains_adapter = self.adapter.type != "none" and (
            not self.textual_inversion.tokens or self.textual_inversion.train_adapter)
        if preservation.trigger and not trains_adapter:
            why = 'adapter.type is "none"' if self.adapter.type == "none" else "textual inversion trains alone"
            raise _KeyError("training.output_preservation", "compares the adapted model with the base model (the "
                            f"same model with its adapter off), so it needs an adapter that trains; here {why}")
        export = self.export
        if trains_adapter and not export.adapter_formats and not (export.save_single_file and export.merge_adapter):
            raise _KeyError("export.adapter_formats", "is empty and no merged single file is written "
                            "(export.save_single_file, export.merge_adapter), so the trained adapter would be saved "
                            'nowhere but in checkpoints; list "diffusers" and/or "kohya"')
        return self

    @model_validator(mode="after")
    def _fused_backward_holds(self) -> Config:
        """What `optimizer.fused_backward` cannot be combined with (sdxl_trainer/fused_backward.py says why)."""
        if not self.optimizer.fused_backward:
            return self
        training = self.training
        refusals = {
            "optimizer.type": (self.optimizer.type not in FUSABLE_OPTIMIZERS,
                               f'"{self.optimizer.type}" couples the tensors of a group; fusable: '
                               + ", ".join(FUSABLE_OPTIMIZERS)),
            "training.grad_accum_steps": (training.grad_accum_steps > 1,
                                          "is above 1: a gradient is complete only after the last micro-batch"),
            "training.max_grad_norm": (training.max_grad_norm is not None,
                                       "clips by the global norm, known only after the last gradient; remove it"),
            "training.mixed_precision": (self.precision == "fp16",
                                         '"fp16": its grad scaler decides after all gradients; use bf16'),
            "training.nan_policy": (training.nan_policy == "skip",
                                    '"skip" cannot undo the tensors stepped before a non-finite gradient; '
                                    'use "abort"'),
        }
        for key, (refused, reason) in refusals.items():
            if refused:
                raise _KeyError(key, f"{reason} (optimizer.fused_backward is true)")
        return self

    def _check_textual_inversion(self) -> None:
        inversion = self.textual_inversion
        if not inversion.tokens:
            return
        if inversion.train_adapter and self.adapter.type == "none":
            raise _KeyError("textual_inversion.train_adapter", 'trains an adapter, but adapter.type is "none" '
                            "(a full fine-tune with new tokens is not supported)")
        if self.adapter.type == "none":  # else the UNet would be planned, kept and exported as fully trained
            raise _KeyError("adapter.type", 'is "none" (a full fine-tune), which textual_inversion.tokens do not '
                            "support: textual inversion alone trains no adapter whatever adapter.type is, so "
                            "leave it at its default")
        if not inversion.train_adapter:
            if inversion.train_fraction < 1:
                raise _KeyError("textual_inversion.train_fraction", "is below 1, but textual inversion alone "
                                "would then train nothing: it is for pivotal tuning (train_adapter true)")
            for index in (1, 2):
                if getattr(self.model, f"train_text_encoder_{index}"):
                    raise _KeyError(f"model.train_text_encoder_{index}", "is true, but textual inversion alone "
                                    "trains the new embeddings only: set it to false (or textual_inversion."
                                    "train_adapter to true)")

    def _check_prodigy_rates(self) -> None:
        """Prodigy estimates one step size for all parameters, and prodigyopt raises at the first
        step when param groups differ in rate: every trained part takes the same rate, no LoRA+."""
        if self.optimizer.type != "prodigy":
            return
        if self.adapter.loraplus_lr_ratio not in (None, 1):
            raise _KeyError("adapter.loraplus_lr_ratio", "trains LoRA's B matrices at another rate, which Prodigy "
                            "does not take (it estimates one step size for all parameters): remove it")
        rates = {RATE_KEYS[name]: rate for name, rate in self.trained_components().items()}
        if self.textual_inversion.tokens:
            rates["textual_inversion.lr"] = self.textual_inversion.lr
        first, rate = next(iter(rates.items()))
        for key, other in rates.items():
            if other != rate:
                raise _KeyError(key, f"is {other:g} and {first} is {rate:g}, but Prodigy takes one rate for every "
                                "part it trains (it estimates one step size for all of them): set them equal "
                                '(1.0), and scale its steps with optimizer.args.d_coef (e.g. {"d_coef": 0.5})')

    # Derived values ------------------------------------------------------------------------
    def trained_components(self) -> dict[str, float]:
        """The components the config trains, with their learning rates (textual inversion's new
        embeddings are not among them: embeddings.attach_tokens adds them)."""
        training, model, inversion = self.training, self.model, self.textual_inversion
        # Textual inversion alone trains the new embeddings only.
        wanted = {"unet": training.lr_unet} if not inversion.tokens or inversion.train_adapter else {}
        if model.train_text_encoder_1:
            wanted["text_encoder"] = training.lr_text_encoder_1
        if model.train_text_encoder_2:
            wanted["text_encoder_2"] = training.lr_text_encoder_2
        return wanted

    @property
    def precision(self) -> str:
        """The effective compute precision (`model.use_bf16` is a legacy alias)."""
        return "bf16" if self.model.use_bf16 else self.training.mixed_precision

    @property
    def output_dir(self) -> Path:
        return Path(self.training.output_dir or Path(self.run.output_root) / self.run.name)

    @property
    def checkpoint_path(self) -> Path:
        if self.export.checkpoint_path:
            return Path(self.export.checkpoint_path)
        root = self.run.checkpoint_root or Path(self.run.output_root) / "safetensors"
        return Path(root) / f"{self.run.name}.safetensors"

    @property
    def state_path(self) -> Path:
        return Path(self.training.state_path or self.output_dir / "trainer_state.pt")

    @property
    def tensorboard_dir(self) -> Path:
        tensorboard = self.training.tensorboard
        return Path(tensorboard.log_dir or Path(tensorboard.base_dir) / self.run.name)

    def resolved(self) -> dict[str, Any]:
        """The config as JSON data with every derived path filled in (for `--print-config`)."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=False)
        data["training"]["output_dir"] = str(self.output_dir)
        data["training"]["state_path"] = str(self.state_path)
        data["training"]["tensorboard"]["log_dir"] = str(self.tensorboard_dir)
        data["export"]["checkpoint_path"] = str(self.checkpoint_path)
        data["run"]["checkpoint_root"] = str(self.checkpoint_path.parent)
        data["training"]["mixed_precision"] = self.precision
        return data


class _KeyError(ValueError):
    """A contradiction found by a validator, attributed to one dotted key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key} {message}")
        self.key = key
        self.message = message


# Options that the schema accepts and validates but whose behaviour is not built yet. A run that
# asks for one of them stops before loading anything, rather than silently ignoring it.
# dotted key -> (does this value need the unbuilt code?, what the option reference says about it)
UNBUILT: dict[str, tuple[Any, str]] = {
}


def unbuilt_options(config: Config) -> list[str]:
    """Dotted keys whose configured value asks for behaviour that is not implemented yet."""
    found = []
    for key, (needs_unbuilt, _) in UNBUILT.items():
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part) if value is not None else None
        if needs_unbuilt(value):
            found.append(key)
    return found


# ------------------------------------------------------------------------------------- loading
def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a config file; every problem is a ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # "UTF-8 with BOM" (Notepad) is UTF-8 too
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found (pass --config PATH)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({not_utf8(exc)})") from None
    try:
        data = json.loads(text, object_pairs_hook=_json_object)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object")
    repeated = _repeated_key(data)
    if repeated is not None:
        raise ConfigError(f"{path}: {repeated} is given twice (JSON would keep only the last); merge them into one")
    for override in overrides or []:
        apply_override(data, override)
    return validate_config(data, source=str(path))


class _RepeatedKeys(dict):
    """A parsed JSON object that names `key` more than once: plain JSON keeps the last value and
    silently drops the rest, e.g. a whole `training` block written twice."""

    def __init__(self, pairs: list[tuple[str, Any]], key: str) -> None:
        super().__init__(pairs)
        self.key = key


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: a plain dict, or a `_RepeatedKeys` that `load_config` refuses."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return _RepeatedKeys(pairs, key)
        seen.add(key)
    return dict(pairs)


def _repeated_key(node: Any, where: str = "") -> str | None:
    """The dotted path of a key named twice in one object of the parsed config, or None."""
    if isinstance(node, _RepeatedKeys):
        return f"{where}.{node.key}" if where else node.key
    if isinstance(node, dict):
        children = ((f"{where}.{key}" if where else key, value) for key, value in node.items())
    elif isinstance(node, list):
        children = ((f"{where}[{index}]", value) for index, value in enumerate(node))
    else:
        return None
    return next((found for child, value in children if (found := _repeated_key(value, child)) is not None), None)


def not_utf8(exc: UnicodeDecodeError) -> str:
    """Where a file stops being UTF-8, for the one-line error that names it."""
    return f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `dotted.key=value` override in place; the value is JSON when it parses."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: expected dotted.key=value")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    parts = key.strip().split(".")
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"--set {key}: {where} is not a block of keys")
        node = child
    node[parts[-1]] = value


def validate_config(data: dict[str, Any], source: str = "config") -> Config:
    """Validate config data; errors name the dotted key, the value and what is allowed."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: {_describe(error)}" for error in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def _describe(error: Any) -> str:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc) or "(top level)"
    context = error.get("ctx") or {}
    cause = context.get("error")
    if isinstance(cause, _KeyError):
        return f"{cause.key} {cause.message}"
    if error["type"] == "extra_forbidden":
        return f"unknown key {key}{_did_you_mean(loc)}"
    if error["type"] == "missing":
        return f"{key} is required"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "literal_error" and isinstance(error.get("input"), str):
        match = closest(error["input"], re.findall(r"'([^']*)'", str(context.get("expected", ""))))
        message += f' (did you mean "{match}"?)' if match else ""
    return f"{key} = {json.dumps(error.get('input'), default=str)}: {message}"


def _did_you_mean(loc: list[str]) -> str:
    """Suggest the nearest valid key among the siblings of an unknown one."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model else None
        model = _model_of(field.annotation) if field else None
    if model is None:
        return ""
    match = closest(loc[-1], model.model_fields)
    return f"; did you mean {'.'.join([*loc[:-1], match])}?" if match else ""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The valid name nearest to a misspelt one, if any is near enough to suggest."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The config block class inside an annotation such as `LRSchedulerConfig | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found:
            return found
    return None
