"""End to end: HTTP in, separate encoder / transformer / decoder processes, files out.

Every group is started and stopped here by pid (launcher.LocalGroup).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from launcher import LocalGroup, group_config, submit
from tests.support.groups import local_group
from tests.support.http import KIND, REQUESTS, body, pixels, result
from tests.support.waits import wait_log

pytestmark = pytest.mark.integration  # starts processes or servers

@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="module")
def baseline_runs(tiny_models: Path, input_png: bytes, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[dict[str, tuple[bytes, dict[str, Any]]]]:
    """Result and then service status of ``--service all`` for each pipeline (one baseline
    process per pipeline)."""
    out: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for pipeline in REQUESTS:
        wd = tmp_path_factory.mktemp(f"all-{pipeline}")
        group = local_group(pipeline, tiny_models, wd)
        try:
            group.start("all")
            group.wait_http(timeout=180)
            st = submit(group.url, KIND[pipeline], body(pipeline, input_png), timeout=300)
            assert st["status"] == "completed", st
            out[pipeline] = (result(group.url, st["task_id"]),
                             httpx.get(f"{group.url}/v1/service/status", timeout=30).json())
        finally:
            group.stop()
    yield out


@pytest.fixture(scope="module")
def baselines(baseline_runs: dict[str, tuple[bytes, dict[str, Any]]]) -> dict[str, bytes]:
    return {pipeline: result for pipeline, (result, _) in baseline_runs.items()}


def test_baseline_status_reports_each_stages_memory(
        baseline_runs: dict[str, tuple[bytes, dict[str, Any]]]) -> None:
    """``--service all`` reports each stage's GPU memory in its status rows, as a group's
    workers do (zeros on a CPU; the gauges: tests/unit/test_stage_memory.py)."""
    for pipeline, (_, status) in baseline_runs.items():
        for role in ("encoder", "transformer", "decoder"):
            (row,) = status["workers"][role]
            assert row["stats"] == {"resident_bytes": 0.0, "last_peak_bytes": 0.0,
                                    "max_peak_bytes": 0.0}, (pipeline, role, row)


@pytest.fixture(scope="module")
def t2i_group(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[LocalGroup]:
    """One qwen_t2i group of 2 encoders, 3 transformers and 2 decoders for the tests that
    only post to it (its start-up is most of what each of them would cost on its own)."""
    wd = tmp_path_factory.mktemp("t2i-group")
    with local_group("qwen_t2i", tiny_models, wd) as group:
        group.start_all(encoders=2, transformers=3, decoders=2)
        yield group


# qwen_t2i last: its group (t2i_group) then serves the tests after these, and is not kept
# running beside the other pipelines' groups.
@pytest.mark.parametrize("pipeline", ["wan_t2v", "wan_i2v", "qwen_i2i", "qwen_t2i"])
def test_disaggregated_equals_baseline(pipeline: str, tiny_models: Path, input_png: bytes,
                                       workdir: Path, baselines: dict[str, bytes],
                                       request: pytest.FixtureRequest) -> None:
    """Each pipeline through a group (qwen_t2i's is the many-workers one) gives the bytes of
    ``--service all``."""
    with contextlib.ExitStack() as stack:
        if pipeline == "qwen_t2i":
            group = request.getfixturevalue("t2i_group")
        else:
            group = stack.enter_context(local_group(pipeline, tiny_models, workdir))
            group.start_all()
        st = submit(group.url, KIND[pipeline], body(pipeline, input_png), timeout=300)
        assert st["status"] == "completed", st
        assert st["attempt"] == 1
        assert list(st["stage_times"]) == ["queued", "encoding", "phase1", "denoising",
                                           "phase2", "decoding", "completed"]
        data = result(group.url, st["task_id"])
    ext = "mp4" if KIND[pipeline] == "video" else "png"
    got, want = pixels(data, ext), pixels(baselines[pipeline], ext)
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"max abs diff {np.abs(got.astype(int) - want).max()}"
    assert data == baselines[pipeline]  # same frames, same encoder settings: same bytes


def test_many_to_many(tiny_models: Path, t2i_group: LocalGroup) -> None:
    """2 encoders, 3 transformers, 2 decoders, 12 concurrent requests: each completes once,
    with diffusers' pixels, and both decoders serve."""
    from contracts.request import GenerationRequest
    from workers.models import LocalPipeline

    pipeline, n, group = "qwen_t2i", 12, t2i_group
    ref = LocalPipeline(tiny_models / pipeline, pipeline)
    ref.load()
    url = group.url
    completed = httpx.get(f"{url}/v1/service/status", timeout=10).json()["counts"]["completed"]

    def one(seed: int) -> tuple[int, dict[str, Any], bytes]:
        st = submit(url, "image", body(pipeline, None, seed=seed, task_id=f"mn-{seed}"),
                    timeout=240)
        return seed, st, result(url, st["task_id"]) if st["status"] == "completed" else b""

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(100, 100 + n)))
    # Which decoder claims a task is a race between the two; one may win all twelve on a
    # loaded machine. Both serving is the event meant: more tasks, one at a time, until the
    # other one has served too (each must still complete once, exactly).
    seed = 100 + n
    while len({st["worker"] for _, st, _ in results}) < 2 and seed < 100 + 4 * n:
        results.append(one(seed))
        seed += 1
    status = httpx.get(f"{url}/v1/service/status", timeout=10).json()
    ctl_log = group.services[0].log()
    assert status["counts"]["completed"] - completed == len(results)
    # Every model stage's heartbeats carry its GPU memory figures (zeros on a CPU).
    for role in ("encoder", "transformer", "decoder"):
        for w in status["workers"][role]:
            assert set(w["stats"]) == {"resident_bytes", "last_peak_bytes", "max_peak_bytes"}
    workers_used = set()
    for seed, st, data in results:
        assert st["status"] == "completed" and st["attempt"] == 1, st
        assert ctl_log.count(f"task mn-{seed} stage=completed") == 1
        workers_used.add(st["worker"])
        req = GenerationRequest.from_dict({"task": pipeline, "prompt": body(pipeline, None)
                                           ["prompt"], "seed": seed, "height": 32, "width": 48,
                                           "infer_steps": 2})
        assert np.array_equal(pixels(data, "png"), ref.run(req).frames), seed
    assert len(workers_used) == 2  # both decoders served


