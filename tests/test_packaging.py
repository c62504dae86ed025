"""The wheel holds every package and cluster preset of the source tree (a non-editable install works).

The wheel is built offline (no index, no build isolation: the setuptools already installed) from a
copy of the tree, so no build/ directory is written into the checkout and no stale build/lib file
from an earlier build can hide a missing package.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_ROOTS = ("planner", "passes", "runtime", "costmodels")
NOT_SHIPPED = ("tests", "examples", "bench", "scripts")
_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", "out"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in PACKAGE_ROOTS + NOT_SHIPPED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=_IGNORE)
    out = tmp / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = subprocess.run(
        [*cmd, "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (whl,) = out.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def _source_files(pattern: str) -> list[str]:
    """Paths (relative to the repository root, '/'-separated) under the package roots matching pattern."""
    found = []
    for root in PACKAGE_ROOTS:
        for path in (ROOT / root).rglob(pattern):
            if "__pycache__" not in path.parts:
                found.append(path.relative_to(ROOT).as_posix())
    return sorted(found)


def test_every_package_and_module_is_in_the_wheel(wheel_names: set[str]) -> None:
    packages = _source_files("__init__.py")
    assert "planner/report/__init__.py" in packages  # the one the hand-written list missed
    missing = [p for p in packages if p not in wheel_names]
    assert not missing, f"packages missing from the wheel: {missing}"
    package_dirs = {p.rsplit("/", 1)[0] for p in packages}
    modules = [p for p in _source_files("*.py") if p.rsplit("/", 1)[0] in package_dirs]
    missing = [p for p in modules if p not in wheel_names]
    assert not missing, f"modules missing from the wheel: {missing}"


def test_every_cluster_preset_is_in_the_wheel(wheel_names: set[str]) -> None:
    presets = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "costmodels" / "clusters").glob("*.yaml")
    )
    assert "costmodels/clusters/local-cpu.yaml" in presets
    missing = [p for p in presets if p not in wheel_names]
    assert not missing, f"cluster presets missing from the wheel: {missing}"


def test_the_wheel_ships_no_tests_or_examples_and_has_the_planner_command(
    wheel: Path, wheel_names: set[str]
) -> None:
    shipped = sorted(n for n in wheel_names if n.split("/", 1)[0] in NOT_SHIPPED)
    assert not shipped, f"not meant to be installed: {shipped}"
    (entry_points,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(wheel) as z:
        text = z.read(entry_points).decode()
    assert "planner = planner.cli:main" in text
