"""The meter against bytes built to break it: every value it can meet ends in "unknown", never in
an exception; a failure of its own never fails the request nor leaves it in flight; and what it
costs grows with the bytes, not with their square (counted in steps here: timings live in
``benchmarks/bench_meter_scan.py``)."""

from __future__ import annotations

import base64
import json
import logging
import random
import struct
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mrc_agent.exporters.instrumentation import MRCMetrics, families, jsonscan, meter
from mrc_agent.exporters.instrumentation.meter import (
    MAX_COUNT,
    ChatRequestScan,
    EventScan,
    Exchange,
    UsageScan,
    image_size,
)
from mrc_agent.exporters.instrumentation.metrics import RequestTracker
from tests.conftest import parse_metrics, series
from tests.openai_support import chat, data_url

HUGE = int("1" + "0" * 399)  # 400 digits: no float holds it


def bmp_url(width: int, height: int) -> str:
    """A ``data:`` URL of a BMP header (BITMAPINFOHEADER) claiming ``width`` x ``height``."""
    header = b"BM" + bytes(12) + struct.pack("<Iii", 40, width, height) + bytes(40)
    return "data:image/bmp;base64," + base64.b64encode(header).decode()


def png_url(width: int, height: int) -> str:
    """A ``data:`` URL of a PNG signature and IHDR claiming ``width`` x ``height``."""
    ihdr = b"\x00\x00\x00\rIHDR" + struct.pack(">II", width, height) + bytes(9)
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + ihdr).decode()


def _metrics() -> tuple[MRCMetrics, CollectorRegistry]:
    reg = CollectorRegistry()
    return MRCMetrics(registry=reg, resolution_unknown=True), reg


def _values(reg: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return parse_metrics(generate_latest(reg).decode())


def _one(reg: CollectorRegistry, name: str, **labels: str) -> float:
    got = series(_values(reg), name, **labels)
    assert len(got) == 1, (name, labels, got)
    return got[0]


def _exchange(metrics: MRCMetrics, body: bytes, status: int, ctype: str,
              answer: list[bytes], client_left: bool = False) -> Exchange:
    x = Exchange(metrics)
    x.request_body(body, False)
    x.response_start(status, ctype)
    for i, piece in enumerate(answer):
        x.response_body(piece, i < len(answer) - 1)
    x.finish(client_left)
    return x


# --- A: every value ends in unknown -------------------------------------------------------


@pytest.mark.parametrize("url", [
    bmp_url(-5, 0), bmp_url(0, 10), bmp_url(10, 0), bmp_url(-1, -1), bmp_url(-2**31, 1),
    png_url(0, 0), png_url(2**32 - 1, 2**32 - 1),
])
def test_an_image_header_with_a_size_no_image_has_is_unknown(url: str) -> None:
    assert image_size(url.encode()) is None
    scan = ChatRequestScan()
    scan.whole(json.dumps(chat("look", url, data_url(64, 64))).encode())
    assert (scan.images, scan.largest, scan.failed) == (2, None, None)


def test_a_crafted_bmp_puts_the_request_in_the_unknown_cell_without_an_error() -> None:
    m, reg = _metrics()
    body = json.dumps(chat("look", bmp_url(-5, 0))).encode()
    x = _exchange(m, body, 200, "application/json", [b'{"choices": []}'])
    assert x.degraded is None
    assert _one(reg, "mrc_request_duration_seconds_count", prompt_length="0-50",
                resolution="unknown") == 1
    assert sum(series(_values(reg), "mrc_meter_errors_total")) == 0
    assert _one(reg, "mrc_requests_in_flight") == 0


UNBELIEVABLE: list[Any] = [HUGE, MAX_COUNT + 1, -1, 3.0, 1e400, "12", True, None,
                           {"n": 1}, [1], float("nan")]


@pytest.mark.parametrize("value", UNBELIEVABLE, ids=repr)
def test_a_usage_count_that_is_not_believable_is_no_count(value: Any) -> None:
    usage = {"prompt_tokens": value, "completion_tokens": value}
    body = json.dumps({"choices": [], "usage": usage}).encode()
    whole = UsageScan()
    whole.whole(body)
    streamed = UsageScan()
    for i in range(0, len(body), 7):
        streamed.feed(body[i:i + 7])
    streamed.close()
    m, _ = _metrics()
    events = EventScan(Exchange(m))
    events.feed(b"data: " + body + b"\n\n")
    for scan in (whole, streamed, events):
        assert (scan.prompt_tokens, scan.completion_tokens) == (None, None), scan


def test_the_largest_believable_count_is_read() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": MAX_COUNT,
                                                "completion_tokens": 3}}).encode()
    scan = UsageScan()
    scan.whole(body)
    assert (scan.prompt_tokens, scan.completion_tokens) == (MAX_COUNT, 3)


