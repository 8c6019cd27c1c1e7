"""``python -m rings inspect``: a read-only look at a controller's rings.

It joins each ring as an ``inspect`` peer, which the host lets read and nothing else, and
reads the header, the counters and the stamps (one READ), plus each slot's payload header
with ``--slots``. It never claims or changes anything.

``head`` and ``tail`` count the tickets handed to consumers and producers; ``depth`` is how
many producer tickets no consumer holds yet, and ``waiting`` how many consumer tickets wait
for an item that no producer has been given yet (idle consumers on an empty ring). An
ORPHANED slot (a dead or idle consumer's item, re-offered to any consumer) counts as
published.

The rings know no service configuration: this command takes plain hosts, ports and a token
(``--token`` or ``DIFFRING_CLUSTER_TOKEN``). ``diffring inspect --config FILE`` reads them from
a service's file (and falls back to the development token, as the services do) and calls
:func:`main` with them.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from collections.abc import Mapping
from typing import Any

from rings import payload as pl
from rings.errors import DiffringError, PayloadCorrupt
from rings.layout import (
    OFF_FREED,
    OFF_HEAD,
    OFF_ORPHANED,
    OFF_REVOKED,
    OFF_TAIL,
    OFF_TOMBSTONES,
    RING_NAMES,
    STAMPS_OFFSET,
    RingLayout,
    SlotState,
    unpack_stamp,
)
from rings.transports import connect
from rings.verbs import READ, Verbs

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORTS = {"request": 5566, "phase1": 5567, "phase2": 5568}
"""Where a controller with the default configuration serves its rings."""


def _summary(item: dict[str, Any]) -> str:
    keys = ("kind", "task_id", "task", "stage", "attempt", "id")
    parts = [f"{k}={item[k]}" for k in keys if k in item]
    if not parts:
        parts = [f"keys={','.join(sorted(item)[:6])}"]
    return " ".join(parts)


def snapshot(verbs: Verbs, with_slots: bool = False) -> dict[str, Any]:
    """Read one ring's state through ``verbs`` (reads only)."""
    lay: RingLayout = verbs.layout
    raw = verbs.read(0, lay.payloads_offset)
    layout = RingLayout.from_header(raw)
    head, tail, tomb, freed, revoked, orphaned = (
        struct.unpack_from("<Q", raw, off)[0]
        for off in (OFF_HEAD, OFF_TAIL, OFF_TOMBSTONES, OFF_FREED, OFF_REVOKED, OFF_ORPHANED)
    )
    counts = {s.name.lower(): 0 for s in SlotState}
    slots: list[dict[str, Any]] = []
    stamps = []
    for i in range(layout.slot_count):
        (word,) = struct.unpack_from("<Q", raw, STAMPS_OFFSET + 8 * i)
        pos, state, holder = unpack_stamp(word)
        counts[state.name.lower()] += 1
        stamps.append((i, pos, state, holder))
    if with_slots:
        ops = [(READ, layout.payload_offset(pos), pl.HEADER_SIZE) for _, pos, _, _ in stamps]
        headers = verbs.batch(ops) if ops else []
        for (i, pos, state, holder), head_bytes in zip(stamps, headers, strict=True):
            row: dict[str, Any] = {
                "slot": i,
                "position": pos,
                "state": state.name.lower(),
                "holder": holder or None,
                "payload_bytes": None,
                "summary": "",
            }
            if state == SlotState.PUBLISHED or state == SlotState.ORPHANED:
                length = pl.peek(head_bytes)[0]
                row["payload_bytes"] = length
                size = min(pl.HEADER_SIZE + length, layout.slot_size)
                data = verbs.read(layout.payload_offset(pos), size)
                try:
                    row["summary"] = _summary(pl.unframe(data, pos, ring=layout.name))
                except PayloadCorrupt as exc:
                    row["summary"] = f"CORRUPT: {exc}"
            slots.append(row)
    out: dict[str, Any] = {
        "ring": layout.name,
        "slot_count": layout.slot_count,
        "slot_size": layout.slot_size,
        "head": head,
        "tail": tail,
        "depth": max(tail - head, 0),
        "waiting": max(head - tail, 0),
        "published": counts["published"] + counts["orphaned"],
        "orphaned": counts["orphaned"],
        "claimed": counts["claimed_push"] + counts["claimed_pop"],
        "claimed_push": counts["claimed_push"],
        "claimed_pop": counts["claimed_pop"],
        "tombstones": counts["tombstone"],
        "repairs": {
            "tombstoned": tomb,
            "freed": freed,
            "peers_revoked": revoked,
            "orphaned": orphaned,
        },
    }
    if with_slots:
        out["slots"] = slots
    return out


