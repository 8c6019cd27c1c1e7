"""scripts/bench/bench_serving.py, quick CPU runs on the tiny models: a well-formed table, JSON
and plot for both modes, on one device and scaled out over two (no speed is asserted: the machine
is shared); its device and placement parsing, and its refusal of missing GPUs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers


def test_bench_serving_quick_run(tiny_models: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_serving", "--pipeline", "qwen_t2i",
         "--models", str(tiny_models), "--concurrency", "1,2", "--requests", "1,2",
         "--steps", "2", "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    md = (out / "bench_serving.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header == ["mode", "N", "requests", "QPS", "P50 s", "P95 s", "P99 s", "enc busy",
                      "DiT busy", "VAE busy", "media busy", "DiT s/step", "enc peak GiB",
                      "DiT peak GiB", "VAE peak GiB"]
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
        busy = [float(x.rstrip("%")) for x in r[7:11]]
        assert all(0 <= b <= 100 for b in busy) and busy[1] > 0  # the DiT did work
        assert float(r[11]) > 0 and r[12:] == ["-"] * 3  # s/step; no GPU memory on a CPU
    assert [r[1] for r in ratios] == ["1", "2"] and all(float(r[3].strip("*")) > 0
                                                        for r in ratios)
    report = json.loads((out / "bench_serving.json").read_text())
    assert [res["mode"] for res in report["results"]] == ["baseline", "disagg"]
    assert report["fidelity_probe"]["equal"] is True  # same seed, same pixels in both modes
    assert (out / "bench_serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _table(md: str) -> tuple[list[str], list[list[str]]]:
    rows = [line for line in md.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert set(rows[1].replace("|", "").split()) == {"---"}
    return header, [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]


def test_bench_serving_scale_out_quick_run(tiny_models: Path, tmp_path: Path) -> None:
    """--gpus 2 on a CPU (two "cpu" devices): G replicas against a disaggregated group with a
    DiT worker per device; per-device busy, Phase1/Phase2 hops and the efficiency against
    G x the one-replica baseline measured in the same run."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_serving", "--pipeline", "qwen_t2i",
         "--models", str(tiny_models), "--gpus", "2", "--concurrency", "2", "--requests", "2",
         "--single-requests", "2", "--steps", "2", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    md = (out / "bench_serving.md").read_text()
    assert "2 devices (d0=cpu, d1=cpu); disagg: d0: e+t+d, d1: t" in md
    header, body = _table(md)
    assert header == ["mode", "N", "requests", "QPS", "P50 s", "P95 s", "P99 s", "enc busy",
                      "DiT busy", "VAE busy", "media busy", "DiT s/step", "enc peak GiB",
                      "DiT peak GiB", "VAE peak GiB", "DiT d0", "DiT d1", "P1 MB",
                      "P1 ms", "P2 MB", "P2 ms", "hops %", "eff"]
    col = {name: i for i, name in enumerate(header)}
    rows = {r[0]: r for r in body}
    assert list(rows) == ["baseline x1", "baseline x2", "disagg 1/2/1", "**ratio** disagg/baseline"]
    for label in ("baseline x1", "baseline x2", "disagg 1/2/1"):
        r = rows[label]
        assert len(r) == len(header) and r[col["N"]] == "2" and r[col["requests"]] == "2"
        qps, p50, p95, p99 = (float(r[col[k]]) for k in ("QPS", "P50 s", "P95 s", "P99 s"))
        assert qps > 0 and 0 < p50 <= p95 <= p99
    single, base, dis = rows["baseline x1"], rows["baseline x2"], rows["disagg 1/2/1"]

    def pct(cell: str) -> float:
        return float(cell.rstrip("%"))

    # One replica alone: only d0 served (and did DiT work); no hops in a baseline; no eff.
    assert pct(single[col["DiT d0"]]) > 0 and single[col["DiT d1"]] == "-"
    assert all(single[col[k]] == "-" for k in ("P1 MB", "P2 ms", "hops %", "eff"))
    # G replicas: both devices busy, still no hops; disagg: Mooncake moved bytes both hops.
    assert all(0 < pct(base[col[k]]) <= 100 for k in ("DiT d0", "DiT d1"))
    assert base[col["P1 MB"]] == "-" and base[col["hops %"]] == "-"
    for k in ("P1 MB", "P1 ms", "P2 MB", "P2 ms"):
        assert float(dis[col[k]]) > 0, k
    assert 0 < pct(dis[col["hops %"]]) < 100
    assert all(0 <= pct(dis[col[k]]) <= 100 for k in ("DiT d0", "DiT d1"))
    assert pct(dis[col["DiT d0"]]) + pct(dis[col["DiT d1"]]) > 0
    report = json.loads((out / "bench_serving.json").read_text())
    scaling = report["scaling"]
    assert scaling["devices"] == 2 and scaling["source"].startswith("measured")
    assert scaling["single_replica_qps"] == report["results"][0]["levels"][0]["qps"]
    for r, res in ((base, report["results"][0]["levels"][1]),
                   (dis, report["results"][1]["levels"][0])):
        eff = res["qps"] / (2 * scaling["single_replica_qps"])
        assert res["efficiency"] == eff and r[col["eff"]] == f"{eff:.2f}"
    assert report["devices"] == ["cpu", "cpu"]
    assert report["placement"] == [["encoder", 0], ["transformer", 0], ["transformer", 1],
                                   ["decoder", 0]]
    assert report["fidelity_probe"]["equal"] is True
    assert (out / "bench_serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serving_refuses_missing_gpus(tmp_path: Path) -> None:
    """More CUDA devices than torch sees (none here): refused before anything is built."""
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_serving", "--arch", "wan-1.3b",
         "--devices", "cuda:0,cuda:1", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "this run needs 2 CUDA device(s) (cuda:0, cuda:1)" in proc.stderr
    assert "torch.cuda.device_count() is 0" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_placements() -> None:
    from scripts.bench import bench_serving_layout as layout

    assert layout.default_placement(1, 1, 1, 1) == "0:e+t+d"
    assert layout.default_placement(2, 1, 1, 1) == "0:e+t+d,1:t"
    assert layout.default_placement(8, 1, 2, 1) == "0:e+2t+d,1-7:2t"
    seed = layout.parse_placement("0:e+d,1-7:t", 8)  # the seed's 7 DiT : 1 encoder split
    assert layout.counts(seed) == {"encoder": 1, "transformer": 7, "decoder": 1}
    assert layout.describe(seed) == "d0: e+d, d1: t, d2: t, d3: t, d4: t, d5: t, d6: t, d7: t"
    assert layout.parse_placement("0:encoder+2dit+decoder", 1) == [
        ("encoder", 0), ("transformer", 0), ("transformer", 0), ("decoder", 0)]
    assert layout.device_list("cuda:2", 3, None) == ["cuda:2", "cuda:3", "cuda:4"]
    assert layout.device_list("cuda", 2, None) == ["cuda:0", "cuda:1"]
    assert layout.device_list("cpu", 2, None) == ["cpu", "cpu"]
    assert layout.device_list("cpu", None, "cpu, cpu") == ["cpu", "cpu"]
    for spec, n, says in (("0:e+t+d,1-2:t", 2, "this run has 2"),
                          ("0:e+t+d", 2, "leaves device(s) [1]"),
                          ("0:e+t,1:t", 2, "has no decoder"),
                          ("0:e+x+d", 1, "use [COUNT]e|t|d"),
                          ("e+t+d", 1, "write DEVICES:ROLES")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            layout.parse_placement(spec, n)
    for args, says in ((("cpu", 2, "cpu,cpu"), "not both"), (("cpu", 0, None), "at least 1"),
                       (("cpu", None, "gpu0"), "'cpu' or 'cuda:N'")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            layout.device_list(*args)


def test_dit_group_plan() -> None:
    """--dit-parallel: each DiT worker spans the layout's devices from its own; the baseline
    is one device (the figure a group is compared to). The run itself is a CPU toy away:
    ``python -m scripts.bench.bench_serving --devices cpu,cpu --dit-parallel cfg=2``
    (docs/parallel.md)."""
    from scripts.bench import bench_serving
    from scripts.bench import bench_serving_layout as layout

    assert layout.default_placement(3, 1, 1, 1, dit_span=2) == "0:e+d,1:t"
    assert layout.default_placement(2, 1, 1, 1, dit_span=2) == "0:e+t+d"
    assert layout.parse_placement("0:e+d,1:t", 3, dit_span=2) == [
        ("encoder", 0), ("transformer", 1), ("decoder", 0)]
    with pytest.raises(SystemExit, match=re.escape("a DiT group of 2 devices from d1 runs "
                                                   "past d1")):
        layout.parse_placement("0:e+d,1:t", 2, dit_span=2)
    with pytest.raises(SystemExit, match=re.escape("leaves device(s) [3]")):
        layout.parse_placement("0:e+d,1:t", 4, dit_span=2)
    plan = bench_serving.make_plan(bench_serving.parse_args(
        ["--devices", "cpu,cpu,cpu,cpu,cpu", "--dit-parallel", "ulysses=2,cfg=2"]))
    assert (plan.dit_parallel, plan.dit_span, plan.scale_out) == ("cfg=2,ulysses=2", 4, False)
    assert plan.workers == [("encoder", 0), ("transformer", 1), ("decoder", 0)]
    assert plan.baseline_devices == ["cpu"]
    with pytest.raises(SystemExit, match="--dit-parallel: parallel: cfg must be 1 or 2"):
        bench_serving.make_plan(bench_serving.parse_args(["--dit-parallel", "cfg=3"]))
