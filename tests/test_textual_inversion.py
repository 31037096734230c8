"""Textual inversion on both text encoders: new rows only, the exports ComfyUI and diffusers load."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdxl_trainer.adapter_kinds import ADAPTER_KINDS
from sdxl_trainer.conditioning import encode_prompts
from sdxl_trainer.config import Config, ConfigError, ModelConfig, TextualInversionConfig, validate_config
from sdxl_trainer.embeddings import add_tokens, save_embedding_files
from sdxl_trainer.eval.eval_prompts import EvalPrompt
from sdxl_trainer.eval.evaluation import run_evaluation
from sdxl_trainer.long_prompts import caption_ids
from sdxl_trainer.models import load_pipeline
from sdxl_trainer.planning import plan_run
from sdxl_trainer.text_cache import CachedEncoder, TextCache, build_text_cache, encoder_spec
from tests.helpers import ROOT, tiny_config, train_here
from tests.test_evaluation import eval_config

SETTINGS = TextualInversionConfig(tokens=[{"token": "<qz>", "vectors": 2, "init_word": "circle"},
                                          {"token": "<zq>", "init_word": "red"}])


def fresh_pipe():
    pipe = load_pipeline(ModelConfig(id="builtin:tiny-sdxl"))
    pipe.set_progress_bar_config(disable=True)
    for name in ("text_encoder", "text_encoder_2", "unet"):
        getattr(pipe, name).requires_grad_(False)
    return pipe


@pytest.fixture
def pipe(tiny_sdxl_dir: Path):
    return fresh_pipe()


def comfyui_load_embed(path: Path, embedding_size: int, embed_key: str) -> torch.Tensor:
    """ComfyUI's comfy/sd1_clip.py `load_embed` for a .safetensors file, written out from its
    source: the tensor under `embed_key` (`clip_l` / `clip_g`), else the first one; SDTokenizer then
    uses each row whose width is the encoder's (`embedding_size`) as one token."""
    embed = load_file(path)
    tensor = embed[embed_key] if embed_key in embed else next(iter(embed.values()))
    assert tensor.shape[-1] == embedding_size  # SDClipModel ignores rows of another width
    return tensor


