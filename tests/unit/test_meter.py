"""The OpenAI meter's reading of the wire, without a network: the incremental JSON scan, image sizes
from the first bytes of a base64 upload, server-sent events, and what an exchange records."""

from __future__ import annotations

import base64
import io
import json
import struct
from typing import Any

import pytest
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest

from mrc_agent.exporters.imagewalk import walk
from mrc_agent.exporters.instrumentation import MRCMetrics
from mrc_agent.exporters.instrumentation.jsonscan import (
    CAPTURE,
    COUNT,
    ITEM,
    MAX_DEPTH,
    SKIP,
    JsonScanner,
)
from mrc_agent.exporters.instrumentation.meter import (
    IMAGE_HEAD_BYTES,
    MAX_SIDE,
    ChatRequestScan,
    Exchange,
    image_size,
    metered,
)
from tests.conftest import parse_metrics, series
from tests.openai_support import chat, data_url


class Recorder(JsonScanner):
    def __init__(self, count: set[tuple[Any, ...]], capture: set[tuple[Any, ...]]) -> None:
        super().__init__()
        self.count, self.capture = count, capture
        self.got: list[tuple[Any, ...]] = []

    def mode(self, path: tuple[str | None, ...]) -> int:
        return COUNT if path in self.count else CAPTURE if path in self.capture else SKIP

    def string(self, path: tuple[str | None, ...], value: bytes | int, cut: bool) -> None:
        self.got.append((path, value, cut))

    def literal(self, path: tuple[str | None, ...], text: bytes) -> None:
        self.got.append((path, text))


TEXT = ("messages", ITEM, "content", ITEM, "text")
URL = ("messages", ITEM, "content", ITEM, "image_url", "url")
TRICKY = 'héllo 😀 "q" \\ / \n tab\t ☃ 𝄞'


def _doc() -> dict[str, Any]:
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": [
        {"type": "text", "text": TRICKY},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA/BBB+"}}]}],
        "max_tokens": 12}


def _scan(chunks: list[bytes]) -> Recorder:
    r = Recorder({TEXT}, {URL})
    for c in chunks:
        r.feed(c)
    r.close()
    return r


@pytest.mark.parametrize("encoding", ["ascii", "utf8", "slashes"])
def test_the_scan_reads_the_same_values_whatever_the_chunking(encoding: str) -> None:
    doc = _doc()
    raw = (json.dumps(doc, ensure_ascii=encoding == "ascii").encode()
           if encoding != "slashes" else json.dumps(doc).replace("/", "\\/").encode())
    want = [(("stream",), b"true"), (TEXT, len(TRICKY), False),
            (URL, b"data:image/png;base64,AAA/BBB+", False), (("max_tokens",), b"12")]
    for cut in range(1, len(raw)):
        r = _scan([raw[:cut], raw[cut:]])
        assert r.failed is None and r.got == want, (cut, r.got, r.failed)
    assert _scan([raw[i:i + 1] for i in range(len(raw))]).got == want


def test_the_character_count_is_len_of_the_decoded_string() -> None:
    for text in ["", "a", "ü" * 70, "😀" * 30, "\\u00e9", "\x00\x1f", "𝄞" * 60 + "x"]:
        raw = json.dumps({"messages": [{"content": [{"text": text}]}]}).encode()
        r = _scan([raw])
        assert r.got == [(TEXT, len(text), False)], text


def test_a_capture_stops_at_its_limit_and_says_so() -> None:
    r = Recorder(set(), {URL})
    r.capture_limit = 10
    r.feed(json.dumps({"messages": [{"content": [{"image_url": {"url": "x" * 50}}]}]}).encode())
    r.close()
    assert r.got == [(URL, b"x" * 10, True)]


@pytest.mark.parametrize(("body", "reason"), [
    (b"[" * 100_000, f"nested more than {MAX_DEPTH} deep"),
    (b"[" + b"1," * 150_000 + b"1]", "more than 100000 values"),
    (b'{"a": "\\q"}', "an unknown escape in a string"),
    (b'{"a": "\\u12G4"}', "a \\u escape without four hex digits"),
    (b'{"messages": [{"content": "abc', "the body ended inside a value"),
    (b'{"model": "m", "max_tokens": 5', "the body ended inside a value"),
    (b'{"stream": fal', "the body ended inside a value"),
    (b"", "no JSON value in the body"),
    (b" \r\n", "no JSON value in the body"),
    (b"]", "a closing bracket with nothing open"),
])
def test_a_body_that_is_not_json_stops_the_scan_with_a_reason(body: bytes, reason: str) -> None:
    r = _scan([body])
    assert r.failed == reason


