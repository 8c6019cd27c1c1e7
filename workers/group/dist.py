"""The wiring of a transformer group: torch's process group, the command channel from rank 0
to the others, and moving the task's tensors from rank 0 to every rank.

Two channels, for two kinds of waiting:

* **Commands** (``load`` done, ``warmup``, ``denoise``, ``stop``, and each rank's outcome) go
  over a socket pair per rank that the supervisor made (:class:`Channel`, msgpack frames).
  An idle rank waits on it for as long as the worker is idle; when rank 0 dies the socket
  closes and the wait ends. No collective is ever pending while the group is idle.
* **Tensors** go over torch.distributed (gloo on CPU, NCCL on CUDA) only while every rank is
  inside the same command, so every collective has a bounded wait: the process group's
  timeout (``transformer.group_timeout_s``), after which the waiting rank's collective
  raises (gloo) or its watchdog ends the process (NCCL). The tensors of a ``denoise``
  command are the task's inputs and, for a resumed attempt, the loop state rank 0 fetched
  (:func:`broadcast_state`); the command says what to allocate for each.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Mapping
from typing import Any

import torch

from contracts.errors import ConnectionLost
from contracts.parallel import ParallelLayout
from rings import wire
from rings.handshake import recv_frame
from workers.models.dit.parallel import GroupMesh
from workers.models.loop_state import LoopState, from_wire, to_wire

__all__ = ["Channel", "broadcast_state", "broadcast_tensors", "init_group", "state_command",
           "tensor_specs"]

STORE_HOST = "127.0.0.1"
"""The rendezvous store binds here: a group spans the devices of one host."""


class Channel:
    """One end of a rank-to-rank command socket: msgpack maps in length-prefixed frames."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer

    @classmethod
    def from_fd(cls, fd: int, peer: str) -> Channel:
        return cls(socket.socket(fileno=fd), peer)

    def send(self, **msg: Any) -> None:
        try:
            self.sock.sendall(wire.pack_msg(msg))
        except OSError as exc:
            raise ConnectionLost(f"{self.peer}: command channel closed: {exc}") from exc

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message; ConnectionLost when the peer is gone, TimeoutError after
        ``timeout`` seconds without one (None: wait as long as it takes)."""
        self.sock.settimeout(timeout)
        try:
            return wire.unpack_msg(recv_frame(self.sock))
        except TimeoutError:
            raise
        except (ConnectionLost, OSError, ValueError) as exc:
            raise ConnectionLost(f"{self.peer}: command channel closed ({exc})") from exc

    def close(self) -> None:
        self.sock.close()


def init_group(rank: int, layout: ParallelLayout, device: torch.device, store_port: int | None,
               timeout_s: float, leader_store: Any = None) -> GroupMesh:
    """Join the group's process group and build its mesh. Rank 0 passes the store it
    serves (``leader_store``, from :func:`serve_store`), the others its port."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = leader_store
    if store is None:
        assert store_port is not None
        store = dist.TCPStore(STORE_HOST, store_port, layout.size, is_master=False,
                              timeout=timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=layout.size,
                                timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.size,
                                timeout=timeout)
    return GroupMesh.build(layout, device.type)


def serve_store(layout: ParallelLayout, timeout_s: float) -> Any:
    """Rank 0's rendezvous store on a port the kernel picks (``.port``), on loopback."""
    import torch.distributed as dist

    return dist.TCPStore(STORE_HOST, 0, layout.size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    """What a follower allocates before :func:`broadcast_tensors` (name order)."""
    return [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for n, t in sorted(tensors.items())]


def broadcast_tensors(specs: list[dict[str, Any]], tensors: Mapping[str, torch.Tensor] | None,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """Rank 0's ``tensors`` on every rank (rank 0 passes them, the others None)."""
    import torch.distributed as dist

    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        if tensors is not None:
            t = tensors[spec["name"]].contiguous()
        else:
            t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
        dist.broadcast(t, src=0)
        out[spec["name"]] = t
    return out


def state_command(state: LoopState | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Rank 0: what a ``denoise`` command says of the loop state it resumes from (None: a
    fresh start), and the tensors :func:`broadcast_state` then sends. The state's own wire
    form (:func:`~workers.models.loop_state.to_wire`, as a checkpoint travels): its ``meta``
    in the command, its tensors in the process group."""
    if state is None:
        return None, {}
    tensors, meta = to_wire(state)
    # A stage whose state is numpy (none that runs in a group today) travels as torch.
    tensors = {n: torch.as_tensor(t) for n, t in tensors.items()}
    return ({"step": state.step, "steps": state.steps, "meta": meta,
             "tensors": tensor_specs(tensors)}, tensors)


def broadcast_state(command: Mapping[str, Any] | None, tensors: Mapping[str, Any] | None,
                    device: torch.device) -> LoopState | None:
    """Rank 0's resumed loop state on every rank (rank 0 passes its tensors, the others
    None). Every tensor crosses on the group's device (NCCL moves no host memory) and is put
    back where the state had it (:func:`~workers.models.loop_state.from_wire`: UniPC keeps
    its sigmas on the CPU)."""
    if command is None:
        return None
    sent = None if tensors is None else {n: t.to(device) for n, t in tensors.items()}
    got = broadcast_tensors(command["tensors"], sent, device)
    return from_wire(int(command["step"]), int(command["steps"]), got, command["meta"], device)
