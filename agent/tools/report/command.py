"""``mrc-agent report`` itself: query, render, write (:func:`run_report`)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from mrc_agent.agent.tools.report.chromium import screenshot
from mrc_agent.agent.tools.report.data import Report, collect
from mrc_agent.agent.tools.report.options import (
    FLAGS,
    REPORT,
    ReportOptions,
    options_from_args,
)
from mrc_agent.agent.tools.report.page import page_height, render_html
from mrc_agent.agent.tools.report.prom import PromClient, Unreachable
from mrc_agent.dashboards.queries import PROMPT_LENGTH_ORDER, RESOLUTION_ORDER

#: Exit code when Prometheus cannot be reached or does not answer like Prometheus (bad flags
#: are code 2, from cli.py).
EXIT_UNREACHABLE = 1


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    FLAGS.add_flags(parser, REPORT)


run = run_report_command
