"""`adapter.init_from`: a run starts from an existing adapter file exactly (judged by diffusers and
LyCORIS, which load the same file), a resumed run of it stays bit-exact without reading the file
again, and a file the run cannot start from is one line and exit 2 before anything is written."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import train_sdxl
from sdxl_trainer.adapter_kinds import ADAPTER_KINDS
from sdxl_trainer.adapters import save_diffusers_adapter
from sdxl_trainer.config import ConfigError, validate_config
from sdxl_trainer.export import export_after_training, merged_copy
from sdxl_trainer.formats.kohya_format import adapter_layers, kohya_module_name, save_kohya_adapter
from sdxl_trainer.init_adapter import preflight_lines
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.planning import RunPlan
from sdxl_trainer.precision import plan_precision
from sdxl_trainer.run import make_accelerator, setup_models
from sdxl_trainer.training_setup import Trainable, prepare_trainable
from tests.helpers import tiny_config, write_config
from tests.test_resume import final_weights, resumable_config

# alpha/rank is 2 for Linear layers and convolutions alike: a power of two, so LoKr's scale, which
# the kohya file folds into `lokr_w2` where no factor is decomposed, comes out again exactly.
SETTINGS = {"rank": 4, "alpha": 8, "targets": "all", "conv_rank": 2, "conv_alpha": 4}
KINDS = ("lora", "dora", "lokr", "loha")


def config_dict(tmp_path: Path, kind: str, **adapter) -> dict:
    """UNet (attention, MLP, convolutions) and both text encoders, with latent and text caches in
    one folder for every run of the module."""
    config = tiny_config(tmp_path, adapter={"type": kind, **SETTINGS, **adapter},
                         model={"train_text_encoder_2": True},
                         training={"num_steps": 2, "lr_unet": 5e-2, "lr_text_encoder_1": 5e-2,
                                   "lr_text_encoder_2": 5e-2, "tensorboard": {"enabled": False}},
                         export={"save_single_file": False, "adapter_formats": ["diffusers", "kohya"]})
    config["data"]["latent_cache"]["cache_dir"] = str(tmp_path.parent / "latents")
    config["data"]["text_cache"]["cache_dir"] = str(tmp_path.parent / "text")
    return config


@pytest.fixture(scope="module")
def trained(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], SimpleNamespace]:
    """A 2-step run of each kind (on demand, once), and its two exported adapter files."""
    root, runs = tmp_path_factory.mktemp("trained"), {}

    def run(kind: str) -> SimpleNamespace:
        if kind not in runs:
            config = config_dict(root / kind, kind)
            assert train_sdxl.main(["--config", str(write_config(root / f"{kind}.json", config))]) == 0
            output = root / kind / "out" / "test_run"
            runs[kind] = SimpleNamespace(kind=kind, root=root, peft=output / ADAPTER_KINDS[kind].weight_file,
                                         kohya=output / "test_run_kohya.safetensors")
        return runs[kind]

    return run


@pytest.fixture(scope="module")
def started(trained: Callable[[str], SimpleNamespace]) -> Callable[[str, str], Trainable]:
    """The trained modules as a new run from a kind's `peft` or `kohya` file sets them up, before
    its first step (the run's own setup: adapters attached, cast, the file loaded, audited); once."""
    setups = {}

    def start(kind: str, file: str) -> Trainable:
        if (kind, file) not in setups:
            run = trained(kind)
            config = validate_config(config_dict(run.root / "new", kind, init_from=str(getattr(run, file))))
            pipe = load_pipeline(config.model)
            plan = RunPlan(None, 1, [], "")
            precision, accelerator = plan_precision(config, "cpu"), make_accelerator(config)
            setups[kind, file] = setup_models(config, plan, precision, accelerator, pipe)[2]
        return setups[kind, file]

    return start


def tensors_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys() and len(expected) > 50
    assert [key for key in expected if not torch.equal(expected[key], got[key])] == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_run_started_from_an_export_holds_exactly_the_exported_adapter(
        kind: str, trained: Callable[[str], SimpleNamespace], started: Callable[[str, str], Trainable],
        tmp_path: Path) -> None:
    """Train → export → start a new run from each file: its adapter, exported again before the
    first step, is the file tensor for tensor (the peft file for every kind, the kohya file too)."""
    run = trained(kind)
    for file in ("peft", "kohya"):
        trainable = started(kind, file)
        written = (save_diffusers_adapter(tmp_path, trainable.modules) if file == "peft" else
                   save_kohya_adapter(tmp_path / "kohya.safetensors", trainable.modules, {}))
        tensors_equal(load_file(getattr(run, file)), load_file(written))


def unet_output(unet: torch.nn.Module) -> torch.Tensor:
    """The UNet's prediction for fixed random inputs of its own sizes."""
    generator, config = torch.Generator().manual_seed(0), unet.config
    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    added = {"text_embeds": torch.randn(1, pooled, generator=generator),
             "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])}
    with torch.no_grad():
        return unet(torch.randn(1, config.in_channels, 16, 16, generator=generator), torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 8, config.cross_attention_dim, generator=generator),
                    added_cond_kwargs=added).sample


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "file"), [("lora", "peft"), ("dora", "peft"), ("lora", "kohya")])
def test_the_first_forward_is_the_base_with_the_file_fused_by_diffusers(
        kind: str, file: str, trained: Callable[[str], SimpleNamespace], started: Callable[[str, str], Trainable],
        tiny_sdxl_dir: Path) -> None:
    run, trainable = trained(kind), started(kind, file)
    fused_like_diffusers(trainable, getattr(run, file), tiny_sdxl_dir)


