"""The import layering of pyproject.toml's [tool.importlinter] contracts holds (``lint-imports``),
and every offstep module sits in one of its layers, so a new module cannot slip past it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 11):
    pytest.skip("import-linter (the test extra) needs Python >= 3.11", allow_module_level=True)

import tomllib  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Packages whose own __init__ holds nothing: not placed in a layer (their modules are).
UNPLACED = {"offstep", "offstep.config"}


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_lint_imports_keeps_every_contract():
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.exists(), f"{exe} is missing: install the test extra (pip install -e '.[test]', scripts/setup.sh does)"
    # --no-cache: nothing is written into the checkout
    out = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in out.stdout, out.stdout[-3000:]


def test_every_module_is_in_a_layer():
    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers"]
    placed = [name.strip() for layer in layers for name in layer.replace("|", ":").split(":")]
    modules = []
    for path in sorted((ROOT / "offstep").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    outside = [m for m in modules if m not in UNPLACED and not any(m == p or m.startswith(p + ".") for p in placed)]
    assert not outside, f"modules in no layer of pyproject.toml's [tool.importlinter] layers contract: {outside}"


def test_no_module_file_name_is_used_twice():
    """A file name says what a module is: two ``stream.py`` in one package make every mention of
    one ambiguous (``__init__.py`` aside)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "offstep").rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"module file names used more than once: {twice}"


def test_no_module_is_over_500_lines():
    """A module past 500 lines holds more than one job: split it by section (the formatter, not
    squeezing, decides how long its lines are: ``ruff format``, 120 columns)."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "offstep").rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500
    }
    assert not long, f"modules over 500 lines: {long}"