def test_missing_component_fails_at_startup(tiny_models: Path, workdir: Path) -> None:
    broken = workdir / "broken"
    shutil.copytree(tiny_models / "wan_t2v", broken)
    shutil.rmtree(broken / "transformer")
    group = LocalGroup(group_config("wan_t2v", str(broken), workdir), workdir)
    try:
        svc = group.start("transformer")
        assert svc.proc.wait(120) == 2
        log = svc.log()
        assert str(broken) in log and "'transformer'" in log
    finally:
        group.stop()


def test_wrong_pipeline_request_is_refused(t2i_group: LocalGroup) -> None:
    r = httpx.post(f"{t2i_group.url}/v1/tasks/video/", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 400
    assert "serves qwen_t2i" in r.json()["detail"]


@pytest.mark.parametrize("phase", ["worker starting (pid", "controller unreachable"])
def test_sigterm_during_startup_stops_the_worker(tiny_models: Path, workdir: Path,
                                                 phase: str) -> None:
    """While importing the model stack (the handler is in place, the imports begin) or while
    waiting for an absent controller, a SIGTERM stops the worker promptly and cleanly (a
    lost one: the worker goes on retrying for reconnect_timeout_s, then fails)."""
    group = local_group("wan_t2v", tiny_models, workdir)
    try:
        svc = group.start("transformer")
        wait_log(svc, phase, timeout=300)
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(90) == 0, svc.log()[-2000:]
        assert "stopped before it was ready" in svc.log()
    finally:
        group.stop()


def test_transformer_registers_after_its_warm_up(tiny_models: Path, workdir: Path) -> None:
    """With warmup_shapes the transformer runs them before it joins: the controller lists it
    only once the warm-up (the compile, with compile on) is done."""
    with local_group("wan_t2v", tiny_models, workdir, warmup_shapes=["32x32x5"]) as group:
        group.start("controller")
        group.wait_http()
        dit = group.start("transformer")
        group.wait_workers({"transformer": 1})
        log = dit.log()
    warm = log.index("warm-up of 32x32x5 took")
    assert warm < log.index("ready: pipeline=wan_t2v")


def test_the_baseline_warms_up_once_before_it_serves(tiny_models: Path, workdir: Path) -> None:
    """``--service all`` with warmup_shapes runs the warm-up once (it ran twice: load, then
    start loaded again), and before it is ready."""
    with local_group("wan_t2v", tiny_models, workdir, warmup_shapes=["32x32x5"]) as group:
        proc = group.start("all")
        group.wait_http(timeout=180)
        log = proc.log()
    assert log.count("baseline: warm-up of 32x32x5 took") == 1, log
    assert log.index("baseline: warm-up of 32x32x5 took") < log.index("baseline ready")
