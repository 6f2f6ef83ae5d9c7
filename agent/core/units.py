"""The one parser of durations and byte sizes, for the agent's settings, its tools' flags and
the alert rules' windows.

Durations are Prometheus' syntax (``1h30m``, ``5m``, ``500ms``: whole numbers, units
``y w d h m s ms`` in that order, each at most once). Where a setting or flag takes one, a plain
number of seconds is accepted too; :func:`check_prometheus_duration` accepts only what
Prometheus itself parses, for text that goes into a rule file.
"""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any

_UNIT_SECONDS = {"y": 365 * 86400.0, "w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0,
                 "s": 1.0, "ms": 0.001}
# At most 18 digits a unit: Prometheus keeps a duration in an int64 of milliseconds, and a
# longer run of digits would only cost int() its quadratic time (or its 4,300-digit refusal).
_PROMETHEUS = re.compile(r"(?:(\d{1,18})y)?(?:(\d{1,18})w)?(?:(\d{1,18})d)?(?:(\d{1,18})h)?"
                         r"(?:(\d{1,18})m)?(?:(\d{1,18})s)?(?:(\d{1,18})ms)?")
_BYTE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2,
               "gi": 1024**3}
_BYTES = re.compile(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([kmg]i?)?b?\s*", re.IGNORECASE)
#: What an error message quotes of a value: its first characters, however long it is.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def _number(value: int | float) -> float:
    """``value`` as a float; ValueError (not OverflowError) for an integer too large for one."""
    try:
        return float(value)
    except OverflowError:  # an int beyond a float; repr() of it may be refused too
        raise ValueError(f"a number of {int(value).bit_length()} bits is too large") from None


def _prometheus_seconds(text: str) -> float | None:
    m = _PROMETHEUS.fullmatch(text)
    if not text or m is None:
        return None
    return sum(int(g) * unit for g, unit in zip(m.groups(), _UNIT_SECONDS.values(), strict=True)
               if g is not None)


def parse_duration(value: Any) -> float:
    """Seconds in ``value``: a number or a Prometheus duration (``1h30m``). Raises ValueError
    for anything else, or a negative or infinite value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = _number(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            parsed = _prometheus_seconds(text)
            if parsed is None:
                raise ValueError(f"{_SHORT.repr(text)} is not a duration such as 3600, 90s, "
                                 "30m, 1h30m, 7d or 500ms") from None
            seconds = parsed
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{_SHORT.repr(value)} is not a finite, non-negative duration")
    return seconds


def check_prometheus_duration(value: str) -> str:
    """``value`` if Prometheus parses it as a duration (``90s``, ``1h30m``), else ValueError."""
    if _prometheus_seconds(value) is None:
        raise ValueError(f"{value!r} is not a Prometheus duration (e.g. 30s, 5m, 1h)")
    return value


def format_duration(seconds: float) -> str:
    """``seconds`` as a short Prometheus duration (``1h30m``, ``2s``, ``1m1s500ms``), to the
    millisecond; what it writes, :func:`parse_duration` and Prometheus read back."""
    ms = round(seconds * 1000)
    if ms <= 0:
        return "0s"
    parts = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000),
                       ("ms", 1)):
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(parts)


def parse_bytes(value: Any) -> int:
    """``104857600``, ``100Mi``, ``100MiB``, ``1G``, ``500k`` -> bytes. Raises ValueError for
    anything else, or a negative or infinite number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(_number(value)) or value < 0:
            raise ValueError(f"{_SHORT.repr(value)} is not a finite, non-negative number of "
                             "bytes")
        return int(value)
    m = _BYTES.fullmatch(str(value))
    if m is None:
        raise ValueError("expected bytes such as 104857600, 100Mi or 1G")
    return int(float(m.group(1)) * _BYTE_UNITS[(m.group(2) or "").lower()])
