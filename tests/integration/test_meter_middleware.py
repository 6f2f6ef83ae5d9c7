"""The meter's ASGI middleware around an app that fails or a client that leaves, on a real
uvicorn server on loopback: whatever happens to the request, it is counted once with the right
outcome and ``mrc_requests_in_flight`` returns to where it was."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mrc_agent.exporters.instrumentation import MRCMeterMiddleware, MRCMetrics, middleware
from mrc_agent.exporters.instrumentation.meter import METERED_PATHS
from mrc_agent.exporters.instrumentation.middleware import (
    ASGIApp,
    Message,
    Receive,
    Send,
    content_type,
)
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


# --- the middleware driven directly, as an ASGI app with scripted receive and send ---------------

Msg = Message
_JSON = [(b"x-request-id", b"7"), (b"content-type", b"Application/JSON; charset=utf-8")]
_SSE = [(b"content-type", b"Text/Event-Stream; charset=utf-8")]
_ANSWER = json.dumps({"choices": [{"message": {"content": "a"}}],
                      "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode()
_USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4}}\n\n'
_BODY = json.dumps(chat("hello")).encode()  # 5 characters of prompt


def _fresh() -> tuple[MRCMetrics, CollectorRegistry]:
    reg = CollectorRegistry()
    return MRCMetrics(registry=reg, resolution_unknown=True), reg


def _seen(reg: CollectorRegistry) -> dict[str, Any]:
    """What the meter recorded: outcomes, in flight, durations by labels, receive stages,
    tokens, images and the meter's own errors (zeros left out)."""
    m = parse_metrics(generate_latest(reg).decode())

    def by(name: str, label: str) -> dict[str, float]:
        return {dict(ls)[label]: v for (n, ls), v in m.items() if n == name and v}

    return {
        "outcomes": by("mrc_requests_total", "outcome"),
        "in_flight": series(m, "mrc_requests_in_flight"),
        "durations": {(dict(ls)["prompt_length"], dict(ls)["resolution"]): v
                      for (n, ls), v in m.items()
                      if n == "mrc_request_duration_seconds_count" and v},
        "receive": series(m, "mrc_stage_duration_seconds_count", stage="receive"),
        "tokens": (series(m, "mrc_prompt_tokens_total"),
                   series(m, "mrc_generation_tokens_total")),
        "images": series(m, "mrc_request_images_count"),
        "meter_errors": by("mrc_meter_errors_total", "stage"),
    }


def _idle() -> dict[str, Any]:
    return {"outcomes": {}, "in_flight": [0.0], "durations": {}, "receive": [0.0],
            "tokens": ([0.0], [0.0]), "images": [0.0], "meter_errors": {}}


def _recorded(outcome: str, *, durations: dict[tuple[str, str], float] | None = None,
              receive: float = 1.0, tokens: tuple[float, float] = (0.0, 0.0),
              images: float = 1.0) -> dict[str, Any]:
    """One request counted with ``outcome``, none in flight and no meter error."""
    return {"outcomes": {outcome: 1.0}, "in_flight": [0.0],
            "durations": {} if durations is None else durations, "receive": [receive],
            "tokens": ([tokens[0]], [tokens[1]]), "images": [images], "meter_errors": {}}


_HELLO = {("0-50", "<1MP"): 1.0}  # 5 characters, no image


def _scope(method: str = "POST", path: str = "/v1/chat/completions",
           kind: str = "http") -> Msg:
    return {"type": kind, "method": method, "path": path, "headers": []}


def _run(mw: MRCMeterMiddleware, scope: Msg, incoming: list[Msg],
         fail_send_at: int | None = None) -> list[Msg]:
    """Call ``mw`` once: ``receive`` hands out ``incoming`` then ``http.disconnect``; ``send``
    collects what reaches the server (raising OSError at message ``fail_send_at``)."""
    sent: list[Msg] = []
    queue = list(incoming)

    async def receive() -> Msg:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: Msg) -> None:
        if len(sent) == fail_send_at:
            raise OSError("the client is gone")
        sent.append(dict(message))

    asyncio.run(mw(scope, receive, send))
    return sent


