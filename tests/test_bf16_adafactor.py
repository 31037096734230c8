"""bf16 weights with Adafactor (kohya's low-memory SDXL full fine-tune): each tensor stepped in
fp32 and rounded back stochastically, so small updates are kept; what it saves in the plan; a fused
run of it resumes bit-exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.optimization import Adafactor

from sdxl_trainer.bf16_adafactor import StochasticRoundingAdafactor
from sdxl_trainer.bf16_adamw import StochasticRoundingAdamW
from sdxl_trainer.config import ConfigError, validate_config
from tests.helpers import tiny_config, train_here, write_config

SETTINGS = {"lr": 1e-4, "scale_parameter": False, "relative_step": False, "warmup_init": False, "weight_decay": 0.0}


def steps(optimizer_class, weight: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    param = torch.nn.Parameter(weight.clone())
    optimizer = optimizer_class([param], **SETTINGS)
    for grad in grads:
        param.grad = grad.to(param.dtype)
        optimizer.step()
    return param.detach(), optimizer.state[param]


def test_small_updates_are_kept_in_expectation_where_rounding_to_nearest_loses_them() -> None:
    torch.manual_seed(0)
    weight = torch.ones(64, 64)
    grads = [torch.randn(64, 64).abs() + 0.5 for _ in range(100)]  # every step pushes every weight down
    reference, _ = steps(Adafactor, weight, grads)  # fp32 weights: the true trajectory
    nearest, _ = steps(Adafactor, weight.bfloat16(), grads)  # transformers' own bf16 path
    rounded, state = steps(StochasticRoundingAdafactor, weight.bfloat16(), grads)
    moved = 1.0 - reference.mean().item()
    assert 5e-3 < moved < 2e-2  # each update (about 1e-4) is far below bf16's spacing of 2^-7 at 1.0
    assert torch.equal(nearest, torch.ones(64, 64, dtype=torch.bfloat16))  # every update lost
    assert rounded.dtype == torch.bfloat16
    assert (1.0 - rounded.float().mean().item()) == pytest.approx(moved, rel=0.05)
    assert state["exp_avg_sq_row"].dtype == torch.float32 and state["exp_avg_sq_row"].shape == (64,)


def test_fp32_weights_get_adafactors_own_step_bit_for_bit() -> None:
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((32, 16), (16,), (8, 4, 3, 3))]
    twins = [torch.nn.Parameter(param.detach().clone()) for param in params]
    optimizers = (Adafactor(params, **SETTINGS), StochasticRoundingAdafactor(twins, **SETTINGS))
    for _ in range(3):
        grads = [torch.randn_like(param) for param in params]
        for group, optimizer in zip((params, twins), optimizers, strict=True):
            for param, grad in zip(group, grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins, strict=True))
    assert len(optimizers[1].param_groups[0]["params"]) == 3  # the group given back after each tensor's step


@pytest.mark.parametrize("optimizer_class", [StochasticRoundingAdafactor, StochasticRoundingAdamW])
def test_a_loaded_state_keeps_its_fp32_moments(optimizer_class) -> None:
    """torch casts a loaded state to the parameters' dtype: the bf16 weights' fp32 moments must come
    back as saved (before the fix a resumed bf16 AdamW run failed at its first step)."""
    settings = SETTINGS if optimizer_class is StochasticRoundingAdafactor else {"lr": 1e-4}
    params = [torch.nn.Parameter(torch.ones(16, 8, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))]
    optimizer = optimizer_class(params, **settings)
    for param in params:
        param.grad = torch.full_like(param, 0.3)
    optimizer.step()
    saved = optimizer.state_dict()
    restored = optimizer_class(params, **settings)
    restored.load_state_dict(saved)
    for param in params:
        moments = {key: value for key, value in optimizer.state[param].items()
                   if torch.is_tensor(value) and value.is_floating_point()}
        assert moments and all(value.dtype == torch.float32 for value in moments.values())
        assert all(torch.equal(restored.state[param][key], value) for key, value in moments.items())
    restored.step()  # steps on the restored state


def test_bf16_weights_take_adamw_or_adafactor(tmp_path: Path) -> None:
    def full(optimizer: str) -> dict:
        return tiny_config(tmp_path, adapter={"type": "none"}, model={"weights_dtype": "bf16"},
                           optimizer={"type": optimizer})

    validate_config(full("adafactor"))
    with pytest.raises(ConfigError, match=r'model\.weights_dtype.*set optimizer\.type to "adamw" or "adafactor"'):
        validate_config(full("lion"))


@pytest.mark.slow
def test_the_plan_of_a_fused_bf16_adafactor_run_holds_half_the_weights(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    from sdxl_trainer.memory.plan import StepShape, plan_memory

    def plan(weights_dtype: str):
        config = tiny_config(tmp_path, adapter={"type": "none"}, model={"weights_dtype": weights_dtype,
                                                                         "train_text_encoder_1": False},
                             optimizer={"type": "adafactor", "fused_backward": True},
                             training={"max_grad_norm": None, "mixed_precision": "bf16"})
        return plan_memory(validate_config(config), StepShape(1, 64, 64), "cpu")

    fp32, bf16 = plan("fp32"), plan("bf16")
    assert bf16.weights["unet"] == {"bfloat16": fp32.weights["unet"]["float32"] // 2}
    assert bf16.gradients == fp32.gradients // 2  # fused: the largest tensor's gradient, in bf16
    assert bf16.optimizer_state == fp32.optimizer_state  # fp32 factored moments either way
    assert bf16.peak < fp32.peak


@pytest.mark.slow
def test_a_fused_bf16_adafactor_run_trains_and_resumes_bit_exactly(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    def run(name: str, **training) -> Path:
        config = tiny_config(tmp_path / name, adapter={"type": "none"},
                             model={"weights_dtype": "bf16", "train_text_encoder_1": False},
                             optimizer={"type": "adafactor", "fused_backward": True},
                             training={"num_steps": 4, "checkpoint_every": 2, "max_grad_norm": None,
                                       "mixed_precision": "bf16", "lr_unet": 1e-4, **training})
        result = train_here("--config", str(write_config(tmp_path / f"{name}.json", config)))
        assert result.returncode == 0, result.stderr[-3000:]
        return tmp_path / name / "out" / "test_run"

    straight = run("straight")
    resumed = run("resumed", resume_from=str(straight / "checkpoints" / "checkpoint-2"))
    base = load_file(tiny_sdxl_dir / "unet" / "diffusion_pytorch_model.safetensors")
    first = load_file(straight / "unet" / "diffusion_pytorch_model.safetensors")
    second = load_file(resumed / "unet" / "diffusion_pytorch_model.safetensors")
    assert first.keys() == second.keys() == base.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    changed = [key for key in first if not torch.equal(first[key].float(), base[key].float())]
    assert len(changed) > len(first) // 2
    assert all(torch.isfinite(value).all() for value in first.values())
