"""Tests of the tensor plane (tensorplane: engine, pool, descriptors, handoff).

Unit tests run in-process; the integration tests start a producer process
(``tests/support/producer.py``) that stages tensors in its pool and prints their descriptors
as JSON; the test process pulls them over Mooncake TCP on 127.0.0.1. Every process a test
starts is stopped by pid in a ``finally``. The protocol's checks that need no second
process: tests/unit/test_handoff.py (an in-process transport).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch

from tensorplane.descriptor import TensorDescriptor, checksum
from tensorplane.engine import MooncakeSettings, TransferEngine, rdma_devices
from tensorplane.errors import (
    DescriptorError,
    MooncakeConfigError,
    PoolExhausted,
    RequestTooLarge,
    TransferFailed,
)
from tensorplane.handoff import pull_tensors, stage_tensors
from tensorplane.pool import ALIGN, StagingPool
from tests.support.paths import ROOT
from tests.support.producer import IMAGE_BYTES, Producer, make_tensors

pytestmark = pytest.mark.integration  # starts processes or servers


@pytest.fixture
def producer() -> Iterator[Producer]:
    p = Producer(seed=7)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    torch.set_num_threads(1)
    # A short deadline so the wedged-peer test is quick; real workers use the default 10 s.
    eng = TransferEngine(MooncakeSettings(protocol="tcp"), timeout_s=2.0)
    eng.start()
    try:
        yield eng
    finally:
        eng.close()


@pytest.fixture
def pool(engine: TransferEngine) -> Iterator[StagingPool]:
    p = StagingPool(8 << 20)
    p.start(engine)
    try:
        yield p
    finally:
        p.close()


# ----------------------------------------------------------------------------- settings
def test_env_overrides_file_and_file_overrides_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"local_hostname": "10.0.0.5", "protocol": "rdma",
                               "metadata_server": "etcd://10.0.0.1:2379"}))
    env = {"MOONCAKE_CONFIG_PATH": str(cfg), "MOONCAKE_PROTOCOL": "tcp",
           "MOONCAKE_DEVICE_NAME": ""}  # empty variable counts as unset
    s = MooncakeSettings.resolve(None, env)
    assert s == MooncakeSettings(local_hostname="10.0.0.5", protocol="tcp",
                                 metadata_server="etcd://10.0.0.1:2379", device_name="")
    # An explicit path is used instead of MOONCAKE_CONFIG_PATH.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"local_hostname": "10.0.0.9"}))
    assert MooncakeSettings.resolve(str(other), env).local_hostname == "10.0.0.9"


def test_overrides_beat_env_and_none_means_not_given() -> None:
    env = {"MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_LOCAL_HOSTNAME": "10.1.1.1"}
    s = MooncakeSettings.resolve(None, env, {"local_hostname": "10.2.2.2", "protocol": None})
    assert (s.local_hostname, s.protocol, s.metadata_server) == ("10.2.2.2", "tcp",
                                                                "P2PHANDSHAKE")


def test_unknown_keys_and_bad_values_are_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"protocol": "tcp", "master_server_address": "x:1"}))
    with pytest.raises(MooncakeConfigError, match="master_server_address"):
        MooncakeSettings.resolve(str(cfg), {})
    with pytest.raises(MooncakeConfigError, match="protcol"):
        MooncakeSettings.resolve(None, {}, {"protcol": "tcp"})
    with pytest.raises(MooncakeConfigError, match="bad protocol 'udp'"):
        MooncakeSettings.resolve(None, {"MOONCAKE_PROTOCOL": "udp"})
    with pytest.raises(MooncakeConfigError, match="cannot read"):
        MooncakeSettings.resolve(str(tmp_path / "missing.json"), {})


def test_auto_protocol(tmp_path: Path) -> None:
    # On the CPU machines (no RDMA device) auto resolves to tcp.
    assert MooncakeSettings.resolve(None, {}).protocol == ("rdma" if rdma_devices() else "tcp")
    fake = tmp_path / "infiniband"
    fake.mkdir()
    assert MooncakeSettings.resolve(None, {}, infiniband_dir=str(fake)).protocol == "tcp"
    (fake / "mlx5_0").mkdir()
    assert MooncakeSettings.resolve(None, {}, infiniband_dir=str(fake)).protocol == "rdma"
    # An explicit choice is kept even when a device exists.
    s = MooncakeSettings.resolve(None, {"MOONCAKE_PROTOCOL": "tcp"}, infiniband_dir=str(fake))
    assert s.protocol == "tcp"


# --------------------------------------------------------------------------- descriptors
def test_descriptor_msgpack_roundtrip_and_strictness() -> None:
    d = TensorDescriptor("x", "127.0.0.1:1", 4096, 24, "bfloat16", (3, 4), 123, 8192, 2**60)
    wire = msgpack.packb(d.to_dict())
    assert TensorDescriptor.from_dict(msgpack.unpackb(wire)) == d
    with pytest.raises(DescriptorError, match=r"unknown descriptor key.*extra"):
        TensorDescriptor.from_dict({**d.to_dict(), "extra": 1})
    with pytest.raises(DescriptorError, match=r"missing descriptor key.*checksum"):
        TensorDescriptor.from_dict({k: v for k, v in d.to_dict().items() if k != "checksum"})
    with pytest.raises(DescriptorError, match="nbytes 20"):
        replace(d, nbytes=20)
    with pytest.raises(DescriptorError, match="dtype"):
        replace(d, dtype="complex64")


# --------------------------------------------------------------------------------- pool
def test_pool_backpressure_and_too_large(engine: TransferEngine) -> None:
    pool = StagingPool(64 * 1024)
    pool.start(engine)
    try:
        a = pool.alloc(40_000, timeout=1)  # rounds up to 40 KiB
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted) as exc:
            pool.alloc(32 * 1024, timeout=0.3, task_id="t-bp")
        assert 0.25 < time.monotonic() - t0 < 30  # it waited its 0.3 s, then gave up
        assert exc.value.requested == 32 * 1024 and exc.value.free_bytes == 24 * 1024
        assert "32768 bytes requested, 24576 free" in str(exc.value) and "t-bp" in str(exc.value)
        t0 = time.monotonic()
        with pytest.raises(RequestTooLarge, match="exceeds the whole pool"):
            pool.alloc(65 * 1024, timeout=120)
        assert time.monotonic() - t0 < 60  # refused at once, not after its 120 s
        # A waiting alloc proceeds as soon as space is freed.
        threading.Timer(0.2, pool.free, args=(a,)).start()
        b = pool.alloc(64 * 1024, timeout=60)
        assert b.offset == 0 and pool.stats().free_bytes == 0
        assert pool.free(b) and not pool.free(b)  # a second free is a no-op
        assert pool.stats().alloc_timeouts == 1
    finally:
        pool.close()


def test_pool_first_fit_coalesces(engine: TransferEngine) -> None:
    pool = StagingPool(16 * ALIGN, max_blocks=4)
    pool.start(engine)
    try:
        blocks = [pool.alloc(4 * ALIGN, timeout=0) for _ in range(4)]
        assert [b.offset for b in blocks] == [0, 4 * ALIGN, 8 * ALIGN, 12 * ALIGN]
        assert all(pool.addr(b) % ALIGN == 0 for b in blocks)
        assert pool.try_alloc(1) is None
        pool.free(blocks[1])
        pool.free(blocks[2])
        assert pool.alloc(8 * ALIGN, timeout=0).offset == 4 * ALIGN  # neighbours merged
        assert len({b.token for b in blocks}) == 4  # a generation per allocation
    finally:
        pool.close()


def _wsum64_reference(data: bytes) -> int:
    """The wsum64 definition, written plainly: it pins what CPU and GPU must both compute."""
    a = b = 0
    for i in range(0, len(data), 2):
        x = int.from_bytes(data[i : i + 2], "little")  # a lone last byte is its own word
        a += x
        b += x * ((i // 2) % 65521 + 1)
    return ((b % 2**32) << 32) | (a % 2**32)


def test_checksums() -> None:
    data = torch.randint(0, 256, (200_001,), generator=torch.Generator().manual_seed(1),
                         dtype=torch.uint8)
    assert checksum(data, "wsum64") == _wsum64_reference(bytes(data.numpy()))
    assert checksum(data[1:], "wsum64") == _wsum64_reference(bytes(data[1:].numpy()))
    assert checksum(data, "crc32") == __import__("zlib").crc32(bytes(data.numpy()))
    # Host buffers hash to the same values without torch (numpy for wsum64, zlib for crc32).
    for algo in ("crc32", "wsum64"):
        assert checksum(memoryview(bytes(data.numpy())), algo) == checksum(data, algo)
        assert checksum(bytes(data[1:].numpy()), algo) == checksum(data[1:], algo)
    flipped = data.clone()
    flipped[12345] ^= 0x10
    swapped = data.clone()
    swapped[0:2], swapped[2:4] = data[2:4].clone(), data[0:2].clone()
    for algo in ("crc32", "wsum64"):
        assert checksum(flipped, algo) != checksum(data, algo)
        if not torch.equal(swapped, data):
            assert checksum(swapped, algo) != checksum(data, algo)


def test_wsum64_pool_stage_and_pull_in_process(engine: TransferEngine, pool: StagingPool) -> None:
    # A GPU producer pool hashes with wsum64; a host consumer must verify that too.
    gpu_like = StagingPool(1 << 20, checksum_algo="wsum64")
    gpu_like.start(engine)
    try:
        src = {"lat": torch.randn(3, 5, 7).to(torch.bfloat16), "odd": torch.arange(5).byte()}
        descs = stage_tensors(gpu_like, engine, src, task_id="t-w")
        assert {d.checksum_algo for d in descs} == {"wsum64"}
        got = pull_tensors(engine, pool, descs, task_id="t-w")
        assert all(torch.equal(got[k], v) for k, v in src.items())
        assert gpu_like.stats().live_blocks == 0  # released through the loopback segment
    finally:
        gpu_like.close()


def test_numpy_arrays_stage_and_pull_without_torch_tensors(
    engine: TransferEngine, pool: StagingPool
) -> None:
    """numpy arrays in, numpy arrays (or torch tensors) out, through host pools; either
    checksum. bfloat16 has no numpy dtype, so pulling it as numpy is refused by name."""
    import numpy as np

    rng = np.random.default_rng(3)
    src = {
        "f32": rng.standard_normal((17, 9), dtype=np.float32),
        "f16": rng.standard_normal(33).astype(np.float16),
        "i64": rng.integers(-(2**62), 2**62, 100, dtype=np.int64),
        "u8_odd": rng.integers(0, 256, 4097, dtype=np.uint8),
        "strided": rng.standard_normal((6, 8), dtype=np.float32).T,  # not contiguous
        "empty": np.zeros((0, 3), dtype=np.int32),
    }
    wsum = StagingPool(1 << 20, checksum_algo="wsum64")
    wsum.start(engine)
    try:
        for producer in (pool, wsum):
            descs = stage_tensors(producer, engine, src, task_id="t-np")
            assert {d.checksum_algo for d in descs} == {producer.checksum_algo}
            got = pull_tensors(engine, pool, descs, task_id="t-np", arrays="numpy",
                               release=False)
            for name, want in src.items():
                assert isinstance(got[name], np.ndarray) and got[name].dtype == want.dtype
                assert np.array_equal(got[name], want), name
            as_torch = pull_tensors(engine, pool, descs, task_id="t-np")
            assert torch.equal(as_torch["i64"], torch.from_numpy(src["i64"]))
            assert producer.stats().live_blocks == 0
        bf16 = stage_tensors(pool, engine, {"b": torch.ones(3, dtype=torch.bfloat16)})
        with pytest.raises(DescriptorError, match="bfloat16 has no numpy dtype"):
            pull_tensors(engine, pool, bf16, arrays="numpy")
        pool.free_staged(bf16)
    finally:
        wsum.close()


def test_host_tensor_plane_never_imports_torch() -> None:
    """A process that moves numpy arrays between host pools (a synthetic worker) stays
    torch-free: importing the tensor plane, its pool, staging and pulling."""
    code = """
