"""The chaos soak's attacks on a running group that are not kills: a worker frozen past its
lease, and a peer holding the cluster token that writes garbage over a ring item or pushes a
forged one. Each returns the line the soak's report keeps."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx

from contracts.config import DisaggConfig
from rings import payload as pl
from rings.layout import STAMPS_OFFSET, SlotState, unpack_stamp
from rings.ring import Ring
from rings.transports import connect


def freeze_a_busy_worker(url: str, seconds: float, stopped: Callable[[int | None], None]
                         ) -> str:
    """SIGSTOP a DiT or decoder worker holding a task for ``seconds`` (past its lease), then
    SIGCONT it: its task moves on and its late work must be refused. ``stopped`` is told the
    pid while it is frozen (and None after)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(f"{url}/v1/service/status", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            time.sleep(0.2)
            continue
        busy = [(w["pid"], w["current_tasks"][0]) for role in ("decoder", "transformer")
                for w in workers.get(role, []) if w["current_tasks"]]
        if busy:
            pid, tid = busy[0]
            stopped(pid)
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(seconds)  # the attack itself: a freeze longer than the lease
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                continue  # killed just before
            finally:
                stopped(None)
            return f"SIGSTOPped pid {pid} holding {tid} past its lease"
        time.sleep(0.05)
    return "SIGSTOP: found no busy worker"


def corrupt_ring(disagg: DisaggConfig, url: str, ring: str, pipeline: str,
                 forge_for: str | None) -> str:
    """As a peer holding the token: garbage over a published item of ``ring``, or (with
    ``forge_for``, a real task's id) a forged item of the wrong kind naming that task."""
    host, port = disagg.ring_address(ring)
    verbs = connect("tcp", host, port, layout=disagg.layout(ring), ring=ring,
                    token=disagg.cluster_token or "", peer_name="chaos-peer")
    try:
        lay = verbs.layout
        if forge_for is not None:
            att = httpx.get(f"{url}/v1/tasks/{forge_for}/status", timeout=5).json()["attempt"]
            Ring(verbs).try_push({"kind": "phase2", "task_id": forge_for, "attempt": att,
                                  "pipeline": pipeline, "request": {}})
            return f"forged a phase2 item for {forge_for} in ring {ring}"
        deadline = time.monotonic() + 20  # consumers leave items for ms at most
        while time.monotonic() < deadline:
            raw = verbs.read(STAMPS_OFFSET, 8 * lay.slot_count)
            for i in range(lay.slot_count):
                pos, state, _ = unpack_stamp(int.from_bytes(raw[8 * i: 8 * i + 8], "little"))
                if state == SlotState.PUBLISHED:
                    verbs.write(lay.payload_offset(pos) + pl.HEADER_SIZE, b"\xde\xad" * 8)
                    return f"corrupted position {pos} of ring {ring}"
        return f"ring {ring}: nothing published to corrupt"
    finally:
        verbs.close()
