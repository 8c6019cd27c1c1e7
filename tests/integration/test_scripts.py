"""Operator tooling: the example configs, the start scripts, the request scripts.

The start-script tests run ``scripts/server/disagg/qwen/start_qwen_t2i_disagg.sh`` on the tiny
models, in its own session (so a SIGINT reaches only the script), and check by pid that every
process it started is gone afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.config import ServiceConfig
from launcher import role_files
from tests.support.paths import ROOT
from tests.support.scripts import Launched, free_offset, launcher_env, pid_alive

pytestmark = pytest.mark.integration  # starts processes or servers

CONFIG_DIR = ROOT / "configs" / "disagg"
GROUPS = {"wan_t2v": "wan", "wan_i2v": "wan", "qwen_t2i": "qwen", "qwen_i2i": "qwen",
          "qwen_i2i_plus": "qwen", "wan22_a14b_t2v": "wan", "wan22_a14b_i2v": "wan",
          "wan22_5b_t2v": "wan", "wan22_5b_i2v": "wan"}
ROLES = ("controller", "encoder", "transformer", "decoder")
SPLIT = ("wan22_a14b_t2v", "wan22_a14b_i2v")
"""Groups with the split placement's two transformer files (``_transformer_{high,low}``)."""
START_T2I = ROOT / "scripts" / "server" / "disagg" / "qwen" / "start_qwen_t2i_disagg.sh"
POST_T2I = ("-m", "scripts.post.post_qwen_t2i")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def service_ports(cfg: ServiceConfig, role: str) -> set[int]:
    """Every port one service binds (or, for a worker, connects to and binds)."""
    d = cfg.disagg_config
    ports = {
        d.control_port,
        d.rdma_request_handshake_port,
        d.rdma_phase1_handshake_port,
        d.rdma_phase2_handshake_port,
    }
    if role == "controller":
        ports.add(cfg.server.port)
    if cfg.server.metric_port is not None:
        ports.add(cfg.server.metric_port)
    return ports


# ------------------------------------------------------------------------ configs (a)
def test_every_config_file_loads_and_groups_share_no_port() -> None:
    files = sorted(CONFIG_DIR.glob("*/*.json"))
    expected = {CONFIG_DIR / sub / f"{g}_{r}.json" for g, sub in GROUPS.items() for r in ROLES}
    expected |= {CONFIG_DIR / "wan" / f"{g}_transformer_{h}.json" for g in SPLIT
                 for h in ("high", "low")}
    assert set(files) == expected
    ports: dict[str, set[int]] = {g: set() for g in GROUPS}
    for path in files:
        cfg = ServiceConfig.load(str(path))  # unknown keys or bad values raise
        group, role = path.stem.removesuffix("_high").removesuffix("_low").rsplit("_", 1)
        assert cfg.pipeline == group, path
        ports[group] |= service_ports(cfg, role)
    for a in GROUPS:
        for b in GROUPS:
            if a < b:
                assert not ports[a] & ports[b], f"{a} and {b} share {ports[a] & ports[b]}"


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_group_is_consistent(group: str, tmp_path: Path) -> None:
    """Same pipeline, rings and results folder in all four files; no port used twice."""
    prep = role_files.prepare(group, CONFIG_DIR / GROUPS[group], tmp_path)
    assert prep.configs == {r: CONFIG_DIR / GROUPS[group] / f"{group}_{r}.json" for r in ROLES}
    ports = [port for _what, _host, port in prep.ports()]
    assert len(ports) == 9 and len(set(ports)) == 9  # front, control, 3 rings, 4 metrics
    assert not list(tmp_path.iterdir())  # nothing to override: the files are used as they are


