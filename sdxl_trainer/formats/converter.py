"""Convert a diffusers SDXL pipeline folder into one single-file SDXL checkpoint (.safetensors):
the logic behind converttosdxl.py and the single-file export after training.

The output uses Stability's "sgm" layout (docs/formats.md, "Single-file checkpoints (SGM keys)"),
which ComfyUI, A1111-family UIs and diffusers' `from_single_file` load. Weights are read tensor by
tensor and the file is written as a stream, so memory stays near the largest single tensor plus a
bounded read window (about 1.1 GB peak for full-size SDXL). Nothing is written unless every
tensor is finite (see `allow_nonfinite`), and the file only appears, complete and verified, at
the very end.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .sgm_keys import COMPONENTS, FLOAT_DTYPES, KeyMapError, PlanEntry, TensorInfo, build_plan, build_tensor

if TYPE_CHECKING:
    import torch

    from .safetensors_stream import StreamWriter
    from .tensor_reader import TensorReader

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
    from ..atomic import atomic_path
    from .safetensors_stream import StreamWriter, TensorSpec
    from .tensor_reader import TensorReader

    readers = {name: TensorReader(files, ConversionError) for name, files in weight_files.items()}
    infos = {name: {key: TensorInfo(reader.shapes[key], reader.dtypes[key]) for key in reader.keys}
             for name, reader in readers.items()}
    try:
        plan = build_plan(
            infos,
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
            problems = _write_all(plan, readers, writer, stop_writing_on_problem=not allow_nonfinite)
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


def _write_all(
    plan: list[PlanEntry],
    readers: dict[str, TensorReader],
    writer: StreamWriter,
    stop_writing_on_problem: bool,
) -> list[str]:
    """Build and write every tensor in plan order; return one line per non-finite tensor.

    After the first problem (unless non-finite tensors are allowed) nothing more is written, but
    every tensor is still checked, so the user sees the whole list at once.
    """
    problems: list[str] = []
    reading = None
    for entry in plan:
        if reading and entry.component != reading:
            # The plan reads one component after the other: unmapping the finished one's files keeps
            # one read window for the whole pipeline (see tensor_reader).
            readers[reading].close()
        reading = entry.component
        sources = [readers[reading].get(key) for key in entry.sources] if reading else []
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


