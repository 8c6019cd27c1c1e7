"""Against a live Qwen T2I group (one for the module, started and stopped by pid here):
OpenAI's images.generate driven by the real ``openai`` package and OpenAI's error shape,
the server-sent progress events, the status page in a real browser, the ``diffring`` CLI,
the request scripts on events, and the prompt cache across processes. Image edits and video
jobs: tests/integration/test_live_openai_media.py.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher import LocalGroup, free_ports, group_config, wait_task
from tests.support.groups import events_of, start_group
from tests.support.http import openai_client, png, post_ok, read_events, result

CHROMIUM = Path("/usr/bin/chromium")
# The openai package marks the video calls deprecated (the hosted API's schedule); the
# protocol is what is tested here.
warnings.filterwarnings("ignore", category=DeprecationWarning, module="openai")
pytestmark = [  # starts processes or servers
    pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def task_result(group: LocalGroup, body: dict[str, Any]) -> bytes:
    st = wait_task(group.url, post_ok(group.url, "image", body), timeout=300)
    assert st["status"] == "completed", st
    return result(group.url, st["task_id"])


def cache_counts(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("diffring_prompt_cache"):
            for s in fam.samples:
                out[s.name] = s.value
    return out


@pytest.fixture(scope="module")
def t2i(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[LocalGroup, int]]:
    """A Qwen T2I group whose encoder serves metrics (its prompt-cache counts) on the port
    given with it."""
    port = free_ports(1)[0]
    with start_group("qwen_t2i", tiny_models, tmp_path_factory.mktemp("live-t2i"),
                     settings={"encoder": {"server": {"metric_port": port}}}) as group:
        yield group, port


SMALL = {"infer_steps": 2}


# -- OpenAI images (T2I) ------------------------------------------------------------------------
def test_images_generate_b64_and_url_match_the_task_api(t2i: tuple[LocalGroup, int]) -> None:
    group, _ = t2i
    oc = openai_client(group.url)
    r = oc.images.generate(prompt="a red cube", n=2, size="48x32", response_format="b64_json",
                           extra_body={"seed": 11, **SMALL})
    assert len(r.data or []) == 2 and r.size == "48x32"
    first, second = (base64.b64decode(d.b64_json or "") for d in r.data or [])
    assert png(first).size == (48, 32) and first != second  # seeds 11 and 12
    # The same task through LightX2V's API gives the same bytes: one mapping, one task kind.
    same = task_result(group, {"prompt": "a red cube", "seed": 11, "height": 32, "width": 48,
                               **SMALL})
    assert same == first
    r = oc.images.generate(prompt="a red cube", size="48x32", response_format="url",
                           extra_body={"seed": 12, **SMALL})
    url = (r.data or [])[0].url
    assert url and url.startswith(group.url) and httpx.get(url).content == second


def test_openai_errors_have_openai_shape(t2i: tuple[LocalGroup, int]) -> None:
    group, _ = t2i
    oc = openai_client(group.url)
    with pytest.raises(openai.BadRequestError) as bad:
        oc.images.generate(prompt="x", size="47x32")
    assert bad.value.status_code == 400 and "multiple of 16" in bad.value.message
    assert bad.value.body["param"] == "size"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        oc.images.generate(prompt="x", extra_body={"colour": "red"})
    assert "unrecognized parameter 'colour'" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        oc.videos.create(prompt="x")
    assert "serves qwen_t2i" in bad.value.message and "/v1/images/generations" in \
        bad.value.message
    r = httpx.post(f"{group.url}/v1/images/generations", json={"prompt": ""}, timeout=10)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "prompt"


def test_cached_prompt_output_is_bit_identical_across_processes(
        t2i: tuple[LocalGroup, int]) -> None:
    """The second request with the same prompts hits the encoder's cache (metrics say so)
    and its PNG equals the first's byte for byte."""
    group, port = t2i
    body = {"prompt": "a prompt for the cache test", "seed": 5, "height": 32, "width": 32,
            **SMALL}
    before = cache_counts(port)
    uncached = task_result(group, body)
    mid = cache_counts(port)
    cached = task_result(group, body)
    after = cache_counts(port)
    assert mid["diffring_prompt_cache_misses_total"] == \
        before["diffring_prompt_cache_misses_total"] + 1
    assert after["diffring_prompt_cache_hits_total"] == \
        mid["diffring_prompt_cache_hits_total"] + 1
    assert after["diffring_prompt_cache_bytes"] > 0
    assert cached == uncached


# -- progress events ------------------------------------------------------------------------------
def test_task_events_stream_stages_steps_and_completion(t2i: tuple[LocalGroup, int]) -> None:
    group, _ = t2i
    # The stream is open while the task waits in phase1: every later event comes through it.
    events = events_of(group, "image", {"prompt": "events", "height": 32, "width": 32,
                                        "infer_steps": 4, "task_id": "ev-1"})
    names = [name for name, _ in events]
    assert names[0] == "status" and names[-1] == "completed", names
    # The stream opens with the task's status, then one event per stage change and one per
    # denoising step.
    stages = [d["stage"] for name, d in events if name in ("status", "stage")]
    assert stages == ["phase1", "denoising", "phase2", "decoding"], stages
    steps = [(d["step"], d["steps"]) for name, d in events if name == "progress"]
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)], events
    done = events[-1][1]
    assert done["result_url"] == f"{group.url}/v1/tasks/ev-1/result"
    assert png(httpx.get(done["result_url"]).content).size == (32, 32)
    # A task that is over already: its status, then its terminal event, then the end.
    again = read_events(group.url, "ev-1")
    assert [n for n, _ in again] == ["status", "completed"]
    assert httpx.get(f"{group.url}/v1/tasks/nope/events").status_code == 404


