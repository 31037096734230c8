"""Convert a diffusers SDXL pipeline folder into one single-file SDXL checkpoint (.safetensors).

The output uses Stability's "sgm" layout, which ComfyUI, A1111-family UIs and diffusers'
`from_single_file` load. The command line is that of diffusers' own
`scripts/convert_diffusers_to_original_sdxl.py`, so existing configs and habits keep working:

    python converttosdxl.py --model_path <diffusers folder> --checkpoint_path <out.safetensors> [--half]

Weights are read tensor by tensor and the file is written as a stream, so memory stays near the
largest single tensor plus a bounded read window (about 1.1 GB peak for full-size SDXL).
Nothing is written unless every tensor is finite (see --allow-nonfinite), and the file only
appears, complete and verified, at the very end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdxl_trainer.sgm_keys import COMPONENTS, FLOAT_DTYPES, KeyMapError, PlanEntry, TensorInfo, build_plan

if TYPE_CHECKING:
    import torch

    from sdxl_trainer.safetensors_stream import StreamWriter

# diffusers names model weights differently from transformers.
WEIGHT_STEMS = {
    "unet": "diffusion_pytorch_model",
    "vae": "diffusion_pytorch_model",
    "text_encoder": "model",
    "text_encoder_2": "model",
}
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth")


class ConversionError(Exception):
    """A problem with the input or the destination, reported as a message rather than a traceback."""

    exit_code = 2


class NonFiniteError(ConversionError):
    """Some weights are NaN/Inf (or overflow float16); writing them would produce black images."""

    exit_code = 1


def convert(
    model_path: str | Path,
    checkpoint_path: str | Path,
    half: bool = False,
    overwrite: bool = False,
    allow_nonfinite: bool = False,
) -> Path:
    """Write the single-file checkpoint for the pipeline folder `model_path`; return its path.

    Raises ConversionError (missing folder or component, pickle-only weights, existing output
    without `overwrite`, weights that do not fit SDXL) or NonFiniteError; in every failure case
    no output file is left behind.
    """
    start = time.perf_counter()
    model_path, checkpoint_path = Path(model_path), Path(checkpoint_path)
    weight_files = _check_inputs(model_path, checkpoint_path, overwrite)
    configs = {name: _read_json(model_path / name / "config.json") for name in ("unet", "vae")}
    scheduler = _read_json(model_path / "scheduler" / "scheduler_config.json", required=False)
    v_prediction, zero_snr = _prediction(scheduler, model_path)

    # Heavy imports only now, so that --help and usage errors stay instant.
    from sdxl_trainer.atomic import atomic_path
    from sdxl_trainer.safetensors_stream import StreamWriter, TensorSpec

    reader = _WeightReader(model_path, weight_files)
    try:
        plan = build_plan(
            reader.infos,
            configs["unet"],
            configs["vae"],
            half=half,
            v_prediction=v_prediction,
            zero_terminal_snr=zero_snr,
        )
    except KeyMapError as error:
        raise ConversionError(f"{model_path}: {error}") from error
    metadata = _metadata(model_path, v_prediction)
    specs = [TensorSpec(entry.key, entry.dtype, entry.shape) for entry in plan]

    with atomic_path(checkpoint_path) as tmp:
        with open(tmp, "wb") as handle, StreamWriter(handle, specs, metadata) as writer:
            problems = _write_all(plan, reader, writer, stop_writing_on_problem=not allow_nonfinite)
            if problems and not allow_nonfinite:
                listing = "\n".join(f"  {line}" for line in problems)
                raise NonFiniteError(
                    f"refusing to write {checkpoint_path}: {len(problems)} tensor(s) are not finite:\n"
                    f"{listing}\nNothing was written. Pass --allow-nonfinite to write them anyway."
                )
        _verify(tmp, plan, metadata)

    for line in problems:
        print(f"warning: written although not finite: {line}", file=sys.stderr)
    _print_summary(checkpoint_path, plan, time.perf_counter() - start)
    return checkpoint_path


def _check_inputs(model_path: Path, checkpoint_path: Path, overwrite: bool) -> dict[str, list[Path]]:
    """Usage checks that need no heavy imports; returns each component's weight files."""
    if not model_path.is_dir():
        raise ConversionError(f"{model_path}: no such folder (expected a diffusers SDXL pipeline folder)")
    if checkpoint_path.is_dir():
        raise ConversionError(f"{checkpoint_path}: is a folder; give the .safetensors file to write")
    if checkpoint_path.exists() and not overwrite:
        raise ConversionError(f"{checkpoint_path}: already exists; pass --overwrite to replace it")
    weight_files = {}
    for name in COMPONENTS:
        folder = model_path / name
        if not folder.is_dir():
            raise ConversionError(f"{folder}: missing; an SDXL pipeline folder has {', '.join(COMPONENTS)}")
        weight_files[name] = _weight_files(folder, WEIGHT_STEMS[name])
    return weight_files


