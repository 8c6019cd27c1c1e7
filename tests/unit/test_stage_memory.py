"""Issue 20's GPU runs, checked as far as a CPU can: the full-size model configs (on the meta
device: no memory), the I2V folder's layout, the stage memory benchmark and the serving
benchmark's capped modes at toy size, and the planned commands of docs/benchmarks.md parsed
and their service configs checked (so the GPU machine needs no new code).

The figures themselves are GPU measurements (docs/benchmarks.md, "Planned: issue 20")."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.bench import planned_commands
from tests.support.paths import ROOT

# -- the published sizes --------------------------------------------------------------------

def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def test_full_size_models_have_the_published_sizes() -> None:
    """Built on the meta device: the parameter counts of the published checkpoints (UMT5-XXL
    5.68B, Qwen2.5-VL-7B 8.29B, CLIP ViT-H/14's vision tower 0.63B, the Wan2.1-I2V-14B DiT
    16.4B), and the tiny tokenizers' ids inside their vocabularies."""
    import torch

    from modelkit import real
    from modelkit.tokenizers import build_qwen_tokenizer, build_t5_tokenizer

    t5, qwen = build_t5_tokenizer(), build_qwen_tokenizer()
    with torch.device("meta"):
        umt5 = real._umt5(t5, 2, full=True)
        vl = real._qwen_text_encoder(qwen, 2, full=True)
        clip, processor = real.clip_vit_h14()
        dit = real.wan_dit("wan-14b-i2v")
        stub = real._umt5(t5, 2)
    assert round(_params(umt5) / 1e9, 2) == 5.68
    assert round(_params(vl) / 1e9, 2) == 8.29
    assert round(_params(clip) / 1e9, 2) == 0.63
    assert round(_params(dit) / 1e9, 1) == 16.4
    assert _params(stub) < 1e8  # the default stays the 2-layer stand-in
    c = umt5.config
    assert (c.d_model, c.d_kv, c.d_ff, c.num_layers, c.num_heads, c.vocab_size) == (
        4096, 64, 10240, 24, 64, 256384)
    text, vision = vl.config.text_config, vl.config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers,
            text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (
        3584, 18944, 28, 28, 4, 152064)
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads,
            vision.out_hidden_size) == (32, 1280, 3420, 16, 3584)
    assert max(t5.get_vocab().values()) < c.vocab_size
    assert max(qwen.get_vocab().values()) < text.vocab_size
    assert vl.config.image_token_id == qwen.convert_tokens_to_ids("<|image_pad|>")
    d = dit.config
    assert (d.in_channels, d.image_dim, d.added_kv_proj_dim, d.num_layers, d.ffn_dim) == (
        36, 1280, 5120, 40, 13824)
    assert d.image_dim == clip.config.hidden_size and d.text_dim == c.d_model
    assert processor.crop_size == {"height": 224, "width": 224}
    assert processor.size == {"shortest_edge": 224}


def test_default_recipes_are_unchanged() -> None:
    """Folders built before these options keep matching their marker (no rebuild); the new
    options are part of a folder's recipe."""
    from modelkit import real

    old = real._recipe("wan-14b", "bfloat16", None, 2, 0, "stub", None)
    assert set(old) == {"arch", "dtype", "layers", "text_layers", "seed", "diffusers"}
    full = real._recipe("wan-14b", "bfloat16", None, 2, 0, "full", 4)
    assert full["text_encoders"] == "full" and full["text_layers"] is None
    assert full["image_layers"] == 4


