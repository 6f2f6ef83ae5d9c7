"""``mrc-agent proxy``'s relay against hostile and unusual traffic, on real sockets: what a relay
that parses bodies in protocol callbacks and hands bytes straight from one transport to the
other can newly get wrong. Request framing a lax server behind would read otherwise is refused
before any of it goes up; requests that arrive in one read with the body before them are
answered one by one, in order; interim answers, bodiless HEAD answers, answers cut mid-chunk,
close-delimited answers and HTTP/1.0 clients each end at the right byte; and a client that never
reads holds up its upstream, not the proxy's memory.

Each upstream here is written by hand: :class:`~tests.raw_upstream.RawUpstream` reads requests
as a lax server does, so a smuggled request shows up in its ``seen``; :class:`Scripted` runs a
script per connection and records every byte it received, for what RawUpstream cannot do
(answer before the body, stream for as long as it is read, record a request it cannot parse).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import generate_latest

from tests.conftest import parse_metrics, series, wait_until
from tests.integration.test_proxy_framing import _connect, _outcomes, named
from tests.openai_support import ProxyThread, chat, send_chat
from tests.raw_upstream import (
    AnswerReader,
    RawUpstream,
    Seen,
    _unchunk_prefix,
    chunked_answer,
    length_answer,
    serve_each,
    status_of,
)

#: A whole request that a lax server behind would read as a second one, if it got these bytes.
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
_EVENT = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
_USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'


class Wire:
    """One upstream connection as a :class:`Scripted` script sees it: what it reads is recorded
    on the upstream; ConnectionError when the proxy closed it."""

    def __init__(self, conn: socket.socket, up: Scripted) -> None:
        self.conn = conn
        self.up = up
        self.buf = b""

    def _more(self) -> None:
        data = self.conn.recv(65536)
        if not data:
            raise ConnectionError("the proxy closed the connection")
        with self.up.lock:
            self.up.received += data
        self.buf += data

    def head(self) -> bytes:
        """The next request head, its blank line included."""
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return head + b"\r\n\r\n"

    def body(self, head: bytes) -> bytes:
        """The body ``head`` declares with ``Content-Length``."""
        m = re.search(rb"(?im)^content-length: *(\d+)", head)
        n = int(m[1]) if m else 0
        while len(self.buf) < n:
            self._more()
        body, self.buf = self.buf[:n], self.buf[n:]
        return body

    def drain(self) -> None:
        """Read (and record) until the proxy closes the connection."""
        while True:
            self._more()

    def send(self, data: bytes) -> None:
        self.conn.sendall(data)
        with self.up.lock:
            self.up.sent += len(data)


class Scripted:
    """An upstream on loopback that runs ``script`` on each connection it accepts, in a thread
    of its own, recording every byte received, the bytes sent, and the connections accepted and
    ended (by the script, or by the proxy closing or resetting it)."""

    def __init__(self, script: Callable[[Wire], None]) -> None:
        self.script = script
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.received = bytearray()
        self.sent = 0
        self.accepted = 0
        self.ended = 0
        serve_each(self.sock, self, self._one)

    def _one(self, conn: socket.socket) -> None:
        try:
            # The proxy closing or resetting the connection ends the script: that is counted
            # in ``ended``, which is what the tests look at.
            with conn, contextlib.suppress(OSError):
                self.script(Wire(conn, self))
        finally:
            with self.lock:
                self.ended += 1

    def close(self) -> None:
        self.sock.close()


def _read_to_close(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything ``sock`` receives until the proxy closes it (a reset ends it too); fails
    the test when the connection is still open after ``timeout`` seconds."""
    sock.settimeout(timeout)
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(1 << 20):
            got += data
    return got


def _counted(p: ProxyThread) -> dict[str, float]:
    """The proxy's ``mrc_requests_total`` by outcome, now."""
    values = parse_metrics(generate_latest(p.metrics.registry).decode())
    return {dict(labels)["outcome"]: v for (name, labels), v in values.items()
            if name == "mrc_requests_total" and v}


def _split(answer: bytes) -> tuple[bytes, bytes]:
    """An answer's head (lowercased, without its blank line) and its body as received."""
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.lower(), body


