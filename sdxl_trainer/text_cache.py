"""Content-addressed text-encoder output cache: one `.safetensors` file per encoder and caption text.

For every frozen text encoder it holds what SDXL uses of its output: the penultimate hidden
states, and for encoder 2 (OpenCLIP bigG) the pooled projection too. The file name is a hash of
everything that output depends on: the caption text (after dropout and shuffle), the tokenizer,
the encoder's weights, the compute and the storage dtype, and `data.max_token_length` where it
is over 75 (a long caption's entry then holds 77 hidden states per 75-token chunk). An edited
caption or another encoder is therefore a miss, never a stale hit. Entries are checked when read
(finite, expected shapes and dtype) and rebuilt when damaged; every write is atomic. A trained
encoder is never cached: its outputs change every step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .latent_cache import DTYPES, load_checked_entry, save_entry
from .latent_cache import vae_fingerprint as weights_fingerprint
from .long_prompts import CHUNK_TOKENS, common_length
from .precision import ENCODERS, cached_encoders

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from .config import Config, ModelConfig
    from .data_plan import DatasetPlan
    from .eval.eval_prompts import EvalPrompt
    from .precision import PrecisionPlan

CACHE_FORMAT = 1
TOKENIZERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
POOLED = "text_encoder_2"  # SDXL's pooled conditioning is encoder 2's projected pooled output
# The long-caption entries' tokenization: 2 since each word is tokenized (1 read "A" as "A</w>").
LONG_FORMAT = 2


def tokenizer_fingerprint(tokenizer) -> str:
    """Identity of a tokenizer from what decides its token ids: its vocabulary and merges (the
    fast tokenizer's full description where there is one) and its length."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    description = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    text = f"{type(tokenizer).__name__}\n{tokenizer.model_max_length}\n{description}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class EncoderSpec:
    """One cached encoder: its identity (tokenizer and weights) and, once it is loaded, the shapes of
    its entries (an entry of other shapes is damaged)."""

    tokenizer_id: str
    weights_id: str
    shapes: dict[str, tuple[int | None, ...]] = field(default_factory=dict)


class TextCache:
    """Reads and writes cached encoder outputs under `cache_dir` for some encoders, a compute dtype
    and a storage dtype."""

    def __init__(self, cache_dir: str | Path, encoders: dict[str, EncoderSpec], dtype: str, compute: str,
                 max_tokens: int = 75):
        self.cache_dir = Path(cache_dir)
        self.encoders = encoders
        self.dtype = dtype  # storage: "fp32", "fp16" or "bf16"
        self.compute = compute  # what the encoder ran in
        self.max_tokens = max_tokens  # data.max_token_length

    def path(self, name: str, text: str) -> Path:
        spec = self.encoders[name]
        fields = {"text": text, "encoder": name, "tokenizer": spec.tokenizer_id, "weights": spec.weights_id,
                  "dtype": self.dtype, "compute": self.compute, "format": CACHE_FORMAT}
        if self.max_tokens != CHUNK_TOKENS:  # 75 keeps the keys of the caches written before the option
            fields["max_tokens"], fields["long_format"] = self.max_tokens, LONG_FORMAT
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.safetensors"

    def load(self, name: str, text: str) -> dict[str, torch.Tensor] | None:
        """The cached tensors, or None when missing or damaged (a damaged entry is deleted)."""
        return load_checked_entry(self.path(name, text), self.encoders[name].shapes, self.dtype)

    def save(self, name: str, text: str, tensors: dict[str, torch.Tensor]) -> None:
        import torch

        save_entry(self.path(name, text), tensors, getattr(torch, DTYPES[self.dtype]),
                   {"format": CACHE_FORMAT, "encoder": name})

    def missing(self, name: str, texts: Iterable[str]) -> list[str]:
        return [text for text in texts if self.load(name, text) is None]

    def present(self, texts: Iterable[str]) -> tuple[int, int]:
        """(entries present, their bytes on disk) over every cached encoder, by presence only."""
        paths = [self.path(name, text) for name in self.encoders for text in texts]
        sizes = [path.stat().st_size for path in paths if path.is_file()]
        return len(sizes), sum(sizes)


def encoder_spec(tokenizer, text_encoder: torch.nn.Module, name: str, max_tokens: int = 75) -> EncoderSpec:
    """The spec of a loaded encoder: fingerprints, and the entry shapes from its config (a long
    caption's hidden states have 77 rows per chunk: any length, with `max_tokens` over 75)."""
    config = text_encoder.config
    shapes = {"hidden": (tokenizer.model_max_length if max_tokens == CHUNK_TOKENS else None, config.hidden_size)}
    if name == POOLED:
        shapes["pooled"] = (config.projection_dim,)
    # Without the new token rows (textual inversion): they train, and no cached caption reads them.
    weights = [value for key, value in text_encoder.state_dict().items() if not key.endswith("token_embedding.new")]
    return EncoderSpec(tokenizer_fingerprint(tokenizer), weights_fingerprint(weights), shapes)


class CachedEncoder:
    """A cached encoder's place in the loss: its outputs read from the text cache, while the
    encoder itself stays off the training device. With `zero_empty` the empty (dropped) caption
    needs no entry: `encode_prompts` zeroes its embedding anyway. `live`: the encoder itself, kept for
    the captions that hold a textual inversion token (never cached: their rows train)."""

    def __init__(self, cache: TextCache, name: str, zero_empty: bool, live: torch.nn.Module | None = None):
        self.cache, self.name, self.zero_empty, self.live = cache, name, zero_empty, live

    def cached_outputs(self, captions: list[str], device) -> tuple[torch.Tensor, torch.Tensor | None]:
        import torch

        shapes = self.cache.encoders[self.name].shapes
        dtype = getattr(torch, DTYPES[self.cache.dtype])
        entries = []
        for caption in captions:
            entry = None if (self.zero_empty and not caption) else self.cache.load(self.name, caption)
            if entry is None and (caption or not self.zero_empty):
                raise RuntimeError(f"text cache entry of {self.name} for {caption!r} vanished during training")
            entries.append(entry or {key: torch.zeros([CHUNK_TOKENS + 2 if size is None else size for size in shape],
                                                      dtype=dtype) for key, shape in shapes.items()})
        hidden = common_length([entry["hidden"] for entry in entries]).to(device)
        pooled = torch.stack([entry["pooled"] for entry in entries]).to(device) if "pooled" in shapes else None
        return hidden, pooled


def build_text_cache(cache: TextCache, texts: list[str], pipe, device, autocast) -> tuple[int, int]:
    """Encode the (encoder, text) pairs missing from the cache, one text at a time as a frozen
    encoder runs live (`frozen_encoder_outputs`), under the training's `autocast`. Returns (hits, built).
    First the temps of writers killed mid-entry go."""
    from tqdm.auto import tqdm

    from .atomic import remove_dead_temps
    from .conditioning import frozen_encoder_outputs

    remove_dead_temps(cache.cache_dir, depth=1)

    missing = [(name, text) for name in cache.encoders for text in cache.missing(name, texts)]
    for name, text in tqdm(missing, desc="caching text embeddings", disable=not missing):
        tokenizer, encoder = getattr(pipe, TOKENIZERS[name]), getattr(pipe, name)
        with autocast:
            hidden, pooled = frozen_encoder_outputs([text], tokenizer, encoder, device, cache.max_tokens)
        cache.save(name, text, {"hidden": hidden[0], "pooled": pooled[0]} if name == POOLED else {"hidden": hidden[0]})
    return len(cache.encoders) * len(texts) - len(missing), len(missing)


def run_texts(config: Config, data_plan: DatasetPlan, seed: int, zero_empty: bool) -> list[str]:
    """Every caption text the run can encode (with output preservation, also the captions it reads
    with a class word); with `zero_empty` not the empty one (its embedding is zero)."""
    from .captions import possible_captions
    from .output_preservation import preserved_texts

    # Each image with its own folder's caption options; once per (caption, folder), not per repeat.
    pairs = {(sample.record.caption, id(sample.folder)): (sample.record.caption, sample.folder)
             for sample in data_plan.samples + data_plan.validation}
    texts = possible_captions(pairs.values(), seed)
    texts |= preserved_texts(texts, config.training.output_preservation)
    if zero_empty:
        texts.discard("")
    return sorted(text for text in texts if not holds_new_token(config, text))


def holds_new_token(config: Config, text: str) -> bool:
    """Whether a caption holds a textual inversion token: it is encoded live, never cached."""
    return any(new.token in text for new in config.textual_inversion.tokens)


def make_text_cache(config: Config, encoders: dict[str, EncoderSpec], compute: str) -> TextCache:
    """The run's text cache for these encoders; `compute` is the dtype they run in."""
    settings = config.data.text_cache
    return TextCache(settings.cache_dir, encoders, compute if settings.dtype == "auto" else settings.dtype, compute,
                     config.data.max_token_length)


@dataclass
class StandIns:
    """What plays the cached encoders: in the loss (training and validation), and in eval rendering."""

    loss: dict[str, CachedEncoder] = field(default_factory=dict)
    eval: dict[str, torch.nn.Module] = field(default_factory=dict)


def prepare_text_cache(config: Config, data_plan: DatasetPlan | None, prompts: list[EvalPrompt],
                       accelerator: Accelerator, pipe, seed: int, precision: PrecisionPlan) -> StandIns:
    """Cache the frozen encoders' outputs (the first process of each machine builds, as for the
    latents), record them for the eval prompts, then move those encoders to the CPU."""
    from .recorded_encoder import record_encoder

    names = precision.cached if data_plan is not None else ()
    stand_ins = StandIns()
    if not names:
        return stand_ins
    max_tokens = config.data.max_token_length
    specs = {name: encoder_spec(getattr(pipe, TOKENIZERS[name]), getattr(pipe, name), name, max_tokens)
             for name in names}
    cache = make_text_cache(config, specs, precision.compute)
    zero_empty = pipe.config.force_zeros_for_empty_prompt
    texts = run_texts(config, data_plan, seed, zero_empty)
    with accelerator.local_main_process_first():
        hits, built = build_text_cache(cache, texts, pipe, accelerator.device, precision.autocast())
    accelerator.print(f"text cache: {hits} hits, {built} encoded now ({len(texts)} texts for {', '.join(names)})")
    eval_texts = [text for prompt in prompts for text in (prompt.prompt, prompt.negative_prompt)] + [""]
    inverted = bool(config.textual_inversion.tokens)  # the encoders stay: captions with new tokens run live
    for name in names:
        stand_ins.loss[name] = CachedEncoder(cache, name, zero_empty, getattr(pipe, name) if inverted else None)
        if inverted:
            continue
        if prompts and accelerator.is_main_process:
            stand_ins.eval[name] = record_encoder(getattr(pipe, TOKENIZERS[name]), getattr(pipe, name), eval_texts,
                                                  name, max_tokens)
        getattr(pipe, name).to("cpu")
    return stand_ins


def specs_from_files(model: ModelConfig, names: tuple[str, ...]) -> dict[str, EncoderSpec] | None:
    """The cached encoders' specs read from a diffusers folder (or the built tiny model) without
    building a model; None where that needs a download or a conversion (hub ids, single files)."""
    from transformers import CLIPTokenizer

    from .latent_cache import vae_fingerprint_from_files
    from .models import resolve_source
    from .tiny_model import tiny_sdxl_folder

    source = resolve_source(model.id)
    if source.kind not in ("builtin", "folder"):
        return None
    folder = tiny_sdxl_folder() if source.kind == "builtin" else Path(source.location)
    specs = {}
    for name in names:
        weight_files = sorted((folder / name).glob("*.safetensors"))
        if not weight_files or not (folder / TOKENIZERS[name]).is_dir():
            return None
        tokenizer = CLIPTokenizer.from_pretrained(folder / TOKENIZERS[name])
        specs[name] = EncoderSpec(tokenizer_fingerprint(tokenizer), vae_fingerprint_from_files(weight_files))
    return specs


def text_cache_status(config: Config, data_plan: DatasetPlan, seed: int | None) -> str:
    """Which encoders are cached and which run live, how many texts, and (when the encoders'
    files are local and the seed is known) hits, misses and the cache's size on disk."""
    names = cached_encoders(config)
    trained = (config.model.train_text_encoder_1, config.model.train_text_encoder_2)
    live = [f"{name} live ({'trained' if is_trained else 'cache off'})"
            for name, is_trained in zip(ENCODERS, trained, strict=True) if name not in names]
    where = ", ".join([f"{name} cached" for name in names] + live)
    data = config.data
    if data.text_cache.enabled and data.shuffles_without_variants():
        return (f"{where}: caption shuffle draws a new order every epoch (set caption_shuffle_variants "
                "to cache that many orders per caption)")
    if not names:
        return where
    if seed is None:
        return f"{where}; texts, hits and misses are counted once the seed is drawn"
    texts = run_texts(config, data_plan, seed, zero_empty=True)  # SDXL's force_zeros_for_empty_prompt
    variants = sorted({folder.caption_shuffle_variants for folder in data.folders() if folder.caption_shuffle_prob > 0})
    variants_said = f", {'/'.join(map(str, variants))} shuffle variants per caption" if variants else ""
    images = len(data_plan.scan.images) + len(data_plan.scan.validation)
    inverted = len({s.record.caption for s in data_plan.samples if holds_new_token(config, s.record.caption)})
    live_said = f", {inverted} with a new token, encoded live" if inverted else ""
    line = f"{where}; {len(texts)} caption texts ({images} images{variants_said}{live_said})"
    specs = specs_from_files(config.model, names)
    if specs is None:
        return f"{line}; hits and misses are counted once the encoders are loaded"
    cache = make_text_cache(config, specs, {"no": "fp32"}.get(config.precision, config.precision))
    present, size = cache.present(texts)
    total = len(texts) * len(names)
    return f"{line}: {present} hits, {total - present} misses (to encode before training), {size / 1e6:.2f} MB " \
           f"in {cache.cache_dir}"
