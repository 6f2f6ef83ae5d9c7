"""The ``mrc-agent`` command line. The only place that turns bad input into exit code 2.

Subcommands: ``run`` (the sidecar), ``record`` (write a replay trace from a real GPU),
``doctor`` (what this host can deliver), ``demo`` (the agent on an embedded default, printing
the golden triangle live) and ``catalog`` (the metric catalogue as Markdown).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from agent import __version__
from agent.catalog import COLLECTORS
from agent.config import DEFAULT_LISTEN, AgentConfig, ConfigError, load

log = logging.getLogger("agent")

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (not usage + error) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _agent_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by run, doctor and demo. Defaults are None so that only the flags given
    override the environment and the config file."""
    p.add_argument("--config", metavar="PATH", help="YAML config file (env MRC_AGENT_CONFIG)")
    p.add_argument("--pid", dest="pids", type=int, action="append", metavar="PID",
                   help="target process ID (repeatable; env MRC_AGENT_PIDS=1,2)")
    p.add_argument("--pidfile", metavar="PATH", help="file holding the target PID, re-read "
                   "every interval")
    p.add_argument("--process-name", metavar="REGEX", help="regex matched against command "
                   "lines every interval; every match is a target")
    p.add_argument("--gpu-backend", metavar="auto|nvml|replay:PATH|none")
    p.add_argument("--collector", dest="enable", action="append", default=[],
                   choices=list(COLLECTORS), help="switch a collector on (repeatable)")
    p.add_argument("--no-collector", dest="disable", action="append", default=[],
                   choices=list(COLLECTORS), help="switch a collector off (repeatable)")
    p.add_argument("--idle-util-threshold", type=float, metavar="RATIO",
                   help="GPU utilisation at or below which the GPU counts as idle (0.05)")
    p.add_argument("--starvation-cpu-threshold", type=float, metavar="RATIO",
                   help="target user CPU (cores) at or above which it counts as hot (0.9)")
    p.add_argument("--starvation-gpu-threshold", type=float, metavar="RATIO",
                   help="GPU utilisation at or below which a hot target is starved (0.2)")
    p.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mrc-agent", description="Observability sidecar for MRC services.")
    parser.add_argument("--version", action="version", version=f"mrc-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run the sidecar agent")
    _agent_flags(run)
    run.add_argument("--listen", metavar="HOST:PORT",
                     help=f"address to serve on ({DEFAULT_LISTEN})")
    run.add_argument("--interval", type=float, metavar="SECONDS", help="sampling period (1)")

    rec = sub.add_parser("record", help="record a replay trace from the local GPUs")
    rec.add_argument("--out", required=True, metavar="FILE")
    rec.add_argument("--duration", type=float, required=True, metavar="SECONDS")
    rec.add_argument("--interval", type=float, default=0.1, metavar="SECONDS")
    rec.add_argument("--profiling", action="store_true",
                     help="also record CUPTI PM sampling counters")

    doc = sub.add_parser("doctor", help="show what this host can deliver")
    _agent_flags(doc)

    demo = sub.add_parser("demo", help="run the reference service, the agent beside it and the "
                          "load generator; print the golden triangle and latencies live")
    demo.add_argument("--duration", type=float, default=30.0, metavar="SECONDS",
                      help="how long the load runs (30)")
    demo.add_argument("--rate", type=float, default=2.0, help="requests per second (2)")
    demo.add_argument("--port", type=int, default=8000, help="the service's port (8000)")
    demo.add_argument("--listen", default="127.0.0.1:9478", metavar="HOST:PORT",
                      help="the agent's address (127.0.0.1:9478)")
    demo.add_argument("--trace", metavar="PATH", help="replay this GPU trace instead of NVML "
                      "or the embedded synthetic one")

    serve = sub.add_parser("serve", help="run the reference MRC service (needs the 'service' "
                           "extra); flags as python -m reference_service", add_help=False)
    serve.add_argument("args", nargs=argparse.REMAINDER)

    load = sub.add_parser("loadgen", help="send a realistic MRC request mix and print "
                          "P50/P90/P99 per prompt-length x resolution bucket")
    load.add_argument("--url", required=True, help="the service's base URL")
    load.add_argument("--rate", type=float, default=2.0, help="requests per second")
    load.add_argument("--duration", type=float, default=30.0, metavar="SECONDS")
    load.add_argument("--max-new-tokens", type=int, default=16)
    load.add_argument("--max-in-flight", type=int, default=64)
    load.add_argument("--seed", type=int, default=1)

    cat = sub.add_parser("catalog", help="print the metric catalogue as Markdown")
    cat.add_argument("--out", metavar="FILE")
    return parser


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    cli: dict[str, Any] = {
        key: getattr(args, key, None)
        for key in ("pids", "pidfile", "process_name", "listen", "interval", "gpu_backend",
                    "idle_util_threshold", "starvation_cpu_threshold",
                    "starvation_gpu_threshold", "log_level")
    }
    switches = [*args.enable, *(f"-{n}" for n in args.disable)]
    if switches:
        cli["collectors"] = ",".join(switches)
    return load(cli, config_path=args.config)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_run(args: argparse.Namespace) -> int:
    from agent.app import build_runner, build_server, make_sources
    from agent.hw.replay import ReplayFormatError
    from agent.targets import PidfileError, read_pidfile

    cfg = config_from_args(args)
    _setup_logging(cfg.log_level)
    if cfg.pidfile:
        try:
            read_pidfile(cfg.pidfile)
        except PidfileError as exc:
            raise ConfigError(str(exc)) from exc
    try:
        sources = make_sources(cfg)
    except ReplayFormatError as exc:
        raise ConfigError(str(exc)) from exc
    runner = build_runner(cfg, sources)
    host, port = cfg.host_port
    try:
        server = build_server(cfg, runner)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    if not runner.targets.configured:
        log.warning("no target configured (--pid, --pidfile or --process-name): "
                    "only GPU series will be exported")

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runner.start()
    server.start()
    log.info("mrc-agent %s listening on http://%s:%d/metrics (interval %.3gs, collectors %s, "
             "gpu backend %s)", __version__, host, server.port, cfg.interval,
             ",".join(cfg.enabled), cfg.gpu_backend)
    while not stop.wait(1.0):
        pass
    server.stop()
    runner.stop()
    if sources.backend is not None and hasattr(sources.backend, "close"):
        sources.backend.close()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # Everything after "serve" belongs to the service's own parser (--help included).
        from reference_service.__main__ import main as serve_main

        return serve_main(argv[1:], prog="mrc-agent serve")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "catalog":
            from agent.docs import write_catalog

            return write_catalog(args.out)
        if args.command == "doctor":
            from agent.doctor import run_doctor

            cfg = config_from_args(args)
            return run_doctor(cfg, explicit_collectors=set(args.enable),
                              explicit_backend=args.gpu_backend is not None)
        if args.command == "record":
            from agent.record import run_record

            if args.duration <= 0 or not 0.01 <= args.interval <= 60:
                raise ConfigError("--duration must be > 0 and --interval 0.01-60 seconds")
            return run_record(args.out, args.duration, args.interval, args.profiling)
        if args.command == "loadgen":
            if args.rate <= 0 or args.duration <= 0 or args.max_in_flight < 1:
                raise ConfigError("--rate and --duration must be > 0, --max-in-flight >= 1")
            if not args.url.startswith(("http://", "https://")):
                raise ConfigError(f"--url {args.url!r} is not an http(s) URL")
            from reference_service.loadgen import run_loadgen

            return run_loadgen(args.url, args.rate, args.duration, args.max_new_tokens,
                               args.max_in_flight, args.seed)
        if args.command == "demo":
            from agent.demo import run_demo

            if args.duration <= 0 or args.rate <= 0 or not 0 < args.port < 65536:
                raise ConfigError("--duration and --rate must be > 0, --port 1-65535")
            return run_demo(args.duration, args.listen, args.trace, args.port, args.rate)
    except ConfigError as exc:
        print(f"mrc-agent {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.error(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
