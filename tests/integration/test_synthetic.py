"""The synthetic pipeline: its config file, deterministic outputs, and a whole group over HTTP.

Groups are started and stopped here by pid (launcher.LocalGroup).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from contracts.errors import ModelLoadError, StageInputError
from contracts.request import GenerationRequest
from launcher import LocalGroup, group_config, submit
from workers.models import LocalPipeline
from workers.models.families.synthetic import CONFIG_NAME, SyntheticConfig, write_config

pytestmark = pytest.mark.integration  # starts processes or servers


def _folder(tmp: Path, **settings: Any) -> Path:
    folder = tmp / "synthetic"
    write_config(folder, **settings)
    return folder


def _run(folder: Path, seed: int, **fields: Any) -> Any:
    pipe = LocalPipeline(folder, "synthetic")
    pipe.load()
    req = GenerationRequest(task="synthetic", prompt="p", seed=seed, **fields)
    return pipe.run(req)


def test_config_round_trip_and_errors(tmp_path: Path) -> None:
    folder = _folder(tmp_path, step_s=0.25, phase2={"lat": {"shape": [2, 3], "dtype": "uint8"}})
    cfg = SyntheticConfig.read(folder)
    assert cfg.step_s == 0.25 and cfg.phase2["lat"].shape == (2, 3)
    assert cfg.phase2["lat"].dtype == "uint8"

    def refused(data: dict[str, Any], match: str) -> None:
        (folder / CONFIG_NAME).write_text(json.dumps(data))
        with pytest.raises(ModelLoadError, match=match):
            SyntheticConfig.read(folder)

    good = cfg.to_json()
    refused({**good, "stepz": 1}, "unknown key.*stepz")
    refused({**good, "mode": "nap"}, "mode must be one of")
    refused({**good, "encoder_s": -1}, "encoder_s must be")
    refused({**good, "phase1": {"x": {"shape": [0], "dtype": "float32"}}}, "positive integers")
    refused({**good, "phase1": {"x": {"shape": [1], "dtype": "complex64"}}}, "dtype must be")
    refused({**good, "phase1": {}}, "at least one tensor")
    refused({k: v for k, v in good.items() if k != "format"}, "not a synthetic model config")
    with pytest.raises(ModelLoadError, match=r"no readable synthetic\.json"):
        SyntheticConfig.read(tmp_path)


def test_outputs_are_deterministic_and_follow_every_byte(tmp_path: Path) -> None:
    folder = _folder(tmp_path, encoder_s=0, step_s=0, decoder_s=0)
    a, b = _run(folder, 5, height=32, width=48), _run(folder, 5, height=32, width=48)
    assert a.data == b.data and a.extension == "png" and a.frames.shape == (32, 48, 3)
    assert a.frames.std() > 1.0, "degenerate picture: the test would prove little"
    assert _run(folder, 6, height=32, width=48).data != a.data

    pipe = LocalPipeline(folder, "synthetic")
    pipe.load()
    req = GenerationRequest(task="synthetic", prompt="p", seed=5, height=32, width=48)
    cond = pipe.encoder.encode(req)
    assert all(isinstance(v, np.ndarray) for v in cond.values())  # cpu + float32: no torch
    lat = pipe.transformer.denoise(req, cond)
    assert pipe.decoder.decode(req, lat).data == a.data
    # One changed element on either hop changes the result.
    bad_cond = {k: v.copy() for k, v in cond.items()}
    next(iter(bad_cond.values())).reshape(-1)[123] += 1
    assert pipe.decoder.decode(req, pipe.transformer.denoise(req, bad_cond)).data != a.data
    bad_lat = {k: v.copy() for k, v in lat.items()}
    next(iter(bad_lat.values())).reshape(-1)[-1] += 1
    assert pipe.decoder.decode(req, bad_lat).data != a.data
    with pytest.raises(StageInputError, match="missing tensor"):
        pipe.decoder.decode(req, {})


def test_bfloat16_tensors_are_torch_and_match_their_bytes(tmp_path: Path) -> None:
    """numpy has no bfloat16: such a config makes torch tensors (2 bytes per element), with
    the same picture on every run."""
    import torch

    folder = _folder(tmp_path, encoder_s=0, step_s=0, decoder_s=0,
                     phase1={"e": {"shape": [2, 3], "dtype": "bfloat16"}},
                     phase2={"l": {"shape": [4], "dtype": "int16"}})
    pipe = LocalPipeline(folder, "synthetic")
    pipe.load()
    assert pipe.encoder.tensor_kind == "torch"
    req = GenerationRequest(task="synthetic", prompt="p", seed=1)
    cond = pipe.encoder.encode(req)
    assert cond["e"].dtype == torch.bfloat16 and cond["e"].element_size() == 2
    lat = pipe.transformer.denoise(req, cond)
    assert lat["l"].dtype == torch.int16 and tuple(lat["l"].shape) == (4,)
    assert pipe.decoder.decode(req, lat).data == _run(folder, 1).data


def test_stage_times_and_steps(tmp_path: Path) -> None:
    folder = _folder(tmp_path, encoder_s=0.05, step_s=0.04, decoder_s=0.05)
    pipe = LocalPipeline(folder, "synthetic")
    pipe.load()
    req = GenerationRequest(task="synthetic", prompt="p", infer_steps=5)
    pipe.run(req)  # warm-up (lazy imports)
    steps: list[tuple[int, int]] = []
    t0 = time.monotonic()
    pipe.run(req, on_step=lambda k, n: steps.append((k, n)))
    took = time.monotonic() - t0
    assert steps == [(k, 5) for k in range(1, 6)]
    assert took >= 0.05 + 5 * 0.04 + 0.05  # never shorter than configured


def test_group_completes_tasks_over_http(tiny_models: Path, tmp_path: Path) -> None:
    """Controller + encoder + transformer + decoder processes: tasks complete over HTTP, and
    the PNG served by the front door is the one a local run makes for the same seed."""
    folder = tiny_models / "synthetic"
    cfg = group_config("synthetic", str(folder), tmp_path, staging_pool_mb=16)
    with LocalGroup(cfg, tmp_path) as group:
        group.start_all()
        done = [submit(group.url, "image", {"prompt": f"p{i}", "seed": i, "infer_steps": 3},
                       timeout=120) for i in range(3)]
        for i, st in enumerate(done):
            assert st["status"] == "completed", st
            assert list(st["stage_times"]) == ["queued", "encoding", "phase1", "denoising",
                                               "phase2", "decoding", "completed"]
            r = httpx.get(f"{group.url}/v1/tasks/{st['task_id']}/result", timeout=30)
            assert r.status_code == 200 and r.headers["content-type"] == "image/png"
            assert r.content == _run(folder, i, infer_steps=3).data
            from PIL import Image

            assert np.asarray(Image.open(io.BytesIO(r.content))).shape == (64, 64, 3)
        # Host tensors only: no worker (nor the controller) ever loaded torch.
        for svc in group.services:
            maps = Path(f"/proc/{svc.proc.pid}/maps").read_text()
            assert "libtorch" not in maps, f"{svc.role} loaded torch"
