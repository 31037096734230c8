"""The training core: precision policy and audit, loss weighting, LR schedules, EMA, optimizers,
stochastic rounding and the NaN policy, each against values that would differ if it were wrong."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dataset
from sdxl_trainer.adapters import weight_file_name
from sdxl_trainer.bf16_adamw import StochasticRoundingAdamW
from sdxl_trainer.conditioning import encode_prompts
from sdxl_trainer.config import LRSchedulerConfig, validate_config
from sdxl_trainer.diffusion import (
    Draws,
    LossModels,
    LossSettings,
    diffusion_loss,
    loss_weights,
    make_noise_scheduler,
    snr,
)
from sdxl_trainer.ema import EMA, ema_warning
from sdxl_trainer.lr_schedule import lr_factor
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.optimizers import make_optimizer
from sdxl_trainer.precision import (
    PrecisionAuditError,
    audit,
    cast_trained_parameters,
    place_pipeline,
    plan_precision,
)
from sdxl_trainer.training_setup import prepare_trainable
from tests.helpers import tiny_config, train_here, write_config

SDXL_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                  "beta_schedule": "scaled_linear", "prediction_type": "epsilon"}


def config_for(tmp_path: Path, **sections):
    return validate_config(tiny_config(tmp_path, **sections))


# ----------------------------------------------------------------------------- precision
def table(plan) -> dict[str, tuple[str, str | None]]:
    return {name: (c.storage, c.trained) for name, c in plan.components.items()}


def test_precision_plans_for_each_mode_and_device(tmp_path: Path) -> None:
    fp32 = plan_precision(config_for(tmp_path), "cpu")
    assert fp32.compute == "fp32" and not fp32.uses_grad_scaler
    assert table(fp32) == {"unet": ("fp32", "fp32"), "text_encoder": ("fp32", "fp32"),
                           "text_encoder_2": ("fp32", None), "vae": ("fp32", None)}

    bf16 = plan_precision(config_for(tmp_path, training={"mixed_precision": "bf16"}), "cuda", bf16_ok=True)
    assert bf16.compute == "bf16" and not bf16.uses_grad_scaler
    assert table(bf16) == {"unet": ("bf16", "fp32"), "text_encoder": ("bf16", "fp32"),
                           "text_encoder_2": ("bf16", None), "vae": ("fp32", None)}
    legacy = plan_precision(config_for(tmp_path, model={"use_bf16": True}), "cuda", bf16_ok=True)
    assert legacy == bf16

    old_gpu = plan_precision(config_for(tmp_path, training={"mixed_precision": "bf16"}), "cuda", bf16_ok=False)
    assert old_gpu.compute == "fp32" and "not supported" in old_gpu.warnings[0]

    fp16 = plan_precision(config_for(tmp_path, training={"mixed_precision": "fp16"}), "cuda")
    assert fp16.compute == "fp16" and fp16.uses_grad_scaler
    assert fp16.components["vae"].storage == "fp32"  # never an fp16 VAE unless marked safe
    assert any("DoRA" in warning for warning in fp16.warnings)
    safe_vae = plan_precision(config_for(tmp_path, training={"mixed_precision": "fp16"},
                                         model={"vae_fp16_safe": True}), "cuda")
    assert safe_vae.components["vae"].storage == "fp16"

    mps = plan_precision(config_for(tmp_path, training={"mixed_precision": "fp16"}), "mps")
    assert mps.compute == "fp32" and not mps.uses_grad_scaler and "MPS" in mps.warnings[0]

    full_bf16 = plan_precision(config_for(tmp_path, adapter={"type": "none"}, model={"weights_dtype": "bf16"},
                                          training={"mixed_precision": "bf16"}), "cuda", bf16_ok=True)
    assert table(full_bf16)["unet"] == ("bf16", "bf16") and table(full_bf16)["text_encoder_2"] == ("bf16", None)
    assert "vae              fp32" in full_bf16.table()


def test_audit_catches_a_layer_created_after_the_cast(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    config = config_for(tmp_path, training={"mixed_precision": "bf16"})
    plan = plan_precision(config, "cpu")
    pipe = load_pipeline(config.model)
    place_pipeline(pipe, plan, "cpu")
    trainable = prepare_trainable(pipe, config)  # DoRA adapters, created in fp32 after the cast
    cast_trained_parameters(trainable.modules, plan)
    audit(pipe, plan, adapter=True)  # as planned: passes
    assert pipe.unet.down_blocks[1].attentions[0].proj_in.lora_A["default"].weight.dtype == torch.float32
    old = pipe.unet.conv_in  # the original tool's bug: a new layer after .half() stays fp32
    pipe.unet.conv_in = torch.nn.Conv2d(old.in_channels, old.out_channels, 3, padding=1)
    with pytest.raises(PrecisionAuditError, match=r"unet\.conv_in\.weight is float32, planned bfloat16"):
        audit(pipe, plan, adapter=True)


# -------------------------------------------------------------------------- loss weighting
def test_min_snr_weights_equal_their_closed_form() -> None:
    timesteps = torch.tensor([5, 250, 600, 999])
    epsilon = make_noise_scheduler(SDXL_SCHEDULER, None, False)
    alphas = epsilon.alphas_cumprod[timesteps].double()
    expected_snr = alphas / (1 - alphas)
    torch.testing.assert_close(snr(epsilon, timesteps).double(), expected_snr, rtol=1e-6, atol=0)
    gamma = 5.0
    torch.testing.assert_close(loss_weights(epsilon, timesteps, LossSettings(gamma)).double(),
                               expected_snr.clamp(max=gamma) / expected_snr, rtol=1e-6, atol=0)
    v_pred = make_noise_scheduler(SDXL_SCHEDULER, "v_prediction", False)
    torch.testing.assert_close(loss_weights(v_pred, timesteps, LossSettings(gamma)).double(),
                               expected_snr.clamp(max=gamma) / (expected_snr + 1), rtol=1e-6, atol=0)
    # min_sigma caps SNR at 1/min_sigma² in the weighting: only the low-noise (high SNR) step changes.
    capped = expected_snr.clamp(max=1 / 0.4**2)
    torch.testing.assert_close(loss_weights(epsilon, timesteps, LossSettings(gamma, 0.4)).double(),
                               capped.clamp(max=gamma) / capped, rtol=1e-6, atol=0)
    assert loss_weights(epsilon, timesteps, LossSettings()) is None
    assert torch.isfinite(loss_weights(make_noise_scheduler(SDXL_SCHEDULER, "v_prediction", True),
                                       timesteps, LossSettings(gamma))).all()
    # Zero-terminal SNR's last step has SNR 0: epsilon's min(SNR, γ)/SNR tends to 1 there (not 0).
    last = torch.tensor([999])
    assert loss_weights(make_noise_scheduler(SDXL_SCHEDULER, "epsilon", True), last, LossSettings(gamma)).item() == 1.0
    assert loss_weights(make_noise_scheduler(SDXL_SCHEDULER, "v_prediction", True), last,
                        LossSettings(gamma)).item() == 0.0  # min(0, γ)/(0 + 1)


def test_min_sigma_needs_snr_gamma(tmp_path: Path) -> None:
    from sdxl_trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"training.min_sigma only changes the min-SNR"):
        config_for(tmp_path, training={"min_sigma": 0.4})


# ----------------------------------------------------------------------------- LR schedule
def test_lr_factors_equal_their_closed_form() -> None:
    total = 1100
    constant = LRSchedulerConfig(type="constant", warmup_steps=100)
    assert [lr_factor(s, constant, total) for s in (0, 50, 100, 900)] == [0.0, 0.5, 1.0, 1.0]
    linear = LRSchedulerConfig(type="linear_decay", warmup_steps=100, min_factor=0.2)
    assert lr_factor(600, linear, total) == pytest.approx(1 - 0.8 * 0.5)
    assert lr_factor(1100, linear, total) == pytest.approx(0.2)
    cosine = LRSchedulerConfig(type="cosine_decay", warmup_steps=100, min_factor=0.1)
    assert lr_factor(350, cosine, total) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_factor(1100, cosine, total) == pytest.approx(0.1)
    restarts = LRSchedulerConfig(type="cosine_restarts", warmup_steps=100, min_factor=0.3, cycle_steps=200,
                                 cycle_mult=2.0)
    # Cycles after warmup: [100, 300) of 200 steps, [300, 700) of 400, [700, 1500) of 800.
    expected = {100: 1.0, 200: 0.3 + 0.7 * 0.5, 299: 0.3 + 0.7 * 0.5 * (1 + math.cos(math.pi * 199 / 200)),
                300: 1.0, 500: 0.3 + 0.7 * 0.5, 700: 1.0, 900: 0.3 + 0.7 * 0.5 * (1 + math.cos(math.pi / 4))}
    for step, factor in expected.items():
        assert lr_factor(step, restarts, total) == pytest.approx(factor), step


@pytest.mark.slow
def test_the_configured_schedule_drives_every_param_group(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tiny_config(tmp_path, training={"num_steps": 6, "log_every": 1, "lr_unet": 1e-3,
                                             "lr_text_encoder_1": 5e-4,
                                             "lr_scheduler": {"type": "linear_decay", "warmup_steps": 2}})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-2000:]
    events = EventAccumulator(str(tmp_path / "tb" / "test_run"))
    events.Reload()
    # LambdaLR has already moved to the next step's factor when the step is logged.
    expected = [lr_factor(step, LRSchedulerConfig(type="linear_decay", warmup_steps=2), 6) for step in range(1, 7)]
    assert [e.value for e in events.Scalars("lr/unet")] == pytest.approx([1e-3 * f for f in expected])
    assert [e.value for e in events.Scalars("lr/text_encoder")] == pytest.approx([5e-4 * f for f in expected])


# -------------------------------------------------------------------------------------- EMA
def test_ema_equals_the_closed_form_average_of_recorded_weights() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([("w", param)], decay=0.9, device="cpu")
    recorded = [param.detach().double().clone()]
    for step in range(1, 6):
        with torch.no_grad():
            param.copy_(torch.tensor([step, -2.0 * step, 0.5]))
        recorded.append(param.detach().double().clone())
        ema.update()
    expected = recorded[0]
    for weights in recorded[1:]:
        expected = 0.9 * expected + 0.1 * weights
    torch.testing.assert_close(ema.shadow[0].double(), expected, rtol=1e-6, atol=1e-6)
    with ema.swapped_in():
        torch.testing.assert_close(param.detach().double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(param.detach(), torch.tensor([5.0, -10.0, 0.5]))


@pytest.mark.slow
def test_ema_run_saves_the_averaged_weights(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    plain = tiny_config(tmp_path / "plain", training={"num_steps": 4})
    averaged = tiny_config(tmp_path / "ema", training={"num_steps": 4, "ema_update_every": 1},
                           model={"use_ema": True, "ema_decay": 0.5})
    for config, folder in ((plain, tmp_path / "plain"), (averaged, tmp_path / "ema")):
        result = train_here("--config", str(write_config(folder / "c.json", config)))
        assert result.returncode == 0, result.stderr[-2000:]
    first = load_file(tmp_path / "plain" / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    second = load_file(tmp_path / "ema" / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    changed = [key for key in first if not torch.equal(first[key], second[key])]
    assert changed and all("lora" in key for key in changed)



def test_the_pre_flight_warns_where_the_ema_would_not_average_the_training(tmp_path: Path,
                                                                        tiny_sdxl_dir: Path) -> None:
    """The default decay (0.9999, every 10 steps) leaves the final EMA 99.8 % the weights of step 10
    after 200 steps; a run shorter than the first update forms no EMA; a fast one averages it."""
    cases = (({"num_steps": 200}, {}, "still 99.8% the weights of step 10 (19 updates"),
             ({"num_steps": 4}, {}, "forms at step 10"),
             ({"num_steps": 200, "ema_update_every": 1}, {"ema_decay": 0.9}, None))
    for training, model, said in cases:
        config = validate_config(tiny_config(tmp_path, training=training, model={"use_ema": True, **model}))
        warning = ema_warning(config, config.training.num_steps)
        assert (said in warning) if said else warning == "", warning
    config = tiny_config(tmp_path, training={"num_steps": 200, "memory_check": "off"}, model={"use_ema": True})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)), "--dry-run")
    assert result.returncode == 0 and "warning: model.use_ema: the final EMA is still 99.8%" in result.stdout


# ----------------------------------------------------------------------------- optimizers
def fixed_batch_loss_drop(tmp_path: Path, optimizer_type: str, gradient_checkpointing: bool = False,
                          steps: int = 20) -> tuple[float, float]:
    config = config_for(tmp_path, optimizer={"type": optimizer_type},
                        model={"use_gradient_checkpointing": gradient_checkpointing},
                        training={"lr_unet": 1e-2, "lr_text_encoder_1": 1e-2})
    plan = dataset.plan_dataset(config.data, 2)
    items = dataset.ImageCaptionDataset(plan.samples, config.data, seed=0)
    batch = dataset.collate([items[(index, 0)] for index, t in enumerate(plan.targets) if t == (64, 64)][:2])
    pipe = load_pipeline(config.model)
    scheduler = make_noise_scheduler(pipe.scheduler.config, None, False)
    trainable = prepare_trainable(pipe, config)
    optimizer = make_optimizer(config.optimizer, trainable.param_groups())
    noise = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(0))

    posterior_noise = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(5))
    draws = Draws(noise, torch.tensor([250, 650]), posterior_noise)

    def loss() -> torch.Tensor:
        return diffusion_loss(LossModels.of(pipe), scheduler, batch, draws, "cpu")

    before = loss()
    for _ in range(steps):
        loss().backward()
        optimizer.step()
        optimizer.zero_grad()
    return before.item(), loss().item()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_type", ["adamw8bit", "adamw", "adafactor"])
def test_each_optimizer_reduces_the_loss(tmp_path: Path, tiny_sdxl_dir: Path, optimizer_type: str) -> None:
    before, after = fixed_batch_loss_drop(tmp_path, optimizer_type)
    assert after < 0.9 * before, (optimizer_type, before, after)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    grads = []
    for checkpointing in (False, True):
        config = config_for(tmp_path, model={"use_gradient_checkpointing": checkpointing}, adapter={"type": "none"})
        plan = dataset.plan_dataset(config.data, 2)
        items = dataset.ImageCaptionDataset(plan.samples, config.data, seed=0)
        batch = dataset.collate([items[(0, 0)]])
        pipe = load_pipeline(config.model)
        scheduler = make_noise_scheduler(pipe.scheduler.config, None, False)
        trainable = prepare_trainable(pipe, config)
        assert pipe.unet.is_gradient_checkpointing == checkpointing
        height, width = batch["target_sizes"][0].tolist()
        noise = torch.randn((1, 4, height // 8, width // 8), generator=torch.Generator().manual_seed(0))
        posterior_noise = torch.randn(noise.shape, generator=torch.Generator().manual_seed(1))
        draws = Draws(noise, torch.tensor([400]), posterior_noise)
        diffusion_loss(LossModels.of(pipe), scheduler, batch, draws, "cpu").backward()
        # (CLIP-L's last layer gets no gradient: SDXL reads the penultimate hidden state.)
        grads.append({name: p.grad.clone() for name, p in trainable.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 500
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)


def test_stochastic_rounding_keeps_updates_below_bf16_resolution() -> None:
    # bf16 spacing at 1.0 is 2^-7 ≈ 0.0078: an update of 1e-4 is lost to round-to-nearest.
    assert torch.tensor(1.0 - 1e-4).to(torch.bfloat16).item() == 1.0
    nearest = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    stochastic = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    plain_adamw = torch.optim.AdamW([nearest], lr=1e-4, weight_decay=0.0)
    rounding_adamw = StochasticRoundingAdamW([stochastic], lr=1e-4, weight_decay=0.0)
    torch.manual_seed(0)
    for _ in range(200):
        for param, optimizer in ((nearest, plain_adamw), (stochastic, rounding_adamw)):
            param.grad = torch.ones_like(param)  # Adam moves each weight by ~lr per step
            optimizer.step()
    assert torch.equal(nearest.float(), torch.ones(4096))  # round-to-nearest lost every update
    assert stochastic.float().mean().item() == pytest.approx(1.0 - 200 * 1e-4, abs=2e-3)
    assert stochastic.dtype == torch.bfloat16


def test_caption_dropout_feeds_the_zero_unconditional_embedding(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    pipe = load_pipeline(config_for(tmp_path).model)
    embeds, pooled = encode_prompts(["tok, a red circle", ""], [pipe.tokenizer, pipe.tokenizer_2],
                                    [pipe.text_encoder, pipe.text_encoder_2], "cpu", zero_empty=True)
    assert embeds[0].abs().sum() > 0 and pooled[0].abs().sum() > 0
    assert torch.equal(embeds[1], torch.zeros_like(embeds[1])) and torch.equal(pooled[1], torch.zeros_like(pooled[1]))
    assert pipe.config.force_zeros_for_empty_prompt


# ----------------------------------------------------------------------------- precisions
# The factor each kind initialises to zero (so that a new adapter changes nothing): training moves it.
ZERO_INITIALISED = {"dora": {"lora_B"}, "lora": {"lora_B"}, "lokr": {"lokr_w1", "lokr_w1_a"}, "loha": {"hada_w2_b"}}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
@pytest.mark.parametrize("kind", ["dora", "lora", "lokr", "loha"])
def test_every_adapter_kind_trains_and_exports_in_every_precision(tmp_path: Path, tiny_sdxl_dir: Path, capsys,
                                                                  kind: str, precision: str) -> None:
    """Each kind on attention, MLP and convolutions: the audit finds every adapter tensor as an
    adapter tensor (LoKr's `lokr_*` and LoHa's `hada_*` stopped bf16/fp16 runs when the audit
    went by a `lora_` prefix), three steps move the zero-initialised factor, and the adapter files
    and the merged single file are written with finite weights."""
    config = tiny_config(tmp_path, adapter={"type": kind, "rank": 4, "alpha": 4, "targets": "all", "conv_rank": 2},
                         training={"num_steps": 3, "mixed_precision": precision},
                         export={"save_single_file": True, "merge_adapter": True,
                                 "adapter_formats": ["diffusers", "kohya"]})
    assert run_in_process(tmp_path, config) == 0
    out = capsys.readouterr().out
    assert f"precision: compute {'fp32' if precision == 'no' else precision} on cpu" in out
    output = tmp_path / "out" / "test_run"
    weights = load_file(output / weight_file_name(kind))
    # every tensor of the adapter file, and nothing else, was audited as a trained (fp32) tensor
    assert f" {len(weights)} of them trained" in out
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    zeroed = [tensor for key, tensor in weights.items() if ZERO_INITIALISED[kind] & set(key.split("."))]
    assert any(tensor.abs().sum() > 0 for tensor in zeroed)
    kohya = load_file(output / "test_run_kohya.safetensors")
    assert sum(key.endswith(".alpha") for key in kohya) == len(zeroed) > 50  # one module per adapted layer
    assert all_saved_tensors_finite(output)
    merged = load_file(output.parent / "safetensors" / "test_run.safetensors")
    assert merged and all(torch.isfinite(tensor).all() for tensor in merged.values())


@pytest.mark.slow
def test_full_bf16_weights_train_with_stochastic_rounding(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    config = tiny_config(tmp_path, adapter={"type": "none"}, model={"weights_dtype": "bf16"},
                         training={"num_steps": 2, "mixed_precision": "bf16", "lr_unet": 1e-4})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "  unet             bf16      bf16     bf16" in result.stdout


# ------------------------------------------------------------------------------- NaN policy
def poisoned(monkeypatch: pytest.MonkeyPatch, poison: str) -> None:
    """Make every sample whose file name contains `poison` deliver NaN latents."""
    original = dataset.ImageCaptionDataset.__getitem__

    def getitem(self, key):
        sample = original(self, key)
        if poison in sample["path"]:
            sample["latents"] = torch.full_like(sample["latents"], float("nan"))
        return sample

    monkeypatch.setattr(dataset.ImageCaptionDataset, "__getitem__", getitem)


def run_in_process(tmp_path: Path, config: dict) -> int:
    import train_sdxl

    return train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))])


def all_saved_tensors_finite(folder: Path) -> bool:
    files = list(folder.rglob("*.safetensors"))
    return all(torch.isfinite(t).all() for f in files for t in load_file(f).values())


@pytest.mark.slow
def test_nan_abort_reports_the_batch_and_saves_nothing_non_finite(tmp_path: Path, tiny_sdxl_dir: Path,
                                                                  monkeypatch, capsys) -> None:
    poisoned(monkeypatch, "shape_03")
    config = tiny_config(tmp_path, training={"num_steps": 30, "checkpoint_every": 2})
    assert run_in_process(tmp_path, config) == 1
    err = capsys.readouterr().err
    assert "became NaN/Inf" in err and "shape_03.png" in err and "timesteps: [" in err
    output = tmp_path / "out" / "test_run"
    assert not (output / "pytorch_lora_weights.safetensors").exists()
    assert all_saved_tensors_finite(output)
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["status"] == "aborted: non-finite loss or gradients"
    assert any("shape_03.png" in path for path in summary["nan_events"][0]["files"])


@pytest.mark.slow
def test_nan_skip_continues_and_too_many_skips_abort(tmp_path: Path, tiny_sdxl_dir: Path, monkeypatch,
                                                     capsys) -> None:
    poisoned(monkeypatch, "shape_03")
    config = tiny_config(tmp_path, training={"num_steps": 12, "nan_policy": "skip", "max_nan_skips": 2})
    assert run_in_process(tmp_path, config) == 0
    summary = json.loads((tmp_path / "out" / "test_run" / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 12 and len(summary["nan_events"]) >= 1
    assert "step skipped" in capsys.readouterr().err

    poisoned(monkeypatch, "shape_")  # every batch is broken now
    again = tiny_config(tmp_path / "again", training={"num_steps": 12, "nan_policy": "skip", "max_nan_skips": 2})
    assert run_in_process(tmp_path / "again", again) == 1
    summary = json.loads((tmp_path / "again" / "out" / "test_run" / "run_summary.json").read_text())
    assert len(summary["nan_events"]) == 3  # two skipped, the third aborts
    assert summary["status"] == "aborted: non-finite loss or gradients"


@pytest.mark.slow
def test_nan_in_an_early_micro_batch_aborts_under_fp16_accumulation(tmp_path: Path, tiny_sdxl_dir: Path,
                                                                     monkeypatch, capsys) -> None:
    """shape_03 is the first of step 6's two micro-batches: its NaN loss must reach the guard, not
    pass as a grad-scaler overflow because the step's last micro-batch was finite."""
    poisoned(monkeypatch, "shape_03")
    config = tiny_config(tmp_path, training={"num_steps": 6, "mixed_precision": "fp16", "grad_accum_steps": 2},
                         data={"bucket": {"resolutions": [[64, 64]], "divisible_by": 32, "batch_size": 1}})
    assert run_in_process(tmp_path, config) == 1
    assert "became NaN/Inf at step 6" in capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "test_run" / "run_summary.json").read_text())
    assert summary["status"] == "aborted: non-finite loss or gradients"
    assert any("shape_03.png" in path for path in summary["nan_events"][0]["files"])


