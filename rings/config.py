"""Configuration shared by every role: where the rings are and how peers reach them.

Field names follow LightX2V's ``disagg_config`` so existing config files keep working; the
keys LightX2V needs for its static rooms and ranks are accepted and ignored with a warning,
because diffring's workers are pull-based and need none. Any other unknown key is an error
that names it.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from rings.errors import ConfigError
from rings.layout import RingLayout

log = logging.getLogger("diffring.config")

T = TypeVar("T")

DEFAULT_TOKEN = "diffring-dev-token"
RING_NAMES = ("request", "phase1", "phase2")


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Loose type check of one JSON value against a dataclass field annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(value) if origin is tuple else list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {value!r}")
        return value
    return value


def from_mapping(
    cls: type[T],
    data: Mapping[str, Any] | None,
    where: str,
    ignored: Mapping[str, str] | None = None,
) -> T:
    """Build frozen dataclass ``cls`` from a JSON object, naming any unknown key.

    ``ignored``: keys accepted for compatibility and dropped, with the reason to log.
    """
    data = dict(data or {})
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object")
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in fields:
            kwargs[key] = _check_type(value, hints[key], f"{where}.{key}")
        elif ignored and key in ignored:
            log.warning("config %s.%s is ignored: %s", where, key, ignored[key])
        else:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key {where}.{key} (known keys: {known})")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


_LIGHTX2V_IGNORED = {
    k: "diffring workers pull from rings; there are no static rooms or ranks"
    for k in (
        "bootstrap_room",
        "sender_engine_rank",
        "receiver_engine_rank",
        "decoder_engine_rank",
        "decoder_bootstrap_room",
        "transformer_engine_rank",
        "encoder_engine_rank",
    )
}
_LIGHTX2V_IGNORED["protocol"] = "set the Mooncake protocol in the mooncake config instead"


@dataclass(frozen=True)
class DisaggConfig:
    """Where the controller's rings and control channel live, and how peers reach them."""

    bootstrap_addr: str = "127.0.0.1"
    """Address of the controller (control channel; default host of every ring)."""
    control_port: int = 5565
    """Port of the controller's control channel (register, heartbeat, progress, leases)."""
    rdma_request_handshake_port: int = 5566
    """Handshake port of the request ring."""
    rdma_phase1_handshake_port: int = 5567
    """Handshake port of the Phase1 ring (encoder -> transformer)."""
    rdma_phase2_handshake_port: int = 5568
    """Handshake port of the Phase2 ring (transformer -> decoder)."""
    rdma_request_host: str | None = None
    """Address of the request ring; defaults to bootstrap_addr."""
    rdma_phase1_host: str | None = None
    """Address of the Phase1 ring; defaults to bootstrap_addr."""
    rdma_phase2_host: str | None = None
    """Address of the Phase2 ring; defaults to bootstrap_addr."""
    rdma_buffer_slots: int = 128
    """Slots per ring (ring capacity)."""
    rdma_buffer_slot_size: int = 4096
    """Bytes per slot, payload header included; a multiple of 8."""
    decentralized_queue: bool = True
    """Queue mode. diffring implements only the decentralized queue mode."""
    ring_transport: str = "auto"
    """Verbs transport of peers: 'rdma', 'tcp', or 'auto' (rdma where a device exists)."""
    cluster_token: str | None = None
    """Shared secret every service proves at handshake. None: DIFFRING_CLUSTER_TOKEN from the
    environment (read at start-up), else a development default (a warning is logged)."""
    claim_timeout_s: float = 30.0
    """A ring claim held longer than this gets its holder revoked and the slot repaired."""
    rdma_device_name: str | None = None
    """RDMA device for the ring transport (None: the first one found)."""
    rdma_ib_port: int = 1
    """Port of that device."""
    rdma_gid_index: int = 0
    """GID index (RoCE)."""

    def __post_init__(self) -> None:
        if not self.decentralized_queue:
            raise ConfigError(
                "decentralized_queue is false, but diffring only implements the decentralized "
                "queue mode; remove the key or set it to true"
            )
        if self.ring_transport not in ("auto", "tcp", "rdma"):
            raise ConfigError(
                f"ring_transport must be 'auto', 'tcp' or 'rdma', got {self.ring_transport!r}"
            )
        ports = [
            self.control_port,
            self.rdma_request_handshake_port,
            self.rdma_phase1_handshake_port,
            self.rdma_phase2_handshake_port,
        ]
        for p in ports:
            if not 0 <= p <= 65535:
                raise ConfigError(f"port {p} is out of range")
        nonzero = [p for p in ports if p]
        if len(set(nonzero)) != len(nonzero):
            raise ConfigError(f"control and ring handshake ports must differ, got {ports}")
        if self.claim_timeout_s <= 0:
            raise ConfigError("claim_timeout_s must be positive")
        for name in RING_NAMES:
            self.layout(name)  # validates slot count and size

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> DisaggConfig:
        return from_mapping(cls, data, "disagg_config", ignored=_LIGHTX2V_IGNORED)

    def rdma_options(self) -> dict[str, Any]:
        """Options the rdma transport takes, for ``rings.verbs.connect``."""
        return {
            "device_name": self.rdma_device_name,
            "ib_port": self.rdma_ib_port,
            "gid_index": self.rdma_gid_index,
        }

    def layout(self, ring: str) -> RingLayout:
        return RingLayout(ring, self.rdma_buffer_slots, self.rdma_buffer_slot_size)

    def ring_address(self, ring: str) -> tuple[str, int]:
        host = {
            "request": self.rdma_request_host,
            "phase1": self.rdma_phase1_host,
            "phase2": self.rdma_phase2_host,
        }[ring]
        port = {
            "request": self.rdma_request_handshake_port,
            "phase1": self.rdma_phase1_handshake_port,
            "phase2": self.rdma_phase2_handshake_port,
        }[ring]
        return host or self.bootstrap_addr, port

    def resolve_token(self, env: Mapping[str, str]) -> str:
        """The cluster token: DIFFRING_CLUSTER_TOKEN, else the config's, else the dev default
        (environment over file, as everywhere)."""
        token = env.get("DIFFRING_CLUSTER_TOKEN") or self.cluster_token
        if token:
            return token
        log.warning(
            "no cluster token configured (disagg_config.cluster_token or "
            "DIFFRING_CLUSTER_TOKEN); using the development default"
        )
        return DEFAULT_TOKEN


