"""Configuration: precedence (command line > environment > file > defaults), validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contracts.config import DEFAULT_TOKEN, DisaggConfig, ServiceConfig
from contracts.errors import ConfigError, DiffringError
from run_service import _parse, build_config


def write(tmp_path: Path, cfg: dict[str, object]) -> str:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"disagg_mode": "encoder", "model_path": "/file", "device": "cpu",
                            "server": {"port": 9000, "metric_port": 9100},
                            "disagg_config": {"cluster_token": "file-token"}})
    env = {"DIFFRING_MODEL_PATH": "/env", "DIFFRING_CLUSTER_TOKEN": "env-token",
           "MOONCAKE_CONFIG_PATH": "/env/mooncake.json"}
    service, cfg = build_config(_parse(["--config", path]), env)
    assert service == "encoder"
    assert cfg.model_path == "/env" and cfg.mooncake_config_path == "/env/mooncake.json"
    assert cfg.disagg_config.resolve_token(env) == "env-token"
    assert cfg.disagg_config.resolve_token({}) == "file-token"
    service, cfg = build_config(
        _parse(["--config", path, "--service", "decoder", "--model_path", "/cli",
                "--metric_port", "9200", "--device", "cuda:1"]), env)
    assert service == "decoder" and cfg.model_path == "/cli" and cfg.device == "cuda:1"
    assert cfg.server.metric_port == 9200 and cfg.server.port == 9000


def test_defaults() -> None:
    cfg = ServiceConfig()
    d = cfg.disagg_config
    assert (d.rdma_request_handshake_port, d.rdma_phase1_handshake_port,
            d.rdma_phase2_handshake_port) == (5566, 5567, 5568)
    assert d.rdma_buffer_slots == 128 and d.rdma_buffer_slot_size == 4096
    assert cfg.server.host == "127.0.0.1" and d.ring_address("phase1") == ("127.0.0.1", 5567)
    assert d.resolve_token({}) == DEFAULT_TOKEN


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"colour": 1}, "unknown config key config.colour"),
        ({"server": {"prt": 1}}, "unknown config key server.prt"),
        ({"disagg_config": {"rdma_buffer_slots": 1}}, "slot count"),
        ({"disagg_config": {"rdma_buffer_slot_size": 100}}, "multiple of 8"),
        ({"disagg_config": {"decentralized_queue": False}}, "decentralized queue"),
        ({"disagg_config": {"ring_transport": "udp"}}, "ring_transport"),
        ({"disagg_config": {"rdma_phase1_handshake_port": 5566}}, "must differ"),
        ({"model_cls": "wan2.1", "task": "t2i"}, "not served by model_cls"),
        ({"dtype": "float16"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"disagg_config": {"rdma_buffer_slots": "many"}}, "expected int"),
        ({"compile": True}, "compile needs warmup_shapes"),
        ({"warmup_shapes": ["480by832"]}, "not HxW or HxWxF"),
        ({"video_codec": "h265"}, "video_codec must be one of auto, libx264, h264_nvenc"),
        ({"video_preset": "quick"}, "video_preset must be one of ultrafast"),
        ({"video_crf": 60}, "video_crf must be within 0..51"),
        ({"encode_queue": -1}, "encode_queue must be >= 0"),
    ],
)
def test_bad_config_is_named(tmp_path: Path, cfg: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ServiceConfig.load(write(tmp_path, cfg))


def test_gpu_options_load(tmp_path: Path) -> None:
    cfg = ServiceConfig.load(write(tmp_path, {
        "compile": True, "cfg_batch": True, "warmup_shapes": ["480x832x81", "1024x1024"],
        "video_codec": "libx264", "video_preset": "medium", "video_crf": 23,
        "video_threads": 4, "encode_queue": 0}))
    assert cfg.compile and cfg.cfg_batch and cfg.warmup_shapes == ("480x832x81", "1024x1024")
    assert (cfg.video_codec, cfg.video_preset, cfg.video_crf, cfg.video_threads,
            cfg.encode_queue) == ("libx264", "medium", 23, 4, 0)
    defaults = ServiceConfig()
    assert not defaults.compile and not defaults.cfg_batch and defaults.encode_queue == 2


def test_missing_service_is_explained(tmp_path: Path) -> None:
    with pytest.raises(DiffringError, match="no service given"):
        build_config(_parse(["--config", write(tmp_path, {})]), {})


def test_lightx2v_room_keys_accepted() -> None:
    d = DisaggConfig.from_dict({"bootstrap_room": 0, "sender_engine_rank": 1})
    assert d == DisaggConfig()
