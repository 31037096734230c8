"""SDXL text and size conditioning, computed exactly as the SDXL pipeline does at inference."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def encode_prompts(
    captions: list[str], tokenizers: list, text_encoders: list, device: torch.device, zero_empty: bool = False,
    max_tokens: int = 75,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (prompt_embeds, pooled_embeds) for a batch of captions.

    prompt_embeds concatenates both encoders' penultimate hidden states along the channel axis
    (768 + 1280 = 2048 for SDXL); pooled_embeds is the projected pooled output of encoder 2.
    With `zero_empty` (the pipeline's `force_zeros_for_empty_prompt`, true for SDXL base) an empty
    caption — a dropped one — gets all-zero embeddings: exactly the unconditional input that
    SDXL's classifier-free guidance uses at inference. `max_tokens` is `data.max_token_length`:
    over 75, long captions are encoded in 75-token chunks (long_prompts.py).
    """
    import torch

    hidden_states = []
    pooled = None
    for tokenizer, text_encoder in zip(tokenizers, text_encoders, strict=True):
        hidden, pooled = one_encoder(captions, tokenizer, text_encoder, device, max_tokens)
        hidden_states.append(hidden)
    prompt_embeds = torch.cat(hidden_states, dim=-1)
    if zero_empty:
        keep = torch.tensor([bool(caption) for caption in captions], device=prompt_embeds.device)
        prompt_embeds = prompt_embeds * keep[:, None, None].to(prompt_embeds.dtype)
        pooled = pooled * keep[:, None].to(pooled.dtype)
    return prompt_embeds, pooled


def one_encoder(captions: list[str], tokenizer, text_encoder, device,
                max_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One encoder's outputs for a batch: the captions that hold a new token (textual inversion,
    embeddings.py) through the live encoder, with gradients for the new rows; the others as
    without new tokens (from the text cache, or frozen one at a time, or trained)."""
    import torch

    from .long_prompts import common_length

    live = getattr(text_encoder, "live", None) or text_encoder  # a CachedEncoder keeps the encoder for those
    words = new_words(live)
    marked = [any(word in caption for word in words) for caption in captions]
    if not any(marked):
        return plain_outputs(captions, tokenizer, text_encoder, device, max_tokens)
    parts = {}
    for flag, run in ((False, plain_outputs), (True, encoder_outputs)):
        chosen = [index for index, mark in enumerate(marked) if mark == flag]
        if chosen:
            hidden, pooled = run([captions[index] for index in chosen], tokenizer, live if flag else text_encoder,
                                 device, max_tokens)
            parts.update({index: (hidden[row], None if pooled is None else pooled[row])
                          for row, index in enumerate(chosen)})
    rows = [parts[index] for index in range(len(captions))]
    pooled = None if any(pool is None for _, pool in rows) else torch.stack([pool for _, pool in rows])
    return common_length([hidden for hidden, _ in rows]), pooled


def new_words(encoder) -> list[str]:
    """The textual inversion tokens an encoder's embedding table holds (none without)."""
    module = getattr(encoder, "module", encoder)  # under DDP, the wrapped encoder
    table = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    return getattr(table, "words", [])


def plain_outputs(captions: list[str], tokenizer, text_encoder, device,
                  max_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Outputs for captions without new tokens: cached, trained (batched, with gradients) or frozen."""
    if hasattr(text_encoder, "cached_outputs"):  # the text cache's stand-in (text_cache.CachedEncoder)
        return text_encoder.cached_outputs(captions, device)
    rows = {id(parameter) for parameter in new_rows(text_encoder)}
    if any(param.requires_grad and id(param) not in rows for param in text_encoder.parameters()):
        return encoder_outputs(captions, tokenizer, text_encoder, device, max_tokens)
    return frozen_encoder_outputs(captions, tokenizer, text_encoder, device, max_tokens)


def new_rows(encoder) -> list:
    """The parameters of an encoder's new token rows (none without textual inversion)."""
    module = getattr(encoder, "module", encoder)
    table = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    return [table.new] if hasattr(table, "new") else []


def encoder_outputs(captions: list[str], tokenizer, text_encoder, device,
                    max_tokens: int = 75) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One encoder's (penultimate hidden states, pooled output) for a batch of captions; the pooled
    output is the projected one where the encoder has a projection (SDXL's encoder 2). A caption
    of several chunks gets its chunks' hidden states one after another and its first chunk's
    pooled output (long_prompts.py)."""
    import torch

    from .long_prompts import captions_ids, common_length

    rows = captions_ids(tokenizer, captions, max_tokens)
    output = text_encoder(torch.cat(rows).to(device), output_hidden_states=True)
    hidden = output.hidden_states[-2]
    pooled = output.text_embeds if hasattr(output, "text_embeds") else output.pooler_output
    counts = [len(ids) for ids in rows]
    firsts = torch.tensor([sum(counts[:index]) for index in range(len(counts))], device=hidden.device)
    contexts = [chunks.reshape(-1, hidden.shape[-1]) for chunks in hidden.split(counts)]
    return common_length(contexts), None if pooled is None else pooled[firsts]  # None: a recorded encoder 1


def frozen_encoder_outputs(captions: list[str], tokenizer, text_encoder, device,
                           max_tokens: int = 75) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A frozen encoder's outputs one caption at a time, exactly as the text cache computes them: a
    row of a matmul can come out different in its last bit with the batch it is computed in, and a
    run with the cache must train exactly like one without."""
    import torch

    from .long_prompts import common_length

    with torch.no_grad():
        rows = [encoder_outputs([caption], tokenizer, text_encoder, device, max_tokens) for caption in captions]
    pooled = [pooled for _, pooled in rows]
    return common_length([hidden[0] for hidden, _ in rows]), None if pooled[0] is None else torch.cat(pooled)


def pipeline_prompt_embeds(pipe, prompt: str, negative_prompt: str, max_tokens: int) -> dict[str, torch.Tensor]:
    """A long eval prompt's conditioning as the SDXL pipeline's keyword arguments: both prompts
    chunked as in training, the negative one zero when empty (the pipeline's
    `force_zeros_for_empty_prompt`, as its own `encode_prompt` does), both of one length."""
    embeds, pooled = encode_prompts(
        [prompt, negative_prompt], [pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2],
        pipe.device, zero_empty=pipe.config.force_zeros_for_empty_prompt, max_tokens=max_tokens)
    return {"prompt_embeds": embeds[:1], "negative_prompt_embeds": embeds[1:],
            "pooled_prompt_embeds": pooled[:1], "negative_pooled_prompt_embeds": pooled[1:]}


def add_time_ids(
    original_sizes: torch.Tensor, crops_top_left: torch.Tensor, target_sizes: torch.Tensor
) -> torch.Tensor:
    """SDXL micro-conditioning: (orig_h, orig_w, crop_top, crop_left, target_h, target_w) per image."""
    import torch

    return torch.cat([original_sizes, crops_top_left, target_sizes], dim=1).float()
