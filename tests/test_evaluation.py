"""Evaluation on the tiny model: samplers map onto the intended diffusers schedulers, NaN images are
caught and flagged, prompts keep their seeds and sizes, outputs and TensorBoard hold what they
promise, and the training state (flags, weights, dtypes, RNG streams) is exactly as before."""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.utils import is_scipy_available
from PIL import Image

from sdxl_trainer.config import SAMPLER_NAMES, ConfigError, EvalConfig, ModelConfig, validate_config
from sdxl_trainer.eval.eval_prompts import EvalPrompt, load_prompts
from sdxl_trainer.eval.evaluation import run_evaluation
from sdxl_trainer.eval.image_checks import check_image
from sdxl_trainer.eval.samplers import SAMPLERS, check_sampler, make_eval_scheduler
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.training_setup import prepare_trainable
from tests.helpers import ROOT, tiny_config

# What each sampler must be, written out independently of the table in samplers.py: the class,
# then the settings that make it that sampler as "key=value" pairs.
EXPECTED_TABLE = """
euler              EulerDiscreteScheduler
euler_a            EulerAncestralDiscreteScheduler
euler_ancestral    EulerAncestralDiscreteScheduler
heun               HeunDiscreteScheduler
lms                LMSDiscreteScheduler
dpm_2              KDPM2DiscreteScheduler
dpm_2_a            KDPM2AncestralDiscreteScheduler
dpm_2_ancestral    KDPM2AncestralDiscreteScheduler
dpmpp_2m           DPMSolverMultistepScheduler     algorithm_type=dpmsolver++ solver_type=midpoint
dpmpp_2m_sde       DPMSolverMultistepScheduler     algorithm_type=sde-dpmsolver++ solver_type=midpoint
dpmpp_2m_sde_heun  DPMSolverMultistepScheduler     algorithm_type=sde-dpmsolver++ solver_type=heun
dpmpp_sde          DPMSolverSinglestepScheduler    algorithm_type=sde-dpmsolver++
ddim               DDIMScheduler                   clip_sample=False
ddpm               DDPMScheduler                   clip_sample=False
unipc              UniPCMultistepScheduler         solver_type=bh2
deis               DEISMultistepScheduler          algorithm_type=deis solver_type=logrho
pndm               PNDMScheduler                   skip_prk_steps=True
"""
EXPECTED_SCHEDULERS = {
    name: (class_name, dict(pair.split("=") for pair in settings))
    for name, class_name, *settings in (line.split() for line in EXPECTED_TABLE.strip().splitlines())
}
# Samplers whose diffusers scheduler has no karras/exponential/beta sigmas (read in diffusers 0.42).
ONLY_NORMAL_SIGMAS = {"euler_a", "euler_ancestral", "ddim", "ddpm", "pndm"}
COMFYUI_ONLY = {"dpmpp_2s_ancestral", "dpmpp_3m_sde"}  # no diffusers scheduler: the kdiffusion backend only
DIFFUSERS_SAMPLERS = [name for name in SAMPLER_NAMES if name not in COMFYUI_ONLY]
NEEDS_SCIPY = {"lms"}  # diffusers only provides LMSDiscreteScheduler with scipy installed
SIGMA_FLAGS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


def eval_config(**values) -> EvalConfig:
    """Fast settings for the tiny model: 2 steps at 64x64, on the diffusers backend (the kdiffusion
    one is tested in test_kdiffusion.py)."""
    return EvalConfig(**{"num_inference_steps": 2, "width": 64, "height": 64, "backend": "diffusers", **values})


def prompt(text: str = "a red circle", seed: int = 1, width: int = 64, height: int = 64) -> EvalPrompt:
    return EvalPrompt(text, "", seed, width, height)


def fresh_pipeline():
    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def pipe(tiny_sdxl_dir: Path):
    """A pipeline of its own for tests that change it (weights, adapters, modes)."""
    return fresh_pipeline()


