"""Which diffusers pipeline a model folder is, checked against the pipeline a stage serves.

A folder names its pipeline in ``model_index.json`` (``_class_name``); a few checkpoints of
one class are yet another pipeline for the stages, told apart by a key of the model index or
of the DiT's ``transformer/config.json``: Wan2.2-A14B's second expert (``transformer_2``,
``boundary_ratio``) and TI2V-5B's ``expand_timesteps`` name the Wan2.1 classes and are rows
of their own (:func:`~contracts.pipelines.rows_for_folder`); Qwen-Image-Edit-2511's
``zero_cond_t`` is served; a first-last-frame DiT is not. :func:`check_model_folder` reads
those JSON files only (no weights, no model library) and refuses, with an error that names
the class and what diffring serves, every folder its task does not serve; without it a 2511
folder would load under ``qwen_i2i`` and give other pixels than diffusers' pipeline.

It runs once per stage, before anything slow: a worker calls it at start through
:func:`~workers.models.components.check_stage_folder` (before Mooncake and the model load),
``run_service.py --check`` reports it, and an adapter loaded on its own (the ``--service
all`` baseline, the tests) runs it first thing in ``load()``. A folder without
``model_index.json`` (a stage's own copy of its components) is checked by its DiT config
alone, where it has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.errors import ModelLoadError
from contracts.pipelines import TASK_SPECS, TaskSpec, rows_for_folder, served_classes, task_spec

from .layouts import detect_layout, view_of

# The DiT class of each family: a folder of a served pipeline class with another DiT class is
# not the checkpoint the stages were written for.
_DIT_CLASS = {"wan": "WanTransformer3DModel", "qwen": "QwenImageTransformer2DModel"}


@dataclass(frozen=True)
class ModelFolder:
    """What :func:`check_model_folder` found (for the start-up log and ``--check``)."""

    pipeline_class: str | None
    """``model_index.json``'s ``_class_name``; None when the folder has no model index."""
    variant: str
    """Which checkpoints of the class this is, in words (e.g. Edit-2511's ``zero_cond_t``)."""
    layout: str = "diffusers"
    """The folder's layout (:mod:`workers.models.layouts`): ``diffusers``, ``wan_original``
    or ``wan22_original``, with ``+ single-file DiT`` when ``dit_original_ckpt`` replaces its
    DiT and ``+ VAE from vae_path`` when ``vae_path`` replaces its VAE."""
    source: Path | None = None
    """Where the stages read the components from: the diffusers-layout view of a folder in
    another layout (None: the folder itself)."""

    def describe(self) -> str:
        name = self.pipeline_class or "no model_index.json"
        found = f"{name}: {self.variant}" if self.variant else name
        return found if self.layout == "diffusers" else f"{found} ({self.layout} layout)"


def read_json(file: Path) -> dict[str, Any] | None:
    """A JSON object file of a model folder (None: no such file); a broken one is a
    :class:`ModelLoadError` naming it."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"unreadable {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    return data


def _served_list() -> str:
    return ", ".join(f"{_want(spec)} ({spec.name})" for spec in TASK_SPECS.values()
                     if spec.folder_pipeline is not None)


def _kind(experts: int, expand: bool) -> str:
    """A folder's Wan2.2 variant in words ("" for every other checkpoint)."""
    if experts == 2:
        return "two-expert (Wan2.2-A14B) "
    return "expand_timesteps (Wan2.2-TI2V-5B) " if expand else ""


def _want(spec: TaskSpec) -> str:
    return f"{_kind(spec.experts, spec.expand_timesteps)}{spec.folder_pipeline}"


def _index_kind(index: dict[str, Any]) -> tuple[int, bool]:
    """(DiTs, expand_timesteps) of a folder by its model index: Wan2.2-A14B names a second
    DiT (``transformer_2``) and the ``boundary_ratio`` between the two."""
    two = index.get("transformer_2") not in (None, [None, None]) or \
        index.get("boundary_ratio") is not None
    return (2 if two else 1), bool(index.get("expand_timesteps"))


def _class_problem(model_dir: Path, index: dict[str, Any], spec: TaskSpec) -> str | None:
    """Why a folder with this model index cannot serve ``spec`` (None: it can)."""
    found = index.get("_class_name")
    experts, expand = _index_kind(index)
    if found == spec.folder_pipeline and (experts, expand) == (spec.experts,
                                                                spec.expand_timesteps):
        return None
    if not isinstance(found, str) or not found:
        return (f"{model_dir}/model_index.json names no pipeline class (_class_name); "
                f"diffring serves {_served_list()}")
    kind = _kind(experts, expand)
    rows = rows_for_folder(found, experts, expand)
    if not rows:
        return (f"model folder {model_dir} is a {kind}{found} checkpoint (model_index.json), "
                f"which diffring does not serve; it serves {_served_list()}. Point model_path "
                f"at a {_want(spec)} folder for {spec.name}")
    # TI2V-5B's one folder serves two rows: the one of this service's kind of output first.
    other = next((r for r in rows if r.needs_image == spec.needs_image), rows[0])
    setting = (f"task to {other.task!r}" if other.model_cls == spec.model_cls else
               f"model_cls to {other.model_cls!r} and task to {other.task!r}")
    return (f"model folder {model_dir} is a {kind}{found} checkpoint (model_index.json), "
            f"served by diffring as {other.name} (model_cls {other.model_cls!r}, task "
            f"{other.task!r}), started by scripts/server/disagg/{other.family}/"
            f"start_{other.name}_disagg.sh; this service is configured for {spec.name}, which "
            f"serves {_want(spec)} folders. Set {setting}, or point model_path at a "
            f"{_want(spec)} folder")


