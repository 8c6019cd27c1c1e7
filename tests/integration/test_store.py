"""The task store (controller/tasks/store.py) and the task table over it: order, paging,
retention, memory bound, durability across a hard kill, the read-only check."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller.tasks.history import RECENT_FINISHED
from controller.tasks.store import StoreConflict, StoreError, StoreLocked, TaskStore
from controller.tasks.store_check import check
from controller.tasks.table import TaskTable, open_table
from controller.tasks.tasks import Stage, Task
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers


def new_task(tid: str) -> Task:
    return Task(task_id=tid, kind="image", pipeline="qwen_t2i",
                request={"task": "qwen_t2i", "prompt": f"p {tid}"}, save_result_path="")


def finish(table: TaskTable, task: Task, stage: Stage = Stage.COMPLETED) -> None:
    table.queued(task)
    if stage == Stage.COMPLETED:
        table.complete(task, f"/nonexistent/{task.task_id}.png", "image/png")
    elif stage == Stage.FAILED:
        table.failed(task, "boom", "StageError")
    else:
        table.cancelled(task, "by the client")


def test_rows_page_in_acceptance_order_with_status_filter(tmp_path: Path) -> None:
    table = open_table(tmp_path)
    tasks = [new_task(f"t{i:02d}") for i in range(12)]
    for t in tasks:
        table.add(t)
        table.queued(t)
    for t in tasks[::3]:
        finish(table, t)
    table.journal.flush().result()  # type: ignore[union-attr]
    total, page = table.page(None, 0, 5)
    assert total == 12 and [t.task_id for t in page] == ["t00", "t01", "t02", "t03", "t04"]
    total, page = table.page(None, 10, 5)
    assert [t.task_id for t in page] == ["t10", "t11"]
    total, page = table.page("completed", 1, 2)
    assert total == 4 and [t.task_id for t in page] == ["t03", "t06"]
    total, page = table.page("pending", 0, 100)
    assert total == 8 and all(t.stage == Stage.QUEUED for t in page)
    # Live tasks come back as the very objects in memory (their step counters are live).
    assert page[0] is table.get(page[0].task_id)
    table.close()


def test_memory_keeps_only_unfinished_and_recent_finished(tmp_path: Path) -> None:
    table = open_table(tmp_path)
    n = RECENT_FINISHED + 50
    for i in range(n):
        t = new_task(f"m{i}")
        table.add(t)
        finish(table, t, Stage.COMPLETED if i % 2 else Stage.FAILED)
    live = new_task("live")
    table.add(live)
    assert len(table.tasks) == 1 and len(table.history.recent) == RECENT_FINISHED
    assert table.get("m0") is None  # left memory ...
    flushed = table.journal.flush(durable=False)  # (what the front door waits for before it reads)
    assert flushed is not None
    flushed.result(timeout=30)
    old = table.lookup("m0")  # ... but the store still serves it
    assert old is not None and old.stage == Stage.FAILED and old.error == "boom"
    assert old.request == {"task": "qwen_t2i", "prompt": "p m0"}
    counts = table.counts()
    assert counts["completed"] + counts["failed"] == n and counts["pending"] == 1
    table.close()


def test_retention_forgets_finished_tasks_and_optionally_their_results(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for delete in (False, True):
        folder = tmp_path / f"store-{delete}"
        table = open_table(folder, retention_s=0.2, delete_results=delete)
        done, running = new_task("done"), new_task("running")
        for t in (done, running):
            table.add(t)
            table.queued(t)
        result = results / f"done-{delete}.png"
        result.write_bytes(b"png")
        table.complete(done, str(result), "image/png")
        later = time.time() + 0.3  # past the window: time is the caller's, no need to wait
        gone = table.history.prune(later).result()  # type: ignore[union-attr]
        table.history.pruned(gone, later)
        assert gone == {"completed": 1}
        assert table.lookup("done") is None  # gone from the store and from memory
        assert table.lookup("running") is not None  # unfinished tasks are never pruned
        assert table.counts()["completed"] == 0
        assert result.exists() != delete
        report = check(folder)
        assert report.ok and report.tasks == 1 and report.expired == 0, report.problems
        table.close()


def test_batched_commits_and_durability_barrier(tmp_path: Path) -> None:
    store = TaskStore(tmp_path)
    store.open()
    futures = [
        store.put("accepted", f"b{i}", status="pending", stage="accepted", fixed={"n": i})
        for i in range(2000)
    ]
    store.barrier().result()
    assert all(f.done() and f.exception() is None for f in futures)
    assert store.ops == 2001 and store.commits < 200  # many changes per transaction
    dup = store.put("accepted", "b7", status="pending", stage="accepted")
    with pytest.raises(StoreConflict):
        dup.result()
    # A failed write fails only itself: the rest of its batch is committed.
    after = store.put("queued", "b8", status="pending", stage="queued")
    after.result()
    assert store.get("b8")["stage"] == "queued"  # type: ignore[index]
    store.close()


def test_second_controller_on_the_same_store_is_refused(tmp_path: Path) -> None:
    first = TaskStore(tmp_path)
    first.open()
    with pytest.raises(StoreLocked, match="own output_dir"):
        TaskStore(tmp_path).open()
    first.close()
    again = TaskStore(tmp_path)
    again.open()
    again.close()


def test_corrupt_store_is_refused_with_a_way_out(tmp_path: Path) -> None:
    (tmp_path / "tasks.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=r"Move the folder .* aside"):
        TaskStore(tmp_path).open()
    with pytest.raises(StoreError) as again:  # the same answer: the lock was let go
        TaskStore(tmp_path).open()
    assert not isinstance(again.value, StoreLocked)


def test_accepted_task_survives_a_hard_kill_right_after_it_is_durable(tmp_path: Path) -> None:
    """The ordering the front door relies on: once the accepted task's future resolves,
    a SIGKILL-like exit (no close, no flush) loses nothing."""
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from controller.tasks.table import open_table
from controller.tasks.tasks import Task
table = open_table(Path({str(tmp_path)!r}))
for i in range(50):
    t = Task(task_id=f"k{{i}}", kind="image", pipeline="qwen_i2i", request={{"prompt": "x"}},
             save_result_path="")
    t.image_bytes = bytes([i]) * 1000
    table.add(t)
    table.queued(t)
table.journal.durable("k49").result()
os._exit(9)
"""
    proc = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == 9
    table = open_table(tmp_path)
    unfinished = table.restore()
    assert [t.task_id for t in unfinished] == [f"k{i}" for i in range(50)]
    assert unfinished[49].image_bytes == bytes([49]) * 1000 and unfinished[0].attempt == 2
    table.close()


