"""The ``mrc-agent`` command line: parses, then dispatches to the sidecar core (``run``) or
an operator tool. The only place that turns bad input into exit code 2. The flags of ``run``,
``doctor`` and ``diagnose`` come from the settings in :mod:`mrc_agent.agent.core.config`.

Subcommands: ``run`` (the sidecar), ``record`` (write a replay trace from a real GPU),
``doctor`` (what this host can deliver), ``demo`` (the agent on an embedded default, printing
the golden triangle live), ``diagnose`` (flame graph, samples and a verdict for one process),
``selfcheck`` (the agent's GPU readings against a reference measured in the same run),
``proxy`` (the OpenAI meter in front of a server that takes no middleware) and ``catalog`` (the
metric catalogue as Markdown).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from mrc_agent.agent import __version__
from mrc_agent.agent.core.config import (
    DIAGNOSE,
    DOCTOR,
    RUN,
    ConfigError,
    add_flags,
    config_from_args,
)
from mrc_agent.reference_service.loadgen import API_CHOICES as LOADGEN_APIS

log = logging.getLogger(__name__)

EXIT_USAGE = 2
#: diagnose samples finer than the sidecar: a 10 s window should hold ~50 passes.
DIAGNOSE_INTERVAL_S = 0.2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (not usage + error) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mrc-agent", description="Observability sidecar for MRC services.")
    parser.add_argument("--version", action="version", version=f"mrc-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run the sidecar agent")
    add_flags(run, RUN)

    rec = sub.add_parser("record", help="record a replay trace from the local GPUs")
    rec.add_argument("--out", required=True, metavar="FILE")
    rec.add_argument("--duration", type=float, required=True, metavar="SECONDS")
    rec.add_argument("--interval", type=float, default=0.1, metavar="SECONDS")
    rec.add_argument("--profiling", action="store_true",
                     help="also record CUPTI PM sampling counters")

    doc = sub.add_parser("doctor", help="show what this host can deliver")
    add_flags(doc, DOCTOR)

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
    demo.add_argument("--api", choices=LOADGEN_APIS, default="mix",
                      help="the load's request path: /mrc/upload, the OpenAI chat API whole or "
                      "streamed, or the three in turn (mix, the default)")

    serve = sub.add_parser("serve", help="run the reference MRC service (needs the 'service' "
                           "extra); flags as python -m mrc_agent.reference_service", add_help=False)
    serve.add_argument("args", nargs=argparse.REMAINDER)

    load = sub.add_parser("loadgen", help="send a realistic MRC request mix and print "
                          "P50/P90/P99 per prompt-length x resolution bucket")
    load.add_argument("--url", required=True, help="the service's base URL")
    load.add_argument("--rate", type=float, default=2.0, help="requests per second")
    load.add_argument("--duration", type=float, default=30.0, metavar="SECONDS")
    load.add_argument("--max-new-tokens", type=int, default=16)
    load.add_argument("--max-in-flight", type=int, default=64)
    load.add_argument("--seed", type=int, default=1)
    load.add_argument("--api", choices=LOADGEN_APIS, default="mix",
                      help="upload: POST /mrc/upload; chat and chat-stream: POST "
                      "/v1/chat/completions, whole or streamed; mix (the default): the three "
                      "in turn")

    diag = sub.add_parser("diagnose", help="py-spy flame graph, golden-triangle samples and GPU "
                          "idle windows of one process over one window, and a verdict")
    diag.add_argument("--pid", type=int, required=True, help="the process to diagnose")
    diag.add_argument("--duration", type=float, default=10.0, metavar="SECONDS",
                      help="length of the window (10)")
    diag.add_argument("--out", metavar="DIR", help="output directory "
                      "(./mrc-diagnose-PID-TIMESTAMP)")
    diag.add_argument("--py-spy", metavar="PATH", help="the py-spy executable (the one beside "
                      "this Python, else PATH)")
    # diagnose's own sampling period, not the sidecar's interval: never read from the
    # environment or the config file, which set the sidecar's.
    diag.add_argument("--interval", type=float, default=DIAGNOSE_INTERVAL_S, metavar="SECONDS",
                      help=f"collector sampling period over the window (default "
                           f"{DIAGNOSE_INTERVAL_S:g}; not read from the environment, whose "
                           "MRC_AGENT_INTERVAL is the sidecar's)")
    add_flags(diag, DIAGNOSE)

    rep = sub.add_parser("report", help="render the golden triangle and the latency heatmap "
                         "from a live Prometheus as one self-contained HTML file (or PNG)")
    rep.add_argument("--prometheus", required=True, metavar="URL",
                     help="Prometheus base URL, e.g. http://prometheus:9090")
    rep.add_argument("--out", required=True, metavar="FILE", help="report.html or report.png")
    rep.add_argument("--range", default="1h", metavar="DURATION",
                     help="how far back from now, e.g. 5m, 1h, 1d (1h)")
    rep.add_argument("--step", default="15s", metavar="DURATION",
                     help="resolution of the charts (15s)")
    rep.add_argument("--selector", metavar="MATCHERS",
                     help='label matchers added to every query, e.g. namespace="mrc"')
    rep.add_argument("--format", choices=["html", "png"],
                     help="html, or png via headless Chromium (from --out's suffix)")
    rep.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                     help="per request to Prometheus (10)")
    rep.add_argument("--chromium", metavar="PATH", help="Chromium for --format png "
                     "(chromium on PATH)")

    check = sub.add_parser("selfcheck", help="check the agent's GPU readings (PCIe, DRAM, GPM, "
                           "SM instructions, utilisation timestamps, NVLink) against copies and "
                           "GEMMs of known size; PASS/FAIL/SKIP per metric")
    mode = check.add_mutually_exclusive_group(required=True)
    mode.add_argument("--gpu", action="store_true",
                      help="on the local NVIDIA GPU (needs torch with CUDA)")
    mode.add_argument("--dry", action="store_true",
                      help="on a simulated GPU, through the agent's real readers")
    check.add_argument("--out", metavar="DIR", help="output directory for gpu_truth.txt, "
                       "gpu_truth.json and the trace (./mrc-selfcheck-TIMESTAMP)")
    check.add_argument("--duration", type=float, metavar="SECONDS",
                       help="length of the recorded trace (20; 2 with --dry); shorter also "
                       "shortens the measured windows")

    cat = sub.add_parser("catalog", help="print the metric catalogue (or, with --settings, the "
                         "settings reference) as Markdown")
    cat.add_argument("--out", metavar="FILE")
    cat.add_argument("--settings", action="store_true",
                     help="the settings: key, flag, environment name, default, meaning")

    alerts = sub.add_parser("alerts", help="Prometheus rules and an Alertmanager example")
    alerts_sub = alerts.add_subparsers(dest="alerts_command", required=True, parser_class=_Parser)
    ab = alerts_sub.add_parser("build", help="write the rule file, the PrometheusRule and "
                               "alertmanager.yaml")
    ab.add_argument("--out", default="alerts/generated", metavar="DIR",
                    help="output directory (alerts/generated)")
    ab.add_argument("--cluster-label", metavar="NAME",
                    help="label that tells clusters apart, kept by the fleet rules and "
                    "Alertmanager's grouping (cluster; empty: none)")

    proxy = sub.add_parser(
        "proxy", help="meter an OpenAI-compatible server (vLLM, SGLang, TGI, Triton) from in "
        "front of it: a streaming reverse proxy serving the request metrics")
    proxy.add_argument("--listen", required=True, metavar="HOST:PORT",
                       help="address the clients connect to")
    proxy.add_argument("--upstream", required=True, metavar="URL",
                       help="the server, http(s)://host:port (the request path is kept)")
    proxy.add_argument("--metrics-listen", required=True, metavar="HOST:PORT",
                       help="address serving /metrics")
    proxy.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="give up connecting to the upstream after this long: 502")
    proxy.add_argument("--drain-timeout", type=float, default=25.0, metavar="SECONDS",
                       help="on SIGTERM, let answers under way finish for this long (below "
                       "the pod's terminationGracePeriodSeconds, 30 by default)")
    proxy.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"])

    dash = sub.add_parser("dashboards", help="Grafana dashboards as code")
    dash_sub = dash.add_subparsers(dest="dashboards_command", required=True, parser_class=_Parser)
    db = dash_sub.add_parser("build", help="write the dashboard JSON, the provisioning file and "
                             "the ConfigMap")
    db.add_argument("--out", default="dashboards/generated", metavar="DIR",
                    help="output directory (dashboards/generated)")
    for build_parser_ in (ab, db):  # one config for rules and dashboards: same flags
        build_parser_.add_argument(
            "--selector", metavar="MATCHERS",
            help='label matchers added to every selector, e.g. namespace="mrc"')
        build_parser_.add_argument("--runbook-base", metavar="URL",
                                   help="base of the runbook links (docs/runbooks)")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_run(args: argparse.Namespace) -> int:
    from mrc_agent.agent.core.run import run_agent
    from mrc_agent.agent.tools.capture import build_capture_api

    cfg = config_from_args(args)
    _setup_logging(cfg.log_level)
    # The capture endpoints answer 404 unless a webhook token is configured. SIGHUP reads the
    # file and the environment again; the flags given stay as given.
    return run_agent(cfg, routes_factory=build_capture_api,
                     reload=lambda: config_from_args(args))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # Everything after "serve" belongs to the service's own parser (--help included).
        from mrc_agent.reference_service.__main__ import main as serve_main

        return serve_main(argv[1:], prog="mrc-agent serve")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "diagnose":
            from mrc_agent.agent.tools.diagnose import run_diagnose_command

            return run_diagnose_command(args)
        if args.command == "report":
            from mrc_agent.agent.tools.report import run_report_command

            return run_report_command(args)
        if args.command == "catalog":
            from mrc_agent.agent.tools.reference_docs import write_catalog

            return write_catalog(args.out, settings=args.settings)
        if args.command in ("alerts", "dashboards"):
            from mrc_agent.alerts.build import BuildError, config_for, run_build

            try:
                if args.command == "alerts":
                    return run_build(args.out, args.selector, args.runbook_base,
                                     args.cluster_label)
                from mrc_agent.dashboards.build import run_build as build_dashboards

                return build_dashboards(args.out, config_for(args.selector, args.runbook_base))
            except BuildError as exc:
                raise ConfigError(str(exc)) from exc
        if args.command == "doctor":
            from mrc_agent.agent.tools.doctor import run_doctor

            cfg = config_from_args(args)
            return run_doctor(cfg, explicit_collectors=set(args.enable),
                              explicit_backend=args.gpu_backend is not None)
        if args.command == "record":
            from mrc_agent.agent.tools.record import run_record

            if args.duration <= 0 or not 0.01 <= args.interval <= 60:
                raise ConfigError("--duration must be > 0 and --interval 0.01-60 seconds")
            return run_record(args.out, args.duration, args.interval, args.profiling)
        if args.command == "proxy":
            from mrc_agent.agent.tools.proxy import ProxyError, run_proxy

            _setup_logging(args.log_level)
            if not args.connect_timeout > 0 or not args.drain_timeout >= 0:
                raise ConfigError("--connect-timeout must be > 0 and --drain-timeout >= 0")
            try:
                return run_proxy(args.listen, args.upstream, args.metrics_listen,
                                 args.connect_timeout, args.drain_timeout)
            except ProxyError as exc:
                raise ConfigError(str(exc)) from exc
        if args.command == "selfcheck":
            from mrc_agent.agent.tools.selfcheck import run_selfcheck_command

            return run_selfcheck_command(args)
        if args.command == "loadgen":
            if args.rate <= 0 or args.duration <= 0 or args.max_in_flight < 1:
                raise ConfigError("--rate and --duration must be > 0, --max-in-flight >= 1")
            if not args.url.startswith(("http://", "https://")):
                raise ConfigError(f"--url {args.url!r} is not an http(s) URL")
            from mrc_agent.reference_service.loadgen import run_loadgen

            return run_loadgen(args.url, args.rate, args.duration, args.max_new_tokens,
                               args.max_in_flight, args.seed, api=args.api)
        if args.command == "demo":
            from mrc_agent.agent.tools.demo import run_demo

            if args.duration <= 0 or args.rate <= 0 or not 0 < args.port < 65536:
                raise ConfigError("--duration and --rate must be > 0, --port 1-65535")
            return run_demo(args.duration, args.listen, args.trace, args.port, args.rate,
                            args.api)
    except ConfigError as exc:
        print(f"mrc-agent {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.error(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
