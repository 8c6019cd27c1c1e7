"""Ports for the services a launcher starts: free ones to hand out, busy ones to refuse.

:func:`free_ports` hands out ports free now (from a range of this process's own when
``DIFFRING_PORT_RANGE`` is set); :func:`port_busy` says whether something listens on a port
already (a start script refuses to start over another group).
"""

from __future__ import annotations

import errno
import os
import socket

from contracts.errors import ConfigError

PORT_RANGE_ENV = "DIFFRING_PORT_RANGE"
"""``LO-HI``: :func:`free_ports` hands out ports of this range only (default: the kernel's
choice). For processes that start groups side by side on one host, each with a range of its
own (the test suite gives each pytest-xdist worker one, below the kernel's ephemeral range)."""

_handed_out: set[tuple[str, int]] = set()
"""Ports this process already handed out from its range: not handed out twice before the
range has been walked through."""


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now. The ports are released for the services to
    bind, so two processes that each ask the kernel (bind to port 0) can be given the same
    port between the asking and the binding, and then one group's client reaches the other's
    server; processes given disjoint ranges (``DIFFRING_PORT_RANGE``) cannot be."""
    spec = os.environ.get(PORT_RANGE_ENV)
    if not spec or n == 0:
        return _kernel_ports(n, host)
    lo, hi = parse_port_range(spec)
    # A walk through the range from a start of this process's own (a child, e.g. a benchmark
    # a test starts, inherits its parent's range), skipping ports in use now.
    span = hi - lo + 1
    start = os.getpid() % span
    ports: list[int] = []
    for _ in range(2):  # the second walk: the range was used up, hand out again
        for i in range(span):
            port = lo + (start + i) % span
            if (host, port) in _handed_out or port in ports or port_busy(host, port):
                continue
            ports.append(port)
            if len(ports) == n:
                _handed_out.update((host, p) for p in ports)
                return ports
        _handed_out.difference_update({(h, p) for h, p in _handed_out if h == host})
    raise OSError(f"fewer than {n} free ports in {PORT_RANGE_ENV}={spec} on {host}")


def parse_port_range(spec: str) -> tuple[int, int]:
    """``"LO-HI"`` -> (LO, HI), both in 1..65535, LO <= HI; a ConfigError names the setting."""
    try:
        lo, hi = (int(part) for part in spec.split("-"))
    except ValueError:
        raise ConfigError(f"{PORT_RANGE_ENV}={spec!r}: expected LO-HI, e.g. 20000-25999") from None
    if not 1 <= lo <= hi <= 65535:
        raise ConfigError(f"{PORT_RANGE_ENV}={spec!r}: expected 1 <= LO <= HI <= 65535")
    return lo, hi


def _kernel_ports(n: int, host: str) -> list[int]:
    """``n`` ports the kernel picks (bound to port 0 together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_busy(host: str, port: int) -> bool:
    """True when something already listens on host:port (an address we cannot bind is
    someone else's machine: not ours to check)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Servers set SO_REUSEADDR too, so a port in TIME_WAIT is not reported as busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False
