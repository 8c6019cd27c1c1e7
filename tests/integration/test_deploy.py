"""deploy/: the Kubernetes manifests validate, and they agree with the code.

- Every core manifest validates against the Kubernetes JSON schemas of a pinned version
  (``kubernetes-validate``, strict: unknown fields are errors; the schemas ship inside the
  package, so this runs offline). KEDA's ScaledObject is a CRD, not in those schemas: it is
  checked against the pydantic models generated from KEDA's CRD (``cloudcoil-models-keda``),
  with a round trip that turns any field the models do not know into a failure.
- Ports, probe paths, environment names, config files and metric names in the manifests are
  checked against the code; then a group is started from the ConfigMap's own config files
  (addresses, ports and model swapped for loopback ones and the tiny model) and every probe
  path the manifests name is hit, every metric the autoscaler queries is read, and a
  SIGTERM'd transformer drains with /ready answering 503.
"""

from __future__ import annotations

import json
import re
import signal
import time
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from contracts.config import ServiceConfig
from contracts.metrics import LIVE_PATH, READY_PATH
from contracts.pipelines import check_device
from launcher import MULTI_HOST, LocalGroup, free_ports, group_config, submit, wait_task
from tests.support.paths import ROOT
from tests.support.waits import wait_log

pytestmark = pytest.mark.integration  # starts processes or servers

DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
WORKERS = ("encoder", "transformer", "decoder")


@cache
def manifests() -> dict[str, list[dict[str, Any]]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted(DEPLOY.glob("*.yaml"))}


def find(kind: str, name: str) -> dict[str, Any]:
    for docs in manifests().values():
        for d in docs:
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
    raise AssertionError(f"no {kind} {name} in {DEPLOY}")


def role_configs() -> dict[str, dict[str, Any]]:
    data = find("ConfigMap", "diffring-config")["data"]
    return {role: json.loads(data[f"{role}.json"]) for role in ("controller", *WORKERS)}


def workload(role: str) -> dict[str, Any]:
    if role == "controller":
        return find("StatefulSet", "diffring-controller")
    return find("Deployment", f"diffring-{role}")


def container(role: str) -> dict[str, Any]:
    (c,) = workload(role)["spec"]["template"]["spec"]["containers"]
    return dict(c)


def probes(role: str) -> list[tuple[str, str]]:
    """(path, port name) of every HTTP probe of ``role``'s container."""
    c = container(role)
    out = []
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        if kind in c:
            get = c[kind]["httpGet"]
            out.append((get["path"], get["port"]))
    return out


def port_map(role: str) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(role)["ports"]}


def autoscaler_metrics() -> set[str]:
    so = find("ScaledObject", "diffring-transformer")
    names = set()
    for trig in so["spec"]["triggers"]:
        names |= set(re.findall(r"\bdiffring_[a-z0-9_]+", trig["metadata"]["query"]))
    return names


# -- schemas ---------------------------------------------------------------------------------
def test_kustomization_lists_every_manifest() -> None:
    (kust,) = manifests()["kustomization.yaml"]
    assert kust["kind"] == "Kustomization"
    listed = kust["resources"]
    assert sorted(listed) == sorted(set(manifests()) - {"kustomization.yaml"})
    assert all((DEPLOY / f).is_file() for f in listed)
    names = {d["spec"]["template"]["spec"]["containers"][0]["image"]
             for docs in manifests().values() for d in docs
             if d["kind"] in ("Deployment", "StatefulSet")}
    assert names == {img["name"] for img in kust["images"]}


