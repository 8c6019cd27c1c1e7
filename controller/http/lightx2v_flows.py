"""LightX2V's three-POST request flow, paired into one task (no HTTP here: the edge that
serves it is :mod:`controller.http.lightx2v_edge`).

A LightX2V client posts one request three times: to the Decoder's port (and keeps the task
id it gets), to the Transformer's, then to the Encoder's, and polls the Decoder's port. Its
Wan scripts send all three the whole payload; its Qwen-Image T2I script has sent the Decoder
only ``save_result_path`` and the Transformer ``{}``. diffring makes one task of the three:

1. The Decoder POST opens a *flow* under the key its payload gives — its ``task_id`` if it
   sends one, else its ``save_result_path``, else the whole payload — and answers with the
   task id the task will have (the client's, or a new one).
2. The Transformer POST carries nothing diffring needs. An empty one is counted against the
   oldest flow waiting for it; one with a payload must match a waiting flow as the Encoder
   POST does.
3. The Encoder POST is paired with the waiting flow of its key (tried in the same order);
   every field the Decoder POST sent must have the same value in it. Its payload becomes the
   task, with the flow's task id, in the request ring like any other task.

Pairing is on what the POSTs share, never on arrival order alone, so two clients whose POSTs
interleave each get their own task. Where what they share cannot tell them apart — two
waiting flows would have one key, such as the same ``save_result_path`` — both are refused,
never crossed: the waiting flow fails with a message saying why, the second Decoder POST and
every later POST of that key get 409 until the pairing window has passed. A flow whose
Encoder POST does not come within the window fails with a message naming the window; its
status says so on the Decoder's port.

Each method takes ``now`` (a monotonic clock): tests drive time instead of sleeping.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, str]
ROLES = ("encoder", "transformer", "decoder")
FAILED_KEPT = 1024
"""Failed flows whose status is still answered (oldest forgotten first)."""
DROPPED_FIELDS = ("data_bootstrap_room", "disagg_bootstrap_room",
                  "disagg_decoder_bootstrap_room", "disagg_phase1_receiver_engine_rank")
"""LightX2V's per-request room and rank overrides: meaningless to pull workers, dropped."""


class Refused(Exception):
    """A POST of the flow that cannot be taken; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class Flow:
    task_id: str
    key: Key
    kind: str
    decoder: dict[str, Any]
    """The Decoder POST's payload: the Encoder POST must agree with every field of it."""
    opened: float
    transformer: bool = False
    error: str | None = None
    """Why the flow failed before its task was made (None: waiting, or made)."""
    finished: float = field(default=0.0)


