"""Task lifecycle events, fanned out to subscribers: the server-sent event streams
(``GET /v1/tasks/{id}/events``, ``GET /v1/events``), the OpenAI routes' synchronous waits and
the status page.

The hub is one of the coordinator's ``listeners``: the coordinator calls it on the event-loop
thread for every lifecycle step (queued, claimed, progress, handoff, completed, failed,
cancelled), so delivery is a plain append to each subscriber's buffer plus a wake-up — no
locks, no thread hops. A subscriber that falls :data:`MAX_BACKLOG` events behind is dropped
with a ``lagged`` event (the client reconnects and gets a fresh snapshot), so a stalled
client never makes the controller buffer without bound.

Event names on the wire:

``status``     the task as ``GET /v1/tasks/{id}/status`` shows it (first event of a per-task
               stream, so a late subscriber starts from the current state)
``stage``      a stage change: queued (again, with a new ``attempt``, after a retry),
               encoding, phase1, denoising, phase2, decoding
``progress``   denoising step ``step`` of ``steps``
``completed``  the result is ready: ``result_url``, ``media_type``, ``thumbnail_url``
``failed``, ``cancelled``   with ``error`` and ``error_type``
``checkpoint`` the controller kept a checkpoint of the denoising loop: ``checkpoint_step``
               of ``steps`` (``final``: the final latents, kept until the result is written)
``resumed``    a new attempt starts from the kept checkpoint, not from the encoder: waiting
               in ``stage`` (phase1: for a DiT from step ``resumed_from``; phase2: only the
               decoder runs again)
``yielded``    its DiT handed it back at a step boundary, checkpointed (drained)
``preempting`` its DiT was asked to yield for a more urgent task (``priority``)
``preempted``  ... and did: it resumes later (``preemptions`` so far); never charged
``handover``   Wan2.2-A14B's split placement: the high-noise DiT reached the boundary and
               handed the task over, its state kept, for a low-noise DiT (``resumed`` next,
               when one takes it); never charged
``lagged``     this subscriber fell too far behind and is dropped; reconnect
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from controller.ownership.coordinator import Coordinator
from controller.tasks.tasks import TERMINAL, Stage, Task, waiting_for

log = logging.getLogger("diffring.events")

MAX_BACKLOG = 1024
"""Undelivered events a subscriber may have before it is dropped."""
RECENT_TASKS = 200
"""Tasks the hub remembers for the status page (most recent activity first)."""
GALLERY_SIZE = 24
"""Completed tasks the status page's gallery shows."""

TERMINAL_EVENTS = frozenset({"completed", "failed", "cancelled"})
# Coordinator event -> wire event; claimed / handoff / queued are all stage changes.
_CHECKPOINT_EVENTS = frozenset({"checkpoint", "resumed", "yielded", "preempting", "preempted",
                                "handover"})
_WIRE_NAME = {"queued": "stage", "claimed": "stage", "handoff": "stage", "progress": "progress",
              "completed": "completed", "failed": "failed", "cancelled": "cancelled",
              **{e: e for e in _CHECKPOINT_EVENTS}}


def result_path(task_id: str) -> str:
    return f"/v1/tasks/{task_id}/result"


def thumbnail_path(task_id: str) -> str:
    return f"/v1/tasks/{task_id}/thumbnail"


def task_event(name: str, task: Task) -> dict[str, Any]:
    """The data of one wire event about ``task``."""
    data: dict[str, Any] = {
        "task_id": task.task_id,
        "stage": task.stage.value,
        "status": task.status,
        "attempt": task.attempt,
        "worker": task.worker,
        "at": time.time(),
    }
    data["waiting_for"] = waiting_for(task)
    if task.waiting_expert is not None and task.stage == Stage.ACCEPTED:
        data["waiting_expert"] = task.waiting_expert  # split: a DiT of this expert
    if name == "progress" or task.stage == Stage.DENOISING:
        data["step"], data["steps"] = task.step, task.steps
        if task.expert is not None:  # Wan2.2-A14B: which expert ran the step
            data["expert"] = task.expert
    if name == "completed":
        data["result_url"] = result_path(task.task_id)
        data["thumbnail_url"] = thumbnail_path(task.task_id)
        data["media_type"] = task.media_type
    if name in ("failed", "cancelled"):
        data["error"], data["error_type"] = task.error, task.error_type
    if name in _CHECKPOINT_EVENTS:
        steps = task.steps or task.request.get("infer_steps")
        data.update(checkpoint_step=task.checkpoint_step, steps=steps,
                    resumed_from=task.resumed_from, resumes=task.resumes,
                    preemptions=task.preemptions, priority=task.priority)
        if name == "checkpoint":  # the last step's: the final latents
            data["final"] = task.checkpoint_step is not None and task.checkpoint_step == steps
    return data


