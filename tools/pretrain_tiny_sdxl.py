"""Rebuild the pretrained built-in tiny SDXL from nothing: the weights file the package ships.

    python tools/pretrain_tiny_sdxl.py            # all stages, into .cache/pretrain (about 1 h 35 min on 2 cores)
    python tools/pretrain_tiny_sdxl.py --stage vae
    python tools/pretrain_tiny_sdxl.py --stage vae-ceiling   # the judge on the VAE's reconstructions

Stages, each resumable by running the command again (a stage whose output exists is skipped):
1. vae:   the tiny VAE, from random weights, reconstructs 64² crops of world images (MSE plus a
          tiny KL term); its scaling factor is then set so that scaled latents have unit variance.
2. data:  PRETRAIN_IMAGES world images at 64², 96×64 and 64×96 with their captions (shapes the pretrained model
          knows: circle, square, triangle), written as an image folder the trainer reads.
3. unet:  `train_sdxl.py --config configs/pretrain_tiny_sdxl.json`: a full fine-tune of the UNet
          and both text encoders from random weights (stage 1's VAE beside them), by this trainer,
          on that folder.
4. ship64: stage 3's pipeline as one fp16 safetensors file, work/tiny_sdxl_64.fp16.safetensors
          (the package shipped this file until 2026-11-27; its sha256 then is STAGE4_SHA256).
5. unet128: stage 4's weights trained on at 128² (and 192×128, 128×192): the same scenes drawn at
          twice the size, where the 8× VAE carries every kind (docs/tiny_model.md says why).
6. ship128: stage 5's pipeline as one fp16 file, work/tiny_sdxl_128.fp16.safetensors (the package
          shipped this file until 2026-11-27's guidance stage; its sha256 is STAGE6_SHA256).
7. guidance: stage 6's weights trained on at 128² with half of the captions dropped: classifier-
          free guidance then keeps the shapes at CFG 5 and 7 (docs/tiny_model.md has the numbers).
8. ship:  stage 7's pipeline as the fp16 file the package ships (sdxl_trainer/weights/), whose
          sha256 goes into sdxl_trainer/tiny_model.py.

Deterministic on one machine: the same command with the same number of threads writes the same
file (fixed seeds, a single-process data loader, torch's deterministic CPU kernels).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import multiprocessing
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sdxl_trainer.tiny_model import build_tiny_sdxl_pipeline, shipped_weights_path, tiny_sdxl_from_weights  # noqa: E402
from sdxl_trainer.world.judge import prompt_matches  # noqa: E402
from sdxl_trainer.world.scenes import SHAPES, WorldSettings, caption, render, scene_for_seed  # noqa: E402

WORK, SMOKE_WORK = ROOT / ".cache" / "pretrain", ROOT / ".cache" / "pretrain-smoke"
VAE_STEPS, VAE_BATCH, VAE_CROP, VAE_LR, VAE_KL = 2000, 8, 64, 1e-3, 1e-6
PRETRAIN_IMAGES, IMAGE_SIZE = 6000, 64
# Two thirds square, the rest in the quickstart's two other buckets.
DATA_SIZES = ((64, 64), (64, 64), (64, 64), (64, 64), (96, 64), (64, 96))
TRAIN_SEEDS = range(0, PRETRAIN_IMAGES)  # held-out world images use seeds from 10**6 on
HELD_OUT_SEEDS = range(10**6, 10**6 + 256)
SMOKE_TRAINING = {"training.num_steps": 10}  # --smoke: what the trainer's stages override
STAGES = ["vae", "data", "unet", "ship64", "unet128", "ship128", "guidance", "ship"]
# Stages 4 and 6's files as the machine that built the shipped model wrote them: a rebuild elsewhere
# may differ (other CPUs round differently); the recipe says so and goes on.
STAGE4_SHA256 = "0396e8cc3043b2961fead6d0452474f6adfb06cff9df8b935eedb5544d675543"
STAGE6_SHA256 = "c5294855a1d357371fbaa7cec32e1cdeec29a6a056f0927f9ff7956e3389694c"
# Stage 5: the same scenes drawn at twice the size. SDXL itself was trained at rising resolutions.
AT_128 = {"data.size": 128, "data.bucket.resolutions": [[128, 128], [192, 128], [128, 192]],
          "data.bucket.batch_size": 16, "training.num_steps": 6000, "training.lr_unet": 3e-4,
          "training.lr_text_encoder_1": 1.5e-4, "training.lr_text_encoder_2": 1.5e-4,
          "training.lr_scheduler.warmup_steps": 50, "training.checkpoint_every": 600}
# Stage 7: trained with 10 % of the captions dropped, the model guided at CFG 5 draws squares with
# pinched sides; a short run dropping half of them trains the unconditional prediction guidance leans on.
GUIDANCE = {**AT_128, "training.num_steps": 1500, "training.lr_unet": 2e-4, "training.lr_text_encoder_1": 1e-4,
            "training.lr_text_encoder_2": 1e-4, "data.caption_dropout_prob": 0.5}


def world_batch(rng: random.Random, count: int, crop: int) -> torch.Tensor:
    """`count` random crops of world images, as a [-1, 1] tensor."""
    crops = []
    for _ in range(count):
        image, _ = render(scene_for_seed(rng.randrange(10**9)), IMAGE_SIZE)
        pixels = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
        top, left = rng.randrange(IMAGE_SIZE - crop + 1), rng.randrange(IMAGE_SIZE - crop + 1)
        crops.append(pixels[top:top + crop, left:left + crop])
    return torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).contiguous()


def held_out_images(seeds: range, settings: WorldSettings | None = None, size: int = IMAGE_SIZE) -> torch.Tensor:
    """World images of `seeds` at `size`², as a [-1, 1] tensor."""
    settings = settings or WorldSettings()
    images = [np.asarray(render(scene_for_seed(seed, settings), size)[0], dtype=np.float32) for seed in seeds]
    return torch.from_numpy(np.stack(images) / 127.5 - 1.0).permute(0, 3, 1, 2).contiguous()


def to_8bit(images: torch.Tensor) -> torch.Tensor:
    return ((images.clamp(-1, 1) + 1) * 127.5).round()


def reconstructions(vae, images: torch.Tensor) -> torch.Tensor:
    """The VAE's reconstruction (posterior mean) of [-1, 1] `images`, in 8-bit values."""
    with torch.no_grad():
        return to_8bit(torch.cat([vae.decode(vae.encode(chunk).latent_dist.mean).sample for chunk in images.split(32)]))