@pytest.mark.parametrize("ctype", ["application/json", "text/event-stream"])
def test_a_400_digit_usage_closes_the_request(ctype: str) -> None:
    m, reg = _metrics()
    usage = b'{"prompt_tokens": %d, "completion_tokens": %d}' % (HUGE, HUGE)
    if ctype == "application/json":
        answer = [b'{"choices": [{"message": {"content": "hi"}}], "usage": ' + usage + b"}"]
    else:
        answer = [b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n',
                  b'data: {"choices": [], "usage": ' + usage + b"}\n\n", b"data: [DONE]\n\n"]
    x = _exchange(m, json.dumps(chat("q")).encode(), 200, ctype, answer)
    assert x.degraded is None
    assert _one(reg, "mrc_requests_total", outcome="ok") == 1
    assert _one(reg, "mrc_requests_in_flight") == 0
    assert _one(reg, "mrc_generation_tokens_total") == 0


# --- B: the guard at the meter's boundary -------------------------------------------------


def _boom(*args: Any, **kwargs: Any) -> None:
    raise ZeroDivisionError("a bug in the meter")


@pytest.mark.parametrize(("target", "stage"), [
    ((ChatRequestScan, "whole"), "request"),
    ((RequestTracker, "set_image"), "request"),
    ((UsageScan, "whole"), "response"),
    ((RequestTracker, "tokens"), "finish"),
    ((RequestTracker, "_final"), "finish"),  # the tracker's own exit
])
def test_a_failure_of_the_meter_is_counted_and_the_request_still_ends(
        monkeypatch: pytest.MonkeyPatch, target: tuple[type, str], stage: str) -> None:
    monkeypatch.setattr(*target, _boom)
    m, reg = _metrics()
    body = json.dumps(chat("q", data_url(64, 64))).encode()
    answer = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
    x = _exchange(m, body, 200, "application/json; charset=utf-8", [answer])
    assert x.degraded == stage
    assert _one(reg, "mrc_meter_errors_total", stage=stage) == 1
    assert sum(series(_values(reg), "mrc_meter_errors_total")) == 1
    assert _one(reg, "mrc_requests_total", outcome="ok") == 1
    assert _one(reg, "mrc_requests_in_flight") == 0


