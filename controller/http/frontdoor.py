"""The HTTP front door (FastAPI): LightX2V's task API, served by the controller.

Field names and response shapes follow LightX2V's server so existing client scripts work;
diffring adds ``height`` / ``width`` / ``guidance_scale`` / ``true_cfg_scale`` /
``guidance_scale_2`` and a finer
``stage`` in the status. Every error body is JSON ``{"detail": "<what to do>"}``.

:class:`FrontDoor` holds what the routes do; the routes themselves are plain handlers in
:mod:`controller.http.routes` (and the other ``routes_*`` modules), which import this module and
nothing imports back; :mod:`controller.http.webapp` assembles them into the application. The
bodies are in :mod:`controller.http.schemas`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from contracts import recipes
from contracts.config import ServerConfig
from contracts.errors import InvalidRequestError, PayloadTooLarge, TransferError
from contracts.input_images import pack_images
from contracts.pipelines import TaskSpec, task_spec
from contracts.priority import check_priority
from contracts.request import RESIZE_MODES, GenerationRequest
from controller.errors import QueueFull
from controller.http import dit_offers, image_sources, resize, views
from controller.http.decoding import ImageDecoder
from controller.http.dit_offers import check_offers, lora_fields
from controller.http.events import EventHub
from controller.http.schemas import (
    TASK_ID_RE,
    TaskRequest,
    VideoTaskRequest,
    http_error,
    safe_relative_path,
)
from controller.http.sizes import plain_defaults, size_fields
from controller.http.thumbs import make_thumbnail, thumbnail_file
from controller.ownership.coordinator import Coordinator
from controller.tasks.store import StoreConflict, StoreError
from controller.tasks.tasks import TERMINAL, DuplicateTask, Stage, Task, waiting_for

log = logging.getLogger("diffring.frontdoor")


class FrontDoor:
    """What the routes do, around a coordinator (disaggregated or baseline); the FastAPI
    application serving it is :func:`controller.http.webapp.build_app`'s."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        status_extra: Callable[[], dict[str, Any]],
        service: str,
        server: ServerConfig | None = None,
        decoder: ImageDecoder | None = None,
        defaults: Mapping[str, Any] | None = None,
        recipe: str | None = None,
    ) -> None:
        self.co = coordinator
        self.pipeline = coordinator.config.pipeline
        self.status_extra = status_extra
        self.service = service
        self.server = server or ServerConfig()
        self.defaults: Mapping[str, Any] = defaults or {}
        """The service's ``request_defaults``: what a request that leaves a field unset gets
        (LightX2V's model knobs; :mod:`controller.http.sizes`), its recipe's included."""
        self.recipe = recipes.recipe(recipe)
        """The service's recipe (None: the one its transformer workers declare, if any)."""
        self.decoder = decoder or ImageDecoder()
        """Input images are decoded in worker processes (:mod:`controller.http.decoding`)."""
        # Staging and store look-ups run here, off the event loop.
        self.blocking = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="frontdoor")
        self.events = EventHub(coordinator)

    def close(self) -> None:
        """The server is stopping: end the event streams and the waits on them."""
        self.events.close()
        self.blocking.shutdown(wait=True)

    # -- request building -----------------------------------------------------------------
    def _generation_request(self, body: TaskRequest) -> dict[str, Any]:
        if getattr(body, "last_frame_path", None) not in (None, ""):
            raise http_error(422, "last_frame_path is not supported by diffring (no "
                             "first-last-frame DiT is served); leave it unset")
        spec = task_spec(self.pipeline)
        fields: dict[str, Any] = {"task": self.pipeline, "prompt": body.prompt}
        fields.update(lora_fields(body))
        for name in (
            "negative_prompt",
            "seed",
            "infer_steps",
            "guidance_scale",
            "true_cfg_scale",
            "i2i_denoise_strength",
            "guidance_scale_2",
        ):
            value = getattr(body, name, None)
            if value is not None:
                fields[name] = value
        fields.update(size_fields(body, spec, self.defaults))
        if isinstance(body, VideoTaskRequest):
            if body.target_video_length is not None:
                fields["num_frames"] = body.target_video_length
            if body.target_fps is not None:
                fields["fps"] = body.target_fps
        plain_defaults(fields, self.defaults)
        # A recipe the DiT workers declare (their model folder's) fills what is still unset.
        recipe = self.recipe or dit_offers.workers_recipe(self.co.registry)
        if recipe is not None and self.recipe is None:
            plain_defaults(fields, recipe.request_defaults)
        try:
            req = GenerationRequest.from_dict(fields)
            recipes.check_guidance(recipe, req.guidance_scale, req.true_cfg_scale)
        except (InvalidRequestError, TypeError) as exc:
            raise http_error(422, str(exc)) from None
        registry = self.co.registry
        check_offers(req, registry.dit_offers(), registry.dit_fused())
        return req.to_dict()

    async def create_task(self, body: TaskRequest, kind: str) -> Task:
        """Validate, decode and stage the input image (off the loop), queue the task, and
        return once it is durable in the task store."""
        refusal = self.co.result_writes.refusal()
        if refusal is not None:  # accepted tasks wait for the storage: take no more
            raise http_error(503, refusal, {"Retry-After": "30"})
        spec = task_spec(self.pipeline)
        served = spec.output
        if kind != served:
            raise http_error(
                400,
                f"this controller serves {self.pipeline} ({served} results); "
                f"POST to /v1/tasks/{served}/ instead",
            )
        request = self._generation_request(body)
        try:
            priority = check_priority(body.priority)
        except InvalidRequestError as exc:
            raise http_error(422, str(exc)) from None
        task_id = body.task_id or uuid.uuid4().hex
        if not TASK_ID_RE.match(task_id):
            raise http_error(
                422, "task_id must be 1-128 characters of letters, digits, '_', '.', '-'"
            )
        values = body.image_values()
        self._check_image_count(spec, values, request.get("i2i_denoise_strength"))
        save = safe_relative_path(body.save_result_path) if body.save_result_path else ""
        if save:
            self._check_result_path_free(save)
        if self.co.table.get(task_id) is not None or (
            body.task_id and await self._off_loop(self.co.table.lookup, task_id) is not None
        ):
            raise http_error(409, f"task {task_id} exists already; choose another task_id")
        image = await self._decode_images(values) if values else None
        mode = getattr(body, "resize_mode", None) or self.defaults.get("resize_mode")
        if image is not None and mode and spec.family == "wan" and spec.needs_image:
            image, request = await self._resized(mode, image, request)
        task = Task(
            task_id=task_id,
            kind=kind,
            pipeline=self.pipeline,
            request=request,
            save_result_path=save,
            priority=priority,
        )
        if image is not None:
            task.image_bytes = image
        try:
            if image is not None and self.co.stage_image is not None:
                task.image = await self._off_loop(self.co.stage_image, image)
            self.co.submit(task)
        except PayloadTooLarge as exc:
            self._unstage(task)
            raise http_error(413, f"request too large for a request-ring slot: {exc}") from None
        except QueueFull as exc:
            self._unstage(task)
            retry = max(1, math.ceil(exc.retry_after_s))
            raise http_error(
                429, f"{exc}; retry in about {retry} s", {"Retry-After": str(retry)}
            ) from None
        except TransferError as exc:  # the controller's staging pool is full (or gone)
            self._unstage(task)
            raise http_error(
                503, f"cannot stage the input image now ({exc}); retry shortly",
                {"Retry-After": "5"},
            ) from None
        except DuplicateTask:
            self._unstage(task)
            raise http_error(409, f"task {task_id} exists already") from None
        except Exception:
            self._unstage(task)
            raise
        await self._durable(task)
        return task

    def _check_result_path_free(self, save: str) -> None:
        """Two live tasks may not write one result file (409): the second would overwrite
        the first's result, or the first's late write the second's. Once the first is over
        the path may be reused (LightX2V's scripts write one name again and again)."""
        for t in self.co.table:
            if t.save_result_path == save:
                raise http_error(
                    409, f"save_result_path {save!r} is the result file of task {t.task_id}, "
                    f"still {t.stage.value}; choose another path, or wait until it is over")

    def _check_image_count(self, spec: TaskSpec, values: list[str],
                           strength: float | None = None) -> None:
        """Refuse a wrong number of input images before anything is decoded: none where one
        is needed, any for a text task (422), several for a one-image pipeline or with
        ``i2i_denoise_strength`` (422), more than ``server.max_input_images`` (413). A
        text-to-image pipeline that serves image-to-image takes its one image together with
        ``i2i_denoise_strength``, and the strength only with an image."""
        if spec.needs_image and not values:
            raise http_error(422, f"{self.pipeline} needs an input image: set image_path")
        if not spec.takes_image and values:
            raise http_error(422, f"{self.pipeline} takes no input image; leave image_path unset")
        if spec.image_to_image and bool(values) != (strength is not None):
            raise http_error(422, (
                f"{self.pipeline} takes no input image without i2i_denoise_strength: set it "
                "too, in (0, 1], for image-to-image, or leave image_path unset")
                if values else (
                "i2i_denoise_strength needs an input image (image_path): image-to-image "
                f"starts from it; {self.pipeline} without one is text-to-image"))
        if strength is not None and len(values) > 1:
            raise http_error(422, f"i2i_denoise_strength redraws one input image, got "
                                  f"{len(values)} in image_path; send one, or leave the "
                                  "strength unset")
        if len(values) > 1 and not spec.multi_image:
            raise http_error(
                422, f"{self.pipeline} takes one input image, got {len(values)} in image_path "
                "(Qwen-Image-Edit-2509 / 2511 folders take several, served as qwen_i2i_plus)")
        limit = self.server.max_input_images
        if len(values) > limit:
            raise http_error(413, f"{len(values)} input images in image_path exceed the limit "
                                  f"of {limit} (server.max_input_images); send fewer")
        if any(not isinstance(v, str) or not v for v in values):
            raise http_error(422, "image_path holds an empty image; give each as base64 or a "
                                  "data: URL")

    async def _decode_images(self, values: list[str]) -> bytes:
        """Each image checked and decoded off the loop (413 / 422 naming which one, when
        there are several), then the one buffer they travel in (contracts.input_images)."""
        out = []
        for index, value in enumerate(values):
            try:
                value = await image_sources.resolve(value, self.server, self._off_loop)
                out.append(await self.decoder.decode(
                    value, self.server.max_image_bytes, self.server.max_image_pixels))
            except HTTPException as exc:
                if len(values) == 1:
                    raise
                where = f"image_path[{index}] (Picture {index + 1})"
                detail = str(exc.detail).replace("image_path", where)
                if "input image" in detail and where not in detail:
                    detail = f"{where}: {detail}"
                raise http_error(exc.status_code, detail) from None
        return pack_images(out)

    async def _resized(self, mode: str, image: bytes, request: dict[str, Any]
                       ) -> tuple[bytes, dict[str, Any]]:
        """LightX2V's ``resize_mode`` (controller/http/resize.py): the output size from the
        input image, the image cropped to its aspect ratio (in a decoding process)."""
        if mode not in RESIZE_MODES:
            raise http_error(422, f"resize_mode must be one of {', '.join(RESIZE_MODES)}, got "
                                  f"{mode!r}")
        size = (request["height"], request["width"]) if request.get("height") else None
        out = await self.decoder.run(resize.apply, mode, image, size,
                                     task_spec(self.pipeline).size_multiple)
        if len(out) == 2:
            raise http_error(out[0], out[1])
        cropped, height, width = out
        try:
            request = GenerationRequest.from_dict({**request, "height": height,
                                                   "width": width}).to_dict()
        except InvalidRequestError as exc:
            raise http_error(422, str(exc)) from None
        return cropped, request

    async def _durable(self, task: Task) -> None:
        """Answer only once the accepted task is in the store (a restart keeps it)."""
        fut = self.co.table.journal.durable(task.task_id)
        if fut is None:
            return
        try:
            await asyncio.wrap_future(fut)
        except StoreConflict:
            self.co.cancel(task)
            raise http_error(409, f"task {task.task_id} exists already") from None
        except StoreError as exc:
            self.co.cancel(task)
            raise http_error(
                503, f"{exc}; the task was not accepted, retry later", {"Retry-After": "5"}
            ) from None

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.blocking, fn, *args)

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

    def status(self, task: Task, positions: dict[str, int] | None = None) -> dict[str, Any]:
        """``GET /v1/tasks/{id}/status``. ``positions``: the table's queue positions, when
        many tasks are reported at once (computed once for them all)."""
        out = task.public()
        out["waiting_for"] = waiting_for(task)
        if task.waiting_expert is not None and task.stage == Stage.ACCEPTED:
            out["waiting_expert"] = task.waiting_expert  # split: a DiT of this expert
        if positions is None:
            out["queue_position"] = self.co.table.queue_position(task)
        else:
            out["queue_position"] = positions.get(task.task_id)
        if task.stage == Stage.DENOISING and task.steps:
            out["progress"] = f"denoising step {task.step}/{task.steps}"
        store = self.co.checkpoints
        ckpt = store.get(task.task_id) if store is not None else None
        out["checkpoint"] = ckpt.public() if ckpt is not None else None
        if task.result_path:
            out["save_result_path"] = str(
                Path(task.result_path).relative_to(self.co.config.output_dir))
        return out

    async def get(self, task_id: str) -> Task:
        """A task in memory or, once it has left memory, in the store; 404 otherwise."""
        task = self.co.table.get(task_id)
        if task is None and self.co.table.journal.store is not None:
            await self._caught_up()
            task = await self._read(self.co.table.lookup, task_id)
        if task is None:
            raise http_error(404, f"no task {task_id}")
        return task

    async def list_tasks(self, status: str | None, offset: int, limit: int,
                         order: str = "newest") -> dict[str, Any]:
        """One page of every stored task, newest first (``order="oldest"``: in acceptance
        order; the store's, when it has one: it sees every task still within its retention
        window)."""
        total, page = await self.read_page(status, offset, limit, order == "newest")
        positions = self.co.table.queue_positions()
        return {
            "total": total,
            "offset": offset,
            "limit": limit,
            "order": order,
            "tasks": [self.status(t, positions) for t in page],
        }

    async def read_page(self, status: str | None, offset: int, limit: int,
                        newest_first: bool) -> tuple[int, list[Task]]:
        """(total, one page) of the stored tasks, once the store has caught up."""
        await self._caught_up()
        result: tuple[int, list[Task]] = await self._read(
            self.co.table.page, status, offset, limit, newest_first)
        return result

    # -- what the routes report and do beyond one task's creation ------------------------------
    @property
    def output_dir(self) -> Path:
        return self.co.config.output_dir

    def queue(self) -> dict[str, Any]:
        return {**views.queue(self.co), **self.status_extra()}

    def service_status(self) -> dict[str, Any]:
        return {"service": self.service, "pipeline": self.pipeline, **views.service(self.co),
                **self.status_extra()}

    def loras(self) -> dict[str, Any]:
        return dit_offers.listing(self.co.registry)

    def page_state(self, now: float) -> dict[str, Any]:
        return {"service": self.service, "pipeline": self.pipeline,
                **views.page_state(self.co, self.events, self.status, self.status_extra(), now)}

    def cancel_task(self, task: Task) -> str:
        """Cancel ``task`` (``success`` or ``do_nothing``): queued, it never starts; running,
        it stops at the next step boundary."""
        return self.co.cancel(task)

    async def cancel(self, task_id: str) -> dict[str, Any]:
        """``DELETE /v1/tasks/{id}``, LightX2V's answer: ``{stop_status, reason}``."""
        task = self.co.table.get(task_id)
        if task is None:  # finished and out of memory (do_nothing), or unknown
            try:
                task = await self.get(task_id)
            except HTTPException:
                return {"stop_status": "error", "reason": f"no task {task_id}"}
        outcome = self.cancel_task(task)
        if outcome == "do_nothing":
            reason = f"task already {task.stage.value}"
        elif task.stage in TERMINAL:
            reason = f"cancelled ({task.stage.value})"
        else:
            reason = "cancel requested; stops at the next step boundary"
        return {"stop_status": outcome, "reason": reason}

    async def thumbnail(self, task: Task) -> Path:
        """A small PNG of a completed task's result (made once, then kept)."""
        assert task.result_path is not None
        out = thumbnail_file(self.output_dir, task.task_id)
        path: Path = await asyncio.to_thread(make_thumbnail, Path(task.result_path),
                                             task.media_type, out)
        return path

    async def _caught_up(self) -> None:
        """Wait until the store holds every change made so far (read your own writes)."""
        flushed = self.co.table.journal.flush(durable=False)
        if flushed is not None:
            await asyncio.wrap_future(flushed)

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        store = self.co.table.journal.store
        if store is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(store.reads, fn, *args)