def terminal_event(task: Task) -> tuple[str, dict[str, Any]]:
    """The closing event of a task that is already over."""
    assert task.stage in TERMINAL
    name = task.stage.value
    return name, task_event(name, task)


@dataclass(eq=False)
class Subscriber:
    """One stream's buffer: events of one task (``task_id``) or of all (None)."""

    task_id: str | None
    backlog: collections.deque[tuple[int, str, dict[str, Any]]] = field(
        default_factory=collections.deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lagged: bool = False
    closed: bool = False

    async def events(self) -> AsyncIterator[tuple[int, str, dict[str, Any]]]:
        """(sequence number, name, data) as they come; ends on close, or after ``lagged``."""
        while True:
            while self.backlog:
                yield self.backlog.popleft()
            if self.lagged:
                yield 0, "lagged", {"task_id": self.task_id,
                                    "error": f"more than {MAX_BACKLOG} events behind; "
                                             "reconnect for a fresh snapshot"}
                return
            if self.closed:
                return
            self.wake.clear()
            await self.wake.wait()


class EventHub:
    """Listens to a coordinator and hands its task events to subscribers."""

    def __init__(self, co: Coordinator) -> None:
        self.co = co
        self._subs: dict[str | None, set[Subscriber]] = collections.defaultdict(set)
        self._seq = itertools.count(1)
        self.closed = False
        # For the status page: recent activity, recent results, work done per worker name.
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.gallery: collections.deque[str] = collections.deque(maxlen=GALLERY_SIZE)
        self.done_by_worker: collections.Counter[str] = collections.Counter()
        for task in list(co.table)[-RECENT_TASKS:]:  # what a restarted controller restored
            self._remember(task)
        co.listeners.append(self._on_event)

    # -- coordinator side (event-loop thread) ----------------------------------------------
    def _remember(self, task: Task) -> None:
        self.recent[task.task_id] = None
        self.recent.move_to_end(task.task_id, last=False)
        while len(self.recent) > RECENT_TASKS:
            self.recent.popitem()
        if task.stage == Stage.COMPLETED and task.task_id not in self.gallery:
            self.gallery.appendleft(task.task_id)

    def _on_event(self, event: str, task: Task) -> None:
        # A listener must never raise into the coordinator's lifecycle step.
        try:
            self._remember(task)
            if event in ("handoff", "completed") and task.worker:
                self.done_by_worker[task.worker] += 1
            name = _WIRE_NAME.get(event)
            if name is None:
                return
            self.publish(name, task_event(name, task))
        except Exception:
            log.exception("event hub: dropping event %s of task %s", event, task.task_id)

    def publish(self, name: str, data: dict[str, Any]) -> None:
        seq = next(self._seq)
        for key in (data.get("task_id"), None):
            for sub in self._subs.get(key, ()):
                if len(sub.backlog) >= MAX_BACKLOG:
                    sub.lagged = True
                else:
                    sub.backlog.append((seq, name, data))
                sub.wake.set()

    # -- subscriber side ---------------------------------------------------------------------
    def subscribe(self, task_id: str | None) -> Subscriber:
        sub = Subscriber(task_id)
        if self.closed:
            sub.closed = True
        self._subs[task_id].add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        subs = self._subs.get(sub.task_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.task_id]

    async def wait_terminal(self, task: Task) -> Task:
        """Wait (without polling) until ``task`` is completed, failed or cancelled; raises
        :class:`ShuttingDown` when the hub closes first."""
        while task.stage not in TERMINAL:
            if self.closed:
                raise ShuttingDown("the controller is shutting down")
            sub = self.subscribe(task.task_id)
            try:
                async for _seq, name, _data in sub.events():
                    if name in TERMINAL_EVENTS or task.stage in TERMINAL:
                        break
            finally:
                self.unsubscribe(sub)
        return task

    def close(self) -> None:
        """End every stream (the server is stopping: open streams would hold it up)."""
        self.closed = True
        for subs in self._subs.values():
            for sub in subs:
                sub.closed = True
                sub.wake.set()


class ShuttingDown(Exception):
    """A wait ended because the controller is stopping."""
