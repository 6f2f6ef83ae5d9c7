"""The reference service as a client meets it: a real uvicorn server on loopback with the
embedded model, driven with httpx; a corpus of bad inputs; the metrics it serves."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from mrc_agent.reference_service.loadgen import make_photo
from tests.conftest import REPO, parse_metrics, series
from tests.support import free_port


class Service:
    def __init__(self, cache_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = cache_dir / f"service-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mrc_agent.reference_service", "--host", "127.0.0.1", "--port",
             str(self.port), "--cache-dir", str(cache_dir), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError("service not ready:\n" + self.log_path.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        finally:
            self.proc.kill()
            self.log.close()

    def text_log(self) -> str:
        self.log.flush()
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def service(cache_dir: Path) -> Iterator[Service]:
    svc = Service(cache_dir, "--max-image-bytes", str(3 * 1024 * 1024), "--max-queue", "4")
    yield svc
    svc.stop()


def _jpeg(w: int, h: int, seed: int = 1) -> bytes:
    return make_photo(w, h, seed)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _png_header_bomb(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels: tiny on the wire."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (len(data).to_bytes(4, "big") + kind + data
                + zlib.crc32(kind + data).to_bytes(4, "big"))
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    idat = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _totals(service: Service) -> dict[str, float]:
    m = parse_metrics(httpx.get(service.url + "/metrics", timeout=10).text)
    names = ("mrc_prompt_tokens_total", "mrc_generation_tokens_total",
             "mrc_request_queue_time_seconds_count")
    return {n: sum(v for (name, _), v in m.items() if name == n) for n in names}


def test_answers_a_photo_question(service: Service) -> None:
    photo = _b64(_jpeg(1200, 900))
    before = _totals(service)
    r = httpx.post(service.url + "/mrc", json={"image": photo,
                                                "text_prompt": "Is the parcel damaged?",
                                                "max_new_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"answer", "latency_ms", "ttft_ms", "cached", "request_id"}
    assert body["cached"] is False and body["output_tokens"] >= 1
    assert 0 < body["ttft_ms"] <= body["latency_ms"]
    assert body["meaningful"] is False  # the embedded model says so
    # The model's token counts reach the comparable counters; the request waited for a slot
    # (0 s or more) once.
    after = _totals(service)
    assert after["mrc_prompt_tokens_total"] - before["mrc_prompt_tokens_total"] == \
        body["input_tokens"] > 0
    assert after["mrc_generation_tokens_total"] - before["mrc_generation_tokens_total"] == \
        body["output_tokens"]
    assert after["mrc_request_queue_time_seconds_count"] == \
        before["mrc_request_queue_time_seconds_count"] + 1
    # The same image and question again: answered from the cache.
    again = httpx.post(service.url + "/mrc", json={"image": photo,
                                                    "text_prompt": "Is the parcel damaged?",
                                                    "max_new_tokens": 8}, timeout=60).json()
    assert again["cached"] is True and again["answer"] == body["answer"]
    # The same image, another question: not the cached answer.
    other = httpx.post(service.url + "/mrc", json={"image": photo,
                                                    "text_prompt": "Is the parcel damaged? No",
                                                    "max_new_tokens": 8}, timeout=60).json()
    assert other["cached"] is False
    # The same image and question with another generation parameter: not the cached answer
    # either (the README: the key includes the generation parameters).
    longer = httpx.post(service.url + "/mrc", json={"image": photo,
                                                     "text_prompt": "Is the parcel damaged?",
                                                     "max_new_tokens": 9}, timeout=60).json()
    assert longer["cached"] is False
    # Another image, same question and parameters: not the cached answer.
    elsewhere = httpx.post(service.url + "/mrc", json={"image": _b64(_jpeg(1200, 900, 5)),
                                                        "text_prompt": "Is the parcel damaged?",
                                                        "max_new_tokens": 8}, timeout=60).json()
    assert elsewhere["cached"] is False


def test_upload_endpoint_and_structured_log(service: Service) -> None:
    r = httpx.post(service.url + "/mrc/upload",
                   files={"file": ("p.jpg", _jpeg(2048, 1536, 7), "image/jpeg")},
                   data={"text_prompt": "What is written on the label?",
                         "max_new_tokens": "4"}, timeout=60)
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    time.sleep(0.2)
    line = next(x for x in service.text_log().splitlines() if f"request_id={rid}" in x)
    assert re.search(r"MRC_SUCCESS\|latency=[0-9.]+\|input_len=\d+\|output_len=\d+\|"
                     rf"request_id={rid}", line), line


BAD = [
    ("not an image", {"image": _b64(b"hello, this is text, not pixels" * 10)}, 415,
     "not_an_image"),
    ("truncated jpeg", {"image": _b64(_jpeg(640, 480)[:4000])}, 422, "image_truncated"),
    ("zero bytes", {"image": ""}, 400, "image_empty"),
    ("bomb", {"image": _b64(_png_header_bomb(50000, 50000))}, 413, "decompression_bomb"),
    ("bad base64", {"image": "!!!notbase64$$$"}, 400, "bad_base64"),
    ("neither image", {}, 422, "invalid_request"),
    ("both images", {"image": _b64(b"x"), "image_url": "https://example.com/a.jpg"}, 422,
     "invalid_request"),
    ("prompt too long", {"image": _b64(b"x"), "text_prompt": "x" * 2001}, 413,
     "prompt_too_long"),
    ("zero tokens", {"image": _b64(b"x"), "max_new_tokens": 0}, 422, "invalid_request"),
    ("too many tokens", {"image": _b64(b"x"), "max_new_tokens": 100000}, 422,
     "invalid_request"),
    ("ftp url", {"image_url": "ftp://example.com/a.jpg"}, 400, "url_not_allowed"),
    ("loopback url", {"image_url": "http://127.0.0.1:1/a.jpg"}, 400, "url_not_allowed"),
    pytest.param("metadata url", {"image_url": "http://169.254.169.254/latest/meta-data"}, 400,
                 "url_not_allowed", marks=pytest.mark.netns),
    pytest.param("private url", {"image_url": "http://10.0.0.1/a.jpg"}, 400,
                 "url_not_allowed", marks=pytest.mark.netns),
    ("unspecified url", {"image_url": "http://0.0.0.0/a.jpg"}, 400, "url_not_allowed"),
]


@pytest.mark.parametrize(("name", "fields", "status", "code"), BAD,
                         ids=[str(getattr(b, "values", b)[0]) for b in BAD])
def test_bad_input_gets_a_clear_json_error(service: Service, name, fields, status,
                                           code) -> None:
    body = {"text_prompt": "What is this?", **fields}
    r = httpx.post(service.url + "/mrc", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_malformed_bodies(service: Service) -> None:
    headers = {"content-type": "application/json"}
    r = httpx.post(service.url + "/mrc", content=b'{"text_prompt": "\xff\xfe"}',
                   headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_utf8")
    r = httpx.post(service.url + "/mrc", content=b'{"text_prompt": ', headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_request")
    big = _b64(b"\0" * (3 * 1024 * 1024 + 10))
    r = httpx.post(service.url + "/mrc", json={"image": big, "text_prompt": "x"})
    assert (r.status_code, r.json()["error"]["code"]) == (413, "image_too_large")
    r = httpx.post(service.url + "/mrc/upload", data={"text_prompt": "x"},
                   files={"other": ("a", b"b")})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request")
    r = httpx.post(service.url + "/mrc/upload",
                   files={"file": ("p.jpg", _jpeg(64, 64), "image/jpeg")},
                   data={"text_prompt": "x", "max_new_tokens": "many"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request")
    assert httpx.get(service.url + "/nope").json()["error"]["code"] == "not_found"


def test_health_ready_and_metrics(service: Service) -> None:
    h = httpx.get(service.url + "/health").json()
    assert h["model_loaded"] is True and h["meaningful_answers"] is False
    assert httpx.get(service.url + "/ready").status_code == 200
    text = httpx.get(service.url + "/metrics").text
    m = parse_metrics(text)
    assert series(m, "mrc_model_info", quantization="none", device="cpu")
    assert len(series(m, "mrc_request_duration_seconds_count")) == 9
    assert sum(series(m, "mrc_requests_total", outcome="client_error")) >= 1
    assert sum(series(m, "mrc_cache_hits_total")) >= 0
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus)"
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True)
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout


def test_service_keeps_serving_after_the_bad_corpus(service: Service) -> None:
    img = io.BytesIO()
    Image.new("RGB", (300, 200), (200, 10, 10)).save(img, "PNG")
    r = httpx.post(service.url + "/mrc", json={"image": "data:image/png;base64," +
                                                _b64(img.getvalue()),
                                                "text_prompt": "Colour?", "max_new_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert "Traceback" not in service.text_log()
    assert " 500 " not in service.text_log()


def test_loadgen_prints_every_bucket(service: Service) -> None:
    r = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "loadgen", "--url", service.url,
                        "--rate", "6", "--duration", "4", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    cells = {(row[0], row[1]) for row in rows if len(row) == 6 and row[0] in
             ("<1MP", "1-4MP", ">4MP")}
    assert len(cells) == 9, r.stdout
    assert "statuses {200:" in r.stdout


def test_overload_is_429_with_retry_after(cache_dir: Path) -> None:
    import asyncio

    svc = Service(cache_dir, "--max-concurrency", "1", "--max-queue", "1")
    try:
        photos = [_b64(_jpeg(1600, 1200, seed)) for seed in range(3)]

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(svc.url + "/mrc", json={
                    "image": photos[i % 3], "text_prompt": f"Question {i}?",
                    "max_new_tokens": 16}) for i in range(10)))

        answers = asyncio.run(burst())
        codes = [a.status_code for a in answers]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(429) >= 1 and codes.count(200) >= 1, codes
        refused = next(a for a in answers if a.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        m = parse_metrics(httpx.get(svc.url + "/metrics").text)
        assert series(m, "mrc_requests_total", outcome="overloaded") == [codes.count(429)]
        assert httpx.post(svc.url + "/mrc", json={"image": photos[0], "text_prompt": "again",
                                                  "max_new_tokens": 2},
                          timeout=60).status_code == 200
    finally:
        svc.stop()


def test_sighup_stops_the_service_cleanly(cache_dir: Path) -> None:
    import signal

    svc = Service(cache_dir)
    try:
        svc.proc.send_signal(signal.SIGHUP)
        # After its clean stop uvicorn re-raises the signal it stopped for (SIGTERM here), so
        # the exit status is that signal's, not SIGHUP's.
        assert svc.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        svc.stop()
    log = svc.log_path.read_text()
    # uvicorn's clean stop ran: the lifespan's shutdown, then the server's own last line.
    assert "Waiting for application shutdown" in log and "Finished server process" in log
