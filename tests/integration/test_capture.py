"""On-alert capture: a real ``mrc-agent run`` with the Alertmanager webhook on loopback,
watching a real process that spins in image resizing; plus the store's bounds, the rate limit,
the token and the payload validation on their own."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from mrc_agent.agent.core.config import AgentConfig, ConfigError
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.core.targets import TargetResolver
from mrc_agent.agent.tools.capture.manager import CaptureManager
from mrc_agent.agent.tools.capture.store import CaptureStore
from mrc_agent.agent.tools.capture.webhook import Token, WebhookError, parse_webhook
from tests.conftest import IDLE, REPO, Procs
from tests.integration.test_diagnose import PTRACER_ANY, spawn_preprocess, starved_trace
from tests.support import Clock

TOKEN = "s3cret-token-0123456789abcdef"
#: Capture length in the end-to-end test, and how long past it a capture may take to appear.
DURATION, MARGIN = 2.0, 20.0


def payload(alertname: str = "MRCGPUStarved", pid: int | None = None,
            status: str = "firing") -> dict[str, Any]:
    labels = {"alertname": alertname, "severity": "critical", "namespace": "mrc"}
    if pid is not None:
        labels["pid"] = str(pid)
    return {
        "version": "4", "groupKey": f'{{}}:{{alertname="{alertname}"}}', "truncatedAlerts": 0,
        "status": status, "receiver": "mrc-agent", "groupLabels": {"alertname": alertname},
        "commonLabels": labels, "commonAnnotations": {"summary": "x"},
        "externalURL": "http://alertmanager:9093",
        "alerts": [{"status": status, "labels": labels, "annotations": {"summary": "x"},
                    "startsAt": "2025-01-01T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
                    "generatorURL": "http://prometheus:9090/graph", "fingerprint": "abc"}],
    }


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def raw_get(port: int, path: str, token: str = TOKEN) -> int:
    """GET with the path exactly as given (httpx would normalise the dot segments)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers=auth(token))
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def test_webhook_is_off_by_default(agent_factory, procs: Procs) -> None:
    p = procs.spawn(PTRACER_ANY + IDLE)
    agent = agent_factory("--pid", str(p.pid), "--gpu-backend", "none")
    with httpx.Client(base_url=agent.url, timeout=5) as client:
        r = client.post("/hooks/alertmanager", json=payload(pid=p.pid), headers=auth())
        assert r.status_code == 404
        assert client.get("/captures", headers=auth()).status_code == 404
        assert client.post("/metrics").status_code == 405  # as before
        assert client.get("/metrics").status_code == 200


def test_wrong_or_missing_token_gets_401_and_captures_nothing(
        agent_factory, procs: Procs, tmp_path: Path, token_file: Path) -> None:
    p = spawn_preprocess(tmp_path, procs)
    captures = tmp_path / "captures"
    agent = agent_factory("--pid", str(p.pid), "--interval", "0.2", "--gpu-backend", "none",
                          "--webhook-token-file", str(token_file), "--capture-dir", str(captures))
    body = payload(pid=p.pid)
    with httpx.Client(base_url=agent.url, timeout=5) as client:
        for headers in ({}, auth("wrong-token-0123456789abcdef"), auth(TOKEN + "x"),
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN}):
            r = client.post("/hooks/alertmanager", json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["www-authenticate"].startswith("Bearer")
        assert client.get("/captures").status_code == 401
        assert client.get("/captures", headers=auth("nope-nope-nope-nope")).status_code == 401
        time.sleep(0.5)
        listing = client.get("/captures", headers=auth()).json()
    assert listing["captures"] == [] and listing["running"] is None
    assert listing["counts"]["unauthorized"] == 7
    assert os.listdir(captures) == []


def test_malformed_or_unrelated_webhooks(agent_factory, procs: Procs, tmp_path: Path,
                                         token_file: Path) -> None:
    p = procs.spawn(PTRACER_ANY + IDLE)
    agent = agent_factory("--pid", str(p.pid), "--gpu-backend", "none", "--webhook-token-file",
                          str(token_file), "--capture-dir", str(tmp_path / "captures"))
    with httpx.Client(base_url=agent.url, timeout=5, headers=auth()) as client:
        def post(content: bytes) -> httpx.Response:
            return client.post("/hooks/alertmanager", content=content,
                               headers={"Content-Type": "application/json"})

        assert post(b"{not json").status_code == 400
        assert post(json.dumps({**payload(pid=p.pid), "version": "3"}).encode()).status_code == 400
        assert post(json.dumps({**payload(pid=p.pid), "alerts": "x"}).encode()).status_code == 400
        other_pod = payload(pid=p.pid)
        other_pod["alerts"][0]["labels"]["pod"] = "mrc-other-pod-7d9f"
        bad_labels = payload(pid=p.pid)
        bad_labels["alerts"][0]["labels"]["pid"] = 42
        assert post(json.dumps(bad_labels).encode()).status_code == 400
        for body, why in ((payload("MRCGPUMemoryBound", p.pid), "not a firing"),
                          (payload(pid=p.pid, status="resolved"), "not a firing"),
                          (payload(pid=1), "is not a target"),
                          (payload(pid=p.pid + 100000), "is not a target"),
                          (other_pod, "is not this agent's pod")):
            r = post(json.dumps(body).encode())
            assert r.status_code == 200 and r.json()["status"] == "ignored"
            assert why in r.json()["alerts"][0]["outcome"]
        assert client.get("/hooks/alertmanager").status_code == 405
        listing = client.get("/captures").json()
    assert listing["captures"] == []
    assert listing["counts"] == {"invalid": 4, "ignored": 5}

    # Too large: answered 413 from the headers, the body never read.
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=5)
    try:
        conn.putrequest("POST", "/hooks/alertmanager")
        conn.putheader("Authorization", f"Bearer {TOKEN}")
        conn.putheader("Content-Length", str(2 << 20))
        conn.endheaders()
        assert conn.getresponse().status == 413
    finally:
        conn.close()


