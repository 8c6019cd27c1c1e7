"""A transformer group in a running cluster: it serves as one worker, and dies and recovers as
one (``run_service.py --service transformer`` with ``devices: [cpu, cpu]``: two rank
processes over gloo under a supervisor).

One controller, encoder and decoder serve the whole module; each test starts its own group
with its faults armed at an exact step (contracts/faults.py, ``group.step@R``: rank R only,
first start of the group only), and stops it, by pid. The outputs are checked against the
one-process pipeline: a CFG-2 group's are exact (tests/integration/test_group_layouts.py says why).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from launcher import LocalGroup, wait_task
from tests.support.groups import gone, rank_pids, start_dit_group, start_group, wait_exit
from tests.support.http import pixels, post_ok, result

pytestmark = pytest.mark.integration  # starts processes
PIPELINE = "qwen_t2i"
# 2 x 3 image tokens; prompts of 13 and 6 tokens (tiny tokenizer): Ulysses-2 splits the
# prompt unevenly (diffusers' "anything" split).
SIZE = {"height": 32, "width": 48, "infer_steps": 3}
PROMPT = "group e2e"


@pytest.fixture(scope="module")
def cluster(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    workdir = tmp_path_factory.mktemp("group-cluster")
    with start_group(PIPELINE, tiny_models, workdir, workers=("encoder", "decoder")) as group:
        yield group


@pytest.fixture(scope="module")
def reference(tiny_models: Path) -> Any:
    import torch

    from workers.models import LocalPipeline

    # As many threads as the workers (torch_threads 1): another count may sum in another order.
    torch.set_num_threads(1)
    pipe = LocalPipeline(tiny_models / PIPELINE, PIPELINE)
    pipe.load()
    return pipe


def expected(reference: Any, seed: int) -> np.ndarray:
    from contracts.request import GenerationRequest

    req = GenerationRequest.from_dict({"task": PIPELINE, "prompt": PROMPT, "seed": seed, **SIZE})
    frames: np.ndarray = reference.run(req).frames
    return frames


def body(task_id: str, seed: int) -> dict[str, Any]:
    return {"prompt": PROMPT, "seed": seed, "task_id": task_id, **SIZE}


@pytest.mark.timeout(900)
def test_a_cfg_group_serves_exactly_and_survives_a_rank_killed_mid_denoise(
        cluster: LocalGroup, reference: Any) -> None:
    # Rank 1 is SIGKILLed before its 5th step: step 2 of the second task (3 steps each).
    svc = start_dit_group(cluster, "cfg=2", "group.step@1:exit:nth=5", timeout_s=60, restarts=1)
    try:
        post_ok(cluster.url, "image", body("grp-ok", 11))
        st = wait_task(cluster.url, "grp-ok", timeout=300)
        assert st["status"] == "completed" and st["attempt"] == 1, st
        got = pixels(result(cluster.url, "grp-ok"), "png")
        assert np.array_equal(got, expected(reference, 11))

        post_ok(cluster.url, "image", body("grp-kill", 12))
        st = wait_task(cluster.url, "grp-kill", timeout=600)
        log = svc.log()
        assert "fault point group.step fired (action exit, hit 5)" in log
        assert re.search(r"rank 1 \(cpu, pid \d+\) was killed by SIGKILL; restarting the "
                         r"group \(1 of 1\)", log), log[-3000:]
        # The lease was dropped and the task retried, on the restarted group, uncharged.
        assert st["status"] == "completed" and st["attempt"] == 2 and st["failures"] == 0, st
        got = pixels(result(cluster.url, "grp-kill"), "png")
        assert np.array_equal(got, expected(reference, 12))
        assert len(rank_pids(svc)) == 4  # two starts of two ranks
    finally:
        svc.proc.send_signal(signal.SIGTERM)  # drains the group: every rank stops
        code = wait_exit(cluster, svc, 120)
    assert code == 0, svc.log()[-3000:]
    assert all(gone(pid) for pid in rank_pids(svc))


@pytest.mark.timeout(900)
def test_a_rank_stopped_past_the_timeout_takes_the_group_down(
        cluster: LocalGroup, reference: Any) -> None:
    # Rank 1 SIGSTOPs itself before its 2nd step; no restart allowed.
    svc = start_dit_group(cluster, "ulysses=2", "group.step@1:stop:nth=2", timeout_s=10,
                          restarts=0)
    post_ok(cluster.url, "image", body("grp-stop", 13))
    try:
        code = wait_exit(cluster, svc, 300)
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()
            svc.proc.wait()
    log = svc.log()
    assert code == 2, log[-3000:]
    assert "fault point group.step fired (action stop, hit 2)" in log
    assert re.search(r"error: transformer group \(ulysses=2\): rank 1 \(cpu, pid \d+\) sent no "
                     r"heartbeat for \d+ s \(hung or stopped; group_timeout_s 10\); gave up "
                     r"after 0 restart\(s\)", log), log[-3000:]
    assert all(gone(pid) for pid in rank_pids(svc))  # the stopped rank too
    # The group's lease is gone with it: a plain DiT worker takes the task over.
    plain = cluster.start("transformer")
    try:
        st = wait_task(cluster.url, "grp-stop", timeout=600)
        assert st["status"] == "completed" and st["attempt"] == 2 and st["failures"] == 0, st
        got = pixels(result(cluster.url, "grp-stop"), "png")
        assert np.array_equal(got, expected(reference, 13))
    finally:
        plain.proc.send_signal(signal.SIGTERM)
        wait_exit(cluster, plain, 120)
