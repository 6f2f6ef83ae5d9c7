"""``mrc-agent proxy --upstream``: an origin is read with its scheme's default port, anything
else is refused saying why, and an https origin is spoken to over verified TLS by default."""

from __future__ import annotations

import ssl

import pytest

from mrc_agent.agent.tools.proxy import Proxy
from mrc_agent.agent.tools.proxy_http import ProxyError, Upstream
from mrc_agent.exporters.instrumentation import MRCMetrics


@pytest.mark.parametrize(("url", "upstream", "authority"), [
    ("http://h", Upstream("http", "h", 80), b"h"),
    ("https://h", Upstream("https", "h", 443), b"h"),
    ("http://h:8000/", Upstream("http", "h", 8000), b"h:8000"),
    ("https://h:443", Upstream("https", "h", 443), b"h"),
    ("https://[::1]:8443", Upstream("https", "::1", 8443), b"[::1]:8443"),
])
def test_an_origin_is_read_with_its_schemes_default_port(url: str, upstream: Upstream,
                                                          authority: bytes) -> None:
    assert Upstream.parse(url) == upstream
    assert upstream.authority == authority


_NOT_AN_ORIGIN = "is not an http(s)://host[:port] URL"
_A_PATH = "has a path; give the origin only, the request's path is passed as received"


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://h", _NOT_AN_ORIGIN), ("http://", _NOT_AN_ORIGIN), ("h:80", _NOT_AN_ORIGIN),
    ("http://h/v1", _A_PATH), ("http://h?x=1", _A_PATH), ("http://h/#f", _A_PATH),
    ("http://h:99999", "Port out of range 0-65535"),
])
def test_anything_but_an_origin_is_refused_naming_the_flag_and_why(url: str, why: str) -> None:
    with pytest.raises(ProxyError) as e:
        Upstream.parse(url)
    sep = ": " if why.startswith("Port") else " "
    assert str(e.value) == f"--upstream {url!r}{sep}{why}"


def test_an_https_upstream_is_verified_against_the_system_store_by_default() -> None:
    metrics = MRCMetrics(resolution_unknown=True)
    tls = Proxy(Upstream.parse("https://h"), metrics)._tls
    assert isinstance(tls, ssl.SSLContext)
    assert tls.verify_mode == ssl.CERT_REQUIRED and tls.check_hostname
    assert Proxy(Upstream.parse("http://h"), metrics)._tls is None
    given = ssl.create_default_context()
    assert Proxy(Upstream.parse("https://h"), metrics, tls=given)._tls is given