def _app(*script: Msg | str) -> ASGIApp:
    """An app that plays ``script``: a message is sent; "read" reads the whole body;
    "wait" reads once more (a disconnect); "boom" raises :class:`Boom`."""
    async def app(scope: Msg, receive: Receive, send: Send) -> None:
        for step in script:
            if not isinstance(step, str):
                await send(step)
            elif step == "read":
                while (await receive()).get("more_body", False):
                    pass
            elif step == "wait":
                assert (await receive())["type"] == "http.disconnect"
            else:
                assert step == "boom"
                raise Boom("the app's bug")
    return app


def _start(headers: list[tuple[bytes, bytes]], status: int = 200) -> Msg:
    return {"type": "http.response.start", "status": status, "headers": headers}


def _body(chunk: bytes, more: bool = False) -> Msg:
    return {"type": "http.response.body", "body": chunk, "more_body": more}


def _upload(body: bytes = _BODY, cut: int = 10) -> list[Msg]:
    """The request body in two pieces, the last without ``more_body`` (False by default)."""
    return [{"type": "http.request", "body": body[:cut], "more_body": True},
            {"type": "http.request", "body": body[cut:]}]


@pytest.mark.parametrize(("headers", "want"), [
    pytest.param([], "", id="no-headers"),
    pytest.param([(b"x-a", b"1")], "", id="no-content-type"),
    pytest.param([(b"x-a", b"1"), (b"content-type", b"text/plain")], "text/plain",
                 id="after-another-header"),
    pytest.param([(b"content-type", b"a/b"), (b"content-type", b"c/d")], "a/b", id="first-wins"),
    pytest.param([(b"content-type", b"text/plain; x=\xe9")], "text/plain; x=\u00e9",
                 id="latin-1-value"),
    pytest.param([(b"Content-Type", b"a/b")], "", id="names-are-lower-case-in-asgi"),
    pytest.param([(b"CONTENT-TYPE", b"a/b")], "", id="upper-case-name-is-not-it"),
])
def test_content_type_is_the_first_lower_case_content_type_header(
        headers: list[tuple[bytes, bytes]], want: str) -> None:
    assert content_type(headers) == want


def test_metrics_without_the_unknown_resolution_cell_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as caught:
        MRCMeterMiddleware(_app(), metrics=MRCMetrics(registry=CollectorRegistry()))
    assert str(caught.value) == ("the meter needs metrics with the unknown resolution cell: "
                                 "MRCMetrics(..., resolution_unknown=True)")


def test_without_metrics_the_middleware_uses_the_process_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    metrics, reg = _fresh()
    monkeypatch.setattr(middleware, "_default", metrics)
    app = _app()
    mw = MRCMeterMiddleware(app)
    assert mw.metrics is metrics and mw.app is app and mw.paths == METERED_PATHS


@pytest.mark.parametrize("scope", [
    pytest.param({"type": "lifespan"}, id="lifespan"),
    pytest.param({"type": "websocket", "path": "/v1/chat/completions"}, id="websocket"),
    pytest.param(_scope(method="GET"), id="get-to-a-metered-path"),
    pytest.param(_scope(method="post"), id="lower-case-post"),
    pytest.param(_scope(path="/v1/embeddings"), id="post-elsewhere"),
    pytest.param(_scope(path="/v1/chat/completions/x"), id="post-below-a-metered-path"),
])
def test_what_is_not_metered_reaches_the_app_untouched_and_uncounted(scope: Msg) -> None:
    metrics, reg = _fresh()
    got: list[tuple[Any, ...]] = []

    async def app(s: Msg, receive: Receive, send: Send) -> None:
        got.append((s, receive, send))

    async def receive() -> Msg:
        raise AssertionError("not read")

    async def send(message: Msg) -> None:
        raise AssertionError("not sent")

    asyncio.run(MRCMeterMiddleware(app, metrics=metrics)(scope, receive, send))
    assert len(got) == 1
    assert got[0][0] is scope and got[0][1] is receive and got[0][2] is send
    assert _seen(reg) == _idle()


