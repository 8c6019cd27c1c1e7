"""Exactly-once soak of a ring: N producer and M consumer processes over a real transport.

Every item carries an id (producer index << 32 | sequence) and random bytes with their crc.
Producers push their items; when all producers are done the driver pushes one stop marker
per consumer (FIFO puts them behind every item); each consumer records what it popped.
The driver then checks that every pushed id was delivered exactly once with intact bytes.

Used by ``scripts/chaos/soak_rings.py`` (long runs) and by the test-suite (quick runs).
"""

from __future__ import annotations

import array
import multiprocessing as mp
import random
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rings.layout import RingLayout
from rings.ring import Ring
from rings.transports import connect

RING = "soak"
SOAK_TOKEN = "diffring-ring-soak"
"""The token of a soak's own ring host, which listens on 127.0.0.1 only (a cluster's token is
the service configuration's business, not the rings')."""


def start_ring_host(
    slots: int,
    slot_size: int = 512,
    *,
    claim_timeout: float = 30.0,
    scan_interval: float = 0.2,
    token: str = SOAK_TOKEN,
    name: str = RING,
) -> tuple[subprocess.Popen[str], int]:
    """Start ``python -m rings serve`` on 127.0.0.1, port chosen by the OS; (process, port)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rings",
            "serve",
            "--name",
            name,
            "--slots",
            str(slots),
            "--slot-size",
            str(slot_size),
            "--claim-timeout",
            str(claim_timeout),
            "--scan-interval",
            str(scan_interval),
            "--token",
            token,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"ring host did not start (said {line!r})")
    return proc, int(line.split()[1])


def stop_process(proc: subprocess.Popen[Any] | mp.process.BaseProcess, timeout: float = 10) -> None:
    """Stop a process we started, by its pid: terminate, then kill."""
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    else:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()


def open_ring(port: int, slots: int, slot_size: int, token: str = SOAK_TOKEN) -> Ring:
    verbs = connect(
        "tcp",
        "127.0.0.1",
        port,
        layout=RingLayout(RING, slots, slot_size),
        ring=RING,
        token=token,
    )
    return Ring(verbs)


def make_item(pid: int, seq: int, rng: random.Random, max_data: int) -> dict[str, Any]:
    data = rng.randbytes(rng.randint(0, max_data))
    return {"id": (pid << 32) | seq, "data": data, "crc": zlib.crc32(data)}


def _producer(
    port: int,
    slots: int,
    slot_size: int,
    index: int,
    count: int,
    seconds: float | None,
    max_data: int,
    out: str,
    token: str = SOAK_TOKEN,
) -> None:
    ring = open_ring(port, slots, slot_size, token)
    rng = random.Random(index)
    deadline = None if seconds is None else time.monotonic() + seconds
    seq = 0
    while (deadline is None and seq < count) or (
        deadline is not None and time.monotonic() < deadline
    ):
        ring.push(make_item(index, seq, rng, max_data), timeout=120)
        seq += 1
    Path(out).write_text(str(seq))
    ring.verbs.close()


def _consumer(port: int, slots: int, slot_size: int, out: str, token: str = SOAK_TOKEN) -> None:
    ring = open_ring(port, slots, slot_size, token)
    ids = array.array("Q")
    bad = 0
    while True:
        item = ring.pop(timeout=300)
        if item.get("stop"):
            break
        if zlib.crc32(item["data"]) != item["crc"]:
            bad += 1
        ids.append(item["id"])
    with open(out, "wb") as f:
        ids.tofile(f)
    Path(out + ".bad").write_text(str(bad))
    ring.verbs.close()


@dataclass
class SoakResult:
    producers: int
    consumers: int
    pushed: int
    delivered: int
    duplicates: int
    missing: int
    unexpected: int
    corrupt: int
    seconds: float
    items_per_s: float
    repairs: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            self.duplicates == 0
            and self.missing == 0
            and self.unexpected == 0
            and self.corrupt == 0
            and self.delivered == self.pushed
        )

    def report(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        return (
            f"exactly-once: {verdict}\n"
            f"producers={self.producers} consumers={self.consumers} pushed={self.pushed} "
            f"delivered={self.delivered} duplicates={self.duplicates} missing={self.missing} "
            f"unexpected={self.unexpected} corrupt={self.corrupt} "
            f"seconds={self.seconds:.2f} items/s={self.items_per_s:.0f}"
        )


def check_delivery(
    pushed_counts: dict[int, int], delivered: list[int], skip: set[int] | None = None
) -> tuple[int, int, int]:
    """(duplicates, missing, unexpected) of ``delivered`` against per-producer counts."""
    seen: dict[int, int] = {}
    for i in delivered:
        seen[i] = seen.get(i, 0) + 1
    duplicates = sum(n - 1 for n in seen.values() if n > 1)
    expected = {(p << 32) | s for p, n in pushed_counts.items() for s in range(n)}
    expected -= skip or set()
    missing = len(expected - seen.keys())
    unexpected = len(seen.keys() - expected)
    return duplicates, missing, unexpected


def run_soak(
    producers: int,
    consumers: int,
    items: int,
    capacity: int,
    *,
    seconds: float | None = None,
    slot_size: int = 512,
    max_data: int = 256,
    workdir: str | None = None,
) -> SoakResult:
    """Run one soak; every process started here is stopped here."""
    import tempfile

    ctx = mp.get_context("spawn")
    tmp = tempfile.TemporaryDirectory(dir=workdir)
    host, port = start_ring_host(capacity, slot_size)
    procs: list[mp.process.BaseProcess] = []
    try:
        per = [items // producers + (1 if i < items % producers else 0) for i in range(producers)]
        t0 = time.monotonic()
        cons = [
            ctx.Process(target=_consumer, args=(port, capacity, slot_size, f"{tmp.name}/c{i}"))
            for i in range(consumers)
        ]
        prods = [
            ctx.Process(
                target=_producer,
                args=(port, capacity, slot_size, i, per[i], seconds, max_data, f"{tmp.name}/p{i}"),
            )
            for i in range(producers)
        ]
        procs = [*cons, *prods]
        for p in procs:
            p.start()
        for p in prods:
            p.join()
        if any(p.exitcode != 0 for p in prods):
            raise RuntimeError(f"producer exit codes {[p.exitcode for p in prods]}")
        driver = open_ring(port, capacity, slot_size)
        for _ in range(consumers):
            driver.push({"stop": True}, timeout=120)
        for p in cons:
            p.join()
        elapsed = time.monotonic() - t0
        if any(p.exitcode != 0 for p in cons):
            raise RuntimeError(f"consumer exit codes {[p.exitcode for p in cons]}")
        pushed = {i: int(Path(f"{tmp.name}/p{i}").read_text()) for i in range(producers)}
        delivered: list[int] = []
        corrupt = 0
        for i in range(consumers):
            arr = array.array("Q")
            path = f"{tmp.name}/c{i}"
            with open(path, "rb") as f:
                arr.frombytes(f.read())
            delivered.extend(arr)
            corrupt += int(Path(path + ".bad").read_text())
        from rings.inspect import snapshot

        repairs = snapshot(driver.verbs)["repairs"]
        driver.verbs.close()
        dup, missing, unexpected = check_delivery(pushed, delivered)
        total = sum(pushed.values())
        return SoakResult(
            producers,
            consumers,
            total,
            len(delivered),
            dup,
            missing,
            unexpected,
            corrupt,
            elapsed,
            total / elapsed if elapsed else 0.0,
            repairs,
        )
    finally:
        for p in procs:
            stop_process(p)
        stop_process(host)
        tmp.cleanup()
