"""What every stage adapter shares (:class:`StageAdapter`): its settings, the explicit
``load()`` (model-folder check, memory budget, the family's ``_load``), the guards around a
request, and the component loaders. The three role interfaces built on it are in
:mod:`workers.models.base`.

Importing this module is cheap: torch is imported by the methods that need it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypeVar

from contracts.errors import ConfigError, ModelLoadError
from contracts.pipelines import task_spec
from contracts.roles import Role
from contracts.stage_options import StageOptions

from .components import (
    ON_DEMAND,
    STAGE_COMPONENTS,
    WEIGHTS,
    check_stage_settings,
    load_component,
    read_component_config,
    resolve_device,
    resolve_dtype,
)
from .family import adapter_class
from .model_folder import ModelFolder, check_model_folder

T = TypeVar("T")


class StageAdapter(ABC):
    """Common part of the three stage adapters: settings, explicit ``load()``, guards.

    Constructors do no I/O and import nothing heavy; ``load()`` reads the folder.
    """

    role: ClassVar[Role]
    torch_model: ClassVar[bool] = True
    """Whether this stage runs a torch model (its load imports torch, and the service's
    ``torch_threads`` applies). The synthetic family has no model."""

    @property
    def tensor_kind(self) -> Literal["torch", "numpy"]:
        """What the stage takes and returns: torch tensors, or numpy arrays (then its worker
        pulls inputs as numpy arrays and never imports torch for them)."""
        return "torch"

    @classmethod
    def for_task(
        cls, model_dir: str | Path, task: str, device: str = "cpu", dtype: str = "float32",
        **options: Any,
    ) -> Self:
        """The adapter of this role for ``task``'s model family, constructed (not loaded).

        ``EncoderAdapter.for_task(folder, "wan_t2v")`` is a ``WanEncoder``. Settings are
        checked first, so a bad one is refused before the family (and torch) is imported.
        """
        check_stage_settings(task, device, dtype)
        impl = adapter_class(task, cls.role)
        assert issubclass(impl, cls)
        adapter: Self = impl(model_dir, task, device, dtype, **options)
        return adapter

    def __init__(
        self, model_dir: str | Path, task: str, device: str = "cpu", dtype: str = "float32",
        options: StageOptions | None = None,
    ) -> None:
        check_stage_settings(task, device, dtype)
        self.model_dir = Path(model_dir)
        self.task = task
        self.spec = task_spec(task)
        self.device_name = device
        self.dtype_name = dtype
        self.options = options or StageOptions()
        """Weight storage, offload, budget (all off: exact, as without options)."""
        try:
            self.options.check_role(self.role.value)
        except ConfigError as exc:  # the options belong to another stage
            raise ModelLoadError(str(exc)) from None
        self._loaded = False
        self.model_folder: ModelFolder | None = None
        """What the model folder is; checked in :meth:`load` unless the caller did."""
        self.dit_file: str | None = None
        """A single-file DiT replacing the folder's (``dit_original_ckpt``; the transformer
        stage's constructor takes it)."""
        self.vae_file: str | None = None
        """A VAE file or folder replacing the folder's (``vae_path``), for every stage (each
        reads the same view of the folder; set before :meth:`load`)."""
        self.on_component: Callable[[str], None] | None = None
        """Called with a component's name after it loaded (the worker's start-up boundary:
        a stop asked for during a long load ends it there)."""

    @property
    def loaded(self) -> bool:
        return self._loaded

    def load(self) -> None:
        """Load this stage's components (and only those) from the model folder."""
        if self._loaded:
            return
        if not self.model_dir.is_dir():
            raise ModelLoadError(f"model folder {self.model_dir} does not exist (task {self.task})")
        if self.model_folder is None:  # a worker checked it at start, before Mooncake
            # The folder must be a checkpoint of this task's pipeline (JSON only, before
            # any weight is read).
            self.model_folder = check_model_folder(self.model_dir, self.task, self.dit_file,
                                                   self.vae_file)
        self._resolve_settings()
        self._check_budget()
        self._load()
        if self.torch_model:
            self.memory.loaded()
        self._loaded = True

    def _check_budget(self) -> None:
        """Refuse, before any weight is read, a ``max_vram_gb`` this stage cannot fit; then
        hold the process to it."""
        if self.options.max_vram_gb is None or not self.torch_model:
            return
        from .memory import apply_budget, check_budget, estimate_weights

        folders = [self.source_dir / c for c in self.resident_components()]
        weights = estimate_weights(folders, self.dtype.itemsize)
        check_budget(self.role.value, self.options, weights, self.working_bytes())
        apply_budget(self.device, self.options)

    def resident_components(self) -> list[str]:
        """The components whose weights live on this stage's device (the budget check's
        first term): every one it loads, unless a family keeps some elsewhere. On-demand
        weights count too: the budget admits the requests that load them."""
        return [c for c, kind in STAGE_COMPONENTS[self.spec.name][self.role.value].items()
                if kind in (WEIGHTS, ON_DEMAND)]

    def working_bytes(self) -> int:
        """GPU memory this stage needs beside its weights (activations, workspace) for the
        requests it is sized for: the budget check's second term."""
        return 2 << 30

    @contextlib.contextmanager
    def guarded(self, what: str) -> Iterator[None]:
        """Around one request: record its peak memory, and turn a GPU out-of-memory into an
        error naming ``what`` (its size) after freeing what it took."""
        if not self.torch_model:
            yield
            return
        from .memory import oom_guard

        with self.memory.request(), oom_guard(self.role.value, what, self.device,
                                              self.options):
            yield

    def _resolve_settings(self) -> None:
        """Turn the device and dtype settings into torch objects (a torch-free stage
        overrides this)."""
        from .memory import MemoryWatch, Placement

        self.device = resolve_device(self.device_name)
        self.dtype = resolve_dtype(self.dtype_name)
        self.placement = Placement(self.device, self.dtype, self.options)
        self.memory = MemoryWatch(self.device)
        if self.device.type == "cuda":
            import torch

            # One process serves one device: make it the current one, so that what follows
            # the current device rather than a tensor's (pinned host buffers, Triton kernels
            # such as sage_attn's, new CUDA streams) does not land on GPU 0 of a cuda:3 worker.
            torch.cuda.set_device(self.device)

    @abstractmethod
    def _load(self) -> None:
        """Load the components; called once by :meth:`load`."""

    def _synchronize(self) -> None:
        """Wait for the device: a stage call returns when its work is done, not launched."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise ModelLoadError(f"{self.role} stage of {self.task}: call load() first")

    @property
    def source_dir(self) -> Path:
        """Where the components are read from: the folder, or its diffusers-layout view
        (a folder in another layout: :mod:`workers.models.layouts`)."""
        found = self.model_folder
        return found.source if found is not None and found.source is not None else \
            self.model_dir

    def _component(self, loader: Callable[[str], T], component: str) -> T:
        loaded = load_component(loader, self.source_dir, component, self.task, self.role)
        if self.on_component is not None:
            self.on_component(component)
        return loaded

    def _on_demand(self, loader: Callable[[str], T], component: str) -> T:
        """An on-demand component (``weights, on demand`` in the component table), loaded
        now by the request that needs it: no start-up boundary, the memory report updated."""
        loaded = load_component(loader, self.source_dir, component, self.task, self.role)
        self.memory.loaded()
        return loaded

    def _config(self, component: str) -> dict[str, Any]:
        return read_component_config(self.source_dir, component, self.task, self.role)
