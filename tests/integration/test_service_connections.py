"""The reference service's connections: how long a client may take to send a request head or
a body, how many connections it holds before new requests get 503, what a client that sends
its whole oversized body before reading (``urllib.request``) gets back, and what the log says
when a client leaves mid-request. A real uvicorn server on loopback (``python -m
reference_service``, through :class:`tests.integration.test_service.Service`), real sockets.

Deadlines are configured small (2 s) and waited for generously (30 s): a test asserts that a
connection is closed, never how fast. The clients here sleep between their bytes, so none of
them needs a CPU core.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mrc_agent.reference_service.__main__ import main as service_main
from mrc_agent.reference_service.loadgen import make_photo
from mrc_agent.reference_service.middleware import CLIENT_CLOSED, BodyLimit
from tests.conftest import (
    read_http_response,
    received_until,
    requests_by_outcome,
    response_statuses,
)
from tests.integration.test_service import Service

MAX_IMAGE = 2 * 1024 * 1024
#: The service's deadlines in these tests, and how long a test waits for one to act.
DEADLINE_S = 2
WAIT_S = 30.0
#: Far past the body cap (about 2.9 MB for a 2 MiB image), under the drain bound (64 MiB).
BIG = 40 * 1000 * 1000


@pytest.fixture(scope="module")
def service(cache_dir: Path) -> Iterator[Service]:
    svc = Service(cache_dir, "--max-image-bytes", str(MAX_IMAGE),
                  "--header-timeout", str(DEADLINE_S), "--body-timeout", str(DEADLINE_S),
                  "--keep-alive-timeout", str(DEADLINE_S))
    yield svc
    svc.stop()


def _connect(service: Service) -> socket.socket:
    return socket.create_connection(("127.0.0.1", service.port), timeout=WAIT_S)


def _closed_by_server(sock: socket.socket, drip: bytes = b"", every_s: float = 0.5) -> bytes:
    """Wait up to WAIT_S for the server to close ``sock``, sending ``drip`` one byte every
    ``every_s`` meanwhile; returns what the server sent. Fails if it is still open."""
    deadline = time.monotonic() + WAIT_S
    got = b""
    while time.monotonic() < deadline:
        sock.settimeout(every_s)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if drip:
                byte, drip = drip[:1], drip[1:]
                try:
                    sock.sendall(byte)
                except (BrokenPipeError, ConnectionResetError):
                    return got
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the server still holds the connection after {WAIT_S} s "
                         f"(received {got!r})")


def _read_response(sock: socket.socket) -> tuple[str, dict[str, str], bytes]:
    """The first response on ``sock``, raw: its status line (a 100 Continue is not skipped),
    headers and body."""
    sock.settimeout(WAIT_S)
    status, headers, body, _ = read_http_response(sock)
    return status, headers, body


def _wait_for(what: str, check: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.2)


def _image_json(prompt: str = "what is this?") -> bytes:
    image = base64.b64encode(make_photo(64, 48, 5)).decode()
    return json.dumps({"image": image, "text_prompt": prompt, "max_new_tokens": 2}).encode()


def _head(path: str, length: int, *extra: str,
          content_type: str = "application/json") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}",
             f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# --- 1. deadlines and the connection cap ---

def test_a_connection_that_sends_nothing_is_closed(service: Service) -> None:
    with _connect(service) as s:
        assert _closed_by_server(s) == b""


def test_a_request_head_sent_a_byte_at_a_time_is_closed(service: Service) -> None:
    """Slowloris: each byte would reset an idle timer; the head never completes."""
    with _connect(service) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _closed_by_server(s, drip=b"X-Slow: " + b"a" * 200) == b""


def test_a_head_dripped_after_a_response_is_closed(service: Service) -> None:
    """The deadline starts again after each response on a keep-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=WAIT_S)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and r.read()
        assert conn.sock is not None  # kept alive
        assert _closed_by_server(conn.sock, drip=b"GET /health HTTP/1.1\r\nX-Slow: " +
                                 b"a" * 200) == b""
    finally:
        conn.close()


def test_an_idle_keep_alive_connection_is_closed(service: Service) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=WAIT_S)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read()
        assert conn.sock is not None
        assert _closed_by_server(conn.sock) == b""
    finally:
        conn.close()


def test_a_stalled_body_gets_408_and_a_close(service: Service) -> None:
    before = requests_by_outcome(service.url)
    with _connect(service) as s:
        s.sendall(_head("/mrc", 1000) + b'{"image": "')
        status, headers, body = _read_response(s)
        assert status.startswith("HTTP/1.1 408"), status
        assert headers["connection"] == "close"
        err = json.loads(body)["error"]
        assert err["code"] == "request_timeout" and "stalled" in err["message"]
        assert _closed_by_server(s) == b""
    # Counted once, as the client's doing.
    _wait_for("the stalled request counted",
              lambda: requests_by_outcome(service.url)["client_error"]
              == before["client_error"] + 1)
    assert requests_by_outcome(service.url)["error"] == before["error"]


