"""The configs of SDXL base 1.0's UNet, VAE and text encoders (stabilityai/stable-diffusion-xl-base-1.0):
the layer shapes every SDXL checkpoint shares. The benchmarks build full-size SDXL from them
(bench/sdxl_arch.py), and the pre-flight reads its layer shapes from them where a model's own
configs are not on disk (a single file without `model.config_dir`, a hub model not yet downloaded).
"""

from __future__ import annotations

from typing import Any

UNET: dict[str, Any] = dict(
    sample_size=128, layers_per_block=2, block_out_channels=(320, 640, 1280), attention_head_dim=(5, 10, 20),
    transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048, use_linear_projection=True,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
)
CLIP_L: dict[str, Any] = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              hidden_act="quick_gelu", projection_dim=768)
CLIP_BIGG: dict[str, Any] = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                 num_attention_heads=20, hidden_act="gelu", projection_dim=1280)
VAE: dict[str, Any] = dict(
    block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4, sample_size=1024,
    scaling_factor=0.13025,
)
