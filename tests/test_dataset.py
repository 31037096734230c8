"""Images, captions and buckets: sizes, crops and batches match the images."""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

import pytest
from PIL import Image

import dataset
from sdxl_trainer.buckets import unmatched_batch_sizes
from sdxl_trainer.config import ConfigError, DataConfig, validate_config
from sdxl_trainer.planning import plan_run
from tests.helpers import tiny_config


def make_images(folder: Path, sizes: list[tuple[int, int]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index, (width, height) in enumerate(sizes):
        Image.new("RGB", (width, height), (index * 20, 100, 200)).save(folder / f"img_{index:02d}.png")
        (folder / f"img_{index:02d}.txt").write_text(f"tok, image {index}, red, blue", encoding="utf-8")


def data_config(folder: Path, **bucket) -> DataConfig:
    return DataConfig(
        image_dir=str(folder), size=64,
        bucket={"resolutions": [[64, 64], [96, 64], [64, 96]], "divisible_by": 32, **bucket},
    )


def test_images_go_to_the_bucket_nearest_their_aspect_ratio(tmp_path: Path) -> None:
    make_images(tmp_path, [(300, 200), (200, 300), (250, 250), (500, 200), (210, 200)])
    plan = dataset.plan_dataset(data_config(tmp_path), batch_size=1)
    assert plan.targets == [(96, 64), (64, 96), (64, 64), (96, 64), (64, 64)]


def test_generated_buckets_keep_the_area_in_both_orientations() -> None:
    resolutions = dataset.bucket_resolutions(DataConfig(size=1024))
    assert (1024, 1024) in resolutions and (832, 1216) in resolutions and (1216, 832) in resolutions
    assert all(w % 64 == 0 and h % 64 == 0 and w * h <= 1024 * 1024 for w, h in resolutions)
    assert all((h, w) in resolutions for w, h in resolutions)


def test_generated_buckets_hold_the_square_even_when_size_is_no_multiple(tmp_path: Path) -> None:
    resolutions = dataset.bucket_resolutions(DataConfig(size=1000))  # sd-scripts: 1000 // 64 * 64
    assert dataset.nearest_bucket(1000, 1000, resolutions) == (960, 960)
    config = tiny_config(tmp_path)
    config["data"].update({"size": 48, "bucket": {"divisible_by": 64}})
    with pytest.raises(ConfigError, match=r"data.size is 48, below data.bucket.divisible_by \(64\)"):
        validate_config(config)


def test_sample_reports_sizes_and_crop_for_sdxl_conditioning(tmp_path: Path) -> None:
    make_images(tmp_path, [(300, 200)])
    plan = dataset.plan_dataset(data_config(tmp_path), batch_size=1)
    sample = dataset.ImageCaptionDataset(plan.samples, data_config(tmp_path), 0)[(0, 0)]
    assert sample["pixel_values"].shape == (3, 64, 96)
    assert str(sample["pixel_values"].dtype) == "torch.float16"
    assert sample["original_size"].tolist() == [200, 300]  # (height, width)
    assert sample["target_size"].tolist() == [64, 96]
    # 300x200 scaled to cover 96x64 is exactly 96x64: nothing to crop.
    assert sample["crop_top_left"].tolist() == [0, 0]
    assert float(sample["pixel_values"].min()) >= -1.0 and float(sample["pixel_values"].max()) <= 1.0


def view(image: Image.Image, width: int, height: int, flip: bool = False, rng=None):
    record = dataset.ImageRecord(Path("x.png"), "", image.width, image.height, "sha")
    crop = dataset.plan_crop(record, width, height, flip, rng)
    return dataset.render_view(image, crop, width, height), crop


def test_center_crop_and_flip_coordinates() -> None:
    cropped, crop = view(Image.new("RGB", (200, 100)), 64, 64)
    assert cropped.size == (64, 64) and (crop.top, crop.left) == (0, 32)  # resized to 128x64, 64 cut off
    two_colors = Image.new("RGB", (201, 100), (255, 0, 0))
    two_colors.paste((0, 0, 255), (100, 0, 201, 100))  # left half red, right half blue
    plain, plain_crop = view(two_colors, 64, 64)
    flipped, flipped_crop = view(two_colors, 64, 64, flip=True)
    # Resized to 129x64; the crop starts at 32 from the left, i.e. at 33 measured from the right.
    assert (plain_crop.left, flipped_crop.top, flipped_crop.left) == (32, 0, 33)
    assert plain.getpixel((0, 32)) == (255, 0, 0) and flipped.getpixel((0, 32)) == (0, 0, 255)


def test_random_crops_stay_inside_and_follow_the_rng() -> None:
    image = Image.new("RGB", (300, 100))
    crops = [view(image, 64, 64, rng=random.Random(seed))[1] for seed in range(30)]
    assert all(0 <= c.crop_left <= 192 - 64 and c.top == 0 for c in crops)
    assert len({c.crop_left for c in crops}) > 5
    assert view(image, 64, 64, rng=random.Random(3))[1] == crops[3]


def test_small_buckets_are_merged_into_the_nearest_full_one(tmp_path: Path) -> None:
    make_images(tmp_path, [(300, 200)] * 4 + [(210, 300)])  # one portrait image, batch size 2
    plan = dataset.plan_dataset(data_config(tmp_path, batch_size=2, drop_last=True), batch_size=1)
    assert plan.targets == [(96, 64)] * 5
    assert plan.notes == ["bucket 64x96: 1 image(s), fewer than its batch size 2: merged into 96x64"]
    assert "merged into 96x64" in plan.report()
    alone = tmp_path / "alone"
    make_images(alone, [(210, 300)])
    plan = dataset.plan_dataset(data_config(alone, batch_size=2, drop_last=True), batch_size=1)
    assert plan.notes == [
        "bucket 64x96: 1 image(s), fewer than its batch size 2: dropped (no other bucket to merge into)"
    ]


def test_batches_never_mix_buckets_and_respect_sizes(tmp_path: Path) -> None:
    make_images(tmp_path, [(300, 200)] * 5 + [(200, 300)] * 4 + [(250, 250)] * 3)
    config = data_config(tmp_path, batch_size=2, drop_last=True, per_resolution_batch_sizes={"64x96": 4})
    plan = dataset.plan_dataset(config, batch_size=1)
    sampler = plan.sampler(seed=3)
    batches = list(sampler)
    for batch in batches:
        assert len({plan.targets[index] for index, _ in batch}) == 1
    sizes = sorted((plan.targets[b[0][0]], len(b)) for b in batches)
    assert sizes == [((64, 64), 2), ((64, 96), 4), ((96, 64), 2), ((96, 64), 2)]  # incomplete batches dropped
    assert [row[4] for row in plan.bucket_rows()] == [1, 0, 1]  # images dropped per bucket
    assert batches == list(plan.sampler(seed=3)), "same seed and epoch must give the same order"
    sampler.set_epoch(1)
    assert list(sampler) != batches


def test_a_per_resolution_batch_size_naming_no_bucket_is_warned_about(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    config["data"]["bucket"]["per_resolution_batch_sizes"] = {"96x64": 1, "96x46": 1, "64x64": 3}
    preflight = plan_run(validate_config(config)).preflight
    assert ("warning: data.bucket.per_resolution_batch_sizes: 96x46 name(s) no bucket of this run, so they set no "
            "batch size") in preflight
    config["data"]["bucket"] = {"enabled": False, "per_resolution_batch_sizes": {"64x64": 1, "1024x1024": 2}}
    assert unmatched_batch_sizes(DataConfig(**config["data"]), [(64, 64), (96, 64)]) == ["1024x1024"]


def test_caption_augmentation_keeps_trigger_words() -> None:
    data = DataConfig(caption_shuffle_prob=1.0, keep_tokens=1, caption_shuffle_min_tokens=2)
    caption = "tok, one, two, three, four, five"
    shuffled = {dataset.augment_caption(caption, data, random.Random(seed)) for seed in range(20)}
    assert len(shuffled) > 1
    for text in shuffled:
        parts = text.split(", ")
        assert parts[0] == "tok" and sorted(parts) == sorted(caption.split(", "))
    dropped = DataConfig(caption_dropout_prob=1.0)
    assert dataset.augment_caption(caption, dropped, random.Random(0)) == ""


@pytest.mark.parametrize("orientation", [6, 8])
def test_exif_rotation_swaps_the_reported_size(tmp_path: Path, orientation: int) -> None:
    image = Image.new("RGB", (300, 200))
    exif = image.getexif()
    exif[0x0112] = orientation
    image.save(tmp_path / "rotated.jpg", exif=exif)
    record = dataset.scan_images(DataConfig(image_dir=str(tmp_path))).images[0]
    assert (record.width, record.height) == (200, 300)
    assert dataset.load_rgb(record.path).size == (200, 300)


def test_dataset_py_only_re_exports_the_package() -> None:
    """`import dataset` is the user's interface; the code lives in `sdxl_trainer`, which never
    imports the top-level script."""
    tree = ast.parse(Path(dataset.__file__).read_text(encoding="utf-8"))
    assert {type(node).__name__ for node in tree.body} <= {"Expr", "ImportFrom", "Assign"}
    assert all(hasattr(dataset, name) for name in dataset.__all__)
    package = Path(dataset.__file__).parent / "sdxl_trainer"
    for path in package.rglob("*.py"):
        assert not re.search(r"^\s*(import|from) dataset\b", path.read_text(encoding="utf-8"), re.M), path
