"""The reference service's OpenAI chat API (``POST /v1/chat/completions``) as a client meets it.

The service runs in this process (the embedded model, uvicorn on loopback), so that one test can
slow the model's stream down to leave in the middle of it; images behind ``http://`` come from a
loopback server of the test's own, through the fetch rules (the test flag admits 127.0.0.1 and
nothing else). Every answer is checked against what ``/metrics`` counted for it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from mrc_agent.reference_service.loadgen import make_photo, run_load
from mrc_agent.reference_service.model.streaming import TextPieces
from mrc_agent.reference_service.settings import Settings
from tests.conftest import REPO, parse_metrics, series, wait_until
from tests.integration.test_service_chain import InProcessService

CHAT = "/v1/chat/completions"
PHOTO = make_photo(1200, 1000, 3)  # 1.2 MP: the 1-4MP cell
SMALL = make_photo(400, 300, 4)
ERROR_KEYS = {"message", "type", "param", "code"}


def _data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def _messages(url: str, text: str = "Is the parcel damaged?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def service(cache_dir: Path) -> Iterator[InProcessService]:
    # OCR off: the chain is /mrc's (tests/integration/test_service_chain.py drives its OCR
    # step); 8 MiB images keep a body past the cap cheap to send.
    svc = InProcessService(Settings(cache_dir=cache_dir, ocr="off", max_concurrency=2,
                                    allow_loopback_fetch_for_tests=True, fetch_timeout_s=5.0,
                                    max_image_bytes=8 * 1024 * 1024))
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def model(service: InProcessService) -> str:
    data = httpx.get(service.url + "/v1/models", timeout=10).json()["data"]
    assert len(data) == 1 and data[0]["object"] == "model"
    return str(data[0]["id"])


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body, code = (PHOTO, 200) if self.path == "/photo.jpg" else (b"no such image", 404)
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        """Quiet: the test reads statuses, not the server's log."""


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _totals(service: InProcessService) -> dict[str, float]:
    m = parse_metrics(httpx.get(service.url + "/metrics", timeout=10).text)
    out = {"prompt": sum(series(m, "mrc_prompt_tokens_total")),
           "generated": sum(series(m, "mrc_generation_tokens_total")),
           "ttft": sum(series(m, "mrc_time_to_first_token_seconds_count")),
           "ttft_s": sum(series(m, "mrc_time_to_first_token_seconds_sum")),
           "in_flight": sum(series(m, "mrc_requests_in_flight")),
           "fetch": sum(series(m, "mrc_stage_duration_seconds_count", stage="fetch")),
           "generate": sum(series(m, "mrc_stage_duration_seconds_count", stage="generate")),
           "cell": sum(series(m, "mrc_request_duration_seconds_count", prompt_length="50-100",
                              resolution="1-4MP"))}
    for outcome in ("ok", "client_error", "error"):
        out[outcome] = sum(series(m, "mrc_requests_total", outcome=outcome))
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _events(r: httpx.Response) -> list[Any]:
    """A stream's events in order: each ``data:`` payload decoded, ``[DONE]`` as the string."""
    out: list[Any] = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", line  # nothing but data lines and the blank lines ending them
    return out


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and set(r.json()) == {"error"}, r.text
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return dict(error)


# ------------------------------------------------------------------------ answers and usage


