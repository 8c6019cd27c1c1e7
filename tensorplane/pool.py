"""The staging pool: one registered buffer per process, carved into blocks that producers
stage tensors in and consumers release with a one-sided write (protocol:
:mod:`tensorplane.handoff`).

A host pool is an anonymous ``mmap`` (page-aligned, untouched pages cost no memory), so a
process that moves host tensors never imports torch; a GPU pool, or a host pool that must be
pinned for CUDA copies, is a torch allocation.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from tensorplane.blocks import ALIGN, Block, BlockAllocator
from tensorplane.descriptor import CHECKSUM_CRC32, CHECKSUM_WSUM64, CHECKSUMS, TensorDescriptor
from tensorplane.errors import EngineError, TransferError
from tensorplane.transport import Transport

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "Block", "PoolStats", "StagingPool"]

log = logging.getLogger(__name__)
_DEVICE_RE: Final = re.compile(r"^(cpu|cuda(:\d+)?)$")

_WORD: Final = 8
_OUTBOX_WORDS: Final = 64
"""Source words for outgoing release writes; a ring so concurrent pulls don't share one."""


@dataclass(frozen=True)
class PoolStats:
    """Occupancy and event counters of a pool, for metrics."""

    capacity: int
    used_bytes: int
    free_bytes: int
    largest_free: int
    live_blocks: int
    max_blocks: int
    quarantined_blocks: int
    allocs: int
    remote_releases: int
    local_frees: int
    alloc_timeouts: int
    release_failures: int
    oldest_block_age_s: float
    device: str = "cpu"
    """Where the buffer lives: the device of the allocated tensor (``cuda:N``) once started,
    else the one asked for."""
    checksum_algo: str = ""
    """How tensors staged here are checksummed (``wsum64``: hashed on the GPU)."""


