"""One rank of a transformer group (started by :mod:`workers.group.supervisor`, never by hand).

    python -m workers.group.rank --config FILE --rank R --start N --heartbeat-fd FD
        (rank 0)  --peer-fds 1:FD,2:FD,...      (others)  --leader-fd FD

The config file is the supervisor's whole service config; this rank runs on
``devices[R]``. Before anything heavy, the rank starts its heartbeat (a byte down the
supervisor's pipe every interval: a frozen process, SIGSTOP included, stops beating) and
asks the kernel to kill it if the supervisor dies (a group never outlives its supervisor).

Exit status: 0 stopped (drained, or told to stop); 2 refused to run (configuration, model
load); 3 the group broke (ranks out of step); 1 any other failure (a fatal error reported to
the controller). The supervisor gives up on 2 and restarts the group after anything else.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from contracts import faults
from contracts.config import ServiceConfig
from contracts.errors import ConfigError, DiffringError, ModelLoadError
from contracts.roles import Role

EXIT_REFUSED = 2
EXIT_BROKEN = 3
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("diffring.group")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--start", type=int, default=0, help="the group's start (0 = first)")
    ap.add_argument("--heartbeat-fd", type=int, required=True)
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--peer-fds", default="", help="rank 0: RANK:FD of each other rank")
    ap.add_argument("--leader-fd", type=int, help="ranks 1..: the channel to rank 0")
    ap.add_argument("--supervisor-pid", type=int)
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def _die_with_supervisor(supervisor: int | None) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the supervisor's kill is the only guard
        return
    if supervisor is not None and os.getppid() != supervisor:
        os._exit(EXIT_BROKEN)  # it died before the request took effect


def _beat(fd: int, every: float) -> None:
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            try:
                os.write(fd, b".")
            except OSError:  # the supervisor is gone: it takes this process with it
                return

    os.write(fd, b".")
    threading.Thread(target=loop, name="group-heartbeat", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _die_with_supervisor(args.supervisor_pid)
    _beat(args.heartbeat_fd, args.heartbeat_s)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [rank {args.rank}]: %(message)s",
    )
    env = dict(os.environ)
    base = ServiceConfig.from_dict(json.loads(args.config.read_text()))
    cfg = dataclasses.replace(base, device=base.devices[args.rank])
    faults.configure(cfg.faults, rank=args.rank, first_start=args.start == 0)
    try:
        if args.rank == 0:
            return _lead(cfg, args, env)
        return _follow(cfg, args)
    except (ConfigError, ModelLoadError) as exc:  # starting again would refuse again
        log.error("%s", exc)
        return EXIT_REFUSED
    except DiffringError as exc:  # e.g. the controller gone for good: a restart may help
        log.error("%s", exc)
        return 1


def _lead(cfg: ServiceConfig, args: argparse.Namespace, env: dict[str, str]) -> int:
    import torch

    from workers.group.dist import Channel, init_group, serve_store
    from workers.group.leader import GroupLeader
    from workers.group.steps import GroupBroken
    from workers.lifecycle import run_stage_worker

    layout, timeout = cfg.transformer.layout, cfg.transformer.group_timeout_s
    peers = []
    for item in filter(None, args.peer_fds.split(",")):
        rank, _, fd = item.partition(":")
        peers.append((int(rank), Channel.from_fd(int(fd), f"rank {rank}")))
    store = serve_store(layout, timeout)
    for _rank, channel in peers:
        channel.send(op="store", port=store.port)
    group = init_group(0, layout, torch.device(cfg.device), None, timeout, leader_store=store)
    token = cfg.disagg_config.resolve_token(env)
    try:
        return run_stage_worker(Role.TRANSFORMER, cfg, token, env,
                                make=lambda c, t, e: GroupLeader(c, t, e, group, peers))
    except GroupBroken as exc:
        log.error("%s", exc)
        return EXIT_BROKEN


def _follow(cfg: ServiceConfig, args: argparse.Namespace) -> int:
    # Only rank 0 drains on SIGTERM / SIGINT (Ctrl+C reaches the whole process group): the
    # others must go on computing its last task with it, then stop on its word.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from workers.group.dist import Channel, init_group
    from workers.group.follower import follow

    assert args.leader_fd is not None
    leader = Channel.from_fd(args.leader_fd, "rank 0")
    port = int(leader.recv(timeout=cfg.transformer.group_timeout_s)["port"])
    group = init_group(args.rank, cfg.transformer.layout, torch.device(cfg.device), port,
                       cfg.transformer.group_timeout_s)
    return follow(cfg, group, leader)


if __name__ == "__main__":
    sys.exit(main())
