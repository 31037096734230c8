"""The fast DoRA forward (sdxl_trainer/fast_dora.py) against peft's own DoRA: outputs and gradients
to float rounding in fp32 and under bf16/fp16 autocast, a finite fp32 norm where 16 bits overflow,
the same model for everything else (state dict, merging, layers peft keeps), and training."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.lora import variants
from peft.tuners.lora.layer import LoraLayer

import dataset
from sdxl_trainer.config import validate_config
from sdxl_trainer.diffusion import Draws, LossModels, diffusion_loss, make_noise_scheduler
from sdxl_trainer.fast_dora import (
    FAST_VARIANTS,
    MERGED_MAX_WEIGHTS,
    FastDoraConv2dVariant,
    FastDoraLinearVariant,
    use_fast_dora,
    weight_norm,
)
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.optimizers import make_optimizer
from sdxl_trainer.training_setup import prepare_trainable
from tests.helpers import tiny_config

# (layer, input shape): the merged form (small fp32 Linear), the branch form with and without a
# bias (large Linear: above MERGED_MAX_WEIGHTS), and convolutions (always the branch form).
LAYERS = {
    "small linear": (lambda: torch.nn.Linear(48, 40), (2, 5, 48)),
    "large linear": (lambda: torch.nn.Linear(256, 160), (2, 7, 256)),
    "large linear, no bias": (lambda: torch.nn.Linear(200, 192, bias=False), (3, 200)),
    "conv 3x3": (lambda: torch.nn.Conv2d(16, 24, 3, padding=1), (2, 16, 6, 6)),
    "conv 1x1 stride 2, no bias": (lambda: torch.nn.Conv2d(12, 20, 1, stride=2, bias=False), (2, 12, 7, 7)),
}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def peft_dora(layer: torch.nn.Module, seed: int = 0, **config) -> torch.nn.Sequential:
    """`layer` with peft's DoRA (rank 4, alpha 8): a zero row in W, B and magnitudes away from their
    initial values (B = 0 and m = n would hide half of the function)."""
    torch.manual_seed(seed)  # the bias and lora_A's initialisation
    generator = torch.Generator().manual_seed(seed)
    module = torch.nn.Sequential(layer)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.1)
        layer.weight[0] = 0
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["0"], **config), module)
    adapted = module[0]
    with torch.no_grad():
        adapted.lora_B["default"].weight.copy_(torch.randn(adapted.lora_B["default"].weight.shape,
                                                           generator=generator) * 0.1)
        magnitude = adapted.lora_magnitude_vector["default"].weight
        magnitude.mul_(1 + 0.1 * torch.randn(magnitude.shape, generator=generator))
    return module


def fast_copy(module: torch.nn.Module) -> torch.nn.Module:
    fast = copy.deepcopy(module)
    assert use_fast_dora(fast) == 1
    return fast


def output_and_grads(module: torch.nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None
                     ) -> list[torch.Tensor]:
    """The output and the gradients of x, A, B and m for a loss that weighs every output."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = module(x)
    (out.double().square() * torch.linspace(0.5, 1.5, out.shape[-1], dtype=torch.float64)).sum().backward()
    layer = module[0]
    params = (layer.lora_A["default"].weight, layer.lora_B["default"].weight,
              layer.lora_magnitude_vector["default"].weight)
    return [out.detach().double(), x.grad.double(), *(p.grad.double() for p in params)]


