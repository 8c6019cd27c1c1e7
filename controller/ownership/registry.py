"""The workers registered with a controller: who they are, when each was last heard from.

A worker registers over its control connection and is known until that connection drops or
it reports a fatal error (:meth:`WorkerRegistry.drop`); its heartbeats say it lives. Liveness
is decided on the caller's monotonic ``now`` (``heard_at``); ``last_heartbeat`` is the wall
clock of the same moment, for people (status page, metrics).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from contracts.roles import Role
from controller.errors import ControlError


@dataclass
class WorkerInfo:
    worker_id: int
    role: Role
    name: str
    pid: int
    segment: str
    pipeline: str
    connected_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    heard_at: float = 0.0
    """When it was last heard from, on the registry's monotonic clock."""
    state: str = "running"
    tasks: set[str] = field(default_factory=set)
    loras: tuple[str, ...] = ()
    """A transformer worker's LoRA adapters (its ``lora_dir``'s files at registration)."""
    caches: tuple[str, ...] = ()
    """The step-cache kinds a transformer worker's model runs."""
    fused: tuple[tuple[str, float], ...] = ()
    """A transformer worker's adapters merged into its weights (name, strength): every
    request it serves gets them."""
    recipe: str | None = None
    """A transformer worker's recipe (contracts/recipes.py), if any."""
    stats: dict[str, float] = field(default_factory=dict)
    """What its last heartbeat reported (a model stage: resident and peak GPU bytes)."""
    checkpoints: bool = False
    """A transformer worker that checkpoints its loops: it can yield at a step boundary."""
    experts: str | None = None
    """Wan2.2-A14B ``split``: the one expert this DiT holds (``high`` pulls the Phase1 ring,
    ``low`` takes the tasks handed over at the boundary); None: every DiT of the model."""

    def public(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "name": self.name,
            "pid": self.pid,
            "state": self.state,
            "connected_at": self.connected_at,
            "last_heartbeat": self.last_heartbeat,
            "current_tasks": sorted(self.tasks),
            "segment": self.segment,
            **({"loras": list(self.loras), "caches": list(self.caches),
                "fused": [{"name": n, "strength": w} for n, w in self.fused],
                "recipe": self.recipe, "checkpoints": self.checkpoints}
               if self.role == Role.TRANSFORMER else {}),
            **({"experts": self.experts} if self.experts is not None else {}),
            "stats": dict(self.stats),
        }


class WorkerRegistry:
    """The registered workers of one controller (serving ``pipeline``), by worker id."""

    def __init__(self, pipeline: str, heartbeat_interval_s: float) -> None:
        self.pipeline = pipeline
        self.heartbeat_interval_s = heartbeat_interval_s
        self._workers: dict[int, WorkerInfo] = {}
        self._next = 1

    def register(self, role: str, name: str, pid: int, pipeline: str, segment: str,
                 now: float, *, loras: tuple[str, ...] = (), caches: tuple[str, ...] = (),
                 fused: tuple[tuple[str, float], ...] = (), recipe: str | None = None,
                 checkpoints: bool = False, experts: str | None = None) -> WorkerInfo:
        """A new worker (ids are never reused), or ControlError saying why not."""
        if pipeline != self.pipeline:
            raise ControlError(
                f"this controller serves pipeline {self.pipeline!r}; worker {name} is "
                f"configured for {pipeline!r}"
            )
        try:
            known = Role(role)
        except ValueError:
            raise ControlError(f"unknown worker role {role!r}") from None
        info = WorkerInfo(self._next, known, name, pid, segment, pipeline, heard_at=now,
                          loras=tuple(loras), caches=tuple(caches), fused=tuple(fused),
                          recipe=recipe, checkpoints=checkpoints, experts=experts)
        self._workers[info.worker_id] = info
        self._next += 1
        return info

    def heard(self, worker: WorkerInfo, now: float) -> None:
        worker.heard_at = now
        worker.last_heartbeat = time.time()
        worker.state = "running"

    def drop(self, worker: WorkerInfo) -> bool:
        """Forget ``worker``; False if it was gone already."""
        if self._workers.pop(worker.worker_id, None) is None:
            return False
        worker.state = "gone"
        return True

    def get(self, worker_id: int | None) -> WorkerInfo | None:
        return None if worker_id is None else self._workers.get(worker_id)

    def alive(self, worker_id: int, now: float) -> bool:
        """Registered and heard from lately (a hung producer serves no reads either)."""
        w = self._workers.get(worker_id)
        return w is not None and now - w.heard_at <= 3 * self.heartbeat_interval_s

    def mark_silent(self, before: float) -> None:
        """Workers not heard from since ``before`` show as silent (their leases expire on
        their own)."""
        for w in self._workers.values():
            if w.heard_at < before:
                w.state = "silent"

    def __iter__(self) -> Iterator[WorkerInfo]:
        # A copy: the metrics thread iterates while the loop registers and drops.
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def dit_offers(self) -> tuple[dict[str, list[str]], set[str]] | None:
        """What the registered transformer workers serve: adapter name -> the workers that
        have it, and the cache kinds any of them runs; None while none is registered (then
        nothing can be judged: the worker that takes the task checks)."""
        dits = [w for w in self if w.role == Role.TRANSFORMER]
        if not dits:
            return None
        loras: dict[str, list[str]] = {}
        for w in dits:
            for name in w.loras:
                loras.setdefault(name, []).append(w.name)
        return dict(sorted(loras.items())), {k for w in dits for k in w.caches}

    def dit_fused(self) -> dict[str, list[tuple[str, float]]]:
        """Adapters fused into registered transformer workers' weights: name -> (worker,
        strength) of each worker that has it."""
        out: dict[str, list[tuple[str, float]]] = {}
        for w in self:
            if w.role == Role.TRANSFORMER:
                for name, strength in w.fused:
                    out.setdefault(name, []).append((w.name, strength))
        return dict(sorted(out.items()))

    def dit_recipes(self) -> set[str | None]:
        """The recipes of the registered transformer workers (None: a worker without)."""
        return {w.recipe for w in self if w.role == Role.TRANSFORMER}

    def by_role(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {role.value: [] for role in Role}
        for w in self:
            out.setdefault(w.role, []).append(w.public())
        return out
