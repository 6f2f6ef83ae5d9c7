"""The OpenAI meter's units pinned at their edges: which bytes of a data URL the image size comes
from (the first comma, the 32-character PNG path, padding, the whitespace slack of a window),
the request and answer scans read whole, the server-sent events' hot path, framing and limits,
and the exchange's state machine: when a body is read whole, what a failure stops and how it is
counted and logged, and which clock readings its stage, TTFT and TPOT come from."""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import struct
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest

from mrc_agent.exporters.instrumentation import MRCMetrics, meter, metrics
from mrc_agent.exporters.instrumentation.families import METER_STAGES
from mrc_agent.exporters.instrumentation.meter import (
    EVENT_LIMIT,
    MAX_SIDE,
    WHOLE_LIMIT,
    ChatRequestScan,
    EventScan,
    Exchange,
    UsageScan,
    image_size,
)
from mrc_agent.exporters.instrumentation.metrics import RequestTracker
from tests.conftest import parse_metrics, series
from tests.openai_support import chat, data_url


def _png_head(width: int, height: int, name: bytes = b"IHDR") -> bytes:
    ihdr = struct.pack(">I4sII", 13, name, width, height) + b"\x08\x02\x00\x00\x00"
    return b"\x89PNG\r\n\x1a\n" + ihdr


_b64 = base64.b64encode


def _metrics() -> tuple[MRCMetrics, CollectorRegistry]:
    reg = CollectorRegistry()
    return MRCMetrics(registry=reg, resolution_unknown=True), reg


