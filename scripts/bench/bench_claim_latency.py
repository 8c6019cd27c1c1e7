#!/usr/bin/env python
"""Request-ring claim latency while 200 concurrent HTTP submissions arrive, before and after.

    python -m scripts.bench.bench_claim_latency [--before-rev REV] [--rounds 3] [--requests 200]

Starts a real controller (``run_service.py --service controller``, Qwen-Image-Edit, so every
submission carries an input image to decode and stage) from two source trees — this one
("after") and ``git archive REV`` ("before") — alternately, ``--rounds`` times each. Against
each controller:

  * a prober process joins the request ring with 16 peers; every 10 ms a push claim falls
    due (open loop) and a free peer makes it; its latency runs from when it fell due to the
    won CAS, so a stall of the controller's event loop (which serves the verbs) delays every
    claim due during it, as it would delay every worker's claims. After each push the peer
    pops twice (its items and the controller's task descriptors), so the ring never fills;
  * after a quiet window, ``--requests`` POSTs with a ``--image-side``-pixel RGB noise PNG
    go out at once (httpx, all concurrent), each with its own image bytes.

The controller (with its decoding processes) and the prober run at ``--nice`` (default -10
when run as root), so that other work on a shared machine disturbs both trees less.
Each tree runs with its own dependencies: the 'before' one without httptools (it did not
depend on it, so uvicorn parsed HTTP in pure Python; the script hides the package from it),
the 'after' one with it.

Printed per tree: claim latency p50 / p99 in the quiet window, p50 / p99 / p99.9 / max
during the burst (first POST sent to last answer), how long the burst took, answers by
status code, and the load average. The figures are medians over the rounds; the last row
is before / after.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import io
import json
import multiprocessing as mp
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from contracts.pipelines import task_spec
from launcher import free_ports
from rings.soak import stop_process
from scripts import ROOT

TOKEN = "bench-claim-latency-token"
EDIT = task_spec("qwen_i2i")  # every submission carries an input image to decode and stage
SLOTS, SLOT_SIZE = 256, 4096
PERIOD_S = 0.01
CONNECTIONS = 16
NICE = 0  # set from --nice


def _import_rings_from(repo: Path) -> None:
    """Make ``rings`` (and so each ``rings.*`` imported next) the package of tree ``repo``:
    the package is loaded from its folder there, and its submodules are found through the
    package's own ``__path__``."""
    for name in [m for m in sys.modules if m == "rings" or m.startswith("rings.")]:
        del sys.modules[name]
    folder = repo / "rings"
    spec = importlib.util.spec_from_file_location(
        "rings", folder / "__init__.py", submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rings"] = module
    spec.loader.exec_module(module)


def _prober(repo: str, port: int, stop: Any, ready: Any, out: Any, nice: int) -> None:
    """Open loop with concurrency: a claim falls due every PERIOD_S whether or not earlier
    ones were answered, and any of CONNECTIONS peers takes it; its latency runs from when it
    fell due to its won CAS. A closed loop (next claim when the last returns) would record a
    2 s stall as one slow sample among thousands (coordinated omission), and a single
    connection would take long to catch up afterwards; here every claim due during a stall
    waits for it, and no longer."""
    if nice:
        os.nice(nice)
    # The ring client of the tree under test: the ring layout changed between trees (v1 ->
    # v2 tickets), and a host refuses a peer of another layout version.
    _import_rings_from(Path(repo))
    from rings.layout import RingLayout
    from rings.ring import Ring
    from rings.transports import connect

    due_q: queue.SimpleQueue[float | None] = queue.SimpleQueue()
    samples: list[tuple[float, float]] = []
    lock = threading.Lock()
    offset = time.time() - time.perf_counter()

    def peer() -> None:
        verbs = connect("tcp", "127.0.0.1", port,
                        layout=RingLayout("request", SLOTS, SLOT_SIZE), ring="request",
                        token=TOKEN)
        ring = Ring(verbs)
        item = {"kind": "probe", "data": b"x" * 200}
        while (due := due_q.get()) is not None:
            ring.try_push(item)  # the claim measured
            done = time.perf_counter()
            for _ in range(2):  # keep the ring nearly empty (its items and the tasks)
                ring.try_pop()
            with lock:
                samples.append((due + offset, done - due))
        verbs.close()

    peers = [threading.Thread(target=peer, daemon=True) for _ in range(CONNECTIONS)]
    for t in peers:
        t.start()
    ready.set()
    due = time.perf_counter()
    while not stop.is_set():
        due += PERIOD_S
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        due_q.put(due)
    for _ in peers:
        due_q.put(None)
    for t in peers:
        t.join(60)
    out.put(samples)


def _png(side: int, seed: int) -> bytes:
    from PIL import Image

    rng = __import__("random").Random(seed)
    img = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


async def _burst(url: str, images: list[str]) -> tuple[float, float, dict[int, int]]:
    import httpx

    limits = httpx.Limits(max_connections=len(images), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as client:

        async def one(i: int, image: str) -> int:
            r = await client.post(f"{url}/v1/tasks/image/", json={
                "prompt": f"burst {i}", "image_path": image, "height": 64, "width": 64})
            return r.status_code

        t0 = time.time()
        codes = await asyncio.gather(*(one(i, im) for i, im in enumerate(images)))
        t1 = time.time()
    out: dict[int, int] = {}
    for c in codes:
        out[c] = out.get(c, 0) + 1
    return t0, t1, out


def _controller(repo: Path, work: Path, hide_httptools: bool
                ) -> tuple[subprocess.Popen[bytes], dict[str, int], Path]:
    ctl, req, p1, p2, http = free_ports(5)
    cfg = {
        "model_cls": EDIT.model_cls, "task": EDIT.task, "output_dir": str(work / "results"),
        "staging_pool_mb": 1024, "max_pending_tasks": 1024,
        "disagg_config": {
            "control_port": ctl, "rdma_request_handshake_port": req,
            "rdma_phase1_handshake_port": p1, "rdma_phase2_handshake_port": p2,
            "rdma_buffer_slots": SLOTS, "rdma_buffer_slot_size": SLOT_SIZE,
            "cluster_token": TOKEN, "ring_transport": "tcp",
        },
        "server": {"host": "127.0.0.1", "port": http},
    }
    path = work / "controller.json"
    path.write_text(json.dumps(cfg))
    log = work / "controller.log"
    path_ = str(repo)
    if hide_httptools:
        # The 'before' tree did not depend on httptools: uvicorn then parses HTTP in Python
        # (h11). A stand-in package that fails to import gives it the same fallback here.
        shim = work / "shim" / "httptools"
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("raise ImportError('not a dependency before')\n")
        path_ = f"{shim.parent}:{repo}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path_}
    proc = subprocess.Popen(
        [sys.executable, str(repo / "run_service.py"), "--service", "controller", "--config",
         str(path), "--log-level", "WARNING"],
        cwd=str(repo), env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.nice(NICE)) if NICE else None,
    )
    return proc, {"request": req, "http": http}, log


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"controller exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("controller did not come up")


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] if xs else float("nan")