def psnr(vae, images: torch.Tensor) -> float:
    """Mean PSNR (dB, 8-bit range) of the VAE's reconstruction of `images`."""
    mse = (reconstructions(vae, images) - to_8bit(images)).pow(2).mean(dim=(1, 2, 3)).clamp(min=1e-10)
    return float((10 * torch.log10(255.0**2 / mse)).mean())


def judged_reconstructions(vae, size: int, count: int = 400) -> dict[str, float]:
    """The judge's accuracy on the VAE's reconstructions of held-out scenes of every kind, at `size`²,
    per kind (over the scenes that hold it): the ceiling the VAE puts on prompt accuracy there."""
    settings, seeds = WorldSettings(shapes=SHAPES), range(HELD_OUT_SEEDS.start, HELD_OUT_SEEDS.start + count)
    images = reconstructions(vae, held_out_images(seeds, settings, size)).byte().permute(0, 2, 3, 1).numpy()
    right: dict[str, int] = {kind: 0 for kind in SHAPES}
    total = dict(right)
    for seed, image in zip(seeds, images, strict=True):
        scene = scene_for_seed(seed, settings)
        matches = prompt_matches(image, scene)
        for kind in {shape.kind for shape in scene.shapes}:
            total[kind] += 1
            right[kind] += matches
    return {kind: right[kind] / total[kind] for kind in SHAPES}


def print_vae_ceiling(vae_dir: Path) -> None:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(vae_dir, subfolder="vae").eval()
    for size in (64, 96, 128):
        shares = ", ".join(f"{kind} {share:.0%}" for kind, share in judged_reconstructions(vae, size).items())
        print(f"vae: reconstructions judged right at {size}²: {shares}", flush=True)


