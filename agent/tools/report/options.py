"""The flags of ``mrc-agent report``, declared once (:class:`ReportSettings`, read by the
settings mechanism of :mod:`mrc_agent.exporters.settings`), and validated together
(:class:`ReportOptions`): one clear line and exit code 2 (a :class:`ConfigError`) for each bad
one.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrc_agent.agent.core.units import parse_duration
from mrc_agent.agent.tools.report.chromium import find_chromium
from mrc_agent.alerts.config import Config
from mrc_agent.exporters.settings import (
    ConfigError,
    Declarations,
    clipped,
    number,
    setting,
    text,
)

#: Prometheus refuses a range query that would return more points per series than this.
MAX_POINTS = 11_000
#: The longest --range: ten years is past any retention, and the dates of a longer one fall
#: outside what the report can write (before year 1).
MAX_RANGE_S = 3650 * 86400.0


REPORT = "report"


@dataclass
class ReportSettings:
    """The flags of ``mrc-agent report`` as given; :func:`options_from_args` checks them
    together."""

    prometheus: str | None = setting(
        parse=text, commands=(REPORT,), required=True, metavar="URL",
        help="Prometheus base URL, e.g. http://prometheus:9090")
    out: str | None = setting(parse=text, commands=(REPORT,), required=True, metavar="FILE",
                              help="report.html or report.png")
    range: str = setting("1h", parse=text, commands=(REPORT,), metavar="DURATION",
                         help="how far back from now, e.g. 5m, 1h, 1d")
    step: str = setting("15s", parse=text, commands=(REPORT,), metavar="DURATION",
                        help="resolution of the charts")
    selector: str | None = setting(
        parse=text, commands=(REPORT,), metavar="MATCHERS",
        help='label matchers added to every query, e.g. namespace="mrc"')
    format: str | None = setting(parse=text, commands=(REPORT,), choices=("html", "png"),
                                 help="html, or png via headless Chromium (from --out's suffix)")
    timeout: float = setting(10.0, parse=number, commands=(REPORT,), metavar="SECONDS",
                             help="per request to Prometheus")
    chromium: str | None = setting(parse=text, commands=(REPORT,), metavar="PATH",
                                   help="Chromium for --format png (chromium on PATH)")


#: The flags of ``mrc-agent report``: no environment, no config file.
FLAGS = Declarations(ReportSettings)


@dataclass(frozen=True)
class ReportOptions:
    """The validated flags of ``mrc-agent report``."""

    prometheus: str
    out: Path
    range_s: float
    step_s: float
    cfg: Config
    fmt: str = "html"
    timeout_s: float = 10.0
    chromium: str | None = None


def options_from_args(args: Any) -> ReportOptions:
    """Validate the CLI flags; raises :class:`ConfigError` (exit code 2) with one clear line."""
    from mrc_agent.alerts.build import BuildError, config_for

    url = (args.prometheus or "").strip().rstrip("/")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"--prometheus {args.prometheus!r} is not an http(s) URL such as "
                          "http://prometheus:9090")
    try:
        range_s = parse_duration(args.range)
    except ValueError as exc:
        raise ConfigError(f"--range {clipped(str(exc))}") from None
    if range_s > MAX_RANGE_S:
        raise ConfigError(f"--range {clipped(args.range, 40)} is longer than 3650d")
    try:
        step_s = parse_duration(args.step)
    except ValueError as exc:
        raise ConfigError(f"--step {clipped(str(exc))}") from None
    if step_s < 0.001:
        raise ConfigError("--step must be at least 1ms")
    if step_s > range_s:
        raise ConfigError(f"--step {args.step} is longer than --range {args.range}")
    points = range_s / step_s + 1
    if points > MAX_POINTS:
        raise ConfigError(f"--range {args.range} at --step {args.step} is {points:.0f} points per "
                          f"series; Prometheus allows {MAX_POINTS}: use a longer --step")
    try:
        cfg = config_for(args.selector)
    except BuildError as exc:
        raise ConfigError(str(exc)) from None
    out = Path(args.out)
    fmt = args.format or ("png" if out.suffix.lower() == ".png" else "html")
    if not out.name or out.is_dir():
        raise ConfigError(f"--out {args.out!r} must be a file path")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {args.out!r}: directory {str(out.parent)!r} does not exist")
    timeout = float(args.timeout)
    if not 0 < timeout <= 300:
        raise ConfigError("--timeout must be > 0 and at most 300 seconds")
    chromium = None
    if fmt == "png":
        chromium = find_chromium(args.chromium)
        if chromium is None:
            raise ConfigError("--format png needs Chromium (Debian package chromium); none "
                              "found: install it or pass --chromium PATH")
    return ReportOptions(url, out, range_s, step_s, cfg, fmt, timeout, chromium)
