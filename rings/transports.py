"""The transport factory: a ring's verbs over the transport named in the config.

Backends are registered by name (name -> module path) and imported on first use, so that
``import rings`` never pulls in pyverbs (or anything heavy); no backend imports this module.
Each backend's ``connect`` takes the options :func:`rings.verbs.transport_options` lists and
refuses the others (:func:`rings.verbs.refuse_unknown_options`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from rings.errors import ConfigError, HandshakeError, TransportUnavailable
from rings.layout import RingLayout
from rings.verbs import Verbs

log = logging.getLogger("diffring.rings.transports")

# name -> "module:factory". Factories take (host, port, *, layout, ring, token, **options)
# and refuse options they do not know (rings.verbs.refuse_unknown_options).
TRANSPORTS: dict[str, str] = {
    "tcp": "rings.tcp:connect",
    "rdma": "rings.rdma:connect",
}


def connect(
    transport: str,
    host: str,
    port: int,
    *,
    layout: RingLayout | None,
    ring: str,
    token: str,
    **options: Any,
) -> Verbs:
    """Open a peer connection to a ring served at host:port over ``transport``.

    ``transport`` is ``tcp``, ``rdma`` or ``auto`` (rdma where a device exists, else tcp).
    ``layout`` is what the caller expects; None (inspection only) accepts the server's.
    ``options`` go to the backend's ``connect`` as they are; an option it does not take is
    a ConfigError naming it (tcp takes and ignores :data:`rings.verbs.RDMA_ONLY_OPTIONS`).
    """
    if transport == "auto":
        from rings.rdma import rdma_available

        if not rdma_available():
            transport = "tcp"
        else:
            try:
                return connect("rdma", host, port, layout=layout, ring=ring, token=token, **options)
            except (TransportUnavailable, HandshakeError) as exc:
                # A device that cannot be used, or a host that serves no rdma: tcp still
                # works (a refusal that is not about rdma is repeated by tcp).
                log.warning("ring %s at %s:%d: rdma unusable, using tcp: %s", ring, host, port, exc)
                transport = "tcp"
    target = TRANSPORTS.get(transport)
    if target is None:
        raise ConfigError(
            f"unknown ring transport {transport!r}; choose one of "
            f"{', '.join([*TRANSPORTS, 'auto'])}"
        )
    module_name, func = target.split(":")
    module = importlib.import_module(module_name)
    verbs: Verbs = getattr(module, func)(
        host, port, layout=layout, ring=ring, token=token, **options
    )
    return verbs