def test_alert_starts_a_capture_that_is_listed_and_served(
        agent_factory, procs: Procs, tmp_path: Path, token_file: Path) -> None:
    p = spawn_preprocess(tmp_path, procs)
    trace = starved_trace(tmp_path)
    captures = tmp_path / "captures"
    agent = agent_factory("--pid", str(p.pid), "--interval", "0.2", "--gpu-backend",
                          f"replay:{trace}", "--webhook-token-file", str(token_file),
                          "--capture-dir", str(captures), "--capture-duration", str(DURATION))
    with httpx.Client(base_url=agent.url, timeout=5, headers=auth()) as client:
        r = client.post("/hooks/alertmanager", json=payload(pid=p.pid))
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "accepted"
        cid = r.json()["capture"]

        # A second alert while the first capture runs: rate-limited, nothing more captured.
        again = client.post("/hooks/alertmanager",
                            json=payload("MRCProcessCPUUserSaturated", p.pid))
        assert again.status_code == 202 and again.json()["status"] == "rate-limited"

        deadline = time.monotonic() + DURATION + MARGIN
        while time.monotonic() < deadline:
            listing = client.get("/captures").json()
            if listing["captures"] and listing["captures"][0]["status"] != "running":
                break
            time.sleep(0.25)
        assert [c["id"] for c in listing["captures"]] == [cid]
        capture = listing["captures"][0]
        assert capture["status"] == "completed", capture
        assert capture["alert"] == "MRCGPUStarved" and capture["pid"] == p.pid
        assert capture["verdict"] == "preprocessing-bound"
        assert {"flamegraph.svg", "stacks.txt", "samples.jsonl", "report.json",
                "report.txt"} <= set(capture["files"])
        assert listing["counts"]["accepted"] == 1 and listing["counts"]["rate_limited"] == 1
        assert os.listdir(captures) == [cid]

        svg = client.get(f"/captures/{cid}/flamegraph.svg")
        assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
        assert "<svg" in svg.text and "resize_image" in svg.text
        assert svg.headers["x-content-type-options"] == "nosniff"
        rep = client.get(f"/captures/{cid}/report.json").json()
        assert rep["top_functions"]["self"][0]["function"] == "resize_image"
        assert client.get(f"/captures/{cid}").json()["verdict"] == "preprocessing-bound"
        assert client.get(f"/captures/{cid}/flamegraph.svg",
                          headers=auth("wrong-token-0123456789")).status_code == 401

        # Nothing outside the capture's own directory.
        (captures / cid / "passwd").symlink_to("/etc/passwd")
        for path in (f"/captures/{cid}/../../etc/passwd", f"/captures/{cid}/%2e%2e%2fpasswd",
                     "/captures/../../../etc/passwd", f"/captures/{cid}/passwd",
                     f"/captures/{cid}/.", f"/captures/{cid}/capture.json.tmp",
                     "/captures/..", f"/captures/{cid}/sub/flamegraph.svg",
                     "/captures/x/flamegraph.svg"):
            assert raw_get(agent.port, path) in (400, 404), path
        assert raw_get(agent.port, f"/captures/{cid}/report.txt") == 200


