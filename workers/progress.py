"""Progress reports off the denoising loop's critical path.

Each denoising step used to wait for a control round trip (``progress`` -> ``{cancel}``)
before the next step could start: on a GPU a bubble per step, on a loaded host several
milliseconds per request. The loop now only queues the step; this reporter's thread sends
the reports in order, and sets the job's cancel flag when the controller answers ``cancel``
(the loop checks that flag before every step, as before). Before the task is handed off the
worker :meth:`~ProgressReporter.flush`-es the job, so every step is reported, in order, while
the worker still holds the task: at most the last report's round trip stays on the path.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Protocol

from contracts.errors import DiffringError
from contracts.messages import Progress, ProgressReply
from workers.control import ControlChannel
from workers.link import HeldTask

log = logging.getLogger("diffring.worker")


class _Job(HeldTask, Protocol):
    attempt: int


class ProgressReporter:
    """One thread per worker; :meth:`report` never blocks on the network."""

    def __init__(self, control: ControlChannel, name: str) -> None:
        self._control = control
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[_Job, int, int, str | None]] = collections.deque()
        self._sending: _Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"progress-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def report(self, job: _Job, step: int, steps: int, expert: str | None = None) -> None:
        """Queue "``job`` finished ``step`` of ``steps``" (on ``expert``) for sending."""
        with self._cond:
            self._queue.append((job, step, steps, expert))
            self._cond.notify_all()

    def flush(self, job: _Job, timeout: float = 30.0) -> bool:
        """Wait until every report of ``job`` has been answered (False after ``timeout``,
        or when the reporter is closed)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._sending is job or any(e[0] is job for e in self._queue):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)
        return True

    def forget(self, job: _Job) -> None:
        """Drop the reports of ``job`` not sent yet (it failed or was dropped)."""
        with self._cond:
            self._queue = collections.deque(e for e in self._queue if e[0] is not job)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, step, steps, expert = self._queue.popleft()
                self._sending = job
            try:
                reply = self._control.call(
                    Progress(task_id=job.task_id, attempt=job.attempt, step=step, steps=steps,
                             expert=expert),
                    ProgressReply)
                job.asked(cancel=reply.cancel, hand_back=reply.yield_)
            except DiffringError as exc:
                # The loop's own calls (handoff, fail) see a lost controller too and
                # reconnect; a progress report is not worth more than a log line.
                log.warning("progress report of %s failed: %s", job.task_id, exc)
            finally:
                with self._cond:
                    self._sending = None
                    self._cond.notify_all()