@pytest.mark.integration  # builds a model folder
def test_i2v_folder_at_toy_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``modelkit.real --arch wan-14b-i2v`` with its widths shrunk (the published VAE kept):
    the folder diffusers' WanImageToVideoPipeline layout names, which the I2V encoder stage
    checks and loads, and a second build of the same recipe reuses it."""
    import torch

    from modelkit import real
    from workers.models import EncoderAdapter
    from workers.models.model_folder import check_model_folder

    torch.set_num_threads(1)
    monkeypatch.setitem(real.WAN_DIT, "wan-14b-i2v", {
        "num_attention_heads": 1, "ffn_dim": 32, "num_layers": 1, "in_channels": 36,
        "image_dim": 32, "added_kv_proj_dim": 128})
    monkeypatch.setattr(real, "CLIP_VIT_H14", {
        **real.CLIP_VIT_H14, "hidden_size": 32, "intermediate_size": 37,
        "num_attention_heads": 4})
    dest = tmp_path / "i2v"
    info = real.build("wan-14b-i2v", dest, device="cpu", dtype="float32", text_layers=1,
                      image_layers=2)
    assert info["pipeline"] == "wan_i2v" and info["image_encoder_params"] > 0
    assert info["recipe"]["image_layers"] == 2
    index = json.loads((dest / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    dit = json.loads((dest / "transformer" / "config.json").read_text())
    assert (dit["in_channels"], dit["added_kv_proj_dim"]) == (36, 128)
    check_model_folder(dest, "wan_i2v")
    enc = EncoderAdapter.for_task(dest, "wan_i2v", "cpu", "float32")
    enc.load()
    assert enc.image_encoder.config.num_hidden_layers == 2
    assert real.build("wan-14b-i2v", dest, device="cpu", dtype="float32", text_layers=1,
                      image_layers=2)["reused"] is True


def test_clean_arch_dir_keeps_only_the_folder_built(tmp_path: Path) -> None:
    """--clean-arch-dir: another architecture's folder and an interrupted build go (in
    /dev/shm they hold host memory), the folder of this recipe stays for reuse."""
    from scripts.bench.bench_models import remove_others

    for name in ("wan-14b-full", "qwen-image-full", "wan-14b-full.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x").write_text("x")
    (tmp_path / "stray").write_text("x")
    said: list[str] = []
    remove_others(tmp_path / "wan-14b-full", said.append)
    assert [p.name for p in tmp_path.iterdir()] == ["wan-14b-full"]
    assert len(said) == 3
    remove_others(tmp_path / "missing" / "x", said.append)  # no folder yet: nothing to do


# -- option parsing -------------------------------------------------------------------------

def test_modes_settings_and_ratios_parse() -> None:
    from scripts.bench import bench_serving_modes as m

    modes = m.parse_modes("disagg,disagg@24g,baseline@24g")
    assert [x.name for x in modes] == ["disagg", "disagg@24g", "baseline@24g"]
    sets = [m.parse_set(s) for s in (
        "cfg_batch=true", "24g:encoder.max_vram_gb=24", "24g:transformer.max_vram_gb=24",
        'disagg@24g:transformer.weight_storage="fp8"', 'baseline:transformer.offload="block"',
        'warmup_shapes=["480x832x81"]')]
    assert sets[1] == m.Setting("24g", {"encoder": {"max_vram_gb": 24}})
    m.check_selectors(sets, modes)
    by = {x.name: m.settings_for(x.name, x.matches, sets, {"device": "cpu"}) for x in modes}
    assert by["disagg"] == {"device": "cpu", "cfg_batch": True,
                            "warmup_shapes": ["480x832x81"]}
    assert by["disagg@24g"]["transformer"] == {"max_vram_gb": 24, "weight_storage": "fp8"}
    assert by["baseline@24g"]["transformer"] == {"max_vram_gb": 24, "offload": "block"}
    assert by["baseline@24g"]["encoder"] == {"max_vram_gb": 24}
    assert m.parse_ratios(None, modes) == [("disagg", "baseline@24g"),
                                           ("disagg@24g", "baseline@24g")]
    assert m.parse_ratios("disagg@24g/disagg", modes) == [("disagg@24g", "disagg")]
    assert m.parse_ratios(None, m.parse_modes("baseline,disagg")) == [("disagg", "baseline")]
    for call, says in (
        (lambda: m.parse_modes("disagg,disagg"), "give each mode once"),
        (lambda: m.parse_modes("group"), "write baseline or disagg"),
        (lambda: m.parse_set("transformer.weight_storage=fp8"), "must be JSON"),
        (lambda: m.parse_set("encoder.max_vram_gb"), "KEY=JSON"),
        (lambda: m.check_selectors([m.parse_set("24G:cfg_batch=true")], modes), "'24G'"),
        (lambda: m.parse_ratios("disagg/nope", modes), "two of the modes"),
        (lambda: m.check_service_config(
            {"model_cls": "wan2.1", "task": "t2v", "transformer": {"weight_storage": "fp4"}},
            "disagg@24g"), "config is refused: transformer: weight_storage must be one of"),
    ):
        with pytest.raises(SystemExit, match=re.escape(says)):
            call()


def test_memory_columns_and_ratio_rows() -> None:
    """The table's DiT s/step and per-stage peak GiB columns, and ratio rows between any two
    modes (figures made up: the columns' formatting and arithmetic only)."""
    from scripts.bench.bench_serving_report import table

    def level(qps: float, step: float, peaks: tuple[float, float, float]) -> dict[str, Any]:
        return {"concurrency": 1, "requests": 2, "qps": qps, "p50_s": 1 / qps,
                "p95_s": 1 / qps, "p99_s": 1 / qps, "dit_s_per_step": step,
                "busy": {"enc": 0.01, "DiT": 0.9, "VAE": 0.05, "media": 0.02},
                "peak_gib": dict(zip(("encoder", "transformer", "decoder"), peaks,
                                     strict=True))}

    results = [
        {"mode": "disagg", "kind": "disagg", "label": "disagg 1/1/1",
         "levels": [level(0.1, 7.2, (12.04, 30.3, 3.2))]},
        {"mode": "disagg@24g", "kind": "disagg", "label": "disagg 1/1/1 @24g",
         "levels": [level(0.1, 7.0, (12.0, 17.5, 3.2))]},
        {"mode": "baseline@24g", "kind": "baseline", "label": "baseline @24g",
         "levels": [level(0.08, 7.7, (20.0, 21.5, 22.0))]},
    ]
    md = table(results, None, [("disagg@24g", "disagg"), ("disagg@24g", "baseline@24g")])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()]
    head = rows[0]
    col = {name: i for i, name in enumerate(head)}
    capped = rows[3]
    assert capped[0] == "disagg 1/1/1 @24g" and capped[col["DiT s/step"]] == "7.000"
    assert [capped[col[f"{s} peak GiB"]] for s in ("enc", "DiT", "VAE")] == [
        "12.0", "17.5", "3.2"]
    ratio = {r[0]: r for r in rows[5:]}
    assert ratio["**ratio** disagg@24g/disagg"][col["DiT s/step"]] == f"{7.0 / 7.2:.2f}"
    assert ratio["**ratio** disagg@24g/baseline@24g"][col["QPS"]] == "**1.25**"
    assert all(len(r) == len(head) for r in rows[2:])


