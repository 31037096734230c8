"""The import-time notices of transformers and bitsandbytes that say nothing about a run are
dropped, and only those: other messages of the same loggers still show."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

IMPORTS = "import peft, diffusers.loaders.ip_adapter, logging\n"
OTHER_MESSAGES = (
    "logging.getLogger('transformers.utils.import_utils').warning('an unrelated notice')\n"
    "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('another unrelated notice')\n"
)
NOTICES = ("requires torchvision (not installed); falling back to", "Failed to load CPU gemm_4bit_forward")


def stderr_of(code: str) -> str:
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "warning"}  # the suite's conftest sets "error"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_the_package_drops_the_libraries_import_notices_and_nothing_else() -> None:
    without = stderr_of(IMPORTS)
    shown = [notice for notice in NOTICES if notice in without]
    if not shown:
        pytest.skip("this environment's libraries print neither notice on import")
    with_package = stderr_of("import sdxl_trainer\n" + IMPORTS + OTHER_MESSAGES)
    assert not [notice for notice in shown if notice in with_package], with_package
    assert "an unrelated notice" in with_package and "another unrelated notice" in with_package


def test_installing_twice_adds_no_second_filter() -> None:
    import logging

    from sdxl_trainer.library_notices import SILENCED, silence_import_notices

    silence_import_notices()
    silence_import_notices()
    assert [len(logging.getLogger(name).filters) for name in SILENCED] == [1] * len(SILENCED)
