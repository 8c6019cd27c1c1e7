"""Quick runs of the scale benchmarks: they produce well-formed tables (no speed asserted).

Each script starts its own group and stops every process it started, by pid.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers

NUMBER = r"\d+(\.\d+)?"


def run(args: list[str], timeout: float) -> str:
    out = subprocess.run([sys.executable, *args], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(400)
def test_bench_scale_quick(tmp_path: Path) -> None:
    md, js, png = tmp_path / "scale.md", tmp_path / "scale.json", tmp_path / "scale.png"
    run(["-m", "scripts.bench.bench_scale", "--ks", "1,2", "--steps", "2", "--step-s", "0.05",
         "--waves", "3", "--md", str(md), "--json", str(js), "--plot", str(png)], 360)
    lines = [ln for ln in md.read_text().splitlines() if ln.startswith("|")]
    assert lines[0] == ("| K | tasks | QPS | ideal K/t | efficiency | DiT s/task | "
                        "added ms/task |")
    assert re.fullmatch(r"\|( --- \|){7}", lines[1])
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "3"), ("2", "6")]
    for r in rows:
        assert all(re.fullmatch(r"-?" + NUMBER, c) for c in r), r
        assert float(r[2]) > 0 and float(r[3]) == 10 * int(r[0])  # ideal = K / 0.1 s
        assert float(r[4]) == pytest.approx(float(r[2]) / float(r[3]), abs=2e-3)
    assert "load average" in md.read_text()
    data = json.loads(js.read_text())
    assert data["t"] == pytest.approx(0.1) and [r["K"] for r in data["rows"]] == [1, 2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(400)
def test_bench_idle_quick(tmp_path: Path) -> None:
    md = tmp_path / "idle.md"
    run(["-m", "scripts.bench.bench_idle", "--workers", "3", "--window", "1", "--settle", "0.5",
         "--probes", "3", "--gap", "0.05", "--min-free-mb", "500", "--md", str(md)], 360)
    text = md.read_text()
    assert re.search(r"controller CPU while idle: \*\*" + NUMBER + r" % of one core\*\*", text)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "ring" in ln]
    assert [r.split("|")[1].split()[0] for r in rows] == ["request", "phase1", "phase2"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")][1:]
        assert cells[0] == "3" and all(re.fullmatch(NUMBER, c) for c in cells[1:]), r