def test_baseline_reports_each_stage_memory() -> None:
    """One process, three stages: one gauge family per figure, a sample per role."""
    import torch
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from workers.metrics import WorkerMetrics
    from workers.models.memory import MemoryWatch

    class Stage:
        torch_model = True

        def __init__(self, peak: int) -> None:
            self.memory = MemoryWatch(torch.device("cpu"), resident_bytes=1 << 30,
                                      last_peak_bytes=peak, max_peak_bytes=peak)

    metrics = WorkerMetrics("decoder")
    metrics.watch_memories({"encoder": Stage(3 << 30), "transformer": Stage(5 << 30),
                            "decoder": Stage(2 << 30)})
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(metrics.registry).decode())}
    peaks = {s.labels["role"]: s.value for s in families["diffring_stage_peak_max_bytes"].samples}
    assert peaks == {"encoder": 3 << 30, "transformer": 5 << 30, "decoder": 2 << 30}


# -- the benchmarks on a CPU ----------------------------------------------------------------

@pytest.mark.integration  # starts processes
def test_stage_memory_bench_on_cpu(tiny_models: Path, tmp_path: Path) -> None:
    """The I2V encoder stage through its adapter: one variant measured, one refused at load
    by its budget (the refusal names the estimate and the budget; the run exits 1)."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_stage_memory", "--pipeline", "wan_i2v",
         "--models", str(tiny_models), "--stage", "encoder", "--variants", "plain,tight",
         "--set", "torch_threads=1", "--set", "tight:encoder.max_vram_gb=0.5",
         "--repeats", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(
        (out / "bench_stage_memory.json").read_text())["rows"]}
    plain, tight = rows["plain"], rows["tight"]
    assert plain["stage"] == "encoder" and plain["shape"] == "32x32x9"
    assert plain["load_s"] > 0 and 0 < plain["first_request_s"] and plain["request_s"] > 0
    assert plain["peak_gib"] == plain["resident_gib"] == 0.0  # no GPU memory on a CPU
    assert plain["estimate_gib"] > 0 and plain["options"] == {}
    assert tight["options"] == {"max_vram_gb": 0.5}
    assert "encoder stage needs about" in tight["error"] and "max_vram_gb is 0.5" in tight["error"]
    md = (out / "bench_stage_memory.md").read_text()
    assert "| plain | encoder | 32x32x9 | - |" in md and "| tight | encoder |" in md


@pytest.mark.integration  # starts processes
def test_bench_serving_capped_modes_on_cpu(tiny_models: Path, tmp_path: Path) -> None:
    """Tagged modes as in the GPU run (a capped group with its workers started one by one,
    a capped baseline that offloads its DiT): each mode gets its own settings, both serve,
    the ratio row compares them, and block offload keeps the pixels."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_serving", "--pipeline", "qwen_t2i",
         "--models", str(tiny_models), "--modes", "disagg@cap,baseline@cap",
         "--set", "cap:encoder.max_vram_gb=24", "--set", "cap:transformer.max_vram_gb=24",
         "--set", 'baseline:transformer.offload="block"', "--serial-start",
         "--concurrency", "1", "--requests", "1", "--steps", "2", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "bench_serving.json").read_text())
    assert [(r["mode"], r["label"]) for r in report["results"]] == [
        ("disagg@cap", "disagg 1/1/1 @cap"), ("baseline@cap", "baseline @cap")]
    caps = report["config_overrides"]
    assert caps["baseline@cap"]["transformer"] == {"max_vram_gb": 24, "offload": "block"}
    assert caps["disagg@cap"]["transformer"] == {"max_vram_gb": 24}
    assert report["fidelity_by_mode"]["baseline@cap"]["equal"] is True
    assert report["fidelity_probe"]["equal"] is True
    labels = [line.split("|")[1].strip() for line in
              (out / "bench_serving.md").read_text().splitlines() if line.startswith("|")]
    assert labels[2:] == ["disagg 1/1/1 @cap", "baseline @cap",
                          "**ratio** disagg@cap/baseline@cap"]
    for res in report["results"]:
        (row,) = res["levels"]
        # Every stage's memory is reported in both modes (zeros on a CPU): the one-process
        # baseline serves the same gauges as the workers.
        assert row["dit_s_per_step"] > 0
        assert row["peak_gib"] == row["resident_gib"] == {
            "encoder": 0.0, "transformer": 0.0, "decoder": 0.0}, res["mode"]