@pytest.mark.parametrize("status", [200, 429, 500])
def test_a_stream_whose_reading_fails_is_counted_by_its_status(
        monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    monkeypatch.setattr(EventScan, "feed", _boom)
    m, reg = _metrics()
    x = Exchange(m)
    x.request_body(json.dumps(chat("q", stream=True)).encode(), False)
    x.response_start(status, "text/event-stream")
    x.response_body(b"data: {}\n\n", True)
    x.response_body(b"data: [DONE]\n\n", True)
    x.response_body(b"", False)
    x.finish()
    outcome = {200: "ok", 429: "overloaded", 500: "error"}[status]
    assert _one(reg, "mrc_requests_total", outcome=outcome) == 1
    assert _one(reg, "mrc_requests_in_flight") == 0
    assert x.degraded == ("response" if status < 400 else None)


def test_failures_are_logged_once_a_minute_then_at_debug(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ChatRequestScan, "whole", _boom)
    monkeypatch.setattr(meter, "_last_warning", {})
    m, _ = _metrics()
    with caplog.at_level(logging.DEBUG, logger=meter.__name__):
        for _ in range(3):
            _exchange(m, b"{}", 200, "application/json", [b"{}"])
    levels = [r.levelno for r in caplog.records if r.name == meter.__name__]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert caplog.records[0].exc_info is not None


def test_the_error_counter_is_declared_with_the_families() -> None:
    f = families.METER_ERRORS
    assert f in families.FAMILIES and f.kind == "counter" and f.labelnames == ("stage",)
    assert f.name == "mrc_meter_errors_total" and f.help.endswith(".")
    assert families.METER_STAGES == ("request", "response", "finish")
    _, reg = _metrics()
    for stage in families.METER_STAGES:  # every series from the first scrape
        assert _one(reg, "mrc_meter_errors_total", stage=stage) == 0
    with pytest.raises(ValueError, match="unknown meter stage"):
        MRCMetrics().meter_error("upload")  # type: ignore[arg-type]


# --- C: random exchanges --------------------------------------------------------------------


_TEXTS = ["hi", "é😀\n\"\\", '\\u00e9\\n\\"' * 40, "\ud800", "x" * 3000]
_URLS = [bmp_url(-5, 0), bmp_url(0, 0), png_url(0, 7), data_url(32, 32), "https://a.example/x",
         "data:image/png;base64,!!!!", "data:,", ""]
_RAW_BODIES = [b"", b"{", b"[" * 500, b'{"messages": "\\q"}', b'{"prompt": "\\u12', b"\xff\xfe",
               b'{"messages": [{"content": [{"image_url": 7}]}]}', b"null", b'"\\"', b"]"]


def _request(rng: random.Random) -> bytes:
    if rng.random() < 0.25:
        return rng.choice(_RAW_BODIES)
    urls = [rng.choice(_URLS) for _ in range(rng.randint(0, 3))]
    body = json.dumps(chat(rng.choice(_TEXTS), *urls, stream=rng.random() < 0.5),
                      ensure_ascii=rng.random() < 0.5)
    return body.encode("utf-8", "surrogatepass")


def _usage(rng: random.Random) -> dict[str, Any]:
    values = [*UNBELIEVABLE[:-1], 0, 7]  # NaN aside: json.dumps writes it, servers may not
    return {"prompt_tokens": rng.choice(values), "completion_tokens": rng.choice(values)}


def _answer(rng: random.Random, stream: bool) -> bytes:
    if stream:
        events: list[dict[str, Any]] = [{"choices": [{"delta": {"content": rng.choice(_TEXTS)}}]}
                  for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.7:
            events.append({"choices": [], "usage": _usage(rng)})
        if rng.random() < 0.2:
            events.append({"error": {"message": "x"}})
        sep = rng.choice([b"\n\n", b"\r\n\r\n", b"\r\r"])
        return b"".join(b"data: " + json.dumps(e).encode() + sep for e in events) + (
            b"data: [DONE]" + sep if rng.random() < 0.8 else b"data: {\"usage\": ")
    if rng.random() < 0.1:
        return b'{"usage": {"prompt_tokens": 1' + b"0" * 400 + b"}"
    return json.dumps({"choices": [{"message": {"content": rng.choice(_TEXTS)}}],
                       "usage": _usage(rng)}).encode()


def _pieces(rng: random.Random, data: bytes) -> list[bytes]:
    shape = rng.choice(["whole", "bytes", "random"])
    if shape == "whole" or not data:
        return [data]
    if shape == "bytes" and len(data) < 2000:
        return [data[i:i + 1] for i in range(len(data))]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 8))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def test_random_hostile_exchanges_always_end_counted_and_out_of_flight() -> None:
    rng = random.Random(20240611)
    reg = CollectorRegistry()
    # Two cells a side: the same code paths, and a scrape per exchange that stays cheap.
    m = MRCMetrics(registry=reg, prompt_edges=(50,), resolution_edges_mp=(1.0,),
                   resolution_unknown=True)
    for n in range(1, 301):
        body = _request(rng)
        x = Exchange(m)
        for i, piece in enumerate(pieces := _pieces(rng, body)):
            x.request_body(piece, i < len(pieces) - 1 or rng.random() < 0.1)
        if rng.random() < 0.9:
            x.response_start(rng.choice([200, 200, 201, 400, 429, 500, 502, 999]),
                             rng.choice(["application/json", "text/event-stream; charset=utf-8",
                                         "application/problem+json", "", "text/plain"]))
            answer = _answer(rng, b'"stream": true' in body)
            ended = rng.random() < 0.85
            for i, piece in enumerate(pieces := _pieces(rng, answer)):
                x.response_body(piece, not ended or i < len(pieces) - 1)
        x.finish(client_left=rng.random() < 0.2)
        x.finish()  # a second call changes nothing
        values = _values(reg)
        assert sum(series(values, "mrc_requests_total")) == n
        assert series(values, "mrc_requests_in_flight") == [0.0]
        assert x.degraded is None, (n, body[:200])
    assert sum(series(_values(reg), "mrc_meter_errors_total")) == 0


