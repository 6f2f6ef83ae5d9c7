"""Shared fixtures: real child processes to watch and a real agent process on loopback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

BUSY = "import time\nend = time.time() + {life}\nwhile time.time() < end: pass\n"
IDLE = "import time\ntime.sleep({life})\n"
#: One hot thread among several sleepers: the process total is ~1 core, the hottest thread too.
THREADED = """
import threading, time
end = time.time() + {life}
def spin():
    while time.time() < end: pass
def nap():
    while time.time() < end: time.sleep(0.05)
for f in [spin, nap, nap, nap]:
    threading.Thread(target=f, daemon=True).start()
time.sleep({life})
"""


class Procs:
    """Spawns bounded-lifetime Python children and kills them all at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, code: str, life: float = 60.0, *extra: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-c", code.format(life=life), *extra])
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    p.close()


class AgentProcess:
    """A real ``mrc-agent run`` subprocess on an ephemeral loopback port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mrc_agent.agent", "run", "--listen", "127.0.0.1:0", *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            env={**os.environ, **(env or {})}, cwd=REPO)
        self.log: list[str] = []
        self.port = 0
        deadline = time.monotonic() + 20
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"listening on http://[^ ]+:(\d+)/metrics", line)
            if m:
                self.port = int(m.group(1))
                break
        if not self.port:
            self.proc.kill()
            raise AssertionError("agent did not start: " + "".join(self.log))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(10)
        finally:
            self.proc.kill()


@pytest.fixture
def agent_factory() -> Iterator[type[AgentProcess]]:
    started: list[AgentProcess] = []

    class Factory(AgentProcess):
        def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
            super().__init__(*args, env=env)
            started.append(self)

    yield Factory
    for a in started:
        a.stop()


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text -> {(name, labels): value}, via prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def requests_by_outcome(url: str) -> Counter[str]:
    """``mrc_requests_total`` of the service at ``url``, summed by outcome."""
    import httpx

    m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return Counter({dict(labels)["outcome"]: int(v) for (name, labels), v in m.items()
                    if name == "mrc_requests_total"})


def read_http_response(sock: socket.socket, pending: bytes = b""
                       ) -> tuple[str, dict[str, str], bytes, bytes]:
    """One HTTP response off a raw socket (after ``pending``, bytes read before): its status
    line, headers (lower-case names), body by Content-Length, and what was read past it."""
    data = pending
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:n], rest[n:]


def socket_closed(sock: socket.socket, within: float = 3.0) -> bool:
    """Whether the peer closes ``sock`` (an end of stream or a reset) within ``within`` s."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.01) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(step)


def received_until(sock: socket.socket, deadline: float) -> bytes:
    """What ``sock`` receives before the monotonic ``deadline`` (or until the peer closes)."""
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
    return data


def response_statuses(data: bytes) -> list[int]:
    """The status of every HTTP/1.1 response in ``data`` (for bodies that hold no status
    line, such as /healthz's and /health's)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]


def series(metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> list[float]:
    want = set(labels.items())
    return [v for (n, ls), v in metrics.items() if n == name and want <= ls]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the reference service builds its embedded model: once per test session."""
    return tmp_path_factory.mktemp("mrc-cache")


def isolated_network() -> bool:
    """Whether this process sees loopback alone (a fresh ``unshare -n`` namespace)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that names a private or link-local address runs only where no packet can leave
    the machine; anywhere else it fails (never skips) and says how to run it."""
    if item.get_closest_marker("netns") is not None and not isolated_network():
        pytest.fail("this test names private or link-local addresses: run it in a network "
                    "namespace with loopback alone, as .ci/run does: unshare -n sh -c 'ip link "
                    "set lo up && python3 -m pytest -m netns tests'", pytrace=False)
