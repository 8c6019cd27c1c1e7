"""The controller's ownership logic in this process: a coordinator over an in-process queue
or over in-process rings, on a clock the test drives, with the usual three workers. Every
coordinator made here is closed after its test (``tests/conftest.py``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rings.layout import HOLDER_LOCAL, RingLayout
from rings.ring import Ring
from rings.verbs import LocalVerbs, Region

if TYPE_CHECKING:
    from controller.ownership.coordinator import Coordinator
    from controller.ownership.registry import WorkerInfo
    from controller.tasks.tasks import Task

PIPE = "qwen_t2i"
"""The pipeline of the coordinators, tasks and workers made here."""

coordinators: list[Coordinator] = []
"""Coordinators made in-process by a test: each has a task-store writer thread, closed after
the test by ``tests/conftest.py``'s ``_close_coordinators`` (closing twice is harmless)."""


class Clock:
    """A monotonic clock a test drives instead of sleeping: ``clock()`` reads it,
    ``clock.advance(s)`` moves it on (leases and liveness then expire on the test's word)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class Rings:
    """The controller's three rings in one process: its own handles and a peer's."""

    def __init__(self, slots: int = 16) -> None:
        self.regions = {n: Region(RingLayout(n, slots, 1024)) for n in ("request", "phase1",
                                                                         "phase2")}
        self.local = {n: Ring(LocalVerbs(r, HOLDER_LOCAL)) for n, r in self.regions.items()}

    def peer(self, name: str, peer_id: int = 7) -> Ring:
        return Ring(LocalVerbs(self.regions[name], peer_id))


def make_coordinator(output_dir: Path | None, ring: Any, *, pipeline: str = PIPE,
                     census: Any = None, clock: Any = None, **config: Any) -> Coordinator:
    """An in-process coordinator over ``ring`` with its task store in
    ``<output_dir>/.journal`` (none without ``output_dir``), closed after the test."""
    from controller.config import CoordinatorConfig
    from controller.ownership.coordinator import Coordinator
    from controller.tasks.table import open_table

    co = Coordinator(
        CoordinatorConfig(pipeline=pipeline, output_dir=output_dir or Path("/nonexistent"),
                          **config),
        open_table(output_dir / ".journal" if output_dir else None),
        ring,
        census=census,
        clock=clock or time.monotonic,
    )
    coordinators.append(co)
    return co


def queue_coordinator(tmp_path: Path | None = None, slots: int = 8, lease: float = 15.0,
                      clock: Clock | None = None) -> Coordinator:
    """A coordinator whose request ring is an in-process queue (``slots`` items of 1 KiB)."""
    from controller.app import LocalQueue

    return make_coordinator(tmp_path, LocalQueue(slots, 1024), lease_timeout_s=lease,
                            max_pending=16, clock=clock)


def ring_coordinator(tmp: Path, rings: Rings | None = None, lease: float = 10.0,
                     clock: Clock | None = None, **kw: Any) -> Coordinator:
    """A coordinator over in-process :class:`Rings` (it reconciles against them), on the
    test's clock (a new :class:`Clock` unless given)."""
    from controller.ownership.reconcile import census

    rings = rings or Rings()
    local = rings.local
    return make_coordinator(tmp, local["request"], pipeline=PIPE, lease_timeout_s=lease,
                            max_pending=64, census=lambda: census(local),
                            clock=clock or Clock(), **kw)


def task(tid: str, priority: str = "normal") -> Task:
    """A task of :data:`PIPE` with the smallest request."""
    from controller.tasks.tasks import Task

    return Task(task_id=tid, kind="image", pipeline=PIPE, request={"task": PIPE, "prompt": "x"},
                save_result_path="", priority=priority)


def workers(co: Coordinator) -> tuple[WorkerInfo, WorkerInfo, WorkerInfo]:
    """An encoder, a transformer and a decoder, registered (segments s1, s2, s3)."""
    return (co.on_register("encoder", "e", 1, PIPE, "s1"),
            co.on_register("transformer", "t", 2, PIPE, "s2"),
            co.on_register("decoder", "d", 3, PIPE, "s3"))


def denoising(co: Coordinator, tid: str) -> tuple[WorkerInfo, WorkerInfo, WorkerInfo]:
    """A new task ``tid`` submitted, encoded, handed off and claimed by the DiT: the
    registered workers (as :func:`workers`)."""
    enc, dit, dec = workers(co)
    co.submit(task(tid))
    co.on_claim(enc, tid, 1)
    co.on_handoff(enc, tid, 1)
    co.on_claim(dit, tid, 1)
    return enc, dit, dec


def complete(co: Coordinator, w: WorkerInfo, tid: str, attempt: int, data: bytes) -> bool:
    """A decoder's completion of a PNG (a coroutine: the result file is written off the loop)."""
    return asyncio.run(co.on_complete(w, tid, attempt, "png", "image/png", data))
