"""The Kubernetes manifests in ``deploy/``, validated offline — no cluster, no kubectl needed.

* Core kinds against the Kubernetes OpenAPI schemas shipped by ``kubernetes-validate`` (strict:
  an unknown field fails), for the oldest and the newest version each variant targets.
* The prometheus-operator kinds through cloudcoil's typed models: they must parse and round
  trip unchanged (a misspelt field would be dropped by the model and show up as a difference).
* The overlays are rendered by a small test-side implementation of the kustomize features
  ``deploy/`` uses (resources, namespace, labels, images, replicas, JSON 6902 patches) that
  refuses any other feature; where ``kubectl`` is installed its ``kustomize`` must agree.
* Semantics: one PID namespace, the agent's capabilities and security context, only the
  service asks for a GPU, the agent's and the service's arguments parse with their real
  command lines, probes hit real endpoints, the PodMonitor's ports exist, the generated
  PrometheusRule and dashboards ConfigMap are the committed builds.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as prom

from mrc_agent.agent.cli import build_parser
from mrc_agent.agent.core.config import ENV_PREFIX, config_from_args
from mrc_agent.agent.core.units import parse_bytes
from mrc_agent.alerts import build as alerts_build
from mrc_agent.dashboards import build as dashboards_build
from tests.conftest import REPO, AgentProcess

DEPLOY = REPO / "deploy"
BASE = DEPLOY / "base"
APP = "mrc-reference-service"
SERVICE, AGENT = "service", "mrc-agent"
GPU = "nvidia.com/gpu"
OPERATOR_GROUP = "monitoring.coreos.com"


# --- a tiny kustomize --------------------------------------------------------------------------

_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "labels", "images",
                       "replicas", "patches"}


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """RFC 6902 add / remove / replace / test, in place."""
    for op in ops:
        *parent_path, last = _pointer(op["path"])
        parent = _walk(doc, parent_path)
        kind = op["op"]
        if kind == "test":
            value = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            assert value == op["value"], f"patch test failed at {op['path']}: {value!r}"
        elif kind == "add":
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), value)
            else:
                parent[last] = value
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                assert last in parent, f"remove: nothing at {op['path']}"
                del parent[last]
        elif kind == "replace":
            assert (int(last) < len(parent)) if isinstance(parent, list) else last in parent
            parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op["value"])
        else:
            raise AssertionError(f"unsupported patch op {kind!r}")


def _pod_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _image_name(image: str) -> tuple[str, str]:
    """``registry:5000/a/b:tag`` -> (``registry:5000/a/b``, ``tag``)."""
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, ""
    return name, tag


def render(path: Path) -> list[dict[str, Any]]:
    """The objects the kustomization in ``path`` builds (the subset of kustomize deploy/
    uses; anything else fails rather than being silently ignored)."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = set(k) - _KUSTOMIZATION_KEYS
    assert not unknown, f"{path}: kustomize features the test renderer lacks: {unknown}"
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        target = (path / res).resolve()
        if target.is_dir():
            objs += render(target)
        else:
            objs += [d for d in yaml.safe_load_all(target.read_text()) if d]
    for patch in k.get("patches", []):
        assert set(patch) == {"path", "target"}, patch
        ops = yaml.safe_load((path / patch["path"]).read_text())
        assert isinstance(ops, list), "only JSON 6902 patches are supported"
        hits = [o for o in objs if o["kind"] == patch["target"]["kind"]
                and o["metadata"]["name"] == patch["target"]["name"]]
        assert len(hits) == 1, patch
        json_patch(hits[0], ops)
    for rep in k.get("replicas", []):
        hits = [o for o in objs if o["metadata"]["name"] == rep["name"] and "replicas" in
                o.get("spec", {})]
        assert hits, rep
        for o in hits:
            o["spec"]["replicas"] = rep["count"]
    for img in k.get("images", []):
        for o in objs:
            for c in _pod_containers(o):
                name, tag = _image_name(c["image"])
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    for lab in k.get("labels", []):
        assert lab.get("includeSelectors") is False and not lab.get("includeTemplates"), lab
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(lab["pairs"])
    if "namespace" in k:
        for o in objs:
            o["metadata"]["namespace"] = k["namespace"]
    return objs


