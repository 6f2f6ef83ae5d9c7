"""Fetching ``image_url`` without becoming an SSRF proxy into the service's own network.

Every hop (the URL and each redirect) goes through the same gate before any connection:

1. scheme http or https only, no credentials in the URL;
2. host on ``settings.allowed_hosts`` when that list is non-empty (``.example.com`` also admits
   subdomains);
3. the host resolved once, and *every* address it resolves to must be publicly routable — no
   loopback, link-local (cloud metadata at 169.254.169.254), private (RFC 1918, fc00::/7),
   shared (100.64/10), unspecified, multicast or reserved, also when embedded in IPv6
   (``::ffff:a.b.c.d``, 6to4, NAT64). Legacy numeric forms (``2130706433``, ``0x7f.1``) are read
   as the IPv4 literals that ``getaddrinfo`` would make of them.

DNS rebinding: the connection goes to the address that was checked, never to a second lookup.
The request URL is rewritten to the pinned IP while the ``Host`` header keeps the name, and for
https the name is sent as SNI and verified against the certificate (httpcore's ``sni_hostname``
request extension). This keeps httpx's public API — a custom network backend that re-validates
at connect time would reach into httpcore internals — and the same code path serves http and
https. Redirects are followed by hand, so each hop is re-checked and re-pinned; environment
proxies are ignored (``trust_env=False``), since a proxy would do its own resolution.

Limits: the whole fetch (all hops, DNS included) is bounded by ``fetch_timeout_s`` (504
``fetch_timeout``); the body is read as a stream and abandoned at ``max_image_bytes + 1``
(413 ``fetch_too_large``); compressed transfer encodings are refused, since one gzip chunk can
inflate a thousandfold before any limit is seen; non-2xx answers and network failures are 502
``fetch_failed``. Refusals of the URL itself are 400 ``url_not_allowed``.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx

from mrc_agent.reference_service.errors import ServiceError
from mrc_agent.reference_service.logs import escape
from mrc_agent.reference_service.settings import Settings

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``(host, port) -> IP address strings``; injectable so tests never need real DNS.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_URL_LEN = 4096
_TEST_LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT; not "private" in 3.10
#: What inet_aton accepts: 1-4 dot-separated decimal, octal or hex parts.
_LEGACY_V4 = re.compile(r"(0[xX][0-9a-fA-F]*|[0-9]+)(\.(0[xX][0-9a-fA-F]*|[0-9]+)){0,3}")
_USER_AGENT = "mrc-reference-service/0.1 (image_url fetch)"


async def system_resolver(host: str, port: int) -> list[str]:
    """The event loop's ``getaddrinfo`` (in its thread pool), as unique address strings."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   proto=socket.IPPROTO_TCP)
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in out:
            out.append(addr)
    return out


