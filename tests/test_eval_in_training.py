"""Evaluation inside a run: images at the right steps, val/loss in TensorBoard, training
untouched by it, and a final eval with broken images fails the run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import ROOT, tiny_config, train_here, write_config

pytestmark = pytest.mark.slow  # every test here trains (make test-fast leaves them out)

PROMPTS = str(ROOT / "tests" / "eval_prompts.three.json")


def eval_config(tmp_path: Path, live: bool, **sections) -> dict:
    config = tiny_config(tmp_path, training={"num_steps": 4, "checkpoint_every": 100}, **sections)
    config["eval"] = {
        "num_inference_steps": 2, "prompts_path": PROMPTS, "width": 64, "height": 64,
        "live": {"enabled": live, "every_n_steps": 2, "max_batches": 2}, "final": {"enabled": True},
    }
    return config


def test_live_eval_writes_images_and_val_loss_without_changing_training(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with_eval, without = tmp_path / "with", tmp_path / "without"
    for folder, live in ((with_eval, True), (without, False)):
        result = train_here("--config", str(write_config(tmp_path / f"{folder.name}.json", eval_config(folder, live))))
        assert result.returncode == 0, result.stderr[-3000:]
    run = with_eval / "out" / "test_run"
    for step in (2, 4):
        names = sorted(p.name for p in (run / "eval" / "live" / f"step_{step}").iterdir())
        assert names == ["00_tok-a-red-circle-blue-background.png",
                         "01_tok-a-yellow-triangle-purple-background.png", "grid.png"]
    assert len(list((run / "eval" / "final").glob("0*.png"))) == 3
    events = EventAccumulator(str(with_eval / "tb" / "test_run"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]
    assert all(0.0 < e.value < 10.0 for e in events.Scalars("val/loss"))
    assert {"eval/live/0", "eval/live/1", "eval/final/2"} <= set(events.Tags()["images"])
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["invalid_eval_images"] == []
    # The training RNG stream is not consumed by eval: the weights are bit-identical.
    first = load_file(run / "pytorch_lora_weights.safetensors")
    second = load_file(without / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_invalid_final_images_fail_the_run(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """A VAE decoder full of NaN (the decoder is never used in training) gives black/NaN images."""
    model = shutil.copytree(tiny_sdxl_dir, tmp_path / "broken-model")
    weights = model / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    tensors["decoder.conv_out.bias"] = torch.full_like(tensors["decoder.conv_out.bias"], float("nan"))
    save_file(tensors, weights)
    config = eval_config(tmp_path, live=False, model={"id": str(model)})
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 1
    assert "3 final eval image(s) are invalid" in result.stderr
    assert "NaN" in result.stderr
    final = tmp_path / "out" / "test_run" / "eval" / "final"
    assert len(list(final.glob("*_INVALID.png"))) == 3
    summary = json.loads((tmp_path / "out" / "test_run" / "run_summary.json").read_text())
    assert summary["status"] == "failed: 3 invalid final eval image(s)"
    assert len(summary["invalid_eval_images"]) == 3
    assert (tmp_path / "out" / "test_run" / "pytorch_lora_weights.safetensors").is_file()  # weights kept


def test_eval_without_prompts_file_is_a_config_error(tmp_path: Path) -> None:
    config = eval_config(tmp_path, live=True)
    config["eval"]["prompts_path"] = None
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 2
    assert "eval.prompts_path is required" in result.stderr
    config["eval"]["prompts_path"] = PROMPTS
    config["eval"]["sampler_name"] = "euler"
    config["eval"]["scheduler"] = "karras-ish"
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 2 and "karras-ish" in result.stderr and "karras" in result.stderr


def test_judging_a_prompts_file_without_a_prompt_in_the_grammar_is_a_config_error(tmp_path: Path) -> None:
    """eval.judge "shapes" on prompts it cannot read printed and logged nothing at all."""
    config = eval_config(tmp_path, live=False)
    config["eval"]["judge"] = "shapes"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": "a blue cross, white gradient background, <shapes>"}]))
    config["eval"]["prompts_path"] = str(prompts)
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert 'eval.judge = "shapes": none of the 1 prompts' in result.stderr and "Traceback" not in result.stderr


def test_an_eval_sampler_that_cannot_follow_the_trained_zero_snr_schedule_stops_the_run_before_training(
        tmp_path: Path) -> None:
    config = eval_config(tmp_path, live=True)
    config["training"].update(prediction_type="v_prediction", zero_terminal_snr=True)
    config["eval"]["sampler_name"] = "deis"  # eval.backend "auto": diffusers (ComfyUI has no deis)
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert 'error: eval.sampler_name = "deis": DEISMultistepScheduler cannot sample the zero' in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "test_run" / "pytorch_lora_weights.safetensors").exists()
