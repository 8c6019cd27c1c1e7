"""The Mooncake engine wrapper and its settings.

Every worker process owns one :class:`TransferEngine` (one Mooncake engine) and one
registered :class:`~tensorplane.pool.StagingPool`.

- ``MooncakeSettings`` - what Mooncake needs to start, resolved once at the entry point.
- ``TransferEngine`` - ``start()``, ``session_id``, ``register``/``unregister``,
  ``read``/``write`` (bounded in time), ``close()``.

Mooncake is imported lazily (inside :meth:`TransferEngine.start`), so this module imports on
machines without it, and a missing package is an error that says what to install.

Behaviour of mooncake-transfer-engine 0.3.13 that shaped this module (measured on loopback):

- A transfer to a *dead* peer (process gone, port closed) fails at once with rc -1.
- A transfer to a *stopped or wedged* peer (socket open, nobody answering) blocks the calling
  thread for 30 s on a warm connection (``MC_TCP_PROGRESS_TIMEOUT_SEC``) and ~60 s on a cold
  one (P2P handshake); even ``batch_transfer_async_read`` blocks in the submit on a cold
  peer. Hence every transfer runs on a helper thread and the caller stops waiting after its
  own deadline (:class:`TransferFailed` with ``timed_out=True``).
- A transfer on an engine that was never initialized crashes the process; hence the
  ``start()`` check on every call.
- ``initialize`` returns 0 even for an unknown protocol string; hence our own validation.
- Registering an overlapping or zero-length region fails (rc -7 / -1).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from typing import Any, Final

from contracts import faults
from tensorplane.errors import (
    EngineError,
    MooncakeConfigError,
    MooncakeNotInstalled,
    TransferFailed,
)

log = logging.getLogger(__name__)

P2P_HANDSHAKE: Final = "P2PHANDSHAKE"
CONFIG_PATH_ENV: Final = "MOONCAKE_CONFIG_PATH"
INFINIBAND_SYSFS: Final = "/sys/class/infiniband"
_PROTOCOLS: Final = ("auto", "tcp", "rdma")
_ENV_VARS: Final = {
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "metadata_server": "MOONCAKE_METADATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE_NAME",
}
_INSTALL_HINT: Final = (
    "install Mooncake's Python package: `pip install mooncake-transfer-engine-non-cuda` on "
    "CPU machines, `pip install mooncake-transfer-engine` with CUDA (it also needs the "
    "system's libibverbs.so.1: `apt-get install -y libibverbs1`)"
)


# ------------------------------------------------------------------------------- settings
_HOST_RE: Final = re.compile(r"^[A-Za-z0-9._\-\[\]:]+$")
_DEVICE_RE: Final = re.compile(r"^[A-Za-z0-9_.\-]*(,[A-Za-z0-9_.\-]+)*$")


def rdma_devices(infiniband_dir: str = INFINIBAND_SYSFS) -> list[str]:
    """Names of the RDMA devices the kernel exposes (empty when none, or no sysfs entry)."""
    try:
        return sorted(os.listdir(infiniband_dir))
    except OSError:
        return []


@dataclass(frozen=True)
class MooncakeSettings:
    """What a process's Mooncake engine needs to start; build it with :meth:`resolve`."""

    local_hostname: str = "127.0.0.1"
    """Address peers use to reach this process (host, or host:port for etcd/http metadata).
    With P2PHANDSHAKE the RPC port is picked by Mooncake and the session id is host:port.
    Services pass their own address as the default (:func:`contracts.addresses`), so this
    class default only applies to direct users of the engine."""

    metadata_server: str = P2P_HANDSHAKE
    """Where segment metadata lives: ``P2PHANDSHAKE`` (peers exchange it directly on the RPC
    port; no extra service) or a metadata service URL such as ``etcd://host:2379`` or
    ``http://host:8080/metadata``."""

    protocol: str = "auto"
    """``tcp``, ``rdma``, or ``auto`` (rdma when the kernel exposes an RDMA device, else tcp;
    resolved by :meth:`resolve` / :meth:`concrete`, which log the choice)."""

    device_name: str = ""
    """Comma-separated RDMA device names to use (e.g. ``mlx5_0,mlx5_1``); empty lets Mooncake
    discover them. Ignored over tcp."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), str):
                raise MooncakeConfigError(f"Mooncake setting {f.name} must be a string")
        if not self.local_hostname or not _HOST_RE.match(self.local_hostname):
            raise MooncakeConfigError(f"bad local_hostname {self.local_hostname!r}")
        if not self.metadata_server or any(c.isspace() for c in self.metadata_server):
            raise MooncakeConfigError(f"bad metadata_server {self.metadata_server!r}")
        if self.protocol not in _PROTOCOLS:
            raise MooncakeConfigError(
                f"bad protocol {self.protocol!r}: expected one of {', '.join(_PROTOCOLS)}"
            )
        if not _DEVICE_RE.match(self.device_name):
            raise MooncakeConfigError(f"bad device_name {self.device_name!r}")

    @classmethod
    def resolve(
        cls,
        file_path: str | None,
        env: Mapping[str, str],
        overrides: Mapping[str, Any] | None = None,
        *,
        defaults: Mapping[str, str] | None = None,
        infiniband_dir: str = INFINIBAND_SYSFS,
        service: Mapping[str, str] | None = None,
    ) -> MooncakeSettings:
        """Merge the sources, highest first: ``overrides`` (command line; a ``None`` value
        means "not given"), ``MOONCAKE_*`` variables in ``env``, ``service`` (the ``mooncake``
        section of the service's own config, where LightX2V's ``disagg_config`` keys land),
        the JSON file at ``file_path`` (or ``env['MOONCAKE_CONFIG_PATH']``), ``defaults``
        (what the service knows, e.g. its own address as ``local_hostname``), then the class
        defaults. An empty environment variable counts as unset. ``protocol='auto'`` is made
        concrete here.

        ``env`` is passed in (read once at the entry point), never read from ``os.environ``.
        """
        names = {f.name for f in fields(cls)}
        values: dict[str, str] = {}
        source: dict[str, str] = {}
        unknown = sorted(set(defaults or {}) - names)
        if unknown:
            raise MooncakeConfigError(f"unknown Mooncake default(s): {', '.join(unknown)}")
        for key, value in (defaults or {}).items():
            values[key], source[key] = value, "service default"
        path = file_path if file_path is not None else env.get(CONFIG_PATH_ENV) or None
        if path is not None:
            for key, value in _read_config_file(path, names).items():
                values[key], source[key] = value, path
        unknown = sorted(set(service or {}) - names)
        if unknown:
            raise MooncakeConfigError(f"unknown Mooncake setting(s): {', '.join(unknown)}")
        for key, value in (service or {}).items():
            values[key], source[key] = value, "service config"
        for key, var in _ENV_VARS.items():
            if env.get(var):
                values[key], source[key] = env[var], var
        unknown = sorted(set(overrides or {}) - names)
        if unknown:
            raise MooncakeConfigError(f"unknown Mooncake override(s): {', '.join(unknown)}")
        for key, value in (overrides or {}).items():
            if value is not None:
                values[key], source[key] = value, "override"
        settings = cls(**values)
        log.info(
            "mooncake settings: %s",
            ", ".join(
                f"{f.name}={getattr(settings, f.name)!r} ({source.get(f.name, 'default')})"
                for f in fields(settings)
            ),
        )
        return settings.concrete(infiniband_dir)

    def concrete(self, infiniband_dir: str = INFINIBAND_SYSFS) -> MooncakeSettings:
        """These settings with ``protocol='auto'`` replaced by ``rdma`` or ``tcp`` (logged)."""
        devices = rdma_devices(infiniband_dir)
        if self.protocol == "rdma" and not devices:
            log.warning("protocol rdma was asked for but %s lists no device", infiniband_dir)
        if self.protocol != "auto":
            return self
        if devices:
            log.info("mooncake protocol auto -> rdma: RDMA devices %s", ", ".join(devices))
            return replace(self, protocol="rdma")
        log.info("mooncake protocol auto -> tcp: no RDMA device under %s", infiniband_dir)
        return replace(self, protocol="tcp")


def _read_config_file(path: str, names: set[str]) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise MooncakeConfigError(f"cannot read Mooncake config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise MooncakeConfigError(f"Mooncake config file {path} must hold a JSON object")
    unknown = sorted(set(data) - names)
    if unknown:
        raise MooncakeConfigError(
            f"unknown key(s) in Mooncake config file {path}: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(names))})"
        )
    bad = sorted(k for k, v in data.items() if not isinstance(v, str))
    if bad:
        raise MooncakeConfigError(f"Mooncake config file {path}: {', '.join(bad)} not strings")
    return data


# --------------------------------------------------------------------------------- engine
def _import_mooncake() -> Any:
    try:
        from mooncake import engine as mooncake_engine
    except ImportError as exc:  # also raised when libibverbs.so.1 is missing
        raise MooncakeNotInstalled(
            f"cannot import mooncake.engine ({exc}); {_INSTALL_HINT}"
        ) from exc
    return mooncake_engine


def check_installed() -> None:
    """Raise MooncakeNotInstalled (saying what to install) unless Mooncake imports here."""
    _import_mooncake()


class _CallRunner:
    """Runs blocking Mooncake calls on daemon threads so that a caller can stop waiting.

    Daemon threads (not a ThreadPoolExecutor, whose workers are joined at interpreter exit)
    because a call stuck on a wedged peer must not keep the process alive. Idle threads are
    reused; a new one is started when none is idle, up to ``max_threads`` (beyond that, calls
    queue and the caller's own deadline still bounds its wait).
    """

    def __init__(self, max_threads: int) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[int], Callable[[], int]] | None]
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for work minus items queued for them
        self._threads = 0
        self._max = max_threads

    def submit(self, call: Callable[[], int]) -> Future[int]:
        fut: Future[int] = Future()
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
            elif self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._work, name="mooncake-call", daemon=True).start()
        self._queue.put((fut, call))
        return fut

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, call = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(call())
                except BaseException as exc:
                    fut.set_exception(exc)
            with self._lock:
                self._idle += 1
        with self._lock:
            self._threads -= 1

    def shutdown(self) -> None:
        """Stop idle threads; busy ones exit after their call returns."""
        with self._lock:
            for _ in range(self._threads):
                self._queue.put(None)


class TransferEngine:
    """One process's Mooncake engine: registration and one-sided, time-bounded transfers.

    The constructor does no I/O; :meth:`start` initializes Mooncake. A transfer's deadline is
    ``timeout_s + nbytes / min_bandwidth`` unless the call passes its own ``timeout_s``.
    """

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        timeout_s: float = 10.0,
        min_bandwidth: float = 50e6,
        max_threads: int = 16,
        infiniband_dir: str = INFINIBAND_SYSFS,
    ) -> None:
        if timeout_s <= 0 or min_bandwidth <= 0 or max_threads < 1:
            raise ValueError("timeout_s, min_bandwidth and max_threads must be positive")
        self._settings = settings
        self._timeout_s = timeout_s
        self._min_bandwidth = min_bandwidth
        self._infiniband_dir = infiniband_dir
        self._runner = _CallRunner(max_threads)
        self._engine: Any = None
        self._session_id: str | None = None
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self._abandoned = 0  # calls the caller gave up on that Mooncake has not returned yet

    @property
    def settings(self) -> MooncakeSettings:
        """The settings this engine was built with (``protocol`` concrete after start)."""
        return self._settings

    @property
    def session_id(self) -> str:
        """This process's segment name, which peers pass to read/write ("host:rpcport")."""
        if self._session_id is None:
            raise EngineError("TransferEngine.session_id used before start()")
        return self._session_id

    @property
    def rpc_endpoint(self) -> tuple[str, int]:
        """(advertised host, RPC port): where peers' Mooncake handshakes connect to reach
        this segment. Mooncake listens on every interface; the host is what it advertises."""
        engine = self._started()
        host = self.session_id
        if host.startswith("["):
            host = host[1 : host.index("]")]
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        return host, int(engine.get_rpc_port())

    @property
    def abandoned_calls(self) -> int:
        """Transfers that passed their deadline and are still inside Mooncake."""
        with self._lock:
            return self._abandoned

    def start(self) -> None:
        """Initialize Mooncake (hostname, metadata server, protocol, device)."""
        if self._engine is not None:
            raise EngineError("TransferEngine.start() called twice")
        mc = _import_mooncake()
        self._settings = s = self._settings.concrete(self._infiniband_dir)
        engine = mc.TransferEngine()
        rc = engine.initialize(s.local_hostname, s.metadata_server, s.protocol, s.device_name)
        if rc != 0:
            raise EngineError(
                f"mooncake initialize({s.local_hostname!r}, {s.metadata_server!r}, "
                f"{s.protocol!r}, {s.device_name!r}) returned {rc}"
            )
        if s.metadata_server == P2P_HANDSHAKE:
            # Mooncake names a P2P segment host:rpcport whatever port local_hostname carried.
            host = s.local_hostname
            if host.count(":") == 1:
                host = host.split(":", 1)[0]
            self._session_id = f"{host}:{engine.get_rpc_port()}"
        else:
            # With a metadata service the segment is published under local_hostname itself.
            self._session_id = s.local_hostname
        self._engine = engine
        log.info("mooncake engine started: session %s over %s", self._session_id, s.protocol)

    def _started(self) -> Any:
        if self._engine is None:
            # An uninitialized Mooncake engine crashes the process on transfer: refuse here.
            raise EngineError("TransferEngine used before start() or after close()")
        return self._engine

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``[ptr, ptr + nbytes)`` so peers may read/write it (no overlaps)."""
        if nbytes <= 0:
            raise EngineError(f"cannot register {nbytes} bytes at {ptr:#x}")
        rc = self._started().register_memory(ptr, nbytes)
        if rc != 0:
            raise EngineError(
                f"mooncake register_memory({ptr:#x}, {nbytes}) returned {rc} "
                "(-7: overlaps an already registered region)"
            )
        with self._lock:
            self._registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        """Unregister a region previously given to :meth:`register`."""
        rc = self._started().unregister_memory(ptr)
        with self._lock:
            self._registered.pop(ptr, None)
        if rc != 0:
            raise EngineError(f"mooncake unregister_memory({ptr:#x}) returned {rc}")

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
        if faults.ON and task_id is not None:  # a task's read (not the start-up probe's)
            faults.hit("transfer.read", lambda why: TransferFailed(
                f"mooncake read of {nbytes} bytes failed ({why})", nbytes=nbytes,
                task_id=task_id, tensor=tensor, peer=peer_session))
        self._transfer("read", peer_session, local_addr, remote_addr, nbytes,
                       timeout_s, task_id, tensor)

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
        self._transfer("write", peer_session, local_addr, remote_addr, nbytes,
                       timeout_s, task_id, tensor)

    def _transfer(
        self,
        op: str,
        peer: str,
        local_addr: int,
        remote_addr: int,
        nbytes: int,
        timeout_s: float | None,
        task_id: str | None,
        tensor: str | None,
    ) -> None:
        engine = self._started()

        def fail(message: str, **extra: Any) -> TransferFailed:
            return TransferFailed(f"mooncake {op} of {nbytes} bytes {message}", nbytes=nbytes,
                                  task_id=task_id, tensor=tensor, peer=peer, **extra)

        if nbytes <= 0:
            raise fail("refused: size must be positive")
        fn = engine.transfer_sync_read if op == "read" else engine.transfer_sync_write
        budget = timeout_s if timeout_s is not None else (
            self._timeout_s + nbytes / self._min_bandwidth
        )
        fut = self._runner.submit(lambda: int(fn(peer, local_addr, remote_addr, nbytes)))
        try:
            rc = fut.result(timeout=budget)
        except TimeoutError:
            pending = None if fut.cancel() else fut
            if pending is not None:
                with self._lock:
                    self._abandoned += 1
                pending.add_done_callback(self._call_returned)
            raise fail(f"did not finish within {budget:.1f}s (peer wedged or unreachable)",
                       timed_out=True, pending=pending) from None
        except Exception as exc:  # pybind11 turns C++ exceptions into RuntimeError & co.
            raise fail(f"raised {exc!r}") from exc
        if rc != 0:
            raise fail(f"returned {rc} (peer dead, unreachable, or address outside its "
                       "registered memory)", rc=rc)

    def _call_returned(self, _fut: Future[int]) -> None:
        with self._lock:
            self._abandoned -= 1

    def close(self) -> None:
        """Unregister what is still registered and drop the Mooncake engine."""
        if self._engine is None:
            return
        for ptr in list(self._registered):
            try:
                self.unregister(ptr)
            except EngineError as exc:
                log.warning("close: %s", exc)
        self._runner.shutdown()
        if self.abandoned_calls:
            # Destroying the engine under a call still inside it could crash the process;
            # keep the native object alive (a leak at shutdown) instead.
            log.warning("close: %d mooncake call(s) still in flight; engine kept alive",
                        self.abandoned_calls)
            _KEEP_ALIVE.append(self._engine)
        self._engine = None
        self._session_id = None


_KEEP_ALIVE: list[Any] = []
