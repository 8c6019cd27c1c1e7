"""The controller's store of denoising checkpoints: a task's progress that outlives the DiT
worker that made it (and this controller's restart).

Per unfinished task it keeps at most one checkpoint -- the latest, with the encoder outputs
the DiT needs to resume (``phase1``, sent once per task) -- or, once the DiT finished, its
*final* latents (the Phase2 outputs), kept until the result is written so that a lost
decoder re-runs only the decoder. The tensors are pulled from the DiT worker's pool into
this controller's own pool (:func:`tensorplane.keep.keep_pulled`: the pull releases the
DiT's blocks) and handed to a resuming worker as descriptors without a release word, so any
number of retries read the same kept bytes. The pool's size (``checkpoint_store_mb``) is the
bound: a checkpoint that does not fit is refused and the task keeps its older one.

Each kept checkpoint is also written to ``<store folder>/checkpoints/<task_id>.{phase1,
state}`` (a msgpack header, then the raw bytes; written to ``.part``, fsync'd and renamed),
so a restarted controller resumes its unfinished tasks from them (:meth:`CheckpointStore.
load`). Files are written in order on one thread; a block is freed on that same thread after
any write that reads it, so a write never reads a reused block. A task that ends (completed,
failed, cancelled) has its checkpoint dropped: blocks freed, files removed.

Pulls run off the event loop (a Mooncake read blocks), each worker's in a *lane* of its own:
one thread per DiT worker, so a wedged peer (SIGSTOPped mid-read: Mooncake gives up after
its timeout, 10 s) holds up only its own checkpoints, never another worker's. When a worker
is gone (:meth:`CheckpointStore.forget`, at once when its control connection drops) its lane
is told: the reads it has not started are not tried and its release writes not yet sent are
dropped (each write to a dead peer takes Mooncake about a second to fail), and what a pull
that nobody awaits any more still kept is freed when it ends. Everything else is called on
the loop. Ownership (who may replace a task's checkpoint) is
:mod:`controller.ownership.resumes`' (the lease, the attempt): see window 8 of
:mod:`controller.ownership.coordinator`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from contracts.errors import DiffringError
from tensorplane.descriptor import TensorDescriptor
from tensorplane.keep import Kept, free_kept, keep_bytes, keep_pulled, kept_bytes
from tensorplane.pool import StagingPool
from tensorplane.transport import Transport

log = logging.getLogger("diffring.controller.checkpoints")

MAGIC = b"DRCKPT01"
_HEADER_LEN = struct.Struct("<I")


@dataclass
class _Lane:
    """One worker's checkpoint pulls: a thread of their own, and whether the worker is gone."""

    pulls: concurrent.futures.ThreadPoolExecutor
    gone: threading.Event = field(default_factory=threading.Event)


@dataclass
class Checkpoint:
    """A task's latest kept loop state (or final latents)."""

    step: int
    steps: int
    final: bool
    meta: dict[str, Any]
    state: list[Kept]
    attempt: int
    at: float = field(default_factory=time.time)
    """Wall-clock time it was kept."""

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.state)

    def public(self) -> dict[str, Any]:
        return {"step": self.step, "steps": self.steps, "final": self.final,
                "bytes": self.nbytes, "attempt": self.attempt, "at": self.at}


