"""The base model's weights (--base_model), looked up per adapter module: the norm checks and most
DoRA repairs need the weight W that a module adapts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..formats.adapter_files import KOHYA, AdapterFile, AdapterModule, find_layer, kohya_name_map

if TYPE_CHECKING:
    import torch


class BaseWeights:
    """A loaded base model, asked for the weight of one adapter module at a time.

    Loading raises what `models.load_pipeline` raises (ConfigError, OSError, ValueError) for a
    model that cannot be loaded.
    """

    def __init__(self, model_id: str, config_dir: str | None = None) -> None:
        from ..config import ModelConfig
        from ..models import load_pipeline

        self.model_id = model_id
        self.pipe = load_pipeline(ModelConfig(id=model_id, config_dir=config_dir))
        self._kohya_names: dict[str, tuple[str, str]] | None = None

    def open(self, path: Path) -> AdapterFile:
        """The adapter file, with kohya module names resolved through this model's layers."""
        adapter = AdapterFile(path)
        if adapter.format == KOHYA:
            if self._kohya_names is None:
                self._kohya_names = kohya_name_map(self.pipe)
            adapter.name_map = self._kohya_names
        return adapter

    def weight(self, module: AdapterModule) -> torch.Tensor | None:
        """W of the layer `module` adapts; None when the model has no such layer."""
        layer = find_layer(self.pipe, module)
        return None if layer is None or not hasattr(layer, "weight") else layer.weight.detach()


def open_adapter(path: Path, base: BaseWeights | None) -> AdapterFile:
    """The adapter file, read through the base model where there is one (kohya names resolved)."""
    return base.open(path) if base else AdapterFile(path)
