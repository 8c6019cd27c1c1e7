"""Groups on this machine for the tests (``launcher.LocalGroup``: a controller and its workers
as processes, stopped by pid), on the tiny models; and a transformer group (one DiT over
several rank processes, ``workers/group/``) started inside such a group."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher import LocalGroup, Service, group_config

WORKERS = ("encoder", "transformer", "decoder")


def local_group(pipeline: str, models: Path, workdir: Path, **overrides: Any) -> LocalGroup:
    """A group of ``pipeline`` on its tiny model folder in ``models``, its files in
    ``workdir``; nothing started yet (``overrides``: more of :func:`launcher.group_config`)."""
    return LocalGroup(group_config(pipeline, str(models / pipeline), workdir, **overrides),
                      workdir)


@contextlib.contextmanager
def start_group(pipeline: str, models: Path, workdir: Path, *,
                workers: Sequence[str] = WORKERS,
                settings: Mapping[str, Mapping[str, Any]] | None = None,
                **overrides: Any) -> Iterator[LocalGroup]:
    """A controller and one worker of each role in ``workers`` (in that order; none: a
    controller alone), started and waited for; stopped by pid after. ``settings``: a role's
    own settings, merged into its config (e.g. ``{"encoder": {"server": {"metric_port":
    P}}}``)."""
    settings = settings or {}
    with local_group(pipeline, models, workdir, **overrides) as group:
        group.start("controller", settings.get("controller"))
        group.wait_http(timeout=120)
        for role in workers:
            group.start(role, settings.get(role))
        if workers:
            group.wait_workers(dict.fromkeys(workers, 1), timeout=300)
        yield group


def events_of(group: LocalGroup, kind: str, request: Mapping[str, Any]
              ) -> list[tuple[str, dict[str, Any]]]:
    """Every event of a task posted to ``/v1/tasks/<kind>/`` (``request`` names its
    ``task_id``), from before its first DiT step: the group's transformers are held (SIGSTOP)
    until the task waits in phase1 and its event stream is open, so every later event comes
    through the stream, in order (a tiny model otherwise finishes before a client
    connects)."""
    import signal

    import httpx

    from tests.support.http import read_events

    task_id = request["task_id"]
    dits = [svc.proc.pid for svc in group.services if svc.role == "transformer"]
    for pid in dits:
        os.kill(pid, signal.SIGSTOP)
    try:
        r = httpx.post(f"{group.url}/v1/tasks/{kind}/", json=dict(request), timeout=30)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 120
        while httpx.get(f"{group.url}/v1/tasks/{task_id}/status").json()["stage"] != "phase1":
            assert time.monotonic() < deadline, "the task never reached phase1"
            time.sleep(0.05)
        def release() -> None:  # once the stream is open (its first event came), not a guess
            for pid in dits:
                os.kill(pid, signal.SIGCONT)

        return read_events(group.url, task_id, release)
    finally:
        for pid in dits:
            os.kill(pid, signal.SIGCONT)


def start_dit_group(cluster: LocalGroup, layout: str, faults: str, timeout_s: float,
                    restarts: int, **transformer: Any) -> Service:
    """A transformer group of two CPU ranks in ``cluster`` (its ``parallel`` ``layout``, its
    fault points armed), registered; ``transformer``: more of its ``transformer`` section."""
    svc = cluster.start("transformer", {
        "devices": ["cpu", "cpu"],
        "transformer": {"parallel": layout, "group_timeout_s": timeout_s,
                        "group_restarts": restarts, **transformer},
        "faults": faults,
    })
    cluster.wait_workers({"transformer": 1}, timeout=300)
    return svc


def rank_pids(svc: Service) -> set[int]:
    """Every rank process a transformer group's supervisor started (it logs each start's
    ranks)."""
    return {int(p) for p in re.findall(r"rank \d \(cpu, pid (\d+)\)", svc.log())}


def gone(pid: int) -> bool:
    """``pid`` no longer runs (or is a zombie of an exited child)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].startswith("Z")


def wait_exit(cluster: LocalGroup, svc: Service, timeout: float) -> int:
    """``svc``'s exit status once it exited; it then leaves the cluster's services (whose
    checks count any exited one as a failure)."""
    deadline = time.monotonic() + timeout
    while svc.proc.poll() is None:
        assert time.monotonic() < deadline, f"the group did not exit:\n{svc.log()[-3000:]}"
        time.sleep(0.2)
    cluster.services.remove(svc)
    return svc.proc.returncode