def test_only_the_new_rows_train_and_the_files_load_in_comfyui_and_diffusers(tmp_path: Path, pipe) -> None:
    before = {name: getattr(pipe, name).get_input_embeddings().weight.detach().clone()
              for name in ("text_encoder", "text_encoder_2")}
    tokens = add_tokens(pipe, SETTINGS)
    circle = pipe.tokenizer("circle", add_special_tokens=False).input_ids
    assert torch.equal(tokens.vectors("<qz>")["text_encoder"][1], before["text_encoder"][circle[0]])
    start = {name: table.new.detach().clone() for name, table in tokens.tables.items()}
    optimizer = torch.optim.AdamW(tokens.parameters(), lr=0.1, weight_decay=0.1)
    trained = [parameter for module in (pipe.text_encoder, pipe.text_encoder_2)
               for parameter in module.parameters() if parameter.requires_grad]
    assert len(trained) == 2 and all(parameter.shape[0] == 3 for parameter in trained)  # 2 + 1 vectors
    for _ in range(3):
        embeds, pooled = encode_prompts(["a <qz> and a <zq>", "a red circle"], [pipe.tokenizer, pipe.tokenizer_2],
                                        [pipe.text_encoder, pipe.text_encoder_2], "cpu")
        (embeds.square().mean() + pooled.square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, table in tokens.tables.items():
        assert torch.equal(table.base.weight, before[name])  # every old row bit-identical
        assert (table.new.detach() != start[name]).any(dim=1).all()  # each new row moved
    ids = caption_ids(pipe.tokenizer, "a <qz>", 75)[0].tolist()
    added = pipe.tokenizer.convert_tokens_to_ids(["<qz>", "<qz>_1"])
    assert ids[:5] == [pipe.tokenizer.bos_token_id, ids[1], *added, pipe.tokenizer.eos_token_id]

    written = save_embedding_files(tokens, tmp_path)
    assert sorted(path.relative_to(tmp_path).as_posix() for path in written) == [
        "qz.diffusers/text_encoder.safetensors", "qz.diffusers/text_encoder_2.safetensors", "qz.safetensors",
        "zq.diffusers/text_encoder.safetensors", "zq.diffusers/text_encoder_2.safetensors", "zq.safetensors"]
    vectors = tokens.vectors("<qz>")
    assert set(load_file(tmp_path / "qz.safetensors")) == {"clip_l", "clip_g"}
    assert torch.equal(comfyui_load_embed(tmp_path / "qz.safetensors", 32, "clip_l"), vectors["text_encoder"])
    assert torch.equal(comfyui_load_embed(tmp_path / "qz.safetensors", 48, "clip_g"), vectors["text_encoder_2"])

    other = fresh_pipe()  # diffusers' own loader, once per encoder
    for name, tokenizer in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        other.load_textual_inversion(str(tmp_path / "qz.diffusers" / f"{name}.safetensors"),
                                     text_encoder=getattr(other, name), tokenizer=getattr(other, tokenizer))
        table = getattr(other, name).get_input_embeddings().weight
        rows = getattr(other, tokenizer).convert_tokens_to_ids(["<qz>", "<qz>_1"])
        assert torch.equal(table[rows], vectors[name])
    with torch.no_grad():
        ours = encode_prompts(["a <qz>"], [pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2],
                              "cpu")[0]
        theirs = other.encode_prompt("a <qz>", device="cpu", do_classifier_free_guidance=False)[0]
    torch.testing.assert_close(ours, theirs)  # the pipeline that loaded the files reads the prompt as training did


def sdxl_eos_config(pipe):
    """The pipeline with SDXL's encoder configs' legacy `eos_token_id: 2` (pooled at the largest id)."""
    for name in ("text_encoder", "text_encoder_2"):
        encoder = getattr(pipe, name)
        encoder.config.eos_token_id = getattr(encoder, "text_model", encoder).eos_token_id = 2
    return pipe


def test_diffusers_with_the_documented_line_reads_the_pooled_output_as_training(tmp_path: Path) -> None:
    pipe = sdxl_eos_config(fresh_pipe())
    tokens = add_tokens(pipe, TextualInversionConfig(tokens=[{"token": "<qz>", "vectors": 2, "init_word": "circle"}]))
    with torch.no_grad():
        for table in tokens.tables.values():
            table.new.add_(torch.randn(table.new.shape, generator=torch.Generator().manual_seed(0)))
    save_embedding_files(tokens, tmp_path)
    other = sdxl_eos_config(fresh_pipe())
    for name, tokenizer in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        other.load_textual_inversion(str(tmp_path / "qz.diffusers" / f"{name}.safetensors"),
                                     text_encoder=getattr(other, name), tokenizer=getattr(other, tokenizer))
    for encoder in (other.text_encoder, other.text_encoder_2):  # docs/training.md, the diffusers row
        getattr(encoder, "text_model", encoder).eos_token_id = other.tokenizer.eos_token_id
    with torch.no_grad():
        ours = encode_prompts(["a <qz> circle"], [pipe.tokenizer, pipe.tokenizer_2],
                              [pipe.text_encoder, pipe.text_encoder_2], "cpu")
        theirs = other.encode_prompt("a <qz> circle", device="cpu", do_classifier_free_guidance=False)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[2])  # bigG's pooled: at <EOS>, not at the new token


def test_a_known_word_or_an_empty_initializer_is_one_line(pipe) -> None:
    with pytest.raises(ConfigError, match=r"textual_inversion.tokens\[0\].token: 'red' is already in the vocabulary"):
        add_tokens(pipe, TextualInversionConfig(tokens=[{"token": "red", "init_word": "dog"}]))
    with pytest.raises(ConfigError, match=r"tokens\[0\].init_word: ' ' tokenizes to nothing"):
        add_tokens(pipe, TextualInversionConfig(tokens=[{"token": "<qz>", "init_word": " "}]))
    with pytest.raises(ValueError, match="one word"):
        TextualInversionConfig(tokens=[{"token": "<q z>", "init_word": "dog"}])
    with pytest.raises(ConfigError, match=r"tokens\[1\].token: '\[qz\]' and '<qz>' would both be saved as qz"):
        add_tokens(pipe, TextualInversionConfig(tokens=[{"token": "<qz>", "init_word": "dog"},
                                                        {"token": "[qz]", "init_word": "dog"}]))


