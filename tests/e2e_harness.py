"""Real Prometheus and real Alertmanager on loopback, for end-to-end tests (the webhook receiver
they page is :mod:`mrc_agent.alerts.webhook`, which a benchmark shares).

Everything binds to 127.0.0.1 on free ports, keeps its state in a temporary directory, and is
stopped by the owner (the fixtures call ``stop()`` in their teardown).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import AgentProcess
from tests.integration.test_service import Service
from tests.support import free_port


def replay_trace(tmp: Path, pattern: str, gpus: int = 1, duration: float = 20) -> Path:
    """``tmp/<pattern>.jsonl``: a synthetic replay trace from ``agent.tools.tracegen``."""
    path = tmp / f"{pattern}.jsonl"
    out = subprocess.run([sys.executable, "-m", "mrc_agent.agent.tools.tracegen", pattern,
                          str(gpus), str(duration)], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=60)
    path.write_text(out.stdout)
    return path


def watched_service(tmp: Path, stack: list[Any]) -> tuple[Service, AgentProcess]:
    """The reference service and an agent watching it with every GPU source (a replayed busy
    trace of two GPUs with NVML, GPM and profiling fields). Each is appended to ``stack`` as it
    starts, so the caller's teardown stops what did start when a later one fails."""
    service = Service(tmp, "--max-queue", "64")
    stack.append(service)
    agent = AgentProcess("--pid", str(service.proc.pid), "--interval", "0.5",
                         "--gpu-backend", f"replay:{replay_trace(tmp, 'busy', 2)}",
                         "--collector", "profiling")
    stack.append(agent)
    return service, agent


def put_load(url: str, duration: float, seed: int) -> None:
    """The load generator against the service at ``url``: 4 requests a second for ``duration``
    seconds, on a thread of its own (the caller may run an event loop), waited for at most
    two minutes."""
    from mrc_agent.reference_service.loadgen import run_load

    thread = threading.Thread(target=lambda: asyncio.run(run_load(
        url, rate=4.0, duration=duration, max_new_tokens=4, seed=seed)), daemon=True)
    thread.start()
    thread.join(120)


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise AssertionError(f"{binary} is required (Debian packages prometheus and "
                             "prometheus-alertmanager; .ci/run installs them)")
    return path


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.5,
               what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout:g} s")


class _Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def text_log(self) -> str:
        return self.log_path.read_text(errors="replace")


class Alertmanager(_Proc):
    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "alertmanager.yml"
        cfg.write_text(yaml.safe_dump(config))
        super().__init__([require("prometheus-alertmanager"), f"--config.file={cfg}",
                          f"--storage.path={workdir / 'data'}",
                          f"--web.listen-address=127.0.0.1:{self.port}",
                          "--cluster.listen-address="], workdir / "alertmanager.log")
        wait_until(self._ready, 30, 0.2, "Alertmanager ready")

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return self.proc.poll() is not None and _raise(self.text_log())


class Prometheus(_Proc):
    def __init__(self, workdir: Path, targets: dict[str, list[str]],
                 rule_files: list[Path] | None = None, alertmanager: str | None = None,
                 interval: str = "1s",
                 labels: dict[str, dict[str, str]] | None = None,
                 config: dict[str, Any] | None = None, mode: str = "server") -> None:
        """``labels``: per job, target labels (what service discovery would add: pod,
        namespace). ``config``: a whole configuration instead (``targets`` and the rest are
        then ignored). ``mode``: ``server``, ``agent`` (scrape and remote-write only) or
        ``receiver`` (a server that accepts remote write)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if config is None:
            config = {
                "global": {"scrape_interval": interval, "evaluation_interval": interval},
                "scrape_configs": [{"job_name": job, "static_configs": [
                    {"targets": addrs, **({"labels": labels[job]} if labels and job in labels
                                          else {})}]}
                    for job, addrs in targets.items()],
            }
            if rule_files:
                config["rule_files"] = [str(p) for p in rule_files]
            if alertmanager:
                config["alerting"] = {"alertmanagers": [{"static_configs": [
                    {"targets": [alertmanager.removeprefix("http://")]}]}]}
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        storage = [f"--storage.tsdb.path={workdir / 'data'}", "--storage.tsdb.retention.time=1h"]
        if mode == "agent":
            storage = ["--enable-feature=agent", f"--storage.agent.path={workdir / 'wal'}"]
        elif mode == "receiver":
            storage.append("--web.enable-remote-write-receiver")
        super().__init__([require("prometheus"), f"--config.file={cfg}", *storage,
                          f"--web.listen-address=127.0.0.1:{self.port}"],
                         workdir / "prometheus.log")
        wait_until(self._ready, 30, 0.2, "Prometheus ready")

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return self.proc.poll() is not None and _raise(self.text_log())

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """``expr`` evaluated now, or at Unix time ``at`` (so that two queries compared in a
        test see the same samples)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=10)
        body: dict[str, Any] = r.json()
        return body

    def targets_up(self) -> bool:
        data = self.query("up")["data"]["result"]
        return bool(data) and all(s["value"][1] == "1" for s in data)

    def alerts(self) -> list[dict[str, Any]]:
        body = httpx.get(self.url + "/api/v1/alerts", timeout=10).json()
        alerts: list[dict[str, Any]] = body["data"]["alerts"]
        return alerts


def serve_exposition(render: Callable[[str], bytes | None]) -> ThreadingHTTPServer:
    """A loopback HTTP server (serving on a daemon thread) that answers ``GET path`` with
    ``render(path)`` as a Prometheus text exposition, or 404 when it returns None; the owner
    calls ``shutdown()``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            body = render(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _raise(log: str) -> bool:
    raise AssertionError("process exited:\n" + log[-3000:])
