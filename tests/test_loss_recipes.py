"""The loss, timestep and noise recipes of `training.*`: their maths checked against closed forms,
their draws per image (so resume stays exact), and the combinations refused at config time."""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_sdxl
from sdxl_trainer.config import ConfigError, validate_config
from sdxl_trainer.diffusion import (
    Draws,
    DrawSettings,
    LossSettings,
    huber_c,
    loss_weights,
    make_noise_scheduler,
    multires_noise,
    noised_input_and_target,
    per_sample_loss,
    sample_draws,
    snr,
)
from tests.helpers import tiny_config, write_config
from tests.test_training_core import SDXL_SCHEDULER

SHAPE = (4, 8, 8)


def draws_for(count: int, **settings) -> Draws:
    return sample_draws([(index, 0) for index in range(count)], 7, (count, *SHAPE), DrawSettings(**settings))


def test_huber_is_half_the_squared_error_near_zero_and_linear_far_out() -> None:
    c = torch.full((1,), 0.5)
    small, large = torch.full((1, 1, 2, 2), 1e-3), torch.full((1, 1, 2, 2), 1e3)
    zero = torch.zeros(1, 1, 2, 2)
    assert per_sample_loss(small, zero, "huber", c).item() == pytest.approx(0.5 * 1e-6, rel=1e-4)
    assert per_sample_loss(small, zero, "l2").item() == pytest.approx(1e-6, rel=1e-4)
    slope = (per_sample_loss(2 * large, zero, "huber", c) - per_sample_loss(large, zero, "huber", c)) / 1e3
    assert slope.item() == pytest.approx(0.5, rel=1e-3)  # c·|r|: slope c
    assert per_sample_loss(small, zero, "smooth_l1", c).item() == pytest.approx(1e-6 / (2 * 0.5), rel=1e-4)
    slope = (per_sample_loss(2 * large, zero, "smooth_l1", c) - per_sample_loss(large, zero, "smooth_l1", c)) / 1e3
    assert slope.item() == pytest.approx(1.0, rel=1e-3)


def test_huber_thresholds_follow_kohyas_schedules() -> None:
    scheduler = make_noise_scheduler(SDXL_SCHEDULER, None, False)
    timesteps = torch.tensor([0, 500, 999])
    constant = huber_c(scheduler, timesteps, LossSettings(loss_type="huber", huber_c=0.2, huber_schedule="constant"))
    assert constant.tolist() == pytest.approx([0.2, 0.2, 0.2])
    exponential = huber_c(scheduler, timesteps, LossSettings(huber_c=0.2, huber_schedule="exponential"))
    assert exponential.tolist() == pytest.approx([0.2 ** (t / 1000) for t in (0, 500, 999)], rel=1e-5)
    sigmas = ((1 - scheduler.alphas_cumprod[timesteps]) / scheduler.alphas_cumprod[timesteps]).double().sqrt()
    expected = ((1 - 0.2) / (1 + sigmas) ** 2 + 0.2).tolist()
    assert huber_c(scheduler, timesteps, LossSettings(huber_c=0.2, huber_schedule="snr")).tolist() == \
        pytest.approx(expected, rel=1e-5)


def test_debiased_estimation_weights_and_their_product_with_min_snr() -> None:
    timesteps = torch.tensor([1, 300, 999])
    for prediction in ("epsilon", "v_prediction"):
        scheduler = make_noise_scheduler(SDXL_SCHEDULER, prediction, False)
        ratio = snr(scheduler, timesteps).double()
        debiased = 1 / (ratio.clamp(max=1000) + 1) if prediction == "v_prediction" else 1 / ratio.clamp(max=1000).sqrt()
        got = loss_weights(scheduler, timesteps, LossSettings(debiased_estimation=True)).double()
        torch.testing.assert_close(got, debiased, rtol=1e-5, atol=0)
        min_snr = loss_weights(scheduler, timesteps, LossSettings(snr_gamma=5.0)).double()
        both = loss_weights(scheduler, timesteps, LossSettings(snr_gamma=5.0, debiased_estimation=True)).double()
        torch.testing.assert_close(both, debiased * min_snr, rtol=1e-5, atol=0)


