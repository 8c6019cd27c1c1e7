"""LightX2V's stage configs read as they are (contracts/lightx2v.py): every key of its
published Wan and Qwen-Image disaggregation configs is mapped to a diffring setting or
reported as ignored with the reason; every problem of a file is reported at once, each with
where the setting lives; a folder of its stage files starts as a group (launcher)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contracts.config import ServiceConfig
from contracts.errors import ConfigError
from contracts.lightx2v import LIGHTX2V_KEYS
from tests.support.scripts import lightx2v_stage_configs

CONFIGS = lightx2v_stage_configs()
# The published Wan files leave model_cls / task to LightX2V's command line.
PIPELINE = {"wan_t2v": ("wan2.1", "t2v"), "wan_i2v": ("wan2.1", "i2v"),
            "qwen_image_t2i": ("qwen_image", "t2i"), "qwen_image_i2i": ("qwen_image", "i2i")}


def load(name: str, **changes: Any) -> ServiceConfig:
    model_cls, task = PIPELINE[name.rsplit("_disagg", 1)[0]]
    return ServiceConfig.from_dict({**CONFIGS[name], "model_cls": model_cls, "task": task,
                                    **changes})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_published_key_is_mapped_or_ignored_with_a_reason(name: str) -> None:
    cfg = load(name)
    noted = {n.key for n in cfg.lightx2v}
    own = {"task", "disagg_mode", "model_cls", "dit_original_ckpt"}  # diffring's keys too
    for key, value in CONFIGS[name].items():
        if key == "disagg_config":
            assert {f"disagg_config.{k}" for k in value} - {"disagg_config.bootstrap_addr"} \
                <= noted
        else:
            assert key in noted or key in own, key
    for note in cfg.lightx2v:
        assert note.to is not None or note.why, note  # an ignored key says why
        assert note.key.split(".")[-1] in LIGHTX2V_KEYS or note.key.startswith("disagg_config")


def test_wan_knobs_land_in_request_defaults_and_stage_options() -> None:
    dit = load("wan_t2v_disagg_transformer")
    assert dit.request_defaults == {"infer_steps": 50, "num_frames": 81, "height": 480,
                                    "width": 832, "guidance_scale": 5, "fps": 16,
                                    "max_sequence_length": 512}
    assert dit.transformer.flow_shift == 5.0  # sample_shift
    assert (dit.attention_backend, dit.attention_fallback) == ("sage_attn", "sdpa")
    assert dit.mooncake == {"protocol": "rdma", "local_hostname": "localhost",
                            "metadata_server": "P2PHANDSHAKE"}
    enc = load("wan_t2v_disagg_encoder")
    assert enc.attention_backend == "sdpa"  # the encoder's kernel keys name no DiT
    assert enc.transformer.flow_shift is None
    i2v = load("wan_i2v_disagg_transformer")
    assert (i2v.request_defaults["infer_steps"], i2v.transformer.flow_shift) == (40, 3.0)
    off = load("wan_t2v_disagg_transformer", cpu_offload=True, enable_cfg=False)
    assert off.transformer.offload == "block"
    assert off.request_defaults["guidance_scale"] == 1.0  # enable_cfg false: guidance off


def test_qwen_knobs() -> None:
    dit = load("qwen_image_t2i_disagg_transformer")
    assert dit.request_defaults == {"infer_steps": 50, "num_frames": 1, "height": 1536,
                                    "width": 2752, "true_cfg_scale": 4.0}
    assert dit.attention_backend == "flash_attn"
    assert dit.dit_original_ckpt == "/path/to/qwen-2512/dit.safetensors"
    assert dit.mooncake["device_name"] == ""
    why = {n.key: n.why for n in dit.lightx2v}
    assert "target_height / target_width win" in why["aspect_ratio"]
    assert "max_sequence_length" in why["text_len"]
    edit = load("qwen_image_i2i_disagg_encoder")
    assert "height" not in edit.request_defaults  # an edit's size follows its input image
    sized = {k: v for k, v in CONFIGS["qwen_image_t2i_disagg_encoder"].items()
             if k not in ("target_height", "target_width")}
    ratio = ServiceConfig.from_dict({**sized, "model_cls": "qwen_image"})
    assert ratio.request_defaults["aspect_ratio"] == "16:9"  # LightX2V's 1664x928


def test_every_problem_of_a_file_at_once_each_saying_where_it_lives() -> None:
    data = {**CONFIGS["wan_t2v_disagg_transformer"], "self_attn_1_type": "radial_attn",
            "guidance_scale": 5.0, "offload": "block", "port": 8002,
            "server": {"metric_port": 18003, "offload": "leaf"},
            "transformer": {"lease_timeout_s": 3.0}}
    with pytest.raises(ConfigError) as err:
        ServiceConfig.from_dict(data)
    text = str(err.value)
    assert text.startswith("6 problems:"), text
    for line in ("self_attn_1_type = 'radial_attn': no diffring attention backend",
                 "config.guidance_scale: it lives in request_defaults.guidance_scale",
                 "config.offload: it lives in the encoder / transformer / decoder section",
                 "config.port: it lives in server.port",
                 "server.offload: it lives in the encoder / transformer / decoder section",
                 "transformer.lease_timeout_s: it lives in config.lease_timeout_s"):
        assert line in text, (line, text)


def test_bad_request_defaults_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"request_defaults: .*infer_steps must be between"):
        load("wan_t2v_disagg_transformer", infer_steps=0)
    with pytest.raises(ConfigError, match="max_sequence_length must be 512 for wan_i2v"):
        load("wan_i2v_disagg_transformer", text_len=256)
    with pytest.raises(ConfigError, match="flow_shift is the Wan scheduler's"):
        ServiceConfig.from_dict({"model_cls": "qwen_image", "task": "t2i",
                                 "transformer": {"flow_shift": 3.0}})


def test_mooncake_keys_rank_below_the_environment_above_the_file(tmp_path: Path) -> None:
    from tensorplane.engine import MooncakeSettings

    file = tmp_path / "mooncake.json"
    file.write_text(json.dumps({"protocol": "tcp", "metadata_server": "etcd://h:2379"}))
    cfg = load("wan_t2v_disagg_encoder")
    s = MooncakeSettings.resolve(str(file), {}, service=cfg.mooncake)
    assert (s.protocol, s.metadata_server, s.local_hostname) == (
        "rdma", "P2PHANDSHAKE", "localhost")
    s = MooncakeSettings.resolve(str(file), {"MOONCAKE_PROTOCOL": "tcp"}, service=cfg.mooncake)
    assert s.protocol == "tcp"  # LightX2V's guide: MOONCAKE_PROTOCOL=tcp without RDMA


def test_run_service_check_says_what_it_mapped(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import run_service

    path = tmp_path / "wan_t2v_disagg_transformer.json"
    path.write_text(json.dumps(CONFIGS["wan_t2v_disagg_transformer"]))
    run_service.main(["--config_json", str(path), "--model_cls", "wan2.1", "--task", "t2v",
                      "--check"])
    out = capsys.readouterr().out
    assert "diffring --check: transformer" in out  # disagg_mode names the service
    assert "lightx2v               sample_shift = 5 -> transformer.flow_shift" in out
    assert "disagg_config.protocol = 'rdma' -> mooncake.protocol" in out
    assert "disagg_config.bootstrap_room = 0: ignored (diffring workers pull" in out


def test_a_folder_of_lightx2v_stage_files_is_a_group(tmp_path: Path) -> None:
    from launcher.role_files import prepare

    for name, data in CONFIGS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    for group, front, steps in (("wan_t2v", 8002, 50), ("wan_i2v", 8004, 40),
                                ("qwen_t2i", 8008, 50), ("qwen_i2i", 8012, 40),
                                ("qwen_i2i_plus", 8016, 40)):
        prep = prepare(group, tmp_path, tmp_path / "logs" / group)
        ctl = prep.loaded["controller"]
        assert ctl.pipeline == group and ctl.server.port == front
        # The controller makes the requests: it carries the stage files' model knobs.
        assert ctl.request_defaults["infer_steps"] == steps
        assert prep.loaded["decoder"].disagg_mode == "decode"
        assert prep.configs["encoder"].parent == tmp_path / "logs" / group / "config"


def test_a_kernel_that_cannot_run_here_falls_back_to_sdpa_and_the_shift_applies(
        tmp_path: Path) -> None:
    """On this CPU machine sage_attn cannot run: attention_fallback (set by LightX2V's
    kernel keys) runs sdpa with a warning; without it the stage refuses to load."""
    import torch

    from contracts.errors import ModelLoadError
    from modelkit.components import wan_scheduler, wan_transformer
    from workers.models.diffusers_glue import load_scheduler
    from workers.models.dit.attention import apply_attention_backend

    dit = wan_transformer(0, i2v=False)
    cpu = torch.device("cpu")
    assert apply_attention_backend(dit, "sage_attn", cpu, torch.float32, 12,
                                   fallback="sdpa") == "sdpa"
    with pytest.raises(ModelLoadError, match="sage"):
        apply_attention_backend(dit, "sage_attn", cpu, torch.float32, 12)
    wan_scheduler().save_pretrained(tmp_path)
    assert load_scheduler(str(tmp_path)).config.flow_shift == 3.0
    assert load_scheduler(str(tmp_path), flow_shift=5.0).config.flow_shift == 5.0
