"""Datasets as users bring them: subsets with repeats, regularization images, masked loss,
metadata.jsonl and file-name captions, and a held-out validation set."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

import dataset
from sdxl_trainer.config import Config, ConfigError, DataConfig, ModelConfig
from sdxl_trainer.diffusion import (
    DrawSettings,
    LossModels,
    LossSettings,
    diffusion_loss,
    make_noise_scheduler,
    sample_draws,
)
from sdxl_trainer.eval.evaluator import validation_batches
from sdxl_trainer.latent_cache import LatentCache
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.planning import plan_run
from tests.helpers import DATA_DIR, tiny_config, train_here, write_config
from tests.test_resume import final_weights

BUCKETS = {"resolutions": [[64, 64], [96, 64], [64, 96]], "divisible_by": 32, "batch_size": 2}


def make_folder(folder: Path, count: int, prefix: str, alpha: bool = False, size=(80, 64)) -> list[Path]:
    """`count` images with captions; with `alpha` the left half of each is transparent."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = folder / f"{prefix}_{index}.png"
        image = Image.new("RGBA" if alpha else "RGB", size, (40 * index % 255, 120, 200, 255)[: 4 if alpha else 3])
        if alpha:
            image.paste((0, 0, 0, 0), (0, 0, size[0] // 2, size[1]))
        image.save(path)
        path.with_suffix(".txt").write_text(f"{prefix} {index}, red, blue", encoding="utf-8")
        paths.append(path)
    return paths


def plan_of(data: dict, batch_size: int = 1, **settings) -> dataset.DatasetPlan:
    config = DataConfig(size=64, bucket=BUCKETS, latent_cache={"enabled": False}, **data)
    return dataset.plan_dataset(config, batch_size, settings=dataset.EpochSettings(**settings))


# ------------------------------------------------------------------------------ repeats and reg
def test_repeats_set_how_often_each_image_is_seen_per_epoch(tmp_path: Path) -> None:
    make_folder(tmp_path / "character", 3, "char")
    make_folder(tmp_path / "style", 4, "style")
    plan = plan_of({"subsets": [{"image_dir": str(tmp_path / "character"), "repeats": 5},
                                {"image_dir": str(tmp_path / "style")}]})
    for epoch in (0, 1):
        seen = Counter(plan.samples[i].record.path.stem.split("_")[0]
                       for batch in plan.sampler(seed=3).batches(epoch) for i in batch)
        assert seen == {"char": 15, "style": 4}
        per_image = Counter(plan.samples[i].record.path.name for batch in plan.sampler(seed=3).batches(epoch)
                            for i in batch)
        assert {per_image[f"char_{i}.png"] for i in range(3)} == {5}
    assert "subset 1" in plan.report() and "3 image(s) x 5 repeats = 15 per epoch" in plan.report()


def test_regularization_images_fill_the_epoch_and_carry_the_prior_loss_weight(tmp_path: Path) -> None:
    make_folder(tmp_path / "train", 4, "train")
    make_folder(tmp_path / "reg", 3, "reg")
    plan = plan_of({"subsets": [{"image_dir": str(tmp_path / "train"), "repeats": 2},
                                {"image_dir": str(tmp_path / "reg"), "is_reg": True, "loss_weight": 0.5}]},
                   prior_loss_weight=0.4)
    reg = [sample for sample in plan.samples if sample.folder.is_reg]
    assert len(plan.samples) == 16 and len(reg) == 8  # as many as the 4 x 2 training samples
    assert sorted(Counter(sample.record.path.name for sample in reg).values()) == [2, 3, 3]  # cycling
    items = dataset.ImageCaptionDataset(plan.samples, DataConfig(size=64), seed=0)
    batch = dataset.collate([items[(index, 0)] for index in range(len(plan.samples))])
    weights = {path: weight for path, weight in zip(batch["paths"], batch["loss_weights"].tolist(), strict=True)}
    assert weights[str(tmp_path / "reg" / "reg_0.png")] == pytest.approx(0.5 * 0.4)
    assert weights[str(tmp_path / "train" / "train_0.png")] == 1.0
    assert "regularization: 8 of each epoch's 16 samples" in plan.report()


def test_sample_weights_scale_each_images_loss() -> None:
    from diffusers import DDPMScheduler

    from sdxl_trainer.diffusion import per_sample_loss, weighted_loss

    generator = torch.Generator().manual_seed(0)
    prediction, target = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8, generator=generator)
    plain = per_sample_loss(prediction, target, "l2")
    loss = weighted_loss(DDPMScheduler(), prediction, target, torch.tensor([10, 500]), LossSettings(),
                         {"loss_weights": torch.tensor([1.0, 0.25])})
    assert loss.item() == pytest.approx((plain[0] + 0.25 * plain[1]).item() / 2, rel=1e-6)


# ----------------------------------------------------------------------------------------- masks
@pytest.fixture(scope="module")
def pipe(tiny_sdxl_dir: Path):
    return load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))


