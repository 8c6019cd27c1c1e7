"""The suite's ports: the range its groups take, split between the pytest-xdist workers by
``tests/conftest.py`` (``pytest_configure``)."""

from __future__ import annotations

from pathlib import Path

TEST_PORTS = "20000-31999"
"""The ports the suite's groups take (``DIFFRING_PORT_RANGE``, unless the caller set its own):
below the kernel's usual ephemeral range (32768-60999, where bind-to-0 and outgoing
connections take theirs) and above Mooncake's (15000-16999), split between the pytest-xdist
workers. A loaded CI run once had a controller answer another worker's health check: both
had been given the same port."""


def ephemeral_start() -> int | None:
    """The first port of the kernel's ephemeral range (None: not Linux)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        return None
