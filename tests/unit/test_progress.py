"""Progress reports leave the denoising loop at once, in order, and carry cancels back."""

from __future__ import annotations

import threading
from typing import Any

from contracts.messages import Progress, ProgressReply
from workers.progress import ProgressReporter
from workers.worker import Job


def claimed(task_id: str) -> Job:
    """A claimed job of the worker's own kind, nothing staged."""
    return Job(task_id, 1, {})


class SlowControl:
    """A control client whose calls block until released, recording what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.release = threading.Event()
        self.cancel: set[str] = set()

    def call(self, msg: Any, reply: type[Any]) -> ProgressReply:
        assert isinstance(msg, Progress) and reply is ProgressReply
        assert self.release.wait(60), "the test never released the control call"
        self.sent.append((msg.task_id, msg.step))
        return ProgressReply(cancel=msg.task_id in self.cancel)


def test_reports_never_block_keep_their_order_flush_and_cancel() -> None:
    ctl = SlowControl()
    rep = ProgressReporter(ctl, "t")  # type: ignore[arg-type]
    rep.start()
    try:
        job = claimed("a")
        for k in range(1, 6):  # the first call is stuck in the "network"
            rep.report(job, k, 5)
        # Every report() returned while the controller had answered nothing: none waited.
        assert ctl.sent == []
        assert not rep.flush(job, timeout=0.2)  # still stuck
        threading.Timer(0.2, ctl.release.set).start()
        assert rep.flush(job, timeout=60)  # waits for the release
        assert ctl.sent == [("a", k) for k in range(1, 6)]  # every step, in order

        ctl.cancel.add("b")
        cancelled = claimed("b")
        rep.report(cancelled, 1, 5)
        assert rep.flush(cancelled) and cancelled.cancel.is_set()

        ctl.release.clear()
        busy, gone = claimed("x"), claimed("c")
        rep.report(busy, 1, 1)  # occupies the thread
        rep.report(gone, 1, 5)
        rep.forget(gone)  # failed before its report left: never sent
        after = claimed("d")
        rep.report(after, 1, 1)  # sent in order: once it is, c would have been before it
        ctl.release.set()
        assert rep.flush(busy) and rep.flush(gone) and rep.flush(after)
        assert ctl.sent[-2:] == [("x", 1), ("d", 1)] and ("c", 1) not in ctl.sent
    finally:
        rep.close()
        ctl.release.set()
