"""Preemptible jobs: one command (`training.resume_from=latest`) for every start of a job. With no
checkpoint yet it starts a new run and says so; after a checkpoint it resumes; an explicit folder
that does not exist is still refused.

Under `accelerate launch` every process runs `plan_run` on the same files before training and the
decision reads nothing but those files (not the rank), so all processes agree: no multi-process test."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import NO_MEMORY_PLAN, start_train, tiny_config, train_here, write_config
from tests.test_resume import final_weights

pytestmark = pytest.mark.slow  # every test here trains (make test-fast leaves them out)

STEPS, EVERY = 16, 8
FRESH = "yet; starting a new run"


def job_config(tmp_path: Path) -> dict:
    return tiny_config(tmp_path, training={"num_steps": STEPS, "checkpoint_every": EVERY, "log_every": 1})


class Job:
    """`train_sdxl.py --config <path> --set training.resume_from=latest`, the job script's one command."""

    def __init__(self, path: Path, python_options: tuple[str, ...] = (), own_group: bool = False,
                 latest: bool = True, steps: int = STEPS) -> None:
        """A process of its own (see `start_train`); `python_options` go to a fresh interpreter (e.g.
        `-X importtime`); `own_group` starts it in a process group of its own, which a terminal's
        Ctrl-C reaches as a whole (workers included); without `latest`, the plain `--config` command
        of a run of `steps` steps."""
        self.steps = steps
        latest_args = ["--set", "training.resume_from=latest"] if latest else []
        self.process = start_train(["--config", str(path), *latest_args], own_group, python_options)
        self.stdout: list[str] = []
        self.stderr: list[str] = []  # tqdm rewrites its line with \r: read characters, not lines
        self.readers = [threading.Thread(target=self._drain, args=(stream, sink), daemon=True)
                        for stream, sink in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _drain(stream, sink: list[str]) -> None:
        while chunk := stream.read(1):
            sink.append(chunk)

    def wait_for(self, done, what: str, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while not done():
            assert self.process.poll() is None, f"exited before {what}: {''.join(self.stderr)[-3000:]}"
            assert time.time() < deadline, f"no {what} in {timeout} s"
            time.sleep(0.02)

    def steps_done(self) -> int:
        counts = re.findall(rf"\| *(\d+)/{self.steps} ", "".join(self.stderr))
        return int(counts[-1]) if counts else 0

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.finish()

    def finish(self) -> int:
        code = self.process.wait(timeout=600)
        for reader in self.readers:
            reader.join()
        return code


def test_one_command_starts_fresh_restarts_fresh_then_resumes(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    straight = train_here("--config", str(write_config(tmp_path / "straight.json", job_config(tmp_path / "straight"))))
    assert straight.returncode == 0, straight.stderr[-3000:]

    path = write_config(tmp_path / "job.json", job_config(tmp_path / "job"))
    checkpoints = tmp_path / "job" / "out" / "test_run" / "checkpoints"
    for start in range(2):  # the first start, then a restart after a kill -9 before the first checkpoint
        job = Job(path)
        if start == 0:
            job.wait_for(lambda job=job: job.steps_done() >= 1, "first training step")  # mid-run, well before step 8
            job.kill()
            assert not list(checkpoints.glob("checkpoint-*")), "the kill came after the first checkpoint"
        else:
            job.wait_for(lambda: (checkpoints / f"checkpoint-{EVERY}").is_dir(), "first checkpoint")
            job.kill()
        output = "".join(job.stdout)
        assert f"resume: latest: no checkpoint in {checkpoints} {FRESH}" in output, output
        assert "resume: from" not in output

    # The restart after a checkpoint: nothing kills it, so it runs in this process.
    resumed = train_here("--config", str(path), "--set", "training.resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {EVERY} " in resumed.stdout and FRESH not in resumed.stdout, resumed.stdout

    first = final_weights(tmp_path / "straight" / "out" / "test_run")
    second = final_weights(tmp_path / "job" / "out" / "test_run")
    assert first.keys() == second.keys() and len(first) > 10
    assert [key for key in first if not torch.equal(first[key], second[key])] == []


def test_latest_with_no_checkpoint_is_a_fresh_plan_and_a_missing_folder_stays_an_error(tmp_path: Path,
                                                                                     tiny_sdxl_dir: Path) -> None:
    path = write_config(tmp_path / "c.json", tiny_config(tmp_path))
    dry = train_here("--config", str(path), "--set", "training.resume_from=latest", "--dry-run", *NO_MEMORY_PLAN)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"resume: latest: no checkpoint in {tmp_path / 'out' / 'test_run' / 'checkpoints'} {FRESH}" in dry.stdout

    missing = tmp_path / "out" / "test_run" / "checkpoints" / "checkpoint-5"
    refused = train_here("--config", str(path), "--set", f"training.resume_from={missing}", "--dry-run")
    assert refused.returncode == 2
    assert f"training.resume_from = {str(missing)!r}: no such folder" in refused.stderr
