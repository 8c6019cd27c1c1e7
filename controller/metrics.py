"""Prometheus metrics of the controller (or of the ``all`` baseline)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.metrics import DURATION_BUCKETS, CallbackCollector, Sample
from contracts.roles import Role
from controller.ownership.coordinator import Coordinator
from controller.tasks.tasks import TERMINAL, Stage, Task

STEP_SECONDS_SMOOTHING = 0.2
"""Weight of the newest step time in the moving average: follows a change of workload (other
resolutions) within a few tasks' worth of steps without jumping on one slow step."""
BEFORE_DIT = (Stage.ACCEPTED, Stage.QUEUED, Stage.ENCODING, Stage.PHASE1)


class ControllerMetrics:
    def __init__(self, co: Coordinator, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.co = co
        self.requests = Counter(
            "diffring_http_requests", "Front-door requests by endpoint and status code",
            ["endpoint", "method", "code"], registry=r)
        self.request_seconds = Histogram(
            "diffring_http_request_seconds", "Front-door request handling time", ["endpoint"],
            buckets=DURATION_BUCKETS, registry=r)
        self.task_events = Counter(
            "diffring_task_events", "Task lifecycle events (queued, claimed, completed, ...)",
            ["event"], registry=r)
        self.task_seconds = Histogram(
            "diffring_task_e2e_seconds", "Task end-to-end latency, accepted to completed",
            buckets=DURATION_BUCKETS, registry=r)
        self.stage_seconds = Histogram(
            "diffring_task_stage_seconds", "Time tasks spent in each lifecycle stage",
            ["stage"], buckets=DURATION_BUCKETS, registry=r)
        self.dit_step_seconds = 0.0
        """Moving average of measured seconds per denoising step (0 until measured)."""
        self._last_step: dict[str, tuple[int, float]] = {}
        co.listeners.append(self._on_event)
        r.register(CallbackCollector(self._gauges))
        self.ring_status: Callable[[], dict[str, Any]] = lambda: {}
        self.pool_stats: Callable[[], Any] | None = None

    def _on_event(self, event: str, task: Task) -> None:
        self.task_events.labels(event).inc()
        self._measure_step(event, task)
        if event == "completed" and task.finished_at is not None:
            self.task_seconds.observe(task.finished_at - task.created_at)
            times = sorted(task.stage_times.items(), key=lambda kv: kv[1])
            for (stage, start), (_next, end) in itertools.pairwise(times):
                self.stage_seconds.labels(stage).observe(end - start)

    def _measure_step(self, event: str, task: Task) -> None:
        """Seconds per denoising step, from consecutive progress reports of one task (so the
        autoscaler can weigh waiting work by what it costs on these GPUs)."""
        now = time.monotonic()
        if event != "progress":
            if task.stage in TERMINAL or event in ("handoff", "queued"):
                self._last_step.pop(task.task_id, None)
            return
        prev = self._last_step.get(task.task_id)
        self._last_step[task.task_id] = (task.step, now)
        if prev is not None and task.step > prev[0]:
            per_step = (now - prev[1]) / (task.step - prev[0])
            a = STEP_SECONDS_SMOOTHING
            self.dit_step_seconds = (
                per_step if not self.dit_step_seconds
                else (1 - a) * self.dit_step_seconds + a * per_step
            )

    def _dit_work(self) -> Iterable[Sample]:
        waiting = 0
        for t in list(self.co.table.tasks.values()):
            if t.stage in BEFORE_DIT:  # a resumed task has only the rest of its steps
                waiting += max(0, int(t.request.get("infer_steps") or 0) - (t.resumed_from or 0))
            elif t.stage == Stage.DENOISING:
                waiting += max(0, (t.steps or int(t.request.get("infer_steps") or 0)) - t.step)
        yield ("diffring_dit_steps_waiting", "Denoising steps not yet run of tasks that have "
               "not left the DiT stage (queued to denoising)", {}, float(waiting))
        yield ("diffring_dit_step_seconds", "Measured seconds per denoising step (moving "
               "average; 0 until the first measurement)", {}, self.dit_step_seconds)
        yield ("diffring_dit_seconds_waiting", "DiT seconds of work waiting: steps waiting "
               "times measured seconds per step (0 until measured)", {},
               waiting * self.dit_step_seconds)

    def _gauges(self) -> Iterable[Sample]:
        yield from self._dit_work()
        for status, n in self.co.table.counts().items():
            yield ("diffring_tasks", "Tasks by status", {"status": status}, float(n))
        yield ("diffring_tasks_in_flight", "Tasks accepted and not finished", {},
               float(self.co.table.in_flight()))
        blocked = self.co.result_writes.blocked
        yield ("diffring_result_writes_blocked", "Places (the controller, decoders) whose "
               "result writes fail for the storage's reasons; new tasks get 503 while > 0",
               {}, float(len(blocked)))
        yield ("diffring_results_held", "Finished results held by decoders until their "
               "files can be written", {}, float(sum(b.held for b in blocked)))
        now = time.time()
        roles: dict[str, int] = dict.fromkeys(Role, 0)
        for w in self.co.registry:
            roles[w.role] = roles.get(w.role, 0) + 1
            yield ("diffring_worker_heartbeat_age_seconds", "Seconds since a worker's last "
                   "heartbeat", {"worker": w.name, "role": w.role}, now - w.last_heartbeat)
        for role, n in roles.items():
            yield ("diffring_workers", "Registered workers by role", {"role": role}, float(n))
        for ring, st in self.ring_status().get("rings", {}).items():
            labels = {"ring": ring}
            yield ("diffring_ring_depth", "Items in the ring (tail - head)", labels,
                   float(st["depth"]))
            yield ("diffring_ring_published", "Published, unclaimed slots", labels,
                   float(st["published"]))
            yield ("diffring_ring_claimed", "Slots claimed in progress", labels,
                   float(st["claimed"]))
            yield ("diffring_ring_peers", "Peers connected to the ring", labels,
                   float(st["peers"]))
            for kind, n in st["repairs"].items():
                yield ("diffring_ring_repairs", "Ring repairs since start", {**labels,
                       "kind": kind}, float(n))
        yield from self._checkpoints()
        if self.pool_stats is not None:
            st = self.pool_stats()
            yield ("diffring_staging_pool_used_bytes", "Bytes allocated in the staging pool",
                   {"role": "controller"}, float(st.used_bytes))
            yield ("diffring_staging_pool_capacity_bytes", "Capacity of the staging pool",
                   {"role": "controller"}, float(st.capacity))

    def _checkpoints(self) -> Iterable[Sample]:
        """Denoising checkpoints kept, resumes, preemptions (the lifecycle events themselves
        are counted in ``diffring_task_events``: checkpoint, resumed, yielded, preempted)."""
        store = self.co.checkpoints
        if store is not None:
            yield ("diffring_checkpoint_bytes", "Bytes of denoising checkpoints the controller "
                   "keeps (checkpoint_store_mb bounds them)", {}, float(store.used_bytes))
            yield ("diffring_checkpoint_tasks", "Tasks whose checkpoint or final latents the "
                   "controller keeps", {}, float(len(store)))
            for outcome, n in list(store.counts.items()):
                yield ("diffring_checkpoints", "Checkpoints since start, by outcome (kept, "
                       "final, refused, resumes, dropped, restored)", {"outcome": outcome},
                       float(n))
        for what, n in list(self.co.priorities.counts.items()):
            yield ("diffring_priority_actions", "Since start: DiT claims deferred for a "
                   "more urgent task, and preemptions", {"action": what}, float(n))

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """The front door's requests counted and timed, as a plain ASGI middleware (Starlette's
        ``BaseHTTPMiddleware`` re-streams every request body through extra tasks, which
        costs the event loop — it also serves the ring verbs — dearly on 1 MB uploads)."""

        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            t0 = time.monotonic()
            code = 500

            async def send_status(message: Message) -> None:
                nonlocal code
                if message["type"] == "http.response.start":
                    code = int(message["status"])
                await send(message)

            try:
                await app(scope, receive, send_status)
            finally:
                route = scope.get("route")  # set by the router on the shared scope
                endpoint = getattr(route, "path", "unmatched")
                self.requests.labels(endpoint, scope.get("method", "?"), str(code)).inc()
                self.request_seconds.labels(endpoint).observe(time.monotonic() - t0)

        return middleware
