"""The chaos soak's quick mode (scripts/chaos/chaos_soak.py --quick): ~100 tasks on 8 workers
of the synthetic pipeline while workers are SIGKILLed and replaced, the controller is killed and
restarted, a worker is SIGSTOPped past its lease, Mooncake reads fail, control connections
drop and ring items are corrupted; every task must complete exactly once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers


def test_chaos_quick(tiny_models: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.chaos.chaos_soak", "--quick", "--pipeline",
         "synthetic", "--models", str(tiny_models), "--workdir", str(tmp_path / "chaos")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("chaos: OK"), proc.stdout[-5000:] + proc.stderr[-5000:]
    assert proc.returncode == 0
    fields = dict(f.split("=") for f in lines[-1].split()[2:])
    assert int(fields["kills"]) >= 10 and int(fields["restarts"]) >= 1
    assert int(fields["tasks"]) == 100
