"""The benchmarks must keep running: each one's smoke mode writes results whose measurements are
finite and positive. `bench/run_all.py --smoke` runs them all once, in one fresh interpreter (one
set of imports for all); each test checks its own benchmark's files. Timings are never asserted
here (bench/ measures)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # each runs a benchmark script (make test-fast leaves them out)


@pytest.fixture(scope="module")
def results(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python bench/run_all.py --smoke` as a user runs it (the tiny model comes from the test
    cache): every benchmark's smoke mode, its results in the folder returned."""
    folder = tmp_path_factory.mktemp("bench-results")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "run_all.py"), "--smoke", "--results-dir",
                             str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def rows_of(path: Path) -> list[dict]:
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["machine"]["torch"] and len(data["machine"]["load_average"]) == 3
    assert (path.with_suffix(".md")).read_text(encoding="utf-8").startswith(f"### {data['benchmark']}")
    return data["rows"]


def assert_positive(row: dict, *fields: str) -> None:
    for field in fields:
        value = row[field]
        assert isinstance(value, float | int) and math.isfinite(value) and value > 0, (field, row)


def test_gpu_benchmark_smoke_runs_on_the_cpu(results: Path) -> None:
    """bench/gpu_sdxl.py --smoke --peak-tflops 1 --profile (the peak run_all gives it, so that MFU is
    computed; the profile counts ops on the CPU, where no GPU kernel runs)."""
    rows = rows_of(results / "gpu_sdxl_smoke.json")
    assert {(r["mode"], r["batch"], r["grad_ckpt"]) for r in rows} == {
        (mode, batch, ckpt) for mode in ("DoRA rank 4", "full") for batch in (1, 2) for ckpt in ("off", "on")}
    for row in rows:
        assert row["status"] == "ok"
        assert_positive(row, "it_per_s", "images_per_s", "peak_memory_GB", "TFLOP_per_step", "achieved_TFLOPS",
                        "MFU_percent", "aten_ops_per_step")
        assert row["kernels_per_step"] == 0 and row["gpu_busy_percent"] is None
    # DoRA's rescale adds ops to every adapted layer; checkpointing runs the forward twice
    ops = {(r["mode"], r["grad_ckpt"]): r["aten_ops_per_step"] for r in rows if r["batch"] == 1}
    assert ops["DoRA rank 4", "off"] > ops["full", "off"] and ops["full", "on"] > ops["full", "off"]
    profiles = (results / "gpu_sdxl_smoke_profile.txt").read_text(encoding="utf-8")
    assert profiles.count("## ") == len(rows)
    # every aten op is counted, not one kind: the first row's matmuls (one step) are a part of them
    first = profiles.split("## ")[1]
    matmuls = int(next(line for line in first.splitlines() if line.split()[:1] == ["aten::mm"]).split()[-1])
    assert 0 < matmuls < rows[0]["aten_ops_per_step"] / 2


def test_cpu_benchmarks_smoke(results: Path) -> None:
    step = {row["step"]: row for row in rows_of(results / "step.json")}
    assert any(name.startswith("bare loop") for name in step)
    for name, row in step.items():
        assert_positive(row, "ms_per_step", "vs_bare")
        if name.startswith("train_sdxl.train()"):
            assert_positive(row, "trainable_params_M")
    assert_positive(step["train_sdxl.train(), DoRA rank 4"], "peak_rss_MB")

    text_cache = {row["step"]: row for row in rows_of(results / "text_cache.json")}
    assert len(text_cache) == 12  # 4 step modes, 2 conditioning rows, 6 full-size measures
    for name, row in text_cache.items():
        assert_positive(row, "value" if name.startswith("full size") else "vs_uncached")
    # Exact at full size: (77×768 + 77×1280 + 1280) bf16 values and two safetensors headers.
    assert 317_952 < text_cache["full size: bytes per cached caption, both encoders, bf16"]["value"] < 320_000

    for row in rows_of(results / "data.json"):
        assert_positive(row, "seconds", "images_per_s")

    convert = rows_of(results / "convert.json")
    assert len(convert) == 2  # the copy and the converter (--smoke leaves out --half)
    for row in convert:
        assert_positive(row, "seconds", "vs_copy", "MB_per_s", "peak_rss_MB")

    startup = {row["command"]: row for row in rows_of(results / "startup.json")}
    for name in ("train_sdxl.py --help", "train_sdxl.py --dry-run (quickstart)"):
        assert_positive(startup[name], "seconds", "peak_rss_MB")

    (pretrained,) = rows_of(results / "pretrained.json")  # --smoke: two world prompts, one step, CFG 2
    assert (pretrained["cfg"], pretrained["steps"], pretrained["prompts_right"][-4:]) == (2.0, 1, " / 2")
    assert 0.0 <= pretrained["accuracy"] <= 1.0
    assert_positive(pretrained, "seconds")

    learning = rows_of(results / "learning.json")
    assert [row["method"] for row in learning] == ["DoRA rank 8 (quickstart)", "pivotal tuning (DoRA rank 8)"]
    for row in learning:  # accuracies are fractions; at 4 steps they may well be 0
        assert {"concept@0", "concept@2", "concept@4", "concept_final", "prior_final"} <= row.keys()
        assert all(0.0 <= row[key] <= 1.0 for key in row if key != "method")
    assert (results / "learning_grid.png").stat().st_size > 1000

    seeds = rows_of(results / "seeds_smoke.json")  # two seeds, then their mean, lowest and highest
    assert [row["seed"] for row in seeds] == [42, 43, "mean", "lowest", "highest"]
    for group in ("concept", "prior"):
        values = [row[group] for row in seeds[:2]]
        assert [row[group] for row in seeds[2:]] == [sum(values) / 2, min(values), max(values)]
    assert "each seed, with eval.cfg_scale=2;" in json.loads((results / "seeds_smoke.json").read_text())["notes"]

    for row in rows_of(results / "fused.json"):  # fused backward frees every gradient during backward
        assert_positive(row, "ordinary_s", "fused_s", "time_ratio", "saved_MB")
        assert row["fused_peak_MB"] < row["ordinary_peak_MB"]

    preflight = rows_of(results / "preflight.json")
    assert [(row["images"], row["scan_cache"], row["workers"]) for row in preflight] == [
        (12, "cold", 1), (12, "cold", 2), (12, "warm", 2)]
    for row in preflight:
        assert_positive(row, "seconds", "peak_rss_MB")


