"""The kdiffusion eval backend reproduces ComfyUI: every number of tests/reference/comfyui_samplers.json
(computed with ComfyUI's own code) to 1e-5, absolute or relative above 1; and on the tiny model it
renders valid, seed-determined images in training runs, v-prediction with zero-terminal SNR included."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import train_sdxl
from sdxl_trainer.config import ConfigError, EvalConfig, ModelConfig
from sdxl_trainer.eval.comfyui_sampling import (
    denoised_estimate,
    eval_backend,
    sample_rows,
    sampling_sigmas,
    scaled_input,
    starting_noise_scale,
)
from sdxl_trainer.eval.eval_prompts import EvalPrompt
from sdxl_trainer.eval.evaluation import prompt_batches, run_evaluation
from sdxl_trainer.eval.kdiffusion_samplers import DISCARD_PENULTIMATE_SIGMA, SAMPLERS, ancestral_step, sample
from sdxl_trainer.eval.samplers import check_eval_sampler
from sdxl_trainer.eval.sigma_schedules import SCHEDULE_NAMES, SigmaTable, make_sigmas
from sdxl_trainer.models import load_pipeline
from tests.helpers import ROOT

REFERENCE = json.loads((Path(__file__).parent / "reference" / "comfyui_samplers.json").read_text())
SDXL_SCHEDULE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                 "num_train_timesteps": 1000}


def assert_close(got: list[float], expected: list[float]) -> None:
    """1e-5 absolute, or relative for values above 1; NaN where ComfyUI gives NaN."""
    assert len(got) == len(expected)
    for value, reference in zip(got, expected, strict=True):
        if math.isnan(reference):
            assert math.isnan(value)
        else:
            assert abs(value - reference) <= 1e-5 * max(1.0, abs(reference)), (value, reference)


@pytest.mark.parametrize("key", list(REFERENCE["schedules"]))
def test_every_schedule_gives_comfyuis_sigmas(key: str) -> None:
    name, steps = key.split("/")
    assert_close(make_sigmas(name, SigmaTable.from_scheduler_config(SDXL_SCHEDULE), int(steps)).tolist(),
                 REFERENCE["schedules"][key])


def test_timestep_input_scaling_and_denoised_estimates_are_comfyuis() -> None:
    figures = REFERENCE["model_sampling"]
    table = SigmaTable.from_scheduler_config(SDXL_SCHEDULE)
    sigmas, x, output = torch.tensor(figures["sigmas_probe"]), torch.linspace(-2, 2, 7), torch.full((7,), 0.3)
    assert table.timestep(sigmas).tolist() == figures["timestep_of_sigma"]
    assert_close(scaled_input(x, sigmas).tolist(), figures["calculate_input(sigma, x) for x = linspace(-2,2,7)"])
    assert_close(denoised_estimate("epsilon", output, x, sigmas).tolist(),
                 figures["eps: calculate_denoised(sigma, model_output=0.3, x)"])
    assert_close(denoised_estimate("v_prediction", output, x, sigmas).tolist(),
                 figures["v: calculate_denoised(sigma, model_output=0.3, x)"])


@pytest.mark.parametrize("name", list(REFERENCE["samplers"]["runs"]))
def test_every_sampler_ends_where_comfyuis_does(name: str) -> None:
    """The setup of the reference: a closed-form denoiser of a Gaussian around `mu`, karras/10."""
    run = REFERENCE["samplers"]["runs"][name]
    shape = (1, 4, 8, 8)
    mu = torch.linspace(-1, 1, 256).view(shape)

    def denoise(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return mu + 0.25 / (0.25 + sigma**2) * (x - mu)

    table = SigmaTable.from_scheduler_config(SDXL_SCHEDULE)
    sigmas = make_sigmas("karras", table, 10)
    if name in DISCARD_PENULTIMATE_SIGMA:
        sigmas = torch.cat([sigmas[:-2], sigmas[-1:]])
    assert_close(sigmas.tolist(), run["sigmas"])
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(1234))
    result = sample(name, denoise, noise * sigmas[0], sigmas, seeds=[7])
    assert_close(result.flatten().tolist(), run["result"])
    assert result.sum().item() == pytest.approx(run["result_sum"], abs=1e-4)


def test_an_ancestral_step_adds_fresh_noise_not_the_starting_noise_again() -> None:
    """ComfyUI on the CPU draws the ancestral noise from seed + 1 (its fix for issue 9819). One
    euler_ancestral step with a denoiser that predicts 0 scales x to σ_down and adds σ_up times the
    sampler's noise, so that noise can be read back exactly: it is seed + 1's, not the starting
    noise of the seed (which would add the same noise twice, 1.4x too strong after the first step)."""
    table = SigmaTable.from_scheduler_config(SDXL_SCHEDULE)
    sigmas = make_sigmas("karras", table, 10)[:2]
    shape, seed = (1, 4, 8, 8), 5
    result = sample_rows("euler_ancestral", lambda x, sigma: torch.zeros_like(x), sigmas, table, shape, [seed])
    start = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x = start * starting_noise_scale(float(sigmas[0]), table)
    sigma_down, sigma_up = ancestral_step(sigmas[0], sigmas[1])
    added = (result - x * sigma_down / sigmas[0]) / sigma_up
    assert torch.allclose(added, torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)), atol=1e-4)
    assert abs(torch.corrcoef(torch.stack([added.flatten(), start.flatten()]))[0, 1]) < 0.2
    # The SDE samplers' Brownian tree keeps the seed: seed + 1 would give another image.
    sde = sample_rows("dpmpp_2m_sde", lambda x, sigma: torch.zeros_like(x), sigmas, table, shape, [seed])
    assert torch.equal(sde, sample("dpmpp_2m_sde", lambda x, sigma: torch.zeros_like(x), x, sigmas, [seed]))


def test_names_are_checked_with_a_did_you_mean_and_auto_picks_the_comfyui_path() -> None:
    assert set(SAMPLERS) == set(REFERENCE["samplers"]["runs"]) and len(SCHEDULE_NAMES) == 8
    with pytest.raises(ConfigError, match='"betta": not a schedule of eval.backend "kdiffusion" '
                                          r'\(did you mean "beta"\?\)'):
        check_eval_sampler(EvalConfig(backend="kdiffusion", scheduler="betta"))
    with pytest.raises(ConfigError, match=r'"ddim": not a sampler of eval\.backend "kdiffusion"'):
        check_eval_sampler(EvalConfig(backend="kdiffusion", sampler_name="ddim"))
    with pytest.raises(ConfigError, match=r'"kl_optimal" needs eval\.num_inference_steps >= 2'):
        check_eval_sampler(EvalConfig(scheduler="kl_optimal", num_inference_steps=1))
    assert eval_backend(EvalConfig(sampler_name="dpmpp_2m_sde_heun", scheduler="beta")) == "kdiffusion"
    assert eval_backend(EvalConfig(sampler_name="euler_a", scheduler="sgm_uniform")) == "kdiffusion"
    assert eval_backend(EvalConfig(sampler_name="unipc", scheduler="karras")) == "diffusers"
    assert eval_backend(EvalConfig(sampler_name="euler", scheduler="UniPCMultistepScheduler")) == "diffusers"
    assert eval_backend(EvalConfig(backend="diffusers", sampler_name="euler")) == "diffusers"


@pytest.mark.slow
def test_an_unknown_name_stops_the_run_before_any_model_loads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--config", str(ROOT / "configs" / "quickstart.json"), "--dry-run",
            "--set", f"run.output_root={tmp_path}", "--set", "eval.sampler_name=dpmpp_2m_sde_hen"]
    assert train_sdxl.main(argv) == 2
    assert 'did you mean "dpmpp_2m_sde_heun"' in capsys.readouterr().err
    assert train_sdxl.main([*argv[:-1], "eval.scheduler=karas"]) == 2
    assert 'did you mean "karras"' in capsys.readouterr().err


def test_ksampler_sigmas_and_starting_noise_are_comfyuis() -> None:
    """KSampler gives dpm_2 one step more and leaves out the second to last sigma; it scales the
    starting noise by √(1 + σ₀²) when it starts at σ_max."""
    table = SigmaTable.from_scheduler_config(SDXL_SCHEDULE)
    eleven = make_sigmas("karras", table, 11)
    assert torch.equal(sampling_sigmas("dpm_2", "karras", table, 10), torch.cat([eleven[:-2], eleven[-1:]]))
    assert torch.equal(sampling_sigmas("euler_a", "karras", table, 10), make_sigmas("karras", table, 10))
    assert starting_noise_scale(table.sigma_max, table) == pytest.approx(math.sqrt(1 + table.sigma_max**2))
    assert starting_noise_scale(8.0, table) == 8.0
    zero_snr = SigmaTable.from_scheduler_config({**SDXL_SCHEDULE, "rescale_betas_zero_snr": True})
    assert 4000 < zero_snr.sigma_max < 5000 and zero_snr.sigma_min == pytest.approx(table.sigma_min)


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def test_same_seed_same_image_other_sampler_other_image(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    pipe.set_progress_bar_config(disable=True)
    prompts = [EvalPrompt("a red circle", "", 5, 64, 64), EvalPrompt("a red circle", "", 5, 64, 64),
               EvalPrompt("a red circle", "", 6, 64, 64)]
    rendered = {}
    for sampler in ("euler", "dpmpp_2m", "dpmpp_2m_sde_heun"):
        config = EvalConfig(backend="kdiffusion", sampler_name=sampler, scheduler="beta", num_inference_steps=3)
        result = run_evaluation(pipe, config, prompts, tmp_path / sampler, tag="final", step=1)
        assert result.invalid == []
        rendered[sampler] = [pixels(path) for path in result.images]
    for images in rendered.values():
        assert np.array_equal(images[0], images[1]) and not np.array_equal(images[0], images[2])
    assert not np.array_equal(rendered["euler"][0], rendered["dpmpp_2m"][0])
    assert not np.array_equal(rendered["dpmpp_2m"][0], rendered["dpmpp_2m_sde_heun"][0])


def test_prompts_sampled_together_give_each_prompts_own_image(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    """`eval.batch_size`: each row its own prompt, seed and noise (an ancestral and an SDE sampler
    draw noise at every step); a row differs from the prompt rendered alone at most in rounding.
    Prompts of another size, or read past 77 tokens, start a batch of their own."""
    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    pipe.set_progress_bar_config(disable=True)
    prompts = [EvalPrompt(text, "", seed, 64, 64) for text, seed in (
        ("a red circle, blue background", 5), ("a green square, white background", 6),
        ("a white circle, green background", 7), ("a yellow triangle, black background", 8))]
    two = "a blue square and a red circle"  # where the two shapes go depends on the seed
    prompts += [EvalPrompt(two, "", 9, 96, 64), EvalPrompt(two, "", 10, 96, 64, max_tokens=150),
                EvalPrompt(two, "", 11, 96, 64)]
    assert [len(batch) for batch in prompt_batches(prompts, 3)] == [3, 1, 1, 1, 1]
    for sampler in ("euler", "euler_ancestral", "dpmpp_2m_sde"):
        rendered = {}
        for size in (1, 3):
            config = EvalConfig(backend="kdiffusion", sampler_name=sampler, num_inference_steps=4, cfg_scale=5.0,
                                batch_size=size)
            result = run_evaluation(pipe, config, prompts, tmp_path / f"{sampler}{size}", tag="final", step=1)
            rendered[size] = [pixels(path).astype(int) for path in result.images]
        differences = [np.abs(alone - together).max() for alone, together in zip(*rendered.values(), strict=True)]
        assert max(differences) <= 2, (sampler, differences)  # 8-bit rounding of last-bit differences
        assert np.abs(rendered[1][4] - rendered[1][6]).max() > 20  # one prompt, two seeds: two images


@pytest.mark.slow
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_a_quickstart_run_evaluates_with_the_comfyui_sampler(tiny_sdxl_dir: Path, tmp_path: Path,
                                                              prediction: str) -> None:
    """dpmpp_2m_sde_heun with the beta schedule; v-prediction with zero-terminal SNR (σ_max about
    4500 instead of infinity) renders too, which the old diffusers k-diffusion pipeline could not."""
    overrides = {"training.num_steps": 2, "run.output_root": str(tmp_path), "export.save_single_file": False,
                 "training.tensorboard.enabled": False, "data.latent_cache.cache_dir": str(tmp_path / "latents"),
                 "data.text_cache.cache_dir": str(tmp_path / "text"), "eval.live.enabled": False,
                 "eval.prompts_path": str(ROOT / "tests" / "eval_prompts.three.json"),
                 "eval.backend": "kdiffusion", "eval.sampler_name": "dpmpp_2m_sde_heun", "eval.scheduler": "beta",
                 "training.prediction_type": prediction, "training.zero_terminal_snr": prediction == "v_prediction"}
    argv = ["--config", str(ROOT / "configs" / "quickstart.json")]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={json.dumps(value)}"]
    assert train_sdxl.main(argv) == 0
    final = tmp_path / "quickstart" / "eval" / "final"
    images = sorted(final.glob("0*.png"))
    assert len(images) == 3 and not list(final.glob("*_INVALID.png"))
    assert all(pixels(path).std() > 0 for path in images)
    summary = json.loads((tmp_path / "quickstart" / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["invalid_eval_images"] == []
