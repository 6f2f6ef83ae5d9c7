"""``--web-config-file``: the exporter-toolkit web configuration (TLS, client certificates,
basic auth, headers) on a real server on loopback, spoken to by real TLS clients. A throwaway
CA, server and client certificates are made per test module; nothing is read from the host's
trust store."""

from __future__ import annotations

import base64
import http.client
import os
import re
import select
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import bcrypt
import pytest
from prometheus_client.registry import CollectorRegistry

from mrc_agent.agent.cli import main
from mrc_agent.agent.core.config import load
from mrc_agent.exporters.exposition.http import (
    ExpositionServer,
    Limits,
    Request,
    Response,
    Routes,
)
from mrc_agent.exporters.exposition.http.webconfig import BasicAuth, credentials, load_web_config
from tests.conftest import REPO, wait_until
from tests.pki import Pki, make_pki

LIMITS = Limits(idle_timeout_s=2.0, head_timeout_s=2.0, body_timeout_s=2.0,
                write_timeout_s=2.0, linger_s=0.5)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throwaway CA with server and client certificates (``tests/pki.py``)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def _client_tls(pki: Pki, cert: str | None = None) -> ssl.SSLContext:
    """A client that trusts only the test CA, optionally presenting ``cert``."""
    ctx = ssl.create_default_context(cafile=pki.ca)
    if cert is not None:
        ctx.load_cert_chain(getattr(pki, cert), getattr(pki, f"{cert}_key"))
    return ctx


# -- a real server, a real client --------------------------------------------------------------

class Hook(Routes):
    """An extra route (as the webhook and captures are) that takes any body."""

    max_body_bytes = 1 << 20

    def handle(self, request: Request) -> Response | None:
        if request.path != "/hook":
            return None
        return Response(200, b"hook\n", "text/plain")


@contextmanager
def serving(path: Path, text: str) -> Iterator[int]:
    """A server built from the web configuration ``text`` (written to ``path``); its port."""
    path.write_text(text)
    web = load_web_config(str(path))
    srv = ExpositionServer(CollectorRegistry(), "127.0.0.1", 0, lambda: 1, lambda: None,
                           routes=Hook(), limits=LIMITS, tls=web.tls, auth=web.auth,
                           headers=web.headers)
    srv.start()
    try:
        yield srv.port
    finally:
        srv.stop()


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _get(port: int, path: str = "/metrics", *, tls: ssl.SSLContext | None = None,
         auth: tuple[str, str] | None = None, method: str = "GET",
         body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    conn: http.client.HTTPConnection
    if tls is not None:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=10)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Authorization": _basic(*auth)} if auth else {}
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


#: What a client sees when the server refuses its TLS handshake or speaks TLS to plain HTTP.
REFUSED = (ssl.SSLError, ConnectionError, http.client.HTTPException)


def _tls(pki: Pki, extra: str = "", cert: str = "server") -> str:
    return (f"tls_server_config:\n  cert_file: {getattr(pki, cert)}\n"
            f"  key_file: {getattr(pki, cert + '_key')}\n{extra}")


def _hash(password: str, cost: int = 4) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()


# -- TLS ---------------------------------------------------------------------------------------

def test_tls_scrape_works_and_plain_http_to_the_tls_port_fails(pki: Pki, tmp_path) -> None:
    with serving(tmp_path / "web.yml", _tls(pki)) as port:
        status, _, body = _get(port, tls=_client_tls(pki))
        assert status == 200
        with pytest.raises(REFUSED):
            _get(port)  # plain HTTP: the server expects a ClientHello
        assert _get(port, "/healthz", tls=_client_tls(pki))[2] == b"ok\n"


def test_relative_paths_are_relative_to_the_file_and_versions_apply(pki: Pki) -> None:
    text = ("tls_server_config:\n  cert_file: server.pem\n  key_file: server-key.pem\n"
            "  min_version: TLS13\n")
    with serving(pki.dir / "relative.yml", text) as port:
        assert _get(port, tls=_client_tls(pki))[0] == 200
        old = _client_tls(pki)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(REFUSED):
            _get(port, tls=old)


def test_require_and_verify_client_cert_refuses_a_client_without_one(pki: Pki,
                                                                     tmp_path) -> None:
    extra = f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
    with serving(tmp_path / "web.yml", _tls(pki, extra)) as port:
        with pytest.raises(REFUSED):
            _get(port, tls=_client_tls(pki))
        with pytest.raises(REFUSED):
            _get(port, tls=_client_tls(pki, "rogue_client"))
        status, _, _ = _get(port, tls=_client_tls(pki, "client"))
        assert status == 200


