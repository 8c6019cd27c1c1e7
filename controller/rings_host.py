"""The controller's three rings, each in its own region on its own handshake port."""

from __future__ import annotations

import logging

from contracts.disagg import DisaggConfig
from rings.errors import ConfigError
from rings.host import RdmaJoinHook, RingHost
from rings.layout import RING_NAMES
from rings.ring import Ring

log = logging.getLogger("diffring.controller")


class ControllerRings:
    """Starts and stops the request, phase1 and phase2 ring hosts of one controller."""

    def __init__(self, disagg: DisaggConfig, token: str) -> None:
        self.disagg = disagg
        self.hosts: dict[str, RingHost] = {}
        rdma_join: RdmaJoinHook | None = None
        if disagg.ring_transport != "tcp":
            from rings.rdma import make_rdma_join

            rdma_join = make_rdma_join(
                disagg.rdma_device_name, disagg.rdma_ib_port, disagg.rdma_gid_index
            )
            if rdma_join is None and disagg.ring_transport == "rdma":
                raise ConfigError(
                    "ring_transport is 'rdma' but this machine has no usable RDMA device "
                    "(or no pyverbs); set disagg_config.ring_transport to 'tcp' or 'auto'"
                )
            log.info("ring transport: %s", "rdma and tcp" if rdma_join else "tcp (no RDMA device)")
        for name in RING_NAMES:
            host, port = disagg.ring_address(name)
            self.hosts[name] = RingHost(
                disagg.layout(name),
                host=host,
                port=port,
                token=token,
                claim_timeout_s=disagg.claim_timeout_s,
                rdma_join=rdma_join,
            )
        self.local: dict[str, Ring] = {}
        """The controller's own handle on each ring, set by :meth:`start`."""

    async def start(self) -> None:
        started: list[RingHost] = []
        try:
            for host in self.hosts.values():
                await host.start()
                started.append(host)
        except BaseException:
            for host in started:
                await host.close()
            raise
        # Only now: start() may swap a host's local verbs for the NIC loopback (rdma), and
        # the controller's own pushes must be atomics of the same kind as its peers'
        # (a CPU update beside NIC atomics is not atomic with them).
        self.local = {n: Ring(h.local) for n, h in self.hosts.items()}

    async def close(self) -> None:
        for host in self.hosts.values():
            await host.close()

    def ports(self) -> dict[str, int]:
        return {name: host.port for name, host in self.hosts.items()}
