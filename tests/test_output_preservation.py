"""Output preservation (training.output_preservation): the class words' captions, the base model
as the same model with its adapters off, and a run that keeps what the base model draws for them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_sdxl
from sdxl_trainer.conditioning import add_time_ids, encode_prompts
from sdxl_trainer.config import ConfigError, OutputPreservationConfig, validate_config
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.output_preservation import adapters_off, class_word, preserved_caption, preserved_texts
from sdxl_trainer.training_setup import prepare_trainable
from tests.helpers import tiny_config, write_config

KEPT = {"trigger": "cross", "classes": ["square", "circle"]}


def test_the_trigger_is_replaced_as_a_whole_word_and_the_classes_take_turns() -> None:
    assert preserved_caption("a red cross, blue background", "cross", "square") == "a red square, blue background"
    assert preserved_caption("a red cross and a blue cross, white background", "cross", "circle") == (
        "a red circle and a blue circle, white background")
    assert preserved_caption("crossing, a red crosses", "cross", "square") is None
    assert preserved_caption("<sks>, a dog", "<sks>", "dog") == "dog, a dog"
    settings = OutputPreservationConfig(**KEPT)
    assert [class_word(settings, step) for step in range(5)] == ["square", "circle", "square", "circle", "square"]
    assert preserved_texts(["a red cross, blue background", "a red square, blue background", ""], settings) == {
        "a red square, blue background", "a red circle, blue background"}


def test_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    for sections, key, message in (
        ({"training": {"output_preservation": {"trigger": "cross"}}}, "training.output_preservation.classes",
         "is missing"),
        ({"training": {"output_preservation": {"classes": ["square"]}}}, "training.output_preservation.trigger",
         "is missing"),
        ({"training": {"output_preservation": {"trigger": "cross", "classes": ["cross"]}}},
         "training.output_preservation.classes", "holds the trigger"),
        ({"training": {"output_preservation": KEPT}, "adapter": {"type": "none"}}, "training.output_preservation",
         'adapter.type is "none"'),
        ({"training": {"output_preservation": KEPT},
          "textual_inversion": {"tokens": [{"token": "<x>", "init_word": "red"}]},
          "model": {"train_text_encoder_1": False}}, "training.output_preservation",
         "textual inversion trains alone"),
    ):
        with pytest.raises(ConfigError, match=re.escape(key) + ".*" + re.escape(message)):
            validate_config(tiny_config(tmp_path, **sections))


def _unet_output(pipe, caption: str) -> torch.Tensor:
    """The UNet's prediction for `caption` on fixed noisy latents at a middle timestep."""
    with torch.no_grad():
        hidden, pooled = encode_prompts([caption], [pipe.tokenizer, pipe.tokenizer_2],
                                        [pipe.text_encoder, pipe.text_encoder_2], "cpu")
        sizes = torch.tensor([[64, 64]])
        time_ids = add_time_ids(sizes, torch.tensor([[0, 0]]), sizes)
        noisy = torch.randn(1, pipe.unet.config.in_channels, 8, 8, generator=torch.Generator().manual_seed(3))
        return pipe.unet(noisy, torch.tensor([500]), encoder_hidden_states=hidden,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample


def test_with_its_adapters_off_the_model_is_the_base_model(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    config = validate_config(tiny_config(tmp_path))  # DoRA on the UNet and CLIP-L
    pipe = load_pipeline(config.model)
    base = _unet_output(pipe, "a red square, blue background")
    trainable = prepare_trainable(pipe, config)
    with torch.no_grad():  # an adapter that has trained: every adapter weight moved
        for module in trainable.modules.values():
            for name, parameter in module.named_parameters():
                if "lora_" in name:
                    parameter.add_(0.05 * torch.randn_like(parameter))
    flags = {name: p.requires_grad for module in trainable.modules.values() for name, p in module.named_parameters()}
    adapted = _unet_output(pipe, "a red square, blue background")
    with adapters_off(trainable.modules.values()):
        assert torch.equal(_unet_output(pipe, "a red square, blue background"), base)
    assert (adapted - base).abs().max() > 1e-3
    assert torch.equal(_unet_output(pipe, "a red square, blue background"), adapted)
    assert flags == {name: p.requires_grad for module in trainable.modules.values()
                     for name, p in module.named_parameters()}


def _drift(tmp_path: Path, preservation: dict) -> float:
    """Train DoRA on the crosses for 40 steps; how far the adapted UNet's prediction for square
    captions then is from the base model's (mean squared difference)."""
    config = write_config(tmp_path / "c.json", tiny_config(tmp_path, training={
        "num_steps": 40, "lr_unet": 2e-3, "output_preservation": preservation},
        model={"train_text_encoder_1": False}))
    assert train_sdxl.main(["--config", str(config)]) == 0
    pipe = load_pipeline(validate_config(tiny_config(tmp_path)).model)
    pipe.load_lora_weights(str(tmp_path / "out" / "test_run" / "pytorch_lora_weights.safetensors"))
    captions = ["a red square, blue background", "a white square, green gradient background"]
    adapted = [_unet_output(pipe, caption) for caption in captions]
    with adapters_off([pipe.unet]):
        base = [_unet_output(pipe, caption) for caption in captions]
    return sum(float((a - b).square().mean()) for a, b in zip(adapted, base, strict=True)) / len(captions)


@pytest.mark.slow
def test_preservation_keeps_the_class_words_prediction_near_the_base_models(tmp_path: Path,
                                                                            tiny_sdxl_dir: Path) -> None:
    free = _drift(tmp_path / "free", {})
    kept = _drift(tmp_path / "kept", {"trigger": "cross", "classes": ["square"]})
    assert kept < 0.5 * free, (kept, free)


@pytest.mark.slow
def test_a_preserving_run_says_so_and_resumes_bit_exactly(tmp_path: Path, tiny_sdxl_dir: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    straight = write_config(tmp_path / "s.json", tiny_config(tmp_path / "straight", training={
        "num_steps": 4, "checkpoint_every": 2, "output_preservation": KEPT}))
    assert train_sdxl.main(["--config", str(straight)]) == 0
    assert ("output preservation: captions holding 'cross' read again as 'square' / 'circle' (in turn), pulled to "
            "the base model's prediction (weight 1)") in capsys.readouterr().out
    split = write_config(tmp_path / "p.json", tiny_config(tmp_path / "split", training={
        "num_steps": 2, "checkpoint_every": 2, "output_preservation": KEPT}))
    assert train_sdxl.main(["--config", str(split)]) == 0
    output = tmp_path / "split" / "out" / "test_run"
    assert train_sdxl.main(["--config", str(split), "--set", "training.num_steps=4",
                            "--set", f"training.resume_from={output}"]) == 0
    for name in ("pytorch_lora_weights.safetensors",):
        expected = load_file(tmp_path / "straight" / "out" / "test_run" / name)
        got = load_file(output / name)
        assert expected.keys() == got.keys() and all(torch.equal(expected[key], got[key]) for key in expected)
    plain = write_config(tmp_path / "n.json", tiny_config(tmp_path / "plain", training={"num_steps": 4}))
    assert train_sdxl.main(["--config", str(plain)]) == 0
    other = load_file(tmp_path / "plain" / "out" / "test_run" / "pytorch_lora_weights.safetensors")
    assert any(not torch.equal(other[key], expected[key]) for key in expected)


@pytest.mark.slow
def test_the_memory_plan_counts_the_preservation_passes(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """The step the memory plan traces is the trainer's: with output preservation it holds the
    activations of a second UNet pass with gradients beside the first's."""
    from sdxl_trainer.memory.plan import StepShape, plan_memory

    shape = StepShape(2, 64, 64)
    plain = plan_memory(validate_config(tiny_config(tmp_path)), shape, "cpu")
    kept = plan_memory(validate_config(tiny_config(tmp_path, training={"output_preservation": KEPT})), shape, "cpu")
    assert kept.trained == plain.trained and kept.optimizer_state == plain.optimizer_state
    assert kept.activations > 1.5 * plain.activations, (kept.activations, plain.activations)