# -- the planned GPU commands (tests/support/bench.py's planned_commands reads them) --------------

def test_planned_gpu_commands_parse_and_their_configs_are_accepted(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every issue-20 command of docs/benchmarks.md, run with --dry-run: the arguments parse,
    the selectors name modes, and each mode's service config passes the services' own
    checks. What is left for the GPU machine is running them."""
    from scripts.bench import bench_serving, bench_stage_memory

    commands = planned_commands()
    mains = {"scripts.bench.bench_serving": bench_serving.main,
             "scripts.bench.bench_stage_memory": bench_stage_memory.main}
    assert {c[0] for c in commands} == set(mains) and len(commands) >= 4
    for module, *argv in commands:
        argv = [a.replace("$OUT", "/tmp/out") for a in argv]
        assert mains[module]([*argv, "--dry-run"]) == 0, argv
    printed = capsys.readouterr().out
    assert '"weight_storage": "fp8"' in printed and '"offload": "block"' in printed


def test_issue_19_qwen_commands_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands BENCHMARKS.md gives for the Qwen-Image FP8 figures parse into what was
    run: one suite of the three variants (its cold starts, then each measured) and the
    few-rows probe."""
    from scripts.bench import bench_dit

    suites: list[Any] = []
    probes: list[Any] = []
    monkeypatch.setattr(bench_dit, "suite", lambda args: suites.append(args) or 0)
    monkeypatch.setattr(bench_dit, "rows", lambda args: probes.append(args) or 0)
    commands = [c for heading in ("### Qwen-Image DiT (20.4B), 1024x1024",
                                  "### FP8 matmuls at a few rows")
                for c in planned_commands(heading, "BENCHMARKS.md")]
    assert {c[0] for c in commands} == {"scripts.bench.bench_dit"}
    for _module, *argv in commands:
        argv = [a.replace("$OUT", str(tmp_path)) for a in argv]
        argv = [a.replace("/dev/shm", str(tmp_path)) for a in argv]
        assert bench_dit.main(argv) == 0, argv
    assert [(a.arch, a.variants, a.cold_only, a.steps) for a in suites] == [
        ("qwen-image", "bf16,bf16_compiled,fp8_compiled", False, 2)]
    assert set(suites[0].variants.split(",")) <= set(bench_dit.VARIANTS)
    assert [a.archs for a in probes] == ["wan-1.3b,wan-14b,qwen-image"]


def test_bench_dit_cold_only_then_measured_keeps_the_first_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``suite --cold-only`` runs the compiled variants' cold starts and nothing else; a later
    suite on the same --work starts only what has no cold record, so the first start it
    reports is the real one. (The variants' processes are stood in for: they need a GPU.)"""
    from scripts.bench import bench_dit

    started: list[tuple[str, str]] = []

    def fake_variant(cmd: list[str], **_kw: Any) -> Any:
        variant, phase = cmd[cmd.index("--variant") + 1], cmd[cmd.index("--phase") + 1]
        started.append((variant, phase))
        work = Path(cmd[cmd.index("--work") + 1])
        row = {"variant": variant, "phase": phase, "ready_s": 1.0 if phase == "cold" else 2.0,
               "step_s": 1.0, "peak_gib": 1.0, "resident_gib": 1.0}
        (work / f"{variant}.{phase}.json").write_text(json.dumps(row))

        class Done:
            def wait(self) -> int:
                return 0
        return Done()

    monkeypatch.setattr(bench_dit, "build_folder", lambda *a, **k: {"reused": True})
    monkeypatch.setattr(bench_dit.subprocess, "Popen", fake_variant)
    monkeypatch.setattr(bench_dit.subprocess, "run", fake_variant)
    common = ["suite", "--arch", "wan-1.3b", "--device", "cpu", "--models", str(tmp_path / "m"),
              "--work", str(tmp_path / "w")]
    assert bench_dit.main([*common, "--cold-only", "--variants", "bf16_compiled",
                           "--out", str(tmp_path / "cold")]) == 0
    assert started == [("bf16_compiled", "cold")]
    assert not (tmp_path / "cold" / "bench_dit.md").exists()  # nothing measured
    started.clear()
    assert bench_dit.main([*common, "--variants", "bf16_compiled,fp8_compiled",
                           "--out", str(tmp_path / "out")]) == 0
    # fp8_compiled had no cold record: its first start runs now; bf16_compiled's is kept.
    assert started == [("fp8_compiled", "cold"), ("bf16_compiled", "warm"),
                       ("fp8_compiled", "warm")]
    assert "| bf16_compiled | - | 1.0 | - | - | - | 1.0 | 1.0 | 1.0 / 2.0 |" in \
        (tmp_path / "out" / "bench_dit.md").read_text()
    # A cold-only run whose cold start left no record says so in its exit status.
    monkeypatch.setattr(bench_dit.subprocess, "Popen", lambda *a, **k: fake_variant(
        ["--variant", "x", "--phase", "none", "--work", str(tmp_path / "w")]))
    assert bench_dit.main([*common, "--cold-only", "--variants", "fp8_linear_compiled",
                           "--out", str(tmp_path / "cold2")]) == 1