def relative_errors(values: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    """‖value − reference‖ / ‖reference‖ for each pair (root mean square, steadier than a maximum)."""
    return [(torch.linalg.norm(v - r) / torch.linalg.norm(r)).item() for v, r in zip(values, reference, strict=True)]


@pytest.mark.parametrize("name", LAYERS)
def test_outputs_and_gradients_equal_peft_in_fp32(name: str) -> None:
    make, shape = LAYERS[name]
    module = peft_dora(make())
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    expected = output_and_grads(module, x)
    errors = relative_errors(output_and_grads(fast_copy(module), x), expected)
    assert max(errors) < 1e-6, (name, errors)


@pytest.mark.parametrize("precision", AUTOCAST)
@pytest.mark.parametrize("name", LAYERS)
def test_under_autocast_as_exact_as_peft(name: str, precision: str) -> None:
    """Against the fp64 truth, the fast forward's rounding errors are peft's: over 8 seeds of these
    cases the ratio of the two errors has a geometric mean of 1.01 and a maximum of 1.6."""
    make, shape = LAYERS[name]
    module = peft_dora(make())
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    truth = output_and_grads(copy.deepcopy(module).double(), x.double())
    peft_errors = relative_errors(output_and_grads(module, x, AUTOCAST[precision]), truth)
    fast_errors = relative_errors(output_and_grads(fast_copy(module), x, AUTOCAST[precision]), truth)
    resolution = 2.0 ** -8 if precision == "bf16" else 2.0 ** -11
    for fast, peft in zip(fast_errors, peft_errors, strict=True):
        assert fast <= 2 * peft and fast < 4 * resolution, (name, precision, fast_errors, peft_errors)


def test_the_norm_stays_fp32_where_fp16_overflows() -> None:
    """A row norm above fp16's largest value (65504), fp16 weights, fp16 autocast: the output and
    the gradients stay finite and equal the fp64 truth to fp16 rounding."""
    module = peft_dora(torch.nn.Linear(64, 32))
    with torch.no_grad():
        module[0].base_layer.weight[1] *= 3e4  # row norm ≈ 3e4 · 0.1 · √64 = 24000; its square overflows
    module[0].base_layer.half()
    fast = fast_copy(module)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    truth = output_and_grads(copy.deepcopy(module).double(), x.double())
    values = output_and_grads(fast, x.half(), torch.float16)
    assert all(torch.isfinite(v).all() for v in values)
    for error in relative_errors(values, truth):
        assert error < 2.0 ** -8


@pytest.mark.parametrize("shape", [(40, 48), (160, 256), (24, 144)])
def test_factored_weight_norm_equals_the_direct_norm(shape: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(3)
    weight, lora_A, lora_B = (torch.randn(*s, generator=generator) for s in (shape, (4, shape[1]), (shape[0], 4)))
    weight[0] = 0
    direct = torch.linalg.vector_norm(weight.double() + 2.0 * lora_B.double() @ lora_A.double(), dim=1)
    torch.testing.assert_close(weight_norm(weight, lora_A, lora_B, 2.0).double(), direct, rtol=2e-6, atol=0)


def test_the_forms_cover_the_layers_tested() -> None:
    """The merged form is for small Linear layers only; SDXL's layers are all large."""
    assert LAYERS["small linear"][0]().weight.numel() <= MERGED_MAX_WEIGHTS
    for name in ("large linear", "large linear, no bias"):
        assert LAYERS[name][0]().weight.numel() > MERGED_MAX_WEIGHTS
    assert MERGED_MAX_WEIGHTS < 320 * 320


def test_no_grad_and_merging_give_peft_s_values() -> None:
    """Inference (no graph) and peft's merge, which stays peft's, agree with the fast forward."""
    for make, shape in LAYERS.values():
        fast = fast_copy(peft_dora(make()))
        x = torch.randn(shape, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            unmerged = fast(x)
            fast[0].merge()
            merged = fast(x)
        torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)


def test_layers_peft_computes_otherwise_keep_peft_s_forward() -> None:
    """Adapter dropout makes peft's DoRA take another branch: such layers are left to peft."""
    module = peft_dora(torch.nn.Linear(32, 16), lora_dropout=0.1)
    assert use_fast_dora(module) == 0
    assert type(module[0].lora_variant["default"]) is variants.DoraLinearVariant


def tiny_pipeline_config(tmp_path: Path, **adapter):
    return validate_config(tiny_config(tmp_path, adapter={"type": "dora", **adapter},
                                       training={"lr_unet": 1e-3, "lr_text_encoder_1": 5e-4}))


def with_peft_variants(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with peft's own DoRA forward back on every layer (today's behaviour)."""
    peft_classes = {fast: peft for peft, fast in FAST_VARIANTS.items()}
    for layer in module.modules():
        if isinstance(layer, LoraLayer):
            for adapter, variant in layer.lora_variant.items():
                layer.lora_variant[adapter] = peft_classes[type(variant)]()
    return module


def test_the_trainer_s_dora_layers_all_get_it_with_peft_s_state_dict(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    config = tiny_pipeline_config(tmp_path, targets="all")  # Linear and Conv2d layers
    pipe = load_pipeline(config.model)
    prepare_trainable(pipe, config)
    for module in (pipe.unet, pipe.text_encoder):
        kinds = {type(variant) for layer in module.modules() if isinstance(layer, LoraLayer)
                 for variant in layer.lora_variant.values()}
        assert kinds <= {FastDoraLinearVariant, FastDoraConv2dVariant} and kinds
        reference = with_peft_variants(copy.deepcopy(module))
        ours, theirs = get_peft_model_state_dict(module), get_peft_model_state_dict(reference)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert FastDoraConv2dVariant in {type(v) for layer in pipe.unet.modules() if isinstance(layer, LoraLayer)
                                     for v in layer.lora_variant.values()}


def test_training_steps_equal_peft_s_to_rounding(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """The quickstart's adapters and learning rates, a few AdamW steps on one batch: the trained
    weights equal those trained with peft's DoRA forward to float rounding. Adam divides by the
    gradients' size, so rounding in a near-zero gradient moves a weight by a fraction of the
    learning rate: peft against itself on another thread count differs by 3e-5 here, as much."""
    config = tiny_pipeline_config(tmp_path)
    plan = dataset.plan_dataset(config.data, 2)
    items = dataset.ImageCaptionDataset(plan.samples, config.data, seed=0)
    batch = dataset.collate([items[(index, 0)] for index, t in enumerate(plan.targets) if t == (64, 64)][:2])
    draws = Draws(torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(0)), torch.tensor([250, 650]),
                  torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(5)))
    trained = []
    for fast in (True, False):
        pipe = load_pipeline(config.model)
        torch.manual_seed(0)  # the same random lora_A initialisation for both
        trainable = prepare_trainable(pipe, config)
        if not fast:
            for module in trainable.modules.values():
                with_peft_variants(module)
        scheduler = make_noise_scheduler(pipe.scheduler.config, None, False)
        optimizer = make_optimizer(config.optimizer, trainable.param_groups())
        for _ in range(3):
            diffusion_loss(LossModels.of(pipe), scheduler, batch, draws, "cpu").backward()
            optimizer.step()
            optimizer.zero_grad()
        trained.append({name: p.detach().clone() for name, p in trainable.named_parameters()})
    assert trained[0].keys() == trained[1].keys()
    for name, value in trained[0].items():
        torch.testing.assert_close(value, trained[1][name], rtol=0, atol=0.1 * config.training.lr_unet, msg=name)
