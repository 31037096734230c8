"""Noise and targets equal their closed forms."""

from __future__ import annotations

import pytest
import torch

from sdxl_trainer.conditioning import add_time_ids
from sdxl_trainer.config import ConfigError, TrainingConfig
from sdxl_trainer.diffusion import make_noise_scheduler, sample_noise, training_noise_scheduler, training_target

SDXL_SCHEDULER = {
    "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
}


def test_v_prediction_target_is_alpha_noise_minus_sigma_latents() -> None:
    scheduler = make_noise_scheduler(SDXL_SCHEDULER, "v_prediction", zero_terminal_snr=False)
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([10, 900])
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1 - betas, 0)[timesteps].view(2, 1, 1, 1).float()
    expected = alphas_cumprod.sqrt() * noise - (1 - alphas_cumprod).sqrt() * latents
    torch.testing.assert_close(training_target(scheduler, latents, noise, timesteps), expected)
    epsilon = make_noise_scheduler(SDXL_SCHEDULER, None, zero_terminal_snr=False)
    assert training_target(epsilon, latents, noise, timesteps) is noise


def test_zero_terminal_snr_makes_the_last_timestep_pure_noise() -> None:
    plain = make_noise_scheduler(SDXL_SCHEDULER, "v_prediction", zero_terminal_snr=False)
    rescaled = make_noise_scheduler(SDXL_SCHEDULER, "v_prediction", zero_terminal_snr=True)
    assert plain.alphas_cumprod[-1] > 1e-3
    assert rescaled.alphas_cumprod[-1] == pytest.approx(0.0, abs=1e-8)


def test_a_zero_terminal_snr_base_keeps_its_schedule_unless_the_config_overrides_it() -> None:
    """The defaults (prediction_type and zero_terminal_snr null) train a ZTSNR v-prediction base on
    its own schedule; an explicit false still turns ZTSNR off."""
    base = {**SDXL_SCHEDULER, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True}
    inherited = training_noise_scheduler(base, TrainingConfig())
    assert inherited.config.prediction_type == "v_prediction" and inherited.config.rescale_betas_zero_snr
    assert inherited.alphas_cumprod[-1] == pytest.approx(0.0, abs=1e-8)
    overridden = training_noise_scheduler(base, TrainingConfig(zero_terminal_snr=False))
    assert not overridden.config.rescale_betas_zero_snr and overridden.alphas_cumprod[-1] > 1e-3


def test_debiased_estimation_is_refused_only_where_the_effective_schedule_makes_it_infinite() -> None:
    """zero_terminal_snr true with the prediction type inherited: fine on a v-prediction base (the
    config alone used to refuse it), a config error on an epsilon one."""
    training = TrainingConfig(debiased_estimation=True, zero_terminal_snr=True)
    v_base = {**SDXL_SCHEDULER, "prediction_type": "v_prediction"}
    assert training_noise_scheduler(v_base, training).config.rescale_betas_zero_snr
    with pytest.raises(ConfigError, match=r"training\.debiased_estimation weighs by 1/sqrt"):
        training_noise_scheduler(SDXL_SCHEDULER, training)
    with pytest.raises(ValueError, match="infinite at zero-terminal SNR"):
        TrainingConfig(debiased_estimation=True, zero_terminal_snr=True, prediction_type="epsilon")


def test_noise_offset_adds_one_value_per_image_and_channel() -> None:
    latents = torch.zeros(3, 4, 16, 16)
    torch.manual_seed(0)
    plain = sample_noise(latents.shape, 0.0)
    torch.manual_seed(0)
    offset = sample_noise(latents.shape, 0.5)
    difference = offset - plain
    # Constant over height and width, different across images/channels: 0.5 x one gaussian each.
    torch.testing.assert_close(difference, difference[:, :, :1, :1].expand_as(difference))
    assert difference[:, :, 0, 0].std() > 0.1


def test_add_time_ids_order_is_original_crop_target() -> None:
    ids = add_time_ids(torch.tensor([[200, 300]]), torch.tensor([[5, 7]]), torch.tensor([[64, 96]]))
    assert ids.tolist() == [[200.0, 300.0, 5.0, 7.0, 64.0, 96.0]]