# --- D: cost linear in the bytes ------------------------------------------------------------


def _escape_body(n: int) -> bytes:
    return json.dumps(chat('\u00e9\n"\t' * n)).encode()


@pytest.mark.parametrize("piece", [1 << 30, 64 * 1024, 1024, 7])
def test_the_request_scan_takes_a_step_per_window_not_per_escape(
        monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    body = _escape_body(20_000)  # 60,000 escapes in 260 KB
    calls = 0
    part = jsonscan.JsonScanner._string_part

    def counted(self: jsonscan.JsonScanner, data: bytes, pos: int, end: int) -> int:
        nonlocal calls
        calls += 1
        return part(self, data, pos, end)

    monkeypatch.setattr(jsonscan.JsonScanner, "_string_part", counted)
    scan = ChatRequestScan()
    carried = 0
    for i in range(0, len(body), piece):
        scan.feed(body[i:i + piece])
        carried = max(carried, len(scan._carry))
    scan.close()
    assert scan.failed is None and scan.prompt_chars == 80_000
    chunks = -(-len(body) // piece)
    assert calls <= chunks + 20  # a string part per chunk, and the few other strings
    assert carried <= 6  # an escape cut by a chunk's end, never the rest of the body


def test_the_request_scan_reads_each_byte_of_a_string_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    body = _escape_body(20_000) + b" " * 10  # ends in whitespace, after the closing brace
    scanned = 0
    scan_string = jsonscan.scanstring

    def counted(text: str, end: int, strict: bool) -> tuple[str, int]:
        nonlocal scanned
        scanned += len(text) - end
        return scan_string(text, end, strict)  # type: ignore[no-any-return]

    monkeypatch.setattr(jsonscan, "scanstring", counted)
    for piece in (len(body), 64 * 1024, 1024):
        scanned = 0
        scan = ChatRequestScan()
        for i in range(0, len(body), piece):
            scan.feed(body[i:i + piece])
        scan.close()
        assert scan.prompt_chars == 80_000
        # Each byte of the prompt once, and at most one window beyond each chunk's strings.
        assert scanned <= len(body) + 2 * 256 * (-(-len(body) // piece)), piece


def test_many_short_strings_with_escapes_cost_their_own_length(
        monkeypatch: pytest.MonkeyPatch) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "\n"}] * 5000}).encode()
    scanned = 0
    scan_string = jsonscan.scanstring

    def counted(text: str, end: int, strict: bool) -> tuple[str, int]:
        nonlocal scanned
        value, after = scan_string(text, end, strict)
        scanned += after - end  # what the C scanner walked
        return value, after  # type: ignore[no-any-return]

    monkeypatch.setattr(jsonscan, "scanstring", counted)
    scan = ChatRequestScan()
    scan.feed(body)
    scan.close()
    assert scan.prompt_chars == 5000
    assert scanned == 5000 * 3  # "\n" and its closing quote, per string: nothing further


def test_an_event_written_a_byte_at_a_time_is_searched_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    event = b'data: {"choices": [{"delta": {"content": "' + b"w" * 60_000 + b'"}}]}\r\n\r\n'
    searched = 0
    pattern = meter._EVENT_END

    class Counted:
        def search(self, data: bytes, pos: int = 0) -> Any:
            nonlocal searched
            searched += len(data) - pos
            return pattern.search(data, pos)

    monkeypatch.setattr(meter, "_EVENT_END", Counted())
    m, _ = _metrics()
    scan = EventScan(Exchange(m))
    held = 0
    for i in range(len(event)):
        scan.feed(event[i:i + 1])
        held = max(held, scan.pending)
    scan.close()
    assert scan.events == 1
    assert searched <= 8 * len(event)  # each byte, and a few bytes of overlap per piece
    assert held <= meter.EVENT_LIMIT