def train_vae(out: Path, steps: int = VAE_STEPS) -> None:
    torch.manual_seed(0)
    pipe = build_tiny_sdxl_pipeline()
    vae = pipe.vae.train()
    with torch.no_grad():  # start with a posterior std of e^-5: random-init noise would drown the signal
        vae.quant_conv.bias[vae.config.latent_channels:] -= 10.0
    optimizer = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps)))
    rng = random.Random(0)
    held_out = held_out_images(HELD_OUT_SEEDS[:64])
    start = time.time()
    for step in range(steps):
        batch = world_batch(rng, VAE_BATCH, VAE_CROP)
        posterior = vae.encode(batch).latent_dist
        decoded = vae.decode(posterior.sample(generator=torch.Generator().manual_seed(step))).sample
        loss = torch.nn.functional.mse_loss(decoded, batch) + VAE_KL * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            vae.eval()
            print(f"vae step {step}: loss {loss.item():.5f}, held-out PSNR {psnr(vae, held_out):.2f} dB, "
                  f"{time.time() - start:.0f} s", flush=True)
            vae.train()
    vae.eval()
    with torch.no_grad():
        images = held_out_images(TRAIN_SEEDS[:256])
        latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(32)])
    vae.register_to_config(scaling_factor=float(1.0 / latents.std()))
    print(f"vae: scaling factor {vae.config.scaling_factor:.5f}", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)


def write_image(folder: Path, scale: int, seed: int) -> None:
    scene = scene_for_seed(seed)
    width, height = DATA_SIZES[seed % len(DATA_SIZES)]
    render(scene, width * scale, height * scale)[0].save(folder / f"world_{seed:05d}.png")
    (folder / f"world_{seed:05d}.txt").write_text(caption(scene) + "\n", encoding="utf-8")


def write_data(folder: Path, count: int = PRETRAIN_IMAGES, scale: int = 1) -> None:
    """The image folder, drawn by every CPU core (each file depends on its seed alone), at DATA_SIZES
    times `scale`."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with multiprocessing.Pool() as pool:
        pool.map(functools.partial(write_image, tmp, scale), TRAIN_SEEDS[:count], chunksize=64)
    tmp.rename(folder)


def saved_pipeline(folder: Path, build: Callable[[], Any]) -> Path:
    """`folder` holding the pipeline `build()` returns, written once and atomically: a start for the trainer."""
    if not (folder / "model_index.json").is_file():
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        build().save_pretrained(tmp, safe_serialization=True)
        tmp.rename(folder)
    return folder


def initial_pipeline(work: Path) -> Any:
    """The random-weight tiny SDXL with stage 1's trained VAE: what stage 3 starts from."""
    from diffusers import AutoencoderKL

    pipe = build_tiny_sdxl_pipeline()
    pipe.vae = AutoencoderKL.from_pretrained(work / "stage1-vae", subfolder="vae")
    return pipe


def train_unet(work: Path, start: Path, name: str, overrides: dict[str, Any]) -> None:
    """Stage 3 through the trainer's own command line; every folder it writes is under `work`."""
    settings = {"model.id": str(start), "data.image_dir": str(work / "world-64"), "run.name": name,
                "run.output_root": str(work / "runs"), "data.scan_cache_dir": str(work / "scan"),
                "data.latent_cache.cache_dir": str(work / "latents"),
                "training.tensorboard.base_dir": str(work / "tensorboard"), **overrides}
    config = ROOT / "configs" / "pretrain_tiny_sdxl.json"
    command = [sys.executable, str(ROOT / "train_sdxl.py"), "--config", str(config)]
    for key, value in settings.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    subprocess.run(command, check=True, cwd=ROOT)


def ship(trained: Path, target: Path) -> str:
    """Write a trained pipeline folder as one fp16 safetensors file; return its sha256."""
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import save_file

    pipe = StableDiffusionXLPipeline.from_pretrained(trained)
    tensors = {}
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        for key, value in getattr(pipe, name).state_dict().items():
            tensors[f"{name}.{key}"] = value.to(torch.float16).contiguous()
    metadata = {"vae_scaling_factor": repr(pipe.vae.config.scaling_factor)}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    save_file(tensors, tmp, metadata=metadata)
    tmp.replace(target)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    print(f"shipped {target} ({target.stat().st_size / 1e6:.1f} MB), sha256 {digest}")
    return digest


