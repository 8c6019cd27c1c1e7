"""The layering of DESIGN.md as a test that cannot rot: the import contracts in
``pyproject.toml`` hold for the tree, and they do catch a new cross import (a lazy one inside
a function included)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes or servers

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "rings", "contracts", "tensorplane", "controller", "workers", "baseline", "doctor",
    "diffring_cli",
)
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(cwd / "pyproject.toml"), "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
    )


def test_import_contracts_hold() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(
    ("module", "statement", "contract"),
    [
        ("controller/_probe.py", "def f():\n    import workers.models\n", "knows no model"),
        ("workers/_probe.py", "def f():\n    from controller import app\n", "never import"),
        ("rings/_probe.py", "from contracts import errors\n", "imports nothing else"),
        ("tensorplane/_probe.py", "def f():\n    import controller\n", "tensor plane"),
        ("contracts/_probe.py", "def f():\n    import torch\n", "no model library"),
        ("diffring_cli/_probe.py", "def f():\n    import controller.group\n", "talks HTTP"),
    ],
)
def test_a_new_cross_import_breaks_a_contract(
    tmp_path: Path, module: str, statement: str, contract: str
) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / module).write_text(statement)
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert len(broken) == 1 and contract in broken[0], result.stdout
