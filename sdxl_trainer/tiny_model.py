"""The built-in tiny SDXL: real SDXL topology, random weights, built locally and deterministically.

It exists so that the quickstart, the tests and the benchmarks run offline on a laptop CPU and go
through exactly the same loading code as a real model: it is written once as a diffusers
pipeline folder and then loaded from that folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
TINY_SDXL = "builtin:tiny-sdxl"
# Bump when the architecture or the tokenizer below changes: the cache folder is keyed by it.
TINY_SDXL_VERSION = 1

# Words the tiny tokenizer knows as whole tokens; anything else falls back to single characters.
_TOKENIZER_WORDS = (
    "a", "photo", "of", "the", "and", "with", "in", "on", "red", "green", "blue", "yellow",
    "orange", "purple", "white", "black", "gray", "circle", "square", "triangle", "stripes",
    "gradient", "checkerboard", "dots", "ring", "background", "foreground", "small", "large",
    "pattern", "shape", "colorful", "bright", "dark", "sky", "sunset", "portrait", "landscape",
    "painting", "style", "tok",
)


def default_cache_dir() -> Path:
    """Where built-in models are written: $SDXL_TRAINER_CACHE, else ~/.cache/sdxl_trainer."""
    root = os.environ.get("SDXL_TRAINER_CACHE") or Path.home() / ".cache" / "sdxl_trainer"
    return Path(root)


def tiny_sdxl_folder(cache_dir: Path | None = None) -> Path:
    """Where the tiny SDXL pipeline lives (it may not be built yet)."""
    return (cache_dir or default_cache_dir()) / f"tiny-sdxl-v{TINY_SDXL_VERSION}"


def tiny_sdxl_path(cache_dir: Path | None = None) -> Path:
    """Return the folder of the tiny SDXL pipeline, building it on first use."""
    folder = tiny_sdxl_folder(cache_dir)
    if not (folder / "model_index.json").is_file():
        _build_atomically(folder)
    return folder


def _build_atomically(folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        build_tiny_sdxl_pipeline().save_pretrained(tmp, safe_serialization=True)
        try:
            tmp.rename(folder)
        except OSError:
            # Another process finished first: its folder is identical, keep it.
            if not (folder / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tiny_clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A real CLIP byte-level BPE vocabulary: every byte, every byte at a word end, and the
    merges that spell out a few common words."""
    byte_chars = _byte_level_alphabet()
    tokens = byte_chars + [c + "</w>" for c in byte_chars]
    merges: list[tuple[str, str]] = []
    for word in _TOKENIZER_WORDS:
        parts = [*list(word[:-1]), word[-1] + "</w>"]
        while len(parts) > 1:
            merged = parts[0] + parts[1]
            merge = (parts[0], parts[1])
            if merge not in merges:
                merges.append(merge)
                tokens.append(merged)
            parts = [merged, *parts[2:]]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def _byte_level_alphabet() -> list[str]:
    """The 256 printable characters that byte-level BPE (GPT-2, CLIP) uses for the 256 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def build_tiny_tokenizers():
    """Two real CLIPTokenizers over the tiny vocabulary, padded as SDXL's are."""
    from transformers import CLIPTokenizer

    vocab, merges = _tiny_clip_vocab()
    tokenizer = CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=77)
    # SDXL's second tokenizer pads with "!" rather than the end-of-text token.
    tokenizer_2 = CLIPTokenizer(
        vocab=dict(vocab), merges=list(merges), model_max_length=77, pad_token="!"
    )
    return tokenizer, tokenizer_2


def build_tiny_sdxl_pipeline():
    """Build the tiny SDXL pipeline in memory with fixed seeds (same weights on every machine)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer, tokenizer_2 = build_tiny_tokenizers()
    # The two encoders have different widths on purpose (as CLIP-L and bigG do): a loader that
    # mixes them up fails loudly instead of passing by accident.
    te1_hidden, te2_hidden = 32, 48

    torch.manual_seed(0)
    text_encoder = CLIPTextModel(_clip_config(tokenizer, te1_hidden, "quick_gelu"))
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer_2, te2_hidden, "gelu"))
    torch.manual_seed(2)
    addition_time_embed_dim = 8
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64, 64),
        layers_per_block=2,
        transformer_layers_per_block=(1, 1, 2),
        attention_head_dim=(2, 4, 4),
        cross_attention_dim=te1_hidden + te2_hidden,
        norm_num_groups=32,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=addition_time_embed_dim,
        projection_class_embeddings_input_dim=6 * addition_time_embed_dim + te2_hidden,
    )
    torch.manual_seed(3)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 64, 64),
        layers_per_block=2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=64,
        scaling_factor=0.13025,
        force_upcast=True,
    )
    # SDXL base's own scheduler settings.
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
        beta_schedule="scaled_linear", prediction_type="epsilon", timestep_spacing="leading",
        steps_offset=1,
    )
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
        tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
    )


def _clip_config(tokenizer, hidden_size: int, activation: str):
    """A 3-layer CLIP text encoder config whose projection keeps the hidden width."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=77, hidden_act=activation,
        projection_dim=hidden_size, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