def test_invalid_utf8_is_counted_not_refused() -> None:
    raw = b'{"messages": [{"content": [{"text": "ab\xff\xfecd"}]}]}'
    r = _scan([raw])
    assert r.failed is None and r.got == [(TEXT, 6, False)]


# --- image sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_the_size_comes_from_the_head_of_a_data_url(fmt: str) -> None:
    url = data_url(1234, 567, fmt).encode()
    assert image_size(url) == (1234, 567)
    bare = url.split(b",", 1)[1]
    assert image_size(bare) == (1234, 567)
    assert image_size(bare.replace(b"+", b"-").replace(b"/", b"_")) == (1234, 567)


@pytest.mark.parametrize(("width", "height"), [(1, 1), (640, 480), (65535, 3), (MAX_SIDE, 7)])
def test_a_png_size_read_from_its_first_bytes_is_the_walks(width: int, height: int) -> None:
    # The first 24 bytes (signature and IHDR) are read without the walk: its size, and its
    # refusal of an unbelievable one, must be the walk's on the same bytes.
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height)
    rest = b"\x08\x02\x00\x00\x00" + b"\x00" * 800
    url = base64.b64encode(head + rest)
    layout = walk(base64.b64decode(url))
    assert layout is not None and layout.size == (width, height)
    assert image_size(url) == (width, height)
    spaced = b"\n".join(url[i:i + 7] for i in range(0, len(url), 7))  # wrapped, as MIME does
    assert image_size(spaced) == (width, height)
    zero = base64.b64encode(head[:16] + struct.pack(">II", 0, height) + rest)
    assert image_size(zero) is None  # a side of 0 is not believable, as through the walk
    assert image_size(url[:31]) is None  # fewer than 24 bytes: no size


def test_a_jpeg_whose_frame_header_follows_a_large_exif_is_read() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4000, 3000)).save(buf, "JPEG", exif=b"Exif\x00\x00" + b"\x00" * 60000)
    url = b"data:image/jpeg;base64," + base64.b64encode(buf.getvalue())
    assert image_size(url) == (4000, 3000)


@pytest.mark.parametrize("url", [
    b"https://images.example/cat.jpg", b"HTTP://images.example/cat.jpg",
    b"data:image/png,rawbytes", b"data:image/png;base64,!!!!", b"", b"file:///etc/passwd",
    b"data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff" + b"\xff" * (1 << 20)),
    b"data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n"),
])
def test_an_image_whose_head_does_not_tell_its_size_is_unknown(url: bytes) -> None:
    assert image_size(url) is None


def test_the_largest_image_decides_and_an_unknown_one_makes_it_unknown() -> None:
    def scan(body: dict[str, Any]) -> ChatRequestScan:
        s = ChatRequestScan()
        s.feed(json.dumps(body).encode())
        s.close()
        return s

    s = scan(chat("p" * 10, data_url(100, 100), data_url(2000, 1500), data_url(640, 480)))
    assert (s.images, s.largest, s.prompt_chars, s.stream) == (3, (2000, 1500), 10, False)
    s = scan(chat("", data_url(100, 100), "https://example.com/a.png", stream=True))
    assert (s.images, s.largest, s.stream) == (2, None, True)
    s = scan({"messages": [{"role": "system", "content": "sys"},
                           {"role": "user", "content": "hello"}]})
    assert (s.images, s.largest, s.prompt_chars) == (0, (0, 0), 8)
    s = scan({"prompt": "complete this", "max_tokens": 3})
    assert s.prompt_chars == 13


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 0, 2), (2, 0, 1), (0, 2, 1)])
def test_the_largest_image_is_by_pixels_not_by_one_side(order: tuple[int, int, int]) -> None:
    """The widest (4000x200) and the tallest (200x4000) hold 0.8 MP each; 1500x1500 holds
    2.25 MP and decides the cell wherever it stands among them."""
    urls = [data_url(4000, 200), data_url(1500, 1500), data_url(200, 4000)]
    s = ChatRequestScan()
    s.feed(json.dumps(chat("", *[urls[i] for i in order])).encode())
    s.close()
    assert (s.images, s.largest) == (3, (1500, 1500))


