"""Window 8 of the ownership argument (controller.ownership.coordinator), in this process: denoising
checkpoints kept by the controller from the lease holder only, the route of a task that has
one (resume item, or kept final latents for the decoder), zombies, yields, restarts, the
bound. An in-process transport (FakeTransport, tests/support/fakes.py) moves the tensors
between a "DiT" pool and the controller's store, as Mooncake does between processes; rings
are in-process; time is the test's clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from contracts import faults, messages
from contracts.messages import Checkpoint as CheckpointMsg
from contracts.messages import Fault
from controller.config import CoordinatorConfig
from controller.ownership.coordinator import Coordinator
from controller.ownership.reconcile import census
from controller.ownership.registry import WorkerInfo
from controller.tasks.checkpoints import CheckpointStore
from controller.tasks.table import open_table
from controller.tasks.tasks import Stage, Task
from tensorplane.descriptor import TensorDescriptor
from tensorplane.handoff import pull_tensors, stage_tensors
from tensorplane.pool import StagingPool
from tests.support.coordinators import Clock, Rings, complete, coordinators
from tests.support.fakes import FakeTransport
from workers.models.loop_state import LoopState, from_wire, to_wire

PIPE = "qwen_t2i"
PROMPT = np.arange(4096, dtype=np.float32).reshape(1, 64, 64)


@pytest.fixture
def engine() -> Iterator[FakeTransport]:
    eng = FakeTransport()
    try:
        yield eng
    finally:
        eng.close()


@pytest.fixture
def dit_pool(engine: FakeTransport) -> Iterator[StagingPool]:
    pool = StagingPool(4 << 20)
    pool.start(engine)
    try:
        yield pool
    finally:
        pool.close()


class Setup:
    def __init__(self, tmp: Path, engine: FakeTransport, store_mb: int = 2) -> None:
        self.rings = Rings()
        self.clock = Clock()
        self.engine = engine
        self.pool = StagingPool(store_mb << 20)
        self.pool.start(engine)
        self.store = CheckpointStore(engine, self.pool, tmp / ".journal" / "checkpoints")
        self.co = Coordinator(
            CoordinatorConfig(pipeline=PIPE, output_dir=tmp, lease_timeout_s=10.0),
            open_table(tmp / ".journal"), self.rings.local["request"],
            census=lambda: census(self.rings.local), checkpoints=self.store,
            rings=self.rings.local, clock=self.clock)
        coordinators.append(self.co)
        self.enc = self.co.on_register("encoder", "e", 1, PIPE, "s1")
        self.dit = self.co.on_register("transformer", "t", 2, PIPE, "s2", checkpoints=True)
        self.dec = self.co.on_register("decoder", "d", 3, PIPE, "s3")

    def close(self) -> None:
        self.co.close()
        self.pool.close()

    def submit(self, tid: str) -> Task:
        t = Task(task_id=tid, kind="image", pipeline=PIPE,
                 request={"task": PIPE, "prompt": "x"}, save_result_path="")
        self.co.submit(t)
        return t

    def to_dit(self, tid: str, attempt: int = 1, dit: WorkerInfo | None = None) -> None:
        if attempt == 1:
            assert self.rings.peer("request").try_pop() is not None
            assert self.co.on_claim(self.enc, tid, 1)[0]
            self.co.on_handoff(self.enc, tid, 1)
        assert self.co.on_claim(dit or self.dit, tid, attempt)[0]


def latents(step: int) -> np.ndarray:
    return np.full((1, 16, 8, 8), float(step), dtype=np.float32)


def staged(s: Setup, pool: StagingPool, tid: str, attempt: int, step: int, *,
           phase1: bool = True, final: bool = False
           ) -> tuple[CheckpointMsg, list[TensorDescriptor]]:
    """What a DiT's Sender stages for a checkpoint: the ``checkpoint`` message, and what it
    frees once answered."""
    state = LoopState(step, 4, {"latents": latents(step)},
                      {"_step_index": step, "timesteps": np.arange(4, dtype=np.int64)})
    tensors, meta = to_wire(state)
    descs = stage_tensors(pool, s.engine, tensors, task_id=tid)
    descs1 = stage_tensors(pool, s.engine, {"prompt_embeds": PROMPT}, task_id=tid) \
        if phase1 else []
    msg = CheckpointMsg(task_id=tid, attempt=attempt, step=step, steps=4, final=final,
                        meta=meta, state=[d.to_dict() for d in descs],
                        phase1=[d.to_dict() for d in descs1] if phase1 else None)
    return msg, [*descs, *descs1]


def checkpoint(s: Setup, pool: StagingPool, worker: WorkerInfo, tid: str, attempt: int,
               step: int, *, phase1: bool = True, final: bool = False) -> dict[str, Any]:
    """What a DiT's Sender does: stage, send ``checkpoint``, free what was not pulled."""
    msg, descs = staged(s, pool, tid, attempt, step, phase1=phase1, final=final)
    try:
        return messages.encode(asyncio.run(s.co.on_checkpoint(worker, msg)))
    finally:
        pool.free_staged(descs)


