"""image_url fetching: a real HTTP server on loopback for the paths that connect, URL and IP
literals plus a fake resolver for every refusal. Nothing here contacts a non-loopback address:
each refused target is refused before any connection is attempted."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from mrc_agent.reference_service import fetch as fetch_module
from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.fetch import (
    check_url,
    fetch_image,
)
from mrc_agent.reference_service.settings import Settings
from tests.fetch_support import FakeResolver, no_dns

#: These tests name private, link-local and public addresses as fetch targets: they run only
#: in a network namespace with loopback alone, so a regression cannot send a packet off the
#: machine (.ci/run runs them under unshare -n).
pytestmark = pytest.mark.netns

BODY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8  # 2056 bytes; only the bytes matter here


@dataclass
class Seen:
    requests: list[tuple[str, str]] = field(default_factory=list)  # (path, Host header)
    stop: threading.Event = field(default_factory=threading.Event)


class Handler(BaseHTTPRequestHandler):
    seen: Seen

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self.seen.requests.append((self.path, self.headers.get("Host", "")))
        url = urlparse(self.path)
        q = parse_qs(url.query)
        if url.path == "/img":
            self._send(200, BODY)
        elif url.path == "/host":
            self._send(200, self.headers.get("Host", "").encode())
        elif url.path == "/redirect":
            self.send_response(int(q.get("code", ["302"])[0]))
            self.send_header("Location", q["to"][0])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/chain":  # n more redirects, then the image
            n = int(q["n"][0])
            self.send_response(302)
            self.send_header("Location", f"/chain?n={n - 1}" if n > 1 else "/img")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/big":
            self._send(200, b"x" * int(q["n"][0]))
        elif url.path == "/chunked":
            n = int(q["n"][0])
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(n // 100):
                if self.seen.stop.is_set():
                    return
                try:
                    self.wfile.write(b"64\r\n" + b"y" * 100 + b"\r\n")
                except OSError:  # the client hung up at its limit, as it should
                    return
            self.wfile.write(b"0\r\n\r\n")
        elif url.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(100):  # 10 s of dribbling unless the test ends first
                if self.seen.stop.wait(0.1):
                    return
                try:
                    self.wfile.write(b"z" * 10)
                    self.wfile.flush()
                except OSError:
                    return
        elif url.path == "/headers":  # the request's headers, one "name: value" a line
            self._send(200, "".join(f"{k}: {v}\n" for k, v in self.headers.items()).encode())
        elif url.path == "/nolocation":
            self.send_response(302)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/lie":  # promises 1 GB, sends 10 bytes and hangs up
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
            self.wfile.write(b"z" * 10)
        elif url.path == "/empty-encoding":
            self.send_response(200)
            self.send_header("Content-Encoding", "")
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)
        elif url.path == "/gzip":
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"abcd")
        else:
            self._send(int(url.path.strip("/") or 404) if url.path.strip("/").isdigit() else 404,
                       b"nope")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@dataclass
class Server:
    port: int
    seen: Seen

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    seen = Seen()
    handler = type("H", (Handler,), {"seen": seen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield Server(httpd.server_address[1], seen)
    finally:
        seen.stop.set()
        httpd.shutdown()
        httpd.server_close()


def loopback_settings(**kw: object) -> Settings:
    base: dict[str, object] = {"allow_loopback_fetch_for_tests": True, "fetch_timeout_s": 5.0}
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]



def fetch(url: str, settings: Settings, resolver: object = no_dns) -> bytes:
    return asyncio.run(fetch_image(url, settings, resolver=resolver))  # type: ignore[arg-type]


def refused(url: str, settings: Settings, resolver: object = no_dns) -> ServiceError:
    with pytest.raises(ServiceError) as ei:
        fetch(url, settings, resolver)
    # The client reads a message in the error body: never null or empty.
    assert isinstance(ei.value.message, str) and ei.value.message
    return ei.value


# ------------------------------------------------------------------------------- happy paths


def test_fetches_from_the_loopback_test_server(server: Server) -> None:
    assert fetch(server.url("/img"), loopback_settings()) == BODY


def test_name_is_resolved_once_and_the_checked_ip_is_what_we_connect_to(server: Server) -> None:
    # DNS rebinding: the first answer is the one checked; a second lookup would get a private
    # address. The fetch must use the first and never ask again.
    answers = iter([["127.0.0.1"], ["10.0.0.1"]])

    class Rebinding(FakeResolver):
        async def __call__(self, host: str, port: int) -> Sequence[str]:
            self.calls.append(host)
            return next(answers)

    r = Rebinding({})
    body = fetch(server.url("/host", host="images.test"), loopback_settings(), r)
    assert r.calls == ["images.test"]
    assert body == f"images.test:{server.port}".encode()  # Host header keeps the name


def test_redirects_are_followed_and_rechecked(server: Server) -> None:
    s = loopback_settings()
    assert fetch(server.url("/redirect?to=/img"), s) == BODY
    assert fetch(server.url(f"/redirect?code=301&to={server.url('/img')}"), s) == BODY
    r = FakeResolver({"cdn.test": ["127.0.0.1"]})
    to = server.url("/img", host="cdn.test")
    assert fetch(server.url(f"/redirect?code=307&to={to}"), s, r) == BODY
    assert r.calls == ["cdn.test"]  # the redirect target was resolved and checked


def test_the_upstream_sees_the_services_own_request_headers(server: Server) -> None:
    lines = fetch(server.url("/headers"), loopback_settings()).decode().splitlines()
    got = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
    assert got["accept"].lower() == "image/*"
    assert got["accept-encoding"].lower() == "identity"  # no gzip: see the bomb note in fetch.py
    assert got["user-agent"].startswith("mrc-reference-service/")
    assert "httpx" not in got["user-agent"]


def test_allowlisted_host_passes(server: Server) -> None:
    s = loopback_settings(allowed_hosts=("images.test",))
    r = FakeResolver({"images.test": ["127.0.0.1"]})
    assert fetch(server.url("/img", host="images.test"), s, r) == BODY
    s = loopback_settings(allowed_hosts=(".example.test",))
    r = FakeResolver({"img.cdn.example.test": ["127.0.0.1"]})
    assert fetch(server.url("/img", host="img.cdn.example.test"), s, r) == BODY


# ------------------------------------------------------------------------------ URL refusals


@pytest.mark.parametrize("url", [
    "ftp://example.com/a.png",
    "file:///etc/passwd",
    "gopher://example.com/",
    "data:image/png;base64,iVBORw0KGgo=",
    "javascript:alert(1)",
    "//example.com/a.png",
    "http:///a.png",
    "http://user:pw@example.com/a.png",
    "not a url",
    "http://example.com:abc/",  # not a port: httpx refuses to parse it
    "http://" + "a" * 5000 + ".com/",
])
def test_bad_urls_are_400(url: str) -> None:
    e = refused(url, loopback_settings())
    assert (e.status, e.code) == (400, "url_not_allowed")


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/",  # without the test flag
    "http://127.0.0.2/",
    "http://loopback-name.test/",  # a name, resolved (by the fake) to 127.0.0.1
    "http://169.254.169.254/latest/meta-data/",
    "http://10.0.0.1/",
    "http://172.16.5.4/",
    "http://192.168.1.1/",
    "http://100.64.0.1/",
    "http://0.0.0.0/",
    "http://224.0.0.1/",
    "http://255.255.255.255/",
    "http://240.0.0.1/",
    "http://[::1]/",
    "http://[::]/",
    "http://[fe80::1]/",
    "http://[fc00::1]/",
    "http://[fd12:3456::1]/",
    "http://[ff02::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:169.254.169.254]/",
    "http://[2002:a00:1::]/",  # 6to4 around 10.0.0.1
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64 around 169.254.169.254
    "http://[64:ff9b::127.0.0.1]/",  # NAT64, dotted tail
    "http://[64:ff9b:1::a00:1]/",  # local-use NAT64 (RFC 8215)
    "http://[::127.0.0.1]/",  # IPv4-compatible (deprecated) loopback
    "http://[::ffff:7f00:1]/",  # mapped loopback, hex tail
    "http://[0:0:0:0:0:ffff:127.0.0.1]/",  # mapped, uncompressed
    "http://[::ffff:0:127.0.0.1]/",  # IPv4-translated (RFC 2765)
    "http://[2002:7f00:1::1]/",  # 6to4 around 127.0.0.1
    "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/",  # Teredo
    "http://[FE80::1]/",  # upper case
    "http://[fe80::1%25eth0]/",  # with a zone
    "http://2130706433/",  # 127.0.0.1 as one decimal number
    "http://0x7f.1/",
    "http://0177.0.0.1/",
    "https://169.254.169.254/",
])
def test_internal_addresses_are_refused_before_connecting(url: str) -> None:
    r = FakeResolver({"loopback-name.test": ["127.0.0.1"]})
    e = refused(url, Settings(), r)
    assert (e.status, e.code) == (400, "url_not_allowed")


def test_the_url_length_limit_is_4096_characters() -> None:
    base = "http://93.184.216.34/"
    url = base + "a" * (4096 - len(base))
    assert asyncio.run(check_url(url, Settings(), no_dns)).url == httpx.URL(url)
    with pytest.raises(ServiceError) as ei:
        asyncio.run(check_url(url + "a", Settings(), no_dns))
    assert ei.value.code == "url_not_allowed" and "4096" in ei.value.message


@pytest.mark.parametrize(("port", "ok"), [
    (0, False), (1, True), (80, True), (8080, True), (65535, True), (65536, False),
    (99999, False),
])
def test_ports_outside_1_to_65535_are_refused(port: int, ok: bool) -> None:
    # httpx parses any digits as a port; the gate itself must draw the line.
    url = f"http://93.184.216.34:{port}/a.png"
    if ok:
        assert asyncio.run(check_url(url, Settings(), no_dns)).url == httpx.URL(url)
    else:
        with pytest.raises(ServiceError) as ei:
            asyncio.run(check_url(url, Settings(), no_dns))
        assert ei.value.code == "url_not_allowed" and str(port) in ei.value.message


def test_the_message_says_what_is_wrong_with_the_url() -> None:
    assert "'ftp'" in refused("ftp://example.com/a.png", Settings()).message
    assert "'none'" in refused("//example.com/a.png", Settings()).message
    assert "host" in refused("http:///a.png", Settings()).message
    assert "credentials" in refused("http://u@example.com/", Settings()).message
    assert "port" in refused("http://example.com:abc/", Settings()).message


@pytest.mark.parametrize(("url", "port"), [
    ("http://images.test/a.png", 80),
    ("https://images.test/a.png", 443),
    ("http://images.test:8080/a.png", 8080),
    ("https://images.test:80/a.png", 80),
])
def test_the_resolver_is_asked_for_the_urls_port(url: str, port: int) -> None:
    r = FakeResolver({"images.test": ["93.184.216.34"]})
    asyncio.run(check_url(url, Settings(), r))
    assert (r.calls, r.ports) == (["images.test"], [port])


def test_an_answer_that_is_no_address_is_400_and_no_answer_is_502() -> None:
    e = refused("http://odd.test/", Settings(), FakeResolver({"odd.test": ["not-an-ip"]}))
    assert (e.status, e.code) == (400, "url_not_allowed")
    e = refused("http://empty.test/", Settings(), FakeResolver({"empty.test": []}))
    assert (e.status, e.code) == (502, "fetch_failed")


def test_test_flag_admits_127_0_0_1_only() -> None:
    s = loopback_settings()
    for url in ("http://127.0.0.2/", "http://[::1]/", "http://[::ffff:127.0.0.1]/",
                "http://10.0.0.1/"):
        assert refused(url, s).code == "url_not_allowed", url


@pytest.mark.parametrize("answers", [
    ["10.1.2.3"],
    ["169.254.169.254"],
    ["93.184.216.34", "127.0.0.1"],  # one bad answer among good ones is enough
    ["2606:2800:220:1:248:1893:25c8:1946", "fd00::1"],
    ["::ffff:192.168.0.1"],
])
def test_every_resolved_address_is_checked(answers: list[str]) -> None:
    r = FakeResolver({"evil.test": answers})
    e = refused("http://evil.test/a.png", Settings(), r)
    assert (e.status, e.code) == (400, "url_not_allowed")
    assert r.calls == ["evil.test"]


def test_unresolvable_name_is_502() -> None:
    e = refused("http://nowhere.test/a.png", Settings(), FakeResolver({}))
    assert (e.status, e.code) == (502, "fetch_failed")


def test_host_not_on_allowlist_is_400(server: Server) -> None:
    s = loopback_settings(allowed_hosts=("images.test",))
    e = refused(server.url("/img"), s)  # 127.0.0.1 is not "images.test"
    assert (e.status, e.code) == (400, "url_not_allowed")
    e = refused("http://images.test.evil.test/", s)
    assert e.code == "url_not_allowed"


@pytest.mark.parametrize("target", [
    "http://10.0.0.1/x.png",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]/",
    "http://127.0.0.2/",
    "file:///etc/passwd",
    "http://internal.test/x.png",  # a name that resolves to a private address
])
def test_redirect_to_a_refused_target_is_refused(server: Server, target: str) -> None:
    r = FakeResolver({"internal.test": ["192.168.0.10"]})
    before = len(server.seen.requests)
    e = refused(server.url(f"/redirect?to={target}"), loopback_settings(), r)
    assert (e.status, e.code) == (400, "url_not_allowed")
    assert len(server.seen.requests) == before + 1  # only the redirecting hop was contacted


def test_redirect_to_allowlist_escape_is_refused(server: Server) -> None:
    s = loopback_settings(allowed_hosts=("images.test",))
    r = FakeResolver({"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    to = server.url("/img", host="other.test")
    e = refused(server.url(f"/redirect?to={to}", host="images.test"), s, r)
    assert e.code == "url_not_allowed"


def test_too_many_redirects_is_502(server: Server) -> None:
    before = len(server.seen.requests)
    e = refused(server.url("/loop"), loopback_settings(max_redirects=3))
    assert (e.status, e.code) == (502, "fetch_failed")
    hops = [p for p, _ in server.seen.requests[before:]]
    assert hops == ["/loop"] * 4  # the first request + 3 redirects, then stop


def test_exactly_max_redirects_are_followed(server: Server) -> None:
    assert fetch(server.url("/chain?n=3"), loopback_settings(max_redirects=3)) == BODY
    e = refused(server.url("/chain?n=4"), loopback_settings(max_redirects=3))
    assert (e.status, e.code) == (502, "fetch_failed")


# ------------------------------------------------------------------------------------ limits


def test_content_length_over_limit_is_413(server: Server) -> None:
    e = refused(server.url("/big?n=5000"), loopback_settings(max_image_bytes=4096))
    assert (e.status, e.code) == (413, "fetch_too_large")
    assert fetch(server.url("/big?n=4096"), loopback_settings(max_image_bytes=4096)) == b"x" * 4096


def test_content_length_over_limit_is_refused_before_the_body_is_read(server: Server) -> None:
    # The upstream announces 1 GB and hangs up after 10 bytes: only the header check answers
    # 413; reading the body first would end in a broken stream (502).
    e = refused(server.url("/lie"), loopback_settings(max_image_bytes=4096))
    assert (e.status, e.code) == (413, "fetch_too_large")
    assert str(10**9) in e.message and "4096" in e.message


def test_streamed_body_over_limit_is_413_without_reading_it_all(server: Server) -> None:
    s = loopback_settings(max_image_bytes=4096)
    e = refused(server.url("/chunked?n=10000000"), s)  # 10 MB offered, no Content-Length
    assert (e.status, e.code) == (413, "fetch_too_large")
    assert fetch(server.url("/chunked?n=4000"), s) == b"y" * 4000


def test_total_time_limit_is_504(server: Server) -> None:
    s = loopback_settings(fetch_timeout_s=0.5)
    t0 = time.monotonic()
    e = refused(server.url("/slow"), s)
    assert (e.status, e.code) == (504, "fetch_timeout")
    assert time.monotonic() - t0 < 5.0  # the body would take 10 s


def test_slow_dns_counts_against_the_time_limit() -> None:
    async def slow(host: str, port: int) -> Sequence[str]:
        await asyncio.sleep(10)
        return ["127.0.0.1"]

    e = refused("http://slow-dns.test/", loopback_settings(fetch_timeout_s=0.3), slow)
    assert (e.status, e.code) == (504, "fetch_timeout")


@pytest.mark.parametrize("path", ["/404", "/500", "/403", "/300"])
def test_non_2xx_is_502(server: Server, path: str) -> None:
    e = refused(server.url(path), loopback_settings())
    assert (e.status, e.code) == (502, "fetch_failed")
    assert path.strip("/") in e.message  # the message says what the upstream answered


def test_compressed_response_is_refused(server: Server) -> None:
    e = refused(server.url("/gzip"), loopback_settings())
    assert (e.status, e.code) == (502, "fetch_failed")


def test_an_empty_content_encoding_means_identity(server: Server) -> None:
    assert fetch(server.url("/empty-encoding"), loopback_settings()) == BODY


def test_redirect_without_location_is_502(server: Server) -> None:
    e = refused(server.url("/nolocation"), loopback_settings())
    assert (e.status, e.code) == (502, "fetch_failed")
    assert "302" in e.message


def test_each_redirect_hop_is_logged_with_its_status_and_target(
        server: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=fetch_module.log.name)
    assert fetch(server.url("/redirect?code=307&to=/img"), loopback_settings()) == BODY
    hops = [r.getMessage() for r in caplog.records if r.name == fetch_module.log.name]
    assert len(hops) == 1
    assert "307" in hops[0] and hops[0].endswith(server.url("/img"))


def test_connection_refused_is_502() -> None:
    import socket

    with socket.socket() as sock:  # a loopback port that nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    e = refused(f"http://127.0.0.1:{port}/", loopback_settings())
    assert (e.status, e.code) == (502, "fetch_failed")


# ---------------------------------------------------------- the client's own settings, observed


def test_proxy_variables_in_the_environment_are_ignored(server: Server,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The URL was checked and pinned to its resolved address; a proxy from the environment
    would make that check moot (the proxy resolves the name again, anywhere it likes)."""
    proxied = Seen()
    handler = type("P", (Handler,), {"seen": proxied})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(var, url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert fetch(server.url("/img"), loopback_settings()) == BODY
        assert proxied.requests == []
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_an_upstream_whose_certificate_does_not_verify_is_refused(tmp_path: Path) -> None:
    import datetime
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    seen = Seen()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("T", (Handler,), {"seen": seen}))
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        e = refused(f"https://127.0.0.1:{httpd.server_address[1]}/img", loopback_settings())
        assert (e.status, e.code) == (502, "fetch_failed")
        assert seen.requests == []  # no request went over the unverified connection
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_each_hop_opens_its_own_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """No keep-alive: a pooled connection is matched by address alone, so a TLS session
    verified for one name would otherwise carry the next hop's request for another name on
    the same IP. Against an HTTP/1.1 server that keeps connections open, every hop must come
    from a fresh client port."""
    ports: list[int] = []

    class KeepAlive(Handler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            ports.append(self.client_address[1])
            super().do_GET()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("K", (KeepAlive,), {"seen": Seen()}))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/chain?n=2"
        assert fetch(url, loopback_settings()) == BODY
        assert len(ports) == 3 and len(set(ports)) == 3
    finally:
        httpd.shutdown()
        httpd.server_close()


