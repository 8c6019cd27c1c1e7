"""The front door in-process (no workers, no rings): API key, body and image limits, result
path checks, and the task list and status served from the task store."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from contracts.config import ServerConfig
from controller.app import LocalQueue
from controller.http.frontdoor import FrontDoor
from controller.http.webapp import build_app
from tests.support.coordinators import make_coordinator

pytestmark = pytest.mark.integration  # starts processes or servers

KEY = "k" * 8 + "-front-door-key"


def make_front(tmp_path: Path, pipeline: str = "qwen_i2i", **server: Any) -> FrontDoor:
    co = make_coordinator(tmp_path, LocalQueue(64, 4096), pipeline=pipeline, max_pending=64)
    return FrontDoor(co, status_extra=lambda: {}, service="controller",
                     server=ServerConfig(**server))


@pytest.fixture
def client(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    front = make_front(tmp_path, **getattr(request, "param", {}))
    with TestClient(build_app(front)) as c:
        c.front = front  # type: ignore[attr-defined]
        yield c
    front.close()
    front.co.close()


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 1024)) + chunk(b"IEND", b""))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def post(c: TestClient, body: dict[str, Any], **kw: Any) -> Any:
    return c.post("/v1/tasks/image/", json={"prompt": "p", **body}, **kw)


# -- API key --------------------------------------------------------------------------------
@pytest.mark.parametrize("client", [{"api_key": KEY}], indirect=True)
def test_api_key_guards_everything_but_health(client: TestClient) -> None:
    image = b64(png(32, 32))
    r = post(client, {"image_path": image, "task_id": "k1"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in r.json()["detail"]
    wrong = {"Authorization": "Bearer not-the-key-at-all"}
    assert post(client, {"image_path": image}, headers=wrong).status_code == 401
    good = {"Authorization": f"Bearer {KEY}"}
    assert post(client, {"image_path": image, "task_id": "k1"}, headers=good).status_code == 200
    for path in ("/v1/tasks/", "/v1/tasks/k1/status", "/v1/service/status",
                 "/v1/tasks/queue/status"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=good).status_code == 200, path
    assert client.delete("/v1/tasks/k1").status_code == 401
    # Every router is behind it: events, the OpenAI API (in OpenAI's error shape), the
    # status page's data; the page itself, its static files and /health are not.
    assert client.get("/v1/tasks/k1/events").status_code == 401
    r = client.post("/v1/images/edits", files={"image": b"x"}, data={"prompt": "p"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client.get("/ui/state").status_code == 401
    assert client.get("/ui").status_code == 200 and client.get("/").status_code == 200
    assert client.get("/ui/static/app.js").status_code == 200
    assert client.get("/health").json() == {"status": "ok"}
    # The status page sends the key as a cookie (EventSource cannot send headers).
    client.cookies.set("diffring_api_key", KEY)
    assert client.get("/ui/state").status_code == 200
    client.cookies.set("diffring_api_key", "wrong-key-wrong-key")
    assert client.get("/ui/state").status_code == 401
    client.cookies.clear()
    spec = client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer",
        "description": "The front door's API key (server.api_key or DIFFRING_API_KEY)"}
    assert spec["components"]["securitySchemes"]["apiKeyCookie"]["in"] == "cookie"
    assert {"apiKey": []} in spec["paths"]["/v1/tasks/image/"]["post"]["security"]
    assert "security" not in spec["paths"]["/health"]["get"]


def test_api_key_config_is_checked() -> None:
    from contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="at least 16"):
        ServerConfig(api_key="short")


# -- save_result_path -----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["a\x00b.png", "cats/\nx.png", "tab\there.png", "x\x7f.png",
                                  "cats/", "cats\\", ".", "a/./", "x" * 300 + ".png"])
def test_bad_result_paths_are_400(client: TestClient, path: str) -> None:
    r = post(client, {"image_path": b64(png(32, 32)), "save_result_path": path})
    assert r.status_code == 400, (path, r.text)
    assert "save_result_path" in r.json()["detail"]


def test_good_result_path_is_kept(client: TestClient) -> None:
    r = post(client, {"image_path": b64(png(32, 32)), "save_result_path": "cats/cat.png"})
    assert r.status_code == 200 and r.json()["save_result_path"] == "cats/cat.png"


def test_lone_surrogates_are_422(client: TestClient) -> None:
    # Valid JSON, but not text msgpack or a file system could take: refused at the edge.
    for field in ("prompt", "save_result_path", "task_id", "negative_prompt"):
        body = b'{"prompt": "p", "image_path": "x", "%s": "a \\ud800 b"}' % field.encode()
        r = client.post("/v1/tasks/image/", content=body,
                        headers={"content-type": "application/json"})
        assert r.status_code == 422 and "unicode" in r.json()["detail"], (field, r.text)


# -- input images ---------------------------------------------------------------------------
def test_decompression_bomb_is_413_before_decoding(client: TestClient) -> None:
    for w, h in ((50_000, 50_000), (8_000, 6_000)):  # over Pillow's own guard; over ours
        r = post(client, {"image_path": b64(png_header_only(w, h))})
        assert r.status_code == 413, r.text
        assert "pixels" in r.json()["detail"] or "bomb" in r.json()["detail"]


@pytest.mark.parametrize("client", [{"max_image_pixels": 1000, "max_image_bytes": 4096}],
                         indirect=True)
def test_image_limits_are_configurable(client: TestClient) -> None:
    r = post(client, {"image_path": b64(png(40, 48))})
    assert r.status_code == 413 and "1920 pixels exceeds 1000" in r.json()["detail"]
    assert post(client, {"image_path": b64(png(20, 20))}).status_code == 200
    noise = bytes(range(256)) * 40
    r = post(client, {"image_path": b64(noise)})
    assert r.status_code == 413 and "exceeds 4096 bytes" in r.json()["detail"]
    # The whole body is capped too, before it is read: the image limit plus 2 MiB.
    r = client.post("/v1/tasks/image/", content=b"{" + b" " * (3 << 20) + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and "request body exceeds" in r.json()["detail"]


def test_undecodable_or_foreign_images_are_422(client: TestClient) -> None:
    whole = png(64, 64)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    for data in (whole[: len(whole) // 2], eps, b"GIF89a" + b"\x00" * 20):
        r = post(client, {"image_path": b64(data)})
        assert r.status_code == 422, r.text
        assert "does not decode" in r.json()["detail"]


# -- list and status from the store ---------------------------------------------------------
def test_list_pages_from_the_store_and_status_outlives_memory(client: TestClient) -> None:
    front: FrontDoor = client.front  # type: ignore[attr-defined]
    image = b64(png(16, 16))
    for i in range(7):
        assert post(client, {"image_path": image, "task_id": f"l{i}"}).status_code == 200
    for i in (1, 4):
        assert client.delete(f"/v1/tasks/l{i}").json()["stop_status"] == "success"
    front.co.table.history.recent.clear()  # the cancelled ones leave memory
    assert front.co.table.get("l1") is None
    st = client.get("/v1/tasks/l1/status").json()
    assert st["status"] == "cancelled" and st["error_type"] == "cancelled"
    assert client.delete("/v1/tasks/l1").json()["stop_status"] == "do_nothing"
    assert client.get("/v1/tasks/l1/result").status_code == 404
    assert post(client, {"image_path": image, "task_id": "l1"}).status_code == 409
    pages = [client.get("/v1/tasks/", params={"offset": o, "limit": 3, "order": "oldest"})
             .json() for o in (0, 3, 6)]
    assert [p["total"] for p in pages] == [7, 7, 7]
    assert [t["task_id"] for p in pages for t in p["tasks"]] == [f"l{i}" for i in range(7)]
    cancelled = client.get("/v1/tasks/", params={"status": "cancelled", "order": "oldest"}
                           ).json()
    assert [t["task_id"] for t in cancelled["tasks"]] == ["l1", "l4"]
    pending = client.get("/v1/tasks/", params={"status": "pending", "limit": 2,
                                               "order": "oldest"}).json()
    assert pending["total"] == 5 and pending["tasks"][0]["queue_position"] == 1
    counts = client.get("/v1/service/status").json()["counts"]
    assert counts["cancelled"] == 2 and counts["pending"] == 5


def test_api_key_from_the_environment_of_a_real_controller(tmp_path: Path) -> None:
    """DIFFRING_API_KEY, read once by run_service.py, guards a controller process."""
    import httpx

    from launcher import LocalGroup, group_config

    group = LocalGroup(group_config("qwen_t2i", str(tmp_path), tmp_path), tmp_path,
                       env={"DIFFRING_API_KEY": KEY})
    try:
        group.start("controller")
        group.wait_http()
        assert httpx.get(f"{group.url}/v1/service/status").status_code == 401
        r = httpx.get(f"{group.url}/v1/service/status", headers=group.headers)
        assert r.status_code == 200 and r.json()["pipeline"] == "qwen_t2i"
        r = httpx.post(f"{group.url}/v1/tasks/image/", json={"prompt": "x"})
        assert r.status_code == 401
    finally:
        group.stop()


# -- several input images (qwen_i2i_plus) ---------------------------------------------------
@pytest.fixture
def plus(tmp_path: Path) -> Iterator[TestClient]:
    front = make_front(tmp_path, pipeline="qwen_i2i_plus", max_input_images=2,
                       max_image_bytes=1 << 20)
    with TestClient(build_app(front)) as c:
        c.front = front  # type: ignore[attr-defined]
        yield c
    front.close()
    front.co.close()


def test_several_images_travel_as_one_pack(plus: TestClient) -> None:
    """A list in image_path (or several OpenAI image parts) becomes the one buffer that is
    staged and kept for retries, in Picture order; one image stays its own bytes."""
    from contracts.input_images import pack_images, unpack_images

    front: FrontDoor = plus.front  # type: ignore[attr-defined]
    a, b = png(40, 48), png(64, 40)
    assert post(plus, {"image_path": [b64(a), b64(b)], "task_id": "two"}).status_code == 200
    kept = front.co.table.get("two").image_bytes
    assert kept == pack_images([a, b]) and unpack_images(kept, "t") == [a, b]
    assert post(plus, {"image_path": b64(a), "task_id": "one"}).status_code == 200
    assert front.co.table.get("one").image_bytes == a
    assert post(plus, {"image_path": [b64(b)], "task_id": "list-of-one"}).status_code == 200
    assert front.co.table.get("list-of-one").image_bytes == b


def test_image_count_and_size_limits(plus: TestClient) -> None:
    image = b64(png(16, 16))
    r = post(plus, {"image_path": [image] * 3})
    assert r.status_code == 413, r.text
    assert "3 input images in image_path exceed the limit of 2" in r.json()["detail"]
    r = post(plus, {"image_path": []})
    assert r.status_code == 422 and "needs an input image" in r.json()["detail"]
    r = post(plus, {"image_path": [image, ""]})
    assert r.status_code == 422 and "empty image" in r.json()["detail"]
    # Each image is held to the per-image limits, and the refusal says which one.
    r = post(plus, {"image_path": [image, b64(png_header_only(8_000, 6_000))]})
    assert r.status_code == 413 and "image_path[1] (Picture 2)" in r.json()["detail"]
    r = post(plus, {"image_path": [b64(b"not an image"), image]})
    assert r.status_code == 422 and "image_path[0] (Picture 1)" in r.json()["detail"]
    # The body cap follows the image count: two largest images fit, far more does not.
    big = b"{" + b" " * ((2 << 20) + 3 * (1 << 20)) + b"}"
    r = plus.post("/v1/tasks/image/", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "request body exceeds" in r.json()["detail"]


def test_one_image_pipeline_refuses_a_second(client: TestClient) -> None:
    image = b64(png(16, 16))
    r = post(client, {"image_path": [image, image]})
    assert r.status_code == 422
    assert "qwen_i2i takes one input image, got 2" in r.json()["detail"]
    assert "qwen_i2i_plus" in r.json()["detail"]
    assert post(client, {"image_path": [image]}).status_code == 200  # a list of one is fine
    r = client.post("/v1/images/edits", data={"prompt": "p"},
                    files=[("image", ("a.png", png(16, 16))), ("image", ("b.png", png(16, 16)))])
    assert r.status_code == 400 and "exactly one image file (got 2)" in r.text


def test_openai_edit_takes_several_image_parts(plus: TestClient, monkeypatch: Any) -> None:
    from contracts.input_images import pack_images
    from controller.http.openai_api import OpenAIDoor

    door: OpenAIDoor = plus.app.state.openai  # type: ignore[attr-defined]

    async def no_wait(tasks: Any) -> None:  # no workers here: stop after the tasks exist
        raise RuntimeError("created")

    monkeypatch.setattr(door, "wait", no_wait)
    a, b = png(16, 16), png(24, 16)
    r = plus.post("/v1/images/edits", data={"prompt": "p"},
                  files=[("image[]", ("a.png", a)), ("image[]", ("b.png", b))])
    assert r.status_code == 500 and "created" in r.text
    task = next(iter(door.front.co.table))
    assert task.image_bytes == pack_images([a, b])
    r = plus.post("/v1/images/edits", data={"prompt": "p"},
                  files=[("image", (f"{i}.png", a)) for i in range(3)])
    assert r.status_code == 413 and "3 image files exceed the limit of 2" in r.text
    assert r.json()["error"]["param"] == "image"


def test_lightx2v_comma_separated_images(plus: TestClient) -> None:
    """LightX2V's image_path takes several images separated by commas; a data: URL keeps
    its own comma."""
    from contracts.input_images import pack_images
    from controller.http.schemas import split_images

    front: FrontDoor = plus.front  # type: ignore[attr-defined]
    a, b = png(16, 16), png(24, 16)
    url = f"data:image/png;base64,{b64(b)}"
    assert split_images(f"{b64(a)},{url}") == [b64(a), url]
    assert split_images(url) == [url] and split_images(b64(a)) == [b64(a)]
    r = post(plus, {"image_path": f"{b64(a)},{url}", "task_id": "commas"})
    assert r.status_code == 200, r.text
    assert front.co.table.get("commas").image_bytes == pack_images([a, b])
