"""The meter proxy variant (``deploy/components/meter-proxy``) and its worked example
``deploy/examples/tgi-metered``, rendered by the real ``kubectl kustomize``: strict Kubernetes
schemas, the operator's typed PodMonitor, the proxy's arguments through the project's real
parser after the kubelet's ``$(VAR)`` expansion, the Service sent through the proxy's port,
Pod Security "restricted" for the proxy, and the proxy started with the rendered arguments in
front of a small OpenAI-shaped server: its readiness port accepts and ``/metrics`` answers
within the PodMonitor's sample limit.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from mrc_agent.agent.cli import build_parser
from mrc_agent.agent.tools.proxy import Upstream, split_hostport
from tests.conftest import REPO, parse_metrics, series
from tests.integration.test_deploy import (
    LATEST,
    _gpu_requests,
    _quantity,
    _round_trip,
    pss_violations,
)
from tests.integration.test_sidecar_component import RENDERED as SIDECAR_EXAMPLES
from tests.integration.test_sidecar_component import _source, kustomize
from tests.openai_support import FakeEngine, ServerThread, chat
from tests.support import free_port

COMPONENTS = REPO / "deploy" / "components"
EXAMPLE = REPO / "deploy" / "examples" / "tgi-metered"
SERVER, AGENT, PROXY = "tgi", "mrc-agent", "mrc-meter-proxy"
CONFIGMAP = "mrc-agent-sidecar"

OBJS = kustomize(EXAMPLE)


def _one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind
              and (name is None or o["metadata"]["name"] == name)]
    return obj


def _pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = _one(objs, "StatefulSet")["spec"]["template"]["spec"]
    return pod


def _container(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (c,) = [c for c in _pod(objs)["containers"] if c["name"] == name]
    return c


def _ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def _env(objs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it from ``env`` (values and required
    ConfigMap keys; a missing one is CreateContainerConfigError, here an assertion)."""
    maps = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    out: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]["configMapKeyRef"]
        assert not ref.get("optional", False), f"{e['name']}: a missing key must be loud"
        assert ref["name"] in maps and ref["key"] in maps[ref["name"]], ref
        out[e["name"]] = maps[ref["name"]][ref["key"]]
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command and args: a defined variable is replaced,
    ``$$`` is a literal ``$``, an undefined reference is left as written."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def _args(objs: list[dict[str, Any]], env: dict[str, str] | None = None) -> list[str]:
    proxy = _container(objs, PROXY)
    env = _env(objs, proxy) if env is None else env
    return [expand(a, env) for a in proxy["args"]]


# --- the rendered objects ----------------------------------------------------------------------


def test_the_example_is_the_tgi_example_plus_the_proxy_and_its_service() -> None:
    """Against examples/tgi rendered alone: the component adds a container, a pod label, a
    PodMonitor and the Service patch, and changes nothing else (the server, the agent and the
    pod's other settings are as components/sidecar left them)."""
    assert sorted(o["kind"] for o in OBJS) == ["ConfigMap", "PodMonitor", "PodMonitor",
                                               "Service", "StatefulSet"]
    names = [c["name"] for c in _pod(OBJS)["containers"]]
    assert names == [SERVER, AGENT, PROXY], "the server first, the proxy appended last"
    assert _pod(OBJS)["containers"][0] == _source("tgi-metered")["spec"]["template"]["spec"][
        "containers"][0]
    plain = SIDECAR_EXAMPLES["tgi"]
    cm_here = _one(OBJS, "ConfigMap")["metadata"]["name"]
    cm_there = _one(plain, "ConfigMap")["metadata"]["name"]
    sts = copy.deepcopy(_one(OBJS, "StatefulSet"))
    spec = sts["spec"]["template"]
    assert spec["metadata"]["labels"].pop("mrc-agent/meter-proxy") == "true"
    spec["spec"]["containers"].pop()
    text = yaml.safe_dump(sts).replace(cm_here, cm_there)  # the hash covers the new key
    assert yaml.safe_load(text) == _one(plain, "StatefulSet")


@pytest.mark.parametrize("version", sorted({"1.30", LATEST}))
def test_core_kinds_validate_strictly(version: str) -> None:
    for obj in OBJS:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_podmonitors_are_what_the_operator_reads() -> None:
    for pm in (o for o in OBJS if o["kind"] == "PodMonitor"):
        assert _round_trip(pm) == pm, f"{pm['metadata']['name']}: fields the operator lacks"


# --- the proxy container -----------------------------------------------------------------------