@pytest.mark.parametrize("group", SPLIT)
def test_each_split_group_is_consistent(group: str, tmp_path: Path) -> None:
    """The split files: a high-noise and a low-noise transformer in place of the one, each
    with a metrics port of its own; 10 ports, none twice."""
    prep = role_files.prepare(group, CONFIG_DIR / "wan", tmp_path, split=True)
    keys = ("controller", "encoder", "transformer_high", "transformer_low", "decoder")
    assert prep.configs == {k: CONFIG_DIR / "wan" / f"{group}_{k}.json" for k in keys}
    assert [prep.loaded[k].transformer.experts for k in keys[2:4]] == ["high", "low"]
    ports = [port for _what, _host, port in prep.ports()]
    assert len(ports) == 10 and len(set(ports)) == 10
    shifted = role_files.prepare(group, CONFIG_DIR / "wan", tmp_path / "b", port_offset=7,
                                 split=True)
    assert [p + 7 for p in ports] == [p for *_, p in shifted.ports()]


def test_a_split_group_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    """Split on a group of one DiT, a missing half, a half with the wrong expert, a split
    transformer file in a group of one DiT worker, two devices without --split."""
    import argparse

    from launcher.launch import LaunchError, resolve_devices

    with pytest.raises(role_files.GroupError, match="wan22_5b_t2v has one DiT"):
        role_files.prepare("wan22_5b_t2v", CONFIG_DIR / "wan", tmp_path, split=True)
    for role in (*ROLES, "transformer_high"):
        shutil.copy(CONFIG_DIR / "wan" / f"wan22_a14b_t2v_{role}.json", tmp_path)
    with pytest.raises(role_files.GroupError, match=r"missing .*transformer_low\.json"):
        role_files.prepare("wan22_a14b_t2v", tmp_path, tmp_path / "logs", split=True)
    shutil.copy(tmp_path / "wan22_a14b_t2v_transformer_high.json",
                tmp_path / "wan22_a14b_t2v_transformer_low.json")
    with pytest.raises(role_files.GroupError, match="low-noise worker needs"):
        role_files.prepare("wan22_a14b_t2v", tmp_path, tmp_path / "logs", split=True)
    low = tmp_path / "wan22_a14b_t2v_transformer_low.json"
    low.write_text(low.read_text().replace('"high"', '"low"'))
    with pytest.raises(role_files.GroupError, match="port 18021 is used twice: transformer "
                       "high metrics and transformer low metrics"):
        role_files.prepare("wan22_a14b_t2v", tmp_path, tmp_path / "logs", split=True)
    shutil.copy(tmp_path / "wan22_a14b_t2v_transformer_high.json",
                tmp_path / "wan22_a14b_t2v_transformer.json")
    with pytest.raises(role_files.GroupError, match=r"starts one DiT worker.*--split"):
        role_files.prepare("wan22_a14b_t2v", tmp_path, tmp_path / "logs")

    def devices(value: str | None, split: bool) -> dict[str, str]:
        args = argparse.Namespace(encoder_device=None, transformer_device=value,
                                  decoder_device=None, split=split)
        return resolve_devices(args, gpu_count=lambda: 4)

    with pytest.raises(LaunchError, match="two devices, HIGH,LOW, are for a split group"):
        devices("1,2", split=False)
    assert devices("1,cuda:3", split=True) == {"encoder": "cuda:0", "transformer_high": "cuda:1",
                                               "transformer_low": "cuda:3", "decoder": "cuda:0"}
    assert devices(None, split=True)["transformer_low"] == "cuda:2"
    assert devices("cpu", split=True)["transformer_low"] == "cpu"


def test_ports_follow_lightx2v_table() -> None:
    """Front door where LightX2V's clients post (its encoder API port); stage metrics 10000
    above LightX2V's stage API ports except where that collides with another group."""
    expect = {  # front door, metrics of controller / encoder / transformer / decoder
        "wan_t2v": (8002, 18102, 18002, 18003, 18006),
        "wan_i2v": (8004, 18104, 18004, 18005, 18007),
        "qwen_t2i": (8008, 18108, 18009, 18010, 18008),
        "qwen_i2i": (8012, 18112, 18012, 18013, 18014),
        # diffring's own group (LightX2V runs 2509 / 2511 as its i2i task): the next free ports.
        "qwen_i2i_plus": (8016, 18116, 18016, 18017, 18018),
        # Wan2.2: LightX2V publishes no disaggregation example: the next free ports.
        "wan22_a14b_t2v": (8020, 18120, 18020, 18021, 18022),
        "wan22_a14b_i2v": (8024, 18124, 18024, 18025, 18026),
        "wan22_5b_t2v": (8028, 18128, 18028, 18029, 18030),
        "wan22_5b_i2v": (8032, 18132, 18032, 18033, 18034),
    }
    for group, (front, *metrics) in expect.items():
        cfgs = {
            r: ServiceConfig.load(str(CONFIG_DIR / GROUPS[group] / f"{group}_{r}.json"))
            for r in ROLES
        }
        assert cfgs["controller"].server.port == front
        assert [cfgs[r].server.metric_port for r in ROLES] == metrics
        assert cfgs["controller"].server.host == "127.0.0.1"


