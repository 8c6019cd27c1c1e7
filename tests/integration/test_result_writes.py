"""A result write the storage refuses (full disk, read-only or missing folder) is the
system's fault: the decoder holds the result and retries, uncharged; the controller reports
the condition and refuses new tasks while it lasts; the held tasks complete once it clears.

In-process: the decoder's holder on a driven clock, the controller's bookkeeping, the
coordinator and the decoder worker with fault points. Processes: a group whose decoder (or
controller) write fails with ENOSPC at the exact step (fault point ``...:while=FILE``, so the
test decides when the disk is "freed"), the bound (``result_write_retry_s``,
``max_held_results``), and, where this machine lets a test mount one, a real tiny tmpfs.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from contracts import faults
from contracts.config import ServiceConfig
from contracts.errors import ResultWriteBlocked, storage_fault
from contracts.messages import Fault, Op
from controller.ownership.result_writes import ResultWrites
from controller.tasks.tasks import Stage
from launcher import LocalGroup, free_ports, group_config, wait_task
from tests.support.coordinators import complete, queue_coordinator, task, workers
from tests.support.fakes import FakeControl
from tests.support.groups import start_group
from tests.support.http import post
from workers.held import RETRY_FIRST_S, RETRY_MAX_S, Held, HeldResults
from workers.models import Artifact, PendingMedia
from workers.roles import DecoderWorker
from workers.worker import Job

pytestmark = pytest.mark.integration  # starts processes or servers


def test_which_write_errors_are_the_storages() -> None:
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.ENOENT):
        assert storage_fault(OSError(code, "x"))
    assert not storage_fault(OSError(errno.ENAMETOOLONG, "a task's own path"))
    assert not storage_fault(ValueError("x"))
    assert storage_fault(faults.no_space("test"))


# -- the decoder's holder, on a driven clock ---------------------------------------------------
class Storage:
    """What the holder's deliver() meets: refused while ``full``."""

    def __init__(self) -> None:
        self.full = True
        self.tries: list[float] = []
        self.delivered: list[str] = []
        self.given_up: list[tuple[str, str]] = []
        self.now = 100.0

    def deliver(self, held: Held) -> None:
        self.tries.append(self.now)
        if self.full:
            raise ResultWriteBlocked("No space left on device")
        self.delivered.append(held.job.task_id)

    def give_up(self, held: Held, why: str) -> None:
        self.given_up.append((held.job.task_id, why))


def holder(storage: Storage, capacity: int = 2, retry_s: float = 60.0) -> HeldResults:
    return HeldResults(capacity, retry_s, storage.deliver, storage.give_up,
                       clock=lambda: storage.now)


def test_a_held_result_is_retried_and_delivered_when_the_disk_is_freed() -> None:
    st = Storage()
    h = holder(st)
    assert h.report() is None
    assert h.hold(Job("a", 1, {}), "art", "disk full")
    report = h.report()
    assert report is not None and (report.error, report.held) == ("disk full", 1)
    due = h.retry_due(st.now)  # not due yet: nothing tried
    assert due == st.now + RETRY_FIRST_S and st.tries == []
    st.now = due
    due = h.retry_due(st.now)  # tried, still full
    assert due is not None and st.tries == [st.now] and h.count == 1
    st.full = False
    st.now = due
    assert h.retry_due(st.now) is None
    assert st.delivered == ["a"] and h.count == 0 and h.report() is None
    assert st.given_up == []


def test_back_off_doubles_up_to_its_maximum() -> None:
    st = Storage()
    h = holder(st, retry_s=1e9)
    h.hold(Job("a", 1, {}), "art", "disk full")
    gaps = []
    due = st.now + RETRY_FIRST_S
    for _ in range(10):
        st.now = due
        nxt = h.retry_due(st.now)
        assert nxt is not None
        gaps.append(nxt - st.now)
        due = nxt
    assert gaps[:3] == [2 * RETRY_FIRST_S, 4 * RETRY_FIRST_S, 8 * RETRY_FIRST_S]
    assert gaps[-1] == RETRY_MAX_S and len(st.tries) == 10


def test_the_bound_on_how_many_results_are_held() -> None:
    st = Storage()
    h = holder(st, capacity=2)
    assert h.hold(Job("a", 1, {}), "art", "full") and h.hold(Job("b", 1, {}), "art", "full")
    assert not h.hold(Job("c", 1, {}), "art", "full")  # the caller hands c back
    assert not h.wait_for_room(timeout=0)
    st.full = False
    st.now += RETRY_FIRST_S
    h.retry_due(st.now)
    assert h.wait_for_room(timeout=0) and sorted(st.delivered) == ["a", "b"]


