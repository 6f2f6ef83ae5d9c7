"""``mrc-agent loadgen``: the reference service's load generator
(:mod:`mrc_agent.reference_service.loadgen`) from the agent's command line."""

from __future__ import annotations

import argparse

from mrc_agent.agent.core.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.reference_service.loadgen import API_CHOICES

    parser.add_argument("--url", required=True, help="the service's base URL")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--api", choices=API_CHOICES, default="mix",
                        help="upload: POST /mrc/upload; chat and chat-stream: POST "
                        "/v1/chat/completions, whole or streamed; mix (the default): the three "
                        "in turn")


def run(args: argparse.Namespace) -> int:
    if args.rate <= 0 or args.duration <= 0 or args.max_in_flight < 1:
        raise ConfigError("--rate and --duration must be > 0, --max-in-flight >= 1")
    if not args.url.startswith(("http://", "https://")):
        raise ConfigError(f"--url {args.url!r} is not an http(s) URL")
    from mrc_agent.reference_service.loadgen import run_loadgen

    return run_loadgen(args.url, args.rate, args.duration, args.max_new_tokens,
                       args.max_in_flight, args.seed, api=args.api)