def _metered_post(body: bytes, version: bytes = b"1.1") -> bytes:
    """A chat completions request whose body is framed by ``Content-Length``."""
    host = b"Host: x\r\n" if version == b"1.1" else b""
    return (b"POST /v1/chat/completions HTTP/" + version + b"\r\n" + host
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body)


# --- request framing that a lax server behind would read otherwise -------------------------------

_POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
_TAIL = b"5\r\nhello\r\n0\r\n\r\n" + SMUGGLED

#: Request heads refused before anything is forwarded: (the bytes, with a smuggled request in
#: the body that follows, and the status). RFC 9112 §6.1: a request whose last transfer coding
#: is not chunked cannot be framed and is a 400; a coding the proxy does not know ahead of
#: chunked is a 501.
REFUSED = {
    "two different content-lengths": (
        _POST + b"Content-Length: 5\r\nContent-Length: %d\r\n\r\nhello" % (5 + len(SMUGGLED))
        + SMUGGLED, 400),
    "a content-length list": (_POST + b"Content-Length: 5, %d\r\n\r\nhello" % (5 + len(SMUGGLED))
                              + SMUGGLED, 400),
    "bare LF line ends": (b"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Length: 5\n\n"
                          b"hello" + SMUGGLED, 400),
    "a bare LF ending one header": (_POST + b"Content-Length: 5\nX-A: 1\r\n\r\nhello" + SMUGGLED,
                                    400),
    "a bare CR in a value": (_POST + b"X-A: 1\rContent-Length: 5\r\n\r\nhello" + SMUGGLED, 400),
    "chunked, gzip": (_POST + b"Transfer-Encoding: chunked, gzip\r\n\r\n" + _TAIL, 400),
    "gzip alone": (_POST + b"Transfer-Encoding: gzip\r\n\r\n" + _TAIL, 400),
    "gzip, chunked": (_POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n" + _TAIL, 501),
    "transfer-encoding twice": (_POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: "
                                b"chunked\r\n\r\n" + _TAIL, 400),
}


@pytest.fixture
def pair() -> Iterator[tuple[RawUpstream, ProxyThread]]:
    """An upstream answering :func:`named` and a proxy to it."""
    up = RawUpstream(named)
    p = ProxyThread(up.url)
    yield up, p
    p.stop()
    up.close()


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_ambiguously_framed_request_is_refused_and_nothing_reaches_the_upstream(
        case: str, pair: tuple[RawUpstream, ProxyThread]) -> None:
    """Each of these is read one way by llhttp and another by some server behind; the proxy
    answers the status, closes the connection (so the bytes after the head are never read as
    a request) and counts the refusal."""
    up, p = pair
    raw, status = REFUSED[case]
    with _connect(p) as s:
        s.sendall(raw)
        answers = AnswerReader(s)
        head, body = answers.read()
        assert status_of(head) == status, head
        assert b"connection: close" in head.lower() and b'"error"' in body
        assert answers.read() == (b"", b""), "the connection must close after the refusal"
    with _connect(p) as s:  # a request after it: the upstream's first
        s.sendall(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        assert AnswerReader(s).read()[1] == b'{"for": "/next"}'
    assert [x.target for x in up.seen] == [b"/next"]
    # Counted before the refusal is written, so by now; by its status, as the meter counts.
    outcome = "client_error" if status < 500 else "error"
    assert _counted(p) == {outcome: 1.0}, "the refusal of a metered request was not counted"


#: Chunk size lines a strict parser refuses and a lax one reads as 5 (an overflow of 2**64 + 5,
#: a ``0x`` prefix, a sign), or as the largest size it holds.
BAD_SIZES = {"17 digits overflowing to 5": b"10000000000000005",
             "17 digits of f": b"fffffffffffffffff", "0x prefix": b"0x5", "negative": b"-5"}


@pytest.mark.parametrize("case", list(BAD_SIZES))
def test_a_malformed_chunk_size_in_a_request_ends_it_before_the_upstream_reads_past_it(
        case: str) -> None:
    """The head and a first good chunk have gone up when a broken size line arrives in one read
    with the rest of the body and a request behind it: nothing from that read reaches the
    upstream, whose connection is closed (a server takes that as an abort), the client's is
    closed without a success, and the request counts as the client's error."""
    up = Scripted(lambda wire: wire.drain())
    p = ProxyThread(up.url)
    try:
        with _connect(p) as s:
            s.sendall(_POST + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            wait_until(lambda: up.received.endswith(b"5\r\nhello\r\n"), timeout=5)
            forwarded = bytes(up.received)
            s.sendall(BAD_SIZES[case] + b"\r\nworld\r\n0\r\n\r\n" + SMUGGLED)
            got = _read_to_close(s)
        assert got == b"" or status_of(got.split(b"\r\n\r\n")[0]) == 400, got[:200]
        wait_until(lambda: up.ended == up.accepted == 1, timeout=5)
        assert bytes(up.received) == forwarded, "bytes past the broken size line went up"
        assert _outcomes(p, 1) == {"client_error": 1.0}
    finally:
        p.stop()
        up.close()


@pytest.mark.parametrize("last", [b"0\r\n\r\n", b"0;ext=1\r\nx-trailer: 1\r\n\r\n"],
                         ids=["last chunk", "last chunk with a trailer"])
def test_a_request_in_the_same_read_as_a_chunked_body_is_answered_as_its_own(
        last: bytes, pair: tuple[RawUpstream, ProxyThread]) -> None:
    """The bytes after the last chunk are the next request: it goes up as the proxy writes
    requests (its own Host, X-Forwarded-For), not as the tail of the first body, and gets its
    own answer after the first's."""
    up, p = pair
    with _connect(p) as s:
        s.sendall(b"POST /first HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"5\r\nhello\r\n" + last + b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = AnswerReader(s, timeout=5)
        assert answers.read()[1] == b'{"for": "/first"}'
        assert answers.read()[1] == b'{"for": "/second"}'
    assert [(x.method, x.target, x.body) for x in up.seen] == [
        (b"POST", b"/first", b"hello"), (b"GET", b"/second", b"")]
    second = up.seen[1]
    assert second.header(b"host") == [up.url.split("//")[1].encode()]
    assert second.header(b"x-forwarded-for") == [b"127.0.0.1"]
    assert up.accepted == 1


# --- requests pipelined behind a body ------------------------------------------------------------


def test_requests_sent_in_one_write_behind_a_body_are_answered_in_order(
        pair: tuple[RawUpstream, ProxyThread]) -> None:
    """A body framed by Content-Length, then a request without a body and one with a body, all
    in one write: the length relay must hand back exactly the bytes past the first body."""
    up, p = pair
    with _connect(p) as s:
        s.sendall(b"POST /one HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nfirst"
                  b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /three HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nthird")
        answers = AnswerReader(s, timeout=5)
        for target in (b"/one", b"/two", b"/three"):
            head, body = answers.read()
            assert status_of(head) == 200 and body == b'{"for": "%s"}' % target
    assert [(x.method, x.target, x.body) for x in up.seen] == [
        (b"POST", b"/one", b"first"), (b"GET", b"/two", b""), (b"POST", b"/three", b"third")]
    assert all(x.header(b"x-forwarded-for") == [b"127.0.0.1"] for x in up.seen)
    assert up.accepted == 1


# --- interim answers -----------------------------------------------------------------------------


def test_interim_answers_pass_before_the_final_one_which_alone_is_counted() -> None:
    """100 Continue and 103 Early Hints (with its header) reach the client byte for byte ahead
    of the 200 and its body; the meter counts one request, with the 200's outcome, and the
    connection goes on with the next request."""
    final = length_answer(b'{"choices": []}')
    answer = (b"HTTP/1.1 100 Continue\r\n\r\n"
              b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n" + final)
    up = RawUpstream(answer)
    p = ProxyThread(up.url)
    try:
        with _connect(p) as s:
            for _ in range(2):
                send_chat(s, chat("x"))
                s.settimeout(5)
                got = b""
                while len(got) < len(answer):
                    data = s.recv(65536)
                    assert data, got
                    got += data
                assert got == answer
        assert _outcomes(p, 2) == {"ok": 2.0}
        values = parse_metrics(generate_latest(p.metrics.registry).decode())
        assert sum(series(values, "mrc_request_duration_seconds_count")) == 2.0
        assert up.accepted == 1
    finally:
        p.stop()
        up.close()


def _continue_then_echo(wire: Wire) -> None:
    """Answer 100 Continue to a request that expects it, then echo its body."""
    head = wire.head()
    if b"expect: 100-continue" in head.lower():
        wire.send(b"HTTP/1.1 100 Continue\r\n\r\n")
    wire.send(length_answer(wire.body(head)))


def test_a_client_expecting_100_continue_gets_it_before_sending_its_body() -> None:
    """The head goes up alone, so the upstream's 100 reaches a client that waits for it (a
    relay that held the head back for a first body byte would leave both waiting)."""
    up = Scripted(_continue_then_echo)
    p = ProxyThread(up.url)
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    try:
        with _connect(p) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue"
                      b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                      % len(raw))
            answers = AnswerReader(s, timeout=5)
            head, _ = answers.read()
            assert head == b"HTTP/1.1 100 Continue"
            s.sendall(raw)
            head, body = answers.read()
            assert status_of(head) == 200 and body == raw
        assert _outcomes(p, 1) == {"ok": 1.0}
    finally:
        p.stop()
        up.close()


# --- answers without a body ----------------------------------------------------------------------


def test_a_head_answer_with_a_content_length_has_no_body_and_the_connection_goes_on(
        pair: tuple[RawUpstream, ProxyThread]) -> None:
    """The length is passed on as the size a GET would have had; the proxy waits for none of
    it, and the next request on the same connection gets its own answer over the same
    upstream connection."""
    up, p = pair

    def answer(seen: Seen) -> bytes:
        if seen.method == b"HEAD":
            return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: 1000\r\n\r\n")
        return named(seen)

    up.answer = answer
    with _connect(p) as s:
        answers = AnswerReader(s, timeout=5)
        s.sendall(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _ = answers.read(head_request=True)
        assert status_of(head) == 200 and b"content-length: 1000" in head.lower()
        s.sendall(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = answers.read()
        assert status_of(head) == 200 and body == b'{"for": "/after"}'
        assert answers.buf == b""
    assert [x.target for x in up.seen] == [b"/h", b"/after"]
    assert up.accepted == 1


# --- an upstream that fails mid-stream -----------------------------------------------------------

#: Where the upstream closes, after one whole event.
CUTS = {"inside a payload": b"20\r\npartial", "inside a size line": b"2",
        "between a size line's CR and LF": b"20\r", "at a chunk boundary": b""}


@pytest.mark.parametrize("case", list(CUTS))
def test_an_upstream_that_closes_mid_chunk_cuts_the_client_and_is_not_reused(case: str) -> None:
    """What had arrived passes as it came, then the client's connection closes with no last
    chunk, so no client reads the answer as complete; the meter counts the upstream's error
    and the next request goes up over a new connection."""
    answer = chunked_answer(_EVENT, tail=CUTS[case])
    up = RawUpstream(lambda seen: answer if seen.target == b"/v1/chat/completions"
                     else named(seen), close_after=True)
    p = ProxyThread(up.url)
    try:
        with _connect(p) as s:
            send_chat(s, chat("x", stream=True))
            head, body = _split(_read_to_close(s))
        assert status_of(head) == 200 and b"transfer-encoding: chunked" in head
        sent = answer.partition(b"\r\n\r\n")[2]
        assert body.startswith(b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)) and sent.startswith(body)
        with pytest.raises(ValueError):
            _unchunk_prefix(body)  # the chunked body is not whole
        assert _outcomes(p, 1) == {"error": 1.0}
        _next_on_a_new_connection(p, up)
    finally:
        p.stop()
        up.close()


def _next_on_a_new_connection(p: ProxyThread, up: RawUpstream) -> None:
    """The next request is answered, over a second upstream connection: the first one, whose
    answer did not end at a message boundary, was not reused."""
    with _connect(p) as s:
        s.sendall(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        assert AnswerReader(s).read()[1] == b'{"for": "/next"}'
    assert up.accepted == 2


# --- back-pressure -------------------------------------------------------------------------------

_LONG = 64 << 20


def _long_answer(wire: Wire) -> None:
    """Answer with a 64 MiB body framed by Content-Length, written 64 KiB at a time for as long
    as the proxy reads it."""
    head = wire.head()
    wire.body(head)
    wire.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
              % _LONG)
    piece = b"x" * 65536
    for _ in range(_LONG // len(piece)):
        wire.send(piece)


def test_a_client_that_never_reads_holds_up_its_upstream_and_leaving_closes_it() -> None:
    """A length-framed answer (the chunked stream is covered in test_meter_proxy) to a client
    that sends its request and never reads: the upstream's writes stall once the sockets'
    buffers are full, with most of the answer unsent, so the proxy holds no more than a read of
    it; when the client goes, the proxy closes the upstream connection and counts the client
    leaving."""
    up = Scripted(_long_answer)
    p = ProxyThread(up.url)
    try:
        s = _connect(p)
        send_chat(s, chat("x"))
        wait_until(lambda: up.sent > 0, timeout=5)
        deadline = time.monotonic() + 10
        last = -1
        while up.sent != last:  # until the upstream is blocked
            assert time.monotonic() < deadline, "the upstream was never held up"
            last = up.sent
            time.sleep(0.3)
        # Loopback buffers on the way hold some megabytes; the answer is 64 MiB.
        assert up.sent < _LONG // 2, up.sent
        s.close()
        wait_until(lambda: up.ended == 1, timeout=5)
        assert up.sent < _LONG
        assert _outcomes(p, 1) == {"client_error": 1.0}
    finally:
        p.stop()
        up.close()


# --- how an answer ends --------------------------------------------------------------------------


def test_an_http_1_0_client_gets_a_chunked_answer_dechunked_and_closed() -> None:
    """An HTTP/1.0 client cannot read chunks: it gets the payloads alone, byte for byte (a big
    chunk, an extension and a trailer on the way), no transfer-encoding, and the end of the
    connection as the end of the answer; the upstream connection, at a message boundary, is
    kept for the next request."""
    big = b"data: " + b"y" * 300_000 + b"\n\n"
    answer = chunked_answer(_EVENT, big, _USAGE, tail=b"0\r\nx-trailer: 1\r\n\r\n")
    answer = answer.replace(b"%x\r\n" % len(_EVENT), b"%x;name=value\r\n" % len(_EVENT), 1)
    up = RawUpstream(answer)
    p = ProxyThread(up.url)
    try:
        with _connect(p) as s:
            s.sendall(_metered_post(b'{"model": "m", "stream": true}', version=b"1.0"))
            head, body = _split(_read_to_close(s))
        assert head.startswith(b"http/1.1 200 ")
        assert b"transfer-encoding" not in head and b"connection: close" in head
        assert body == _EVENT + big + _USAGE
        assert _outcomes(p, 1) == {"ok": 1.0}
        values = parse_metrics(generate_latest(p.metrics.registry).decode())
        assert series(values, "mrc_generation_tokens_total") == [2.0]
        wait_until(lambda: len(p.proxy._pool) == 1, timeout=5)
    finally:
        p.stop()
        up.close()


def test_a_close_delimited_answer_reaches_the_client_whole_and_is_not_pooled() -> None:
    """No Content-Length, no Transfer-Encoding: the upstream's close ends the answer (an ``ok``,
    not an error), so the client's connection closes after all of it and the upstream
    connection is never offered to the next request."""
    body = b'{"pad": "' + b"z" * (1 << 20) + b'"}'
    up = RawUpstream(lambda seen: (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n"
                                   + body) if seen.target == b"/v1/chat/completions"
                     else named(seen), close_after=True)
    p = ProxyThread(up.url)
    try:
        with _connect(p) as s:
            s.sendall(_metered_post(b'{"model": "m"}'))
            head, got = _split(_read_to_close(s))
        assert head.startswith(b"http/1.1 200 ") and b"connection: close" in head
        assert b"content-length" not in head and b"transfer-encoding" not in head
        assert got == body
        assert _outcomes(p, 1) == {"ok": 1.0}
        assert not p.proxy._pool
        _next_on_a_new_connection(p, up)
    finally:
        p.stop()
        up.close()
