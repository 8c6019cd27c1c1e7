"""free_ports with a port range of its own (DIFFRING_PORT_RANGE): groups started side by side
on one host, each from its own range, are never handed the same port."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from contracts.errors import ConfigError
from launcher import PORT_RANGE_ENV, free_ports
from launcher import ports as launcher_ports
from tests.support.ports import TEST_PORTS, ephemeral_start


@pytest.fixture
def port_range(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    """A range of 16 ports and a fresh hand-out record: between the suite's ranges (conftest's
    TEST_PORTS) and the kernel's ephemeral range, so no other test's server is on them."""
    lo = 32000 + 16 * (os.getpid() % 48)
    monkeypatch.setenv(PORT_RANGE_ENV, f"{lo}-{lo + 15}")
    monkeypatch.setattr(launcher_ports, "_handed_out", set())
    yield lo, lo + 15


def test_the_suite_runs_each_worker_in_a_range_of_its_own() -> None:
    """conftest's pytest_configure set it (on a Linux host whose ephemeral range starts
    above it): the check that the other tests here run under it."""
    spec = os.environ.get(PORT_RANGE_ENV)
    suite_lo, suite_hi = launcher_ports.parse_port_range(TEST_PORTS)
    eph_lo = ephemeral_start()
    if eph_lo is None or eph_lo <= suite_hi:
        pytest.skip(f"this host's kernel hands out ports from {eph_lo}")
    assert spec is not None
    lo, hi = launcher_ports.parse_port_range(spec)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    assert suite_lo <= lo <= hi <= suite_hi, (spec, TEST_PORTS)
    assert hi - lo + 1 == (suite_hi - suite_lo + 1) // workers, (spec, workers)


def test_ports_come_from_the_range_and_are_not_handed_out_twice(
        port_range: tuple[int, int]) -> None:
    lo, hi = port_range
    first = free_ports(5)
    second = free_ports(5)
    assert len(set(first + second)) == 10
    assert all(lo <= p <= hi for p in first + second)


def test_a_port_in_use_is_skipped(port_range: tuple[int, int]) -> None:
    lo, hi = port_range
    holders = []
    try:
        for port in range(lo, hi):  # all but the last one
            s = socket.socket()
            holders.append(s)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                pass  # taken by someone else: in use all the same
        assert free_ports(1) == [hi]
        with pytest.raises(OSError, match=f"fewer than 2 free ports in {PORT_RANGE_ENV}"):
            free_ports(2)
    finally:
        for s in holders:
            s.close()


def test_none_asked_none_given(port_range: tuple[int, int]) -> None:
    assert free_ports(0) == []


def test_a_used_up_range_hands_its_ports_out_again(port_range: tuple[int, int]) -> None:
    lo, hi = port_range
    assert sorted(free_ports(16)) == list(range(lo, hi + 1))
    assert len(set(free_ports(3))) == 3


@pytest.mark.parametrize("spec", ["20000", "a-b", "30000-20000", "0-10", "60000-70000"])
def test_a_bad_range_is_refused_with_the_setting_named(
        monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, spec)
    with pytest.raises(ConfigError, match=PORT_RANGE_ENV):
        free_ports(1)


def test_without_a_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
