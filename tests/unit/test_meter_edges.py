"""The meter's reading of the wire at its edges: usage however the answer carries it, events
however the server frames them, image heads however the client encodes them."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from mrc_agent.exporters.instrumentation import MRCMetrics
from mrc_agent.exporters.instrumentation.meter import EventScan, Exchange, UsageScan, image_size
from tests.openai_support import data_url


def _usage_scanned(body: bytes, cut: int) -> UsageScan:
    scan = UsageScan()
    scan.feed(body[:cut])
    scan.feed(body[cut:])
    scan.close()
    return scan


@pytest.mark.parametrize(("usage", "want"), [
    ({"prompt_tokens": 0, "completion_tokens": 7}, (0, 7)),
    ({"prompt_tokens": 12, "completion_tokens": 0, "total_tokens": 12}, (12, 0)),
    ({"prompt_tokens": -1, "completion_tokens": 3}, (None, 3)),
    ({"prompt_tokens": "x", "completion_tokens": 3.5}, (None, None)),
    ({"prompt_tokens_details": {"cached_tokens": 4}, "prompt_tokens": 9,
      "completion_tokens": 2, "completion_tokens_details": {"reasoning_tokens": 1}}, (9, 2)),
])
def test_usage_reads_the_same_whole_or_streamed_through(usage: dict[str, Any],
                                                       want: tuple[Any, Any]) -> None:
    body = json.dumps({"choices": [{"message": {"content": 'say "usage": 5'}}],
                       "usage": usage}).encode()
    whole = UsageScan()
    whole.whole(body)
    assert (whole.prompt_tokens, whole.completion_tokens) == want
    for cut in (1, len(body) // 2, len(body) - 3):
        s = _usage_scanned(body, cut)
        assert (s.prompt_tokens, s.completion_tokens) == want, cut


def test_usage_first_or_spaced_out_is_still_read() -> None:
    body = b'{"usage" : {"completion_tokens" :\n 12 , "prompt_tokens": 3}, "choices": []}'
    s = UsageScan()
    s.whole(body)
    assert (s.prompt_tokens, s.completion_tokens) == (3, 12)
    s = UsageScan()
    s.whole(b'{"usage": {"total_tokens": 4}, "choices": []}')
    assert (s.prompt_tokens, s.completion_tokens) == (None, None)
    s = UsageScan()
    s.whole(b'{"choices": []}')
    assert (s.prompt_tokens, s.completion_tokens) == (None, None)


def _events(framing: str) -> bytes:
    one = [b'{"choices":[{"delta":{"role":"assistant","content":""}}]}',
           b'{"choices":[{"delta":{"content":"a"}}]}',
           b'{"choices":[{"delta":{"reasoning_content":"b"}}]}',
           b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}', b"[DONE]"]
    if framing == "lf":
        return b"".join(b"data: " + e + b"\n\n" for e in one)
    if framing == "crlf":
        return b"".join(b"data: " + e + b"\r\n\r\n" for e in one)
    if framing == "comments":  # keep-alive comments, event names, ids
        return b"".join(b": ping\nevent: message\nid: 1\ndata:" + e + b"\n\n" for e in one)
    if framing == "multiline":  # one JSON split over data lines, as SSE allows
        return b"".join(b"data: " + e.replace(b",", b",\ndata: ", 1) + b"\n\n" for e in one)
    raise AssertionError(framing)


@pytest.mark.parametrize("framing", ["lf", "crlf", "comments", "multiline"])
@pytest.mark.parametrize("step", [1, 7, 1000])
def test_events_read_the_same_however_framed_and_cut(framing: str, step: int) -> None:
    x = Exchange(MRCMetrics(registry=CollectorRegistry(), resolution_unknown=True))
    x.response_start(200, "text/event-stream")
    scan = x._resp
    assert isinstance(scan, EventScan)
    body = _events(framing)
    for i in range(0, len(body), step):
        x.response_body(body[i:i + step], True)
    x.response_body(b"", False)
    scan.close()
    assert (scan.events, scan.prompt_tokens, scan.completion_tokens, scan.error) == (2, 5, 2,
                                                                                    False)
    assert x.tracker._t_first is not None
    x.finish()


def test_a_last_event_without_its_blank_line_still_counts() -> None:
    x = Exchange(MRCMetrics(registry=CollectorRegistry(), resolution_unknown=True))
    x.response_start(200, "text/event-stream; charset=utf-8")
    scan = x._resp
    assert isinstance(scan, EventScan)
    x.response_body(b'data: {"choices":[{"delta":{"content":"a"}}]}', False)
    scan.close()
    assert scan.events == 1
    x.finish()


@pytest.mark.parametrize(("status", "media", "kind"), [
    (200, "text/event-stream", EventScan), (200, "application/json", UsageScan),
    (200, "application/vnd.api+json", UsageScan), (200, "text/plain", type(None)),
    (400, "application/json", type(None)), (500, "text/event-stream", type(None)),
])
def test_the_answer_is_read_by_its_media_type_when_it_succeeded(status: int, media: str,
                                                                kind: type) -> None:
    x = Exchange(MRCMetrics(registry=CollectorRegistry(), resolution_unknown=True))
    x.response_start(status, media)
    assert type(x._resp) is kind
    x.finish()


def test_image_heads_in_every_spelling_a_client_uses() -> None:
    url = data_url(900, 700).encode()
    b64 = url.split(b",", 1)[1]
    wrapped = b"\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))  # MIME line breaks
    assert image_size(b"data:image/png;base64," + wrapped) == (900, 700)
    assert image_size(b"DATA:image/png;BASE64," + b64) == (900, 700)
    assert image_size(b"data:image/png;charset=x;base64," + b64) == (900, 700)
    assert image_size(b"data:image/png;base64," + b64[:40]) == (900, 700)  # head only
    assert image_size(b"data:;base64," + base64.b64encode(b"not an image at all")) is None
    assert image_size(b"data:image/png;base64" + b64) is None  # no comma
    assert image_size(b"data:image/png," + b64) is None  # not base64


@pytest.mark.parametrize("pieces", [
    pytest.param([(b"", False)], id="one-empty-piece"),
    pytest.param([(b"", True), (b"", False)], id="two-empty-pieces"),
    pytest.param([(b"  ", True), (b"\n", False)], id="whitespace-in-two"),
])
def test_an_empty_body_is_counted_in_no_cell_however_it_arrives(
        pieces: list[tuple[bytes, bool]]) -> None:
    reg = CollectorRegistry()
    x = Exchange(MRCMetrics(registry=reg, resolution_unknown=True))
    for chunk, more in pieces:
        x.request_body(chunk, more)
    x.response_start(200, "application/json")
    x.response_body(b"{}", False)
    x.finish()
    counted = [s for metric in reg.collect() for s in metric.samples
               if s.name == "mrc_request_duration_seconds_count" and s.value]
    assert counted == []