@pytest.mark.parametrize("body", [
    json.dumps(chat("q" * 70, data_url(100, 100), data_url(2000, 1500), stream=True)),
    json.dumps(chat("", data_url(100, 100), "https://example.com/a.png")),
    json.dumps({"messages": [{"role": "system", "content": "sys é😀"},
                             {"role": "user", "content": [{"type": "text", "text": "x"},
                                                          {"image_url": data_url(64, 64)}]}]}),
    json.dumps({"prompt": ["one", "two", 3], "stream": False}),
    json.dumps({"messages": "not a list", "stream": "true"}),
    json.dumps([1, 2, 3]),
    r'{"messages": [{"content": "ab\udcff \ud83d\ude00 \ud83d"}]}',
])
def test_a_whole_body_reads_as_the_scan_reads_it(body: str) -> None:
    raw = body.encode("utf-8", "surrogatepass")
    whole, scanned = ChatRequestScan(), ChatRequestScan()
    whole.whole(raw)
    for i in range(0, len(raw), 5):
        scanned.feed(raw[i:i + 5])
    scanned.close()
    assert whole.failed is None and scanned.failed is None
    assert (whole.prompt_chars, whole.images, whole.largest, whole.stream) == (
        scanned.prompt_chars, scanned.images, scanned.largest, scanned.stream)


def test_an_image_head_is_read_only_up_to_its_bound() -> None:
    s = ChatRequestScan()
    huge = "data:image/png;base64," + "A" * (8 << 20)
    s.feed(json.dumps(chat("x", huge)).encode())
    s.close()
    assert s.capture_limit < 2 * IMAGE_HEAD_BYTES and s.images == 1 and s.largest is None


# --- exchanges ------------------------------------------------------------------------------


def _metrics() -> tuple[MRCMetrics, CollectorRegistry]:
    reg = CollectorRegistry()
    return MRCMetrics(registry=reg, resolution_unknown=True), reg


def _values(reg: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return parse_metrics(generate_latest(reg).decode())


def _events(*objs: Any) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode())
                    + b"\n\n" for o in objs)


