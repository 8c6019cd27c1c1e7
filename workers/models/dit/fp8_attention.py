"""FP8 self-attention for the DiT stage (attention backend ``fp8_cudnn``).

Why cuDNN's FP8 graph and not a kernel of our own: NVIDIA's cuDNN frontend
(``nvidia-cudnn-frontend``, a 2 MB wheel that drives the cuDNN library torch already ships)
has a per-tensor-scaled FP8 flash-attention forward for Hopper, tuned by the vendor, with
any sequence length (no partial-block problem such as sageattention 1.x has), strided
inputs (the (B, S, H, D) layout diffusers hands its processors needs no transpose) and the
scales read from device memory (no host synchronisation per call). sageattention 1.0.6 on
PyPI does not mask the last partial block, and a Triton kernel of our own would have to
beat a vendor kernel on its own hardware.

What it computes (exactly what SDPA computes, in FP8 where cuDNN allows):

1. *Smoothing* (softmax and convex-combination invariances, SageAttention's idea): the key
   mean over the sequence is subtracted from every key (it shifts each query's scores by a
   constant, which softmax ignores) and the value mean from every value (each output row is
   a convex combination of values, so the mean is added back exactly afterwards). Both
   shrink the range the FP8 scales must cover, which is what costs FP8 its precision.
2. Q, K and V are quantised to ``float8_e4m3fn`` with one scale per tensor
   (``448 / amax``); the descales travel to cuDNN as device tensors.
3. cuDNN computes softmax(QK^T * d^-0.5) V with FP32 accumulation, the probabilities
   quantised to FP8 with a fixed scale (they lie in [0, 1]) and, on Hopper, an FP8 output
   (cuDNN requires FP8 O there). Every output row is a convex combination of smoothed
   values, so ``|O| <= amax(V)``: the output scale is V's own and can never overflow.
4. O is dequantised to the input dtype and the value mean added back.

The cuDNN call is a ``torch.library`` custom op with a fake implementation, so
``torch.compile`` keeps the DiT blocks in one graph around it and fuses the quantisation
(steps 1, 2 and 4) into the neighbouring kernels.

Precision is stated, not assumed: ``scripts/bench/bench_dit.py`` reports the relative L2
of the kernel and of one DiT forward against bf16 SDPA.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .dit_options import check_fp8_device

__all__ = ["E4M3_MAX", "check_fp8_attention", "cudnn_fp8_kernel", "fp8_attention"]

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
_P_SCALE = 256.0
"""Fixed FP8 scale of the softmax probabilities (in [0, 1]): a power of two, so scaling is
exact, with headroom below 448."""
FP8_MIN_TOKENS = 16384
"""Shortest self-attention that goes to FP8. Measured on an H200 against bf16 cuDNN SDPA
(quantisation included, compiled): 4,352 tokens 0.69x (Qwen-Image 1024), 7,145 tokens 0.91x
(Qwen-Image 1328), 32,760 tokens 1.36x (Wan 480p), 75,600 tokens 1.43x (Wan 720p)."""
_MIN_CAPABILITY = (9, 0)
"""cuDNN's FP8 flash-attention forward runs on Hopper (sm_90) and newer."""


def check_fp8_attention(device: torch.device) -> None:
    """Refuse (at load, with what to do) a device or install the FP8 kernel cannot use."""
    check_fp8_device(device, "attention backend 'fp8_cudnn'", _MIN_CAPABILITY, "Hopper",
                     "Use attention_backend 'sdpa'.", "cudnn",
                     "NVIDIA's cuDNN frontend: pip install nvidia-cudnn-frontend==1.16.0")


