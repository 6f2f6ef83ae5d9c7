"""The one exposition renderer both halves use: negotiate the format (OpenMetrics when the
scraper asks for it), encode a registry, and gzip the body when the scraper accepts it.

Negotiation answers what prometheus-client's ``choose_encoder`` answers for a well-formed
``Accept`` header, but picks from a fixed set of :data:`FORMATS` whose ``Content-Type`` strings
are ours. ``choose_encoder`` echoes the client's version into the answer, so every new
``version=1.0.<N>`` was a new content type — a new render-cache entry on the agent, and a bare CR
sent in the version came back inside the response header — and a version it cannot compare
(``version=1.a``) made it raise ``TypeError`` (no answer from the agent, a 500 from the
service). Here a version is read as dotted digits or not at all; a media range that cannot be
read is skipped, and when none is usable the answer is Prometheus text 0.0.4, the format every
scraper reads. OpenMetrics versions 1.x answer 1.0.0 and 2.x and later 2.0.0 (the only version
boundary prometheus-client's encoder knows); text versions 1.x and later answer 1.0.0, as
prometheus-client does. A media range with ``q=0`` is not acceptable (RFC 9110 12.4.2);
otherwise the first usable range wins, as in prometheus-client.
"""

from __future__ import annotations

import gzip
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from prometheus_client import exposition as _text
from prometheus_client.openmetrics import exposition as _om
from prometheus_client.registry import CollectorRegistry


@dataclass(frozen=True)
class Format:
    """One exposition format: the ``Content-Type`` answered and the encoder that writes it."""

    content_type: str
    encoder: Callable[[CollectorRegistry], bytes]


#: Recent prometheus-client releases (0.26 here) write metric names in the escaping scheme a
#: scraper asks for (Prometheus 3 asks for one); older ones, which the dependency range still
#: admits, write them as they are and know two formats only.
_ESCAPING = ({"escaping", "version"} <= set(inspect.signature(_om.generate_latest).parameters)
             and "escaping" in inspect.signature(_text.generate_latest).parameters)
#: The metric-name escaping schemes a scraper may ask for; an unknown one means underscores,
#: as in prometheus-client.
ESCAPINGS = ("underscores", "allow-utf-8", "dots", "values") if _ESCAPING else ()

TEXT = Format("text/plain; version=0.0.4; charset=utf-8", _text.generate_latest)
#: A bare ``application/openmetrics-text``: answered without an escaping parameter.
OPENMETRICS = Format("application/openmetrics-text; version=1.0.0; charset=utf-8",
                     partial(_om.generate_latest, escaping="underscores", version="1.0.0")
                     if _ESCAPING else _om.generate_latest)
_TEXT_1 = {e: Format(f"text/plain; version=1.0.0; charset=utf-8; escaping={e}",
                     partial(_text.generate_latest, escaping=e)) for e in ESCAPINGS}
_OM = {(major, e): Format(f"application/openmetrics-text; version={major}.0.0; charset=utf-8; "
                          f"escaping={e}",
                          partial(_om.generate_latest, escaping=e, version=f"{major}.0.0"))
       for major in (1, 2) for e in ESCAPINGS}
#: Every format a scrape can get: a render cache keyed by format holds at most this many.
FORMATS: tuple[Format, ...] = (TEXT, OPENMETRICS, *_TEXT_1.values(), *_OM.values())

_VERSION = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9}){0,7}")
#: RFC 9110's qvalue: 0 to 1 with at most three decimals.
_QVALUE = re.compile(r"0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?")


def _params(tokens: list[str]) -> dict[str, str] | None:
    """``name=value`` parameters of a media range (names lower-cased, quotes removed, the first
    of a name kept); None when one cannot be read."""
    out: dict[str, str] = {}
    for token in tokens:
        if not token.strip():
            continue  # "text/plain;" or ";;": nothing given
        name, sep, value = token.partition("=")
        name, value = name.strip().lower(), value.strip()
        if not sep or not name:
            return None
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        out.setdefault(name, value)
    return out


def _weight(params: dict[str, str]) -> float | None:
    """The ``q`` weight (1 when absent); None when it is not a qvalue."""
    q = params.get("q")
    if q is None:
        return 1.0
    return float(q) if _QVALUE.fullmatch(q) else None


def negotiate(accept: str) -> Format:
    """The format to answer an ``Accept`` header with: one of :data:`FORMATS`, never an error."""
    for media_range in (accept or "").split(","):
        kind, *tokens = media_range.split(";")
        kind = kind.strip().lower()
        if kind not in ("application/openmetrics-text", "text/plain"):
            continue
        params = _params(tokens)
        if params is None or not _weight(params):  # unreadable, or q=0: not acceptable
            continue
        escaping = params.get("escaping", "underscores")
        escaping = escaping if escaping in ESCAPINGS else "underscores"
        given = params.get("version")
        if kind == "application/openmetrics-text" and given is None:
            return OPENMETRICS
        if given is None or not _VERSION.fullmatch(given):
            continue
        version = tuple(int(part) for part in given.split("."))
        if version < (1, 0, 0):
            continue  # text 0.0.4 or OpenMetrics 0.0.1: a later range, or the default
        if kind == "text/plain":
            return _TEXT_1.get(escaping, TEXT)
        return _OM.get((1 if version[0] == 1 else 2, escaping), OPENMETRICS)
    return TEXT


def wants_gzip(accept_encoding: str) -> bool:
    """Whether ``Accept-Encoding`` accepts gzip: listed (as prometheus-client's
    ``gzip_accepted`` reads it: the coding's name, any case) with a weight above zero —
    ``gzip;q=0`` means "not gzip" (RFC 9110 12.5.3). An unreadable weight means no gzip:
    the identity body is always acceptable."""
    for item in (accept_encoding or "").split(","):
        coding, *tokens = item.split(";")
        if coding.strip().lower() != "gzip":
            continue
        params = _params(tokens)
        return params is not None and bool(_weight(params))
    return False


def encode(registry: CollectorRegistry, fmt: Format, gzipped: bool = False) -> bytes:
    """``registry``'s exposition in ``fmt``, gzipped when asked."""
    body = fmt.encoder(registry)
    if gzipped:
        body = gzip.compress(body, compresslevel=1)  # level 1: most of the gain, little CPU
    return body


def render(registry: CollectorRegistry, accept: str = "",
           gzipped: bool = False) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of ``registry``'s exposition for an ``Accept`` header."""
    fmt = negotiate(accept)
    headers = {"Content-Type": fmt.content_type}
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    return encode(registry, fmt, gzipped), headers