def _table(snaps: list[dict[str, Any]], with_slots: bool) -> str:
    cols = [
        ("ring", "ring"),
        ("slots", "slot_count"),
        ("slot_size", "slot_size"),
        ("head", "head"),
        ("tail", "tail"),
        ("depth", "depth"),
        ("published", "published"),
        ("claimed", "claimed"),
        ("tombstones", "tombstones"),
    ]
    rows = [[name for name, _ in cols] + ["repairs (tomb/freed/revoked/orphaned)"]]
    for s in snaps:
        if "error" in s:
            rows.append([s["ring"], f"unreachable: {s['error']}"])
            continue
        r = s["repairs"]
        rows.append(
            [str(s[key]) for _, key in cols]
            + [f"{r['tombstoned']}/{r['freed']}/{r['peers_revoked']}/{r['orphaned']}"]
        )
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    if with_slots:
        for s in snaps:
            if "slots" not in s:
                continue
            lines.append("")
            lines.append(f"[{s['ring']}]  slot  position  state         holder  bytes  summary")
            for row in s["slots"]:
                lines.append(
                    f"  {row['slot']:>10}  {row['position']:>8}  {row['state']:<12}  "
                    f"{row['holder'] or '-':>6}  {row['payload_bytes'] or '-':>5}  "
                    f"{row['summary']}"
                )
    return "\n".join(lines)


def inspect_rings(
    hosts: Mapping[str, str], ports: Mapping[str, int], token: str, with_slots: bool
) -> list[dict[str, Any]]:
    """A snapshot of each ring (or the error that kept it from being read), in ring order."""
    snaps = []
    for ring in RING_NAMES:
        try:
            with connect(
                "tcp",
                hosts[ring],
                ports[ring],
                layout=None,
                ring=ring,
                token=token,
                role="inspect",
                timeout=5.0,
            ) as verbs:
                snaps.append(snapshot(verbs, with_slots))
        except DiffringError as exc:
            snaps.append({"ring": ring, "error": str(exc)})
    return snaps


def main(
    argv: list[str] | None = None,
    *,
    hosts: Mapping[str, str] | None = None,
    ports: Mapping[str, int] | None = None,
    token: str | None = None,
    prog: str = "python -m rings inspect",
) -> int:
    """The command; ``hosts``, ``ports`` and ``token`` are the defaults its flags override
    (a caller that read them from a service's configuration passes them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" in argv:
        print("python -m rings inspect reads no service configuration (the rings know no "
              "services): run `diffring inspect --config FILE`, or give --controller, "
              "--<ring>-port and --token", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--controller", default=None,
                        help=f"address of every ring (default {DEFAULT_HOST})")
    for ring in RING_NAMES:
        parser.add_argument(f"--{ring}-port", type=int, default=None)
    parser.add_argument("--token", default=None, help="cluster token (or DIFFRING_CLUSTER_TOKEN)")
    parser.add_argument("--slots", action="store_true", help="a row per slot")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS")
    args = parser.parse_args(argv)

    where = dict(hosts or dict.fromkeys(RING_NAMES, DEFAULT_HOST))
    if args.controller:
        where = dict.fromkeys(RING_NAMES, args.controller)
    at = dict(ports or DEFAULT_PORTS)
    for ring in RING_NAMES:
        override = getattr(args, f"{ring}_port")
        if override is not None:
            at[ring] = override
    secret = args.token or token or os.environ.get("DIFFRING_CLUSTER_TOKEN")
    if not secret:
        print("no cluster token: pass --token, set DIFFRING_CLUSTER_TOKEN, or run "
              "`diffring inspect [--config FILE]`, which uses the services' token (and their "
              "development default)", file=sys.stderr)
        return 2
    while True:
        snaps = inspect_rings(where, at, secret, args.slots)
        if args.json:
            print(json.dumps(snaps, indent=2))
        else:
            if args.watch:
                print("\x1b[2J\x1b[H" + time.strftime("%H:%M:%S"))
            print(_table(snaps, args.slots))
        sys.stdout.flush()
        if not args.watch:
            return 1 if all("error" in s for s in snaps) else 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
