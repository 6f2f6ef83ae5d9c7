"""``mrc-agent alerts build`` and ``mrc-agent dashboards build``: the rules and the dashboards
as code, from one configuration (the same ``--selector`` and ``--runbook-base`` for both)."""

from __future__ import annotations

import argparse

from mrc_agent.agent.core.config import ConfigError


def _build_parser(parser: argparse.ArgumentParser, dest: str, help: str,
                  ) -> argparse.ArgumentParser:
    sub = parser.add_subparsers(dest=dest, required=True, parser_class=type(parser))
    return sub.add_parser("build", help=help)


def add_alerts_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import ALERTS, ALERTS_FLAGS

    ALERTS_FLAGS.add_flags(_build_parser(parser, "alerts_command", "write the rule file, the "
                                         "PrometheusRule and alertmanager.yaml"), ALERTS)


def add_dashboards_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import DASHBOARDS, DASHBOARDS_FLAGS

    DASHBOARDS_FLAGS.add_flags(_build_parser(parser, "dashboards_command", "write the dashboard "
                                             "JSON, the provisioning file and the ConfigMap"),
                               DASHBOARDS)


def run_alerts(args: argparse.Namespace) -> int:
    from mrc_agent.alerts.build import BuildError, run_build

    try:
        return run_build(args.out, args.selector, args.runbook_base, args.cluster_label)
    except BuildError as exc:
        raise ConfigError(str(exc)) from exc


def run_dashboards(args: argparse.Namespace) -> int:
    from mrc_agent.alerts.build import BuildError, config_for
    from mrc_agent.dashboards.build import run_build

    try:
        return run_build(args.out, config_for(args.selector, args.runbook_base))
    except BuildError as exc:
        raise ConfigError(str(exc)) from exc