def test_the_bound_on_how_long_a_result_is_held() -> None:
    st = Storage()
    h = holder(st, retry_s=30.0)
    h.hold(Job("a", 1, {}), "art", "full")
    while (nxt := h.retry_due(st.now)) is not None:
        st.now = nxt
    assert st.now - 100.0 >= 30.0 and len(st.given_up) == 1
    assert "result_write_retry_s" in st.given_up[0][1] and h.count == 0


def test_a_retry_that_fails_otherwise_hands_the_task_back() -> None:
    st = Storage()
    h = holder(st)
    h.hold(Job("a", 1, {}), "art", "full")

    def broken(held: Held) -> None:
        raise RuntimeError("not a storage error")

    h._deliver = broken
    h.retry_due(st.now + RETRY_FIRST_S)
    assert h.count == 0 and st.given_up and "not a storage error" in st.given_up[0][1]


def test_closing_gives_every_held_result_up() -> None:
    st = Storage()
    h = holder(st)
    h.hold(Job("a", 1, {}), "art", "full")
    h.close("the decoder is stopping")
    assert [t for t, _ in st.given_up] == ["a"] and "stopping" in st.given_up[0][1]
    assert not h.hold(Job("b", 1, {}), "art", "full")


# -- the controller's bookkeeping --------------------------------------------------------------
def test_the_condition_at_the_controller() -> None:
    rw = ResultWrites()
    assert rw.refusal() is None and rw.public()["status"] == "ok"
    rw.report("decoder-1", {"error": "No space left on device", "held": 2, "since": 1.0})
    rw.failed("cannot write /out/x.png: [Errno 30] Read-only file system")
    assert rw.public()["status"] == "blocked" and rw.public()["held"] == 2
    text = rw.refusal()
    assert text is not None and "No space left" in text and "retry" in text
    rw.report("decoder-1", None)
    assert rw.refusal() is not None  # the controller's own write still fails
    rw.written()
    assert rw.refusal() is None
    rw.report("decoder-2", {"error": "full", "held": "junk"})  # a peer's nonsense: blocked
    assert rw.public()["blocked"][0]["held"] == 0
    rw.forget("decoder-2")
    assert rw.refusal() is None


@pytest.fixture
def disk_full(tmp_path: Path) -> Iterator[Path]:
    """A file whose existence is a full disk at the armed fault points."""
    flag = tmp_path / "disk-full"
    flag.touch()
    faults.configure(f"controller.result_write:raise:while={flag},"
                     f"decoder.before_write:raise:while={flag}")
    try:
        yield flag
    finally:
        faults.configure(None)


def test_the_controllers_write_fails_for_the_storage_and_nothing_is_charged(
        tmp_path: Path, disk_full: Path) -> None:
    co = queue_coordinator(tmp_path)
    enc, dit, dec = workers(co)
    t = task("a")
    co.submit(t)
    for w in (enc, dit):
        co.on_claim(w, "a", 1)
        co.on_handoff(w, "a", 1)
    assert co.on_claim(dec, "a", 1)[0]
    with pytest.raises(ResultWriteBlocked, match="No space left"):
        complete(co, dec, "a", 1, b"PNG")
    assert t.stage == Stage.DECODING and t.failures == 0 and t.worker == "d"
    assert co.result_writes.refusal() is not None
    assert not list(tmp_path.glob("a.png*"))  # no partial file left taking room
    disk_full.unlink()
    assert complete(co, dec, "a", 1, b"PNG") is True
    assert t.stage == Stage.COMPLETED and t.attempt == 1 and t.failures == 0
    assert co.result_writes.refusal() is None


# -- the decoder worker, in-process ------------------------------------------------------------
def decoder(tmp_path: Path, **cfg: Any) -> tuple[DecoderWorker, FakeControl]:
    worker = DecoderWorker(ServiceConfig(output_dir=str(tmp_path / "out"), encode_queue=0,
                                         **cfg), "token", {})
    control = FakeControl()
    worker.link.control = control
    return worker, control


ART = Artifact(b"PNG" * 100, "image/png", "png", np.zeros((2, 2, 3), np.uint8))


def publish_and_release(worker: DecoderWorker, tid: str) -> Job:
    job = Job(tid, 1, {"request": {}})
    worker.publish(job, PendingMedia(lambda: ART))  # a result whose media is made
    worker.release(job)
    return job


