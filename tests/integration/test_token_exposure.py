"""A service reachable from other machines refuses the public development token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contracts.cluster_token import DEFAULT_TOKEN, is_loopback, require_token
from contracts.config import ServiceConfig
from contracts.errors import ConfigError
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("10.0.0.7", False),
    ("node-1", False), ("192.168.1.2", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_require_token_names_the_address_and_the_fix() -> None:
    require_token(DEFAULT_TOKEN, {"server.host": "127.0.0.1"}, "controller")
    require_token("a-real-secret", {"server.host": "0.0.0.0"}, "controller")
    with pytest.raises(ConfigError) as err:
        require_token(DEFAULT_TOKEN, {"disagg_config.bootstrap_addr": "10.0.0.7"}, "encoder")
    msg = str(err.value)
    assert "disagg_config.bootstrap_addr='10.0.0.7'" in msg and "DIFFRING_CLUSTER_TOKEN" in msg


def test_addresses_of_each_service() -> None:
    cfg = ServiceConfig.from_dict({"disagg_config": {"rdma_phase1_host": "10.1.1.1"},
                                   "server": {"host": "0.0.0.0"}})
    ctl = cfg.addresses("controller")
    assert ctl["disagg_config.rdma_phase1_host"] == "10.1.1.1"
    assert ctl["server.host"] == "0.0.0.0"
    assert "server.host" not in cfg.addresses("encoder")  # no metrics port: binds nothing
    assert cfg.addresses("all") == {"server.host": "0.0.0.0"}  # no rings, no control


def run(
    service: str, cfg: dict[str, Any], tmp_path: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{service}.json"
    path.write_text(json.dumps(cfg))
    clean = {k: v for k, v in os.environ.items()
             if k not in ("DIFFRING_CLUSTER_TOKEN", "MOONCAKE_LOCAL_HOSTNAME")}
    return subprocess.run(
        [sys.executable, "run_service.py", "--service", service, "--config", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env={**clean, **env},
    )


@pytest.mark.parametrize(("service", "cfg", "env"), [
    ("controller", {"server": {"host": "0.0.0.0"}}, {}),
    ("controller", {"disagg_config": {"bootstrap_addr": "10.0.0.7"}}, {}),
    ("encoder", {"disagg_config": {"rdma_request_host": "10.0.0.7"}}, {}),
    ("decoder", {}, {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.8"}),
    ("all", {"server": {"host": "0.0.0.0"}}, {}),
])
def test_exposed_service_refuses_the_development_token(
    service: str, cfg: dict[str, Any], env: dict[str, str], tmp_path: Path
) -> None:
    proc = run(service, {"model_path": str(tmp_path), **cfg}, tmp_path, **env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "public development default" in proc.stderr
    assert "DIFFRING_CLUSTER_TOKEN" in proc.stderr


def test_exposed_service_starts_with_a_real_token(tmp_path: Path) -> None:
    """Same exposed address, a token set: the check passes and the service goes on (to the
    next refusal here: the model folder is empty)."""
    proc = run("encoder", {"model_path": str(tmp_path),
                           "disagg_config": {"rdma_request_host": "10.0.0.7"}},
               tmp_path, DIFFRING_CLUSTER_TOKEN="s3cret-token-for-this-group")
    assert "public development default" not in proc.stderr
    assert proc.returncode != 0 and str(tmp_path) in proc.stderr
