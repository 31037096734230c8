"""The structure check `make lint` runs (tools/check_structure.py), on small trees made here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import check_structure

TRAIN = "def train(config):\n    while True:\n        pass\n"


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"train_sdxl.py": TRAIN, "sdxl_trainer/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def problems(root: Path) -> list[str]:
    original = check_structure.ROOT
    check_structure.ROOT = root  # messages name files relative to the checked tree
    try:
        return check_structure.check(root)
    finally:
        check_structure.ROOT = original


def test_the_product_code_passes() -> None:
    assert check_structure.check() == []


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        "sdxl_trainer/a.py": "from .b import thing\n",
        "sdxl_trainer/b.py": "def thing():\n    from . import a\n    return a\n",
        "sdxl_trainer/c.py": "from sdxl_trainer.a import thing\n",
    })
    assert problems(root) == ["import cycle: sdxl_trainer.a -> sdxl_trainer.b -> sdxl_trainer.a"]


def test_the_package_may_not_import_a_top_level_script(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"dataset.py": "X = 1\n", "sdxl_trainer/data.py": "import dataset\n"})
    assert problems(root) == ["sdxl_trainer.data imports the top-level script dataset"]


def test_long_signatures_and_long_functions_are_reported(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(check_structure.MAX_FUNCTION_LINES))
    root = make_tree(tmp_path, {"sdxl_trainer/m.py": (
        "class A:\n    def ok(self, a, b, c, d, e, f, g, h):\n        pass\n\n"
        "def wide(a, b, c, d, e, f, g, *args, **kwargs):\n    pass\n\n"
        f"def long():\n{body}"
    )})
    assert problems(root) == [
        "sdxl_trainer/m.py:5 wide() takes 9 parameters (at most 8: use a dataclass)",
        f"sdxl_trainer/m.py:8 long() is {check_structure.MAX_FUNCTION_LINES + 1} lines long (at most 70)",
    ]


def test_a_long_step_loop_is_reported(tmp_path: Path) -> None:
    loop = "def train(config):\n    while True:\n" + "        pass\n" * 45
    root = make_tree(tmp_path, {"train_sdxl.py": loop})
    assert problems(root) == ["train_sdxl.py train()'s step loop is 46 lines long (at most 40)"]