def _values(reg: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return parse_metrics(generate_latest(reg).decode())


def _total(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return sum(series(_values(reg), name, **labels))


def _boom(*args: Any, **kwargs: Any) -> None:
    raise ZeroDivisionError("a bug in the meter")


def _calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[Any]:
    """Wrap ``owner.name`` so that each call's first argument after ``self`` is recorded."""
    real: Callable[..., Any] = getattr(owner, name)
    seen: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[1] if isinstance(owner, type) else args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen


class Clock:  # a perf_counter the test moves by hand, in the meter and in the tracker

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: float = 0.0) -> None:
        self.now = now
        monkeypatch.setattr(meter, "perf_counter", self)
        monkeypatch.setattr(metrics, "perf_counter", self)

    def __call__(self) -> float:
        return self.now


# --- image_size: which bytes tell the size ----------------------------------------------------


def test_a_remote_url_is_never_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    png = _b64(_png_head(64, 48) + bytes(40))
    monkeypatch.setattr(meter, "walk", _boom)
    monkeypatch.setattr(meter, "binascii", SimpleNamespace(a2b_base64=_boom, Error=binascii.Error))
    for url in (b"http://" + png, b"https://" + png, b"HTTP://" + png, b"HttpS://" + png):
        assert image_size(url) is None, url


@pytest.mark.parametrize(("header", "want"), [
    pytest.param(b"data:image/png;base64,", (64, 48), id="plain"),
    pytest.param(b"data:image/png;" + b"p" * (511 - 22) + b";base64,", (64, 48),
                 id="comma-at-511"),
    pytest.param(b"data:image/png;" + b"p" * (512 - 22) + b";base64,", None, id="comma-at-512"),
    pytest.param(b"data:image/png;name=a,b;base64,", None, id="first-comma-ends-media-type"),
])
def test_the_first_comma_within_512_bytes_ends_the_media_type(header: bytes,
                                                              want: Any) -> None:
    url = header + _b64(_png_head(64, 48) + bytes(40))
    assert image_size(url) == want


@pytest.mark.parametrize(("spell", "walks"), [
    pytest.param(lambda b: b, 0, id="plain"),
    pytest.param(lambda b: b"\n".join(b[i:i + 7] for i in range(0, len(b), 7)), 0,
                 id="wrapped"),
    pytest.param(lambda b: b" " * 64 + b, 0, id="32-chars-within-96"),
    pytest.param(lambda b: b" " * 65 + b, 1, id="31-chars-within-96"),
])
def test_a_png_size_comes_from_its_first_32_characters_without_the_walk(
        monkeypatch: pytest.MonkeyPatch, spell: Callable[[bytes], bytes], walks: int) -> None:
    url = b"data:image/png;base64," + spell(_b64(_png_head(3000, 2000) + bytes(60)))
    seen = _calls(monkeypatch, meter, "walk")
    assert image_size(url) == (3000, 2000)
    assert len(seen) == walks


def test_the_32_character_path_reads_only_a_png_signature_and_ihdr() -> None:
    not_png = bytes(12) + b"IHDR" + struct.pack(">II", 10, 10)  # 24 bytes, no signature
    assert image_size(_b64(not_png)) is None
    other_chunk = _png_head(10, 10, b"tEXt")[:24]  # a signature, then not IHDR
    assert image_size(_b64(other_chunk)) is None


def _gif_head(width: int, height: int, n: int) -> bytes:
    return (b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00" + bytes(n))[:n]


def test_an_unpadded_head_shorter_than_32_characters_is_read_whole_quanta() -> None:
    text = _b64(_gif_head(321, 123, 22)).rstrip(b"=")  # 30 characters, padding dropped
    assert len(text) == 30
    assert image_size(b"data:image/gif;base64," + text) == (321, 123)
    assert image_size(text) == (321, 123)


def test_the_first_padding_character_ends_the_data() -> None:
    gif = _b64(_gif_head(321, 123, 22))  # ends in "=="
    assert image_size(b"data:image/gif;base64," + gif + b"AAAA") == (321, 123)
    # 15 bytes, "=", then what a decoder of the whole 32 characters refuses: read up to "=".
    assert image_size(b"data:image/gif;base64," + _b64(_gif_head(321, 123, 15)) + b"=" +
                      b"A" * 11) == (321, 123)
    # Padding first: no data, whatever follows (a lenient decoder skips the "=" and reads on).
    assert image_size(b"data:image/gif;base64,====" + _b64(_gif_head(321, 123, 21)) + b"=") \
        is None
    assert image_size(b"data:image/gif;base64,AAAA=" + gif) is None


def _jpeg_past_768_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (300, 200)).save(buf, "JPEG", exif=b"Exif\x00\x00" + bytes(1500))
    return _b64(buf.getvalue())


@pytest.mark.parametrize(("spaces", "want"), [(0, (300, 200)), (64, (300, 200)), (65, None)],
                         ids=["none", "64-at-the-slack", "65-past-it"])
def test_whitespace_past_a_windows_64_character_slack_reads_as_the_end_of_the_data(
        spaces: int, want: Any) -> None:
    """The first window is 1024 characters and 64 more for whitespace: when its whitespace
    leaves fewer than 1024, the head is taken to end there (no second window is read)."""
    url = b"data:image/jpeg;base64," + b" " * spaces + _jpeg_past_768_bytes()
    assert image_size(url) == want


@pytest.mark.parametrize(("width", "height", "want"), [
    (7, MAX_SIDE, (7, MAX_SIDE)), (7, MAX_SIDE + 1, None),
    (MAX_SIDE, MAX_SIDE, (MAX_SIDE, MAX_SIDE)), (MAX_SIDE + 1, 7, None),
])
def test_a_side_is_believed_up_to_max_side(width: int, height: int, want: Any) -> None:
    assert image_size(_b64(_png_head(width, height) + bytes(40))) == want


# --- the request scan -------------------------------------------------------------------------


def test_of_images_with_equal_pixels_the_later_one_is_the_largest() -> None:
    s = ChatRequestScan()
    s.whole(json.dumps(chat("", data_url(100, 200), data_url(200, 100))).encode())
    assert (s.images, s.largest) == (2, (200, 100))
    s = ChatRequestScan()
    s.feed(json.dumps(chat("", data_url(200, 100), data_url(100, 200))).encode())
    s.close()
    assert (s.images, s.largest) == (2, (100, 200))


@pytest.mark.parametrize(("body", "stream"), [
    ({"stream": True, "max_tokens": 5}, True),
    ({"stream": False, "stream_options": {"include_usage": True}}, False),
    ({"n": True}, False),
])
def test_stream_is_the_top_level_stream_literal_alone(body: dict[str, Any],
                                                      stream: bool) -> None:
    raw = json.dumps(body).encode()
    fed, whole = ChatRequestScan(), ChatRequestScan()
    fed.feed(raw)
    fed.close()
    whole.whole(raw)
    assert (fed.stream, whole.stream) == (stream, stream)


def test_a_whole_body_counts_every_message_shape_the_api_sends() -> None:
    body = {"messages": [
        {"role": "system", "content": "sys"},  # 3
        "not a message",
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12345"},  # 5
        {"role": "user", "content": ["stray", {"type": "text", "text": "abcd"},  # 4
                                     {"type": "image_url", "image_url": data_url(64, 64)}]},
    ]}
    raw = json.dumps(body).encode()
    whole, fed = ChatRequestScan(), ChatRequestScan()
    whole.whole(raw)
    fed.feed(raw)
    fed.close()
    for s in (whole, fed):
        assert (s.prompt_chars, s.images, s.largest, s.failed) == (12, 1, (64, 64), None)


def test_a_whole_body_with_a_lone_surrogate_or_invalid_utf8_is_counted() -> None:
    raw = b'{"messages": [{"content": [{"text": "ab\xff\xfecd"}, ' \
          b'{"image_url": {"url": "data:image/png;base64,\\ud800AAAA"}}]}]}'
    s = ChatRequestScan()
    s.whole(raw)
    assert (s.failed, s.prompt_chars, s.images, s.largest) == (None, 6, 1, None)


def test_a_whole_body_that_is_not_json_fails_and_is_counted_in_no_cell() -> None:
    s = ChatRequestScan()
    s.whole(b'{"messages": [')
    assert s.failed == "not JSON"
    _, reg = _exchanged(b'{"messages": [', "application/json", [(b"{}", False)])
    assert series(_values(reg), "mrc_requests_total", outcome="ok") == [1.0]
    assert _total(reg, "mrc_request_duration_seconds_count") == 0
    assert _total(reg, "mrc_request_images_count") == 0


# --- the answer's usage -----------------------------------------------------------------------


@pytest.mark.parametrize(("body", "want"), [
    pytest.param(b'{"x": {"usage": {"prompt_tokens": 5}}, "usage": {"completion_tokens": 3}}',
                 (None, 3), id="only-after-the-last-usage-key"),
    pytest.param(b'{"x": {"prompt_tokens": 5}, "usage": {"completion_tokens": 3}}',
                 (None, 3), id="not-before-the-usage-key"),
    pytest.param(b'{"choices": [], "usage": {"prompt_tokens": 7}}', (7, None),
                 id="prompt-alone-parsed"),
    pytest.param(b'{"usage": {"prompt_tok\\u0065ns": 7, "completion_tok\\u0065ns": 5}}',
                 (7, 5), id="escaped-keys-parsed"),
    pytest.param(b'["usage"]', (None, None), id="not-an-object"),
    pytest.param(b'{"usage": 4}', (None, None), id="usage-not-an-object"),
])
def test_usage_of_a_whole_answer(body: bytes, want: tuple[Any, Any]) -> None:
    s = UsageScan()
    s.whole(body)
    assert (s.prompt_tokens, s.completion_tokens) == want


def test_usage_numbers_after_the_key_are_read_without_parsing_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meter, "_loads", _boom)
    s = UsageScan()
    s.whole(b'{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}} trailing')
    assert (s.prompt_tokens, s.completion_tokens) == (9, 4)


