"""Shared parts of the SDXL fine-tuner: one module per concern (see DESIGN.md)."""

__version__ = "0.1.0"