def test_the_plain_recipe_draws_what_it_always_drew() -> None:
    """Uniform timesteps, noise, offset and posterior noise, in that order from the image's own
    generator: the draws of every earlier run (and its checkpoints) are unchanged."""
    draws = draws_for(3, noise_offset=0.1)
    for row, index in enumerate(range(3)):
        digest = hashlib.sha256(f"7-{index}-0".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        assert draws.timesteps[row] == torch.randint(0, 1000, (1,), generator=generator)
        noise = torch.randn(SHAPE, generator=generator)
        noise = noise + 0.1 * torch.randn((4, 1, 1), generator=generator)
        assert torch.equal(draws.noise[row], noise)
        assert torch.equal(draws.posterior_noise[row], torch.randn(SHAPE, generator=generator))
    assert draws.input_noise is None


@pytest.mark.parametrize(("sampling", "extra", "median"), [
    ("logit_normal", {"logit_mean": 1.0, "logit_std": 0.5}, 200 + 600 / (1 + math.exp(-1.0))),
    ("sigmoid", {"sigmoid_scale": 2.0}, 200 + 600 * 0.5),
])
def test_logit_normal_timesteps_have_the_configured_median_and_stay_in_bounds(sampling, extra, median) -> None:
    timesteps = draws_for(2000, timestep_sampling=sampling, min_timestep=200, max_timestep=800, **extra).timesteps
    assert timesteps.min() >= 200 and timesteps.max() < 800
    assert timesteps.float().median().item() == pytest.approx(median, abs=12)
    uniform = draws_for(2000, min_timestep=200, max_timestep=800).timesteps
    assert uniform.min() >= 200 and uniform.max() < 800
    if sampling == "logit_normal":  # std 0.5: concentrated around the median, unlike uniform draws
        assert timesteps.float().std() < 0.7 * uniform.float().std()


def test_multires_noise_has_unit_variance_and_more_coarse_structure() -> None:
    white, multires = draws_for(16).noise, draws_for(16, multires_noise_iterations=6,
                                                       multires_noise_discount=0.5).noise
    assert [sample.std().item() for sample in multires] == pytest.approx([1.0] * 16, abs=1e-5)

    def neighbour_correlation(noise: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(noise[..., 1:].flatten(), noise[..., :-1].flatten(), dim=0).item()

    # kohya's octave 0 is a second white noise at weight 1, which dilutes the coarse octaves' share.
    assert neighbour_correlation(multires) > neighbour_correlation(white) + 0.05


def test_multires_noise_follows_kohyas_pyramid_noise_like() -> None:
    """kohya's loop runs i = 0 … iterations − 1, so octave 0 is a second full-size noise at weight
    discount^0 = 1 (transcribed here with the image's own generator and per-image std)."""
    noise = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(0))
    ours = multires_noise(noise, 2, 0.3, torch.Generator().manual_seed(1))
    generator, expected = torch.Generator().manual_seed(1), noise.clone()
    for i in range(2):
        r = 2 + 2 * torch.rand(1, generator=generator).item()
        coarse = torch.randn((1, 4, max(1, int(32 / r**i)), max(1, int(32 / r**i))), generator=generator)
        expected += torch.nn.functional.interpolate(coarse, size=(32, 32), mode="bilinear")[0] * 0.3**i
    torch.testing.assert_close(ours, expected / expected.std())


def test_input_perturbation_changes_the_noised_input_not_the_target() -> None:
    scheduler = make_noise_scheduler(SDXL_SCHEDULER, None, False)
    latents = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(1))
    plain, perturbed = draws_for(3), draws_for(3, ip_noise_gamma=0.1)
    assert torch.equal(plain.noise, perturbed.noise) and torch.equal(plain.timesteps, perturbed.timesteps)
    plain_input, plain_target = noised_input_and_target(scheduler, latents, plain, "cpu")
    input_, target = noised_input_and_target(scheduler, latents, perturbed, "cpu")
    assert torch.equal(target, plain_target) and not torch.equal(input_, plain_input)
    extra = (perturbed.input_noise - perturbed.noise) / 0.1
    assert extra.std().item() == pytest.approx(1.0, abs=0.1)


def test_recipes_that_cannot_work_are_refused(tmp_path: Path) -> None:
    for training, message in (
        ({"min_timestep": 500, "max_timestep": 400}, "min_timestep (500) must be below training.max_timestep"),
        ({"debiased_estimation": True, "zero_terminal_snr": True, "prediction_type": "epsilon"},
         "infinite at zero-terminal SNR"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_config(tiny_config(tmp_path, training=training))


@pytest.mark.slow
def test_every_recipe_at_once_trains_and_resumes_bit_exactly(tmp_path: Path, tiny_sdxl_dir: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    recipe = {"loss_type": "huber", "huber_schedule": "exponential", "debiased_estimation": True, "snr_gamma": 5.0,
              "timestep_sampling": "logit_normal", "min_timestep": 100, "noise_offset": 0.05,
              "noise_offset_random_strength": True, "multires_noise_iterations": 4, "ip_noise_gamma": 0.1}
    straight = write_config(tmp_path / "s.json", tiny_config(tmp_path / "straight", training={
        **recipe, "num_steps": 6, "checkpoint_every": 3}))
    assert train_sdxl.main(["--config", str(straight)]) == 0
    said = capsys.readouterr().out
    assert ("loss: huber (c 0.1, exponential schedule), weighted by min-SNR 5 and debiased estimation; timesteps "
            "logit-normal (mean 0, std 1) in [100, 1000); noise: offset 0.05 (random strength), multires 4 x 0.3, "
            "input perturbation 0.1") in said
    split = write_config(tmp_path / "p.json", tiny_config(tmp_path / "split", training={
        **recipe, "num_steps": 3, "checkpoint_every": 3}))
    assert train_sdxl.main(["--config", str(split)]) == 0
    output = tmp_path / "split" / "out" / "test_run"
    assert train_sdxl.main(["--config", str(split), "--set", "training.num_steps=6",
                            "--set", f"training.resume_from={output}"]) == 0
    expected = load_file(tmp_path / "straight" / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    got = load_file(output / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(expected[key], got[key]) for key in expected)