@pytest.mark.parametrize("name", sorted(set(manifests()) - {"kustomization.yaml"}))
def test_manifest_validates(name: str) -> None:
    import kubernetes_validate

    for doc in manifests()[name]:
        if doc["kind"] == "ScaledObject":
            continue  # a CRD: test_scaledobject_validates
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_catches_a_typo() -> None:
    import kubernetes_validate

    bad = json.loads(json.dumps(workload("transformer")))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 10
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def _pruned(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def test_scaledobject_validates() -> None:
    from cloudcoil.models.keda.v1alpha1 import ScaledObject

    doc = find("ScaledObject", "diffring-transformer")
    model = ScaledObject.model_validate(doc)
    # The models ignore unknown fields; a round trip that loses one is a misspelt field.
    assert _pruned(model.model_dump(by_alias=True, exclude_none=True, mode="json")) == doc
    typo = json.loads(json.dumps(doc))
    typo["spec"]["minReplicaCounts"] = 1
    again = ScaledObject.model_validate(typo).model_dump(by_alias=True, exclude_none=True)
    assert _pruned(again) != typo
    assert doc["spec"]["scaleTargetRef"]["name"] == workload("transformer")["metadata"]["name"]
    for trig in doc["spec"]["triggers"]:
        assert trig["type"] == "prometheus"
        assert {"serverAddress", "query", "threshold"} <= set(trig["metadata"])
        float(trig["metadata"]["threshold"])


# -- the manifests against the code -----------------------------------------------------------
def test_configs_and_ports_match() -> None:
    cfgs = {role: ServiceConfig.from_dict(c) for role, c in role_configs().items()}
    ctl = cfgs["controller"]
    d = ctl.disagg_config
    service = find("Service", "diffring-controller")
    assert all(c.pipeline == ctl.pipeline for c in cfgs.values())
    want = {"http": ctl.server.port, "control": d.control_port,
            "ring-request": d.rdma_request_handshake_port,
            "ring-phase1": d.rdma_phase1_handshake_port,
            "ring-phase2": d.rdma_phase2_handshake_port, "metrics": ctl.server.metric_port}
    assert port_map("controller") == want
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == want
    assert workload("controller")["spec"]["serviceName"] == service["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in container("controller")["volumeMounts"]}
    assert ctl.output_dir.startswith(mounts["data"] + "/")  # journal and results on the PVC
    claims = [t["metadata"]["name"] for t in workload("controller")["spec"]["volumeClaimTemplates"]]
    assert claims == ["data"]
    for role in WORKERS:
        w = cfgs[role]
        assert w.disagg_config.bootstrap_addr == service["metadata"]["name"]
        assert w.disagg_config.ring_address("phase1")[1] == d.rdma_phase1_handshake_port
        assert w.disagg_config.control_port == d.control_port
        assert port_map(role) == {"metrics": w.server.metric_port}
        annotations = workload(role)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(w.server.metric_port)
        mounts = {m["name"]: m["mountPath"] for m in container(role)["volumeMounts"]}
        assert w.model_path and w.model_path.startswith(mounts["models"] + "/")
        assert container(role)["resources"]["limits"]["nvidia.com/gpu"] == 1
    annotations = workload("controller")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ctl.server.metric_port)
    grace = {r: workload(r)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
             for r in WORKERS}
    assert min(grace.values()) >= 60
    # The transformer checkpoints, so a drain waits for one step (its request is handed back
    # and resumed elsewhere), not a whole denoise: its grace covers the drain timeout.
    dit = ServiceConfig.from_dict(json.loads(find("ConfigMap", "diffring-config")["data"]
                                             ["transformer.json"]))
    assert dit.transformer.checkpointing and dit.drain_timeout_s + 60 <= grace["transformer"]


def test_commands_environment_and_probes_match() -> None:
    import run_service

    data = find("ConfigMap", "diffring-config")["data"]
    secret_refs = set()
    for role in ("controller", *WORKERS):
        c = container(role)
        env = {e["name"]: e for e in c["env"]}
        # Only variables the entry point reads, plus POD_IP for $(POD_IP) in the arguments.
        assert set(env) - {"POD_IP"} <= set(run_service.ENV_VARS), set(env)
        for ref in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
            assert ref in env, (role, ref)
        args = [a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]]
        parsed = run_service._parse(args)
        assert parsed.service == role
        mount = next(m for m in c["volumeMounts"] if m["name"] == "config")["mountPath"]
        assert parsed.config == f"{mount}/{role}.json" and f"{role}.json" in data
        moon = env["MOONCAKE_CONFIG_PATH"]["value"]
        assert moon.startswith(mount + "/") and Path(moon).name in data
        assert env["MOONCAKE_LOCAL_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP")
        ref = env["DIFFRING_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        secret_refs.add((ref["name"], ref["key"]))
        if role != "controller":
            assert parsed.host == "10.0.0.1"  # binds its pod IP
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert check_device(env["DIFFRING_DEVICE"]["value"])
        names = port_map(role)
        for path, port in probes(role):
            assert port in names, (role, port)
            assert path in {READY_PATH, LIVE_PATH} or (role, path) == ("controller", "/health")
        assert any(p == READY_PATH for p, _ in probes(role))
    assert len(secret_refs) == 1  # every service proves the same token


def test_dockerfile_matches_the_project() -> None:
    import tomllib

    text = (ROOT / "deploy" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M)
    assert base and base.group(1).startswith("nvidia/cuda:") and "runtime" in base.group(1)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]
                ["include"]}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    assert packages <= copied, packages - copied
    for src in re.findall(r"^COPY ([^\n]+) \./?$", text, re.M):
        for name in src.split():
            assert (ROOT / name).exists(), name
    assert '".[cuda]"' in text  # Mooncake's CUDA build
    assert 'ENTRYPOINT ["python", "run_service.py"]' in text
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}  # type: ignore[union-attr]
    for role in ("controller", *WORKERS):
        assert set(port_map(role).values()) <= exposed