def test_a_capture_reads_the_agents_own_stacks_from_before_the_alert(
        agent_factory, procs: Procs, tmp_path: Path, token_file: Path) -> None:
    """With the stacks collector on, the capture starts no py-spy: its stacks and flame graph
    are the agent's austin samples, from before the webhook to the window's end."""
    p = spawn_preprocess(tmp_path, procs)
    captures = tmp_path / "captures"
    agent = agent_factory("--pid", str(p.pid), "--interval", "0.2", "--gpu-backend",
                          f"replay:{starved_trace(tmp_path)}", "--collector", "stacks",
                          "--webhook-token-file", str(token_file), "--capture-dir",
                          str(captures), "--capture-duration", str(DURATION))
    with httpx.Client(base_url=agent.url, timeout=5, headers=auth()) as client:
        deadline = time.monotonic() + 15
        ok = f'mrc_process_stacks_available{{pid="{p.pid}",process="python",reason="ok"}} 1'
        while ok not in client.get("/metrics").text:
            assert time.monotonic() < deadline, "the agent never sampled the target's stacks"
            time.sleep(0.2)
        time.sleep(1.0)  # samples from before the alert
        r = client.post("/hooks/alertmanager", json=payload(pid=p.pid))
        assert r.status_code == 202 and r.json()["status"] == "accepted", r.text
        cid = r.json()["capture"]
        deadline = time.monotonic() + DURATION + MARGIN
        while client.get(f"/captures/{cid}").json()["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.25)
        capture = client.get(f"/captures/{cid}").json()
        assert capture["status"] == "completed", capture
        rep = client.get(f"/captures/{cid}/report.json").json()
        svg = client.get(f"/captures/{cid}/flamegraph.svg").text
        raw = client.get(f"/captures/{cid}/stacks.txt").text
    assert rep["stacks"]["source"] == "agent" and rep["stacks"]["from_seconds"] == -60.0
    assert rep["stacks"]["first_sample_seconds"] < 0  # the agent's samples before the alert
    assert rep["stacks"]["rate_hz"] == 10.0 and rep["stacks"]["busy_thread_samples"] > 0
    assert rep["top_functions"]["self"][0]["function"] == "resize_image"
    assert rep["verdict"] == "preprocessing-bound", rep["evidence"]
    assert any("the agent's own" in line for line in rep["evidence"])
    assert "<svg" in svg and "resize_image" in svg
    assert raw.startswith("thread (") and "resize_image (" in raw


def test_diagnose_asks_the_agent_which_captures_on_its_own_samples(
        agent_factory, procs: Procs, tmp_path: Path, token_file: Path) -> None:
    """``mrc-agent diagnose --agent``: the agent runs the diagnosis as a capture (POST
    /captures) on its own stack samples, and the command copies its files and prints it."""
    p = spawn_preprocess(tmp_path, procs)
    agent = agent_factory("--pid", str(p.pid), "--interval", "0.2", "--gpu-backend",
                          f"replay:{starved_trace(tmp_path)}", "--collector", "stacks",
                          "--webhook-token-file", str(token_file), "--capture-dir",
                          str(tmp_path / "captures"), "--capture-duration", "30")
    with httpx.Client(base_url=agent.url, timeout=5) as client:
        assert client.post("/captures", json={"pid": p.pid}).status_code == 401
        for bad in (b"[1]", b"{not json", b'{"pid": "7"}', b'{"pid": true}',
                    b'{"pid": 1, "extra": 1}', b'{"duration": 0.5}', b'{"duration": 121}'):
            r = client.post("/captures", content=bad, headers=auth())
            assert r.status_code == 400, (bad, r.text)
        assert client.post("/captures", json={"pid": 1}, headers=auth()).status_code == 404
        assert client.post("/captures/x", headers=auth()).headers["allow"] == "GET, HEAD"
        ok = f'mrc_process_stacks_available{{pid="{p.pid}",process="python",reason="ok"}} 1'
        deadline = time.monotonic() + 15
        while ok not in client.get("/metrics").text:
            assert time.monotonic() < deadline, "the agent never sampled the target's stacks"
            time.sleep(0.2)
    out = tmp_path / "diag"
    done = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "diagnose", "--pid",
                           str(p.pid), "--duration", str(DURATION), "--agent", agent.url,
                           "--agent-token-file", str(token_file), "--out", str(out)],
                          capture_output=True, text=True, timeout=DURATION + MARGIN + 30,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "preprocessing-bound" in done.stdout and f"by the agent at {agent.url}" in done.stdout
    rep = json.loads((out / "report.json").read_text())
    assert rep["stacks"]["source"] == "agent" and rep["window"]["duration_seconds"] < 10
    assert {"flamegraph.svg", "stacks.txt", "samples.jsonl", "report.txt"} <= {
        f.name for f in out.iterdir()}
    listing = httpx.get(agent.url + "/captures", headers=auth(), timeout=5).json()
    assert [c["alert"] for c in listing["captures"]] == ["manual"]