def resumed_state(s: Setup, worker: WorkerInfo, tid: str, attempt: int
                  ) -> tuple[dict[str, Any], LoopState]:
    reply = s.co.on_resume(worker, tid, attempt)
    pool = StagingPool(1 << 20)
    pool.start(s.engine)
    try:
        descs = [TensorDescriptor.from_dict(d) for d in reply["state"]]
        assert all(d.release_token == 0 for d in descs)  # consumers never free kept blocks
        inputs = pull_tensors(s.engine, pool, [TensorDescriptor.from_dict(d)
                                               for d in reply["phase1"]], arrays="numpy")
        tensors = pull_tensors(s.engine, pool, descs, arrays="numpy")
    finally:
        pool.close()
    return inputs, from_wire(reply["step"], reply["steps"], tensors, reply["meta"], "cpu")


@pytest.fixture
def setup(tmp_path: Path, engine: FakeTransport) -> Iterator[Setup]:
    s = Setup(tmp_path, engine)
    try:
        yield s
    finally:
        s.close()


def test_kept_from_the_lease_holder_only_and_resumed_anywhere(
        setup: Setup, dit_pool: StagingPool) -> None:
    s = setup
    t = s.submit("a")
    s.to_dit("a")
    other = s.co.on_register("transformer", "t2", 4, PIPE, "s4", checkpoints=True)
    assert checkpoint(s, dit_pool, other, "a", 1, 1)["accepted"] is False  # not its lease
    assert checkpoint(s, dit_pool, s.dit, "a", 1, 2) == {"accepted": True}
    assert checkpoint(s, dit_pool, s.dit, "a", 1, 3, phase1=False) == {"accepted": True}
    assert t.checkpoint_step == 3 and s.store.get("a").step == 3  # type: ignore[union-attr]
    assert dit_pool.stats().used_bytes == 0  # the controller's reads released the DiT's blocks
    # The DiT dies: the task is back in play from its checkpoint, not from the encoder.
    s.co.on_gone(s.dit, "killed")
    assert (t.attempt, t.stage, t.resumed_from, t.resumes, t.failures) == (
        2, Stage.PHASE1, 3, 1, 0)
    assert s.rings.peer("request").try_pop() is None
    item = s.rings.peer("phase1").try_pop()
    assert item is not None and item["resume"] == {"step": 3, "steps": 4}
    assert item["tensors"] == [] and item["attempt"] == 2
    s.to_dit("a", 2, other)
    inputs, state = resumed_state(s, other, "a", 2)
    assert inputs["prompt_embeds"].tobytes() == PROMPT.tobytes()
    assert state.step == 3 and state.tensors["latents"].tobytes() == latents(3).tobytes()
    assert state.scheduler["_step_index"] == 3
    # The zombie: the old DiT's late checkpoint and resume are refused, nothing replaced.
    zombie = s.co.on_register("transformer", "t", 2, PIPE, "s2", checkpoints=True)
    assert checkpoint(s, dit_pool, zombie, "a", 1, 4)["accepted"] is False
    with pytest.raises(Exception, match="not"):
        s.co.on_resume(zombie, "a", 1)
    assert s.store.get("a").step == 3  # type: ignore[union-attr]


def test_checkpoint_in_flight_when_the_attempt_ends_is_discarded(
        setup: Setup, dit_pool: StagingPool) -> None:
    s = setup
    t = s.submit("b")
    s.to_dit("b")
    assert checkpoint(s, dit_pool, s.dit, "b", 1, 1)["accepted"]
    real_pull = s.store.pull

    async def slow_pull(*args: Any, **kwargs: Any) -> Any:
        got = await real_pull(*args, **kwargs)
        s.clock.advance(11.0)  # the lease ran out while the controller pulled
        s.co.sweep(s.clock())
        return got

    s.store.pull = slow_pull  # type: ignore[method-assign]
    assert checkpoint(s, dit_pool, s.dit, "b", 1, 2, phase1=False)["accepted"] is False
    assert t.attempt == 2 and s.store.get("b").step == 1  # type: ignore[union-attr]
    assert t.resumed_from == 1