def _weight_files(folder: Path, stem: str) -> list[Path]:
    """The safetensors file, or the shards named by its index. Pickle files are refused: loading
    one (torch.load) can run arbitrary code from the file."""
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index}: has no weight_map")
        shards = []
        for name in sorted(set(weight_map.values())):
            shard = folder / name
            if Path(name).name != name or not shard.is_file():
                raise ConversionError(f"{index}: shard {name!r} is not a file in {folder}")
            shards.append(shard)
        return shards
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ConversionError(
            f"{folder}: only pickle weights ({', '.join(pickles)}); they are not loaded because unpickling "
            "can run arbitrary code. Re-save the model with save_pretrained(safe_serialization=True)"
        )
    raise ConversionError(f"{folder}: no {stem}.safetensors or {stem}.safetensors.index.json")


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConversionError(f"{path}: missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path}: not readable JSON ({error})") from error
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return data


def _prediction(scheduler: dict[str, Any], model_path: Path) -> tuple[bool, bool]:
    """(v_prediction, zero_terminal_snr) from the scheduler config. A single file can only say
    "epsilon" (nothing) or "v" (ComfyUI's v_pred marker), so anything else is refused."""
    if not scheduler:
        print(
            f"warning: {model_path / 'scheduler'} has no scheduler_config.json; assuming epsilon prediction",
            file=sys.stderr,
        )
    prediction_type = scheduler.get("prediction_type", "epsilon")
    if prediction_type not in ("epsilon", "v_prediction"):
        raise ConversionError(
            f"{model_path}: prediction_type {prediction_type!r} cannot be expressed in a single file"
        )
    v_prediction = prediction_type == "v_prediction"
    return v_prediction, v_prediction and bool(scheduler.get("rescale_betas_zero_snr", False))


class _WeightReader:
    """The tensors of all components, read one at a time from their safetensors files.

    safe_open maps a whole file into memory, and every page read stays in the process's resident
    set until the mapping is closed: reading all of SDXL through open handles would show ~14 GB
    resident. So all files are closed after every REOPEN_BYTES read (and re-opened on demand),
    which keeps the resident set near one tensor plus REOPEN_BYTES.
    """

    REOPEN_BYTES = 64 << 20  # measured (bench/bench_convert.py): 512 MiB kept ~3x the largest tensor resident

    def __init__(self, model_path: Path, weight_files: dict[str, list[Path]]) -> None:
        self.infos: dict[str, dict[str, TensorInfo]] = {}
        self._file_of: dict[tuple[str, str], Path] = {}
        self._handles: dict[Path, Any] = {}
        self._bytes_read = 0
        for component, files in weight_files.items():
            infos = self.infos[component] = {}
            for path in files:
                handle = self._handle(path)
                for key in handle.keys():  # noqa: SIM118 (safe_open handles are not dicts)
                    if key in infos:
                        raise ConversionError(f"{model_path / component}: {key} is stored in more than one shard")
                    tensor_slice = handle.get_slice(key)
                    infos[key] = TensorInfo(tuple(tensor_slice.get_shape()), tensor_slice.get_dtype())
                    self._file_of[component, key] = path
        self._handles.clear()

    def tensor(self, component: str, key: str) -> torch.Tensor:
        tensor = self._handle(self._file_of[component, key]).get_tensor(key)  # a copy, not a view
        self._bytes_read += tensor.nbytes
        if self._bytes_read >= self.REOPEN_BYTES:
            self._handles.clear()  # unmaps the files; the next reads open them again
            self._bytes_read = 0
        return tensor

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (OSError, SafetensorError) as error:
                raise ConversionError(f"{path}: not a readable safetensors file ({error})") from error
        return self._handles[path]


