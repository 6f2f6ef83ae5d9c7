"""The OpenAI meter on a server no one here wrote: ``transformers serve`` (it ships with
transformers) serving the embedded tiny Llava on CPU, driven through ``mrc-agent proxy`` the way
real clients call it. What ``/metrics`` counts must equal what the clients saw, by cell and by
outcome, and the token counters the sum of the ``usage`` the server reported."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mrc_agent.reference_service.model.embedded import ensure_embedded
from tests.conftest import parse_metrics, series
from tests.openai_support import ProxyThread, chat, data_url, leave_after
from tests.support import free_port


@pytest.fixture(scope="module")
def serve(cache_dir: Path) -> Iterator[tuple[str, str]]:
    """``transformers serve`` on loopback: (its URL, the model id to ask for)."""
    model = ensure_embedded(cache_dir)
    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    proc = subprocess.Popen([str(cli), "serve", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "--device", "cpu"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "transformers serve did not start in 300 s"
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url, str(model)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_proxy_counts_what_clients_of_transformers_serve_saw(serve: tuple[str, str]) -> None:
    url, model = serve
    proxy = ProxyThread(url)
    try:
        cells: Counter[tuple[str, str]] = Counter()
        outcomes: Counter[str] = Counter()
        streams = prompt = completion = 0
        small, mid, large = data_url(320, 240), data_url(1280, 960), data_url(2600, 2000)
        for text, image, stream, cell in [
            ("What is this?", small, False, ("0-50", "<1MP")),
            ("What is this?", small, True, ("0-50", "<1MP")),
            ("Describe the colours of this picture in a sentence or two.", mid, False,
             ("50-100", "1-4MP")),
            ("Describe the colours of this picture in a sentence or two.", mid, True,
             ("50-100", "1-4MP")),
            ("Read every word in this photo, then say what the scene shows, then say what "
             "is odd about it, and why it matters.", large, True, ("100+", ">4MP")),
        ]:
            body = chat(text, image, stream=stream, model=model, max_tokens=5)
            if stream:
                with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                                  timeout=120) as r:
                    assert r.status_code == 200
                    events = [json.loads(x[6:]) for x in r.iter_lines()
                              if x.startswith("data: {")]
                assert any(e["choices"] and e["choices"][0]["delta"].get("content")
                           for e in events)
                for e in events:
                    if e.get("usage"):
                        prompt += e["usage"]["prompt_tokens"]
                        completion += e["usage"]["completion_tokens"]
                streams += 1
            else:
                r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                prompt += r.json()["usage"]["prompt_tokens"]
                completion += r.json()["usage"]["completion_tokens"]
            cells[cell] += 1
            outcomes["ok"] += 1

        # An image the server must fetch: the meter never does, so its cell is "unknown",
        # whatever the server makes of the address (nothing listens there).
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=120, json=chat(
            "x", f"http://127.0.0.1:{free_port()}/cat.png", model=model, max_tokens=2))
        outcomes["ok" if r.status_code < 400 else
                 "client_error" if r.status_code < 500 else "error"] += 1
        remote_status = r.status_code

        # A request the server refuses: not JSON.
        r = httpx.post(proxy.url + "/v1/chat/completions", content=b'{"model": ',
                       headers={"content-type": "application/json"}, timeout=60)
        assert 400 <= r.status_code < 500
        outcomes["client_error"] += 1

        # A client that leaves mid-stream.
        leave_after(proxy.url, chat("Tell a long story.", small, stream=True, model=model,
                                    max_tokens=400), seen=b'"content"')
        outcomes["client_error"] += 1

        deadline = time.monotonic() + 60
        while True:
            values = parse_metrics(_exposition(proxy))
            counted = {o: sum(series(values, "mrc_requests_total", outcome=o))
                       for o in ("ok", "client_error", "error")}
            if counted == {o: float(outcomes[o]) for o in counted}:
                break
            assert time.monotonic() < deadline, (counted, outcomes, remote_status)
            time.sleep(0.2)
        for (p, res), n in cells.items():
            assert series(values, "mrc_request_duration_seconds_count", prompt_length=p,
                          resolution=res) == [float(n)], (p, res)
        if remote_status < 400 or remote_status >= 500:  # latency observed: ok or error
            assert series(values, "mrc_request_duration_seconds_count", prompt_length="0-50",
                          resolution="unknown") == [1.0]
        # Every stream had its first token, the one the client left included.
        assert sum(series(values, "mrc_time_to_first_token_seconds_count")) == streams + 1
        assert series(values, "mrc_prompt_tokens_total") == [float(prompt)]
        assert series(values, "mrc_generation_tokens_total") == [float(completion)]
        assert series(values, "mrc_requests_in_flight") == [0.0]
    finally:
        proxy.stop()


def _exposition(proxy: ProxyThread) -> str:
    from prometheus_client import generate_latest

    return generate_latest(proxy.metrics.registry).decode()
