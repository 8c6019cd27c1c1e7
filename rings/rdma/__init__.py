"""The ``rdma`` verbs transport: a pyverbs RC queue pair onto the ring host's region.

A peer (:func:`connect`) runs the ordinary ring handshake (:func:`rings.handshake.handshake`) on
the ring's port with ``transport="rdma"``. Its JOIN carries its queue pair's details, the
WELCOME the host's (:class:`RdmaJoin`):

    JOIN    + {qp_num, lid, gid, psn, mtu, link_layer}
    WELCOME + {qp_num, lid, gid, psn, mtu, max_dest_rd_atomic, link_layer,
               addr, rkey, write_rkey}          (region_size is in every WELCOME)

``addr`` is the virtual address of region offset 0 on the host. ``rkey`` covers the whole
region for RDMA READ; ``write_rkey`` covers only ``[WRITABLE_FROM, region_size)`` for WRITE
and atomics. Afterwards the peer's verbs are executed by the NICs alone; the TCP connection
stays open and idle as the peer's liveness. When it drops, the host revokes the peer and
destroys the host side of its queue pair, so a late verb of a revoked peer cannot land.

One layer per module, each importing only the ones above it:

* :mod:`rings.rdma._pyverbs`: imports pyverbs lazily (never at import time), lists devices,
  translates pyverbs errors into :mod:`rings.errors`.
* :mod:`rings.rdma.qp`: queue-pair attributes of each state transition, work requests,
  work completion statuses.
* :mod:`rings.rdma.device`: an opened device port, and the requesting endpoint that posts a
  batch of verbs and waits for its completions.
* :mod:`rings.rdma.selftest`: the byte-order self-test of a device's atomics.
* :mod:`rings.rdma.peer`: :class:`RdmaVerbs` and :func:`connect`.
* :mod:`rings.rdma.host`: :class:`RdmaJoin` and :func:`make_rdma_join`, what
  :class:`rings.host.RingHost` uses to let rdma peers join.

Not exercised on any machine of this project (none has an RDMA device): everything past
device discovery runs only against the fake pyverbs in ``tests/integration/test_rdma.py``. The fake
checks the attribute masks of the state transitions, the access flags, the keys, the bounds
and the order. The attribute, work-request and address-handle classes are also built with
the real pyverbs 44 where it imports.
"""

from rings.rdma._pyverbs import rdma_available
from rings.rdma.host import RdmaJoin, make_rdma_join
from rings.rdma.peer import RdmaVerbs, connect

__all__ = ["RdmaJoin", "RdmaVerbs", "connect", "make_rdma_join", "rdma_available"]