@pytest.fixture(scope="module")
def shared_pipe(tiny_sdxl_dir: Path):
    """One pipeline for the tests that only render."""
    return fresh_pipeline()


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def can_build(sampler_name: str) -> bool:
    return sampler_name not in NEEDS_SCIPY or is_scipy_available()


# ------------------------------------------------------------------------------------ samplers
def test_every_schema_sampler_name_is_mapped() -> None:
    assert set(SAMPLERS) == set(DIFFUSERS_SAMPLERS) == set(EXPECTED_SCHEDULERS)
    for name in COMFYUI_ONLY:
        with pytest.raises(ConfigError, match=f'"{name}" has no diffusers scheduler: use it with eval.backend'):
            check_sampler(name, "normal")


@pytest.mark.parametrize("sampler_name", DIFFUSERS_SAMPLERS)
def test_sampler_builds_the_intended_scheduler(shared_pipe, sampler_name: str) -> None:
    if not can_build(sampler_name):
        with pytest.raises(ConfigError, match="pip install scipy"):
            check_sampler(sampler_name, "normal")
        return
    class_name, settings = EXPECTED_SCHEDULERS[sampler_name]
    # A base config with other choices already made: the sampler's own settings must win.
    base = {**shared_pipe.scheduler.config, "use_karras_sigmas": True, "algorithm_type": "sde-dpmsolver++",
            "solver_type": "heun", "clip_sample": True}
    scheduler = make_eval_scheduler(base, sampler_name, "normal")
    assert type(scheduler).__name__ == class_name
    for key, value in settings.items():
        assert str(scheduler.config[key]) == value, key
    if sampler_name not in ONLY_NORMAL_SIGMAS:
        assert not any(scheduler.config[flag] for flag in SIGMA_FLAGS)
    # The model's own noise schedule is kept.
    assert scheduler.config.beta_schedule == "scaled_linear"
    assert scheduler.config.beta_end == pytest.approx(0.012)


@pytest.mark.parametrize("sampler_name", DIFFUSERS_SAMPLERS)
@pytest.mark.parametrize(("schedule", "flag"), [("karras", "use_karras_sigmas"),
                                                ("exponential", "use_exponential_sigmas")])
def test_sigma_schedule_sets_exactly_its_flag_or_is_refused(sampler_name: str, schedule: str, flag: str) -> None:
    if not can_build(sampler_name):
        pytest.skip("needs scipy; the refusal is tested above")
    if sampler_name in ONLY_NORMAL_SIGMAS:
        with pytest.raises(ConfigError, match=f'"{schedule}" cannot be used with eval.sampler_name = "{sampler_name}"'):
            check_sampler(sampler_name, schedule)
        return
    scheduler = make_eval_scheduler({"num_train_timesteps": 1000}, sampler_name, schedule)
    assert {name for name in SIGMA_FLAGS if scheduler.config[name]} == {flag}


def test_beta_schedule_needs_scipy() -> None:
    if is_scipy_available():
        assert make_eval_scheduler({}, "euler", "beta").config.use_beta_sigmas
    else:
        with pytest.raises(ConfigError, match='"beta" needs the optional package scipy: pip install scipy'):
            check_sampler("euler", "beta")


def test_unknown_sampler_or_schedule_is_rejected_with_the_valid_names() -> None:
    with pytest.raises(ConfigError) as error:
        check_sampler("eulr", "normal")
    assert 'did you mean "euler"' in str(error.value)
    assert all(name in str(error.value) for name in DIFFUSERS_SAMPLERS)
    with pytest.raises(ConfigError) as error:
        check_sampler("euler", "karas")
    message = str(error.value)
    assert 'did you mean "karras"' in message
    assert all(name in message for name in ("normal", "exponential", "beta", "DPMSolverMultistepScheduler"))


