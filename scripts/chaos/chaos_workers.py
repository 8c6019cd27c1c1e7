"""Worker processes for the chaos soak, started from a fork server.

The soak replaces a killed worker every couple of seconds. Started with ``exec`` (as
``launcher.LocalGroup`` does), each replacement spends a few CPU-seconds importing
torch, Mooncake and the model stack before it can register, which on a 2-core machine is most
of the machine at that kill rate. So the soak starts workers from the standard library's
fork server with those modules preloaded: each worker is still a process of its own, running
``run_service.py``'s ``main`` from its own config file and log, killed by pid like any other;
it only skips the imports. (Nothing is shared at run time: the fork server forks before any
engine, pool, thread or connection exists.)
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRELOAD = ["run_service", "workers.main", "workers.roles", "workers.models.families.synthetic",
           "tensorplane.engine", "tensorplane.pool", "tensorplane.handoff", "torch"]


def _worker_main(role: str, config: str, log: str) -> None:
    """Body of a forked worker: its own log on stdout/stderr, then the service entry point."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    import run_service

    sys.exit(run_service.main(["--service", role, "--config", config]))


@dataclass
class ForkedWorker:
    """A worker process started by :class:`Launcher` (the fields ``Service`` also has)."""

    role: str
    proc: Any  # multiprocessing.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def alive(self) -> bool:
        return bool(self.proc.is_alive())

    def wait(self, timeout: float | None = None) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class Launcher:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.started: list[ForkedWorker] = []

    def start(self, role: str, config: dict[str, Any]) -> ForkedWorker:
        import json

        n = len(self.started)
        path = self.workdir / f"{role}-w{n}.json"
        path.write_text(json.dumps(config, indent=2))
        log = path.with_suffix(".log")
        proc = self.ctx.Process(target=_worker_main, args=(role, str(path), str(log)),
                                name=f"{role}-w{n}")
        worker = ForkedWorker(role, proc, log)
        # A Ctrl+C while the fork server answers would leave a worker whose pid we never
        # learnt (so nobody could stop it): hold SIGINT / SIGTERM until it is known.
        held = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            proc.start()
            self.started.append(worker)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
        return worker

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM every worker still running (they drain), then SIGKILL what is left."""
        workers = [w for w in self.started if w.alive()]
        for w in workers:
            _signal(w.pid, signal.SIGCONT)  # a stopped one could not drain
            _signal(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for w in workers:
            if w.wait(max(0.1, deadline - time.monotonic())) is None:
                _signal(w.pid, signal.SIGKILL)
                w.wait()
        # The fork server we started goes too (it would linger until it noticed that this
        # process is gone); the standard library's own tests stop it this way.
        server = getattr(multiprocessing.forkserver, "_forkserver", None)
        if server is not None and hasattr(server, "_stop"):
            server._stop()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it exited meanwhile
