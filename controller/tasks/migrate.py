"""The one-time move of an older controller's JSON-lines journal into the task store.

Controllers before the SQLite store appended every event to ``<journal>/tasks.jsonl`` and
kept unfinished tasks' input images in ``<journal>/images/``. The first controller on the
store reads the last state of each task from it, inserts what the store lacks (a restart that
interrupted an import finds those rows there already), waits until they are committed, then
renames the file to ``tasks.jsonl.imported`` and deletes the images, so it runs once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from controller.tasks.journal import TaskJournal
from controller.tasks.tasks import TERMINAL, Stage, task_from_record

log = logging.getLogger("diffring.controller.tasks")


def import_jsonl(journal: TaskJournal, folder: Path) -> int:
    """Import ``folder/tasks.jsonl`` through ``journal`` (once); how many tasks it held."""
    path = folder / "tasks.jsonl"
    store = journal.store
    if store is None or not path.exists():
        return 0
    last: dict[str, dict[str, Any]] = {}
    with path.open() as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                log.warning("journal: skipping a torn line (crash while writing it)")
                continue
            if rec["event"] == "rejected":
                last.pop(rec["task"]["task_id"], None)
            else:
                last[rec["task"]["task_id"]] = rec["task"]
    futures = []
    for data in last.values():
        task = task_from_record(data)
        if store.get(task.task_id) is not None:
            continue  # imported already (a restart interrupted the import)
        if task.stage not in TERMINAL:
            image = folder / "images" / task.task_id
            task.image_bytes = image.read_bytes() if image.exists() else None
        futures.append(journal.record("accepted", task))
        if task.stage == Stage.COMPLETED:
            futures.append(journal.record("completed", task))
    for fut in futures:
        if fut is not None:
            fut.result()
    path.rename(path.with_name("tasks.jsonl.imported"))
    for image in (folder / "images").glob("*"):
        image.unlink(missing_ok=True)
    log.info("journal: imported %d task(s) from %s into the task store", len(last), path)
    return len(last)