def test_the_proxy_args_parse_with_the_real_command_line() -> None:
    """The image's entrypoint ``mrc-agent`` with the args the kubelet passes after expanding
    ``$(MRC_METER_UPSTREAM_PORT)`` from the ConfigMap: the upstream is the server's own port
    on loopback, and both listen addresses are ports the container declares."""
    proxy, agent = _container(OBJS, PROXY), _container(OBJS, AGENT)
    assert "command" not in proxy and proxy["image"] == agent["image"]
    assert "envFrom" not in proxy, "the agent's settings stay out of the proxy"
    args = build_parser().parse_args(_args(OBJS))
    assert args.command == "proxy"
    server_port = _ports(_container(OBJS, SERVER))["http"]
    assert Upstream.parse(args.upstream) == Upstream("http", "127.0.0.1", server_port)
    ports = _ports(proxy)
    assert split_hostport(args.listen, "--listen") == ("0.0.0.0", ports["mrc-proxy"])
    assert split_hostport(args.metrics_listen, "--metrics-listen") == (
        "0.0.0.0", ports["mrc-meter"])
    every = [p["containerPort"] for c in _pod(OBJS)["containers"] for p in c.get("ports", [])]
    assert len(every) == len(set(every)), "a port the pod already uses"
    assert sorted(ports.values()) == [9479, 9480] and _ports(agent) == {"mrc-agent": 9478}


def test_without_the_key_the_url_would_not_be_expanded() -> None:
    """What the kubelet does with a reference it cannot resolve (leaves it as written): the
    reason the key comes through a required configMapKeyRef rather than envFrom."""
    (upstream,) = [a for a in _args(OBJS, env={}) if a.startswith("--upstream=")]
    assert upstream == "--upstream=http://127.0.0.1:$(MRC_METER_UPSTREAM_PORT)"
    assert expand("$$(X) $(X)", {"X": "1"}) == "$(X) 1"


def test_the_proxy_asks_for_no_gpu_gates_readiness_and_meets_restricted() -> None:
    proxy = _container(OBJS, PROXY)
    assert not _gpu_requests(proxy)
    assert not [n for n in _env(OBJS, proxy) if n.startswith("NVIDIA_")]
    # The Service sends traffic through it: readiness on the port the Service targets. No
    # liveness (a restart cuts every stream; a failed proxy exits).
    assert proxy["readinessProbe"]["tcpSocket"] == {"port": "mrc-proxy"}
    assert "livenessProbe" not in proxy and "startupProbe" not in proxy
    res = proxy["resources"]
    assert _quantity(res["requests"]["memory"]) == 64 << 20
    assert _quantity(res["limits"]["memory"]) == 256 << 20
    assert _quantity(res["limits"]["cpu"]) >= 1, "throttling would add to every request"
    assert _quantity(res["requests"]["cpu"]) <= _quantity(res["limits"]["cpu"])
    assert "volumeMounts" not in proxy, "it writes nothing"
    sc = proxy["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert _pss(OBJS, PROXY) == []


def _pss(objs: list[dict[str, Any]], name: str) -> list[str]:
    """Container ``name``'s violations of Pod Security "restricted" (with its own seccomp
    profile and the volumes it mounts; the server's settings are the server's business)."""
    c = _container(objs, name)
    mounted = {m["name"] for m in c.get("volumeMounts", [])}
    alone = {"containers": [c],
             "volumes": [v for v in _pod(objs).get("volumes", []) if v["name"] in mounted],
             "securityContext": {"seccompProfile": c["securityContext"]["seccompProfile"]}}
    return sorted(set(pss_violations(alone)["restricted"]))


def _sources() -> list[dict[str, Any]]:
    """The example's StatefulSet and Service as written."""
    return [yaml.safe_load((EXAMPLE / f).read_text()) for f in ("statefulset.yaml",
                                                                 "service.yaml")]


def _kustomization(tmp_path: Path, docs: list[dict[str, Any]], *components: str) -> Path:
    """A kustomization in ``tmp_path`` of ``docs`` with ``components`` and the ConfigMap."""
    (tmp_path / "w.yaml").write_text(yaml.safe_dump_all(docs))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["w.yaml"],
        "components": [os.path.relpath(COMPONENTS / c, tmp_path) for c in components],
        "configMapGenerator": [{"name": CONFIGMAP, "literals": [
            "MRC_AGENT_PROCESS_NAME=x", "MRC_METER_UPSTREAM_PORT=8080"]}]}))
    return tmp_path


def test_with_sidecar_restricted_the_agent_and_the_proxy_both_meet_restricted(
        tmp_path: Path) -> None:
    """components/sidecar-restricted patches the agent by index: the proxy, appended after
    it, leaves it second, in either order of the two components."""
    for order in (("meter-proxy", "sidecar-restricted"), ("sidecar-restricted", "meter-proxy")):
        objs = kustomize(_kustomization(tmp_path, _sources(), "sidecar", *order))
        assert [c["name"] for c in _pod(objs)["containers"]] == [SERVER, AGENT, PROXY]
        assert _pss(objs, AGENT) == [] and _pss(objs, PROXY) == []


# --- the Service and the PodMonitor ------------------------------------------------------------


