"""``run_service.py --check``: each check fails (or warns) on the problem it is for.

Sockets: binds on 127.0.0.0/8 and one bind attempt on a documentation address (203.0.113.7,
never assigned here), which sends nothing; connections only to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contracts.config import DEFAULT_TOKEN, ServiceConfig
from doctor import Check, format_report, run_checks
from launcher import free_ports
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers

GOOD_TOKEN = "0123456789abcdef0123456789abcdef"


def controller_cfg(host: str = "127.0.0.10", **extra: Any) -> ServiceConfig:
    ctl, req, p1, p2, http, met = free_ports(6, "127.0.0.1")
    data = {
        "model_cls": "qwen_image", "task": "t2i",
        "disagg_config": {"bootstrap_addr": host, "control_port": ctl,
                          "rdma_request_handshake_port": req, "rdma_phase1_handshake_port": p1,
                          "rdma_phase2_handshake_port": p2, "ring_transport": "tcp"},
        "server": {"host": host, "port": http, "metric_port": met},
        **extra,
    }
    return ServiceConfig.from_dict(data)


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_controller_ports_and_token(tmp_path: Path) -> None:
    cfg = controller_cfg()
    checks = by_name(run_checks("controller", cfg, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert all(c.status == "ok" for c in checks.values()), format_report("c", [*checks.values()])
    assert {"bind front door", "bind control channel", "bind request ring", "bind phase1 ring",
            "bind phase2 ring", "bind metrics and probes"} <= set(checks)

    # A busy port is named, with the process holding it.
    with socket.socket() as s:
        s.bind(("127.0.0.10", cfg.disagg_config.control_port))
        s.listen()
        checks = by_name(run_checks("controller", cfg, GOOD_TOKEN, {},
                                    infiniband_dir=str(tmp_path)))
    c = checks["bind control channel"]
    assert c.status == "fail" and f"port {cfg.disagg_config.control_port}" in c.detail
    assert f"pid {os.getpid()}" in c.detail

    # The development token: a warning on loopback, a failure once anything is exposed.
    loop = by_name(run_checks("controller", cfg, DEFAULT_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert loop["token"].status == "warn"
    wide = controller_cfg(host="0.0.0.0")
    checks = by_name(run_checks("controller", wide, DEFAULT_TOKEN, {},
                                infiniband_dir=str(tmp_path)))
    assert checks["token"].status == "fail" and "0.0.0.0" in checks["token"].detail
    assert "DIFFRING_CLUSTER_TOKEN" in checks["token"].detail
    short = by_name(run_checks("controller", cfg, "abc", {}, infiniband_dir=str(tmp_path)))
    assert short["token"].status == "warn" and "3 characters" in short["token"].detail
    env = {"DIFFRING_CLUSTER_TOKEN": GOOD_TOKEN}
    ok = by_name(run_checks("controller", cfg, GOOD_TOKEN, env, infiniband_dir=str(tmp_path)))
    assert ok["token"].status == "ok" and "DIFFRING_CLUSTER_TOKEN" in ok["token"].detail
    assert GOOD_TOKEN not in format_report("controller", [*ok.values()])  # never printed


def test_address_not_of_this_host(tmp_path: Path) -> None:
    cfg = controller_cfg(host="203.0.113.7")
    checks = by_name(run_checks("controller", cfg, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert checks["bind front door"].status == "fail"
    assert "not an address of this host" in checks["bind front door"].detail


def fake_ib(root: Path, dev: str, port: int, state: str, link: str = "InfiniBand") -> None:
    p = root / dev / "ports" / str(port)
    p.mkdir(parents=True)
    (p / "state").write_text(f"{state}\n")
    (p / "phys_state").write_text("5: LinkUp\n" if "ACTIVE" in state else "3: Disabled\n")
    (p / "link_layer").write_text(f"{link}\n")
    (p / "rate").write_text("400 Gb/sec (4X NDR)\n")


def test_rdma_devices_and_mooncake_protocol(tmp_path: Path, tiny_models: Path) -> None:
    worker = {"model_path": str(tiny_models / "qwen_t2i")}
    none = tmp_path / "none"
    # rdma asked for, no device: both the rings and Mooncake fail clearly.
    cfg = controller_cfg(**worker)
    cfg = ServiceConfig.from_dict({**_raw(cfg), "disagg_config": {
        **_raw(cfg)["disagg_config"], "ring_transport": "rdma"}})
    checks = by_name(run_checks("transformer", cfg, GOOD_TOKEN, {"MOONCAKE_PROTOCOL": "rdma"},
                                infiniband_dir=str(none)))
    assert checks["rdma devices"].status == "fail" and "'rdma'" in checks["rdma devices"].detail
    assert checks["mooncake rdma"].status == "fail"
    assert checks["mooncake protocol"].detail.startswith("rdma")

    # Devices and their port states are listed; a DOWN port is a warning.
    ib = tmp_path / "ib"
    fake_ib(ib, "mlx5_0", 1, "4: ACTIVE")
    fake_ib(ib, "mlx5_1", 1, "1: DOWN", link="Ethernet")
    checks = by_name(run_checks("transformer", controller_cfg(**worker), GOOD_TOKEN,
                                {"MOONCAKE_PROTOCOL": "rdma", "MOONCAKE_DEVICE_NAME": "mlx5_0"},
                                infiniband_dir=str(ib)))
    assert checks["rdma mlx5_0 port 1"].status == "ok"
    assert "400 Gb/sec" in checks["rdma mlx5_0 port 1"].detail
    assert checks["rdma mlx5_1 port 1"].status == "warn"
    assert "Ethernet" in checks["rdma mlx5_1 port 1"].detail
    assert "mooncake rdma" not in checks  # an ACTIVE device named mlx5_0 exists
    checks = by_name(run_checks("transformer", controller_cfg(**worker), GOOD_TOKEN,
                                {"MOONCAKE_PROTOCOL": "rdma", "MOONCAKE_DEVICE_NAME": "mlx5_9"},
                                infiniband_dir=str(ib)))
    assert "mlx5_9" in checks["mooncake rdma"].detail
    # auto picks by the kernel's device list.
    checks = by_name(run_checks("transformer", controller_cfg(**worker), GOOD_TOKEN, {},
                                infiniband_dir=str(none)))
    assert checks["mooncake protocol"].detail.startswith("tcp")


def _raw(cfg: ServiceConfig) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(cfg)


def test_advertised_address(tmp_path: Path, tiny_models: Path) -> None:
    cfg = controller_cfg(model_path=str(tiny_models / "qwen_t2i"))
    bad = by_name(run_checks("decoder", cfg, GOOD_TOKEN,
                             {"MOONCAKE_LOCAL_HOSTNAME": "203.0.113.7"},
                             infiniband_dir=str(tmp_path)))
    assert bad["mooncake advertises"].status == "fail"
    assert "203.0.113.7 is not an address of this host" in bad["mooncake advertises"].detail
    wild = by_name(run_checks("decoder", cfg, GOOD_TOKEN, {"MOONCAKE_LOCAL_HOSTNAME": "0.0.0.0"},
                              infiniband_dir=str(tmp_path)))
    assert "every interface" in wild["mooncake advertises"].detail
    good = by_name(run_checks("decoder", cfg, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert good["mooncake advertises"].status == "ok"
    assert good["mooncake advertises"].detail.startswith("127.0.0.10 ")  # its server.host


def test_model_folder(tmp_path: Path, tiny_models: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_models / "wan_i2v", model)
    cfg = controller_cfg(model_path=str(model))
    cfg = ServiceConfig.from_dict({**_raw(cfg), "model_cls": "wan2.1", "task": "i2v"})
    for role in ("encoder", "transformer", "decoder"):
        c = by_name(run_checks(role, cfg, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
        assert c[f"model ({role})"].status == "ok", c[f"model ({role})"].detail
    # The transformer reads only the VAE's config: VAE weights missing fail the decoder only.
    (model / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    shutil.rmtree(model / "image_encoder")
    c = by_name(run_checks("transformer", cfg, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert c["model (transformer)"].status == "ok"
    c = by_name(run_checks("decoder", cfg, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert c["model (decoder)"].status == "fail"
    assert "vae (weights): no weight files" in c["model (decoder)"].detail
    c = by_name(run_checks("encoder", cfg, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert "image_encoder (weights): missing" in c["model (encoder)"].detail
    # A sharded checkpoint with a shard missing.
    t = model / "transformer"
    (t / "diffusion_pytorch_model.safetensors").rename(t / "part-1.safetensors")
    (t / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}))
    c = by_name(run_checks("transformer", cfg, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert "part-2.safetensors" in c["model (transformer)"].detail
    c = by_name(run_checks("transformer", ServiceConfig.from_dict(
        {**_raw(cfg), "model_path": None}), GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert "no model_path" in c["model (transformer)"].detail


def test_checkpoint_class(tmp_path: Path, tiny_models: Path) -> None:
    """--check says when the folder is a checkpoint of another pipeline than the config's,
    and what to set (the stages would refuse it at start)."""
    raw = {**_raw(controller_cfg(model_path=str(tiny_models / "qwen_i2i_plus"))),
           "model_cls": "qwen_image"}
    wrong = ServiceConfig.from_dict({**raw, "task": "i2i"})
    c = by_name(run_checks("encoder", wrong, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert c["checkpoint"].status == "fail"
    assert "QwenImageEditPlusPipeline checkpoint" in c["checkpoint"].detail
    assert "Set task to 'i2i_plus'" in c["checkpoint"].detail
    right = ServiceConfig.from_dict({**raw, "task": "i2i_plus"})
    c = by_name(run_checks("all", right, GOOD_TOKEN, {}, infiniband_dir=str(tmp_path)))
    assert c["checkpoint"].status == "ok"
    assert "zero_cond_t (Qwen-Image-Edit-2511 style), served as qwen_i2i_plus" in \
        c["checkpoint"].detail


def test_component_table_matches_what_the_stages_read(tiny_models: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """STAGE_COMPONENTS (what --check verifies) is exactly what each stage loads."""
    from workers.models import components, get_family
    from workers.models.base import StageAdapter
    from workers.models.components import STAGE_COMPONENTS

    read: dict[str, str] = {}
    component, config = StageAdapter._component, StageAdapter._config

    def rec_component(self: StageAdapter, loader: Any, name: str) -> Any:
        read[name] = "loaded"
        return component(self, loader, name)

    def rec_config(self: StageAdapter, name: str) -> Any:
        read.setdefault(name, components.CONFIG)
        return config(self, name)

    monkeypatch.setattr(StageAdapter, "_component", rec_component)
    monkeypatch.setattr(StageAdapter, "_config", rec_config)
    for task, roles in STAGE_COMPONENTS.items():
        family = get_family(task)
        for role, needs in roles.items():
            read.clear()
            getattr(family, role).for_task(tiny_models / task, task, "cpu", "float32").load()
            # FILE: read by the stage itself, not as a component; ON_DEMAND: by a request.
            want = {c: ("loaded" if k != components.CONFIG else k) for c, k in needs.items()
                    if k not in (components.FILE, components.ON_DEMAND)}
            assert read == want, (task, role, read)


def test_cli_exit_status(tmp_path: Path) -> None:
    cfg = controller_cfg()
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_raw(cfg)))
    env = {**os.environ, "DIFFRING_CLUSTER_TOKEN": GOOD_TOKEN}
    out = subprocess.run([sys.executable, "run_service.py", "--service", "controller",
                          "--config", str(path), "--check"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 failed" in out.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.10", cfg.server.port))
        s.listen()
        out = subprocess.run([sys.executable, "run_service.py", "--service", "controller",
                              "--config", str(path), "--check"], capture_output=True,
                             text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 1 and "FAIL" in out.stdout and "bind front door" in out.stdout
