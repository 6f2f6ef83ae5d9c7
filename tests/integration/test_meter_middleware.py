"""The meter's ASGI middleware around an app that fails or a client that leaves, on a real
uvicorn server on loopback: whatever happens to the request, it is counted once with the right
outcome and ``mrc_requests_in_flight`` returns to where it was."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mrc_agent.exporters.instrumentation import MRCMeterMiddleware, MRCMetrics
from tests.conftest import parse_metrics, series, wait_until
from tests.openai_support import ServerThread, chat

_EVENT = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'


class Boom(RuntimeError):
    """The app's own bug."""


async def _chat(request: Request) -> Response:
    body = await request.json()
    how = body.get("x_fail")
    if how == "before":
        raise Boom("before the answer began")

    async def events() -> AsyncIterator[bytes]:
        yield _EVENT
        await asyncio.sleep(0.05)
        if how == "midstream":
            raise Boom("after the first event")
        yield b"data: [DONE]\n\n"

    if body.get("stream"):
        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"choices": [{"message": {"content": "a"}}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1}})


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, CollectorRegistry]]:
    reg = CollectorRegistry()
    app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])
    app.add_middleware(MRCMeterMiddleware, metrics=MRCMetrics(registry=reg,
                                                              resolution_unknown=True))
    server = ServerThread(app)
    yield server, reg
    server.stop()


def _outcomes(reg: CollectorRegistry) -> dict[str, float]:
    values = parse_metrics(generate_latest(reg).decode())
    return {dict(labels)["outcome"]: v for (name, labels), v in values.items()
            if name == "mrc_requests_total" and v}


def _in_flight(reg: CollectorRegistry) -> list[float]:
    return series(parse_metrics(generate_latest(reg).decode()), "mrc_requests_in_flight")


def _counted(reg: CollectorRegistry, before: dict[str, float], outcome: str) -> None:
    """One more request counted, with ``outcome``, and none in flight."""
    want = {**before, outcome: before.get(outcome, 0.0) + 1}
    wait_until(lambda: _outcomes(reg) == want)
    assert _in_flight(reg) == [0.0]


def test_an_app_that_raises_before_answering_is_counted_as_an_error(
        served: tuple[ServerThread, CollectorRegistry]) -> None:
    server, reg = served
    before = _outcomes(reg)
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("x", x_fail="before"),
                   timeout=10)
    assert r.status_code == 500  # the server's own answer to an app that raised
    _counted(reg, before, "error")


def test_an_app_that_raises_mid_stream_is_counted_as_an_error(
        served: tuple[ServerThread, CollectorRegistry]) -> None:
    server, reg = served
    before = _outcomes(reg)
    # The stream is cut, never complete.
    with pytest.raises(httpx.RemoteProtocolError), httpx.stream(
            "POST", server.url + "/v1/chat/completions",
            json=chat("x", stream=True, x_fail="midstream"), timeout=10) as r:
        assert r.status_code == 200
        list(r.iter_bytes())
    _counted(reg, before, "error")


def test_a_client_that_leaves_mid_upload_is_counted_as_leaving(
        served: tuple[ServerThread, CollectorRegistry]) -> None:
    """The app reads a body that never ends: the server hands it ``http.disconnect``, and the
    request counts as the client's (499), not the app's."""
    server, reg = served
    before = _outcomes(reg)
    body = json.dumps(chat("x")).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body) + 100,
                                                                         body))
        wait_until(lambda: _in_flight(reg) == [1.0])
    _counted(reg, before, "client_error")


def test_a_whole_answer_after_all_that_is_counted_ok(
        served: tuple[ServerThread, CollectorRegistry]) -> None:
    """After the failures above, the middleware still meters: its state is per request."""
    server, reg = served
    before = _outcomes(reg)
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("x"), timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    _counted(reg, before, "ok")
