"""Background media encoding for the decoder: a bounded queue in front of one thread.

The decoder's critical path is the VAE; writing an MP4 of 81 frames takes as long again on
the CPU. The decoder hands a finished decode to this pool -- its uint8 pixels, or for a
streamed Wan decode the MP4 whose writer is still finishing
(:meth:`~workers.models.base.DecoderAdapter.decode_media`) -- and claims its next task while
the file is encoded (or its encoding finished) and written here. The pool is bounded: at
most ``depth`` results are held (waiting or being encoded); while the pool is full the
decoder claims nothing (it waits for room), so pixels never pile up in memory and a Phase2
item it cannot start yet stays in the ring for another decoder.

One thread, on purpose: libx264 already runs one thread per core on one video, and two
videos encoded at once would only split the same cores while both finish later.

Ownership does not change: the task's lease stays with the decoder worker (the controller
renews every lease a worker holds at each of its heartbeats) until the job itself reports
the completion; if the worker dies first, the task goes back in play like any other it held.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("diffring.worker.encode")


class EncodePool:
    """At most ``depth`` jobs held at once, run one after the other on a background thread."""

    def __init__(self, depth: int, name: str = "encode") -> None:
        if depth < 1:
            raise ValueError(f"an encode pool needs depth >= 1, got {depth}")
        self.depth = depth
        self._slots = threading.BoundedSemaphore(depth)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._pending: set[Future[None]] = set()

    @property
    def held(self) -> int:
        """Jobs waiting or running."""
        with self._lock:
            return len(self._pending)

    def has_room(self) -> bool:
        return self.held < self.depth

    def wait_for_room(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until a job can be queued without waiting."""
        with self._room:
            return self._room.wait_for(lambda: len(self._pending) < self.depth, timeout)

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; waits while the pool is full (the caller checked :meth:`has_room`
        before claiming, so this wait is the exception). ``job`` must handle its own errors:
        anything it raises is logged here and dropped."""
        self._slots.acquire()
        fut = self._executor.submit(self._run, job)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:
            log.exception("background encode job failed")

    def _done(self, fut: Future[None]) -> None:
        self._slots.release()
        with self._room:
            self._pending.discard(fut)
            self._room.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every job queued so far has finished; False on timeout."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            try:
                fut.result(timeout=timeout)
            except TimeoutError:
                return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued (up to ``timeout``), then stop the thread."""
        self.join(timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
