"""OpenAI-compatible routes (images, video jobs) as plain handlers on one ``APIRouter``.

What they do is in :mod:`controller.http.openai_api`; here HTTP is translated to it and back.
Every error leaving these routes has OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, so the ``openai`` package raises its
own exception classes with our message: the router's :class:`OpenAIRoute` converts the
front door's errors, validation errors and unexpected ones at the boundary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.http import forms
from controller.http.events import ShuttingDown
from controller.http.openai_api import (
    ImageParams,
    OpenAIDoor,
    OpenAIError,
    VideoParams,
    parse_params,
)
from controller.http.schemas import MAX_IMAGE_BYTES
from controller.tasks.tasks import Stage

log = logging.getLogger("diffring.openai")

_ERROR_TYPE = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
               503: "server_error"}


OPENAI_PATHS = ("/v1/images/", "/v1/videos")
"""Where a request is answered in OpenAI's error shape, whatever fails (an unknown method
or path under them included: :func:`openai_http_error`)."""


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> JSONResponse:
    etype = _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": etype, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=body, headers=headers)


def openai_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse | None:
    """An HTTP error (405, 404 of no route) under the OpenAI paths in OpenAI's shape; None
    elsewhere (the front door's own shape)."""
    if not request.url.path.startswith(OPENAI_PATHS):
        return None
    return openai_error(exc.status_code, str(exc.detail), headers=exc.headers)


class OpenAIRoute(APIRoute):
    """A route whose every error is answered in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as exc:
                return openai_error(exc.status_code, str(exc.detail), exc.param, exc.code,
                                    exc.headers)
            except RequestValidationError as exc:
                problems, param = [], None
                for err in exc.errors():
                    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
                    param = param or loc or None
                    problems.append(f"unrecognized parameter {loc!r}"
                                    if err.get("type") == "extra_forbidden"
                                    else f"{loc or 'body'}: {err.get('msg')}")
                return openai_error(400, "; ".join(problems), param)
            except StarletteHTTPException as exc:  # FastAPI's (body parsing) included
                status = 400 if exc.status_code == 422 else exc.status_code
                return openai_error(status, str(exc.detail), headers=exc.headers)
            except ShuttingDown as exc:
                return openai_error(503, f"{exc}; retry against the restarted controller")
            except Exception as exc:
                log.exception("openai route: unexpected error")
                return openai_error(500, f"internal error ({type(exc).__name__}: {exc}); the "
                                         "controller log has the details")

        return openai_handler


def _door(request: Request) -> OpenAIDoor:
    door: OpenAIDoor = request.app.state.openai
    return door


Door = Annotated[OpenAIDoor, Depends(_door)]
router = APIRouter(route_class=OpenAIRoute, tags=["OpenAI-compatible"])


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


async def _read_upload(upload: UploadFile, param: str) -> bytes:
    data = await upload.read(MAX_IMAGE_BYTES + 1)
    if len(data) > MAX_IMAGE_BYTES:
        raise OpenAIError(413, f"{param} is larger than {MAX_IMAGE_BYTES} bytes", param)
    if not data:
        raise OpenAIError(400, f"{param} is an empty file", param)
    return data


async def _form(request: Request, file_fields: tuple[str, ...]
                ) -> tuple[dict[str, Any], dict[str, list[UploadFile]]]:
    """A multipart (or urlencoded) body as (plain fields, uploaded files by field)."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise OpenAIError(400, f"expected a multipart/form-data body, got {ctype or 'none'}")
    form = await request.form(max_part_size=1 << 20)
    fields: dict[str, Any] = {}
    nested: list[tuple[str, Any]] = []
    files: dict[str, list[UploadFile]] = {}
    for key, value in form.multi_items():
        name = key[:-2] if key.endswith("[]") else key
        if isinstance(value, UploadFile):
            if name not in file_fields:
                raise OpenAIError(400, f"unexpected file field {key!r}", key)
            files.setdefault(name, []).append(value)
        elif key.split("[", 1)[0] in forms.NESTED and "[" in key:
            nested.append((key, value))
        else:
            fields[name] = value
    try:
        return forms.nest(fields, nested), files
    except forms.FormError as exc:
        raise OpenAIError(400, str(exc), exc.param) from None


@router.post("/v1/images/generations")
async def images_generations(body: ImageParams, request: Request, door: Door
                             ) -> dict[str, Any]:
    """Text to image (T2I controllers): waits for the images, like OpenAI's."""
    door.require("image", needs_image=False)
    tasks = await door.create_images(body, None)
    await door.wait(tasks)
    return await door.images_response(tasks, body.response_format, _base(request))


@router.post("/v1/images/edits")
async def images_edits(request: Request, door: Door) -> dict[str, Any]:
    """Image edit (I2I controllers), multipart ``image`` + ``prompt``: waits for the images.
    A multi-image edit (qwen_i2i_plus) takes several ``image`` (or ``image[]``) parts, in
    "Picture" order. On a qwen_t2i controller an edit is image-to-image: one image and
    ``i2i_denoise_strength`` (LightX2V's form field, the openai package's ``extra_body``)."""
    door.require("image", needs_image=True)
    fields, files = await _form(request, ("image", "mask"))
    if "mask" in files:
        raise OpenAIError(400, "mask is not supported: the edit applies to the whole image",
                          "mask")
    uploads = files.get("image", [])
    door.check_image_count(len(uploads))
    images = [await _read_upload(u, "image" if len(uploads) == 1 else f"image[{i}]")
              for i, u in enumerate(uploads)]
    params: ImageParams = parse_params(ImageParams, fields)
    tasks = await door.create_images(params, images)
    await door.wait(tasks)
    return await door.images_response(tasks, params.response_format, _base(request))


@router.post("/v1/videos")
async def create_video(request: Request, door: Door) -> dict[str, Any]:
    """A video job (T2V / I2V controllers): answers at once with the queued job."""
    door.require("video", needs_image=None)
    image: bytes | None = None
    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            data = await request.json()
        except ValueError:
            raise OpenAIError(400, "the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise OpenAIError(400, "the body must be a JSON object")
        ref = data.get("input_reference")
        if ref is not None:
            url = ref.get("image_url") if isinstance(ref, dict) else None
            if not isinstance(url, str):
                raise OpenAIError(400, 'input_reference must be {"image_url": "data:...;base64,'
                                       '..."} in a JSON body (or a file in a multipart one)',
                                  "input_reference")
            server = door.front.server
            try:  # in the decoding processes, like every input image
                image = await door.front.decoder.decode(url, server.max_image_bytes,
                                                        server.max_image_pixels)
            except StarletteHTTPException as exc:  # FastAPI's (body parsing) included
                raise OpenAIError(400, str(exc.detail).replace("image_path", "input_reference"),
                                  "input_reference") from None
    else:
        data, files = await _form(request, ("input_reference",))
        refs = files.get("input_reference", [])
        if len(refs) > 1:
            raise OpenAIError(400, "send one input_reference image", "input_reference")
        if refs:
            image = await _read_upload(refs[0], "input_reference")
    params: VideoParams = parse_params(VideoParams, data)
    if params.input_reference is not None and image is None:
        raise OpenAIError(400, "input_reference must carry an image_url", "input_reference")
    return door.video(await door.create_video(params, image))


@router.get("/v1/videos")
async def list_videos(
    door: Door, after: str | None = Query(None, description="the last id of the previous page"),
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = Query("desc", description="desc: newest first"),
) -> dict[str, Any]:
    """The video jobs, a page at a time (OpenAI's list shape and cursor)."""
    door.require("video", needs_image=None)
    return await door.list_videos(after, limit, order)


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, door: Door) -> dict[str, Any]:
    return door.video(await door.video_task(video_id))


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, door: Door) -> dict[str, Any]:
    """Cancel the job if it still runs, delete its files; it is gone for this API."""
    return door.delete_video(await door.video_task(video_id))


@router.get("/v1/videos/{video_id}/content", responses={200: {"content": {"video/mp4": {}}}})
async def video_content(
    video_id: str, door: Door,
    variant: Literal["video", "thumbnail", "spritesheet"] = Query("video"),
) -> Response:
    task = await door.video_task(video_id)
    if task.stage != Stage.COMPLETED or not task.result_path:
        raise OpenAIError(404, f"video {video_id} has no content yet (status "
                               f"{door.video(task)['status']})", "video_id", code="not_ready")
    if variant == "spritesheet":
        raise OpenAIError(400, "variant 'spritesheet' is not supported; use 'video' or "
                               "'thumbnail'", "variant")
    if variant == "thumbnail":
        return FileResponse(await door.front.thumbnail(task), media_type="image/png")
    return FileResponse(task.result_path, media_type=task.media_type or "video/mp4",
                        filename=Path(task.result_path).name)
