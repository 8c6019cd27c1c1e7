"""Staging pool, tensor descriptors, and the stage / pull / release protocol.

Protocol for one tensor (producer P, consumer C, each with its own pool and engine):

1. P ``stage_tensors``: allocates a block in its pool, copies the tensor's raw bytes in,
   hashes them, and describes the block with a :class:`TensorDescriptor` that also names the
   block's *release word* (``release_addr``) and a *release token* unique to this allocation.
2. The descriptor travels through a ring slot (msgpack via ``to_dict``/``from_dict``).
3. C ``pull_tensors``: allocates a local block, Mooncake-reads P's bytes into it, verifies
   the checksum, copies them out into a fresh tensor, frees its local block, then writes the
   token into P's release word (one-sided Mooncake write; P does nothing).
4. P reclaims every block whose release word equals its token (on each allocation and on
   :meth:`StagingPool.reclaim`). A stale or duplicate release writes an old token, which
   matches no live allocation, so it is harmless. On task failure/cancel P frees locally.

Checksums: ``crc32`` (zlib, over the bytes) when the producer's pool is in host memory;
``wsum64`` (a position-weighted sum of 16-bit words computed with torch ops on the pool's
device, so no device-to-host copy) when it is in GPU memory. The descriptor names the
algorithm, so a consumer on either kind of device can verify either.
"""

from __future__ import annotations

import bisect
import logging
import math
import secrets
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any, Final

import torch

from workers.transfer import (
    ChecksumMismatch,
    DescriptorError,
    EngineError,
    PoolExhausted,
    RequestTooLarge,
    TransferEngine,
    TransferError,
    TransferFailed,
)

log = logging.getLogger(__name__)

ALIGN: Final = 4096
"""Block alignment and size granule: page-aligned blocks suit DMA/RDMA and any dtype view."""
_WORD: Final = 8
_OUTBOX_WORDS: Final = 64
"""Source words for outgoing release writes; a ring so concurrent pulls don't share one."""

CHECKSUM_CRC32: Final = "crc32"
CHECKSUM_WSUM64: Final = "wsum64"
_CHECKSUMS: Final = (CHECKSUM_CRC32, CHECKSUM_WSUM64)

_DTYPES: Final[dict[str, torch.dtype]] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES: Final = {v: k for k, v in _DTYPES.items()}


# ------------------------------------------------------------------------------ checksums
def checksum(data: torch.Tensor, algo: str) -> int:
    """Hash a 1-D uint8 tensor with ``algo`` (``crc32`` or ``wsum64``); both deterministic."""
    if algo == CHECKSUM_CRC32:
        # crc32 needs host bytes; a GPU block pays a copy here (only when a CPU producer
        # feeds a GPU pool). ~3.4 GB/s on the CPU machines, and zlib releases the GIL.
        host = data.cpu() if data.device.type != "cpu" else data
        return zlib.crc32(host.numpy().data) if host.numel() else 0
    if algo == CHECKSUM_WSUM64:
        return _wsum64(data)
    raise DescriptorError(f"unknown checksum algorithm {algo!r}")


_WSUM_CHUNK: Final = 1 << 24  # 16-bit words per partial sum: keeps every partial < 2**56


def _wsum64(data: torch.Tensor) -> int:
    """Fletcher-like hash that runs where the data is (GPU): ``a = sum(x_i)``,
    ``b = sum(x_i * (i mod 65521 + 1))`` over little-endian 16-bit words, packed as
    ``(b mod 2**32) << 32 | (a mod 2**32)``. Products stay below 2**32 and each chunk's sum
    below 2**56, so int64 never overflows and the result does not depend on reduction order.
    Any single-word change alters ``a``; swapped words alter ``b``."""
    n = data.numel()
    half = n // 2
    words = data[: 2 * half]
    if words.data_ptr() % 2:
        words = words.clone()
    words16 = words.view(torch.int16)
    a = b = 0
    for start in range(0, half, _WSUM_CHUNK):
        x = words16[start : start + _WSUM_CHUNK].to(torch.int64) & 0xFFFF
        w = torch.arange(start, start + x.numel(), dtype=torch.int64, device=x.device)
        w = w % 65521 + 1
        a += int(x.sum())
        b += int((x * w).sum())
    if n % 2:
        x_last = int(data[n - 1])
        a += x_last
        b += x_last * (half % 65521 + 1)
    return ((b & 0xFFFFFFFF) << 32) | (a & 0xFFFFFFFF)