def test_a_wedged_pull_holds_up_only_its_own_worker_and_a_gone_one_is_not_released(
        setup: Setup, engine: FakeTransport, tmp_path: Path) -> None:
    """DiT A's checkpoint is held in its pull, its tensors read and its release writes not yet
    sent (fault point ``keep.release``, ``hold``): DiT B's checkpoint is kept meanwhile, in
    its own lane. A is then gone: its task is back in play, and when its pull goes on, the
    release writes it had left are dropped (A's memory went with it) and what it read is
    freed, nothing kept of it."""
    s = setup
    a_pool, b_pool = StagingPool(1 << 20), StagingPool(1 << 20)
    for pool in (a_pool, b_pool):
        pool.start(engine)
    t = s.submit("wa")
    s.to_dit("wa")
    b = s.co.on_register("transformer", "tb", 5, PIPE, "s5", checkpoints=True)
    s.submit("wb")
    s.to_dit("wb", 1, b)
    gate = tmp_path / "release-gate"
    gate.touch()
    faults.configure(f"keep.release:hold={gate}:nth=1")
    try:
        async def scenario() -> tuple[dict[str, Any], int, int]:
            msg_a, descs_a = staged(s, a_pool, "wa", 1, 1)
            held = asyncio.ensure_future(s.co.on_checkpoint(s.dit, msg_a))
            await until(lambda: faults.fired().get("keep.release") == 1)
            msg_b, descs_b = staged(s, b_pool, "wb", 1, 1)
            # B's pull is not queued behind A's (one lane each): kept while A is held.
            assert messages.encode(await asyncio.wait_for(s.co.on_checkpoint(b, msg_b), 30)) \
                == {"accepted": True}
            b_released = b_pool.stats().remote_releases
            assert b_released == sum(bool(d.release_token) for d in descs_b) > 0
            b_pool.free_staged(descs_b)
            assert not held.done()
            s.co.on_gone(s.dit, "control connection dropped")
            assert (t.attempt, t.worker_id) == (2, None)  # back in play, A's pull still held
            gate.unlink()
            reply = await asyncio.wait_for(held, 30)
            a_released = a_pool.stats().remote_releases
            a_pool.free_staged(descs_a)
            return reply, a_released, b_released
        reply, a_released, b_released = asyncio.run(scenario())
    finally:
        gate.unlink(missing_ok=True)  # a held pull never outlives the test
        faults.configure(None)
        for pool in (a_pool, b_pool):
            pool.close()
    assert messages.encode(reply) == {"accepted": False,
                                      "reason": "attempt 1 ended meanwhile"}, reply
    assert a_released == 0  # A's releases dropped: none was sent
    assert s.store.get("wa") is None and s.store.get("wb").step == 1  # type: ignore[union-attr]
    s.store.flush()
    assert s.pool.stats().live_blocks == b_released  # B's kept; what A's pull read is freed


