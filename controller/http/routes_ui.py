"""The live status page (``/`` and ``/ui``) and what it reads: ``/ui/state`` (one JSON
snapshot of rings, workers, tasks and recent results) and ``/v1/tasks/{id}/thumbnail``.

The page itself is three static files in ``controller/http/ui/`` (HTML, CSS, plain JavaScript,
no framework, no CDN), served from ``/ui/static/``. It refreshes from the event stream
(``GET /v1/events``: step progress, completions) and re-reads ``/ui/state`` every
:data:`REFRESH_S` seconds for heartbeat ages and ring depths.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from controller.http.routes import Front
from controller.http.schemas import http_error
from controller.tasks.tasks import Stage

UI_DIR = Path(__file__).resolve().parent / "ui"
REFRESH_S = 2.0

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
    return {"refresh_s": REFRESH_S, **front.page_state(time.time())}


@router.get("/v1/tasks/{task_id}/thumbnail", responses={200: {"content": {"image/png": {}}}})
async def thumbnail(task_id: str, front: Front) -> Response:
    """A small PNG of a completed task's result (a video's first frame)."""
    task = await front.get(task_id)
    if task.stage != Stage.COMPLETED or not task.result_path:
        raise http_error(404, f"task {task_id} has no result yet (stage {task.stage.value})")
    result = Path(task.result_path)
    if not result.exists():
        raise http_error(404, f"the result of task {task_id} was deleted")
    return FileResponse(await front.thumbnail(task), media_type="image/png",
                        headers={"Cache-Control": "max-age=3600"})
