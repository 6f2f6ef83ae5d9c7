"""The ``mrc-agent`` command line: a table of subcommands, each a module with the same two entry
points, ``add_arguments(parser)`` (its flags) and ``run(args) -> int``. The only place that turns
bad input into exit code 2: a command raises :class:`~mrc_agent.exporters.settings.ConfigError`.

A command's module is imported only when that command runs (``mrc-agent run`` loads no tool,
no web framework), or when the whole parser is built (:func:`build_parser` with no argument, as
the tests and the docs generator do). Every command's flags come from declarations read by the
one settings mechanism, :mod:`mrc_agent.exporters.settings`: the sidecar's settings
(:mod:`mrc_agent.agent.core.config`) for ``run``, ``doctor`` and ``diagnose``, the tools' flags
(:mod:`mrc_agent.agent.tools.flags`, :mod:`mrc_agent.agent.tools.report.options`) and the
reference service's (:mod:`mrc_agent.reference_service.settings`) for ``serve``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import NoReturn

from mrc_agent.agent import __version__
from mrc_agent.exporters.settings import ConfigError

EXIT_USAGE = 2


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    #: The module holding the command's entry points.
    module: str
    #: Its entry points' names there: (add its flags to a parser, run it on the parsed flags).
    entry: tuple[str, str] = ("add_arguments", "run")
    #: Everything after the name goes to the command as given: its own parser reads it
    #: (``--help`` included).
    passthrough: bool = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        getattr(import_module(self.module), self.entry[0])(parser)

    def run(self, args: argparse.Namespace) -> int:
        return int(getattr(import_module(self.module), self.entry[1])(args))


TOOLS = "mrc_agent.agent.tools"
COMMANDS: tuple[Command, ...] = (
    Command("run", "run the sidecar agent", f"{TOOLS}.sidecar"),
    Command("record", "record a replay trace from the local GPUs", f"{TOOLS}.record"),
    Command("doctor", "show what this host can deliver", f"{TOOLS}.doctor"),
    Command("demo", "run the reference service, the agent beside it and the load generator; "
            "print the golden triangle and latencies live", f"{TOOLS}.demo"),
    Command("serve", "run the reference MRC service (needs the 'service' extra); flags as "
            "python -m mrc_agent.reference_service", "mrc_agent.reference_service.__main__",
            passthrough=True),
    Command("loadgen", "send a realistic MRC request mix and print P50/P90/P99 per "
            "prompt-length x resolution bucket", f"{TOOLS}.loadgen"),
    Command("diagnose", "py-spy flame graph, golden-triangle samples and GPU idle windows of "
            "one process over one window, and a verdict", f"{TOOLS}.diagnose.command"),
    Command("report", "render the golden triangle and the latency heatmap from a live "
            "Prometheus as one self-contained HTML file (or PNG)", f"{TOOLS}.report.command"),
    Command("selfcheck", "check the agent's GPU readings (PCIe, DRAM, GPM, SM instructions, "
            "utilisation timestamps, NVLink) against copies and GEMMs of known size; "
            "PASS/FAIL/SKIP per metric", f"{TOOLS}.selfcheck.command"),
    Command("catalog", "print the metric catalogue (or, with --settings, the settings "
            "reference) as Markdown", f"{TOOLS}.reference_docs"),
    Command("alerts", "Prometheus rules and an Alertmanager example", f"{TOOLS}.mixin",
            entry=("add_alerts_arguments", "run_alerts")),
    Command("proxy", "meter an OpenAI-compatible server (vLLM, SGLang, TGI, Triton) from in "
            "front of it: a streaming reverse proxy serving the request metrics",
            f"{TOOLS}.proxy_cli"),
    Command("dashboards", "Grafana dashboards as code", f"{TOOLS}.mixin",
            entry=("add_dashboards_arguments", "run_dashboards")),
)
BY_NAME = {c.name: c for c in COMMANDS}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (not usage + error) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, the flags of that command alone are added (the others are
    listed by name and help), so that only its module is imported."""
    parser = _Parser(prog="mrc-agent", description="Observability sidecar for MRC services.")
    parser.add_argument("--version", action="version", version=f"mrc-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, add_help=not command.passthrough)
        if only is None or only == command.name:
            command.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = BY_NAME.get(argv[0]) if argv else None
    if command is not None and command.passthrough:
        return command.run(argparse.Namespace(command=command.name, args=argv[1:]))
    args = build_parser(only=command.name if command is not None else "").parse_args(argv)
    assert command is not None  # argparse has refused any other first word
    try:
        return command.run(args)
    except ConfigError as exc:
        print(f"mrc-agent {command.name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