def test_scheduler_may_name_a_diffusers_class(shared_pipe) -> None:
    scheduler = make_eval_scheduler(shared_pipe.scheduler.config, "euler", "UniPCMultistepScheduler")
    assert type(scheduler).__name__ == "UniPCMultistepScheduler"
    with pytest.raises(ConfigError, match='"FlowMatchEulerDiscreteScheduler": unknown'):  # not an SDXL scheduler
        check_sampler("euler", "FlowMatchEulerDiscreteScheduler")


def test_a_sampler_that_cannot_follow_zero_terminal_snr_is_refused_not_silently_changed() -> None:
    """DEIS, PNDM, Heun, LMS, KDPM2 and the single-step solver have no rescale_betas_zero_snr: on a
    ZTSNR model they would sample the original schedule."""
    zero_snr = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                "beta_schedule": "scaled_linear", "prediction_type": "v_prediction", "rescale_betas_zero_snr": True}
    assert make_eval_scheduler(zero_snr, "euler", "normal").alphas_cumprod[-1] < 1e-6
    for sampler_name in ("deis", "pndm", "heun", "lms", "dpm_2", "dpm_2_a", "dpmpp_sde"):
        with pytest.raises(ConfigError, match=rf'eval\.sampler_name = "{sampler_name}": .* cannot sample the zero'):
            make_eval_scheduler(zero_snr, sampler_name, "normal")
    with pytest.raises(ConfigError, match=r'eval\.scheduler = "HeunDiscreteScheduler": '):
        make_eval_scheduler(zero_snr, "euler", "HeunDiscreteScheduler")
    assert type(make_eval_scheduler({**zero_snr, "rescale_betas_zero_snr": False}, "deis", "normal")).__name__ \
        == "DEISMultistepScheduler"


@pytest.mark.parametrize("sampler_name", [name for name in DIFFUSERS_SAMPLERS if can_build(name)])
def test_each_sampler_renders_a_finite_image_with_its_scheduler(shared_pipe, tmp_path: Path, sampler_name: str) -> None:
    used = []
    hook = shared_pipe.unet.register_forward_pre_hook(lambda *_: used.append(type(shared_pipe.scheduler).__name__))
    own_scheduler = shared_pipe.scheduler
    try:
        result = run_evaluation(shared_pipe, eval_config(sampler_name=sampler_name), [prompt()], tmp_path / "eval",
                                tag="final", step=1)
    finally:
        hook.remove()
    assert result.invalid == []
    assert set(used) == {EXPECTED_SCHEDULERS[sampler_name][0]}
    assert shared_pipe.scheduler is own_scheduler
    assert pixels(result.images[0]).std() > 0


def test_karras_and_exponential_schedules_render(shared_pipe, tmp_path: Path) -> None:
    for schedule in ("karras", "exponential"):
        config = eval_config(sampler_name="dpmpp_2m_sde", scheduler=schedule)
        result = run_evaluation(shared_pipe, config, [prompt()], tmp_path / schedule, tag="final", step=1)
        assert result.invalid == []


# ----------------------------------------------------------------------------- image checks
def test_check_image_names_what_is_wrong() -> None:
    picture = np.random.default_rng(0).random((8, 8, 3), dtype=np.float32)
    assert check_image(picture) is None
    assert check_image(torch.from_numpy(picture)) is None
    with_nan = picture.copy()
    with_nan[0, 0, 0] = np.nan
    assert check_image(with_nan).startswith("contains NaN/Inf (1 of 192")
    assert check_image(torch.full((3, 8, 8), float("inf"))).startswith("contains NaN/Inf")
    assert check_image(np.zeros((8, 8, 3))) == "all black"
    assert check_image(np.full((8, 8, 3), 0.5)).startswith("constant")
    assert check_image(picture * 255).startswith("out of range")
    assert check_image(picture - 0.5).startswith("out of range")


