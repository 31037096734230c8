"""The memory plan (sdxl_trainer/memory/): its counter, its device rules, the plan against the
tracked peak of real runs on the CPU, and the pre-flight's answer when a run does not fit."""

from __future__ import annotations

import shutil

import pytest
import torch

import train_sdxl
from sdxl_trainer.config import validate_config
from sdxl_trainer.memory.plan import DeviceRules
from sdxl_trainer.memory.tracker import LiveBytes
from tests.helpers import tiny_config, train_here, write_config


def mlp_steps(device: str) -> tuple[int, int]:
    """Two AdamW steps of a small MLP, counted by LiveBytes: (bytes alive after, peak)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    live = LiveBytes(device)
    live.track(model.parameters())
    with live:
        for _ in range(2):
            model(torch.ones(32, 64, device=device)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return live.current, live.peak


def test_the_counter_counts_a_traced_step_as_the_real_one():
    """The plan's premise: the same step on meta tensors (no memory) and on real CPU tensors is
    counted alike, byte for byte; and the numbers are the step's own (weights, Adam's two moments)."""
    real, meta = mlp_steps("cpu"), mlp_steps("meta")
    steps = 4 * 4  # AdamW's step counters: a CPU scalar per parameter whatever the device (as on CUDA)
    assert (real[0] - steps, real[1] - steps) == meta
    weights = (64 * 256 + 256 + 256 * 64 + 64) * 4
    assert meta[0] == 3 * weights  # after the steps: weights and AdamW's exp_avg and exp_avg_sq
    assert meta[1] > 4 * weights  # during the second backward: gradients and activations on top


def test_a_repeated_meta_call_gets_the_layout_its_kernel_gave():
    """The counter's layout cache: a call like an earlier one gets new tensors of the layout the
    meta kernel gave then (strides and dtypes included, each output its own storage), a pointwise
    in-place call gets its input back, and a call with other layouts runs the kernel again."""
    def calls() -> list:
        x = torch.empty(8, 16, device="meta").t()  # transposed: the outputs keep its strides
        y = torch.empty(16, 8, device="meta", dtype=torch.bfloat16)
        var, mean = torch.var_mean(x, dim=0)
        added = x.add_(1.0)
        return [x + y, x @ torch.empty(8, 4, device="meta"), var, mean, added is x]

    def layout(value):
        return (value.shape, value.stride(), value.dtype, value.untyped_storage().nbytes()) \
            if isinstance(value, torch.Tensor) else value

    live = LiveBytes("meta")
    with live:
        first, second = calls(), calls()
        other = torch.empty(4, 16, device="meta").t() + torch.empty(16, 4, device="meta", dtype=torch.bfloat16)
    assert [layout(value) for value in first] == [layout(value) for value in second]
    assert first[0].stride() == (1, 16) and first[0].dtype == torch.float32 and first[4] is True
    assert second[2].untyped_storage()._cdata != second[3].untyped_storage()._cdata
    assert other.shape == (16, 4) and other.stride() == (1, 16)


def test_cuda_rules_run_norms_in_fp32_and_attention_without_its_score_matrix():
    """On meta tensors inside a CPU autocast region: CUDA's autocast gives GroupNorm fp32 outputs
    where the CPU's keeps bf16, and attention is counted as the fused kernel allocates it."""
    x = torch.empty(2, 32, 8, 8, device="meta")
    conv = torch.nn.Conv2d(32, 32, 3, padding=1, device="meta")
    norm = torch.nn.GroupNorm(8, 32, device="meta")
    dtypes = {}
    for device in ("cpu", "cuda"):
        with DeviceRules(device), torch.autocast("cpu", dtype=torch.bfloat16):
            dtypes[device] = (conv(x).dtype, norm(conv(x)).dtype)
    assert dtypes == {"cpu": (torch.bfloat16, torch.bfloat16), "cuda": (torch.bfloat16, torch.float32)}

    tokens = 1024
    query = torch.empty(1, 4, tokens, 64, device="meta", dtype=torch.bfloat16)
    for device in ("cuda", "cpu"):
        live = LiveBytes("meta")
        with live, DeviceRules(device):
            torch.nn.functional.scaled_dot_product_attention(query, query, query)
        assert live.peak < tokens * tokens * 4 * 2  # one head's score matrix would not fit under it


