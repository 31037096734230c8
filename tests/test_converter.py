"""The diffusers-folder → single-file SDXL converter, judged by the real loaders.

The judge is diffusers itself: `from_single_file` must rebuild every tensor of the tiny pipeline
bit for bit and render the same image, and diffusers' own sgm → diffusers key conversion must
accept the plan for a full-size SDXL built on the meta device.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import converttosdxl
from sdxl_trainer.formats.safetensors_stream import DTYPE_NAMES, StreamWriter, TensorSpec
from sdxl_trainer.formats.sgm_keys import (
    LOGIT_SCALE_KEY,
    POSITION_IDS_KEY,
    TE1_PREFIX,
    TE2_PREFIX,
    UNET_PREFIX,
    VAE_PREFIX,
    KeyMapError,
    TensorInfo,
    build_plan,
)
from tests.helpers import ROOT, run_cli

COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _copy_pipeline(source: Path, destination: Path, weights: bool = True) -> Path:
    """A copy of the tiny pipeline folder; without weights it is the config-only folder that
    `from_single_file(config=...)` needs."""
    ignore = None if weights else shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json")
    shutil.copytree(source, destination, ignore=ignore)
    return destination


def _realign(pipe):
    """Give every weight a fresh allocation. CPU matmul kernels round differently depending on a
    tensor's memory alignment, and weights mmapped from a file sit at arbitrary offsets, so equal
    weights only give bit-equal images once both pipelines hold them in fresh memory."""
    for name in COMPONENTS:
        for parameter in getattr(pipe, name).parameters():
            parameter.data = parameter.data.clone()
    return pipe


def _generate(pipe) -> torch.Tensor:
    """A seeded 2-step 64×64 image as floats (no uint8 rounding to hide differences). On one
    thread: the tiny model gains nothing from more, and on a busy machine threaded steps crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        image = pipe(
            prompt="a red circle on a blue background",
            num_inference_steps=2,
            height=64,
            width=64,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).images
    finally:
        torch.set_num_threads(threads)
    return torch.from_numpy(image)


@pytest.fixture(scope="module")
def files(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """The tiny pipeline converted once in fp32 (False) and once with --half (True)."""
    out = tmp_path_factory.mktemp("converted")
    return {
        False: converttosdxl.convert(tiny_sdxl_dir, out / "tiny-fp32.safetensors"),
        True: converttosdxl.convert(tiny_sdxl_dir, out / "tiny-fp16.safetensors", half=True),
    }


@pytest.fixture(scope="module")
def reference(tiny_sdxl_dir: Path):
    """The tiny pipeline loaded the ordinary way, and its image."""
    from diffusers import StableDiffusionXLPipeline

    pipe = _realign(StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir))
    return pipe, _generate(pipe)


