"""Eval without a cached encoder on the device: its outputs for the eval prompts, recorded once.

Eval prompts never change, so a frozen encoder's outputs for them are computed once, when the text
cache is built, and a `RecordedEncoder` plays that encoder in the eval pipeline. The pipeline
(diffusers' `encode_prompt`, also behind the ComfyUI-style samplers) reads `hidden_states[-2]`,
the penultimate layer, and from encoder 2 `[0]`, the pooled projection: that is what is recorded.
"""

from __future__ import annotations

import torch
from transformers.models.clip.modeling_clip import CLIPTextModelOutput

from .long_prompts import caption_ids


class RecordedEncoder(torch.nn.Module):
    """Returns the recorded outputs of a text encoder for the token ids it was recorded with."""

    def __init__(self, outputs: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]], name: str,
                 config):
        super().__init__()
        self.outputs, self.name = outputs, name
        self.config = config  # the encoder's (the pipeline reads encoder 2's projection_dim)
        hidden = next(iter(outputs.values()))[0]
        self.register_buffer("anchor", torch.zeros((), dtype=hidden.dtype, device=hidden.device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def forward(self, input_ids: torch.Tensor, output_hidden_states: bool = True) -> CLIPTextModelOutput:
        rows = []
        for ids in input_ids.tolist():
            if tuple(ids) not in self.outputs:
                raise KeyError(f"{self.name} was recorded for the eval prompts only, not for token ids {ids[:8]}…")
            rows.append(self.outputs[tuple(ids)])
        hidden = torch.stack([hidden for hidden, _ in rows]).to(self.device)
        pooled = torch.stack([pooled for _, pooled in rows]).to(self.device) if rows[0][1] is not None else None
        return CLIPTextModelOutput(text_embeds=pooled, last_hidden_state=hidden, hidden_states=(hidden, None))


def record_encoder(tokenizer, text_encoder: torch.nn.Module, prompts: list[str], name: str,
                   max_tokens: int = 75) -> RecordedEncoder:
    """Run the encoder once per prompt (where it is now) and record what the pipeline reads, row by
    row: a long prompt's chunks (`max_tokens` over 75) are rows of their own."""
    outputs = {}
    with torch.no_grad():
        for prompt in sorted(set(prompts)):
            ids = caption_ids(tokenizer, prompt, max_tokens)
            output = text_encoder(ids.to(text_encoder.device), output_hidden_states=True)
            for row, row_ids in enumerate(ids.tolist()):
                pooled = output.text_embeds[row] if hasattr(output, "text_embeds") else None
                outputs[tuple(row_ids)] = (output.hidden_states[-2][row], pooled)
    return RecordedEncoder(outputs, name, text_encoder.config)
