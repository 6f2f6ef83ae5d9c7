"""The middleware around the reference service: two measurements of the same requests, one the
service's own instrumentation, one the meter's from the wire, must agree by cell with each other
and with what the clients saw."""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mrc_agent.exporters.instrumentation import MRCMeterMiddleware, MRCMetrics
from mrc_agent.reference_service.loadgen import make_photo
from mrc_agent.reference_service.main import create_app
from mrc_agent.reference_service.settings import Settings
from tests.conftest import parse_metrics, series
from tests.openai_support import ServerThread, chat


@pytest.fixture(scope="module")
def metered(cache_dir: Path) -> Iterator[tuple[str, CollectorRegistry]]:
    app = create_app(Settings(cache_dir=cache_dir, ocr="off", max_concurrency=2))
    reg = CollectorRegistry()
    app.add_middleware(MRCMeterMiddleware, metrics=MRCMetrics(registry=reg,
                                                              resolution_unknown=True))
    server = ServerThread(app, lifespan="on")
    deadline = time.monotonic() + 240
    while httpx.get(server.url + "/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    yield server.url, reg
    server.stop()


def _url(w: int, h: int) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(make_photo(w, h, w + h)).decode()


def test_the_meter_and_the_services_own_metrics_agree(
        metered: tuple[str, CollectorRegistry]) -> None:
    url, reg = metered
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    cells: Counter[tuple[str, str]] = Counter()
    streams = completion = 0
    for text, (w, h), stream, cell in [
        ("Is it damaged?", (400, 300), False, ("0-50", "<1MP")),
        ("Is it damaged?", (400, 300), True, ("0-50", "<1MP")),
        ("What does the label on this parcel say, and is the parcel damaged anywhere?",
         (1200, 1000), True, ("50-100", "1-4MP")),
        ("x" * 120, (2400, 2000), False, ("100+", ">4MP")),
    ]:
        body = chat(text, _url(w, h), stream=stream, model=model, max_tokens=3)
        if stream:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                              timeout=120) as r:
                assert r.status_code == 200
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            (usage,) = [e["usage"] for e in events if e.get("usage")]
            streams += 1
        else:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
        completion += usage["completion_tokens"]
        cells[cell] += 1
    refused = httpx.post(url + "/v1/chat/completions", timeout=30, json=chat(
        "x", _url(64, 64), model="no-such-model"))
    assert refused.status_code == 404

    # Both record a request as its handler returns, just after the client got the last byte.
    deadline = time.monotonic() + 10
    while True:
        meter = parse_metrics(generate_latest(reg).decode())
        own = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        if all(sum(series(v, "mrc_requests_total")) == 5 for v in (meter, own)):
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for (p, res), n in cells.items():
        for values in (meter, own):
            assert series(values, "mrc_request_duration_seconds_count", prompt_length=p,
                          resolution=res) == [float(n)], (p, res)
    assert sum(series(meter, "mrc_time_to_first_token_seconds_count")) == streams
    for values in (meter, own):
        assert series(values, "mrc_requests_total", outcome="ok") == [float(sum(cells.values()))]
        assert series(values, "mrc_requests_total", outcome="client_error") == [1.0]
        assert series(values, "mrc_generation_tokens_total") == [float(completion)]
    # The wire sees the upload the service's own stages start after.
    assert series(meter, "mrc_stage_duration_seconds_count", stage="receive") == [5.0]