def test_verify_client_cert_if_given_lets_in_no_cert_but_not_a_bad_one(pki: Pki,
                                                                       tmp_path) -> None:
    extra = f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {pki.ca}\n"
    with serving(tmp_path / "web.yml", _tls(pki, extra)) as port:
        assert _get(port, tls=_client_tls(pki))[0] == 200
        assert _get(port, tls=_client_tls(pki, "client"))[0] == 200
        with pytest.raises(REFUSED):
            _get(port, tls=_client_tls(pki, "rogue_client"))


# -- basic auth --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def users() -> str:
    return f"basic_auth_users:\n  alice: {_hash('wonderland')}\n  bob: {_hash('builder')}\n"


@pytest.mark.parametrize("path", ["/metrics", "/hook", "/healthz", "/nowhere"])
def test_basic_auth_guards_every_path(users: str, tmp_path, path: str) -> None:
    with serving(tmp_path / "web.yml", users) as port:
        status, headers, _ = _get(port, path)
        assert status == 401 and headers["www-authenticate"].startswith("Basic")
        assert _get(port, path, auth=("alice", "wrong"))[0] == 401
        assert _get(port, path, auth=("mallory", "wonderland"))[0] == 401
        assert _get(port, path, auth=("bob", "wonderland"))[0] == 401  # alice's password
        assert _get(port, path, auth=("alice", "wonderland"))[0] == (
            404 if path == "/nowhere" else 200)
        assert _get(port, path, auth=("bob", "builder"))[0] == (
            404 if path == "/nowhere" else 200)


def test_a_stranger_posting_a_body_gets_401_unread(users: str, tmp_path) -> None:
    with serving(tmp_path / "web.yml", users) as port:
        status, headers, _ = _get(port, "/hook", method="POST", body=b"x" * 100_000)
        assert status == 401 and headers["connection"] == "close"
        assert _get(port, "/hook", method="POST", body=b"{}",
                    auth=("alice", "wonderland"))[0] == 200


def test_basic_auth_over_tls_with_client_certificates(pki: Pki, users: str,
                                                      tmp_path) -> None:
    extra = f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
    with serving(tmp_path / "web.yml", _tls(pki, extra) + users) as port:
        tls = _client_tls(pki, "client")
        assert _get(port, tls=tls)[0] == 401
        assert _get(port, tls=tls, auth=("alice", "wonderland"))[0] == 200


def test_a_flood_of_wrong_passwords_does_not_stall_a_remembered_scrape(tmp_path) -> None:
    """The bcrypt checks run in a thread: while several slow ones queue there, a scraper
    whose password already passed is answered at once (with the checks on the event loop it
    would be answered after all of them)."""
    slow = _hash("not-this", cost=12)  # ~0.1-0.3 s per check on this kind of machine
    text = f"basic_auth_users:\n  prometheus: {_hash('scrape')}\n  slow: {slow}\n"
    with serving(tmp_path / "web.yml", text) as port:
        assert _get(port, auth=("prometheus", "scrape"))[0] == 200  # checked, remembered
        flood = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(6)]
        try:
            for s in flood:
                s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: "
                          f"{_basic('slow', 'guess')}\r\n\r\n".encode())
            assert _get(port, auth=("prometheus", "scrape"))[0] == 200
            unanswered = [s for s in flood if not select.select([s], [], [], 0)[0]]
            assert unanswered, "the remembered scrape waited for every bcrypt check"
            for s in flood:  # past four waiting checks from one address: 503 at once
                assert s.recv(65536).startswith((b"HTTP/1.1 401 ", b"HTTP/1.1 503 "))
        finally:
            for s in flood:
                s.close()


def test_a_passed_check_is_remembered_and_a_failed_one_is_not() -> None:
    auth = BasicAuth({"alice": _hash("wonderland")})
    right, wrong = _basic("alice", "wonderland"), _basic("alice", "nope")
    assert auth.cached(right) is None and auth.cached(wrong) is None
    assert auth.check(wrong) is False and auth.cached(wrong) is None
    assert auth.check(right) is True and auth.cached(right) is True
    assert auth.cached(_basic("alice", "wonderland!")) is None
    # Nothing to check at all: answered without bcrypt.
    assert auth.cached(None) is False and auth.cached("Bearer abc") is False


@pytest.mark.parametrize(("header", "expected"), [
    (_basic("a", "b:c"), (b"a", b"b:c")),
    (_basic("a", ""), (b"a", b"")),
    ("basic " + base64.b64encode(b"u:p").decode(), (b"u", b"p")),
    ("Basic " + base64.b64encode(b"no-colon").decode(), None),
    ("Basic !!!", None),
    ("Bearer " + base64.b64encode(b"u:p").decode(), None),
    ("", None),
    (None, None),
])
def test_credentials_are_read_as_basic_auth_defines_them(header, expected) -> None:
    assert credentials(header) == expected


# -- headers -----------------------------------------------------------------------------------