import sys
import numpy as np
from tensorplane.engine import MooncakeSettings, TransferEngine
from tensorplane.handoff import pull_tensors, stage_bytes, stage_tensors
from tensorplane.pool import StagingPool
engine = TransferEngine(MooncakeSettings(protocol="tcp"))
engine.start()
a, b = StagingPool(1 << 20), StagingPool(1 << 20)
a.start(engine)
b.start(engine)
x = np.arange(1000, dtype=np.float32)
descs = stage_tensors(a, engine, {"x": x}) + [stage_bytes(a, engine, "img", b"png!")]
got = pull_tensors(engine, b, descs, arrays="numpy")
assert np.array_equal(got["x"], x) and got["img"].tobytes() == b"png!"
assert a.stats().live_blocks == 0
assert "torch" not in sys.modules, "torch was imported"
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(ROOT), timeout=120)
    assert out.stdout.strip().endswith("OK"), out.stderr[-3000:]


# -------------------------------------------------------------------- two-process pulls
@pytest.mark.timeout(180)  # with the producer process starting on a loaded machine
def test_pull_between_processes_and_release(
    producer: Producer, engine: TransferEngine, pool: StagingPool
) -> None:
    expected = make_tensors(7)
    assert producer.ask("stats")["live_blocks"] == len(expected) + 1
    got = pull_tensors(engine, pool, producer.descs, task_id="t-1")
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name
    assert got["bf16"].element_size() == 2
    assert bytes(got["image"].numpy()) == IMAGE_BYTES
    assert pool.stats().used_bytes == 0
    after = producer.ask("stats")  # the producer reclaims on its own; it was never told
    assert after["live_blocks"] == 0 and after["used_bytes"] == 0
    assert after["remote_releases"] == len(producer.descs)
    # Stale releases (old tokens) do not free newer allocations in the same slots.
    fresh = [TensorDescriptor.from_dict(d) for d in producer.ask("stage")["descs"]]
    assert {d.release_addr for d in fresh} == {d.release_addr for d in producer.descs}
    assert pool.release_producers(engine, producer.descs) == 0
    assert producer.ask("stats")["live_blocks"] == len(fresh)
    got = pull_tensors(engine, pool, fresh, task_id="t-2")
    assert torch.equal(got["big"], expected["big"])
    assert producer.ask("stats")["live_blocks"] == 0


