"""A worker's transport preflight: prove the address it advertises works before registering.

Three checks, each failing with :class:`PreflightFailed` that names the address and what
failed (the worker then exits instead of failing its first task minutes later):

1. on paper (:func:`check_on_paper`): the advertised Mooncake host is not a wildcard, and not
   a loopback address while the controller is on another host;
2. connect-back (:func:`connect_back`): the controller opens a TCP connection to the
   advertised segment's handshake port, from the controller's host
   (:mod:`controller.preflight`);
3. Mooncake loopback read (:func:`loopback_read`): bytes staged in this worker's pool are
   read back through its own advertised segment name, the way a peer pulls them, so the
   engine, the protocol (tcp or rdma) and the advertised host work end to end.

All three run at start, in this order, before the model loads (minutes for a real
checkpoint); the connect-back runs again on every reconnection, before ``register``.
"""

from __future__ import annotations

import logging
import os
import time

from contracts.addresses import advertised_problem
from contracts.errors import ControlRefused, DiffringError, PreflightFailed
from contracts.messages import Endpoint, Preflight, PreflightReply
from tensorplane.engine import TransferEngine
from tensorplane.handoff import pull_tensors, stage_bytes
from tensorplane.pool import StagingPool
from workers.control import ControlChannel

log = logging.getLogger("diffring.worker.preflight")

PROBE_BYTES = 4096
LOOPBACK_TIMEOUT_S = 10.0

_FIX = (
    "set MOONCAKE_LOCAL_HOSTNAME (or local_hostname in the Mooncake config file, or this "
    "worker's server.host) to an address of this host that the other hosts reach"
)


def check_on_paper(engine: TransferEngine, controller: str, name: str) -> None:
    host, _port = engine.rpc_endpoint
    problem = advertised_problem(host, controller)
    if problem is not None:
        raise PreflightFailed(
            f"worker {name} advertises Mooncake segment {engine.session_id}: {problem}"
        )


def loopback_read(engine: TransferEngine, pool: StagingPool, name: str) -> float:
    """Stage random bytes and pull them back through the advertised segment; seconds taken."""
    data = os.urandom(PROBE_BYTES)
    t0 = time.monotonic()
    desc = stage_bytes(pool, engine, "preflight", data, alloc_timeout=LOOPBACK_TIMEOUT_S)
    try:
        # Into numpy arrays: the probe must not import torch into a worker that has none.
        got = pull_tensors(engine, pool, [desc], device="cpu", release=False,
                           alloc_timeout=LOOPBACK_TIMEOUT_S, arrays="numpy")
    except DiffringError as exc:
        raise PreflightFailed(
            f"worker {name}: a Mooncake read of its own segment {engine.session_id} "
            f"(protocol {engine.settings.protocol}) failed: {exc}; peers would fail the same "
            f"way. {_FIX}; with protocol rdma, check the RDMA device (run_service.py --check)"
        ) from exc
    finally:
        pool.free_staged([desc])
    if got["preflight"].tobytes() != data:
        raise PreflightFailed(
            f"worker {name}: a Mooncake read of its own segment {engine.session_id} returned "
            "different bytes than were staged"
        )
    seconds = time.monotonic() - t0
    log.info("preflight: read %d bytes back through segment %s in %.1f ms", PROBE_BYTES,
             engine.session_id, 1e3 * seconds)
    return seconds


def connect_back(
    control: ControlChannel, engine: TransferEngine, role: str, name: str, own: bool = False
) -> None:
    """Ask the controller to connect to this worker's advertised segment; raise on refusal.
    ``own``: open (and close) a control connection of its own for it."""
    if own:
        control.connect(role)
        try:
            connect_back(control, engine, role, name)
        finally:
            control.close()
        return
    host, port = engine.rpc_endpoint
    try:
        reply = control.call(
            Preflight(role=role, name=name,
                      endpoints=[Endpoint(what="Mooncake segment", host=host, port=port)]),
            PreflightReply)
    except ControlRefused as exc:
        raise PreflightFailed(
            f"worker {name} refuses to register: {str(exc).removeprefix('controller refused ')}"
        ) from exc
    for c in reply.checked:
        log.info("preflight: controller reached %s %s:%s in %.1f ms", c.what, c.host, c.port,
                 1e3 * c.seconds)
