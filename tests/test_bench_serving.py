"""scripts/bench_serving.py, quick CPU run on the tiny models: a well-formed table, JSON and
plot for both modes (no speed is asserted: the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_serving_quick_run(tiny_models: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--pipeline", "qwen_t2i",
         "--models", str(tiny_models), "--concurrency", "1,2", "--requests", "1,2",
         "--steps", "2", "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    md = (out / "bench_serving.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header == ["mode", "N", "requests", "QPS", "P50 s", "P95 s", "P99 s", "enc busy",
                      "DiT busy", "VAE busy", "media busy"]
    assert set(rows[1].replace("|", "").split()) == {"---"}
    body = [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]
    measured = [r for r in body if not r[0].startswith("**ratio")]
    ratios = [r for r in body if r[0].startswith("**ratio")]
    assert [(r[0], r[1], r[2]) for r in measured] == [
        ("baseline", "1", "1"), ("baseline", "2", "2"),
        ("disagg 1/1/1", "1", "1"), ("disagg 1/1/1", "2", "2")]
    for r in measured:
        assert len(r) == len(header)
        qps, p50, p95, p99 = (float(x) for x in r[3:7])
        assert qps > 0 and 0 < p50 <= p95 <= p99
        busy = [float(x.rstrip("%")) for x in r[7:]]
        assert all(0 <= b <= 100 for b in busy) and busy[1] > 0  # the DiT did work
    assert [r[1] for r in ratios] == ["1", "2"] and all(float(r[3].strip("*")) > 0
                                                        for r in ratios)
    report = json.loads((out / "bench_serving.json").read_text())
    assert [res["mode"] for res in report["results"]] == ["baseline", "disagg"]
    assert report["fidelity_probe"]["equal"] is True  # same seed, same pixels in both modes
    assert (out / "bench_serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