class CheckpointStore:
    """Checkpoints of one controller, in ``pool`` (registered with ``engine``) and, when
    ``folder`` is set, in files there."""

    def __init__(self, engine: Transport, pool: StagingPool, folder: Path | None) -> None:
        self.engine = engine
        self.pool = pool
        self.folder = folder
        self._phase1: dict[str, list[Kept]] = {}
        self._latest: dict[str, Checkpoint] = {}
        self._lanes: dict[int, _Lane] = {}
        self._files = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-file")
        self.counts: dict[str, int] = dict.fromkeys(
            ("kept", "refused", "final", "resumes", "dropped", "restored"), 0)
        """Checkpoints kept and refused, final latents kept, resumes served, checkpoints of
        finished tasks dropped, checkpoints loaded at start (metrics and the status)."""
        self.pull_seconds = 0.0
        """Total time spent pulling checkpoints (what they cost the controller)."""

    # -- reading -----------------------------------------------------------------------------
    def get(self, task_id: str) -> Checkpoint | None:
        return self._latest.get(task_id)

    def has_phase1(self, task_id: str) -> bool:
        return task_id in self._phase1

    def __len__(self) -> int:
        return len(self._latest)

    @property
    def used_bytes(self) -> int:
        """Bytes kept (list(): the metrics thread reads while the loop changes them)."""
        return sum(c.nbytes for c in list(self._latest.values())) + sum(
            k.nbytes for ks in list(self._phase1.values()) for k in ks)

    def summary(self) -> dict[str, Any]:
        """For the service status: what is kept, the bound, and the counts."""
        return {"tasks": len(self._latest), "bytes": self.used_bytes,
                "capacity": self.pool.capacity, "pull_seconds": round(self.pull_seconds, 3),
                **self.counts}

    def resume_reply(self, task_id: str) -> dict[str, Any] | None:
        """What a resuming DiT worker fetches (``resume``), or None: nothing kept."""
        ckpt = self._latest.get(task_id)
        phase1 = self._phase1.get(task_id)
        if ckpt is None or (phase1 is None and not ckpt.final):
            return None
        self.counts["resumes"] += 1
        return {"step": ckpt.step, "steps": ckpt.steps, "final": ckpt.final, "meta": ckpt.meta,
                "phase1": [k.desc.to_dict() for k in phase1 or []],
                "state": [k.desc.to_dict() for k in ckpt.state]}

    # -- keeping -----------------------------------------------------------------------------
    async def pull(self, task_id: str, phase1: Sequence[TensorDescriptor] | None,
                   state: Sequence[TensorDescriptor], lane: int = 0
                   ) -> tuple[list[Kept] | None, list[Kept]]:
        """Pull a checkpoint's tensors into this pool, in the lane of worker ``lane`` (off the
        loop). Raises what :func:`keep_pulled` raises (PoolExhausted: the store is full;
        TransferFailed: a read failed, or the worker is gone)."""
        worker = self._lane(lane)
        t0 = time.monotonic()
        n1 = len(phase1) if phase1 is not None else 0
        descs = [*(phase1 or []), *state]
        # One keep_pulled for both: one batch of release writes after every read.
        job = worker.pulls.submit(keep_pulled, self.engine, self.pool, descs, task_id=task_id,
                                  gone=worker.gone.is_set)
        try:
            kept = await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # Nobody awaits it any more (its worker is gone, or the controller stops): what
            # it still keeps is freed when it ends.
            job.add_done_callback(self._discard_late)
            raise
        self.pull_seconds += time.monotonic() - t0
        return (kept[:n1] if phase1 is not None else None), kept[n1:]

    def _lane(self, worker_id: int) -> _Lane:
        lane = self._lanes.get(worker_id)
        if lane is None:
            lane = self._lanes[worker_id] = _Lane(concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"ckpt-pull-{worker_id}"))
        return lane

    def forget(self, worker_id: int) -> None:
        """Worker ``worker_id`` is gone: its lane drops the reads and releases it has left
        (the thread ends after the Mooncake call it may be in)."""
        lane = self._lanes.pop(worker_id, None)
        if lane is not None:
            lane.gone.set()
            lane.pulls.shutdown(wait=False, cancel_futures=True)

    def _discard_late(self, job: concurrent.futures.Future[list[Kept]]) -> None:
        """Free what a pull nobody awaits kept (on its lane's thread). Never put, so no file
        write reads it: freed at once."""
        if not job.cancelled() and job.exception() is None:
            free_kept(self.pool, job.result())

    def put(self, task_id: str, ckpt: Checkpoint, phase1: list[Kept] | None) -> None:
        """Keep ``ckpt`` (and ``phase1``, when given) as ``task_id``'s, freeing what it
        replaces; its files are written in the background."""
        old = self._latest.pop(task_id, None)
        self._latest[task_id] = ckpt
        self.counts["final" if ckpt.final else "kept"] += 1
        replaced: list[Kept] = list(old.state) if old is not None else []
        if phase1 is not None:
            replaced += self._phase1.pop(task_id, [])
            self._phase1[task_id] = phase1
            self._write(task_id, "phase1", self._header(task_id, ckpt, phase1, phase1=True),
                        phase1)
        self._write(task_id, "state", self._header(task_id, ckpt, ckpt.state, phase1=False),
                    ckpt.state)
        self._free(replaced)

    def discard(self, kept1: list[Kept] | None, kept: list[Kept]) -> None:
        """Give back what :meth:`pull` kept for a checkpoint that is not wanted after all."""
        self._free([*(kept1 or []), *kept])

    def drop(self, task_id: str) -> bool:
        """Forget ``task_id``'s checkpoint (its task ended, or its checkpoint cannot be
        resumed): blocks freed, files removed. False when it had none."""
        ckpt = self._latest.pop(task_id, None)
        phase1 = self._phase1.pop(task_id, None)
        if ckpt is None and phase1 is None:
            return False
        self.counts["dropped"] += 1
        self._free([*(ckpt.state if ckpt else []), *(phase1 or [])])
        if self.folder is not None:
            self._files.submit(_remove, self.folder, task_id)
        return True

    def _free(self, kept: Iterable[Kept]) -> None:
        items = list(kept)
        if items:  # after any write queued before that still reads them
            self._files.submit(free_kept, self.pool, items)

    # -- files -------------------------------------------------------------------------------
    def _header(self, task_id: str, ckpt: Checkpoint, kept: list[Kept], *, phase1: bool
                ) -> dict[str, Any]:
        return {"task_id": task_id, "phase1": phase1, "step": ckpt.step, "steps": ckpt.steps,
                "final": ckpt.final, "meta": ckpt.meta, "attempt": ckpt.attempt,
                "tensors": [k.desc.to_dict() for k in kept]}

    def _write(self, task_id: str, part: str, header: dict[str, Any], kept: list[Kept]) -> None:
        if self.folder is None:
            return
        folder = self.folder
        self._files.submit(self._write_file, folder / f"{task_id}.{part}", header, kept)

    def _write_file(self, path: Path, header: dict[str, Any], kept: list[Kept]) -> None:
        tmp = path.with_name(path.name + ".part")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            head = msgpack.packb(header)
            with open(tmp, "wb") as f:
                f.write(MAGIC + _HEADER_LEN.pack(len(head)) + head)
                for k in kept:
                    f.write(kept_bytes(self.pool, k))
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        except OSError as exc:  # the kept copy stands; only a restart would miss it
            log.warning("checkpoint file %s not written: %s", path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def load(self, task_ids: Iterable[str]) -> int:
        """At start, before any worker connects: keep the checkpoints in the files of the
        unfinished ``task_ids``; remove every other file (finished tasks, half-written
        ones). Returns how many tasks have a checkpoint again."""
        if self.folder is None or not self.folder.is_dir():
            return 0
        wanted = set(task_ids)
        for path in self.folder.iterdir():
            if path.suffix == ".part" or path.stem not in wanted:
                path.unlink(missing_ok=True)
        for tid in sorted(wanted):
            try:
                self._load_one(tid)
            except (DiffringError, OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("task %s: checkpoint files not usable (%s); it starts over", tid,
                            exc)
                self.drop(tid)
                _remove(self.folder, tid)
        self.counts["restored"] = len(self._latest)
        return len(self._latest)

    def _load_one(self, task_id: str) -> None:
        assert self.folder is not None
        state_path = self.folder / f"{task_id}.state"
        if not state_path.exists():
            _remove(self.folder, task_id)
            return
        head, kept = self._read(state_path, task_id)
        phase1_path = self.folder / f"{task_id}.phase1"
        phase1 = None
        if phase1_path.exists():
            _, phase1 = self._read(phase1_path, task_id)
        elif not head["final"]:  # a loop state without its inputs cannot resume
            free_kept(self.pool, kept)
            raise ValueError("its phase1 file is missing")
        self._latest[task_id] = Checkpoint(int(head["step"]), int(head["steps"]),
                                           bool(head["final"]), dict(head["meta"]), kept,
                                           int(head["attempt"]))
        if phase1 is not None:
            self._phase1[task_id] = phase1

    def _read(self, path: Path, task_id: str) -> tuple[dict[str, Any], list[Kept]]:
        data = memoryview(path.read_bytes())
        if bytes(data[:8]) != MAGIC:
            raise ValueError(f"{path} is not a checkpoint file")
        (n,) = _HEADER_LEN.unpack(data[8:12])
        head = msgpack.unpackb(data[12:12 + n])
        if head["task_id"] != task_id:
            raise ValueError(f"{path} holds task {head['task_id']!r}")
        off = 12 + n
        kept: list[Kept] = []
        try:
            for d in head["tensors"]:
                like = TensorDescriptor.from_dict(d)
                kept.append(keep_bytes(self.engine, self.pool, like,
                                       data[off:off + like.nbytes], task_id=task_id))
                off += like.nbytes
        except BaseException:
            free_kept(self.pool, kept)
            raise
        return head, kept

    def flush(self) -> None:
        """Wait for the file writes and removals queued so far."""
        self._files.submit(lambda: None).result()

    def close(self) -> None:
        """Stop the lanes (the reads and releases they have left are dropped; a Mooncake call
        one is in ends within the engine's timeout) and finish the file writes."""
        lanes = list(self._lanes.values())
        for worker_id in list(self._lanes):
            self.forget(worker_id)
        for lane in lanes:
            lane.pulls.shutdown(wait=True)
        self._files.shutdown(wait=True)


def _remove(folder: Path, task_id: str) -> None:
    for part in ("phase1", "state"):
        (folder / f"{task_id}.{part}").unlink(missing_ok=True)
