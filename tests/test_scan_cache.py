"""The scan cache: a second start decodes nothing it has seen, yet never answers with a stale
result, and a damaged cache costs a rescan, never a crash; the 1/8-scale JPEG check still rejects
every truncated file that a full decode rejects."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdxl_trainer import scan_cache
from sdxl_trainer.config import DataConfig
from sdxl_trainer.images import check_image, inspect_image, load_mask, load_rgb
from sdxl_trainer.scan import scan_images
from sdxl_trainer.scan_cache import cache_path, inspect_images, load


def photo(seed: int, width: int = 256, height: int = 192) -> Image.Image:
    """Noisy, so that its JPEG has a long entropy-coded stream to cut."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def make_folder(folder: Path) -> list[Path]:
    """Good images of each format, an EXIF-rotated one, a large one, and each kind of damage."""
    folder.mkdir(parents=True, exist_ok=True)
    rotated = photo(1, 96, 64)
    exif = rotated.getexif()
    exif[0x0112] = 6
    files = {
        "a.jpg": encoded(photo(0), "JPEG", quality=90),
        "b.png": encoded(photo(2, 64, 64), "PNG"),
        "c.webp": encoded(photo(3, 64, 64), "WEBP"),
        "d_rotated.jpg": encoded(rotated, "JPEG", exif=exif),
        "e_large.png": encoded(Image.new("L", (400, 300)), "PNG"),
        "f_truncated.jpg": encoded(photo(4), "JPEG")[:-300],
        "g_truncated.png": encoded(photo(5, 64, 64), "PNG")[:2000],
        "h_truncated.webp": encoded(photo(6, 64, 64), "WEBP")[:500],
        "i_empty.png": b"",
        "j_text.png": b"hello",
    }
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return sorted(folder / name for name in files)


def rewrite_keeping_stamp(path: Path, content: bytes) -> None:
    """New bytes of the same length in the same inode, with the old mtime put back: what only a
    scan that trusted its cache could miss."""
    status = path.stat()
    assert len(content) == status.st_size
    with open(path, "r+b") as handle:
        handle.write(content)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))


