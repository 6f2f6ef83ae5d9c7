"""A minimal client of the Prometheus HTTP API (stdlib only, every request bounded), the
errors it raises (:class:`Unreachable`: nothing that answers like Prometheus; :class:`QueryError`:
one query refused or aborted) and the parsing of its answers.

The answers are parsed as a stranger's: any JSON shape where a mapping or a list belongs, any
number where a sample belongs. A result that is not a list is a :class:`QueryError` (the panel
says its query failed); an item or a label set of the wrong shape, a label value that is not
text, is left out; a sample that is not a number the charts can place (not finite, or beyond
:data:`MAX_SAMPLE`) is a gap. A report never ends in a traceback over what a server sent.
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, NoReturn

from mrc_agent.agent import __version__
from mrc_agent.agent.core.units import parse_duration

#: Answers larger than this are refused (a selector matching a whole fleet over a long range).
MAX_BODY_BYTES = 64 << 20
#: Grafana's default when it cannot know the scrape interval.
DEFAULT_SCRAPE_INTERVAL_S = 15.0
#: Largest sample magnitude drawn. No metric of the report comes near (bytes per second are
#: around 1e12), and the axes' arithmetic (a span, a rounded step above it) must stay finite
#: in floats that end at 1.8e308; a sample beyond is a gap.
MAX_SAMPLE = 1e300
#: A scrape interval is a few seconds; a target claiming more than a day is not believed.
MAX_SCRAPE_INTERVAL_S = 86400.0


class Unreachable(Exception):
    """Prometheus cannot be reached, or what answered is not the Prometheus HTTP API."""


class QueryError(Exception):
    """Prometheus refused or aborted one query (bad expression, timeout, too many samples)."""


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


class PromClient:
    """A minimal client of the Prometheus HTTP API (stdlib only), every request bounded."""

    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.reached = False

    def get(self, path: str, params: dict[str, str] | None = None) -> Any:
        """``data`` of a successful answer; raises :class:`QueryError` or :class:`Unreachable`."""
        url = self.base_url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        req = urllib.request.Request(url, headers={
            "Accept": "application/json", "User-Agent": f"mrc-agent/{__version__} report"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310
                body = resp.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            # Prometheus answers a bad or aborted query with 400/422/503 and a JSON error body.
            payload = _json(exc.read(1 << 20))
            if isinstance(payload, dict) and payload.get("status") == "error":
                raise QueryError(f"{payload.get('errorType', 'error')}: "
                                 f"{payload.get('error', exc.reason)}") from None
            raise Unreachable(f"HTTP {exc.code} {exc.reason} from {self.base_url}{path}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                self._timed_out()
            raise Unreachable(str(exc.reason)) from None
        except TimeoutError:
            self._timed_out()
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(str(exc) or type(exc).__name__) from None
        if len(body) > MAX_BODY_BYTES:
            raise QueryError(f"answer larger than {MAX_BODY_BYTES >> 20} MiB: narrow --selector "
                             "or use a longer --step")
        payload = _json(body)
        if not isinstance(payload, dict) or "status" not in payload:
            raise Unreachable(f"{self.base_url}{path} did not answer like the Prometheus HTTP API")
        if payload["status"] != "success":
            raise QueryError(f"{payload.get('errorType', 'error')}: {payload.get('error')}")
        self.reached = True
        return payload.get("data")

    def _timed_out(self) -> NoReturn:
        # Once Prometheus has answered, a timeout is one slow query (a failed panel in the
        # report); before that, nothing answers at that address.
        if self.reached:
            raise QueryError(f"no answer within {self.timeout_s:g} s (raise --timeout or "
                             "narrow --selector)") from None
        raise Unreachable(f"no answer within {self.timeout_s:g} s") from None

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", {"query": expr, "time": f"{at:.3f}"})
        return _result(data, "vector")

    def query_range(self, expr: str, start: float, end: float,
                    step: float) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}",
                                                "end": f"{end:.3f}", "step": f"{step:g}"})
        return _result(data, "matrix")

    def version(self) -> str | None:
        """Prometheus' version, or None where the server does not say (Thanos, Mimir, ...)."""
        try:
            data = self.get("/api/v1/status/buildinfo")
        except QueryError:
            return None
        return str(data.get("version")) if isinstance(data, dict) and data.get("version") else None

    def scrape_interval(self) -> float | None:
        """The longest scrape interval among the active targets, or None when not reported."""
        try:
            data = self.get("/api/v1/targets", {"state": "active"})
        except QueryError:
            return None
        targets = data.get("activeTargets") if isinstance(data, dict) else None
        intervals = []
        for target in targets if isinstance(targets, list) else []:
            text = target.get("scrapeInterval") if isinstance(target, dict) else None
            if not isinstance(text, str):
                continue
            try:
                seconds = parse_duration(text)
            except ValueError:
                continue
            if 0 < seconds <= MAX_SCRAPE_INTERVAL_S:
                intervals.append(seconds)
        return max(intervals) if intervals else None


def _result(data: Any, kind: str) -> list[dict[str, Any]]:
    if not isinstance(data, dict) or data.get("resultType") != kind:
        got = data.get("resultType") if isinstance(data, dict) else type(data).__name__
        raise QueryError(f"expected a {kind} result, got {got}")
    result = data.get("result") or []
    if not isinstance(result, list):
        raise QueryError(f"expected a list of {kind} series, got {type(result).__name__}")
    return [r for r in result if isinstance(r, dict)]


def labels_of(series: dict[str, Any]) -> dict[str, str]:
    """A result's ``metric``: the label names and values that are text (Prometheus' always
    are); ``{}`` for anything that is not a mapping."""
    metric = series.get("metric")
    if not isinstance(metric, dict):
        return {}
    return {k: v for k, v in metric.items() if isinstance(k, str) and isinstance(v, str)}


def rate_interval(step_s: float, scrape_s: float) -> float:
    """Grafana's ``$__rate_interval``: max(step + scrape interval, 4 x scrape interval)."""
    return max(step_s + scrape_s, 4 * scrape_s)


def _value(text: Any) -> float | None:
    """A sample (or timestamp) as a float; None where it is no number :data:`MAX_SAMPLE` bounds
    (text that is no number, NaN, infinities, 1.7e308)."""
    if isinstance(text, bool):
        return None
    try:
        v = float(text)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) and abs(v) <= MAX_SAMPLE else None

