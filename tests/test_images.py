"""Every kind of image a user brings is used correctly or skipped with its reason; one bad file
never stops a run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dataset
from sdxl_trainer.config import DataConfig
from tests.helpers import tiny_config, train_here, write_config

BACKGROUND = (10, 200, 30)


def save(folder: Path, name: str, image: Image.Image, caption: str | None = "tok, a test image", **kwargs) -> Path:
    path = folder / name
    image.save(path, **kwargs)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def zoo(tmp_path: Path) -> Path:
    """One folder with every mode and kind of damage."""
    folder = tmp_path / "zoo"
    folder.mkdir()
    save(folder, "rgb.png", Image.new("RGB", (96, 64), (200, 10, 10)))
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 0))  # fully transparent red
    save(folder, "rgba.png", rgba)
    palette = Image.new("P", (64, 64), 0)
    palette.putpalette([255, 0, 0] + [0, 0, 255] * 255)
    save(folder, "palette.png", palette, transparency=0)  # index 0 (red) is transparent
    save(folder, "gray.png", Image.new("L", (64, 96), 128))
    save(folder, "gray_alpha.png", Image.new("LA", (64, 64), (0, 0)))
    sixteen = Image.fromarray(np.full((64, 64), 65535, dtype=np.uint16))
    save(folder, "sixteen_bit.png", sixteen)
    save(folder, "cmyk.jpg", Image.new("CMYK", (64, 64), (0, 255, 255, 0)))  # red in CMYK
    rotated = Image.new("RGB", (96, 64), (0, 0, 200))
    exif = rotated.getexif()
    exif[0x0112] = 6
    save(folder, "rotated.jpg", rotated, exif=exif)
    save(folder, "tiny.png", Image.new("RGB", (8, 8), (0, 255, 0)))
    save(folder, "webp.webp", Image.new("RGB", (64, 64), (0, 100, 0)))
    (folder / "png_named.jpg").write_bytes(png_bytes(Image.new("RGB", (64, 64), (1, 2, 3))))  # wrong extension
    (folder / "png_named.txt").write_text("tok, misnamed", encoding="utf-8")
    save(folder, "no_caption.png", Image.new("RGB", (64, 64)), caption=None)
    # Damage:
    (folder / "zero.png").write_bytes(b"")
    (folder / "not_an_image.png").write_text("hello", encoding="utf-8")
    full = png_bytes(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)))
    (folder / "truncated.png").write_bytes(full[: len(full) // 2])
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    (folder / "truncated.jpg").write_bytes(buffer.getvalue()[:400])
    save(folder, "huge.png", Image.new("1", (4000, 3000)))  # 12 Mpx: over the limit set below
    (folder / "bad_caption.png").write_bytes(png_bytes(Image.new("RGB", (64, 64))))
    (folder / "bad_caption.txt").write_bytes(b"\xff\xfe\xfa not utf-8")
    return folder


def zoo_config(folder: Path) -> DataConfig:
    return DataConfig(
        image_dir=str(folder), size=64, max_image_pixels=1_000_000, background_color=BACKGROUND,
        bucket={"resolutions": [[64, 64], [96, 64], [64, 96]], "divisible_by": 32},
    )


def test_every_mode_is_used_and_every_damage_skipped_with_its_reason(zoo: Path) -> None:
    report = dataset.scan_images(zoo_config(zoo))
    used = {record.path.name for record in report.images}
    assert used == {"rgb.png", "rgba.png", "palette.png", "gray.png", "gray_alpha.png", "sixteen_bit.png",
                    "cmyk.jpg", "rotated.jpg", "tiny.png", "webp.webp", "png_named.jpg", "no_caption.png"}
    reasons = {path.name: reason for path, reason in report.skipped}
    assert reasons["zero.png"] == "empty file (0 bytes)"
    assert reasons["not_an_image.png"] == "not an image (PIL recognises no image format in it)"
    assert reasons["truncated.png"].startswith("cannot read image")
    assert reasons["truncated.jpg"].startswith("cannot read image")
    assert reasons["huge.png"].startswith("too large: 4000x3000")
    assert reasons["bad_caption.png"] == "caption bad_caption.txt is not UTF-8 text"
    assert [path.name for path in report.missing_captions] == ["no_caption.png"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("rgba.png", BACKGROUND),  # transparent pixels show the background, not the hidden red
        ("palette.png", BACKGROUND),
        ("gray_alpha.png", BACKGROUND),
        ("gray.png", (128, 128, 128)),
        ("sixteen_bit.png", (255, 255, 255)),  # 65535 is white, not clipped garbage
        ("cmyk.jpg", (255, 0, 0)),
    ],
)
def test_modes_convert_to_the_right_rgb(zoo: Path, name: str, expected: tuple[int, int, int]) -> None:
    pixel = dataset.load_rgb(zoo / name, BACKGROUND).getpixel((5, 5))
    assert all(abs(a - b) <= 3 for a, b in zip(pixel, expected, strict=True)), pixel


def test_a_16_bit_mask_is_scaled_not_clipped(tmp_path: Path) -> None:
    path = save(tmp_path, "mask.png", Image.fromarray(np.full((64, 64), 32768, dtype=np.uint16)), caption=None)
    mask = dataset.load_mask(path, alpha=False)
    assert mask.mode == "L" and mask.getpixel((5, 5)) == 128  # half grey, not white
    assert float(dataset.mask_to_latent_grid(mask, 64, 64).mean()) == pytest.approx(128 / 255)


def test_rotated_and_tiny_images_are_planned_correctly(zoo: Path) -> None:
    config = zoo_config(zoo)
    plan = dataset.plan_dataset(config, batch_size=1)
    by_name = {sample.record.path.name: (sample.record, sample.target) for sample in plan.samples}
    record, target = by_name["rotated.jpg"]
    assert (record.width, record.height) == (64, 96) and target == (64, 96)
    upscaled, largest, _, _ = plan.scaling_stats()
    assert upscaled == 1 and largest == pytest.approx(8.0)  # tiny.png: 8x8 -> 64x64
    assert "upscaled: 1 image(s) (up to 8.00x)" in plan.report()


@pytest.mark.slow
def test_a_run_over_damaged_data_proceeds_and_lists_what_it_skipped(zoo: Path, tmp_path: Path,
                                                                    tiny_sdxl_dir: Path) -> None:
    config = tiny_config(tmp_path, training={"num_steps": 2})
    config["data"].update({"image_dir": str(zoo), "max_image_pixels": 1_000_000})
    config["data"]["latent_cache"] = {"cache_dir": str(tmp_path / "cache")}
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "6 skipped" in result.stdout
    summary = json.loads((tmp_path / "out" / "test_run" / "run_summary.json").read_text())
    assert len(summary["skipped_files"]) == 6 and summary["images"] == 12
