"""The drop-in sidecar (``deploy/components/sidecar``) and its worked examples (vLLM, TGI,
Triton, TGI behind the meter proxy), rendered by the real ``kubectl kustomize`` and validated
offline: strict Kubernetes schemas, the operator's typed PodMonitor, the agent's real command
line, and what a sidecar must never do to the pod it joins (ask for a GPU, gate its readiness,
reorder its containers).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mrc_agent.agent.cli import build_parser
from mrc_agent.agent.core.config import ENV_PREFIX, config_from_args
from tests.conftest import REPO
from tests.integration.test_deploy import LATEST, _gpu_requests, _round_trip, pss_violations

COMPONENT = REPO / "deploy" / "components" / "sidecar"
EXAMPLES = REPO / "deploy" / "examples"
AGENT = "mrc-agent"

#: Per example: command lines (as /proc shows them: arguments joined by spaces) the pattern
#: must match, and neighbours it must not.
TARGETS: dict[str, tuple[list[str], list[str]]] = {
    "vllm": (["python3 -m vllm.entrypoints.openai.api_server --model=/models/llava-1.5-7b-hf "
              "--port=8000", "VLLM::EngineCore"],
             ["pip install vllm", "mrc-agent run --listen=0.0.0.0:9478"]),
    "tgi": (["/opt/conda/bin/python3.11 /opt/conda/bin/text-generation-server serve "
             "/data/idefics2-8b --uds-path /tmp/text-generation-server"],
            ["text-generation-launcher --model-id=/data/idefics2-8b --port=8080",
             "text-generation-server download-weights /data/idefics2-8b"]),
    "triton": (["tritonserver --model-repository=/models --http-port=8000 --metrics-port=8002",
                "/opt/tritonserver/backends/python/triton_python_backend_stub "
                "/models/preprocess/1/model.py triton_python_backend_shm_region_1 1048576"],
               ["perf_analyzer -m ensemble -u localhost:8001", "tritonclient-install"]),
}
TARGETS["tgi-metered"] = TARGETS["tgi"]  # the same server, behind the meter proxy
#: Containers that other components of an example append after the agent
#: (tests/integration/test_meter_proxy_component.py checks them).
AFTER_AGENT = {"tgi-metered": ["mrc-meter-proxy"]}


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render kustomize Components (.ci/run's image has it)"
    res = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return [o for o in yaml.safe_load_all(res.stdout) if o]


RENDERED = {name: kustomize(EXAMPLES / name) for name in sorted(TARGETS)}


def _workload(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (w,) = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    return w


def _source(name: str) -> dict[str, Any]:
    """The example's workload as written, before the components (its other resources, such
    as a Service, are not workloads)."""
    k = yaml.safe_load((EXAMPLES / name / "kustomization.yaml").read_text())
    docs = [yaml.safe_load((EXAMPLES / name / res).read_text()) for res in k["resources"]]
    (doc,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    return doc


def _agent(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = [c for c in _workload(objs)["spec"]["template"]["spec"]["containers"]
            if c["name"] == AGENT]
    return c


def test_every_example_is_listed_and_renders() -> None:
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()) == sorted(TARGETS)
    assert {_workload(o)["kind"] for o in RENDERED.values()} == {"Deployment", "StatefulSet"}


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("version", sorted({"1.30", LATEST}))
def test_rendered_core_kinds_validate_strictly(name: str, version: str) -> None:
    for obj in RENDERED[name]:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_podmonitor_scrapes_the_agent_of_the_labelled_pods(name: str) -> None:
    objs = RENDERED[name]
    (pm,) = [o for o in objs if o["kind"] == "PodMonitor"
             and o["metadata"]["name"] == "mrc-agent-sidecar"]
    assert _round_trip(pm) == pm, "fields the operator does not know"
    pod_labels = _workload(objs)["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for p in _agent(objs)["ports"]}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= ports


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_server_is_untouched_and_stays_first(name: str) -> None:
    src = _source(name)["spec"]["template"]["spec"]
    pod = _workload(RENDERED[name])["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == [
        *(c["name"] for c in src["containers"]), AGENT, *AFTER_AGENT.get(name, [])]
    for before, after in zip(src["containers"], pod["containers"], strict=False):
        assert after == before
    assert pod["shareProcessNamespace"] is True
    assert {v["name"] for v in src.get("volumes", [])} < {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_agent_asks_for_no_gpu_and_never_gates_readiness(name: str) -> None:
    agent = _agent(RENDERED[name])
    assert not _gpu_requests(agent)
    assert "readinessProbe" not in agent and "startupProbe" not in agent
    probe = agent["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and probe["port"] in {p["name"] for p in agent["ports"]}
    sc = agent["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"add": ["SYS_PTRACE"], "drop": ["ALL"]}
    assert agent["image"] == "registry.example.com/mrc-agent:0.1.0"  # the example's images:
    assert agent["resources"]["limits"]["memory"] == "128Mi"
    # Pod Security: the one added capability is all that keeps the agent from "restricted".
    assert _agent_pss(RENDERED[name]) == [f"{AGENT}: capabilities.add ['SYS_PTRACE']"]


def _agent_pss(objs: list[dict[str, Any]]) -> list[str]:
    """The agent container's violations of Pod Security "restricted" (its seccomp profile
    is its own; the pod's other containers are the server's business)."""
    pod = _workload(objs)["spec"]["template"]["spec"]
    agent = _agent(objs)
    mounted = {m["name"] for m in agent["volumeMounts"]}
    alone = {"containers": [agent],
             "volumes": [v for v in pod["volumes"] if v["name"] in mounted],
             "securityContext": {"seccompProfile": agent["securityContext"]["seccompProfile"]}}
    return sorted(set(pss_violations(alone)["restricted"]))


def _with(tmp_path: Path, workload: dict[str, Any], *variants: str) -> list[dict[str, Any]]:
    """``workload`` built with components/sidecar and then ``variants`` of it."""
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(workload))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["w.yaml"],
        "components": [os.path.relpath(COMPONENT.parent / c, tmp_path)
                       for c in ("sidecar", *variants)],
        "configMapGenerator": [{"name": "mrc-agent-sidecar",
                                "literals": ["MRC_AGENT_PROCESS_NAME=x"]}]}))
    return kustomize(tmp_path)


def _names(objs: list[dict[str, Any]]) -> list[str]:
    return [c["name"] for c in _workload(objs)["spec"]["template"]["spec"]["containers"]]


def test_the_restricted_component_drops_the_capability(tmp_path: Path) -> None:
    objs = _with(tmp_path, _source("triton"), "sidecar-restricted")
    assert _agent_pss(objs) == []
    agent = _agent(objs)
    assert agent["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"  # the rest is kept
    assert _names(objs) == ["triton", AGENT]


def test_the_web_config_component_mounts_the_file_the_agent_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = _with(tmp_path, _source("vllm"), "sidecar-restricted", "sidecar-web-config")
    assert _names(objs) == ["vllm", AGENT]
    for obj in objs:
        if obj["kind"] == "Deployment":
            kubernetes_validate.validate(obj, LATEST, strict=True)
    agent = _agent(objs)
    cfg = _agent_config(objs, monkeypatch)
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "mrc-agent-web-config")
    assert Path(cfg.web_config_file).parent == Path(mount["mountPath"]) and mount["readOnly"]
    pod = _workload(objs)["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "mrc-agent-web-config")
    assert vol["secret"] == {"secretName": "mrc-agent-web-config", "defaultMode": 0o440}
    # An HTTP probe would need the basic-auth credentials in the pod spec.
    assert agent["livenessProbe"]["tcpSocket"] == {"port": "mrc-agent"}
    assert _agent_pss(objs) == []


def test_a_variant_refuses_a_pod_where_the_agent_is_not_second(tmp_path: Path) -> None:
    """The variants patch the agent by index (a strategic merge would reorder the
    containers): on a pod with two server containers the build fails instead of patching
    the wrong container."""
    two = _source("vllm")
    spec = two["spec"]["template"]["spec"]
    spec["containers"].append({"name": "proxy", "image": "envoyproxy/envoy:v1.31.0"})
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(two))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["w.yaml"],
        "components": [os.path.relpath(COMPONENT, tmp_path),
                       os.path.relpath(COMPONENT.parent / "sidecar-restricted", tmp_path)]}))
    res = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode != 0 and "test" in res.stderr.lower(), res.stderr


def _agent_config(objs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The agent's settings as the pod gives them: the image's entrypoint ``mrc-agent`` with
    the container's args, and the environment from its ConfigMap and env list."""
    agent = _agent(objs)
    (ref,) = agent["envFrom"]
    maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    assert ref["configMapRef"]["name"] in maps, "envFrom must name the generated ConfigMap"
    for var in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(var)
    env = {**maps[ref["configMapRef"]["name"]]["data"],
           **{e["name"]: e["value"] for e in agent.get("env", [])}}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = build_parser().parse_args(agent["args"])
    assert args.command == "run"
    return config_from_args(args)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_pattern_set_in_one_place_picks_the_servers_processes(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _agent_config(RENDERED[name], monkeypatch)
    good, bad = TARGETS[name]
    for cmdline in good:
        assert re.search(cfg.process_name, cmdline), cmdline
    for cmdline in bad:
        assert not re.search(cfg.process_name, cmdline), cmdline
    assert cfg.interval == 0.5 and cfg.host_port == ("0.0.0.0", 9478)


def test_only_labelled_workloads_get_the_sidecar(tmp_path: Path) -> None:
    labelled = _source("vllm")
    plain = yaml.safe_load(yaml.safe_dump(labelled))
    plain["metadata"] = {"name": "plain"}
    (tmp_path / "w.yaml").write_text(yaml.safe_dump_all([labelled, plain]))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["w.yaml"], "components": [os.path.relpath(COMPONENT, tmp_path)],
        "configMapGenerator": [{"name": "mrc-agent-sidecar",
                                "literals": ["MRC_AGENT_PROCESS_NAME=x"]}]}))
    out = {o["metadata"]["name"]: o for o in kustomize(tmp_path)}
    assert out["plain"] == plain
    names = [c["name"] for c in out["vllm-llava"]["spec"]["template"]["spec"]["containers"]]
    assert names == ["vllm", AGENT]


