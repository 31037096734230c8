"""The optimizers beyond AdamW (Prodigy, schedule-free AdamW, Lion, 8-bit Lion, CAME), their
arguments, LoRA+, and schedule-free's two sets of weights: eval images and exports use the averaged
ones, training goes on from the trained ones exactly. (Each optimizer's 2-process run is in
tests/test_multiprocess.py, sharing that module's launch.)"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_sdxl
from sdxl_trainer import run as run_module
from sdxl_trainer.config import ConfigError, OptimizerConfig, validate_config
from sdxl_trainer.data import ImageCaptionDataset, collate
from sdxl_trainer.data_plan import plan_dataset
from sdxl_trainer.diffusion import DrawSettings, LossModels, diffusion_loss, make_noise_scheduler, sample_draws
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.optimizers import averaged_weights, check_optimizer, make_optimizer
from sdxl_trainer.training_setup import prepare_trainable
from tests.helpers import tiny_config, write_config

# Learning rates each optimizer trains the tiny model with (Prodigy's is a multiplier of its own step).
NEW_OPTIMIZERS = {"prodigy": 1.0, "adamw_schedulefree": 1e-3, "lion": 1e-4, "lion8bit": 1e-4, "came": 1e-3}


def optimizer_config(tmp_path: Path, kind: str, **training) -> dict:
    lr = NEW_OPTIMIZERS[kind]
    return tiny_config(tmp_path, optimizer={"type": kind},
                       training={"lr_unet": lr, "lr_text_encoder_1": lr, **training})


@pytest.mark.slow
def test_argument_values_must_have_the_type_of_the_constructors_default(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A string is truthy: "maybe" would switch AMSGrad on. Each value is checked against the type
    of the constructor's default (a number may be an int, a tuple a list of its length)."""
    for accepted in ({"amsgrad": True, "maximize": False}, {"foreach": None}):
        check_optimizer(OptimizerConfig(type="adamw", args=accepted))
    check_optimizer(OptimizerConfig(type="prodigy", args={"d_coef": 2, "slice_p": 11, "use_bias_correction": True}))
    refused = [
        ("adamw", "amsgrad", "maybe", 'optimizer.args.amsgrad = "maybe": must be true or false, as adamw\'s '
                                        "default False is"),
        ("adamw", "maximize", 1, "optimizer.args.maximize = 1: must be true or false"),
        ("prodigy", "slice_p", 1.5, "optimizer.args.slice_p = 1.5: must be an integer, as prodigy's default 1 is"),
        ("prodigy", "d_coef", "2", 'optimizer.args.d_coef = "2": must be a number'),
        ("adafactor", "eps", [1e-30], "optimizer.args.eps = [1e-30]: must be a list of 2: a number, a number"),
    ]
    for kind, key, value, message in refused:
        with pytest.raises(ConfigError) as caught:
            check_optimizer(OptimizerConfig(type=kind, args={key: value}))
        assert str(caught.value).startswith(message), caught.value
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, optimizer={"type": "adamw",
                                                                               "args": {"amsgrad": "maybe"}}))
    assert train_sdxl.main(["--config", str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().startswith('error: optimizer.args.amsgrad = "maybe": must be true or false')


@pytest.mark.slow
@pytest.mark.parametrize("kind", NEW_OPTIMIZERS)
def test_each_optimizer_lowers_the_loss_on_fixed_draws(kind: str, tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    config = validate_config(optimizer_config(tmp_path, kind))
    pipe = load_pipeline(config.model)
    trainable = prepare_trainable(pipe, config)
    optimizer = make_optimizer(config.optimizer, trainable.param_groups())
    if kind == "adamw_schedulefree":
        optimizer.train()
    plan = plan_dataset(config.data, 2)
    dataset = ImageCaptionDataset(plan.samples, config.data, seed=7)
    batch = collate([dataset[(index, 0)] for index in plan.sampler(seed=7).batches(0)[0]])
    scheduler = make_noise_scheduler(pipe.scheduler.config, None, False)
    height, width = batch["target_sizes"][0].tolist()
    draws = sample_draws(batch["keys"], 7, (len(batch["keys"]), 4, height // 8, width // 8), DrawSettings())

    def loss() -> torch.Tensor:
        return diffusion_loss(LossModels.of(pipe), scheduler, batch, draws, "cpu")

    before = loss().item()
    for _ in range(8):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    with averaged_weights(optimizer, list(trainable.parameters())), torch.no_grad():
        after = loss().item()
    assert after < before, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("kind", NEW_OPTIMIZERS)
def test_each_optimizer_resumes_bit_exactly(kind: str, tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """6 steps straight, and 3 + 3 from the straight run's checkpoint at step 3."""
    path = write_config(tmp_path / "c.json", optimizer_config(tmp_path, kind, num_steps=6, checkpoint_every=3))
    assert train_sdxl.main(["--config", str(path)]) == 0
    output = tmp_path / "out"
    checkpoint = output / "test_run" / "checkpoints" / "checkpoint-3"
    assert train_sdxl.main(["--config", str(path), "--set", "run.name=resumed",
                            "--set", f"training.resume_from={checkpoint}"]) == 0
    expected = load_file(output / "test_run" / "pytorch_lora_weights.safetensors")
    got = load_file(output / "resumed" / "pytorch_lora_weights.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[key], got[key]) for key in expected), kind


@pytest.mark.slow
def test_averaged_weights_are_schedule_frees_eval_weights_and_training_weights_come_back_exactly() -> None:
    import schedulefree

    layer = torch.nn.Linear(8, 8)
    optimizer = schedulefree.AdamWScheduleFree(layer.parameters(), lr=1e-2, warmup_steps=2)
    optimizer.train()
    for step in range(5):
        optimizer.zero_grad()
        layer(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        optimizer.step()
    training = [param.detach().clone() for param in layer.parameters()]
    oracle_layer, oracle = copy.deepcopy((layer, optimizer))
    oracle.eval()  # schedule-free's own switch, on a copy
    with averaged_weights(optimizer, list(layer.parameters())):
        during = [param.detach().clone() for param in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(during, oracle_layer.parameters(), strict=True))
    assert not torch.equal(during[0], training[0])
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), training, strict=True))


@pytest.mark.slow
def test_schedule_free_exports_its_averaged_weights(tmp_path: Path, tiny_sdxl_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """x = y + (1 − 1/β1)(z − y) from the trained weights y and the optimizer's z at the end is what
    the exported adapter file holds (schedule-free's relation, computed here independently)."""
    expected = []
    real_snapshot = run_module.take_snapshot

    def snapshot(run):  # save_outputs takes it last (after the last step's checkpoint), before the averaging
        expected.clear()
        inner = getattr(run.optimizer, "optimizer", run.optimizer)
        for group in inner.param_groups:
            beta1 = group["betas"][0]
            for param in group["params"]:
                z = inner.state[param]["z"]
                expected.append(param.detach() + (1 - 1 / beta1) * (z - param.detach()))
        return real_snapshot(run)

    monkeypatch.setattr(run_module, "take_snapshot", snapshot)
    config = optimizer_config(tmp_path, "adamw_schedulefree", num_steps=4)
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))]) == 0
    exported = load_file(tmp_path / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    # The same tensors under other names: paired by shape and sum, then compared element by element.
    assert len(exported) == len(expected)

    def ordered(tensors) -> list[torch.Tensor]:
        return sorted((t.float().reshape(-1) for t in tensors), key=lambda t: (t.numel(), t.sum().item()))

    for got, want in zip(ordered(exported.values()), ordered(expected), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_lora_plus_gives_the_b_matrices_the_ratio(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    config = validate_config(tiny_config(tmp_path, adapter={"type": "lora", "rank": 4, "alpha": 4,
                                                            "loraplus_lr_ratio": 16}))
    trainable = prepare_trainable(load_pipeline(config.model), config)
    groups = {group["name"]: group for group in trainable.param_groups()}
    assert list(groups) == ["unet", "unet_lora_B", "text_encoder", "text_encoder_lora_B"]
    assert groups["unet_lora_B"]["lr"] == 16 * groups["unet"]["lr"]
    b_params = {id(p) for name, module in trainable.modules.items() for key, p in module.named_parameters()
                if ".lora_B." in key and p.requires_grad}
    assert {id(p) for p in groups["unet_lora_B"]["params"] + groups["text_encoder_lora_B"]["params"]} == b_params
    assert not b_params & {id(p) for p in groups["unet"]["params"] + groups["text_encoder"]["params"]}
    with pytest.raises(ConfigError, match=r"adapter\.loraplus_lr_ratio applies to LoRA's B matrices; loha has none"):
        validate_config(tiny_config(tmp_path, adapter={"type": "loha", "loraplus_lr_ratio": 16}))


def test_prodigy_takes_one_rate_for_everything_it_trains(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """prodigyopt raises at the first step when param groups differ in rate (after the whole set-up):
    the config refuses that instead, naming the key, with exit code 2 and no traceback."""
    prodigy = {"optimizer": {"type": "prodigy"}}
    validate_config(tiny_config(tmp_path, **prodigy, training={"lr_unet": 1.0, "lr_text_encoder_1": 1.0}))
    cases = [
        ({"training": {"lr_unet": 1.0, "lr_text_encoder_1": 0.5}},
         "training.lr_text_encoder_1 is 0.5 and training.lr_unet is 1, but Prodigy takes one rate"),
        ({"training": {"lr_unet": 1.0, "lr_text_encoder_1": 1.0},
          "adapter": {"type": "lora", "rank": 4, "loraplus_lr_ratio": 16}},
         "adapter.loraplus_lr_ratio trains LoRA's B matrices at another rate, which Prodigy does not take"),
        ({"training": {"lr_unet": 1.0, "lr_text_encoder_1": 1.0},
          "textual_inversion": {"tokens": [{"token": "<t>", "init_word": "shape"}], "train_adapter": True,
                                "lr": 0.1}},
         "textual_inversion.lr is 0.1 and training.lr_unet is 1"),
    ]
    for sections, message in cases:
        with pytest.raises(ConfigError) as caught:
            validate_config(tiny_config(tmp_path, **prodigy, **sections))
        assert str(caught.value).startswith(f"config: {message}"), caught.value
    # another optimizer takes different rates
    validate_config(tiny_config(tmp_path, training={"lr_unet": 1e-3, "lr_text_encoder_1": 5e-4}))
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, **cases[0][0], **prodigy))
    assert train_sdxl.main(["--config", str(path), "--dry-run"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and cases[0][1] in error and "Traceback" not in error, error


@pytest.mark.slow
def test_prodigy_follows_its_authors_advice_and_logs_its_own_step_size(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """Bias correction and the warmup safeguard are on unless optimizer.args says otherwise (without
    the correction the quickstart's 600 steps broke the model: docs/training.md), and lr/unet is
    the step size Prodigy takes (its estimate d times the rate), not the rate."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sdxl_trainer.checkpointing import load_state

    def group_of(args: dict) -> dict:
        params = [torch.nn.Parameter(torch.zeros(2))]
        optimizer = make_optimizer(OptimizerConfig(type="prodigy", args=args), [{"params": params, "lr": 1.0}])
        return optimizer.param_groups[0]

    assert group_of({})["use_bias_correction"] and group_of({})["safeguard_warmup"]
    assert not group_of({"use_bias_correction": False, "safeguard_warmup": False})["use_bias_correction"]
    half = {"lr_unet": 0.5, "lr_text_encoder_1": 0.5, "num_steps": 4, "log_every": 4}
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, optimizer={"type": "prodigy"}, training=half))
    assert train_sdxl.main(["--config", str(path)]) == 0
    state = load_state(tmp_path / "out" / "test_run" / "trainer_state.pt")  # after the last step
    group = state.snapshot.optimizer["param_groups"][0]
    assert group["use_bias_correction"] and group["safeguard_warmup"] and group["lr"] == 0.5
    events = EventAccumulator(str(tmp_path / "tb" / "test_run"))
    events.Reload()
    assert events.Scalars("lr/unet")[-1].value == pytest.approx(0.5 * group["d"])  # d: 1e-6 at first, growing


@pytest.mark.slow
def test_arguments_and_combinations_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    check_optimizer(OptimizerConfig(type="prodigy", args={"d_coef": 0.5}))
    with pytest.raises(ConfigError, match=r'args\.d_cof: not an argument of prodigy \(did you mean "d_coef"'):
        check_optimizer(OptimizerConfig(type="prodigy", args={"d_cof": 0.5}))
    with pytest.raises(ConfigError, match=r"optimizer\.args\.lr is set by the trainer"):
        check_optimizer(OptimizerConfig(type="came", args={"lr": 1.0}))
    with pytest.raises(ConfigError, match='is "cosine_decay", but schedule-free AdamW replaces the decay'):
        validate_config(tiny_config(tmp_path, optimizer={"type": "adamw_schedulefree"},
                                    training={"lr_scheduler": {"type": "cosine_decay"}}))
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path, optimizer={"type": "prodigy"}))
    assert train_sdxl.main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "warning: Prodigy's learning rates multiply its own step size; 0.001 makes its steps 1,000 times" in out
    assert "optimizer: prodigy, use_bias_correction=True, safeguard_warmup=True\n" in out  # what it will run with
