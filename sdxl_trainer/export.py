"""What a run exports once training is over (`export.*`): the adapter files of
`export.adapter_formats`, and one single-file SDXL checkpoint for ComfyUI and A1111.

Adapter runs write `pytorch_lora_weights.safetensors` (diffusers/peft) and
`<run.name>_kohya.safetensors` (kohya/LyCORIS). The single file holds the trained model: the
output folder of a full fine-tune, or the base with the adapter merged (`export.merge_adapter`);
over a quantized base (`model.base_quantization`) that base is re-read in full precision first.
An adapter run without merging writes no single file: its base model is unchanged, and the
adapter files are what it produced.
"""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .adapters import save_diffusers_adapter
from .atomic import reported_write_failures
from .config import Config, ConfigError
from .finite import check_finite
from .formats import converter
from .formats.kohya_format import adapter_layers, save_kohya_adapter
from .models import with_components

if TYPE_CHECKING:
    import torch
    from diffusers import StableDiffusionXLPipeline

    from .training_setup import Trainable

OWN_CONVERTER = Path(__file__).resolve().parent.parent / "converttosdxl.py"
STDERR_TAIL_CHARS = 3000


class ExportError(RuntimeError):
    """A single-file export failed; the message says which converter and why."""


def check_export(config: Config) -> None:
    """Export settings that would fail at the end of the run, found before it starts."""
    export = config.export
    if not export.save_single_file:
        return
    if config.checkpoint_path.is_dir():
        raise ConfigError(f"export.checkpoint_path = {str(config.checkpoint_path)!r}: is a folder, not a file")
    script = Path(export.converter_script)
    if is_own_converter(script):
        if export.extra_args:
            raise ConfigError(
                "export.extra_args: the built-in converter takes none; they are for an external "
                "export.converter_script"
            )
    elif not script.is_file():
        raise ConfigError(
            f"export.converter_script = {export.converter_script!r}: no such file (relative paths start "
            "in the current folder)"
        )


def is_own_converter(script: Path) -> bool:
    """Whether `script` is this project's converttosdxl.py, whose logic (`converter`) runs in-process
    rather than as a subprocess."""
    return script.resolve() == OWN_CONVERTER


def export_after_training(config: Config, pipe: StableDiffusionXLPipeline, trainable: Trainable) -> list[Path]:
    """Write the export files of a finished run and return their paths.

    Call it once, after the final weights are saved (a full fine-tune converts the pipeline
    folder in `output_dir`). The training modules are left as they are.
    """
    from .embeddings import plain_embeddings, save_embedding_files

    check_export(config)
    check_finite(trainable)
    written = save_adapter_files(config, trainable) if trainable.is_adapter and trainable.modules else []
    if trainable.tokens:
        files = save_embedding_files(trainable.tokens, config.output_dir)
        print(f"export: new token embeddings {', '.join(str(path) for path in files)}")
        written += files
    if config.export.save_single_file and not trainable.modules and trainable.is_adapter:
        print("export: no single file, because textual inversion alone leaves the model unchanged; load the "
              "embedding file with the base model")
    elif config.export.save_single_file:
        if not trainable.is_adapter:
            written.append(convert(config, config.output_dir))
        elif config.export.merge_adapter:
            # The merged file holds the base vocabulary: new tokens go in the embedding files.
            with (tempfile.TemporaryDirectory(prefix=".merged-", dir=config.output_dir) as tmp,
                  plain_embeddings(pipe, trainable.tokens)):
                folder = Path(tmp) / config.run.name  # converters title the file after the folder
                if config.model.base_quantization == "none":
                    save_merged_pipeline(pipe, trainable.modules, folder)
                else:
                    from .quantized_base import full_precision_pipeline

                    save_merged_pipeline(*full_precision_pipeline(config, pipe, trainable.modules), folder)
                written.append(convert(config, folder))
        else:
            print("export: no single file, because export.merge_adapter is false and the base model is "
                  "unchanged; load the adapter file on top of the base instead")
    return written


def save_adapter_files(config: Config, trainable: Trainable) -> list[Path]:
    """The adapter in each of `export.adapter_formats`, in `output_dir`."""
    written = []
    for adapter_format in config.export.adapter_formats:
        if adapter_format == "diffusers":
            written.append(save_diffusers_adapter(config.output_dir, trainable.modules))
        else:
            destination = config.output_dir / f"{config.run.name}_kohya.safetensors"
            metadata = {"modelspec.title": config.run.name}
            written.append(save_kohya_adapter(destination, trainable.modules, metadata))
        print(f"export: {adapter_format} adapter {written[-1]}")
    return written


def save_merged_pipeline(pipe: StableDiffusionXLPipeline, trained: dict[str, torch.nn.Module], folder: Path) -> None:
    """Save `pipe` as a diffusers folder with the `trained` components, their adapters merged."""
    merged = {name: merged_copy(module) for name, module in trained.items()}
    with reported_write_failures(folder):
        with_components(pipe, **merged).save_pretrained(folder, safe_serialization=True)


def merged_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A CPU copy of `module` with its peft adapter merged into the base weights and the adapter
    layers removed, as peft's `merge_and_unload` does for a PeftModel; `module` is unchanged.

    The copy is built tensor by tensor on the CPU, so the accelerator never holds the model twice,
    and in fp32, so a base stored in fp16/bf16 is merged (DoRA norms included) without overflow.
    """
    import torch

    on_cpu: dict[int, object] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
        data = tensor.detach().to("cpu", dtype, copy=True)
        is_parameter = isinstance(tensor, torch.nn.Parameter)
        on_cpu[id(tensor)] = torch.nn.Parameter(data, requires_grad=False) if is_parameter else data
    merged = copy.deepcopy(module, on_cpu)
    remove_adapter(merged, merge=True)
    return merged


def remove_adapter(module: torch.nn.Module, merge: bool) -> None:
    """Put every peft adapter layer of `module` back to its base layer, merged into it or not, and
    forget the adapter config, as peft's `merge_and_unload` / `unload` do for a PeftModel."""
    for name, layer in adapter_layers(module):
        if merge:
            layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, layer.get_base_layer())
    # Without an adapter config, save_pretrained writes the whole model (transformers would
    # otherwise write only the adapter).
    del module.peft_config
    module._hf_peft_config_loaded = False


def convert(config: Config, model_path: Path) -> Path:
    """Convert the diffusers folder `model_path` to `config.checkpoint_path` with
    `export.converter_script`: this project's converter in-process, any other script as a
    subprocess with diffusers' command line (`--model_path`, `--checkpoint_path`, `--half`,
    `--use_safetensors`, then `export.extra_args`)."""
    export, destination = config.export, config.checkpoint_path
    script = Path(export.converter_script)
    if is_own_converter(script):
        try:
            return converter.convert(model_path, destination, half=export.half_precision, overwrite=True)
        except converter.ConversionError as error:
            raise ExportError(f"single-file export failed: {error}") from error
    command = [sys.executable, str(script), "--model_path", str(model_path), "--checkpoint_path", str(destination)]
    if export.half_precision:
        command.append("--half")
    if export.use_safetensors:
        command.append("--use_safetensors")
    command += export.extra_args
    destination.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False)
    print(result.stderr, end="", file=sys.stderr)
    if result.returncode != 0:
        raise ExportError(
            f"export.converter_script {script} failed with exit code {result.returncode}; the end of its "
            f"error output:\n{result.stderr[-STDERR_TAIL_CHARS:]}"
        )
    if not destination.is_file():
        raise ExportError(f"export.converter_script {script} succeeded but wrote no {destination}")
    print(f"export: single file {destination}")
    return destination
