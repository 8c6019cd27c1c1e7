"""A service's whole configuration file: role, model, device, Mooncake, front door, and the
metadata-plane section (:class:`contracts.disagg.DisaggConfig`, LightX2V's ``disagg_config``).

Frozen dataclasses with a docstring per field, validated in ``__post_init__``; unknown keys
are an error that names them (:func:`contracts.configio.from_mapping`). The cluster token's
development default and its refusal off loopback are :mod:`contracts.cluster_token`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contracts import faults
from contracts.cluster_token import DEFAULT_TOKEN
from contracts.configio import file_fields, from_mapping
from contracts.disagg import DisaggConfig
from contracts.errors import ConfigError, InvalidRequestError
from contracts.lightx2v import MOONCAKE_KEYS, Note, translate
from contracts.parallel import ParallelLayout
from contracts.pipelines import (
    ATTENTION_BACKENDS,
    DTYPES,
    MODEL_TASKS,
    VIDEO_CODECS,
    X264_PRESETS,
    check_device,
    parse_shape,
    pipeline_name,
    task_spec,
)
from contracts.recipes import recipe
from contracts.request import check_request_defaults
from contracts.stage_options import SPLIT_EXPERTS, StageOptions
from rings.layout import RING_NAMES

STAGE_SECTIONS = ("encoder", "transformer", "decoder")
"""The per-stage option sections of a service's file (:class:`StageOptions`)."""

__all__ = [
    "DEFAULT_TOKEN",
    "RING_NAMES",
    "STAGE_SECTIONS",
    "DisaggConfig",
    "ServerConfig",
    "ServiceConfig",
]


