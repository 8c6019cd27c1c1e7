"""The typed control wire (contracts/messages.py): one struct per op, encoded and decoded in
one place, checked on decode, and a handshake that refuses a peer of another version."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from contracts import messages
from contracts.errors import DiffringError
from contracts.messages import (
    OP,
    BadMessage,
    Checkpoint,
    Claim,
    Complete,
    Dropped,
    Endpoint,
    FusedAdapter,
    Heartbeat,
    HeartbeatReply,
    Op,
    Preflight,
    Register,
    StorageReport,
    Wait,
)
from controller.control import ControlServer
from tests.support.controller import TOKEN
from tests.support.coordinators import make_coordinator
from workers.control import ControlClient

EXAMPLES: list[Any] = [
    Preflight(role="transformer", name="w", endpoints=[Endpoint(what="seg", host="h", port=1)]),
    Register(role="transformer", name="w", pid=1, pipeline="wan_t2v", segment="s",
             loras=["a"], caches=["first_block_cache"],
             fused=[FusedAdapter(name="d", strength=0.5)], recipe="r", checkpoints=True),
    Heartbeat(tasks=["t"], staged=[("t", 2)], storage=StorageReport(error="full", held=1,
                                                                    since=2.5),
              stats={"resident_bytes": 1.0}),
    Claim(task_id="t", attempt=1),
    Checkpoint(task_id="t", attempt=1, step=2, steps=4, final=False, meta={"k": [1, 2]},
               state=[{"name": "latents"}], phase1=None),
    Complete(task_id="t", attempt=1, extension="png", media_type="image/png",
             data=b"\x89PNG\x00"),
    Dropped(ring="phase1", reason="corrupt", slot=3),
    Wait(ring="request", timeout_s=2.5, ticket=7),
]


def test_every_op_has_one_message_type() -> None:
    assert set(OP.values()) == set(Op) and len(OP) == len(Op)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_through_their_map(msg: Any) -> None:
    wire = messages.encode(msg)
    assert wire["op"] == OP[type(msg)].value
    assert messages.decode({**wire, "seq": 9}) == msg  # the frame's seq is not a field


def test_decode_refuses_what_is_not_a_message_naming_the_field() -> None:
    for data, says in [
        ({"op": "claim", "task_id": "t", "attempt": "1"}, "$.attempt"),
        ({"op": "claim", "task_id": "t"}, "attempt"),
        ({"op": "claim", "task_id": "t", "attempt": True}, "$.attempt"),
        ({"op": "heartbeat", "staged": [["t"]]}, "$.staged"),
        ({"op": "teleport"}, "$.op"),
        ({"task_id": "t"}, "op"),
    ]:
        with pytest.raises(BadMessage) as bad:
            messages.decode(data)
        assert says in str(bad.value), (data, str(bad.value))


def test_a_newer_peers_extra_field_is_ignored_and_defaults_fill_in() -> None:
    msg = messages.decode({"op": "heartbeat", "tasks": ["t"], "a_field_of_tomorrow": 1})
    assert msg == Heartbeat(tasks=["t"])
    reply = messages.decode_reply({"seq": 1, "ok": True, "yield": ["t"]}, HeartbeatReply)
    assert reply.yield_ == ["t"] and reply.cancel == [] and reply.drop_staged == []


def test_a_worker_of_another_control_version_is_refused(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The handshake carries CONTROL_VERSION and the controller checks it, before any
    message: a worker of another build is told so instead of being misread."""
    import workers.control

    co = make_coordinator(None, None)

    async def scenario() -> str:
        server = ControlServer(co, "127.0.0.1", 0, TOKEN)
        await server.start()
        try:
            client = ControlClient("127.0.0.1", server.port, TOKEN, timeout=10)
            monkeypatch.setattr(workers.control, "CONTROL_VERSION", messages.CONTROL_VERSION - 1)
            with pytest.raises(DiffringError) as refused:
                await asyncio.to_thread(client.connect, "encoder")
            monkeypatch.undo()
            await asyncio.to_thread(client.connect, "encoder")  # this build's is let in
            client.close()
            return str(refused.value)
        finally:
            await server.close()

    said = asyncio.run(scenario())
    assert f"speaks control version {messages.CONTROL_VERSION - 1}" in said
    assert "same build of diffring" in said
