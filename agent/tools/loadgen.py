"""``mrc-agent loadgen``: the reference service's load generator
(:mod:`mrc_agent.reference_service.loadgen`) from the agent's command line."""

from __future__ import annotations

import argparse

from mrc_agent.agent.core.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import LOADGEN, LOADGEN_FLAGS

    LOADGEN_FLAGS.add_flags(parser, LOADGEN)


def run(args: argparse.Namespace) -> int:
    if args.rate <= 0 or args.duration <= 0 or args.max_in_flight < 1:
        raise ConfigError("--rate and --duration must be > 0, --max-in-flight >= 1")
    if not args.url.startswith(("http://", "https://")):
        raise ConfigError(f"--url {args.url!r} is not an http(s) URL")
    from mrc_agent.reference_service.loadgen import run_loadgen

    return run_loadgen(args.url, args.rate, args.duration, args.max_new_tokens,
                       args.max_in_flight, args.seed, api=args.api)
