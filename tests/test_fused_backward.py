"""Fused backward (`optimizer.fused_backward`): each tensor stepped inside backward equals the
ordinary step, a non-finite gradient stops the stepping before its tensor, what cannot hold is
refused, and a run with it trains, resumes and is planned like one without."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdxl_trainer.config import FUSABLE_OPTIMIZERS, ConfigError, OptimizerConfig, validate_config
from sdxl_trainer.fused_backward import FusedBackward
from sdxl_trainer.optimizers import make_optimizer
from tests.helpers import tiny_config, train_here, write_config


class Small(torch.nn.Module):
    """A conv, a norm and two linears: tensors of every rank an SDXL UNet has."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.first = torch.nn.Linear(8 * 8 * 8, 64)
        self.second = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.conv(x)).flatten(1)
        return self.second(torch.nn.functional.gelu(self.first(hidden)))


def model_and_optimizer(kind: str) -> tuple[Small, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Small()
    groups = [{"params": [*model.conv.parameters(), *model.norm.parameters()], "lr": 1e-3},
              {"params": [*model.first.parameters(), *model.second.parameters()], "lr": 3e-4}]
    return model, make_optimizer(OptimizerConfig(type=kind), groups)


def train(kind: str, fused: bool, steps: int = 3) -> tuple[Small, torch.optim.Optimizer]:
    model, optimizer = model_and_optimizer(kind)
    hooks = FusedBackward(optimizer, model.named_parameters()) if fused else None
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        if hooks:
            assert all(param.grad is None for param in model.parameters())  # every gradient freed in backward
            norm, first_bad = hooks.finish_step()
            assert torch.isfinite(norm) and norm > 0 and first_bad is None
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def same(first, second) -> bool:
    """Equal values: tensors bit for bit (dtype and shape too), containers item by item."""
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and first.dtype == second.dtype and torch.equal(first, second)
    if isinstance(first, (list, tuple)):
        return type(first) is type(second) and len(first) == len(second) and all(map(same, first, second))
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(same(first[key], second[key]) for key in first)
    return first == second


@pytest.mark.parametrize("kind", FUSABLE_OPTIMIZERS)
def test_fused_steps_equal_the_ordinary_step_bit_for_bit(kind: str) -> None:
    plain_model, plain_optimizer = train(kind, fused=False)
    fused_model, fused_optimizer = train(kind, fused=True)
    for (name, plain), fused in zip(plain_model.state_dict().items(), fused_model.state_dict().values(), strict=True):
        assert torch.equal(plain, fused), f"{kind}: {name} differs"
    plain_state, fused_state = plain_optimizer.state_dict()["state"], fused_optimizer.state_dict()["state"]
    assert plain_state.keys() == fused_state.keys() and len(plain_state) == 8
    for index, entry in plain_state.items():
        for key, value in entry.items():
            assert same(value, fused_state[index][key]), (kind, index, key)
    # The group settings the step read stayed the optimizer's own (nothing of the narrowed copy leaked).
    assert [len(group["params"]) for group in fused_optimizer.param_groups] == [4, 4]


def test_a_non_finite_gradient_is_found_before_its_tensor_is_stepped() -> None:
    model, optimizer = model_and_optimizer("adamw")
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    hooks = FusedBackward(optimizer, model.named_parameters())
    model.first.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    model(torch.randn(2, 3, 8, 8)).square().mean().backward()
    norm, first_bad = hooks.finish_step()
    assert torch.isnan(norm) and first_bad == "first.weight"
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    # Backward reaches `second` before `first`: its tensors (and first.bias, whose gradient is
    # complete before first.weight's) were stepped; first.weight and everything after it were not.
    assert {"second.weight", "second.bias"} <= changed
    assert not changed & {"first.weight", "conv.weight", "conv.bias", "norm.weight", "norm.bias"}
    assert all(torch.isfinite(param).all() for param in model.parameters())
    assert hooks.finish_step()[1] is None  # the next step starts clean


@pytest.mark.slow  # two spawned processes
def test_two_processes_average_each_gradient_and_must_meet_it_in_one_order(tmp_path: Path) -> None:
    """In two gloo processes, each gradient is averaged in its hook (the step equals SGD on the
    mean of both processes' gradients, from rank 0's weights); a step whose backward order differs
    from the first step's, or a first step whose order differs between the processes, is an error."""
    from tests.fused_two_processes import TwoBranches, two_process_worker
    from tests.helpers import free_port

    torch.multiprocessing.start_processes(two_process_worker, (free_port(), tmp_path), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert all(same(ranks[0][key], ranks[1][key]) for key in ("start", "after"))  # one model in both
    torch.manual_seed(0)
    expected = TwoBranches()
    gradients = []
    for rank in ranks:
        expected.zero_grad(set_to_none=True)
        expected(rank["x"], a_first=True).backward()
        gradients.append({name: param.grad.clone() for name, param in expected.named_parameters()})
    for name, param in expected.named_parameters():
        assert torch.equal(ranks[0]["start"][name], param.detach())
        mean = gradients[0][name].div(2) + gradients[1][name].div(2)
        assert torch.equal(ranks[0]["after"][name], param.detach().add(mean, alpha=-0.1)), name  # SGD's update
    for rank in ranks:
        assert len(rank["errors"]) == 2
        assert "another order than the first step's" in rank["errors"][0]
        assert "different orders" in rank["errors"][1]


@pytest.mark.parametrize(("override", "key"), [
    ({"optimizer": {"type": "prodigy"}}, "optimizer.type"),
    ({"optimizer": {"type": "adamw_schedulefree"}}, "optimizer.type"),
    ({"training": {"grad_accum_steps": 2}}, "training.grad_accum_steps"),
    ({"training": {"max_grad_norm": 1.0}}, "training.max_grad_norm"),
    ({"training": {"mixed_precision": "fp16"}}, "training.mixed_precision"),
    ({"training": {"nan_policy": "skip"}}, "training.nan_policy"),
])
def test_what_cannot_hold_is_refused_naming_the_key(tmp_path: Path, override: dict, key: str) -> None:
    config = tiny_config(tmp_path, adapter={"type": "none"})
    config["optimizer"]["fused_backward"] = True
    for section, values in override.items():
        config[section].update(values)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(config)
    config["optimizer"]["fused_backward"] = False
    validate_config(config)  # the same settings without it are fine


def test_ddp_is_accepted_and_fsdp_refused_in_one_line_before_loading(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DDP the hooks average each gradient (tests/test_multiprocess.py trains it); under FSDP
    a process holds only a slice of a gradient, so the run stops with exit 2 before any weight loads."""
    from sdxl_trainer.distributed import check_launch

    config = tiny_config(tmp_path, adapter={"type": "none"}, model={"train_text_encoder_1": False},
                         optimizer={"fused_backward": True})
    check_launch(validate_config(config), {"WORLD_SIZE": "2"})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "under FSDP: optimizer.fused_backward (each process holds a slice" in lines[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_memory_plan_holds_one_gradient_at_a_time(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    from sdxl_trainer.memory.plan import StepShape, plan_memory
    from sdxl_trainer.memory.preflight import fused_backward_fits

    config = tiny_config(tmp_path, adapter={"type": "none"}, model={"train_text_encoder_1": False})
    plain = validate_config(config)
    config["optimizer"]["fused_backward"] = True
    fused = validate_config(config)
    shape = StepShape(2, 64, 64, None)
    plain_plan, fused_plan = plan_memory(plain, shape, "cpu"), plan_memory(fused, shape, "cpu")
    unet_gradients = sum(p.numel() * 4 for p in plain_plan_parameters(tiny_sdxl_dir))
    assert plain_plan.gradients == unet_gradients
    assert fused_plan.gradients < unet_gradients / 10
    assert fused_plan.optimizer_state == plain_plan.optimizer_state
    assert fused_plan.train_peak < plain_plan.train_peak
    assert fused_backward_fits(plain) and not fused_backward_fits(fused)  # proposed where it is not on yet
    # Several processes: DDP's reducer holds a second copy of the gradients for the model's life;
    # fused backward wraps nothing in DDP (its hooks average each gradient) and holds none.
    ddp = dataclasses.replace(shape, ddp=True)
    plain_ddp, fused_ddp = plan_memory(plain, ddp, "cpu"), plan_memory(fused, ddp, "cpu")
    assert plain_ddp.ddp_buckets == unet_gradients and plain_ddp.gradients == unet_gradients
    assert plain_ddp.train_peak == plain_plan.train_peak + unet_gradients
    assert fused_ddp.ddp_buckets == 0 and fused_ddp.train_peak == fused_plan.train_peak
    config["optimizer"]["fused_backward"], config["adapter"]["type"] = False, "dora"
    assert not fused_backward_fits(validate_config(config))  # an adapter's gradients are small


def plain_plan_parameters(tiny_sdxl_dir: Path) -> list[torch.nn.Parameter]:
    from diffusers import UNet2DConditionModel

    return list(UNet2DConditionModel.from_pretrained(tiny_sdxl_dir / "unet").parameters())


@pytest.mark.slow
def test_a_fused_run_trains_and_checkpoints_exactly_like_an_ordinary_one(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """A fused full fine-tune of 4 steps; an ordinary run resumed from its step-2 checkpoint ends
    with the same weights (the fused steps equal the ordinary ones and its checkpoint is whole)."""
    def run(name: str, fused: bool, **training) -> Path:
        config = tiny_config(tmp_path / name, adapter={"type": "none"}, model={"train_text_encoder_1": False},
                             training={"num_steps": 4, "lr_unet": 1e-4, "checkpoint_every": 2, **training})
        config["optimizer"]["fused_backward"] = fused
        result = train_here("--config", str(write_config(tmp_path / f"{name}.json", config)))
        assert result.returncode == 0, result.stderr[-3000:]
        return tmp_path / name / "out" / "test_run"

    fused = run("fused", True)
    ordinary = run("ordinary", False, resume_from=str(fused / "checkpoints" / "checkpoint-2"))
    fused_unet, ordinary_unet = (load_file(folder / "unet" / "diffusion_pytorch_model.safetensors")
                                 for folder in (fused, ordinary))
    assert fused_unet.keys() == ordinary_unet.keys()
    assert [key for key in fused_unet if not torch.equal(fused_unet[key], ordinary_unet[key])] == []
    base = load_file(tiny_sdxl_dir / "unet" / "diffusion_pytorch_model.safetensors")
    assert not torch.equal(base["conv_in.weight"].float(), fused_unet["conv_in.weight"].float())  # it trained
    summary = json.loads((ordinary / "run_summary.json").read_text())
    assert summary["steps"] == 4 and summary["status"] == "completed"
