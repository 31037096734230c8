"""SDXL's architecture with random weights, built locally (no download): full size for the GPU
benchmark, a narrower UNet and shallower text encoders for the converter benchmark.

The full-size configs are those of stabilityai/stable-diffusion-xl-base-1.0 (UNet 2.6 B
parameters, VAE, CLIP-L, OpenCLIP-bigG: sdxl_trainer/sdxl_base.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdxl_trainer.sdxl_base import CLIP_BIGG, CLIP_L, UNET, VAE

if TYPE_CHECKING:
    import torch

# The converter benchmark's "large" model: every SDXL key (all blocks, transformer depths 1/2/10),
# the UNet at a fifth of the width, CLIP-L with 4 layers and bigG with 2. About 1.65 GB in fp32;
# its largest tensor is bigG's token embedding (49408 × 1280, 253 MB), as in the real SDXL.
MID_SIZE: dict[str, dict[str, Any]] = {
    "unet": {"block_out_channels": (64, 128, 256), "attention_head_dim": (2, 4, 8)},
    "text_encoder": {"num_hidden_layers": 4},
    "text_encoder_2": {"num_hidden_layers": 2},
}


def sdxl_modules(device: str | torch.device = "meta", sizes: dict[str, dict[str, Any]] | None = None,
                 tokenizer=None) -> dict[str, torch.nn.Module]:
    """UNet, VAE and both text encoders with random weights, created directly on `device`
    (`meta`: shapes only). `sizes` overrides config keys per component; `tokenizer` supplies the
    special token ids (the pooled output of bigG is read at the end-of-text token)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    sizes = sizes or {}
    ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_token_id,
                                        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}

    def clip(base: dict[str, Any], name: str) -> CLIPTextConfig:
        return CLIPTextConfig(**{**base, **sizes.get(name, {})}, vocab_size=49408, max_position_embeddings=77, **ids)

    with torch.device(device):
        return {
            "unet": UNet2DConditionModel(**{**UNET, **sizes.get("unet", {})}),
            "vae": AutoencoderKL(**{**VAE, **sizes.get("vae", {})}),
            "text_encoder": CLIPTextModel(clip(CLIP_L, "text_encoder")),
            "text_encoder_2": CLIPTextModelWithProjection(clip(CLIP_BIGG, "text_encoder_2")),
        }


def write_random_pipeline(folder: Path, sizes: dict[str, dict[str, Any]], seed: int = 0) -> dict[str, float]:
    """A diffusers pipeline folder (the converter's input) with random fp32 weights, written one
    tensor at a time. Returns its total and largest tensor size in bytes."""
    import torch

    from sdxl_trainer.formats.safetensors_stream import DTYPE_NAMES, StreamWriter, TensorSpec

    generator = torch.Generator().manual_seed(seed)
    total = largest = 0
    for name, module in sdxl_modules("meta", sizes).items():
        target = folder / name
        target.mkdir(parents=True)
        if hasattr(module, "save_config"):
            module.save_config(target)
            stem = "diffusion_pytorch_model"
        else:
            module.config.save_pretrained(target)
            stem = "model"
        state = module.state_dict()
        specs = [TensorSpec(key, DTYPE_NAMES[t.dtype], tuple(t.shape)) for key, t in state.items()]
        with open(target / f"{stem}.safetensors", "wb") as handle, StreamWriter(handle, specs, {"format": "pt"}) as out:
            for tensor in state.values():
                out.write(torch.randn(tensor.shape, generator=generator).mul_(0.02))
                total += tensor.numel() * 4
                largest = max(largest, tensor.numel() * 4)
    return {"total_bytes": total, "largest_tensor_bytes": largest}
