#!/usr/bin/env python3
"""Serving throughput: the one-process baseline against a disaggregated group, N concurrent.

    # CPU, tiny models (built if missing)
    python -m scripts.bench.bench_serving --pipeline qwen_t2i --concurrency 1,2,4,8 --out out/bench
    # GPU, real-size random-weight architectures built on the fly
    python -m scripts.bench.bench_serving --arch wan-1.3b --device cuda:0 --dtype bfloat16 \\
        --steps 8 --concurrency 1,2,4,8 --out $OUT
    # Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline), two 1024x1024 input pictures
    python -m scripts.bench.bench_serving --arch qwen-image-edit-2511 --device cuda:0 \\
        --images 2 --steps 8 --concurrency 1,2,4 --out $OUT
    # scale-out over G GPUs (BENCHMARKS.md, "Multi-GPU scale-out")
    python -m scripts.bench.bench_serving --arch wan-1.3b --device cuda --gpus 8 --steps 8 \\
        --out $OUT
    # one request's DiT over several GPUs: a transformer group (docs/parallel.md)
    python -m scripts.bench.bench_serving --arch wan-14b --devices cuda:0,cuda:1,cuda:2 \\
        --dit-parallel cfg=2 --steps 4 --concurrency 1 --out $OUT

For each mode (``baseline``: ``run_service.py --service all``; ``disagg``: a controller plus
its workers, all on this machine, started by ``controller.group.LocalGroup``) it sends warm-up
requests, then for each N in ``--concurrency`` keeps N requests in flight (closed loop: a
client posts its next request when its last one completed) until ``--requests`` requests of
that level completed.

Scale-out (``--gpus G`` or ``--devices LIST``; devices and placements: ``bench_serving_layout``):
the baseline is G ``--service all`` replicas, one per device, request i going to replica
i mod G (client-side round robin); the disaggregated group places its workers by
``--placement`` (default: the encoder, the decoder and ``--transformers`` DiT workers on the
first device, ``--transformers`` DiT workers on every other one), each worker's ``device`` set
in its own config file. Before its G-replica levels the baseline measures one replica alone
(replica 0 at N = 2: one request running, one queued, so it never waits for the client;
``--single-requests`` requests) unless ``--single-qps`` gives that figure; a row's efficiency
is its QPS over G x that. N defaults to G, 2G, 4G.

Transformer groups (``--dit-parallel cfg=2,ulysses=2``, contracts/parallel.py): each DiT
worker of the placement is one group spanning G consecutive devices from its own (default
placement: the encoder and the decoder on d0, the group on d1..dG when the run has G + 1
devices, else everything from d0); the baseline is then one ``--service all`` on d0, the
one-device figure the group is compared to. The report adds the DiT's seconds per step and
the group's speedup over the baseline at each N.

Per level: requests, QPS, P50/P95/P99 latency, the busy fraction of each stage; scale-out adds
DiT busy per device, Mooncake bytes and milliseconds per Phase1 / Phase2 pull, their share of a
request, and the efficiency (``bench_serving_report`` defines each). Latency is the server's
(``created_at`` to ``end_time`` of the task's status); QPS is requests over the level's wall
time (first accepted to last completed).

Output: a markdown table on stdout and in ``OUT/bench_serving.md``, everything in
``OUT/bench_serving.json``, and ``OUT/bench_serving.png`` (QPS and P95 against N; scale-out:
the efficiency too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from contracts.pipelines import TASK_SPECS
from controller.group import LocalGroup, free_ports, group_config
from scripts import ROOT
from scripts.bench import bench_serving_layout as layout
from scripts.bench.bench_serving_layout import Endpoint
from scripts.bench.bench_serving_report import environment, level_stats, plot, scrape, table

# Default request geometry: tiny models on a CPU, real sizes with --arch.
TINY_SIZE = {"wan_t2v": (32, 32, 9), "qwen_t2i": (64, 64, 1), "qwen_i2i_plus": (32, 32, 1)}
REAL_SIZE = {"wan_t2v": (480, 832, 81), "qwen_t2i": (1024, 1024, 1),
             "qwen_i2i_plus": (1024, 1024, 1)}


# ------------------------------------------------------------------------------- groups
@dataclass
class Deployment:
    """A started mode: its processes, the front doors clients use, the metrics endpoints."""

    group: LocalGroup
    urls: list[str]
    endpoints: list[Endpoint]

    @property
    def url(self) -> str:
        return self.urls[0]


def wait_health(group: LocalGroup, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        group.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"front door {url} did not answer within {timeout} s")


@contextlib.contextmanager
def running(mode: str, cfg: dict[str, Any], workdir: Path, workers: list[tuple[str, int]],
            devices: list[str], timeout: float, dit: tuple[str, int] | None = None
            ) -> Iterator[Deployment]:
    """Start a baseline (one ``--service all`` replica per device) or a disaggregated group
    (a controller and ``workers``: (role, device index)); yields it once all of it is up.
    ``dit``: (layout, devices) of each DiT worker as a transformer group (``--dit-parallel``)."""
    group = LocalGroup(cfg, workdir)
    host = cfg["server"]["host"]
    parallel, span = dit or (None, 1)
    urls: list[str] = []
    endpoints: list[Endpoint] = []
    try:
        if mode == "baseline":
            # Replica 0 keeps the config's port (group.url); each has its own results folder
            # (the task journal lives there).
            ports = [cfg["server"]["port"], *free_ports(len(devices) - 1, host)]
            for i, (dev, port) in enumerate(zip(devices, ports, strict=True)):
                (mport,) = free_ports(1, host)
                group.start("all", {"device": dev, "output_dir": str(workdir / f"results-{i}"),
                                    "server": {"port": port, "metric_port": mport}})
                urls.append(f"http://{host}:{port}")
                endpoints.append(Endpoint(f"http://{host}:{mport}/metrics", "all", i))
            for url in urls:
                wait_health(group, url, timeout)
        else:
            group.start("controller")
            group.wait_http(timeout=120)
            urls.append(group.url)
            for role, index in workers:
                (mport,) = free_ports(1, host)
                extra: dict[str, Any] = {"device": devices[index],
                                         "server": {"metric_port": mport}}
                if role == "transformer" and span > 1:
                    extra["devices"] = devices[index:index + span]
                    extra["transformer"] = {"parallel": parallel}
                group.start(role, extra)
                endpoints.append(Endpoint(f"http://{host}:{mport}/metrics", role, index))
            group.wait_workers(layout.counts(workers), timeout=timeout)
        yield Deployment(group, urls, endpoints)
    finally:
        group.stop(timeout=120)


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


def closed_loop(urls: list[str], kind: str, body: Mapping[str, Any], conc: int, n: int,
                timeout: float, seed0: int, prompt: str) -> list[dict[str, Any]]:
    """``n`` requests, ``conc`` in flight; request i goes to ``urls[i % len(urls)]``."""
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
            st = post(urls[i % len(urls)], kind,
                      {**body, "prompt": f"{prompt} {seed0 + i}", "seed": seed0 + i}, timeout)
            with lock:
                statuses.append(st)

    with ThreadPoolExecutor(conc) as pool:
        for fut in [pool.submit(client) for _ in range(conc)]:
            fut.result()
    return statuses


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values), q))


def run_level(dep: Deployment, urls: list[str], kind: str, body: dict[str, Any], conc: int,
              n: int, active: list[int], n_devices: int, timeout: float,
              seed0: int) -> dict[str, Any]:
    before = scrape(dep.endpoints)
    statuses = closed_loop(urls, kind, body, conc, n, timeout, seed0, "bench request")
    after = scrape(dep.endpoints)
    created = [s["created_at"] for s in statuses]
    ended = [s["end_time"] for s in statuses]
    lat = sorted(e - c for c, e in zip(created, ended, strict=True))
    wall = max(ended) - min(created)
    return {
        "concurrency": conc, "requests": n, "wall_s": wall, "qps": n / wall,
        "p50_s": percentile(lat, 50), "p95_s": percentile(lat, 95), "p99_s": percentile(lat, 99),
        "mean_s": statistics.fmean(lat), "latencies_s": lat,
        **level_stats(dep.endpoints, before, after, active, wall, n_devices),
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


@dataclass(frozen=True)
class Plan:
    """Where a run's services go: its devices and the disaggregated workers' placement."""

    devices: list[str]
    workers: list[tuple[str, int]]
    scale_out: bool
    dit_parallel: str | None = None
    """The DiT workers' transformer-group layout (``--dit-parallel``), None: one device."""
    dit_span: int = 1
    """Devices per DiT worker (the layout's size)."""

    @property
    def baseline_devices(self) -> list[str]:
        """One ``--service all`` replica per device; against a group, one on d0."""
        return self.devices[:1] if self.dit_span > 1 else self.devices


