"""The stage / pull / release protocol (tensorplane/handoff.py) between a producer's pool and
a consumer's, in this process: each pool on a transport of its own (FakeTransport,
tests/support/fakes.py), as two processes each have their Mooncake engine. Mooncake itself,
between processes: tests/integration/test_transfer.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from tensorplane.descriptor import TensorDescriptor
from tensorplane.errors import ChecksumMismatch, TransferFailed
from tensorplane.handoff import pull_tensors, stage_bytes, stage_tensors
from tensorplane.pool import StagingPool
from tests.support.fakes import FakeTransport
from tests.support.producer import IMAGE_BYTES, make_tensors


class Side:
    """What one process of a hand-over has: its transport and its pool (8 MiB, as the
    producer process of test_transfer.py), and what it staged."""

    def __init__(self) -> None:
        self.transport = FakeTransport()
        self.pool = StagingPool(8 << 20)
        self.pool.start(self.transport)
        self.descs: list[TensorDescriptor] = []

    def close(self) -> None:
        self.pool.close()
        self.transport.close()


@pytest.fixture
def producer() -> Iterator[Side]:
    """A producer that staged ``make_tensors(7)`` and an image's bytes."""
    side = Side()
    try:
        side.descs = stage_tensors(side.pool, side.transport, make_tensors(7), task_id="t-prod")
        side.descs.append(stage_bytes(side.pool, side.transport, "image", IMAGE_BYTES,
                                      task_id="t-prod"))
        yield side
    finally:
        side.close()


@pytest.fixture
def consumer() -> Iterator[Side]:
    side = Side()
    try:
        yield side
    finally:
        side.close()


def test_checksum_mismatch_is_reported(producer: Side, consumer: Side) -> None:
    bad = replace(producer.descs[1], checksum=producer.descs[1].checksum ^ 1)
    with pytest.raises(ChecksumMismatch) as exc:
        pull_tensors(consumer.transport, consumer.pool, [producer.descs[0], bad],
                     task_id="t-crc")
    msg = str(exc.value)
    assert "task t-crc" in msg and "'bf16'" in msg and producer.transport.session_id in msg
    assert consumer.pool.stats().used_bytes == 0
    # Nothing is released when the pull fails: the producer's copy stays for a retry.
    assert producer.pool.stats().live_blocks == len(producer.descs)


def test_the_transport_refuses_what_mooncake_refuses(producer: Side, consumer: Side) -> None:
    """The fake is held to Mooncake's checks: registered memory on both sides, a live peer;
    a refusal names the task, tensor and peer, and the pull leaves nothing behind."""
    session = producer.transport.session_id
    nowhere = 4096  # the first page above NULL: never mapped, never registered
    with pytest.raises(TransferFailed, match="outside the peer's registered memory"):
        consumer.transport.read(session, consumer.pool.base_addr, nowhere, 8)
    with pytest.raises(TransferFailed, match=r"local 0x1000 outside registered memory"):
        consumer.transport.read(session, nowhere, producer.descs[0].address, 8)
    producer.transport.close()  # the producer process is gone
    with pytest.raises(TransferFailed) as exc:
        pull_tensors(consumer.transport, consumer.pool, producer.descs, task_id="t-dead")
    assert exc.value.peer == session and exc.value.task_id == "t-dead"
    assert "'f32'" in str(exc.value)
    assert consumer.pool.stats().used_bytes == 0