def test_port_offset_shifts_every_port(tmp_path: Path) -> None:
    base = role_files.prepare("wan_i2v", CONFIG_DIR / "wan", tmp_path / "a")
    shifted = role_files.prepare(
        "wan_i2v", CONFIG_DIR / "wan", tmp_path / "b", port_offset=1000, output_dir="res"
    )
    assert [p + 1000 for *_, p in base.ports()] == [p for *_, p in shifted.ports()]
    for role in ROLES:
        path = shifted.configs[role]
        assert path.parent == tmp_path / "b" / "config"
        assert ServiceConfig.load(str(path)).disagg_config == shifted.loaded[role].disagg_config
    assert shifted.loaded["decoder"].output_dir == shifted.loaded["controller"].output_dir == "res"


def test_inconsistent_group_is_refused(tmp_path: Path) -> None:
    for role in ROLES:
        shutil.copy(CONFIG_DIR / "qwen" / f"qwen_i2i_{role}.json", tmp_path)
    path = tmp_path / "qwen_i2i_transformer.json"
    data = json.loads(path.read_text())
    data["disagg_config"]["rdma_buffer_slots"] = 64
    path.write_text(json.dumps(data))
    with pytest.raises(role_files.GroupError, match="disagg_config differs"):
        role_files.prepare("qwen_i2i", tmp_path, tmp_path / "logs")