def fused_like_diffusers(trainable: Trainable, file: Path, tiny_sdxl_dir: Path) -> None:
    """The run's adapter before its first step is the base with `file` fused by diffusers: merged
    weights bit for bit, and the UNet's output, which the adapter changes."""
    from diffusers import StableDiffusionXLPipeline

    judge = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    base = unet_output(judge.unet)
    judge.load_lora_weights(str(file))
    judge.fuse_lora(lora_scale=1.0)
    judge.unload_lora_weights()
    for name, module in trainable.modules.items():  # peft's merged weights: bit for bit
        merged, fused = merged_copy(module).state_dict(), getattr(judge, name).state_dict()
        assert merged.keys() == fused.keys()
        assert [key for key in merged if not torch.equal(merged[key], fused[key])] == [], name
    ours, theirs = unet_output(trainable.modules["unet"]), unet_output(judge.unet)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - base).abs().max() > 1e-2  # the adapter changes the output far beyond the tolerance


def lycoris_judge(name: str, base: torch.nn.Module, part: dict[str, torch.Tensor]):
    """LyCORIS's own module for one module of a kohya file, applied to a copy of its base layer."""
    modules = pytest.importorskip("lycoris.modules")
    base = copy.deepcopy(base)
    if "lokr_w1" in part or "lokr_w1_a" in part:
        judge = modules.lokr.LokrModule.make_module_from_state_dict(
            name, base, part.get("lokr_w1"), part.get("lokr_w1_a"), part.get("lokr_w1_b"), part.get("lokr_w2"),
            part.get("lokr_w2_a"), part.get("lokr_w2_b"), None, None, part["alpha"], None)
    elif "hada_w1_a" in part:
        judge = modules.loha.LohaModule.make_module_from_state_dict(
            name, base, part["hada_w1_a"], part["hada_w1_b"], part["hada_w2_a"], part["hada_w2_b"], None, None,
            part["alpha"], None)
    else:
        judge = modules.locon.LoConModule.make_module_from_state_dict(
            name, base, part["lora_up.weight"], part["lora_down.weight"], None, part["alpha"], part["dora_scale"])
    judge.apply_to()
    return judge


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lokr", "loha", "dora"])
def test_each_layers_first_forward_is_lycoris_own_module_of_the_kohya_file(
        kind: str, trained: Callable[[str], SimpleNamespace], started: Callable[[str, str], Trainable]) -> None:
    """diffusers loads no LoKr or LoHa, and drops a kohya file's DoRA magnitude: LyCORIS's modules
    judge those, layer by layer (the output, as the step computes it: peft's unmerged forward)."""
    run, trainable = trained(kind), started(kind, "kohya")
    tensors, unet_config = load_file(run.kohya), trainable.modules["unet"].config
    generator, checked, moved = torch.Generator().manual_seed(0), set(), 0
    for component, module in trainable.modules.items():
        for path, layer in adapter_layers(module):
            name = kohya_module_name(component, path, unet_config)
            part = {key.removeprefix(name + "."): value for key, value in tensors.items()
                    if key.startswith(name + ".")}
            base = layer.get_base_layer()
            conv = isinstance(base, torch.nn.Conv2d)
            x = torch.randn(2, *([base.in_channels, 8, 8] if conv else [base.in_features]), generator=generator)
            with torch.no_grad():
                judge = lycoris_judge(name, base, part)
                ours, theirs, plain = layer(x), judge.org_module[0](x), base(x)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=lambda text, n=name: f"{n}: {text}")
            moved += (ours - plain).abs().max() > 1e-3
            checked.add((component, conv))
    assert checked == {("unet", False), ("unet", True), ("text_encoder", False), ("text_encoder_2", False)}
    assert moved > len(list(adapter_layers(trainable.modules["unet"]))) // 2