def ip_literal(host: str) -> IPAddress | None:
    """``host`` as an IP address if it is one (including inet_aton's legacy IPv4 forms)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _LEGACY_V4.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def address_refusal(ip: IPAddress, allow_test_loopback: bool = False) -> str | None:
    """Why ``ip`` may not be fetched from, or None when it is a public address."""
    if allow_test_loopback and ip == _TEST_LOOPBACK:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            why = address_refusal(embedded)
            if why:
                return f"{why} (embedded in {ip})"
    checks: tuple[tuple[bool, str], ...] = (
        (ip.is_unspecified, "unspecified"),
        (ip.is_loopback, "loopback"),
        (ip.is_link_local, "link-local"),
        (ip.is_multicast, "multicast"),
        (ip.is_private, "private"),
        (ip.is_reserved, "reserved"),
        (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local, "site-local"),
        (isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED, "shared (CGNAT)"),
        (not ip.is_global, "not globally routable"),
    )
    for hit, why in checks:
        if hit:
            return f"{ip} is {why}"
    return None


def _normalise_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        return host


def host_allowed(host: str, allowed_hosts: Sequence[str]) -> bool:
    """Exact match on the allowlist, or a subdomain of an entry written ``.example.com``."""
    h = _normalise_host(host)
    for entry in allowed_hosts:
        wildcard = entry.strip().startswith(".")
        e = _normalise_host(entry.strip().lstrip("."))
        if h == e or (wildcard and h.endswith("." + e)):
            return True
    return False


@dataclass(frozen=True)
class _Target:
    url: httpx.URL  # as named by the client (or the redirect)
    connect_url: httpx.URL  # same, with the host replaced by the pinned, checked IP
    host_header: str
    sni: str | None


def _parse(url: str | httpx.URL) -> httpx.URL:
    if isinstance(url, str) and len(url) > _MAX_URL_LEN:
        raise ServiceError.of("url_not_allowed", f"URL longer than {_MAX_URL_LEN} characters")
    try:
        u = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        raise ServiceError.of("url_not_allowed", f"not a valid URL: {e}") from e
    if u.scheme not in ("http", "https"):
        raise ServiceError.of("url_not_allowed",
                              f"only http and https URLs are fetched, not {u.scheme or 'none'!r}")
    if not u.host:
        raise ServiceError.of("url_not_allowed", "URL has no host")
    if u.userinfo:
        raise ServiceError.of("url_not_allowed", "credentials in URLs are not accepted")
    try:
        port = u.port
    except ValueError as e:
        raise ServiceError.of("url_not_allowed", f"not a valid URL: {e}") from e
    if port is not None and not 0 < port < 65536:
        raise ServiceError.of("url_not_allowed", f"port {port} is not 1-65535")
    return u


async def check_url(url: str | httpx.URL, settings: Settings, resolver: Resolver) -> _Target:
    """Apply the gate (scheme, allowlist, every resolved address) and pin the address."""
    u = _parse(url)
    host = u.host
    if settings.allowed_hosts and not host_allowed(host, settings.allowed_hosts):
        raise ServiceError.of("url_not_allowed", f"host {host!r} is not on the allowed list")
    port = u.port or (443 if u.scheme == "https" else 80)
    allow_lo = settings.allow_loopback_fetch_for_tests
    literal = ip_literal(host)
    if literal is not None:
        addrs: list[IPAddress] = [literal]
    else:
        try:
            found = await resolver(u.raw_host.decode("ascii"), port)
        except (OSError, UnicodeError) as e:
            raise ServiceError.of("fetch_failed", f"cannot resolve {host!r}: {e}") from e
        addrs = []
        for a in found:
            try:
                addrs.append(ipaddress.ip_address(a))
            except ValueError as e:  # e.g. a scoped fe80::1%eth0: link-local anyway
                raise ServiceError.of("url_not_allowed",
                                      f"{host!r} resolves to unusable address {a!r}") from e
        if not addrs:
            raise ServiceError.of("fetch_failed", f"{host!r} resolves to no address")
    for ip in addrs:  # all of them: an attacker's DNS may mix a public and a private answer
        why = address_refusal(ip, allow_lo)
        if why:
            raise ServiceError.of("url_not_allowed", f"{host!r} is not fetchable: {why}")
    # Connect to the checked address itself — also for literals, so "0x7f.1"-style spellings
    # are never handed to another parser. SNI carries the ASCII (IDNA) name; an IP has none.
    pinned = addrs[0]
    connect = u.copy_with(host=str(pinned))
    sni = u.raw_host.decode("ascii") if (u.scheme == "https" and literal is None) else None
    return _Target(u, connect, u.netloc.decode("ascii"), sni)


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    # Built once (loading the CA bundle takes tens of ms) and shared; verification stays on.
    return httpx.create_ssl_context()


async def _fetch(url: str, settings: Settings, resolver: Resolver) -> bytes:
    limit = settings.max_image_bytes
    current: str | httpx.URL = url
    async with httpx.AsyncClient(
        trust_env=False, follow_redirects=False, verify=_ssl_context(),
        timeout=httpx.Timeout(settings.fetch_timeout_s),
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=0),
    ) as client:
        for _hop in range(settings.max_redirects + 1):
            target = await check_url(current, settings, resolver)
            headers = {"Host": target.host_header, "Accept": "image/*",
                       "Accept-Encoding": "identity", "User-Agent": _USER_AGENT}
            extensions = {"sni_hostname": target.sni} if target.sni else {}
            request = client.build_request("GET", target.connect_url, headers=headers,
                                           extensions=extensions)
            response = await client.send(request, stream=True)
            try:
                status = response.status_code
                if status in _REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise ServiceError.of("fetch_failed",
                                              f"redirect {status} without Location")
                    # Relative to the URL as named, not the pinned IP, so Host stays right.
                    current = target.url.join(location)
                    log.debug("image_url redirect %d -> %s", status, escape(str(current)))
                    continue
                if not 200 <= status < 300:
                    raise ServiceError.of("fetch_failed", f"image_url answered HTTP {status}")
                encoding = response.headers.get("content-encoding", "identity").lower()
                if encoding not in ("", "identity"):
                    raise ServiceError.of("fetch_failed",
                                          f"compressed response ({encoding}) not accepted")
                length = response.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > limit:
                    raise ServiceError.of("fetch_too_large",
                                          f"image_url body is {length} bytes, over {limit}")
                chunks: list[bytes] = []
                total = 0
                async for chunk in response.aiter_raw():
                    total += len(chunk)
                    if total > limit:
                        raise ServiceError.of("fetch_too_large",
                                              f"image_url body is over the {limit}-byte limit")
                    chunks.append(chunk)
                return b"".join(chunks)
            finally:
                await response.aclose()
    raise ServiceError.of("fetch_failed", f"more than {settings.max_redirects} redirects")


async def fetch_image(url: str, settings: Settings, *, resolver: Resolver | None = None) -> bytes:
    """Download ``url`` under the rules in the module docstring; raises :class:`ServiceError`."""
    try:
        return await asyncio.wait_for(_fetch(url, settings, resolver or system_resolver),
                                      settings.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        raise ServiceError.of(
            "fetch_timeout",
            f"fetching image_url took longer than {settings.fetch_timeout_s:g}s") from e
    except httpx.UnsupportedProtocol as e:
        raise ServiceError.of("url_not_allowed", str(e)) from e
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise ServiceError.of("fetch_failed", f"fetching image_url failed: {e}") from e