def test_nan_weights_give_invalid_images_and_an_error(pipe, tmp_path: Path, capsys) -> None:
    with torch.no_grad():
        pipe.unet.conv_out.bias[0] = float("nan")
    prompts = [prompt("a red circle"), prompt("a blue square", seed=2)]
    result = run_evaluation(pipe, eval_config(), prompts, tmp_path / "eval", tag="live", step=5)

    assert [path.name for path in result.images] == ["00_a-red-circle_INVALID.png", "01_a-blue-square_INVALID.png"]
    assert [path for path, _ in result.invalid] == result.images
    assert all(reason.startswith("contains NaN/Inf") for _, reason in result.invalid)
    assert all(path.is_file() and pixels(path).max() == 0 for path in result.images)  # NaN shows as black
    stderr = capsys.readouterr().err
    assert "error: eval/live step 5: image 0 ('a red circle', seed 1, 64x64) is invalid: contains NaN/Inf" in stderr
    assert "2 invalid eval image(s); likely causes" in stderr
    assert "fp16" in stderr and "MPS" in stderr and "NaN/Inf in the weights" in stderr
    assert result.summary()["invalid"][1] == {"path": str(result.images[1]), "reason": result.invalid[1].reason}


# ------------------------------------------------------------------------- prompts and outputs
def test_prompt_seed_and_size_are_honoured(shared_pipe, tmp_path: Path) -> None:
    prompts = [prompt(seed=1), prompt(seed=1), prompt(seed=2), prompt(seed=1, width=96, height=64)]
    # An ancestral sampler: its per-step noise must come from the prompt's seed too.
    result = run_evaluation(shared_pipe, eval_config(sampler_name="euler_a"), prompts, tmp_path, tag="final", step=0)
    first, same_seed, other_seed, wide = (pixels(path) for path in result.images)
    assert np.array_equal(first, same_seed)
    assert np.abs(first.astype(int) - other_seed.astype(int)).mean() > 1
    assert wide.shape == (64, 96, 3)
    assert result.invalid == []


