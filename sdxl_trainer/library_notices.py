"""Silence two notices the libraries print on import that say nothing about a run.

- transformers, when diffusers imports the IP-Adapter image processors (every SDXL pipeline does):
  "`CLIPImageProcessor` requires torchvision (not installed); falling back to ...". This trainer
  never uses an image processor, and torchvision is not one of its dependencies.
- bitsandbytes, when peft imports it on a CPU with AVX-512 BF16: "Failed to load CPU
  gemm_4bit_forward from kernels-community ...", an optional kernel for 4-bit layers on the CPU,
  which a run of this trainer never computes with.

Each is dropped by a logging filter on the logger that emits it, matched by its own wording, so
every other message of those loggers still shows. No library is imported here: the filters must
be in place before the first import of diffusers or peft.
"""

from __future__ import annotations

import logging

# logger name → words of the one message of it that is dropped (the wording it logs, not its arguments)
SILENCED = {
    "transformers.utils.import_utils": "requires torchvision (not installed); falling back to",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}


class _DropNotice(logging.Filter):
    def __init__(self, wording: str):
        super().__init__()
        self.wording = wording

    def filter(self, record: logging.LogRecord) -> bool:
        return self.wording not in str(record.msg)


def silence_import_notices() -> None:
    """Install the filters (once: a second call adds nothing)."""
    for logger_name, wording in SILENCED.items():
        logger = logging.getLogger(logger_name)
        if not any(isinstance(known, _DropNotice) for known in logger.filters):
            logger.addFilter(_DropNotice(wording))