def test_an_answer_with_prompt_tokens_alone_counts_them_and_no_generation() -> None:
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q")).encode(), False)
    x.response_start(200, "application/json")
    x.response_body(b'{"choices": [], "usage": {"prompt_tokens": 7}}', False)
    x.finish()
    assert series(_values(reg), "mrc_prompt_tokens_total") == [7.0]
    assert series(_values(reg), "mrc_generation_tokens_total") == [0.0]


# --- server-sent events -----------------------------------------------------------------------


def _event(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _delta(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}


def _scan() -> tuple[EventScan, Exchange, CollectorRegistry]:
    m, reg = _metrics()
    x = Exchange(m)
    return EventScan(x), x, reg


def test_one_whole_event_per_chunk_is_read_without_searching_for_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meter, "_EVENT_END", SimpleNamespace(search=_boom))
    scan, x, _ = _scan()
    for obj in (_delta("a"), _delta("b"), {"choices": [{"delta": {}, "finish_reason": "stop"}]},
                USAGE, b"[DONE]"):
        scan.feed(_event(obj))
    assert (scan.events, scan.prompt_tokens, scan.completion_tokens, scan.error) == (3, 5, 3,
                                                                                    False)
    scan.feed(_event({"error": {"message": "engine died"}}))
    assert (scan.events, scan.error) == (3, True)
    x.finish()


