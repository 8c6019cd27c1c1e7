"""The controller's half of a worker's transport preflight: connect back to what it advertises.

A worker that advertises an address nobody can reach (the 127.0.0.1 default on a cluster, a
typo, the wrong network interface, a firewall in the way) would register, claim a task and
fail it minutes later when the next stage tries to pull its tensors. Before it registers,
the worker asks the controller to open a TCP connection to each endpoint it advertises (its
Mooncake segment's handshake port); the controller reaches it over the same network its
peers use, so a failure here is the failure the first task would have met, reported with
the address and the reason while the operator is still watching the start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from contracts.messages import Checked, Preflight, PreflightReply
from controller.errors import ControlError

log = logging.getLogger("diffring.controller.preflight")

MAX_ENDPOINTS = 8
"""A worker advertises one segment; the cap keeps a (token-holding) peer from turning the
controller into a port scanner."""

CONNECT_BACK_TIMEOUT_S = 5.0
"""Long enough for a TCP handshake across a loaded data-centre network, short enough that an
unroutable address (packets silently dropped) is reported while someone watches start-up."""


async def _reach(host: str, port: int, timeout: float) -> None:
    _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def connect_back(
    msg: Preflight, controller: str, timeout: float = CONNECT_BACK_TIMEOUT_S
) -> PreflightReply:
    """Check every endpoint of a preflight message; the reply, or ControlError naming each
    endpoint that could not be reached and why."""
    name = msg.name
    endpoints = msg.endpoints
    if not 0 < len(endpoints) <= MAX_ENDPOINTS:
        raise ControlError(f"preflight must name 1 to {MAX_ENDPOINTS} endpoints to check")
    checked: list[Checked] = []
    problems: list[str] = []
    for ep in endpoints:
        what, host, port = ep.what, ep.host, ep.port
        t0 = time.monotonic()
        try:
            await _reach(host, port, timeout)
        except TimeoutError:
            problems.append(
                f"the controller ({controller}) could not connect to {host}:{port}, the {what} "
                f"that worker {name} advertises: no answer within {timeout:g} s (an address "
                "of another network, or a firewall dropping the packets)"
            )
            continue
        except OSError as exc:
            problems.append(
                f"the controller ({controller}) could not connect to {host}:{port}, the {what} "
                f"that worker {name} advertises: {exc.strerror or exc}"
            )
            continue
        checked.append(Checked(what=what, host=host, port=port,
                               seconds=round(time.monotonic() - t0, 4)))
    if problems:
        hint = (
            "; set MOONCAKE_LOCAL_HOSTNAME (or local_hostname in the Mooncake config file, or "
            "the worker's server.host) to an address of the worker's host that the controller "
            "and the other workers reach, and let Mooncake's ports through any firewall"
        )
        log.warning("preflight refused %s: %s", name, "; ".join(problems))
        raise ControlError("; ".join(problems) + hint)
    log.info("preflight of %s: reached %s", name,
             ", ".join(f"{c.what} {c.host}:{c.port}" for c in checked))
    return PreflightReply(checked=checked)
