"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) of a live controller render in a real
browser with no network beyond the controller: every request to another host is refused
and recorded (none may be tried), and the pages must list the API's operations. FastAPI's
own pages load their scripts from a CDN: on an air-gapped cluster they were blank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.controller import Controller

pytestmark = pytest.mark.integration  # starts processes or servers

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def url(controller: Controller) -> Iterator[str]:
    yield f"http://127.0.0.1:{controller.config['server']['port']}"


@pytest.mark.skipif(not CHROMIUM.exists(),
                    reason="Debian's chromium is not installed (/usr/bin/chromium); "
                           "scripts/bootstrap.sh test installs it")
def test_api_docs_render_without_network(url: str, tmp_path: Path) -> None:
    from playwright.sync_api import Route, sync_playwright

    elsewhere: list[str] = []
    errors: list[str] = []
    here = urlsplit(url).netloc

    def only_here(route: Route) -> None:
        if urlsplit(route.request.url).netloc == here or route.request.url.startswith("data:"):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort("internetdisconnected")

    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
            args=FLAGS, viewport={"width": 1280, "height": 900})
        try:
            browser.route("**/*", only_here)
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{url}/docs", wait_until="load")
            # Swagger UI drew the operations from /openapi.json.
            page.wait_for_selector(".opblock-summary-path[data-path='/v1/tasks/image/']",
                                   timeout=60_000)
            swagger_ops = page.locator(".opblock").count()
            page.screenshot(path=str(tmp_path / "docs.png"))
            page.goto(f"{url}/redoc", wait_until="load")
            # ReDoc drew them too: an operation's title, from its summary.
            page.locator("h2", has_text="Task Status").first.wait_for(timeout=60_000)
            page.screenshot(path=str(tmp_path / "redoc.png"))
        finally:
            browser.close()
    assert elsewhere == [] and errors == []
    assert swagger_ops >= 15