def test_a_data_line_that_completes_a_pending_event_is_read_with_it() -> None:
    scan, x, _ = _scan()
    scan.feed(b'data: {"choices": [{"delta": {"content": "a"}}]}\n')
    scan.feed(b"data: {}\n\n")
    assert scan.events == 1
    x.finish()


@pytest.mark.parametrize("pieces", [1, 7], ids=["one-event-per-chunk", "cut-every-7"])
def test_the_last_content_events_time_is_kept_and_tpot_ends_there(
        monkeypatch: pytest.MonkeyPatch, pieces: int) -> None:
    clock = Clock(monkeypatch, 100.0)
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q", stream=True)).encode(), False)
    x.response_start(200, "text/event-stream")
    scan = x._resp
    assert isinstance(scan, EventScan)
    for t, obj in ((101.0, _delta("a")), (102.0, _delta("b")), (104.0, _delta("c")),
                   (110.0, USAGE), (111.0, b"[DONE]")):
        clock.now = t
        raw = _event(obj)
        step = len(raw) if pieces == 1 else pieces
        for i in range(0, len(raw), step):
            x.response_body(raw[i:i + step], True)
        if t == 101.0:
            assert scan.last == 101.0
    clock.now = 112.0
    x.response_body(b"", False)
    assert (scan.events, scan.last) == (3, 104.0)
    x.finish()
    v = _values(reg)
    assert sum(series(v, "mrc_time_to_first_token_seconds_sum")) == 1.0
    assert sum(series(v, "mrc_time_per_output_token_seconds_sum")) == 1.5  # (104-101)/(3-1)
    assert series(v, "mrc_generation_tokens_total") == [3.0]


def test_content_carried_by_a_usage_event_or_oversized_events_each_count() -> None:
    scan, x, _ = _scan()
    scan.feed(_event(_delta("a")) + _event(_delta("b")))
    scan.feed(_event({**_delta("c"), "usage": USAGE["usage"]}))
    assert (scan.events, scan.completion_tokens) == (3, 3)
    for _ in range(2):
        scan.feed(b"data: " + b"x" * (EVENT_LIMIT + 10))
        scan.feed(b"\n\n")
    assert scan.events == 5
    x.finish()


@pytest.mark.parametrize("after_split", [False, True], ids=["first", "after-a-split-event"])
@pytest.mark.parametrize(("size", "parsed"), [(EVENT_LIMIT, True), (EVENT_LIMIT + 1, False)],
                         ids=["at-the-limit", "one-past"])
def test_a_pending_event_is_parsed_up_to_event_limit_bytes(size: int, parsed: bool,
                                                          after_split: bool) -> None:
    scan, x, _ = _scan()
    if after_split:
        first = _event(_delta("a"))
        scan.feed(first[:10])
        scan.feed(first[10:])
        assert (scan.events, scan.pending) == (1, 0)
    head = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}'
    event = head + b" " * (size - len(head))
    scan.feed(event)
    assert scan.pending == (size if parsed else 0)
    scan.feed(b"\n\n")
    assert scan.completion_tokens == (3 if parsed else None)
    assert scan.events == (int(after_split) + (0 if parsed else 1))
    x.finish()


def test_nothing_is_held_after_an_oversized_piece_or_a_close() -> None:
    scan, x, _ = _scan()
    scan.feed(b"data: " + b"x" * (EVENT_LIMIT + 1))
    assert scan.pending == 0
    scan.close()
    assert (scan.pending, scan.events) == (0, 1)
    scan.feed(b'data: {"choices": [{"delta": {"content": "a"}}]}')
    assert scan.pending > 0
    scan.close()
    assert (scan.pending, scan.events) == (0, 2)
    x.finish()


