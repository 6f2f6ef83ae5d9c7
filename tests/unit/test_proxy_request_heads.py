"""The request heads ``mrc-agent proxy`` refuses before anything is forwarded, each with the
status and the reason a client is told (RFC 9110 and 9112), and the ones it reads."""

from __future__ import annotations

import pytest

from mrc_agent.agent.tools.proxy_http import BadHead, parse_request

HOST = b"Host: x\r\n"


@pytest.mark.parametrize(("data", "status", "message"), [
    (b"BREW /pot HTTP/1.1\r\n" + HOST, 501, "the request method is not supported"),
    (b"connect x:443 HTTP/1.1\r\n" + HOST, 501, "the request method is not supported"),
    (b"GE(T / HTTP/1.1\r\n" + HOST, 400, "the request line is malformed"),
    (b"BREW\t/ HTTP/1.1\r\n" + HOST, 400, "the request line is malformed"),
    (b"GET / HTTP/2.0\r\n" + HOST, 505, "only HTTP/1.0 and HTTP/1.1 are supported"),
    (b"GET / HTTP/0.9\r\n" + HOST, 505, "only HTTP/1.0 and HTTP/1.1 are supported"),
    (b"CONNECT x:443 HTTP/1.1\r\n" + HOST, 501, "CONNECT is not supported"),
    (b"GET / HTTP/1.1\r\n", 400, "an HTTP/1.1 request needs a Host header"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n", 400, "a request may have only one Host header"),
    (b"GET / HTTP/1.0\r\nHost: a\r\nhost: b\r\n", 400, "a request may have only one Host header"),
    (b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: gzip, chunked\r\n", 501,
     "only Transfer-Encoding: chunked is supported"),
], ids=["unknown-method", "lowercase-connect", "not-a-token", "tab-separated", "http-2",
        "http-0.9", "connect", "no-host", "two-hosts", "two-hosts-http-1.0", "gzip-chunked"])
def test_a_request_head_the_proxy_cannot_forward_is_refused_with_its_status_and_reason(
        data: bytes, status: int, message: str) -> None:
    with pytest.raises(BadHead) as e:
        parse_request(data + b"\r\n")
    assert (e.value.status, e.value.message) == (status, message)


@pytest.mark.parametrize(("data", "why"), [
    (b"GET / HTTP/1.1\r\n" + HOST, "the request head is malformed"),  # no blank line
    (b"GET / HTTP/1.2\r\n" + HOST + b"\r\n", "the request head is malformed: "),
])
def test_a_head_llhttp_refuses_is_a_400_naming_the_request_head(data: bytes, why: str) -> None:
    with pytest.raises(BadHead) as e:
        parse_request(data)
    assert e.value.status == 400 and e.value.message.startswith(why)


@pytest.mark.parametrize(("data", "method", "version"), [
    (b"GET / HTTP/1.0\r\n\r\n", b"GET", b"1.0"),  # HTTP/1.0 may leave Host out
    (b"M-SEARCH * HTTP/1.1\r\n" + HOST + b"\r\n", b"M-SEARCH", b"1.1"),
    (b"POST /v1/chat/completions HTTP/1.1\r\n" + HOST
     + b"Transfer-Encoding: chunked\r\n\r\n", b"POST", b"1.1"),
])
def test_a_head_the_proxy_can_forward_is_read(data: bytes, method: bytes,
                                              version: bytes) -> None:
    head = parse_request(data)
    assert (head.method, head.version) == (method, version)