def _patched(objs: list[dict[str, Any]], patch: Path) -> list[dict[str, Any]]:
    out = copy.deepcopy(objs)
    json_patch(_deployment(out), yaml.safe_load(patch.read_text()))
    return out


KUSTOMIZATIONS = {
    "base": BASE,
    "example": DEPLOY / "overlays" / "example",
    "dra-shared-gpu": DEPLOY / "overlays" / "dra-shared-gpu",
}
PATCHES = {name: DEPLOY / "patches" / f"{name}.yaml" for name in
           ("agent-as-root", "pss-restricted", "profiling")}
#: Kubernetes versions each variant must validate against: the oldest it supports, the newest
#: kubernetes-validate ships. DRA's resource.k8s.io/v1 is GA from 1.34.
LATEST = kubernetes_validate.latest_version()
MIN_VERSION = {"dra-shared-gpu": "1.34"}


def variants() -> dict[str, list[dict[str, Any]]]:
    out = {name: render(path) for name, path in KUSTOMIZATIONS.items()}
    for name, path in PATCHES.items():
        out[f"base+{name}"] = _patched(out["base"], path)
    return out


def _deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    return dep


def _pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = _deployment(objs)["spec"]["template"]["spec"]
    return spec


def _container(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (c,) = [c for c in _pod_containers(_deployment(objs)) if c["name"] == name]
    return c


def _one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind]
    return obj


VARIANTS = variants()


# --- the files ---------------------------------------------------------------------------------


