"""A ring peer that stops dead at a precise step (for stall-repair tests).

    python -m tests.support.stall_peer PORT SLOTS SLOT_SIZE MODE TOKEN   (from the repository root)

MODE is one of
  push, pop                  stop right after the claim CAS won (a pop also has read the slot)
  push-ticket, pop-ticket    stop right after the ticket fetch-and-add, before the claim CAS:
                             the peer holds a position that no stamp names yet

It prints ``CLAIMED <position> <item id or ->`` or ``TICKET <position> <stamp word>`` once that
step has run, then sleeps until the test SIGKILLs it. The step is reached by the verbs the
ring itself sends (a batch is cut where the step ends and the rest never sent), so it is the
same on every run, not a matter of timing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from rings import payload as pl
from rings.layout import OFF_HEAD, OFF_TAIL, POS_SHIFT, RingLayout, SlotState, unpack_stamp
from rings.ring import Ring
from rings.soak import RING
from rings.transports import connect
from rings.verbs import CAS, FAA, READ, Op, Verbs


def _stall() -> None:
    while True:
        time.sleep(3600)


class StallAfterClaim(Verbs):
    def __init__(self, inner: Verbs, state: SlotState) -> None:
        self.inner = inner
        self.layout = inner.layout
        self.peer_id = inner.peer_id
        self.state = state

    def batch(self, ops: Sequence[Op]) -> list[Any]:
        for i, op in enumerate(ops):
            if op[0] != CAS:
                continue
            pos, state, holder = unpack_stamp(op[3])
            if state != self.state or holder != self.peer_id:
                continue
            # Send the batch up to the claim (and the READ of a pop claim), not beyond: the
            # publish or free that the ring posts in the same batch never happens.
            cut = i + 2 if i + 1 < len(ops) and ops[i + 1][0] == READ else i + 1
            head = self.inner.batch(list(ops[:cut]))
            if head[i] != op[2]:
                return head + self.inner.batch(list(ops[cut:]))
            item_id = "-"
            if state == SlotState.CLAIMED_POP:
                item_id = str(pl.unframe(head[i + 1], op[3] >> POS_SHIFT)["id"])
            print(f"CLAIMED {pos} {item_id}", flush=True)
            _stall()
        return self.inner.batch(ops)


class StallAfterTicket(Verbs):
    """Stops after the batch holding the ticket FAA on ``counter`` (tail or head)."""

    def __init__(self, inner: Verbs, counter: int) -> None:
        self.inner = inner
        self.layout = inner.layout
        self.peer_id = inner.peer_id
        self.counter = counter

    def batch(self, ops: Sequence[Op]) -> list[Any]:
        res = self.inner.batch(ops)
        for i, op in enumerate(ops):
            if op[0] == FAA and op[1] == self.counter:
                position = res[i]
                word = self.inner.batch([(READ, self.layout.stamp_offset(position), 8)])[0]
                print(f"TICKET {position} {int.from_bytes(word, 'little')}", flush=True)
                _stall()
        return res


def main() -> None:
    port, slots, slot_size, mode, token = sys.argv[1:6]
    verbs = connect(
        "tcp",
        "127.0.0.1",
        int(port),
        layout=RingLayout(RING, int(slots), int(slot_size)),
        ring=RING,
        token=token,
    )
    item = {"id": 99 << 32, "data": b"never", "crc": 0}
    if mode == "push":
        Ring(StallAfterClaim(verbs, SlotState.CLAIMED_PUSH)).try_push(item)
    elif mode == "pop":
        Ring(StallAfterClaim(verbs, SlotState.CLAIMED_POP)).pop(timeout=60)
    elif mode == "push-ticket":
        Ring(StallAfterTicket(verbs, OFF_TAIL)).try_push(item)
    elif mode == "pop-ticket":
        Ring(StallAfterTicket(verbs, OFF_HEAD)).try_pop()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("NOT STALLED", flush=True)


if __name__ == "__main__":
    main()
