"""The family registry: which module's adapters serve a task, imported on first use, so that
importing this package imports neither torch nor diffusers.

It names the adapters (module and class names) and imports nothing of the adapters itself:
:meth:`StageAdapter.for_task <workers.models.adapter.StageAdapter.for_task>` and
:func:`workers.models.base.get_family` look them up here.
"""

from __future__ import annotations

import importlib

from contracts.pipelines import TASKS, task_spec
from contracts.roles import Role

# task -> (module, encoder, transformer, decoder). Families are imported on first use, so that
# importing this package does not import torch or diffusers. The diffusers pipeline each row
# follows is the pipeline table's (contracts.pipelines.TaskSpec.pipeline_class).
_QWEN = ("families.qwen", "QwenEncoder", "QwenTransformer", "QwenDecoder")
_FAMILIES: dict[str, tuple[str, str, str, str]] = {
    "wan_t2v": ("families.wan", "WanEncoder", "WanTransformer", "WanDecoder"),
    "wan_i2v": ("families.wan", "WanEncoder", "WanTransformer", "WanDecoder"),
    **{f"wan22_{size}_{task}": ("families.wan", "WanEncoder", "WanTransformer", "WanDecoder")
       for size in ("a14b", "5b") for task in ("t2v", "i2v")},
    "qwen_t2i": _QWEN,
    "qwen_i2i": _QWEN,
    "qwen_i2i_plus": _QWEN,
    "synthetic": ("families.synthetic", "SyntheticEncoder", "SyntheticTransformer",
                  "SyntheticDecoder"),
}
assert set(_FAMILIES) == set(TASKS)
_COLUMN = {Role.ENCODER: 1, Role.TRANSFORMER: 2, Role.DECODER: 3}


def adapter_class(task: str, role: Role) -> type:
    """The class of ``role``'s adapter serving ``task``. Imports the family module, and with
    it torch; the caller checks what it got (``issubclass``)."""
    row = _FAMILIES[task_spec(task).name]
    module = importlib.import_module(f"{__package__}.{row[0]}")
    cls: type = getattr(module, row[_COLUMN[role]])
    return cls