def test_base_is_plain_resources_listed_in_its_kustomization() -> None:
    k = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    files = sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(k["resources"]) == files
    for name in files:
        docs = [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
        assert len(docs) == 1 and {"apiVersion", "kind", "metadata"} <= set(docs[0]), name


def test_generated_copies_match_the_committed_and_a_fresh_build() -> None:
    spec = importlib.util.spec_from_file_location("sync_generated",
                                                  DEPLOY / "sync_generated.py")
    assert spec is not None and spec.loader is not None
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    assert sync.stale() == [], "run: python3 deploy/sync_generated.py"
    rule = (BASE / "mrc-prometheusrule.yaml").read_text()
    assert rule == (REPO / "alerts" / "generated" / alerts_build.PROMETHEUS_RULE_FILE).read_text()
    assert rule == alerts_build.render()[alerts_build.PROMETHEUS_RULE_FILE]
    cm = (BASE / "mrc-dashboards-configmap.yaml").read_text()
    generated = REPO / "dashboards" / "generated" / dashboards_build.CONFIGMAP_FILE
    assert cm == generated.read_text()
    assert cm == dashboards_build.render_all()[dashboards_build.CONFIGMAP_FILE]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_overlays_keep_the_generated_rules_and_dashboards(variant: str) -> None:
    objs = VARIANTS[variant]
    rule = yaml.safe_load((BASE / "mrc-prometheusrule.yaml").read_text())
    assert _one(objs, "PrometheusRule")["spec"] == rule["spec"]
    cm = yaml.safe_load((BASE / "mrc-dashboards-configmap.yaml").read_text())
    got = _one(objs, "ConfigMap")
    assert got["data"] == cm["data"]
    assert got["metadata"]["labels"]["grafana_dashboard"] == "1"


# --- schemas -----------------------------------------------------------------------------------


def _core(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if not o["apiVersion"].startswith(OPERATOR_GROUP + "/")]


@pytest.mark.parametrize(("variant", "version"),
                         [(v, ver) for v in sorted(VARIANTS)
                          for ver in sorted({MIN_VERSION.get(v, "1.30"), LATEST})])
def test_core_kinds_validate_strictly(variant: str, version: str) -> None:
    objs = _core(VARIANTS[variant])
    assert {o["kind"] for o in objs} >= {"Deployment", "Service", "ConfigMap"}
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_schema_validation_catches_a_misspelt_field() -> None:
    dep = copy.deepcopy(_deployment(VARIANTS["base"]))
    dep["spec"]["template"]["spec"]["shareProcessNameSpace"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, LATEST, strict=True)


_MODELS: dict[str, Any] = {"PodMonitor": prom.PodMonitor,
                           "PrometheusRule": prom.PrometheusRule}


def _round_trip(obj: dict[str, Any]) -> dict[str, Any]:
    model = _MODELS[obj["kind"]].model_validate(obj)
    dumped: dict[str, Any] = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    return dumped


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_operator_kinds_parse_with_typed_models(variant: str) -> None:
    objs = [o for o in VARIANTS[variant] if o["apiVersion"].startswith(OPERATOR_GROUP + "/")]
    assert sorted(o["kind"] for o in objs) == ["PodMonitor", "PrometheusRule"]
    for obj in objs:
        assert obj["apiVersion"] == f"{OPERATOR_GROUP}/v1"
        assert _round_trip(obj) == obj, f"{obj['kind']}: fields the operator does not know"


def test_typed_models_catch_a_misspelt_field() -> None:
    pm = copy.deepcopy(_one(VARIANTS["base"], "PodMonitor"))
    pm["spec"]["podMetricEndpoints"] = pm["spec"].pop("podMetricsEndpoints")
    assert _round_trip(pm) != pm


# --- the pod -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_pid_namespace_and_locked_down_containers(variant: str) -> None:
    objs = VARIANTS[variant]
    pod = _pod(objs)
    assert pod["shareProcessNamespace"] is True
    assert pod["automountServiceAccountToken"] is False
    assert "hostname" not in pod, "captures compare the alert's pod label with the hostname"
    assert not any(pod.get(k) for k in ("hostPID", "hostIPC", "hostNetwork"))
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert [c["name"] for c in pod["containers"]] == [SERVICE, AGENT]
    assert not pod.get("initContainers")
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert not sc.get("privileged"), c["name"]
    assert "add" not in _container(objs, SERVICE)["securityContext"]["capabilities"]
    agent_sc = _container(objs, AGENT)["securityContext"]
    if variant == "base+pss-restricted":
        assert "add" not in agent_sc["capabilities"]
    else:
        assert agent_sc["capabilities"]["add"] == ["SYS_PTRACE"]
    if variant == "base+agent-as-root":
        assert agent_sc["runAsUser"] == 0 and agent_sc["runAsNonRoot"] is False
    else:  # both containers: the pod's one non-root UID
        for c in pod["containers"]:
            assert "runAsUser" not in c["securityContext"], c["name"]


_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                       "persistentVolumeClaim", "projected", "secret"}
_BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                  "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def pss_violations(pod: dict[str, Any]) -> dict[str, list[str]]:
    """The Pod Security Standards controls this pod breaks, by level (the controls that a pod
    of this shape can break; the full list is in the Kubernetes documentation)."""
    baseline: list[str] = []
    restricted: list[str] = []
    psc = pod.get("securityContext", {})
    for c in _pod_containers({"spec": {"template": {"spec": pod}}}):
        sc = c.get("securityContext", {})
        add = set(sc.get("capabilities", {}).get("add", []))
        if add - _BASELINE_CAPS:
            baseline.append(f"{c['name']}: capabilities.add {sorted(add - _BASELINE_CAPS)}")
        if add - {"NET_BIND_SERVICE"}:
            restricted.append(f"{c['name']}: capabilities.add {sorted(add)}")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            restricted.append(f"{c['name']}: capabilities.drop lacks ALL")
        if sc.get("allowPrivilegeEscalation") is not False:
            restricted.append(f"{c['name']}: allowPrivilegeEscalation")
        if sc.get("privileged") or any(p.get("hostPort") for p in c.get("ports", [])):
            baseline.append(f"{c['name']}: privileged or hostPort")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")) \
                or sc.get("runAsUser", psc.get("runAsUser")) == 0:
            restricted.append(f"{c['name']}: runs as root")
    if psc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        restricted.append("seccompProfile")
    for vol in pod.get("volumes", []):
        if not set(vol) - {"name"} <= _RESTRICTED_VOLUMES:
            restricted.append(f"volume {vol['name']}")
    return {"baseline": baseline, "restricted": baseline + restricted}