def one_round(repo: Path, images: list[str], quiet_s: float, hide_httptools: bool
              ) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="claimbench-") as tmp:
        proc, ports, log = _controller(repo, Path(tmp), hide_httptools)
        url = f"http://127.0.0.1:{ports['http']}"
        ctx = mp.get_context("spawn")
        stop, ready, q = ctx.Event(), ctx.Event(), ctx.Queue()
        prober = ctx.Process(target=_prober,
                             args=(str(repo), ports["request"], stop, ready, q, NICE))
        try:
            _wait_http(url, proc, log)
            prober.start()
            if not ready.wait(60):
                raise RuntimeError("prober did not join the request ring")
            q0 = time.time()
            time.sleep(quiet_s)
            q1 = time.time()
            t0, t1, codes = asyncio.run(_burst(url, images))
            time.sleep(0.5)
            stop.set()
            samples = q.get(timeout=120)
            prober.join(30)
            load = open("/proc/loadavg").read().split()[:3]
        finally:
            stop.set()
            stop_process(prober)
            stop_process(proc)
    quiet = [lat for t, lat in samples if q0 <= t <= q1]
    burst = [lat for t, lat in samples if t0 <= t <= t1]
    return {
        "quiet_p50": statistics.median(quiet) * 1e3, "quiet_p99": _pct(quiet, 0.99) * 1e3,
        "burst_p50": statistics.median(burst) * 1e3, "burst_p99": _pct(burst, 0.99) * 1e3,
        "burst_p999": _pct(burst, 0.999) * 1e3, "burst_max": max(burst) * 1e3,
        "burst_s": t1 - t0,
        "codes": codes, "load": " ".join(load),
    }


def _fmt(key: str, value: float) -> str:
    if key == "burst_s":
        return f"{value:.1f} s"
    return f"{value:.2f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before-rev", default="2bc40cc",
                    help="git revision of the 'before' tree (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--image-side", type=int, default=512)
    ap.add_argument("--quiet-s", type=float, default=3.0)
    ap.add_argument("--trees", default="before,after", help="which trees to run")
    ap.add_argument("--nice", type=int, default=-10 if os.geteuid() == 0 else 0,
                    help="niceness of the controller and the prober (default: -10 as root): "
                         "on a shared machine the other users' load would otherwise decide "
                         "the figures; both trees get the same")
    args = ap.parse_args()
    global NICE
    NICE = args.nice
    before = Path(tempfile.mkdtemp(prefix="claimbench-before-"))
    archive = subprocess.run(["git", "archive", args.before_rev], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
    images = [base64.b64encode(_png(args.image_side, i)).decode()
              for i in range(args.requests)]
    print(f"{args.requests} concurrent POSTs, {args.image_side}x{args.image_side} noise PNGs "
          f"(~{len(images[0]) * 3 // 4 // 1024} KiB each); before = {args.before_rev}, "
          f"after = working tree; {args.rounds} round(s) each", flush=True)
    trees = {k: v for k, v in {"before": before, "after": ROOT}.items()
             if k in args.trees.split(",")}
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for name, repo in trees.items():
            res = one_round(repo, images, args.quiet_s, hide_httptools=name == "before")
            results[name].append(res)
            print(f"  round {r + 1} {name:>6}: " + ", ".join(
                f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in res.items()), flush=True)
    keys = ("quiet_p50", "quiet_p99", "burst_p50", "burst_p99", "burst_p999", "burst_max",
            "burst_s")
    print()
    print(f"| tree | {' | '.join(keys)} | answers | load average |")
    print(f"| --- | {' | '.join('---' for _ in keys)} | --- | --- |")
    med: dict[str, dict[str, float]] = {}
    for name, rs in results.items():
        med[name] = {k: statistics.median(x[k] for x in rs) for k in keys}
        codes = rs[-1]["codes"]
        print(f"| {name} | " + " | ".join(_fmt(k, med[name][k]) for k in keys)
              + f" | {codes} | {rs[-1]['load']} |")
    if len(med) == 2:
        print("| before / after | " + " | ".join(
            f"{med['before'][k] / med['after'][k]:.1f}x" for k in keys) + " | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