@pytest.mark.parametrize(("path", "counted"), [
    pytest.param("/generate", True, id="its-own-path"),
    pytest.param("/root/generate", True, id="its-path-under-a-root"),
    pytest.param("/v1/chat/completions", False, id="not-the-default-paths"),
])
def test_the_paths_given_replace_the_default_ones(path: str, counted: bool) -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", _start(_JSON), _body(_ANSWER)), metrics=metrics,
                            paths=iter(["/generate"]))
    sent = _run(mw, _scope(path=path), _upload())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    want = (_recorded("ok", durations=_HELLO, tokens=(3.0, 2.0)) if counted else _idle())
    assert _seen(reg) == want


def test_a_whole_exchange_is_read_through_and_passed_on_unchanged() -> None:
    """Split body, messages without ``body`` or ``more_body`` (their defaults), a JSON answer
    whose content type has parameters and odd case: every value is read."""
    metrics, reg = _fresh()
    answer = [_start(_JSON), {"type": "http.response.body", "more_body": True},
              _body(_ANSWER[:7], more=True), {"type": "http.response.body", "body": _ANSWER[7:]}]
    upload = [{"type": "http.request", "more_body": True}, *_upload()]
    mw = MRCMeterMiddleware(_app("read", *answer), metrics=metrics)
    assert _run(mw, _scope(), upload) == answer
    assert _seen(reg) == _recorded("ok", durations=_HELLO, tokens=(3.0, 2.0))


def test_a_small_answer_in_one_piece_without_headers_or_body_keys_is_counted_ok() -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", {"type": "http.response.start", "status": 204},
                                 {"type": "http.response.body"}), metrics=metrics)
    sent = _run(mw, _scope(), [{"type": "http.request", "body": _BODY}])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert _seen(reg) == _recorded("ok", durations=_HELLO)


def test_a_json_answer_held_first_then_ended_empty_gives_its_tokens() -> None:
    """The answer's first piece is kept until the next says whether it was the last; a body
    message without ``body`` reads as empty."""
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", _start(_JSON), _body(_ANSWER, more=True),
                                 {"type": "http.response.body"}), metrics=metrics)
    _run(mw, _scope(), _upload())
    assert _seen(reg) == _recorded("ok", durations=_HELLO, tokens=(3.0, 2.0))


def test_a_stream_with_a_parameterised_content_type_gives_its_tokens() -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", _start(_SSE), _body(_EVENT, more=True),
                                 _body(_USAGE, more=True), _body(b"data: [DONE]\n\n")),
                            metrics=metrics)
    _run(mw, _scope(), _upload())
    assert _seen(reg) == _recorded("ok", durations=_HELLO, tokens=(5.0, 4.0))


@pytest.mark.parametrize(("upload", "durations"), [
    pytest.param(_upload(), _HELLO, id="split-body"),
    pytest.param([{"type": "http.request", "body": _BODY}], _HELLO, id="one-piece"),
    pytest.param([{"type": "http.request", "body": _BODY, "more_body": False}], _HELLO,
                 id="one-piece-said-last"),
])
def test_an_app_that_raises_after_reading_the_body_is_an_error_with_its_labels(
        upload: list[Msg], durations: dict[tuple[str, str], float]) -> None:
    """The body's end is read when it arrives: its labels and receive stage are recorded
    even though no answer ever starts."""
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", "boom"), metrics=metrics)
    with pytest.raises(Boom):
        _run(mw, _scope(), upload)
    assert _seen(reg) == _recorded("error", durations=durations)


