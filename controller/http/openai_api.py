"""OpenAI-compatible images and videos, mapped onto the front door's tasks.

``POST /v1/images/generations`` (T2I) and ``POST /v1/images/edits`` (I2I, multipart) create
``n`` ordinary tasks (seeds ``seed``, ``seed + 1``, ...), wait for them through the event hub
and answer OpenAI's ``ImagesResponse``. ``POST /v1/videos`` (T2V / I2V) creates one task and
answers a ``video`` job object at once; ``GET /v1/videos/{id}`` maps the task's stage to
OpenAI's status and a 0-100 progress, ``GET .../content`` serves the MP4 (or the poster
frame with ``variant=thumbnail``) and ``DELETE`` cancels the task and deletes its files.
Each job is a task like any other: ``/v1/tasks/{id}/status`` and ``/events`` see it too.

The bodies (pydantic, at the HTTP edge only) accept OpenAI's own fields — those that change
nothing here (``model``, ``user``, ``quality``, ...) are accepted and ignored, those diffring
cannot honour (``stream``, ``mask``, a transparent background, a non-PNG format) are refused
— and diffring's extensions (``seed``, ``negative_prompt``, ``infer_steps``,
``guidance_scale``, ``true_cfg_scale``, ``guidance_scale_2``; videos also ``fps`` and
``num_frames``). Errors leave these routes in OpenAI's shape (:mod:`controller.http.routes_openai`).
"""

from __future__ import annotations

import asyncio
import base64
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contracts.pipelines import task_spec
from controller.http.frontdoor import FrontDoor
from controller.http.schemas import ImageTaskRequest, TaskRequest, VideoTaskRequest
from controller.http.thumbs import remove_thumbnail
from controller.tasks.tasks import TERMINAL, Stage, Task


class OpenAIError(HTTPException):
    """An error these routes answer in OpenAI's shape, naming the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.param = param
        self.code = code


NO_RETRY = {"x-should-retry": "false"}
"""The header the openai package reads before retrying a 5xx (or a 409 / 429)."""


class _Extensions(BaseModel):
    """diffring's own fields, accepted beside OpenAI's."""

    model_config = ConfigDict(extra="forbid")

    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="diffring: noise seed")
    negative_prompt: str | None = Field(None, description="diffring: what to steer away from")
    infer_steps: int | None = Field(None, ge=1, le=1000, description="diffring: denoising steps")
    guidance_scale: float | None = Field(None, ge=0, description="diffring: Wan CFG scale")
    true_cfg_scale: float | None = Field(None, ge=0, description="diffring: Qwen CFG scale")
    guidance_scale_2: float | None = Field(
        None, ge=0, description="diffring: Wan2.2-A14B low-noise expert's CFG scale")
    loras: list[dict[str, Any]] | None = Field(
        None, description='diffring: LoRA adapters [{"name", "strength"}] (GET /v1/loras)')
    cache: dict[str, Any] | None = Field(
        None, description='diffring: step cache {"kind", ...} in diffusers\' names')
    priority: str | None = Field(
        None, description="diffring: low, normal (default) or high (release order, "
        "preemption)")


class ImageParams(_Extensions):
    """``/v1/images/generations`` (JSON) and ``/v1/images/edits`` (multipart) fields."""

    prompt: str = Field(..., min_length=1, max_length=100_000)
    n: int = Field(1, ge=1, le=10, description="images to make (one task each)")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" or "auto"')
    response_format: Literal["b64_json", "url"] | None = Field(
        None, description="b64_json (default) or url (the task's result URL)")
    output_format: Literal["png"] | None = None
    background: Literal["auto", "opaque"] | None = None
    stream: bool | None = None
    partial_images: int | None = Field(None, ge=0, le=0)
    i2i_denoise_strength: float | None = Field(
        None, description="LightX2V's extension, Qwen-Image edits (0, 1]: how much of the "
        "input image is redrawn; on a qwen_t2i controller an edit is image-to-image and needs it")
    # OpenAI fields with no effect here: accepted so that existing clients work unchanged.
    model: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    quality: str | None = None
    style: str | None = None
    moderation: str | None = None
    input_fidelity: str | None = None
    output_compression: int | None = None


class VideoParams(_Extensions):
    """``/v1/videos`` fields (multipart, as the openai package sends them, or JSON)."""

    prompt: str = Field(..., min_length=1, max_length=100_000)
    model: str | None = None
    seconds: float | None = Field(None, gt=0, le=600, description="clip length; frames = "
                                  "4k+1 nearest seconds x fps")
    size: str | None = Field(None, description='"WIDTHxHEIGHT"')
    input_reference: dict[str, Any] | None = Field(
        None, description='I2V input image as JSON: {"image_url": "data:image/png;base64,..."}')
    fps: int | None = Field(None, ge=1, le=240, description="diffring: frames per second")
    num_frames: int | None = Field(None, ge=1, le=1025, description="diffring: 4k+1 frames")


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A person-readable message for a body that does not validate, and its first field."""
    problems, param = [], None
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        param = param or loc or None
        if err.get("type") == "extra_forbidden":
            problems.append(f"unrecognized parameter {loc!r}")
        elif err.get("type") == "missing":
            problems.append(f"missing required parameter {loc!r}")
        else:
            problems.append(f"{loc}: {err.get('msg')}")
    return "; ".join(problems), param


