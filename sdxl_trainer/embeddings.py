"""New words for SDXL: textual inversion and pivotal tuning on both text encoders.

Each new token (`textual_inversion.tokens`) is added to both tokenizers as `vectors` tokens named
as diffusers names them (`<tok>`, `<tok>_1`, …), and a caption's `<tok>` is read as all of them,
as diffusers' `maybe_convert_prompt` reads it (long_prompts.expand_vectors). Their embedding
rows live in a parameter of their own (`NewRowsEmbedding`) beside the encoder's frozen table:
only the new rows can train, and every other row stays bit-identical by construction (no weight
decay or stray update can reach it). The vectors are exported as the A1111/Forge/ComfyUI
embedding file (`clip_l` and `clip_g`, each (vectors, width), which ComfyUI's `load_embed` reads
by those keys) and as diffusers' `load_textual_inversion` files (`{token: (vectors, width)}`, one
per encoder).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import ConfigError

if TYPE_CHECKING:
    from .config import Config, TextualInversionConfig
    from .data_plan import DatasetPlan

ENCODERS = {"text_encoder": ("tokenizer", "clip_l"), "text_encoder_2": ("tokenizer_2", "clip_g")}


def vector_tokens(token: str, vectors: int) -> list[str]:
    """The tokenizer entries of a token of several vectors, named as diffusers names them."""
    return [token] + [f"{token}_{index}" for index in range(1, vectors)]


class NewRowsEmbedding(torch.nn.Module):
    """An embedding table with new rows appended: ids below the frozen table's size read it, the
    others read `new` (the only parameter that trains)."""

    def __init__(self, base: torch.nn.Embedding, new: torch.Tensor, words: list[str]):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.new = torch.nn.Parameter(new.clone().float())
        self.words = words  # the tokens as captions write them: a caption holding one needs the gradient

    @property
    def weight(self) -> torch.Tensor:
        """The whole table (for code that reads the input embeddings' width, dtype or rows)."""
        return torch.cat([self.base.weight, self.new.detach().to(self.base.weight.dtype)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        size = self.base.num_embeddings
        rows = self.base(ids.clamp(max=size - 1))
        added = self.new[(ids - size).clamp(min=0)].to(rows.dtype)
        return torch.where((ids >= size)[..., None], added, rows)


@dataclass
class TokenSet:
    """The new tokens in one pipeline: per encoder the embedding holding their rows."""

    settings: TextualInversionConfig
    tables: dict[str, NewRowsEmbedding]

    def vectors(self, token: str) -> dict[str, torch.Tensor]:
        """One token's trained vectors per encoder, as (vectors, width) in fp32."""
        start = 0
        for new in self.settings.tokens:
            if new.token == token:
                return {name: table.new.detach()[start:start + new.vectors].float().cpu()
                        for name, table in self.tables.items()}
            start += new.vectors
        raise KeyError(token)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [table.new for table in self.tables.values()]


def check_tokens(tokenizer, settings: TextualInversionConfig) -> None:
    """Raise a ConfigError for a token already in the vocabulary or an initializer word that
    tokenizes to nothing (both need the tokenizer: the pre-flight checks them where it is local), and
    two tokens of one file name (`<sks>`, `[sks]`: one file would replace the other's)."""
    stems: dict[str, str] = {}
    for index, new in enumerate(settings.tokens):
        other = stems.setdefault(file_stem(new.token), new.token)
        if other != new.token:
            raise ConfigError(f"textual_inversion.tokens[{index}].token: {new.token!r} and {other!r} would both be "
                              f"saved as {file_stem(new.token)}.safetensors; make their letters or digits differ")
    for index, new in enumerate(settings.tokens):
        key = f"textual_inversion.tokens[{index}]"
        # One id: a word of the vocabulary (or a token added before), which the caption already means.
        taken = [entry for entry in vector_tokens(new.token, new.vectors)
                 if len(tokenizer(entry, add_special_tokens=False).input_ids) == 1]
        if taken:
            raise ConfigError(f"{key}.token: {taken[0]!r} is already in the vocabulary; choose a string the "
                              "tokenizer does not know as one word, e.g. <sks>")
        if not tokenizer(new.init_word, add_special_tokens=False).input_ids:
            raise ConfigError(f"{key}.init_word: {new.init_word!r} tokenizes to nothing; give a word, e.g. \"dog\"")


def add_tokens(pipe, settings: TextualInversionConfig) -> TokenSet:
    """Add the tokens to both tokenizers and their rows to both encoders, each vector initialised
    from the initializer word's token embeddings (cycled when the word has fewer tokens)."""
    tables = {}
    for name, (tokenizer_name, _) in ENCODERS.items():
        tokenizer, encoder = getattr(pipe, tokenizer_name), getattr(pipe, name)
        check_tokens(tokenizer, settings)
        base = encoder.get_input_embeddings()
        rows = []
        for new in settings.tokens:
            init = tokenizer(new.init_word, add_special_tokens=False).input_ids
            rows += [base.weight.detach()[init[index % len(init)]].float() for index in range(new.vectors)]
            tokenizer.add_tokens(vector_tokens(new.token, new.vectors))
        added = tokenizer.convert_tokens_to_ids([entry for new in settings.tokens
                                                 for entry in vector_tokens(new.token, new.vectors)])
        if added != list(range(base.num_embeddings, base.num_embeddings + len(rows))):
            raise ValueError(f"{tokenizer_name} has {len(tokenizer) - len(rows)} entries but {name} "
                             f"{base.num_embeddings} rows: the new tokens' ids would not be their rows")
        words = [new.token for new in settings.tokens]
        tables[name] = NewRowsEmbedding(base, torch.stack(rows).to(base.weight.device), words)
        encoder.set_input_embeddings(tables[name])
        # The pooled output is read at the end token; a legacy config (eos_token_id 2) reads it at the
        # largest id instead, which is now a new token's (kohya's "pool workaround" fixes the same).
        getattr(encoder, "text_model", encoder).eos_token_id = tokenizer.eos_token_id
    return TokenSet(settings, tables)


def save_embedding_files(tokens: TokenSet, folder: Path) -> list[Path]:
    """Per token: `<name>.safetensors` with `clip_l` and `clip_g` (A1111, Forge, ComfyUI), and
    `<name>.diffusers/{text_encoder,text_encoder_2}.safetensors` with `{token: vectors}`
    (diffusers' `load_textual_inversion`, one encoder each). Each file atomic and checked finite."""
    from safetensors.torch import save_file

    from .atomic import atomic_path

    written = []
    for new in tokens.settings.tokens:
        vectors = tokens.vectors(new.token)
        if not all(bool(torch.isfinite(tensor).all()) for tensor in vectors.values()):
            raise ValueError(f"the embedding of {new.token!r} is not finite; nothing written")
        stem = file_stem(new.token)
        files = {folder / f"{stem}.safetensors": {key: vectors[name].contiguous()
                                                  for name, (_, key) in ENCODERS.items()}}
        for name in ENCODERS:
            files[folder / f"{stem}.diffusers" / f"{name}.safetensors"] = {new.token: vectors[name].contiguous()}
        for path, tensors in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                save_file(tensors, str(tmp), metadata={"token": new.token, "vectors": str(new.vectors)})
            written.append(path)
    return written


def file_stem(token: str) -> str:
    """A file name for a token: its letters, digits, '-' and '_' (`<sks>` → `sks`)."""
    stem = "".join(char for char in token if char.isalnum() or char in "-_")
    return stem or "embedding"


def attach_tokens(pipe, config: Config, resume_folder: Path | None) -> TokenSet | None:
    """Add the config's new tokens to the pipeline (after the precision audit: their rows keep fp32
    master weights in encoders stored in the compute dtype) and, resuming, their saved vectors."""
    if not config.textual_inversion.tokens:
        return None
    tokens = add_tokens(pipe, config.textual_inversion)
    if resume_folder is not None:
        load_embedding_files(tokens, resume_folder)
    return tokens


def load_embedding_files(tokens: TokenSet, folder: Path, key: str = "training.resume_from") -> None:
    """Put the vectors of a checkpoint's embedding files back; a missing file or one of another
    shape (another model, another `vectors`) is a ConfigError naming it (and `key`, where it came from)."""
    from safetensors.torch import load_file

    start = 0
    for new in tokens.settings.tokens:
        path = folder / f"{file_stem(new.token)}.safetensors"
        if not path.is_file():
            raise ConfigError(f"{key}: no {path.name} in {folder} (the embedding of {new.token!r})")
        saved = load_file(path)
        for name, (_, name_key) in ENCODERS.items():
            table = tokens.tables[name].new
            expected = (new.vectors, table.shape[1])
            if name_key not in saved or tuple(saved[name_key].shape) != expected:
                found = tuple(saved[name_key].shape) if name_key in saved else "no such tensor"
                raise ConfigError(f"{key}: {path}: {name_key} is {found}, this run's {new.token!r} "
                                  f"needs {expected} (vectors, width)")
            with torch.no_grad():
                table[start:start + new.vectors] = saved[name_key].to(table.dtype)
        start += new.vectors


def set_training(tokens: TokenSet | None, step: int, total_steps: int) -> None:
    """The embeddings train during the first `train_fraction` of the steps (pivotal tuning)."""
    if tokens:
        on = step < tokens.settings.train_fraction * total_steps
        for parameter in tokens.parameters():
            parameter.requires_grad_(on)


def inversion_report(config: Config, data_plan: DatasetPlan, tokenizer) -> str:
    """The pre-flight lines of textual inversion: each token's captions (a warning where none holds
    it: it would not train); with a local tokenizer, the tokens and initializer words are checked."""
    import os

    settings = config.textual_inversion
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("textual_inversion.tokens: trains on one process only (the new rows are not "
                          "synchronised between processes); run it without accelerate launch")
    if tokenizer is not None:
        check_tokens(tokenizer, settings)
    captions = [sample.record.caption for sample in data_plan.samples]
    mode = "pivotal tuning (with the adapter)" if settings.train_adapter else "textual inversion (embeddings only)"
    lines = [f"{mode}: {sum(new.vectors for new in settings.tokens)} new vectors per encoder at lr {settings.lr:g}"]
    for index, new in enumerate(settings.tokens):
        count = sum(new.token in caption for caption in captions)
        if count:
            lines.append(f"  {new.token}: in {count} of {len(captions)} training samples' captions")
        else:
            lines.append(f"  warning: textual_inversion.tokens[{index}].token {new.token!r} is in none of the "
                         f"{len(captions)} training samples' captions: it gets no training (caption_prefix adds it)")
    return "\n".join(lines)


@contextmanager
def plain_embeddings(pipe, tokens: TokenSet | None) -> Iterator[None]:
    """The encoders with their original embedding tables while a pipeline folder is written (a
    merged single file holds the base vocabulary; the new tokens go in the embedding files)."""
    if tokens is None:
        yield
        return
    for name, table in tokens.tables.items():
        getattr(pipe, name).set_input_embeddings(table.base)
    try:
        yield
    finally:
        for name, table in tokens.tables.items():
            getattr(pipe, name).set_input_embeddings(table)
