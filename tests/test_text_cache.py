"""The text-encoder output cache: runs with it train exactly like runs without, it is
content-addressed and self-repairing, and eval needs no cached encoder."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

import dataset
from sdxl_trainer.captions import augment_caption, caption_variant, possible_captions
from sdxl_trainer.config import Config
from sdxl_trainer.models import load_pipeline, with_components
from sdxl_trainer.planning import plan_run
from sdxl_trainer.recorded_encoder import record_encoder
from sdxl_trainer.text_cache import TextCache, build_text_cache, encoder_spec, run_texts
from tests.helpers import DATA_DIR, NO_MEMORY_PLAN, tiny_config, train_here, write_config
from tests.test_resume import final_weights

FROZEN = {"train_text_encoder_1": False}
AUGMENTED = {"caption_dropout_prob": 0.2, "caption_shuffle_prob": 0.5, "caption_shuffle_variants": 2}
SUBSETS = {"subsets": [  # each subset's own caption options: the cache must hold the texts of both
    {"image_dir": str(DATA_DIR), "caption_shuffle_prob": 0.7, "caption_shuffle_variants": 3, "keep_tokens": 1},
    {"image_dir": str(DATA_DIR), "is_reg": True, "caption_dropout_prob": 0.5}]}


def train(tmp_path: Path, cache_on: bool, model: dict, data: dict, **training) -> tuple[Path, str]:
    config = tiny_config(tmp_path, model=model, training={"num_steps": 4, **training})
    config["data"].update(data)
    if "subsets" in data:
        del config["data"]["image_dir"]
    config["data"]["text_cache"]["enabled"] = cache_on
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "out" / "test_run", result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("model", "data", "cached"), [
    (FROZEN, {}, "text_encoder cached, text_encoder_2 cached"),
    ({}, {}, "text_encoder_2 cached, text_encoder live (trained)"),
    (FROZEN, AUGMENTED, "text_encoder cached, text_encoder_2 cached"),
    (FROZEN, SUBSETS, "text_encoder cached, text_encoder_2 cached"),
], ids=["both-frozen", "clip-l-trained", "dropout-and-shuffle", "subsets"])
def test_cached_runs_train_bit_identical_weights(tmp_path: Path, tiny_sdxl_dir: Path, model: dict, data: dict,
                                                 cached: str) -> None:
    with_cache, stdout = train(tmp_path / "cached", True, model, data)
    without, live_stdout = train(tmp_path / "live", False, model, data)
    assert f"text cache: {cached}" in stdout and "text cache:" not in live_stdout
    assert "text_encoder_2   fp32      -        fp32     cpu (text cache)" in stdout
    assert "(text cache)" not in live_stdout
    entries = list((tmp_path / "cached" / "text").glob("*/*.safetensors"))
    distinct = len({path.read_text(encoding="utf-8").strip() for path in DATA_DIR.glob("*.txt")})
    assert distinct == 15  # 18 images; two captions repeat
    assert len(entries) >= distinct * (2 if model else 1)  # one per text and encoder, more with shuffle variants
    assert not (tmp_path / "live" / "text").exists()
    first, second = final_weights(with_cache), final_weights(without)
    assert first.keys() == second.keys() and len(first) > 10
    assert [key for key in first if not torch.equal(first[key], second[key])] == []


@pytest.mark.slow
def test_resume_with_the_cache_is_bit_exact(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    straight, _ = train(tmp_path / "straight", True, {}, AUGMENTED, num_steps=6, checkpoint_every=3)
    checkpoint = straight / "checkpoints" / "checkpoint-3"
    resumed, stdout = train(tmp_path / "resumed", True, {}, AUGMENTED, num_steps=6, checkpoint_every=3,
                            resume_from=str(checkpoint))
    assert "at step 3" in stdout and "text cache: text_encoder_2 cached" in stdout
    first, second = final_weights(straight), final_weights(resumed)
    assert first.keys() == second.keys() and len(first) > 10
    assert [key for key in first if not torch.equal(first[key], second[key])] == []


@pytest.mark.slow
def test_dry_run_counts_hits_and_an_edited_caption_misses_for_its_image_only(tmp_path: Path,
                                                                              tiny_sdxl_dir: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(DATA_DIR, images)
    config = tiny_config(tmp_path, model=FROZEN, training={"num_steps": 1})
    config["data"].update(image_dir=str(images), **AUGMENTED)
    path = write_config(tmp_path / "c.json", config)
    before = train_here("--config", str(path), "--dry-run", *NO_MEMORY_PLAN)
    assert before.returncode == 0, before.stderr[-2000:]
    texts = texts_of(config)
    assert f"{len(texts)} caption texts (18 images, 2 shuffle variants per caption): 0 hits, " \
           f"{2 * len(texts)} misses" in before.stdout
    assert len(texts) > 18  # the variants of the captions with several parts
    assert train_here("--config", str(path)).returncode == 0
    after = train_here("--config", str(path), "--dry-run", *NO_MEMORY_PLAN)
    assert f"{2 * len(texts)} hits, 0 misses" in after.stdout

    edited_caption = "tok, an edited caption, green"
    (images / "shape_03.txt").write_text(edited_caption, encoding="utf-8")
    new_texts = possible_captions([(edited_caption, Config.model_validate(config).data)], 7) - {""}
    assert 2 <= len(new_texts) <= 3  # the caption and its shuffle variants
    edited = train_here("--config", str(path), "--dry-run", *NO_MEMORY_PLAN)
    now = texts_of(config)
    assert set(now) - set(texts) == new_texts  # the edited image's texts are the only new ones
    assert f"{2 * (len(now) - len(new_texts))} hits, {2 * len(new_texts)} misses" in edited.stdout, edited.stdout


def test_hits_are_not_counted_under_a_seed_not_drawn_yet(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, model=FROZEN, training={"seed": 0})  # 0: drawn at random at the start
    config["data"].update(AUGMENTED)  # the shuffle variants, and so the texts, depend on the seed
    preflight = plan_run(Config.model_validate(config)).preflight
    assert "texts, hits and misses are counted once the seed is drawn" in preflight


def texts_of(config: dict) -> list[str]:
    validated = Config.model_validate(config)
    return run_texts(validated, dataset.plan_dataset(validated.data, 2), 7, zero_empty=True)


@pytest.fixture(scope="module")
def pipe(tiny_sdxl_dir: Path):
    return load_pipeline(Config.model_validate(tiny_config(Path("/unused"))).model)


def test_entries_are_the_live_outputs_and_damaged_ones_are_rebuilt(tmp_path: Path, pipe) -> None:
    names = ("text_encoder", "text_encoder_2")
    specs = {name: encoder_spec(getattr(pipe, name.replace("text_encoder", "tokenizer")), getattr(pipe, name), name)
             for name in names}
    cache = TextCache(tmp_path, specs, "fp32", "fp32")
    texts = ["tok, a red circle", "a blue square"]
    off = torch.autocast("cpu", enabled=False)
    assert build_text_cache(cache, texts, pipe, "cpu", off) == (0, 4)
    assert build_text_cache(cache, texts, pipe, "cpu", off) == (4, 0)
    with torch.no_grad():
        output = pipe.text_encoder_2(pipe.tokenizer_2(["a blue square"], padding="max_length", max_length=77,
                                                      return_tensors="pt").input_ids, output_hidden_states=True)
    entry = cache.load("text_encoder_2", "a blue square")
    assert torch.equal(entry["hidden"], output.hidden_states[-2][0]) and torch.equal(entry["pooled"],
                                                                                    output.text_embeds[0])
    assert set(cache.load("text_encoder", "a blue square")) == {"hidden"}
    cache.path("text_encoder", texts[0]).write_bytes(b"not a safetensors file")
    assert cache.missing("text_encoder", texts) == [texts[0]]
    assert not cache.path("text_encoder", texts[0]).exists()  # deleted, rebuilt on the next build
    assert build_text_cache(cache, texts, pipe, "cpu", off) == (3, 1)

    other = dict(pipe.text_encoder_2.state_dict())
    other["text_projection.weight"] = other["text_projection.weight"] * 2
    changed = {**specs, "text_encoder_2": encoder_spec(pipe.tokenizer_2, _with_weights(pipe.text_encoder_2, other),
                                                       "text_encoder_2")}
    another = TextCache(tmp_path, changed, "fp32", "fp32")
    assert another.missing("text_encoder_2", texts) == texts and another.missing("text_encoder", texts) == []
    assert TextCache(tmp_path, specs, "bf16", "fp32").missing("text_encoder", texts) == texts


def test_an_entry_depends_on_its_text_alone(tmp_path: Path, pipe) -> None:
    """Built in one go, one text at a time, or in a shuffled order: the same bytes."""
    specs = {name: encoder_spec(getattr(pipe, name.replace("text_encoder", "tokenizer")), getattr(pipe, name), name)
             for name in ("text_encoder", "text_encoder_2")}
    texts = sorted({path.read_text(encoding="utf-8").strip() for path in DATA_DIR.glob("*.txt")})
    off = torch.autocast("cpu", enabled=False)
    caches = [TextCache(tmp_path / name, specs, "fp32", "fp32") for name in ("whole", "alone", "shuffled")]
    build_text_cache(caches[0], texts, pipe, "cpu", off)
    for text in texts:
        assert build_text_cache(caches[1], [text], pipe, "cpu", off) == (0, 2)
    build_text_cache(caches[2], random.Random(5).sample(texts, len(texts)), pipe, "cpu", off)
    entries = [{(name, text): cache.path(name, text).read_bytes() for name in specs for text in texts}
               for cache in caches]
    assert len(entries[0]) == 30 and entries[1] == entries[0] and entries[2] == entries[0]


def _with_weights(module: torch.nn.Module, state: dict) -> torch.nn.Module:
    import copy

    changed = copy.deepcopy(module)
    changed.load_state_dict(state)
    return changed


def test_recorded_encoders_render_the_same_latents(pipe) -> None:
    prompts = ["tok, a red circle", "a blue square"]
    recorded = {name: record_encoder(getattr(pipe, name.replace("text_encoder", "tokenizer")), getattr(pipe, name),
                                     [*prompts, ""], name) for name in ("text_encoder", "text_encoder_2")}
    stand_in = with_components(pipe, **recorded)
    for negative in (None, "a blue square"):
        settings = {"prompt": prompts[0], "negative_prompt": negative, "num_inference_steps": 2, "width": 64,
                    "height": 64, "output_type": "latent"}
        live = pipe(generator=torch.Generator().manual_seed(1), **settings).images
        replayed = stand_in(generator=torch.Generator().manual_seed(1), **settings).images
        assert torch.equal(live, replayed)
    with pytest.raises(KeyError, match="recorded for the eval prompts only"):
        stand_in(prompt="an unrecorded prompt", num_inference_steps=1, width=64, height=64, output_type="latent")


def test_shuffle_variants_are_fixed_orders_drawn_from_the_seed() -> None:
    data = Config.model_validate(tiny_config(Path("/unused"))).data.model_copy(update=AUGMENTED)
    caption = "tok, a, b, c, d"
    variants = {caption_variant(caption, data, 7, v) for v in range(2)}
    drawn = {augment_caption(caption, data, random.Random(i), seed=7) for i in range(200)}
    assert drawn == variants | {caption, ""}
    assert possible_captions([(caption, data)], 7) == variants | {caption, ""}
    assert {caption_variant(caption, data, 8, v) for v in range(2)} != variants  # another seed, other orders
    assert all(sorted(text.split(", ")) == sorted(caption.split(", ")) for text in variants)
