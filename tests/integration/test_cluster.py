"""A group spread over addresses as if over hosts, and the transport preflight.

Every service gets its own loopback address (127.0.0.0/8 is all loopback on Linux): the
controller 127.0.0.10, the encoder .11, two transformers .12 and .13, the decoder .14. Each
must bind and advertise only its own address, and the decoder keeps its results in a folder
of its own: the controller serves what the decoder sent it, not a shared folder.

Every process is started by the test and stopped by it, by pid (LocalGroup.stop).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.errors import ControlRefused, PreflightFailed
from contracts.messages import Endpoint, Heartbeat, HeartbeatReply, Preflight, PreflightReply
from launcher import MULTI_HOST, LocalGroup, group_config, submit
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers

PIPELINE = "wan_i2v"  # image-conditioned: the controller's own Mooncake segment is used too
SMALL = {"height": 32, "width": 32, "target_video_length": 5, "infer_steps": 2,
         "target_fps": 8}


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = parts[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, words)
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            out.add((addr, int(hexport, 16)))
    return out


def test_loopback_aliases_work_without_setup() -> None:
    """127.0.0.10-14 bind and connect on a stock Linux loopback (no ip addr add needed)."""
    for host in ("127.0.0.10", "127.0.0.14"):
        with socket.socket() as srv:
            srv.bind((host, 0))
            srv.listen()
            with socket.create_connection((host, srv.getsockname()[1]), timeout=5):
                pass


@pytest.mark.timeout(600)
def test_multi_host_group(tiny_models: Path, input_png: bytes, tmp_path: Path) -> None:
    cfg = group_config(PIPELINE, str(tiny_models / PIPELINE), tmp_path,
                       host=MULTI_HOST["controller"][0])
    ctl_metrics = _free(MULTI_HOST["controller"][0])
    with LocalGroup(cfg, tmp_path, hosts=MULTI_HOST) as group:
        ctl = group.start("controller", {"server": {"metric_port": ctl_metrics}})
        group.wait_http(timeout=120)
        workers = [group.start(role) for role in ("encoder", "transformer", "transformer",
                                                   "decoder")]
        group.wait_workers({"encoder": 1, "transformer": 2, "decoder": 1}, timeout=300)
        assert group.url.startswith("http://127.0.0.10:")

        body = {"prompt": "two hosts", "seed": 3, **SMALL,
                "image_path": base64.b64encode(input_png).decode()}
        results = []
        for i in range(2):
            st = submit(group.url, "video", {**body, "task_id": f"mh-{i}"}, timeout=300)
            assert st["status"] == "completed", st
            r = httpx.get(f"{group.url}/v1/tasks/mh-{i}/result", timeout=30)
            assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
            results.append(r.content)

        # Served by the controller from its own folder; the decoder kept its copy in its own.
        ctl_dir = Path(cfg["output_dir"])
        dec_dir = tmp_path / "127.0.0.14" / "decoder-0-results"
        for i, data in enumerate(results):
            assert (ctl_dir / f"mh-{i}.mp4").read_bytes() == data
            assert (dec_dir / f"mh-{i}.mp4").read_bytes() == data
        assert ctl_dir.resolve() != dec_dir.resolve()

        # Each worker advertises its own address (Mooncake segment host), and registered
        # after the controller connected back to it.
        status = httpx.get(f"{group.url}/v1/service/status", timeout=10).json()
        seen = {w["pid"]: w["segment"] for ws in status["workers"].values() for w in ws}
        own = {svc.proc.pid: group_host(svc) for svc in workers}
        for pid, host in own.items():
            assert seen[pid].rsplit(":", 1)[0] == host, (pid, seen[pid], host)
        ctl_log = ctl.log()
        for host in own.values():
            assert re.search(rf"preflight of \S+: reached Mooncake segment {host}:\d+", ctl_log)
        # The controller's own segment (the staged input images) advertises its address.
        assert "mooncake engine started: session 127.0.0.10:" in ctl_log

        # Listeners: everything a service binds itself is on its own address. Mooncake
        # (which offers no bind-address setting) listens on every interface: its handshake
        # port (the segment's) and one data port, nothing else.
        for svc in [ctl, *workers]:
            host = MULTI_HOST["controller"][0] if svc is ctl else own[svc.proc.pid]
            socks = listeners(svc.proc.pid)
            wild = {(a, p) for a, p in socks if a in ("0.0.0.0", "::")}
            assert all(a == host for a, _p in socks - wild), (svc.role, socks, host)
            assert len(wild) <= 2, (svc.role, wild)
            if svc is not ctl:
                rpc = int(seen[svc.proc.pid].rsplit(":", 1)[1])
                assert rpc in {p for _a, p in wild}, (svc.role, wild, rpc)
                port = group_metric_port(svc)
                assert (host, port) in socks
                for path in ("/ready", "/live"):
                    r = httpx.get(f"http://{host}:{port}{path}", timeout=10)
                    assert r.status_code == 200 and r.json()["state"] == "running", r.text
        d = cfg["disagg_config"]
        ctl_ports = {cfg["server"]["port"], ctl_metrics, d["control_port"],
                     d["rdma_request_handshake_port"], d["rdma_phase1_handshake_port"],
                     d["rdma_phase2_handshake_port"]}
        assert {("127.0.0.10", p) for p in ctl_ports} <= listeners(ctl.proc.pid)
        r = httpx.get(f"http://127.0.0.10:{ctl_metrics}/ready", timeout=10)
        assert r.status_code == 200


def _free(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _service_config(svc: Any) -> dict[str, Any]:
    import json

    return dict(json.loads(svc.log_path.with_suffix(".json").read_text()))


def group_host(svc: Any) -> str:
    return str(_service_config(svc)["server"]["host"])


def group_metric_port(svc: Any) -> int:
    return int(_service_config(svc)["server"]["metric_port"])


# -- the preflight --------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_wrong_advertised_address_is_refused(tiny_models: Path, tmp_path: Path) -> None:
    """A worker advertising an address the controller cannot reach exits at start-up with
    a message naming the address and what failed; it never registers, and it finds out
    before loading its model."""
    cfg = group_config("qwen_t2i", str(tiny_models / "qwen_t2i"), tmp_path,
                       host="127.0.0.10")
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http(timeout=120)
        # 127.255.255.255 is the broadcast address of the loopback network: no TCP peer can
        # be reached there, and no packet leaves this machine trying.
        group.env = {"MOONCAKE_LOCAL_HOSTNAME": "127.255.255.255"}
        # Weights that cannot load: had the model load come first, it would have failed.
        model = tmp_path / "not-loadable"
        shutil.copytree(tiny_models / "qwen_t2i", model)
        (model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"junk")
        bad = group.start("transformer", {"server": {"host": "127.0.0.12"},
                                          "model_path": str(model)})
        rc = bad.proc.wait(timeout=240)
        log = bad.log()
        assert rc != 0, log
        line = next(ln for ln in log.splitlines() if ln.startswith("error:"))
        assert "refuses to register" in line and "127.255.255.255:" in line, line
        assert "could not connect to" in line and "Network is unreachable" in line, line
        assert "MOONCAKE_LOCAL_HOSTNAME" in line, line
        assert "could not load" not in log, log  # the model load was never reached
        status = httpx.get(f"{group.url}/v1/service/status", timeout=10).json()
        assert status["workers"]["transformer"] == []
        group.services.remove(bad)  # exited already: nothing left to stop


def test_controller_connect_back(controller: Any) -> None:
    """The control-channel op itself: reachable endpoints pass, a closed port is refused
    with the address and the reason."""
    from tests.support.controller import TOKEN
    from workers.control import ControlClient

    port = controller.config["disagg_config"]["control_port"]
    client = ControlClient("127.0.0.1", port, TOKEN, timeout=30)
    client.connect("transformer")
    try:
        with socket.socket() as srv:
            srv.bind(("127.0.0.12", 0))
            srv.listen()
            open_port = srv.getsockname()[1]
            reply = client.call(Preflight(role="transformer", name="t-1", endpoints=[
                Endpoint(what="Mooncake segment", host="127.0.0.12", port=open_port)]),
                PreflightReply)
            assert reply.checked[0].port == open_port
        closed = _free("127.0.0.13")
        with pytest.raises(ControlRefused) as err:
            client.call(Preflight(role="transformer", name="t-2", endpoints=[
                Endpoint(what="Mooncake segment", host="127.0.0.13", port=closed)]),
                PreflightReply)
        msg = str(err.value)
        assert f"127.0.0.13:{closed}" in msg and "Connection refused" in msg and "t-2" in msg
        # The connection stays usable: a refused preflight is an answer, not a drop.
        with pytest.raises(ControlRefused, match="before register"):
            client.call(Heartbeat(tasks=[], staged=[]), HeartbeatReply)
    finally:
        client.close()


def test_loopback_read_and_on_paper_checks() -> None:
    """The worker-side checks with a real Mooncake engine (no controller needed)."""
    from tensorplane.engine import MooncakeSettings, TransferEngine
    from tensorplane.pool import StagingPool
    from workers import preflight

    def engine(host: str) -> tuple[TransferEngine, StagingPool]:
        e = TransferEngine(MooncakeSettings(local_hostname=host, protocol="tcp"), timeout_s=10)
        e.start()
        p = StagingPool(1 << 20)
        p.start(e)
        return e, p

    e, p = engine("127.0.0.12")
    try:
        assert preflight.loopback_read(e, p, "w") < 10
        preflight.check_on_paper(e, "127.0.0.10", "w")  # loopback with a loopback controller
        with pytest.raises(PreflightFailed, match=r"loopback address.*10\.1\.2\.3"):
            preflight.check_on_paper(e, "10.1.2.3", "w")
        assert p.stats().live_blocks == 0
    finally:
        p.close()
        e.close()
    e, p = engine("127.255.255.255")
    try:
        with pytest.raises(PreflightFailed, match=r"own segment 127\.255\.255\.255:\d+"):
            preflight.loopback_read(e, p, "w")
        assert p.stats().live_blocks == 0
    finally:
        p.close()
        e.close()
    e, p = engine("0.0.0.0")
    try:
        with pytest.raises(PreflightFailed, match="every interface"):
            preflight.check_on_paper(e, "127.0.0.10", "w")
    finally:
        p.close()
        e.close()


def test_default_advertised_host() -> None:
    from contracts.addresses import default_advertised_host
    from contracts.config import ServiceConfig
    from contracts.errors import ConfigError

    def cfg(host: str, boot: str) -> ServiceConfig:
        return ServiceConfig.from_dict({"server": {"host": host},
                                        "disagg_config": {"bootstrap_addr": boot}})

    assert default_advertised_host(cfg("10.0.0.7", "10.0.0.1"), controller=False) == "10.0.0.7"
    assert default_advertised_host(cfg("0.0.0.0", "10.0.0.1"), controller=True) == "10.0.0.1"
    assert default_advertised_host(cfg("0.0.0.0", "127.0.0.1"), controller=False) == "127.0.0.1"
    with pytest.raises(ConfigError, match="MOONCAKE_LOCAL_HOSTNAME"):
        default_advertised_host(cfg("0.0.0.0", "ctl.example"), controller=False)
    with pytest.raises(ConfigError, match="MOONCAKE_LOCAL_HOSTNAME"):
        default_advertised_host(cfg("::", "0.0.0.0"), controller=True)


def test_worker_exits_when_nothing_to_advertise(tmp_path: Path) -> None:
    """Bound to every interface, controller on another host, no MOONCAKE_LOCAL_HOSTNAME:
    refused at start-up with what to set (not a silent 127.0.0.1)."""
    import json

    path = tmp_path / "w.json"
    path.write_text(json.dumps({"server": {"host": "0.0.0.0"}, "model_path": str(tmp_path),
                                "disagg_config": {"bootstrap_addr": "ctl.invalid"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env["DIFFRING_CLUSTER_TOKEN"] = "a-real-secret-" + "x" * 32  # past the token check
    out = subprocess.run([sys.executable, "run_service.py", "--service", "encoder", "--config",
                          str(path)], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "MOONCAKE_LOCAL_HOSTNAME" in out.stderr and "ctl.invalid" in out.stderr
