"""The live status page (``/`` and ``/ui``) and what it reads: ``/ui/state`` (one JSON
snapshot of rings, workers, tasks and recent results) and ``/v1/tasks/{id}/thumbnail``.

The page itself is three static files in ``controller/http/ui/`` (HTML, CSS, plain JavaScript,
no framework, no CDN), served from ``/ui/static/``. It refreshes from the event stream
(``GET /v1/events``: step progress, completions) and re-reads ``/ui/state`` every
:data:`REFRESH_S` seconds for heartbeat ages and ring depths.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from controller.http.events import result_path, thumbnail_path
from controller.http.routes import Front
from controller.http.schemas import http_error
from controller.http.thumbs import make_thumbnail, thumbnail_file
from controller.tasks.tasks import Stage

UI_DIR = Path(__file__).resolve().parent / "ui"
REFRESH_S = 2.0
TASKS_SHOWN = 30

router = APIRouter(tags=["status page"])
page_router = APIRouter()
"""The page's HTML: open even with an API key (what it reads is behind the key)."""


@page_router.get("/", include_in_schema=False)
@page_router.get("/ui", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(UI_DIR / "index.html", media_type="text/html",
                        headers={"Cache-Control": "no-store"})


@router.get("/ui/state")
async def state(front: Front) -> dict[str, Any]:
    """Everything the status page shows, in one snapshot."""
    now = time.time()
    hub = front.events
    table = front.co.table
    workers: dict[str, list[dict[str, Any]]] = {}
    for role, infos in front.co.registry.by_role().items():
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
        row = front.status(task)
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
    extra = front.status_extra()
    return {
        "service": front.service, "pipeline": front.pipeline, "now": now,
        "refresh_s": REFRESH_S, "counts": table.counts(), "rings": extra.get("rings", {}),
        "workers": workers, "tasks": tasks, "gallery": gallery,
    }


@router.get("/v1/tasks/{task_id}/thumbnail", responses={200: {"content": {"image/png": {}}}})
async def thumbnail(task_id: str, front: Front) -> Response:
    """A small PNG of a completed task's result (a video's first frame)."""
    task = await front.get(task_id)
    if task.stage != Stage.COMPLETED or not task.result_path:
        raise http_error(404, f"task {task_id} has no result yet (stage {task.stage.value})")
    result = Path(task.result_path)
    if not result.exists():
        raise http_error(404, f"the result of task {task_id} was deleted")
    out = thumbnail_file(front.co.config.output_dir, task_id)
    path = await asyncio.to_thread(make_thumbnail, result, task.media_type, out)
    return FileResponse(path, media_type="image/png",
                        headers={"Cache-Control": "max-age=3600"})
