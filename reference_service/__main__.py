"""``python -m mrc_agent.reference_service --host H --port P`` (also ``mrc-agent serve``).

Flags become one :class:`~mrc_agent.reference_service.settings.Settings` (a bad value: one line,
exit 2); how the server meets the network (uvicorn's protocol, timeouts and connection cap) is built
in :mod:`mrc_agent.reference_service.server` for both the single-process and the ``--workers`` path.
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

from mrc_agent.reference_service.logs import EscapeArgs
from mrc_agent.reference_service.settings import ENV_SETTINGS, Settings, settings_to_json

#: Above an hour a connection deadline is no deadline; a typo (ms for s) more likely.
MAX_TIMEOUT_S = 3600
#: Far above any one process's useful share of a host's open files.
MAX_CONNECTIONS = 1_000_000
#: Requests a second (and at once) per connection: beyond this, pacing is no pacing.
MAX_PACE = 1_000_000


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = "python -m mrc_agent.reference_service") -> argparse.ArgumentParser:
    d = Settings()
    p = _Parser(prog=prog, description="The instrumented reference MRC service.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1,
                   help="uvicorn worker processes (metrics use prometheus-client's "
                   "multiprocess mode when > 1)")
    p.add_argument("--model", metavar="PATH", help="local checkpoint (default: the embedded "
                   "tiny model, random weights)")
    p.add_argument("--quantize", choices=["nf4"])
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=d.dtype,
                   choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--cache-dir", type=Path, default=d.cache_dir)
    p.add_argument("--ocr", choices=["auto", "on", "off"], default=d.ocr)
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency)
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes)
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars)
    p.add_argument("--max-new-tokens-limit", type=int, default=d.max_new_tokens_limit)
    p.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=[],
                   help="image_url hosts to allow (repeatable; default: any public host)")
    p.add_argument("--header-timeout", dest="http_header_timeout_s", type=float,
                   metavar="S", default=d.http_header_timeout_s,
                   help="close a connection whose request head is not complete this many "
                   "seconds after it opened or after its previous response (default: "
                   "%(default)g)")
    p.add_argument("--body-timeout", dest="http_body_timeout_s", type=float, metavar="S",
                   default=d.http_body_timeout_s,
                   help="answer 408 when a request body pauses this many seconds between "
                   "chunks (default: %(default)g)")
    p.add_argument("--keep-alive-timeout", dest="keep_alive_timeout_s", type=float,
                   metavar="S", default=d.keep_alive_timeout_s,
                   help="close a keep-alive connection idle this many seconds between "
                   "requests (default: %(default)g)")
    p.add_argument("--max-connections", type=int, metavar="N", default=d.max_connections,
                   help="open connections per process from which new requests get 503 "
                   "(default: %(default)s)")
    p.add_argument("--pace-rate", dest="http_pace_rate", type=float, metavar="N",
                   default=d.http_pace_rate,
                   help="requests a second one connection may send, sustained; past that "
                   "its next request is read later, never refused (default: %(default)g)")
    p.add_argument("--pace-burst", dest="http_pace_burst", type=int, metavar="N",
                   default=d.http_pace_burst,
                   help="requests one connection may send at once before --pace-rate "
                   "applies (default: %(default)s)")
    p.add_argument("--json-logs", action="store_true")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    for name in ("port", "workers", "max_concurrency", "max_queue", "max_image_bytes",
                 "max_prompt_chars", "max_new_tokens_limit"):
        value = getattr(args, name)
        if value < (0 if name == "port" else 1) or (name == "port" and value > 65535):
            raise ValueError(f"--{name.replace('_', '-')} {value} is out of range")
    for flag, value in (("--header-timeout", args.http_header_timeout_s),
                        ("--body-timeout", args.http_body_timeout_s),
                        ("--keep-alive-timeout", args.keep_alive_timeout_s)):
        if not 0 < value <= MAX_TIMEOUT_S:  # also refuses nan and inf
            raise ValueError(f"{flag} {value:g} is out of range (above 0, at most "
                             f"{MAX_TIMEOUT_S} s)")
    if not 1 <= args.max_connections <= MAX_CONNECTIONS:
        raise ValueError(f"--max-connections {args.max_connections} is out of range "
                         f"(1-{MAX_CONNECTIONS})")
    if not 0 < args.http_pace_rate <= MAX_PACE:  # also refuses nan and inf
        raise ValueError(f"--pace-rate {args.http_pace_rate:g} is out of range (above 0, "
                         f"at most {MAX_PACE})")
    if not 1 <= args.http_pace_burst <= MAX_PACE:
        raise ValueError(f"--pace-burst {args.http_pace_burst} is out of range "
                         f"(1-{MAX_PACE})")
    return Settings(model=args.model, quantize=args.quantize, device=args.device,
                    dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                    cache_dir=args.cache_dir, ocr=args.ocr,
                    max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                    max_image_bytes=args.max_image_bytes,
                    max_prompt_chars=args.max_prompt_chars,
                    max_new_tokens_limit=args.max_new_tokens_limit,
                    allowed_hosts=tuple(args.allowed_hosts), json_logs=args.json_logs,
                    http_header_timeout_s=args.http_header_timeout_s,
                    http_body_timeout_s=args.http_body_timeout_s,
                    keep_alive_timeout_s=args.keep_alive_timeout_s,
                    max_connections=args.max_connections,
                    http_pace_rate=args.http_pace_rate, http_pace_burst=args.http_pace_burst)


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m mrc_agent.reference_service") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
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