def test_a_slow_body_that_keeps_moving_is_served(service: Service) -> None:
    """The body deadline is between chunks, not for the whole body."""
    raw = _image_json("slow?")
    step = -(-len(raw) // 6)
    with _connect(service) as s:
        s.sendall(_head("/mrc", len(raw)))
        for at in range(0, len(raw), step):
            # Six gaps of 0.6 s: longer than the deadline in all, each well under it.
            time.sleep(0.6)
            s.sendall(raw[at:at + step])
        status, _, body = _read_response(s)
    assert status.startswith("HTTP/1.1 200"), (status, body)
    assert json.loads(body)["output_tokens"] >= 1


def test_connections_past_the_cap_get_503(cache_dir: Path) -> None:
    cap = 8
    svc = Service(cache_dir, "--max-connections", str(cap), "--header-timeout", "600")
    held: list[socket.socket] = []
    try:
        held = [_connect(svc) for _ in range(cap)]

        def refused() -> bool:
            r = httpx.get(svc.url + "/health", timeout=10)
            return r.status_code == 503 and r.headers["connection"] == "close"

        _wait_for(f"a 503 with {cap} connections held", refused)
        for s in held:
            s.close()
        _wait_for("a 200 once they are closed",
                  lambda: httpx.get(svc.url + "/health", timeout=10).status_code == 200)
    finally:
        for s in held:
            s.close()
        svc.stop()


def test_the_workers_path_has_the_same_deadlines(cache_dir: Path) -> None:
    svc = Service(cache_dir, "--workers", "2", "--header-timeout", str(DEADLINE_S))
    try:
        for _ in range(2):  # whichever worker accepts it
            with _connect(svc) as s:
                s.sendall(b"GET /health HTTP/1.1\r\n")
                assert _closed_by_server(s, drip=b"X-Slow: " + b"a" * 200) == b""
        assert httpx.get(svc.url + "/health", timeout=10).status_code == 200
    finally:
        svc.stop()


@pytest.mark.parametrize(("flag", "value"), [
    ("--header-timeout", "0"), ("--body-timeout", "-1"), ("--keep-alive-timeout", "nan"),
    ("--header-timeout", "inf"), ("--body-timeout", "86400"), ("--max-connections", "0"),
    ("--pace-rate", "0"), ("--pace-rate", "nan"), ("--pace-burst", "0"),
])
def test_out_of_range_connection_flags_are_one_line_and_exit_2(
        flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert service_main([flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "out of range" in err, err


def test_a_connection_flag_that_is_not_a_number_exits_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        service_main(["--body-timeout", "soon"])
    assert stop.value.code == 2
    assert "--body-timeout" in capsys.readouterr().err




def test_a_connection_looping_on_requests_is_paced_never_refused(cache_dir: Path) -> None:
    """Per connection: 1 request a second after a burst of 3. The wait between two requests
    (1 s) is longer than the header timeout (0.5 s): the head clock starts after the wait, so
    the paced connection is served, not closed. A second connection from the same address
    has a budget of its own (behind a proxy, one address is many users)."""
    rate, burst, window = 1.0, 3, 1.5
    svc = Service(cache_dir, "--pace-rate", str(rate), "--pace-burst", str(burst),
                  "--header-timeout", "0.5", "--keep-alive-timeout", "0.5")
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    try:
        start = time.monotonic()
        with _connect(svc) as s:
            s.sendall(health * 8)  # pipelined: as fast as a client can send them
            got = received_until(s, start + window)
            # At most the burst, the rate over the window and one at its edge (+1 slack).
            assert burst <= len(response_statuses(got)) <= burst + rate * window + 2, got
            with _connect(svc) as other:
                other.sendall(health * burst)
                theirs = b""
                while len(response_statuses(theirs)) < burst:
                    more = received_until(other, time.monotonic() + WAIT_S)
                    assert more, theirs
                    theirs += more
            assert response_statuses(theirs) == [200] * burst
            got += received_until(s, time.monotonic() + 0.1)
            assert len(response_statuses(got)) < 8  # the first connection is still waiting its turn
            deadline = time.monotonic() + WAIT_S
            while len(response_statuses(got)) < 8 and time.monotonic() < deadline:
                got += received_until(s, min(deadline, time.monotonic() + 1))
            assert response_statuses(got) == [200] * 8  # every one answered, none refused
    finally:
        svc.stop()


# --- 2. an oversized body: the client reads the 413 ---

def _assert_413(status: int, body: bytes) -> None:
    assert status == 413, body
    assert json.loads(body)["error"]["code"] == "image_too_large"


def test_urllib_sending_40_mb_reads_the_413(service: Service) -> None:
    """urllib sends the whole body before it reads: an unread body used to mean a reset."""
    before = requests_by_outcome(service.url)
    req = urllib.request.Request(service.url + "/mrc/upload", data=b"\0" * BIG,
                                 headers={"Content-Type": "multipart/form-data; boundary=x"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=WAIT_S)
    _assert_413(refused.value.code, refused.value.read())
    assert requests_by_outcome(service.url)["client_error"] == before["client_error"] + 1


def test_a_chunked_body_past_the_cap_sent_whole_reads_the_413(service: Service) -> None:
    before = requests_by_outcome(service.url)

    def chunks() -> Iterator[bytes]:
        for _ in range(BIG // (1 << 20)):
            yield b"\xff" * (1 << 20)

    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=WAIT_S)
    try:
        conn.request("POST", "/mrc", body=chunks(), encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        _assert_413(r.status, r.read())
    finally:
        conn.close()
    assert requests_by_outcome(service.url)["client_error"] == before["client_error"] + 1


def test_expect_100_continue_gets_the_413_without_sending_the_body(service: Service) -> None:
    """10 GB declared, nothing sent: the answer comes at once, no 100 Continue first."""
    before = requests_by_outcome(service.url)
    with _connect(service) as s:
        s.sendall(_head("/mrc/upload", 10 * 1000**3, "Expect: 100-continue",
                        content_type="multipart/form-data; boundary=x"))
        status, headers, body = _read_response(s)
        assert status.startswith("HTTP/1.1 413"), status
        _assert_413(413, body)
        assert headers["connection"] == "close"
        assert _closed_by_server(s) == b""
    assert requests_by_outcome(service.url)["client_error"] == before["client_error"] + 1


# --- 3. a client that leaves: one line, no traceback ---

def _rst(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a killed client's kernel does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def test_clients_that_leave_mid_request_leave_one_line_and_no_traceback(
        service: Service) -> None:
    gone = "the connection closed before the request body was complete"
    lines_before = service.text_log().count(gone)
    before = requests_by_outcome(service.url)
    raw = _image_json("gone?")
    multipart = (_head("/mrc/upload", 100_000, content_type="multipart/form-data; boundary=x")
                 + b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.jpg"'
                 b"\r\n\r\n" + b"\xff" * 3000)
    # Half a body, then a close: the server reads what came before the FIN, so these two
    # surely reach the application. Then the same with a reset (RST), which may overtake
    # the bytes before it; a whole request reset before its answer; and a /metrics request
    # reset before its answer.
    sent = [(_head("/mrc", len(raw)) + raw[: len(raw) // 2], socket.socket.close),
            (multipart, socket.socket.close),
            (_head("/mrc", len(raw)) + raw[: len(raw) // 2], _rst),
            (_head("/mrc", len(raw)) + raw, _rst),
            (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", _rst)]
    for data, close in sent:
        s = _connect(service)
        s.sendall(data)
        time.sleep(0.3)
        close(s)

    def settled() -> bool:  # true before the fix too (then as errors), so it can only wait
        now = requests_by_outcome(service.url)
        return (now["client_error"] + now["error"]
                >= before["client_error"] + before["error"] + 2)

    _wait_for("the two half bodies counted", settled)
    time.sleep(1.0)  # the reset requests: whatever they cause has been logged by now
    assert httpx.get(service.url + "/health", timeout=10).status_code == 200
    log = service.text_log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert log.count(gone) >= lines_before + 1, log
    after = requests_by_outcome(service.url)
    assert after["error"] == before["error"], (before, after)


def test_the_disconnect_traceback_is_there_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """BodyLimit alone, around an app that meets a disconnect as Starlette does."""
    from starlette.requests import ClientDisconnect, Request

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await Request(scope, receive).body()

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        raise AssertionError(f"nobody to answer: {message}")

    refused: list[tuple[str, int]] = []
    limit = BodyLimit(app, max_bytes=100, on_refuse=lambda p, s: refused.append((p, s)))
    scope = {"type": "http", "method": "POST", "path": "/mrc", "headers": []}
    for level, traceback in ((logging.INFO, False), (logging.DEBUG, True)):
        caplog.clear()
        with caplog.at_level(level, logger="mrc_agent.reference_service.middleware"):
            asyncio.run(limit(scope, receive, send))
        (record,) = [r for r in caplog.records
                     if r.name == "mrc_agent.reference_service.middleware"]
        assert record.levelno == logging.INFO
        exc_info = record.exc_info if isinstance(record.exc_info, tuple) else None
        assert (exc_info is not None and exc_info[0] is ClientDisconnect) == traceback
    assert refused == [("/mrc", CLIENT_CLOSED)] * 2
