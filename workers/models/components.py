"""Cheap helpers of the stage adapters: settings checks, finding and loading one component of
a diffusers folder with errors that name folder and component, input guards.

Importing this module imports no model library; torch is imported inside the functions that
need it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from contracts.errors import InvalidRequestError, ModelLoadError, StageInputError
from contracts.pipelines import (
    ATTENTION_BACKENDS,
    DTYPES,
    TASKS,
    TaskSpec,
    check_device,
    parse_shape,
    task_spec,
)
from contracts.request import GenerationRequest

from .layouts import source_of
from .model_folder import ModelFolder, check_model_folder, read_json

if TYPE_CHECKING:
    import torch

def check_stage_settings(task: str, device: str, dtype: str) -> None:
    """Cheap checks of a stage's settings (no torch import), run in the constructor."""
    try:
        task_spec(task)
    except InvalidRequestError as e:
        raise ModelLoadError(str(e)) from None
    if not check_device(device):
        raise ModelLoadError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def check_backend_name(backend: str) -> None:
    """Reject an unknown DiT attention backend name (availability is checked at load)."""
    if backend not in ATTENTION_BACKENDS:
        known = ", ".join(ATTENTION_BACKENDS)
        raise ModelLoadError(f"unknown attention backend {backend!r}; expected one of {known}")


def resolve_device(device: str) -> torch.device:
    """``torch.device`` for a stage setting, failing clearly if the GPU is not there."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available here")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
        dev = torch.device("cuda", index)
    return dev


def resolve_dtype(dtype: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


# -- what each stage reads ---------------------------------------------------------------

WEIGHTS, CONFIG, FILES, FILE = "weights", "config", "files", "file"
ON_DEMAND = "weights, on demand"
_TEXT = {"tokenizer": FILES, "text_encoder": WEIGHTS}
_DIT = {"transformer": WEIGHTS, "scheduler": FILES, "vae": CONFIG}
_EXPERTS = {**_DIT, "transformer_2": WEIGHTS, "model_index.json": FILE}
_EDIT = {
    "encoder": {"processor": FILES, "vae": WEIGHTS, "text_encoder": WEIGHTS},
    "transformer": _DIT,
    "decoder": {"vae": WEIGHTS},
}
STAGE_COMPONENTS: dict[str, dict[str, dict[str, str]]] = {
    "wan_t2v": {"encoder": _TEXT, "transformer": _DIT, "decoder": {"vae": WEIGHTS}},
    "wan_i2v": {
        "encoder": {**_TEXT, "image_processor": FILES, "image_encoder": WEIGHTS,
                    "vae": WEIGHTS},
        "transformer": _DIT,
        "decoder": {"vae": WEIGHTS},
    },
    # Wan2.2-A14B: two DiTs, and the boundary between them from the model index. Its I2V and
    # TI2V-5B's have no CLIP: the first frame reaches the DiT through the VAE alone.
    "wan22_a14b_t2v": {"encoder": _TEXT, "transformer": _EXPERTS, "decoder": {"vae": WEIGHTS}},
    "wan22_a14b_i2v": {"encoder": {**_TEXT, "vae": WEIGHTS}, "transformer": _EXPERTS,
                       "decoder": {"vae": WEIGHTS}},
    "wan22_5b_t2v": {"encoder": _TEXT, "transformer": _DIT, "decoder": {"vae": WEIGHTS}},
    "wan22_5b_i2v": {"encoder": {**_TEXT, "vae": WEIGHTS}, "transformer": _DIT,
                     "decoder": {"vae": WEIGHTS}},
    # The T2I encoder's VAE encodes the input image of an image-to-image request only: it is
    # loaded by the first such request, so a worker serving text-to-image holds no more than
    # before image-to-image existed.
    "qwen_t2i": {"encoder": {**_TEXT, "vae": ON_DEMAND}, "transformer": _DIT,
                 "decoder": {"vae": WEIGHTS}},
    "qwen_i2i": _EDIT,
    "qwen_i2i_plus": _EDIT,  # the same components; the model index names another pipeline
    # No model: one settings file, read directly by each stage
    # (workers/models/families/synthetic.py).
    "synthetic": {r: {"synthetic.json": FILE} for r in ("encoder", "transformer", "decoder")},
}
"""task -> role -> the components of the model folder its stage reads, and how much of each:
``weights`` (config and weights), ``config`` (the config file only: the DiT reads the VAE's
geometry), ``files`` (tokenizer, processor, scheduler: their own files), ``file`` (a single
file the stage reads itself, not a component folder), ``weights, on demand`` (weights
loaded by the first request that needs them, not at start: a folder without them serves
every other request). What a worker checks before anything slow (:func:`check_stage_folder`)
and ``run_service.py --check`` reports; a test loads every stage and checks that it reads
exactly these (the on-demand ones when a request needs them)."""
assert set(STAGE_COMPONENTS) == set(TASKS)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def component_problem(folder: Path, kind: str) -> str | None:
    """What is missing from one component folder for ``kind`` (None: nothing), without
    reading any weights: the folder, its config file, its weight files, every shard a
    sharded checkpoint's index lists."""
    if kind == FILE:
        return None if folder.is_file() else "missing"
    if not folder.is_dir():
        return "missing"
    files = [p for p in folder.rglob("*") if p.is_file()]
    if not files:
        return "empty"
    if kind == FILES:
        return None
    if not (folder / "config.json").is_file():
        return "no config.json"
    if kind == CONFIG:
        return None
    source = source_of(folder)
    if source is not None:  # a view's component: its weights are in the listed files
        absent = [f for f in source["files"] if not Path(f).is_file()]
        return f"{absent[0]} missing" if absent else None
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            return f"unreadable {index.name}: {exc}"
        absent = sorted(s for s in shards if not (folder / s).is_file())
        if absent:
            return f"{len(absent)} shard(s) listed in {index.name} missing ({absent[0]}, ...)"
        return None
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        return "no weight files"
    return None


