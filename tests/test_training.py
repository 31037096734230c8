"""Training is real: the loss falls, runs write what the output contract promises, and what they
write loads in diffusers (the third-party loader is the judge)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dataset
from sdxl_trainer.config import validate_config
from sdxl_trainer.diffusion import Draws, LossModels, diffusion_loss, make_noise_scheduler
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.optimizers import make_optimizer
from sdxl_trainer.training_setup import prepare_trainable
from tests.helpers import run_cli, tiny_config, train_here, write_config


def fixed_batch(config) -> dict:
    """Two 64x64 images of the sample data, captions as written (no augmentation)."""
    plan = dataset.plan_dataset(config.data, 2)
    images = dataset.ImageCaptionDataset(plan.samples, config.data, seed=0)
    square = [index for index, target in enumerate(plan.targets) if target == (64, 64)][:2]
    return dataset.collate([images[(index, 0)] for index in square])


@pytest.mark.slow
@pytest.mark.parametrize(("adapter_type", "lr"), [("dora", 1e-2), ("none", 1e-4)])
def test_loss_at_fixed_noise_and_timesteps_falls(tmp_path: Path, tiny_sdxl_dir: Path, adapter_type: str, lr: float):
    config = validate_config(tiny_config(
        tmp_path, adapter={"type": adapter_type}, training={"lr_unet": lr, "lr_text_encoder_1": lr},
    ))
    batch = fixed_batch(config)
    pipe = load_pipeline(config.model)
    noise_scheduler = make_noise_scheduler(pipe.scheduler.config, None, False)
    trainable = prepare_trainable(pipe, config)
    optimizer = make_optimizer(config.optimizer, trainable.param_groups())
    noise = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([250, 650])

    posterior_noise = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(5))  # the same VAE sample

    def loss() -> torch.Tensor:
        return diffusion_loss(LossModels.of(pipe), noise_scheduler, batch, Draws(noise, timesteps, posterior_noise),
                              "cpu")

    with torch.no_grad():
        before = loss().item()
    for _ in range(15):  # here 15 steps take it to about 0.35 (DoRA) and 0.30 (full) of where it started
        loss().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        after = loss().item()
    assert after <= 0.7 * before, f"{adapter_type}: loss {before:.4f} -> {after:.4f}"


@pytest.fixture(scope="module")
def dora_run(tmp_path_factory: pytest.TempPathFactory, tiny_sdxl_dir: Path) -> Path:
    """A short DoRA run through the CLI: 6 steps, a checkpoint every 2, keep the newest 2. In a fresh
    interpreter: the run a user starts, and the same-seed test repeats it in this process (two
    processes, the same weights)."""
    tmp_path = tmp_path_factory.mktemp("dora_run")
    config = tiny_config(tmp_path, training={"num_steps": 6, "checkpoint_every": 2, "checkpoints_total_limit": 2})
    result = run_cli("train_sdxl.py", "--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path


@pytest.mark.slow
def test_dora_run_writes_the_output_contract(dora_run: Path) -> None:
    output = dora_run / "out" / "test_run"
    assert (output / "pytorch_lora_weights.safetensors").is_file()
    checkpoints = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint-2", "checkpoint-4"]  # 6 is the final output, limit 2 kept
    assert (output / "checkpoints" / "checkpoint-4" / "pytorch_lora_weights.safetensors").is_file()
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6 and summary["images"] == 18
    assert not [p for p in output.rglob("*") if p.name.startswith(".")], "temporary files left behind"


@pytest.mark.slow
def test_dora_output_loads_in_diffusers_and_generates(dora_run: Path, tiny_sdxl_dir: Path) -> None:
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    base_unet = pipe.unet.down_blocks[1].attentions[0].proj_in.weight.detach().clone()
    base_te1 = pipe.text_encoder.encoder.layers[0].self_attn.q_proj.weight.detach().clone()
    pipe.load_lora_weights(dora_run / "out" / "test_run")
    pipe.fuse_lora(lora_scale=1.0)
    # The trained adapter really changes both the UNet and CLIP-L.
    assert not torch.equal(pipe.unet.down_blocks[1].attentions[0].proj_in.weight, base_unet)
    assert not torch.equal(pipe.text_encoder.encoder.layers[0].self_attn.q_proj.weight, base_te1)
    image = pipe("tok, a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.shape == (64, 64, 3)
    assert torch.isfinite(torch.from_numpy(image)).all()


@pytest.mark.slow
def test_tensorboard_event_file_holds_the_training_scalars(dora_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dora_run / "tb" / "test_run"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/grad_norm", "lr/unet", "lr/text_encoder"} <= set(tags)
    losses = events.Scalars("train/loss")
    assert [event.step for event in losses] == [2, 4, 6]
    assert all(0.0 < event.value < 10.0 for event in losses)
    assert events.Scalars("lr/unet")[-1].value == pytest.approx(1e-3)
    assert "run/preflight/text_summary" in events.Tags()["tensors"]  # text is stored as tensors
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


@pytest.mark.slow
def test_same_seed_gives_identical_weights(tmp_path: Path, dora_run: Path) -> None:
    from safetensors.torch import load_file

    config = tiny_config(tmp_path, training={"num_steps": 6, "checkpoint_every": 2, "checkpoints_total_limit": 2})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-3000:]
    first = load_file(dora_run / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    second = load_file(tmp_path / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.slow
def test_full_fine_tune_output_loads_with_from_pretrained(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    from diffusers import StableDiffusionXLPipeline

    config = tiny_config(tmp_path, adapter={"type": "none"}, training={"num_steps": 2, "lr_unet": 1e-4})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-3000:]
    trained = StableDiffusionXLPipeline.from_pretrained(tmp_path / "out" / "test_run")
    base = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    changed = lambda a, b: any(not torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))  # noqa: E731
    assert changed(trained.unet, base.unet)
    assert changed(trained.text_encoder, base.text_encoder)  # train_text_encoder_1 is on
    assert not changed(trained.text_encoder_2, base.text_encoder_2)
    assert not changed(trained.vae, base.vae)
    image = trained("tok, a blue square", num_inference_steps=2, height=64, width=64, output_type="np").images[0]
    assert torch.isfinite(torch.from_numpy(image)).all()
