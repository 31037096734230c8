"""Helpers for the benchmarks: timing and writing results as JSON plus a markdown table."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdxl_trainer.atomic import write_json, write_text

RESULTS = Path(__file__).resolve().parent / "results"


def best_of(function: Callable[[], Any], repeats: int = 3) -> float:
    """The fastest of `repeats` wall-clock runs, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_results(name: str, rows: list[dict[str, Any]], notes: str = "") -> Path:
    """bench/results/<name>.json and <name>.md: one row per measurement."""
    data = {"benchmark": name, "machine": machine(), "rows": rows, "notes": notes}
    write_json(RESULTS / f"{name}.json", data)
    columns = list(rows[0])
    lines = [f"### {name}", "", f"Machine: {data['machine']['cpu_count']} CPU cores, torch {data['machine']['torch']}"
             + (f", {data['machine']['cuda']}" if data["machine"]["cuda"] else ""), ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    if notes:
        lines += ["", notes]
    write_text(RESULTS / f"{name}.md", "\n".join(lines) + "\n")
    print(json.dumps(data, indent=2))
    return RESULTS / f"{name}.md"


def _cell(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
