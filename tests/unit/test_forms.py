"""Nested multipart fields (``controller/http/forms.py``) as real clients send them: requests are
built by the ``openai`` package itself (its own multipart serialiser, which groups list items
by key) and by plain httpx in the alternating and indexed orders, and read back by the front
door's own form reader in-process."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from controller.http import routes_openai
from controller.http.forms import FormError, nest
from controller.http.openai_api import OpenAIError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai's Sora notice
PNG = b"\x89PNG\r\n\x1a\n fake"  # the reader does not decode pictures


@pytest.fixture
def echo() -> Iterator[tuple[TestClient, list[dict[str, Any]]]]:
    """An app whose OpenAI media routes read the form as the front door does and keep what
    they read (or the OpenAI error it raised)."""
    seen: list[dict[str, Any]] = []
    app = FastAPI()

    async def read(request: Request, files: tuple[str, ...]) -> Any:
        try:
            fields, _ = await routes_openai._form(request, files)
        except OpenAIError as exc:
            return routes_openai.openai_error(exc.status_code, str(exc.detail), exc.param)
        seen.append(fields)
        return fields

    @app.post("/v1/videos")
    async def videos(request: Request) -> Any:
        got = await read(request, ("input_reference",))
        return got if not isinstance(got, dict) else {"id": "video_1", "object": "video",
                                                     "status": "queued"}

    @app.post("/v1/images/edits")
    async def edits(request: Request) -> Any:
        got = await read(request, ("image",))
        return got if not isinstance(got, dict) else {"created": 0, "data": []}

    with TestClient(app) as c:
        yield c, seen


def client(c: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=c,
                         max_retries=0)


LORAS = [
    [{"name": "style", "strength": 0.5}, {"name": "orig", "strength": 1.0}],
    [{"name": "123", "strength": 2}],  # a name that is a number stays text
    [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    [{"name": "a", "strength": 0.25}, {"name": "b", "strength": 0.5},
     {"name": "c", "strength": 0.75}],
]


@pytest.mark.parametrize("loras", LORAS)
def test_openai_videos_and_edits_carry_extra_body_lists(
        echo: tuple[TestClient, list[dict[str, Any]]], loras: list[dict[str, Any]]) -> None:
    """videos.create with an input_reference and images.edit are multipart: the openai
    package sends every ``loras[][name]`` first, then every ``loras[][strength]``. Each
    adapter keeps its own strength (main paired them as they came: [style 0.5, orig 1.0]
    was served as style 1.0, orig 0.5, or refused for a third item)."""
    c, seen = echo
    oc = client(c)
    cache = {"kind": "mag_cache", "mag_ratios": [1.0, 2], "calibrate": False}
    extra = {"loras": loras, "cache": cache, "seed": 3}
    oc.videos.create(prompt="p", input_reference=("in.png", PNG, "image/png"),
                     extra_body=extra)
    oc.images.edit(image=("in.png", PNG, "image/png"), prompt="p", extra_body=extra)
    assert len(seen) == 2
    for fields in seen:
        assert fields["loras"] == loras
        assert fields["cache"] == cache
        assert fields["seed"] == "3"  # plain fields stay text: the params model reads them


def test_openai_lists_whose_pairing_is_lost_are_refused(
        echo: tuple[TestClient, list[dict[str, Any]]]) -> None:
    """[{style, 0.5}, {orig}] and [{style}, {orig, 0.5}] reach the server as the same
    parts in the grouped order: refused with what to send instead, never guessed."""
    c, seen = echo
    oc = client(c)
    for loras in ([{"name": "style", "strength": 0.5}, {"name": "orig"}],
                  [{"name": "style"}, {"name": "orig", "strength": 0.5}]):
        with pytest.raises(openai.BadRequestError) as bad:
            oc.videos.create(prompt="p", input_reference=("in.png", PNG, "image/png"),
                             extra_body={"loras": loras})
        assert bad.value.body["param"] == "loras"  # type: ignore[index]
        assert "2 'name', 1 'strength'" in bad.value.message
        assert "give every item every key" in bad.value.message.lower()
        with pytest.raises(openai.BadRequestError):
            oc.images.edit(image=("in.png", PNG, "image/png"), prompt="p",
                           extra_body={"loras": loras})
    assert seen == []


def _multipart(c: TestClient, route: str, parts: list[tuple[str, str]]) -> httpx.Response:
    # Parts without a file name are form fields, written in the order given: the
    # alternating and indexed orders.
    files: list[tuple[str, Any]] = [(key, (None, value)) for key, value in parts]
    files.append(("input_reference" if route == "/v1/videos" else "image",
                  ("in.png", io.BytesIO(PNG), "image/png")))
    return c.post(route, files=files)


@pytest.mark.parametrize("route", ["/v1/videos", "/v1/images/edits"])
def test_alternating_and_indexed_forms(echo: tuple[TestClient, list[dict[str, Any]]],
                                       route: str) -> None:
    c, seen = echo
    alternating = [("prompt", "p"), ("loras[][name]", "style"), ("loras[][strength]", "0.5"),
                   ("loras[][name]", "orig"), ("loras[][name]", "x"),
                   ("loras[][strength]", "2")]
    indexed = [("prompt", "p"), ("loras[1][name]", "orig"), ("loras[0][name]", "style"),
               ("loras[0][strength]", "0.5"), ("loras[2][strength]", "2"),
               ("loras[2][name]", "x"), ("cache[kind]", "first_block_cache"),
               ("cache[threshold]", "0.1")]
    for parts in (alternating, indexed):
        r = _multipart(c, route, parts)
        assert r.status_code == 200, r.text
    want = [{"name": "style", "strength": 0.5}, {"name": "orig"}, {"name": "x", "strength": 2}]
    assert [f["loras"] for f in seen] == [want, want]
    assert seen[1]["cache"] == {"kind": "first_block_cache", "threshold": 0.1}
    for parts, says in [
        ([("loras[0][name]", "a"), ("loras[2][name]", "b")], "without gaps"),
        ([("loras[][name]", "a"), ("loras[0][name]", "b")], "mixes list items"),
        ([("loras", '[{"name": "a"}]'), ("loras[][name]", "b")], "both as one field"),
        ([("cache[kind]", "a"), ("cache[kind]", "b")], "given 2 times"),
        ([("loras[][name][x]", "a")], "flat objects"),
    ]:
        r = _multipart(c, route, [("prompt", "p"), *parts])
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_nest_reads_json_fields_and_keeps_names_text() -> None:
    assert nest({"loras": '[{"name": "a"}]'}, []) == {"loras": [{"name": "a"}]}
    assert nest({}, [("loras[][name]", "7"), ("loras[][strength]", "1")]) == {
        "loras": [{"name": "7", "strength": 1}]}
    assert nest({}, [("cache[mag_ratios][]", "1.0"), ("cache[mag_ratios][]", "2")]) == {
        "cache": {"mag_ratios": [1.0, 2]}}
    with pytest.raises(FormError) as bad:
        nest({}, [("loras[][name]", "a"), ("loras[][name]", "b"), ("loras[][strength]", "1")])
    assert bad.value.param == "loras"