def test_pod_security_levels_are_what_deploy_readme_says() -> None:
    """SYS_PTRACE is outside the baseline level's capabilities: the base needs a namespace at
    the privileged level; without the add (pss-restricted) the pod meets restricted; the root
    variant breaks restricted by running as root as well."""
    base = pss_violations(_pod(VARIANTS["base"]))
    assert base["baseline"] == ["mrc-agent: capabilities.add ['SYS_PTRACE']"]
    assert pss_violations(_pod(VARIANTS["base+pss-restricted"])) == \
        {"baseline": [], "restricted": []}
    root = pss_violations(_pod(VARIANTS["base+agent-as-root"]))["restricted"]
    assert "mrc-agent: runs as root" in root


def _quantity(value: str | int) -> float:
    """Kubernetes quantities used here: 20m, 4, 64Mi, 16Gi."""
    text = str(value)
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(parse_bytes(text.removesuffix("B")))


def _gpu_requests(c: dict[str, Any]) -> list[Any]:
    res = c.get("resources", {})
    return [res.get(kind, {}).get(GPU) for kind in ("requests", "limits")
            if GPU in res.get(kind, {})]


def _env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_only_the_service_asks_for_a_gpu(variant: str) -> None:
    objs = VARIANTS[variant]
    pod = _pod(objs)
    service, agent = _container(objs, SERVICE), _container(objs, AGENT)
    assert _gpu_requests(agent) == []
    if variant != "dra-shared-gpu":
        assert "claims" not in agent.get("resources", {})
        assert _gpu_requests(service) == [1]
        assert "resourceClaims" not in pod
        # The agent reaches NVML through the runtime's env, read-only driver utilities only;
        # the profiling counters need the CUDA driver library too (compute), nothing more.
        assert _env(agent)["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert _env(agent)["NVIDIA_DRIVER_CAPABILITIES"] == (
            "compute,utility" if variant == "base+profiling" else "utility")
        assert "NVIDIA_VISIBLE_DEVICES" not in _env(service)
        return
    # DRA: no device-plugin GPU anywhere; one claim for one GPU, shared by both containers.
    assert all(_gpu_requests(c) == [] for c in pod["containers"])
    (claim,) = pod["resourceClaims"]
    for c in (service, agent):
        assert c["resources"]["claims"] == [{"name": claim["name"]}]
    assert "NVIDIA_VISIBLE_DEVICES" not in _env(agent)
    template = _one(objs, "ResourceClaimTemplate")
    assert template["metadata"]["name"] == claim["resourceClaimTemplateName"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com",
                                  "allocationMode": "ExactCount", "count": 1}


def _mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def _volume_for(objs: list[dict[str, Any]], c: dict[str, Any], path: str) -> dict[str, Any]:
    """The pod volume mounted at ``path`` or above it in container ``c``."""
    hits = [mp for mp in _mounts(c) if path == mp or path.startswith(mp.rstrip("/") + "/")]
    assert hits, f"{c['name']}: nothing mounted at {path} (root filesystem is read-only)"
    name = _mounts(c)[max(hits, key=len)]
    (vol,) = [v for v in _pod(objs)["volumes"] if v["name"] == name]
    return vol


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_volumes_are_declared_and_writable_paths_bounded(variant: str) -> None:
    objs = VARIANTS[variant]
    names = [v["name"] for v in _pod(objs)["volumes"]]
    assert len(names) == len(set(names))
    for c in _pod(objs)["containers"]:
        assert set(_mounts(c).values()) <= set(names), c["name"]
        tmp = _volume_for(objs, c, "/tmp")
        assert "emptyDir" in tmp and "sizeLimit" in tmp["emptyDir"], c["name"]


