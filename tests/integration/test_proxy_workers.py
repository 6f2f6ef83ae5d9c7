"""``mrc-agent proxy --workers 2`` as an operator runs it: a supervisor and two worker processes
on one port (``SO_REUSEPORT``) in front of an OpenAI-shaped server on loopback. ``/metrics`` on
the supervisor's port must count every worker's requests exactly once, with the families of one
process; a signal stops every process; a worker that dies is replaced and its counts kept."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from mrc_agent.exporters.instrumentation import MRCMetrics
from tests.conftest import parse_metrics, series, wait_until
from tests.openai_support import FakeEngine, ServerThread, chat
from tests.support import free_port

#: Starting three Python processes on a busy two-core machine can take a while.
START_S = 180.0


class Supervisor:
    """``mrc-agent proxy --workers 2`` in a child process, its log in a file."""

    def __init__(self, tmp: Path, upstream: str, listen: str, env: dict[str, str] | None = None,
                 workers: int = 2) -> None:
        self.log = tmp / "proxy.log"
        self.metrics_port = free_port()
        self.workers = workers
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mrc_agent.agent", "proxy", "--listen", listen,
             "--upstream", upstream, "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
             "--workers", str(workers), "--drain-timeout", "5"],
            stderr=self.log.open("w"), env=env)
        wait_until(lambda: self._alive() and len(self.ready()) >= workers, timeout=START_S,
                   step=0.1)
        found = re.search(r"proxying 127\.0\.0\.1:(\d+) ", self.text())
        assert found, self.text()
        self.url = f"http://127.0.0.1:{found.group(1)}/v1/chat/completions"

    def _alive(self) -> bool:
        assert self.proc.poll() is None, self.text()
        return True

    def text(self) -> str:
        return self.log.read_text()

    def ready(self) -> list[int]:
        """The workers that said they were ready, in order."""
        return [int(p) for p in re.findall(r"worker (\d+) ready", self.text())]

    def children(self) -> set[int]:
        found = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return {int(p) for p in found.split()}

    def scrape(self) -> str:
        r = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30)
        assert r.status_code == 200
        return r.text

    def send(self, n: int) -> None:
        """``n`` requests, each on a connection of its own: the kernel picks a worker for each."""
        for i in range(n):
            r = httpx.post(self.url, json=chat("q" * 60, stream=bool(i % 2)), timeout=60)
            assert r.status_code == 200

    def total(self) -> float:
        return sum(series(parse_metrics(self.scrape()), "mrc_requests_total"))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    """Every supervisor a test starts is stopped, whatever the test's fate."""
    made: list[Supervisor] = []
    yield made
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(30)


def _gone(pid: int) -> bool:
    """The process is no more (or only a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _worker_requests(prom: Path, pid: int) -> float:
    """``mrc_requests_total`` as one worker wrote it, from its own memory-mapped file."""
    total = 0.0
    for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(
            str(prom / f"counter_{pid}.db")):
        if json.loads(key)[1] == "mrc_requests_total":
            total += value
    return total


def _families(text: str) -> list[str]:
    return [f.name for f in text_string_to_metric_families(text)]


def _types(text: str) -> list[str]:
    """The names of the ``# TYPE`` lines: one per family declared."""
    return [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]


def test_two_workers_share_the_port_and_their_counts_merge(
        engine: tuple[FakeEngine, ServerThread], tmp_path: Path,
        supervisors: list[Supervisor]) -> None:
    prom = tmp_path / "prom"  # the user's own directory: kept, and readable per worker
    env = {**_environ(), "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    sup = Supervisor(tmp_path, engine[1].url, "127.0.0.1:0", env)  # port 0: the kernel's pick
    supervisors.append(sup)
    workers = sup.children()
    assert len(workers) == 2 and workers == set(sup.ready())
    n = 40
    sup.send(n)
    wait_until(lambda: sup.total() == n, timeout=30, step=0.1)
    text = sup.scrape()
    values = parse_metrics(text)
    assert sum(series(values, "mrc_request_duration_seconds_count")) == n
    assert sum(series(values, "mrc_time_to_first_token_seconds_count")) == n // 2
    assert series(values, "mrc_requests_in_flight") == [0.0]
    per_worker = {pid: _worker_requests(prom, pid) for pid in workers}
    assert sum(per_worker.values()) == n
    # 40 connections all hashed to one worker: about one chance in 2**39.
    assert all(v > 0 for v in per_worker.values()), per_worker
    # The families of one process, each declared once.
    one = generate_latest(MRCMetrics(registry=CollectorRegistry(),
                                     resolution_unknown=True).registry).decode()
    assert sorted(_families(text)) == sorted(_families(one))
    assert len(_types(text)) == len(set(_types(text)))
    assert sorted(_types(text)) == sorted(_types(one))
    promtool = shutil.which("promtool")
    assert promtool, "promtool not on PATH: install Debian's prometheus package"
    lint = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                          capture_output=True, timeout=30)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), (
        lint.stdout.decode() + lint.stderr.decode())

    assert sup.stop() == 0, sup.text()
    wait_until(lambda: all(_gone(pid) for pid in workers), timeout=30, step=0.1)
    assert "exited unexpectedly" not in sup.text()
    assert prom.is_dir()  # the user's directory stays


def test_a_killed_worker_is_replaced_and_its_counts_kept(
        engine: tuple[FakeEngine, ServerThread], tmp_path: Path,
        supervisors: list[Supervisor]) -> None:
    sup = Supervisor(tmp_path, engine[1].url, f"127.0.0.1:{free_port()}", _environ())
    supervisors.append(sup)
    workers = sup.children()
    victim = min(workers)
    prom = Path(_environ_of(victim)["PROMETHEUS_MULTIPROC_DIR"])  # the private directory
    assert prom.is_dir()
    sup.send(6)
    wait_until(lambda: sup.total() == 6, timeout=30, step=0.1)

    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(sup.ready()) == 3, timeout=START_S, step=0.1)
    assert f"worker {victim} exited unexpectedly (killed by SIGKILL)" in sup.text()
    now = sup.children()
    assert len(now) == 2 and victim not in now and (workers - {victim}) <= now
    sup.send(10)
    wait_until(lambda: sup.total() == 16, timeout=30, step=0.1)  # the victim's 6 included
    assert series(parse_metrics(sup.scrape()), "mrc_requests_in_flight") == [0.0]

    assert sup.stop() == 0, sup.text()
    wait_until(lambda: all(_gone(pid) for pid in now), timeout=30, step=0.1)
    assert not prom.exists()  # the private directory is removed at exit


@pytest.mark.parametrize("workers", ["0", "-2"])
def test_fewer_than_one_worker_is_refused(workers: str) -> None:
    bad = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "proxy", "--listen",
                          "127.0.0.1:1", "--upstream", "http://127.0.0.1:2",
                          "--metrics-listen", "127.0.0.1:3", "--workers", workers],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert f"--workers {workers} must be at least 1" in bad.stderr


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.upper() != "PROMETHEUS_MULTIPROC_DIR"}


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)
