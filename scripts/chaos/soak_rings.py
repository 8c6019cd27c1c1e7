#!/usr/bin/env python
"""Exactly-once soak of a ring over tcp on loopback.

    python -m scripts.chaos.soak_rings --producers 16 --consumers 16 --items 200000 --capacity 3
    python -m scripts.chaos.soak_rings --producers 16 --consumers 16 --capacity 2 --seconds 600

Ends with ``exactly-once: OK`` or ``exactly-once: FAILED`` and the counts and items/s;
exit status 0 only when OK.
"""

from __future__ import annotations

import argparse
import sys

from rings.soak import run_soak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--consumers", type=int, default=4)
    p.add_argument("--items", type=int, default=20000, help="total items (ignored with --seconds)")
    p.add_argument("--capacity", type=int, default=3, help="ring slots; tiny so it wraps often")
    p.add_argument("--seconds", type=float, default=None, help="push for this long instead")
    p.add_argument("--slot-size", type=int, default=512)
    args = p.parse_args()
    if args.producers < 1 or args.consumers < 1:
        p.error("need at least one producer and one consumer")
    res = run_soak(
        args.producers,
        args.consumers,
        args.items,
        args.capacity,
        seconds=args.seconds,
        slot_size=args.slot_size,
    )
    print(f"repairs: {res.repairs}")
    print(res.report())
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