@pytest.mark.slow
def test_a_run_from_a_file_resumes_bit_exactly_without_reading_it_again(
        trained: Callable[[str], SimpleNamespace], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An uninterrupted run against one resumed from its checkpoint, whose init file has been
    replaced by garbage in between: the checkpoint alone holds the adapter."""
    source = trained("dora").peft

    def config(name: str, init_from: Path, **training) -> Path:
        values = resumable_config(tmp_path / name, "dora", num_steps=2, checkpoint_every=1,
                                  lr_text_encoder_2=1e-3, **training)
        values["adapter"].update(SETTINGS, init_from=str(init_from))
        values["model"]["train_text_encoder_2"] = True
        return write_config(tmp_path / f"{name}.json", values)

    assert train_sdxl.main(["--config", str(config("straight", source))]) == 0
    assert f"init: the adapter starts from {source}" in capsys.readouterr().out
    checkpoint = tmp_path / "straight" / "out" / "test_run" / "checkpoints" / "checkpoint-1"
    garbage = tmp_path / "gone.safetensors"
    garbage.write_bytes(b"not an adapter any more")
    assert train_sdxl.main(["--config", str(config("resumed", garbage, resume_from=str(checkpoint)))]) == 0
    assert "init: adapter.init_from is not read: the run continues from its checkpoint" in capsys.readouterr().out
    first = final_weights(tmp_path / "straight" / "out" / "test_run")
    second = final_weights(tmp_path / "resumed" / "out" / "test_run")
    tensors_equal(first, second)
    started = load_file(source)  # and the run did start from the file: trained on from its values
    assert 0 < max((first[f"test_run/{key}"] - value).abs().max() for key, value in started.items()) < 0.1


@pytest.mark.slow
def test_lokr_factors_other_than_the_files_are_named(trained: Callable[[str], SimpleNamespace]) -> None:
    run = trained("lokr")
    config = config_dict(run.root / "new", "lokr", init_from=str(run.kohya), lokr_factor=2)
    with pytest.raises(ConfigError, match=r"adapter\.lokr_factor 2 and adapter\.lokr_decompose_both false make "):
        preflight_lines(validate_config(config), resuming=False)


# --- files a run cannot start from (no training: a file written by the exporter in place of one) --


@pytest.fixture(scope="module")
def exported(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A DoRA adapter of UNet and both text encoders with seeded random values, in both formats."""
    tmp_path = tmp_path_factory.mktemp("exported")
    config = validate_config(config_dict(tmp_path / "run", "dora"))
    pipe = load_pipeline(config.model)
    trainable = prepare_trainable(pipe, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, parameter in trainable.named_parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    peft, kohya = export_after_training(config, pipe, trainable)
    return SimpleNamespace(root=tmp_path, peft=peft, kohya=kohya)


def preflight(exported: SimpleNamespace, init_from: Path, kind: str = "dora", **sections) -> list[str]:
    config = config_dict(exported.root / "new", kind, init_from=str(init_from))
    for section, values in sections.items():
        config[section].update(values)
    return preflight_lines(validate_config(config), resuming=False)


def refused(exported: SimpleNamespace, init_from: Path, kind: str = "dora", **sections) -> str:
    with pytest.raises(ConfigError) as error:
        preflight(exported, init_from, kind, **sections)
    message = str(error.value)
    assert message.startswith("adapter.init_from: ") and "\n" not in message
    return message


def test_differences_from_the_config_are_named_with_both_values(exported: SimpleNamespace, tmp_path: Path) -> None:
    assert preflight(exported, exported.kohya)[0].startswith(f"init: the adapter starts from {exported.kohya} (")
    message = refused(exported, exported.peft, "lora", adapter={"rank": 8, "alpha": 2.5, "conv_alpha": None})
    assert message == (f"adapter.init_from: {exported.peft} does not match the config: adapter.type is \"lora\", "
                       "the file's \"dora\"; adapter.rank is 8, the file's 4; adapter.alpha is 2.5, the file's 8; "
                       "adapter.conv_alpha is unset (= alpha 2.5), the file's 4")  # conv_rank 2 agrees
    assert refused(exported, exported.kohya, adapter={"targets": "attn-mlp"}).endswith(
        'adapter.targets is "attn-mlp", the file\'s "all"')
    assert refused(exported, exported.peft, model={"train_text_encoder_2": False}).endswith(
        "model.train_text_encoder_2 is false, the file adapts text_encoder_2")
    save_file(load_file(exported.peft), tmp_path / "bare.safetensors")  # no metadata: alpha = rank, as in diffusers
    assert refused(exported, tmp_path / "bare.safetensors").endswith(
        "adapter.alpha is 8, the file's 4; adapter.conv_alpha is 4, the file's 2")
    tensors = load_file(exported.kohya)  # one module resized to rank 2, as kohya's dynamic resizing does
    name = next(key for key in tensors if key.endswith("attn1_to_q.lora_down.weight")).split(".")[0]
    tensors[f"{name}.lora_down.weight"] = tensors[f"{name}.lora_down.weight"][:2].contiguous()
    tensors[f"{name}.lora_up.weight"] = tensors[f"{name}.lora_up.weight"][:, :2].contiguous()
    save_file(tensors, tmp_path / "resized.safetensors")
    assert preflight(exported, tmp_path / "resized.safetensors")[1] == (
        "  note: 1 module keeps the file's own rank and alpha, not the config's (peft's rank_pattern and "
        "alpha_pattern): ranks 2; alphas 8")
    assert refused(exported, tmp_path / "resized.safetensors", adapter={"rank": 2}).endswith(
        "adapter.rank is 2, the file's most common 4 (of 2, 4)")


def test_another_models_adapter_no_adapter_or_a_damaged_one_is_refused_in_one_line(
        exported: SimpleNamespace, tmp_path: Path) -> None:
    sd15 = tmp_path / "sd15.safetensors"  # SD 1.5's names: one text encoder, attention in down_blocks.0
    save_file({"lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": torch.ones(4, 768),
               "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": torch.ones(768, 4),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.ones(4, 320, 1, 1),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.ones(320, 4, 1, 1)}, sd15)
    assert refused(exported, sd15).endswith("(lora_te_ keys are SD 1.x's): an adapter for another model")
    full_size = tmp_path / "sdxl.safetensors"  # full-size SDXL's layer on the tiny model's 64 channels
    name = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    save_file({f"{name}.lora_down.weight": torch.ones(4, 640), f"{name}.lora_up.weight": torch.ones(640, 4),
               f"{name}.alpha": torch.tensor(8.0)}, full_size)
    assert refused(exported, full_size).endswith(
        f"{name} (unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q) is an update of 640 x 640 for a "
        "layer of shape [64, 64] in this model: an adapter for another model")
    model = tmp_path / "model.safetensors"
    save_file({"conv_in.weight": torch.ones(4, 4, 3, 3)}, model)
    assert "not an adapter file" in refused(exported, model)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(exported.peft.read_bytes()[: exported.peft.stat().st_size // 2])
    assert "truncated" in refused(exported, truncated)
    damaged = tmp_path / "nan.safetensors"
    tensors = load_file(exported.peft)
    key = next(key for key in tensors if key.endswith("lora_B.weight"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, damaged)
    assert "NaN/Inf" in refused(exported, damaged) and "fix_dora_weights.py" in refused(exported, damaged)
    legacy = tmp_path / "legacy_dora.safetensors"  # LyCORIS < 3.2: the magnitude on the input axis
    tensors = load_file(exported.kohya)
    down = next(key for key, value in tensors.items() if key.endswith("ff_net_2.lora_down.weight"))
    tensors[down.replace("lora_down.weight", "dora_scale")] = torch.ones(1, tensors[down].shape[1])
    save_file(tensors, legacy)
    assert "a DoRA magnitude on the input axis (LyCORIS before 3.2)" in refused(exported, legacy)
    assert refused(exported, tmp_path / "missing").endswith("missing: no such file or folder")


def test_modules_on_no_layer_and_layers_the_file_lacks_are_listed(exported: SimpleNamespace,
                                                                   tmp_path: Path) -> None:
    tensors = load_file(exported.kohya)
    lacking = "lora_unet_input_blocks_1_0_in_layers_2"  # down_blocks.0.resnets.0.conv1
    tensors = {key: value for key, value in tensors.items() if not key.startswith(lacking + ".")}
    last = "lora_te1_text_model_encoder_layers_2_mlp_fc1"  # CLIP-L's last layer: SDXL never runs it
    extra = "lora_unet_output_blocks_9_0_in_layers_2"  # no such block in the tiny UNet
    for name in (last, extra):
        tensors |= {f"{name}.lora_down.weight": torch.ones(4, 8), f"{name}.lora_up.weight": torch.zeros(8, 4),
                    f"{name}.alpha": torch.tensor(8.0), f"{name}.dora_scale": torch.ones(8, 1)}
    edited = tmp_path / "edited.safetensors"
    save_file(tensors, edited)
    lines = preflight(exported, edited)
    assert lines[1] == ("  warning: the file's modules on no layer this model has or runs are left out (2 modules): "
                        f"{last}, {extra}")
    assert lines[2] == ("  note: the file lacks 1 module this run adapts; they start as a new adapter does (a no-op): "
                        "unet.down_blocks.0.resnets.0.conv1")


def test_a_refused_file_stops_the_run_before_anything_is_written(exported: SimpleNamespace, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    config = config_dict(tmp_path, "dora", init_from=str(exported.peft), rank=8)
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: adapter.init_from: ") and "adapter.rank is 8, the file's 4" in error
    assert "\n" not in error and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=r'adapter\.init_from starts an adapter; adapter\.type "none"'):
        validate_config(tiny_config(tmp_path, adapter={"type": "none", "init_from": str(exported.peft)}))


# --- a file of several ranks (kohya's dynamic resizing): each module keeps its own -----------------


@pytest.fixture(scope="module")
def dynamic(exported: SimpleNamespace) -> SimpleNamespace:
    """The random DoRA resized by resize_adapter.py's sv_ratio: Linear layers of ranks 2, 3 and 4
    (alpha = rank), with the config's settings the file's most common rank and alpha."""
    import resize_adapter
    from sdxl_trainer.formats.adapter_files import AdapterFile
    from sdxl_trainer.init_adapter import layer_key

    file = exported.root / "dynamic.safetensors"
    assert resize_adapter.main([str(exported.peft), "--rank", "4", "--dynamic", "sv_ratio", "--dynamic-param", "2",
                                "--out", str(file), "--quiet"]) == 0
    with AdapterFile(file) as adapter:
        modules = {layer_key(m.component, m.name): m for m in adapter.modules()}
    ranks = {key: m.rank for key, m in modules.items()}
    assert all(m.alpha == m.rank for m in modules.values())
    is_conv = {key: m.down.dim() == 4 for key, m in modules.items()}
    assert {rank for key, rank in ranks.items() if not is_conv[key]} == {2, 3, 4}
    common = {conv: Counter(rank for key, rank in ranks.items() if is_conv[key] == conv).most_common(1)[0][0]
              for conv in (False, True)}
    settings = {"rank": common[False], "alpha": common[False], "conv_rank": common[True], "conv_alpha": common[True]}
    own = [rank for key, rank in ranks.items() if rank != common[is_conv[key]]]
    return SimpleNamespace(file=file, ranks=ranks, settings=settings, own=sorted(set(own)), count=len(own))


def adapter_ranks(modules: dict[str, torch.nn.Module]) -> dict[str, int]:
    """layer_key → the rank of the peft layer on it (its one adapter, whatever its name: diffusers
    names it default_0); every layer's scale must be 1 (alpha = rank)."""
    from sdxl_trainer.init_adapter import layer_key

    layers = {layer_key(component, path): layer for component, module in modules.items()
              for path, layer in adapter_layers(module)}
    assert {scale for layer in layers.values() for scale in layer.scaling.values()} == {1.0}
    ranks = {key: list(layer.r.values()) for key, layer in layers.items()}
    assert {len(held) for held in ranks.values()} == {1}
    return {key: held[0] for key, held in ranks.items()}


@pytest.mark.slow
def test_a_file_of_several_ranks_starts_each_module_at_its_own(exported: SimpleNamespace, dynamic: SimpleNamespace,
                                                               tiny_sdxl_dir: Path) -> None:
    config = validate_config(config_dict(exported.root / "several", "dora", init_from=str(dynamic.file),
                                         **dynamic.settings))
    shown = ", ".join(str(rank) for rank in dynamic.own)
    assert preflight_lines(config, resuming=False)[1] == (
        f"  note: {dynamic.count} modules keep the file's own rank and alpha, not the config's (peft's rank_pattern "
        f"and alpha_pattern): ranks {shown}; alphas {shown}")
    pipe = load_pipeline(config.model)
    trainable = setup_models(config, RunPlan(None, 1, [], ""), plan_precision(config, "cpu"),
                             make_accelerator(config), pipe)[2]
    assert adapter_ranks(trainable.modules) == dynamic.ranks
    fused_like_diffusers(trainable, dynamic.file, tiny_sdxl_dir)


@pytest.mark.slow
def test_a_run_from_a_file_of_several_ranks_exports_them_and_resumes_bit_exactly(
        dynamic: SimpleNamespace, tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """Both exports hold each module's own rank and alpha, and the diffusers file loads so in
    diffusers; the resumed run (its init file gone) attaches the ranks its checkpoint was saved
    with, and ends bit for bit as the uninterrupted one."""
    from diffusers import StableDiffusionXLPipeline

    from sdxl_trainer.formats.adapter_files import AdapterFile, kohya_name_map
    from sdxl_trainer.init_adapter import layer_key

    def config(name: str, init_from: Path, **training) -> Path:
        values = resumable_config(tmp_path / name, "dora", num_steps=2, checkpoint_every=1,
                                  lr_text_encoder_2=1e-3, **training)
        values["adapter"].update(SETTINGS, **dynamic.settings, init_from=str(init_from))
        values["model"]["train_text_encoder_2"] = True
        values["export"]["adapter_formats"] = ["diffusers", "kohya"]
        return write_config(tmp_path / f"{name}.json", values)

    assert train_sdxl.main(["--config", str(config("straight", dynamic.file))]) == 0
    output = tmp_path / "straight" / "out" / "test_run"
    garbage = tmp_path / "gone.safetensors"
    garbage.write_bytes(b"not an adapter any more")
    resumed = config("resumed", garbage, resume_from=str(output / "checkpoints" / "checkpoint-1"))
    assert train_sdxl.main(["--config", str(resumed)]) == 0
    first = final_weights(output)
    tensors_equal(first, final_weights(tmp_path / "resumed" / "out" / "test_run"))
    started = load_file(dynamic.file)  # trained on from the file's values
    assert 0 < max((first[f"test_run/{key}"] - value).abs().max() for key, value in started.items()) < 0.1
    for export in (output / "pytorch_lora_weights.safetensors", output / "test_run_kohya.safetensors"):
        pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
        with AdapterFile(export) as adapter:  # the file itself: each module's rank, alpha = rank
            adapter.name_map = kohya_name_map(pipe)
            modules = {layer_key(m.component, m.name): m for m in adapter.modules()}
        assert {key: m.rank for key, m in modules.items()} == dynamic.ranks
        assert all(m.alpha == m.rank for m in modules.values())
    # diffusers: each layer at the file's rank, scale 1. (Its kohya loader turns per-module alphas of
    # attention and text-encoder layers into alpha_pattern keys that match no module, and ignores them.)
    pipe.load_lora_weights(str(output / "pytorch_lora_weights.safetensors"))
    assert adapter_ranks({name: getattr(pipe, name) for name in ("unet", "text_encoder", "text_encoder_2")}) \
        == dynamic.ranks
