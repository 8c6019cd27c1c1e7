"""Measure tensor pull throughput between two processes over Mooncake on loopback.

Usage: ``python -m scripts.bench.bench_transfer [--protocol tcp] [--reps-scale 1.0]``

Starts a producer process (this script with ``--producer``) that stages uint8 tensors of
4 KiB, 1 MiB and 64 MiB, then, in this process, times for each size:

- ``read``: the bare Mooncake read into a registered pool block;
- ``pull``: ``pull_tensors`` end to end (alloc, read, checksum, copy out, free; no release,
  so the producer's blocks can be pulled again);
- ``crc32``: the checksum alone on the pulled bytes, and its cost relative to the read.

The producer is stopped by pid when the run ends. Runs in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from scripts import ROOT
from tensorplane.descriptor import TensorDescriptor, checksum
from tensorplane.engine import MooncakeSettings, TransferEngine
from tensorplane.handoff import pull_tensors, stage_tensors
from tensorplane.pool import StagingPool

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
REPS = {"4 KiB": 500, "1 MiB": 100, "64 MiB": 8}
POOL_BYTES = 160 << 20


def producer(protocol: str) -> None:
    """Stage one tensor per size, print descriptors, wait for stdin to close."""
    engine = TransferEngine(MooncakeSettings.resolve(None, os.environ, {"protocol": protocol}))
    engine.start()
    pool = StagingPool(POOL_BYTES)
    pool.start(engine)
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
               for k, n in SIZES.items()}
    descs = stage_tensors(pool, engine, tensors)
    print(json.dumps([d.to_dict() for d in descs]), flush=True)
    sys.stdin.read()
    pool.close()
    engine.close()


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--protocol", default="tcp", choices=("tcp", "rdma", "auto"))
    ap.add_argument("--reps-scale", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.producer:
        producer(args.protocol)
        return

    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.bench.bench_transfer", "--producer", "--protocol",
         args.protocol],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], 60)[0]:
            raise SystemExit("producer did not start within 60 s")
        descs = [TensorDescriptor.from_dict(d) for d in json.loads(proc.stdout.readline())]
        settings = MooncakeSettings.resolve(None, os.environ, {"protocol": args.protocol})
        engine = TransferEngine(settings)
        engine.start()
        pool = StagingPool(POOL_BYTES)
        pool.start(engine)
        print(f"protocol {engine.settings.protocol}, loopback, median of N reps")
        print(f"{'size':>7} {'N':>4} {'read MB/s':>10} {'read us':>9} {'pull MB/s':>10} "
              f"{'crc32 us':>9} {'crc32/read':>10}")
        for d in descs:
            reps = max(3, int(REPS[d.name] * args.reps_scale))
            block = pool.alloc(d.nbytes, timeout=1)
            local, view = pool.addr(block), pool.view(block)

            def read(d: TensorDescriptor = d, local: int = local) -> None:
                engine.read(d.segment, local, d.address, d.nbytes)

            def crc(d: TensorDescriptor = d, view: torch.Tensor = view) -> None:
                checksum(view, d.checksum_algo)

            def pull(d: TensorDescriptor = d) -> None:
                pull_tensors(engine, pool, [d], release=False)

            t_read = timed(read, reps)
            t_crc = timed(crc, reps)
            pool.free(block)
            t_pull = timed(pull, reps)
            print(f"{d.name:>7} {reps:>4} {d.nbytes / t_read / 1e6:>10.1f} "
                  f"{t_read * 1e6:>9.1f} {d.nbytes / t_pull / 1e6:>10.1f} "
                  f"{t_crc * 1e6:>9.1f} {t_crc / t_read:>10.2f}")
        pool.close()
        engine.close()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
