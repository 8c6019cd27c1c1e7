"""The groups running on this machine, recorded by the launcher that started each one, so
that a client started without a URL finds the front door (``diffring submit``, ``status``,
``list``, ..., and the request scripts ``scripts/post/post_*.py``).

``python -m launcher`` (the start scripts, ``diffring group``) writes one small JSON file per
group once it is ready, named by its own pid, under ``$XDG_STATE_HOME/diffring/groups``
(default ``~/.local/state/diffring/groups``), and removes it when the group stops; a file
whose launcher is gone (killed with SIGKILL) is ignored and removed by the next reader. No
secret goes into it: a client of a front door with an API key still needs the key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_ENV = "XDG_STATE_HOME"


@dataclass(frozen=True)
class RunningGroup:
    pipeline: str
    url: str
    """Its front door."""
    pid: int
    """The launcher's pid (the group lives as long as it does)."""
    log_dir: str


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get(STATE_ENV) or str(Path.home() / ".local" / "state")
    return Path(base) / "diffring" / "groups"


def record(group: RunningGroup) -> Path:
    """Write down a group that is ready (replacing an earlier record of the same pid)."""
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{group.pid}.json"
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(asdict(group)) + "\n")
    os.replace(tmp, path)
    return path


def forget(pid: int) -> None:
    (state_dir() / f"{pid}.json").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def running(pipeline: str | None = None) -> list[RunningGroup]:
    """The groups whose launcher still runs (of ``pipeline`` only, when given), oldest
    record first; records of launchers that are gone are removed."""
    folder = state_dir()
    out = []
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime) if (
            folder.is_dir()) else []:
        try:
            group = RunningGroup(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours
        if not _alive(group.pid):
            path.unlink(missing_ok=True)
            continue
        if pipeline is None or group.pipeline == pipeline:
            out.append(group)
    return out
