"""converttosdxl.py on a large generated SDXL-topology model: wall time and peak RSS, against
copying the same bytes.

    python bench/bench_convert.py

The model is bench.sdxl_arch.MID_SIZE with random fp32 weights (every SDXL key, about 1.65 GB,
largest tensor 253 MB as in the real SDXL), written to a temporary folder and removed afterwards.
Each command runs in a fresh interpreter; its peak RSS is its own VmHWM. The converter's fixed
overhead is its peak RSS on the built-in tiny SDXL (same imports and code, tensors of kilobytes).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, bench_args, run_measured, write_results
from bench.sdxl_arch import MID_SIZE, write_random_pipeline
from sdxl_trainer.tiny_model import tiny_sdxl_path

COPY = ("import shutil, sys\n"
        "for source, target in zip(sys.argv[1::2], sys.argv[2::2]):\n    shutil.copyfile(source, target)")
# --smoke: the same topology at toy widths (generated like the large model, in a second).
TINY_SIZES = {"unet": {"block_out_channels": (32, 64, 64), "attention_head_dim": (2, 4, 4),
                       "transformer_layers_per_block": (1, 1, 2)},
              "vae": {"block_out_channels": (32, 32, 64, 64)},
              "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "projection_dim": 32},
              "text_encoder_2": {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "projection_dim": 48}}


def convert_args(model: Path, output: Path, half: bool) -> list[str]:
    return [str(ROOT / "converttosdxl.py"), "--model_path", str(model), "--checkpoint_path", str(output),
            "--overwrite", *(["--half"] if half else [])]


def main(argv: list[str] | None = None) -> None:
    args = bench_args(__doc__.splitlines()[0], argv)
    repeats = 1 if args.smoke else 2
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp_name:
        tmp = Path(tmp_name)
        # The built-in tiny SDXL's tensors are kilobytes: its peak is the converter's fixed overhead.
        overhead = max(run_measured(convert_args(tiny_sdxl_path(), tmp / "tiny.safetensors", False))[1]
                       for _ in range(repeats))
        model = tmp / "large"
        sizes = write_random_pipeline(model, TINY_SIZES if args.smoke else MID_SIZE)
        sources = sorted(model.rglob("*.safetensors"))
        copies = [tmp / "copy" / f"{index}.safetensors" for index in range(len(sources))]
        copies[0].parent.mkdir()
        pairs = [str(path) for pair in zip(sources, copies, strict=True) for path in pair]
        commands = {
            "copy the weight files (shutil.copyfile)": ["-c", COPY, *pairs],
            "converttosdxl.py (fp32 out)": convert_args(model, tmp / "out.safetensors", False),
        }
        if not args.smoke:  # (--half is only a flag: the smoke test runs each code path once)
            commands["converttosdxl.py --half (fp16 out)"] = convert_args(model, tmp / "out.safetensors", True)
        best: dict[str, tuple[float, int]] = {}
        for _ in range(repeats):  # interleaved; the first round also warms the page cache for all
            for name, command in commands.items():
                seconds, peak = run_measured(command)
                previous = best.get(name, (float("inf"), 0))
                best[name] = (min(seconds, previous[0]), max(peak, previous[1]))
    largest, total = sizes["largest_tensor_bytes"], sizes["total_bytes"]
    copy_seconds = best["copy the weight files (shutil.copyfile)"][0]
    rows = []
    for name, (seconds, peak) in best.items():
        converter = name.startswith("converttosdxl")
        rows.append({
            "command": name, "seconds": seconds, "vs_copy": seconds / copy_seconds, "MB_per_s": total / seconds / 1e6,
            "peak_rss_MB": peak / 1e6,
            "peak_minus_overhead_MB": (peak - overhead) / 1e6 if converter else None,
            "over_largest": (peak - overhead) / largest if converter else None,
            "in_bound": (peak <= overhead + 2 * largest) if converter else None,
        })
    notes = (
        f"Input: {total / 1e9:.2f} GB of fp32 weights, largest tensor {largest / 1e6:.0f} MB "
        "(bigG's token embedding). Fixed overhead (the converter's peak RSS on the tiny model): "
        f"{overhead / 1e6:.0f} MB. in_bound: peak RSS ≤ fixed overhead + 2 × largest tensor "
        f"= {(overhead + 2 * largest) / 1e6:.0f} MB; over_largest: (peak − overhead) / largest tensor. "
        f"seconds: best of {repeats} interleaved runs, interpreter start included, files in the page cache; "
        "peak_rss_MB: the highest of the runs (VmHWM, read in the process)."
    )
    write_results("convert", rows, notes, args.results_dir,
                  extra={"input_bytes": total, "largest_tensor_bytes": largest, "fixed_overhead_bytes": overhead})


if __name__ == "__main__":
    main()