def test_the_decoder_holds_a_result_its_disk_refuses(tmp_path: Path, disk_full: Path) -> None:
    worker, control = decoder(tmp_path)
    publish_and_release(worker, "a")
    assert control.ops() == [] and worker.held.count == 1  # neither completed nor failed
    report = worker.held.report()  # what its heartbeats carry
    assert report is not None and report.held == 1 and "No space left" in report.error
    assert not list((tmp_path / "out").glob("*"))
    disk_full.unlink()
    worker.held.retry_due(time.monotonic() + RETRY_MAX_S)
    assert control.ops() == [Op.COMPLETE] and worker.held.count == 0
    assert (tmp_path / "out" / "a.png").read_bytes() == ART.data
    assert worker.held.report() is None


def test_the_decoder_holds_a_result_the_controller_cannot_write(tmp_path: Path) -> None:
    worker, control = decoder(tmp_path)
    control.answers[Op.COMPLETE] = {
        "accepted": False,
        "storage_error": "cannot write /srv/a.png: [Errno 28] No space left on device"}
    publish_and_release(worker, "a")
    assert control.ops() == [Op.COMPLETE] and worker.held.count == 1
    del control.answers[Op.COMPLETE]
    worker.held.retry_due(time.monotonic() + RETRY_MAX_S)
    assert control.ops() == [Op.COMPLETE, Op.COMPLETE] and worker.held.count == 0


def test_past_its_bounds_the_decoder_hands_the_task_back_uncharged(
        tmp_path: Path, disk_full: Path) -> None:
    worker, control = decoder(tmp_path, max_held_results=1, result_write_retry_s=0)
    publish_and_release(worker, "a")
    publish_and_release(worker, "b")  # one held already: b is handed back at once
    assert worker.held.count == 1
    op, fail = control.calls[-1]
    assert op == Op.FAIL and fail["task_id"] == "b" and fail["fault"] == Fault.SYSTEM.value
    assert "max_held_results" in fail["error"]
    worker.held.retry_due(time.monotonic() + RETRY_MAX_S)  # held 0 s: given up at its retry
    op, fail = control.calls[-1]
    assert op == Op.FAIL and fail["task_id"] == "a" and fail["fault"] == Fault.SYSTEM.value
    assert "result_write_retry_s" in fail["error"] and worker.held.count == 0


# -- processes -----------------------------------------------------------------------------------
SYNTHETIC = "synthetic"
NO_SPACE = "No space left on device"


def _status(group: LocalGroup) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{group.url}/v1/service/status", timeout=30).json()
    return out


def _wait_status(group: LocalGroup, what: str, pred: Any, timeout: float = 300) -> dict[str, Any]:
    """Poll the service status until ``pred`` holds (an event, with a generous bound)."""
    deadline = time.monotonic() + timeout
    while True:
        group.check_alive()
        st = _status(group)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:g} s: {st['result_writes']}")
        time.sleep(0.1)


def _post(group: LocalGroup, task_id: str) -> httpx.Response:
    return post(group.url, "image", {"prompt": f"held {task_id}", "task_id": task_id})


def _blocked_then_freed(group: LocalGroup, free: Any, metric_port: int | None = None) -> None:
    """Three tasks held while the disk is full, new work refused, then freed: each completes
    at its first attempt, uncharged, and new work is taken again."""
    ids = ["full-1", "full-2", "full-3"]
    for tid in ids:
        assert _post(group, tid).status_code == 200
    st = _wait_status(group, "3 held results", lambda s: s["result_writes"]["held"] == 3)
    assert st["result_writes"]["status"] == "blocked"
    assert NO_SPACE in st["result_writes"]["blocked"][0]["error"]
    refused = _post(group, "while-full")
    assert refused.status_code == 503, refused.text
    assert "results cannot be written" in refused.json()["detail"]
    assert NO_SPACE in refused.json()["detail"]
    if metric_port is not None:
        text = httpx.get(f"http://127.0.0.1:{metric_port}/metrics", timeout=30).text
        assert "diffring_results_held 3.0" in text
        assert "diffring_result_writes_blocked 0.0" not in text
    for tid in ids:
        task = httpx.get(f"{group.url}/v1/tasks/{tid}/status", timeout=30).json()
        assert task["stage"] == "decoding" and task["failures"] == 0, task
    free()
    _all_complete_uncharged(group, ids)