def clean(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``payload`` without LightX2V's room and rank overrides."""
    return {k: v for k, v in payload.items() if k not in DROPPED_FIELDS}


def keys_of(payload: Mapping[str, Any]) -> list[Key]:
    """The keys a POST may pair on, strongest first."""
    out: list[Key] = []
    for name in ("task_id", "save_result_path"):
        value = payload.get(name)
        if isinstance(value, str) and value:
            out.append((name, value))
    if payload:
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        out.append(("payload", hashlib.sha256(canonical.encode()).hexdigest()))
    return out


def _name(key: Key) -> str:
    return f"{key[0]} {key[1]!r}" if key[0] != "payload" else "the same payload"


class FlowTable:
    """The flows between their Decoder POST and the task their Encoder POST makes."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.waiting: dict[Key, Flow] = {}
        self.by_id: dict[str, Flow] = {}
        self.failed: OrderedDict[str, Flow] = OrderedDict()
        self.contested: dict[Key, float] = {}
        """Keys two flows claimed at once -> until when their POSTs are refused."""

    # -- the three POSTs ----------------------------------------------------------------------
    def decoder_post(self, kind: str, payload: Mapping[str, Any], now: float) -> Flow:
        self.sweep(now)
        payload = clean(payload)
        keys = keys_of(payload)
        if not keys:
            raise Refused(422, "a Decoder POST of a three-POST flow must carry what its Encoder "
                          "POST repeats: save_result_path, task_id or the whole payload")
        key = keys[0]
        self._check_contested([key], now)
        if key in self.waiting:
            other = self.waiting.pop(key)
            why = (f"two three-POST flows used {_name(key)} at once, so their POSTs cannot be "
                   "told apart; give each request its own save_result_path (or task_id)")
            self._fail(other, why, now)
            self.contested[key] = now + self.window_s
            raise Refused(409, why)
        task_id = payload.get("task_id") or uuid.uuid4().hex
        if task_id in self.by_id or task_id in self.failed:
            raise Refused(409, f"task {task_id} exists already; choose another task_id")
        flow = Flow(str(task_id), key, kind, dict(payload), now)
        self.waiting[key] = flow
        self.by_id[flow.task_id] = flow
        return flow

    def transformer_post(self, kind: str, payload: Mapping[str, Any], now: float) -> Flow:
        self.sweep(now)
        payload = clean(payload)
        if not payload:
            # It carries nothing: which waiting flow it is counted against changes nothing.
            for waiting in self.waiting.values():
                if waiting.kind == kind and not waiting.transformer:
                    waiting.transformer = True
                    return waiting
            raise Refused(409, "no Decoder POST is waiting for its Transformer POST: a "
                          "three-POST flow posts to the Decoder first")
        flow = self._match(kind, payload, now, "Transformer")
        if flow is None:
            raise Refused(409, "this Transformer POST matches no waiting Decoder POST (by "
                          "task_id, save_result_path or payload): POST to the Decoder first")
        flow.transformer = True
        return flow

    def encoder_post(self, kind: str, payload: Mapping[str, Any], now: float) -> Flow | None:
        """The flow this Encoder POST completes (taken off the waiting list: the caller makes
        its task, then calls :meth:`made` or :meth:`fail`), or None when no flow waits for
        it (the POST is then a task of its own, as a single POST to the front door is)."""
        self.sweep(now)
        flow = self._match(kind, clean(payload), now, "Encoder")
        if flow is not None:
            del self.waiting[flow.key]
        return flow

    def made(self, flow: Flow) -> None:
        """The flow's task exists: from now on the task answers for it."""
        self.by_id.pop(flow.task_id, None)

    def fail(self, flow: Flow, error: str, now: float) -> None:
        self.waiting.pop(flow.key, None)
        self._fail(flow, error, now)

    # -- status ------------------------------------------------------------------------------
    def status(self, task_id: str, now: float) -> dict[str, Any] | None:
        """LightX2V's status body for a flow not yet a task (None: not a flow of ours)."""
        self.sweep(now)
        flow = self.by_id.get(task_id) or self.failed.get(task_id)
        if flow is None:
            return None
        waiting = flow.error is None
        return {
            "task_id": flow.task_id,
            "status": "pending" if waiting else "failed",
            "stage": "awaiting the Encoder POST" if waiting else "failed",
            "error": flow.error,
            "error_type": None if waiting else "three_post_flow",
            "save_result_path": flow.decoder.get("save_result_path", ""),
        }

    def sweep(self, now: float) -> None:
        """Fail flows past the pairing window; forget expired contested keys."""
        for key, flow in list(self.waiting.items()):
            if now - flow.opened > self.window_s:
                del self.waiting[key]
                self._fail(flow, f"the Encoder POST of this three-POST flow did not come within "
                                 f"{self.window_s:g} s of its Decoder POST "
                                 "(server.lightx2v_pair_timeout_s)", now)
        for key, until in list(self.contested.items()):
            if now >= until:
                del self.contested[key]

    # -- inside ------------------------------------------------------------------------------
    def _match(self, kind: str, payload: dict[str, Any], now: float, role: str) -> Flow | None:
        keys = keys_of(payload)
        self._check_contested(keys, now)
        for key in keys:
            flow = self.waiting.get(key)
            if flow is None:
                continue
            if flow.kind != kind:
                raise Refused(409, f"this {role} POST is for /v1/tasks/{kind}/ but its Decoder "
                              f"POST (task {flow.task_id}) was for /v1/tasks/{flow.kind}/")
            differ = sorted(k for k, v in flow.decoder.items() if payload.get(k) != v)
            if differ:
                raise Refused(409, f"this {role} POST differs from the Decoder POST of task "
                              f"{flow.task_id} in {', '.join(differ)}; a three-POST flow sends "
                              "the same payload to all three")
            return flow
        return None

    def _check_contested(self, keys: list[Key], now: float) -> None:
        for key in keys:
            if self.contested.get(key, 0.0) > now:
                raise Refused(409, f"two three-POST flows used {_name(key)} at once and were "
                              "refused; give each request its own save_result_path (or "
                              "task_id) and start again from the Decoder POST")

    def _fail(self, flow: Flow, error: str, now: float) -> None:
        flow.error, flow.finished = error, now
        self.by_id.pop(flow.task_id, None)
        self.failed[flow.task_id] = flow
        while len(self.failed) > FAILED_KEPT:
            self.failed.popitem(last=False)
