"""docs/design.md's module map names every module and sub-package of sdxl_trainer, and nothing
that is not there: the map a newcomer reads is the tree they find."""

from __future__ import annotations

import re

from tests.helpers import ROOT

PACKAGE = ROOT / "sdxl_trainer"


def modules_in_tree() -> set[str]:
    """Every module as the map writes it: `run.py`, and `eval/evaluator.py` inside a sub-package."""
    return {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
            if path.name != "__init__.py" and "__pycache__" not in path.parts}


def modules_in_map() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    package_part = section.split("`sdxl_trainer/`", 1)[1]
    named = set()
    for row in package_part.splitlines():
        if not row.startswith("|"):
            continue
        folder = ""
        for name in re.findall(r"`([\w/]+(?:\.py)?)`", row):
            if name.endswith("/"):
                folder = name
            elif name.endswith(".py") and not (ROOT / name).is_file():  # top-level scripts are named too
                named.add(name if "/" in name else folder + name)
    return named


def test_the_design_module_map_matches_the_package() -> None:
    tree, mapped = modules_in_tree(), modules_in_map()
    assert sorted(tree - mapped) == [], "modules missing from docs/design.md's module map"
    assert sorted(mapped - tree) == [], "docs/design.md's module map names modules that do not exist"
