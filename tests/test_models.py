"""Model loading: every source goes through one code path and gives the same weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from sdxl_trainer.config import ConfigError, ModelConfig
from sdxl_trainer.models import load_pipeline, resolve_source
from sdxl_trainer.tiny_model import build_pretrained_tiny_sdxl, build_tiny_tokenizers, tiny_sdxl_path


def test_sources_are_classified_without_touching_weights(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    assert resolve_source("builtin:tiny-sdxl").kind == "builtin"
    assert resolve_source(str(tiny_sdxl_dir)).kind == "folder"
    assert resolve_source("stabilityai/stable-diffusion-xl-base-1.0").kind == "hub"
    single = tmp_path / "model.safetensors"
    single.write_bytes(b"")
    assert resolve_source(str(single)).kind == "single_file"
    for bad, message in [
        ("builtin:huge", "unknown built-in model"),
        ("./missing/folder", "no such file or folder"),
        (str(tmp_path / "nope.safetensors"), "no such file or folder"),
        ("not a hub id", "neither a local path nor a hub id"),
    ]:
        with pytest.raises(ConfigError, match=message):
            resolve_source(bad)
    pickle = tmp_path / "model.ckpt"
    pickle.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"only \.safetensors"):
        resolve_source(str(pickle))


def test_tiny_model_has_the_sdxl_topology(tiny_sdxl_dir: Path) -> None:
    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    unet = pipe.unet.config
    assert unet.down_block_types == ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]
    assert unet.up_block_types == ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]
    assert unet.layers_per_block == 2 and unet.addition_embed_type == "text_time"
    te1, te2 = pipe.text_encoder.config.hidden_size, pipe.text_encoder_2.config.hidden_size
    assert te1 != te2, "the two encoders must differ in width, as CLIP-L and bigG do"
    assert unet.cross_attention_dim == te1 + te2
    assert unet.projection_class_embeddings_input_dim == 6 * unet.addition_time_embed_dim + te2
    assert len(pipe.vae.config.block_out_channels) == 4  # latents are H/8 x W/8
    assert pipe.vae.config.scaling_factor == pytest.approx(0.94686, abs=1e-5)  # pretraining: unit-variance latents
    # A real CLIP tokenizer: known words are single tokens, text is wrapped in start/end tokens.
    ids = pipe.tokenizer("a red circle").input_ids
    assert len(ids) == 5 and ids[0] == pipe.tokenizer.bos_token_id and ids[-1] == pipe.tokenizer.eos_token_id
    assert pipe.tokenizer_2.pad_token == "!"


def test_tiny_model_build_is_deterministic(tiny_sdxl_dir: Path) -> None:
    rebuilt = build_pretrained_tiny_sdxl()
    loaded = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        ours, theirs = getattr(rebuilt, name).state_dict(), getattr(loaded, name).state_dict()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
    assert build_tiny_tokenizers()[0].get_vocab() == loaded.tokenizer.get_vocab()


def test_building_the_tiny_model_leaves_the_random_stream_alone(tmp_path: Path) -> None:
    """The run that builds the cache folder (after seeding) must draw what every later run draws:
    the build once reseeded torch, and a fresh cache's first run trained to other weights."""
    torch.manual_seed(7)
    tiny_sdxl_path(tmp_path / "fresh-cache")  # a folder of its own: the session's cache is already built
    after_build = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after_build, torch.rand(4))


def test_local_folder_and_builtin_load_the_same_weights(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_sdxl_dir, tmp_path / "my-sdxl")
    from_folder = load_pipeline(ModelConfig(id=str(copy)))
    builtin = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    assert torch.equal(from_folder.unet.conv_in.weight, builtin.unet.conv_in.weight)
    shutil.rmtree(copy / "text_encoder_2")
    with pytest.raises(ConfigError, match="missing component folder"):
        load_pipeline(ModelConfig(id=str(copy)))


def test_vae_override_from_a_vae_folder(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_sdxl_dir, subfolder="vae")
    with torch.no_grad():
        vae.decoder.conv_out.bias.add_(1.0)  # a recognisably different VAE
    vae.save_pretrained(tmp_path / "better-vae")
    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl", vae=str(tmp_path / "better-vae")))
    assert torch.equal(pipe.vae.decoder.conv_out.bias, vae.decoder.conv_out.bias)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_pipeline(ModelConfig(id="builtin:tiny-sdxl", vae=str(tmp_path / "empty")))


def test_a_damaged_tiny_model_cache_is_rebuilt(tmp_path: Path, tiny_sdxl_dir: Path, capfd) -> None:
    """A cache file cut short failed deep in diffusers (OSError traceback), and one with changed
    bytes loaded other weights silently: the folder is checked against its build's sha256 list."""
    folder = tiny_sdxl_path(tmp_path / "cache")
    unet = folder / "unet" / "diffusion_pytorch_model.safetensors"
    intact = unet.read_bytes()
    for damaged in (intact[:len(intact) // 2], intact[:-64] + bytes(64)):
        unet.write_bytes(damaged)
        assert tiny_sdxl_path(tmp_path / "cache") == folder
        assert unet.read_bytes() == intact
        assert "rebuilding the built-in tiny SDXL's cache folder" in capfd.readouterr().err
    assert tiny_sdxl_path(tmp_path / "cache") == folder and capfd.readouterr().err == ""  # intact: no rebuild
    assert not [path for path in folder.parent.iterdir() if path != folder]  # nothing left beside it