async def until(ok: Callable[[], bool], timeout: float = 60) -> None:
    """Until ``ok()``, the loop running meanwhile (a bound, not a pause)."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_decoder_lost_after_the_handoff_reruns_only_the_decoder(
        setup: Setup, dit_pool: StagingPool) -> None:
    s = setup
    t = s.submit("c")
    s.to_dit("c")
    assert checkpoint(s, dit_pool, s.dit, "c", 1, 2)["accepted"]
    # The decoder claims before the DiT's handoff message: the final latents still count.
    assert s.co.on_claim(s.dec, "c", 1)[0]
    assert checkpoint(s, dit_pool, s.dit, "c", 1, 4, phase1=False, final=True)["accepted"]
    s.co.on_handoff(s.dit, "c", 1)
    s.co.on_gone(s.dec, "killed")
    assert (t.attempt, t.stage, t.resumed_from, t.failures) == (2, Stage.PHASE2, 4, 0)
    item = s.rings.peer("phase2").try_pop()
    assert item is not None and item["producer"] == "controller"
    assert s.rings.peer("phase1").try_pop() is None and s.rings.peer("request").try_pop() is None
    pool = StagingPool(1 << 20)
    pool.start(s.engine)
    try:
        descs = [TensorDescriptor.from_dict(d) for d in item["tensors"]]
        for _ in range(2):  # kept: a second read (a second retry) finds the same bytes
            got = pull_tensors(s.engine, pool, descs, arrays="numpy")
            assert got["latents"].tobytes() == latents(4).tobytes()
    finally:
        pool.close()
    assert s.co.on_claim(s.dec, "c", 2)[0]
    assert complete(s.co, s.dec, "c", 2, b"PNG")
    assert s.store.get("c") is None and len(s.store) == 0  # dropped with the task


def test_yield_is_never_charged_and_resumes(setup: Setup, dit_pool: StagingPool) -> None:
    s = setup
    t = s.submit("d")
    s.to_dit("d")
    assert checkpoint(s, dit_pool, s.dit, "d", 1, 2)["accepted"]
    s.co.on_fail(s.dit, "d", 1, "handed back after step 2 of 4 (drain)", "yielded", True,
                 Fault.YIELDED)
    assert (t.attempt, t.stage, t.failures, t.killers, t.resumed_from) == (
        2, Stage.PHASE1, 0, [], 2)


def test_unusable_checkpoint_is_dropped_and_the_task_starts_over(
        setup: Setup, dit_pool: StagingPool) -> None:
    s = setup
    t = s.submit("e")
    s.to_dit("e")
    assert checkpoint(s, dit_pool, s.dit, "e", 1, 2)["accepted"]
    s.co.on_gone(s.dit, "killed")
    other = s.co.on_register("transformer", "t2", 4, PIPE, "s4", checkpoints=True)
    s.to_dit("e", 2, other)
    s.co.on_fail(other, "e", 2, "cannot resume", "CheckpointError", True, Fault.SYSTEM)
    assert (t.attempt, t.stage, t.failures, t.checkpoint_step) == (3, Stage.QUEUED, 0, None)
    assert s.store.get("e") is None


def test_a_full_store_refuses_and_keeps_the_older(
        tmp_path: Path, engine: FakeTransport, dit_pool: StagingPool) -> None:
    s = Setup(tmp_path, engine, store_mb=1)
    try:
        s.submit("f")
        s.to_dit("f")
        assert checkpoint(s, dit_pool, s.dit, "f", 1, 1)["accepted"]
        big = np.zeros((1, 300_000), dtype=np.float32)  # 1.2 MB: more than the store holds
        descs = stage_tensors(dit_pool, engine, {"latents": big}, task_id="f")
        msg = CheckpointMsg(task_id="f", attempt=1, step=2, steps=4, final=False,
                            meta={"tensors": {"latents": {"t": "ndarray", "k": "latents"}},
                                  "scheduler": {}},
                            state=[d.to_dict() for d in descs], phase1=None)
        reply = asyncio.run(s.co.on_checkpoint(s.dit, msg))
        dit_pool.free_staged(descs)
        assert reply.accepted is False and "cannot keep" in reply.reason
        assert s.store.get("f").step == 1 and s.store.counts["refused"] == 1  # type: ignore[union-attr]
    finally:
        s.close()


def test_a_restarted_controller_resumes_from_the_files(
        tmp_path: Path, engine: FakeTransport, dit_pool: StagingPool) -> None:
    s = Setup(tmp_path, engine)
    s.submit("g")
    s.to_dit("g")
    assert checkpoint(s, dit_pool, s.dit, "g", 1, 3)["accepted"]
    s.submit("h")  # no checkpoint: starts over
    s.close()  # the controller goes (its file writes finish)
    folder = tmp_path / ".journal" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["g.phase1", "g.state"]
    again = Setup(tmp_path, engine)
    try:
        assert again.co.restore() == 2
        g, h = again.co.table.get("g"), again.co.table.get("h")
        assert g is not None and h is not None
        assert (g.stage, g.attempt, g.resumed_from) == (Stage.PHASE1, 2, 3)
        assert h.stage == Stage.QUEUED
        again.to_dit("g", 2)
        inputs, state = resumed_state(again, again.dit, "g", 2)
        assert inputs["prompt_embeds"].tobytes() == PROMPT.tobytes()
        assert state.tensors["latents"].tobytes() == latents(3).tobytes()
        again.co.cancel(g)
        again.co.on_fail(again.dit, "g", 2, "cancelled", "cancelled", False, Fault.CANCELLED)
        again.store.flush()
        assert not list(folder.iterdir())  # removed with the task
    finally:
        again.close()


def test_store_reads_back_what_it_wrote_exactly(tmp_path: Path, engine: FakeTransport,
                                                dit_pool: StagingPool) -> None:
    """A torn or foreign file is not resumed from: the task starts over."""
    s = Setup(tmp_path, engine)
    s.submit("i")
    s.to_dit("i")
    assert checkpoint(s, dit_pool, s.dit, "i", 1, 2)["accepted"]
    s.close()
    path = tmp_path / ".journal" / "checkpoints" / "i.state"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    again = Setup(tmp_path, engine)
    try:
        t0 = time.monotonic()
        assert again.co.restore() == 1
        assert time.monotonic() - t0 < 30
        i = again.co.table.get("i")
        assert i is not None and i.stage == Stage.QUEUED and i.checkpoint_step is None
    finally:
        again.close()


def test_a_split_handover_waits_for_a_low_noise_worker(setup: Setup,
                                                       dit_pool: StagingPool) -> None:
    """``split`` (Wan2.2-A14B, experts high / low): a state whose next expert is the
    low-noise one, sent by a worker holding one expert, is no ring's: the task waits at the
    controller (no DiT can pop it) until a low-noise worker takes it, which claims it in the
    same call; a lost taker puts it back there, uncharged. The same state from a worker
    holding both experts resumes through the Phase1 ring, as before."""
    s = setup
    t = s.submit("s")
    s.to_dit("s")
    msg, descs = staged(s, dit_pool, "s", 1, 2)
    msg.meta.update(expert="low", split=True)
    assert messages.encode(asyncio.run(s.co.on_checkpoint(s.dit, msg))) == {"accepted": True}
    dit_pool.free_staged(descs)
    s.co.on_fail(s.dit, "s", 1, "handed over to the low-noise expert after step 2 of 4",
                 "handover", True, Fault.HANDOVER)
    assert (t.stage, t.attempt, t.failures) == (Stage.ACCEPTED, 2, 0)
    assert s.rings.peer("phase1").try_pop() is None  # a high-noise worker finds nothing
    assert s.rings.peer("request").try_pop() is None
    assert s.co.requeue.low_waiting() == 1
    assert t.waiting_expert == "low"  # the status says: waiting for a low-noise DiT
    high = s.co.on_register("transformer", "high", 6, PIPE, "s6", checkpoints=True,
                            experts="high")
    low = s.co.on_register("transformer", "low", 4, PIPE, "s4", checkpoints=False,
                           experts="low")
    for other in (s.enc, s.dit, high):  # an encoder, a DiT of both experts, a high-noise one
        assert s.co.on_take(other) is None
    item = s.co.on_take(low)
    assert item is not None and item["resume"] == {"step": 2, "steps": 4}
    assert (item["task_id"], item["attempt"]) == ("s", 2)
    assert (t.stage, t.worker, t.resumed_from) == (Stage.DENOISING, "low", 2)
    assert t.waiting_expert is None
    assert s.co.on_take(low) is None
    _inputs, state = resumed_state(s, low, "s", 2)
    assert state.expert == "low" and state.tensors["latents"].tobytes() == latents(2).tobytes()
    s.co.on_gone(low, "killed")  # after the take: back at the controller, uncharged
    assert (t.stage, t.attempt, t.failures) == (Stage.ACCEPTED, 3, 0)
    other = s.co.on_register("transformer", "low2", 5, PIPE, "s5", checkpoints=False,
                             experts="low")
    again = s.co.on_take(other)
    assert again is not None and again["attempt"] == 3 and t.worker == "low2"
    # Exact mode: the same state from a worker holding both experts (no split mark).
    s.submit("u")
    s.to_dit("u")
    msg, descs = staged(s, dit_pool, "u", 1, 2)
    msg.meta.update(expert="low")
    assert messages.encode(asyncio.run(s.co.on_checkpoint(s.dit, msg))) == {"accepted": True}
    dit_pool.free_staged(descs)
    s.co.on_fail(s.dit, "u", 1, "handed back (drain)", "StageYielded", True, Fault.YIELDED)
    assert s.co.on_take(other) is None
    back = s.rings.peer("phase1").try_pop()
    assert back is not None and back["task_id"] == "u" and back["resume"]["step"] == 2
    # Cancelled while it waits for a low-noise worker: nobody takes it.
    v = s.submit("v")
    s.to_dit("v")
    msg, descs = staged(s, dit_pool, "v", 1, 2)
    msg.meta.update(expert="low", split=True)
    assert messages.encode(asyncio.run(s.co.on_checkpoint(s.dit, msg))) == {"accepted": True}
    dit_pool.free_staged(descs)
    s.co.on_fail(s.dit, "v", 1, "handed over", "handover", True, Fault.HANDOVER)
    assert v.stage == Stage.ACCEPTED and s.co.cancel(v) == "success"
    assert v.stage == Stage.CANCELLED and s.co.on_take(other) is None
    assert s.co.requeue.low_waiting() == 0
