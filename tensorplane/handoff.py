"""The stage / pull / release protocol of one task's tensors between two stages.

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

Tensors are torch tensors or numpy arrays. Numpy arrays between host pools never touch
torch (the synthetic pipeline's CPU workers stay torch-free); torch is imported only when a
torch tensor or a GPU pool is involved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from contracts import faults
from tensorplane.blocks import Block
from tensorplane.descriptor import (
    TENSOR_DTYPES,
    TensorDescriptor,
    checksum,
    dtype_name,
    is_torch,
    numpy_dtype,
    torch_dtype,
)
from tensorplane.errors import ChecksumMismatch, TransferError, TransferFailed
from tensorplane.pool import StagingPool
from tensorplane.transport import Transport

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ArrayKind = Literal["torch", "numpy"]


# ------------------------------------------------------------------------- stage and pull
def _sync(*tensors: torch.Tensor) -> None:
    # Mooncake reads/writes raw memory outside any CUDA stream: queued copies must be done.
    for t in tensors:
        if t.device.type == "cuda":
            import torch

            torch.cuda.current_stream(t.device).synchronize()


def stage_tensors(
    pool: StagingPool,
    engine: Transport,
    tensors: Mapping[str, Any],
    *,
    task_id: str | None = None,
    alloc_timeout: float = 30.0,
) -> list[TensorDescriptor]:
    """Copy each tensor's raw bytes (made contiguous; dtype kept, so bf16 stays 2 bytes per
    element) into a pool block and describe it. Values are torch tensors or numpy arrays.
    On error, blocks already taken are freed."""
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
    engine: Transport,
    name: str,
    data: bytes | bytearray | memoryview,
    *,
    task_id: str | None = None,
    alloc_timeout: float = 30.0,
) -> TensorDescriptor:
    """Stage raw bytes (e.g. an input image file) as a 1-D uint8 tensor."""
    import numpy as np

    return _stage_one(pool, engine, name, np.frombuffer(data, dtype=np.uint8), task_id,
                      alloc_timeout)


def _stage_one(
    pool: StagingPool, engine: Transport, name: str, tensor: Any,
    task_id: str | None, alloc_timeout: float,
) -> TensorDescriptor:
    dtype = dtype_name(tensor)
    if dtype is None:
        raise TransferError(f"cannot stage dtype {getattr(tensor, 'dtype', type(tensor))} "
                            f"(supported: {', '.join(TENSOR_DTYPES)})", task_id=task_id,
                            tensor=name)
    shape = tuple(int(d) for d in tensor.shape)
    nbytes = _nbytes(tensor)
    if nbytes == 0:  # nothing to move or release
        return TensorDescriptor(name, engine.session_id, 0, 0, dtype, shape, 0, 0, 0,
                                pool.checksum_algo)
    block = pool.alloc(nbytes, alloc_timeout, task_id=task_id)
    try:
        digest = _fill(pool, block, tensor)
    except BaseException:
        pool.free(block)
        raise
    return TensorDescriptor(
        name=name, segment=engine.session_id, address=pool.addr(block), nbytes=block.nbytes,
        dtype=dtype, shape=shape, checksum=digest, release_addr=pool.release_addr(block),
        release_token=block.token, checksum_algo=pool.checksum_algo,
    )


def _nbytes(tensor: Any) -> int:
    if is_torch(tensor):
        return int(tensor.numel() * tensor.element_size())
    return int(tensor.nbytes)


def _fill(pool: StagingPool, block: Block, tensor: Any) -> int:
    """Copy ``tensor``'s bytes into ``block``; returns their checksum."""
    if pool.is_host and not is_torch(tensor):
        import numpy as np

        dst = pool.host_view(block)
        dst[:] = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data
        return checksum(dst, pool.checksum_algo)
    import torch

    if not is_torch(tensor):
        tensor = torch.from_numpy(tensor)
    src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    view = pool.view(block)
    view.copy_(src)
    _sync(view, src)
    return checksum(view, pool.checksum_algo)


