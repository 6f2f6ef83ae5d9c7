"""Prometheus durations: ``1h30m``, ``5m``, ``500ms`` to seconds and back, for the flags,
the targets' scrape intervals and the page's header.
"""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?"
                       r"(?:(\d+)ms)?")
_DURATION_UNITS = (365 * 86400.0, 7 * 86400.0, 86400.0, 3600.0, 60.0, 1.0, 0.001)


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration (``1h30m``, ``5m``, ``500ms``) or a plain number."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        m = _DURATION.fullmatch(text)
        if not text or m is None:
            raise ValueError(f"{text!r} is not a duration such as 1h, 5m, 15s or 500ms") from None
        seconds = sum(int(g) * unit for g, unit in zip(m.groups(), _DURATION_UNITS, strict=True)
                      if g is not None)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{text!r} must be a positive duration")
    return seconds


def format_duration(seconds: float) -> str:
    """``seconds`` as a short Prometheus-style duration (``1h30m``, ``2s``, ``250ms``)."""
    ms = round(seconds * 1000)
    if ms % 1000:
        return f"{ms}ms" if ms < 60_000 else f"{seconds:g}s"
    s = ms // 1000
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    return "".join(parts)

