"""What the text-encoder output cache saves: the step time on the built-in tiny SDXL with both
encoders cached, with bigG cached while CLIP-L trains, and with none cached, and the text
conditioning alone; the FLOPs a 1024² step saves at full size; the bytes one cached caption takes
at full size.

    python bench/bench_text_cache.py

Step times are `train_sdxl.train()`'s intervals between optimizer steps (bench_step's StepClock)
in CPU time of this process (torch on 1 thread, no loader workers): on a shared machine wall time
also counts the time other processes hold the core. All modes run in one process, in alternating
order.
FLOPs are counted by torch's FlopCounterMode on the meta device with SDXL's full-size encoders and
UNet (bench/sdxl_arch.py): nothing is allocated. Bytes are the size of a real cache entry file of
full-size shapes (77×768 CLIP-L and 77×1280 bigG penultimate hidden states, bigG's 1280 pooled).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_step import StepClock, run_trainer, trainer_config
from bench.common import bench_args, write_results

# name: (CLIP-L trained, text cache on)
MODES = {
    "none cached, CLIP-L trained (both encoders live)": (True, False),
    "bigG cached, CLIP-L trained": (True, True),
    "none cached, both encoders frozen (both live)": (False, False),
    "both cached, both encoders frozen": (False, True),
}
BASELINES = {"bigG cached, CLIP-L trained": "none cached, CLIP-L trained (both encoders live)",
             "both cached, both encoders frozen": "none cached, both encoders frozen (both live)"}


def mode_config(tmp: Path, mode: str, steps: int) -> dict[str, Any]:
    train_clip_l, cached = MODES[mode]
    config = trainer_config(tmp, "dora", steps)
    config["model"]["train_text_encoder_1"] = train_clip_l
    config["data"]["text_cache"] = {"enabled": cached, "cache_dir": str(tmp / "text")}
    return config


def encoder_flops(modules: dict[str, Any]) -> dict[str, float]:
    """Forward FLOPs of each full-size encoder (of sdxl_modules("meta")) for one caption (77 tokens)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.zeros((1, 77), dtype=torch.long, device="meta")
    flops = {}
    for name in ("text_encoder", "text_encoder_2"):
        with FlopCounterMode(display=False) as counter:
            modules[name](ids, output_hidden_states=True)
        flops[name] = float(counter.get_total_flops())
    return flops


def unet_step_flops(unet) -> float:
    """Forward and backward FLOPs of the full-size UNet (on the meta device) for one 1024² image (128² latents)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"), FlopCounterMode(display=False) as counter:
        sample = torch.randn(1, 4, 128, 128, requires_grad=False)
        conditioning = {"text_embeds": torch.randn(1, 1280), "time_ids": torch.randn(1, 6)}
        output = unet(sample, torch.tensor([500]), encoder_hidden_states=torch.randn(1, 77, 2048),
                      added_cond_kwargs=conditioning).sample
        output.sum().backward()
    return float(counter.get_total_flops())


def conditioning_ms(tmp: Path, captions: list[str], repeats: int) -> dict[str, float]:
    """The text conditioning of one batch on the tiny model, `encode_prompts` as the loss calls it:
    both frozen encoders live, and both read from a complete text cache (best of `repeats` runs of 20)."""
    import torch

    from bench.common import best_of
    from sdxl_trainer.conditioning import encode_prompts
    from sdxl_trainer.config import ModelConfig
    from sdxl_trainer.models import load_pipeline
    from sdxl_trainer.text_cache import TOKENIZERS, CachedEncoder, TextCache, build_text_cache, encoder_spec

    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    tokenizers = [pipe.tokenizer, pipe.tokenizer_2]
    live = [pipe.text_encoder, pipe.text_encoder_2]
    specs = {name: encoder_spec(getattr(pipe, TOKENIZERS[name]), getattr(pipe, name), name) for name in TOKENIZERS}
    cache = TextCache(tmp / "conditioning", specs, "fp32", "fp32")
    build_text_cache(cache, captions, pipe, "cpu", torch.autocast("cpu", enabled=False))
    cached = [CachedEncoder(cache, name, True) for name in TOKENIZERS]
    return {name: best_of(lambda e=encoders: [encode_prompts(captions, tokenizers, e, "cpu") for _ in range(20)],
                          repeats) / 20 * 1e3
            for name, encoders in (("live", live), ("cached", cached))}


def entry_bytes(tmp: Path) -> dict[str, int]:
    """Bytes on disk of one caption's entries at full size, per storage dtype: both encoders, and bigG alone."""
    import torch

    from sdxl_trainer.text_cache import EncoderSpec, TextCache

    shapes = {"text_encoder": {"hidden": (77, 768)}, "text_encoder_2": {"hidden": (77, 1280), "pooled": (1280,)}}
    sizes = {}
    for dtype in ("bf16", "fp32"):
        cache = TextCache(tmp / dtype, {name: EncoderSpec("t", "w", shape) for name, shape in shapes.items()}, dtype,
                          dtype)
        for name, shape in shapes.items():
            cache.save(name, "a caption", {key: torch.zeros(size) for key, size in shape.items()})
            sizes[f"{name}_{dtype}"] = cache.path(name, "a caption").stat().st_size
    return sizes


