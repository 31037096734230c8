"""The eval prompts file (`eval.prompts_path`): a JSON list with one object per image.

    [{"prompt": "tok, a red circle", "negative_prompt": "blurry", "seed": 1, "height": 64, "width": 64},
     {"prompt": "tok, a green ring", "resolution": "96x64"}]

`prompt` is required. `negative_prompt` defaults to none. `seed` defaults to the entry's index
(counting from 0, like the image file names), so every image keeps its seed from one eval to the
next and eval images stay comparable across training steps. The size is `width` and `height`, or
one `resolution` (or `size`) string "WIDTHxHEIGHT"; what is not given comes from `eval.width` and
`eval.height`. `group` names a set of prompts whose accuracy `eval.judge` reports together
(e.g. "concept" and "prior"). Every problem is a ConfigError naming the file and the entry, found before training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import BUCKET_KEY, ConfigError, closest

SIZE_MULTIPLE = 8  # the VAE's downsampling factor: latents need whole pixels
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
KEYS = ("prompt", "negative_prompt", "seed", "height", "width", "resolution", "size", "group")


@dataclass(frozen=True)
class EvalPrompt:
    """One eval image: what to render, with which seed, at which size."""

    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    group: str = ""  # prompts are judged per group (`eval.judge`), e.g. "concept" and "prior"
    max_tokens: int = 75  # the tokens each text encoder reads (`data.max_token_length`)


def load_prompts(path: str | Path, default_width: int, default_height: int) -> list[EvalPrompt]:
    """Read and validate the prompts file; the defaults are `eval.width` and `eval.height`."""
    where = f"eval.prompts_path = {str(path)!r}"
    for key, value in (("eval.width", default_width), ("eval.height", default_height)):
        if value % SIZE_MULTIPLE:
            raise ConfigError(f"{key} = {value}: must be a multiple of {SIZE_MULTIPLE}")
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a UTF-8 text file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f'{where}: must be a non-empty JSON list of objects like {{"prompt": "...", "seed": 1}}')
    prompts = []
    for index, entry in enumerate(entries):
        try:
            prompts.append(_parse_entry(entry, index, default_width, default_height))
        except ValueError as exc:
            raise ConfigError(f"{where}: entry {index}: {exc}") from None
    return prompts


def _parse_entry(entry: Any, index: int, default_width: int, default_height: int) -> EvalPrompt:
    """One entry; a ValueError says what is wrong with it."""
    if not isinstance(entry, dict):
        raise ValueError(f'must be an object like {{"prompt": "...", "seed": 1}}, not {json.dumps(entry)}')
    for key in entry:
        if key not in KEYS:
            match = closest(key, KEYS)
            hint = f'; did you mean "{match}"?' if match else f"; valid keys: {', '.join(KEYS)}"
            raise ValueError(f'unknown key "{key}"{hint}')
    if not isinstance(entry.get("prompt"), str):
        raise ValueError('"prompt" is required and must be a string')
    negative_prompt = entry.get("negative_prompt", "")
    if not isinstance(negative_prompt, str):
        raise ValueError('"negative_prompt" must be a string')
    seed = entry.get("seed", index)
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f'"seed" must be an integer from 0 to 2**64 - 1, not {json.dumps(seed)}')
    width, height = _size(entry, default_width, default_height)
    group = entry.get("group", "")
    if not isinstance(group, str):
        raise ValueError('"group" must be a string')
    return EvalPrompt(entry["prompt"], negative_prompt, seed, width, height, group)


def _size(entry: dict[str, Any], default_width: int, default_height: int) -> tuple[int, int]:
    """(width, height) from `resolution`/`size` or `width`/`height`, the defaults filling in."""
    given = [key for key in ("resolution", "size", "width", "height") if key in entry]
    text_key = next((key for key in given if key in ("resolution", "size")), None)
    if text_key is None:
        sizes = {"width": entry.get("width", default_width), "height": entry.get("height", default_height)}
    else:
        if len(given) > 1:
            raise ValueError(f"give the size once, not {' and '.join(given)} together")
        text = entry[text_key]
        match = BUCKET_KEY.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f'"{text_key}" must look like "1024x640" (width x height), not {json.dumps(text)}')
        sizes = {"width": int(match.group(1)), "height": int(match.group(2))}
    for name, value in sizes.items():
        if not _is_int(value) or value <= 0 or value % SIZE_MULTIPLE:
            raise ValueError(
                f'"{text_key or name}": the {name} must be a positive multiple of {SIZE_MULTIPLE} (the VAE works '
                f"on {SIZE_MULTIPLE}x{SIZE_MULTIPLE} pixel blocks), not {json.dumps(value)}"
            )
    return sizes["width"], sizes["height"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