@pytest.mark.slow
def test_logged_losses_average_every_micro_batch_and_leave_a_skipped_nan_out(tmp_path: Path, tiny_sdxl_dir: Path,
                                                                            monkeypatch) -> None:
    """train/loss of a step is the mean of its micro-batches' losses (not the last one's); a skipped
    step's NaN does not make the epoch's loss statistics NaN."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import sdxl_trainer.run as run_module

    poisoned(monkeypatch, "shape_03")
    losses: list[float] = []
    forward_backward = run_module.forward_backward

    def recorded(run, batch):
        loss = forward_backward(run, batch)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(run_module, "forward_backward", recorded)
    config = tiny_config(tmp_path, training={"num_steps": 9, "grad_accum_steps": 2, "nan_policy": "skip",
                                             "log_every": 1},
                         data={"bucket": {"resolutions": [[64, 64]], "divisible_by": 32, "batch_size": 1}})
    assert run_in_process(tmp_path, config) == 0
    steps = [pair for pair in zip(losses[::2], losses[1::2], strict=True) if all(map(math.isfinite, pair))]
    events = EventAccumulator(str(tmp_path / "tb" / "test_run"))
    events.Reload()
    logged = [event.value for event in events.Scalars("train/loss")]
    assert logged == pytest.approx([sum(pair) / 2 for pair in steps[:len(logged)]], rel=1e-5) and len(logged) == 9
    epoch = {name: events.Scalars(f"epoch/loss_{name}")[0].value for name in ("min", "mean", "max")}
    assert all(map(math.isfinite, epoch.values())) and epoch["min"] < epoch["mean"] < epoch["max"]


@pytest.mark.slow
def test_fp16_dora_with_a_huge_learning_rate_aborts_cleanly(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    config = tiny_config(tmp_path, training={"num_steps": 40, "mixed_precision": "fp16", "lr_unet": 1e4,
                                             "lr_text_encoder_1": 1e4, "checkpoint_every": 1})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 1, result.stdout[-2000:]
    assert "NaN/Inf" in result.stderr
    output = tmp_path / "out" / "test_run"
    assert all_saved_tensors_finite(output)
    assert not (output / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.slow
def test_attention_backend_is_chosen_and_a_missing_package_is_a_config_error(tmp_path: Path,
                                                                             tiny_sdxl_dir: Path) -> None:
    config = tiny_config(tmp_path, model={"attention": "flash"})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 2 and "flash_attn" in result.stderr and "pip install" in result.stderr
    # DoRA on the attention layers only: compiled all the same, in half the tracing time of attn-mlp.
    config = tiny_config(tmp_path, training={"num_steps": 1}, adapter={"type": "dora", "rank": 4, "alpha": 4,
                                                                       "targets": "attn"},
                         model={"use_torch_compile": True, "torch_compile_kwargs": {"backend": "eager"}})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "attention: sdpa" in result.stdout


def test_target_patterns_that_select_no_unet_module_are_a_config_error(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """A list in `adapter.targets` must match whole module names: `to_q` selects nothing, which the
    dry run's pre-flight says in one line (exit code 2); `.*to_q` selects the queries."""
    for targets, code in ((["to_q"], 2), ([".*to_q"], 0)):
        config = tiny_config(tmp_path, adapter={"type": "lora", "rank": 4, "alpha": 4, "targets": targets},
                             training={"memory_check": "off"})
        result = train_here("--config", str(write_config(tmp_path / "c.json", config)), "--dry-run")
        assert result.returncode == code, result.stderr[-2000:]
        assert ('adapter.targets: ["to_q"] selects no module of the unet' in result.stderr) == (code == 2)
