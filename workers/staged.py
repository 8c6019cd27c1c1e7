"""What a producer (encoder, transformer) staged in its pool for the next stage.

A published task's outputs live only in this worker's pool until the consumer pulls them.
The consumer releases each buffer after its pull, but only the controller knows when no
consumer ever will (the task ended, the attempt was superseded, or it is already past the
consumer): it says so in a heartbeat reply (``drop``), and the producer frees those copies
itself instead of leaking pool memory. A draining producer stays until its book is empty.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tensorplane.descriptor import TensorDescriptor

Key = tuple[str, int]
"""(task_id, attempt)"""


class StagedOutputs:
    """The book of staged outputs, shared by the pull loop (which adds to it and drops a
    failed attempt's), the heartbeat thread (which reports it and drops what the controller
    names) and the drain (which waits for it to empty)."""

    def __init__(self, free: Callable[[list[TensorDescriptor]], None]) -> None:
        self._free = free
        """Gives descriptors' buffers back to the pool (called outside the lock)."""
        self._by_key: dict[Key, list[TensorDescriptor]] = {}
        self._cond = threading.Condition()

    def put(self, key: Key, descs: list[TensorDescriptor]) -> None:
        """Record ``key``'s staged outputs."""
        with self._cond:
            # The same attempt again: a restarted controller numbers attempts from its
            # journal, so it can hand out one this worker staged for its predecessor. That
            # copy is nobody's now; keeping it unreferenced would leak it.
            stale = self._by_key.pop(key, [])
            self._by_key[key] = descs
        if stale:
            self._free(stale)

    def drop(self, pred: Callable[[Key], bool]) -> None:
        """Free the outputs of every key ``pred`` accepts."""
        with self._cond:
            keys = [k for k in self._by_key if pred(k)]
            descs = [d for k in keys for d in self._by_key.pop(k)]
            if keys:
                self._cond.notify_all()
        if descs:
            self._free(descs)

    def drop_keys(self, keys: set[Key]) -> None:
        """Free the outputs of exactly these (task_id, attempt) keys."""
        if keys:
            self.drop(lambda key: key in keys)

    def drop_tasks(self, task_ids: set[str]) -> None:
        """Free the outputs of every attempt of ``task_ids``."""
        self.drop(lambda key: key[0] in task_ids)

    def keys(self) -> list[Key]:
        with self._cond:
            return list(self._by_key)

    def __len__(self) -> int:
        with self._cond:
            return len(self._by_key)

    def wait_pulled(self, timeout_s: float, heartbeating: Callable[[], bool]) -> bool:
        """Wait until nothing is staged (True), ``timeout_s`` passes, or ``heartbeating()``
        turns False: without heartbeats no ``drop`` can arrive."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._by_key and heartbeating():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # A drop notifies; the heartbeat thread's end does not, hence the cap.
                self._cond.wait(min(left, 0.1))
            return not self._by_key
