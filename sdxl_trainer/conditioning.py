"""SDXL text and size conditioning, computed exactly as the SDXL pipeline does at inference."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def encode_prompts(
    captions: list[str], tokenizers: list, text_encoders: list, device: torch.device, zero_empty: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (prompt_embeds, pooled_embeds) for a batch of captions.

    prompt_embeds concatenates both encoders' penultimate hidden states along the channel axis
    (768 + 1280 = 2048 for SDXL); pooled_embeds is the projected pooled output of encoder 2.
    With `zero_empty` (the pipeline's `force_zeros_for_empty_prompt`, true for SDXL base) an empty
    caption — a dropped one — gets all-zero embeddings: exactly the unconditional input that
    SDXL's classifier-free guidance uses at inference.
    """
    import torch

    hidden_states = []
    pooled = None
    for tokenizer, text_encoder in zip(tokenizers, text_encoders, strict=True):
        if hasattr(text_encoder, "cached_outputs"):  # the text cache's stand-in (text_cache.CachedEncoder)
            hidden, pooled = text_encoder.cached_outputs(captions, device)
        elif any(param.requires_grad for param in text_encoder.parameters()):
            hidden, pooled = encoder_outputs(captions, tokenizer, text_encoder, device)
        else:
            hidden, pooled = frozen_encoder_outputs(captions, tokenizer, text_encoder, device)
        hidden_states.append(hidden)
    prompt_embeds = torch.cat(hidden_states, dim=-1)
    if zero_empty:
        keep = torch.tensor([bool(caption) for caption in captions], device=prompt_embeds.device)
        prompt_embeds = prompt_embeds * keep[:, None, None].to(prompt_embeds.dtype)
        pooled = pooled * keep[:, None].to(pooled.dtype)
    return prompt_embeds, pooled


def prompt_ids(tokenizer, captions: list[str]) -> torch.Tensor:
    """Token ids padded and truncated to the tokenizer's length, as the SDXL pipeline makes them."""
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def encoder_outputs(captions: list[str], tokenizer, text_encoder, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One encoder's (penultimate hidden states, pooled output) for a batch of captions; the pooled
    output is the projected one where the encoder has a projection (SDXL's encoder 2)."""
    output = text_encoder(prompt_ids(tokenizer, captions).to(device), output_hidden_states=True)
    return output.hidden_states[-2], output.text_embeds if hasattr(output, "text_embeds") else output.pooler_output


def frozen_encoder_outputs(captions: list[str], tokenizer, text_encoder,
                           device) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen encoder's outputs one caption at a time, exactly as the text cache computes them: a
    row of a matmul can come out different in its last bit with the batch it is computed in, and a
    run with the cache must train exactly like one without."""
    import torch

    with torch.no_grad():
        rows = [encoder_outputs([caption], tokenizer, text_encoder, device) for caption in captions]
    return torch.cat([hidden for hidden, _ in rows]), torch.cat([pooled for _, pooled in rows])


def add_time_ids(
    original_sizes: torch.Tensor, crops_top_left: torch.Tensor, target_sizes: torch.Tensor
) -> torch.Tensor:
    """SDXL micro-conditioning: (orig_h, orig_w, crop_top, crop_left, target_h, target_w) per image."""
    import torch

    return torch.cat([original_sizes, crops_top_left, target_sizes], dim=1).float()