def _dit_variant(model_dir: Path, dit: dict[str, Any], spec: TaskSpec) -> tuple[str | None, str]:
    """(why the DiT config is not served by ``spec`` or None, the variant it makes)."""
    where = f"{model_dir}/transformer"
    found = dit.get("_class_name")
    want = _DIT_CLASS.get(spec.family)
    if want is not None and found is not None and found != want:
        return f"{where} is a {found}, but {spec.name} runs a {want}", ""
    if spec.family == "qwen":
        for key in ("use_additional_t_cond", "use_layer3d_rope"):
            if dit.get(key):
                return (f"{where} sets {key} (a Qwen-Image-Layered DiT), which diffring does "
                        f"not serve; it serves {_served_list()}"), ""
        if dit.get("zero_cond_t"):
            plus = next(s for s in served_classes().values() if s.multi_image)
            if spec.name != plus.name:
                return (f"{where} sets zero_cond_t (a Qwen-Image-Edit-2511 DiT: the condition "
                        f"images are modulated at timestep 0), which only "
                        f"{plus.pipeline_class} serves: diffring's {plus.name} (task "
                        f"{plus.task!r}); this service is configured for {spec.name}"), ""
            return None, "zero_cond_t (Qwen-Image-Edit-2511 style)"
        return None, "zero_cond_t off (Qwen-Image-Edit-2509 style)" if spec.multi_image else ""
    if spec.family == "wan":
        if dit.get("pos_embed_seq_len"):
            return (f"{where} sets pos_embed_seq_len (a Wan2.1 first-last-frame DiT, FLF2V), "
                    "which diffring does not serve: it takes no last frame"), ""
        if spec.model_cls == "wan2.1":
            i2v = dit.get("image_dim") is not None
        else:
            # Wan2.2's I2V DiTs have no CLIP context (image_dim unset): the A14B one takes
            # the mask and the condition latents beside the noise (36 channels against 16);
            # TI2V-5B's one DiT serves both tasks.
            i2v = spec.needs_image if spec.expand_timesteps else \
                dit.get("in_channels", 16) != dit.get("out_channels", 16)
        if i2v != spec.needs_image:
            return (f"{where} is {'an I2V' if i2v else 'a T2V'} DiT, but the task is "
                    f"{spec.name}"), ""
        if spec.experts == 2 and dit.get("image_dim") is not None:
            return (f"{where} has a CLIP image context (image_dim), which no Wan2.2-A14B DiT "
                    "has"), ""
    return None, ""


def check_model_folder(model_dir: Path, task: str, dit_file: str | Path | None = None,
                       vae_file: str | Path | None = None) -> ModelFolder:
    """Refuse (:class:`ModelLoadError`) a folder in no layout diffring serves, or whose
    pipeline ``task`` does not serve; return what it is and where its components are read
    from. ``dit_file``: a single-file DiT that replaces the folder's (``dit_original_ckpt``);
    ``vae_file``: a VAE file or folder that replaces the folder's (``vae_path``). JSON and
    tensor headers only: seconds before any weight is read."""
    spec = task_spec(task)
    if spec.pipeline_class is None:  # the synthetic pipeline reads its own settings file
        return ModelFolder(None, "")
    layout = detect_layout(model_dir)
    source = None
    if layout != "diffusers" or dit_file is not None or vae_file is not None:
        source = view_of(model_dir, layout, None if dit_file is None else Path(dit_file),
                         None if vae_file is None else Path(vae_file))
        if dit_file is not None:
            layout += " + single-file DiT"
        if vae_file is not None:
            layout += " + VAE from vae_path"
    read_from = source or model_dir
    index = read_json(read_from / "model_index.json")
    if index is not None:
        problem = _class_problem(model_dir, index, spec)
        if problem is not None:
            raise ModelLoadError(problem)
    variant = ""
    dit = read_json(read_from / "transformer" / "config.json")
    if dit is not None:
        problem, variant = _dit_variant(model_dir, dit, spec)
        if problem is not None:
            raise ModelLoadError(problem)
    if spec.experts == 2 and index is not None:
        variant = f"two experts, boundary_ratio {index.get('boundary_ratio')}"
    elif spec.expand_timesteps:
        variant = "expand_timesteps (TI2V-5B)"
    return ModelFolder(None if index is None else str(index["_class_name"]), variant, layout,
                       source)