def continue_at_128(work: Path, weights: Path, run: str, settings: dict[str, Any], smoke: bool) -> None:
    """Stages 5 and 7: the fp16 file `weights` trained on at 128² (and 192×128, 128×192) as run `run`."""
    data_dir = work / "world-128"
    if not data_dir.is_dir():
        write_data(data_dir, 96 if smoke else PRETRAIN_IMAGES, scale=2)
    start = saved_pipeline(work / f"{run}-init", lambda: tiny_sdxl_from_weights(weights))
    train_unet(work, start, run,
               {**settings, "data.image_dir": str(data_dir), "data.latent_cache.cache_dir": str(work / "latents-128"),
                "data.scan_cache_dir": str(work / "scan-128"), **(SMOKE_TRAINING if smoke else {})})


def ship_checked(trained: Path, target: Path, expected: str) -> None:
    """`ship`, with a note when the file differs from the one the shipped model was trained from."""
    if ship(trained, target) != expected:
        print(f"note: {target.name} differs from the file the shipped model was trained from ({expected}): "
              "a smoke run, another machine or another number of threads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=[*STAGES, "vae-ceiling", "all"], default="all",
                        help="vae-ceiling: the judge's accuracy on the stage-1 VAE's reconstructions (a measurement)")
    parser.add_argument("--work", type=Path, help=f"where stages write (default {WORK}, or {SMOKE_WORK} with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="a few steps of each stage, shipped into --work instead "
                        "of the package: checks the recipe and its determinism in about a minute")
    args = parser.parse_args()
    work = args.work or (SMOKE_WORK if args.smoke else WORK)
    torch.use_deterministic_algorithms(True)
    vae_dir, data_dir, runs = work / "stage1-vae", work / "world-64", work / "runs"
    at_64, at_128 = work / "tiny_sdxl_64.fp16.safetensors", work / "tiny_sdxl_128.fp16.safetensors"
    stages = STAGES if args.stage == "all" else [args.stage]
    if "vae" in stages and not vae_dir.is_dir():
        train_vae(vae_dir, 20 if args.smoke else VAE_STEPS)
    if args.stage == "vae-ceiling":
        print_vae_ceiling(vae_dir)
    if "data" in stages and not data_dir.is_dir():
        write_data(data_dir, 96 if args.smoke else PRETRAIN_IMAGES)
    if "unet" in stages and not (runs / "tiny-sdxl" / "model_index.json").is_file():
        start = saved_pipeline(work / "stage3-init", lambda: initial_pipeline(work))
        train_unet(work, start, "tiny-sdxl", SMOKE_TRAINING if args.smoke else {})
    if "ship64" in stages and not at_64.is_file():
        ship_checked(runs / "tiny-sdxl", at_64, STAGE4_SHA256)
    # Stage 5's run keeps its name from before the guidance stage, so a work folder that has it is reused.
    if "unet128" in stages and not (runs / "tiny-sdxl-128" / "model_index.json").is_file():
        continue_at_128(work, at_64, "tiny-sdxl-128", AT_128, args.smoke)
    if "ship128" in stages and not at_128.is_file():
        ship_checked(runs / "tiny-sdxl-128", at_128, STAGE6_SHA256)
    if "guidance" in stages and not (runs / "tiny-sdxl-guidance" / "model_index.json").is_file():
        continue_at_128(work, at_128, "tiny-sdxl-guidance", GUIDANCE, args.smoke)
    if "ship" in stages:
        target = work / "tiny_sdxl.fp16.safetensors" if args.smoke else shipped_weights_path()
        ship(runs / "tiny-sdxl-guidance", target)
        if not args.smoke:
            print("put this sha256 into sdxl_trainer/tiny_model.py (TINY_SDXL_SHA256)")

if __name__ == "__main__":
    main()