# ----------------------------------------------------------------------------- descriptor
@dataclass(frozen=True)
class TensorDescriptor:
    """Where a staged tensor lives and how to check and release it; travels in ring slots."""

    name: str
    """Tensor name within the task (e.g. ``prompt_embeds``)."""
    segment: str
    """Producer's Mooncake session id ("host:rpcport")."""
    address: int
    """Address of the bytes in the producer's registered pool (0 for an empty tensor)."""
    nbytes: int
    """Byte count: numel x element size (bf16 stays 2 bytes)."""
    dtype: str
    """torch dtype name without the prefix: float32, bfloat16, uint8, int64, ..."""
    shape: tuple[int, ...]
    """Tensor shape; the bytes are the row-major (contiguous) layout."""
    checksum: int
    """Hash of the bytes with ``checksum_algo``."""
    release_addr: int
    """Producer's release word for this block (0: nothing to release)."""
    release_token: int
    """Generation number of this allocation; writing it into the release word frees it."""
    checksum_algo: str = CHECKSUM_CRC32
    """``crc32`` (host pool) or ``wsum64`` (GPU pool)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            want: type = tuple if f.name == "shape" else (str if f.type == "str" else int)
            if not isinstance(value, want) or isinstance(value, bool):
                raise DescriptorError(f"descriptor field {f.name} has type "
                                      f"{type(value).__name__}", tensor=str(self.name))
        if self.dtype not in _DTYPES:
            raise DescriptorError(f"unsupported dtype {self.dtype!r}", tensor=self.name)
        if self.checksum_algo not in _CHECKSUMS:
            raise DescriptorError(f"unknown checksum {self.checksum_algo!r}", tensor=self.name)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape):
            raise DescriptorError(f"bad shape {self.shape!r}", tensor=self.name)
        itemsize = _DTYPES[self.dtype].itemsize
        if self.nbytes != math.prod(self.shape) * itemsize:
            raise DescriptorError(
                f"nbytes {self.nbytes} != prod{self.shape} x {itemsize}", tensor=self.name
            )
        if min(self.address, self.release_addr, self.release_token, self.checksum) < 0:
            raise DescriptorError("negative address, token or checksum", tensor=self.name)

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-able map (shape as a list)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorDescriptor:
        """Inverse of :meth:`to_dict`; unknown keys and missing required keys are errors."""
        if not isinstance(data, Mapping):
            raise DescriptorError(f"descriptor must be a map, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise DescriptorError(f"unknown descriptor key(s): {', '.join(unknown)}",
                                  tensor=str(data.get("name")))
        missing = sorted(known - set(data) - {"checksum_algo"})
        if missing:
            raise DescriptorError(f"missing descriptor key(s): {', '.join(missing)}",
                                  tensor=str(data.get("name")))
        values = dict(data)
        if not isinstance(values["shape"], list | tuple):
            raise DescriptorError("descriptor shape must be a list", tensor=str(data["name"]))
        values["shape"] = tuple(values["shape"])
        return cls(**values)


# ----------------------------------------------------------------------------------- pool
@dataclass(frozen=True)
class Block:
    """One live allocation: ``size`` bytes (``nbytes`` rounded up to ALIGN) at ``offset``."""

    offset: int
    nbytes: int
    size: int
    slot: int
    token: int


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


class StagingPool:
    """One bounded, registered buffer per process, carved into 4 KiB-aligned blocks.

    Allocator: first-fit over a sorted list of free extents, coalescing on free. A worker
    holds a handful of tensors per task and a few tasks at once, with roughly FIFO
    lifetimes, so the list stays short (O(n) first-fit is cheap) and coalescing keeps
    fragmentation low without a buddy allocator's 2x rounding on multi-MiB latents.

    Each block also takes a *slot* (at most ``max_blocks`` live) whose u64 release word, in a
    separately registered host array, a consumer overwrites with the block's token to free
    it. The array is on the host even for a GPU pool so reclaiming is a CPU compare.

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
        if capacity < ALIGN:
            raise ValueError(f"pool capacity must be at least {ALIGN} bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self.device = torch.device(device)
        self.max_blocks = max(1, min(max_blocks, self.capacity // ALIGN))
        self._pin = pin_memory
        if checksum_algo is None:
            checksum_algo = CHECKSUM_CRC32 if self.device.type == "cpu" else CHECKSUM_WSUM64
        if checksum_algo not in _CHECKSUMS:
            raise ValueError(f"unknown checksum algorithm {checksum_algo!r}")
        self.checksum_algo = checksum_algo
        self._buffer: torch.Tensor | None = None
        self._words: torch.Tensor | None = None
        self._words_np: Any = None  # numpy view of _words: cheap scalar reads when reclaiming
        self._engine: TransferEngine | None = None
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size) by offset
        self._free_slots = list(range(self.max_blocks - 1, -1, -1))
        self._live: dict[int, tuple[Block, float]] = {}  # slot -> (block, alloc time)
        self._quarantined: set[int] = set()
        # Tokens start at a random base so a release aimed at a previous incarnation of
        # this process (same addresses) cannot match; < 2**62 so they fit int64 words.
        self._next_token = (secrets.randbits(40) << 20) | 1
        self._next_outbox = 0
        self._counts = dict.fromkeys(
            ("allocs", "remote_releases", "local_frees", "alloc_timeouts", "release_failures"), 0
        )

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, engine: TransferEngine) -> None:
        """Allocate the buffer and release words and register both with ``engine``."""
        if self._buffer is not None:
            raise EngineError("StagingPool.start() called twice")
        # torch only guarantees 64-byte (CPU) / 512-byte (CUDA) alignment: over-allocate by a
        # page and start at the first page boundary so block addresses, not just offsets,
        # are page-aligned.
        if self.device.type == "cpu":
            pin = torch.cuda.is_available() if self._pin is None else self._pin
            raw = torch.empty(self.capacity + ALIGN, dtype=torch.uint8, pin_memory=pin)
        else:
            raw = torch.empty(self.capacity + ALIGN, dtype=torch.uint8, device=self.device)
        pad = -raw.data_ptr() % ALIGN
        buf = raw[pad : pad + self.capacity]
        words = torch.zeros(self.max_blocks + _OUTBOX_WORDS, dtype=torch.int64)
        engine.register(buf.data_ptr(), self.capacity)
        try:
            engine.register(words.data_ptr(), words.numel() * _WORD)
        except BaseException:
            engine.unregister(buf.data_ptr())
            raise
        self._buffer, self._words, self._engine = buf, words, engine
        self._words_np = words.numpy()

    def close(self) -> None:
        """Unregister the buffers; blocks still staged become unreadable to peers."""
        if self._engine is None or self._buffer is None or self._words is None:
            return
        for ptr in (self._buffer.data_ptr(), self._words.data_ptr()):
            try:
                self._engine.unregister(ptr)
            except EngineError as exc:
                log.warning("pool close: %s", exc)
        self._engine = None

    @property
    def base_addr(self) -> int:
        """Address of the pool's first byte."""
        return self._buf().data_ptr()

    def _buf(self) -> torch.Tensor:
        if self._buffer is None:
            raise EngineError("StagingPool used before start()")
        return self._buffer

    def addr(self, block: Block) -> int:
        """Address of ``block``'s first byte."""
        return self.base_addr + block.offset

    def view(self, block: Block) -> torch.Tensor:
        """The block's ``nbytes`` as a 1-D uint8 tensor on the pool's device."""
        return self._buf()[block.offset : block.offset + block.nbytes]

    def release_addr(self, block: Block) -> int:
        """Address of the block's release word (what a descriptor carries)."""
        assert self._words is not None
        return self._words.data_ptr() + block.slot * _WORD

    # -- allocation (non-blocking core + blocking layer) ----------------------------------
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

    def free_staged(self, descs: Iterable[TensorDescriptor]) -> int:
        """Free the blocks behind descriptors this pool staged (producer-side failure or
        cancel); descriptors of released or unknown blocks are skipped. Returns how many."""
        assert self._words is not None
        base = self._words.data_ptr()
        freed = 0
        with self._cond:
            for d in descs:
                slot, rem = divmod(d.release_addr - base, _WORD)
                live = self._live.get(slot)
                if rem == 0 and live is not None and live[0].token == d.release_token:
                    freed += self._free_locked(live[0])
            self._counts["local_frees"] += freed
        return freed

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
            if int(self._words_np[slot]) == block.token:
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

    # -- releases -------------------------------------------------------------------------
    def send_release(
        self, engine: TransferEngine, segment: str, release_addr: int, token: int, *,
        task_id: str | None = None, tensor: str | None = None,
    ) -> None:
        """Write ``token`` into a producer's release word (one-sided). The source must be
        registered memory (RDMA requires it), hence a word from this pool's outbox ring."""
        assert self._words is not None
        with self._cond:
            idx = self.max_blocks + self._next_outbox
            self._next_outbox = (self._next_outbox + 1) % _OUTBOX_WORDS
            self._words_np[idx] = token
        engine.write(segment, self._words.data_ptr() + idx * _WORD, release_addr, _WORD,
                     task_id=task_id, tensor=tensor)

    def release_producers(
        self, engine: TransferEngine, descs: Iterable[TensorDescriptor], *,
        task_id: str | None = None,
    ) -> int:
        """Release the producers' blocks behind ``descs``; returns how many releases failed.

        A failed release is logged and counted, not raised: the tensors are already here, so
        failing the task would only force a recompute, and a producer that cannot be written
        to is dead or wedged, so its own recovery (restart, local free) owns that memory.
        """
        failed = 0
        for d in descs:
            if not d.release_token:
                continue
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
                **self._counts,
            )


