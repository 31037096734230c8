"""The latent cache is content-addressed, never stale, self-repairing and exact."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from safetensors import safe_open

import dataset
from sdxl_trainer.config import DataConfig
from sdxl_trainer.latent_cache import LatentCache, vae_fingerprint, vae_fingerprint_from_files
from tests.helpers import DATA_DIR, tiny_config, write_config


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    shutil.copytree(DATA_DIR, folder)
    return folder


@pytest.fixture(scope="module")
def vae(tiny_sdxl_dir: Path) -> AutoencoderKL:
    return AutoencoderKL.from_pretrained(tiny_sdxl_dir, subfolder="vae").eval()


class CountingVAE:
    """The real VAE, counting how many images its encoder sees."""

    def __init__(self, vae: AutoencoderKL):
        self.vae, self.encoded, self.dtype = vae, 0, vae.dtype

    def encode(self, pixels):
        self.encoded += pixels.shape[0]
        return self.vae.encode(pixels)


def setup(folder: Path, cache_dir: Path, vae: AutoencoderKL, **data) -> tuple:
    cache_settings = {"cache_dir": str(cache_dir), **data.pop("cache", {})}
    config = DataConfig(image_dir=str(folder), size=64, latent_cache=cache_settings,
                        bucket={"resolutions": [[64, 64], [96, 64], [64, 96]], "divisible_by": 32}, **data)
    plan = dataset.plan_dataset(config, batch_size=1)
    vae_id = vae_fingerprint(vae.state_dict().values())
    cache = LatentCache(cache_dir, vae_id, "fp32", config.latent_cache.latents, "fp32")
    return config, plan, cache


def test_second_build_is_all_hits_and_never_encodes(images: Path, tmp_path: Path, vae: AutoencoderKL) -> None:
    config, plan, cache = setup(images, tmp_path / "cache", vae, random_flip=True)
    counting = CountingVAE(vae)
    assert dataset.build_latent_cache(plan, config, cache, counting, "cpu") == (0, 36)  # 18 images, 2 flips each
    assert counting.encoded == 36
    assert dataset.build_latent_cache(plan, config, cache, counting, "cpu") == (36, 0)
    assert counting.encoded == 36


def test_an_edited_image_or_another_vae_misses(images: Path, tmp_path: Path, vae: AutoencoderKL) -> None:
    config, plan, cache = setup(images, tmp_path / "cache", vae)
    dataset.build_latent_cache(plan, config, cache, vae, "cpu")
    edited = images / "shape_03.png"
    image = dataset.load_rgb(edited)
    image.putpixel((0, 0), (1, 2, 3))
    image.save(edited)
    config, plan, cache = setup(images, tmp_path / "cache", vae)
    missing = cache.missing(key for _, key, _ in dataset.cache_views(plan, config))
    assert [key.image_sha256 for key in missing] == [plan.scan.images[3].sha256]

    other = AutoencoderKL.from_config(vae.config)
    other.load_state_dict(vae.state_dict())
    with torch.no_grad():
        other.encoder.conv_in.bias.add_(1e-3)
    _, plan, other_cache = setup(images, tmp_path / "cache", other)
    assert other_cache.vae_id != cache.vae_id
    assert len(other_cache.missing(key for _, key, _ in dataset.cache_views(plan, config))) == 18


def test_a_transparent_image_misses_under_another_background_and_so_does_another_vae_dtype(
        images: Path, tmp_path: Path, vae: AutoencoderKL) -> None:
    """`data.background_color` changes what the VAE sees of an image with transparency: its entries
    miss, an opaque image's stay; a VAE computing in another dtype misses everywhere. Entries of
    opaque images from an fp32 VAE keep the names they had before these keys existed."""
    transparent = images / "shape_03.png"
    image = dataset.load_rgb(transparent).convert("RGBA")
    image.putpixel((0, 0), (0, 0, 0, 0))
    image.save(transparent)
    config, plan, cache = setup(images, tmp_path / "cache", vae)
    dataset.build_latent_cache(plan, config, cache, vae, "cpu")
    black, plan, _ = setup(images, tmp_path / "cache", vae, background_color=[0, 0, 0])
    missing = cache.missing(key for _, key, _ in dataset.cache_views(plan, black))
    assert [key.image_sha256 for key in missing] == [plan.scan.images[3].sha256]

    keys = [key for _, key, _ in dataset.cache_views(plan, config)]
    assert len(LatentCache(cache.cache_dir, cache.vae_id, "fp32", cache.stored, "fp16").missing(keys)) == 18
    opaque = keys[0]
    named = {name: getattr(opaque, name) for name in ("image_sha256", "width", "height", "crop_top", "crop_left",
                                                       "flip")} | {"vae": cache.vae_id, "dtype": "fp32",
                                                                   "stored": cache.stored, "format": 1}
    digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()
    assert cache.path(opaque) == cache.cache_dir / digest[:2] / f"{digest}.safetensors"


def test_a_damaged_entry_is_rebuilt(images: Path, tmp_path: Path, vae: AutoencoderKL) -> None:
    config, plan, cache = setup(images, tmp_path / "cache", vae)
    dataset.build_latent_cache(plan, config, cache, vae, "cpu")
    views = dataset.cache_views(plan, config)
    cache.path(views[0][1]).write_bytes(b"garbage")
    from safetensors.torch import save_file
    save_file({"mean": torch.full((4, 8, 8), float("nan")), "std": torch.ones(4, 8, 8)}, cache.path(views[1][1]))
    counting = CountingVAE(vae)
    assert dataset.build_latent_cache(plan, config, cache, counting, "cpu") == (16, 2)
    assert counting.encoded == 2
    assert cache.load(views[0][1]) is not None and torch.isfinite(cache.load(views[1][1])["mean"]).all()


def entry_bytes(plan, config: DataConfig, cache: LatentCache) -> dict:
    return {key: cache.path(key).read_bytes() for _, key, _ in dataset.cache_views(plan, config)}


def test_an_entry_depends_on_its_key_alone(images: Path, tmp_path: Path, vae: AutoencoderKL) -> None:
    """Built in one go, one view at a time, in a shuffled order, or finished after a kill (every
    other entry missing): the same bytes (batched encodes differed in the last bits)."""
    config, plan, whole = setup(images, tmp_path / "whole", vae, random_flip=True)
    dataset.build_latent_cache(plan, config, whole, vae, "cpu")
    expected = entry_bytes(plan, config, whole)
    assert len(expected) == 36
    _, _, alone = setup(images, tmp_path / "alone", vae, random_flip=True)
    for sample in plan.samples:
        assert dataset.build_latent_cache(replace(plan, samples=[sample]), config, alone, vae, "cpu") == (0, 2)
    _, _, shuffled = setup(images, tmp_path / "shuffled", vae, random_flip=True)
    order = random.Random(3).sample(plan.samples, len(plan.samples))
    dataset.build_latent_cache(replace(plan, samples=order), config, shuffled, vae, "cpu")
    for path in sorted(tmp_path.glob("whole/*/*.safetensors"))[::2]:
        path.unlink()
    assert dataset.build_latent_cache(plan, config, whole, vae, "cpu") == (18, 18)
    for cache in (alone, shuffled, whole):
        assert entry_bytes(plan, config, cache) == expected


def test_a_cached_latent_equals_a_fresh_encode(images: Path, tmp_path: Path, vae: AutoencoderKL) -> None:
    # Batch size 1 on both sides: CPU convolutions differ in the last bits between batch sizes.
    config, plan, cache = setup(images, tmp_path / "cache", vae, cache={"latents": "mode", "build_batch_size": 1})
    dataset.build_latent_cache(plan, config, cache, vae, "cpu")
    view, key, crop = dataset.cache_views(plan, config)[5]
    index = plan.samples.index(view)
    width, height = view.target
    pixels = dataset.to_tensor(dataset.render_view(dataset.load_rgb(view.record.path), crop, width, height))
    with torch.no_grad():
        fresh = vae.encode(pixels[None].float()).latent_dist.mean[0]
    cached = cache.load(key)
    assert set(cached) == {"mean"}
    assert torch.equal(cached["mean"], fresh)
    sample = dataset.ImageCaptionDataset(plan.samples, config, seed=0, cache=cache)[(index, 0)]
    assert "pixel_values" not in sample and torch.equal(sample["latents"], cached["mean"])


def test_distributions_are_sampled_per_epoch_and_half_entries_take_two_bytes(images: Path, tmp_path: Path,
                                                                              vae: AutoencoderKL) -> None:
    config, plan, _ = setup(images, tmp_path / "cache", vae)
    cache = LatentCache(tmp_path / "cache", "some-vae", "fp16", "sample", "fp32")
    dataset.build_latent_cache(plan, config, cache, vae, "cpu")
    _, key, _ = dataset.cache_views(plan, config)[0]
    with safe_open(str(cache.path(key)), "pt") as handle:
        mean = handle.get_tensor("mean")
    assert mean.dtype == torch.float16 and mean.element_size() == 2
    items = dataset.ImageCaptionDataset(plan.samples, config, seed=0, cache=cache)
    assert torch.equal(items[(0, 0)]["latents"], items[(0, 0)]["latents"])  # deterministic
    assert not torch.equal(items[(0, 0)]["latents"], items[(0, 1)]["latents"])  # a new draw each epoch


def test_file_and_module_fingerprints_agree(tiny_sdxl_dir: Path, vae: AutoencoderKL) -> None:
    weights = tiny_sdxl_dir / "vae" / "diffusion_pytorch_model.safetensors"
    assert vae_fingerprint_from_files([weights]) == vae_fingerprint(vae.state_dict().values())


@pytest.mark.slow
def test_training_from_the_cache_never_runs_the_vae_encoder(tmp_path: Path, tiny_sdxl_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import train_sdxl

    config = tiny_config(tmp_path, training={"num_steps": 2})
    config["data"]["latent_cache"] = {"cache_dir": str(tmp_path / "cache")}
    path = write_config(tmp_path / "c.json", config)
    assert train_sdxl.main(["--config", str(path)]) == 0
    assert "latent cache: 0 hits, 18 encoded now" in capsys.readouterr().out

    def no_encoding(*args, **kwargs):
        raise AssertionError("the VAE encoder ran during a cached run")

    monkeypatch.setattr(AutoencoderKL, "encode", no_encoding)
    assert train_sdxl.main(["--config", str(path), "--set", "run.name=second"]) == 0
    output = capsys.readouterr().out
    assert "latent cache: 18 hits, 0 misses" in output and "latent cache: 18 hits, 0 encoded now" in output
