"""The oldest Python the project says it runs on is one that every requirement installs on: with
3.10 as the floor, `make quickstart` on a 3.10 system created the venv, installed torch and then
failed on diffusers 0.42, which needs 3.11."""

from __future__ import annotations

import importlib.metadata
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.helpers import ROOT


def project_floor() -> Version:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["requires-python"]
    assert spec.startswith(">=")
    return Version(spec.removeprefix(">="))


def requirement_names() -> list[str]:
    lines = (line.split("#")[0].strip() for path in sorted(ROOT.glob("requirements*.txt"))
             for line in path.read_text(encoding="utf-8").splitlines())
    return [Requirement(line).name for line in lines if line and not line.startswith("-")]


def test_every_installed_requirement_runs_on_the_projects_oldest_python() -> None:
    floor = project_floor()
    needs_newer = {}
    for name in requirement_names():
        try:
            needs = importlib.metadata.metadata(name)["Requires-Python"]
        except importlib.metadata.PackageNotFoundError:
            continue
        if needs and floor not in SpecifierSet(needs):
            needs_newer[name] = needs
    assert len(requirement_names()) > 20 and needs_newer == {}


def test_setup_venv_checks_the_projects_floor() -> None:
    floor = project_floor()
    setup = (ROOT / "tools" / "setup_venv.py").read_text(encoding="utf-8")
    assert f"sys.version_info < ({floor.major}, {floor.minor})" in setup
    assert f"sys.version_info >= ({floor.major}, {floor.minor})" in setup
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"`python3` ({floor.major}.{floor.minor} or newer)" in readme