def _ca_and_leaf(tmp_path: Path, dns_name: str) -> tuple[bytes, Path, Path]:
    """A throwaway CA (its PEM) and a leaf certificate for ``dns_name`` signed by it (files)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mrc test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(1)
          .not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_name)]))
            .issuer_name(ca_name).public_key(leaf_key.public_key()).serial_number(2)
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (tmp_path / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "leaf.key").write_bytes(leaf_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return ca.public_bytes(serialization.Encoding.PEM), tmp_path / "leaf.pem", tmp_path / "leaf.key"


def test_https_by_name_sends_sni_and_verifies_the_name_on_the_pinned_ip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection goes to the checked IP, yet the certificate must be verified for the
    name in the URL: the name travels as SNI, and the shared context does the verifying."""
    import ssl

    ca_pem, cert, key = _ca_and_leaf(tmp_path, "images.test")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    sni_seen: list[str | None] = []

    def note_sni(sock: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
        sni_seen.append(name)

    server_ctx.sni_callback = note_sni
    seen = Seen()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("T", (Handler,), {"seen": seen}))
    httpd.socket = server_ctx.wrap_socket(httpd.socket, server_side=True)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client_ctx = ssl.create_default_context(cadata=ca_pem.decode())
    monkeypatch.setattr(fetch_module, "_ssl_context", lambda: client_ctx)
    try:
        port = httpd.server_address[1]
        r = FakeResolver({"images.test": ["127.0.0.1"]})
        assert fetch(f"https://images.test:{port}/img", loopback_settings(), r) == BODY
        assert sni_seen == ["images.test"]
        assert seen.requests == [("/img", f"images.test:{port}")]
    finally:
        httpd.shutdown()
        httpd.server_close()