def check_stage_folder(model_dir: Path, task: str, role: str,
                       dit_file: str | Path | None = None,
                       vae_file: str | Path | None = None) -> ModelFolder:
    """Fail fast (seconds, not the minutes of a load) when the folder is in no layout
    diffring serves, lacks something the ``role`` stage of ``task`` reads, or is a checkpoint
    ``task`` does not serve (:func:`~workers.models.model_folder.check_model_folder`); the
    error names folder and component, or the pipeline class. Returns what the folder is.
    ``dit_file``: the transformer's single-file DiT (``dit_original_ckpt``); ``vae_file``:
    the VAE replacing the folder's (``vae_path``)."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist (task {task})")
    found = check_model_folder(model_dir, task, dit_file, vae_file)
    source = found.source or model_dir
    for component, kind in STAGE_COMPONENTS[task_spec(task).name][role].items():
        if kind == ON_DEMAND:
            continue  # checked by the request that needs it (load_component's message)
        if kind != FILE:
            component_dir(source, component, task, role)  # the loader's own message
        problem = component_problem(source / component, kind)
        if problem is not None:
            raise ModelLoadError(
                f"model folder {model_dir}: the {component!r} component is incomplete "
                f"({problem}); the {role} stage of {task} needs it"
            )
    return found


# -- loading -----------------------------------------------------------------------------

T = TypeVar("T")


def component_dir(model_dir: Path, component: str, task: str, role: str) -> Path:
    """The folder of one component, or a :class:`ModelLoadError` naming folder and component."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist (task {task})")
    path = model_dir / component
    if not path.is_dir():
        raise ModelLoadError(
            f"model folder {model_dir} has no {component!r} component (expected {path}); "
            f"the {role} stage of {task} needs it"
        )
    return path


def load_component(
    loader: Callable[[str], T], model_dir: Path, component: str, task: str, role: str
) -> T:
    """Run ``loader(path)`` on a component folder; any failure becomes a
    :class:`ModelLoadError` that names the component and the folder."""
    path = component_dir(model_dir, component, task, role)
    try:
        return loader(str(path))
    except ModelLoadError:
        raise
    except Exception as e:  # a corrupt or foreign folder: say which one
        raise ModelLoadError(
            f"could not load the {component!r} component from {path}: {type(e).__name__}: {e}"
        ) from e


def read_component_config(model_dir: Path, component: str, task: str, role: str) -> dict[str, Any]:
    """A component's ``config.json`` without loading its weights (the DiT stage reads the VAE's
    scale factors this way)."""
    path = component_dir(model_dir, component, task, role)
    for name in ("config.json", "scheduler_config.json"):
        data = read_json(path / name)
        if data is not None:
            return data
    raise ModelLoadError(f"component folder {path} has no config.json")


def require_tensor(
    tensors: Mapping[str, torch.Tensor], name: str, stage: str, ndim: int | None = None
) -> torch.Tensor:
    """A named input tensor, or a :class:`StageInputError` that says which one is missing."""
    if name not in tensors:
        raise StageInputError(
            f"{stage} stage input is missing tensor {name!r} (got: {', '.join(sorted(tensors))})"
        )
    tensor = tensors[name]
    if ndim is not None and tensor.ndim != ndim:
        raise StageInputError(
            f"{stage} stage input {name!r} must have {ndim} dimensions, got shape "
            f"{tuple(tensor.shape)}"
        )
    return tensor


def check_request_task(req: GenerationRequest, task: str, stage: str) -> None:
    if not isinstance(req, GenerationRequest):
        raise StageInputError(f"{stage} stage expects a GenerationRequest, got {type(req)!r}")
    if req.task != task:
        raise StageInputError(f"{stage} stage was loaded for {task}, got a {req.task} request")


def warmup_geometry(shape: str, spec: TaskSpec) -> dict[str, Any]:
    """The request geometry of a warm-up shape ("HxW" for images, "HxWxF" for videos)."""
    try:
        dims = parse_shape(shape)
    except ValueError as exc:
        raise ModelLoadError(f"warm-up {exc}") from None
    if len(dims) != (3 if spec.output == "video" else 2):
        want = "HxWxF" if spec.output == "video" else "HxW"
        raise ModelLoadError(f"warm-up shape {shape!r}: {spec.name} needs {want}")
    geometry: dict[str, Any] = {"height": dims[0], "width": dims[1]}
    if len(dims) == 3:
        geometry["num_frames"] = dims[2]
    return geometry
