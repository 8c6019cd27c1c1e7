"""A folder of LightX2V's stage configs as a group's role files.

LightX2V names its files ``<prefix>_disagg_{encoder,transformer,decode}.json``
(``wan_t2v_disagg_encoder.json``, ``qwen_image_t2i_disagg_decode.json``), has no controller
file for its three-POST groups (its Qwen controller file belongs to its other, decentralized
mode and is not read), and leaves ``model_cls`` / ``task`` to its command line.
:func:`role_data` turns such a folder into the four role objects the launcher writes and
starts: each stage file as it is, with the group's ``model_cls`` / ``task`` and what it lacks
taken from diffring's example file of the same role (its ``server`` section: the metrics
port; its ports of the rings and the control channel), and a controller made from diffring's
example controller file with the stage files' model knobs as its ``request_defaults`` (the
controller makes the requests; the transformer's file wins where the files differ). Every
LightX2V key is then read by the service itself (:mod:`contracts.lightx2v`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from contracts.lightx2v import translate
from contracts.pipelines import TASK_SPECS

ROOT = Path(__file__).resolve().parent.parent

PREFIXES = {
    "wan_t2v": "wan_t2v_disagg", "wan_i2v": "wan_i2v_disagg",
    "qwen_t2i": "qwen_image_t2i_disagg", "qwen_i2i": "qwen_image_i2i_disagg",
    # LightX2V serves Edit-2509 / 2511 with its i2i files.
    "qwen_i2i_plus": "qwen_image_i2i_disagg",
}
SUFFIXES = {"encoder": "encoder", "transformer": "transformer", "decoder": "decode"}
_PORT_KEYS = ("control_port", "rdma_request_handshake_port", "rdma_phase1_handshake_port",
              "rdma_phase2_handshake_port")


def lightx2v_files(group: str, config_dir: Path) -> dict[str, Path] | None:
    """The three LightX2V stage files of ``group`` in ``config_dir``, or None when they are
    not all there (or LightX2V publishes none for the group: Wan2.2)."""
    prefix = PREFIXES.get(group)
    if prefix is None:
        return None
    files = {role: config_dir / f"{prefix}_{suffix}.json" for role, suffix in SUFFIXES.items()}
    return files if all(f.is_file() for f in files.values()) else None


def _example(group: str, role: str) -> dict[str, Any]:
    family = TASK_SPECS[group].family
    path = ROOT / "configs" / "disagg" / family / f"{group}_{role}.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def role_data(group: str, files: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """The four role objects of a group read from LightX2V's ``files``."""
    spec = TASK_SPECS[group]
    out: dict[str, dict[str, Any]] = {}
    for role in ("controller", "encoder", "transformer", "decoder"):
        example = _example(group, role)
        data = json.loads(files[role].read_text()) if role in files else example
        data["model_cls"], data["task"] = spec.model_cls, spec.task
        data.setdefault("server", example.get("server", {}))
        disagg = data.setdefault("disagg_config", {})
        for key in _PORT_KEYS:
            disagg.setdefault(key, example["disagg_config"][key])
        out[role] = data
    defaults: dict[str, Any] = {}
    for role in ("encoder", "decoder", "transformer"):  # the last one wins
        translated, _notes, _problems = translate(out[role], role)  # problems: at load
        defaults.update(translated.get("request_defaults", {}))
    if defaults:
        out["controller"]["request_defaults"] = defaults
    return out