def parse_params(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise OpenAIError(400, message, param) from None


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"WxH"`` -> (height, width); ``None`` / ``"auto"`` -> the pipeline's default."""
    if size is None or size == "auto":
        return None, None
    m = re.fullmatch(r"\s*(\d{1,5})\s*x\s*(\d{1,5})\s*", size)
    if not m:
        raise OpenAIError(400, f"size {size!r} is not of the form 'WIDTHxHEIGHT' (e.g. "
                               "'1024x1024') or 'auto'", "size")
    return int(m[2]), int(m[1])


def _body(model: type[TaskRequest], **fields: Any) -> Any:
    """The front door's own request body, so that the task is built exactly as there."""
    try:
        return model(**fields)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise OpenAIError(400, message, param) from None


def _progress(task: Task) -> int:
    """A 0-100 estimate from the stage (denoising dominates, so it gets 10-90)."""
    fixed = {Stage.ACCEPTED: 0, Stage.QUEUED: 0, Stage.ENCODING: 5, Stage.PHASE1: 10,
             Stage.PHASE2: 90, Stage.DECODING: 95, Stage.COMPLETED: 100}
    if task.stage == Stage.DENOISING:
        return 10 + (80 * task.step // task.steps if task.steps else 0)
    return fixed.get(task.stage, 0)


class OpenAIDoor:
    """What the OpenAI routes do, on top of a :class:`FrontDoor`."""

    def __init__(self, front: FrontDoor) -> None:
        self.front = front
        self.spec = task_spec(front.pipeline)
        # Videos deleted through DELETE /v1/videos/{id}: gone for the OpenAI view. Their
        # files are deleted too, and a completed task without its file reads as deleted
        # after a restart.
        self.deleted: set[str] = set()

    # -- which controller serves what --------------------------------------------------------
    def _route_for_pipeline(self) -> str:
        if self.spec.output == "video":
            return "POST /v1/videos"
        if self.spec.image_to_image:
            return ("POST /v1/images/generations (or /v1/images/edits with "
                    "i2i_denoise_strength: image-to-image)")
        return "POST /v1/images/edits" if self.spec.needs_image else "POST /v1/images/generations"

    def require(self, output: str, needs_image: bool | None) -> None:
        """Refuse a route of another pipeline. ``needs_image``: the route takes an input
        image (edits; a text-to-image pipeline that serves image-to-image takes them too),
        or not (generations); None: either."""
        ok = self.spec.output == output and (
            needs_image is None or self.spec.needs_image == needs_image
            or (needs_image and self.spec.image_to_image))
        if not ok:
            raise OpenAIError(
                400, f"this controller serves {self.front.pipeline}; use "
                     f"{self._route_for_pipeline()} (or a controller of another pipeline)",
                code="unsupported_pipeline")

    # -- task creation ---------------------------------------------------------------------------
    async def _create(self, body: TaskRequest, kind: str, image_param: str) -> Task:
        try:
            return await self.front.create_task(body, kind)
        except OpenAIError:
            raise
        except HTTPException as exc:
            message = str(exc.detail).replace("image_path", image_param)
            status = 400 if exc.status_code == 422 else exc.status_code
            code = {409: "conflict", 413: "payload_too_large", 429: "rate_limit_exceeded"}.get(
                exc.status_code)
            # The size reaches the task as height / width: name the parameter the client sent.
            param = "size" if re.search(r"\b(height|width)\b", message) else None
            # Their errors name them.
            for name in ("loras", "cache", "priority", "i2i_denoise_strength"):
                if re.search(rf"\b({name}|{name.rstrip('s')})\b", message, re.I):
                    param = param or name
            if image_param in message:
                param = image_param
            raise OpenAIError(status, message, param, code, exc.headers) from None

    def _extensions(self, p: _Extensions) -> dict[str, Any]:
        return {k: v for k, v in p.model_dump(include=set(_Extensions.model_fields)).items()
                if v is not None}

    def check_image_count(self, count: int) -> None:
        """The number of ``image`` parts of an edit: one, or up to ``max_input_images`` for
        a multi-image pipeline (more: 413, as the task API)."""
        limit = self.front.server.max_input_images
        if count == 0 or (count > 1 and not self.spec.multi_image):
            raise OpenAIError(400, f"send exactly one image file (got {count})"
                              if count else "send an image file", "image")
        if count > limit:
            raise OpenAIError(413, f"{count} image files exceed the limit of {limit} "
                                   "(server.max_input_images); send fewer", "image",
                              code="payload_too_large")

    async def create_images(self, p: ImageParams, image: bytes | list[bytes] | None
                            ) -> list[Task]:
        """``n`` tasks of the prompt; ``image``: the edit's input image, or its images."""
        if p.stream:
            raise OpenAIError(400, "stream is not supported; follow a task's progress with "
                                   "GET /v1/tasks/{id}/events instead", "stream")
        height, width = parse_size(p.size)
        fields = self._extensions(p)
        base_seed = fields.pop("seed", 0)
        if height is not None:
            fields["height"], fields["width"] = height, width
        if p.i2i_denoise_strength is not None:
            fields["i2i_denoise_strength"] = p.i2i_denoise_strength
        encoded: str | list[str] | None = None
        if isinstance(image, list):  # one image travels as a string, as it always has
            encoded = [base64.b64encode(i).decode() for i in image]
            encoded = encoded[0] if len(encoded) == 1 else encoded
        elif image is not None:
            encoded = base64.b64encode(image).decode()
        tasks: list[Task] = []
        try:
            for i in range(p.n):
                seed = (base_seed + i) % 2**63
                body = _body(ImageTaskRequest, task_id=f"img_{uuid.uuid4().hex}",
                             prompt=p.prompt, image_path=encoded, seed=seed, **fields)
                tasks.append(await self._create(body, "image", "image"))
        except BaseException:
            for task in tasks:  # all or nothing
                self.front.cancel_task(task)
            raise
        return tasks

    async def create_video(self, p: VideoParams, image: bytes | None) -> Task:
        if self.spec.needs_image and image is None:
            raise OpenAIError(400, f"{self.front.pipeline} needs an input image: send it as "
                                   "input_reference", "input_reference")
        if not self.spec.needs_image and image is not None:
            raise OpenAIError(400, f"{self.front.pipeline} takes no input image; leave "
                                   "input_reference unset", "input_reference")
        height, width = parse_size(p.size)
        fields = self._extensions(p)
        fps = p.fps or int(self.spec.defaults.get("fps") or 16)
        if p.seconds is not None and p.num_frames is not None:
            raise OpenAIError(400, "give seconds or num_frames, not both", "seconds")
        frames = p.num_frames
        if p.seconds is not None:
            step = self.spec.temporal_multiple
            frames = step * max(0, round(p.seconds * fps / step)) + 1
        body = _body(
            VideoTaskRequest, task_id=f"video_{uuid.uuid4().hex}", prompt=p.prompt,
            height=height, width=width,
            target_video_length=frames, target_fps=fps,
            image_path=base64.b64encode(image).decode() if image is not None else None,
            **fields)
        return await self._create(body, "video", "input_reference")

    async def wait(self, tasks: list[Task]) -> None:
        await asyncio.gather(*(self.front.events.wait_terminal(t) for t in tasks))
        for task in tasks:
            if task.stage != Stage.COMPLETED or not task.result_path:
                # A task that failed in a worker is a server error, but the same request
                # would fail the same way again: ``x-should-retry: false`` keeps the openai
                # client from posting it twice more (it retries a 500 by default).
                raise OpenAIError(
                    500, f"task {task.task_id} {task.stage.value}: {task.error or 'no result'}",
                    code=task.error_type or task.stage.value, headers=NO_RETRY)

    async def images_response(self, tasks: list[Task], response_format: str | None,
                              base_url: str) -> dict[str, Any]:
        data = []
        for task in tasks:
            item: dict[str, Any] = {"revised_prompt": None, "task_id": task.task_id}
            if response_format == "url":
                item["url"] = f"{base_url}/v1/tasks/{task.task_id}/result"
            else:
                raw = await asyncio.to_thread(Path(str(task.result_path)).read_bytes)
                item["b64_json"] = base64.b64encode(raw).decode()
            data.append(item)
        req = tasks[0].request
        return {"created": int(time.time()), "data": data, "output_format": "png",
                "size": f"{req.get('width')}x{req.get('height')}" if req.get("width") else None}

    # -- video jobs ------------------------------------------------------------------------------
    async def video_task(self, video_id: str) -> Task:
        try:
            task: Task | None = await self.front.get(video_id)  # memory, else the store
        except HTTPException:
            task = None
        if task is None or video_id in self.deleted or task.kind != "video":
            raise OpenAIError(404, f"no video {video_id}", "video_id", code="not_found")
        if task.stage == Stage.COMPLETED and (
                not task.result_path or not Path(task.result_path).exists()):
            raise OpenAIError(404, f"video {video_id} was deleted", "video_id", code="not_found")
        return task

    async def list_videos(self, after: str | None, limit: int, order: str) -> dict[str, Any]:
        """``GET /v1/videos``: one page of video jobs (deleted ones left out), newest first
        by default; ``after``: the last id of the previous page, as OpenAI's cursor. A video
        controller makes a few jobs a minute, so the whole retention window is read and the
        page cut here."""
        _total, tasks = await self.front.read_page(None, 0, 100_000, order == "desc")
        jobs = [t for t in tasks if t.kind == "video" and t.task_id not in self.deleted]
        if after is not None:
            ids = [t.task_id for t in jobs]
            if after not in ids:
                raise OpenAIError(400, f"after: no video {after}", "after")
            jobs = jobs[ids.index(after) + 1:]
        page = [self.video(t) for t in jobs[:limit]]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(jobs) > limit}

    def video(self, task: Task) -> dict[str, Any]:
        """OpenAI's ``video`` object of a task."""
        status = {"pending": "queued", "processing": "in_progress", "completed": "completed"}.get(
            task.status, "failed")
        req = task.request
        frames, fps = req.get("num_frames") or 1, req.get("fps") or 16
        out: dict[str, Any] = {
            "id": task.task_id,
            "object": "video",
            "model": task.pipeline,
            "status": status,
            "progress": _progress(task),
            "created_at": int(task.created_at),
            "completed_at": int(task.finished_at) if status == "completed" and
            task.finished_at else None,
            "expires_at": None,
            "prompt": req.get("prompt"),
            "seconds": f"{(frames - 1) / fps:g}",
            "size": f"{req.get('width')}x{req.get('height')}",
            "remixed_from_video_id": None,
            "error": None,
            # diffring's finer view of the same task
            "stage": task.stage.value,
            "step": task.step,
            "steps": task.steps,
            "expert": task.expert,
        }
        if status == "failed":
            out["error"] = {"code": task.error_type or task.stage.value,
                            "message": task.error or task.stage.value}
        return out

    def delete_video(self, task: Task) -> dict[str, Any]:
        if task.stage not in TERMINAL:
            self.front.cancel_task(task)
        self.deleted.add(task.task_id)
        if task.result_path:
            Path(task.result_path).unlink(missing_ok=True)
        remove_thumbnail(self.front.output_dir, task.task_id)
        return {"id": task.task_id, "object": "video.deleted", "deleted": True}