def _delta(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_a_stream_records_ttft_tpot_and_the_usage_tokens() -> None:
    m, reg = _metrics()
    x = Exchange(m)
    raw = json.dumps(chat("q" * 60, data_url(1500, 1000), stream=True)).encode()
    x.request_body(raw[:100], True)
    x.request_body(raw[100:], False)
    x.response_start(200, "text/event-stream; charset=utf-8")
    body = _events({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                   _delta("a"), _delta("b"), {"choices": [], "usage": {
                       "prompt_tokens": 40, "completion_tokens": 2}}, b"[DONE]")
    for i in range(0, len(body), 7):  # events cut anywhere
        x.response_body(body[i:i + 7], True)
    x.response_body(b"", False)
    x.finish()
    v = _values(reg)
    cell = {"prompt_length": "50-100", "resolution": "1-4MP"}
    for family in ("mrc_request_duration_seconds_count", "mrc_time_to_first_token_seconds_count",
                   "mrc_time_per_output_token_seconds_count"):
        assert series(v, family, **cell) == [1.0], family
    assert series(v, "mrc_requests_total", outcome="ok") == [1.0]
    assert series(v, "mrc_prompt_tokens_total") == [40.0]
    assert series(v, "mrc_generation_tokens_total") == [2.0]
    assert series(v, "mrc_request_images_count") == [1.0]
    assert series(v, "mrc_stage_duration_seconds_count", stage="receive") == [1.0]
    assert series(v, "mrc_requests_in_flight") == [0.0]


def test_a_stream_without_usage_counts_no_tokens_and_has_no_tpot() -> None:
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q", stream=True, usage=False)).encode(), False)
    x.response_start(200, "text/event-stream")
    x.response_body(_events(_delta("a"), _delta("b"), _delta("c"), b"[DONE]"), False)
    x.finish()
    v = _values(reg)
    assert sum(series(v, "mrc_time_to_first_token_seconds_count")) == 1.0
    assert sum(series(v, "mrc_time_per_output_token_seconds_count")) == 0.0
    assert series(v, "mrc_generation_tokens_total") == [0.0]


def test_a_tool_call_is_a_first_token_as_text_is() -> None:
    """A stream whose content is a function call alone (``content`` null, then
    ``tool_calls`` deltas, as the OpenAI API streams them) has a first token."""
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q", stream=True, usage=False)).encode(), False)
    x.response_start(200, "text/event-stream")
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": ""}}
    x.response_body(_events(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '{"q": 1}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}, b"[DONE]"),
        False)
    x.finish()
    v = _values(reg)
    assert sum(series(v, "mrc_time_to_first_token_seconds_count")) == 1.0
    assert series(v, "mrc_requests_total", outcome="ok") == [1.0]


def test_a_plain_answer_records_usage_but_no_first_token() -> None:
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q", "https://example.com/x.jpg")).encode(), False)
    x.response_start(200, "application/json")
    x.response_body(json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": {
        "prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}).encode(), False)
    x.finish()
    v = _values(reg)
    assert series(v, "mrc_request_duration_seconds_count", prompt_length="0-50",
                  resolution="unknown") == [1.0]
    assert sum(series(v, "mrc_time_to_first_token_seconds_count")) == 0.0
    assert series(v, "mrc_prompt_tokens_total") == [9.0]
    assert series(v, "mrc_generation_tokens_total") == [4.0]


@pytest.mark.parametrize(("how", "outcome"), [
    ("client_left", "client_error"), ("server_died", "error"), ("error_event", "error"),
    ("refused", "client_error"), ("overloaded", "overloaded"),
])
def test_outcomes_follow_how_the_answer_ended(how: str, outcome: str) -> None:
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q", stream=True)).encode(), False)
    status = {"refused": 400, "overloaded": 503}.get(how, 200)
    x.response_start(status, "text/event-stream")
    x.response_body(_events(_delta("a")), True)
    if how == "error_event":
        x.response_body(_events({"error": {"message": "engine died", "code": 500}}), False)
    elif how in ("refused", "overloaded"):
        x.response_body(b"", False)
    x.finish(client_left=how == "client_left")
    v = _values(reg)
    assert series(v, "mrc_requests_total", outcome=outcome) == [1.0]
    assert sum(series(v, "mrc_requests_total")) == 1.0


def test_a_body_that_is_not_json_is_counted_in_no_cell() -> None:
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(b'{"messages": [', False)
    x.response_start(400, "application/json")
    x.response_body(b'{"error": {}}', False)
    x.finish()
    v = _values(reg)
    assert series(v, "mrc_requests_total", outcome="client_error") == [1.0]
    assert sum(series(v, "mrc_request_duration_seconds_count")) == 0.0


def test_an_oversized_event_counts_as_content_unread() -> None:
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q", stream=True)).encode(), False)
    x.response_start(200, "text/event-stream")
    x.response_body(b"data: " + b"x" * (200 * 1024), True)
    x.response_body(b"\n\n" + _events({"choices": [], "usage": {"completion_tokens": 1}}), False)
    x.finish()
    v = _values(reg)
    assert sum(series(v, "mrc_time_to_first_token_seconds_count")) == 1.0
    assert series(v, "mrc_generation_tokens_total") == [1.0]


def test_only_posts_to_the_openai_paths_are_metered() -> None:
    assert metered("POST", "/v1/chat/completions")
    assert metered("POST", "/api/v1/completions")
    assert not metered("GET", "/v1/chat/completions")
    assert not metered("POST", "/v1/embeddings")
    assert not metered("POST", "/v1/chat/completions/x")


def test_metrics_without_the_unknown_cell_refuse_an_unknown_image() -> None:
    tracker = MRCMetrics().request()
    with pytest.raises(ValueError, match="unknown resolution cell"):
        tracker.set_image_unknown()


@pytest.mark.parametrize("calls", [
    "whole", "then_end", "two_then_end", "answer_before_end", "cut_off"])
def test_the_same_exchange_however_a_transport_hands_it_over(calls: str) -> None:
    """A proxy hands the body's end over as a call of its own, and may hand its answer over
    before that end: the cells, tokens and outcome are the same each way."""
    m, reg = _metrics()
    x = Exchange(m)
    raw = json.dumps(chat("q" * 60, data_url(1500, 1000))).encode()
    answer = json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": {
        "prompt_tokens": 9, "completion_tokens": 4}}).encode()
    pieces = {"whole": [(raw, False)], "then_end": [(raw, True), (b"", False)],
              "two_then_end": [(raw[:50], True), (raw[50:], True), (b"", False)],
              "answer_before_end": [(raw, True)], "cut_off": [(raw, True), (b"", False)]}
    for chunk, more in pieces[calls]:
        x.request_body(chunk, more)
    x.response_start(200, "application/json")
    x.response_body(answer, True)
    if calls != "cut_off":
        x.response_body(b"", False)
    x.finish()
    v = _values(reg)
    assert series(v, "mrc_request_duration_seconds_count", prompt_length="50-100",
                  resolution="1-4MP") == [1.0]
    assert series(v, "mrc_prompt_tokens_total") == [9.0]
    assert series(v, "mrc_generation_tokens_total") == [4.0]
    assert series(v, "mrc_requests_total", outcome="ok" if calls != "cut_off" else "error") \
        == [1.0]
