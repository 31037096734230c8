"""The built-in tiny SDXL: real SDXL topology, pretrained on the world of shapes, shipped in the package.

It exists so that the quickstart, the tests and the benchmarks run offline on a laptop CPU, go
through exactly the same loading code as a real model, and show learning a person and a test can
see: its UNet and text encoders were trained by this trainer on `world/scenes.py`'s images
(tools/pretrain_tiny_sdxl.py rebuilds the weights from nothing). The architecture is built here
from code with fixed seeds, the shipped fp16 weights (checked against their sha256) are loaded
into it, and the result is written once as a diffusers pipeline folder and loaded from there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
TINY_SDXL = "builtin:tiny-sdxl"
# Bump when the architecture, the tokenizer or the folder's layout changes: the cache folder is
# keyed by it. 3: the folder holds a manifest of its files' hashes (older folders are left unused,
# not rebuilt in place, where two processes starting at once could race).
TINY_SDXL_VERSION = 3
# The sha256 of the shipped weights (tools/pretrain_tiny_sdxl.py prints it when it writes them).
TINY_SDXL_SHA256 = "5780df27ffe2f4c5fb0655b0970342ccbe0866295620e289941490d8cf0c3d5e"
# Written into the built folder: the sha256 of every file the build wrote, checked on each use.
MANIFEST = "sha256.json"

# Words the tiny tokenizer knows as whole tokens; anything else falls back to single characters.
_TOKENIZER_WORDS = (
    "a", "photo", "of", "the", "and", "with", "in", "on", "red", "green", "blue", "yellow",
    "orange", "purple", "white", "black", "gray", "circle", "square", "triangle", "stripes",
    "gradient", "checkerboard", "dots", "ring", "background", "foreground", "small", "large",
    "pattern", "shape", "colorful", "bright", "dark", "sky", "sunset", "portrait", "landscape",
    "painting", "style", "tok", "cross",
)


def shipped_weights_path() -> Path:
    """The pretrained weights of the tiny SDXL, shipped in the package (tools/pretrain_tiny_sdxl.py makes them)."""
    return Path(__file__).resolve().parent / "weights" / "tiny_sdxl.fp16.safetensors"


def default_cache_dir() -> Path:
    """Where built-in models are written: $SDXL_TRAINER_CACHE, else ~/.cache/sdxl_trainer."""
    root = os.environ.get("SDXL_TRAINER_CACHE") or Path.home() / ".cache" / "sdxl_trainer"
    return Path(root)


def tiny_sdxl_folder(cache_dir: Path | None = None) -> Path:
    """Where the tiny SDXL pipeline lives (it may not be built yet); named by the weights' hash, so
    new shipped weights are a new folder."""
    return (cache_dir or default_cache_dir()) / f"tiny-sdxl-v{TINY_SDXL_VERSION}-{TINY_SDXL_SHA256[:12]}"


def tiny_sdxl_path(cache_dir: Path | None = None) -> Path:
    """Return the folder of the tiny SDXL pipeline, building it on first use and rebuilding it
    when its files are not the ones the build wrote (a damaged cache would load other weights,
    or fail deep in diffusers)."""
    folder = tiny_sdxl_folder(cache_dir)
    if folder.exists():
        damage = _damage(folder)
        if damage is None:
            return folder
        print(f"warning: rebuilding the built-in tiny SDXL's cache folder {folder}: {damage}",
              file=sys.stderr, flush=True)
        _discard(folder)
    _build_atomically(folder)
    return folder


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _damage(folder: Path) -> str | None:
    """What is wrong with a built folder against its manifest, or None when every file is intact."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"no readable {MANIFEST} (damaged, or built by an older version)"
    if not isinstance(manifest, dict) or "model_index.json" not in manifest:
        return f"{MANIFEST} does not list the folder's files"
    try:
        stamp = tuple((stat.st_size, stat.st_mtime_ns) for stat in ((folder / name).stat() for name in manifest))
    except OSError:  # a file is missing: the loop below names it
        stamp = None
    if stamp is not None and _VERIFIED.get(folder) == stamp:  # a run asks several times: hash once
        return None
    for name, digest in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if _sha256(path) != digest:
            return f"{name} is damaged (not the file that was built)"
    _VERIFIED[folder] = stamp
    return None


