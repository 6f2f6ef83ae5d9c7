"""``python -m mrc_agent.reference_service --host H --port P`` (also ``mrc-agent serve``).

Flags, declared with the settings they set, become one
:class:`~mrc_agent.reference_service.settings.Settings` (a bad value: one line, exit 2); how the
server meets the network (uvicorn's protocol, timeouts and connection cap) is built in
:mod:`mrc_agent.reference_service.server` for both the single-process and the ``--workers``
path.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from mrc_agent.exporters.settings import ConfigError
from mrc_agent.reference_service.logs import EscapeArgs
from mrc_agent.reference_service.settings import (
    ENV_SETTINGS,
    SERVE,
    SERVER_FLAGS,
    SETTINGS_FLAGS,
    Settings,
    settings_to_json,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = "python -m mrc_agent.reference_service") -> argparse.ArgumentParser:
    """The flags, as :mod:`mrc_agent.reference_service.settings` declares them."""
    p = _Parser(prog=prog, description="The instrumented reference MRC service.")
    SERVER_FLAGS.add_flags(p, SERVE)
    SETTINGS_FLAGS.add_flags(p, SERVE)
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The service's settings from its flags, each checked (:class:`ConfigError`)."""
    SERVER_FLAGS.from_args(args)
    settings: Settings = SETTINGS_FLAGS.from_args(args)
    return settings


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m mrc_agent.reference_service") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.model and not Path(args.model).exists():
        print(f"{prog}: error: --model {args.model}: no such file or directory",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(EscapeArgs())
    from mrc_agent.reference_service import server

    if args.workers > 1:
        # Must be in the environment before the workers import prometheus-client.
        import tempfile

        from mrc_agent.exporters.instrumentation import prepare_multiproc_dir

        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(
            prefix="mrc-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prepare_multiproc_dir(path))
        os.environ[ENV_SETTINGS] = settings_to_json(settings)
        server.run("mrc_agent.reference_service.main:app_from_env", settings, factory=True,
                   host=args.host, port=args.port, workers=args.workers,
                   log_level=args.log_level)
        return 0
    from mrc_agent.reference_service.main import create_app

    # SIGHUP (a closed terminal, a supervisor's reload) would kill the process on the spot:
    # make it uvicorn's clean stop instead, which finishes the requests in flight and runs the
    # shutdown handlers. (With --workers, uvicorn's supervisor restarts the workers on SIGHUP.)
    signal.signal(signal.SIGHUP, lambda _sig, _frame: signal.raise_signal(signal.SIGTERM))
    server.run(create_app(settings), settings, host=args.host, port=args.port,
               log_level=args.log_level)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """As ``mrc-agent serve``: everything after it is this module's (see :func:`run`)."""
    parser.add_argument("args", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    """``mrc-agent serve ARGS``: :func:`main` on ``ARGS``, under that name."""
    return main(args.args, prog="mrc-agent serve")


if __name__ == "__main__":
    sys.exit(main())
