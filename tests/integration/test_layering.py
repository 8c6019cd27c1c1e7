"""The layering of DESIGN.md as a test that cannot rot: the import contracts in
``pyproject.toml`` hold for the tree, and each of them does catch a new cross import (a lazy
one inside a function included) or a new cycle inside a package."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES = tuple(CONFIG["root_packages"])
LAYERS = "layers of DESIGN.md"


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


def test_one_layers_contract_states_the_whole_order() -> None:
    # One for the packages; the others order the rooms inside one package (containers).
    layers = [c for c in CONFIG["contracts"] if c["type"] == "layers" and "containers" not in c]
    assert len(layers) == 1 and "allow_indirect_imports" not in layers[0]
    assert layers[0]["layers"] == [
        "diffring_cli", "run_service", "baseline | doctor | modelkit | launcher",
        "controller | workers", "tensorplane", "contracts", "rings",
    ]
    assert {"run_service", "diffring_cli"} <= set(PACKAGES)  # scanned, not only imported


@pytest.mark.parametrize(
    ("module", "statement", "contract"),
    [
        # Upward, layer by layer (the lazy import inside a function counts).
        ("rings/_probe.py", "from contracts import errors\n", LAYERS),
        ("contracts/_probe.py", "def f():\n    import tensorplane\n", LAYERS),
        ("tensorplane/_probe.py", "def f():\n    import controller\n", LAYERS),
        ("controller/_probe.py", "def f():\n    import doctor\n", LAYERS),
        ("workers/_probe.py", "def f():\n    import baseline\n", LAYERS),
        ("doctor/_probe.py", "import run_service\n", LAYERS),
        ("run_service/_probe.py", "def f():\n    import diffring_cli.main\n", LAYERS),
        # Across independent packages of one layer.
        ("controller/_probe.py", "def f():\n    import workers.models\n", LAYERS),
        ("workers/_probe.py", "def f():\n    from controller import app\n", LAYERS),
        ("baseline/_probe.py", "def f():\n    import doctor\n", LAYERS),
        ("launcher/_probe.py", "def f():\n    import baseline\n", LAYERS),
        # The launcher is imported by the tests and the scripts only.
        ("controller/_probe.py", "def f():\n    import launcher\n", LAYERS),
        ("workers/_probe.py", "def f():\n    from launcher import LocalGroup\n", LAYERS),
        # What the order cannot say.
        ("contracts/_probe.py", "def f():\n    import torch\n", "contracts import no model"),
        ("controller/_probe.py", "def f():\n    import diffusers\n", "knows no model library"),
        ("tensorplane/_probe.py", "from rings import layout\n", "tensor plane"),
        ("diffring_cli/_probe.py", "def f():\n    import controller.app\n", "talks HTTP"),
        # Upward between the controller's rooms, without a cycle (metrics imports no HTTP).
        ("controller/http/_probe.py", "def f():\n    import controller.metrics\n", "rooms"),
        ("controller/ownership/_probe.py", "import controller.preflight\n", "rooms"),
        # A cycle inside a package (appended to a module the other one imports).
        ("controller/http/routes.py", "\n\ndef _probe():\n    import controller.http.webapp\n",
         "the controller's modules"),
        # The interface knowing a backend (the 12-module cycle rings/ had).
        ("rings/verbs.py", "\n\ndef _probe():\n    import rings.tcp\n", "rings' modules"),
        ("rings/rdma/qp.py", "\n\ndef _probe():\n    import rings.rdma.peer\n",
         "rings' modules"),
        ("workers/models/adapter.py", "\n\ndef _probe():\n    from . import base\n",
         "the workers' modules"),
        ("workers/group/rank.py", "\n\ndef _probe():\n    import workers.main\n",
         "the workers' modules"),
        ("launcher/ports.py", "\n\ndef _probe():\n    import launcher.local\n",
         "the launcher's modules"),
        ("contracts/errors.py", "\n\ndef _probe():\n    import contracts.config\n",
         "the other packages' modules"),
        ("tensorplane/descriptor.py", "\n\ndef _probe():\n    import tensorplane.handoff\n",
         "the other packages' modules"),
    ],
)
def test_a_new_cross_import_breaks_a_contract(
    tmp_path: Path, module: str, statement: str, contract: str
) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    probe = tmp_path / module
    probe.write_text((probe.read_text() if probe.exists() else "") + statement)
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    # "NAME BROKEN", or "NAME BROKEN (1 ignored import)" for a contract that ignores one.
    broken = [line for line in result.stdout.splitlines()
              if re.search(r" BROKEN( \(\d+ ignored imports?\))?$", line)]
    assert len(broken) == 1 and contract in broken[0], result.stdout