def test_old_json_lines_journal_is_imported_once(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    done = {"task_id": "old-done", "kind": "image", "pipeline": "qwen_i2i",
            "request": {"prompt": "x"}, "save_result_path": "", "stage": "completed",
            "result_path": "/r/old-done.png", "finished_at": time.time()}
    running = {**done, "task_id": "old-running", "stage": "encoding", "result_path": None,
               "finished_at": None}
    refused = {**running, "task_id": "old-refused"}
    lines = [{"event": "accepted", "task": running}, {"event": "accepted", "task": refused},
             {"event": "rejected", "task": refused}, {"event": "completed", "task": done}]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines)
                                          + '{"torn')
    (tmp_path / "images" / "old-running").write_bytes(b"IMG")
    table = open_table(tmp_path)
    unfinished = table.restore()
    assert [t.task_id for t in unfinished] == ["old-running"]
    assert unfinished[0].image_bytes == b"IMG" and unfinished[0].attempt == 2
    old = table.lookup("old-done")
    assert old is not None and old.stage == Stage.COMPLETED
    assert table.lookup("old-refused") is None
    assert not (tmp_path / "tasks.jsonl").exists()
    assert (tmp_path / "tasks.jsonl.imported").exists()
    table.close()
    assert check(tmp_path).ok


def test_check_finds_double_completions_and_expired_rows(tmp_path: Path) -> None:
    store = TaskStore(tmp_path, retention_s=5)
    store.open()
    store.put("accepted", "a", status="pending", stage="accepted")
    store.put("completed", "a", status="completed", stage="completed", finished_at=time.time())
    store.put("accepted", "b", status="pending", stage="accepted")
    store.put("completed", "b", status="completed", stage="completed", finished_at=1.0)
    store.put("completed", "b", status="completed", stage="completed", finished_at=1.0)
    store.barrier().result()
    report = check(tmp_path)
    assert not report.ok
    assert report.duplicated == ["b"] and report.expired == 1
    assert report.by_status["completed"] == 2
    # The command line: exit status 1 and a one-line verdict, while the store is open.
    cli = subprocess.run([sys.executable, "-m", "controller.tasks.store_check", "--check",
                          str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert cli.returncode == 1 and cli.stdout.startswith("store: FAILED"), cli.stdout
    assert "completed more than once" in cli.stdout
    store.close()
    good = tmp_path / "good"
    table = open_table(good)
    t = new_task("g")
    table.add(t)
    finish(table, t)
    table.close()
    cli = subprocess.run([sys.executable, "-m", "controller.tasks.store_check", "--check",
                          str(good),
                          "--json", "--max-bytes", str(10 << 20)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    out = json.loads(cli.stdout)
    assert out["ok"] and out["by_status"]["completed"] == 1 and out["duplicated"] == []
    assert check(good, max_bytes=10).problems[0].startswith("store is")

