"""Captions longer than 77 tokens (`data.max_token_length`): chunked as kohya and ComfyUI chunk
them, on the tiny model's real CLIP encoders, in training, the text cache and eval."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdxl_trainer.conditioning import encode_prompts, pipeline_prompt_embeds
from sdxl_trainer.config import ModelConfig, load_config
from sdxl_trainer.diffusion import LossModels, conditioning
from sdxl_trainer.eval.eval_prompts import EvalPrompt
from sdxl_trainer.eval.evaluation import run_evaluation
from sdxl_trainer.long_prompts import caption_ids, captions_ids, count_truncated, token_chunks
from sdxl_trainer.models import load_pipeline, with_components
from sdxl_trainer.planning import plan_run
from sdxl_trainer.recorded_encoder import record_encoder
from sdxl_trainer.text_cache import CachedEncoder, TextCache, build_text_cache, encoder_spec
from tests.helpers import DATA_DIR, tiny_config, train_here, write_config
from tests.test_evaluation import eval_config
from tests.test_resume import final_weights

NAMES = ("text_encoder", "text_encoder_2")
WORDS = [chr(ord("a") + index % 26) for index in range(160)]  # one token each in the tiny vocabulary
LONG = " ".join(WORDS)  # 160 tokens: three chunks of 75, 75 and 10


@pytest.fixture(scope="module")
def pipe(tiny_sdxl_dir: Path):
    """The tiny SDXL with frozen encoders (encoded a caption at a time, as the text cache does)."""
    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    pipe.set_progress_bar_config(disable=True)
    for name in NAMES:
        getattr(pipe, name).requires_grad_(False)
    return pipe


def encode(pipe, captions: list[str], max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return encode_prompts(captions, [pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2],
                          "cpu", zero_empty=True, max_tokens=max_tokens)


def test_a_batch_is_tokenized_in_one_call_with_the_ids_of_one_call_per_caption(pipe) -> None:
    texts = ["a red circle, blue background", "", LONG, "a b c", "yellow triangle"]
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_2):
        for max_tokens in (75, 225):
            batched = captions_ids(tokenizer, texts, max_tokens)
            one_by_one = [caption_ids(tokenizer, text, max_tokens) for text in texts]
            assert [ids.tolist() for ids in batched] == [ids.tolist() for ids in one_by_one]
        assert [len(ids) for ids in captions_ids(tokenizer, texts, 225)] == [1, 1, 3, 1, 1]


def test_each_chunk_is_the_encoding_of_its_75_tokens_alone(pipe) -> None:
    hidden, pooled = encode(pipe, [LONG], 225)
    assert hidden.shape == (1, 3 * 77, 80)
    for index, words in enumerate((WORDS[:75], WORDS[75:150], WORDS[150:])):
        alone, alone_pooled = encode(pipe, [" ".join(words)], 75)  # today's encoding: <BOS> words <EOS> <pad>…
        torch.testing.assert_close(hidden[:, 77 * index:77 * (index + 1)], alone, rtol=1e-6, atol=1e-6)
        if index == 0:
            torch.testing.assert_close(pooled, alone_pooled, rtol=1e-6, atol=1e-6)  # the first chunk's
        else:
            assert not torch.allclose(pooled, alone_pooled, atol=1e-3)
    for tokenizer, pad in ((pipe.tokenizer, pipe.tokenizer.eos_token_id), (pipe.tokenizer_2, 33)):  # 33: "!"
        ids = caption_ids(tokenizer, LONG, 225)
        assert ids[:, 0].tolist() == [tokenizer.bos_token_id] * 3
        assert ids[:2, 76].tolist() == [tokenizer.eos_token_id] * 2
        assert ids[2, 11] == tokenizer.eos_token_id and ids[2, 12:].tolist() == [pad] * 65
    assert encode(pipe, [LONG], 150)[0].shape == (1, 2 * 77, 80)  # the rest is cut
    assert encode(pipe, [LONG], 75)[0].shape == (1, 77, 80)


def kohya_input_ids(tokenizer, text: str, max_token_length: int) -> torch.Tensor:
    """sd-scripts' TokenizeStrategy._get_input_ids for SDXL, written out from its source: the text
    padded to max_token_length + 2, then cut into (n, 77) rows <BOS> 75 tokens <last token>, with
    its fixes for a tokenizer whose pad is not its end token."""
    max_length = max_token_length + 2
    ids = tokenizer(text, padding="max_length", truncation=True, max_length=max_length,
                    return_tensors="pt").input_ids[0]
    rows = []
    for start in range(1, max_length - 77 + 2, 75):
        row = torch.cat((ids[:1], ids[start:start + 75], ids[-1:]))
        if tokenizer.pad_token_id != tokenizer.eos_token_id:
            if row[-2] not in (tokenizer.eos_token_id, tokenizer.pad_token_id):
                row[-1] = tokenizer.eos_token_id
            if row[1] == tokenizer.pad_token_id:
                row[1] = tokenizer.eos_token_id
        rows.append(row)
    return torch.stack(rows)


def test_kohya_reference_on_the_real_encoders(pipe) -> None:
    """kohya encodes all max_token_length / 75 chunks (empty ones too) and keeps <BOS>, each chunk's
    75 tokens and the last token (227 states); its non-empty chunks are ours, token for token,
    and so are their hidden states and the pooled output."""
    for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
        kohya = kohya_input_ids(tokenizer, LONG, 225)
        assert kohya.shape == (3, 77) and torch.equal(caption_ids(tokenizer, LONG, 225), kohya)
        short = kohya_input_ids(tokenizer, "a b c", 225)
        assert torch.equal(caption_ids(tokenizer, "a b c", 225), short[:1])  # kohya adds two empty chunks
        with torch.no_grad():
            output = encoder(kohya, output_hidden_states=True)
        states = output.hidden_states[-2]
        kohya_hidden = torch.cat([states[0, :1], *[states[row, 1:76] for row in range(3)], states[2, -1:]])
        ours = encode_prompts([LONG], [tokenizer], [encoder], "cpu", max_tokens=225)[0][0]
        assert kohya_hidden.shape == (227, ours.shape[-1])
        for row in range(3):
            torch.testing.assert_close(ours[77 * row + 1:77 * row + 76], kohya_hidden[1 + 75 * row:76 + 75 * row],
                                       rtol=1e-6, atol=1e-6)
    kohya_pooled = pipe.text_encoder_2(kohya_input_ids(pipe.tokenizer_2, LONG, 225)).text_embeds[::3]
    torch.testing.assert_close(encode(pipe, [LONG], 225)[1], kohya_pooled, rtol=1e-6, atol=1e-6)


def test_comfyui_keeps_short_words_whole_and_splits_long_ones(pipe) -> None:
    tokenizer = pipe.tokenizer
    word = "qzx"  # three tokens
    assert len(tokenizer(word, add_special_tokens=False).input_ids) == 3
    chunks = token_chunks(tokenizer, " ".join(["a"] * 74 + [word, "b"]))
    assert [len(chunk) for chunk in chunks] == [74, 4]  # the word would straddle the line: it starts chunk 2
    long_word = "qzx" * 4  # twelve tokens: split at the line, as ComfyUI splits a word of 8 or more
    assert [len(chunk) for chunk in token_chunks(tokenizer, " ".join(["a"] * 70 + [long_word]))] == [75, 7]
    assert token_chunks(tokenizer, "") == [[]] and caption_ids(tokenizer, "", 150).shape == (1, 77)


def test_capitals_and_accents_read_as_the_pipeline_and_comfyui_read_them(pipe) -> None:
    text = "A red circle, I see \u00e9 and H"  # "A</w>", "H</w>": byte-level entries the tokenizer never gives
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_2):
        per_word = [token for word in text.split() for token in tokenizer(word, add_special_tokens=False).input_ids]
        assert token_chunks(tokenizer, text) == [per_word]  # ComfyUI: the tokenizer on each word
        assert torch.equal(caption_ids(tokenizer, text, 150), caption_ids(tokenizer, text, 75))  # the pipeline's


def test_captions_of_different_lengths_share_a_batch_as_comfyui_batches_them(pipe) -> None:
    hidden, _ = encode(pipe, [LONG, "a b", ""], 225)
    assert hidden.shape == (3, 231, 80)
    short = encode(pipe, ["a b"], 225)[0]
    assert torch.equal(hidden[1], short[0].repeat(3, 1)) and not hidden[2].any()  # repeated; empty: zero
    assert encode(pipe, [LONG, " ".join(WORDS[:100])], 225)[0].shape == (2, 462, 80)  # lcm(231, 154)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    added = {"text_embeds": torch.zeros(1, 48), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])}
    with torch.no_grad():
        once = pipe.unet(latents, 500, encoder_hidden_states=short, added_cond_kwargs=added).sample
        thrice = pipe.unet(latents, 500, encoder_hidden_states=short.repeat(1, 3, 1), added_cond_kwargs=added).sample
    torch.testing.assert_close(once, thrice, rtol=1e-5, atol=1e-5)  # attention over a repeated context


def test_the_loss_reads_chunked_captions(pipe) -> None:
    batch = {"captions": [LONG, "a b"], "original_sizes": torch.tensor([[64, 64]] * 2),
             "crops_top_left": torch.zeros(2, 2), "target_sizes": torch.tensor([[64, 64]] * 2)}
    inputs = conditioning(LossModels.of(pipe, max_tokens=225), batch, "cpu")
    assert inputs["encoder_hidden_states"].shape == (2, 231, 80)
    torch.testing.assert_close(inputs["encoder_hidden_states"], encode(pipe, batch["captions"], 225)[0])
    assert conditioning(LossModels.of(pipe), batch, "cpu")["encoder_hidden_states"].shape == (2, 77, 80)


def test_the_text_cache_holds_chunked_entries_under_their_own_key(tmp_path: Path, pipe) -> None:
    specs = {name: encoder_spec(getattr(pipe, name.replace("text_encoder", "tokenizer")), getattr(pipe, name),
                                name, 225) for name in NAMES}
    cache = TextCache(tmp_path, specs, "fp32", "fp32", max_tokens=225)
    texts = [LONG, "a red circle"]
    off = torch.autocast("cpu", enabled=False)
    assert build_text_cache(cache, texts, pipe, "cpu", off) == (0, 4)
    assert build_text_cache(cache, texts, pipe, "cpu", off) == (4, 0)
    assert cache.load("text_encoder_2", LONG)["hidden"].shape == (231, 48)
    assert cache.load("text_encoder", "a red circle")["hidden"].shape == (77, 32)
    cached = [CachedEncoder(cache, name, zero_empty=True) for name in NAMES]
    captions = [LONG, "a red circle", ""]
    from_cache = encode_prompts(captions, [pipe.tokenizer, pipe.tokenizer_2], cached, "cpu", True, 225)
    live = encode(pipe, captions, 225)
    assert torch.equal(from_cache[0], live[0]) and torch.equal(from_cache[1], live[1])
    short = TextCache(tmp_path, specs, "fp32", "fp32", max_tokens=75)
    assert cache.path("text_encoder", LONG) != short.path("text_encoder", LONG)
    assert short.path("text_encoder", LONG) == TextCache(tmp_path, specs, "fp32", "fp32").path("text_encoder", LONG)
    # An entry an earlier version tokenized differently ("A" read as "A</w>") is a miss, never a stale hit.
    spec = specs["text_encoder"]
    earlier = {"text": LONG, "encoder": "text_encoder", "tokenizer": spec.tokenizer_id, "weights": spec.weights_id,
               "dtype": "fp32", "compute": "fp32", "format": 1, "max_tokens": 225}
    digest = hashlib.sha256(json.dumps(earlier, sort_keys=True).encode()).hexdigest()
    assert cache.path("text_encoder", LONG) != tmp_path / digest[:2] / f"{digest}.safetensors"


@pytest.mark.parametrize("backend", ["diffusers", "kdiffusion"])
def test_eval_renders_the_words_past_77_tokens(tmp_path: Path, pipe, backend: str) -> None:
    """Two prompts alike in their first 75 tokens: one image at 75 (the rest is cut), two at 225;
    the encoders recorded for eval (text cache) render what the live ones render."""
    texts = [LONG, " ".join(WORDS[:75] + ["z"] * 60)]
    config = eval_config(backend=backend, sampler_name="euler")

    def render(max_tokens: int, renderer, name: str) -> list[bytes]:
        prompts = [EvalPrompt(text, "", 3, 64, 64, max_tokens=max_tokens) for text in texts]
        result = run_evaluation(renderer, config, prompts, tmp_path / name, tag="final", step=0)
        return [path.read_bytes() for path in result.images]

    cut = render(75, pipe, "cut")
    assert cut[0] == cut[1]
    read = render(225, pipe, "read")
    assert read[0] != read[1]
    recorded = {name: record_encoder(getattr(pipe, name.replace("text_encoder", "tokenizer")), getattr(pipe, name),
                                     [*texts, ""], name, 225) for name in NAMES}
    assert render(225, with_components(pipe, **recorded), "recorded") == read
    live = pipeline_prompt_embeds(pipe, texts[0], "a b", 225)
    assert live["prompt_embeds"].shape == live["negative_prompt_embeds"].shape == (1, 231, 80)


def long_caption_folder(folder: Path) -> Path:
    """Four sample images, two of them with captions of 100 tokens."""
    folder.mkdir(parents=True)
    for index, source in enumerate(sorted(DATA_DIR.glob("*.png"))[:4]):
        shutil.copy(source, folder / source.name)
        words = 100 if index < 2 else 10
        (folder / source.with_suffix(".txt").name).write_text(" ".join(WORDS[index:index + words]), encoding="utf-8")
    return folder


def test_the_preflight_counts_the_captions_it_cuts(tmp_path: Path, tiny_sdxl_dir: Path, pipe) -> None:
    images = long_caption_folder(tmp_path / "images")
    assert count_truncated(pipe.tokenizer, [" ".join(WORDS[:100]), LONG, "a"], 150) == 1
    config = tiny_config(tmp_path)
    config["data"]["image_dir"] = str(images)
    path = write_config(tmp_path / "c.json", config)
    assert "captions: up to 75 tokens; 2 of 4 longer, cut there (data.max_token_length)" in plan_run(
        load_config(path)).preflight
    read = plan_run(load_config(path, ["data.max_token_length=150"])).preflight
    assert "captions: up to 150 tokens (2 chunks of 75); 0 of 4 longer, cut there\n" in read
    wrong = train_here("--dry-run", "--config", str(path), "--set", "data.max_token_length=100")
    assert wrong.returncode == 2 and "data.max_token_length" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1 and "Traceback" not in wrong.stderr


@pytest.mark.slow
def test_training_on_long_captions_is_the_same_with_and_without_the_text_cache(tmp_path: Path,
                                                                                tiny_sdxl_dir: Path) -> None:
    images = long_caption_folder(tmp_path / "images")
    weights = []
    for cache_on in (True, False):
        config = tiny_config(tmp_path / str(cache_on), model={"train_text_encoder_1": False},
                             training={"num_steps": 2})
        config["data"].update(image_dir=str(images), max_token_length=150)
        config["data"]["text_cache"]["enabled"] = cache_on
        result = train_here("--config", str(write_config(tmp_path / f"{cache_on}.json", config)))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "captions: up to 150 tokens (2 chunks of 75); 0 of 4 longer" in result.stdout
        weights.append(final_weights(tmp_path / str(cache_on) / "out" / "test_run"))
    entries = sorted((tmp_path / "True" / "text").glob("*/*.safetensors"))
    assert len(entries) == 8 and {load_file(entry)["hidden"].shape[0] for entry in entries} == {77, 154}
    assert weights[0].keys() == weights[1].keys() and len(weights[0]) > 10
    assert [key for key in weights[0] if not torch.equal(weights[0][key], weights[1][key])] == []