def test_the_service_sends_the_clients_through_the_proxy() -> None:
    svc = _one(OBJS, "Service")
    source = _sources()[1]
    pod = _one(OBJS, "StatefulSet")["spec"]["template"]
    assert svc["metadata"]["labels"]["mrc-agent/meter-proxy"] == "true"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    (before,) = source["spec"]["ports"]
    assert before["targetPort"] == "http" and "http" in _ports(_container(OBJS, SERVER))
    assert port == {**before, "targetPort": "mrc-proxy"}, "clients keep name and port"
    proxy = _container(OBJS, PROXY)
    assert port["targetPort"] in _ports(proxy)
    assert port["targetPort"] == proxy["readinessProbe"]["tcpSocket"]["port"]
    assert svc["spec"].get("clusterIP") != "None", "a headless Service ignores targetPort"


def test_only_labelled_services_are_repointed_and_only_from_http(tmp_path: Path) -> None:
    sts, svc = _sources()
    plain = copy.deepcopy(svc)
    plain["metadata"] = {"name": "tgi-direct"}
    objs = kustomize(_kustomization(tmp_path, [sts, svc, plain], "sidecar", "meter-proxy"))
    assert _one(objs, "Service", "tgi-direct") == plain
    assert _one(objs, "Service", svc["metadata"]["name"])["spec"]["ports"][0][
        "targetPort"] == "mrc-proxy"
    # A first port that does not point at the server's `http` (gRPC, a number): the build
    # fails rather than send it through an HTTP/1.1 proxy.
    svc["spec"]["ports"][0]["targetPort"] = 8080
    path = _kustomization(tmp_path, [sts, svc], "sidecar", "meter-proxy")
    res = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode != 0 and "test" in res.stderr.lower(), res.stderr


def test_the_podmonitor_scrapes_the_proxy_as_the_services_job() -> None:
    """The proxy's request metrics carry job `mrc`, as the reference service's do
    (deploy/base/podmonitor.yaml), and no rule matches on job, so the relabel cannot hide them
    from an alert."""
    pm = _one(OBJS, "PodMonitor", "mrc-meter-proxy")
    labels = _one(OBJS, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    proxy = _ports(_container(OBJS, PROXY))
    assert endpoint["port"] in proxy and endpoint["port"] != _one(OBJS, "Service")["spec"][
        "ports"][0]["targetPort"], "scrape the metrics port, not the traffic port"
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    base = yaml.safe_load((REPO / "deploy" / "base" / "podmonitor.yaml").read_text())
    (service_job,) = [e["relabelings"][0]["replacement"]
                      for e in base["spec"]["podMetricsEndpoints"] if e["port"] == "http"]
    assert endpoint["relabelings"] == [
        {"action": "replace", "targetLabel": "job", "replacement": service_job}]
    rule = yaml.safe_load((REPO / "deploy" / "base" / "mrc-prometheusrule.yaml").read_text())
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert exprs and not [e for e in exprs if re.search(r'\bjob\s*(=~|!~|!=|=)\s*"', e)]


# --- the proxy as the pod runs it --------------------------------------------------------------


def test_the_proxy_started_with_the_rendered_args_is_ready_and_serves_metrics() -> None:
    """``mrc-agent proxy`` with the container's args and environment, the listen ports swapped
    for free loopback ports and the upstream port for a small OpenAI-shaped server's: the
    readiness probe's port accepts, a request goes through, and the PodMonitor's port and
    path answer with the request counted, in fewer samples than its sampleLimit."""
    proxy = _container(OBJS, PROXY)
    pm = _one(OBJS, "PodMonitor", "mrc-meter-proxy")
    engine = ServerThread(FakeEngine().app())
    env = {**_env(OBJS, proxy), "MRC_METER_UPSTREAM_PORT": str(engine.port)}
    swapped = {name: free_port() for name in _ports(proxy)}
    by_number = {n: swapped[name] for name, n in _ports(proxy).items()}
    args = []
    for arg in _args(OBJS, env):
        flag, _, value = arg.partition("=")
        if flag in ("--listen", "--metrics-listen"):
            arg = f"{flag}=127.0.0.1:{by_number[split_hostport(value, flag)[1]]}"
        args.append(arg)
    proc = subprocess.Popen([sys.executable, "-m", "mrc_agent.agent", *args],
                            env={**os.environ, **env}, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready = swapped[proxy["readinessProbe"]["tcpSocket"]["port"]]
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", ready), timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{ready}/v1/chat/completions", json=chat("hi"),
                       timeout=10)
        assert r.status_code == 200
        (endpoint,) = pm["spec"]["podMetricsEndpoints"]
        scrape = httpx.get(f"http://127.0.0.1:{swapped[endpoint['port']]}{endpoint['path']}",
                           timeout=10)
        assert scrape.status_code == 200
        values = parse_metrics(scrape.text)
        assert series(values, "mrc_requests_total", outcome="ok") == [1.0]
        assert len(values) <= pm["spec"]["sampleLimit"], "every scrape would fail (up = 0)"
    finally:
        proc.terminate()
        try:
            code = proc.wait(20)
        finally:
            proc.kill()
            engine.stop()
    assert code == 0, proc.stderr.read() if proc.stderr else ""