class _Graphs:
    """Built cuDNN graphs by (device, shapes, strides); building one costs ~0.1-1 s, running
    it microseconds of host time. One handle per device, bound to torch's current stream at
    every call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._graphs: dict[tuple[Any, ...], tuple[Any, dict[str, Any], int, int]] = {}
        self._handles: dict[int, Any] = {}

    def handle(self, index: int) -> Any:
        import cudnn

        with self._lock:
            if index not in self._handles:
                with torch.cuda.device(index):
                    self._handles[index] = cudnn.create_handle()
            return self._handles[index]

    def get(self, q: torch.Tensor, k: torch.Tensor) -> tuple[Any, dict[str, Any], int, int]:
        """(graph, its tensors by name, the plan to run, its workspace bytes)."""
        key = (q.device.index, tuple(q.shape), q.stride(), tuple(k.shape), k.stride())
        with self._lock:
            found = self._graphs.get(key)
        if found is None:
            found = self._build(q, k)
            with self._lock:
                self._graphs[key] = found
        return found

    def _build(self, q: torch.Tensor, k: torch.Tensor) -> tuple[Any, dict[str, Any], int, int]:
        import cudnn

        handle = self.handle(q.device.index)
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(
            io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32,
            handle=handle,
        )
        b, s_q, h, d = q.shape
        s_kv = k.shape[1]

        def bhsd(name: str, t: torch.Tensor, seq: int) -> Any:
            # The (B, S, H, D) tensors diffusers hands us, described as (B, H, S, D) by strides.
            st = t.stride()
            return graph.tensor(
                name=name, dim=[b, h, seq, d], stride=[st[0], st[2], st[1], st[3]],
                data_type=e4m3,
            )

        tq, tk, tv = bhsd("q", q, s_q), bhsd("k", k, s_kv), bhsd("v", k, s_kv)
        scalars = {
            n: graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
            for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        }
        kwargs: dict[str, Any] = {
            "attn_scale": d**-0.5, "use_causal_mask": False, "name": "sdpa_fp8",
        }
        args = (tq, tk, tv, *scalars.values())
        try:
            o, _stats, amax_s, amax_o = graph.sdpa_fp8(*args, is_inference=True, **kwargs)
        except TypeError:  # newer frontends name it generate_stats
            o, _stats, amax_s, amax_o = graph.sdpa_fp8(*args, generate_stats=False, **kwargs)
        # Output in the query's (B, S, H, D) layout, contiguous.
        o.set_output(True).set_dim([b, h, s_q, d]).set_stride(
            [s_q * h * d, d, h * d, 1]
        ).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
                fp32
            )
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B,
                                          cudnn.heur_mode.FALLBACK])
            graph.check_support()
        except Exception as exc:  # cuDNN's own message names the unsupported part
            raise RuntimeError(
                f"cuDNN has no FP8 attention plan for q {tuple(q.shape)}, k {tuple(k.shape)} "
                f"on {torch.cuda.get_device_name(q.device)}: {exc}"
            ) from exc
        tensors = {"q": tq, "k": tk, "v": tv, "o": o, "amax_s": amax_s, "amax_o": amax_o,
                   **scalars}
        try:
            plan, workspace = self._fastest_plan(graph, tensors, q, k, handle)
        except Exception:  # pragma: no cover - GPU only; the heuristics' choice then
            logging.getLogger(__name__).warning(
                "cuDNN FP8 attention: timing the plans failed; using the heuristics' choice",
                exc_info=True)
            graph.build_plans()
            plan, workspace = -1, int(graph.get_workspace_size())
        return graph, tensors, plan, workspace

    @staticmethod
    def _fastest_plan(
        graph: Any, tensors: dict[str, Any], q: torch.Tensor, k: torch.Tensor, handle: Any,
    ) -> tuple[int, int]:
        """Build every plan cuDNN's heuristics offer and keep the fastest, timed on random
        inputs of this shape (the heuristics' first choice was measured 1.47x bf16 on an
        H200 for Wan 14B's self-attention; this costs well under a second per shape, once).
        """
        import cudnn

        built: list[tuple[int, int]] = []
        for index in range(graph.get_execution_plan_count()):
            try:
                graph.build_plan_at_index(index)
                built.append((index, int(graph.get_workspace_size_plan_at_index(index))))
            except Exception:  # an engine that cannot run this graph here; try the next
                continue
        if not built:
            raise RuntimeError(f"cuDNN could build no FP8 attention plan for q {tuple(q.shape)}")
        if len(built) == 1:
            return built[0]
        dev = q.device
        pack = {
            tensors["q"]: torch.randn(q.shape, device=dev).to(torch.float8_e4m3fn),
            tensors["k"]: torch.randn(k.shape, device=dev).to(torch.float8_e4m3fn),
            tensors["v"]: torch.randn(k.shape, device=dev).to(torch.float8_e4m3fn),
            tensors["o"]: torch.empty(q.shape, device=dev, dtype=torch.float8_e4m3fn),
            tensors["amax_s"]: torch.empty((1, 1, 1, 1), device=dev),
            tensors["amax_o"]: torch.empty((1, 1, 1, 1), device=dev),
        }
        for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
            pack[tensors[name]] = torch.ones((1, 1, 1, 1), device=dev)
        workspace = torch.empty(max(w for _, w in built), dtype=torch.uint8, device=dev)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(dev).cuda_stream)
        best: tuple[float, int, int] | None = None
        for index, ws in built:
            try:
                graph.execute_plan_at_index(pack, workspace, index, handle=handle)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(3):
                    graph.execute_plan_at_index(pack, workspace, index, handle=handle)
                end.record()
                end.synchronize()
            except Exception:
                continue
            ms = start.elapsed_time(end)
            if best is None or ms < best[0]:
                best = (ms, index, ws)
        if best is None:
            raise RuntimeError(f"no cuDNN FP8 attention plan ran for q {tuple(q.shape)}")
        return best[1], best[2]


_GRAPHS = _Graphs()
_P_SCALES: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}


def _p_scales(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    found = _P_SCALES.get(device)
    if found is None:
        scale = torch.full((1, 1, 1, 1), _P_SCALE, dtype=torch.float32, device=device)
        found = (scale, torch.reciprocal(scale))
        _P_SCALES[device] = found
    return found


@torch.library.custom_op("diffring::cudnn_sdpa_fp8", mutates_args=())
def _cudnn_sdpa_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    descale_q: torch.Tensor, descale_k: torch.Tensor, descale_v: torch.Tensor,
    scale_o: torch.Tensor,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v on FP8 (B, S, H, D) tensors; FP8 output scaled by
    ``scale_o``."""
    import cudnn

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    graph, t, plan, workspace_bytes = _GRAPHS.get(q, k)
    b, s_q, h, d = q.shape
    out = torch.empty((b, s_q, h, d), dtype=torch.float8_e4m3fn, device=q.device)
    amax_s = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
    amax_o = torch.empty_like(amax_s)
    scale_s, descale_s = _p_scales(q.device)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
    handle = _GRAPHS.handle(q.device.index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    pack = {
        t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: out,
        t["descale_q"]: descale_q, t["descale_k"]: descale_k, t["descale_v"]: descale_v,
        t["descale_s"]: descale_s, t["scale_s"]: scale_s, t["scale_o"]: scale_o,
        t["amax_s"]: amax_s, t["amax_o"]: amax_o,
    }
    if plan < 0:
        graph.execute(pack, workspace, handle=handle)
    else:
        graph.execute_plan_at_index(pack, workspace, plan, handle=handle)
    return out


@_cudnn_sdpa_fp8.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: (x8, scale, descale), the scales as (1, 1, 1, 1) fp32 tensors."""
    amax = x.abs().amax().float().clamp(min=1e-12).reshape(1, 1, 1, 1)
    scale = E4M3_MAX / amax
    x8 = (x.float() * scale).to(torch.float8_e4m3fn)
    return x8, scale, torch.reciprocal(scale)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of (B, S, H, D) tensors through cuDNN's FP8 graph (see the module doc).

    Only long self-attention (as many keys as queries, at least :data:`FP8_MIN_TOKENS`) goes
    to FP8: cross-attention to the 512 text tokens (or Wan I2V's 257 image tokens) is a few
    percent of the work, and SDPA keeps it exact; below that length the quantisation passes
    cost more than FP8 saves.
    """
    if k.shape[1] != q.shape[1] or q.shape[1] < FP8_MIN_TOKENS:
        from .kernels import sdpa_kernel

        return sdpa_kernel(q, k, v)
    k = k - k.mean(dim=1, keepdim=True)
    v_mean = v.mean(dim=1, keepdim=True)
    v = v - v_mean
    q8, _, dq = _quantize(q)
    k8, _, dk = _quantize(k)
    v8, scale_v, dv = _quantize(v)
    o8 = _cudnn_sdpa_fp8(q8, k8, v8, dq, dk, dv, scale_v)
    return (o8.float() * dv + v_mean.float()).to(q.dtype)


def cudnn_fp8_kernel() -> Any:
    """:func:`fp8_attention` as a kernel for the kernel attention processors
    (:func:`workers.models.dit.kernels.install_kernel_processors`)."""
    return fp8_attention