def output_gradient(pipe, batch: dict, settings: LossSettings) -> torch.Tensor:
    """d loss / d UNet output for one batch through the real loss."""
    captured = {}

    def unet(*args, **kwargs):
        output = pipe.unet(*args, **kwargs)
        output.sample.retain_grad()
        captured["sample"] = output.sample
        return output

    height, width = batch["target_sizes"][0].tolist()
    draws = sample_draws(batch["keys"], 0, (len(batch["keys"]), 4, height // 8, width // 8), DrawSettings())
    models = LossModels(pipe, unet, [pipe.text_encoder, pipe.text_encoder_2])
    scheduler = make_noise_scheduler(pipe.scheduler.config, None, False)  # what training builds
    diffusion_loss(models, scheduler, batch, draws, "cpu", settings).backward()
    return captured["sample"].grad


def test_a_masked_out_latent_pixel_gets_no_gradient_and_the_mask_follows_the_flip(tmp_path: Path, pipe) -> None:
    make_folder(tmp_path / "masked", 1, "cut", alpha=True, size=(64, 64))
    plan = plan_of({"image_dir": str(tmp_path / "masked"), "alpha_mask": True})
    data = DataConfig(size=64, random_flip=True, latent_cache={"enabled": False})
    items = dataset.ImageCaptionDataset(plan.samples, data, seed=0)
    by_flip = {}
    for epoch in range(8):  # the transparent left half is composited onto white: pixels say if it was mirrored
        sample = items[(0, epoch)]
        by_flip.setdefault(bool(sample["pixel_values"][0, 0, 0] < 0.9), sample)
    assert set(by_flip) == {False, True}
    plain = by_flip[False]
    assert plain["mask"].shape == (1, 8, 8)  # the latent grid
    assert plain["mask"][0, :, :4].max() == 0.0 and plain["mask"][0, :, 4:].min() == 1.0
    assert torch.equal(by_flip[True]["mask"], plain["mask"].flip(-1))  # mirrored with the image

    batch = dataset.collate([plain])
    gradient = output_gradient(pipe, batch, LossSettings())
    assert gradient[..., :4].abs().max() == 0.0 and gradient[..., 4:].abs().min() > 0.0
    with_floor = output_gradient(pipe, batch, LossSettings(unmasked_weight=0.1))
    assert with_floor[..., :4].abs().min() > 0.0  # the unmasked part keeps a tenth of its weight
    batch["masks"] = torch.ones_like(batch["masks"])
    assert output_gradient(pipe, batch, LossSettings())[..., :4].abs().min() > 0.0  # another mask, another gradient


def test_mask_files_are_matched_by_name_and_bad_ones_skip_their_image(tmp_path: Path) -> None:
    images = make_folder(tmp_path / "images", 4, "img")
    masks = tmp_path / "masks"
    masks.mkdir()
    Image.new("L", (80, 64), 255).save(masks / "img_0.png")
    Image.new("L", (80, 64), 0).save(masks / "img_1.jpg")  # any image extension
    Image.new("L", (40, 32), 255).save(masks / "img_2.png")  # the wrong size
    (masks / "img_3.png").write_bytes(b"not a png")  # unreadable
    plan = plan_of({"image_dir": str(tmp_path / "images"), "mask_dir": str(masks)})
    assert [record.path for record in plan.scan.images] == images[:2]
    assert [record.mask_path for record in plan.scan.images] == [masks / "img_0.png", masks / "img_1.jpg"]
    reasons = dict(plan.scan.skipped)
    assert "is 40x32, the image 80x64" in reasons[images[2]] and "not an image" in reasons[images[3]]
    shutil.rmtree(masks)
    masks.mkdir()
    plan = plan_of({"image_dir": str(tmp_path / "images"), "mask_dir": str(masks)})
    assert not plan.scan.images and all("no mask for it" in reason for _, reason in plan.scan.skipped)


def test_a_subsets_own_mask_source_replaces_the_one_it_would_take_from_data(tmp_path: Path) -> None:
    make_folder(tmp_path / "cut", 1, "cut", alpha=True)
    plain = make_folder(tmp_path / "plain", 1, "plain")
    (tmp_path / "masks").mkdir()
    Image.new("L", (80, 64), 255).save(tmp_path / "masks" / plain[0].name)
    plan = plan_of({"mask_dir": str(tmp_path / "masks"), "subsets": [
        {"image_dir": str(tmp_path / "cut"), "alpha_mask": True},  # its alpha instead of data.mask_dir
        {"image_dir": str(tmp_path / "plain")},  # takes data.mask_dir
        {"image_dir": str(tmp_path / "cut"), "mask_dir": ""}]})  # no mask at all
    masks = {(record.subset, record.path.stem): record.mask for record in plan.scan.images}
    assert masks[(0, "cut_0")] == "alpha" and len(masks[(1, "plain_0")]) == 64 and masks[(2, "cut_0")] == ""
    plan = plan_of({"alpha_mask": True, "subsets": [
        {"image_dir": str(tmp_path / "plain"), "mask_dir": str(tmp_path / "masks")}]})
    assert [record.mask_path for record in plan.scan.images] == [tmp_path / "masks" / plain[0].name]


def test_an_edited_image_or_mask_changes_only_its_own_cache_entries(tmp_path: Path, pipe) -> None:
    make_folder(tmp_path / "images", 4, "img")
    masks = tmp_path / "masks"
    masks.mkdir()
    for index in range(4):
        Image.new("L", (80, 64), 255 if index % 2 else 128).save(masks / f"img_{index}.png")
    data = {"image_dir": str(tmp_path / "images"), "mask_dir": str(masks), "random_flip": True}
    config = DataConfig(size=64, bucket=BUCKETS, **data)
    cache = LatentCache(tmp_path / "cache", "vae", "fp32", "sample", "fp32")
    dataset.build_latent_cache(dataset.plan_dataset(config, 1), config, cache, pipe.vae, "cpu")
    cached = dataset.ImageCaptionDataset(dataset.plan_dataset(config, 1).samples, config, 0, cache)[(0, 0)]
    assert cached["mask"].shape == (1, 8, 12) and cached["mask"].max() == pytest.approx(128 / 255, abs=1e-6)

    Image.new("RGB", (80, 64), (1, 2, 3)).save(tmp_path / "images" / "img_1.png")
    edited_mask = Image.new("L", (80, 64), 0)
    edited_mask.paste(255, (0, 0, 40, 64))
    edited_mask.save(masks / "img_2.png")
    views = dataset.cache_views(dataset.plan_dataset(config, 1), config)
    missing = set(cache.missing(key for _, key, _ in views))
    assert sorted({sample.record.path.name for sample, key, _ in views if key in missing}) == ["img_1.png", "img_2.png"]
    assert len(missing) == 4  # two images, each plain and mirrored


# ------------------------------------------------------------------------------------- captions
def test_metadata_captions_reach_the_text_encoder(tmp_path: Path, pipe) -> None:
    folder = tmp_path / "hf"
    make_folder(folder / "part", 2, "img")
    for path in (folder / "part").glob("*.txt"):
        path.unlink()
    lines = [{"file_name": "part/img_0.png", "text": "a photo of sks dog"}, {"file_name": "part/img_1.png"}]
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    plan = plan_of({"image_dir": str(folder), "recursive": True, "caption_source": "metadata"})
    assert [record.caption for record in plan.scan.images] == ["a photo of sks dog", ""]
    seen = []
    hook = pipe.text_encoder.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    try:
        items = dataset.ImageCaptionDataset(plan.samples, DataConfig(size=64), seed=0)
        output_gradient(pipe, dataset.collate([items[(0, 0)]]), LossSettings())
    finally:
        hook.remove()
    assert pipe.tokenizer.decode(seen[0][0], skip_special_tokens=True) == "a photo of sks dog"


def test_a_byte_order_mark_is_not_part_of_a_caption(tmp_path: Path) -> None:
    path = make_folder(tmp_path / "notepad", 1, "img")[0]
    path.with_suffix(".txt").write_text("sks dog, red", encoding="utf-8-sig")  # "UTF-8 with BOM"
    assert plan_of({"image_dir": str(tmp_path / "notepad")}).scan.images[0].caption == "sks dog, red"
    line = json.dumps({"file_name": path.name, "text": "sks cat"})
    (tmp_path / "notepad" / "metadata.jsonl").write_text(line + "\n", encoding="utf-8-sig")
    plan = plan_of({"image_dir": str(tmp_path / "notepad"), "caption_source": "metadata"})
    assert plan.scan.images[0].caption == "sks cat"


@pytest.mark.slow
def test_file_name_captions_and_a_bad_metadata_line(tmp_path: Path) -> None:
    folder = tmp_path / "named"
    folder.mkdir()
    Image.new("RGB", (64, 64)).save(folder / "red_car_at_night.png")
    assert plan_of({"image_dir": str(folder), "caption_source": "filename"}).scan.images[0].caption == \
        "red car at night"
    (folder / "metadata.jsonl").write_text('{"file_name": "red_car_at_night.png", "text": "x"}\n{oops\n')
    config = tiny_config(tmp_path, data={"image_dir": str(folder), "caption_source": "metadata"})
    result = train_here("--dry-run", "--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 2 and "metadata.jsonl, line 2: not JSON" in result.stderr
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------------------------- validation
def test_held_out_images_never_appear_in_a_training_batch(tmp_path: Path) -> None:
    data = {"image_dir": str(DATA_DIR), "validation_split": 0.25}
    plan = plan_of(data, split_seed=5)
    held_out = {sample.record.path for sample in plan.validation}
    assert len(held_out) == 4 and len(plan.samples) == 14  # round(0.25 x 18) of the 18 images
    for epoch in range(3):
        trained = {plan.samples[i].record.path for batch in plan.sampler(seed=1).batches(epoch) for i in batch}
        assert trained and not trained & held_out
    assert {sample.record.path for sample in plan_of(data, split_seed=5).validation} == held_out  # same seed
    assert {sample.record.path for sample in plan_of(data, split_seed=6).validation} != held_out
    config = Config.model_validate(tiny_config(tmp_path, data=data))
    batches = validation_batches(plan, config, seed=0, cache=None)
    assert {Path(path) for batch in batches for path in batch["paths"]} == held_out
    assert "validation: 4 image(s) held out" in plan.report()


def test_a_validation_folder_is_the_validation_set(tmp_path: Path) -> None:
    held = make_folder(tmp_path / "val", 3, "val")
    plan = plan_of({"image_dir": str(DATA_DIR), "validation_dir": str(tmp_path / "val")})
    assert len(plan.samples) == 18 and sorted(s.record.path for s in plan.validation) == held
    assert f"validation: 3 image(s) in data.validation_dir {tmp_path / 'val'}, never trained on" in plan.composition
    config = Config.model_validate(tiny_config(tmp_path))
    paths = [path for batch in validation_batches(plan, config, 0, None) for path in batch["paths"]]
    assert sorted(paths) == [str(path) for path in held]


def test_a_validation_folder_without_usable_images_is_refused(tmp_path: Path) -> None:
    (tmp_path / "val").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "val" / "only.bmp")  # not an image type the scan reads
    (tmp_path / "val" / "broken.png").write_bytes(b"not a png")
    config = Config.model_validate(tiny_config(tmp_path, data={"validation_dir": str(tmp_path / "val")}))
    with pytest.raises(ConfigError, match=r"^data.validation_dir: no readable images found in .*val; broken.png: "):
        plan_run(config)


# --------------------------------------------------------------------------------------- runs
def subsets_config(tmp_path: Path, root: Path, **training) -> dict:
    config = tiny_config(tmp_path, training={"num_steps": 6, "checkpoint_every": 3, "prior_loss_weight": 0.5,
                                             "unmasked_weight": 0.1, **training})
    del config["data"]["image_dir"]
    config["data"].update({"random_flip": True, "caption_dropout_prob": 0.2, "subsets": [
        {"image_dir": str(root / "alpha"), "alpha_mask": True, "repeats": 3},
        {"image_dir": str(root / "plain"), "mask_dir": str(root / "masks"), "caption_shuffle_prob": 0.5},
        {"image_dir": str(root / "reg"), "is_reg": True},
    ]})
    return config


def make_subset_folders(root: Path) -> None:
    make_folder(root / "alpha", 2, "cut", alpha=True)
    (root / "masks").mkdir(parents=True)
    top_half = Image.new("L", (64, 96), 0)
    top_half.paste(255, (0, 0, 64, 48))
    for path in make_folder(root / "plain", 3, "plain", size=(64, 96)):
        top_half.save(root / "masks" / path.name)
    for index, path in enumerate(sorted(DATA_DIR.glob("*.png"))[:3]):
        (root / "reg").mkdir(exist_ok=True)
        shutil.copy(path, root / "reg" / f"reg_{index}.png")


@pytest.mark.slow
def test_resume_with_subsets_repeats_reg_and_masks_is_bit_exact(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    make_subset_folders(tmp_path / "data")
    straight = subsets_config(tmp_path / "straight", tmp_path / "data")
    result = train_here("--config", str(write_config(tmp_path / "straight.json", straight)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "subset 3" in result.stdout and "(regularization)" in result.stdout
    summary = json.loads((tmp_path / "straight" / "out" / "test_run" / "run_summary.json").read_text())
    assert summary["data"]["samples_per_epoch"] == 18 and [f["samples_per_epoch"] for f in
                                                             summary["data"]["folders"]] == [6, 3, 9]
    checkpoint = tmp_path / "straight" / "out" / "test_run" / "checkpoints" / "checkpoint-3"
    resumed = subsets_config(tmp_path / "resumed", tmp_path / "data", resume_from=str(checkpoint))
    result = train_here("--config", str(write_config(tmp_path / "resumed.json", resumed)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 3" in result.stdout
    first = final_weights(tmp_path / "straight" / "out" / "test_run")
    second = final_weights(tmp_path / "resumed" / "out" / "test_run")
    assert first.keys() == second.keys() and len(first) > 10
    assert [key for key in first if not torch.equal(first[key], second[key])] == []


@pytest.mark.slow
def test_one_folder_as_a_subset_trains_exactly_as_data_image_dir(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    plain = tiny_config(tmp_path / "plain", training={"num_steps": 3})
    as_subset = tiny_config(tmp_path / "subset", training={"num_steps": 3})
    as_subset["data"]["subsets"] = [{"image_dir": as_subset["data"].pop("image_dir")}]
    for name, config in (("plain", plain), ("subset", as_subset)):
        result = train_here("--config", str(write_config(tmp_path / f"{name}.json", config)))
        assert result.returncode == 0, result.stderr[-3000:]
    first = final_weights(tmp_path / "plain" / "out" / "test_run")
    second = final_weights(tmp_path / "subset" / "out" / "test_run")
    assert first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)
