"""Shared parts of the SDXL fine-tuner: one module per concern (docs/design.md, 'Module map')."""

from .library_notices import silence_import_notices

__version__ = "0.1.0"

silence_import_notices()