@pytest.mark.parametrize("raw", [
    pytest.param(b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}'
                 b"\rid: 7\r\r", id="lone-cr-lines"),
    pytest.param(b'data:{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n',
                 id="no-space-after-data"),
    pytest.param(b'data:  {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}'
                 b"\n\n", id="two-spaces-after-data"),
])
def test_usage_is_read_however_its_data_line_is_framed(raw: bytes) -> None:
    scan, x, _ = _scan()
    scan.feed(raw[:3])
    scan.feed(raw[3:])
    scan.close()
    assert (scan.prompt_tokens, scan.completion_tokens) == (5, 3)
    x.finish()


def test_done_in_a_block_with_other_lines_is_no_event() -> None:
    scan, x, _ = _scan()
    scan.feed(_event(_delta("a")))
    scan.feed(b": keep-alive\nid: 9\ndata: [DONE]\n\n")
    scan.feed(b"event: x\ndata: [DONE]\r\n\r\n")
    assert scan.events == 1
    x.finish()


# --- the exchange: when a body is read whole --------------------------------------------------


def _padded_request(size: int) -> bytes:
    raw = json.dumps(chat("q")).encode()
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


@pytest.mark.parametrize(("pieces", "wholes"), [
    pytest.param([(b"1", True), (b"", False)], [b"1"], id="1-byte-then-end"),
    pytest.param([("body", True), (b"", False)], ["body"], id="body-then-end"),
    pytest.param([("body", False)], ["body"], id="body-alone"),
    pytest.param([(b"", True), ("body", False)], [], id="empty-first"),
    pytest.param([("limit", True), (b"", False)], ["limit"], id="limit-then-end"),
    pytest.param([("limit", False)], ["limit"], id="limit-alone"),
    pytest.param([("past", True), (b"", False)], [], id="past-limit-then-end"),
    pytest.param([("past", False)], [], id="past-limit-alone"),
])
def test_a_request_body_is_read_whole_when_it_came_in_one_small_piece(
        monkeypatch: pytest.MonkeyPatch, pieces: list[tuple[Any, bool]],
        wholes: list[Any]) -> None:
    bodies = {"body": json.dumps(chat("q" * 60)).encode(), "limit": _padded_request(WHOLE_LIMIT),
              "past": _padded_request(WHOLE_LIMIT + 1)}
    seen = _calls(monkeypatch, ChatRequestScan, "whole")
    m, reg = _metrics()
    x = Exchange(m)
    for chunk, more in pieces:
        x.request_body(bodies.get(chunk, chunk), more)
    assert seen == [bodies.get(w, w) for w in wholes]
    x.finish()


def test_the_rest_of_a_body_whose_end_was_read_at_the_answer_is_not_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    raw = json.dumps(chat("q" * 60)).encode()
    fed = _calls(monkeypatch, ChatRequestScan, "feed")
    wholes = _calls(monkeypatch, ChatRequestScan, "whole")
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(raw, True)
    x.response_start(200, "application/json")  # the answer before the body's end
    assert (fed, wholes) == ([raw], [])
    x.request_body(b"", False)
    x.request_body(b"{}", False)
    assert (fed, wholes) == ([raw], [])
    x.finish()


def test_a_large_body_in_two_pieces_is_read_to_its_end() -> None:
    raw = json.dumps(chat("q" * 70_000, data_url(1500, 1000))).encode()
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(raw[:WHOLE_LIMIT + 10], True)
    x.request_body(raw[WHOLE_LIMIT + 10:], False)
    x.response_start(200, "application/json")
    x.response_body(b"{}", False)
    x.finish()
    assert series(_values(reg), "mrc_request_duration_seconds_count",
                  prompt_length="100+", resolution="1-4MP") == [1.0]


def test_a_large_body_cut_off_is_counted_in_no_cell() -> None:
    raw = json.dumps(chat("q" * 70_000)).encode()[:WHOLE_LIMIT + 100]  # inside the text
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(raw, False)
    x.response_start(200, "application/json")
    x.response_body(b"{}", False)
    x.finish()
    assert series(_values(reg), "mrc_requests_total", outcome="ok") == [1.0]
    assert _total(reg, "mrc_request_duration_seconds_count") == 0