@dataclass(frozen=True)
class ServerConfig:
    """The controller's HTTP front door and every service's metrics endpoint."""

    host: str = "127.0.0.1"
    """Address the front door binds to (never silently 0.0.0.0)."""
    port: int = 8000
    """Front-door port."""
    metric_port: int | None = None
    """Prometheus metrics port of this service; None disables the metrics endpoint."""

    def __post_init__(self) -> None:
        for p in (self.port, self.metric_port):
            if p is not None and not 0 <= p <= 65535:
                raise ConfigError(f"port {p} is out of range")


@dataclass(frozen=True)
class ServiceConfig:
    """One service's whole configuration file (controller, a worker, or ``all``)."""

    disagg_mode: str | None = None
    """Role this file is for (LightX2V naming); --service on the command line wins."""
    model_cls: str = "wan2.1"
    """Model family: 'wan2.1' or 'qwen_image'."""
    task: str = "t2v"
    """Task: 't2v' / 'i2v' for wan2.1, 't2i' / 'i2i' for qwen_image."""
    model_path: str | None = None
    """Local diffusers-format model folder (workers and ``all``)."""
    device: str = "cpu"
    """Torch device of a worker's model stage: 'cpu' or 'cuda:N'."""
    dtype: str = "float32"
    """Model dtype: 'float32' or 'bfloat16'."""
    attention_backend: str = "sdpa"
    """DiT attention backend: 'sdpa', 'flash_attn' or 'sage_attn'."""
    torch_threads: int | None = None
    """CPU threads torch may use in this process (None: torch's default). Many CPU workers
    sharing few cores want 1."""
    output_dir: str = "out/results"
    """Folder results are written to (decoder, ``all``); the controller serves them."""
    mooncake_config_path: str | None = None
    """Mooncake config JSON (MOONCAKE_CONFIG_PATH from the environment otherwise)."""
    staging_pool_mb: int = 512
    """Size of a worker's registered staging pool in MiB (bounded: full means backpressure)."""
    heartbeat_interval_s: float = 1.0
    """How often a worker renews its leases with the controller."""
    lease_timeout_s: float = 15.0
    """A task whose worker missed heartbeats this long goes back in play."""
    reconnect_timeout_s: float = 300.0
    """How long a worker waits for its controller to come (back) up before giving up."""
    max_pending_tasks: int = 256
    """Front door: tasks accepted but not finished before new ones get 429."""
    disagg_config: DisaggConfig = dataclasses.field(default_factory=DisaggConfig)
    """Rings and control channel (LightX2V's field names)."""
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    """HTTP front door and metrics."""

    def __post_init__(self) -> None:
        tasks = {"wan2.1": ("t2v", "i2v"), "qwen_image": ("t2i", "i2i")}
        if self.model_cls not in tasks:
            raise ConfigError(f"model_cls must be one of {sorted(tasks)}, got {self.model_cls!r}")
        if self.task not in tasks[self.model_cls]:
            raise ConfigError(
                f"task {self.task!r} is not served by model_cls {self.model_cls!r} "
                f"(choose {' or '.join(tasks[self.model_cls])})"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.attention_backend not in ("sdpa", "flash_attn", "sage_attn"):
            raise ConfigError(
                f"attention_backend must be sdpa, flash_attn or sage_attn, "
                f"got {self.attention_backend!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError("torch_threads must be at least 1 (or null for torch's default)")
        if self.staging_pool_mb <= 0 or self.max_pending_tasks <= 0:
            raise ConfigError("staging_pool_mb and max_pending_tasks must be positive")

    @property
    def pipeline(self) -> str:
        """Short pipeline name: wan_t2v, wan_i2v, qwen_t2i or qwen_i2i."""
        return ("wan_" if self.model_cls == "wan2.1" else "qwen_") + self.task

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServiceConfig:
        data = dict(data)
        disagg = DisaggConfig.from_dict(data.pop("disagg_config", None))
        server = from_mapping(ServerConfig, data.pop("server", None), "server")
        base = from_mapping(cls, data, "config")
        return dataclasses.replace(base, disagg_config=disagg, server=server)

    @classmethod
    def load(cls, path: str | None) -> ServiceConfig:
        """Read a JSON config file (None: all defaults)."""
        if path is None:
            return cls()
        import json

        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a JSON object")
        return cls.from_dict(data)
