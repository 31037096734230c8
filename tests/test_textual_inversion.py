"""Textual inversion on both text encoders: new rows only, the exports ComfyUI and diffusers load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdxl_trainer.conditioning import encode_prompts
from sdxl_trainer.config import ConfigError, ModelConfig, TextualInversionConfig
from sdxl_trainer.embeddings import add_tokens, save_embedding_files
from sdxl_trainer.long_prompts import caption_ids
from sdxl_trainer.models import load_pipeline

SETTINGS = TextualInversionConfig(tokens=[{"token": "<qz>", "vectors": 2, "init_word": "circle"},
                                          {"token": "<zq>", "init_word": "red"}])


def fresh_pipe():
    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    pipe.set_progress_bar_config(disable=True)
    for name in ("text_encoder", "text_encoder_2", "unet"):
        getattr(pipe, name).requires_grad_(False)
    return pipe


@pytest.fixture
def pipe(tiny_sdxl_dir: Path):
    return fresh_pipe()


def comfyui_load_embed(path: Path, embedding_size: int, embed_key: str) -> torch.Tensor:
    """ComfyUI's comfy/sd1_clip.py `load_embed` for a .safetensors file, written out from its
    source: the tensor under `embed_key` (`clip_l` / `clip_g`), else the first one; SDTokenizer then
    uses each row whose width is the encoder's (`embedding_size`) as one token."""
    embed = load_file(path)
    tensor = embed[embed_key] if embed_key in embed else next(iter(embed.values()))
    assert tensor.shape[-1] == embedding_size  # SDClipModel ignores rows of another width
    return tensor


def test_only_the_new_rows_train_and_the_files_load_in_comfyui_and_diffusers(tmp_path: Path, pipe) -> None:
    before = {name: getattr(pipe, name).get_input_embeddings().weight.detach().clone()
              for name in ("text_encoder", "text_encoder_2")}
    tokens = add_tokens(pipe, SETTINGS)
    circle = pipe.tokenizer("circle", add_special_tokens=False).input_ids
    assert torch.equal(tokens.vectors("<qz>")["text_encoder"][1], before["text_encoder"][circle[0]])
    start = {name: table.new.detach().clone() for name, table in tokens.tables.items()}
    optimizer = torch.optim.AdamW(tokens.parameters(), lr=0.1, weight_decay=0.1)
    trained = [parameter for module in (pipe.text_encoder, pipe.text_encoder_2)
               for parameter in module.parameters() if parameter.requires_grad]
    assert len(trained) == 2 and all(parameter.shape[0] == 3 for parameter in trained)  # 2 + 1 vectors
    for _ in range(3):
        embeds, pooled = encode_prompts(["a <qz> and a <zq>", "a red circle"], [pipe.tokenizer, pipe.tokenizer_2],
                                        [pipe.text_encoder, pipe.text_encoder_2], "cpu")
        (embeds.square().mean() + pooled.square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, table in tokens.tables.items():
        assert torch.equal(table.base.weight, before[name])  # every old row bit-identical
        assert (table.new.detach() != start[name]).any(dim=1).all()  # each new row moved
    ids = caption_ids(pipe.tokenizer, "a <qz>", 75)[0].tolist()
    added = pipe.tokenizer.convert_tokens_to_ids(["<qz>", "<qz>_1"])
    assert ids[:5] == [pipe.tokenizer.bos_token_id, ids[1], *added, pipe.tokenizer.eos_token_id]

    written = save_embedding_files(tokens, tmp_path)
    assert sorted(path.relative_to(tmp_path).as_posix() for path in written) == [
        "qz.diffusers/text_encoder.safetensors", "qz.diffusers/text_encoder_2.safetensors", "qz.safetensors",
        "zq.diffusers/text_encoder.safetensors", "zq.diffusers/text_encoder_2.safetensors", "zq.safetensors"]
    vectors = tokens.vectors("<qz>")
    assert set(load_file(tmp_path / "qz.safetensors")) == {"clip_l", "clip_g"}
    assert torch.equal(comfyui_load_embed(tmp_path / "qz.safetensors", 32, "clip_l"), vectors["text_encoder"])
    assert torch.equal(comfyui_load_embed(tmp_path / "qz.safetensors", 48, "clip_g"), vectors["text_encoder_2"])

    other = fresh_pipe()  # diffusers' own loader, once per encoder
    for name, tokenizer in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        other.load_textual_inversion(str(tmp_path / "qz.diffusers" / f"{name}.safetensors"),
                                     text_encoder=getattr(other, name), tokenizer=getattr(other, tokenizer))
        table = getattr(other, name).get_input_embeddings().weight
        rows = getattr(other, tokenizer).convert_tokens_to_ids(["<qz>", "<qz>_1"])
        assert torch.equal(table[rows], vectors[name])
    with torch.no_grad():
        ours = encode_prompts(["a <qz>"], [pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2],
                              "cpu")[0]
        theirs = other.encode_prompt("a <qz>", device="cpu", do_classifier_free_guidance=False)[0]
    torch.testing.assert_close(ours, theirs)  # the pipeline that loaded the files reads the prompt as training did


def test_a_known_word_or_an_empty_initializer_is_one_line(pipe) -> None:
    with pytest.raises(ConfigError, match=r"textual_inversion.tokens\[0\].token: 'red' is already in the vocabulary"):
        add_tokens(pipe, TextualInversionConfig(tokens=[{"token": "red", "init_word": "dog"}]))
    with pytest.raises(ConfigError, match=r"tokens\[0\].init_word: ' ' tokenizes to nothing"):
        add_tokens(pipe, TextualInversionConfig(tokens=[{"token": "<qz>", "init_word": " "}]))
    with pytest.raises(ValueError, match="one word"):
        TextualInversionConfig(tokens=[{"token": "<q z>", "init_word": "dog"}])
