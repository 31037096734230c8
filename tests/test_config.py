"""The config contract: errors name the key and exit 2 with nothing written; overrides; schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdxl_trainer.config import ConfigError, apply_override, load_config, validate_config
from sdxl_trainer.schema_docs import stale_files
from tests.helpers import ROOT, run_cli, tiny_config, train_here, write_config

# Every key the original tool's README names, with the values it shows (docs/design.md, 'Config
# compatibility with the original tool').
SEED_README_CONFIG = {
    "model": {
        "id": "stabilityai/stable-diffusion-xl-base-1.0", "use_ema": True, "ema_decay": 0.9999,
        "use_bf16": True, "use_gradient_checkpointing": True, "train_text_encoder_1": True,
        "train_text_encoder_2": False, "use_torch_compile": False,
        "torch_compile_kwargs": {"mode": "max-autotune"},
    },
    "run": {"name": "new_beginning_v_0_0_4", "output_root": ".output", "checkpoint_root": None},
    "training": {
        "output_dir": "", "num_steps": 2000, "num_epochs": None, "lr_unet": 1e-5,
        "lr_text_encoder_1": 5e-6, "lr_text_encoder_2": None, "seed": 0, "grad_accum_steps": 4,
        "batch_size": 1, "noise_offset": 0.1, "min_sigma": 0.4, "min_sigma_warmup_steps": 500,
        "prediction_type": "v_prediction", "snr_gamma": 5.0, "max_grad_norm": 1.0,
        "detect_anomaly": True, "lr_warmup_steps": 200,
        "lr_scheduler": {"type": "cosine_restarts", "warmup_steps": 200, "min_factor": 0.3,
                         "cycle_steps": 400, "cycle_mult": 1.0},
        "ema_update_every": 10, "resume_from": None, "resume_state_path": None, "state_path": None,
        "tensorboard": {"enabled": True, "base_dir": "./logs/tensorboard", "log_grad_norm": True,
                        "log_scaler": True, "log_dir": ""},
    },
    "data": {
        "image_dir": "./data/images", "caption_dropout_prob": 0.1, "caption_shuffle_prob": 0.2,
        "caption_shuffle_separator": ",", "caption_shuffle_min_tokens": 3,
        "bucket": {"enabled": True, "resolutions": [[1024, 1024], [896, 1152], [1152, 896]],
                   "divisible_by": 64, "batch_size": 2, "drop_last": True,
                   "per_resolution_batch_sizes": {"832x1216": 2, "1216x832": 2}},
        "latent_cache": {"enabled": True, "cache_dir": "./cache/latents", "dtype": "auto", "build_batch_size": 2},
    },
    "optimizer": {"weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8},
    "export": {"save_single_file": True, "checkpoint_path": "", "converter_script": "./converttosdxl.py",
               "half_precision": True, "use_safetensors": True, "extra_args": []},
    "eval": {
        "backend": "diffusers", "sampler_name": "dpmpp_2m_sde_heun", "scheduler": "beta",
        "num_inference_steps": 30, "cfg_scale": 7.0, "prompts_path": "data/eval_prompts.example.json",
        "height": 1024, "width": 1024, "use_ema": True,
        "live": {"enabled": True, "every_n_steps": 250, "max_batches": 2},
        "final": {"enabled": True, "max_batches": 4},
    },
}


def test_seed_readme_config_loads_unchanged(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path / "config.json", SEED_README_CONFIG))
    assert config.run.name == "new_beginning_v_0_0_4"
    assert config.precision == "bf16"  # model.use_bf16 is the legacy alias
    assert config.data.bucket.per_resolution_batch_sizes == {"832x1216": 2, "1216x832": 2}
    assert config.training.lr_scheduler.cycle_steps == 400
    # Derived paths follow the seed README: {output_root}/{name}, {checkpoint_root}/{name}.safetensors
    assert config.output_dir == Path(".output/new_beginning_v_0_0_4")
    assert config.checkpoint_path == Path(".output/safetensors/new_beginning_v_0_0_4.safetensors")
    assert config.state_path == Path(".output/new_beginning_v_0_0_4/trainer_state.pt")
    assert config.tensorboard_dir == Path("logs/tensorboard/new_beginning_v_0_0_4")


def test_shipped_configs_are_valid() -> None:
    for path in [ROOT / "config.json", *sorted((ROOT / "configs").glob("*.json"))]:
        config = load_config(path)
        assert config.run.name, path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("training", "snr_gama", 5.0), "unknown key training.snr_gama; did you mean training.snr_gamma?"),
        (("training", "num_steps", "many"), "training.num_steps = \"many\""),
        (("adapter", "rank", 0), "adapter.rank = 0: Input should be greater than or equal to 1"),
        (("training", "num_steps", None), "training.num_steps is missing"),
        (("model", "use_bf16", True), "model.use_bf16 is true but training.mixed_precision is \"fp16\""),
    ],
)
def test_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, change, expected) -> None:
    section, key, value = change
    config = tiny_config(tmp_path)
    config[section][key] = value
    if key == "use_bf16":
        config["training"]["mixed_precision"] = "fp16"
    # One case in a fresh interpreter, as a user sees it (no warning or traceback from the imports
    # either); the others in this process, which gives main()'s exit code and stderr alike.
    run = (lambda *args: run_cli("train_sdxl.py", *args)) if key == "snr_gama" else train_here
    result = run("--config", str(write_config(tmp_path / "c.json", config)))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "tb").exists()


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"run": {"name": "x"},\n "training": {num_steps: 3}}', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"broken.json: invalid JSON at line 2"):
        load_config(path)


def test_a_key_given_twice_is_refused_not_half_dropped(tmp_path: Path) -> None:
    path = tmp_path / "twice.json"
    path.write_text('{"training": {"num_steps": 3}, "run": {"name": "x"}, "training": {"lr_unet": 0.5}}',
                    encoding="utf-8")
    with pytest.raises(ConfigError, match=r"twice.json: training is given twice"):
        load_config(path)
    path.write_text('{"data": {"subsets": [{"image_dir": "a"}, {"image_dir": "b", "repeats": 2, "repeats": 3}]}}',
                    encoding="utf-8")
    with pytest.raises(ConfigError, match=r"twice.json: data.subsets\[1\].repeats is given twice"):
        load_config(path)


def test_a_config_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    """Windows editors save "UTF-8 with BOM"; json would read the mark as invalid JSON at line 1."""
    path = tmp_path / "bom.json"
    path.write_text(json.dumps(tiny_config(tmp_path)), encoding="utf-8-sig")
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_config(path).training.num_steps == tiny_config(tmp_path)["training"]["num_steps"]


def test_text_encoder_trained_without_its_rate_is_refused(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    config["model"]["train_text_encoder_2"] = True
    with pytest.raises(ConfigError, match=r"training.lr_text_encoder_2 must be set"):
        validate_config(config)



def test_eval_with_ema_weights_needs_an_ema(tmp_path: Path) -> None:
    """eval.use_ema without model.use_ema rendered the trained weights, silently."""
    with pytest.raises(ConfigError, match=r"eval.use_ema renders with the EMA weights, but model.use_ema is false"):
        validate_config(tiny_config(tmp_path, eval={"use_ema": True}))
    validate_config(tiny_config(tmp_path, eval={"use_ema": True}, model={"use_ema": True}))

def test_an_adapter_run_must_export_the_adapter_somewhere(tmp_path: Path) -> None:
    """No adapter format and no merged single file: the run completed and wrote no adapter file."""
    with pytest.raises(ConfigError, match=r"export.adapter_formats is empty and no merged single file is written"):
        validate_config(tiny_config(tmp_path, export={"save_single_file": False, "adapter_formats": []}))
    validate_config(tiny_config(tmp_path, export={"save_single_file": True, "adapter_formats": []}))
    validate_config(tiny_config(tmp_path, adapter={"type": "none"}, export={"save_single_file": False,
                                                                            "adapter_formats": []}))


def test_set_overrides_parse_json_and_create_nested_keys(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path))
    config = load_config(path, ["training.num_steps=20", "data.bucket.enabled=false",
                                "run.name=other", "training.lr_scheduler.type=linear_decay"])
    assert config.training.num_steps == 20
    assert config.data.bucket.enabled is False
    assert config.run.name == "other"
    assert config.training.lr_scheduler.type == "linear_decay"
    with pytest.raises(ConfigError, match=r"unknown key training.nmu_steps; did you mean training.num_steps"):
        load_config(path, ["training.nmu_steps=3"])
    with pytest.raises(ConfigError, match=r"expected dotted\.key=value"):
        apply_override({}, "training.num_steps")


@pytest.mark.slow
def test_print_config_shows_derived_paths(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    result = train_here("--config", str(write_config(tmp_path / "c.json", config)),
                        "--print-config", "--set", "model.use_bf16=true")
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["training"]["output_dir"] == str(tmp_path / "out" / "test_run")
    assert resolved["export"]["checkpoint_path"] == str(tmp_path / "out" / "safetensors" / "test_run.safetensors")
    assert resolved["training"]["tensorboard"]["log_dir"] == str(tmp_path / "tb" / "test_run")
    assert resolved["training"]["mixed_precision"] == "bf16"


@pytest.mark.slow
def test_unbuilt_option_is_refused_not_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The mechanism that keeps a not-yet-built option from being silently ignored."""
    import train_sdxl
    from sdxl_trainer import config as config_module

    monkeypatch.setitem(config_module.UNBUILT, "training.snr_gamma", (lambda v: v is not None, "planned"))
    config = tiny_config(tmp_path, training={"snr_gamma": 5.0})
    assert train_sdxl.main(["--config", str(write_config(tmp_path / "c.json", config))]) == 2
    assert "not implemented yet: training.snr_gamma (planned)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_help_defers_heavy_imports() -> None:
    """`--help` must answer at once: parsing arguments may not import torch or diffusers."""
    import subprocess
    import sys

    code = (
        "import runpy, sys; sys.argv = ['train_sdxl.py', '--help']\n"
        "try:\n    runpy.run_path('train_sdxl.py', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers', 'peft') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert "usage: train_sdxl.py" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_dry_run_prints_the_preflight_and_builds_no_model(tmp_path: Path, tiny_sdxl_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for cls in (diffusers.ModelMixin, diffusers.DiffusionPipeline, transformers.PreTrainedModel):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_single_file", classmethod(refuse), raising=False)
    monkeypatch.chdir(ROOT)
    result = train_here("--config", "configs/quickstart.json", "--dry-run",
                        "--set", f"data.latent_cache.cache_dir={tmp_path / 'latents'}")
    assert result.returncode == 0, result.stderr
    report = result.stdout
    assert "images: 18 usable, 0 skipped, 0 without caption" in report
    assert "  128x128          6      2        3        0" in report
    assert "steps: 600 optimizer steps (9 per epoch" in report
    assert "latent cache: 0 hits, 18 misses" in report


def test_generated_schema_and_option_table_are_current() -> None:
    assert stale_files() == [], "run: python -m sdxl_trainer.schema_docs"


def test_schema_validates_the_shipped_config() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "config.schema.json").read_text(encoding="utf-8"))
    shipped = json.loads((ROOT / "config.json").read_text(encoding="utf-8"))
    jsonschema.validate(shipped, schema)
    shipped["training"]["snr_gama"] = 5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(shipped, schema)