def _level_log(mode: str, row: dict[str, Any]) -> None:
    dits = " ".join("-" if b is None else f"{b:.0%}" for b in row["dit_busy_by_device"])
    log(f"{row.get('label', mode)} N={row['concurrency']}: {row['requests']} requests, "
        f"QPS {row['qps']:.3f}, P50 {row['p50_s']:.2f} s, DiT busy {row['busy']['DiT']:.1%} "
        f"(by device: {dits})")


def run_mode(mode: str, args: argparse.Namespace, cfg: dict[str, Any], body: dict[str, Any],
             levels: list[tuple[int, int]], log_dir: Path, plan: Plan) -> dict[str, Any]:
    kind = TASK_SPECS[args.pipeline].output
    g = len(plan.devices)
    counts = dict.fromkeys(layout.ROLES, len(plan.baseline_devices)) if mode == "baseline" \
        else layout.counts(plan.workers)
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-", dir=args.workdir))
    t0 = time.perf_counter()
    out: dict[str, Any] = {"mode": mode, "workers": counts, "levels": []}
    probe = None
    devices = plan.baseline_devices if mode == "baseline" else plan.devices
    dit = (plan.dit_parallel, plan.dit_span) if plan.dit_parallel else None
    with running(mode, cfg, workdir, plan.workers, devices, args.start_timeout,
                 dit=dit) as dep:
        out["start_s"] = time.perf_counter() - t0
        log(f"{mode}: ready in {out['start_s']:.1f} s; warm-up x{args.warmup}")
        if args.warmup > 0:
            # The first warm-up request has a fixed seed: its output is compared across modes.
            st = post(dep.url, kind, {**body, "prompt": "bench fidelity probe", "seed": 7},
                      args.request_timeout)
            probe = fetch_pixels(dep.url, st["task_id"], kind)
            # The rest: --warmup per replica / per DiT worker, as many at once, so that each
            # one has run a request before the levels (the probe went to replica 0).
            width = len(dep.urls) if mode == "baseline" else counts["transformer"]
            if args.warmup * width > 1:
                closed_loop(dep.urls[1:] + dep.urls[:1], kind, body, width,
                            args.warmup * width - 1, args.request_timeout, 1000, "warm-up")
        everyone = list(range(len(dep.endpoints)))
        if plan.scale_out and mode == "baseline" and args.single_qps is None:
            row = run_level(dep, [dep.url], kind, body, 2, args.single_requests, [0], g,
                            args.request_timeout, seed0=500)
            row.update(single=True, label="baseline x1")
            _level_log(mode, row)
            out["levels"].append(row)
        for conc, n in levels:
            dep.group.check_alive()
            row = run_level(dep, dep.urls, kind, body, conc, n, everyone, g,
                            args.request_timeout, seed0=conc * 1000)
            compute = row["stage_seconds"].get("stage/transformer/compute")
            if compute:
                row["dit_s_per_step"] = compute / (n * args.steps)
            _level_log(mode, row)
            out["levels"].append(row)
    for svc in dep.group.services:
        dest = log_dir / f"{mode}-{svc.log_path.name}"
        dest.write_bytes(svc.log_path.read_bytes())
    out["probe"] = probe
    return out


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
    for (mode, conc), value in sorted(p50.items()):
        base = p50.get(("baseline", conc))
        if mode == "disagg" and base:
            lines.append(f"- N={conc}: group speedup {base / value:.2f}x (P50 {base:.2f} s "
                         f"one device, {value:.2f} s group)")
    return "\n".join(lines) + "\n"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pipeline", choices=sorted(TINY_SIZE), help="default: the --arch's")
    ap.add_argument("--models", type=Path, default=ROOT / "out" / "tiny-models",
                    help="tiny-model root (built there if missing); ignored with --arch")
    ap.add_argument("--model-path", type=Path, help="a model folder to serve as is")
    ap.add_argument("--arch", choices=("wan-1.3b", "wan-14b", "qwen-image",
                                       "qwen-image-edit-2511"),
                    help="build a real-size random-weight model of this architecture")
    ap.add_argument("--arch-dir", type=Path, default=Path("/tmp/diffring-real"))
    ap.add_argument("--layers", type=int, help="--arch: DiT depth (default: the published)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (with --gpus: the "
                    "first of G)")
    ap.add_argument("--gpus", type=int, help="scale out over G devices: cuda:N..cuda:N+G-1 "
                    "from --device cuda:N, or G x cpu from --device cpu")
    ap.add_argument("--devices", help="scale out over these devices, e.g. cuda:0,cuda:1 or "
                    "cpu,cpu (instead of --gpus)")
    ap.add_argument("--placement", help="scale-out: the disaggregated workers per device "
                    "index, e.g. '0:e+d,1-7:t' (default: 0:e+t+d, one t on each other device; "
                    "see scripts/bench/bench_serving_layout.py)")
    ap.add_argument("--single-qps", type=float, help="scale-out: the one-replica baseline QPS "
                    "to compute the efficiency against, instead of measuring it")
    ap.add_argument("--single-requests", type=int, default=4,
                    help="scale-out: requests of the one-replica baseline level (at N = 2)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    ap.add_argument("--modes", default="baseline,disagg")
    ap.add_argument("--concurrency", help="N per level (default 1,2,4,8; scale-out: G,2G,4G)")
    ap.add_argument("--requests", default="auto",
                    help="requests per level: a list matching --concurrency, or 'auto' "
                         "(2N, at least 2)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="warm-up requests per mode and per replica / DiT worker")
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--transformers", type=int, default=1,
                    help="DiT workers (scale-out: per device)")
    ap.add_argument("--decoders", type=int, default=1)
    ap.add_argument("--dit-parallel", metavar="LAYOUT",
                    help="each DiT worker a transformer group, e.g. cfg=2, ulysses=2, "
                         "cfg=2,ulysses=2 (docs/parallel.md); the baseline: one device")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--images", type=int, default=2, help="input pictures per request of an "
                    "image-conditioned pipeline, each of the output's size (default 2: a "
                    "multi-image edit; 1 for the one-image pipelines)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="service config override for every service of both modes, e.g. "
                         "--set cfg_batch=true --set 'warmup_shapes=[\"480x832x81\"]'")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_serving")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--request-timeout", type=float, default=1800)
    ap.add_argument("--keep-logs", action="store_true", help="OUT/bench_serving_logs.tar.gz")
    return ap.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """Devices and placement from the command line; refuses a GPU run asking for more CUDA
    devices than the machine has before anything is built or started."""
    devices = layout.device_list(args.device, args.gpus, args.devices)
    span, dit = 1, None
    if args.dit_parallel:
        from contracts.errors import ConfigError
        from contracts.parallel import ParallelLayout

        try:
            parsed = ParallelLayout.parse(args.dit_parallel)
        except ConfigError as exc:
            raise SystemExit(f"--dit-parallel: {exc}") from None
        span, dit = parsed.size, str(parsed)
    scale_out = span == 1 and (args.gpus is not None or args.devices is not None
                               or args.placement is not None)
    layout.check_devices(devices)
    if args.single_requests < 2:
        raise SystemExit("--single-requests must be at least 2")
    if args.single_qps is not None and args.single_qps <= 0:
        raise SystemExit("--single-qps must be a positive QPS")
    spec = args.placement or layout.default_placement(
        len(devices), args.encoders, args.transformers, args.decoders, span)
    return Plan(devices, layout.parse_placement(spec, len(devices), span), scale_out, dit, span)


