"""What ``scripts/bench/bench_serving.py`` reads off its services and how it prints it: Prometheus
scrapes per endpoint, the busy fractions and the Mooncake hops of one level, the markdown
table and the plot.

Busy: time inside a stage call (``diffring_stage_seconds{step="compute"}``: encode, denoise,
VAE decode; ``step="encode_media"``: PNG/MP4 writing, for a streamed Wan decode only what
follows the VAE) over wall time x the workers running
that stage; the same histogram in both modes. "DiT dK" is that fraction for the DiT workers
(or the baseline replica) on device K: the time they spent inside denoise over wall time x
their number on that device.

Hops: the transformer's pulls are Phase1 (encoder -> DiT), the decoder's Phase2 (DiT -> VAE),
read from each worker's ``diffring_transfer_bytes{direction="pull"}`` and
``diffring_transfer_seconds{direction="pull"}`` (time in the Mooncake pull of one task's
tensors). Per pull: MB and ms. "hops %" is Phase1 + Phase2 time per request over that plus
the request's time inside encode, denoise and VAE decode (its own work, queueing left out;
the scale-out issue's goal: at most 1 %). The baseline has no hops.

Efficiency ("eff"): a row's QPS over G x the one-replica baseline's QPS, G the run's devices.

DiT s/step: the transformer's time inside denoise over the level's requests x steps. Peak GiB
of a stage: the largest ``diffring_stage_peak_max_bytes`` of the workers of that role (each
its process's ``torch.cuda.max_memory_allocated`` over one request, weights included) after
the level; in a baseline the three stages share one process, so each is that process's peak
while the stage ran. "-" on a CPU (nothing to read).

Ratio rows: mode A's level over mode B's at the same N (QPS, latencies, DiT s/step).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import httpx

from scripts import ROOT
from scripts.bench.bench_serving_layout import ROLES, Endpoint

STAGES = (("encoder", "compute", "enc"), ("transformer", "compute", "DiT"),
          ("decoder", "compute", "VAE"), ("decoder", "encode_media", "media"))
GAUGES = {"diffring_stage_peak_max_bytes": "peak", "diffring_stage_resident_bytes": "resident"}
"""Memory gauges read after a level (not differences), by their ``role`` label."""
HOPS = (("P1", "transformer"), ("P2", "decoder"))


def scrape(endpoints: list[Endpoint]) -> list[dict[str, float]]:
    """Per endpoint: stage seconds (``stage/ROLE/STEP``), pull totals (``pull_bytes``,
    ``pull_s``, ``pull_n``) and memory gauges (``peak/ROLE``, ``resident/ROLE``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for ep in endpoints:
        got: dict[str, float] = {}
        text = httpx.get(ep.url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = None
                if s.name == "diffring_stage_seconds_sum":
                    key = f"stage/{s.labels['role']}/{s.labels['step']}"
                elif s.name in GAUGES:
                    key = f"{GAUGES[s.name]}/{s.labels['role']}"
                elif s.labels.get("direction") == "pull":
                    key = {"diffring_transfer_bytes_total": "pull_bytes",
                           "diffring_transfer_seconds_sum": "pull_s",
                           "diffring_transfer_seconds_count": "pull_n"}.get(s.name)
                if key is not None:
                    got[key] = got.get(key, 0.0) + s.value
        out.append(got)
    return out


def level_stats(endpoints: list[Endpoint], before: list[dict[str, float]],
                after: list[dict[str, float]], active: list[int], wall: float,
                n_devices: int) -> dict[str, Any]:
    """Busy fractions, per-device DiT busy and hop costs of one level, from the scrapes
    before and after it; ``active``: the endpoints (indices) that served the level."""
    def gauge(key: str) -> bool:
        return key.split("/", 1)[0] in GAUGES.values()

    delta = [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b) if not gauge(k)}
             for b, a in zip(before, after, strict=True)]
    act = [(endpoints[i], delta[i]) for i in active]
    def gib(key: str) -> float | None:
        """The largest reading among the active endpoints; None where none reports it."""
        got = [after[i][key] for i in active if key in after[i]]
        return max(got) / 2**30 if got else None

    memory = {f"{kind}_gib": {role: gib(f"{kind}/{role}") for role in ROLES}
              for kind in GAUGES.values()}

    def runs(ep: Endpoint, role: str) -> bool:
        return ep.role in (role, "all")

    busy = {}
    for role, step, label in STAGES:
        eps = [d for ep, d in act if runs(ep, role)]
        busy[label] = sum(d.get(f"stage/{role}/{step}", 0.0) for d in eps) / (
            wall * max(1, len(eps)))
    dit_by_device: list[float | None] = []
    for dev in range(n_devices):
        eps = [d for ep, d in act if ep.device == dev and runs(ep, "transformer")]
        dit_by_device.append(
            sum(d.get("stage/transformer/compute", 0.0) for d in eps) / (wall * len(eps))
            if eps else None)
    hops: dict[str, dict[str, float] | None] = {}
    for hop, role in HOPS:
        eps = [d for ep, d in act if ep.role == role]
        n = sum(d.get("pull_n", 0.0) for d in eps)
        hops[hop] = None if n == 0 else {
            "pulls": n, "bytes_per_pull": sum(d.get("pull_bytes", 0.0) for d in eps) / n,
            "s_per_pull": sum(d.get("pull_s", 0.0) for d in eps) / n}
    return {"busy": busy, "dit_busy_by_device": dit_by_device, "hops": hops, **memory,
            "stage_seconds": {k: sum(d.get(k, 0.0) for _, d in act)
                              for k in sorted({k for _, d in act for k in d})}}


