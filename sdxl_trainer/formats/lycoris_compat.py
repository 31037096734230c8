"""Which LoKr modules LyCORIS cannot load back, predicted from layer shapes alone (no LyCORIS
needed), for the pre-flight to warn about.

LyCORIS (lycoris-lora 4.1.3, `lycoris/modules/lokr.py`, `LokrModule.make_module_from_state_dict`;
its kohya loader `lycoris.kohya.create_network_from_weights` and `create_lycoris_from_weights` go
through it) does not read the factor from a file: it rebuilds each module by guessing the factor
from the tensor shapes, builds new Kronecker factors for the guess, and copies the file's tensors
into them. Two things go wrong on SDXL:

- a convolution whose large factor is decomposed stores `lokr_w2_b` as (rank, in·kh·kw); the
  guess multiplies the kernel into the input width (17280 for 1920 × 3 × 3), so "as square as
  possible" (factor -1) is not recognised, and the fallback guess (the larger side of `lokr_w1`)
  splits the output width differently: `up_blocks.1.resnets.0.conv1` (640 × 1920 × 3 × 3) at
  factor -1 and rank < 24 becomes w1 16 × 40 where the file holds 20 × 40, and the copy fails;
- a factor above the square root of a width: peft (which trains the adapter) keeps (factor,
  width/factor) in that order, LyCORIS orders the pair small-first, so the factors come out
  transposed (factor 32 or 64 on most SDXL layers).

ComfyUI multiplies the factors as stored and is not affected. `lycoris_mismatches` follows both
codes step by step; tests/test_lycoris_adapters.py checks it against LyCORIS and peft on every
full-size SDXL layer shape.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import AdapterConfig, Config

Shape = tuple[int, ...]
# Factors the warning proposes instead, in order of preference (each is exact on SDXL base).
SAFER_FACTORS = (8, 4, 16, 2)


def peft_factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """peft's `factorization` (peft/tuners/lokr/layer.py): (factor, dimension/factor) where the
    factor divides the dimension, in that order; else the most square split with m <= factor."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    return _square_split(dimension, dimension if factor == -1 else factor)


def lycoris_factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS's `factorization` (lycoris/functional/general.py): as peft's, smaller value first."""
    if factor > 0 and dimension % factor == 0:
        return tuple(sorted((factor, dimension // factor)))
    return _square_split(dimension, dimension if factor < 0 else factor)


def _square_split(dimension: int, factor: int) -> tuple[int, int]:
    m, n = 1, dimension
    while m < n:
        new_m = m + 1
        while dimension % new_m:
            new_m += 1
        if new_m + dimension // new_m > m + n or new_m > factor:
            break
        m, n = new_m, dimension // new_m
    return min(m, n), max(m, n)


def lokr_parts(weight: Shape, out_pair: tuple[int, int], in_pair: tuple[int, int], rank: int,
               decompose_w1: bool, full_w2: bool) -> dict[str, Shape]:
    """The LoKr tensors of a Linear (out, in) or Conv2d (out, in, kh, kw) weight split as
    out = a·b, in = c·d: `lokr_w1` (a, c) or its rank-`rank` factors, `lokr_w2` (b, d, kh, kw) or
    (b, rank) @ (rank, d·kh·kw), as peft and LyCORIS (without Tucker) both lay them out."""
    (a, b), (c, d), kernel = out_pair, in_pair, weight[2:]
    parts = {"lokr_w1_a": (a, rank), "lokr_w1_b": (rank, c)} if decompose_w1 else {"lokr_w1": (a, c)}
    if full_w2:
        return parts | {"lokr_w2": (b, d, *kernel)}
    return parts | {"lokr_w2_a": (b, rank), "lokr_w2_b": (rank, d * math.prod(kernel))}


def peft_lokr_parts(weight: Shape, rank: int, factor: int, decompose_both: bool) -> dict[str, Shape]:
    """What peft's LoKrLayer.update_layer creates for this weight (use_effective_conv2d off, as
    adapters.peft_config leaves it); these shapes go unchanged into the kohya file."""
    out_pair, in_pair = peft_factorization(weight[0], factor), peft_factorization(weight[1], factor)
    decompose_w1 = decompose_both and rank < max(out_pair[0], in_pair[0]) / 2
    return lokr_parts(weight, out_pair, in_pair, rank, decompose_w1, rank >= max(out_pair[1], in_pair[1]) / 2)


def lycoris_guessed_factor(parts: dict[str, Shape]) -> int:
    """The factor LokrModule.make_module_from_state_dict guesses from a module's tensors."""
    w1 = parts.get("lokr_w1") or (parts["lokr_w1_a"][0], parts["lokr_w1_b"][1])
    w2 = parts.get("lokr_w2") or (parts["lokr_w2_a"][0], parts["lokr_w2_b"][1])
    out_dim, in_dim = w1[0] * w2[0], w1[1] * w2[1]  # w2_b's width includes the kernel (LyCORIS's slip)
    if w1[0] == lycoris_factorization(out_dim)[0] and w1[1] == lycoris_factorization(in_dim)[0]:
        return -1
    factor1 = max(w1)
    factor2 = max(parts["lokr_w2"]) if "lokr_w2" in parts else max(w2)
    for factor in (factor1, factor2):
        if out_dim % factor == 0 and in_dim % factor == 0 and factor in (w1[0], w2[0]) and factor in (w1[1], w2[1]):
            return factor
    return min(factor1, factor2)


