"""Fine-tune Stable Diffusion XL from one JSON config.

    python train_sdxl.py                        # reads ./config.json
    python train_sdxl.py --config configs/quickstart.json --set training.num_steps=20

The run goes: validate the config → plan the data → load SDXL → attach adapters (DoRA/LoRA) or
unfreeze weights (full fine-tune) → train → save outputs (see docs/exports.md, "Outputs"). `train()` below
is the whole training loop; the pieces it calls are in `sdxl_trainer/run.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from sdxl_trainer.stop_request import EXIT_INTERRUPTED, StartupStop  # first: it handles Ctrl-C from here on

if TYPE_CHECKING:
    from sdxl_trainer.config import Config
    from sdxl_trainer.planning import RunPlan

EXIT_OK, EXIT_USAGE = 0, 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_sdxl.py", description="Fine-tune SDXL (DoRA, LoRA or full) from a JSON config."
    )
    parser.add_argument("--config", default="config.json", help="config file (default: ./config.json)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set training.num_steps=20 (repeatable; JSON values)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan; load no weights")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command line; a Ctrl-C or SIGTERM before the first step (imports included: the package is
    imported here, once the handler is in place) is one line and exit 130."""
    startup = StartupStop()
    try:
        return run_command(parse_args(argv))
    except BaseException:
        if startup.signal is None:
            raise
        print(f"\n{startup.signal}: interrupted before training started; nothing was trained", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        startup.restore()


def run_command(args: argparse.Namespace) -> int:
    from sdxl_trainer.checkpointing import RunComplete
    from sdxl_trainer.config import ConfigError, load_config
    from sdxl_trainer.planning import check_inputs, plan_run

    try:
        config = load_config(args.config, args.set)
        if args.print_config:
            print(json.dumps(config.resolved(), indent=2))
            return EXIT_OK
        check_inputs(config)
        plan = plan_run(config)
        from sdxl_trainer.memory.preflight import memory_preflight  # torch: not on the --help path

        plan.memory, memory_lines = memory_preflight(config, plan, args.dry_run)
        plan.preflight += memory_lines and f"\n{memory_lines}"
        plan.command = ["--config", args.config, *[part for item in args.set for part in ("--set", item)]]
        if os.environ.get("RANK", "0") == "0":  # one report, however many processes `accelerate launch` starts
            print(plan.preflight)
        return EXIT_OK if args.dry_run else train(config, plan)
    except RunComplete as exc:  # said in the pre-flight, unless it completed after that
        if os.environ.get("RANK", "0") == "0" and str(exc) not in plan.preflight:
            print(exc)
        return EXIT_OK
    except ConfigError as exc:  # also what loading the model finds wrong with it
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def train(config: Config, plan: RunPlan) -> int:
    """The training loop: micro-batches until the planned number of optimizer steps is done."""
    from sdxl_trainer.atomic import OutputWriteError
    from sdxl_trainer.finite import NonFiniteWeightsError
    from sdxl_trainer.nan_guard import ABORT, SKIP
    from sdxl_trainer.notify import notify_error
    from sdxl_trainer.run import (
        EXIT_FAILED,
        after_step,
        checkpoint_due,
        end_epoch,
        epoch_batches,
        finish,
        forward_backward,
        interrupt,
        optimizer_step,
        save_checkpoint,
        save_outputs,
        start_run,
    )

    try:
        run = start_run(config, plan)
    except OutputWriteError as exc:  # a full disk while the caches are built: nothing was trained yet
        print(f"error: {exc}", file=sys.stderr)
        notify_error(config, exc)
        return EXIT_FAILED
    except Exception as exc:
        notify_error(config, exc)
        raise
    try:
        while run.position.step < run.total_steps:
            for batch in epoch_batches(run):
                forward_backward(run, batch)
                if not run.accelerator.sync_gradients:
                    continue  # gradients add up over training.grad_accum_steps micro-batches
                result = optimizer_step(run)
                if result.verdict == ABORT:
                    return finish(run, "aborted: non-finite loss or gradients", EXIT_FAILED)
                if result.verdict != SKIP:
                    after_step(run, result)
                if run.stop.agreed(run.accelerator):
                    return interrupt(run)
                if result.verdict != SKIP and checkpoint_due(run):
                    save_checkpoint(run)
                if run.position.step >= run.total_steps:
                    break
            else:
                end_epoch(run)
                if not run.tally.batch_paths and run.stop.agreed(run.accelerator):  # no half-accumulated step
                    return interrupt(run)
        return save_outputs(run)
    except NonFiniteWeightsError as exc:
        run.accelerator.print(f"error: {exc}; training stopped; they were not saved", file=sys.stderr)
        return finish(run, "aborted: non-finite weights", EXIT_FAILED)
    except OutputWriteError as exc:
        print(f"error: {exc}; earlier checkpoints are intact", file=sys.stderr)
        return finish(run, "failed: could not write the outputs", EXIT_FAILED)
    except Exception as exc:  # unexpected: the trackers' runs end as failed, run.notify hears of it
        try:
            if run.writer:
                run.writer.close(EXIT_FAILED)
        finally:
            notify_error(config, exc)
        raise
    finally:
        run.progress.close()
        if run.memory:
            run.memory.stop()
        run.stop.restore()


if __name__ == "__main__":
    sys.exit(main())