def _write_all(
    plan: list[PlanEntry],
    reader: _WeightReader,
    writer: StreamWriter,
    stop_writing_on_problem: bool,
) -> list[str]:
    """Build and write every tensor in plan order; return one line per non-finite tensor.

    After the first problem (unless non-finite tensors are allowed) nothing more is written, but
    every tensor is still checked, so the user sees the whole list at once.
    """
    from sdxl_trainer.sgm_keys import build_tensor

    problems: list[str] = []
    for entry in plan:
        sources = [reader.tensor(entry.component, key) for key in entry.sources] if entry.component else []
        tensor = build_tensor(entry, sources)
        problem = _nonfinite_problem(entry, sources, tensor)
        if problem:
            problems.append(problem)
        if not (problems and stop_writing_on_problem):
            writer.write(tensor)
    return problems


def _nonfinite_problem(entry: PlanEntry, sources: list[torch.Tensor], tensor: torch.Tensor) -> str | None:
    """Name the source tensors that hold NaN/Inf, or say the cast to the file dtype overflowed."""
    import torch

    # NaN propagates through min and max, and an infinity is the min or the max: checking those two
    # values is exact and, unlike isfinite(tensor), allocates no tensor-sized mask.
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    if bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all()):
        return None
    where = f"(written as {entry.key})"
    bad = []
    for key, source in zip(entry.sources, sources, strict=True):
        count = int((~torch.isfinite(source)).sum()) if source.is_floating_point() else 0
        if count:
            bad.append(f"{entry.component}/{key}: {count} of {source.numel()} values are NaN/Inf")
    if bad:
        return f"{'; '.join(bad)} {where}"
    names = ", ".join(f"{entry.component}/{key}" for key in entry.sources)
    count = int((~torch.isfinite(tensor)).sum())
    return f"{names}: {count} values overflow {tensor.dtype} {where}"


def _metadata(model_path: Path, v_prediction: bool) -> dict[str, str]:
    """modelspec metadata as ComfyUI and kohya write it (no loader needs it; UIs show it)."""
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "stable-diffusion-xl-v1-base",
        "modelspec.implementation": "sgm",
        "modelspec.title": model_path.resolve().name,
        "modelspec.date": datetime.datetime.now().isoformat(timespec="seconds"),
        "modelspec.prediction_type": "v" if v_prediction else "epsilon",
    }


def _verify(path: Path, plan: list[PlanEntry], metadata: dict[str, str]) -> None:
    """Re-open the written file with the real safetensors reader: same keys, shapes, dtypes and
    metadata as planned. Runs before the file is renamed into place."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        written = {
            key: (tuple(handle.get_slice(key).get_shape()), handle.get_slice(key).get_dtype())
            for key in handle.keys()  # noqa: SIM118 (safe_open handles are not dicts)
        }
        written_metadata = handle.metadata()
    planned = {entry.key: (entry.shape, entry.dtype) for entry in plan}
    if written != planned or written_metadata != metadata:
        raise RuntimeError(f"{path}: the written file does not match the plan (a converter bug)")


def _print_summary(path: Path, plan: list[PlanEntry], seconds: float) -> None:
    float_dtypes = sorted({entry.dtype for entry in plan if entry.component} & FLOAT_DTYPES)
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    size_gb = path.stat().st_size / 1e9
    print(
        f"Wrote {path}: {len(plan)} tensors, {size_gb:.3f} GB, "
        f"{'+'.join(names[d] for d in float_dtypes)}, {seconds:.1f} s"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert a diffusers SDXL pipeline folder to a single-file SDXL checkpoint "
        "(ComfyUI / A1111 / from_single_file)."
    )
    parser.add_argument("--model_path", required=True, help="the diffusers pipeline folder to convert")
    parser.add_argument("--checkpoint_path", required=True, help="the .safetensors file to write")
    parser.add_argument("--half", action="store_true", help="store floating-point weights as float16")
    parser.add_argument(
        "--use_safetensors",
        action="store_true",
        help="accepted for compatibility with diffusers' script; the output is always safetensors",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint_path")
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="write the file even if some weights are NaN/Inf (they are listed as warnings)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (0 ok, 1 non-finite weights, 2 usage)."""
    args = _parser().parse_args(argv)
    if args.checkpoint_path.lower().endswith(".ckpt"):
        print(
            f"warning: {args.checkpoint_path} will be a safetensors file despite its .ckpt name; "
            "tools that pick the format from the name will try to unpickle it",
            file=sys.stderr,
        )
    try:
        convert(
            args.model_path,
            args.checkpoint_path,
            half=args.half,
            overwrite=args.overwrite,
            allow_nonfinite=args.allow_nonfinite,
        )
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