# -- status page in a real browser ----------------------------------------------------------------
@pytest.mark.skipif(not CHROMIUM.exists(),
                    reason="Debian's chromium is not installed (/usr/bin/chromium); "
                           "scripts/bootstrap.sh installs it")
def test_status_page_in_a_browser(t2i: tuple[LocalGroup, int], tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    group, _ = t2i
    done = task_result(group, {"prompt": "for the gallery", "task_id": "page-1", "height": 32,
                               "width": 48, **SMALL})
    assert done
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    errors: list[str] = []
    shot = tmp_path / "status-page.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
            args=flags, viewport={"width": 1280, "height": 900})
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{group.url}/", wait_until="load")
            for role in ("encoder", "transformer", "decoder"):
                page.wait_for_selector(f'#workers [data-role="{role}"] .worker', timeout=30_000)
            thumb = '#gallery img.thumb[data-task-id="page-1"]'
            page.wait_for_selector(thumb, timeout=30_000)
            page.wait_for_function(
                f"() => {{ const i = document.querySelector('{thumb}'); "
                "return i && i.complete && i.naturalWidth > 0; }", timeout=30_000)
            page.wait_for_selector("#live.on", timeout=30_000)  # the event stream is open
            # A task posted while the page is open shows up through the events.
            httpx.post(f"{group.url}/v1/tasks/image/", json={
                "prompt": "live", "task_id": "page-2", "height": 32, "width": 32, **SMALL})
            page.wait_for_selector('#tasks tr[data-task-id="page-2"] .stage-completed',
                                   timeout=120_000)
            last = '#gallery img.thumb[data-task-id="page-2"]'
            page.wait_for_function(  # the last thumbnail loaded, so it paints in the shot
                f"() => {{ const i = document.querySelector('{last}'); "
                "return i && i.complete && i.naturalWidth > 0; }", timeout=30_000)
            page.screenshot(path=str(shot), full_page=True)
            rings = page.locator("#rings tbody tr").count()
        finally:
            browser.close()
    assert errors == []
    assert rings == 3
    assert shot.stat().st_size > 10_000 and shot.read_bytes().startswith(b"\x89PNG")


# -- the command line and the request scripts ----------------------------------------------------
def test_diffring_submit_and_inspect(t2i: tuple[LocalGroup, int], tmp_path: Path) -> None:
    group, _ = t2i
    exe = Path(sys.executable).with_name("diffring")
    assert exe.exists(), "the diffring console script is missing: pip install -e ."
    out = tmp_path / "cli" / "cube.png"
    done = subprocess.run(
        [str(exe), "submit", "--url", group.url, "--kind", "image", "--prompt", "a cube",
         "--height", "32", "--width", "48", "--steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(out.resolve())
    assert png(out.read_bytes()).size == (48, 32)
    refused = subprocess.run(
        [str(exe), "submit", "--url", group.url, "--kind", "video", "--prompt", "x"],
        capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "serves qwen_t2i" in refused.stderr
    cfg = group.workdir / "controller-0.json"
    inspect = subprocess.run([str(exe), "inspect", "--config", str(cfg), "--json"],
                             capture_output=True, text=True, timeout=60)
    assert inspect.returncode == 0, inspect.stderr
    assert {s["ring"] for s in json.loads(inspect.stdout)} == {"request", "phase1", "phase2"}


def test_request_script_follows_the_events(t2i: tuple[LocalGroup, int], tmp_path: Path
                                           ) -> None:
    """With a 10-minute polling interval the script can only finish in time by following
    the event stream."""
    group, _ = t2i
    out = tmp_path / "script.png"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "scripts.post.post_qwen_t2i", "--url", group.url,
         "--height", "32", "--width", "32", "--steps", "3", "--poll-interval", "600",
         "--out", str(out)],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 180 and png(out.read_bytes()).size == (32, 32)


def test_diffring_serve_starts_a_controller(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("diffring")
    cfg = group_config("qwen_t2i", "unused", tmp_path)
    path = tmp_path / "controller.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.Popen([str(exe), "serve", "--service", "controller", "--config",
                             str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = f"http://127.0.0.1:{cfg['server']['port']}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/service/status").json()["pipeline"] == "qwen_t2i"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_ui_assets_are_served_locally(t2i: tuple[LocalGroup, int]) -> None:
    """No CDN: every asset the page names is served by the controller itself."""
    group, _ = t2i
    html = httpx.get(f"{group.url}/").text
    assert "http://" not in html.replace(group.url, "") and "https://" not in html
    for asset in ("/ui/static/app.js", "/ui/static/style.css", "/ui/static/favicon.svg"):
        assert asset in html or asset.endswith("favicon.svg")
        assert httpx.get(f"{group.url}{asset}").status_code == 200
