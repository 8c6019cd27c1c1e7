"""The supervisor of a transformer group: ``run_service.py --service transformer --devices ...``.

It imports no torch and computes nothing. It starts one process per device
(:mod:`workers.group.rank`), wires them (a socket pair from rank 0 to each other rank for
commands, a pipe from each rank for heartbeats; no port is chosen by anyone but the kernel)
and then watches them. The group lives and dies as one:

* a rank that exits, for any reason, or that sends no heartbeat for ``group_timeout_s``
  (hung, or frozen by SIGSTOP), takes the whole group down: every rank is killed (SIGKILL,
  by pid). Rank 0's control connection closes with it, so the controller puts its task back
  in play at once (a lost worker: not charged to the task), unless rank 0 reported the
  failure itself first (a broken group, :class:`~workers.group.steps.GroupBroken`);
* no rank waits forever: the idle ranks wait on their command channel, which closes with
  rank 0, and every collective has the process group's timeout (``group_timeout_s``);
* then the group is started again, up to ``group_restarts`` times; after that, or when a
  rank refused to run (exit status 2: configuration, model load), the supervisor exits with
  an error that names the rank, its device and pid, and what happened to it.

SIGTERM / SIGINT drain the group: rank 0 finishes its task -- or, checkpointing
(``checkpoint_every_*``), hands it back at the next step boundary, every rank leaving the
loop there -- tells the others to stop, and everything exits; the supervisor waits for
that, then for nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from contracts.config import ServiceConfig
from contracts.errors import DiffringError

log = logging.getLogger("diffring.group")

ROOT = Path(__file__).resolve().parents[2]
EXIT_REFUSED, EXIT_BROKEN = 2, 3  # as workers.group.rank's
RESTART_PAUSE_S = 1.0


class GroupFailed(DiffringError):
    """The group failed and will not be restarted (the message names the rank)."""


@dataclass
class Rank:
    rank: int
    device: str
    proc: subprocess.Popen[bytes]
    beats: int
    """Read end of the rank's heartbeat pipe."""
    last_beat: float
    exited: bool = False

    def describe(self) -> str:
        return f"rank {self.rank} ({self.device}, pid {self.proc.pid})"


def _exit_text(code: int) -> str:
    if code == EXIT_BROKEN:
        return "found the group out of step (exit status 3; its log says why)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class GroupSupervisor:
    """Starts, watches and restarts the ranks of one transformer group."""

    def __init__(self, cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> None:
        self.cfg = cfg
        self.layout = cfg.transformer.layout
        self.timeout_s = cfg.transformer.group_timeout_s
        self.beat_s = min(1.0, self.timeout_s / 10)
        # The ranks resolve the token as any worker does; the supervisor hands them its own.
        self.env = {**env, "DIFFRING_CLUSTER_TOKEN": token}
        self.draining = False
        self.ranks: list[Rank] = []
        self.starts = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        with tempfile.TemporaryDirectory(prefix="diffring-group-") as tmp:
            # The whole service config, as the ranks read it (mode 0600: it may hold keys).
            path = Path(tmp) / "service.json"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(dataclasses.asdict(self.cfg), f)
            restarts = self.cfg.transformer.group_restarts
            while True:
                failure = self._one_start(path)
                if failure is None or self.draining:
                    return 0
                why, refused = failure
                if refused:
                    raise GroupFailed(f"transformer group ({self.layout}): {why}; not "
                                      "restarted (it would refuse again)")
                if self.starts > restarts:
                    raise GroupFailed(f"transformer group ({self.layout}): {why}; gave up "
                                      f"after {restarts} restart(s)")
                log.warning("transformer group (%s): %s; restarting the group (%d of %d)",
                            self.layout, why, self.starts, restarts)
                time.sleep(RESTART_PAUSE_S)
                if self.draining:
                    return 0

    def drain(self) -> None:
        """Signal handlers call this: rank 0 finishes or hands back its task, then the group
        stops."""
        self.draining = True
        if self.ranks and not self.ranks[0].exited:
            self.ranks[0].proc.send_signal(signal.SIGTERM)

    # -- one start of the group ------------------------------------------------------------
    def _one_start(self, config: Path) -> tuple[str, bool] | None:
        """Start every rank and watch them; None when the group stopped cleanly, else what
        failed and whether it refused to run."""
        self._spawn(config)
        try:
            return self._watch()
        finally:
            self._kill_all()
            self.starts += 1

    def _spawn(self, config: Path) -> None:
        devices = self.cfg.devices
        pairs = [socket.socketpair() for _ in devices[1:]]
        self.ranks = []
        for rank, device in enumerate(devices):
            beat_r, beat_w = os.pipe()
            args = [sys.executable, "-m", "workers.group.rank", "--config", str(config),
                    "--rank", str(rank), "--start", str(self.starts),
                    "--heartbeat-fd", str(beat_w), "--heartbeat-s", str(self.beat_s),
                    "--supervisor-pid", str(os.getpid()),
                    "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
            if rank == 0:
                ends = [a.fileno() for a, _b in pairs]
                args += ["--peer-fds", ",".join(f"{k + 1}:{fd}" for k, fd in enumerate(ends))]
            else:
                ends = [pairs[rank - 1][1].fileno()]
                args += ["--leader-fd", str(ends[0])]
            proc = subprocess.Popen(args, cwd=ROOT, env=self.env, pass_fds=[beat_w, *ends])
            os.close(beat_w)
            self.ranks.append(Rank(rank, device, proc, beat_r, time.monotonic()))
        for a, b in pairs:  # the ranks hold their ends now
            a.close()
            b.close()
        log.info("transformer group (%s), start %d: %s", self.layout, self.starts,
                 ", ".join(r.describe() for r in self.ranks))
        if self.draining:  # a signal during the start
            self.drain()

    def _watch(self) -> tuple[str, bool] | None:
        while True:
            live = {r.beats: r for r in self.ranks if not r.exited}
            ready, _, _ = select.select(list(live), [], [], self.beat_s)
            now = time.monotonic()
            for fd in ready:
                if os.read(fd, 4096):
                    live[fd].last_beat = now
            for r in self.ranks:
                code = r.proc.poll()
                if code is None or r.exited:
                    continue
                r.exited = True
                if r.rank == 0 and code == 0:  # drained: the others were told to stop
                    self._wait_stopped()
                    return None
                if code == 0:
                    # Only rank 0's word stops a rank: its exit (in this pass or soon)
                    # decides; a rank lost without it breaks the next collective.
                    continue
                return f"{r.describe()} {_exit_text(code)}", code == EXIT_REFUSED
            for r in self.ranks:
                if not r.exited and now - r.last_beat > self.timeout_s:
                    return (f"{r.describe()} sent no heartbeat for {now - r.last_beat:.0f} s "
                            f"(hung or stopped; group_timeout_s {self.timeout_s:g})", False)

    def _wait_stopped(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for r in self.ranks[1:]:
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("transformer group: %s did not stop; killing it", r.describe())

    def _kill_all(self) -> None:
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.kill()  # SIGKILL: ends a stopped (SIGSTOP) process too
        for r in self.ranks:
            r.proc.wait()
            os.close(r.beats)


def run_group(cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> int:
    """Run a transformer group until drained; GroupFailed when it fails for good."""
    if len(cfg.devices) != cfg.transformer.layout.size:
        raise GroupFailed(cfg.group_devices_needed())
    sup = GroupSupervisor(cfg, token, env)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("transformer group: signal %d, draining", signum)
        sup.drain()  # only flips the state and passes SIGTERM on to rank 0

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return sup.run()
