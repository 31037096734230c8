"""Captions and prompts longer than CLIP's 77 tokens (`data.max_token_length` 150 or 225).

As ComfyUI encodes a long prompt (comfy/sd1_clip.py `SDTokenizer.tokenize_with_weights` and
`ClipTokenWeightEncoder.encode_token_weights`): the text's tokens go into chunks of at most 75,
each chunk wrapped as `<BOS> tokens <EOS>` and padded to 77 with the tokenizer's pad token (the
end token for CLIP-L, "!" for bigG, as both the SDXL pipeline and ComfyUI pad); each chunk is
encoded on its own row, the penultimate hidden states of the chunks are concatenated along the
sequence axis (77 per chunk), and the pooled output is the first chunk's. A word of fewer than 8
tokens is not split between two chunks (it starts the next one), as ComfyUI does; kohya's
sd-scripts splits at exactly 75 tokens. Prompts of different chunk counts in one batch are
repeated to a common length as ComfyUI batches them (comfy/conds.py `CONDCrossAttn.concat`):
attention over a context repeated k times is attention over the context. docs/data.md, 'Long
captions', says where this differs from kohya's `--max_token_length`.

With the default 75 nothing here changes the tokens: the pipeline's own truncation at 77 applies.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig
    from .data_plan import DatasetPlan
    from .eval.eval_prompts import EvalPrompt

CHUNK_TOKENS = 75  # a chunk's tokens between <BOS> and <EOS>
LONG_WORD = 8  # ComfyUI's max_word_length: a word of this many tokens or more may be split


def word_token_groups(tokenizer, text: str) -> list[list[int]]:
    """The text's token ids word by word (words split at spaces and line breaks), each word
    tokenized on its own, as ComfyUI tokenizes a prompt (one batched call). Not a vocabulary look-up
    of `word</w>`: the tokenizer lowercases first, and CLIP's byte-level entries such as `A</w>`
    are ids it never gives ("A photo" reads as `a</w> photo</w>`)."""
    words = [word for word in text.replace("\n", " ").split(" ") if word]
    return tokenizer(words, add_special_tokens=False).input_ids if words else []


def token_chunks(tokenizer, text: str) -> list[list[int]]:
    """The text's tokens in chunks of at most 75, a short word never split between two."""
    chunks: list[list[int]] = [[]]
    for group in word_token_groups(tokenizer, text):
        splittable = len(group) >= LONG_WORD
        while group:
            room = CHUNK_TOKENS - len(chunks[-1])
            if len(group) <= room:
                chunks[-1] += group
                group = []
                continue
            if splittable:
                chunks[-1] += group[:room]
                group = group[room:]
            chunks.append([])
    return chunks


def is_truncated(tokenizer, text: str, max_tokens: int) -> bool:
    """Whether the text is longer than `max_tokens` (with 75: than the pipeline's 77-token row;
    else: it needs more than `max_tokens // 75` chunks), and so is cut when it is encoded."""
    if max_tokens == CHUNK_TOKENS:
        return len(tokenizer(text).input_ids) - 2 > CHUNK_TOKENS
    return len(token_chunks(tokenizer, text)) > max_tokens // CHUNK_TOKENS


def prompt_ids(tokenizer, captions: list[str]) -> torch.Tensor:
    """Token ids padded and truncated to the tokenizer's length, as the SDXL pipeline makes them."""
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def expand_vectors(tokenizer, text: str) -> str:
    """The text with each added token of several vectors written as all of them (`<sks>` →
    `<sks> <sks>_1 …`), as diffusers' `maybe_convert_prompt` writes it before its pipeline
    tokenizes (textual inversion, embeddings.py); unchanged without such tokens."""
    added = tokenizer.added_tokens_encoder
    if not any(f"{token}_1" in added for token in added):
        return text
    for token in set(tokenizer.tokenize(text)):
        if token in added:
            replacement, index = token, 1
            while f"{token}_{index}" in added:
                replacement += f" {token}_{index}"
                index += 1
            text = text.replace(token, replacement)
    return text