def lycoris_rebuilt_parts(weight: Shape, parts: dict[str, Shape]) -> dict[str, Shape]:
    """The tensors LyCORIS's rebuilt LokrModule holds for a module of this weight whose file
    tensors are `parts`: the file loads only where they are the same."""
    decomposed = [name for name in ("lokr_w1_a", "lokr_w2_a") if name in parts]
    rank = parts[decomposed[0]][1] if decomposed else 1
    full_matrix = not decomposed
    factor = lycoris_guessed_factor(parts)
    out_pair, in_pair = lycoris_factorization(weight[0], factor), lycoris_factorization(weight[1], factor)
    decompose_both = "lokr_w1" not in parts and "lokr_w2" not in parts
    decompose_w1 = decompose_both and rank < max(out_pair[0], in_pair[0]) / 2 and not full_matrix
    full_w2 = full_matrix or rank >= max(out_pair[1], in_pair[1]) / 2
    return lokr_parts(weight, out_pair, in_pair, rank, decompose_w1, full_w2)


def lycoris_mismatches(shapes: dict[str, Shape], adapter: AdapterConfig) -> list[str]:
    """The modules (name → weight shape) whose LoKr LyCORIS cannot rebuild for this config
    (convolutions at `conv_rank`, like adapters.peft_config)."""
    failing = []
    for name, weight in shapes.items():
        rank = (adapter.conv_rank or adapter.rank) if len(weight) == 4 else adapter.rank
        parts = peft_lokr_parts(weight, rank, adapter.lokr_factor, adapter.lokr_decompose_both)
        if lycoris_rebuilt_parts(weight, parts) != parts:
            failing.append(name)
    return failing


def adapted_shapes(config: Config) -> dict[str, Shape]:
    """The weight shapes of the modules this config puts adapters on, from the model's configs
    (built on the meta device: no weights read); `<component>.<module path>` → shape."""
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from ..adapters import text_encoder_target_modules, unet_target_modules
    from ..sdxl_base import CLIP_BIGG, CLIP_L, UNET

    folder = config_folder(config)
    trained = {"text_encoder": config.model.train_text_encoder_1, "text_encoder_2": config.model.train_text_encoder_2}
    with torch.device("meta"):
        if folder is None:
            modules = {"unet": UNet2DConditionModel(**UNET)}
            texts = {"text_encoder": CLIPTextConfig(**CLIP_L), "text_encoder_2": CLIPTextConfig(**CLIP_BIGG)}
        else:
            modules = {"unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))}
            texts = {name: CLIPTextConfig.from_pretrained(folder / name) for name in trained}
        classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
        modules |= {name: classes[name](texts[name]) for name, on in trained.items() if on}
    shapes = {}
    for component, module in modules.items():
        names = (unet_target_modules(module, config.adapter.targets) if component == "unet"
                 else text_encoder_target_modules(module, config.adapter.targets))
        shapes |= {f"{component}.{name}": tuple(module.get_submodule(name).weight.shape) for name in names}
    return shapes


def config_folder(config: Config) -> Path | None:
    """A local pipeline folder with the model's component configs, or None where only SDXL base's
    shapes can be assumed (a single file without `model.config_dir`, a hub model not downloaded)."""
    from ..models import resolve_source
    from ..tiny_model import tiny_sdxl_path

    source = resolve_source(config.model.id)
    if source.kind == "builtin":
        return tiny_sdxl_path()
    if source.kind == "folder":
        return Path(source.location)
    if source.kind == "single_file":
        return Path(config.model.config_dir) if config.model.config_dir else None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(source.location, "model_index.json")
    folder = Path(found).parent if isinstance(found, str) else None
    names = ("unet", "text_encoder", "text_encoder_2")
    return folder if folder and all((folder / name / "config.json").is_file() for name in names) else None


def lokr_load_warning(config: Config) -> str | None:
    """One line for the pre-flight when LyCORIS would fail to load this run's LoKr file (the
    kohya/LyCORIS export, the one file LyCORIS reads)."""
    adapter = config.adapter
    if adapter.type != "lokr" or "kohya" not in config.export.adapter_formats:
        return None
    shapes = adapted_shapes(config)
    failing = lycoris_mismatches(shapes, adapter)
    if not failing:
        return None
    safer = next((factor for factor in SAFER_FACTORS
                  if not lycoris_mismatches(shapes, adapter.model_copy(update={"lokr_factor": factor}))), None)
    shown = ", ".join(f"{name} {'x'.join(map(str, shapes[name]))}" for name in failing[:2])
    more = f" and {len(failing) - 2} more" if len(failing) > 2 else ""
    fix = f"; adapter.lokr_factor {safer} avoids it" if safer else ""
    return (f"LyCORIS 4.1.3 cannot load {len(failing)} of the {len(shapes)} LoKr modules at adapter.lokr_factor "
            f"{adapter.lokr_factor} ({shown}{more}; ComfyUI and A1111 can){fix}")