def test_diagnose_via_an_agent_says_what_went_wrong(tmp_path: Path, token_file: Path) -> None:
    def diag(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mrc_agent.agent", "diagnose", "--pid",
                               "1", "--out", str(tmp_path / "d"), *extra],
                              capture_output=True, text=True, timeout=60, cwd=REPO)

    no_token = diag("--agent", "http://127.0.0.1:9")
    assert no_token.returncode == 2 and "--agent-token-file" in no_token.stderr
    alone = diag("--agent-token-file", str(token_file))
    assert alone.returncode == 2 and "goes with --agent" in alone.stderr
    down = diag("--agent", "http://127.0.0.1:9", "--agent-token-file", str(token_file))
    assert down.returncode == 1 and "cannot reach the agent" in down.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert diag("--agent", "http://127.0.0.1:9", "--agent-token-file",
                str(empty)).returncode == 2


def test_run_rejects_bad_capture_settings(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("tooshort")
    for args, message in (
            (["--webhook-token-file", str(tmp_path / "missing")], "cannot read webhook token"),
            (["--webhook-token-file", str(short)], "at least 16 characters"),
            (["--capture-max-bytes", "lots"], "invalid value 'lots' for capture_max_bytes"),
            (["--capture-retention", "7 days"], "invalid value '7 days' for capture_retention"),
            (["--capture-duration", "0.5"], "capture-duration 0.5 is out of range"),
            (["--capture-max-per-hour", "0"], "capture-max-per-hour 0 is out of range")):
        r = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "run",
                            "--listen", "127.0.0.1:0", "--gpu-backend", "none", *args],
                           capture_output=True, text=True, timeout=30, cwd=REPO)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "run", "--listen", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=30, cwd=REPO,
                       env={**os.environ, "MRC_AGENT_WEBHOOK_TOKEN": "short"})
    assert r.returncode == 2 and "MRC_AGENT_WEBHOOK_TOKEN" in r.stderr


# -- the parts on their own ------------------------------------------------------------------
def _fill(store: CaptureStore, cid: str, nbytes: int) -> None:
    (Path(store.root) / cid / "flamegraph.svg").write_bytes(b"x" * nbytes)


def test_store_deletes_oldest_first_when_over_count_or_bytes(tmp_path: Path) -> None:
    clock = Clock(1_700_000_000.0)  # a wall clock: capture ids carry the date
    store = CaptureStore(str(tmp_path / "c"), max_count=3, max_bytes=10_000,
                         retention_s=3600, clock=clock)
    ids = []
    for i in range(3):
        clock.t += 1
        ids.append(store.create("MRCGPUStarved", 100 + i))
        _fill(store, ids[-1], 1000)
    assert store.prune() == []
    # Room for a fourth: the oldest goes.
    assert store.prune(room_for=1) == [ids[0]]
    clock.t += 1
    ids.append(store.create("MRCGPUStarved", 200))
    _fill(store, ids[-1], 8000)  # now over max_bytes: 3 x ~1 kB + 8 kB
    assert store.prune() == [ids[1]]
    assert [m["id"] for m in store.entries()] == [ids[3], ids[2]]
    count, used = store.usage()
    assert count == 2 and used <= 10_000
    # The running capture is never deleted, even when it alone is over the limit.
    _fill(store, ids[3], 20_000)
    assert store.prune(keep=[ids[3]]) == [ids[2]]
    assert store.usage()[0] == 1


