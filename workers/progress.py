"""Progress reports off the denoising loop's critical path.

Each denoising step used to wait for a control round trip (``progress`` -> ``{cancel}``)
before the next step could start: on a GPU a bubble per step, on a loaded host several
milliseconds per request. The loop now only records the latest step; this reporter's thread
sends it, coalescing steps that come faster than round trips, and sets the job's cancel
flag when the controller answers ``cancel`` (the loop checks that flag before every step,
as before). Reports of a job that has moved on are dropped, and one that still arrives after
the handoff is refused harmlessly by the controller (the worker no longer holds the task).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from contracts.errors import DiffringError
from contracts.messages import Op
from workers.control import ControlClient

log = logging.getLogger("diffring.worker")


class _Job(Protocol):
    task_id: str
    attempt: int
    cancel: threading.Event


class ProgressReporter:
    """One thread per worker; :meth:`report` never blocks on the network."""

    def __init__(self, control: ControlClient, name: str) -> None:
        self._control = control
        self._cond = threading.Condition()
        self._pending: tuple[_Job, int, int] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"progress-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def report(self, job: _Job, step: int, steps: int) -> None:
        """Record that ``job`` finished ``step`` of ``steps`` (the newest report wins)."""
        with self._cond:
            self._pending = (job, step, steps)
            self._cond.notify()

    def forget(self, job: _Job) -> None:
        """Drop a report of ``job`` not sent yet (it is being handed off or failed)."""
        with self._cond:
            if self._pending is not None and self._pending[0] is job:
                self._pending = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                assert self._pending is not None
                job, step, steps = self._pending
                self._pending = None
            try:
                reply = self._control.call(
                    Op.PROGRESS, task_id=job.task_id, attempt=job.attempt, step=step,
                    steps=steps,
                )
            except DiffringError as exc:
                # The loop's own calls (handoff, fail) see a lost controller too, and
                # reconnect; a progress report is not worth more than a log line.
                log.warning("progress report of %s failed: %s", job.task_id, exc)
                continue
            if reply.get("cancel"):
                job.cancel.set()