def test_an_app_that_raises_before_reading_the_body_is_an_error_without_labels() -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("boom"), metrics=metrics)
    with pytest.raises(Boom):
        _run(mw, _scope(), _upload())
    assert _seen(reg) == _recorded("error", receive=0.0, images=0.0)


def test_an_app_that_raises_mid_stream_directly_is_an_error_and_leaves_no_one_in_flight() -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", _start(_SSE), _body(_EVENT, more=True), "boom"),
                            metrics=metrics)
    with pytest.raises(Boom):
        _run(mw, _scope(), _upload())
    assert _seen(reg) == _recorded("error", durations=_HELLO)


def test_a_client_that_disconnects_mid_upload_is_counted_as_leaving() -> None:
    """The app reads on and is handed ``http.disconnect``; it gives up without answering."""
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read"), metrics=metrics)
    _run(mw, _scope(), _upload()[:1])
    assert _seen(reg) == _recorded("client_error", receive=0.0, images=0.0)


def test_a_client_that_disconnects_mid_stream_is_counted_as_leaving() -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", _start(_SSE), _body(_EVENT, more=True), "wait"),
                            metrics=metrics)
    _run(mw, _scope(), _upload())
    assert _seen(reg) == _recorded("client_error")


def test_an_app_that_stops_mid_stream_with_the_client_still_there_is_an_error() -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", _start(_SSE), _body(_EVENT, more=True)),
                            metrics=metrics)
    _run(mw, _scope(), _upload())
    assert _seen(reg) == _recorded("error", durations=_HELLO)


@pytest.mark.parametrize("at", [pytest.param(0, id="at-the-start"),
                                pytest.param(1, id="at-the-first-chunk"),
                                pytest.param(2, id="mid-stream")])
def test_a_server_that_cannot_write_counts_the_client_as_gone(at: int) -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", _start(_SSE), _body(_EVENT, more=True),
                                 _body(_EVENT, more=True), _body(b"")), metrics=metrics)
    with pytest.raises(OSError, match="the client is gone"):
        _run(mw, _scope(), _upload(), fail_send_at=at)
    assert _seen(reg) == _recorded("client_error")


def test_each_request_has_its_own_exchange() -> None:
    metrics, reg = _fresh()
    mw = MRCMeterMiddleware(_app("read", _start(_JSON), _body(_ANSWER)), metrics=metrics)
    for _ in range(3):
        _run(mw, _scope(), _upload())
    want = _recorded("ok", durations={("0-50", "<1MP"): 3.0}, receive=3.0,
                     tokens=(9.0, 6.0), images=3.0)
    want["outcomes"] = {"ok": 3.0}
    assert _seen(reg) == want


def _split_at(raw: bytes, inside: bytes, kind: str) -> list[Msg]:
    """``raw`` in two pieces cut in the middle of ``inside``, with a body message without
    ``body`` between them; the last piece says nothing of ``more_body``."""
    cut = raw.index(inside) + len(inside) // 2
    return [{"type": kind, "body": raw[:cut], "more_body": True},
            {"type": kind, "more_body": True}, {"type": kind, "body": raw[cut:]}]


def test_a_body_message_without_body_mid_body_adds_no_bytes() -> None:
    """Cut inside a key, a missing body read as anything but empty would rename the key: the
    60-character prompt and the completion tokens would be lost."""
    metrics, reg = _fresh()
    upload = _split_at(json.dumps(chat("p" * 60)).encode(), b'"content"', "http.request")
    answer = _split_at(_ANSWER, b'"completion_tokens"', "http.response.body")
    mw = MRCMeterMiddleware(_app("read", _start(_JSON), *answer), metrics=metrics)
    assert _run(mw, _scope(), upload)[1:] == answer
    assert _seen(reg) == _recorded("ok", durations={("50-100", "<1MP"): 1.0}, tokens=(3.0, 2.0))
