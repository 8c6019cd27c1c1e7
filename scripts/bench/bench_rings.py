#!/usr/bin/env python
"""Ring throughput and claim latency over tcp on loopback, against the raw verb floor.

    python -m scripts.bench.bench_rings --clients 1,4,16,32 [--seconds 3] [--capacity 128]

For each client count, in one run and against one host process per point:
  raw RT/s     round trips per second the host answers (each client: one 8-byte READ per
               round trip, back to back) — the floor every ring operation is built from;
  ring ops/s   push and pop operations per second (each client alternates push and pop;
               the ring is half full at the start, so pops rarely find it empty);
  RT/op        round trips per ring operation, measured (the protocol's minimum is 2);
  target       0.8 x raw RT/s / 2 (the issue's bar: 80% of the floor divided by the round
               trips on one operation's critical path);
  p50/p99      claim latency: from an operation's first verb to the answer of the round trip
               whose stamp CAS won (the claim that records the holder);
  ticket p99   from an operation's first verb to the answer of its ticket FAA (the position
               is this peer's from then on).
The load average of the machine is printed before and after (the machine is shared).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from rings.layout import OFF_HEAD
from rings.ring import Ring
from rings.soak import open_ring, start_ring_host, stop_process
from rings.verbs import READ

CRITICAL_PATH_RTS = 2


def _raw_client(port: int, cap: int, go: Any, seconds: float, out: mp.Queue) -> None:
    ring = open_ring(port, cap, 512)
    verbs = ring.verbs
    ops = [(READ, OFF_HEAD, 8)]
    out.put("ready")
    go.wait()
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        verbs.batch(ops)
        n += 1
    out.put((n / (time.perf_counter() - t0),))
    verbs.close()


def _ring_client(port: int, cap: int, go: Any, seconds: float, out: mp.Queue) -> None:
    ring: Ring = open_ring(port, cap, 512)
    item = {"task_id": "bench", "data": b"x" * 200}
    lat: list[float] = []
    tick: list[float] = []
    out.put("ready")
    go.wait()
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    rt0 = ring.stats.round_trips
    while time.perf_counter() < end:
        if ring.try_push(item) is None:
            lat.append(ring.stats.last_claim_s)
            tick.append(ring.stats.last_ticket_s)
            n += 1
        if ring.try_pop() is not None:
            lat.append(ring.stats.last_claim_s)
            tick.append(ring.stats.last_ticket_s)
            n += 1
    rate = n / (time.perf_counter() - t0)
    out.put((rate, n, ring.stats.round_trips - rt0, lat[::4], tick[::4]))
    ring.verbs.close()


def _run(kind: str, clients: int, capacity: int, seconds: float) -> list[Any]:
    host, port = start_ring_host(capacity, 512)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    go = ctx.Event()
    target = _raw_client if kind == "raw" else _ring_client
    procs = [
        ctx.Process(target=target, args=(port, capacity, go, seconds, q)) for _ in range(clients)
    ]
    try:
        if kind == "ring":
            # Keep the ring half full, so a pop measures claiming an item rather than
            # polling an empty ring.
            feeder = open_ring(port, capacity, 512)
            for _ in range(capacity // 2):
                feeder.push({"task_id": "prefill"}, timeout=5)
            feeder.verbs.close()
        for p in procs:
            p.start()
        for _ in procs:  # every client connected before anyone starts counting
            assert q.get(timeout=120) == "ready"
        go.set()
        results = [q.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(30)
        return results
    finally:
        for p in procs:
            stop_process(p)
        stop_process(host)


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--capacity", type=int, default=128)
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    header = (
        f"{'clients':>7} {'raw RT/s':>9} {'ring ops/s':>10} {'RT/op':>6} {'target':>8} "
        f"{'vs target':>9} {'p50 claim':>10} {'p99 claim':>10} {'p99 ticket':>10}"
    )
    print(_load())
    print(header)
    print("-" * len(header))
    for c in counts:
        raw = sum(r[0] for r in _run("raw", c, args.capacity, args.seconds))
        res = _run("ring", c, args.capacity, args.seconds)
        ops = sum(r[0] for r in res)
        rts = sum(r[2] for r in res)
        lat = sorted(x for r in res for x in r[3])
        tick = sorted(x for r in res for x in r[4])
        rt_per_op = rts / max(1, sum(r[1] for r in res))
        target = 0.8 * raw / CRITICAL_PATH_RTS
        p50 = statistics.median(lat) * 1e6 if lat else float("nan")
        p99 = lat[int(0.99 * (len(lat) - 1))] * 1e6 if lat else float("nan")
        t99 = tick[int(0.99 * (len(tick) - 1))] * 1e6 if tick else float("nan")
        print(
            f"{c:>7} {raw:>9.0f} {ops:>10.0f} {rt_per_op:>6.2f} {target:>8.0f} "
            f"{ops / target:>8.0%} {p50:>8.0f}us {p99:>8.0f}us {t99:>8.0f}us",
            flush=True,
        )
    print(_load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