def test_results_equal_inspect_image_with_and_without_the_cache(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    paths = make_folder(tmp_path / "images")
    expected = [inspect_image(path, 50_000) for path in paths]
    assert [type(v) for v in expected].count(tuple) == 4 and expected[3][:2] == (64, 96)  # the rotated one
    assert expected[4] == "too large: 400x300 is over data.max_image_pixels=50000"
    assert all(v.startswith("cannot read image") for v in expected[5:8])
    assert inspect_images(paths, 50_000, None, workers=2) == expected
    assert "inspecting 10 new or changed images" in capfd.readouterr().err
    cache = tmp_path / "cache"
    assert inspect_images(paths, 50_000, cache, workers=2) == expected  # cold
    assert inspect_images(paths, 50_000, cache, workers=1) == expected  # warm
    assert "inspecting 10" in capfd.readouterr().err


def test_a_second_scan_decodes_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    paths = make_folder(tmp_path / "images")
    cache = tmp_path / "cache"
    cold = inspect_images(paths, 50_000, cache, workers=2)
    assert "inspecting 10 new or changed images" in capfd.readouterr().err
    for path in paths:  # every file now fails to decode, but looks unchanged
        rewrite_keeping_stamp(path, b"\0" * path.stat().st_size)
    assert inspect_images(paths, 50_000, cache, workers=2) == cold
    assert "inspecting" not in capfd.readouterr().err  # no progress bar: nothing was inspected


def test_scans_of_other_files_in_the_same_folder_keep_each_others_entries(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    paths = make_folder(tmp_path / "images")
    cache = tmp_path / "cache"
    first = inspect_images(paths[:3], 50_000, cache, workers=1)
    inspect_images(paths[3:], 50_000, cache, workers=1)  # one cache file: the same folder
    capfd.readouterr()
    for path in paths:
        rewrite_keeping_stamp(path, b"\0" * path.stat().st_size)
    assert inspect_images(paths[:3], 50_000, cache, workers=1) == first
    assert "inspecting" not in capfd.readouterr().err


def test_an_edited_image_is_inspected_again(tmp_path: Path) -> None:
    paths = make_folder(tmp_path / "images")
    cache = tmp_path / "cache"
    before = inspect_images(paths, 50_000, cache, workers=1)
    edited = encoded(photo(7, 128, 160), "JPEG")
    paths[0].write_bytes(edited)
    os.utime(paths[0], ns=(1, paths[0].stat().st_mtime_ns + 1_000_000_000))
    after = inspect_images(paths, 50_000, cache, workers=1)
    assert after[0] == (128, 160, inspect_image(paths[0], 50_000)[2], False) and after[0] != before[0]
    assert after[1:] == before[1:]
    assert load(cache_path([str(path) for path in paths], cache))[os.path.abspath(paths[0])][0][0] == len(edited)


def test_a_file_replaced_with_the_same_size_and_mtime_is_inspected_again(tmp_path: Path) -> None:
    paths = make_folder(tmp_path / "images")
    cache = tmp_path / "cache"
    before = inspect_images(paths, 50_000, cache, workers=1)[1]
    status = paths[1].stat()
    other = encoded(photo(8, 48, 48), "PNG")  # a new file renamed over the old one: a new inode
    replacement = tmp_path / "replacement.png"
    replacement.write_bytes(other + b"\0" * (status.st_size - len(other)))
    os.utime(replacement, ns=(status.st_atime_ns, status.st_mtime_ns))
    os.replace(replacement, paths[1])
    assert (paths[1].stat().st_size, paths[1].stat().st_mtime_ns) == (status.st_size, status.st_mtime_ns)
    after = inspect_images(paths, 50_000, cache, workers=1)[1]
    assert after == inspect_image(paths[1], 50_000) and after[:2] == (48, 48) and before[:2] == (64, 64)


@pytest.mark.parametrize("damage", [b"", b"\x00\xff not json", b'{"format": "sdxl-trainer scan cache 1", "fi',
                                    b"[1, 2]", b'{"format": "sdxl-trainer scan cache 1", "files": {"x": [1, 2]}}'])
def test_a_damaged_cache_file_is_rebuilt(tmp_path: Path, damage: bytes) -> None:
    paths = make_folder(tmp_path / "images")
    cache = tmp_path / "cache"
    expected = inspect_images(paths, 50_000, cache, workers=1)
    cache_file = cache_path([str(path) for path in paths], cache)
    cache_file.write_bytes(damage)
    assert load(cache_file) == {}
    assert inspect_images(paths, 50_000, cache, workers=1) == expected
    assert set(load(cache_file)) == {os.path.abspath(path) for path in paths}


def test_an_entry_of_the_wrong_type_voids_the_cache_file(tmp_path: Path) -> None:
    paths = make_folder(tmp_path / "images")
    cache = tmp_path / "cache"
    expected = inspect_images(paths, 50_000, cache, workers=1)
    cache_file = cache_path([str(path) for path in paths], cache)
    data = json.loads(cache_file.read_text(encoding="utf-8"))
    assert data["columns"]["path"][0] == os.path.abspath(paths[0]) and data["columns"]["width"][0] == 256
    data["columns"]["width"][0] = "256"  # as text
    cache_file.write_text(json.dumps(data), encoding="utf-8")
    assert load(cache_file) == {}
    assert inspect_images(paths, 50_000, cache, workers=1) == expected


def test_the_pixel_limit_is_applied_anew_on_every_scan(tmp_path: Path) -> None:
    paths = make_folder(tmp_path / "images")
    cache = tmp_path / "cache"
    large, photo_jpg = paths[4], paths[0]
    first = inspect_images(paths, 50_000, cache, workers=1)
    assert first[4] == "too large: 400x300 is over data.max_image_pixels=50000"
    assert check_image(large, 50_000).sha256 is None  # over the limit: never decoded, so not known to be good
    raised = inspect_images(paths, 200_000, cache, workers=1)  # now within the limit: decoded
    assert raised[4] == inspect_image(large, 200_000) == (400, 300, raised[4][2], False)
    lowered = inspect_images(paths, 10_000, cache, workers=1)
    assert lowered[0] == "too large: 256x192 is over data.max_image_pixels=10000" == inspect_image(photo_jpg, 10_000)
    assert lowered[3] == raised[3] == (64, 96, raised[3][2], False)  # EXIF-rotated: the size as displayed
    rotated = inspect_images(paths, 5_000, cache, workers=1)[3]  # its message names the stored size
    assert rotated == inspect_image(paths[3], 5_000) == "too large: 96x64 is over data.max_image_pixels=5000"


def test_max_image_pixels_is_honoured_above_pils_own_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20_000)  # PIL's limit below the setting, as for a 200 MP photo
    paths = make_folder(tmp_path / "images")
    large = paths[4]
    cache = tmp_path / "cache"
    assert inspect_images(paths, 200_000, cache, workers=2)[4] == (400, 300, inspect_image(large, 200_000)[2], False)
    assert load_rgb(large).size == (400, 300) and load_mask(large, alpha=False).size == (400, 300)
    assert Image.MAX_IMAGE_PIXELS == 20_000  # lifted for our own opens only
    assert inspect_images(paths, 200_000, cache, workers=1)[4] == (400, 300, inspect_image(large, 200_000)[2], False)


@pytest.mark.parametrize("progressive", [False, True])
def test_every_truncation_a_full_decode_rejects_is_rejected(tmp_path: Path, progressive: bool) -> None:
    content = encoded(photo(9, 512, 384), "JPEG", quality=90, progressive=progressive)
    path = tmp_path / "cut.jpg"
    rejected = 0
    for end in np.linspace(2000, len(content) - 1, 40).astype(int):
        path.write_bytes(content[:end])
        try:
            with Image.open(path) as image:
                image.load()  # the full-scale decode: the reference
            full_rejects = False
        except OSError:
            full_rejects = True
        verdict = inspect_images([path], 10**8, None, workers=1)[0]
        assert isinstance(verdict, str) == full_rejects, (end, verdict)
        rejected += full_rejects
    assert rejected == 40  # the cut always shows, up to the last byte


def test_scan_images_writes_the_cache_only_where_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_folder(tmp_path / "images")
    cache = tmp_path / "scan"
    with_cache = scan_images(DataConfig(image_dir=str(tmp_path / "images"), scan_cache_dir=str(cache)))
    assert len(list(cache.glob("*.json"))) == 1
    monkeypatch.chdir(tmp_path / "images")
    without = scan_images(DataConfig(image_dir=".", scan_cache_dir="", num_workers=0))
    assert [(r.path.name, r.width, r.sha256) for r in without.images] == [
        (r.path.name, r.width, r.sha256) for r in with_cache.images]
    assert len(with_cache.images) == 5 and len(with_cache.skipped) == 5  # no captions: used all the same
    assert len(list(Path().iterdir())) == 10  # nothing written beside the images


def test_what_was_inspected_before_a_scan_stopped_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = make_folder(tmp_path / "images")[:4]
    stop = tmp_path / "images" / "c_stop.jpg"  # a Ctrl-C arrives while this one is inspected
    stop.write_bytes(paths[0].read_bytes())
    cache = tmp_path / "cache"
    real_check = scan_cache.check_image

    def interrupted_at_stop(path: Path, max_pixels: int):
        if path == stop:
            raise KeyboardInterrupt
        return real_check(path, max_pixels)

    monkeypatch.setattr(scan_cache, "check_image", interrupted_at_stop)
    with pytest.raises(KeyboardInterrupt):
        inspect_images([*paths[:2], stop, *paths[2:]], 50_000, cache, workers=1)
    keys = [str(path) for path in [*paths[:2], stop, *paths[2:]]]
    assert set(load(cache_path(keys, cache))) == {str(paths[0]), str(paths[1])}