@pytest.mark.slow
def test_a_run_that_does_not_fit_is_refused_with_what_would_make_it_fit(tmp_path, monkeypatch, capsys,
                                                                        tiny_sdxl_dir):
    """`refuse` stops before any weight is loaded (exit 2) and lists the changes that fit, each
    with the saving a new plan computed for it, most saving first; `warn` says the same and goes on."""
    import sdxl_trainer.memory.preflight as preflight

    config = tiny_config(tmp_path, model={"use_gradient_checkpointing": False})
    config["training"]["memory_check"] = "refuse"
    path = write_config(tmp_path / "c.json", config)
    monkeypatch.setattr(preflight, "free_memory", lambda device: 1_000_000)  # a 1 MB device
    code = train_sdxl.main(["--config", str(path), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2
    assert "training.memory_check: the planned peak of" in err and "does not fit the 1.0 MB free" in err
    remedies = [line.strip() for line in err.splitlines() if line.strip().startswith("- ")]
    savings = [float(line.split("saves ")[1].split(" MB")[0]) for line in remedies]
    assert any("gradient checkpointing" in line for line in remedies)
    assert any("batch 1 with 2x gradient accumulation" in line for line in remedies)
    assert any('an fp8 base under the adapter (model.base_quantization "float8_e4m3fn")' in line for line in remedies)
    assert savings == sorted(savings, reverse=True) and all(saving > 0 for saving in savings)

    config["training"]["memory_check"] = "warn"
    code = train_sdxl.main(["--config", str(write_config(tmp_path / "w.json", config)), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and "  warning: the planned peak of" in out


@pytest.mark.slow
def test_a_plan_that_cannot_be_made_is_skipped_in_one_line(tmp_path, tiny_sdxl_dir):
    """A model whose config files cannot be read: the plan says why, the run is unaffected."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_sdxl_dir, folder)
    (folder / "unet" / "config.json").write_text("{not json", encoding="utf-8")
    config = tiny_config(tmp_path, model={"id": str(folder)})
    config["training"]["memory_check"] = "warn"
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)), "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("memory plan")]
    assert lines == [f"memory plan: skipped (cannot read {folder / 'unet' / 'config.json'}: "
                     "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
                     "the run itself is unaffected"]


def test_a_model_without_its_config_files_is_planned_with_sdxl_base_shapes(tmp_path):
    """A hub model that is not downloaded, or a single file: SDXL base 1.0's shapes (every SDXL
    checkpoint shares them), said in the plan; a downloaded one's own config files otherwise."""
    from sdxl_trainer.memory.architecture import component_configs
    from sdxl_trainer.sdxl_base import UNET

    single = tmp_path / "model.safetensors"
    single.write_bytes(b"")
    for model_id, source in (("nobody/not-downloaded", "is not in the local Hugging Face cache"),
                             (str(single), "(a single file)")):
        config = validate_config({"model": {"id": model_id}, "run": {"name": "plan"},
                                  "training": {"num_steps": 1, "lr_text_encoder_1": 1e-5}, "data": {"image_dir": "."}})
        configs, where = component_configs(config.model)
        assert where.startswith("SDXL base 1.0's shapes") and source in where
        assert configs["unet"]["transformer_layers_per_block"] == UNET["transformer_layers_per_block"] == (1, 2, 10)
        assert configs["text_encoder_2"]["num_hidden_layers"] == 32


@pytest.mark.slow
def test_every_optimizer_can_be_planned(tmp_path, tiny_sdxl_dir):
    """Each optimizer's own state is traced (Prodigy reads numbers with `.item()`, schedule-free
    AdamW steps only in train mode): the state a plan counts is the optimizer's, not a guess."""
    from sdxl_trainer.config import OptimizerConfig
    from sdxl_trainer.memory.plan import StepShape, plan_memory

    plans = {}
    for kind in OptimizerConfig.model_fields["type"].annotation.__args__:
        scheduler = {"lr_scheduler": {"type": "constant"}} if kind == "adamw_schedulefree" else {}
        config = tiny_config(tmp_path, optimizer={"type": kind}, training={"lr_text_encoder_1": 1e-3, **scheduler})
        plans[kind] = plan_memory(validate_config(config), StepShape(1, 64, 64), "cpu")
    states = {kind: plan.optimizer_state for kind, plan in plans.items()}
    trained = plans["adamw"].trained  # tiny_config's own optimizer and rates: the plain adapter run's
    assert trained > 0 and {plan.trained for plan in plans.values()} == {trained}
    assert states["adamw"] > 2 * trained  # two moments (and a step counter per parameter)
    assert states["lion"] == trained  # one moment
    assert states["adafactor"] < states["adamw"]  # factored second moments
    assert states["prodigy"] > states["adamw"]  # Prodigy keeps the initial weights and its s as well


@pytest.mark.slow
def test_an_adapter_run_is_offered_a_quantized_base_where_it_runs(tmp_path, tiny_sdxl_dir):
    """An fp8 and an NF4 base are offered to a DoRA run, each planned anew and saving what the
    smaller UNet weights save; a full fine-tune (refused with a quantized base) is offered neither."""
    from sdxl_trainer.memory.plan import StepShape
    from sdxl_trainer.memory.preflight import cached_plan, quantized_base_remedies

    shape = StepShape(1, 64, 64)
    dora = validate_config(tiny_config(tmp_path))
    offered = {remedy.changes["model.base_quantization"]: remedy.what
               for remedy in quantized_base_remedies(dora, "cpu")}
    assert offered == {"float8_e4m3fn": 'an fp8 base under the adapter (model.base_quantization "float8_e4m3fn")',
                       "nf4": 'an NF4 base under the adapter (model.base_quantization "nf4")'}
    # Each remedy re-validates the config with its change: a config with data.subsets (and the
    # default data.image_dir beside them) gets the same offers.
    subsets = tiny_config(tmp_path)
    subsets["data"]["subsets"] = [{"image_dir": subsets["data"].pop("image_dir")}]
    assert [remedy.changes for remedy in quantized_base_remedies(validate_config(subsets), "cpu")] == [
        remedy.changes for remedy in quantized_base_remedies(dora, "cpu")]
    full_precision = cached_plan(dora, shape, "cpu")
    for form in offered:
        quantized = cached_plan(validate_config(tiny_config(tmp_path, model={"base_quantization": form})), shape, "cpu")
        assert full_precision.weight_bytes - quantized.weight_bytes > 5_000_000  # the UNet's 12.4 MB of fp32
        assert quantized.peak < full_precision.peak
    assert quantized_base_remedies(validate_config(tiny_config(tmp_path, adapter={"type": "none"})), "cpu") == []
    assert quantized_base_remedies(validate_config(tiny_config(tmp_path, model={"base_quantization": "nf4"})),
                                   "cpu") == []
    assert list(quantized_base_remedies(dora, "mps")) == []  # no float8 on MPS, no bitsandbytes NF4 there


def test_the_plan_cache_key_tells_apart_what_changes_the_plan(tmp_path, tiny_sdxl_dir):
    """Output preservation (two more UNet passes) and textual inversion alone (no UNet trained)
    plan differently from the plain run: a cached plan of one is not the plan of the others.
    Textual inversion alone is skipped with its reason, not a failed trace."""
    from sdxl_trainer.memory.architecture import PlanSkipped
    from sdxl_trainer.memory.plan import StepShape, plan_memory
    from sdxl_trainer.memory.preflight import plan_key

    base = tiny_config(tmp_path, model={"train_text_encoder_1": False}, training={"lr_text_encoder_1": None})
    preserving = {**base, "training": {**base["training"],
                                       "output_preservation": {"trigger": "circle", "classes": ["square"]}}}
    inversion = {**base, "textual_inversion": {"tokens": [{"token": "<x>", "vectors": 1, "init_word": "dog"}],
                                               "train_adapter": False}}
    shape = StepShape(2, 64, 64)
    keys = {plan_key(validate_config(config), shape, "cpu") for config in (base, preserving, inversion)}
    assert len(keys) == 3
    with pytest.raises(PlanSkipped, match="textual inversion alone trains only its new embeddings"):
        plan_memory(validate_config(inversion), shape, "cpu")


def test_the_plan_traces_the_bucket_whose_step_is_largest(tmp_path, tiny_sdxl_dir):
    """per_resolution_batch_sizes gives the small 64x64 bucket batch 6: its step (6 x 64x64) is
    larger than the 96x64 buckets' (batch 1), and the plan is that step's."""
    from sdxl_trainer.memory.plan import StepShape
    from sdxl_trainer.memory.preflight import memory_preflight
    from sdxl_trainer.planning import plan_run

    config = tiny_config(tmp_path, model={"train_text_encoder_1": False},
                         training={"lr_text_encoder_1": None, "memory_check": "warn"})
    config["data"]["bucket"].update({"batch_size": 1, "per_resolution_batch_sizes": {"64x64": 6}})
    config = validate_config(config)
    plan = plan_run(config)
    assert plan.data.batch_sizes == {(64, 96): 1, (96, 64): 1, (64, 64): 6}
    assert StepShape.candidates(plan.data, []) == [StepShape(6, 64, 64), StepShape(1, 64, 96)]
    memory, lines = memory_preflight(config, plan, dry_run=False)
    assert memory.shape == StepShape(6, 64, 64) and "batch 6 at 64x64" in lines.splitlines()[0]


def test_the_eval_peak_is_planned_at_the_batch_eval_samples(tmp_path, tiny_sdxl_dir):
    """The kdiffusion backend samples up to eval.batch_size prompts of one size in one UNet call:
    three 64x64 prompts at batch_size 4 are a CFG batch of 6, which the eval peak is traced at."""
    import dataclasses
    import json

    from sdxl_trainer.memory.plan import plan_memory
    from sdxl_trainer.memory.preflight import memory_preflight
    from sdxl_trainer.planning import plan_run

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": f"a red circle {seed}", "seed": seed, "width": 64, "height": 64}
                                   for seed in (1, 2, 3)]), encoding="utf-8")
    config = validate_config(tiny_config(
        tmp_path, training={"memory_check": "warn"},
        eval={"prompts_path": str(prompts), "batch_size": 4, "sampler_name": "euler", "scheduler": "normal",
              "backend": "kdiffusion", "final": {"enabled": True}}))
    memory, lines = memory_preflight(config, plan_run(config), dry_run=False)
    assert memory.shape.eval_batch == 3 and "(UNet on the CFG batch of 6 at 64x64" in lines
    one_at_a_time = plan_memory(config, dataclasses.replace(memory.shape, eval_batch=1), "cpu")
    assert memory.eval_peak > one_at_a_time.eval_peak


def test_each_process_of_a_launch_asks_its_own_gpu_for_free_memory(monkeypatch):
    """The pre-flight runs before the Accelerator sets each process's device: the free memory is
    read on LOCAL_RANK's GPU (modulo the visible ones, as accelerate picks it), not cuda:0 for all."""
    from sdxl_trainer.memory.preflight import free_memory

    asked = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # no GPU here: the driver's answers
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (1, 2))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    free_memory("cuda")
    for rank in ("1", "3", "5"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        free_memory("cuda")
    assert asked == [0, 1, 3, 1]