def test_output_layout_and_tensorboard(shared_pipe, tmp_path: Path, capsys) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "out" / "eval" / "live" / "step_10"
    folder.mkdir(parents=True)
    (folder / "stale.png").write_bytes(b"from an earlier run")
    prompts = [prompt("tok, a red circle"), prompt("a | b", seed=2, width=96), prompt("x", seed=3, height=96),
               prompt("not rendered", seed=4)]
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    result = run_evaluation(shared_pipe, eval_config(), prompts, folder, tag="live", step=10, writer=writer,
                            max_batches=3)
    writer.close()

    assert result.invalid == [] and result.summary() == {"folder": str(folder), "images": 3, "invalid": []}
    assert sorted(path.name for path in folder.iterdir()) == ["00_tok-a-red-circle.png", "01_a-b.png", "02_x.png",
                                                              "grid.png"]
    assert result.images == [folder / "00_tok-a-red-circle.png", folder / "01_a-b.png", folder / "02_x.png"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "temporary files left behind"
    with Image.open(result.grid) as grid:
        assert grid.size == (2 * 96, 2 * 96)  # 2x2 cells as large as the largest image
    assert np.array_equal(pixels(result.grid)[:64, :64], pixels(result.images[0]))
    assert "error" not in capsys.readouterr().err

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["eval/live/0", "eval/live/1", "eval/live/2"]
    image_event = events.Images("eval/live/1")[0]
    assert (image_event.step, image_event.width, image_event.height) == (10, 96, 64)
    logged = np.asarray(Image.open(io.BytesIO(image_event.encoded_image_string)).convert("RGB"))
    assert np.array_equal(logged, pixels(result.images[1]))
    text_event = events.Tensors("eval/live/text_summary")[0]
    text = text_event.tensor_proto.string_val[0].decode()
    assert text_event.step == 10
    assert "3 images, 0 invalid; sampler euler (normal), 2 steps, cfg 7" in text
    assert "| 1 | a \\| b |  | 2 | 96x64 | ok |" in text


# --------------------------------------------------------------------------- training state
@pytest.mark.parametrize("backend", ["diffusers", "kdiffusion"])
def test_training_state_and_global_rng_are_untouched(pipe, tmp_path: Path, backend: str) -> None:
    config = validate_config(tiny_config(tmp_path, model={"use_gradient_checkpointing": True}))
    prepare_trainable(pipe, config)  # DoRA adapters on the UNet and CLIP-L, gradient checkpointing, train()
    pipe.unet.down_blocks[0].eval()  # one frozen part inside a training module stays as it is
    pipe.vae.half()  # an fp16 VAE must still decode in fp32, and stay fp16
    components = {name: getattr(pipe, name) for name in ("unet", "vae", "text_encoder", "text_encoder_2")}

    def snapshot() -> dict:
        return {
            "modes": {(name, sub): m.training for name, c in components.items() for sub, m in c.named_modules()},
            "weights": {(name, key): t.clone() for name, c in components.items() for key, t in c.state_dict().items()},
            "requires_grad": {(name, key): p.requires_grad for name, c in components.items()
                              for key, p in c.named_parameters()},
            "checkpointing": (pipe.unet.is_gradient_checkpointing, pipe.text_encoder.is_gradient_checkpointing),
            "scheduler": pipe.scheduler,
        }

    before = snapshot()
    assert any(key[1].endswith("lora_magnitude_vector.default.weight") for key in before["weights"])
    assert before["modes"][("unet", "")] and not before["modes"][("unet", "down_blocks.0")]
    assert all(before["checkpointing"])
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    rng_before = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    decode_dtypes, modes_during_eval, draws = [], [], []

    def during_unet_call(module, args):
        modes_during_eval.append(any(m.training for c in components.values() for m in c.modules()))
        # Code that draws from the global RNG streams during eval, as a train-mode dropout would.
        draws.append(torch.rand(1).item())
        np.random.rand(), random.random()

    hooks = [pipe.unet.register_forward_pre_hook(during_unet_call),
             pipe.vae.decoder.register_forward_pre_hook(lambda module, args: decode_dtypes.append(args[0].dtype))]
    result = run_evaluation(pipe, eval_config(sampler_name="dpmpp_2m_sde", backend=backend),
                            [prompt(seed=5), prompt(seed=5)], tmp_path, tag="live", step=1)
    for hook in hooks:
        hook.remove()

    assert result.invalid == []
    assert np.array_equal(pixels(result.images[0]), pixels(result.images[1]))
    assert modes_during_eval and not any(modes_during_eval)  # everything in eval() while rendering
    assert decode_dtypes == [torch.float32, torch.float32]
    assert draws[: len(draws) // 2] == draws[len(draws) // 2 :]  # global draws depend on the prompt's seed
    after = snapshot()
    assert after["modes"] == before["modes"]
    assert after["requires_grad"] == before["requires_grad"]
    assert after["checkpointing"] == before["checkpointing"]
    assert after["scheduler"] is before["scheduler"]
    assert after["weights"].keys() == before["weights"].keys()
    for key, tensor in before["weights"].items():
        assert after["weights"][key].dtype == tensor.dtype, key
        assert torch.equal(after["weights"][key], tensor), key
    assert pipe.vae.dtype == torch.float16
    rng_after = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    assert torch.equal(rng_after[0], rng_before[0])
    assert all(np.array_equal(a, b) for a, b in zip(rng_after[1], rng_before[1], strict=True))
    assert rng_after[2] == rng_before[2]


# ------------------------------------------------------------------------------ prompts file
def write_prompts(tmp_path: Path, entries) -> Path:
    path = tmp_path / "prompts.json"
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries), encoding="utf-8")
    return path


