"""diffring rings: bounded MPMC queues in controller-hosted regions, over one-sided verbs.

Public surface: :class:`RingLayout`, :class:`Ring`, :class:`RingHost`, :func:`connect`, and
the exceptions in :mod:`rings.errors`. Nothing here imports torch, mooncake or pyverbs.
"""

from rings.errors import (
    DiffringError,
    HandshakeError,
    PayloadCorrupt,
    PayloadTooLarge,
    RingEmpty,
    RingFull,
    VerbsError,
)
from rings.host import RingHost
from rings.layout import RingLayout, SlotState
from rings.ring import Ring
from rings.transports import connect
from rings.verbs import LocalVerbs, Region, Verbs

__all__ = [
    "DiffringError",
    "HandshakeError",
    "LocalVerbs",
    "PayloadCorrupt",
    "PayloadTooLarge",
    "Region",
    "Ring",
    "RingEmpty",
    "RingFull",
    "RingHost",
    "RingLayout",
    "SlotState",
    "Verbs",
    "VerbsError",
    "connect",
]
