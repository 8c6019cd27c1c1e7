"""``image_path`` as LightX2V's clients send it beside base64: an http(s) URL of an allowed
host (fetched with a size and a time limit; a loopback HTTP server stands in for the web) or
a file under the configured input folder, never outside it; and ``resize_mode`` for Wan I2V.
In-process: the front door's image reading, with a thread pool for its decoder."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import HTTPException

from contracts.config import ServerConfig
from controller.app import LocalQueue
from controller.http import resize
from controller.http.decoding import ImageDecoder
from controller.http.frontdoor import FrontDoor
from controller.http.schemas import VideoTaskRequest
from tests.support.coordinators import make_coordinator

LIMIT = 50_000


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


class Web:
    """A loopback HTTP server: ``/cat.png``, ``/big.png`` (over the limit, declared),
    ``/chunked.png`` (over the limit, not declared), ``/slow.png`` (answers only once the
    test is over), ``/moved.png`` (a redirect)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        web = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def do_GET(self) -> None:
                try:
                    self.answer()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the front door hung up on purpose: too large, too slow

            def answer(self) -> None:
                if self.path == "/none.png":
                    self.send_error(404)
                    return
                if self.path == "/moved.png":
                    self.send_response(302)
                    self.send_header("Location", "/cat.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path == "/slow.png":
                    web.release.wait(30)
                body = png(40, 48) if self.path != "/big.png" else b"\0" * (LIMIT + 1)
                self.send_response(200)
                if self.path == "/chunked.png":
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for _ in range(3):
                        chunk = b"\0" * (LIMIT // 2)
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def web() -> Iterator[Web]:
    w = Web()
    yield w
    w.close()


def front(tmp_path: Path, pipeline: str = "qwen_i2i", **server: Any) -> FrontDoor:
    co = make_coordinator(None, LocalQueue(8, 4096), pipeline=pipeline)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    return FrontDoor(co, status_extra=dict, service="controller",
                     server=ServerConfig(max_image_bytes=LIMIT, **server),
                     decoder=ImageDecoder(pool))


def read(door: FrontDoor, value: str) -> bytes:
    return asyncio.run(door._decode_images([value]))


def refused(door: FrontDoor, value: str) -> HTTPException:
    with pytest.raises(HTTPException) as err:
        read(door, value)
    return err.value


def test_urls_of_allowed_hosts_are_fetched_within_limits(tmp_path: Path, web: Web) -> None:
    door = front(tmp_path, image_url_hosts=("127.0.0.1",), image_fetch_timeout_s=1.0)
    assert read(door, f"{web.url}/cat.png") == png(40, 48)
    for path, status, says in (
            ("/big.png", 413, "over the 50000 bytes of server.max_image_bytes"),
            ("/chunked.png", 413, "sent more than the 50000 bytes"),
            ("/slow.png", 422, "did not arrive within 1 s (server.image_fetch_timeout_s)"),
            ("/moved.png", 422, "redirects (HTTP 302)"),
            ("/none.png", 422, "answered HTTP 404")):
        err = refused(door, f"{web.url}{path}")
        assert (err.status_code, says in err.detail) == (status, True), err.detail
    other = refused(door, f"http://localhost:{web.server.server_port}/cat.png")
    assert "host 'localhost' is not in server.image_url_hosts" in other.detail
    assert "scheme 'ftp' is not allowed" in refused(door, "ftp://127.0.0.1/cat.png").detail
    # Nothing else broke: base64 is read first, and the server still answers.
    assert read(door, base64.b64encode(png(8, 8)).decode()) == png(8, 8)
    assert read(door, f"{web.url}/cat.png") == png(40, 48)
    door.close()


def test_urls_are_refused_by_default(tmp_path: Path, web: Web) -> None:
    door = front(tmp_path)
    err = refused(door, f"{web.url}/cat.png")
    assert err.status_code == 422 and "server.image_url_hosts" in err.detail
    door.close()


def test_paths_are_read_under_the_input_folder_only(tmp_path: Path) -> None:
    inputs = tmp_path / "inputs"
    (inputs / "cats").mkdir(parents=True)
    (inputs / "cats" / "cat.png").write_bytes(png(40, 48))
    (tmp_path / "secret.png").write_bytes(png(8, 8))
    (inputs / "link.png").symlink_to(tmp_path / "secret.png")
    door = front(tmp_path, input_dir=str(inputs))
    assert read(door, "cats/cat.png") == png(40, 48)
    assert read(door, str(inputs / "cats" / "cat.png")) == png(40, 48)
    for outside in ("../secret.png", str(tmp_path / "secret.png"), "link.png",
                    "cats/../../secret.png"):
        err = refused(door, outside)
        assert err.status_code == 422 and "outside the input folder" in err.detail, outside
    assert "no such file" in refused(door, "cats/dog.png").detail
    (inputs / "big.png").write_bytes(b"\0" * (LIMIT + 1))
    assert refused(door, "big.png").status_code == 413
    door.close()
    unset = front(tmp_path)
    assert "server.input_dir, which is not set" in refused(unset, "cats/cat.png").detail
    unset.close()


def test_resize_modes_as_lightx2v_reads_them() -> None:
    # A 40x48 (w x h) portrait image: ratio 1.2, nearest bucket the square one.
    assert resize.target_size("adaptive", 48, 40, None) == (480, 480)
    assert resize.target_size("fixed_max_area", 48, 40, None) == (960, 960)
    assert resize.target_size("keep_ratio_fixed_area", 48, 40, None) == (688, 576)
    assert resize.target_size("fixed_min_side", 48, 40, None) == (576, 480)
    assert resize.target_size("adaptive", 900, 1600, None) == (480, 832)
    assert resize.target_size("fixed_shape", 48, 40, (64, 96)) == (64, 96)
    assert resize.crop_box(48, 40, 480, 480) == (0, 4, 40, 44)  # centred, full width
    with pytest.raises(ValueError, match="needs a size"):
        resize.target_size("fixed_shape", 48, 40, None)


def test_resize_mode_sets_the_size_and_crops_the_image(tmp_path: Path) -> None:
    from PIL import Image

    door = front(tmp_path, pipeline="wan_i2v")
    request = door._generation_request(VideoTaskRequest(prompt="a cat",
                                                        resize_mode="adaptive"))
    image, request = asyncio.run(door._resized("adaptive", png(40, 48), request))
    assert (request["height"], request["width"]) == (480, 480)
    assert Image.open(io.BytesIO(image)).size == (40, 40)
    with pytest.raises(HTTPException, match="resize_mode must be one of"):
        asyncio.run(door._resized("stretch", png(40, 48), request))
    door.close()
