"""The reference service's hostile-input corpus: client mistakes that used to end in a 500,
bodies over the cap sent chunked, control characters aimed at the logs, and the count of every
request — refused before the pipeline or not — in ``mrc_requests_total``. A real uvicorn server
on loopback with the embedded model."""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mrc_agent.reference_service.loadgen import make_photo
from tests.conftest import parse_metrics, requests_by_outcome, series
from tests.integration.test_service import Service

MAX_IMAGE = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def service(cache_dir: Path) -> Iterator[Service]:
    svc = Service(cache_dir, "--max-image-bytes", str(MAX_IMAGE))
    yield svc
    svc.stop()


def _image() -> str:
    return base64.b64encode(make_photo(64, 48, 3)).decode()


def _post_json(service: Service, raw: bytes) -> httpx.Response:
    return httpx.post(service.url + "/mrc", content=raw,
                      headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize(("raw", "status", "code", "says"), ids=[
    "lone-surrogate", "nested-100k", "int-5000-digits", "port-99999"], argvalues=[
    (b'{"image": "%s", "text_prompt": "\\ud800 what?"}', 422, "invalid_request",
     "lone surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "bad_request", "nested too deeply"),
    (b'{"image": "%s", "text_prompt": "hi", "max_new_tokens": 1' + b"0" * 5000 + b"}", 400,
     "bad_request", "not valid JSON"),
    (b'{"image_url": "http://127.0.0.1:99999/x.jpg", "text_prompt": "hi"}', 400,
     "url_not_allowed", "port 99999 is not 1-65535"),
])
def test_client_mistakes_that_were_500s(service: Service, raw: bytes, status: int, code: str,
                                        says: str) -> None:
    if b"%s" in raw:
        raw = raw.replace(b"%s", _image().encode())
    r = _post_json(service, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and says in err["message"]


@pytest.mark.parametrize("tokens", ["²", "⁵", "٣", "1" * 20, "-"],
                         ids=["sup2", "sup5", "arabic3", "20-digits", "minus"])
def test_upload_with_a_unicode_digit_token_budget(service: Service, tokens: str) -> None:
    r = httpx.post(service.url + "/mrc/upload", timeout=60,
                   files={"file": ("p.jpg", make_photo(64, 48, 3), "image/jpeg")},
                   data={"text_prompt": "what is this?", "max_new_tokens": tokens})
    assert r.status_code == 422, r.text
    assert "max_new_tokens must be an integer" in r.json()["error"]["message"]


def test_chunked_upload_over_the_cap_is_413(service: Service) -> None:
    def chunks() -> Iterator[bytes]:
        boundary = b"--x\r\n"
        yield boundary + b'Content-Disposition: form-data; name="text_prompt"\r\n\r\nhi\r\n'
        yield boundary + (b'Content-Disposition: form-data; name="file"; filename="a.jpg"\r\n'
                          b"Content-Type: image/jpeg\r\n\r\n")
        for _ in range(6):  # 6 MiB: well over the cap of the encoded image
            yield b"\xff" * (1 << 20)
        yield b"\r\n--x--\r\n"

    r = httpx.post(service.url + "/mrc/upload", content=chunks(), timeout=60,
                   headers={"Content-Type": "multipart/form-data; boundary=x"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "image_too_large"


def test_control_characters_never_reach_the_log_raw(service: Service) -> None:
    prompt = "look\x1b[31m red\u2028line\x85nel\x00nul"
    r = httpx.post(service.url + "/mrc", timeout=60,
                   json={"image": _image(), "text_prompt": prompt, "max_new_tokens": 2})
    assert r.status_code == 200, r.text
    log = service.text_log()
    line = next(ln for ln in log.splitlines() if r.json()["request_id"] in ln)
    for raw in ("\x1b", "\u2028", "\x85", "\x00"):
        assert raw not in log
    assert "\\u001b" in line


def _outcome(status: int) -> str:
    # Written out here, not taken from exporters.instrumentation.outcome_for_status: the
    # expectation must not agree with the code under test by construction.
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "overloaded"
    if status == 504:
        return "timeout"
    return "client_error" if status < 500 else "error"


def test_every_request_is_counted_once_by_outcome(service: Service) -> None:
    before = requests_by_outcome(service.url)
    image = _image()
    sent: list[tuple[str, dict[str, object]]] = [
        ("/mrc", {"content": json.dumps({"image": image, "text_prompt": "what?",
                                         "max_new_tokens": 2})}),
        ("/mrc", {"content": b"{not json"}),
        ("/mrc", {"content": json.dumps({"text_prompt": "no image"})}),
        ("/mrc", {"content": json.dumps({"image": "@@@", "text_prompt": "bad base64"})}),
        ("/mrc", {"content": json.dumps({"image": image, "text_prompt": "x" * 100_000})}),
        ("/mrc", {"content": b"\xff\xfe"}),
        ("/mrc", {"content": b"[" * 100_000}),
        ("/mrc", {"content": json.dumps({"image": base64.b64encode(b"not an image").decode(),
                                         "text_prompt": "in the pipeline"})}),
        ("/mrc", {"content": b"x" * (4 * MAX_IMAGE)}),
        ("/mrc/upload", {"files": {"file": ("p.jpg", make_photo(64, 48, 3), "image/jpeg")},
                         "data": {"text_prompt": "what?", "max_new_tokens": "2"}}),
        ("/mrc/upload", {"data": {"text_prompt": "no file"}}),
        ("/mrc/upload", {"content": b"plain", "headers": {"Content-Type": "text/plain"}}),
    ]
    statuses: Counter[str] = Counter()
    for path, kw in sent:
        headers = kw.pop("headers", None) or (
            {"Content-Type": "application/json"} if "content" in kw else None)
        r = httpx.post(service.url + path, timeout=60, headers=headers, **kw)  # type: ignore
        statuses[_outcome(r.status_code)] += 1
    assert statuses["ok"] == 2 and statuses["client_error"] == len(sent) - 2, statuses
    after = requests_by_outcome(service.url)
    assert after - before == statuses


def test_content_length_with_transfer_encoding_is_refused(service: Service) -> None:
    import socket

    before = requests_by_outcome(service.url)
    raw = (b"POST /mrc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    with socket.create_connection(("127.0.0.1", service.port), timeout=10) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    if head.startswith(b"http/1.1 400"):
        assert b"connection: close" in head
    else:  # the HTTP parser itself may refuse it first: never a 2xx
        assert not head.startswith(b"http/1.1 2"), head
    counted = requests_by_outcome(service.url) - before
    assert counted in (Counter({"client_error": 1}), Counter())


def test_a_crafted_header_does_not_freeze_the_service(service: Service) -> None:
    """1.9 MB of JPEG fill bytes took Pillow about a second to walk; on the event loop that
    second froze /health, and on a header thread it held the lock every probe needed. Now the
    structure walk refuses it by count before Pillow sees it
    (tests/unit/test_preprocess_structure.py times it), as the damaged image it is."""
    crafted = b"\xff\xd8" + b"\xff" * (MAX_IMAGE - 200_000)
    r = httpx.post(service.url + "/mrc/upload", timeout=60,
                   files={"file": ("c.jpg", crafted, "image/jpeg")},
                   data={"text_prompt": "what is this?"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "image_corrupt" and "fill or stray bytes" in err["message"]
    assert httpx.get(service.url + "/health", timeout=10).status_code == 200


def test_a_form_field_that_is_not_utf8_is_400(service: Service) -> None:
    boundary = b"b0undary"
    body = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="text_prompt"\r\n\r\n'
            b"caf\xe9?\r\n--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; '
            b'filename="p.jpg"\r\nContent-Type: image/jpeg\r\n\r\n' + make_photo(64, 48, 3)
            + b"\r\n--" + boundary + b"--\r\n")
    before = requests_by_outcome(service.url)
    r = httpx.post(service.url + "/mrc/upload", content=body, timeout=60,
                   headers={"Content-Type": "multipart/form-data; boundary=b0undary"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_utf8" and "'text_prompt'" in err["message"]
    assert requests_by_outcome(service.url) - before == Counter({"client_error": 1})
    # The same bytes, declared Latin-1 by the client, are what it says they are.
    r = httpx.post(service.url + "/mrc/upload", timeout=60, content=body, headers={
        "Content-Type": "multipart/form-data; boundary=b0undary; charset=latin-1"})
    assert r.status_code == 200, r.text


def test_a_jpeg_shorter_than_its_header_claims_is_422(service: Service) -> None:
    import io
    import struct

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.find(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", 6000, 6000)
    r = httpx.post(service.url + "/mrc/upload", timeout=60,
                   files={"file": ("t.jpg", bytes(data), "image/jpeg")},
                   data={"text_prompt": "what is this?"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "image_truncated"


# -- isolation: a hostile input costs only itself ---------------------------------------------


def test_good_requests_succeed_while_crafted_headers_arrive(cache_dir: Path) -> None:
    """Two clients upload 19 MB crafted headers (JPEG fill bytes, empty PNG chunks, GIF comment
    blocks) without pause. Each took Pillow seconds under one process-wide lock, and every
    other request's header probe ran out of its 1 s budget: 422 image_corrupt for good images
    (36 of 36 failed). Now the crafted ones are refused by count in milliseconds and hold
    nothing another request needs."""
    import threading

    from tests.unit.test_preprocess_structure import CRAFTED

    svc = Service(cache_dir)  # the default 20 MiB image limit
    try:
        crafted = [CRAFTED[n][0]() for n in ("jpeg-fill-bytes", "png-empty-chunks",
                                             "gif-comment-blocks")]
        stop = threading.Event()
        hostile: list[httpx.Response] = []

        def attack(first: int) -> None:
            with httpx.Client(timeout=120) as client:
                i = first
                while not stop.is_set():
                    hostile.append(client.post(
                        svc.url + "/mrc/upload", data={"text_prompt": "what is this?"},
                        files={"file": ("x.img", crafted[i % len(crafted)], "image/jpeg")}))
                    i += 1

        attackers = [threading.Thread(target=attack, args=(i,)) for i in range(2)]
        for t in attackers:
            t.start()
        good: list[httpx.Response] = []
        try:
            while len(hostile) < 2:  # both attackers are under way
                time.sleep(0.05)
            with httpx.Client(timeout=120) as client:
                for i in range(8):
                    good.append(client.post(svc.url + "/mrc", json={
                        "image": _image(), "text_prompt": f"good {i}?", "max_new_tokens": 2}))
        finally:
            stop.set()
            for t in attackers:
                t.join(180)
        assert [r.status_code for r in good] == [200] * 8, [r.text for r in good if
                                                          r.status_code != 200]
        assert len(hostile) >= 4
        for r in hostile:
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "image_corrupt"
            assert "at most" in r.json()["error"]["message"]
        m = parse_metrics(httpx.get(svc.url + "/metrics", timeout=10).text)
        assert series(m, "mrc_preprocess_abandoned_threads", pool="header") == [0]
    finally:
        svc.stop()


def test_the_abandoned_preprocess_threads_are_exported_per_pool(service: Service) -> None:
    m = parse_metrics(httpx.get(service.url + "/metrics", timeout=10).text)
    for pool in ("header", "decode"):
        assert series(m, "mrc_preprocess_abandoned_threads", pool=pool) == [0], pool


@pytest.mark.parametrize("tokens", ["--5", "+-5", "+5", "1e3", "1.0", "0x10", "5 5", "٣"])
def test_an_upload_token_budget_is_an_ascii_decimal_integer(service: Service,
                                                            tokens: str) -> None:
    """``--5`` passed the digit check and made int() raise: a 500 counted as the server's."""
    before = requests_by_outcome(service.url)
    r = httpx.post(service.url + "/mrc/upload", timeout=60,
                   files={"file": ("p.jpg", make_photo(64, 48, 3), "image/jpeg")},
                   data={"text_prompt": "what is this?", "max_new_tokens": tokens})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and "max_new_tokens must be an integer" in \
        err["message"]
    assert requests_by_outcome(service.url) - before == Counter({"client_error": 1})


@pytest.mark.parametrize("tokens", ["true", "false", "1.0", "1e1", '"5"', "[5]", "null"])
def test_a_json_token_budget_is_a_json_integer(service: Service, tokens: str) -> None:
    """``true`` was taken as 1, ``1.0`` and ``"5"`` as integers: only a JSON integer is one."""
    body = json.dumps({"image": _image(), "text_prompt": "what?"})
    raw = (body[:-1] + f', "max_new_tokens": {tokens}}}').encode()
    r = _post_json(service, raw)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and "max_new_tokens" in err["message"]


def test_a_path_cannot_forge_a_log_line(service: Service) -> None:
    """The body limit logged the percent-decoded path raw: ``%0a`` began a new line, here a
    fake MRC_SUCCESS. A declared body over the cap that never arrives makes it log the path
    (after its drain timeout, 5 s)."""
    import socket

    forged = "MRC_SUCCESS|latency=0.001|input_len=1|output_len=1|request_id=forged"
    path = "/mrc%0a" + forged.replace("|", "%7C") + "%0d%0a"
    with socket.create_connection(("127.0.0.1", service.port), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {3 * MAX_IMAGE}\r\n\r\n".encode() + b"{" * 100)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    log = service.text_log()
    assert "request_id=forged" in log  # the line was written, escaped
    for line in log.splitlines():
        assert not line.startswith("MRC_"), line
    assert "\\u000aMRC_SUCCESS" in log
