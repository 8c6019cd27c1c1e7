"""Where ``scripts/bench/bench_serving.py`` puts its services: the device list, the disaggregated
placement, and the refusal when a run asks for more GPUs than the machine has.

Devices are service ``device`` settings (:class:`contracts.config.ServiceConfig`): ``cuda:N``
on a GPU machine, ``cpu`` on a CPU one. ``--gpus G`` names G of them: ``cuda:K`` ..
``cuda:K+G-1`` when ``--device`` is ``cuda:K``, or G times ``cpu`` when it is ``cpu`` (G
"devices" sharing the cores: the code path of a scale-out run, not its speed).
``--devices cuda:0,cuda:1`` names them one by one. Tables index them d0, d1, ...

A placement says which workers of the disaggregated group run on which device (by index in
that list): comma-separated ``DEVICES:ROLES``, DEVICES an index (``0``) or a range (``1-7``),
ROLES ``+``-joined roles, each with an optional count: ``e``/``encoder``,
``t``/``transformer``/``dit``, ``d``/``decoder``. Examples on 8 devices:

    0:e+t+d,1-7:t    1 encoder, 1 decoder and 1 DiT on d0, one DiT on each other device
    0:e+d,1-7:t      the seed's split: 7 DiT devices, d0 for the encoder and the decoder
    0:e+2t+d,1-7:2t  two DiT workers per device

With ``--dit-parallel`` (a transformer group of G ranks, contracts/parallel.py) each DiT
worker is a group spanning G consecutive devices from the one it is placed on: on 3 devices
``0:e+d,1:t`` with ``cfg=2`` runs the encoder and the decoder on d0 and one DiT group on d1
and d2.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass

from contracts.pipelines import check_device
from contracts.roles import Role

ROLES = tuple(role.value for role in Role)  # the worker roles, in pipeline order
_ROLE_NAMES = {"e": "encoder", "encoder": "encoder", "t": "transformer",
               "transformer": "transformer", "dit": "transformer", "d": "decoder",
               "decoder": "decoder"}
_SHORT = {"encoder": "e", "transformer": "t", "decoder": "d"}
_ITEM = re.compile(r"^(\d+)(?:-(\d+))?:(.+)$")
_ROLE = re.compile(r"^(\d*)([a-z]+)$")


@dataclass(frozen=True)
class Endpoint:
    """One service's metrics endpoint: what it runs ("all" for a baseline replica) and on
    which device (index into the run's device list)."""

    url: str
    role: str
    device: int


def device_list(device: str, gpus: int | None, devices: str | None) -> list[str]:
    """The run's devices from ``--device``, ``--gpus`` and ``--devices`` (see the module)."""
    if devices is not None and gpus is not None:
        raise SystemExit("give --gpus G or --devices LIST, not both")
    if devices is not None:
        out = [d.strip() for d in devices.split(",") if d.strip()]
    elif gpus is not None:
        if gpus < 1:
            raise SystemExit(f"--gpus must be at least 1, got {gpus}")
        if device == "cpu":
            out = ["cpu"] * gpus
        elif device.startswith("cuda"):
            first = int(device.partition(":")[2] or 0)
            out = [f"cuda:{first + i}" for i in range(gpus)]
        else:
            raise SystemExit(f"--device must be cpu or cuda[:N] with --gpus, got {device!r}")
    else:
        out = [device]
    bad = [d for d in out if not check_device(d)]
    if not out or bad:
        raise SystemExit(f"devices must be 'cpu' or 'cuda:N', got {bad or 'none'}")
    return out


def check_devices(devices: list[str]) -> None:
    """Refuse, before anything starts, a GPU run that names a CUDA device this machine lacks."""
    indices = [int(d.partition(":")[2] or 0) for d in devices if d.startswith("cuda")]
    if not indices:
        return
    import torch

    have = torch.cuda.device_count()
    need = max(indices) + 1
    if need > have:
        raise SystemExit(
            f"this run needs {need} CUDA device(s) ({', '.join(devices)}) but "
            f"torch.cuda.device_count() is {have} here: lower --gpus / --devices, or run it on "
            f"a machine with at least {need} GPUs (e.g. nvidia-h200-x{max(2, need)})")


def default_placement(n_devices: int, encoders: int, transformers: int, decoders: int,
                      dit_span: int = 1) -> str:
    """The encoders, ``transformers`` DiT workers and the decoders on d0, then
    ``transformers`` DiT workers on every other device. DiT groups of ``dit_span`` devices:
    one group on d1.. when there is a device to spare for the encoder and the decoder, else
    one from d0."""
    def roles(*pairs: tuple[int, str]) -> str:
        return "+".join(("" if n == 1 else str(n)) + r for n, r in pairs if n > 0)

    if dit_span > 1:
        if n_devices < dit_span:
            raise SystemExit(f"a DiT group of {dit_span} devices needs at least {dit_span} "
                             f"devices; this run has {n_devices}")
        if n_devices > dit_span:
            return f"0:{roles((encoders, 'e'), (decoders, 'd'))},1:t"
        return f"0:{roles((encoders, 'e'), (1, 't'), (decoders, 'd'))}"

    items = [f"0:{roles((encoders, 'e'), (transformers, 't'), (decoders, 'd'))}"]
    if n_devices > 1:
        rest = "1" if n_devices == 2 else f"1-{n_devices - 1}"
        items.append(f"{rest}:{roles((transformers, 't'))}")
    return ",".join(items)


def parse_placement(spec: str, n_devices: int, dit_span: int = 1) -> list[tuple[str, int]]:
    """``(role, device index)`` of every worker in start order (all encoders, then all DiT
    workers, then all decoders, each by device). Refuses what would leave a role without a
    worker or a device without one, or names a device the run does not have. A DiT worker
    covers ``dit_span`` devices from its own (a transformer group)."""
    workers: list[tuple[str, int]] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        m = _ITEM.match(item)
        if m is None:
            raise SystemExit(f"--placement item {item!r}: write DEVICES:ROLES, e.g. 0:e+t+d "
                             "or 1-7:t")
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        if not lo <= hi < n_devices:
            raise SystemExit(f"--placement item {item!r} names device(s) {lo}-{hi}; this run "
                             f"has {n_devices} (d0..d{n_devices - 1})")
        for part in m[3].split("+"):
            r = _ROLE.match(part.strip())
            if r is None or r[2] not in _ROLE_NAMES or r[1] == "0":
                raise SystemExit(f"--placement role {part!r}: use [COUNT]e|t|d (encoder, "
                                 "transformer, decoder), e.g. 2t")
            for dev in range(lo, hi + 1):
                workers += [(_ROLE_NAMES[r[2]], dev)] * int(r[1] or 1)
    have = Counter(role for role, _ in workers)
    missing = [r for r in ROLES if have[r] == 0]
    if missing:
        raise SystemExit(f"--placement {spec!r} has no {' and no '.join(missing)}")
    used: set[int] = set()
    for role, dev in workers:
        span = dit_span if role == "transformer" else 1
        if dev + span > n_devices:
            raise SystemExit(f"--placement {spec!r}: a DiT group of {span} devices from d{dev} "
                             f"runs past d{n_devices - 1}")
        used.update(range(dev, dev + span))
    idle = sorted(set(range(n_devices)) - used)
    if idle:
        raise SystemExit(f"--placement {spec!r} leaves device(s) {idle} without a worker (the "
                         "baseline uses every device: give each one a role)")
    return sorted(workers, key=lambda w: (ROLES.index(w[0]), w[1]))


def describe(workers: list[tuple[str, int]]) -> str:
    """``d0: e+t+d, d1: t`` (what runs where, for titles and logs)."""
    by_dev: dict[int, Counter[str]] = {}
    for role, dev in workers:
        by_dev.setdefault(dev, Counter())[role] += 1
    return ", ".join(
        f"d{dev}: " + "+".join(("" if c[r] == 1 else str(c[r])) + _SHORT[r]
                               for r in ROLES if c[r])
        for dev, c in sorted(by_dev.items()))


def counts(workers: list[tuple[str, int]]) -> dict[str, int]:
    have = Counter(role for role, _ in workers)
    return {r: have[r] for r in ROLES}


@dataclass(frozen=True)
class Plan:
    """Where a run's services go: its devices and the disaggregated workers' placement."""

    devices: list[str]
    workers: list[tuple[str, int]]
    scale_out: bool
    dit_parallel: str | None = None
    """The DiT workers' transformer-group layout (``--dit-parallel``), None: one device."""
    dit_span: int = 1
    """Devices per DiT worker (the layout's size)."""

    @property
    def baseline_devices(self) -> list[str]:
        """One ``--service all`` replica per device; against a group, one on d0."""
        return self.devices[:1] if self.dit_span > 1 else self.devices


def make_plan(args: argparse.Namespace) -> Plan:
    """Devices and placement from the command line; refuses a GPU run asking for more CUDA
    devices than the machine has before anything is built or started."""
    devices = device_list(args.device, args.gpus, args.devices)
    span, dit = 1, None
    if args.dit_parallel:
        from contracts.errors import ConfigError
        from contracts.parallel import ParallelLayout

        try:
            parsed = ParallelLayout.parse(args.dit_parallel)
        except ConfigError as exc:
            raise SystemExit(f"--dit-parallel: {exc}") from None
        span, dit = parsed.size, str(parsed)
    scale_out = span == 1 and (args.gpus is not None or args.devices is not None
                               or args.placement is not None)
    if not args.dry_run:
        check_devices(devices)
    if args.single_requests < 2:
        raise SystemExit("--single-requests must be at least 2")
    if args.single_qps is not None and args.single_qps <= 0:
        raise SystemExit("--single-qps must be a positive QPS")
    spec = args.placement or default_placement(
        len(devices), args.encoders, args.transformers, args.decoders, span)
    return Plan(devices, parse_placement(spec, len(devices), span), scale_out, dit, span)
