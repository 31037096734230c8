"""Small builders shared by the tests (configs for the tiny model, running the CLI)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import io
import json
import os
import runpy
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import train_sdxl_here

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data" / "images"
# For dry runs whose test is not about the memory plan: on the CPU a dry run traces the step twice
# (gradient checkpointing on and off), ~18 s of CPU for each new shape and setup.
NO_MEMORY_PLAN = ("--set", "training.memory_check=off")


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
                           processes: int = 2, forked: bool = False) -> dict[str, subprocess.CompletedProcess]:
    """One `accelerate launch` that trains `runs` (name: train_sdxl.py's arguments) one after another
    in the same processes (tests/runs_in_one_launch.py; `env`: variables for some runs only), for
    tests that need two processes to train but no launch of their own. Each run's result is what
    `accelerate_launch` would give for it alone: the first failing process's exit code, and the
    processes' output in rank order (and the launch's stderr where not all `processes` finished it).
    `forked`: the processes forked from this one (`launch_forked`; `launch_args` then unused)."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = {"folder": str(folder), "runs": [{"name": name, "args": args, "env": (env or {}).get(name, {})}
                                            for name, args in runs.items()]}
    plan_path = folder / "plan.json"
    plan_path.write_text(json.dumps(plan), encoding="utf-8")
    script_and_args = [*target, str(ROOT / "tests" / "runs_in_one_launch.py"), str(plan_path)]
    launch = launch_forked(script_and_args, processes) if forked else _launch(launch_args, script_and_args)
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


def cpu_launch_args(processes: int) -> list[str]:
    """`accelerate launch` options for `processes` training processes on this machine's CPU."""
    return ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no"]


def forked_launch(config_path: Path, *overrides: str, target: tuple[str, ...] = (),
                  processes: int = 2) -> subprocess.CompletedProcess:
    """`launch_forked` of `[target] train_sdxl.py --config ... --set ...`."""
    return launch_forked([*target, str(ROOT / "train_sdxl.py"), *train_args(config_path, *overrides)], processes)


def launch_forked(script_and_args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    """What `accelerate launch --multi_gpu --num_processes N SCRIPT ARGS` gives on the CPU (the
    first failing process's exit code, the processes' output in rank order), its processes forked
    from this one with the variables the launcher sets, without the launcher's and the processes'
    fresh imports (~8 s each). For tests about how two processes train, not about the launcher
    (the Ctrl-C, wait-timeout and FSDP tests launch for real). Where torch computes on several
    threads here, the real launcher runs (a child forked then hangs)."""
    import torch

    if torch.get_num_threads() != 1:
        return _launch(cpu_launch_args(processes), script_and_args)
    port = free_port()
    children = [ForkedTrain(script_and_args, main=functools.partial(run_launched, env=launcher_env(rank, processes,
                                                                                                   port)))
                for rank in range(processes)]
    with concurrent.futures.ThreadPoolExecutor(2 * processes) as pool:  # drained together: no full pipe blocks
        outputs = [(pool.submit(child.stdout.read), pool.submit(child.stderr.read)) for child in children]
        try:
            codes = [child.wait(timeout=900) for child in children]
        finally:
            for child in children:
                child.send_signal(9)
        texts = [(out.result(), err.result()) for out, err in outputs]
    code = next((code for code in codes if code != 0), 0)
    return subprocess.CompletedProcess(script_and_args, code, "".join(out for out, _ in texts),
                                       "".join(err for _, err in texts))


def launcher_env(rank: int, processes: int, port: int) -> dict[str, str]:
    """The variables `accelerate launch --multi_gpu` (torch's elastic agent) gives process `rank`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO", "OMP_NUM_THREADS": "1"}


def run_launched(script_and_args: list[str], env: dict[str, str]) -> int:
    """In a forked child: one process of a launch, `python SCRIPT ARGS` under the launcher's
    variables, with the accelerate state this process may hold from an in-process run dropped."""
    from accelerate.state import AcceleratorState

    os.environ.update(env)
    AcceleratorState._reset_state(reset_partial_state=True)
    sys.argv = list(script_and_args)
    runpy.run_path(script_and_args[0], run_name="__main__")
    return 0


def start_train(args: list[str], own_group: bool = False,
                python_options: tuple[str, ...] = ()) -> subprocess.Popen | ForkedTrain:
    """`train_sdxl.py ARGS` running in a process of its own, its output in text pipes: forked from
    this one (`ForkedTrain`) where torch computes on one thread here, else, or with `python_options`
    for the interpreter (e.g. `-X importtime`), a fresh interpreter (a child forked after OpenMP's
    threads started hangs in its first parallel region)."""
    import torch

    if torch.get_num_threads() == 1 and not python_options:
        return ForkedTrain(args, own_group)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *python_options, str(ROOT / "train_sdxl.py"), *args], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=own_group)


class ForkedTrain:
    """`train_sdxl.py ARGS` in a child forked from this process: a process of its own (its own pid,
    signals, kill -9, exit code, process group with `own_group`) that starts with this interpreter's
    modules, without a fresh interpreter's ~8 s of imports. For tests of how a run behaves when its
    process is signalled or killed (`main`: what the child runs instead of train_sdxl.main, given
    ARGS); a test about a fresh interpreter starts one (`run_cli`)."""

    def __init__(self, args: list[str], own_group: bool = False, main=None) -> None:
        import sdxl_trainer.run  # noqa: F401  (torch, diffusers, accelerate: imported once, here)
        import train_sdxl

        main = main or train_sdxl.main

        pipes = [os.pipe(), os.pipe()]
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never back into pytest, whatever happens
            code = 1
            try:
                code = run_in_child(main, args, own_group, pipes)
            finally:
                os._exit(code)
        for _, write in pipes:
            os.close(write)
        self.stdout, self.stderr = (os.fdopen(read, encoding="utf-8", errors="replace")
                                    for read, _ in pipes)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked train_sdxl.py (pid {self.pid})", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def run_in_child(main, args: list[str], own_group: bool, pipes: list[tuple[int, int]]) -> int:
    """The forked child's whole life: stdout and stderr to the pipes, unbuffered as under
    PYTHONUNBUFFERED=1, `main(args)`, and its exit code as the interpreter would give it."""
    code = 1
    try:
        if own_group:
            os.setsid()
        sys.argv = [str(ROOT / "train_sdxl.py"), *args]  # what the run says to resume with names the script
        for target, (read, write) in zip((1, 2), pipes, strict=True):
            os.dup2(write, target)
            os.close(read)
            os.close(write)
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                                   line_buffering=True, write_through=True) for fd in (1, 2))
        code = main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # what an uncaught exception does to the interpreter: a traceback, exit 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    return code
