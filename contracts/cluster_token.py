"""The cluster token: its public development default, and the refusal to use that default on
a service other machines can reach.

Every service proves the token at each ring and control-channel handshake. The default is
in this file for anyone to read, so it may only guard a group that lives on loopback.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from contracts.errors import ConfigError

DEFAULT_TOKEN = "diffring-dev-token"
"""The development default (public): refused off loopback by :func:`require_token`."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1); every other
    name counts as reachable from elsewhere (nothing is resolved here)."""
    h = host.strip().lower().strip("[]")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def require_token(token: str, addresses: Mapping[str, str], service: str) -> None:
    """Refuse the development token on a service reachable from other machines.

    ``addresses``: config key -> address the service binds, advertises or joins. The
    default token is public (it is in this file), so with it anyone who reaches a ring or
    the control channel could join as a peer.
    """
    if token != DEFAULT_TOKEN:
        return
    exposed = {k: v for k, v in addresses.items() if not is_loopback(v)}
    if exposed:
        where = ", ".join(f"{k}={v!r}" for k, v in exposed.items())
        raise ConfigError(
            f"{service}: {where} is not a loopback address, and the cluster token is the "
            "public development default. Give every service of the group the same secret "
            "token: export DIFFRING_CLUSTER_TOKEN=$(python -c 'import secrets; "
            "print(secrets.token_hex(32))') (or set disagg_config.cluster_token)"
        )
