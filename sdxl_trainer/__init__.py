"""Shared parts of the SDXL fine-tuner: one module per concern (docs/design.md, 'Module map')."""

__version__ = "0.1.0"
