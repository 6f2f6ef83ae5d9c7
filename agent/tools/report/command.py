"""``mrc-agent report`` itself: the validated flags (:class:`ReportOptions`), and query, render,
write (:func:`run_report`).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.core.config import ConfigError
from agent.tools.report.chromium import find_chromium, screenshot
from agent.tools.report.data import Report, collect
from agent.tools.report.durations import parse_duration
from agent.tools.report.page import page_height, render_html
from agent.tools.report.prom import PromClient, Unreachable
from alerts.config import Config
from dashboards.queries import PROMPT_LENGTH_ORDER, RESOLUTION_ORDER

#: Exit code when Prometheus cannot be reached or does not answer like Prometheus (bad flags
#: are code 2, from cli.py).
EXIT_UNREACHABLE = 1
#: Prometheus refuses a range query that would return more points per series than this.
MAX_POINTS = 11_000


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
    from alerts.build import BuildError, config_for

    url = (args.prometheus or "").strip().rstrip("/")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"--prometheus {args.prometheus!r} is not an http(s) URL such as "
                          "http://prometheus:9090")
    try:
        range_s = parse_duration(args.range)
    except ValueError as exc:
        raise ConfigError(f"--range {exc}") from None
    try:
        step_s = parse_duration(args.step)
    except ValueError as exc:
        raise ConfigError(f"--step {exc}") from None
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


def _summary(report: Report) -> str:
    cells = len(report.heatmap.cells)
    total = len(RESOLUTION_ORDER) * len(PROMPT_LENGTH_ORDER)
    no_data = ", ".join(t for _, t in report.no_data) or "none"
    failed = ("; queries failed: " + ", ".join(t for _, t, _ in report.failed)
              if report.failed else "")
    return (f"{len(report.charts)} charts, heatmap {cells}/{total} cells with data; "
            f"no data: {no_data}{failed}")


def run_report(opts: ReportOptions) -> int:
    """Query, render, write. 0 on success, 1 when Prometheus cannot be reached or the output
    cannot be written (one line on stderr)."""
    client = PromClient(opts.prometheus, opts.timeout_s)
    try:
        report = collect(client, opts)
    except Unreachable as exc:
        print(f"mrc-agent report: error: cannot reach Prometheus at {opts.prometheus}: {exc}",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    page = render_html(report)
    try:
        if opts.fmt == "png":
            assert opts.chromium is not None  # checked in options_from_args
            with tempfile.TemporaryDirectory(prefix="mrc-report-") as tmp:
                html_path = Path(tmp) / "report.html"
                html_path.write_text(page, encoding="utf-8")
                png = Path(tmp) / "report.png"
                screenshot(opts.chromium, html_path, png, page_height(report))
                shutil.copyfile(png, opts.out)
        else:
            opts.out.write_text(page, encoding="utf-8")
    except (OSError, RuntimeError) as exc:
        print(f"mrc-agent report: error: cannot write {opts.out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {opts.out}: {_summary(report)}")
    return 0


def run_report_command(args: Any) -> int:
    """The CLI entry point; bad flags raise :class:`ConfigError` (exit code 2 in cli.py)."""
    return run_report(options_from_args(args))

