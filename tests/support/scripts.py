"""Running the start scripts and the launcher as an operator runs them (a free port offset,
a start script in its own session, its environment), and LightX2V's shapes: its published
disaggregation stage configs, key for key."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launcher import port_busy, role_files
from tests.support.paths import ROOT

# -- the start scripts and the launcher, run as an operator runs them -----------------------
MOONCAKE_PORTS = range(12000, 17001)
"""Where a Mooncake engine with P2P handshake binds its RPC and TCP-transport ports (seen:
12001 as the default, 15xxx-16xxx picked at random)."""


def free_offset(group: str, subdir: str, split: bool = False) -> int:
    """A PORT_OFFSET under which every port of the group is free. The shifted ports stay
    below Linux's ephemeral range (32768+), so other tests' free_ports() cannot race us, and
    out of the range Mooncake picks its own ports from (MOONCAKE_PORTS), so the engines of
    tests running beside this one cannot take one between this check and the bind."""
    prep = role_files.prepare(group, ROOT / "configs" / "disagg" / subdir,
                              Path("/nonexistent"), split=split)
    ports = [(host, port) for _what, host, port in prep.ports()]
    top = 32767 - max(port for _host, port in ports)
    rng = random.Random()
    for _ in range(200):
        offset = rng.randrange(1000, top)
        if any(port + offset in MOONCAKE_PORTS for _host, port in ports):
            continue
        if not any(port_busy(host, port + offset) for host, port in ports):
            return offset
    raise RuntimeError("no free port offset found")


class Launched:
    """A start script run in its own session, its output in a file."""

    def __init__(self, script: Path, env: dict[str, str], log_dir: Path) -> None:
        self.log_dir = log_dir
        self.out_path = log_dir.parent / "launcher.out"
        with self.out_path.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", str(script)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
                env=env,
                start_new_session=True,  # our SIGINT reaches the script alone
            )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        path = self.log_dir / "pids"
        if not path.exists():
            return {}
        return {
            role: int(pid)
            for role, pid in (ln.split() for ln in path.read_text().split("\n") if ln.strip())
        }

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"launcher exited with {self.proc.returncode}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def cleanup(self) -> None:
        """Whatever happened: stop the script, then any service it left, by pid."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.pids().values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def launcher_env(tmp_path: Path, model: Path, offset: int) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.endswith("_GPU") and not k.startswith("GPU_") and k != "model_path"
    }
    env.update(
        model_path=str(model),
        ENCODER_GPU="cpu",
        TRANSFORMER_GPU="cpu",
        DECODER_GPU="cpu",
        PORT_OFFSET=str(offset),
        LOG_DIR=str(tmp_path / "logs"),
        OUTPUT_DIR=str(tmp_path / "results"),
        PYTHON=sys.executable,
        READY_TIMEOUT="120",
        METRICS_TIMEOUT="5",
        STOP_TIMEOUT="20",
    )
    return env

# -- LightX2V's shapes: its published disaggregation stage configs (configs/disagg/{wan,qwen}/
# of its repository), key for key, and its request scripts' payloads ----------------------
def lightx2v_stage_configs() -> dict[str, dict[str, Any]]:
    """``<prefix>_disagg_<role>.json`` name -> the object LightX2V publishes there."""
    def disagg(room: int, sender: int, receiver: int, phase2: tuple[int, int] | None = None,
               device_name: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"bootstrap_addr": "127.0.0.1", "bootstrap_room": room,
                             "sender_engine_rank": sender, "receiver_engine_rank": receiver,
                             "protocol": "rdma", "local_hostname": "localhost",
                             "metadata_server": "P2PHANDSHAKE"}
        if device_name:
            d["device_name"] = ""
        if phase2 is not None:
            d["decoder_engine_rank"], d["decoder_bootstrap_room"] = phase2
        return d

    def wan(steps: int, shift: int, i2v: bool) -> dict[str, dict[str, Any]]:
        base: dict[str, Any] = {"infer_steps": steps, "target_video_length": 81,
                                "text_len": 512, "target_height": 480, "target_width": 832}
        dit = {"self_attn_1_type": "sage_attn2", "cross_attn_1_type": "sage_attn2",
               "cross_attn_2_type": "sage_attn2", "sample_guide_scale": 5,
               "sample_shift": shift, "enable_cfg": True}
        tail: dict[str, Any] = {"cpu_offload": False, "fps": 16}
        if i2v:
            tail["clip_embed_dim"] = 329216
        room = 2 if i2v else 0
        name = "wan_i2v" if i2v else "wan_t2v"
        return {
            f"{name}_disagg_encoder": {**base, **dit, **tail, "disagg_mode": "encoder",
                                       "disagg_config": disagg(room, 0, 1)},
            f"{name}_disagg_transformer": {**base, **dit, **tail, "disagg_mode": "transformer",
                                           "disagg_config": disagg(room, 0, 1,
                                                                   (2, room + 1))},
            f"{name}_disagg_decode": {**base, **tail, "disagg_mode": "decode",
                                      "disagg_config": disagg(room + 1, 1, 2)},
        }

    def qwen(task: str) -> dict[str, dict[str, Any]]:
        t2i = task == "t2i"
        steps = 50 if t2i else 40
        size = {"target_height": 1536, "target_width": 2752} if t2i else {
            "target_height": 1664, "target_width": 1664}
        geo = {"vae_z_dim": 16, "vae_stride": [1, 8, 8], "target_video_length": 1, **size}
        template = {"prompt_template_encode": "<|im_start|>system\nDescribe ...<|im_end|>\n"
                    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
                    "prompt_template_encode_start_idx": 34 if t2i else 64}
        cfg = {"enable_cfg": True, "sample_guide_scale": 4.0}
        text = {"text_encoder_dim": 3584, "text_len": 4096, "infer_steps": steps}
        extra: dict[str, Any] = ({"aspect_ratio": "16:9", "max_custom_size": 3072} if t2i else
                                 {"resize_mode": "adaptive"})
        edit: dict[str, Any] = {} if t2i else {"CONDITION_IMAGE_SIZE": 147456,
                                               "USE_IMAGE_ID_IN_PROMPT": True}
        room = 0 if t2i else 1
        name = f"qwen_image_{task}_disagg"
        transformer = {"task": task, "disagg_mode": "transformer", **text, **extra, **template,
                       "attn_type": "flash_attn2" if t2i else "flash_attn3", **cfg, **edit,
                       **geo, "disagg_config": disagg(room, 0, 1, (2, 2), device_name=True)}
        if t2i:
            transformer["dit_original_ckpt"] = "/path/to/qwen-2512/dit.safetensors"
        decode: dict[str, Any] = {"task": task, "disagg_mode": "decode", "infer_steps": steps,
                                  "vae_scale_factor": 8, **geo}
        if t2i:
            decode["max_custom_size"] = 3072
        return {
            f"{name}_encoder": {"task": task, "disagg_mode": "encoder",
                                "text_encoder_type": "lightllm_kernel", **text, **extra,
                                **template, "attn_type": "flash_attn3", **cfg, **edit, **geo,
                                "disagg_config": disagg(room, 0, 1, device_name=True)},
            f"{name}_transformer": transformer,
            f"{name}_decode": {**decode, "disagg_config": disagg(2, 1, 2)},
        }

    return {**wan(50, 5, False), **wan(40, 3, True), **qwen("t2i"), **qwen("i2i")}
