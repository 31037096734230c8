"""The attention backend of the UNet: FlashAttention, xformers or PyTorch SDPA.

`auto` takes FlashAttention when the package is installed and the GPU can run it (compute
capability 8.0 or newer), else PyTorch's scaled-dot-product attention; naming `flash` or
`xformers` makes a missing package a config error rather than a silent fallback.
"""

from __future__ import annotations

import importlib.util

from .config import ConfigError

PACKAGES = {"flash": "flash_attn", "xformers": "xformers"}
INSTALL = {"flash": "pip install flash-attn --no-build-isolation", "xformers": "pip install xformers"}


def check_attention(choice: str) -> None:
    """Config-time check that an explicitly named backend's package is installed."""
    if choice in PACKAGES and importlib.util.find_spec(PACKAGES[choice]) is None:
        raise ConfigError(
            f'model.attention = "{choice}" needs the {PACKAGES[choice]} package: {INSTALL[choice]} '
            '(or use "auto" / "sdpa")'
        )


def resolve_attention(choice: str, device_type: str) -> str:
    """The backend `auto` stands for on this machine."""
    if choice != "auto":
        return choice
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        import torch

        if torch.cuda.get_device_capability()[0] >= 8:
            return "flash"
    return "sdpa"


def set_attention(unet, choice: str, device_type: str) -> str:
    """Switch the UNet's attention to the chosen backend; returns what was chosen."""
    backend = resolve_attention(choice, device_type)
    if backend == "flash":
        unet.set_attention_backend("flash")
    elif backend == "xformers":
        unet.enable_xformers_memory_efficient_attention()
    return backend