@dataclass(frozen=True)
class ServerConfig:
    """The controller's HTTP front door and every service's metrics endpoint."""

    host: str = "127.0.0.1"
    """Address the front door binds to (never silently 0.0.0.0)."""
    port: int = 8000
    """Front-door port."""
    metric_port: int | None = None
    """Prometheus metrics port of this service; None disables the metrics endpoint."""
    api_key: str | None = None
    """Front-door API key: when set, every request but ``GET /health`` (and the API docs)
    must carry ``Authorization: Bearer <key>`` or gets 401. ``DIFFRING_API_KEY`` wins."""
    max_image_pixels: int = 40_000_000
    """Largest input image (width x height) the front door accepts; larger ones get 413
    before they are decoded (decompression-bomb guard)."""
    max_image_bytes: int = 32 << 20
    """Largest input image file (after base64 decoding) the front door accepts (413)."""
    image_url_hosts: tuple[str, ...] = ()
    """Hosts an ``image_path`` URL (http or https) may name; the front door fetches it, at
    most ``max_image_bytes`` within ``image_fetch_timeout_s``, no redirects. Empty: URLs are
    refused (422)."""
    image_fetch_timeout_s: float = 10.0
    """The longest an ``image_path`` URL's fetch may take, whole (422 past it)."""
    input_dir: str | None = None
    """A folder whose files an ``image_path`` may name (relative to it, or absolute inside
    it; never outside it, links resolved first). None: paths are refused (422)."""
    lightx2v_ports: dict[str, int] | None = None
    """Controller (and ``all``): LightX2V's per-stage API ports, ``{"encoder": 8002,
    "transformer": 8003, "decoder": 8006}``, on which its three-POST request scripts work
    unchanged (controller/http/lightx2v_edge.py); the encoder's may be ``port``. None: not
    opened."""
    lightx2v_pair_timeout_s: float = 60.0
    """How long a three-POST flow's Decoder POST waits for its Encoder POST before the flow
    fails (its status says so)."""
    max_input_images: int = 3
    """Most input images one request of a multi-image pipeline (``qwen_i2i_plus``) may carry;
    more get 413. Each is held to ``max_image_bytes`` and ``max_image_pixels``, and request
    bodies are capped at this many largest images. Qwen's guidance for Edit-2509 / 2511 is
    one to three input images."""

    def __post_init__(self) -> None:
        for p in (self.port, self.metric_port):
            if p is not None and not 0 <= p <= 65535:
                raise ConfigError(f"port {p} is out of range")
        if self.api_key is not None and (
            len(self.api_key) < 16 or not self.api_key.isascii() or not self.api_key.isprintable()
            or " " in self.api_key
        ):
            raise ConfigError(
                "server.api_key must be at least 16 printable ASCII characters without spaces "
                "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        if self.max_image_pixels <= 0 or self.max_image_bytes <= 0:
            raise ConfigError("server.max_image_pixels and max_image_bytes must be positive")
        if self.lightx2v_ports is not None:
            roles = ("encoder", "transformer", "decoder")
            if sorted(self.lightx2v_ports) != sorted(roles) or not all(
                    isinstance(p, int) and 0 < p <= 65535 for p in self.lightx2v_ports.values()):
                raise ConfigError("server.lightx2v_ports must give a port (1-65535) for each "
                                  "of encoder, transformer, decoder, e.g. {\"encoder\": 8002, "
                                  "\"transformer\": 8003, \"decoder\": 8006}")
            ports = self.lightx2v_ports
            if len(set(ports.values())) != 3:
                raise ConfigError(f"server.lightx2v_ports must be three different ports, got "
                                  f"{ports}")
            clash = [r for r in ("transformer", "decoder") if ports[r] == self.port]
            if clash:
                raise ConfigError(
                    f"server.lightx2v_ports: the {clash[0]}'s port {self.port} is the front "
                    "door's (server.port); only the encoder's may be (a single POST there is "
                    "a task of its own): move the front door to the encoder's port")
            if self.metric_port in ports.values():
                raise ConfigError(f"server.lightx2v_ports: {self.metric_port} is the metrics "
                                  "port")
        if not self.image_fetch_timeout_s > 0:
            raise ConfigError("server.image_fetch_timeout_s must be positive")
        bad_hosts = [h for h in self.image_url_hosts
                     if not h or h != h.lower() or "/" in h or ":" in h or " " in h]
        if bad_hosts:
            raise ConfigError(f"server.image_url_hosts: {bad_hosts[0]!r} is not a host name in "
                              "lower case (no scheme, port or path), e.g. \"images.example.com\"")
        if not self.lightx2v_pair_timeout_s > 0:
            raise ConfigError("server.lightx2v_pair_timeout_s must be positive")
        if not 1 <= self.max_input_images <= 64:
            raise ConfigError("server.max_input_images must be between 1 and 64, got "
                              f"{self.max_input_images}")


@dataclass(frozen=True)
class ServiceConfig:
    """One service's whole configuration file (controller, a worker, or ``all``)."""

    disagg_mode: str | None = None
    """Role this file is for (LightX2V naming); --service on the command line wins."""
    model_cls: str = "wan2.1"
    """Model family: 'wan2.1', 'qwen_image' or 'synthetic' (timed stages, no model)."""
    task: str = "t2v"
    """Task: 't2v' / 'i2v' for wan2.1; 't2i' / 'i2i' / 'i2i_plus' (Qwen-Image-Edit-2509 /
    2511) for qwen_image; 't2i' for synthetic."""
    model_path: str | None = None
    """Local diffusers-format model folder (workers and ``all``)."""
    device: str = "cpu"
    """Torch device of a worker's model stage: 'cpu' or 'cuda:N'."""
    devices: tuple[str, ...] = ()
    """Transformer group: one device per rank (``--devices cuda:0,cuda:1``), as many as
    ``transformer.parallel`` has ranks; rank 0's is the worker's ``device``. Empty: one
    process on ``device``."""
    dtype: str = "float32"
    """Model dtype: 'float32' or 'bfloat16'."""
    attention_backend: str = "sdpa"
    """DiT attention backend: 'sdpa', 'sdpa_cudnn', 'sdpa_flash', 'flash_attn', 'sage_attn',
    'fp8_cudnn' (FP8 self-attention through cuDNN's graph, Hopper and newer; lossy:
    workers/models/dit/fp8_attention.py), 'sage2' (SageAttention2's sm90 kernel, Hopper only;
    lossy: workers/models/dit/sage2_attention.py)."""
    compile: bool = False
    """Transformer stage: torch.compile the DiT's repeated blocks at start. Needs
    ``warmup_shapes``: the worker compiles them before it registers (ready = compiled)."""
    cfg_batch: bool = False
    """Transformer stage: run the two classifier-free-guidance branches as one batch-2
    forward instead of two batch-1 forwards."""
    warmup_shapes: tuple[str, ...] = ()
    """Transformer stage: geometries ("HxW" for images, "HxWxF" for videos) run through a
    short denoising loop on synthetic inputs at start, before the worker registers."""
    video_codec: str = "auto"
    """MP4 encoder: 'libx264', 'h264_nvenc', or 'auto' (NVENC when it opens, else libx264)."""
    video_preset: str = "veryfast"
    """libx264 preset, 'ultrafast' .. 'veryslow' (NVENC: the preset of similar rank)."""
    video_crf: int = 18
    """libx264 constant rate factor, 0 (lossless) .. 51 (NVENC: its constant quality)."""
    video_threads: int = 0
    """libx264 threads; 0 = one per core."""
    encode_queue: int = 2
    """Decoder: results being encoded and written in the background at most; the decoder
    claims its next task meanwhile and reports each completion after its file is written.
    0 = encode in the foreground."""
    result_write_retry_s: float = 600.0
    """Decoder: how long a result whose file cannot be written for the storage's reasons (a
    full disk, a read-only, missing or forbidden output folder, here or at the controller)
    is held and its write retried, with back-off. Meanwhile the task stays this decoder's,
    uncharged, and the front door refuses new tasks (503). Past it the decoder drops the
    result and hands the task back, uncharged: the controller runs it again (from the
    start, the decoded result is gone), so no accepted task fails for a full disk; cancel
    those you no longer want."""
    max_held_results: int = 4
    """Decoder: results it holds at most while their files cannot be written (each held in
    memory, encoded). While it holds this many it claims nothing new, so the next stage's
    outputs wait in its pool and the ring (backpressure); a write failing beyond the bound
    (a result already being encoded) hands its task back at once, uncharged."""
    torch_threads: int | None = None
    """CPU threads torch may use in this process (None: torch's default). Many CPU workers
    sharing few cores want 1."""
    output_dir: str = "out/results"
    """Folder results are written to (decoder, ``all``); the controller serves them."""
    mooncake_config_path: str | None = None
    """Mooncake config JSON (MOONCAKE_CONFIG_PATH from the environment otherwise)."""
    staging_pool_mb: int = 512
    """Size of a worker's registered staging pool in MiB (bounded: full means backpressure)."""
    prompt_cache_mb: int = 256
    """Encoder: bytes of text embeddings (MiB) kept for repeated prompts, least recently used
    first out, on the encoder's device; 0 turns the cache off."""
    heartbeat_interval_s: float = 1.0
    """How often a worker renews its leases with the controller (an idle worker, holding
    nothing, heartbeats every min(5, lease_timeout_s / 3) s, never more often than this)."""
    lease_timeout_s: float = 15.0
    """A task whose worker missed heartbeats this long goes back in play."""
    reconnect_timeout_s: float = 300.0
    """How long a worker waits for its controller to come (back) up before giving up."""
    drain_timeout_s: float = 600.0
    """A draining worker (SIGTERM) finishes its task, then waits up to this long for the next
    stage to pull the outputs it staged (they live only in its pool) before it exits."""
    max_pending_tasks: int = 256
    """Front door: tasks accepted but not finished before new ones get 429."""
    max_task_failures: int = 3
    """Controller: failures a task itself causes (its stage raises, its tensors keep failing
    their checksum, a transfer fails while its producer lives) before it is failed. Lost
    workers, expired leases, controller restarts and dead producers never count."""
    poison_worker_deaths: int = 3
    """Controller: consecutive attempts of one task that each lose the worker holding it
    before the task is quarantined as poison (failed, error_type ``poison``)."""
    release_ahead: int | None = 2
    """Controller: how far queued work runs ahead of the DiT workers. Tasks between the
    controller and a DiT's claim (queued, encoding, encoded and waiting) are held to the
    registered encoders + transformers + this, counted per priority class and up (a task is
    released while fewer than that of its class or a higher one are ahead); the rest wait in
    the controller, released highest priority first, oldest first within a class. So the
    rings stay shallow and the ordering happens in the controller. None: every task goes to
    the request ring at once, in arrival order (a full ring answers 429)."""
    preempt_after_s: float | None = 30.0
    """Controller: a task encoded and waiting for a DiT this long, while every DiT worker is
    busy and one runs a task of a lower priority class, has that DiT hand its task back at
    its next step boundary (checkpointed: it resumes later, unchanged and uncharged). Only
    DiT workers that checkpoint can be asked. None: never preempt."""
    max_preemptions: int = 2
    """Controller: times one task can be preempted at most (then it runs to its end)."""
    checkpoint_store_mb: int = 1024
    """Controller: MiB of denoising checkpoints it keeps at most (host memory, and the same
    again in files under ``<output_dir>/.journal/checkpoints`` so that they survive a
    restart): each unfinished task's latest checkpoint and its encoder outputs, or its final
    latents until the result is written. A checkpoint that does not fit is refused (the DiT
    goes on; the task keeps its older one). 0: keep none (DiT workers do not checkpoint)."""
    faults: str | None = None
    """Fault points to arm in this process (tests and chaos runs only; syntax in
    contracts/faults.py, e.g. ``worker.after_pop:exit``); DIFFRING_FAULTS wins."""
    task_retention_s: float = 86400.0
    """How long a finished task (completed, failed, cancelled) stays in the controller's task
    store: its status and result are served until then, then it is forgotten."""
    delete_results_after_retention: bool = False
    """Also delete a forgotten task's result file (default: result files stay)."""
    attention_fallback: str | None = None
    """Transformer stage: the backend to run where ``attention_backend`` cannot (its package
    or a CUDA GPU missing), with a warning; None: such a worker refuses to start. A LightX2V
    kernel key (``self_attn_1_type: "sage_attn2"``) sets it to 'sdpa'."""
    dit_original_ckpt: str | None = None
    """Transformer stage: a single-file DiT checkpoint (LightX2V's key) loaded instead of the
    model folder's own DiT, converted at load by diffusers' single-file loader: the
    original key names, ComfyUI's, or diffusers' (docs/models.md). The DiT's config is the
    folder's."""
    vae_path: str | None = None
    """Stages that read the VAE: a VAE loaded instead of the model folder's own (LightX2V's
    key): a single file in the original Wan VAE names (``Wan2.1_VAE.pth``, ComfyUI's VAE
    files) or diffusers' names, converted at load by diffusers' Wan VAE converter (Qwen-Image
    too: its VAE has the same names), or a diffusers VAE folder. A file's config is the
    folder's VAE config (Wan: the published one where the folder has none)."""
    request_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Controller (and ``all``): what a request that leaves a field unset gets, before the
    pipeline's own defaults: ``infer_steps``, ``height``, ``width``, ``num_frames``, ``fps``,
    ``guidance_scale``, ``true_cfg_scale``, ``max_sequence_length``, ``negative_prompt``,
    ``aspect_ratio``, ``resize_mode`` (LightX2V's model knobs land here)."""
    recipe: str | None = None
    """How a step-distilled model is served (:mod:`contracts.recipes`): its request defaults
    (below ``request_defaults``), its scheduler settings, and, CFG-distilled, the refusal of
    requests asking for guidance. E.g. ``"wan2.1-distill-4step"``,
    ``"qwen-image-lightning-8step"``. None: the folder's own (a transformer worker reads a
    model folder's ``diffring_recipe.json`` and reports it when it registers)."""
    mooncake: dict[str, str] = dataclasses.field(default_factory=dict)
    """Mooncake settings of this service (``protocol``, ``local_hostname``,
    ``metadata_server``, ``device_name``): below the ``MOONCAKE_*`` variables, above the
    Mooncake config file. LightX2V's ``disagg_config`` carries them."""
    lightx2v: tuple[Note, ...] = dataclasses.field(default=(), compare=False,
                                                  metadata={"from_file": False})
    """What the reader did with the file's LightX2V keys (``--check`` prints it)."""
    encoder: StageOptions = dataclasses.field(default_factory=StageOptions)
    """Encoder stage: weight storage, offload, memory budget (contracts/stage_options.py)."""
    transformer: StageOptions = dataclasses.field(default_factory=StageOptions)
    """Transformer (DiT) stage: the same, plus FP8 linear layers and the compile cache."""
    decoder: StageOptions = dataclasses.field(default_factory=StageOptions)
    """Decoder stage: the same, plus tiled VAE decode."""
    disagg_config: DisaggConfig = dataclasses.field(default_factory=DisaggConfig)
    """Rings and control channel (LightX2V's field names)."""
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    """HTTP front door and metrics."""

    def __post_init__(self) -> None:
        if self.model_cls not in MODEL_TASKS:
            raise ConfigError(
                f"model_cls must be one of {sorted(MODEL_TASKS)}, got {self.model_cls!r}"
            )
        if self.task not in MODEL_TASKS[self.model_cls]:
            raise ConfigError(
                f"task {self.task!r} is not served by model_cls {self.model_cls!r} "
                f"(choose {' or '.join(MODEL_TASKS[self.model_cls])})"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if not check_device(self.device):
            raise ConfigError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")
        self._check_group()
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError("torch_threads must be at least 1 (or null for torch's default)")
        for shape in self.warmup_shapes:
            try:
                parse_shape(shape)
            except ValueError as exc:
                raise ConfigError(f"warmup_shapes: {exc}") from None
        if self.compile and not self.warmup_shapes:
            raise ConfigError(
                "compile needs warmup_shapes (the request geometries to compile for, e.g. "
                '["480x832x81"]), or the first requests would wait for the compiler'
            )
        if self.video_codec not in VIDEO_CODECS:
            raise ConfigError(
                f"video_codec must be one of {', '.join(VIDEO_CODECS)}, got {self.video_codec!r}"
            )
        if self.video_preset not in X264_PRESETS:
            raise ConfigError(
                f"video_preset must be one of {', '.join(X264_PRESETS)}, got "
                f"{self.video_preset!r}"
            )
        if not 0 <= self.video_crf <= 51:
            raise ConfigError(f"video_crf must be within 0..51, got {self.video_crf}")
        if self.video_threads < 0 or self.encode_queue < 0:
            raise ConfigError("video_threads and encode_queue must be >= 0")
        if self.drain_timeout_s < 0:
            raise ConfigError("drain_timeout_s must not be negative")
        if not self.result_write_retry_s >= 0 or self.max_held_results < 1:
            raise ConfigError(
                "result_write_retry_s must be >= 0 (seconds) and max_held_results at least 1"
            )
        if self.prompt_cache_mb < 0:
            raise ConfigError("prompt_cache_mb must be 0 (off) or a positive number of MiB")
        if self.release_ahead is not None and self.release_ahead < 1:
            raise ConfigError("release_ahead must be at least 1 (or null: release at once)")
        if self.preempt_after_s is not None and not self.preempt_after_s >= 0:
            raise ConfigError("preempt_after_s must be >= 0 seconds (or null: never)")
        if self.max_preemptions < 0:
            raise ConfigError("max_preemptions must be >= 0")
        if self.checkpoint_store_mb < 0:
            raise ConfigError("checkpoint_store_mb must be 0 (keep none) or a number of MiB")
        if self.staging_pool_mb <= 0 or self.max_pending_tasks <= 0:
            raise ConfigError("staging_pool_mb and max_pending_tasks must be positive")
        if self.max_task_failures < 1 or self.poison_worker_deaths < 1:
            raise ConfigError("max_task_failures and poison_worker_deaths must be at least 1")
        faults.parse(self.faults)  # a bad spec is a ConfigError naming the entry
        for role in STAGE_SECTIONS:
            self.stage_options(role).check_role(role)
        if self.transformer.linear == "fp8" and self.dtype != "bfloat16":
            raise ConfigError("transformer.linear 'fp8' needs dtype 'bfloat16'")
        if self.transformer.compile_cache_dir is not None and not self.compile:
            raise ConfigError("transformer.compile_cache_dir needs compile: true")
        if self.transformer.cache is not None and self.compile:
            raise ConfigError("transformer.cache (a step cache) cannot be combined with "
                              "compile: its hooks skip blocks by data-dependent branches; "
                              "drop one of them")
        if self.transformer.lora_max_rank is not None and not self.compile:
            raise ConfigError("transformer.lora_max_rank applies with compile: true only "
                              "(the rank of the compiled adapter slots)")
        if not self.task_retention_s > 0:
            raise ConfigError(
                f"task_retention_s must be positive (seconds), got {self.task_retention_s}"
            )
        if self.transformer.flow_shift is not None and task_spec(self.pipeline).family != "wan":
            raise ConfigError("transformer.flow_shift is the Wan scheduler's shift; Qwen-Image "
                              "shifts by the image's size")
        if self.transformer.experts != "both":
            if task_spec(self.pipeline).experts != 2:
                raise ConfigError(f"transformer.experts {self.transformer.experts!r} places the "
                                  "two experts of Wan2.2-A14B; "
                                  f"{self.pipeline} has one DiT")
            if self.compile and self.transformer.experts == "swap":
                raise ConfigError("transformer.experts 'swap' cannot be combined with "
                                  "compile (it moves the weights a compiled graph holds)")
            if self.transformer.experts in SPLIT_EXPERTS and \
                    ParallelLayout.parse(self.transformer.parallel).size > 1:
                raise ConfigError(f"transformer.experts {self.transformer.experts!r} (the split "
                                  "placement) runs one expert on one device; a transformer "
                                  "group (parallel) cannot run a two-expert DiT yet")
        if self.attention_fallback is not None and self.attention_fallback not in (
                ATTENTION_BACKENDS):
            raise ConfigError(f"attention_fallback must be one of {', '.join(ATTENTION_BACKENDS)}"
                              f" or null, got {self.attention_fallback!r}")
        bad = sorted(k for k, v in self.mooncake.items()
                     if k not in MOONCAKE_KEYS or not isinstance(v, str))
        if bad:
            raise ConfigError(f"mooncake: {', '.join(bad)}: the section takes "
                              f"{', '.join(MOONCAKE_KEYS)}, each a string")
        try:
            check_request_defaults(self.pipeline, self.request_defaults)
        except InvalidRequestError as exc:
            raise ConfigError(f"request_defaults: {exc}") from None
        found = recipe(self.recipe, task_spec(self.pipeline).family)
        if found is not None:
            # The file's own request_defaults win over the recipe's; the DiT's options carry
            # the recipe (its scheduler, its refusal of guidance).
            object.__setattr__(self, "request_defaults",
                               {**found.request_defaults, **self.request_defaults})
            object.__setattr__(self, "transformer",
                               dataclasses.replace(self.transformer, recipe=found.name))

    def _check_group(self) -> None:
        """A transformer group's devices against its layout (contracts/parallel.py)."""
        layout = self.transformer.layout
        bad = [d for d in self.devices if not check_device(d)]
        if bad:
            raise ConfigError(f"devices must be 'cpu' or 'cuda:N', got {', '.join(bad)}")
        if len({d.partition(":")[0] for d in self.devices}) > 1:
            raise ConfigError(f"devices {', '.join(self.devices)}: a group is all cpu or all "
                              "cuda")
        cuda = [d for d in self.devices if d.startswith("cuda")]
        if len(set(cuda)) != len(cuda):
            raise ConfigError(f"devices {', '.join(self.devices)}: each rank needs a GPU of "
                              "its own")
        # No devices yet is fine here: --devices may bring them (the group checks at start).
        if layout.size > 1 and self.devices and len(self.devices) != layout.size:
            raise ConfigError(self.group_devices_needed())
        if layout.size == 1 and len(self.devices) > 1:
            raise ConfigError(
                f"devices lists {len(self.devices)} devices but transformer.parallel is unset: "
                f'set it, e.g. "parallel": "cfg=2" or "ulysses={len(self.devices)}" in the '
                "transformer section"
            )
        if layout.cfg == 2 and self.cfg_batch:
            raise ConfigError("cfg_batch runs both guidance branches as one batch on one "
                              "device, transformer.parallel cfg=2 runs them on two: choose one")

    def group_devices_needed(self) -> str:
        """What a transformer group whose ``devices`` do not match its layout is told."""
        layout = self.transformer.layout
        return (f"transformer.parallel {layout} is a group of {layout.size} ranks: give one "
                f"device per rank, e.g. --devices "
                + ",".join(f"cuda:{i}" for i in range(layout.size)))

    def addresses(self, service: str) -> dict[str, str]:
        """The addresses ``service`` binds, advertises or joins, by config key (what the
        development-token check looks at; see :func:`contracts.cluster_token.require_token`)."""
        d = self.disagg_config
        out: dict[str, str] = {}
        if service != "all":  # the baseline has no rings and no control channel
            out["disagg_config.bootstrap_addr"] = d.bootstrap_addr
            for ring in RING_NAMES:
                out[f"disagg_config.rdma_{ring}_host"] = d.ring_address(ring)[0]
        if service in ("controller", "all") or self.server.metric_port is not None:
            out["server.host"] = self.server.host
        return out

    def stage_options(self, role: str) -> StageOptions:
        """The options section of one stage ('encoder', 'transformer' or 'decoder')."""
        found: StageOptions = getattr(self, role)
        return found

    @property
    def pipeline(self) -> str:
        """Short pipeline name: a row of :data:`contracts.pipelines.TASK_SPECS` (wan_t2v,
        wan22_a14b_i2v, qwen_i2i_plus, ...)."""
        return pipeline_name(self.model_cls, self.task)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], role: str | None = None) -> ServiceConfig:
        """Read one service's file: LightX2V's keys translated (:mod:`contracts.lightx2v`),
        then every section read strictly; every problem found is reported at once, each
        naming where its setting lives. ``role``: the service it is for (else the file's
        ``disagg_mode``), which LightX2V's per-stage keys need."""
        # ``lightx2v`` is the reader's output: a config written back (a transformer group's
        # ranks read ``dataclasses.asdict`` of it) carries it, already translated.
        data = {k: v for k, v in data.items() if k != "lightx2v"}
        data, notes, problems = translate(data, role)
        sections: dict[str, Any] = {}

        def read(name: str, build: Any) -> None:
            try:
                sections[name] = build()
            except ConfigError as exc:
                problems.append(str(exc))

        read("disagg_config", lambda: DisaggConfig.from_dict(data.pop("disagg_config", None)))
        read("server", lambda: from_mapping(ServerConfig, data.pop("server", None), "server",
                                            hints=_hints("server")))
        for role_name in STAGE_SECTIONS:
            section = data.pop(role_name, None)
            if isinstance(section, Mapping) and "recipe" in section and (
                    section["recipe"] in (None, data.get("recipe"))):
                # A config written back: the copy of the top level's recipe.
                section = {k: v for k, v in section.items() if k != "recipe"}
            read(role_name, lambda r=role_name, s=section: from_mapping(
                StageOptions, s, r, hints=_hints(r)))
        if problems:  # the sections first: the whole object needs them
            unknown = [k for k in data if k not in file_fields(cls)]
            hints = _hints("config")
            problems += [f"unknown config key config.{k}" + (
                f": it lives in {hints[k]}" if k in hints else "") for k in unknown]
            raise ConfigError(_listed(problems))
        # The sections go in with the rest, so that checks across them (a group's devices
        # against transformer.parallel) see the file's values, not the defaults.
        try:
            cfg = from_mapping(cls, {**data, **sections}, "config", hints=_hints("config"))
        except ConfigError as exc:
            raise ConfigError(_listed([*problems, str(exc)])) from None
        object.__setattr__(cfg, "lightx2v", tuple(notes))
        return cfg

    @classmethod
    def load(cls, path: str | None, role: str | None = None,
             overrides: Mapping[str, Any] | None = None) -> ServiceConfig:
        """Read a JSON config file (None: all defaults). ``overrides``: top-level keys the
        command line gives (``--model_cls``, ``--task``), set before the file is read, so
        that LightX2V's keys are translated for the right pipeline."""
        if path is None:
            return cls.from_dict(dict(overrides or {}), role)
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a JSON object")
        return cls.from_dict({**data, **(overrides or {})}, role)


def _listed(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)


def _hints(where: str) -> dict[str, str]:
    """Where a key that is unknown in section ``where`` lives instead."""
    out: dict[str, str] = {}
    request = ("negative_prompt", "infer_steps", "height", "width", "num_frames", "fps",
               "guidance_scale", "true_cfg_scale", "max_sequence_length", "aspect_ratio",
               "resize_mode")
    for key in request:
        out[key] = f"request_defaults.{key} (or each request)"
    for key in file_fields(StageOptions):
        if where not in STAGE_SECTIONS:
            out[key] = "the encoder / transformer / decoder section (a stage option)"
    for key in file_fields(ServiceConfig):
        if where != "config":
            out[key] = f"config.{key} (a top-level key)"
    for section, cls in (("server", ServerConfig), ("disagg_config", DisaggConfig)):
        for key in file_fields(cls):
            if where != section:
                out.setdefault(key, f"{section}.{key}")
    return out
