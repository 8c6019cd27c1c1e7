"""Which address each service binds and which one it advertises, in one place.

A group may span hosts: the controller binds its rings, control channel, front door and
metrics endpoint to its own address; a worker binds its metrics / probe endpoint to its own
address and *advertises* an address for its Mooncake segment, which other workers (and the
controller, for its preflight connect-back) use to reach it.

Settings involved (docs/cluster.md explains them for operators):

- ``server.host``: what a service binds its HTTP endpoints to (front door, metrics, probes).
- ``disagg_config.bootstrap_addr`` (and the ``rdma_*_host`` ring hosts): on the controller,
  what it binds the control channel and rings to; on a worker, where it connects to.
- Mooncake ``local_hostname`` (``MOONCAKE_LOCAL_HOSTNAME``): what a process advertises as its
  segment. When neither the environment nor the Mooncake file sets it, it defaults to the
  service's own address (:func:`default_advertised_host`), never silently to 127.0.0.1.

Everything here is pure (no sockets opened) except :func:`resolve`, which asks the system
resolver.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Final

from contracts.cluster_token import is_loopback as is_loopback
from contracts.config import ServiceConfig
from contracts.errors import ConfigError

WILDCARDS: Final = frozenset({"", "0.0.0.0", "::", "[::]"})


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_wildcard(host: str) -> bool:
    """True for an address that means "every interface" (fine to bind, useless to advertise)."""
    return host in WILDCARDS


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to here, or a ConfigError saying it does not resolve."""
    ip = _ip(host)
    if ip is not None:
        return [str(ip)]
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise ConfigError(f"address {host!r} does not resolve on this host: {exc}") from exc
    return sorted({str(info[4][0]) for info in infos})


def controller_address(cfg: ServiceConfig) -> str:
    """The address the controller is known by: where workers connect (control channel)."""
    return cfg.disagg_config.bootstrap_addr


def default_advertised_host(cfg: ServiceConfig, *, controller: bool) -> str:
    """The Mooncake ``local_hostname`` to use when neither MOONCAKE_LOCAL_HOSTNAME nor the
    Mooncake file sets one: the service's own address.

    A worker's own address is ``server.host`` (what its metrics endpoint binds). The
    controller's is ``bootstrap_addr`` (what workers already reach it at), else
    ``server.host``. A wildcard cannot be advertised; then loopback is right only when the
    controller is on loopback too (one machine), otherwise the operator must say.
    """
    candidates = [cfg.server.host]
    if controller:
        candidates.insert(0, controller_address(cfg))
    for host in candidates:
        if not is_wildcard(host):
            return host
    if is_loopback(controller_address(cfg)):
        # The group's controller is on this machine's loopback: so is the whole group.
        return "127.0.0.1"
    raise ConfigError(
        f"cannot tell which address to advertise for this service's Mooncake segment: "
        f"server.host is {cfg.server.host!r} (every interface) and the controller is at "
        f"{controller_address(cfg)!r}; set MOONCAKE_LOCAL_HOSTNAME (or local_hostname in the "
        "Mooncake config file) to the address other hosts reach this one at"
    )


def advertised_problem(host: str, controller: str) -> str | None:
    """Why ``host`` cannot work as an advertised address in a group whose controller is at
    ``controller``, or None when nothing is wrong on paper (reachability is checked by the
    preflight connect-back)."""
    if is_wildcard(host):
        return (
            f"{host!r} means every interface, which peers cannot connect to; advertise an "
            "address of this host that the others reach"
        )
    ip = _ip(host)
    if ip is not None and (ip.is_multicast or ip.is_unspecified):
        return f"{host!r} is not a unicast address"
    if is_loopback(host) and not is_loopback(controller):
        return (
            f"{host!r} is a loopback address, reachable from this machine only, but the "
            f"controller is at {controller!r} (another host); advertise this host's "
            "network address instead (MOONCAKE_LOCAL_HOSTNAME, or server.host)"
        )
    return None
