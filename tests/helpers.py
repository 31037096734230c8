"""Small builders shared by the tests (configs for the tiny model, running the CLI)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import train_sdxl_here

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data" / "images"


def tiny_config(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A small, fast config for the built-in tiny model writing under tmp_path."""
    config: dict[str, Any] = {
        "model": {"id": "builtin:tiny-sdxl", "train_text_encoder_1": True, "use_gradient_checkpointing": False},
        "adapter": {"type": "dora", "rank": 4, "alpha": 4},
        "run": {"name": "test_run", "output_root": str(tmp_path / "out")},
        "training": {
            "num_steps": 4, "lr_unet": 1e-3, "lr_text_encoder_1": 1e-3, "seed": 7, "log_every": 2,
            "tensorboard": {"enabled": True, "base_dir": str(tmp_path / "tb")},
        },
        "data": {
            "image_dir": str(DATA_DIR), "size": 64, "num_workers": 0,
            "bucket": {"resolutions": [[64, 64], [96, 64], [64, 96]], "divisible_by": 32, "batch_size": 2},
            "latent_cache": {"cache_dir": str(tmp_path / "latents")},
            "text_cache": {"cache_dir": str(tmp_path / "text")},
        },
        "optimizer": {"type": "adamw"},
        "export": {"save_single_file": False, "adapter_formats": ["diffusers"]},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


def run_cli(script: str, *args: str, cwd: Path | None = None, timeout: int = 600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a top-level script the way a user does, in a fresh interpreter (`env`: extra variables)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args], cwd=cwd or ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


def train_here(*args: str) -> subprocess.CompletedProcess:
    """`train_sdxl.py ARGS` in this process, its output captured: what `run_cli` gives, without a
    fresh interpreter's ~8 s of imports. For tests that need no process of their own (no signals,
    no kill, nothing that must start from a clean interpreter)."""
    return train_sdxl_here(list(args))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def accelerate_launch(launch_args: list[str], config_path: Path, *overrides: str,
                      target: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`accelerate launch <launch_args> [target] train_sdxl.py --config ... --set ...` in a fresh
    interpreter, one thread per process (the processes share this machine's cores)."""
    return _launch(launch_args, [*target, str(ROOT / "train_sdxl.py"), *train_args(config_path, *overrides)])


def train_args(config_path: Path, *overrides: str) -> list[str]:
    """`--config PATH --set OVERRIDE ...`: train_sdxl.py's command line."""
    return ["--config", str(config_path), *[part for item in overrides for part in ("--set", item)]]


def accelerate_launch_runs(launch_args: list[str], runs: dict[str, list[str]], folder: Path,
                           target: tuple[str, ...] = (), env: dict[str, dict[str, str]] | None = None,
                           processes: int = 2) -> dict[str, subprocess.CompletedProcess]:
    """One `accelerate launch` that trains `runs` (name: train_sdxl.py's arguments) one after another
    in the same processes (tests/runs_in_one_launch.py; `env`: variables for some runs only), for
    tests that need two processes to train but no launch of their own. Each run's result is what
    `accelerate_launch` would give for it alone: the first failing process's exit code, and the
    processes' output in rank order (and the launch's stderr where not all `processes` finished it)."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = {"folder": str(folder), "runs": [{"name": name, "args": args, "env": (env or {}).get(name, {})}
                                            for name, args in runs.items()]}
    plan_path = folder / "plan.json"
    plan_path.write_text(json.dumps(plan), encoding="utf-8")
    launch = _launch(launch_args, [*target, str(ROOT / "tests" / "runs_in_one_launch.py"), str(plan_path)])
    results = {}
    for name, args in runs.items():
        ranks = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob(f"{name}.rank*.json"))]
        finished = len(ranks) == processes
        codes = [rank["code"] for rank in ranks if rank["code"] != 0] or [0 if finished else launch.returncode or 1]
        stderr = "".join(rank["stderr"] for rank in ranks) + ("" if finished else launch.stderr)
        results[name] = subprocess.CompletedProcess(args, codes[0], "".join(rank["stdout"] for rank in ranks), stderr)
    return results


def _launch(launch_args: list[str], script_and_args: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch_args,
               "--main_process_port", str(free_port()), *script_and_args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
