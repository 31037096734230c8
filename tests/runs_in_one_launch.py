"""Launch target that trains several runs in one launch: `accelerate launch ... tests/runs_in_one_launch.py PLAN`.

A launch pays three fresh interpreters' imports (the launcher and two processes, ~8 s each) before
a few seconds of training; tests that only need two processes to train, not a launch of their
own, share one. PLAN (JSON, written by tests.helpers.accelerate_launch_runs) names the runs in
order: each is `train_sdxl.main(args)` in these same processes, as the launch would run
`train_sdxl.py ARGS` (its process group, Accelerator and model built again, the process group
kept), with `env` set for that run only. Each process writes each run's exit code, stdout and
stderr to `<folder>/<name>.rank<R>.json`. A run that fails or raises ends this process: the runs
after it would wait on a process that has left.
"""

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

import train_sdxl
from sdxl_trainer.atomic import write_json


def run_one(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """`train_sdxl.py ARGS` under `env`: its exit code and its output."""
    stdout, stderr = io.StringIO(), io.StringIO()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = train_sdxl.main(args)
    except BaseException:
        code = 1
        stderr.write(traceback.format_exc())
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    return code, stdout.getvalue(), stderr.getvalue()


if __name__ == "__main__":
    plan = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    folder, rank = Path(plan["folder"]), os.environ.get("RANK", "0")
    for run in plan["runs"]:
        code, out, err = run_one(run["args"], run.get("env", {}))
        write_json(folder / f"{run['name']}.rank{rank}.json", {"code": code, "stdout": out, "stderr": err})
        if code != 0:
            sys.exit(code)