def test_configured_headers_are_on_every_response(users: str, tmp_path) -> None:
    text = users + ("http_server_config:\n  http2: false\n  headers:\n"
                    "    X-Frame-Options: deny\n"
                    "    Content-Security-Policy: \"default-src 'none'\"\n"
                    "    X-XSS-Protection: ''\n")
    with serving(tmp_path / "web.yml", text) as port:
        for status, headers, _ in (_get(port), _get(port, auth=("alice", "wonderland")),
                                   _get(port, "/nowhere", auth=("alice", "wonderland"))):
            assert status in (200, 401, 404)
            assert headers["x-frame-options"] == "deny"
            assert headers["content-security-policy"] == "default-src 'none'"
            assert "x-xss-protection" not in headers  # blank: unset


# -- bad files: one line, exit code 2 ----------------------------------------------------------

BAD_FILES: list[tuple[str, Callable[[Pki], str], str]] = [
    ("not-yaml", lambda p: "tls_server_config: [oops\n", "is not valid YAML"),
    ("not-a-mapping", lambda p: "- tls_server_config\n", "must hold a mapping"),
    ("unknown-top-key", lambda p: "tls_config: {}\n", "unknown key 'tls_config'"),
    ("unknown-tls-key", lambda p: _tls(p, "  cert_fil: x\n"),
     "unknown key 'tls_server_config.cert_fil'"),
    ("unknown-http-key", lambda p: "http_server_config: {http3: true}\n",
     "unknown key 'http_server_config.http3'"),
    ("unsupported-key", lambda p: "rate_limit: {interval: 1s, burst: 5}\n",
     "rate_limit is not supported by mrc-agent"),
    ("bad-client-auth", lambda p: _tls(p, "  client_auth_type: Sometimes\n"),
     "client_auth_type 'Sometimes' is not one of NoClientCert, RequestClientCert"),
    ("ca-without-client-auth", lambda p: _tls(p, f"  client_ca_file: {p.ca}\n"),
     "a client CA is given but client_auth_type is NoClientCert"),
    ("verify-without-ca", lambda p: _tls(p, "  client_auth_type: RequireAndVerifyClientCert\n"),
     "needs tls_server_config.client_ca_file"),
    ("bad-version", lambda p: _tls(p, "  min_version: TLS14\n"),
     "min_version 'TLS14' is not one of TLS10, TLS11, TLS12, TLS13"),
    ("no-key", lambda p: f"tls_server_config:\n  cert_file: {p.server}\n",
     "tls_server_config.key_file is missing"),
    ("missing-cert", lambda p: _tls(p).replace(p.server, "/nonexistent/cert.pem"),
     "cannot read cert_file /nonexistent/cert.pem"),
    ("cert-is-not-pem", lambda p: _tls(p).replace(p.server, p.server_key),
     "holds no PEM certificate"),
    ("key-of-another-cert", lambda p: _tls(p).replace(p.server_key, p.client_key),
     "do not load: key values mismatch"),
    ("ca-is-not-pem", lambda p: _tls(p, "  client_auth_type: VerifyClientCertIfGiven\n"
                                        f"  client_ca_file: {p.server_key}\n"),
     "holds no PEM certificate"),
    ("plain-password", lambda p: "basic_auth_users:\n  alice: wonderland\n",
     "the password of 'alice' is not a bcrypt hash"),
    ("user-given-twice", lambda p: f"basic_auth_users:\n  alice: {_hash('a')}\n"
                                   f"  alice: {_hash('b')}\n", "key 'alice' given twice"),
    ("header-not-allowed", lambda p: "http_server_config:\n  headers: {Server: nginx}\n",
     "header 'Server' cannot be set"),
    ("header-bad-value", lambda p: "http_server_config:\n  headers:\n"
                                   "    X-Frame-Options: allow-from\n",
     "header X-Frame-Options 'allow-from' is not one of deny, sameorigin"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_FILES,
                         ids=[b[0] for b in BAD_FILES])
def test_a_bad_file_is_one_line_and_exit_2(pki: Pki, tmp_path, capsys, monkeypatch,
                                           name: str, content: Callable[[Pki], str],
                                           message: str) -> None:
    for var in [v for v in os.environ if v.startswith("MRC_AGENT_")]:
        monkeypatch.delenv(var)
    path = tmp_path / f"{name}.yml"
    path.write_text(content(pki))
    rc = main(["run", "--gpu-backend", "none", "--listen", "127.0.0.1:0",
               "--web-config-file", str(path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_missing_file_named_in_the_environment_is_exit_2_from_the_command() -> None:
    r = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "run", "--gpu-backend", "none",
                        "--listen", "127.0.0.1:0"], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "MRC_AGENT_WEB_CONFIG_FILE": "/nonexistent/web.yml"},
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert "cannot read web config file /nonexistent/web.yml" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_setting_comes_from_the_file_the_environment_and_the_flag(tmp_path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("web_config_file: /etc/mrc/web.yml\n")
    assert load({}, env={}, config_path=str(config)).web_config_file == "/etc/mrc/web.yml"
    env = {"MRC_AGENT_WEB_CONFIG_FILE": "/env/web.yml"}
    assert load({}, env=env, config_path=str(config)).web_config_file == "/env/web.yml"
    assert load({"web_config_file": "/flag.yml"}, env=env).web_config_file == "/flag.yml"


# -- the agent itself, and SIGHUP --------------------------------------------------------------

def _peer_der(port: int, tls: ssl.SSLContext) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            tls.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return der



def test_the_agent_serves_the_file_and_rereads_it_on_sighup(pki: Pki, tmp_path) -> None:
    web = tmp_path / "web.yml"
    headers = "http_server_config:\n  headers: {X-Content-Type-Options: nosniff}\n"
    web.write_text(_tls(pki) + f"basic_auth_users:\n  alice: {_hash('a')}\n" + headers)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mrc_agent.agent", "run", "--listen", "127.0.0.1:0", "--gpu-backend",
         "none", "--interval", "0.2", "--web-config-file", str(web)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        assert proc.stderr is not None
        log: list[str] = []
        port = 0
        while not port:
            line = proc.stderr.readline()
            assert line, "agent ended: " + "".join(log)
            log.append(line)
            m = re.search(r"listening on https://127\.0\.0\.1:(\d+)/metrics", line)
            port = int(m.group(1)) if m else 0
        tls = _client_tls(pki)
        status, got, body = _get(port, tls=tls, auth=("alice", "a"))
        assert status == 200 and b"mrc_agent_" in body
        assert got["x-content-type-options"] == "nosniff"
        assert _get(port, tls=tls)[0] == 401
        assert _peer_der(port, tls) == pki.der("server")

        # A new certificate and a new user, as a rotation would bring them.
        web.write_text(_tls(pki, cert="server2") + f"basic_auth_users:\n  bob: {_hash('b')}\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _get(port, tls=tls, auth=("bob", "b"))[0] == 200, timeout=15.0,
                   step=0.1)
        assert _get(port, tls=tls, auth=("alice", "a"))[0] == 401
        assert _peer_der(port, tls) == pki.der("server2")
        assert "x-content-type-options" not in _get(port, tls=tls, auth=("bob", "b"))[1]

        # Switching TLS off needs a restart: refused, the running configuration kept.
        web.write_text(f"basic_auth_users:\n  carol: {_hash('c')}\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert _get(port, tls=tls, auth=("bob", "b"))[0] == 200
        assert _get(port, tls=tls, auth=("carol", "c"))[0] == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        text = "".join(log) + proc.stderr.read()
        assert "web config file" in text and "re-read: TLS" in text
        assert "switching TLS off needs a restart" in text
        assert "Traceback" not in text
    finally:
        proc.kill()
        proc.wait()


class BearerHook(Hook):
    """A route behind its own bearer token, as the capture webhook is."""

    def checks_own_bearer(self, path: str) -> bool:
        return path == "/hook"

    def handle(self, request: Request) -> Response | None:
        if request.path != "/hook":
            return None
        if request.headers.get("authorization") != "Bearer s3cret":
            return Response(401, b"bad token\n", "text/plain")
        return Response(200, b"hook\n", "text/plain")


def test_a_route_with_its_own_bearer_token_takes_alertmanagers_one_credential(
        users: str, tmp_path) -> None:
    (tmp_path / "web.yml").write_text(users)
    web = load_web_config(str(tmp_path / "web.yml"))
    srv = ExpositionServer(CollectorRegistry(), "127.0.0.1", 0, lambda: 1, lambda: None,
                           routes=BearerHook(), limits=LIMITS, tls=web.tls, auth=web.auth,
                           headers=web.headers)
    srv.start()

    def call(path: str, authorization: str | None, method: str = "POST") -> int:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        try:
            conn.request(method, path, body=b"{}" if method == "POST" else None,
                         headers={"Authorization": authorization} if authorization else {})
            return conn.getresponse().status
        finally:
            conn.close()

    try:
        assert call("/hook", "Bearer s3cret") == 200
        assert call("/hook", "Bearer wrong") == 401  # the route's own check still applies
        assert call("/hook", None) == 401
        assert call("/hook", _basic("alice", "wonderland")) == 401  # no token: route says no
        # A bearer token opens nothing else: /metrics stays behind basic auth.
        assert call("/metrics", "Bearer s3cret", method="GET") == 401
        assert call("/metrics", _basic("alice", "wonderland"), method="GET") == 200
    finally:
        srv.stop()