# The folders this process found intact, with their files' sizes and modification times then: a
# later call with the same stamps skips hashing 18 MB again.
_VERIFIED: dict[Path, tuple | None] = {}


def _discard(folder: Path) -> None:
    """Move a damaged folder out of the way (atomically, so no run loads half of it), then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=folder.name + ".damaged-", dir=folder.parent))
    try:
        folder.rename(aside / folder.name)
    except FileNotFoundError:
        pass  # another process moved it first
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _build_atomically(folder: Path) -> None:
    import torch

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        # The build reseeds torch's CPU generator: without the fork, the run that builds the folder
        # (after setting its seed) would draw its adapter init and noise from the build's seeds and
        # train differently from every later run with the same seed.
        with torch.random.fork_rng(devices=[]):
            pipe = build_pretrained_tiny_sdxl()
        pipe.save_pretrained(tmp, safe_serialization=True)
        files = sorted(path for path in tmp.rglob("*") if path.is_file())
        manifest = {path.relative_to(tmp).as_posix(): _sha256(path) for path in files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
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


def build_pretrained_tiny_sdxl():
    """The tiny SDXL architecture with the shipped pretrained weights, after checking their hash."""
    path = shipped_weights_path()
    digest = _sha256(path) if path.is_file() else "missing"
    if digest != TINY_SDXL_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {TINY_SDXL_SHA256}; the shipped weights of the "
                           "built-in tiny SDXL are damaged (git checkout the file, or rebuild them with "
                           "tools/pretrain_tiny_sdxl.py)")
    return tiny_sdxl_from_weights(path)


def tiny_sdxl_from_weights(path: Path):
    """The tiny SDXL architecture with the weights of an fp16 file in the shipped layout, in fp32."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    pipe = build_tiny_sdxl_pipeline()
    tensors = load_file(path)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        component = getattr(pipe, name)
        prefix = name + "."
        state = {key[len(prefix):]: value.float() for key, value in tensors.items() if key.startswith(prefix)}
        component.load_state_dict(state, strict=True, assign=False)
    with safe_open(path, "pt") as handle:
        pipe.vae.register_to_config(scaling_factor=float(handle.metadata()["vae_scaling_factor"]))
    return pipe


def build_tiny_sdxl_pipeline():
    """The tiny SDXL architecture with random weights from fixed seeds (the pretraining recipe's
    starting point; the same weights on every machine)."""
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

    cpu = torch.random.default_generator  # the modules are made on the CPU; a caller's GPU streams stay as they were
    cpu.manual_seed(0)
    text_encoder = CLIPTextModel(_clip_config(tokenizer, te1_hidden, "quick_gelu"))
    cpu.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer_2, te2_hidden, "gelu"))
    cpu.manual_seed(2)
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
        # 8 groups, as for the VAE below: with 32 groups of one channel the output's last norm is
        # an instance norm, which cannot give a whole image a colour.
        norm_num_groups=8,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=addition_time_embed_dim,
        projection_class_embeddings_input_dim=6 * addition_time_embed_dim + te2_hidden,
    )
    cpu.manual_seed(3)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 64, 64),
        layers_per_block=2,
        latent_channels=4,
        # One group, not 32: with one channel per group every norm is an instance norm, which erases
        # a flat colour's value; trained with 32 groups this VAE could not learn the world's colours.
        norm_num_groups=1,
        sample_size=64,
        scaling_factor=0.13025,
        force_upcast=True,
    )
    # SDXL base's own scheduler settings.
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
        beta_schedule="scaled_linear", prediction_type="v_prediction", timestep_spacing="leading",
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
