"""The HTTP front door (FastAPI): LightX2V's task API, served by the controller.

Field names and response shapes follow LightX2V's server so existing client scripts work;
diffring adds ``height`` / ``width`` / ``guidance_scale`` / ``true_cfg_scale`` and a finer
``stage`` in the status. Every error body is JSON ``{"detail": "<what to do>"}``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import math
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from controller.coordinator import Coordinator, QueueFull
from controller.tasks import TERMINAL, DuplicateTask, Stage, Task
from rings.errors import PayloadTooLarge

log = logging.getLogger("diffring.frontdoor")

TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
MAX_IMAGE_BYTES = 32 << 20


class _TaskBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str | None = Field(None, description="client-chosen id; a duplicate gets 409")
    prompt: str = Field(..., min_length=1, max_length=100_000)
    negative_prompt: str | None = None
    image_path: str | None = Field(
        None, description="input image for i2v / i2i: base64 or a data: URL"
    )
    last_frame_path: str | None = Field(None, description="not supported by diffring")
    save_result_path: str | None = Field(
        None, description="result file name, relative to the controller's output folder"
    )
    infer_steps: int | None = Field(None, ge=1, le=1000)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    target_shape: list[int] | None = Field(None, description="[height, width]")
    height: int | None = None
    width: int | None = None
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0)
    lora_name: str | None = Field(None, description="not supported by diffring")
    lora_strength: float | None = None


class VideoTaskRequest(_TaskBase):
    target_video_length: int | None = Field(None, ge=1, le=1025)
    target_fps: int | None = Field(None, ge=1, le=240)
    resize_mode: str | None = Field(None, description="not supported by diffring")


class ImageTaskRequest(_TaskBase):
    aspect_ratio: str | None = Field(None, description='e.g. "16:9"')
    i2i_denoise_strength: float | None = Field(None, description="not supported by diffring")


class SyncImageTaskRequest(ImageTaskRequest):
    timeout_seconds: float = Field(600.0, gt=0, le=86400)
    poll_interval_seconds: float = Field(0.5, gt=0, le=60)


class TaskCreated(BaseModel):
    task_id: str
    task_status: str
    save_result_path: str


def _bad(status: int, message: str, headers: dict[str, str] | None = None) -> HTTPException:
    return HTTPException(status_code=status, detail=message, headers=headers)


def safe_relative_path(path: str) -> str:
    """``save_result_path`` must stay inside the output folder: relative, no ``..``."""
    p = PurePosixPath(path.replace("\\", "/"))
    if not path or p.is_absolute() or ".." in p.parts or any(part == "" for part in p.parts):
        raise _bad(
            400,
            f"save_result_path {path!r} would escape the output folder; give a "
            "relative file name such as 'cat.png'",
        )
    if re.match(r"^[A-Za-z]:", path):
        raise _bad(400, f"save_result_path {path!r} must be relative")
    return str(p)


def decode_image(value: str) -> bytes:
    """Input image from base64 or a data: URL; other schemes are refused (422)."""
    value = value.strip()
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if ";base64" not in head:
            raise _bad(422, "image_path data: URL must be base64-encoded")
        value = payload
    elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://", value):
        scheme = value.split("://", 1)[0]
        raise _bad(
            422,
            f"image_path scheme {scheme!r} is not allowed; send the image as base64 or a data: URL",
        )
    elif value.startswith("/") or value.startswith("."):
        raise _bad(
            422,
            "image_path looks like a file path; the controller does not read local "
            "files — send the image as base64 or a data: URL",
        )
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(422, "image_path is not valid base64") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise _bad(413, f"input image of {len(data)} bytes exceeds {MAX_IMAGE_BYTES} bytes")
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            im.verify()
    except Exception as exc:  # PIL raises many types for undecodable data
        raise _bad(422, f"image_path does not decode as an image: {exc}") from None
    return data


def size_for_aspect(ratio: str, area: int, multiple: int) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", ratio)
    if not m or int(m[1]) == 0 or int(m[2]) == 0:
        raise _bad(422, f"aspect_ratio {ratio!r} is not of the form 'W:H' with positive integers")
    w_r, h_r = int(m[1]), int(m[2])
    if max(w_r / h_r, h_r / w_r) > 8:
        raise _bad(422, f"aspect_ratio {ratio!r} is more extreme than 8:1")
    width = math.sqrt(area * w_r / h_r)
    height = area / width
    snap = lambda v: max(multiple, round(v / multiple) * multiple)  # noqa: E731
    return snap(height), snap(width)


class FrontDoor:
    """Builds the FastAPI app around a coordinator (disaggregated or baseline)."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        status_extra: Callable[[], dict[str, Any]],
        service: str,
    ) -> None:
        self.co = coordinator
        self.pipeline = coordinator.pipeline
        self.status_extra = status_extra
        self.service = service
        self.app = self._build()

    # -- request building -----------------------------------------------------------------
    def _generation_request(self, body: _TaskBase, kind: str) -> dict[str, Any]:
        from workers.models.base import GenerationRequest, InvalidRequestError, task_spec

        for name in ("last_frame_path", "lora_name", "resize_mode", "i2i_denoise_strength"):
            if getattr(body, name, None) not in (None, ""):
                raise _bad(422, f"{name} is not supported by diffring; leave it unset")
        if body.lora_strength not in (None, 0, 1, 1.0):
            raise _bad(422, "lora_strength is not supported by diffring; leave it unset")
        spec = task_spec(self.pipeline)
        fields: dict[str, Any] = {"task": self.pipeline, "prompt": body.prompt}
        for name in (
            "negative_prompt",
            "seed",
            "infer_steps",
            "guidance_scale",
            "true_cfg_scale",
            "height",
            "width",
        ):
            value = getattr(body, name)
            if value is not None:
                fields[name] = value
        if body.target_shape is not None:
            if len(body.target_shape) != 2:
                raise _bad(422, "target_shape must be [height, width]")
            fields["height"], fields["width"] = body.target_shape
        if isinstance(body, VideoTaskRequest):
            if body.target_video_length is not None:
                fields["num_frames"] = body.target_video_length
            if body.target_fps is not None:
                fields["fps"] = body.target_fps
        if isinstance(body, ImageTaskRequest) and body.aspect_ratio:
            if "height" in fields or "width" in fields:
                raise _bad(422, "give aspect_ratio or an explicit size, not both")
            h = spec.defaults.get("height") or 1328
            w = spec.defaults.get("width") or 1328
            fields["height"], fields["width"] = size_for_aspect(
                body.aspect_ratio, int(h) * int(w), spec.size_multiple
            )
        try:
            return GenerationRequest.from_dict(fields).to_dict()
        except (InvalidRequestError, TypeError) as exc:
            raise _bad(422, str(exc)) from None

    def create_task(self, body: _TaskBase, kind: str) -> Task:
        from workers.models.base import task_spec

        spec = task_spec(self.pipeline)
        served = spec.output
        if kind != served:
            raise _bad(
                400,
                f"this controller serves {self.pipeline} ({served} results); "
                f"POST to /v1/tasks/{served}/ instead",
            )
        request = self._generation_request(body, kind)
        task_id = body.task_id or uuid.uuid4().hex
        if not TASK_ID_RE.match(task_id):
            raise _bad(422, "task_id must be 1-128 characters of letters, digits, '_', '.', '-'")
        if self.co.table.get(task_id) is not None:
            raise _bad(409, f"task {task_id} exists already; choose another task_id")
        image = None
        if spec.needs_image:
            if not body.image_path:
                raise _bad(422, f"{self.pipeline} needs an input image: set image_path")
            image = decode_image(body.image_path)
        elif body.image_path:
            raise _bad(422, f"{self.pipeline} takes no input image; leave image_path unset")
        save = safe_relative_path(body.save_result_path) if body.save_result_path else ""
        task = Task(
            task_id=task_id,
            kind=kind,
            pipeline=self.pipeline,
            request=request,
            save_result_path=save,
        )
        if image is not None:
            task.image_bytes = image
        try:
            if image is not None and self.co.stage_image is not None:
                task.image = self.co.stage_image(image)
            self.co.submit(task)
        except PayloadTooLarge as exc:
            self._unstage(task)
            raise _bad(413, f"request too large for a request-ring slot: {exc}") from None
        except QueueFull as exc:
            self._unstage(task)
            retry = max(1, math.ceil(exc.retry_after_s))
            raise _bad(
                429, f"{exc}; retry in about {retry} s", {"Retry-After": str(retry)}
            ) from None
        except DuplicateTask:
            self._unstage(task)
            raise _bad(409, f"task {task_id} exists already") from None
        except Exception:
            self._unstage(task)
            raise
        return task

    def _unstage(self, task: Task) -> None:
        if task.image is not None and self.co.release_image is not None:
            self.co.release_image(task)
            task.image = None

    def created(self, task: Task) -> dict[str, Any]:
        return {
            "task_id": task.task_id,
            "task_status": task.status,
            "save_result_path": task.save_result_path or "",
        }

    def status(self, task: Task) -> dict[str, Any]:
        out = task.public()
        out["queue_position"] = self.co.table.queue_position(task)
        if task.stage == Stage.DENOISING and task.steps:
            out["progress"] = f"denoising step {task.step}/{task.steps}"
        if task.result_path:
            out["save_result_path"] = str(Path(task.result_path).relative_to(self.co.output_dir))
        return out

    def _get(self, task_id: str) -> Task:
        task = self.co.table.get(task_id)
        if task is None:
            raise _bad(404, f"no task {task_id}")
        return task

    # -- app --------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(
            title="diffring",
            description=f"Disaggregated diffusion serving — this controller serves "
            f"{self.pipeline}.",
            version="0.1.0",
        )

        @app.exception_handler(RequestValidationError)
        async def validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
            problems = []
            for err in exc.errors():
                loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
                if err.get("type") == "extra_forbidden":
                    problems.append(f"unknown field {loc!r}")
                else:
                    problems.append(f"{loc}: {err.get('msg')}")
            return JSONResponse(status_code=422, content={"detail": "; ".join(problems)})

        @app.exception_handler(Exception)
        async def unexpected(_req: Request, exc: Exception) -> JSONResponse:
            log.exception("front door: unexpected error")
            return JSONResponse(
                status_code=500,
                content={"detail": f"internal error ({type(exc).__name__}: {exc}); the "
                                   "controller log has the details"},
            )

        @app.post("/v1/tasks/video/", response_model=TaskCreated)
        async def create_video(body: VideoTaskRequest) -> dict[str, Any]:
            return self.created(self.create_task(body, "video"))

        @app.post("/v1/tasks/image/", response_model=TaskCreated)
        async def create_image(body: ImageTaskRequest) -> dict[str, Any]:
            return self.created(self.create_task(body, "image"))

        @app.post("/v1/tasks/image/sync", responses={200: {"content": {"image/png": {}}}})
        async def create_image_sync(body: SyncImageTaskRequest) -> Response:
            fields = body.model_dump(exclude={"timeout_seconds", "poll_interval_seconds"})
            task = self.create_task(ImageTaskRequest(**fields), "image")
            deadline = time.monotonic() + body.timeout_seconds
            while task.stage not in TERMINAL:
                if time.monotonic() >= deadline:
                    raise _bad(
                        504,
                        f"task {task.task_id} did not finish within "
                        f"{body.timeout_seconds:g} s; it goes on — poll "
                        f"/v1/tasks/{task.task_id}/status",
                    )
                await asyncio.sleep(body.poll_interval_seconds)
            if task.stage != Stage.COMPLETED or not task.result_path:
                raise _bad(500, f"task {task.task_id} {task.stage.value}: {task.error}")
            return FileResponse(
                task.result_path,
                media_type=task.media_type or "image/png",
                headers={"X-Task-Id": task.task_id},
            )

        @app.get("/v1/tasks/")
        async def list_tasks(
            offset: int = Query(0, ge=0),
            limit: int = Query(100, ge=1, le=1000),
            status: Literal["pending", "processing", "completed", "failed", "cancelled"]
            | None = None,
        ) -> dict[str, Any]:
            tasks = [t for t in self.co.table if status is None or t.status == status]
            page = tasks[offset : offset + limit]
            return {
                "total": len(tasks),
                "offset": offset,
                "limit": limit,
                "tasks": [self.status(t) for t in page],
            }

        @app.get("/v1/tasks/queue/status")
        async def queue_status() -> dict[str, Any]:
            queued = [t.task_id for t in self.co.table if t.stage in (Stage.ACCEPTED, Stage.QUEUED)]
            running = [
                t.task_id
                for t in self.co.table
                if t.stage not in TERMINAL and t.stage not in (Stage.ACCEPTED, Stage.QUEUED)
            ]
            return {
                "pending": len(queued),
                "processing": len(running),
                "queue": queued,
                "running": running,
                "max_pending": self.co.max_pending,
                **self.status_extra(),
            }

        @app.get("/v1/tasks/{task_id}/status")
        async def task_status(task_id: str) -> dict[str, Any]:
            return self.status(self._get(task_id))

        @app.get("/v1/tasks/{task_id}/result")
        async def task_result(task_id: str) -> Response:
            task = self._get(task_id)
            if task.stage != Stage.COMPLETED or not task.result_path:
                raise _bad(
                    404,
                    f"task {task_id} has no result yet (status {task.status}, "
                    f"stage {task.stage.value})",
                )
            return FileResponse(
                task.result_path, media_type=task.media_type, filename=Path(task.result_path).name
            )

        @app.delete("/v1/tasks/{task_id}")
        async def cancel(task_id: str) -> dict[str, Any]:
            task = self.co.table.get(task_id)
            if task is None:
                return {"stop_status": "error", "reason": f"no task {task_id}"}
            outcome = self.co.cancel(task)
            reason = (
                f"task already {task.stage.value}"
                if outcome == "do_nothing"
                else f"cancelled ({task.stage.value})"
                if task.stage in TERMINAL
                else "cancel requested; stops at the next step boundary"
            )
            return {"stop_status": outcome, "reason": reason}

        @app.get("/v1/service/status")
        async def service_status() -> dict[str, Any]:
            counts = self.co.table.counts()
            busy = counts["pending"] + counts["processing"] > 0
            return {
                "service_status": "busy" if busy else "idle",
                "service": self.service,
                "pipeline": self.pipeline,
                "counts": counts,
                "workers": self.co.workers_by_role(),
                **self.status_extra(),
            }

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        return app
