"""``mrc-agent proxy``'s parts that need no socket, called directly: the address rule
(:func:`split_hostport`), the open-file limit (:func:`descriptors_for`), the event loop it runs
on (:func:`run_loop`), the error answers it writes itself, head parsing details
(:class:`MessageHead`, :class:`BadHead`), the chunk size line, the relay's chunk feeder driven
with a body split at every position (what is written after each piece, the last chunk, the
trailers, the 64 KiB bounds, the bytes past the end), the read holds of a connection, the
lingering close of a refused client. Transports are stand-ins that record what they are asked to do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, cast

import httptools
import pytest

from mrc_agent.agent.tools import proxy_http
from mrc_agent.agent.tools.proxy import ClientConn, Proxy, run_loop
from mrc_agent.agent.tools.proxy_http import (
    BadHead,
    MessageHead,
    ProxyError,
    Upstream,
    descriptors_for,
    error_body,
    parse_response,
    raw_error,
    split_hostport,
)
from mrc_agent.agent.tools.proxy_upstream import (
    BACKPRESSURE,
    FULL,
    MAX_HEAD,
    ClientGone,
    Relay,
    Side,
    UpstreamConn,
    UpstreamFailed,
    chunk_size,
)
from mrc_agent.exporters.instrumentation.metrics import MRCMetrics


class FakeTransport:
    """A transport that records writes, read pauses and half-closes."""

    def __init__(self, closing: bool = False, eof_error: Exception | None = None,
                 can_eof: bool = True) -> None:
        self.written = bytearray()
        self.closing = closing
        self.paused = self.resumed = self.eofs = 0
        self.eof_error = eof_error
        self.can_eof = can_eof

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.resumed += 1

    def can_write_eof(self) -> bool:
        return self.can_eof

    def write_eof(self) -> None:
        self.eofs += 1
        if self.eof_error is not None:
            raise self.eof_error

    def close(self) -> None:
        self.closing = True


def _attach(side: Side, transport: FakeTransport) -> None:
    side.transport = cast(asyncio.Transport, transport)


# --- addresses and limits ------------------------------------------------------------------


@pytest.mark.parametrize(("value", "want"), [
    ("127.0.0.1:8080", ("127.0.0.1", 8080)),
    ("localhost:0", ("localhost", 0)),
    ("h:65535", ("h", 65535)),
    ("[::1]:9000", ("::1", 9000)),
    ("[::]:1", ("::", 1)),
    ("XboX:80", ("XboX", 80)),
], ids=["v4", "port-0", "top-port", "v6-bracketed", "v6-any", "host-edged-with-x"])
def test_an_address_splits_at_its_last_colon(value: str, want: tuple[str, int]) -> None:
    assert split_hostport(value, "--listen") == want


@pytest.mark.parametrize("value", [
    "8080", "host", ":8080", "host:", "host:http", "host:-1", "host:65536", "host:99999",
    "host:8 0",
], ids=["no-host", "no-port", "empty-host", "empty-port", "named-port", "negative",
        "just-past-top", "far-past-top", "blank-in-port"])
def test_an_address_that_is_not_host_colon_port_is_refused_naming_the_flag(value: str) -> None:
    with pytest.raises(ProxyError) as e:
        split_hostport(value, "--listen")
    assert str(e.value) == f"--listen {value!r} is not HOST:PORT"


INF = -7  # a stand-in for RLIM_INFINITY, unlike any real count


class FakeLimits:
    """``resource`` as :func:`descriptors_for` sees it: one soft and hard limit."""

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = INF

    def __init__(self, soft: int, hard: int, refuse: type[Exception] | None = None) -> None:
        self.soft, self.hard, self.refuse = soft, hard, refuse
        self.set: list[tuple[int, tuple[int, int]]] = []

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.soft, self.hard

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        self.set.append((which, limits))
        if self.refuse is not None:
            raise self.refuse("refused")
        self.soft = limits[0]


# 10 connections and a pool of 6 need 2 * 10 + 6 + 64 = 90 descriptors.
@pytest.mark.parametrize(("soft", "hard", "refuse", "raised_to", "warned"), [
    (90, 1000, None, None, None),
    (89, 1000, None, 90, None),
    (89, INF, None, 90, None),
    (50, 70, None, 70, 70),
    (50, 90, None, 90, None),
    (INF, INF, None, None, None),
    (50, 1000, ValueError, 90, 50),
    (50, 1000, OSError, 90, 50),
], ids=["at-need", "one-short", "hard-unlimited", "hard-below-need", "hard-at-need",
        "soft-unlimited", "refused-valueerror", "refused-oserror"])
def test_the_open_file_limit_is_raised_toward_what_the_connections_need(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, soft: int,
        hard: int, refuse: type[Exception] | None, raised_to: int | None,
        warned: int | None) -> None:
    limits = FakeLimits(soft, hard, refuse)
    monkeypatch.setattr(proxy_http, "resource", limits)
    with caplog.at_level(logging.WARNING, logger=proxy_http.__name__):
        descriptors_for(10, 6)
    want_set = [] if raised_to is None else [(FakeLimits.RLIMIT_NOFILE, (raised_to, hard))]
    assert limits.set == want_set
    messages = [r.getMessage() for r in caplog.records if r.name == proxy_http.__name__]
    assert messages == ([] if warned is None else [
        f"open-file limit {warned} is below the 90 that --max-connections 10 needs"])


# --- the event loop ------------------------------------------------------------------------


async def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_the_proxy_runs_on_uvloop_when_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert run_loop(_loop_kind()) == "uvloop"


def test_without_uvloop_the_proxy_runs_on_asyncios_own_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert run_loop(_loop_kind()) == "asyncio"


def test_before_python_3_11_the_proxy_runs_on_asyncios_own_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(asyncio, "Runner", raising=False)  # Python 3.10 has no Runner
    assert run_loop(_loop_kind()) == "asyncio"


# --- error answers and heads ---------------------------------------------------------------


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (431, "invalid_request_error"),
    (499, "invalid_request_error"), (500, "server_error"), (501, "server_error"),
    (502, "bad_gateway"), (503, "server_error"), (505, "server_error"),
])
def test_an_error_body_is_openai_shaped_and_typed_by_status(status: int, kind: str) -> None:
    body = error_body(status, "why")
    assert json.loads(body) == {"error": {"message": "why", "type": kind, "param": None,
                                          "code": status}}


def test_a_raw_error_is_a_whole_answer_that_closes_the_connection() -> None:
    body = error_body(503, "full")
    assert raw_error(503, "full") == (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)


def test_a_refused_head_carries_its_status_and_message() -> None:
    e = BadHead(431, "too long")
    assert (e.status, e.message, str(e)) == (431, "too long", "too long")


@pytest.mark.parametrize(("parser", "pieces", "field", "whole"), [
    (httptools.HttpResponseParser, (b"HTTP/1.1 200 Al", b"l Good\r\ncontent-length: 0\r\n\r\n"),
     "reason", b"All Good"),
    (httptools.HttpRequestParser, (b"GET /v1/mod", b"els?x=1 HTTP/1.1\r\nHost: h\r\n\r\n"),
     "target", b"/v1/models?x=1"),
], ids=["a reason phrase", "a request target"])
def test_a_head_field_read_in_pieces_is_kept_whole(
        parser: Any, pieces: tuple[bytes, bytes], field: str, whole: bytes) -> None:
    head = MessageHead()
    feeder = parser(head)
    for piece in pieces:
        feeder.feed_data(piece)
    assert getattr(head, field) == whole


def test_tokens_are_the_lowercased_comma_separated_values_of_one_header() -> None:
    head = MessageHead()
    head.headers = [(b"connection", b"Keep-Alive, CLOSE"), (b"x-other", b"nope"),
                    (b"connection", b" Upgrade ,te")]
    assert head.tokens(b"connection") == {b"keep-alive", b"close", b"upgrade", b"te"}
    assert head.tokens(b"absent") == set()


_MALFORMED = "the upstream server's answer has a malformed status line"


@pytest.mark.parametrize(("data", "status", "version"), [
    (b"HTTP/1.1 599 X\r\n\r\n", 599, b"1.1"), (b"HTTP/1.0 100 Go\r\n\r\n", 100, b"1.0"),
])
def test_an_answer_head_with_a_status_from_100_to_599_is_read(data: bytes, status: int,
                                                               version: bytes) -> None:
    head = parse_response(data)
    assert (head.status, head.version) == (status, version)


@pytest.mark.parametrize(("data", "message"), [
    (b"HTTP/1.1 600 X\r\n\r\n", _MALFORMED),
    (b"HTTP/1.1 099 X\r\n\r\n", _MALFORMED),
    (b"HTTP/2.0 200 X\r\n\r\n", _MALFORMED),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
     "the upstream server's answer has a transfer coding other than chunked"),
    (b"HTTP/1.1 200 OK\r\n", "the upstream server's answer head is malformed"),
    (b"XTTP/1.1 200 OK\r\n\r\n", "the upstream server's answer head is malformed: "
                                    "Expected HTTP/, RTSP/ or ICE/"),
], ids=["status-600", "status-99", "http-2", "gzip", "cut-short", "not-http"])
def test_an_answer_head_a_strict_client_refuses_is_a_502(data: bytes, message: str) -> None:
    with pytest.raises(BadHead) as e:
        parse_response(data)
    assert (e.value.status, e.value.message) == (502, message)


# --- the chunk size line -------------------------------------------------------------------


@pytest.mark.parametrize(("line", "size"), [
    (b"0", 0), (b"a", 10), (b"Ff", 255), (b"ffffffffffffffff", 2**64 - 1),
    (b"5 ", 5), (b"5\t;name=value", 5), (b"5;ext", 5), (b"10;\x80\xff ~", 16),
])
def test_a_chunk_size_line_is_read_as_hex_with_extensions_ignored(line: bytes,
                                                                 size: int) -> None:
    buf = bytearray(b"xx" + line + b"\r\n")
    assert chunk_size(buf, 2, 2 + len(line)) == size


@pytest.mark.parametrize("line", [
    b"", b"0x5", b"-5", b"+5", b" 5", b"1ffffffffffffffff", b"5;a\x01", b"5;a\rb", b"g",
    b"5 5",
], ids=["empty", "0x", "minus", "plus", "leading-blank", "17-digits", "control-byte",
        "bare-cr", "not-hex", "two-numbers"])
def test_a_chunk_size_line_a_strict_parser_refuses_is_a_value_error(line: bytes) -> None:
    with pytest.raises(ValueError, match="^malformed chunk size line$"):
        chunk_size(bytearray(line), 0, len(line))


# --- the relay's chunk feeder --------------------------------------------------------------


class Fed:
    """A relay to a :class:`FakeTransport`, with what it handed on recorded."""

    def __init__(self, mode: int, length: int = 0, head: bytes = b"",
                 closing: bool = False) -> None:
        self.sink = FakeTransport(closing=closing)
        self.payloads: list[bytes] = []
        self.starts = 0
        self.done: list[Relay] = []
        self.relay = Relay(mode, length, cast(asyncio.WriteTransport, self.sink), head,
                           self.payloads.append, self._start, ClientGone, UpstreamFailed)
        self.relay.done = self.done.append

    def _start(self) -> None:
        self.starts += 1

    def feed(self, *pieces: bytes) -> bytes:
        return b"".join(self.relay.feed(p) for p in pieces)


LAST = b"0\r\n\r\n"
#: A chunked body as (kind, bytes): size lines and CRLFs go on whole, payloads byte by byte,
#: the last chunk and the trailers never (the relay writes its own last chunk).
BODY = [("line", b"5\r\n"), ("data", b"hello"), ("crlf", b"\r\n"),
        ("line", b"1A;ext=\"v\"\r\n"), ("data", b"abcdefghijklmnopqrstuvwxyz"),
        ("crlf", b"\r\n"), ("line", b"1\r\n"), ("data", b"!"), ("crlf", b"\r\n"),
        ("last", b"0;end\r\n"), ("trailers", b"x-checksum: 1\r\nx-more: 2\r\n\r\n")]
WIRE = b"".join(b for _, b in BODY)
PAYLOAD = b"hello" + b"abcdefghijklmnopqrstuvwxyz" + b"!"
FORWARDED = b"".join(b for kind, b in BODY if kind in ("line", "data", "crlf")) + LAST


def _forwardable(n: int) -> bytes:
    """What the relay has written once ``WIRE[:n]`` arrived (CHUNKED)."""
    out, pos = b"", 0
    for kind, part in BODY:
        have = max(0, min(len(part), n - pos))
        if kind == "data":
            out += part[:have]
        elif kind in ("line", "crlf") and have == len(part):
            out += part
        if have < len(part):
            return out
        pos += len(part)
    return out + LAST


@pytest.mark.parametrize("tail", [b"", b"GET / HTTP/1.1\r\n"], ids=["alone", "pipelined"])
def test_a_chunked_body_split_anywhere_is_relayed_byte_for_byte(tail: bytes) -> None:
    data = WIRE + tail
    for k in range(len(data) + 1):
        f = Fed(Relay.CHUNKED)
        assert f.feed(data[:k], data[k:]) == tail, k
        assert (bytes(f.sink.written), b"".join(f.payloads)) == (FORWARDED, PAYLOAD), k
        assert (f.relay.ended, f.relay.error, f.relay.leftover) == (True, None, bool(tail)), k
        assert f.done == [f.relay], k


def test_a_chunked_body_is_written_as_soon_as_each_byte_can_be() -> None:
    f = Fed(Relay.CHUNKED)
    for n in range(1, len(WIRE) + 1):
        assert f.relay.feed(WIRE[n - 1:n]) == b"", n
        assert bytes(f.sink.written) == _forwardable(n), n
        assert f.relay.leftover is False, n
        assert f.relay.ended == (n == len(WIRE)), n


def test_a_dechunked_body_split_anywhere_is_its_payloads_alone() -> None:
    for k in range(len(WIRE) + 1):
        f = Fed(Relay.DECHUNK)
        assert f.feed(WIRE[:k], WIRE[k:]) == b"", k
        assert bytes(f.sink.written) == PAYLOAD == b"".join(f.payloads), k
        assert f.relay.ended, k


def test_the_head_goes_with_the_first_write_and_start_is_called_once_after_it() -> None:
    f = Fed(Relay.CHUNKED, head=b"HEAD\r\n\r\n")
    assert (f.relay.head_sent, f.relay.ended, f.relay.leftover) == (False, False, False)
    assert f.starts == 0
    f.feed(b"5")
    assert (bytes(f.sink.written), f.starts, f.relay.head_sent) == (b"HEAD\r\n\r\n", 1, True)
    f.feed(b"\r\nhe")
    assert bytes(f.sink.written) == b"HEAD\r\n\r\n5\r\nhe"
    assert (f.starts, f.payloads) == (1, [b"he"])
    f.feed(b"llo\r\n0\r\n\r\n")
    assert bytes(f.sink.written) == b"HEAD\r\n\r\n5\r\nhello\r\n" + LAST
    assert (f.starts, f.payloads) == (1, [b"he", b"llo"])


def test_an_empty_chunked_body_is_the_relays_own_last_chunk() -> None:
    f = Fed(Relay.CHUNKED)
    assert f.feed(b"0\r\n", b"\r\n") == b""
    assert (bytes(f.sink.written), f.payloads, f.relay.ended) == (LAST, [], True)


@pytest.mark.parametrize("body", [
    b"\r\n5\r\nhello\r\n0\r\n\r\n",
    b"5\nhello\r\n0\r\n\r\n",
    b"5\r\nhelloXY0\r\n\r\n",
    b"5\r\nhello\n0\r\n\r\n",
    b"0x5\r\nhello\r\n0\r\n\r\n",
    b"5;a\x00b\r\nhello\r\n0\r\n\r\n",
], ids=["empty-size-line", "bare-lf-size-line", "no-crlf-after-data", "bare-lf-after-data",
        "0x-prefix", "control-byte-extension"])
def test_broken_chunked_framing_fails_the_relay_wherever_it_is_split(body: bytes) -> None:
    for k in range(len(body) + 1):
        f = Fed(Relay.CHUNKED)
        f.feed(body[:k], body[k:])
        assert isinstance(f.relay.error, UpstreamFailed), k
        assert not f.relay.ended and f.done == [f.relay], k
        assert not bytes(f.sink.written).endswith(LAST), k


@pytest.mark.parametrize("before", [b"", b"5\r\nhello\r\n"], ids=["first", "after-a-chunk"])
def test_a_chunk_size_line_may_be_64_kib_without_its_crlf_and_no_more(before: bytes) -> None:
    f = Fed(Relay.CHUNKED)
    f.feed(before + b"1" * MAX_HEAD)
    assert f.relay.error is None and not f.relay.ended
    f.feed(b"1")
    assert isinstance(f.relay.error, UpstreamFailed)


@pytest.mark.parametrize("before", [b"", b"8000\r\n" + b"p" * 0x8000 + b"\r\n"],
                         ids=["first", "after-a-32-kib-chunk"])
def test_trailers_may_be_64_kib_without_a_crlf_and_no_more(before: bytes) -> None:
    f = Fed(Relay.CHUNKED)
    f.feed(before + b"0\r\n" + b"t" * MAX_HEAD)
    assert f.relay.error is None and not f.relay.ended
    f.feed(b"t")
    assert isinstance(f.relay.error, UpstreamFailed)


def test_an_incomplete_chunked_body_returns_nothing_and_leaves_nothing_over() -> None:
    f = Fed(Relay.CHUNKED)
    for piece in (b"5", b"\r", b"\nhel", b"lo\r", b"\n0", b"\r\nx: y", b"\r\n"):
        assert f.relay.feed(piece) == b""
        assert f.relay.leftover is False and not f.relay.ended
    assert f.relay.feed(b"\r\nNEXT") == b"NEXT"
    assert f.relay.leftover is True and f.relay.ended


def test_bytes_after_an_ended_body_are_returned_and_marked_as_left_over() -> None:
    f = Fed(Relay.CHUNKED)
    assert f.feed(b"0\r\n\r\n") == b""
    assert f.relay.leftover is False
    assert f.relay.feed(b"") == b"" and f.relay.leftover is False
    assert f.relay.feed(b"X") == b"X" and f.relay.leftover is True


@pytest.mark.parametrize("k", range(8))
def test_a_length_body_ends_at_its_length_wherever_it_is_split(k: int) -> None:
    data = b"abcde" + b"NX"
    f = Fed(Relay.LENGTH, 5)
    assert f.feed(data[:k], data[k:]) == b"NX"
    assert (bytes(f.sink.written), b"".join(f.payloads)) == (b"abcde", b"abcde")
    assert f.relay.ended and f.relay.leftover


def test_an_empty_read_hands_no_payload_on() -> None:
    f = Fed(Relay.LENGTH, 3)
    assert f.feed(b"", b"abc") == b""
    assert f.payloads == [b"abc"]
    g = Fed(Relay.LENGTH, 0, head=b"H")
    assert g.feed(b"") == b""
    assert (g.payloads, bytes(g.sink.written), g.relay.ended) == ([], b"H", True)


def test_a_close_delimited_body_ends_when_its_source_does() -> None:
    f = Fed(Relay.CLOSE, head=b"H")
    assert f.feed(b"ab", b"", b"c") == b""
    assert not f.relay.ended and f.payloads == [b"ab", b"c"]
    f.relay.source_ended()
    assert f.relay.ended and f.relay.error is None and bytes(f.sink.written) == b"Habc"


def test_a_body_framed_by_length_or_chunks_fails_when_its_source_ends_early() -> None:
    for mode in (Relay.LENGTH, Relay.CHUNKED):
        f = Fed(mode, 5)
        f.feed(b"ab" if mode == Relay.LENGTH else b"5\r\nab")
        f.relay.source_ended()
        assert isinstance(f.relay.error, UpstreamFailed) and not f.relay.ended


def test_a_sink_that_is_closing_fails_the_relay_with_the_sinks_error() -> None:
    f = Fed(Relay.CHUNKED, closing=True)
    assert f.feed(b"5\r\nhello\r\n") == b""
    assert isinstance(f.relay.error, ClientGone) and bytes(f.sink.written) == b""


def test_a_relay_fails_once_and_never_after_it_ended() -> None:
    f = Fed(Relay.LENGTH, 1)
    first, second = UpstreamFailed(), ClientGone()
    f.relay.fail(first)
    f.relay.fail(second)
    assert f.relay.error is first and f.done == [f.relay]
    g = Fed(Relay.LENGTH, 1)
    g.feed(b"a")
    g.relay.fail(first)
    assert g.relay.error is None and g.relay.ended and g.done == [g.relay]


# --- a connection's holds ------------------------------------------------------------------


def test_reading_pauses_at_the_first_hold_and_resumes_when_the_last_is_released() -> None:
    side, t = Side(), FakeTransport()
    _attach(side, t)
    side.hold(BACKPRESSURE)
    side.hold(FULL)
    assert (t.paused, t.resumed) == (1, 0)
    side.release(FULL)
    assert t.resumed == 0
    side.release(FULL)  # not held: nothing to release
    side.release(BACKPRESSURE)
    assert (t.paused, t.resumed) == (1, 1)


def test_a_closing_transport_is_neither_paused_nor_resumed() -> None:
    side, t = Side(), FakeTransport(closing=True)
    _attach(side, t)
    side.hold(FULL)
    side.release(FULL)
    assert (t.paused, t.resumed) == (0, 0)


def test_a_side_whose_buffer_is_full_holds_the_side_that_feeds_it() -> None:
    sink, source, t = Side(), Side(), FakeTransport()
    _attach(source, t)
    sink.pause_writing()
    assert sink.writing_paused is True
    sink.feed_from(source)
    assert t.paused == 1
    sink.resume_writing()
    assert (sink.writing_paused, t.resumed) == (False, 1)
    sink.pause_writing()
    sink.feed_from(None)  # the old feeder is let go
    assert (t.paused, t.resumed) == (2, 2)


# --- the two connections -------------------------------------------------------------------


@pytest.mark.parametrize(("eof", "buf", "transport", "usable"), [
    (False, b"", "open", True), (True, b"", "open", False), (False, b"x", "open", False),
    (False, b"", "closing", False), (False, b"", None, False),
], ids=["idle", "ended", "bytes-waiting", "closing", "no-transport"])
def test_an_upstream_connection_is_usable_only_idle_open_and_empty(
        eof: bool, buf: bytes, transport: str | None, usable: bool) -> None:
    c = UpstreamConn()
    if transport is not None:
        _attach(c, FakeTransport(closing=transport == "closing"))
    c.eof, c.buf = eof, bytearray(buf)
    assert c.usable() is usable


@pytest.mark.parametrize(("lost", "closing"), [(True, False), (False, True)],
                         ids=["lost", "closing"])
def test_writing_to_a_gone_upstream_fails(lost: bool, closing: bool) -> None:
    c, t = UpstreamConn(), FakeTransport(closing=closing)
    _attach(c, t)
    c.lost = lost
    with pytest.raises(UpstreamFailed):
        c.write(b"x")
    assert t.written == b""


def test_a_byte_from_a_pooled_upstream_ends_and_closes_it() -> None:
    c, t = _conn(pooled=True)
    c.data_received(b"x")
    assert (c.eof, t.closing, bytes(c.buf)) == (True, True, b"")
    d, u = _conn()
    d.data_received(b"HTTP/1.1")
    assert (d.eof, u.closing, bytes(d.buf)) == (False, False, b"HTTP/1.1")


def test_an_upstreams_end_closes_it_and_a_clients_half_close_keeps_it_writable() -> None:
    up = UpstreamConn()
    assert up.eof_received() is False and up.eof
    client = ClientConn(_proxy())
    assert client.eof_received() is True and client.eof


def test_a_client_connection_writes_only_while_its_transport_is_open() -> None:
    client, t = ClientConn(_proxy()), FakeTransport()
    client.write(b"no transport yet")
    _attach(client, t)
    client.write(b"a")
    t.closing = True
    client.write(b"b")
    assert t.written == b"a"


# --- the lingering close -------------------------------------------------------------------


def _proxy(**options: Any) -> Proxy:
    return Proxy(Upstream.parse("http://127.0.0.1:9"), MRCMetrics(resolution_unknown=True),
                 **options)


def _lingering(client: ClientConn, seconds: float, limit: int,
               check: Callable[[], None]) -> None:
    """Run ``client.linger`` and ``check`` while it lingers; it must then end."""

    async def main() -> None:
        task = asyncio.create_task(client.linger(seconds, limit))
        await asyncio.sleep(0)
        check()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_a_refused_client_is_read_until_the_limit_less_what_it_already_sent() -> None:
    client, t = ClientConn(_proxy()), FakeTransport()
    _attach(client, t)
    client.buf += b"abc"
    client.hold(FULL)

    def check() -> None:
        assert (t.eofs, bytes(client.buf), t.resumed) == (1, b"", 1)
        client.data_received(b"1234")
        client.data_received(b"56")
        assert client._lingered is not None and not client._lingered.done()
        client.data_received(b"7")
        assert client._lingered.done()

    _lingering(client, 30, 10, check)


def test_a_refused_client_that_already_sent_the_limit_is_read_for_one_more_byte() -> None:
    client, t = ClientConn(_proxy()), FakeTransport()
    _attach(client, t)
    client.buf += b"abc"

    def check() -> None:
        client.data_received(b"z")
        assert client._lingered is not None and client._lingered.done()

    _lingering(client, 30, 3, check)


def test_lingering_ends_when_its_time_is_up() -> None:
    client, t = ClientConn(_proxy()), FakeTransport()
    _attach(client, t)
    _lingering(client, 0.01, 100, lambda: None)
    assert t.eofs == 1


@pytest.mark.parametrize("error", [OSError("reset"), RuntimeError("closed"),
                                   NotImplementedError()], ids=lambda e: type(e).__name__)
def test_lingering_goes_on_when_the_half_close_fails(error: Exception) -> None:
    client, t = ClientConn(_proxy()), FakeTransport(eof_error=error)
    _attach(client, t)

    def check() -> None:
        client.data_received(b"x" * 9)
        assert client._lingered is not None and client._lingered.done()

    _lingering(client, 30, 9, check)
    assert t.eofs == 1


def test_a_transport_that_cannot_half_close_is_not_asked_to() -> None:
    client, t = ClientConn(_proxy()), FakeTransport(can_eof=False)
    _attach(client, t)
    _lingering(client, 30, 1, lambda: client.data_received(b"x"))
    assert t.eofs == 0


@pytest.mark.parametrize("case", ["no-transport", "closing", "ended"])
def test_there_is_no_lingering_on_a_connection_that_is_gone(case: str) -> None:
    client, t = ClientConn(_proxy()), FakeTransport(closing=case == "closing")
    if case != "no-transport":
        _attach(client, t)
    client.eof = case == "ended"
    client.buf += b"kept"
    _lingering(client, 30, 10, lambda: None)
    assert (t.eofs, bytes(client.buf), client._drop) == (0, b"kept", -1)


def _conn(**state: Any) -> tuple[UpstreamConn, FakeTransport]:
    c, t = UpstreamConn(), FakeTransport()
    _attach(c, t)
    for name, value in state.items():
        setattr(c, name, value)
    return c, t