@pytest.fixture(scope="module")
def config_dir(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _copy_pipeline(tiny_sdxl_dir, tmp_path_factory.mktemp("config") / "tiny-config", weights=False)


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_from_single_file_rebuilds_every_tensor_and_the_same_image(
    half: bool,
    files: dict[bool, Path],
    config_dir: Path,
    reference,
    tiny_sdxl_dir: Path,
) -> None:
    from diffusers import StableDiffusionXLPipeline
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE, "conftest sets HF_HUB_OFFLINE=1 before any import: no hub access"
    assert not any(p.suffix in WEIGHT_SUFFIXES for p in config_dir.rglob("*")), "config copy holds weights"
    loaded = StableDiffusionXLPipeline.from_single_file(
        str(files[half]), config=str(config_dir), local_files_only=True
    )
    file_dtype = torch.float16 if half else torch.float32
    for name in COMPONENTS:
        module, source = getattr(loaded, name), getattr(reference[0], name)
        on_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        assert not on_meta, f"{name}: left on the meta device (missing from the file): {on_meta[:5]}"
        got, want = module.state_dict(), source.state_dict()
        assert got.keys() == want.keys(), name
        # Without torch_dtype diffusers loads into fp32 modules: the values are the file's values.
        assert {t.dtype for t in got.values()} == {torch.float32}, name
        different = [k for k, v in want.items() if not torch.equal(got[k], v.to(file_dtype).float())]
        assert not different, f"{name}: {len(different)} tensors differ, e.g. {different[:3]}"

    image = _generate(_realign(loaded))
    if not half:
        assert torch.equal(image, reference[1])
        return
    # The fair reference for an fp16 file is the source rounded to fp16 and run in fp32, as the
    # loaded pipeline is. The built-in tiny SDXL ships fp16 weights, so rounding changes none of
    # them and the fp16 file must give the source's own image, bit for bit (the dtypes above show
    # the file holds fp16).
    rounded = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    rounded.to(torch.float16).to(torch.float32)  # fresh allocations, no _realign needed
    assert torch.equal(image, _generate(rounded))
    assert torch.equal(image, reference[1])


# --- full-size SDXL on the meta device ---------------------------------------------------------

SDXL_UNET = {
    "sample_size": 128,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "block_out_channels": (320, 640, 1280),
    "layers_per_block": 2,
    "transformer_layers_per_block": (1, 2, 10),
    "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}
SDXL_VAE = {
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 4,
    "sample_size": 1024,
    "scaling_factor": 0.13025,
}
CLIP_L = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
CLIP_BIGG = {
    "hidden_size": 1280,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "intermediate_size": 5120,
    "hidden_act": "gelu",
    "projection_dim": 1280,
}


@pytest.fixture(scope="module")
def full_size():
    """Full-size SDXL modules with no storage: only shapes, which is all a plan needs."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    with torch.device("meta"):
        modules = {
            "unet": UNet2DConditionModel(**SDXL_UNET),
            "vae": AutoencoderKL(**SDXL_VAE),
            "text_encoder": CLIPTextModel(CLIPTextConfig(**CLIP_L)),
            "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_BIGG)),
        }
    infos = {
        name: {k: TensorInfo(tuple(v.shape), DTYPE_NAMES[v.dtype]) for k, v in module.state_dict().items()}
        for name, module in modules.items()
    }
    plan = build_plan(infos, modules["unet"].config, modules["vae"].config, half=True)
    return modules, plan


def test_full_size_plan_has_the_sdxl_key_set_and_shapes(full_size) -> None:
    _, plan = full_size
    shapes = {entry.key: entry.shape for entry in plan}
    assert len(shapes) == len(plan) == 2515  # 2513 required + position_ids + logit_scale
    counts = {prefix: sum(k.startswith(prefix) for k in shapes) for prefix in (UNET_PREFIX, VAE_PREFIX)}
    counts[TE1_PREFIX] = sum(k.startswith(TE1_PREFIX) and k != POSITION_IDS_KEY for k in shapes)
    counts[TE2_PREFIX] = sum(k.startswith(TE2_PREFIX) and k != LOGIT_SCALE_KEY for k in shapes)
    assert counts == {UNET_PREFIX: 1680, VAE_PREFIX: 248, TE1_PREFIX: 196, TE2_PREFIX: 389}

    expected = {
        TE2_PREFIX + "transformer.resblocks.0.attn.in_proj_weight": (3840, 1280),
        TE2_PREFIX + "transformer.resblocks.31.attn.in_proj_bias": (3840,),
        TE2_PREFIX + "text_projection": (1280, 1280),
        TE2_PREFIX + "positional_embedding": (77, 1280),
        TE2_PREFIX + "transformer.resblocks.31.mlp.c_fc.weight": (5120, 1280),
        TE1_PREFIX + "encoder.layers.11.mlp.fc1.weight": (3072, 768),
        POSITION_IDS_KEY: (1, 77),
        LOGIT_SCALE_KEY: (),
        VAE_PREFIX + "decoder.mid.attn_1.q.weight": (512, 512, 1, 1),
        VAE_PREFIX + "encoder.mid.attn_1.proj_out.weight": (512, 512, 1, 1),
        VAE_PREFIX + "decoder.up.0.block.0.nin_shortcut.weight": (128, 256, 1, 1),  # levels reversed
        VAE_PREFIX + "encoder.down.1.block.0.nin_shortcut.weight": (256, 128, 1, 1),
        VAE_PREFIX + "decoder.up.3.upsample.conv.weight": (512, 512, 3, 3),
        UNET_PREFIX + "input_blocks.3.0.op.weight": (320, 320, 3, 3),
        UNET_PREFIX + "input_blocks.6.0.op.weight": (640, 640, 3, 3),
        UNET_PREFIX + "input_blocks.4.1.proj_in.weight": (640, 640),
        UNET_PREFIX + "input_blocks.8.1.transformer_blocks.9.ff.net.0.proj.weight": (10240, 1280),
        UNET_PREFIX + "middle_block.1.transformer_blocks.9.attn2.to_k.weight": (1280, 2048),
        UNET_PREFIX + "middle_block.2.emb_layers.1.weight": (1280, 1280),
        UNET_PREFIX + "output_blocks.2.2.conv.weight": (1280, 1280, 3, 3),
        UNET_PREFIX + "output_blocks.5.2.conv.weight": (640, 640, 3, 3),
        UNET_PREFIX + "output_blocks.8.0.skip_connection.weight": (320, 640, 1, 1),
        UNET_PREFIX + "label_emb.0.0.weight": (1280, 2816),
        UNET_PREFIX + "time_embed.2.weight": (1280, 1280),
        UNET_PREFIX + "out.2.weight": (4, 320, 3, 3),
    }
    assert {key: shapes.get(key) for key in expected} == expected

    # Transformer depth per block, counted the way ComfyUI's detector counts it (docs/formats.md,
    # 'Single-file checkpoints (SGM keys)', 'How loaders recognise SDXL').
    def depth(block: str) -> int:
        prefix = f"{UNET_PREFIX}{block}.1.transformer_blocks."
        return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})

    assert [depth(f"input_blocks.{i}") for i in (1, 2, 4, 5, 7, 8)] == [0, 0, 2, 2, 10, 10]
    assert [depth(f"output_blocks.{i}") for i in range(9)] == [10, 10, 10, 2, 2, 2, 0, 0, 0]
    assert depth("middle_block") == 10
    assert {entry.dtype for entry in plan if entry.key != POSITION_IDS_KEY} == {"F16"}


def test_full_size_plan_is_what_diffusers_converts_back(full_size) -> None:
    """diffusers' own sgm → diffusers converters, fed the plan's keys and shapes as meta tensors,
    must give back exactly the models' own state-dict keys and shapes."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )

    modules, plan = full_size
    checkpoint = {e.key: torch.empty(e.shape, dtype=torch.float16, device="meta") for e in plan}
    converted = {
        "unet": convert_ldm_unet_checkpoint(checkpoint, modules["unet"].config),
        "vae": convert_ldm_vae_checkpoint(checkpoint, modules["vae"].config),
        "text_encoder": convert_ldm_clip_checkpoint(checkpoint),
        "text_encoder_2": convert_open_clip_checkpoint(
            modules["text_encoder_2"], checkpoint, prefix="conditioner.embedders.1.model."
        ),
    }
    for name, state_dict in converted.items():
        got = {k.removeprefix("text_model."): tuple(v.shape) for k, v in state_dict.items()}
        got.pop("embeddings.position_ids", None)
        want = {k.removeprefix("text_model."): tuple(v.shape) for k, v in modules[name].state_dict().items()}
        assert got == want, name


def test_key_map_refuses_weights_that_do_not_fit(tiny_sdxl_dir: Path) -> None:
    """Anything the layout cannot hold, or a config that does not describe the weights, is an
    error naming the tensor, never a silently incomplete file."""
    infos = {}
    for name in COMPONENTS:
        stem = "model" if name.startswith("text_encoder") else "diffusion_pytorch_model"
        with safe_open(tiny_sdxl_dir / name / f"{stem}.safetensors", framework="pt") as handle:
            infos[name] = {
                k: TensorInfo(tuple(handle.get_slice(k).get_shape()), handle.get_slice(k).get_dtype())
                for k in handle.keys()  # noqa: SIM118
            }
    configs = {name: json.loads((tiny_sdxl_dir / name / "config.json").read_text()) for name in ("unet", "vae")}
    assert len(build_plan(infos, configs["unet"], configs["vae"])) == 957

    def refused(component: str, change, unet_config=configs["unet"]) -> str:
        changed = {**infos, component: dict(infos[component])}
        change(changed[component])
        with pytest.raises(KeyMapError) as error:
            build_plan(changed, unet_config, configs["vae"])
        return str(error.value)

    # diffusers would load these files without a word, leaving the tensor unloaded (docs/formats.md,
    # 'Single-file checkpoints (SGM keys)', 'Missing and optional keys').
    message = refused("text_encoder", lambda d: d.pop("encoder.layers.2.mlp.fc2.bias"))
    assert message == "text_encoder: 1 tensor(s) missing, e.g. encoder.layers.2.mlp.fc2.bias"
    message = refused("text_encoder_2", lambda d: d.pop("text_model.encoder.layers.0.self_attn.v_proj.weight"))
    assert message == "text_encoder_2: 1 tensor(s) missing, e.g. encoder.layers.0.self_attn.v_proj.weight"
    message = refused("unet", lambda d: d.update({"class_embedding.weight": TensorInfo((4, 4), "F32")}))
    assert message == "unet: class_embedding.weight has no place in the SDXL single-file layout"
    message = refused("unet", lambda d: None, unet_config={**configs["unet"], "layers_per_block": 3})
    assert message.startswith("unet: its config.json describes down_blocks.0.resnets.2 but the weights")


# --- the tiny file itself ----------------------------------------------------------------------


def _source(folder: Path, component: str) -> dict[str, torch.Tensor]:
    stem = "model" if component.startswith("text_encoder") else "diffusion_pytorch_model"
    return load_file(folder / component / f"{stem}.safetensors")


def test_tiny_file_orientation_dtypes_and_metadata(files: dict[bool, Path], tiny_sdxl_dir: Path) -> None:
    written = load_file(files[False])
    te1, te2, vae = (_source(tiny_sdxl_dir, c) for c in ("text_encoder", "text_encoder_2", "vae"))

    # The tiny projection is square, like bigG's: only the values show the orientation.
    projection = te2["text_projection.weight"]
    assert torch.equal(written[TE2_PREFIX + "text_projection"], projection.T)
    assert not torch.equal(projection, projection.T)
    layer = "text_model.encoder.layers.1.self_attn."
    for kind in ("weight", "bias"):
        fused = torch.cat([te2[f"{layer}{p}_proj.{kind}"] for p in "qkv"])
        assert torch.equal(written[f"{TE2_PREFIX}transformer.resblocks.1.attn.in_proj_{kind}"], fused)
    positions = te2["text_model.embeddings.position_embedding.weight"]
    assert torch.equal(written[TE2_PREFIX + "positional_embedding"], positions)
    # transformers 5 saves CLIP-L without `text_model.`; the file must have it.
    tokens = te1["embeddings.token_embedding.weight"]
    assert torch.equal(written[TE1_PREFIX + "embeddings.token_embedding.weight"], tokens)

    for part in ("encoder", "decoder"):
        q = written[f"{VAE_PREFIX}{part}.mid.attn_1.q.weight"]
        assert q.shape == (*vae[f"{part}.mid_block.attentions.0.to_q.weight"].shape, 1, 1)
        assert torch.equal(q[:, :, 0, 0], vae[f"{part}.mid_block.attentions.0.to_q.weight"])
        assert written[f"{VAE_PREFIX}{part}.mid.attn_1.proj_out.bias"].dim() == 1

    assert written[POSITION_IDS_KEY].dtype == torch.int64
    assert torch.equal(written[POSITION_IDS_KEY], torch.arange(77)[None])
    for half, dtype in ((False, torch.float32), (True, torch.float16)):
        scale = load_file(files[half])[LOGIT_SCALE_KEY]
        assert scale.shape == () and scale.dtype == dtype
        assert scale.item() == torch.tensor(math.log(100)).half().item() == 4.60546875
    assert "v_pred" in written and "ztsnr" not in written  # the tiny SDXL is v-prediction without zero-terminal SNR

    with safe_open(files[True], framework="pt") as handle:
        metadata = handle.metadata()
        dtypes = {handle.get_slice(k).get_dtype() for k in handle.keys() if k != "v_pred"}  # noqa: SIM118
        marker = handle.get_slice("v_pred").get_dtype()
    assert dtypes == {"F16", "I64"} and marker == "F32"  # the weights in fp16; the v-prediction marker as written
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    assert metadata["modelspec.sai_model_spec"] == "1.0.0"
    assert metadata["modelspec.implementation"] == "sgm"
    assert metadata["modelspec.title"] == tiny_sdxl_dir.name
    assert metadata["modelspec.prediction_type"] == "v"  # the built-in tiny SDXL is a v-prediction model
    assert metadata["modelspec.date"][:2] == "20"


# --- refusals ------------------------------------------------------------------------------------


@pytest.fixture()
def tiny_copy(tiny_sdxl_dir: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the tiny pipeline folder (with weights)."""
    return _copy_pipeline(tiny_sdxl_dir, tmp_path / "tiny-copy")


def _poison(folder: Path, component: str, key: str, value: float) -> None:
    state = _source(folder, component)
    state[key].view(-1)[0] = value
    stem = "model" if component.startswith("text_encoder") else "diffusion_pytorch_model"
    save_file(state, folder / component / f"{stem}.safetensors", metadata={"format": "pt"})


@pytest.mark.slow
def test_nonfinite_weights_are_refused_and_named(tiny_copy: Path, tmp_path: Path, capsys) -> None:
    # k_proj is fused into in_proj with q and v: the message must still name k_proj itself.
    _poison(tiny_copy, "text_encoder_2", "text_model.encoder.layers.2.self_attn.k_proj.weight", math.nan)
    _poison(tiny_copy, "unet", "down_blocks.1.attentions.0.proj_in.weight", math.inf)
    out_dir = tmp_path / "out"
    out = out_dir / "poisoned.safetensors"

    assert converttosdxl.main(["--model_path", str(tiny_copy), "--checkpoint_path", str(out)]) == 1
    error = capsys.readouterr().err
    assert "text_encoder_2/text_model.encoder.layers.2.self_attn.k_proj.weight: 1 of" in error
    assert "unet/down_blocks.1.attentions.0.proj_in.weight: 1 of" in error
    assert "q_proj" not in error and "v_proj" not in error
    assert not out.exists() and list(out_dir.iterdir()) == []  # no temp file left behind either

    argv = ["--model_path", str(tiny_copy), "--checkpoint_path", str(out), "--allow-nonfinite"]
    assert converttosdxl.main(argv) == 0
    assert "warning: written although not finite" in capsys.readouterr().err
    fused = load_file(out)[TE2_PREFIX + "transformer.resblocks.2.attn.in_proj_weight"]
    hidden = fused.shape[1]
    assert torch.isnan(fused[hidden, 0]) and int(torch.isnan(fused).sum()) == 1  # first row of k


@pytest.mark.slow
def test_float16_overflow_is_refused_only_with_half(tiny_copy: Path, tmp_path: Path, capsys) -> None:
    _poison(tiny_copy, "vae", "decoder.conv_in.weight", 1e5)  # fine in fp32, inf in fp16 (max 65504)
    fp32, fp16 = tmp_path / "fp32.safetensors", tmp_path / "fp16.safetensors"
    assert converttosdxl.main(["--model_path", str(tiny_copy), "--checkpoint_path", str(fp32)]) == 0
    assert converttosdxl.main(["--model_path", str(tiny_copy), "--checkpoint_path", str(fp16), "--half"]) == 1
    assert "vae/decoder.conv_in.weight: 1 values overflow torch.float16" in capsys.readouterr().err
    assert fp32.exists() and not fp16.exists()


@pytest.mark.slow
def test_existing_output_is_kept_without_overwrite(
    files: dict[bool, Path], tiny_sdxl_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    argv = ["--model_path", str(tiny_sdxl_dir), "--checkpoint_path", str(out)]
    assert converttosdxl.main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"
    assert converttosdxl.main([*argv, "--overwrite"]) == 0
    assert out.read_bytes()[8:] != b"keep me" and load_file(out).keys() == load_file(files[False]).keys()


@pytest.mark.slow
def test_sharded_weights_and_the_diffusers_script_flags(
    files: dict[bool, Path], tiny_copy: Path, tmp_path: Path, capsys
) -> None:
    """A UNet saved in two shards (as full-size SDXL is) converts to the same tensors; the flags
    of diffusers' own script are accepted, and a .ckpt name is warned about."""
    unet = tiny_copy / "unet"
    state = _source(tiny_copy, "unet")
    (unet / "diffusion_pytorch_model.safetensors").unlink()
    keys = sorted(state)
    shards = {"part-1.safetensors": keys[: len(keys) // 2], "part-2.safetensors": keys[len(keys) // 2 :]}
    for name, shard_keys in shards.items():
        save_file({k: state[k] for k in shard_keys}, unet / name, metadata={"format": "pt"})
    weight_map = {k: name for name, shard_keys in shards.items() for k in shard_keys}
    (unet / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    out = tmp_path / "model.ckpt"
    argv = ["--model_path", str(tiny_copy), "--checkpoint_path", str(out), "--use_safetensors"]
    assert converttosdxl.main(argv) == 0
    assert ".ckpt name" in capsys.readouterr().err
    got, want = load_file(out), load_file(files[False])
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.slow
def test_usage_errors_are_one_line_and_exit_2(tiny_copy: Path, tmp_path: Path, capsys) -> None:
    missing = tmp_path / "no-such-model"
    result = run_cli("converttosdxl.py", "--model_path", str(missing), "--checkpoint_path", str(tmp_path / "x"))
    assert result.returncode == 2
    expected = f"error: {missing}: no such folder (expected a diffusers SDXL pipeline folder)"
    assert result.stderr.strip().splitlines() == [expected]

    out = tmp_path / "out.safetensors"
    vae = tiny_copy / "vae"
    (vae / "diffusion_pytorch_model.safetensors").rename(vae / "diffusion_pytorch_model.bin")
    assert converttosdxl.main(["--model_path", str(tiny_copy), "--checkpoint_path", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(vae) in error and "diffusion_pytorch_model.bin" in error
    assert "arbitrary code" in error

    (vae / "diffusion_pytorch_model.bin").rename(vae / "diffusion_pytorch_model.safetensors")
    truncated = tiny_copy / "text_encoder" / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    assert converttosdxl.main(["--model_path", str(tiny_copy), "--checkpoint_path", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{truncated}: not a readable safetensors file" in error

    shutil.rmtree(tiny_copy / "text_encoder_2")
    assert converttosdxl.main(["--model_path", str(tiny_copy), "--checkpoint_path", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{tiny_copy / 'text_encoder_2'}: missing" in error
    assert not out.exists()


def test_an_output_path_through_a_file_is_one_line_and_exit_2(tiny_sdxl_dir: Path, tmp_path: Path,
                                                               capsys) -> None:
    """A typo that puts the output under an existing file: one line naming it, not a traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("mine")
    for out in (blocker / "x.safetensors", blocker / "sub" / "x.safetensors"):
        assert converttosdxl.main(["--model_path", str(tiny_sdxl_dir), "--checkpoint_path", str(out)]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"cannot write {out}: " in error and "is a file, not a folder" in error
    assert blocker.read_text() == "mine"


def test_help_and_usage_errors_do_not_import_torch() -> None:
    code = (
        "import sys, converttosdxl\n"
        "for argv in (['--help'], ['--model_path', '/no/such/dir', '--checkpoint_path', 'x']):\n"
        "    try:\n"
        "        converttosdxl.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules, 'diffusers' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == "False False"


# --- v-prediction markers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prediction_type", "zero_snr", "markers"),
    [
        ("v_prediction", False, {"v_pred"}),
        ("v_prediction", True, {"v_pred", "ztsnr"}),
        ("epsilon", True, set()),
    ],
)
def test_v_prediction_markers_follow_the_scheduler_config(
    tiny_copy: Path, tmp_path: Path, prediction_type: str, zero_snr: bool, markers: set[str]
) -> None:
    config_path = tiny_copy / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config.update(prediction_type=prediction_type, rescale_betas_zero_snr=zero_snr)
    config_path.write_text(json.dumps(config))

    out = converttosdxl.convert(tiny_copy, tmp_path / "out.safetensors")
    with safe_open(out, framework="pt") as handle:
        keys = set(handle.keys())
        metadata = handle.metadata()
        found = {key: handle.get_tensor(key) for key in keys & {"v_pred", "ztsnr"}}
    assert set(found) == markers
    assert all(t.shape == (0,) for t in found.values())  # ComfyUI's torch.tensor([]): presence is all
    assert metadata["modelspec.prediction_type"] == ("v" if markers else "epsilon")
    assert len(keys) == 957 + len(markers)


# --- the streaming writer ------------------------------------------------------------------------


def test_stream_writer_output_reads_back_with_safetensors(tmp_path: Path) -> None:
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.tensor([]),
        "ids": torch.arange(7)[None],
        "odd": torch.randn(3, dtype=torch.float64),
    }
    specs = [TensorSpec(name, DTYPE_NAMES[t.dtype], tuple(t.shape)) for name, t in tensors.items()]
    path = tmp_path / "stream.safetensors"
    with open(path, "wb") as handle, StreamWriter(handle, specs, {"note": "x"}) as writer:
        for tensor in tensors.values():
            writer.write(tensor)
    read = load_file(path)
    assert read.keys() == tensors.keys()
    assert all(torch.equal(read[k], t) and read[k].dtype == t.dtype for k, t in tensors.items())
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"note": "x"}
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_length % 8 == 0

    with open(tmp_path / "short.safetensors", "wb") as handle, pytest.raises(ValueError, match="header says"):
        StreamWriter(handle, specs, {}).write(tensors["scalar"])  # out of order