def test_mooncake_config_file() -> None:
    from tensorplane.engine import MooncakeSettings

    path = ROOT / "configs" / "mooncake_config.json"
    # No local_hostname: each service advertises its own address unless told otherwise
    # (a shared file saying 127.0.0.1 would break every group spanning hosts).
    assert json.loads(path.read_text()) == {
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "device_name": "",
    }
    settings = MooncakeSettings.resolve(str(path), {}, defaults={"local_hostname": "10.0.0.7"})
    assert (settings.protocol, settings.metadata_server) == ("tcp", "P2PHANDSHAKE")
    assert settings.local_hostname == "10.0.0.7"  # the service's own address
    env = {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.8"}
    assert MooncakeSettings.resolve(str(path), env, defaults={"local_hostname": "10.0.0.7"}
                                    ).local_hostname == "10.0.0.8"  # environment wins
    override = MooncakeSettings.resolve(str(path), {"MOONCAKE_PROTOCOL": "rdma"})
    assert override.protocol == "rdma"  # environment over file


def test_readme_documents_every_config_field() -> None:
    import dataclasses

    from contracts.config import DisaggConfig, ServerConfig

    readme = (ROOT / "docs" / "configuration.md").read_text()
    start = readme.index("## Configuration reference")
    section = readme[start : readme.index("\n## ", start + 1)]
    for cls in (ServiceConfig, DisaggConfig, ServerConfig):
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in section, f"{cls.__name__}.{field.name} undocumented"
    for var in (
        "MOONCAKE_CONFIG_PATH",
        "MOONCAKE_PROTOCOL",
        "MOONCAKE_METADATA_SERVER",
        "MOONCAKE_DEVICE_NAME",
        "MOONCAKE_LOCAL_HOSTNAME",
        "DIFFRING_CONFIG",
        "DIFFRING_MODEL_PATH",
        "DIFFRING_CLUSTER_TOKEN",
    ):
        assert var in section, var


# -------------------------------------------------------------------- start script (b)
@pytest.fixture
def launched() -> Iterator[list[Launched]]:
    started: list[Launched] = []
    try:
        yield started
    finally:
        for item in started:
            item.cleanup()


@pytest.mark.timeout(600)  # four services starting on a loaded machine
def test_qwen_t2i_start_script_serves_and_stops_on_sigint(
    tiny_models: Path, tmp_path: Path, launched: list[Launched]
) -> None:
    t0 = time.monotonic()
    offset = free_offset("qwen_t2i", "qwen")
    url = f"http://127.0.0.1:{8008 + offset}"
    group = Launched(
        START_T2I, launcher_env(tmp_path, tiny_models / "qwen_t2i", offset), tmp_path / "logs"
    )
    launched.append(group)
    group.wait_for("group ready", timeout=300)  # four services starting on a loaded machine
    t_ready = time.monotonic() - t0
    out = group.output()
    for port in (8008, 18108, 18009, 18010, 18008):
        assert f"127.0.0.1:{port + offset}" in out  # front door and the four metrics URLs
    pids = group.pids()
    assert sorted(pids) == sorted(ROLES)

    result = tmp_path / "client" / "cat.png"
    post = subprocess.run(
        [
            sys.executable,
            *POST_T2I,
            "--url",
            url,
            "--prompt",
            "a tiny cat",
            "--height",
            "32",
            "--width",
            "48",
            "--steps",
            "2",
            "--seed",
            "3",
            "--task-id",
            "script-t2i",
            "--out",
            str(result),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert post.returncode == 0, post.stderr
    assert post.stdout.strip().splitlines()[-1] == str(result.resolve())
    assert result.read_bytes().startswith(PNG_MAGIC)
    assert not list(result.parent.glob("*.part"))

    refused = subprocess.run(  # the server's message comes through, with a non-zero exit
        [
            sys.executable,
            *POST_T2I,
            "--url",
            url,
            "--steps",
            "0",
            "--out",
            str(tmp_path / "never.png"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "HTTP 422" in refused.stderr and "infer_steps" in refused.stderr
    assert not (tmp_path / "never.png").exists()

    t_stop = time.monotonic()
    os.kill(group.proc.pid, signal.SIGINT)
    assert group.proc.wait(180) == 130  # a bound: each service drains on SIGTERM
    t_stopped = time.monotonic() - t_stop
    left = {role: pid for role, pid in pids.items() if pid_alive(pid)}
    assert not left, f"left running: {left}\n{group.output()}"
    out = group.output()
    assert out.index("stopping workers") < out.index("stopping controller")
    assert "group stopped" in out and "SIGKILL" not in out  # each service drained on SIGTERM
    print(
        f"ready after {t_ready:.1f} s, stopped {t_stopped:.1f} s after SIGINT, "
        f"total {time.monotonic() - t0:.1f} s"
    )


@pytest.mark.timeout(600)  # four services starting on a loaded machine
def test_start_script_reports_a_service_dying_at_startup(
    tiny_models: Path, tmp_path: Path, launched: list[Launched]
) -> None:
    """The transformer cannot load its model: the launcher prints its log tail, stops the
    others and exits 1, leaving no process behind."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models / "qwen_t2i", broken)
    shutil.rmtree(broken / "transformer")
    offset = free_offset("qwen_t2i", "qwen")
    group = Launched(START_T2I, launcher_env(tmp_path, broken, offset), tmp_path / "logs")
    launched.append(group)
    assert group.proc.wait(300) == 1
    out = group.output()
    assert "transformer (pid" in out and "exited with status" in out
    assert "'transformer'" in out  # the log tail names the missing component
    assert "group ready" not in out
    pids = group.pids()
    assert sorted(pids) == sorted(ROLES)
    assert not [pid for pid in pids.values() if pid_alive(pid)]


def test_start_script_refuses_busy_ports(tmp_path: Path, launched: list[Launched]) -> None:
    import socket

    offset = free_offset("qwen_t2i", "qwen")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 5587 + offset))  # the phase1 ring's port
        s.listen()
        group = Launched(START_T2I, launcher_env(tmp_path, tmp_path, offset), tmp_path / "logs")
        launched.append(group)
        assert group.proc.wait(60) == 1
    out = group.output()
    assert f"port {5587 + offset} (phase1 ring handshake" in out and "PORT_OFFSET" in out
    assert group.pids() == {}