def test_captions_with_a_new_token_run_live_and_the_rest_come_from_the_cache(tmp_path: Path, pipe) -> None:
    tokens = add_tokens(pipe, SETTINGS)
    names = ("text_encoder", "text_encoder_2")
    specs = {name: encoder_spec(getattr(pipe, name.replace("text_encoder", "tokenizer")), getattr(pipe, name), name)
             for name in names}
    cache = TextCache(tmp_path, specs, "fp32", "fp32")
    plain = ["a red circle", "a blue square"]
    build_text_cache(cache, plain, pipe, "cpu", torch.autocast("cpu", enabled=False))
    cached = [CachedEncoder(cache, name, zero_empty=True, live=getattr(pipe, name)) for name in names]
    captions = ["a <qz> circle", "a red circle", "", "a blue square, <zq>"]
    tokenizers = [pipe.tokenizer, pipe.tokenizer_2]
    from_cache = encode_prompts(captions, tokenizers, cached, "cpu", True)
    live = encode_prompts(captions, tokenizers, [pipe.text_encoder, pipe.text_encoder_2], "cpu", True)
    assert torch.equal(from_cache[0], live[0]) and torch.equal(from_cache[1], live[1])
    assert cache.missing("text_encoder", [captions[0], captions[3]]) == [captions[0], captions[3]]  # never cached
    from_cache[0][[0, 3]].sum().backward()
    assert all(table.new.grad is not None and table.new.grad.abs().sum() > 0 for table in tokens.tables.values())
    plain_only = encode_prompts(plain, tokenizers, cached, "cpu", True)[0]
    assert plain_only.grad_fn is None  # no caption with a new token: nothing runs live


def test_the_preflight_checks_the_tokens_against_the_tokenizer_and_the_captions(tmp_path: Path,
                                                                               tiny_sdxl_dir: Path) -> None:
    config = tiny_config(tmp_path, model={"train_text_encoder_1": False})
    config["textual_inversion"] = {"tokens": [{"token": "<qz>", "init_word": "circle"}]}
    preflight = plan_run(Config.model_validate(config)).preflight
    assert "warning: textual_inversion.tokens[0].token '<qz>' is in none of the 18 training samples' captions" \
        in preflight
    assert "run test_run: textual inversion of the new tokens' embeddings on " in preflight  # no UNet, no adapter
    config["data"]["caption_prefix"] = "<qz>,"
    assert "<qz>: in 18 of 18 training samples' captions" in plan_run(Config.model_validate(config)).preflight
    config["textual_inversion"]["tokens"][0]["token"] = "red"
    with pytest.raises(ConfigError, match="'red' is already in the vocabulary"):
        plan_run(Config.model_validate(config))


def run_preset(name: str, output: Path, *overrides: str):
    """The preset trained in this process, from the repository root (its paths are relative to it)."""
    settings = ["training.num_steps=4", "training.checkpoint_every=2", f"run.output_root={json.dumps(str(output))}",
                "training.tensorboard.enabled=false", *overrides]
    with contextlib.chdir(ROOT):
        return train_here("--config", str(ROOT / "configs" / f"{name}.json"),
                          *[part for item in settings for part in ("--set", item)])


def presets_initial_vectors() -> dict[str, torch.Tensor]:
    """The presets' `<shapes>` vectors before training (from `shape`), per text encoder."""
    started = TextualInversionConfig(tokens=[{"token": "<shapes>", "vectors": 2, "init_word": "shape"}])
    return add_tokens(fresh_pipe(), started).vectors("<shapes>")