# ------------------------------------------------------------------------- stage and pull
def _sync(*tensors: torch.Tensor) -> None:
    # Mooncake reads/writes raw memory outside any CUDA stream: queued copies must be done.
    for t in tensors:
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()


def stage_tensors(
    pool: StagingPool,
    engine: TransferEngine,
    tensors: Mapping[str, torch.Tensor],
    *,
    task_id: str | None = None,
    alloc_timeout: float = 30.0,
) -> list[TensorDescriptor]:
    """Copy each tensor's raw bytes (made contiguous; dtype kept, so bf16 stays 2 bytes per
    element) into a pool block and describe it. On error, blocks already taken are freed."""
    descs: list[TensorDescriptor] = []
    try:
        for name, tensor in tensors.items():
            descs.append(_stage_one(pool, engine, name, tensor, task_id, alloc_timeout))
    except BaseException:
        pool.free_staged(descs)
        raise
    return descs


def stage_bytes(
    pool: StagingPool,
    engine: TransferEngine,
    name: str,
    data: bytes | bytearray | memoryview,
    *,
    task_id: str | None = None,
    alloc_timeout: float = 30.0,
) -> TensorDescriptor:
    """Stage raw bytes (e.g. an input image file) as a 1-D uint8 tensor."""
    buf = bytearray(data)  # frombuffer wants a writable buffer, and refuses an empty one
    tensor = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return _stage_one(pool, engine, name, tensor, task_id, alloc_timeout)