def caption_ids(tokenizer, text: str, max_tokens: int) -> torch.Tensor:
    """One text's token ids as (chunks, 77) rows: with 75 the SDXL pipeline's single padded and
    truncated row; else up to `max_tokens // 75` chunks, each `<BOS> … <EOS> <pad>…`."""
    import torch

    text = expand_vectors(tokenizer, text)
    if max_tokens == CHUNK_TOKENS:
        return prompt_ids(tokenizer, [text])
    rows = []
    for chunk in token_chunks(tokenizer, text)[:max_tokens // CHUNK_TOKENS]:
        padding = [tokenizer.pad_token_id] * (CHUNK_TOKENS - len(chunk))
        rows.append([tokenizer.bos_token_id, *chunk, tokenizer.eos_token_id, *padding])
    return torch.tensor(rows, dtype=torch.long)


def captions_ids(tokenizer, texts: list[str], max_tokens: int) -> list[torch.Tensor]:
    """`caption_ids` of each text; SDXL's single rows (`max_tokens` 75) come from one batched
    tokenizer call, the same ids as one call per text, which cost a training step at batch 256
    more than its forward and backward on a GPU."""
    if max_tokens == CHUNK_TOKENS:
        return list(prompt_ids(tokenizer, [expand_vectors(tokenizer, text) for text in texts]).split(1))
    return [caption_ids(tokenizer, text, max_tokens) for text in texts]


def common_length(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack (length, width) contexts of different lengths into one batch, each repeated up to
    the least common multiple of the lengths (ComfyUI's way; equal lengths are just stacked)."""
    import torch

    length = math.lcm(*(row.shape[0] for row in rows))
    return torch.stack([row.repeat(length // row.shape[0], 1) for row in rows])


def count_truncated(tokenizer, texts: list[str], max_tokens: int) -> int:
    """How many of `texts` are longer than `max_tokens` (cut there when they are encoded)."""
    return sum(is_truncated(tokenizer, text, max_tokens) for text in texts)


def local_tokenizer(model: ModelConfig):
    """CLIP-L's tokenizer (SDXL's two share their vocabulary and merges) read from local files
    (the built-in model, a diffusers folder, `model.config_dir`), or None where it would need a
    download or the model: then the captions are counted once the model is loaded."""
    from pathlib import Path

    from transformers import CLIPTokenizer

    from .models import resolve_source
    from .tiny_model import tiny_sdxl_folder

    source = resolve_source(model.id)
    folders = {"builtin": tiny_sdxl_folder(), "folder": Path(source.location)}
    folder = Path(model.config_dir) if model.config_dir else folders.get(source.kind)
    if folder is None or not (folder / "tokenizer").is_dir():
        return None
    return CLIPTokenizer.from_pretrained(folder / "tokenizer")


def length_report(tokenizer, max_tokens: int, data_plan: DatasetPlan, prompts: list[EvalPrompt]) -> str:
    """The pre-flight line on caption lengths: how many captions (each distinct text once, before
    dropout and shuffle) and eval prompts are longer than `data.max_token_length` and cut there."""
    captions = sorted({sample.record.caption for sample in data_plan.samples + data_plan.validation})
    texts = sorted({text for prompt in prompts for text in (prompt.prompt, prompt.negative_prompt)})
    cut, cut_prompts = count_truncated(tokenizer, captions, max_tokens), count_truncated(tokenizer, texts, max_tokens)
    chunks = f" ({max_tokens // CHUNK_TOKENS} chunks of {CHUNK_TOKENS})" if max_tokens > CHUNK_TOKENS else ""
    line = f"captions: up to {max_tokens} tokens{chunks}; {cut} of {len(captions)} longer, cut there"
    if cut_prompts:
        line += f"; {cut_prompts} of {len(texts)} eval prompt texts longer, cut there"
    return line + (" (data.max_token_length)" if cut or cut_prompts else "")