def hop_share(row: dict[str, Any]) -> float | None:
    """Phase1 + Phase2 seconds of a request over its own work: those plus its seconds inside
    encode, denoise and VAE decode (None without hops). Queueing is left out: at N >> G it
    would make any hop look small."""
    p1, p2 = row["hops"]["P1"], row["hops"]["P2"]
    if p1 is None or p2 is None:
        return None
    hops = p1["s_per_pull"] + p2["s_per_pull"]
    work = sum(row["stage_seconds"].get(f"stage/{role}/compute", 0.0)
               for role in ROLES) / row["requests"]
    return float(hops / (hops + work))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _gib(x: float | None) -> str:
    return f"{x:.1f}" if x else "-"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else ""


def table(results: list[dict[str, Any]], devices: list[str] | None = None,
          ratios: list[tuple[str, str]] | None = None) -> str:
    """The markdown table; ``devices`` (a scale-out run) adds per-device DiT busy, the hop
    columns and the efficiency; ``ratios`` (mode names A, B) adds A/B rows."""
    head = ["mode", "N", "requests", "QPS", "P50 s", "P95 s", "P99 s", "enc busy", "DiT busy",
            "VAE busy", "media busy", "DiT s/step", "enc peak GiB", "DiT peak GiB",
            "VAE peak GiB"]
    if devices is not None:
        head += [f"DiT d{i}" for i in range(len(devices))]
        head += ["P1 MB", "P1 ms", "P2 MB", "P2 ms", "hops %", "eff"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for res in results:
        for row in res["levels"]:
            b = row["busy"]
            cells = [row.get("label", res["label"]), str(row["concurrency"]),
                     str(row["requests"]), f"{row['qps']:.3f}", f"{row['p50_s']:.2f}",
                     f"{row['p95_s']:.2f}", f"{row['p99_s']:.2f}", _pct(b["enc"]),
                     _pct(b["DiT"]), _pct(b["VAE"]), _pct(b["media"])]
            step = row.get("dit_s_per_step")
            cells.append("-" if step is None else f"{step:.3f}")
            cells += [_gib(row.get("peak_gib", {}).get(role)) for role in ROLES]
            if devices is not None:
                cells += [_pct(x) for x in row["dit_busy_by_device"]]
                for hop in ("P1", "P2"):
                    h = row["hops"][hop]
                    cells += (["-", "-"] if h is None else [
                        f"{h['bytes_per_pull'] / 1e6:.3g}", f"{h['s_per_pull'] * 1e3:.3g}"])
                share = hop_share(row)
                cells.append("-" if share is None else f"{share * 100:.3g}%")
                eff = row.get("efficiency")
                cells.append("-" if eff is None else f"{eff:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    by_name = {res["mode"]: res for res in results}
    for a, b in ratios or []:
        if a not in by_name or b not in by_name:
            continue
        pairs = {row["concurrency"]: row for row in by_name[b]["levels"] if not row.get("single")}
        for rd in by_name[a]["levels"]:
            rb = pairs.get(rd["concurrency"])
            if rb is None or rd.get("single"):
                continue
            cells = [f"**ratio** {a}/{b}", str(rd["concurrency"]), "",
                     f"**{rd['qps'] / rb['qps']:.2f}**"]
            cells += [f"{rd[k] / rb[k]:.2f}" for k in ("p50_s", "p95_s", "p99_s")]
            cells += [""] * 4 + [_ratio(rd.get("dit_s_per_step"), rb.get("dit_s_per_step"))]
            cells += [""] * (len(head) - len(cells))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def group_lines(results: list[dict[str, Any]]) -> str:
    """DiT seconds per step of each mode and level, and the group's latency speedup (P50 of
    the one-device baseline over the group's) at each N both ran."""
    lines = []
    p50 = {}
    for res in results:
        for row in res["levels"]:
            p50[(res["mode"], row["concurrency"])] = row["p50_s"]
            if "dit_s_per_step" in row:
                lines.append(f"- {res['label']} N={row['concurrency']}: DiT "
                             f"{row['dit_s_per_step']:.3f} s/step")
    base = next((r["mode"] for r in results if r["kind"] == "baseline"), None)
    for res in results:
        for row in res["levels"] if res["kind"] == "disagg" else []:
            conc, value = row["concurrency"], row["p50_s"]
            ref = p50.get((base, conc))
            if ref:
                lines.append(f"- N={conc}: group speedup {ref / value:.2f}x (P50 {ref:.2f} s "
                             f"one device, {value:.2f} s group)")
    return "\n".join(lines) + "\n"


def efficiency(results: list[dict[str, Any]], n_devices: int,
               given: float | None) -> dict[str, Any] | None:
    """The one-replica QPS (given, or the baseline's measured level; None: neither) and each
    other row's QPS over G x it, written into the rows."""
    qps, source = given, "--single-qps"
    if qps is None:
        rows = [r for res in results for r in res["levels"] if r.get("single")]
        if not rows:
            return None
        qps, source = rows[0]["qps"], "measured (baseline x1 row)"
    reference = n_devices * qps
    for res in results:
        for row in res["levels"]:
            if not row.get("single"):
                row["efficiency"] = row["qps"] / reference
    return {"single_replica_qps": qps, "source": source, "devices": n_devices,
            "reference_qps": reference}


def plot(results: list[dict[str, Any]], path: Path, title: str,
         reference_qps: float | None = None) -> None:
    """QPS and P95 against N per mode; with ``reference_qps`` (G x one replica) a line for it
    and a third panel with the scaling efficiency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if reference_qps else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    names = ["QPS (requests / s)", "P95 latency (s)", "QPS / (G x one replica)"]
    for res in results:
        rows = [r for r in res["levels"] if not r.get("single")]
        ns = [r["concurrency"] for r in rows]
        axes[0].plot(ns, [r["qps"] for r in rows], marker="o", label=res["label"])
        axes[1].plot(ns, [r["p95_s"] for r in rows], marker="o", label=res["label"])
        if reference_qps:
            axes[2].plot(ns, [r["qps"] / reference_qps for r in rows], marker="o",
                         label=res["label"])
    if reference_qps:
        axes[0].axhline(reference_qps, color="grey", linestyle="--", label="G x one replica")
        axes[2].axhline(1.0, color="grey", linestyle="--")
    for ax, name in zip(axes, names, strict=False):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N concurrent requests")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(devices: list[str]) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    try:
        import torch

        info["torch"] = torch.__version__
        if any(d.startswith("cuda") for d in devices) and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda_devices"] = torch.cuda.device_count()
            info["gpus"] = {d: torch.cuda.get_device_name(d) for d in dict.fromkeys(devices)}
    except Exception as exc:
        info["torch_error"] = repr(exc)
    with contextlib.suppress(Exception):
        import av

        info["av"] = av.__version__
    with contextlib.suppress(Exception):
        # Only when this checkout is itself a repository (a copied tree inside another
        # repository would report that one's commit).
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
        if top and Path(top).resolve() == ROOT:
            info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                         capture_output=True, text=True).stdout.strip()
    return info
