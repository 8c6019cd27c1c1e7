"""The one seam of the tensor plane: what the staging pool (:mod:`tensorplane.pool`), the
stage / pull / release protocol (:mod:`tensorplane.handoff`) and kept tensors
(:mod:`tensorplane.keep`) need of a transfer engine.

Five operations: the name peers address this process's memory by, registration of that
memory, and one-sided copies from and to a peer's registered memory. The services use
Mooncake's (:class:`tensorplane.engine.TransferEngine`: starting it, its settings and its
RPC endpoint are its own business, used at start-up only); the unit tests use an in-process
one that copies between pools of one process (``tests/support/fakes.py``), so a producer
and a consumer of tensors are tested in one process without Mooncake's servers.
"""

from __future__ import annotations

from typing import Protocol


class Transport(Protocol):
    """Registered memory and one-sided copies between processes' registered memory.

    Contract (what the pool and the protocol rely on): a copy touches only registered
    memory, on both sides, and is bounded in time; a failed or timed-out copy raises
    :class:`~tensorplane.errors.TransferFailed` naming the task, tensor and peer (with
    ``pending`` set while the engine may still write into the local buffer); a registration
    that cannot be made raises :class:`~tensorplane.errors.EngineError`.
    """

    @property
    def session_id(self) -> str:
        """This process's segment: the name peers pass to :meth:`read` / :meth:`write`."""
        ...

    def register(self, ptr: int, nbytes: int) -> None:
        """Let peers read and write ``[ptr, ptr + nbytes)`` (no overlaps)."""
        ...

    def unregister(self, ptr: int) -> None:
        """Withdraw a region given to :meth:`register`."""
        ...

    def read(
        self,
        peer_session: str,
        local_addr: int,
        remote_addr: int,
        nbytes: int,
        *,
        timeout_s: float | None = None,
        task_id: str | None = None,
        tensor: str | None = None,
    ) -> None:
        """Copy ``nbytes`` from the peer's ``remote_addr`` into local ``local_addr``."""
        ...

    def write(
        self,
        peer_session: str,
        local_addr: int,
        remote_addr: int,
        nbytes: int,
        *,
        timeout_s: float | None = None,
        task_id: str | None = None,
        tensor: str | None = None,
    ) -> None:
        """Copy ``nbytes`` from local ``local_addr`` to the peer's ``remote_addr``."""
        ...