def pull_tensors(
    engine: Transport,
    pool: StagingPool,
    descs: Iterable[TensorDescriptor],
    device: str | torch.device = "cpu",
    task_id: str | None = None,
    *,
    alloc_timeout: float = 30.0,
    release: bool = True,
    arrays: ArrayKind = "torch",
) -> dict[str, Any]:
    """Pull described tensors into fresh torch tensors on ``device`` (``arrays="torch"``) or
    fresh numpy arrays (``arrays="numpy"``; host only, no torch imported).

    Per tensor: local block, Mooncake read, checksum, copy out, free the block. Producers'
    blocks are released only once *every* tensor has arrived, so a task that fails halfway
    leaves the producer's copy intact for a retry. A failed read raises
    :class:`TransferFailed`, a bad checksum :class:`ChecksumMismatch`; both name the task,
    tensor and peer. Every read has a deadline, so this never hangs on a wedged peer.
    """
    if arrays == "numpy" and str(device) != "cpu":
        raise TransferError(f"numpy arrays live on the host; cannot pull to {device}",
                            task_id=task_id)
    out: dict[str, Any] = {}
    descs = list(descs)
    for d in descs:
        tensor = _empty(d, device, arrays)
        if d.nbytes:
            _pull_one(engine, pool, d, tensor, task_id, alloc_timeout)
        out[d.name] = tensor
        if task_id is not None:  # a task's pull (the preflight's probe read has no task)
            faults.hit("transfer.pull")
    if release:
        pool.release_producers(engine, descs, task_id=task_id)
    return out


def _empty(d: TensorDescriptor, device: Any, arrays: ArrayKind) -> Any:
    if arrays == "numpy":
        import numpy as np

        return np.empty(d.shape, dtype=numpy_dtype(d.dtype))
    import torch

    return torch.empty(d.shape, dtype=torch_dtype(d.dtype), device=torch.device(device))


def read_block(engine: Transport, pool: StagingPool, block: Block,
               d: TensorDescriptor, task_id: str | None) -> None:
    """Mooncake-read the bytes ``d`` describes into ``block``. On a failed read the block
    is freed, or kept (quarantined) while Mooncake may still write into it."""
    try:
        engine.read(d.segment, pool.addr(block), d.address, d.nbytes, task_id=task_id,
                    tensor=d.name)
    except TransferFailed as exc:
        if exc.pending is not None:
            pool.quarantine(block, exc.pending)
        else:
            pool.free(block)
        raise


def verify(local: Any, d: TensorDescriptor, task_id: str | None) -> None:
    """ChecksumMismatch unless the bytes read (``local``) are the ones ``d`` describes."""
    actual = checksum(local, d.checksum_algo)
    if actual != d.checksum:
        raise ChecksumMismatch(
            f"checksum mismatch on {d.nbytes} bytes read from {d.address:#x}: "
            f"{d.checksum_algo} expected {d.checksum:#x}, got {actual:#x}",
            expected=d.checksum, actual=actual, task_id=task_id, tensor=d.name,
            peer=d.segment,
        )


def _pull_one(
    engine: Transport, pool: StagingPool, d: TensorDescriptor, out: Any,
    task_id: str | None, alloc_timeout: float,
) -> None:
    block = pool.alloc(d.nbytes, alloc_timeout, task_id=task_id)
    read_block(engine, pool, block, d, task_id)
    try:
        host = pool.is_host and not is_torch(out)
        local: Any = pool.host_view(block) if host else pool.view(block)
        verify(local, d, task_id)
        if host:
            import numpy as np

            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(local, dtype=np.uint8)
        else:
            import torch

            # A numpy array pulled through a GPU pool is filled through a tensor sharing
            # its memory.
            dst = out if is_torch(out) else torch.from_numpy(out)
            dst.reshape(-1).view(torch.uint8).copy_(local)
            _sync(dst, local)
    finally:
        pool.free(block)
