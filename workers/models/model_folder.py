"""Which diffusers pipeline a model folder is, checked against the pipeline a stage serves.

A folder names its pipeline in ``model_index.json`` (``_class_name``); a few checkpoints of
one class are yet another pipeline for the stages, told apart by a key of the model index or
of the DiT's ``transformer/config.json`` (Qwen-Image-Edit-2511's ``zero_cond_t`` is served;
Wan2.2's second expert or a first-last-frame DiT are not). :func:`check_model_folder` reads
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
from contracts.pipelines import TaskSpec, served_classes, task_spec

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
    """The folder's layout (:mod:`workers.models.layouts`): ``diffusers`` or
    ``wan_original``, with ``+ single-file DiT`` when ``dit_original_ckpt`` replaces its DiT
    and ``+ VAE from vae_path`` when ``vae_path`` replaces its VAE."""
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
    return ", ".join(f"{cls} ({spec.name})" for cls, spec in served_classes().items())


def _class_problem(model_dir: Path, found: object, spec: TaskSpec) -> str | None:
    """Why a folder of pipeline class ``found`` cannot serve ``spec`` (None: it can)."""
    if found == spec.pipeline_class:
        return None
    if not isinstance(found, str) or not found:
        return (f"{model_dir}/model_index.json names no pipeline class (_class_name); "
                f"diffring serves {_served_list()}")
    other = served_classes().get(str(found))
    if other is None:
        return (f"model folder {model_dir} is a {found} checkpoint (model_index.json), which "
                f"diffring does not serve; it serves {_served_list()}. Point model_path at a "
                f"{spec.pipeline_class} folder for {spec.name}")
    return (f"model folder {model_dir} is a {found} checkpoint (model_index.json), served by "
            f"diffring as {other.name} (model_cls {other.model_cls!r}, task {other.task!r}), "
            f"started by scripts/server/disagg/{other.family}/start_{other.name}_disagg.sh; "
            f"this service is configured for {spec.name}, which serves "
            f"{spec.pipeline_class} folders. Set task to {other.task!r}, or point model_path "
            f"at a {spec.pipeline_class} folder")


def _index_variant(model_dir: Path, index: dict[str, Any]) -> str | None:
    """A model-index key that makes a served class a pipeline diffring does not serve."""
    if index.get("transformer_2") not in (None, [None, None]) or index.get("boundary_ratio"):
        return (f"{model_dir} is a two-expert (Wan2.2) checkpoint (model_index.json names "
                "transformer_2 / boundary_ratio); only Wan2.1 is supported")
    if index.get("expand_timesteps"):
        return (f"{model_dir} uses expand_timesteps (Wan2.2 TI2V, model_index.json); only "
                "Wan2.1 is supported")
    return None


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
        i2v = dit.get("image_dim") is not None
        if i2v != spec.needs_image:
            return (f"{where} is {'an I2V' if i2v else 'a T2V'} DiT, but the task is "
                    f"{spec.name}"), ""
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
        problem = _class_problem(model_dir, index.get("_class_name"), spec)
        problem = problem or _index_variant(model_dir, index)
        if problem is not None:
            raise ModelLoadError(problem)
    variant = ""
    dit = read_json(read_from / "transformer" / "config.json")
    if dit is not None:
        problem, variant = _dit_variant(model_dir, dit, spec)
        if problem is not None:
            raise ModelLoadError(problem)
    return ModelFolder(None if index is None else str(index["_class_name"]), variant, layout,
                       source)
