"""``run_service.py --check`` of a worker asks the running controller what it serves: a
qwen_t2i transformer checked against a wan_t2v controller fails (it used to report
"0 failed", then be refused at registration after loading its model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.config import ServiceConfig
from doctor import run_checks
from rings.soak import stop_process as stop
from tests.support.controller import TOKEN, Controller, controller_config, start_controller
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers



@pytest.fixture
def wan_controller(tmp_path: Path) -> Iterator[Controller]:
    cfg = {**controller_config(tmp_path), "model_cls": "wan2.1", "task": "t2v"}
    ctl = start_controller(tmp_path, cfg)
    try:
        yield ctl
    finally:
        stop(ctl.proc)


def worker_file(ctl: Controller, tmp_path: Path, model_cls: str, task: str) -> Path:
    data = {"model_cls": model_cls, "task": task, "model_path": str(tmp_path),
            "disagg_config": ctl.config["disagg_config"]}
    path = tmp_path / f"{model_cls}-{task}.json"
    path.write_text(json.dumps(data))
    return path


def test_a_worker_of_another_pipeline_fails_its_check(wan_controller: Controller,
                                                     tmp_path: Path) -> None:
    wrong = worker_file(wan_controller, tmp_path, "qwen_image", "t2i")
    checks = {c.name: c for c in run_checks(
        "transformer", ServiceConfig.load(str(wrong)), TOKEN, {})}
    got = checks["controller's pipeline"]
    assert got.status == "fail" and "serves wan_t2v" in got.detail and "qwen_t2i" in got.detail
    right = worker_file(wan_controller, tmp_path, "wan2.1", "t2v")
    checks = {c.name: c for c in run_checks(
        "transformer", ServiceConfig.load(str(right)), TOKEN, {})}
    assert checks["controller's pipeline"].status == "ok"
    # A wrong token: the question cannot be asked, which is said, not failed.
    checks = {c.name: c for c in run_checks(
        "transformer", ServiceConfig.load(str(right)), "another-token-of-enough-length", {})}
    assert checks["controller's pipeline"].status == "warn"
    # The command as an operator runs it: exit status 1, the line in the report.
    out = subprocess.run(
        [sys.executable, "run_service.py", "--service", "transformer", "--config", str(wrong),
         "--check"], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "DIFFRING_CLUSTER_TOKEN": TOKEN})
    assert out.returncode == 1 and "serves wan_t2v" in out.stdout, out.stdout + out.stderr
