"""Tensors a third party keeps for a task: pulled from a producer into this pool and held
there, then read by any number of consumers, until the keeper frees them.

The stage / pull / release protocol (:mod:`tensorplane.handoff`) moves a tensor from one
producer to one consumer, whose release frees the producer's block. A keeper (the
controller, holding a task's denoising checkpoint) instead :func:`keep_pulled` the producer's
tensors into blocks of its own pool -- verified, the producer released as by any consumer --
and hands out descriptors of those blocks *without a release word* (``release_token`` 0):
consumers' pulls never free them (:meth:`StagingPool.release_producers` skips such
descriptors), so the same kept tensors serve a retry, and another, until the keeper
:func:`free_kept` them. The kept descriptor carries the producer's checksum and algorithm:
the bytes are the same, so nothing is hashed again.

A keeper that learns its producer is gone (the controller: the DiT's control connection
dropped) says so through ``gone``: the reads not yet started are not tried and the release
writes not yet sent are dropped -- the producer's memory went with it, and each write to a
dead peer would take Mooncake about a second to give up on.

Host pools only (the keeper's is an anonymous mmap: no torch in the keeper).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from contracts import faults
from tensorplane.descriptor import TensorDescriptor, checksum
from tensorplane.errors import ChecksumMismatch, PoolExhausted, TransferFailed
from tensorplane.handoff import read_block, verify
from tensorplane.pool import Block, StagingPool
from tensorplane.transport import Transport


@dataclass(frozen=True)
class Kept:
    """One kept tensor: the block holding it and the descriptor consumers get."""

    block: Block | None
    """None for an empty tensor (nothing to hold)."""
    desc: TensorDescriptor

    @property
    def nbytes(self) -> int:
        return self.desc.nbytes


def _take(pool: StagingPool, nbytes: int, task_id: str | None) -> Block:
    block = pool.try_alloc(nbytes)
    if block is None:  # a keeper is bounded: full is a refusal, not a wait
        stats = pool.stats()
        raise PoolExhausted(f"cannot keep {nbytes} more bytes: {stats.free_bytes} of "
                            f"{stats.capacity} free", requested=nbytes,
                            free_bytes=stats.free_bytes, task_id=task_id)
    return block


def _described(pool: StagingPool, engine: Transport, block: Block,
               like: TensorDescriptor) -> TensorDescriptor:
    return replace(like, segment=engine.session_id, address=pool.addr(block), release_addr=0,
                   release_token=0)


def _never() -> bool:
    return False


def keep_pulled(engine: Transport, pool: StagingPool, descs: Sequence[TensorDescriptor],
                *, task_id: str | None = None, gone: Callable[[], bool] = _never
                ) -> list[Kept]:
    """Read each described tensor into a block of ``pool`` and keep it; then release the
    producer's blocks (all of them arrived). Raises PoolExhausted when they do not fit,
    TransferFailed / ChecksumMismatch as a pull would, TransferFailed when ``gone()`` before
    a read; nothing is kept then. Releases are dropped from the first ``gone()`` on."""
    kept: list[Kept] = []
    try:
        for d in descs:
            if gone():
                raise TransferFailed(f"{d.name}: not read, its producer {d.segment} is gone",
                                     nbytes=d.nbytes, task_id=task_id, tensor=d.name,
                                     peer=d.segment)
            if not d.nbytes:
                kept.append(Kept(None, d))
                continue
            block = _take(pool, d.nbytes, task_id)
            read_block(engine, pool, block, d, task_id)
            kept.append(Kept(block, _described(pool, engine, block, d)))
            verify(pool.host_view(block), d, task_id)
    except BaseException:
        free_kept(pool, kept)
        raise
    faults.hit("keep.release")
    pool.release_producers(engine, descs, task_id=task_id, gone=gone)
    return kept


def keep_bytes(engine: Transport, pool: StagingPool, like: TensorDescriptor,
               data: bytes | memoryview, *, task_id: str | None = None) -> Kept:
    """Keep ``data`` (read back from a file) as the tensor ``like`` describes; its checksum
    must match (ChecksumMismatch otherwise)."""
    if len(data) != like.nbytes:
        raise ChecksumMismatch(f"{like.name}: {len(data)} bytes, the record says {like.nbytes}",
                               expected=like.checksum, actual=0, task_id=task_id,
                               tensor=like.name)
    if not like.nbytes:
        return Kept(None, like)
    actual = checksum(data, like.checksum_algo)
    if actual != like.checksum:
        raise ChecksumMismatch(f"{like.name}: stored bytes fail their {like.checksum_algo}",
                               expected=like.checksum, actual=actual, task_id=task_id,
                               tensor=like.name)
    block = _take(pool, like.nbytes, task_id)
    pool.host_view(block)[:] = data
    return Kept(block, _described(pool, engine, block, like))


def kept_bytes(pool: StagingPool, kept: Kept) -> memoryview:
    """The kept tensor's raw bytes (a view into the pool: copy it before freeing)."""
    return pool.host_view(kept.block) if kept.block is not None else memoryview(b"")


def free_kept(pool: StagingPool, kept: Iterable[Kept]) -> None:
    for k in kept:
        if k.block is not None:
            pool.free(k.block)
