"""What the front door reports about the whole service, read from the coordinator: the
queue, the service status and the status page's snapshot. Read-only; each a function of the
coordinator's state (and the time, given), so the route modules never reach past the front
door into the coordinator's parts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from controller.http import dit_offers
from controller.http.events import EventHub, result_path, thumbnail_path
from controller.ownership.coordinator import Coordinator
from controller.tasks.tasks import TERMINAL, Stage, Task

TASKS_SHOWN = 30
"""Recent tasks on the status page."""


def queue(co: Coordinator) -> dict[str, Any]:
    """``GET /v1/tasks/queue/status``: the queued and the running tasks."""
    waiting = (Stage.ACCEPTED, Stage.QUEUED)
    queued = [t.task_id for t in co.table if t.stage in waiting]
    running = [t.task_id for t in co.table if t.stage not in TERMINAL and t.stage not in waiting]
    return {
        "pending": len(queued),
        "processing": len(running),
        "queue": queued,
        "running": running,
        "max_pending": co.config.max_pending,
    }


def service(co: Coordinator) -> dict[str, Any]:
    """``GET /v1/service/status``: busy or idle, the counts, the workers, the offers."""
    counts = co.table.counts()
    return {
        "service_status": "busy" if counts["pending"] + counts["processing"] > 0 else "idle",
        "counts": counts,
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
