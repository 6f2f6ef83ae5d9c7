"""The chain's OCR step under a slow or failing tesseract: it never holds a model slot, and an
answer made without the image's text is never served again from the cache.

The service runs in this process (the embedded model, uvicorn on loopback) so that its OCR step
can be a hand-written fake put in through ``ServiceState.ocr``, the seam the service reads the
step from: a tesseract that blocks until released, or that times out once.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from PIL import Image

from mrc_agent.reference_service.loadgen import make_photo
from mrc_agent.reference_service.main import create_app
from mrc_agent.reference_service.ocr import OCRError
from mrc_agent.reference_service.settings import Settings
from mrc_agent.reference_service.state import ServiceState
from tests.conftest import parse_metrics, series


class InProcessService:
    """The app on a uvicorn server in a thread of this process, on an ephemeral port."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        self.state: ServiceState = self.app.state.mrc
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 240
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        while httpx.get(self.url + "/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, self.state.loading
            time.sleep(0.2)

    def post(self, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
        return httpx.post(self.url + "/mrc", json=body, timeout=timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def service(cache_dir: Path) -> Iterator[InProcessService]:
    # OCR "off" at start: each test puts its own fake in ServiceState.ocr.
    svc = InProcessService(Settings(cache_dir=cache_dir, ocr="off", max_concurrency=2))
    yield svc
    svc.stop()


@pytest.fixture
def state(service: InProcessService) -> Iterator[ServiceState]:
    yield service.state
    service.state.ocr = None
    service.state.cache.clear()


def _body(w: int, h: int, prompt: str, seed: int = 1) -> dict[str, Any]:
    return {"image": base64.b64encode(make_photo(w, h, seed)).decode(), "text_prompt": prompt,
            "max_new_tokens": 2}


class GatedOCR:
    """Reads an image at least ``wide`` pixels wide only once released (a page of dense text
    that takes tesseract its whole timeout), or until its call is cancelled; any other image
    at once."""

    def __init__(self, wide: int = 600) -> None:
        self.wide = wide
        self.release = threading.Event()
        self._started = threading.Semaphore(0)
        self.cancelled = 0

    def read(self, image: Image.Image, cancel: threading.Event | None = None) -> str:
        if image.width < self.wide:
            return "QUICK TEXT"
        self._started.release()
        deadline = time.monotonic() + 120
        while not self.release.wait(0.02) and time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                self.cancelled += 1
                raise OCRError("preempted", "cancelled")
        return "SLOW TEXT"

    def wait_started(self, n: int, timeout: float) -> bool:
        return all(self._started.acquire(timeout=timeout) for _ in range(n))


def test_a_slow_ocr_does_not_hold_a_model_slot(service: InProcessService,
                                              state: ServiceState) -> None:
    """Two requests whose OCR ran its whole course held both model slots (max_concurrency 2):
    a request that takes 0.1 s waited 9.4-10.1 s behind them. Now OCR runs outside the slot,
    on threads of its own (two per model slot): with two long reads in flight a quick request
    finds a thread free and reads its text at once."""
    ocr = GatedOCR()
    state.ocr = ocr
    try:
        with ThreadPoolExecutor(2) as pool:
            slow = [pool.submit(service.post, _body(800, 600, f"slow {i}?", seed=i))
                    for i in range(2)]
            assert ocr.wait_started(2, timeout=120)  # both are reading, neither may finish
            quick = service.post(_body(64, 48, "quick?"), timeout=30)
            assert not ocr.release.is_set()
            assert quick.status_code == 200, quick.text
            assert quick.json()["ocr_text"] == "QUICK TEXT"
            ocr.release.set()
            answers = [f.result() for f in slow]
        assert [a.status_code for a in answers] == [200, 200]
        assert [a.json()["ocr_text"] for a in answers] == ["SLOW TEXT"] * 2
        assert ocr.cancelled == 0  # a thread was free: nothing was taken over
    finally:
        ocr.release.set()


def test_a_request_takes_over_the_thread_of_a_long_ocr(service: InProcessService,
                                                      state: ServiceState) -> None:
    """With every OCR thread held by a long read (four pages of dense text, two threads per
    model slot), a new request takes over the thread of the read that has run longest once it
    has run past the step's preempt_after_s, and reads its own text; the request taken over
    answers without its text, and that answer is not kept in the cache."""
    ocr = GatedOCR()
    state.ocr = ocr
    threads = 2 * state.settings.max_concurrency
    try:
        with ThreadPoolExecutor(threads) as pool:
            slow = [pool.submit(service.post, _body(800, 600, f"page {i}?", seed=i))
                    for i in range(threads)]
            assert ocr.wait_started(threads, timeout=120)
            quick = service.post(_body(64, 48, "quick, with every thread taken?"), timeout=60)
            assert quick.status_code == 200, quick.text
            assert quick.json()["ocr_text"] == "QUICK TEXT"
            assert not ocr.release.is_set()
            ocr.release.set()
            answers = [f.result() for f in slow]
        assert ocr.cancelled == 1
        assert sorted(a.json()["ocr_text"] for a in answers) == [""] + ["SLOW TEXT"] * (
            threads - 1)
        taken = next(i for i, a in enumerate(answers) if a.json()["ocr_text"] == "")
        again = service.post(_body(800, 600, f"page {taken}?", seed=taken))
        assert again.status_code == 200 and again.json()["cached"] is False
    finally:
        ocr.release.set()


class FlakyOCR:
    """Times out on its first call (tesseract under load), reads the text after that."""

    def __init__(self) -> None:
        self.calls = 0

    def read(self, image: Image.Image, cancel: threading.Event | None = None) -> str:
        self.calls += 1
        if self.calls == 1:
            raise OCRError("timeout", "tesseract took longer than 10s")
        return "PARCEL 48213"


def test_an_answer_made_without_its_ocr_text_is_not_cached(service: InProcessService,
                                                           state: ServiceState) -> None:
    """An answer made while OCR timed out was served from the cache for its whole 600 s to
    requests made later, with ``ocr_text: ""``. A degraded answer is not stored; a complete
    one is, as before."""
    state.ocr = FlakyOCR()
    body = _body(320, 240, "what does the label say?")
    before = parse_metrics(httpx.get(service.url + "/metrics", timeout=10).text)
    first = service.post(body)
    assert first.status_code == 200 and first.json()["ocr_text"] == ""
    second = service.post(body)
    assert second.status_code == 200, second.text
    assert second.json()["cached"] is False and second.json()["ocr_text"] == "PARCEL 48213"
    third = service.post(body)
    assert third.json()["cached"] is True and third.json()["ocr_text"] == "PARCEL 48213"
    after = parse_metrics(httpx.get(service.url + "/metrics", timeout=10).text)
    hits = series(after, "mrc_cache_hits_total")[0] - series(before, "mrc_cache_hits_total")[0]
    assert hits == 1