def test_without_the_configmap_the_agent_names_what_is_missing(tmp_path: Path) -> None:
    """Forgetting the one setting is loud: the pod references a ConfigMap nobody made (the
    kubelet then refuses to start the container, naming it) instead of watching nothing."""
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(_source("vllm")))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["w.yaml"], "components": [os.path.relpath(COMPONENT, tmp_path)]}))
    objs = kustomize(tmp_path)
    assert not [o for o in objs if o["kind"] == "ConfigMap"]
    ref = _agent(objs)["envFrom"][0]["configMapRef"]
    assert ref["name"] == "mrc-agent-sidecar" and not ref.get("optional", False)


def test_the_podmonitor_patch_for_tls_and_basic_auth_is_what_the_operator_reads() -> None:
    from tests.integration.test_deploy import json_patch

    (pm,) = [copy.deepcopy(o) for o in RENDERED["vllm"] if o["kind"] == "PodMonitor"]
    ops = yaml.safe_load((COMPONENT.parent / "sidecar-web-config" / "podmonitor-patch.yaml")
                         .read_text())
    json_patch(pm, ops)
    assert _round_trip(pm) == pm, "fields the operator does not know"
    endpoint = pm["spec"]["podMetricsEndpoints"][0]
    assert endpoint["scheme"] == "https" and endpoint["basicAuth"]["password"]["key"]
