"""``python -m rings serve``: host one ring on its own, outside a controller.

For soak runs, benchmarks and tests of the ring itself. Prints ``READY <port>`` on stdout
once it listens (port 0 picks a free one); SIGINT/SIGTERM stop it. The peers' token is
``--token`` or ``DIFFRING_CLUSTER_TOKEN`` (the rings know no service configuration, hence no
development default).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from rings.errors import TransportUnavailable
from rings.host import RdmaJoinHook, RingHost
from rings.layout import RingLayout


def _rdma_join() -> RdmaJoinHook:
    from rings.rdma import make_rdma_join

    join = make_rdma_join()
    if join is None:
        raise TransportUnavailable("--rdma given, but this machine has no usable RDMA device")
    return join


async def _serve(args: argparse.Namespace, token: str) -> None:
    host = RingHost(
        RingLayout(args.name, args.slots, args.slot_size),
        host=args.host,
        port=args.port,
        token=token,
        claim_timeout_s=args.claim_timeout,
        scan_interval_s=args.scan_interval,
        rdma_join=_rdma_join() if args.rdma else None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await host.start()
    print(f"READY {host.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await host.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rings serve", description=__doc__)
    p.add_argument("--name", default="test")
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--slot-size", type=int, default=4096)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--token", default=None)
    p.add_argument("--claim-timeout", type=float, default=30.0)
    p.add_argument("--scan-interval", type=float, default=0.2)
    p.add_argument("--rdma", action="store_true", help="also serve rdma peers (needs a device)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    token = args.token or os.environ.get("DIFFRING_CLUSTER_TOKEN")
    if not token:
        print("python -m rings serve needs the peers' token: pass --token or set "
              "DIFFRING_CLUSTER_TOKEN", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args, token))
    else:
        uvloop.run(_serve(args, token))
    return 0
