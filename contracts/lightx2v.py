"""LightX2V's stage configs, read through a mapping table: every key of its published Wan and
Qwen-Image disaggregation configs lands in a diffring setting or is reported as ignored, with
the reason (``docs/from-lightx2v.md`` has the table as a page).

:func:`translate` runs before the strict reader (:mod:`contracts.configio`): it takes the raw
JSON object of one service's file and returns the object in diffring's keys, the notes of
what it did with each LightX2V key (``run_service.py --check`` prints them), and the problems
it found (a value it cannot map), which the reader reports together with every other problem
of the file. Where each kind of key goes:

* model knobs (``infer_steps``, ``target_video_length``, ``target_height`` / ``_width``,
  ``fps``, ``sample_guide_scale``, ``enable_cfg``, Wan's ``text_len``, ``aspect_ratio``,
  ``resize_mode``) become the pipeline's request defaults (``request_defaults``: what a
  request that leaves the field unset gets; the controller applies them);
* the attention kernels (``self_attn_1_type``, ``attn_type``), offload and quantisation flags
  become stage options of the role the file is for (``attention_backend``,
  ``<role>.offload``, ``transformer.linear``, ``encoder.weight_storage``);
* ``sample_shift`` is the Wan scheduler's shift (``transformer.flow_shift``);
* Mooncake's keys in ``disagg_config`` (``protocol``, ``local_hostname``, ``metadata_server``,
  ``device_name``) go to the ``mooncake`` section, read below the ``MOONCAKE_*`` variables and
  above the Mooncake config file (LightX2V reads its ``protocol`` and never uses it);
* sizes diffring reads from the model folder (``vae_stride``, ``text_encoder_dim``,
  ``clip_embed_dim``, ...) and LightX2V's static rooms and ranks are ignored, each with why.

Nothing here imports a model library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from contracts.pipelines import MODEL_TASKS, pipeline_name, task_spec

__all__ = ["DISAGG_ROOMS", "LIGHTX2V_KEYS", "LIGHTX2V_PORTS", "MOONCAKE_KEYS", "NO_ROOMS", "Note",
           "translate"]

# The seed's API ports per example group: encoder / transformer / decoder (its guide's table;
# its request scripts post there). diffring's groups by pipeline name.
LIGHTX2V_PORTS: Final[dict[str, dict[str, int]]] = {
    "wan_t2v": {"encoder": 8002, "transformer": 8003, "decoder": 8006},
    "wan_i2v": {"encoder": 8004, "transformer": 8005, "decoder": 8007},
    "qwen_t2i": {"encoder": 8002, "transformer": 8003, "decoder": 8008},
    "qwen_i2i": {"encoder": 8012, "transformer": 8013, "decoder": 8014},
    # LightX2V runs Edit-2509 / 2511 as its i2i task: the same request script and ports.
    "qwen_i2i_plus": {"encoder": 8012, "transformer": 8013, "decoder": 8014},
}

# LightX2V's Qwen-Image aspect-ratio table (width, height), used when a request or a config
# names an aspect ratio and no size (its qwen_image_runner.get_custom_shape).
QWEN_ASPECT_SIZES: Final[dict[str, tuple[int, int]]] = {
    "16:9": (1664, 928), "9:16": (928, 1664), "1:1": (1328, 1328), "4:3": (1472, 1104),
    "3:4": (1104, 1472), "3:2": (1584, 1056), "2:3": (1056, 1584),
}

# LightX2V kernel names -> diffring's DiT attention backend.
_KERNELS: Final[dict[str, str]] = {
    "sage_attn2": "sage_attn", "sage_attn3": "sage_attn", "sageattn": "sage_attn",
    "flash_attn2": "flash_attn", "flash_attn3": "flash_attn", "torch_sdpa": "sdpa",
}
_ATTENTION_KEYS: Final = ("self_attn_1_type", "attn_type", "cross_attn_1_type",
                          "cross_attn_2_type")
MOONCAKE_KEYS: Final = ("protocol", "local_hostname", "metadata_server", "device_name")

# diffusers' prompt templates of the Qwen pipelines (the text before and after the prompt),
# which diffring's encoders use; a LightX2V config that names the same is "built in".
_QWEN_TEMPLATE_STARTS: Final[dict[str, int]] = {"t2i": 34, "i2i": 64, "i2i_plus": 64}

_FROM_FOLDER = "diffring reads it from the model folder (the component's config)"
NO_ROOMS = "diffring workers pull from rings; there are no static rooms or ranks"


@dataclass(frozen=True)
class Note:
    """What happened to one LightX2V key."""

    key: str
    """Where it was in the file (``infer_steps``, ``disagg_config.protocol``)."""
    value: Any
    to: str | None
    """The diffring setting it set (``request_defaults.infer_steps``); None: ignored."""
    why: str = ""
    """Why it was ignored, or what the mapping means (empty: nothing to add)."""

    def line(self) -> str:
        if self.to is None:
            return f"{self.key} = {self.value!r}: ignored ({self.why})"
        extra = f" ({self.why})" if self.why else ""
        return f"{self.key} = {self.value!r} -> {self.to}{extra}"


@dataclass
class _Run:
    """One translation: the output object, the notes and the problems so far."""

    src: Mapping[str, Any]
    """The file as written (a rule may look at other keys of it)."""
    out: dict[str, Any]
    family: str
    task: str
    role: str | None
    notes: list[Note]
    problems: list[str]
    model_cls: str = "wan2.1"

    def set(self, key: str, value: Any, to: str, why: str = "", target: Any = None) -> None:
        """Set diffring's ``to`` (dotted: ``section.key``) to ``target`` (default: the
        ``value`` of ``key``) unless the file sets it itself."""
        target_value = value if target is None else target
        section, _, name = to.rpartition(".")
        where = self.out
        if section:
            current = where.get(section)
            if current is None:
                current = where[section] = {}
            if not isinstance(current, dict):
                self.problems.append(f"{key}: {section} must be an object to take {to}")
                return
            where = current
        if name in where and where[name] != target_value:
            self.notes.append(Note(key, value, None, f"{to} is set in the file: "
                                                     f"{where[name]!r} wins"))
            return
        where[name] = target_value
        self.notes.append(Note(key, value, to, why))

    def ignore(self, key: str, value: Any, why: str) -> None:
        self.notes.append(Note(key, value, None, why))

    def bad(self, key: str, value: Any, message: str) -> None:
        self.problems.append(f"{key} = {value!r}: {message}")


Rule = Callable[[_Run, str, Any], None]


def _default(name: str, why: str = "") -> Rule:
    def rule(run: _Run, key: str, value: Any) -> None:
        run.set(key, value, f"request_defaults.{name}", why)
    return rule


def _ignored(why: str) -> Rule:
    def rule(run: _Run, key: str, value: Any) -> None:
        run.ignore(key, value, why)
    return rule


def _text_len(run: _Run, key: str, value: Any) -> None:
    if run.family == "wan":
        run.set(key, value, "request_defaults.max_sequence_length",
                "the text tokens the DiT sees")
    else:
        run.ignore(key, value, "LightX2V's text-encoder buffer length; a Qwen request carries "
                   "max_sequence_length (1..1024, default 512), which request_defaults may set")


def _guide_scale(run: _Run, key: str, value: Any) -> None:
    name = "guidance_scale" if run.family == "wan" else "true_cfg_scale"
    if run.src.get("enable_cfg") is False:
        run.ignore(key, value, "enable_cfg is false: guidance is off")
        return
    if isinstance(value, list | tuple):
        # Wan2.2-A14B's pair, LightX2V's order: the high-noise expert's scale, then the
        # low-noise one's (its MoE runner reads [0] above the boundary, [1] below).
        if run.model_cls != "wan2.2_moe" or len(value) != 2:
            run.bad(key, value, "a pair of scales is for the two experts of Wan2.2-A14B "
                    "(model_cls wan2.2_moe): [high_noise, low_noise]")
            return
        run.set(key, value[0], "request_defaults.guidance_scale", "the high-noise expert's",
                target=value[0])
        run.set(key, value[1], "request_defaults.guidance_scale_2", "the low-noise expert's",
                target=value[1])
        return
    run.set(key, value, f"request_defaults.{name}")


def _enable_cfg(run: _Run, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        run.bad(key, value, "expected true or false")
    elif value:
        run.ignore(key, value, "guidance is on whenever the guidance scale is above 1 "
                   "(sample_guide_scale)")
    else:
        name = "guidance_scale" if run.family == "wan" else "true_cfg_scale"
        run.set(key, value, f"request_defaults.{name}", "1.0: guidance off", target=1.0)


def _size(name: str) -> Rule:
    def rule(run: _Run, key: str, value: Any) -> None:
        if run.family == "qwen" and run.task != "t2i":
            run.ignore(key, value, "an edit's output size follows its input image (~1 "
                       "megapixel), as diffusers' pipeline and LightX2V's i2i do; a request "
                       "may set target_shape")
            return
        run.set(key, value, f"request_defaults.{name}")
    return rule


def _aspect_ratio(run: _Run, key: str, value: Any) -> None:
    if run.family != "qwen":
        run.ignore(key, value, "LightX2V reads it for Qwen-Image only")
    elif run.task != "t2i":
        run.ignore(key, value, "an edit's output size follows its input image")
    elif "target_height" in run.src or "target_width" in run.src:
        run.ignore(key, value, "target_height / target_width win, as in LightX2V")
    elif value not in QWEN_ASPECT_SIZES:
        run.bad(key, value, f"LightX2V's aspect ratios are {', '.join(QWEN_ASPECT_SIZES)}")
    else:
        run.set(key, value, "request_defaults.aspect_ratio",
                "LightX2V's size for it: {}x{}".format(*QWEN_ASPECT_SIZES[value]))


def _sample_shift(run: _Run, key: str, value: Any) -> None:
    if run.family != "wan":
        run.ignore(key, value, "Qwen-Image's scheduler shifts by the image's size "
                   "(diffusers' dynamic shifting)")
    elif run.role not in (None, "transformer", "all"):
        run.ignore(key, value, "the scheduler runs in the transformer stage: its file's "
                   "sample_shift counts")
    else:
        run.set(key, value, "transformer.flow_shift",
                "the UniPC scheduler's flow_shift, instead of the folder's")


def _attention(run: _Run, key: str, value: Any) -> None:
    if run.role not in (None, "transformer", "all"):
        run.ignore(key, value, f"the {run.role}'s models run transformers' / diffusers' own "
                   "attention; the DiT's kernel is the transformer file's")
        return
    backend = _KERNELS.get(value) if isinstance(value, str) else None
    if backend is None:
        run.bad(key, value, f"no diffring attention backend for it (LightX2V kernels served: "
                f"{', '.join(_KERNELS)}); set attention_backend instead")
        return
    first = next(k for k in _ATTENTION_KEYS if k in run.src)
    if key != first:
        if _KERNELS.get(run.src[first]) == backend:
            run.ignore(key, value, f"the same kernel as {first}: one backend runs all of "
                       "the DiT's attention")
        else:
            run.ignore(key, value, f"one backend runs all of the DiT's attention: {first}'s")
        return
    run.set(key, value, "attention_backend", "sdpa where the kernel cannot run here "
            "(attention_fallback)", target=backend)
    run.out["attention_fallback"] = run.out.get("attention_fallback", "sdpa")


def _offload_role(run: _Run) -> list[str]:
    return ["encoder", "transformer", "decoder"] if run.role in (None, "all") else [run.role]


def _cpu_offload(run: _Run, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        run.bad(key, value, "expected true or false")
        return
    if run.role == "controller":
        run.ignore(key, value, "the controller loads no model")
        return
    if not value:
        run.ignore(key, value, "no offload: diffring's default")
        return
    mode = "leaf" if run.src.get("offload_granularity") == "phase" else "block"
    for role in _offload_role(run):
        run.set(key, value, f"{role}.offload", "weights in pinned host memory, moved in ahead "
                "of use (diffusers' group offloading)", target=mode)


def _t5_offload(run: _Run, key: str, value: Any) -> None:
    if value is True and run.role in (None, "encoder", "all"):
        run.set(key, value, "encoder.offload", target="block")
    else:
        run.ignore(key, value, "only the encoder holds the text encoder" if value else
                   "no offload: diffring's default")


def _dit_quantized(run: _Run, key: str, value: Any) -> None:
    if not value:
        run.ignore(key, value, "bf16 DiT: diffring's default")
        return
    scheme = str(run.src.get("dit_quant_scheme", run.src.get("quant_scheme", "")))
    if run.role not in (None, "transformer", "all"):
        run.ignore(key, value, "only the transformer stage holds the DiT")
    elif scheme.startswith("fp8"):
        run.set(key, value, "transformer.linear", target="fp8", why=
                "FP8 matmuls with rowwise scales, quantised at load (torchao); pre-quantised "
                "files are not read")
    else:
        run.bad(key, value, f"quantisation scheme {scheme or '(none)'!r} is not served; "
                "diffring offers transformer.linear 'fp8' and weight_storage 'fp8' "
                "(docs/dit-options.md)")


def _encoder_quantized(run: _Run, key: str, value: Any) -> None:
    if value and run.role in (None, "encoder", "all"):
        run.set(key, value, "encoder.weight_storage", "FP8 weight storage, computed in the "
                "stage's dtype", target="fp8")
    else:
        run.ignore(key, value, "only the encoder holds it" if value else "not quantised")


def _vae_tiling(run: _Run, key: str, value: Any) -> None:
    if value and run.role in (None, "decoder", "all"):
        run.set(key, value, "decoder.vae_tiling", target=True)
    else:
        run.ignore(key, value, "only the decoder decodes" if value else "off: the default")


def _prompt_template(run: _Run, key: str, value: Any) -> None:
    if run.family != "qwen":
        run.ignore(key, value, "Wan encodes the prompt without a template")
        return
    if key.endswith("_start_idx"):
        want = _QWEN_TEMPLATE_STARTS.get(run.task)
        why = ("diffusers' own for this task, built in" if value == want else
               f"diffring cuts diffusers' template at {want}, its own")
        run.ignore(key, value, why)
        return
    run.ignore(key, _short(value), "diffring encodes with diffusers' Qwen-Image template of "
               "the task (the text around the prompt), as its pipelines do")


def _short(value: Any) -> Any:
    return value if not isinstance(value, str) or len(value) <= 40 else value[:37] + "..."


def _condition_size(run: _Run, key: str, value: Any) -> None:
    run.ignore(key, value, "diffusers' QwenImageEditPlusPipeline sizes condition images for "
               "the vision-language encoder at 384x384 = 147456 pixels, built in"
               + ("" if value == 384 * 384 else "; this value is not used"))


def _resize_mode(run: _Run, key: str, value: Any) -> None:
    if run.family == "qwen":
        run.ignore(key, value, "LightX2V's Qwen runners do not read it either; the edit's "
                   "output follows its input image")
    else:
        run.set(key, value, "request_defaults.resize_mode")


# Every key of LightX2V's published disaggregation stage configs (configs/disagg/wan and
# configs/disagg/qwen, the controller file included) and the few model keys its other Wan
# configs carry, with what diffring does with each. Keys diffring reads as they are
# (model_cls, task, disagg_mode) are its own.
LIGHTX2V_KEYS: Final[dict[str, Rule]] = {
    "infer_steps": _default("infer_steps"),
    "target_video_length": _default("num_frames"),
    "target_height": _size("height"),
    "target_width": _size("width"),
    "fps": _default("fps"),
    "text_len": _text_len,
    "sample_guide_scale": _guide_scale,
    "enable_cfg": _enable_cfg,
    "sample_shift": _sample_shift,
    "aspect_ratio": _aspect_ratio,
    "resize_mode": _resize_mode,
    "sample_neg_prompt": _default("negative_prompt"),
    "self_attn_1_type": _attention,
    "cross_attn_1_type": _attention,
    "cross_attn_2_type": _attention,
    "attn_type": _attention,
    "cpu_offload": _cpu_offload,
    "offload_granularity": _ignored("read with cpu_offload ('phase' offloads per layer)"),
    "t5_cpu_offload": _t5_offload,
    "dit_quantized": _dit_quantized,
    "dit_quant_scheme": _ignored("read with dit_quantized"),
    "quant_scheme": _ignored("read with dit_quantized"),
    "t5_quantized": _encoder_quantized,
    "clip_quantized": _encoder_quantized,
    "use_tiling_vae": _vae_tiling,
    "clip_embed_dim": _ignored("diffring moves each tensor at its own size (a descriptor "
                               "carries its shape and bytes); no buffer is reserved"),
    "vae_z_dim": _ignored(_FROM_FOLDER),
    "vae_stride": _ignored(_FROM_FOLDER),
    "vae_scale_factor": _ignored(_FROM_FOLDER),
    "text_encoder_dim": _ignored(_FROM_FOLDER),
    "patch_size": _ignored(_FROM_FOLDER),
    "text_encoder_type": _ignored("diffring runs transformers' Qwen2.5-VL; LightLLM kernels "
                                  "are not used"),
    "max_custom_size": _ignored("requests up to 4096 pixels a side are served as asked; "
                                "larger ones are refused, not scaled down"),
    "prompt_template_encode": _prompt_template,
    "prompt_template_encode_start_idx": _prompt_template,
    "CONDITION_IMAGE_SIZE": _condition_size,
    "USE_IMAGE_ID_IN_PROMPT": _ignored("'Picture N:' before each image, as diffusers' "
                                       "QwenImageEditPlusPipeline: built in (task i2i_plus)"),
    "seed": _ignored("each request carries its own seed (default 0)"),
    "boundary": _ignored("Wan2.2-A14B's switch between its experts is the model folder's "
                         "boundary_ratio (model_index.json), as in diffusers' pipelines"),
    "boundary_step_index": _ignored("the experts switch at the folder's boundary timestep, "
                                    "whatever the step count"),
    "denoising_step_list": _ignored("diffring runs the folder's scheduler (UniPC) for "
                                    "infer_steps steps; a fixed timestep list is not served"),
    "feature_caching": _ignored("step caches are diffusers' (transformer.cache, "
                                "docs/lora.md); LightX2V's are not mapped"),
    "unload_modules": _ignored("each stage process holds only its own components"),
    "lazy_load": _ignored("components are loaded whole at start"),
    "rope_type": _ignored("diffusers' RoPE of the model"),
    "use_image_encoder": _ignored("Wan I2V always runs its CLIP image encoder, as diffusers"),
}

# Keys of LightX2V's disagg_config that DisaggConfig does not read (its rooms and ranks are
# handled there, with the same reason; Mooncake's go to the mooncake section).
DISAGG_ROOMS: Final = ("bootstrap_room", "sender_engine_rank", "receiver_engine_rank",
                        "decoder_engine_rank", "decoder_bootstrap_room",
                        "transformer_engine_rank", "encoder_engine_rank")


def _family_task(data: Mapping[str, Any]) -> tuple[str, str]:
    model_cls = data.get("model_cls", "wan2.1")
    task = data.get("task", MODEL_TASKS.get(str(model_cls), ("t2v",))[0])
    try:
        name = pipeline_name(str(model_cls), str(task))
    except Exception:  # a bad pair is the config's own error, reported by the reader
        return ("qwen" if model_cls == "qwen_image" else "wan"), str(task)
    return task_spec(name).family, str(task)


def translate(data: Mapping[str, Any], role: str | None = None
              ) -> tuple[dict[str, Any], list[Note], list[str]]:
    """(``data`` in diffring's keys, the notes, the problems): every LightX2V key of the
    table mapped or noted as ignored, Mooncake's ``disagg_config`` keys moved to
    ``mooncake``. ``role``: the service the file is for (else its ``disagg_mode``)."""
    out = dict(data)
    mode = out.get("disagg_mode")
    role = role or {"decode": "decoder", "encode": "encoder"}.get(str(mode), mode)
    family, task = _family_task(out)
    run = _Run(data, out, family, task, role, [], [], str(out.get("model_cls", "wan2.1")))
    for key in [k for k in data if k in LIGHTX2V_KEYS]:
        LIGHTX2V_KEYS[key](run, key, out.pop(key))
    disagg = out.get("disagg_config")
    if isinstance(disagg, Mapping):
        disagg = dict(disagg)
        for key in MOONCAKE_KEYS:
            if key in disagg:
                value = disagg.pop(key)
                run.set(f"disagg_config.{key}", value, f"mooncake.{key}",
                        "below MOONCAKE_* variables, above the Mooncake config file")
        for key in DISAGG_ROOMS:
            if key in disagg:
                run.ignore(f"disagg_config.{key}", disagg.pop(key), NO_ROOMS)
        out["disagg_config"] = disagg
    return out, run.notes, run.problems
