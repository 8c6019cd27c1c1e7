"""The front door's routes: LightX2V's task API as plain handlers on one ``APIRouter``.

Each handler finds the :class:`~controller.http.frontdoor.FrontDoor` of its application through
the ``Front`` dependency and does no more than translate HTTP to its methods and back.
``router`` holds the API (behind the API key, when one is configured); ``open_router``
what stays open (``/health``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, Response

from controller.http.bodies import OffLoopJSONRoute
from controller.http.frontdoor import FrontDoor
from controller.http.schemas import (
    ImageTaskRequest,
    SyncImageTaskRequest,
    TaskCreated,
    VideoTaskRequest,
    http_error,
)
from controller.tasks.tasks import TERMINAL, Stage


def _front(request: Request) -> FrontDoor:
    front: FrontDoor = request.app.state.front
    return front


Front = Annotated[FrontDoor, Depends(_front)]
router = APIRouter(route_class=OffLoopJSONRoute)
open_router = APIRouter()


@router.post("/v1/tasks/video/", response_model=TaskCreated)
async def create_video(body: VideoTaskRequest, front: Front) -> dict[str, Any]:
    return front.created(await front.create_task(body, "video"))


@router.post("/v1/tasks/image/", response_model=TaskCreated)
async def create_image(body: ImageTaskRequest, front: Front) -> dict[str, Any]:
    return front.created(await front.create_task(body, "image"))


@router.post(
    "/v1/tasks/image/sync",
    responses={
        200: {"content": {"image/png": {}}, "description": "the result image"},
        409: {"description": "the task was cancelled before it finished"},
        504: {"description": "not finished within timeout_seconds; the task goes on"},
    },
)
async def create_image_sync(body: SyncImageTaskRequest, front: Front) -> Response:
    fields = body.model_dump(exclude={"timeout_seconds", "poll_interval_seconds"})
    task = await front.create_task(ImageTaskRequest(**fields), "image")
    deadline = time.monotonic() + body.timeout_seconds
    while task.stage not in TERMINAL:
        if time.monotonic() >= deadline:
            raise http_error(
                504,
                f"task {task.task_id} did not finish within {body.timeout_seconds:g} s; it "
                f"goes on — poll /v1/tasks/{task.task_id}/status",
            )
        await asyncio.sleep(body.poll_interval_seconds)
    if task.stage == Stage.CANCELLED:
        raise http_error(409, f"task {task.task_id} was cancelled: {task.error}")
    if task.stage != Stage.COMPLETED or not task.result_path:
        raise http_error(500, f"task {task.task_id} {task.stage.value}: {task.error}")
    return FileResponse(
        task.result_path,
        media_type=task.media_type or "image/png",
        headers={"X-Task-Id": task.task_id},
    )


@router.get("/v1/tasks/")
async def list_tasks(
    front: Front,
    offset: int = Query(0, ge=0, le=2**62),
    limit: int = Query(100, ge=1, le=1000),
    status: Literal["pending", "processing", "completed", "failed", "cancelled"] | None = None,
    order: Literal["newest", "oldest"] = Query(
        "newest", description="newest first (the default) or oldest first"),
) -> dict[str, Any]:
    return await front.list_tasks(status, offset, limit, order)


@router.get("/v1/tasks/queue/status")
async def queue_status(front: Front) -> dict[str, Any]:
    return front.queue()


@router.get("/v1/tasks/{task_id}/status")
async def task_status(task_id: str, front: Front) -> dict[str, Any]:
    return front.status(await front.get(task_id))


@router.get("/v1/tasks/{task_id}/result")
async def task_result(task_id: str, front: Front) -> Response:
    task = await front.get(task_id)
    if task.stage != Stage.COMPLETED or not task.result_path:
        raise http_error(
            404,
            f"task {task_id} has no result yet (status {task.status}, stage {task.stage.value})",
        )
    if not Path(task.result_path).is_file():
        raise http_error(404, f"the result of task {task_id} was deleted")
    return FileResponse(
        task.result_path, media_type=task.media_type, filename=Path(task.result_path).name
    )


@router.delete("/v1/tasks/{task_id}")
async def cancel(task_id: str, front: Front) -> dict[str, Any]:
    return await front.cancel(task_id)


@router.get("/v1/service/status")
async def service_status(front: Front) -> dict[str, Any]:
    return front.service_status()


@router.get("/v1/loras")
async def list_loras(front: Front) -> dict[str, Any]:
    """The LoRA adapters the transformer workers serve (and their step-cache kinds)."""
    return front.loras()


@open_router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}