def test_the_receive_stage_runs_from_the_exchange_start_to_the_body_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch, 100.0)
    m, reg = _metrics()
    x = Exchange(m)
    raw = json.dumps(chat("q")).encode()
    clock.now = 100.125
    x.request_body(raw[:10], True)
    clock.now = 100.25
    x.request_body(raw[10:], False)
    assert series(_values(reg), "mrc_stage_duration_seconds_sum", stage="receive") == [0.25]
    x.finish()


def _answer(size: int = 0) -> bytes:
    raw = json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": {
        "prompt_tokens": 9, "completion_tokens": 4}}).encode()
    return raw[:-1] + b" " * max(0, size - len(raw)) + b"}"


@pytest.mark.parametrize(("pieces", "wholes"), [
    pytest.param([(b"1", True), (b"", False)], [b"1"], id="1-byte-then-end"),
    pytest.param([("answer", True), (b"", False)], ["answer"], id="answer-then-end"),
    pytest.param([(b"", True), ("answer", False)], ["answer"], id="empty-first"),
    pytest.param([("limit", True), (b"", False)], ["limit"], id="limit-then-end"),
    pytest.param([("limit", False)], ["limit"], id="limit-alone"),
    pytest.param([("past", True), (b"", False)], [], id="past-limit-then-end"),
    pytest.param([("past", False)], [], id="past-limit-alone"),
])
def test_an_answer_is_read_whole_when_it_came_in_one_small_piece(
        monkeypatch: pytest.MonkeyPatch, pieces: list[tuple[Any, bool]],
        wholes: list[Any]) -> None:
    answers = {"answer": _answer(), "limit": _answer(WHOLE_LIMIT),
               "past": _answer(WHOLE_LIMIT + 1)}
    seen = _calls(monkeypatch, UsageScan, "whole")
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q")).encode(), False)
    x.response_start(200, "application/json")
    for chunk, more in pieces:
        x.response_body(answers.get(chunk, chunk), more)
    x.finish()
    assert seen == [answers.get(w, w) for w in wholes]
    if wholes != [b"1"]:
        assert series(_values(reg), "mrc_generation_tokens_total") == [4.0]


@pytest.mark.parametrize("first", [40, WHOLE_LIMIT + 40], ids=["small", "large"])
def test_an_answer_whose_usage_is_cut_across_pieces_is_read_streamed(first: int) -> None:
    head = b'{"choices": [{"message": {"content": "' + b"w" * first + b'"}}], "usage": {'
    pieces = [head + b'"prompt_tokens": 9, ', b'"completion_tokens": 4}}']
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q")).encode(), False)
    x.response_start(200, "application/json")
    x.response_body(pieces[0], True)
    x.response_body(pieces[1], False)
    x.finish()
    assert series(_values(reg), "mrc_prompt_tokens_total") == [9.0]
    assert series(_values(reg), "mrc_generation_tokens_total") == [4.0]


def test_a_stream_media_type_with_two_parameters_is_read() -> None:
    x = Exchange(_metrics()[0])
    x.response_start(200, "Text/Event-Stream; charset=utf-8; x=y")
    assert isinstance(x._resp, EventScan)
    x.finish()


# --- the exchange: failures ------------------------------------------------------------------


def _errors(reg: CollectorRegistry) -> dict[str, float]:
    return {s: _total(reg, "mrc_meter_errors_total", stage=s) for s in METER_STAGES}


def _exchanged(request: bytes, media: str, answer: list[tuple[bytes, bool]]
               ) -> tuple[Exchange, CollectorRegistry]:
    """One exchange on a fresh meter: ``request`` in one piece, a 200 of ``media`` answered
    in ``answer``'s pieces, finished."""
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(request, False)
    x.response_start(200, media)
    for chunk, more in answer:
        x.response_body(chunk, more)
    x.finish()
    return x, reg


def _verdict(x: Exchange, reg: CollectorRegistry, outcome: str
             ) -> tuple[str | None, dict[str, float], list[float]]:
    """Which stage failed, the meter's errors by stage, and the requests counted ``outcome``."""
    return x.degraded, _errors(reg), series(_values(reg), "mrc_requests_total", outcome=outcome)


