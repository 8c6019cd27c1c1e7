"""A staging pool's blocks: which extents are free, which release slots are taken, and the
tokens that let a consumer free a block with one remote write (the memory itself, its
registration and its addresses are :class:`tensorplane.pool.StagingPool`'s).
"""

from __future__ import annotations

import bisect
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final

from tensorplane.errors import PoolExhausted, RequestTooLarge

ALIGN: Final = 4096
"""Block alignment and size granule: page-aligned blocks suit DMA/RDMA and any dtype view."""


@dataclass(frozen=True)
class Block:
    """One live allocation: ``size`` bytes (``nbytes`` rounded up to ALIGN) at ``offset``."""

    offset: int
    nbytes: int
    size: int
    slot: int
    token: int


class BlockAllocator:
    """The blocks of one pool of ``capacity`` bytes, at most ``max_blocks`` live at once.

    Allocator: first-fit over a sorted list of free extents, coalescing on free. A worker
    holds a handful of tensors per task and a few tasks at once, with roughly FIFO
    lifetimes, so the list stays short (O(n) first-fit is cheap) and coalescing keeps
    fragmentation low without a buddy allocator's 2x rounding on multi-MiB latents.

    Each block also takes a *slot* whose u64 release word (``_words``, set once the pool has
    its memory) a consumer overwrites with the block's token to free it: :meth:`reclaim`
    frees the blocks whose word holds their token. All public methods are thread-safe.
    """

    def __init__(self, capacity: int, max_blocks: int) -> None:
        if capacity < ALIGN:
            raise ValueError(f"pool capacity must be at least {ALIGN} bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self.max_blocks = max(1, min(max_blocks, self.capacity // ALIGN))
        self._words: memoryview | None = None  # u64 release words, then the pool's outbox
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size) by offset
        self._free_slots = list(range(self.max_blocks - 1, -1, -1))
        self._live: dict[int, tuple[Block, float]] = {}  # slot -> (block, alloc time)
        self._quarantined: set[int] = set()
        # Tokens start at a random base so a release aimed at a previous incarnation of
        # this process (same addresses) cannot match; < 2**62 so they fit int64 words.
        self._next_token = (secrets.randbits(40) << 20) | 1
        self._counts = dict.fromkeys(
            ("allocs", "remote_releases", "local_frees", "alloc_timeouts", "release_failures"), 0
        )

    def try_alloc(self, nbytes: int) -> Block | None:
        """A block of at least ``nbytes``, or ``None`` when no extent or slot is free now."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = -(-nbytes // ALIGN) * ALIGN
        with self._cond:
            self._reclaim_locked()
            if not self._free_slots:
                return None
            for i, (off, ext) in enumerate(self._free):
                if ext >= size:
                    if ext == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, ext - size)
                    block = Block(off, nbytes, size, self._free_slots.pop(), self._next_token)
                    self._next_token += 1
                    self._live[block.slot] = (block, time.monotonic())
                    self._counts["allocs"] += 1
                    return block
            return None

    def alloc(self, nbytes: int, timeout: float, *, task_id: str | None = None) -> Block:
        """Like :meth:`try_alloc` but waits (backing off) up to ``timeout`` seconds for space:
        a full pool is backpressure. Raises :class:`RequestTooLarge` at once for a request
        that can never fit, :class:`PoolExhausted` when the timeout passes."""
        if nbytes > self.capacity:
            raise RequestTooLarge(
                f"staging request of {nbytes} bytes exceeds the whole pool ({self.capacity} "
                "bytes); raise the pool capacity", requested=nbytes, capacity=self.capacity,
                task_id=task_id,
            )
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while (block := self.try_alloc(nbytes)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                with self._cond:
                    self._counts["alloc_timeouts"] += 1
                    free = sum(ext for _, ext in self._free)
                    largest = max((ext for _, ext in self._free), default=0)
                    slots = len(self._free_slots)
                raise PoolExhausted(
                    f"staging pool full: {nbytes} bytes requested, {free} free (largest "
                    f"extent {largest}, {slots} free slots) after waiting {timeout:.1f}s",
                    requested=nbytes, free_bytes=free, task_id=task_id,
                )
            # Local frees notify; remote releases are only seen by polling, hence the cap.
            with self._cond:
                self._cond.wait(min(pause, left))
            pause = min(pause * 2, 0.05)
        return block

    def free(self, block: Block) -> bool:
        """Return ``block`` to the pool; ``False`` if it was already freed (harmless)."""
        with self._cond:
            ok = self._free_locked(block)
            if ok:
                self._counts["local_frees"] += 1
            return ok

    def quarantine(self, block: Block, pending: Future[int]) -> None:
        """Keep ``block`` allocated until ``pending`` (a transfer Mooncake still runs into
        it) completes, then free it: reusing it earlier could let a late write corrupt it."""
        with self._cond:
            self._quarantined.add(block.slot)

        def done(_fut: Future[int]) -> None:
            with self._cond:
                self._quarantined.discard(block.slot)
            self.free(block)

        pending.add_done_callback(done)

    def reclaim(self) -> int:
        """Free every block whose release word holds its token; returns how many."""
        with self._cond:
            return self._reclaim_locked()

    def _reclaim_locked(self) -> int:
        n = 0
        for slot, (block, _) in list(self._live.items()):
            if self._words is not None and self._words[slot] == block.token:
                n += self._free_locked(block)
        self._counts["remote_releases"] += n
        return n

    def _free_locked(self, block: Block) -> bool:
        live = self._live.get(block.slot)
        if live is None or live[0].token != block.token:
            return False
        del self._live[block.slot]
        self._free_slots.append(block.slot)
        off, size = block.offset, block.size
        i = bisect.bisect_left(self._free, (off, 0))
        if i < len(self._free) and off + size == self._free[i][0]:  # merge with next
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # merge with prev
            off, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free[i - 1] = (off, size)
        else:
            self._free.insert(i, (off, size))
        self._cond.notify_all()
        return True
