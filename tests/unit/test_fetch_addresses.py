"""image_url fetching's address rules, without connecting: IP literals in their legacy forms,
the kind of address each refusal names, the host allow-list, the system resolver and how an
https target is pinned. The connecting paths are in test_fetch."""

from __future__ import annotations

import asyncio
import ipaddress

import httpx
import pytest

from mrc_agent.reference_service.fetch import (
    address_refusal,
    check_url,
    host_allowed,
    ip_literal,
    system_resolver,
)
from mrc_agent.reference_service.settings import Settings
from tests.fetch_support import FakeResolver, no_dns

#: These tests name private, link-local and public addresses: they run only in a network
#: namespace with loopback alone (.ci/check netns runs them under unshare -n).
pytestmark = pytest.mark.netns


def test_ip_literal_reads_legacy_forms() -> None:
    assert ip_literal("2130706433") == ipaddress.ip_address("127.0.0.1")
    assert ip_literal("0x7f.1") == ipaddress.ip_address("127.0.0.1")
    assert ip_literal("::1") == ipaddress.ip_address("::1")
    assert ip_literal("example.com") is None
    assert ip_literal("1.2.3.4.5") is None


@pytest.mark.parametrize(("addr", "why"), [
    ("0.0.0.0", "0.0.0.0 is unspecified"),
    ("::1", "::1 is loopback"),
    ("fe80::1", "fe80::1 is link-local"),
    ("ff02::1", "ff02::1 is multicast"),
    ("10.0.0.1", "10.0.0.1 is private"),
    ("5f00::1", "5f00::1 is reserved"),
    ("fec0::1", "fec0::1 is site-local"),
    ("100.64.0.1", "100.64.0.1 is shared (CGNAT)"),
    ("64:ff9b::a9fe:a9fe", "169.254.169.254 is link-local (embedded in 64:ff9b::a9fe:a9fe)"),
    ("64:ff9b::5db8:d822", "64:ff9b::5db8:d822 is reserved"),  # NAT64 around a public one
    ("::ffff:10.0.0.1", "10.0.0.1 is private (embedded in ::ffff:a00:1)"),
])
def test_the_refusal_names_the_first_kind_that_applies(addr: str, why: str) -> None:
    # The reason reaches the client's message and the log: it must name the right kind
    # (loopback before private, the embedded IPv4 address before the wrapper's own range).
    assert address_refusal(ipaddress.ip_address(addr)) == why


def test_address_refusal() -> None:
    assert address_refusal(ipaddress.ip_address("93.184.216.34")) is None
    assert address_refusal(ipaddress.ip_address("2606:4700:4700::1111")) is None
    assert "link-local" in (address_refusal(ipaddress.ip_address("169.254.169.254")) or "")
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), allow_test_loopback=True) is None
    assert address_refusal(ipaddress.ip_address("127.0.0.1")) is not None


def test_host_allowed() -> None:
    assert host_allowed("Images.Test.", ["images.test"])
    assert not host_allowed("sub.images.test", ["images.test"])
    assert host_allowed("sub.images.test", [".images.test"])
    assert host_allowed("images.test", [".images.test"])
    assert not host_allowed("evilimages.test", [".images.test"])
    assert host_allowed("xray.test", ["XRAY.Test"])  # entries compare case-insensitively too
    assert host_allowed("a.xray.test", [".XRAY.test"])
    assert not host_allowed("ı.test", ["i.test"])  # dotless i is another name (xn--cfa)


def test_the_system_resolver_answers_unique_address_strings() -> None:
    assert asyncio.run(system_resolver("127.0.0.2", 80)) == ["127.0.0.2"]
    assert asyncio.run(system_resolver("2130706433", 443)) == ["127.0.0.1"]


def test_https_target_is_pinned_with_host_header_and_sni() -> None:
    r = FakeResolver({"images.test": ["2606:2800:220:1:248:1893:25c8:1946", "93.184.216.34"]})
    t = asyncio.run(check_url("https://images.test:8443/a.png?x=1", Settings(), r))
    assert t.connect_url == httpx.URL("https://[2606:2800:220:1:248:1893:25c8:1946]:8443/a.png?x=1")
    assert (t.host_header, t.sni) == ("images.test:8443", "images.test")
    t = asyncio.run(check_url("http://93.184.216.34/a.png", Settings(), no_dns))
    assert t.sni is None and t.connect_url == httpx.URL("http://93.184.216.34/a.png")
    r = FakeResolver({"images.test": ["93.184.216.34"]})
    t = asyncio.run(check_url("http://images.test/a.png", Settings(), r))
    assert t.sni is None and t.host_header == "images.test"  # plain http: no TLS, no SNI
    r = FakeResolver({"xn--fiqs8s.test": ["93.184.216.34"]})
    t = asyncio.run(check_url("https://中国.test/a.png", Settings(), r))
    assert t.sni == "xn--fiqs8s.test" and r.calls == ["xn--fiqs8s.test"]
