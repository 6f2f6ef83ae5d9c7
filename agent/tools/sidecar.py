"""``mrc-agent run``: the sidecar, with the on-alert capture endpoints as its extra routes
(the core never imports a tool, so the two are put together here)."""

from __future__ import annotations

import argparse
import logging
import sys

from mrc_agent.agent.core.config import RUN, add_flags, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, RUN)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    from mrc_agent.agent.core.run import run_agent
    from mrc_agent.agent.tools.capture import build_capture_api

    cfg = config_from_args(args)
    setup_logging(cfg.log_level)
    # The capture endpoints answer 404 unless a webhook token is configured. SIGHUP reads the
    # file and the environment again; the flags given stay as given.
    return run_agent(cfg, routes_factory=build_capture_api,
                     reload=lambda: config_from_args(args))
