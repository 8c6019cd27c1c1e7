#!/usr/bin/env python3
"""Serving throughput: the one-process baseline against a disaggregated group, N concurrent.

    # CPU, tiny models (built if missing)
    python scripts/bench_serving.py --pipeline qwen_t2i --concurrency 1,2,4,8 --out out/bench
    # GPU, real-size random-weight architectures built on the fly
    python scripts/bench_serving.py --arch wan-1.3b --device cuda:0 --dtype bfloat16 \\
        --steps 8 --concurrency 1,2,4,8 --out $OUT

For each mode (``baseline``: ``run_service.py --service all``; ``disagg``: a controller plus
``--encoders/--transformers/--decoders`` workers, all on this machine, started by
``controller.group.LocalGroup``) it sends one warm-up request, then for each N in
``--concurrency`` keeps N requests in flight (closed loop: a client posts its next request
when its last one completed) until ``--requests`` requests of that level completed.

Per level it reports requests, QPS, P50/P95/P99 latency and the busy fraction of each stage.
Latency is the server's (``created_at`` to ``end_time`` of the task's status); QPS is
requests over the level's wall time (first accepted to last completed). A stage's busy
fraction is the time its workers spent inside the stage call over wall time x workers, read
from the same Prometheus histogram in both modes (``diffring_stage_seconds{step="compute"}``:
encode, denoise, VAE decode; ``step="encode_media"``: PNG/MP4 writing). On a GPU the stage
calls return after the device finished, so "DiT busy" is time inside denoise.

Output: a markdown table on stdout and in ``OUT/bench_serving.md``, everything in
``OUT/bench_serving.json``, and ``OUT/bench_serving.png`` (QPS and P95 against N, both modes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import httpx  # noqa: E402

from controller.group import LocalGroup, free_ports, group_config  # noqa: E402

KIND = {"wan_t2v": "video", "wan_i2v": "video", "qwen_t2i": "image", "qwen_i2i": "image"}
# Default request geometry: tiny models on a CPU, real sizes with --arch.
TINY_SIZE = {"wan_t2v": (32, 32, 9), "qwen_t2i": (64, 64, 1)}
REAL_SIZE = {"wan_t2v": (480, 832, 81), "qwen_t2i": (1024, 1024, 1)}
STAGES = (("encoder", "compute", "enc"), ("transformer", "compute", "DiT"),
          ("decoder", "compute", "VAE"), ("decoder", "encode_media", "media"))


# ------------------------------------------------------------------------------- groups
def _server(cfg: Mapping[str, Any], metric_port: int) -> dict[str, Any]:
    return {"server": {**cfg["server"], "metric_port": metric_port}}


@contextlib.contextmanager
def running(mode: str, cfg: dict[str, Any], workdir: Path, counts: tuple[int, int, int],
            timeout: float) -> Iterator[tuple[LocalGroup, list[str]]]:
    """Start a baseline or a disaggregated group; yields it and its metrics URLs."""
    group = LocalGroup(cfg, workdir)
    metrics: list[str] = []
    try:
        if mode == "baseline":
            (port,) = free_ports(1)
            group.start("all", _server(cfg, port))
            metrics.append(f"http://127.0.0.1:{port}/metrics")
            group.wait_http(timeout=timeout)
        else:
            group.start("controller")
            group.wait_http(timeout=120)
            roles = {"encoder": counts[0], "transformer": counts[1], "decoder": counts[2]}
            for role, n in roles.items():
                for port in free_ports(n):
                    group.start(role, _server(cfg, port))
                    metrics.append(f"http://127.0.0.1:{port}/metrics")
            group.wait_workers(roles, timeout=timeout)
        yield group, metrics
    finally:
        group.stop(timeout=120)


def scrape(urls: list[str]) -> dict[tuple[str, str], float]:
    """Sum of ``diffring_stage_seconds`` per (role, step) over all endpoints."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for url in urls:
        text = httpx.get(url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "diffring_stage_seconds_sum":
                    key = (s.labels["role"], s.labels["step"])
                    out[key] = out.get(key, 0.0) + s.value
    return out


# ------------------------------------------------------------------------------- load
def post(url: str, kind: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/tasks/{kind}/", json=dict(body), timeout=60)
    r.raise_for_status()
    task_id = r.json()["task_id"]
    deadline = time.monotonic() + timeout
    while True:
        st: dict[str, Any] = httpx.get(f"{url}/v1/tasks/{task_id}/status", timeout=60).json()
        if st["status"] in ("completed", "failed", "cancelled"):
            if st["status"] != "completed":
                raise RuntimeError(f"task {task_id} {st['status']}: {st.get('error')}")
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {task_id} still {st['stage']} after {timeout} s")
        time.sleep(0.02)


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values), q))


