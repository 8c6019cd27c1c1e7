"""Progress reports leave the denoising loop at once, coalesce, and carry cancels back."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from contracts.messages import Op
from workers.progress import ProgressReporter


@dataclass
class FakeJob:
    task_id: str
    attempt: int = 1
    cancel: threading.Event = field(default_factory=threading.Event)


class SlowControl:
    """A control client whose calls block until released, recording what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.release = threading.Event()
        self.cancel: set[str] = set()

    def call(self, op: Op, **fields: Any) -> dict[str, Any]:
        assert op == Op.PROGRESS
        self.release.wait(10)
        self.sent.append((fields["task_id"], fields["step"]))
        return {"ok": True, "cancel": fields["task_id"] in self.cancel}


def wait_for(cond: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_reports_never_block_coalesce_and_cancel() -> None:
    ctl = SlowControl()
    rep = ProgressReporter(ctl, "t")  # type: ignore[arg-type]
    rep.start()
    try:
        job = FakeJob("a")
        t0 = time.monotonic()
        for k in range(1, 6):  # the first call is stuck in the "network"
            rep.report(job, k, 5)
        assert time.monotonic() - t0 < 0.5, "report() waited for the controller"
        time.sleep(0.1)
        ctl.release.set()
        wait_for(lambda: ctl.sent and ctl.sent[-1] == ("a", 5))
        # At most the step already in flight, then the newest: 2-4 were superseded by 5.
        assert ctl.sent[-1] == ("a", 5) and len(ctl.sent) <= 2

        ctl.cancel.add("b")
        cancelled = FakeJob("b")
        rep.report(cancelled, 1, 5)
        wait_for(cancelled.cancel.is_set)

        ctl.release.clear()
        gone = FakeJob("c")
        rep.report(FakeJob("x"), 1, 1)  # occupies the thread
        time.sleep(0.1)
        rep.report(gone, 1, 5)
        rep.forget(gone)  # handed off before its report left: never sent
        ctl.release.set()
        wait_for(lambda: ("x", 1) in ctl.sent)
        time.sleep(0.2)
        assert ("c", 1) not in ctl.sent
    finally:
        rep.close()
        ctl.release.set()