@pytest.fixture
def agent_config(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``(objs) -> AgentConfig`` from the agent container's command, args and environment,
    through the real parser and config validation (nothing is bound or started)."""

    def parse(objs: list[dict[str, Any]]) -> Any:
        c = _container(objs, AGENT)
        assert c["command"][0] == "mrc-agent"
        for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(name)
        for name, value in _env(c).items():
            monkeypatch.setenv(name, value)
        args = build_parser().parse_args([*c["command"][1:], *c["args"]])
        assert args.command == "run"
        return config_from_args(args)

    yield parse


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_agent_args_are_its_real_command_line(variant: str, agent_config: Any) -> None:
    objs = VARIANTS[variant]
    cfg = agent_config(objs)
    agent, service = _container(objs, AGENT), _container(objs, SERVICE)
    # It watches the service: the regex matches the service's command line (as /proc shows it:
    # arguments joined by spaces) and not a neighbour that merely imports the package.
    service_cmdline = " ".join([*service["command"], *service["args"]])
    assert re.search(cfg.process_name, service_cmdline)
    assert not re.search(cfg.process_name, "python3 -m mrc_agent.reference_service.loadgen --url x")
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert cfg.host_port == ("0.0.0.0", ports["agent-metrics"])
    assert 0.05 <= cfg.interval <= 1.0, "sub-second sampling resolves GPU idle windows"
    # Profiling is opt-in: on only where the patch that also gives it libcuda is applied.
    assert cfg.gpu_backend == "auto"
    assert cfg.collectors["profiling"] == (variant == "base+profiling")
    captures = _volume_for(objs, agent, cfg.capture_dir)
    assert "emptyDir" in captures and "medium" not in captures["emptyDir"]
    # The agent's own bound stays under the volume's, so it never gets the pod evicted.
    assert cfg.capture_max_bytes < _quantity(captures["emptyDir"]["sizeLimit"])
    if variant == "example":
        assert cfg.webhook_enabled and cfg.webhook_token is None
        token = _volume_for(objs, agent, cfg.webhook_token_file)
        assert token["secret"]["secretName"] and token["secret"]["defaultMode"] == 0o440
        assert ENV_PREFIX + "WEBHOOK_TOKEN" not in _env(agent)
    else:
        assert not cfg.webhook_enabled, "captures are off unless an overlay gives a token"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_service_args_are_its_real_command_line(variant: str) -> None:
    from mrc_agent.reference_service.__main__ import build_parser as service_parser
    from mrc_agent.reference_service.__main__ import settings_from_args

    objs = VARIANTS[variant]
    c = _container(objs, SERVICE)
    assert c["command"] == ["python3", "-m", "mrc_agent.reference_service"]
    args = service_parser().parse_args(c["args"])
    settings = settings_from_args(args)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (args.host, args.port) == ("0.0.0.0", ports["http"])
    assert args.workers == 1, "one process: the agent's process-name match finds the worker"
    assert "emptyDir" in _volume_for(objs, c, str(settings.cache_dir))


def test_service_probes_hit_its_routes() -> None:
    """The service's own app answers every probe path (no lifespan: the model is not loaded,
    so /health is live and /ready says 503 until it is)."""
    from fastapi.testclient import TestClient

    from mrc_agent.reference_service.main import create_app

    app = create_app()
    state = app.state.mrc
    c = _container(VARIANTS["base"], SERVICE)
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/health"
    assert probes["readinessProbe"]["path"] == "/ready"
    assert {p["port"] for p in probes.values()} == {p["name"] for p in c["ports"]} == {"http"}
    try:
        client = TestClient(app)
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 503
        assert client.get("/nope").status_code == 404
    finally:
        for pool in (state.model_pool, state.ocr_pool):
            pool.shutdown(wait=False)
        state.decode_pool.shutdown()


def test_agent_probes_answer_on_the_real_agent(tmp_path: Path) -> None:
    """The agent started with the container's own arguments (loopback port, a temporary
    capture directory): every probe path answers 200 once it has sampled. It has no readiness
    probe: its /readyz turns 503 when sampling stalls, which must not unready the pod."""
    c = _container(VARIANTS["base"], AGENT)
    args = [a for a in c["args"] if not a.startswith(("--listen=", "--capture-dir="))]
    assert len(args) == len(c["args"]) - 2
    agent = AgentProcess(*args, f"--capture-dir={tmp_path / 'captures'}")
    try:
        assert "readinessProbe" not in c
        probes = {k: c[k]["httpGet"] for k in ("livenessProbe", "startupProbe")}
        assert {p["path"] for p in probes.values()} == {"/healthz", "/readyz"}
        assert {p["port"] for p in probes.values()} == {"agent-metrics"}
        deadline = time.monotonic() + 10
        codes: dict[str, int] = {}
        while time.monotonic() < deadline:
            codes = {p["path"]: httpx.get(agent.url + p["path"], timeout=2).status_code
                     for p in probes.values()}
            if set(codes.values()) == {200}:
                break
            time.sleep(0.2)
        assert codes == {"/healthz": 200, "/readyz": 200}
    finally:
        assert agent.stop() == 0


def test_agent_resources_are_sized_from_its_measured_footprint() -> None:
    """Requests cover the measured steady state with room, limits the measured peaks plus an
    on-alert capture (docs/fleet.md); benchmarks/results/agent.md is the measurement."""
    text = (REPO / "benchmarks" / "results" / "agent.md").read_text()
    rss_mb = [float(m) for m in re.findall(r"agent (?:peak )?RSS \(Vm\w+\)[^|]*\| ([\d.]+) MB",
                                           text)]
    cpu_pct = [float(m) for m in re.findall(r"agent CPU, idle \(not scraped\), interval "
                                            r"[\d.]+ s \| ([\d.]+) %", text)]
    assert len(rss_mb) >= 4 and len(cpu_pct) >= 2, "benchmark table format changed"
    res = _container(VARIANTS["base"], AGENT)["resources"]
    assert _quantity(res["requests"]["memory"]) >= 1.5 * max(rss_mb) * 1e6
    # An on-alert capture adds two py-spy children of at most ~14 MB RSS each, in the same
    # cgroup (measured, docs/fleet.md "Footprint"); the agent's own peak barely moves.
    assert _quantity(res["limits"]["memory"]) >= 1.5 * (max(rss_mb) + 2 * 14) * 1e6
    assert _quantity(res["requests"]["cpu"]) >= 2 * max(cpu_pct) / 100
    assert _quantity(res["limits"]["cpu"]) >= 5 * _quantity(res["requests"]["cpu"])
    assert _quantity(res["limits"]["cpu"]) <= 0.25, "the sidecar must not compete for a core"


# --- monitoring --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_podmonitor_and_service_select_the_pod_and_its_ports(variant: str) -> None:
    objs = VARIANTS[variant]
    dep = _deployment(objs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: c["name"] for c in _pod_containers(dep) for p in c.get("ports", [])}
    pm = _one(objs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    endpoints = pm["spec"]["podMetricsEndpoints"]
    assert {ports[e["port"]] for e in endpoints} == {SERVICE, AGENT}, "both containers scraped"
    for e in endpoints:
        assert e["path"] == "/metrics"
    jobs = {ports[e["port"]]: e["relabelings"][0]["replacement"] for e in endpoints}
    assert jobs == {SERVICE: "mrc", AGENT: "mrc-agent"}
    svc = _one(objs, "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == {"http"}
    namespaces = {o["metadata"].get("namespace") for o in objs}
    assert len(namespaces) == 1, "everything in one namespace"


def test_example_overlay_is_labelled_for_the_operator_and_pinned() -> None:
    objs = VARIANTS["example"]
    for kind in ("PodMonitor", "PrometheusRule"):
        assert _one(objs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dep = _deployment(objs)
    assert dep["spec"]["replicas"] == 2
    assert "release" not in dep["spec"]["selector"]["matchLabels"], "selectors are immutable"
    for c in _pod_containers(dep):
        name, tag = _image_name(c["image"])
        assert name.startswith("registry.example.com/") and tag == "0.1.0"


# --- kubectl, where installed -----------------------------------------------------------------


def _key(o: dict[str, Any]) -> tuple[str, str]:
    return o["kind"], o["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None,
                    reason="kubectl not installed: the test renderer alone is used")
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_kubectl_kustomize_agrees_with_the_test_renderer(name: str) -> None:
    res = subprocess.run(["kubectl", "kustomize", str(KUSTOMIZATIONS[name])],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    theirs = {_key(o): o for o in yaml.safe_load_all(res.stdout) if o}
    ours = {_key(o): o for o in render(KUSTOMIZATIONS[name])}
    assert theirs == ours


def test_renderer_refuses_features_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(AssertionError, match="namePrefix"):
        render(tmp_path)