def run_level(url: str, kind: str, body: dict[str, Any], conc: int, n: int, metrics: list[str],
              counts: dict[str, int], timeout: float, seed0: int) -> dict[str, Any]:
    before = scrape(metrics)
    lock = threading.Lock()
    next_index = [0]
    statuses: list[dict[str, Any]] = []

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                if i >= n:
                    return
                next_index[0] += 1
            st = post(url, kind, {**body, "prompt": f"bench request {seed0 + i}",
                                  "seed": seed0 + i}, timeout)
            with lock:
                statuses.append(st)

    with ThreadPoolExecutor(conc) as pool:
        for fut in [pool.submit(client) for _ in range(conc)]:
            fut.result()
    after = scrape(metrics)
    created = [s["created_at"] for s in statuses]
    ended = [s["end_time"] for s in statuses]
    lat = sorted(e - c for c, e in zip(created, ended, strict=True))
    wall = max(ended) - min(created)
    busy = {}
    for role, step, label in STAGES:
        spent = after.get((role, step), 0.0) - before.get((role, step), 0.0)
        busy[label] = spent / (wall * max(1, counts[role]))
    return {
        "concurrency": conc, "requests": n, "wall_s": wall, "qps": n / wall,
        "p50_s": percentile(lat, 50), "p95_s": percentile(lat, 95), "p99_s": percentile(lat, 99),
        "busy": busy, "latencies_s": lat,
        "stage_seconds": {f"{r}/{s}": after.get((r, s), 0.0) - before.get((r, s), 0.0)
                          for r, s in sorted(set(after) | set(before))},
    }


def fetch_pixels(url: str, task_id: str, kind: str) -> Any:
    import io

    import numpy as np

    data = httpx.get(f"{url}/v1/tasks/{task_id}/result", timeout=120).content
    if kind == "image":
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    from workers.models.media import read_mp4

    return read_mp4(data)


def run_mode(mode: str, args: argparse.Namespace, cfg: dict[str, Any], body: dict[str, Any],
             levels: list[tuple[int, int]], log_dir: Path) -> dict[str, Any]:
    kind = KIND[args.pipeline]
    counts = {"encoder": args.encoders, "transformer": args.transformers,
              "decoder": args.decoders}
    if mode == "baseline":
        counts = dict.fromkeys(counts, 1)
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-", dir=args.workdir))
    t0 = time.perf_counter()
    out: dict[str, Any] = {"mode": mode, "workers": counts, "levels": []}
    with running(mode, cfg, workdir, (args.encoders, args.transformers, args.decoders),
                 args.start_timeout) as (group, metrics):
        out["start_s"] = time.perf_counter() - t0
        log(f"{mode}: ready in {out['start_s']:.1f} s; warm-up x{args.warmup}")
        probe = None
        for i in range(args.warmup):
            # The first warm-up request has a fixed seed: its output is compared across modes.
            st = post(group.url, kind, {**body, "prompt": "bench fidelity probe", "seed": 7},
                      args.request_timeout) if i == 0 else post(
                group.url, kind, {**body, "prompt": f"warm-up {i}", "seed": 1000 + i},
                args.request_timeout)
            if i == 0:
                probe = fetch_pixels(group.url, st["task_id"], kind)
        for conc, n in levels:
            group.check_alive()
            row = run_level(group.url, kind, body, conc, n, metrics, counts,
                            args.request_timeout, seed0=conc * 1000)
            log(f"{mode} N={conc}: {n} requests, QPS {row['qps']:.3f}, "
                f"P50 {row['p50_s']:.2f} s, DiT busy {row['busy']['DiT']:.1%}")
            out["levels"].append(row)
    for svc in group.services:
        dest = log_dir / f"{mode}-{svc.log_path.name}"
        dest.write_bytes(svc.log_path.read_bytes())
    out["probe"] = probe
    return out