@pytest.mark.timeout(180)  # with the producer process starting on a loaded machine
def test_dead_producer_fails_fast(
    producer: Producer, engine: TransferEngine, pool: StagingPool
) -> None:
    producer.kill(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed) as exc:
        pull_tensors(engine, pool, producer.descs, task_id="t-dead")
    assert time.monotonic() - t0 < 30
    assert exc.value.peer == producer.session and exc.value.task_id == "t-dead"
    assert "task t-dead" in str(exc.value) and "'f32'" in str(exc.value)
    assert pool.stats().used_bytes == 0


@pytest.mark.timeout(180)  # with the producer process starting on a loaded machine
def test_wedged_producer_is_bounded_and_block_quarantined(
    producer: Producer, engine: TransferEngine, pool: StagingPool
) -> None:
    # A stopped process keeps its sockets open: Mooncake alone would block 30-60 s here.
    producer.kill(signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed) as exc:
        pull_tensors(engine, pool, producer.descs, task_id="t-wedged")
    # Its own 2 s deadline, not Mooncake's 30-60 s (generous: the machine may be loaded).
    assert time.monotonic() - t0 < 25
    assert exc.value.timed_out and exc.value.pending is not None
    # Mooncake may still write into the local block: it stays out of circulation ...
    assert pool.stats().quarantined_blocks == 1 and pool.stats().used_bytes > 0
    producer.kill(signal.SIGKILL)
    deadline = time.monotonic() + 20
    while pool.stats().used_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    # ... until the call inside Mooncake returns (the peer's death ends it).
    assert pool.stats().used_bytes == 0 and pool.stats().quarantined_blocks == 0
    assert engine.abandoned_calls == 0

