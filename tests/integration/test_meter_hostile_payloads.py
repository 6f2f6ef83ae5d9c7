"""The meter on real sockets against bytes built to break it: through the ASGI middleware and
through ``mrc-agent proxy``, a crafted image header and a 400-digit ``usage`` count leave the
server's own answer, the body the app received, the request's count and the in-flight gauge as
they would be without the meter."""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from mrc_agent.exporters.instrumentation import MRCMeterMiddleware, MRCMetrics
from tests.conftest import parse_metrics, series
from tests.openai_support import FakeEngine, ProxyThread, ServerThread, chat

#: A BMP header claiming a width of -5 and a height of 0, as a data URL.
CRAFTED_BMP = "data:image/bmp;base64," + base64.b64encode(
    b"BM" + bytes(12) + struct.pack("<Iii", 40, -5, 0) + bytes(40)).decode()
HUGE = b"1" + b"0" * 399  # 400 digits


def huge_usage_app() -> Starlette:
    """An upstream whose ``usage`` holds 400-digit counts, streamed or not."""

    async def answer(request: Request) -> Response:
        body = json.loads(await request.body())
        usage = b'{"prompt_tokens": %s, "completion_tokens": %s}' % (HUGE, HUGE)
        if not body.get("stream"):
            return Response(b'{"object": "chat.completion", "choices": [{"index": 0, "message": '
                            b'{"role": "assistant", "content": "hi"}}], "usage": ' + usage + b"}",
                            media_type="application/json")

        async def events() -> Any:
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
            yield b'data: {"choices": [], "usage": ' + usage + b"}\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"])])


def _metered(app: Starlette) -> tuple[Starlette, CollectorRegistry]:
    reg = CollectorRegistry()
    app.add_middleware(MRCMeterMiddleware, metrics=MRCMetrics(registry=reg,
                                                              resolution_unknown=True))
    return app, reg


@pytest.fixture(scope="module")
def wrapped() -> Iterator[tuple[FakeEngine, ServerThread, CollectorRegistry]]:
    fake = FakeEngine()
    app, reg = _metered(fake.app())
    server = ServerThread(app)
    yield fake, server, reg
    server.stop()


@pytest.fixture(scope="module")
def huge() -> Iterator[ServerThread]:
    server = ServerThread(huge_usage_app())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def huge_wrapped() -> Iterator[tuple[ServerThread, CollectorRegistry]]:
    app, reg = _metered(huge_usage_app())
    server = ServerThread(app)
    yield server, reg
    server.stop()


Values = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _settled(reg: CollectorRegistry, requests: float) -> Values:
    """The values once ``requests`` are counted (an exchange ends just after the client read
    its last byte)."""
    deadline = time.monotonic() + 10
    while True:
        values = parse_metrics(generate_latest(reg).decode())
        if sum(series(values, "mrc_requests_total")) >= requests:
            return values
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.02)


def _post(url: str, raw: bytes, stream: bool) -> tuple[int, bytes]:
    with httpx.stream("POST", url + "/v1/chat/completions", content=raw, timeout=30,
                      headers={"content-type": "application/json"}) as r:
        return r.status_code, r.read()


def _check_crafted_bmp(url: str, fake: FakeEngine, reg: CollectorRegistry,
                       stream: bool) -> None:
    before = parse_metrics(generate_latest(reg).decode())
    n = sum(series(before, "mrc_requests_total"))
    raw = json.dumps(chat("what is this?", CRAFTED_BMP, stream=stream)).encode()
    status, answer = _post(url, raw, stream)
    assert status == 200
    assert (b"data: [DONE]" in answer) if stream else (json.loads(answer)["usage"] is not None)
    assert fake.bodies[-1] == raw  # the app got the body, byte for byte
    after = _settled(reg, n + 1)
    assert series(after, "mrc_requests_total", outcome="ok") == [
        series(before, "mrc_requests_total", outcome="ok")[0] + 1]
    cell = {"prompt_length": "0-50", "resolution": "unknown"}
    assert series(after, "mrc_request_duration_seconds_count", **cell) == [
        series(before, "mrc_request_duration_seconds_count", **cell)[0] + 1]
    assert series(after, "mrc_requests_in_flight") == [0.0]
    assert sum(series(after, "mrc_meter_errors_total")) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_crafted_image_header_through_the_middleware(
        wrapped: tuple[FakeEngine, ServerThread, CollectorRegistry], stream: bool) -> None:
    fake, server, reg = wrapped
    _check_crafted_bmp(server.url, fake, reg, stream)


@pytest.mark.parametrize("stream", [False, True])
def test_a_crafted_image_header_through_the_proxy(
        engine: tuple[FakeEngine, ServerThread], stream: bool) -> None:
    fake, server = engine
    proxy = ProxyThread(server.url)
    try:
        _check_crafted_bmp(proxy.url, fake, proxy.metrics.registry, stream)
    finally:
        proxy.stop()


def _check_huge_usage(url: str, reg: CollectorRegistry, stream: bool) -> None:
    raw = json.dumps(chat("count me", stream=stream)).encode()
    status, answer = _post(url, raw, stream)
    assert status == 200 and HUGE in answer  # the client got the upstream's answer
    values = _settled(reg, 1)
    assert series(values, "mrc_requests_total", outcome="ok") == [1.0]
    assert sum(series(values, "mrc_requests_total")) == 1
    assert series(values, "mrc_requests_in_flight") == [0.0]
    assert series(values, "mrc_generation_tokens_total") == [0.0]  # no believable count
    assert series(values, "mrc_request_duration_seconds_count", prompt_length="0-50",
                  resolution="<1MP") == [1.0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_400_digit_usage_through_the_proxy(huge: ServerThread, stream: bool) -> None:
    proxy = ProxyThread(huge.url)
    try:
        _check_huge_usage(proxy.url, proxy.metrics.registry, stream)
    finally:
        proxy.stop()


def test_a_400_digit_usage_through_the_middleware(
        huge_wrapped: tuple[ServerThread, CollectorRegistry]) -> None:
    server, reg = huge_wrapped
    # One registry for the module: the non-streamed answer, then the streamed one.
    _check_huge_usage(server.url, reg, stream=False)
    raw = json.dumps(chat("count me", stream=True)).encode()
    status, answer = _post(server.url, raw, True)
    assert status == 200 and HUGE in answer
    values = _settled(reg, 2)
    assert series(values, "mrc_requests_total", outcome="ok") == [2.0]
    assert series(values, "mrc_requests_in_flight") == [0.0]
    assert series(values, "mrc_generation_tokens_total") == [0.0]