def _all_complete_uncharged(group: LocalGroup, ids: list[str]) -> None:
    """Once the storage works: each held task completes at its first attempt, uncharged,
    the condition clears and new work is taken again."""
    for tid in ids:
        task = wait_task(group.url, tid, timeout=300)
        assert task["status"] == "completed" and task["attempt"] == 1, task
        assert task["failures"] == 0, task
    _wait_status(group, "result writes ok", lambda s: s["result_writes"]["status"] == "ok")
    assert _post(group, "after").status_code == 200
    assert wait_task(group.url, "after", timeout=300)["status"] == "completed"


@pytest.mark.parametrize("where", ["decoder", "controller"])
def test_a_full_disk_holds_results_refuses_new_work_and_charges_nothing(
        tiny_models: Path, tmp_path: Path, where: str) -> None:
    """ENOSPC at the exact write (fault point, armed while a file exists): at the decoder's
    own write, or at the controller's write of the copy it serves."""
    flag = tmp_path / "disk-full"
    flag.touch()
    spec = {"faults": f"{where}.{'before' if where == 'decoder' else 'result'}_write:raise:"
                      f"while={flag}"}
    metric_port = free_ports(1)[0]
    ctl = {"server": {"metric_port": metric_port}}
    settings = {"controller": {**ctl, **spec}} if where == "controller" else {
        "controller": ctl, "decoder": spec}
    with start_group(SYNTHETIC, tiny_models, tmp_path, settings=settings) as group:
        _blocked_then_freed(group, flag.unlink, metric_port)
        controller_log = next(s for s in group.services if s.role == "controller").log()
    assert f"result writes blocked at {'controller' if where == 'controller' else 'decoder'}" in (
        controller_log)


def test_past_the_bound_a_held_task_is_handed_back_uncharged_and_completes_later(
        tiny_models: Path, tmp_path: Path) -> None:
    """``result_write_retry_s`` 1 s, ``max_held_results`` 1: a decoder holds one result at a
    time, gives it up after a second (the task runs again, uncharged), and once the disk is
    freed every task completes, none charged."""
    flag = tmp_path / "disk-full"
    flag.touch()
    bounded = {"faults": f"decoder.before_write:raise:while={flag}",
               "result_write_retry_s": 1.0, "max_held_results": 1, "encode_queue": 0}
    with start_group(SYNTHETIC, tiny_models, tmp_path, settings={"decoder": bounded}) as group:
        for tid in ("bound-1", "bound-2"):
            assert _post(group, tid).status_code == 200
        deadline = time.monotonic() + 300
        while True:  # until one was handed back and runs again
            tasks = [httpx.get(f"{group.url}/v1/tasks/{t}/status", timeout=30).json()
                     for t in ("bound-1", "bound-2")]
            assert all(t["failures"] == 0 and t["status"] != "failed" for t in tasks), tasks
            assert _status(group)["result_writes"]["held"] <= 1
            if any(t["attempt"] >= 2 for t in tasks):
                break
            assert time.monotonic() < deadline, tasks
            time.sleep(0.1)
        flag.unlink()
        for tid in ("bound-1", "bound-2"):
            task = wait_task(group.url, tid, timeout=300)
            assert task["status"] == "completed" and task["failures"] == 0, task
        decoder_log = next(s for s in group.services if s.role == "decoder").log()
    assert "result_write_retry_s" in decoder_log and "handed back, not charged" in decoder_log


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (root with mount rights, as on CI's fresh machine); skipped where
    this machine does not allow it."""
    mnt = tmp_path / "tiny-fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder: Path) -> Path:
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_a_really_full_filesystem(tiny_models: Path, tmp_path: Path, tiny_fs: Path) -> None:
    """The reported case: every service's output folder (results and the task store) on a
    1 MiB filesystem that fills up after three tasks were accepted. They are held, new work
    is refused, and once space is freed they complete at their first attempt, uncharged."""
    cfg = group_config(SYNTHETIC, str(tiny_models / SYNTHETIC), tmp_path,
                       output_dir=str(tiny_fs / "results"))
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        group.start("encoder")
        group.start("transformer")
        group.wait_workers({"encoder": 1, "transformer": 1})
        ids = ["fs-1", "fs-2", "fs-3"]
        for tid in ids:
            assert _post(group, tid).status_code == 200
        filler = _fill(tiny_fs)  # accepted (durable); the decoder is not there yet
        group.start("decoder")
        _wait_status(group, "3 held results", lambda s: s["result_writes"]["held"] == 3)
        refused = _post(group, "while-full")
        assert refused.status_code == 503 and NO_SPACE in refused.json()["detail"]
        filler.unlink()
        _all_complete_uncharged(group, ids)
