"""How much one run of the learning benchmark says: the quickstart at several seeds.

    python bench/bench_seeds.py                                   # seeds 42-46: about 15 minutes on 2 CPU cores
    python bench/bench_seeds.py --set training.min_timestep=400   # a change, over the same seeds
    python bench/bench_seeds.py --config configs/quickstart_prior_preservation.json   # another recipe
    python bench/bench_seeds.py --smoke                           # seconds: checks the code path only

Every row of bench/bench_learning.py is one run at one seed, and the quickstart's crosses move by
several of 16 from one seed to the next. Before calling a change to the recipe better, run it here
beside the quickstart: each seed trains the quickstart (its config, or `--config`, with the `--set`
overrides, JSON values) and evaluates it once at the end; the table gives each seed's concept and
prior accuracy, then their mean, lowest and highest.

Writes bench/results/seeds.{json,md}; with `--set`, seeds_changed.{json,md} (so the quickstart's own
table stays); with `--config`, seeds_<config's name>; --smoke: seeds_smoke.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_learning import smoke_prompts, train
from bench.common import QUICKSTART, bench_args, write_results

SEEDS = [42, 43, 44, 45, 46]
GROUPS = ("concept", "prior")


def override(text: str) -> tuple[str, Any]:
    """One `--set KEY=VALUE`, the value read as JSON."""
    key, sep, value = text.partition("=")
    try:
        if not sep or not key:
            raise ValueError
        return key, json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--set {text!r}: give KEY=VALUE with a JSON value, "
                                         'e.g. training.min_timestep=400 or eval.sampler_name="euler"') from None


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=SEEDS, help=f"training seeds (default {SEEDS})")
    parser.add_argument("--config", type=Path, default=QUICKSTART,
                        help="the recipe to train (default: the quickstart's, configs/quickstart.json)")
    parser.add_argument("--set", type=override, action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The mean, lowest and highest of each group's accuracy over the seeds' rows."""
    return [{"seed": name, **{group: reduce([row[group] for row in rows]) for group in GROUPS}}
            for name, reduce in (("mean", statistics.fmean), ("lowest", min), ("highest", max))]


def main(argv: list[str] | None = None) -> None:
    args = bench_args(__doc__.splitlines()[0], argv, extra=options)
    seeds = args.seeds[:2] if args.smoke else args.seeds
    overrides = dict(args.set)
    config = args.config.resolve()
    config_steps = json.loads(config.read_text(encoding="utf-8"))["training"]["num_steps"]
    steps = 4 if args.smoke else overrides.get("training.num_steps", config_steps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        smoke = {"training.num_steps": steps, "eval.num_inference_steps": 1,
                 "eval.prompts_path": str(smoke_prompts(work))} if args.smoke else {}
        for seed in seeds:
            settings = {**overrides, "training.seed": seed, "eval.live.enabled": False, **smoke}
            final = next(entry for entry in train(f"seed {seed}", settings, work, steps, args.smoke, config)["evals"]
                         if entry["tag"] == "final")
            rows.append({"seed": seed, **{group: final["accuracy"][group]["all"] for group in GROUPS}})
            print(f"seed {seed}: {rows[-1]}", flush=True)
    changed = ", ".join(f"{key}={json.dumps(value)}" for key, value in args.set)
    prompts = "first prompt of each group" if args.smoke else "16 concept and 32 prior prompts"
    recipe = "The quickstart" if config == QUICKSTART else f"`{args.config.as_posix()}`"
    notes = (f"{recipe} ({steps} steps) at each seed, " + (f"with {changed}" if changed else "as it is")
             + f"; accuracy at the end over its {prompts} (the shapes judge).")
    name = ("seeds_smoke" if args.smoke else "seeds_changed" if args.set
            else "seeds" if config == QUICKSTART else f"seeds_{config.stem}")
    write_results(name, rows + summary(rows), notes, args.results_dir)


if __name__ == "__main__":
    main()