def build_model(args: argparse.Namespace, device: str, dtype: str) -> tuple[Path, Any]:
    if args.model_path is not None:
        return args.model_path, None
    if not args.arch:
        from modelkit.tiny import build_task

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return build_task(args.models, args.pipeline, seed=0), None
    model = args.arch_dir / (args.arch + (f"-l{args.layers}" if args.layers else ""))
    log(f"building {args.arch} in {model} on {device} ({dtype})")
    # In a child process: the builder's GPU memory is gone before the services start.
    proc = subprocess.run(
        [sys.executable, "-m", "modelkit.real", "--arch", args.arch,
         "--out", str(model), "--device", device, "--dtype", dtype]
        + (["--layers", str(args.layers)] if args.layers else []),
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"building {args.arch} failed:\n{proc.stderr[-3000:]}")
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"built: {built}")
    return model, built


def efficiency(results: list[dict[str, Any]], plan: Plan,
               given: float | None) -> dict[str, Any] | None:
    """The one-replica QPS (given, or the baseline's measured level) and each other row's
    QPS over G x it, written into the rows."""
    qps, source = given, "--single-qps"
    if qps is None:
        rows = [r for res in results for r in res["levels"] if r.get("single")]
        if not rows:
            log("no one-replica baseline (mode baseline not run, no --single-qps): no efficiency")
            return None
        qps, source = rows[0]["qps"], "measured (baseline x1 row)"
    reference = len(plan.devices) * qps
    for res in results:
        for row in res["levels"]:
            if not row.get("single"):
                row["efficiency"] = row["qps"] / reference
    return {"single_replica_qps": qps, "source": source, "devices": len(plan.devices),
            "reference_qps": reference}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    g = len(plan.devices)
    if args.arch:
        from modelkit import real as real_models

        args.pipeline = args.pipeline or real_models.PIPELINE[args.arch]
    args.pipeline = args.pipeline or "qwen_t2i"
    device = plan.devices[0]
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    default_conc = f"{g},{2 * g},{4 * g}" if plan.scale_out else "1,2,4,8"
    conc = [int(c) for c in (args.concurrency or default_conc).split(",")]
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
    model, built = build_model(args, device, dtype)

    sizes = REAL_SIZE if args.arch else TINY_SIZE
    height, width, frames = sizes[args.pipeline]
    height, width = args.height or height, args.width or width
    frames = args.frames or frames
    body: dict[str, Any] = {"height": height, "width": width, "infer_steps": args.steps}
    if TASK_SPECS[args.pipeline].output == "video":
        body.update(target_video_length=frames, target_fps=16)
    spec = TASK_SPECS[args.pipeline]
    if spec.needs_image:
        from scripts.bench.bench_inputs import input_images

        body["image_path"] = input_images(args.images if spec.multi_image else 1, height,
                                          width)
    overrides: dict[str, Any] = {"device": device, "dtype": dtype}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)

    results = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    counts = layout.counts(plan.workers)
    for mode in args.modes.split(","):
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-cfg-", dir=args.workdir))
        cfg = group_config(args.pipeline, str(model), workdir, **overrides)
        res = run_mode(mode, args, cfg, body, levels, log_dir, plan)
        if mode == "baseline":
            res["label"] = f"baseline x{g}" if plan.scale_out else "baseline"
        else:
            res["label"] = "disagg " + "/".join(str(counts[r]) for r in layout.ROLES)
            if plan.dit_parallel:
                res["label"] += f" DiT {plan.dit_parallel}"
        results.append(res)

    fidelity = None
    probes = {r["mode"]: r.pop("probe") for r in results}
    if probes.get("baseline") is not None and probes.get("disagg") is not None:
        import numpy as np

        a, b = (np.asarray(probes[m], dtype=np.int16) for m in ("baseline", "disagg"))
        fidelity = {"same_shape": a.shape == b.shape,
                    "max_abs_diff": int(np.abs(a - b).max()) if a.shape == b.shape else None,
                    "equal": bool(a.shape == b.shape and np.array_equal(a, b))}
    scaling = efficiency(results, plan, args.single_qps) if plan.scale_out else None
    title = (f"{args.arch or args.pipeline} {height}x{width}"
             + (f"x{frames}" if TASK_SPECS[args.pipeline].output == "video" else "")
             + f", {args.steps} steps, {device} {dtype}")
    if plan.scale_out:
        title += (f"; {g} devices ({', '.join(f'd{i}={d}' for i, d in enumerate(plan.devices))})"
                  f"; disagg: {layout.describe(plan.workers)}")
    md = f"{title}\n\n{table(results, plan.devices if plan.scale_out else None)}\n"
    if scaling is not None:
        md += (f"\neff = QPS / ({g} x {scaling['single_replica_qps']:.3f}), one-replica "
               f"baseline QPS {scaling['source']}\n")
    if plan.dit_parallel:
        title += (f"; DiT group {plan.dit_parallel} over {plan.dit_span} devices "
                  f"({layout.describe(plan.workers)}), baseline on {plan.devices[0]}")
        md = f"{title}\n\n{table(results, None)}\n\n{group_lines(results)}"
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "title": title, "pipeline": args.pipeline, "model": str(model), "built": built,
        "request": body, "config_overrides": overrides, "levels": levels,
        "devices": plan.devices, "placement": plan.workers, "scaling": scaling,
        "environment": environment(plan.devices), "results": results,
        "fidelity_probe": fidelity,
    }
    (args.out / "bench_serving.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "bench_serving.md").write_text(md)
    try:
        plot(results, args.out / "bench_serving.png", title,
             scaling["reference_qps"] if scaling else None)
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