def test_prompts_file_sizes_seeds_and_defaults(tmp_path: Path) -> None:
    path = write_prompts(tmp_path, [
        {"prompt": "a", "negative_prompt": "blurry", "seed": 7, "height": 64, "width": 96},
        {"prompt": "b", "resolution": "1024x640"},
        {"prompt": "c", "size": "64x96", "seed": 0},
        {"prompt": "d", "width": 128},
    ])
    assert load_prompts(path, 1024, 1024) == [
        EvalPrompt("a", "blurry", 7, 96, 64),
        EvalPrompt("b", "", 1, 1024, 640),  # no seed: the entry's index
        EvalPrompt("c", "", 0, 64, 96),
        EvalPrompt("d", "", 3, 128, 1024),
    ]
    shipped = load_prompts(ROOT / "data" / "eval_prompts.example.json", 1024, 1024)
    assert [(p.seed, p.width, p.height) for p in shipped] == [(1, 1024, 1024), (2, 1216, 832), (3, 832, 1216),
                                                             (4, 1024, 1024)]
    three = load_prompts(ROOT / "tests" / "eval_prompts.three.json", 64, 64)
    assert [(p.seed, p.width, p.height, p.group) for p in three] == [(1, 64, 64, ""), (2, 96, 64, ""), (3, 64, 96, "")]
    quickstart = load_prompts(ROOT / "data" / "eval_prompts.quickstart.json", 64, 64)
    assert [p.group for p in quickstart] == ["concept"] * 16 + ["prior"] * 32
    assert {(p.width, p.height) for p in quickstart} == {(64, 64)}


@pytest.mark.parametrize(("entries", "message"), [
    ({"prompt": "a"}, "must be a non-empty JSON list"),
    ([], "must be a non-empty JSON list"),
    ('[{"prompt": "a",}]', "invalid JSON at line 1, column 17"),
    (["a red circle"], 'entry 0: must be an object like {"prompt": "...", "seed": 1}, not "a red circle"'),
    ([{"prompt": "a"}, {"negative_prompt": "b"}], 'entry 1: "prompt" is required and must be a string'),
    ([{"prompt": "a", "sed": 3}], 'entry 0: unknown key "sed"; did you mean "seed"?'),
    ([{"prompt": "a", "colour": 3}], 'entry 0: unknown key "colour"; valid keys: prompt, negative_prompt, seed'),
    ([{"prompt": "a", "seed": -1}], 'entry 0: "seed" must be an integer from 0 to 2**64 - 1, not -1'),
    ([{"prompt": "a", "seed": "5"}], '"seed" must be an integer'),
    ([{"prompt": "a", "seed": True}], '"seed" must be an integer'),
    ([{"prompt": "a", "negative_prompt": None}], '"negative_prompt" must be a string'),
    ([{"prompt": "a", "group": 2}], 'entry 0: "group" must be a string'),
    ([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}, {"prompt": "d", "resolution": "1024*640"}],
     'entry 3: "resolution" must look like "1024x640" (width x height), not "1024*640"'),
    ([{"prompt": "a", "size": 1024}], '"size" must look like "1024x640"'),
    ([{"prompt": "a", "resolution": "1020x640"}], '"resolution": the width must be a positive multiple of 8'),
    ([{"prompt": "a", "height": 100}], '"height": the height must be a positive multiple of 8'),
    ([{"prompt": "a", "width": 0}], '"width": the width must be a positive multiple of 8'),
    ([{"prompt": "a", "resolution": "64x64", "width": 64}], "give the size once, not resolution and width together"),
])
def test_prompts_file_errors_name_the_file_and_entry(tmp_path: Path, entries, message: str) -> None:
    path = write_prompts(tmp_path, entries)
    with pytest.raises(ConfigError) as error:
        load_prompts(path, 64, 64)
    assert str(error.value).startswith(f"eval.prompts_path = {str(path)!r}: ")
    assert message in str(error.value)


def test_prompts_file_missing_and_bad_defaults(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("prompts.json': file not found")):
        load_prompts(tmp_path / "prompts.json", 64, 64)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ConfigError, match=re.escape("image.png': not a UTF-8 text file")):
        load_prompts(tmp_path / "image.png", 64, 64)
    with pytest.raises(ConfigError, match=re.escape("eval.width = 1020: must be a multiple of 8")):
        load_prompts(write_prompts(tmp_path, [{"prompt": "a"}]), 1020, 64)