class StagingPool(BlockAllocator):
    """One bounded, registered buffer per process, carved into 4 KiB-aligned blocks
    (:class:`~tensorplane.blocks.BlockAllocator`: first-fit extents, at most ``max_blocks``
    live).

    Each block's release word lives in a separately registered host array, which a consumer
    writes the block's token into to free it. The array is on the host even for a GPU pool so
    reclaiming is a CPU compare.

    ``checksum_algo`` defaults to ``crc32`` for a host pool, ``wsum64`` for a GPU pool.
    Lifecycle: the constructor does no I/O; :meth:`start` allocates and registers;
    :meth:`close` unregisters. ``alloc``/``free``/``reclaim`` are thread-safe.
    """

    def __init__(
        self,
        capacity: int,
        *,
        device: str | torch.device = "cpu",
        max_blocks: int = 4096,
        pin_memory: bool | None = None,
        checksum_algo: str | None = None,
    ) -> None:
        super().__init__(capacity, max_blocks)
        self.device = str(device)
        if not _DEVICE_RE.match(self.device):
            raise ValueError(f"pool device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.is_host = self.device == "cpu"
        self._pin = pin_memory
        if checksum_algo is None:
            checksum_algo = CHECKSUM_CRC32 if self.is_host else CHECKSUM_WSUM64
        if checksum_algo not in CHECKSUMS:
            raise ValueError(f"unknown checksum algorithm {checksum_algo!r}")
        self.checksum_algo = checksum_algo
        self._base = 0  # address of the first byte (0: not started)
        self._mem: Any = None  # what owns the buffer: an mmap, or a torch tensor
        self._host: memoryview | None = None  # the buffer's bytes, for a host pool
        self._tensor: torch.Tensor | None = None  # the buffer as a torch tensor, made lazily
        self._words_mem: mmap.mmap | None = None
        self._words_addr = 0
        self._engine: Transport | None = None
        self._next_outbox = 0

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, engine: Transport) -> None:
        """Allocate the buffer and release words and register both with ``engine``."""
        if self._base:
            raise EngineError("StagingPool.start() called twice")
        if self.is_host and not self._pinned():
            # Page-aligned, zero-filled on first touch, and no torch needed to make or use it.
            mem: Any = mmap.mmap(-1, self.capacity)
            base = _address(mem)
            host: memoryview | None = memoryview(mem)
            tensor = None
        else:
            import torch

            # torch only guarantees 64-byte (CPU) / 512-byte (CUDA) alignment: over-allocate
            # by a page and start at the first page boundary so block addresses, not just
            # offsets, are page-aligned.
            if self.is_host:
                raw = torch.empty(self.capacity + ALIGN, dtype=torch.uint8, pin_memory=True)
            else:
                raw = torch.empty(self.capacity + ALIGN, dtype=torch.uint8, device=self.device)
            pad = -raw.data_ptr() % ALIGN
            mem = tensor = raw[pad : pad + self.capacity]
            base = tensor.data_ptr()
            host = tensor.numpy().data if self.is_host else None
        nwords = self.max_blocks + _OUTBOX_WORDS
        words_mem = mmap.mmap(-1, -(-nwords * _WORD // ALIGN) * ALIGN)
        words_addr = _address(words_mem)
        engine.register(base, self.capacity)
        try:
            engine.register(words_addr, nwords * _WORD)
        except BaseException:
            engine.unregister(base)
            raise
        self._mem, self._host, self._tensor = mem, host, tensor
        self._words_mem, self._words_addr = words_mem, words_addr
        self._words = memoryview(words_mem).cast("Q")
        self._base, self._engine = base, engine

    def _pinned(self) -> bool:
        """Whether a host pool is allocated in pinned memory (through torch)."""
        if self._pin is not None:
            return self._pin
        torch = sys.modules.get("torch")  # never imported: nothing here uses CUDA
        return torch is not None and bool(torch.cuda.is_available())

    def close(self) -> None:
        """Unregister the buffers; blocks still staged become unreadable to peers."""
        if self._engine is None or not self._base:
            return
        for ptr in (self._base, self._words_addr):
            try:
                self._engine.unregister(ptr)
            except EngineError as exc:
                log.warning("pool close: %s", exc)
        self._engine = None

    @property
    def base_addr(self) -> int:
        """Address of the pool's first byte."""
        if not self._base:
            raise EngineError("StagingPool used before start()")
        return self._base

    def addr(self, block: Block) -> int:
        """Address of ``block``'s first byte."""
        return self.base_addr + block.offset

    def view(self, block: Block) -> torch.Tensor:
        """The block's ``nbytes`` as a 1-D uint8 tensor on the pool's device (imports torch;
        host code that needs no tensor uses :meth:`host_view`)."""
        if self._tensor is None:
            if self._host is None:
                raise EngineError("StagingPool used before start()")
            import torch

            self._tensor = torch.frombuffer(self._host, dtype=torch.uint8)
        return self._tensor[block.offset : block.offset + block.nbytes]

    def host_view(self, block: Block) -> memoryview:
        """The block's ``nbytes`` as a writable memoryview (host pools only)."""
        if self._host is None:
            raise EngineError(f"host_view of a {self.device} pool (or before start())")
        return self._host[block.offset : block.offset + block.nbytes]

    def release_addr(self, block: Block) -> int:
        """Address of the block's release word (what a descriptor carries)."""
        return self._words_addr + block.slot * _WORD

    def free_staged(self, descs: Iterable[TensorDescriptor]) -> int:
        """Free the blocks behind descriptors this pool staged (producer-side failure or
        cancel); descriptors of released or unknown blocks are skipped. Returns how many."""
        base = self._words_addr
        freed = 0
        with self._cond:
            for d in descs:
                slot, rem = divmod(d.release_addr - base, _WORD)
                live = self._live.get(slot)
                if rem == 0 and live is not None and live[0].token == d.release_token:
                    freed += self._free_locked(live[0])
            self._counts["local_frees"] += freed
        return freed

    # -- releases -------------------------------------------------------------------------
    def send_release(
        self, engine: Transport, segment: str, release_addr: int, token: int, *,
        task_id: str | None = None, tensor: str | None = None,
    ) -> None:
        """Write ``token`` into a producer's release word (one-sided). The source must be
        registered memory (RDMA requires it), hence a word from this pool's outbox ring."""
        assert self._words is not None
        with self._cond:
            idx = self.max_blocks + self._next_outbox
            self._next_outbox = (self._next_outbox + 1) % _OUTBOX_WORDS
            self._words[idx] = token
        engine.write(segment, self._words_addr + idx * _WORD, release_addr, _WORD,
                     task_id=task_id, tensor=tensor)

    def release_producers(
        self, engine: Transport, descs: Iterable[TensorDescriptor], *,
        task_id: str | None = None, gone: Callable[[], bool] | None = None,
    ) -> int:
        """Release the producers' blocks behind ``descs``; returns how many releases failed.

        A failed release is logged and counted, not raised: the tensors are already here, so
        failing the task would only force a recompute, and a producer that cannot be written
        to is dead or wedged, so its own recovery (restart, local free) owns that memory.
        ``gone``: once it says the producer is gone, the releases left are dropped unsent
        (each write to a dead peer takes Mooncake about a second to fail).
        """
        failed = 0
        todo = [d for d in descs if d.release_token]
        for i, d in enumerate(todo):
            if gone is not None and gone():
                log.info("%d release(s) of producer blocks at %s dropped: the producer is "
                         "gone (task %s)", len(todo) - i, d.segment, task_id)
                break
            try:
                self.send_release(engine, d.segment, d.release_addr, d.release_token,
                                  task_id=task_id, tensor=d.name)
            except TransferError as exc:
                failed += 1
                log.warning("release of producer block failed: %s", exc)
        with self._cond:
            self._counts["release_failures"] += failed
        return failed

    def stats(self) -> PoolStats:
        """A consistent snapshot of occupancy and counters (reclaims released blocks first)."""
        with self._cond:
            self._reclaim_locked()
            free = sum(ext for _, ext in self._free)
            now = time.monotonic()
            return PoolStats(
                capacity=self.capacity, used_bytes=self.capacity - free, free_bytes=free,
                largest_free=max((ext for _, ext in self._free), default=0),
                live_blocks=len(self._live), max_blocks=self.max_blocks,
                quarantined_blocks=len(self._quarantined),
                oldest_block_age_s=max((now - t for _, t in self._live.values()), default=0.0),
                device=self.device if self._tensor is None else str(self._tensor.device),
                checksum_algo=self.checksum_algo, **self._counts,
            )


def _address(mem: mmap.mmap) -> int:
    """Address of an mmap's first byte (ctypes is the standard library's one way to get it).
    It stays valid while the mmap object lives; a pool keeps its mmaps for its whole life,
    so memory a peer may still address is never unmapped."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mem))