def test_a_request_failure_stops_the_request_reading_and_its_cell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChatRequestScan, "feed", _boom)
    raw = json.dumps(chat("q" * 70_000)).encode()
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(raw[:WHOLE_LIMIT + 1], True)
    x.request_body(raw[WHOLE_LIMIT + 1:WHOLE_LIMIT + 11], True)
    x.request_body(raw[WHOLE_LIMIT + 11:], False)
    x.response_start(200, "application/json")
    x.response_body(b"{}", False)
    x.finish()
    assert x.degraded == "request"
    assert _errors(reg) == {"request": 1, "response": 0, "finish": 0}
    assert _total(reg, "mrc_request_duration_seconds_count") == 0
    assert _total(reg, "mrc_stage_duration_seconds_count", stage="receive") == 0
    assert series(_values(reg), "mrc_requests_total", outcome="ok") == [1.0]


def test_a_failure_reading_the_body_end_late_is_a_request_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RequestTracker, "set_image", _boom)
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q", data_url(64, 64))).encode(), True)  # no end yet
    x.response_start(200, "application/json")
    x.response_body(_answer(), False)
    x.finish()
    assert x.degraded == "request"
    assert _errors(reg) == {"request": 1, "response": 0, "finish": 0}
    assert series(_values(reg), "mrc_generation_tokens_total") == [4.0]


def test_a_failure_choosing_the_answers_reader_is_a_response_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(UsageScan, "__init__", _boom)
    x, reg = _exchanged(json.dumps(chat("q")).encode(), "application/json", [(_answer(), False)])
    assert _verdict(x, reg, "ok") == (
        "response", {"request": 0, "response": 1, "finish": 0}, [1.0])


def test_a_response_failure_stops_the_answer_reading_and_counts_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EventScan, "feed", _boom)
    events = (_event(_delta("a")), _event(USAGE), b"data: [DONE]\n\n")
    x, reg = _exchanged(json.dumps(chat("q", stream=True)).encode(), "text/event-stream",
                        [(chunk, True) for chunk in events] + [(b"", False)])
    assert _verdict(x, reg, "ok") == (
        "response", {"request": 0, "response": 1, "finish": 0}, [1.0])


def test_a_finish_failure_keeps_the_error_event_of_the_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RequestTracker, "tokens", _boom)
    x, reg = _exchanged(json.dumps(chat("q", stream=True)).encode(), "text/event-stream",
                        [(_event(_delta("a")) + _event(USAGE), True),
                         (_event({"error": {"message": "engine died"}}), False)])
    assert _verdict(x, reg, "error") == (
        "finish", {"request": 0, "response": 0, "finish": 1}, [1.0])


def test_a_second_finish_changes_nothing() -> None:
    x, reg = _exchanged(json.dumps(chat("q")).encode(), "application/json", [(_answer(), False)])
    x.finish(client_left=True)
    v = _values(reg)
    assert series(v, "mrc_requests_total", outcome="ok") == [1.0]
    assert sum(series(v, "mrc_requests_total")) == 1.0
    assert series(v, "mrc_requests_in_flight") == [0.0]
    assert series(v, "mrc_generation_tokens_total") == [4.0]


WARNING = ("the OpenAI meter failed reading an exchange ({}); the request goes on, counted "
           "without the values this cost (mrc_meter_errors_total)")


def test_a_failure_is_logged_with_its_stage_and_traceback_a_warning_each_60_seconds(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ChatRequestScan, "whole", _boom)
    monkeypatch.setattr(meter, "_last_warning", {})
    now = [1000.0]
    monkeypatch.setattr(meter, "monotonic", lambda: now[0])
    m, _ = _metrics()
    with caplog.at_level(logging.DEBUG, logger=meter.__name__):
        for t in (1000.0, 1059.75, 1060.0, 1119.75, 1120.0):
            now[0] = t
            x = Exchange(m)
            x.request_body(b"{}", False)
            x.finish()
    got = [(r.levelno, r.getMessage(), r.exc_info is not None and r.exc_info[0])
           for r in caplog.records if r.name == meter.__name__]
    warn = (logging.WARNING, WARNING.format("request"), ZeroDivisionError)
    debug = (logging.DEBUG, WARNING.format("request").split(";")[0], ZeroDivisionError)
    assert got == [warn, debug, warn, debug, warn]

