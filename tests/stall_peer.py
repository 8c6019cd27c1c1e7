"""A ring peer that stops dead right after a successful claim (for stall-repair tests).

    python tests/stall_peer.py PORT SLOTS SLOT_SIZE push|pop TOKEN

It prints ``CLAIMED <position> <item id or ->`` once its claim verb succeeded, then sleeps
until the test SIGKILLs it: the slot stays claimed by a peer that will never finish.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rings import payload as pl
from rings.layout import POS_SHIFT, RingLayout, SlotState, unpack_stamp
from rings.ring import Ring
from rings.soak import RING
from rings.verbs import CAS, Op, Verbs, connect


class StallAfterClaim(Verbs):
    def __init__(self, inner: Verbs, state: SlotState) -> None:
        self.inner = inner
        self.layout = inner.layout
        self.peer_id = inner.peer_id
        self.state = state

    def batch(self, ops: Sequence[Op]) -> list[Any]:
        res = self.inner.batch(ops)
        for i, op in enumerate(ops):
            if op[0] != CAS or res[i] != op[2]:
                continue
            pos, state, holder = unpack_stamp(op[3])
            if state == self.state and holder == self.peer_id:
                item_id = "-"
                if state == SlotState.CLAIMED_POP:
                    item_id = str(pl.unframe(res[i + 1], op[3] >> POS_SHIFT)["id"])
                print(f"CLAIMED {pos} {item_id}", flush=True)
                while True:
                    time.sleep(3600)
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
    if mode == "push":
        ring = Ring(StallAfterClaim(verbs, SlotState.CLAIMED_PUSH))
        ring.try_push({"id": 99 << 32, "data": b"never", "crc": 0})
    else:
        ring = Ring(StallAfterClaim(verbs, SlotState.CLAIMED_POP))
        ring.pop(timeout=60)
    print("NOT STALLED", flush=True)


if __name__ == "__main__":
    main()