def test_store_retention_and_foreign_entries(tmp_path: Path) -> None:
    clock = Clock(1_700_000_000.0)  # a wall clock: capture ids carry the date
    store = CaptureStore(str(tmp_path / "c"), max_count=10, max_bytes=1 << 20,
                         retention_s=3600, clock=clock)
    old = store.create("MRCGPUStarved", 1)
    clock.t += 3000
    new = store.create("MRCGPUStarved", 2)
    (Path(store.root) / "not-a-capture").mkdir()
    (Path(store.root) / "README").write_text("mine")
    clock.t += 1000  # old is 4000 s old, new 1000 s
    assert store.prune() == [old]
    assert [m["id"] for m in store.entries()] == [new]
    assert sorted(os.listdir(store.root)) == sorted([new, "not-a-capture", "README"])
    assert store.file_path(new, "capture.json") is not None
    assert store.file_path(new, "../README") is None
    assert store.file_path("not-a-capture", "x") is None


def test_at_most_n_captures_per_hour(tmp_path: Path, procs: Procs) -> None:
    p = procs.spawn(PTRACER_ANY + IDLE)
    cfg = AgentConfig(pids=[p.pid], gpu_backend="none", capture_max_per_hour=2,
                      capture_duration=1.0)
    store = CaptureStore(str(tmp_path / "c"), 10, 1 << 20, 3600)
    runner = Runner([], TargetResolver([p.pid]), 1.0)
    clock = Clock(1000.0)
    manager = CaptureManager(cfg, store, runner, clock=clock)
    # A PID that no longer exists: each capture fails at once, which frees the slot.
    gone = 999_999_999
    for _ in range(2):
        assert manager.request("MRCGPUStarved", gone)[0] == "accepted"
        manager.wait(10)
    status, why = manager.request("MRCGPUStarved", gone)
    assert status == "rate-limited" and "2 captures started in the last hour" in why
    clock.t += 3601
    assert manager.request("MRCGPUStarved", gone)[0] == "accepted"
    manager.wait(10)
    assert manager.counts == {"accepted": 3, "rate_limited": 1, "failed": 3}
    assert all(m["status"] == "failed" and "no process" in m["error"] for m in store.entries())


def test_token_is_compared_whole_and_follows_its_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    token = Token(path=str(path))
    assert token.check(f"Bearer {TOKEN}") and token.check(f"bearer  {TOKEN} ")
    assert not token.check(None) and not token.check("") and not token.check(TOKEN)
    assert not token.check(f"Bearer {TOKEN[:-1]}") and not token.check(f"Basic {TOKEN}")
    rotated = "rotated-token-abcdefghijkl"
    path.write_text(rotated)
    os.utime(path, (time.time() + 5, time.time() + 5))
    assert token.check(f"Bearer {rotated}") and not token.check(f"Bearer {TOKEN}")
    path.unlink()  # unreadable: refuse everything rather than keep an old secret
    assert not token.check(f"Bearer {rotated}")
    with pytest.raises(ConfigError):
        Token(path=str(tmp_path / "missing"))


def test_payload_validation() -> None:
    alerts = parse_webhook(json.dumps(payload(pid=7)).encode())
    assert alerts[0].name == "MRCGPUStarved" and alerts[0].labels["pid"] == "7"
    for bad in (b"", b"[]", b'{"version": "4"}', json.dumps({**payload(), "status": "x"}),
                json.dumps({**payload(), "alerts": [1]}),
                json.dumps({**payload(), "commonLabels": {"a": 1}})):
        with pytest.raises(WebhookError):
            parse_webhook(bad if isinstance(bad, bytes) else bad.encode())


def test_a_capture_larger_than_the_byte_limit_is_reported_as_such(tmp_path: Path,
                                                                   procs: Procs) -> None:
    p = procs.spawn(PTRACER_ANY + IDLE)
    cfg = AgentConfig(pids=[p.pid], gpu_backend="none", capture_duration=1.0)
    store = CaptureStore(str(tmp_path / "c"), 10, 1024, 3600)  # 1 KiB: any capture is more
    manager = CaptureManager(cfg, store, Runner([], TargetResolver([p.pid]), 1.0))
    assert manager.request("MRCGPUStarved", p.pid)[0] == "accepted"
    manager.wait(60)
    assert manager.counts["too_large"] == 1 and manager.counts["completed"] == 0
    assert store.ids() == []