# ------------------------------------------------------------------------------- report
def table(results: list[dict[str, Any]]) -> str:
    head = ("| mode | N | requests | QPS | P50 s | P95 s | P99 s | enc busy | DiT busy | "
            "VAE busy | media busy |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for res in results:
        for row in res["levels"]:
            b = row["busy"]
            lines.append(
                f"| {res['label']} | {row['concurrency']} | {row['requests']} | "
                f"{row['qps']:.3f} | {row['p50_s']:.2f} | {row['p95_s']:.2f} | "
                f"{row['p99_s']:.2f} | {b['enc']:.0%} | {b['DiT']:.0%} | {b['VAE']:.0%} | "
                f"{b['media']:.0%} |")
    if len(results) == 2:
        base, dis = results
        for rb, rd in zip(base["levels"], dis["levels"], strict=True):
            lines.append(
                f"| **ratio** disagg/baseline | {rb['concurrency']} | | "
                f"**{rd['qps'] / rb['qps']:.2f}** | {rd['p50_s'] / rb['p50_s']:.2f} | "
                f"{rd['p95_s'] / rb['p95_s']:.2f} | {rd['p99_s'] / rb['p99_s']:.2f} | | | | |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_qps, ax_p95) = plt.subplots(1, 2, figsize=(10, 4))
    for res in results:
        ns = [r["concurrency"] for r in res["levels"]]
        ax_qps.plot(ns, [r["qps"] for r in res["levels"]], marker="o", label=res["label"])
        ax_p95.plot(ns, [r["p95_s"] for r in res["levels"]], marker="o", label=res["label"])
    for ax, name in ((ax_qps, "QPS (requests / s)"), (ax_p95, "P95 latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N concurrent requests")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    try:
        import torch

        info["torch"] = torch.__version__
        if args.device.startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
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


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pipeline", choices=sorted(TINY_SIZE), help="default: the --arch's")
    ap.add_argument("--models", type=Path, default=ROOT / "out" / "tiny-models",
                    help="tiny-model root (built there if missing); ignored with --arch")
    ap.add_argument("--model-path", type=Path, help="a model folder to serve as is")
    ap.add_argument("--arch", choices=("wan-1.3b", "wan-14b", "qwen-image"),
                    help="build a real-size random-weight model of this architecture")
    ap.add_argument("--arch-dir", type=Path, default=Path("/tmp/diffring-real"))
    ap.add_argument("--layers", type=int, help="--arch: DiT depth (default: the published)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    ap.add_argument("--modes", default="baseline,disagg")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests", default="auto",
                    help="requests per level: a list matching --concurrency, or 'auto' "
                         "(2N, at least 2)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests per mode")
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--transformers", type=int, default=1)
    ap.add_argument("--decoders", type=int, default=1)
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="service config override for every service of both modes, e.g. "
                         "--set cfg_batch=true --set 'warmup_shapes=[\"480x832x81\"]'")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_serving")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--request-timeout", type=float, default=1800)
    ap.add_argument("--keep-logs", action="store_true", help="OUT/bench_serving_logs.tar.gz")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.arch:
        import real_models

        args.pipeline = args.pipeline or real_models.PIPELINE[args.arch]
    args.pipeline = args.pipeline or "qwen_t2i"
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    conc = [int(c) for c in args.concurrency.split(",")]
    if args.requests == "auto":
        reqs = [max(2, 2 * c) for c in conc]
    else:
        reqs = [int(r) for r in args.requests.split(",")]
        if len(reqs) != len(conc):
            raise SystemExit("--requests needs one count per --concurrency level")
    levels = list(zip(conc, reqs, strict=True))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)

    built: dict[str, Any] | None = None
    if args.model_path is not None:
        model = args.model_path
    elif args.arch:
        import real_models

        model = args.arch_dir / (args.arch + (f"-l{args.layers}" if args.layers else ""))
        log(f"building {args.arch} in {model} on {args.device} ({dtype})")
        # In a child process: the builder's GPU memory is gone before the services start.
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "real_models.py"), "--arch", args.arch,
             "--out", str(model), "--device", args.device, "--dtype", dtype]
            + (["--layers", str(args.layers)] if args.layers else []),
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"building {args.arch} failed:\n{proc.stderr[-3000:]}")
        built = json.loads(proc.stdout.strip().splitlines()[-1])
        log(f"built: {built}")
    else:
        import make_tiny_models

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model = make_tiny_models.build_task(args.models, args.pipeline, seed=0)

    sizes = REAL_SIZE if args.arch else TINY_SIZE
    height, width, frames = sizes[args.pipeline]
    height, width = args.height or height, args.width or width
    frames = args.frames or frames
    body: dict[str, Any] = {"height": height, "width": width, "infer_steps": args.steps}
    if KIND[args.pipeline] == "video":
        body.update(target_video_length=frames, target_fps=16)
    overrides: dict[str, Any] = {"device": args.device, "dtype": dtype}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)

    results = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    for mode in args.modes.split(","):
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-cfg-", dir=args.workdir))
        cfg = group_config(args.pipeline, str(model), workdir, **overrides)
        res = run_mode(mode, args, cfg, body, levels, log_dir)
        workers = "" if mode == "baseline" else (
            f" {args.encoders}/{args.transformers}/{args.decoders}")
        res["label"] = ("baseline" if mode == "baseline" else "disagg") + workers
        results.append(res)

    fidelity = None
    probes = [r.pop("probe") for r in results]
    if len(probes) == 2 and probes[0] is not None and probes[1] is not None:
        import numpy as np

        a, b = (np.asarray(p, dtype=np.int16) for p in probes)
        fidelity = {"same_shape": a.shape == b.shape,
                    "max_abs_diff": int(np.abs(a - b).max()) if a.shape == b.shape else None,
                    "equal": bool(a.shape == b.shape and np.array_equal(a, b))}
    title = (f"{args.arch or args.pipeline} {height}x{width}"
             + (f"x{frames}" if KIND[args.pipeline] == "video" else "")
             + f", {args.steps} steps, {args.device} {dtype}")
    md = f"{title}\n\n{table(results)}\n"
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "title": title, "pipeline": args.pipeline, "model": str(model), "built": built,
        "request": body, "config_overrides": overrides, "levels": levels,
        "environment": environment(args), "results": results, "fidelity_probe": fidelity,
    }
    (args.out / "bench_serving.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "bench_serving.md").write_text(md)
    try:
        plot(results, args.out / "bench_serving.png", title)
    except ImportError as exc:
        log(f"no plot: {exc} (pip install matplotlib)")
    if args.keep_logs:
        with tarfile.open(args.out / "bench_serving_logs.tar.gz", "w:gz") as tar:
            tar.add(log_dir, arcname="logs")
    print(md)
    if fidelity is not None:
        print(f"fidelity probe (seed 7, baseline vs disagg): {fidelity}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