def test_a_whole_answer_is_a_chat_completion_whose_usage_is_what_the_metrics_counted(
        service: InProcessService, model: str) -> None:
    # A system message's text joins the prompt: 23 + 1 + 44 = 68 characters, the 50-100 cell.
    messages = [{"role": "system", "content": "You read parcel labels."},
                *_messages(_data_url(PHOTO), "What is written on the label of this parcel?")]
    before = _totals(service)
    r = httpx.post(service.url + CHAT, json={"model": model, "messages": messages,
                                             "max_tokens": 6}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == model
    assert body["id"].startswith("chatcmpl-") and r.headers["x-mrc-cached"] == "false"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= 6
    assert choice["finish_reason"] == ("length" if usage["completion_tokens"] == 6 else "stop")
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    d = _delta(before, _totals(service))
    assert d["prompt"] == usage["prompt_tokens"] > 0
    assert d["generated"] == usage["completion_tokens"]
    # Counted once, in its prompt x resolution cell, with its stages and TTFT (a whole answer's
    # first token, as on /mrc).
    assert (d["ok"], d["client_error"], d["cell"], d["generate"], d["ttft"]) == (1, 0, 1, 1, 1)
    assert d["in_flight"] == 0

    # The same question on /mrc is the same request to the chain: answered from the cache.
    mrc = httpx.post(service.url + "/mrc", json={
        "image": base64.b64encode(PHOTO).decode(), "max_new_tokens": 6,
        "text_prompt": "You read parcel labels.\nWhat is written on the label of this parcel?"},
        timeout=60).json()
    assert mrc["cached"] is True and mrc["answer"] == choice["message"]["content"]


def test_a_stream_sends_the_answer_in_pieces_then_its_usage_and_done(
        service: InProcessService, model: str) -> None:
    request = {"model": model, "messages": _messages(_data_url(SMALL), "Colour of the box?"),
               "max_completion_tokens": 12, "stream": True,
               "stream_options": {"include_usage": True}}
    before = _totals(service)
    t0 = time.perf_counter()
    first_content = None
    with httpx.stream("POST", service.url + CHAT, json=request, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = []
        for event in _events(r):
            events.append(event)
            if first_content is None and event != "[DONE]" and event["choices"] and \
                    event["choices"][0]["delta"].get("content"):
                first_content = time.perf_counter() - t0
    after = _totals(service)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and {c["model"] for c in chunks} == {model}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert len(pieces) >= 2 and all(pieces)  # piece by piece, never an empty one
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] in ("stop", "length")
    # Every chunk carries usage: null but the last, which has no choices and the usage.
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    d = _delta(before, after)
    assert (d["prompt"], d["generated"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert usage["completion_tokens"] <= 12 and (finish["finish_reason"] == "length") is (
        usage["completion_tokens"] == 12)
    # TTFT observed once, at the first streamed text: before the client read it.
    assert d["ttft"] == 1 and first_content is not None and 0 < d["ttft_s"] <= first_content
    assert (d["ok"], d["in_flight"]) == (1, 0)

    # The pieces joined are the answer: the same request whole is the cached answer.
    again = httpx.post(service.url + CHAT, json={**request, "stream": False,
                                                 "stream_options": None}, timeout=60)
    assert again.headers["x-mrc-cached"] == "true"
    assert again.json()["choices"][0]["message"]["content"] == "".join(pieces)
    assert again.json()["usage"] == usage


def test_a_stream_without_include_usage_has_no_usage_and_a_cached_one_comes_whole(
        service: InProcessService) -> None:
    request = {"messages": _messages(_data_url(SMALL), "Is the seal intact?"),
               "max_tokens": 5, "stream": True}
    for cached in ("false", "true"):
        before = _totals(service)
        with httpx.stream("POST", service.url + CHAT, json=request, timeout=60) as r:
            assert r.status_code == 200 and r.headers["x-mrc-cached"] == cached
            events = _events(r)
        assert events[-1] == "[DONE]" and all("usage" not in c for c in events[:-1])
        contents = [c["choices"][0]["delta"].get("content") for c in events[1:-2]]
        d = _delta(before, _totals(service))
        if cached == "true":
            # One piece; the model made nothing, so no token and no TTFT is counted.
            assert len(contents) == 1 and (d["generated"], d["ttft"], d["ok"]) == (0, 0, 1)
        else:
            assert len(contents) >= 1 and d["generated"] >= 1 and d["ttft"] == 1


def test_an_http_image_url_is_fetched_through_the_fetch_rules(
        service: InProcessService, images: str) -> None:
    before = _totals(service)
    r = httpx.post(service.url + CHAT, json={
        "messages": _messages(images + "/photo.jpg"), "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    d = _delta(before, _totals(service))
    assert (d["fetch"], d["ok"], d["generated"]) == (1, 1, r.json()["usage"]["completion_tokens"])

    param = "messages[0].content[1].image_url.url"
    refused = [
        (images + "/missing.jpg", 502, "fetch_failed"),  # the upstream's 404: its fault
        (images.replace("127.0.0.1", "[::1]") + "/photo.jpg", 400, "url_not_allowed"),
        ("ftp://127.0.0.1/photo.jpg", 400, "url_not_allowed"),
        ("photo.jpg", 400, "url_not_allowed"),  # neither a data: URL nor an http(s) one
    ]
    for url, status, code in refused:
        error = _error(httpx.post(service.url + CHAT, json={"messages": _messages(url)},
                                  timeout=30), status, code)
        assert error["param"] == param, url


# ------------------------------------------------------------------------------ bad inputs

_GOOD = _messages(_data_url(SMALL))
_PART = "messages[0].content[1]"
BAD: list[tuple[str, Any, int, str, str | None]] = [
    ("malformed JSON", b'{"messages": [', 400, "bad_request", None),
    ("invalid UTF-8", b'{"messages": "\xff"}', 400, "invalid_utf8", None),
    ("a body that is no object", [], 400, "invalid_value", None),
    ("missing messages", {"max_tokens": 4}, 400, "invalid_value", "messages"),
    ("empty messages", {"messages": []}, 400, "invalid_value", "messages"),
    ("content of the wrong type", {"messages": [{"role": "user", "content": 5}]}, 400,
     "invalid_value", "messages[0].content"),
    ("no image", {"messages": [{"role": "user", "content": "What is it?"}]}, 400,
     "invalid_value", "messages"),
    ("two images", {"messages": [{"role": "user", "content": [
        *_GOOD[0]["content"], {"type": "image_url", "image_url": {"url": _data_url(SMALL)}}]}]},
     400, "unsupported", "messages[0].content[2].image_url.url"),
    ("bad base64", {"messages": _messages("data:image/png;base64,!!!!")}, 400, "bad_base64",
     f"{_PART}.image_url.url"),
    ("a data URL that is no image", {"messages": _messages(
        "data:image/png;base64," + base64.b64encode(b"not a picture").decode())}, 415,
     "not_an_image", f"{_PART}.image_url.url"),
    ("the same, streamed: refused before the stream", {"stream": True, "messages": _messages(
        "data:image/png;base64," + base64.b64encode(b"not a picture").decode())}, 415,
     "not_an_image", f"{_PART}.image_url.url"),
    ("a wrong model", {"model": "gpt-4o", "messages": _GOOD}, 404, "model_not_found", "model"),
    ("an unsupported content part", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, 400,
     "unsupported", "messages[0].content[0].type"),
    ("a tool message", {"messages": [*_GOOD, {"role": "tool", "content": "42"}]}, 400,
     "unsupported", "messages[1].role"),
    ("n = 2", {"n": 2, "messages": _GOOD}, 400, "unsupported", "n"),
    ("JSON mode", {"response_format": {"type": "json_object"}, "messages": _GOOD}, 400,
     "unsupported", "response_format"),
    ("max_tokens 0", {"max_tokens": 0, "messages": _GOOD}, 400, "invalid_value", "max_tokens"),
    ("max_tokens true", {"max_tokens": True, "messages": _GOOD}, 400, "invalid_value",
     "max_tokens"),
    ("max_completion_tokens over the limit", {"max_completion_tokens": 257, "messages": _GOOD},
     400, "invalid_value", "max_completion_tokens"),
    ("stream not a boolean", {"stream": "yes", "messages": _GOOD}, 400, "invalid_value",
     "stream"),
    ("stream_options without a stream", {"stream_options": {"include_usage": True},
                                         "messages": _GOOD}, 400, "invalid_value",
     "stream_options"),
    ("a prompt over the limit", {"messages": _messages(_data_url(SMALL), "x" * 2001)}, 413,
     "prompt_too_long", "messages"),
]


@pytest.mark.parametrize(("why", "body", "status", "code", "param"), BAD,
                         ids=[case[0] for case in BAD])
def test_a_bad_request_gets_its_4xx_in_the_openai_shape_and_is_counted_once(
        service: InProcessService, why: str, body: Any, status: int, code: str,
        param: str | None) -> None:
    before = _totals(service)
    sent = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    error = _error(httpx.post(service.url + CHAT, timeout=30, **sent), status, code)
    assert error["param"] == param
    d = _delta(before, _totals(service))
    assert (d["client_error"], d["ok"], d["error"], d["generated"], d["in_flight"]) == \
        (1, 0, 0, 0, 0)


def test_fields_that_ask_for_nothing_more_than_the_service_does_are_accepted(
        service: InProcessService) -> None:
    r = httpx.post(service.url + CHAT, timeout=60, json={
        "messages": _GOOD, "max_tokens": 2, "n": 1, "logprobs": False, "top_logprobs": 0,
        "stop": None, "tools": [], "response_format": {"type": "text"}, "temperature": 0.7,
        "seed": 3, "user": "someone", "model": None, "stream": False})
    assert r.status_code == 200, r.text


def test_a_wrong_method_and_a_body_over_the_cap_get_the_openai_shape_too(
        service: InProcessService) -> None:
    before = _totals(service)
    _error(httpx.get(service.url + CHAT, timeout=10), 405, "method_not_allowed")
    big = b'{"messages": "' + b"A" * (12 * 1024 * 1024) + b'"}'
    _error(httpx.post(service.url + CHAT, content=big, timeout=60,
                      headers={"content-type": "application/json"}), 413, "image_too_large")
    assert _delta(before, _totals(service))["client_error"] == 2
    # /mrc keeps the service's own shape.
    r = httpx.post(service.url + "/mrc", content=b"{", timeout=10)
    assert r.status_code == 400 and set(r.json()["error"]) == {"code", "message"}


# ------------------------------------------------------------------ a client leaves mid-stream


class _SlowStream:
    """The served model, with each streamed piece ``piece_s`` late and a stream's generation
    ``start_s`` late: a stream long enough to leave."""

    def __init__(self, vlm: Any, piece_s: float = 0.02, start_s: float = 0.0) -> None:
        self._vlm, self.piece_s, self.start_s = vlm, piece_s, start_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vlm, name)

    def generate(self, *args: Any, on_text: Any = None, **kwargs: Any) -> Any:
        if on_text is not None:
            sink = on_text

            def on_text(piece: str) -> None:
                time.sleep(self.piece_s)
                sink(piece)
            time.sleep(self.start_s)
        return self._vlm.generate(*args, on_text=on_text, **kwargs)


def _send_stream(service: InProcessService, request: dict[str, Any]) -> socket.socket:
    body = json.dumps(request).encode()
    sock = socket.create_connection(("127.0.0.1", int(service.url.rsplit(":", 1)[1])), timeout=30)
    sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    return sock


def test_a_client_that_leaves_mid_stream_stops_its_generation_and_the_service_goes_on(
        service: InProcessService, caplog: pytest.LogCaptureFixture) -> None:
    request = {"messages": _messages(_data_url(SMALL), "Describe every corner of the box."),
               "max_tokens": 256, "stream": True}
    state = service.state
    real = state.vlm
    state.vlm = _SlowStream(real)
    before = _totals(service)
    try:
        with caplog.at_level(logging.INFO), _send_stream(service, request) as sock:
            seen = b""
            while seen.count(b"data: ") < 3:  # the role, then two pieces of text
                chunk = sock.recv(65536)
                assert chunk, seen
                seen += chunk
            assert seen.startswith(b"HTTP/1.1 200 ")
        # Gone: the request ends as the client's doing, having made far fewer than 256 tokens.
        wait_until(lambda: _delta(before, _totals(service))["client_error"] == 1, timeout=20)
        d = _delta(before, _totals(service))
        assert (d["ok"], d["error"], d["in_flight"]) == (0, 0, 0)
        assert 2 <= d["generated"] < 64
        assert any("code=client_closed" in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        state.vlm = real
    # The partial answer was not cached, and the service answers the same question whole.
    r = httpx.post(service.url + CHAT, json={**request, "stream": False}, timeout=60)
    assert r.status_code == 200 and r.headers["x-mrc-cached"] == "false"
    assert r.json()["usage"]["completion_tokens"] > d["generated"]


def test_a_client_that_leaves_before_its_first_text_stops_the_model_at_one_token(
        service: InProcessService) -> None:
    """Waiting for a slot or its first text, the request watches its client: gone, the
    generation stops at its first token (a stream noticed only once it started would make
    dozens at 1-2 ms each before the stop)."""
    request = {"messages": _messages(_data_url(SMALL), "Describe the tape on the box."),
               "max_tokens": 256, "stream": True}
    state = service.state
    real = state.vlm
    state.vlm = _SlowStream(real, piece_s=0.0, start_s=1.0)
    before = _totals(service)
    try:
        with _send_stream(service, request):
            time.sleep(0.3)  # inside the model's late start, before any text
        wait_until(lambda: _delta(before, _totals(service))["client_error"] == 1, timeout=20)
    finally:
        state.vlm = real
    d = _delta(before, _totals(service))
    assert (d["generated"], d["ok"], d["in_flight"]) == (1, 0, 0)


# ------------------------------------------------------------------------- the text pieces


def test_text_pieces_join_to_the_stripped_answer_and_never_split_a_character() -> None:
    tokens = [b" ", b" He", b"llo", b" ", b"\xc3", b"\xa9t\xc3", b"\xa9", b"  ", b"\n"]

    def decode(ids: list[int]) -> str:
        return b"".join(tokens[i] for i in ids).decode("utf-8", errors="replace")

    sent: list[str] = []
    pieces = TextPieces(decode, sent.append)
    for i in range(len(tokens)):
        pieces.add(i)
    pieces.finish()
    assert "".join(sent) == decode(list(range(len(tokens)))).strip() == "Hello \u00e9t\u00e9"
    # Whitespace waits for what follows it, a character for its last byte.
    assert sent == ["He", "llo", " \u00e9t\u00e9"]
    assert all("\ufffd" not in s for s in sent)


def test_text_pieces_never_take_back_text_and_wait_until_the_decoding_agrees_again() -> None:
    # A tokenizer's clean-up rewrites " ." once it knows more, then (here) undoes it.
    decoded = ["a ", "a .", "a.", "a.!", "a . b", "a . b c."]
    sent: list[str] = []
    pieces = TextPieces(lambda ids: decoded[min(len(ids), len(decoded)) - 1], sent.append)
    for i in range(len(decoded)):
        pieces.add(i)
    pieces.finish()
    assert sent == ["a", " .", " b", " c."] and pieces.sent == "a . b c."


# -------------------------------------------------------------------------- the load generator


def test_loadgen_sends_chat_completions_whole_and_streamed_by_default(
        service: InProcessService) -> None:
    before = _totals(service)
    outcome = asyncio.run(run_load(service.url, rate=6.0, duration=1.5, max_new_tokens=2,
                                   seed=7))
    assert outcome.sent >= 6 and not outcome.errors, outcome.errors
    assert set(outcome.by_api) == {"upload", "chat", "chat-stream"}
    assert dict(outcome.statuses) == {200: outcome.sent}
    assert len(outcome.ttfts) == outcome.by_api["chat-stream"]
    assert _delta(before, _totals(service))["ok"] == outcome.sent

    r = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "loadgen", "--url", service.url,
                        "--api", "chat-stream", "--rate", "4", "--duration", "1",
                        "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "by API: chat-stream " in r.stdout and "streamed time to first content p50" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "loadgen", "--url",
                          service.url, "--api", "grpc"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "--api" in bad.stderr

    from mrc_agent.agent.cli import build_parser

    assert build_parser().parse_args(["demo"]).api == "mix"
    assert build_parser().parse_args(["demo", "--api", "chat"]).api == "chat"


def test_the_openai_client_library_reads_both_answers(service: InProcessService,
                                                      model: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
    messages = _messages(_data_url(SMALL), "What is on the label?")
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    assert whole.choices[0].message.content and whole.usage.completion_tokens <= 4
    chunks = list(client.chat.completions.create(
        model=model, messages=_messages(_data_url(SMALL), "What else is on the label?"),
        max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert err.value.code == "model_not_found"
