"""Transformer groups on CPU: each layout's output against the single-process output.

Groups of 2 and 4 processes over gloo (tests/support/group_layouts.py: what stands in for what is
written there), on the tiny models, for every layout kind: CFG-parallel, Ulysses, ring, and
their products. Every rank of a group must end with the same latents (they all step the
scheduler on the same predictions), and those latents must equal the single-process ones:

* bit for bit for ``cfg=2``: each rank runs the batch-1 forward of the single-device loop,
  and the combination is the loop's own expression;
* within ``TOL`` for sequence parallelism: the same math in another order of float32 sums
  (each rank projects a slice of the tokens; Qwen's joint attention sees its keys in rank
  order; ring attention merges per-block softmaxes by their log-sum-exp). One such forward
  differs from one device by ~1e-7 relative (measured: 2e-7 on these models), and a few
  scheduler steps carry that on about linearly; latents here are of size ~1-5, so 1e-4 is
  ~100x the observed difference and ~1e4x below what a wrong split gives (a lost or
  misplaced token or head changes the output by O(1)).

The refusals of layouts a model cannot run are checked in-process, without a group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from contracts.errors import ConfigError, InvalidRequestError, ModelLoadError
from contracts.parallel import ParallelLayout, head_refusal
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes
TOL = 1e-4

TWO = ["wan_t2v:cfg=2", "wan_t2v:ulysses=2", "wan_t2v:ring=2", "qwen_t2i:cfg=2",
       "qwen_t2i:ulysses=2", "qwen_t2i:ring=2", "wan_i2v:ulysses=2"]
FOUR = ["wan_t2v:cfg=2,ulysses=2", "qwen_t2i:cfg=2,ulysses=2", "wan_t2v:ring=2,ulysses=2",
        "qwen_i2i:cfg=2,ring=2"]


HANG_TIMEOUT_S = 30.0
"""The process-group timeout of the two-rank run, which ends with a rank that stops taking
part: the others must give up on the collective after it, not wait for ever."""


def run_group(world: int, cases: list[str], models: Path, tmp: Path,
              *extra: str) -> list[dict[str, Any]]:
    """Start ``world`` rank processes, wait for all (each has the process group's timeout on
    every collective), and load what each saved."""
    import torch

    rendezvous, out = tmp / "rendezvous", tmp / "out"
    rendezvous.mkdir()
    out.mkdir()
    procs = []
    for rank in range(world):
        log = (tmp / f"rank{rank}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.support.group_layouts", "--rank", str(rank),
             "--world", str(world), "--rendezvous", str(rendezvous), "--models", str(models),
             "--out", str(out), "--cases", ";".join(cases), *extra],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((tmp / f"rank{r}.log").read_text()[-2000:] for r in range(world))
    assert codes == [0] * world, logs
    return [{"ref": torch.load(out / f"{i}-ref.pt"),
             "ranks": [torch.load(out / f"{i}-rank{r}.pt") for r in range(world)]}
            for i in range(len(cases))]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("world", "cases"), [(2, TWO), (4, FOUR)], ids=["two", "four"])
def test_layouts_against_one_process(world: int, cases: list[str], tiny_models: Path,
                                     tmp_path: Path) -> None:
    import torch

    extra = ("--timeout", str(HANG_TIMEOUT_S), "--then-hang") if world == 2 else ()
    results = run_group(world, cases, tiny_models, tmp_path, *extra)
    for case, res in zip(cases, results, strict=True):
        ref, first = res["ref"], res["ranks"][0]
        for other in res["ranks"][1:]:
            assert torch.equal(first, other), f"{case}: the ranks disagree"
        assert first.shape == ref.shape and not first.isnan().any(), case
        layout = ParallelLayout.parse(case.partition(":")[2])
        diff = (first - ref).abs().max().item()
        if layout.sequence == 1:
            assert diff == 0.0, f"{case}: CFG-parallel must be exact, max abs diff {diff}"
        else:
            assert diff <= TOL, f"{case}: max abs diff {diff} > {TOL}"
    if extra:
        waited, what = (tmp_path / "out" / "hang-rank0.txt").read_text().split("\n", 1)
        assert "Timed out" in what, what
        assert HANG_TIMEOUT_S - 1 <= float(waited) < HANG_TIMEOUT_S + 60, waited


# -- refusals, by name, without a group ----------------------------------------------------
def test_layout_syntax_and_head_counts() -> None:
    assert ParallelLayout.parse("ulysses=2, cfg=2") == ParallelLayout(cfg=2, ulysses=2)
    assert ParallelLayout.parse("cfg=2,ulysses=2").size == 4
    assert str(ParallelLayout.parse("ring=2,cfg=2")) == "cfg=2,ring=2"
    assert ParallelLayout(cfg=2, ring=2, ulysses=2).coords(5) == (1, 0, 1)
    for bad, needle in (("cfg=4", "cfg must be 1 or 2"), ("tp=2", "DEGREE one of"),
                        ("ulysses=two", "not a number"), ("ring=0", "whole number")):
        with pytest.raises(ConfigError, match=needle):
            ParallelLayout.parse(bad)
    # The published head counts: Wan2.1-14B 40, Wan2.1-1.3B 12, Qwen-Image 24.
    assert head_refusal(ParallelLayout(ulysses=8), 40, "Wan2.1-14B") is None
    assert head_refusal(ParallelLayout(ulysses=8), 24, "Qwen-Image") is None
    refusal = head_refusal(ParallelLayout(ulysses=8), 12, "Wan2.1-1.3B")
    assert refusal is not None and "ulysses=8 does not divide the 12 attention heads" in refusal
    assert "[2, 3, 4, 6]" in refusal
    assert head_refusal(ParallelLayout(ring=8), 12, "Wan2.1-1.3B") is None


def _loaded(tiny_models: Path, pipeline: str, layout: str, attention: str = "sdpa") -> Any:
    """A single-process stage given a group of ``layout`` whose mesh is never touched: the
    refusals come before any collective."""
    from workers.models import TransformerAdapter
    from workers.models.dit.parallel import GroupMesh

    stage = TransformerAdapter.for_task(
        tiny_models / pipeline, pipeline, "cpu", "float32", attention=attention,
        group=GroupMesh(ParallelLayout.parse(layout), 0, None))
    return stage


@pytest.mark.parametrize(("pipeline", "layout", "needle"), [
    # the tiny DiTs have 2 heads
    ("wan_t2v", "ulysses=4", "ulysses=4 does not divide the 2 attention heads"),
    ("qwen_t2i", "ring=2", "ring attention merges the partial attentions by their "
                           "log-sum-exp, which attention_backend 'sdpa'"),
    ("qwen_t2i", "ring=2,ulysses=2", "splits the prompt's tokens across the ranks"),
])
def test_layouts_a_model_cannot_run_are_refused_at_load(
        tiny_models: Path, pipeline: str, layout: str, needle: str) -> None:
    attention = "sdpa_flash" if layout == "ring=2,ulysses=2" else "sdpa"
    stage = _loaded(tiny_models, pipeline, layout, attention)
    if attention == "sdpa_flash":
        import workers.models.dit.attention as attn

        real = attn._require_cuda_half
        attn._require_cuda_half = lambda *a: None  # as tests/support/group_layouts.py
        try:
            with pytest.raises(ModelLoadError, match=needle):
                stage.load()
        finally:
            attn._require_cuda_half = real
        return
    with pytest.raises(ModelLoadError, match=needle):
        stage.load()


def test_the_split_follows_each_forwards_token_counts() -> None:
    """diffusers' even split where N divides every split sequence, its "anything" split where
    not (pure Ulysses or ring), a request error for the rest."""
    from workers.models.dit.parallel import _choose_split

    wan = SimpleNamespace(config=SimpleNamespace(patch_size=(1, 2, 2)), _cp_plan={})
    qwen = SimpleNamespace(_cp_plan={"transformer_blocks.0": {"encoder_hidden_states": 1}})

    def shape(*dims: int) -> Any:
        return SimpleNamespace(ndim=len(dims), shape=dims)

    cfg = SimpleNamespace(ulysses_anything=None, ring_anything=None)
    uly = _choose_split(cfg, ParallelLayout(ulysses=2), "cuda")
    uly(wan, (), {"hidden_states": shape(1, 16, 2, 4, 6)})  # 2 x 2 x 3 = 12 tokens
    assert (cfg.ulysses_anything, cfg.ring_anything) == (False, False)
    uly(qwen, (), {"hidden_states": shape(1, 6889, 64), "encoder_hidden_states": shape(1, 8, 9)})
    assert (cfg.ulysses_anything, cfg.ring_anything) == (True, False)  # Qwen 1328 x 1328
    _choose_split(cfg, ParallelLayout(ring=2), "cuda")(
        qwen, (), {"hidden_states": shape(1, 16, 64), "encoder_hidden_states": shape(1, 7, 9)})
    assert (cfg.ulysses_anything, cfg.ring_anything) == (False, True)
    with pytest.raises(InvalidRequestError, match=r"token counts \[6\] cannot be split over "
                                                  "4 ranks evenly"):
        _choose_split(cfg, ParallelLayout(ring=2, ulysses=2), "cuda")(
            wan, (), {"hidden_states": shape(1, 16, 1, 4, 6)})
    with pytest.raises(InvalidRequestError, match="gloo gathers equal shards only"):
        _choose_split(cfg, ParallelLayout(ulysses=2), "cpu")(
            qwen, (), {"hidden_states": shape(1, 9, 64), "encoder_hidden_states": shape(1, 8, 9)})


def test_group_settings_are_refused_by_name(tmp_path: Path) -> None:
    """A group's devices against its layout, at configuration time (before any process)."""
    import json

    from contracts.config import ServiceConfig
    from contracts.errors import DiffringError
    from run_service import _parse, build_config

    def refused(data: dict[str, Any], needle: str) -> None:
        with pytest.raises(ConfigError, match=needle):
            ServiceConfig.from_dict(data)

    group = {"transformer": {"parallel": "cfg=2"}}
    assert ServiceConfig.from_dict({**group, "devices": ["cuda:0", "cuda:1"]}).devices == (
        "cuda:0", "cuda:1")
    refused({**group, "devices": ["cpu"] * 3}, r"cfg=2 is a group of 2 ranks: give one "
                                                r"device per rank, e\.g\. --devices cuda:0,cuda:1")
    refused({"devices": ["cpu", "cpu"]}, "transformer.parallel is unset")
    refused({**group, "devices": ["cuda:1", "cuda:1"]}, "each rank needs a GPU of its own")
    refused({**group, "devices": ["cpu", "cuda:0"]}, "all cpu or all cuda")
    refused({**group, "devices": ["cpu", "cpu"], "cfg_batch": True}, "choose one")
    refused({"decoder": {"parallel": "cfg=2"}}, "apply to the transformer stage only")
    refused({"transformer": {"parallel": "cfg=2", "group_timeout_s": 0}},
            "group_timeout_s must be positive")

    path = tmp_path / "dit.json"
    path.write_text(json.dumps(group))
    _, cfg = build_config(_parse(["--service", "transformer", "--config", str(path),
                                  "--devices", "cpu, cpu"]), {})
    assert cfg.devices == ("cpu", "cpu") and cfg.transformer.layout.size == 2
    from workers.group.supervisor import GroupFailed, run_group

    _, cfg = build_config(_parse(["--service", "transformer", "--config", str(path)]), {})
    with pytest.raises(GroupFailed, match="give one device per rank"):  # before any process
        run_group(cfg, "token", {})
    with pytest.raises(DiffringError, match="use it with --service transformer"):
        build_config(_parse(["--service", "encoder", "--devices", "cpu,cpu"]), {})
    with pytest.raises(DiffringError, match="the one-process baseline has one device"):
        build_config(_parse(["--service", "all", "--config", str(path)]), {})