# -- a live group from the ConfigMap's configs ------------------------------------------------
def metrics_text(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


SMALL_STEPS = 4
"""The first task's steps: the transformer's fault point is armed for the second's."""


@pytest.mark.timeout(600)
def test_probes_and_autoscaler_metrics_on_a_live_group(tiny_models: Path,
                                                       tmp_path: Path) -> None:
    cfgs = role_configs()
    pipeline = ServiceConfig.from_dict(cfgs["controller"]).pipeline
    ctl_host = MULTI_HOST["controller"][0]
    base = group_config(pipeline, str(tiny_models / pipeline), tmp_path, host=ctl_host)
    ports: dict[str, int] = {}
    gate = tmp_path / "drain-gate"
    gate.touch()
    group = LocalGroup(base, tmp_path)
    try:
        for role in ("controller", *WORKERS):
            cfg = json.loads(json.dumps(cfgs[role]))
            host = MULTI_HOST[role][0]
            (ports[role],) = free_ports(1, host)
            # Swap what only a cluster has (addresses, ports, GPU, model volume); keep the rest.
            cfg["disagg_config"] = base["disagg_config"]
            cfg["server"] = {**cfg["server"], "host": host, "metric_port": ports[role]}
            if role == "controller":
                cfg["server"]["port"] = base["server"]["port"]
                cfg["output_dir"] = base["output_dir"]
            else:
                cfg.update(model_path=base["model_path"], dtype="float32", torch_threads=1,
                           output_dir=str(tmp_path / role))
            if role == "transformer":  # held after the drain task's second step (below)
                cfg["faults"] = f"dit.step:hold={gate}:nth={SMALL_STEPS + 2}"
            group.start(role, cfg)
            if role == "controller":
                group.wait_http(timeout=120)
        group.wait_workers(dict.fromkeys(WORKERS, 1), timeout=300)

        def url(role: str, path: str) -> str:
            return f"http://{MULTI_HOST[role][0]}:{ports[role]}{path}"

        for role in ("controller", *WORKERS):
            for path, port in probes(role):
                target = (f"{group.url}{path}" if port == "http" else url(role, path))
                r = httpx.get(target, timeout=10)
                assert r.status_code == 200, (role, path, r.text)

        # Every metric the autoscaler queries is exported by the controller, and measured.
        small = {"prompt": "k8s", "height": 32, "width": 32, "target_video_length": 5,
                 "target_fps": 8}
        st = submit(group.url, "video", {**small, "infer_steps": SMALL_STEPS}, timeout=300)
        assert st["status"] == "completed", st
        m = metrics_text(url("controller", "/metrics"))
        assert autoscaler_metrics() <= set(m), autoscaler_metrics() - set(m)
        assert m["diffring_dit_step_seconds"] > 0

        # A longer task, its DiT held after step 2 (fault point dit.step): the waiting DiT
        # work shows while it runs; SIGTERM to the transformer drains it (/ready 503, /live
        # 200); released, it hands the task back at that step boundary, checkpointed, and
        # exits 0; a new replica resumes it from that step.
        r = httpx.post(f"{group.url}/v1/tasks/video/",
                       json={**small, "infer_steps": 8, "task_id": "drain"}, timeout=30)
        assert r.status_code == 200, r.text
        dit = next(s for s in group.services if s.role == "transformer")
        wait_log(dit, "fault point dit.step fired", timeout=300)
        m = metrics_text(url("controller", "/metrics"))
        assert m["diffring_dit_steps_waiting"] > 0 and m["diffring_dit_seconds_waiting"] > 0
        dit.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while (r := httpx.get(url("transformer", READY_PATH), timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/ready still 200 after the SIGTERM"
            time.sleep(0.02)
        assert r.status_code == 503 and r.json()["state"] == "draining", r.text
        assert httpx.get(url("transformer", LIVE_PATH), timeout=10).status_code == 200
        gate.unlink()
        assert dit.proc.wait(timeout=120) == 0
        cfg = json.loads(json.dumps(cfgs["transformer"]))
        cfg["disagg_config"] = base["disagg_config"]
        cfg["server"] = {**cfg["server"], "host": MULTI_HOST["transformer"][0],
                         "metric_port": free_ports(1, MULTI_HOST["transformer"][0])[0]}
        cfg.update(model_path=base["model_path"], dtype="float32", torch_threads=1,
                   output_dir=str(tmp_path / "transformer-2"))
        group.start("transformer", cfg)
        st = wait_task(group.url, "drain", timeout=300)
        assert st["status"] == "completed" and st["attempt"] == 2, st
        assert st["failures"] == 0 and st["resumed_from"] == 2, st
    finally:
        group.stop()