@pytest.mark.slow
def test_the_textual_inversion_preset_trains_exports_and_resumes_bit_exact(tmp_path: Path,
                                                                          tiny_sdxl_dir: Path) -> None:
    straight = run_preset("textual_inversion", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "text cache: text_encoder cached, text_encoder_2 cached; 0 caption texts (18 images, 15 with a new " \
           "token, encoded live)" in straight.stdout
    folder = tmp_path / "straight" / "textual_inversion"
    assert not (folder / "pytorch_lora_weights.safetensors").exists()  # the model is unchanged
    final = load_file(folder / "shapes.safetensors")
    assert final["clip_l"].shape == (2, 32) and final["clip_g"].shape == (2, 48)
    checkpoint = folder / "checkpoints" / "checkpoint-2"
    resume = f"training.resume_from={json.dumps(str(checkpoint))}"
    resumed = run_preset("textual_inversion", tmp_path / "resumed", resume)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = load_file(tmp_path / "resumed" / "textual_inversion" / "shapes.safetensors")
    assert all(torch.equal(final[key], again[key]) for key in final)
    assert not torch.equal(final["clip_l"], load_file(checkpoint / "shapes.safetensors")["clip_l"])

    wrong = tmp_path / "wrong"
    shutil.copytree(checkpoint, wrong)
    save_file({"clip_l": torch.zeros(2, 16), "clip_g": torch.zeros(2, 48)}, str(wrong / "shapes.safetensors"))
    failed = run_preset("textual_inversion", tmp_path / "failed", f"training.resume_from={json.dumps(str(wrong))}")
    assert failed.returncode == 2 and "clip_l is (2, 16), this run's '<shapes>' needs (2, 32)" in failed.stderr
    assert "Traceback" not in failed.stderr


@pytest.mark.slow
def test_the_pivotal_tuning_preset_trains_the_embeddings_for_its_fraction(tmp_path: Path,
                                                                          tiny_sdxl_dir: Path) -> None:
    result = run_preset("pivotal_tuning", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "pivotal_tuning"
    assert (folder / "pytorch_lora_weights.safetensors").is_file() and (folder / "shapes.safetensors").is_file()
    assert list((tmp_path / "safetensors").glob("*.safetensors"))  # the merged single file
    at_half = load_file(folder / "checkpoints" / "checkpoint-2" / "shapes.safetensors")
    final = load_file(folder / "shapes.safetensors")
    assert all(torch.equal(final[key], at_half[key]) for key in final)  # train_fraction 0.5 of 4 steps
    # they did train in steps 1 and 2
    assert not torch.equal(presets_initial_vectors()["text_encoder"], final["clip_l"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "lokr", "loha"])
def test_pivotal_tuning_trains_beside_every_adapter_kind(tmp_path: Path, tiny_sdxl_dir: Path, kind: str) -> None:
    """The pivotal preset with another adapter kind: the embeddings train for the first half, the
    adapter to the end, and the embedding file is written beside both adapter files."""
    result = run_preset("pivotal_tuning", tmp_path, f'adapter.type="{kind}"', "export.save_single_file=false")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "pivotal_tuning"
    halfway = folder / "checkpoints" / "checkpoint-2"  # train_fraction 0.5 of 4 steps
    weight_file = ADAPTER_KINDS[kind].weight_file
    adapter, at_half = load_file(folder / weight_file), load_file(halfway / weight_file)
    assert adapter.keys() == at_half.keys() and any(not torch.equal(adapter[k], at_half[k]) for k in adapter)
    assert (folder / "pivotal_tuning_kohya.safetensors").is_file()
    final, half = (load_file(path / "shapes.safetensors") for path in (folder, halfway))
    assert all(torch.equal(final[key], half[key]) for key in final)
    assert not torch.equal(presets_initial_vectors()["text_encoder"], final["clip_l"])


@pytest.mark.slow
def test_a_batch_whose_captions_are_all_dropped_teaches_the_new_vectors_nothing(tmp_path: Path,
                                                                               tiny_sdxl_dir: Path) -> None:
    """With textual inversion alone, a batch of dropped captions does not reach the new rows (SDXL's
    embedding of an empty caption is zero): a zero gradient, not a failed backward."""
    result = run_preset("textual_inversion", tmp_path, "data.caption_dropout_prob=1.0")
    assert result.returncode == 0, result.stderr[-3000:]
    final = load_file(tmp_path / "textual_inversion" / "shapes.safetensors")
    initial = presets_initial_vectors()
    assert torch.equal(final["clip_l"], initial["text_encoder"])
    assert torch.equal(final["clip_g"], initial["text_encoder_2"])


@pytest.mark.parametrize("max_tokens", [75, 150])
def test_eval_prompts_read_the_trained_vectors(tmp_path: Path, pipe, max_tokens: int) -> None:
    tokens = add_tokens(pipe, SETTINGS)
    prompts = [EvalPrompt("a <qz> on a red square", "", 3, 64, 64, max_tokens=max_tokens)]

    def render(name: str) -> bytes:
        return run_evaluation(pipe, eval_config(), prompts, tmp_path / name, tag="final", step=0).images[0].read_bytes()

    before = render("before")
    with torch.no_grad():
        tokens.tables["text_encoder_2"].new[1] += 1.0  # <qz>_1, read only where the prompt's <qz> is
    assert render("after") != before


def test_textual_inversion_alone_with_adapter_type_none_is_refused(tmp_path: Path) -> None:
    """adapter.type "none" is a full fine-tune, which new tokens do not support (docs/training.md):
    textual inversion alone with it is refused in one line naming the key, not run as a full
    fine-tune that stores and exports an untrained fp32 UNet."""
    config = tiny_config(tmp_path, adapter={"type": "none"}, model={"train_text_encoder_1": False},
                         training={"lr_text_encoder_1": None},
                         textual_inversion={"tokens": [{"token": "<x>", "init_word": "dog"}], "train_adapter": False})
    with pytest.raises(ConfigError, match=r'adapter.type is "none" \(a full fine-tune\), which '
                                          r"textual_inversion.tokens do not support"):
        validate_config(config)
