"""Shared fixtures: the built-in tiny SDXL is built once per test session into a temp cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per worker (and per process a test starts): pytest-xdist runs one worker
    # per core, and two workers' thread pools on one core wait on each other.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


# The files that keep a worker busiest, longest first (their time on 2 cores, summed from
# `--durations=0`), handed out first. With `--dist loadfile` pytest-xdist gives each idle worker the
# next file in collection order (the Makefile turns off its own ordering by test count), so the
# suite ends on short files rather than on a long one that happened to start last: in the order of
# the measured times, the two workers' totals come out within seconds of each other.
LONGEST_FIRST = ("test_multiprocess.py", "test_bench.py", "test_learning.py", "test_training_core.py", "test_fsdp.py",
                 "test_lycoris_adapters.py", "test_resume.py", "test_memory.py", "test_optimizers.py",
                 "test_init_adapter.py", "test_reliability.py", "test_dora_doctor.py", "test_adapter_tools.py",
                 "test_training.py", "test_text_cache.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file's own order kept


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private SDXL_TRAINER_CACHE for the whole test session (never the user's own cache)."""
    cache = tmp_path_factory.mktemp("model-cache")
    os.environ["SDXL_TRAINER_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_sdxl_dir(model_cache: Path) -> Path:
    """The built-in tiny SDXL as a diffusers pipeline folder."""
    from sdxl_trainer.tiny_model import tiny_sdxl_path

    return tiny_sdxl_path(model_cache)
