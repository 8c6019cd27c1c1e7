"""What the front door reports about the whole service, read from the coordinator: the
queue, the service status and the status page's snapshot. Read-only; each a function of the
coordinator's state (and the time, given), so the route modules never reach past the front
door into the coordinator's parts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from contracts.roles import Role
from controller.http import dit_offers
from controller.http.events import EventHub, result_path, thumbnail_path
from controller.ownership.coordinator import Coordinator
from controller.tasks.tasks import WORKING_STAGE, Stage, Task

WORKING_ROLE = {stage: role for role, stage in WORKING_STAGE.items()}
"""The role whose worker holds a task in each working stage."""

TASKS_SHOWN = 30
"""Recent tasks on the status page."""


def queue(co: Coordinator) -> dict[str, Any]:
    """``GET /v1/tasks/queue/status``: the waiting tasks (for an encoder, a DiT or a
    decoder: ``waiting``, each queue in the order its workers are expected to take it) and
    the running ones (a worker holds them: ``running``, also by role); ``pending`` /
    ``processing`` / ``queue`` / ``running`` as LightX2V's, counted the same way."""
    waiting = co.table.waiting()
    running: dict[str, list[str]] = {role.value: [] for role in Role}
    for t in co.table:
        role = WORKING_ROLE.get(t.stage)
        if role is not None:
            running[role.value].append(t.task_id)
    queued = [t.task_id for queue in waiting.values() for t in queue]
    busy = [tid for ids in running.values() for tid in ids]
    return {
        "pending": len(queued),
        "processing": len(busy),
        "queue": queued,
        "running": busy,
        "waiting": {role.value: [t.task_id for t in q] for role, q in waiting.items()},
        "running_by_role": running,
        "stages": co.table.counts_by_stage(),
        "max_pending": co.config.max_pending,
    }


def service(co: Coordinator) -> dict[str, Any]:
    """``GET /v1/service/status``: busy or idle, the counts (by status, and the unfinished
    by stage), the workers, the offers."""
    counts = co.table.counts()
    return {
        "service_status": "busy" if counts["pending"] + counts["processing"] > 0 else "idle",
        "counts": counts,
        "stages": co.table.counts_by_stage(),
        "workers": co.registry.by_role(),
        "result_writes": co.result_writes.public(),
        **dit_offers.listing(co.registry),
    }


def page_state(co: Coordinator, hub: EventHub, status: Callable[[Task], dict[str, Any]],
               extra: Mapping[str, Any], now: float) -> dict[str, Any]:
    """``GET /ui/state``: everything the status page shows, in one snapshot (``now``: the
    wall clock, for ages)."""
    table = co.table
    workers: dict[str, list[dict[str, Any]]] = {}
    for role, infos in co.registry.by_role().items():
        rows = []
        for w in infos:
            current = [table.get(t) for t in w["current_tasks"]]
            task = next((t for t in current if t is not None), None)
            rows.append({
                "name": w["name"], "pid": w["pid"], "state": w["state"],
                "heartbeat_age_s": round(now - w["last_heartbeat"], 1),
                "current_task": task.task_id if task else None,
                "current_stage": task.stage.value if task else None,
                "step": task.step if task else 0, "steps": task.steps if task else 0,
                "tasks_done": hub.done_by_worker.get(w["name"], 0),
            })
        workers[role] = rows
    tasks = []
    for task_id in list(hub.recent)[:TASKS_SHOWN]:
        task = table.get(task_id)
        if task is None:
            continue
        row = status(task)
        row["age_s"] = round(now - task.created_at, 1)
        row["kind"] = task.kind
        tasks.append(row)
    gallery = []
    for task_id in hub.gallery:
        task = table.get(task_id)
        if task is None or task.stage != Stage.COMPLETED or not task.result_path:
            continue
        if not Path(task.result_path).exists():
            continue  # deleted (DELETE /v1/videos/{id})
        gallery.append({
            "task_id": task_id, "media_type": task.media_type,
            "result_url": result_path(task_id), "thumbnail_url": thumbnail_path(task_id),
            "finished_at": task.finished_at, "prompt": task.request.get("prompt"),
        })
    return {"now": now, "counts": table.counts(), "rings": extra.get("rings", {}),
            "workers": workers, "tasks": tasks, "gallery": gallery}
