"""Where a controller keeps its task store, and whether a controller holds it now: what the
controller (which opens the store, :mod:`controller.tasks.store`) and the launcher (which
checks it before starting a group, so that a second group sharing a results folder is
refused before anything starts) agree on."""

from __future__ import annotations

import fcntl
from pathlib import Path

STORE_DIR = ".journal"
"""The task store's folder inside a controller's ``output_dir``."""
LOCK_FILE = "tasks.lock"
"""The file a controller holds an exclusive ``flock`` on while it uses the store."""


def store_folder(output_dir: Path) -> Path:
    return output_dir / STORE_DIR


def in_use(output_dir: Path) -> bool:
    """Whether a running controller holds the task store of ``output_dir`` (its lock is
    tried and, when free, given back at once)."""
    lock = store_folder(output_dir) / LOCK_FILE
    if not lock.exists():
        return False
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False