def main(argv: list[str] | None = None) -> None:
    args = bench_args(__doc__.splitlines()[0], argv)
    rounds, steps, warmup = (1, 2, 1) if args.smoke else (4, 40, 5)
    import torch

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(rounds):
            for mode in MODES if round_index % 2 == 0 else list(MODES)[::-1]:
                with StepClock(timer=time.process_time) as clock:
                    run_trainer(mode_config(Path(tmp), mode, steps + warmup), clock)
                times[mode] += clock.trainer[warmup:]
        sizes = entry_bytes(Path(tmp))
        captions = ["tok, a red circle, green background, small pattern", "tok, a blue square, yellow background"]
        conditioning = conditioning_ms(Path(tmp), captions, 1 if args.smoke else 5)
    from bench.sdxl_arch import sdxl_modules

    modules = sdxl_modules("meta")  # built once for both counts (a full-size build takes seconds)
    flops, unet = encoder_flops(modules), unet_step_flops(modules["unet"])
    medians = {mode: statistics.median(seconds) for mode, seconds in times.items()}
    rows = [{"step": mode, "ms_per_step": medians[mode] * 1e3,
             "vs_uncached": medians[mode] / medians[BASELINES.get(mode, mode)],
             "vs_none_cached_default": medians[mode] / medians[next(iter(MODES))], "value": None} for mode in MODES]
    saved_both, saved_bigg = flops["text_encoder"] + flops["text_encoder_2"], flops["text_encoder_2"]
    full = [
        ("GFLOP saved per 1024² image per step, both cached", saved_both / 1e9),
        ("GFLOP saved per 1024² image per step, bigG cached", saved_bigg / 1e9),
        ("GFLOP of the UNet's forward + backward per 1024² image", unet / 1e9),
        ("bytes per cached caption, both encoders, bf16", sizes["text_encoder_bf16"] + sizes["text_encoder_2_bf16"]),
        ("bytes per cached caption, both encoders, fp32", sizes["text_encoder_fp32"] + sizes["text_encoder_2_fp32"]),
        ("bytes per cached caption, bigG only, bf16", sizes["text_encoder_2_bf16"]),
    ]
    rows += [{"step": f"tiny model: text conditioning of a batch of 2, both encoders {name}", "ms_per_step": ms,
              "vs_uncached": ms / conditioning["live"], "vs_none_cached_default": None, "value": None}
             for name, ms in conditioning.items()]
    rows += [{"step": f"full size: {name}", "ms_per_step": None, "vs_uncached": None, "vs_none_cached_default": None,
              "value": value} for name, value in full]
    notes = (
        f"Built-in tiny SDXL, DoRA rank 4 on the UNet (and CLIP-L where trained), batch 2 of 64×64 from the latent "
        f"cache, AdamW, fp32, torch on 1 thread; step times in CPU time of the process (median); {rounds} training "
        f"runs per mode of {steps} timed steps after "
        f"{warmup} warm-up steps, modes in alternating order. vs_uncached: against the same training without the "
        "text cache; vs_none_cached_default: against the default config (CLIP-L trained) without it. Text "
        "conditioning rows: `encode_prompts` alone (frozen encoders one caption at a time, as in training), best "
        "of 5 runs of 20 calls. Full-size "
        "rows: FlopCounterMode on the meta device (encoders: forward only, they are frozen; a cached CLIP-L saves "
        "its forward, the trained one is never cached); bytes: the file of one real cache entry, header included."
    )
    write_results("text_cache", rows, notes, args.results_dir)


if __name__ == "__main__":
    main()