def _stage_one(
    pool: StagingPool, engine: TransferEngine, name: str, tensor: torch.Tensor,
    task_id: str | None, alloc_timeout: float,
) -> TensorDescriptor:
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise TransferError(f"cannot stage dtype {tensor.dtype} (supported: "
                            f"{', '.join(_DTYPES)})", task_id=task_id, tensor=name)
    src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    shape = tuple(int(d) for d in tensor.shape)
    if src.numel() == 0:  # nothing to move or release
        return TensorDescriptor(name, engine.session_id, 0, 0, dtype, shape, 0, 0, 0,
                                pool.checksum_algo)
    block = pool.alloc(src.numel(), alloc_timeout, task_id=task_id)
    try:
        dst = pool.view(block)
        dst.copy_(src)
        _sync(dst, src)
        digest = checksum(dst, pool.checksum_algo)
    except BaseException:
        pool.free(block)
        raise
    return TensorDescriptor(
        name=name, segment=engine.session_id, address=pool.addr(block), nbytes=block.nbytes,
        dtype=dtype, shape=shape, checksum=digest, release_addr=pool.release_addr(block),
        release_token=block.token, checksum_algo=pool.checksum_algo,
    )


def pull_tensors(
    engine: TransferEngine,
    pool: StagingPool,
    descs: Iterable[TensorDescriptor],
    device: str | torch.device = "cpu",
    task_id: str | None = None,
    *,
    alloc_timeout: float = 30.0,
    release: bool = True,
) -> dict[str, torch.Tensor]:
    """Pull described tensors into fresh tensors on ``device``.

    Per tensor: local block, Mooncake read, checksum, copy out, free the block. Producers'
    blocks are released only once *every* tensor has arrived, so a task that fails halfway
    leaves the producer's copy intact for a retry. A failed read raises
    :class:`TransferFailed`, a bad checksum :class:`ChecksumMismatch`; both name the task,
    tensor and peer. Every read has a deadline, so this never hangs on a wedged peer.
    """
    out: dict[str, torch.Tensor] = {}
    descs = list(descs)
    target = torch.device(device)
    for d in descs:
        tensor = torch.empty(d.shape, dtype=_DTYPES[d.dtype], device=target)
        if d.nbytes:
            _pull_one(engine, pool, d, tensor, task_id, alloc_timeout)
        out[d.name] = tensor
    if release:
        pool.release_producers(engine, descs, task_id=task_id)
    return out


def _pull_one(
    engine: TransferEngine, pool: StagingPool, d: TensorDescriptor, out: torch.Tensor,
    task_id: str | None, alloc_timeout: float,
) -> None:
    block = pool.alloc(d.nbytes, alloc_timeout, task_id=task_id)
    try:
        engine.read(d.segment, pool.addr(block), d.address, d.nbytes, task_id=task_id,
                    tensor=d.name)
    except TransferFailed as exc:
        if exc.pending is not None:
            pool.quarantine(block, exc.pending)
        else:
            pool.free(block)
        raise
    try:
        local = pool.view(block)
        actual = checksum(local, d.checksum_algo)
        if actual != d.checksum:
            raise ChecksumMismatch(
                f"checksum mismatch on {d.nbytes} bytes pulled from {d.address:#x}: "
                f"{d.checksum_algo} expected {d.checksum:#x}, got {actual:#x}",
                expected=d.checksum, actual=actual, task_id=task_id, tensor=d.name,
                peer=d.segment,
            )
        out.reshape(-1).view(torch.uint8).copy_(local)
        _sync(out, local)
    finally:
        pool.free(block)