def test_memory_benchmark_smoke(results: Path) -> None:
    """One real run of the tiny model against its plan (bench/bench_memory.py --smoke)."""
    (row,) = rows_of(results / "memory_smoke.json")
    assert row["run"] == "DoRA rank 4 (quickstart)"
    assert_positive(row, "planned_MB", "measured_MB")
    assert 0.95 <= row["measured_over_planned"] <= 1.05


def test_adapter_benchmark_smoke(results: Path) -> None:
    """Three 2-step runs, extraction at two ranks, the resize and the judge (bench/bench_adapters.py --smoke)."""
    adapters = {(row["model"], row["rank"]): row for row in rows_of(results / "adapters_smoke.json")}
    assert len(adapters) == 9  # the full fine-tune, LoRA and DoRA at 2 ranks, one randomized, 3 for the resize
    for rank in (4, 8):  # after 2 steps the update is small, but a rank-r cut of it is not exact
        assert 0 < adapters[("LoRA extracted", rank)]["update_error"] < 1
    assert 0 < adapters[("DoRA rank 32 resized to 8", 8)]["merged_weight_error"] < 1
    assert all(0.0 <= row["concept"] <= 1.0 for row in adapters.values() if row["concept"] is not None)


@pytest.mark.slow
def test_quantized_base_benchmark_smoke(results: Path) -> None:
    """An fp8 base against its plan and the full-precision base's step (bench/bench_quantized_base.py --smoke)."""
    rows = rows_of(results / "quantized_base_smoke.json")
    assert [row["base"] for row in rows] == ["none", "float8_e4m3fn"]
    assert_positive(rows[1], "planned_MB", "measured_MB", "step_s")
    assert 0.95 <= rows[1]["measured_over_planned"] <= 1.05
    assert rows[1]["unet_weights_MB"] < rows[0]["unet_weights_MB"] / 3  # fp8 against fp32, biases and norms aside
    block = rows_of(results / "quantized_base_block_smoke.json")
    assert [row["base"] for row in block] == ["none", "float8_e4m3fn", "int8", "nf4"]
    assert [row["quantized_layers"] for row in block] == [0, 10, 10, 10]  # 4 + 4 attention, 2 feed-forward
    for row in block:
        assert_positive(row, "ms_per_step", "vs_full_precision")


def test_seed_benchmark_refuses_an_override_that_is_not_json() -> None:
    """`--set KEY=VALUE` takes a JSON value; a bare word is a usage error (exit 2) before any run."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_seeds.py"), "--set",
                             "eval.sampler_name=euler"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "eval.sampler_name=euler" in result.stderr and "JSON value" in result.stderr


def test_seed_benchmark_trains_the_config_it_is_given(tmp_path: Path) -> None:
    """`--config` is the recipe each seed trains: a key the trainer does not know in that file stops
    the first run, and the error names the file and the key."""
    config = json.loads((ROOT / "configs" / "quickstart_prior_preservation.json").read_text(encoding="utf-8"))
    config["adapter"]["rnk"] = 4
    (tmp_path / "typo.json").write_text(json.dumps(config), encoding="utf-8")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_seeds.py"), "--smoke", "--seeds", "42",
                             "--config", str(tmp_path / "typo.json"), "--results-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "typo.json: unknown key adapter.rnk" in result.stderr
    assert not (tmp_path / "seeds_smoke.json").exists()


def test_seed_benchmark_summary_is_the_mean_lowest_and_highest_of_each_group() -> None:
    """The smoke run's two seeds may well score alike; here each statistic has its own answer."""
    from bench.bench_seeds import summary

    rows = [{"seed": 1, "concept": 0.0, "prior": 1.0}, {"seed": 2, "concept": 0.75, "prior": 0.25},
            {"seed": 3, "concept": 0.0, "prior": 1.0}]  # means differ from medians (0, 1)
    assert summary(rows) == [{"seed": "mean", "concept": 0.25, "prior": 0.75},
                             {"seed": "lowest", "concept": 0.0, "prior": 0.25},
                             {"seed": "highest", "concept": 0.75, "prior": 1.0}]
