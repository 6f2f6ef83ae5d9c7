"""The flags of the operator tools, each declared once: its default, type, metavar and
``--help`` text. The settings mechanism (:mod:`mrc_agent.exporters.settings`) adds them to a
subcommand's parser and shows each default from its declaration. The tools' flags are their
only source (no environment, no config file); each tool checks its values together when it
runs. The sidecar's settings are :mod:`mrc_agent.agent.core.config`'s, the report's
:mod:`mrc_agent.agent.tools.report.options`'.
"""

from __future__ import annotations

from dataclasses import dataclass

from mrc_agent.exporters.settings import Declarations, number, setting, text, whole, yes_no
from mrc_agent.reference_service.loadgen import API_CHOICES

RECORD, DEMO, LOADGEN, CATALOG = "record", "demo", "loadgen", "catalog"
ALERTS, DASHBOARDS, PROXY, SELFCHECK, DIAGNOSE = (
    "alerts", "dashboards", "proxy", "selfcheck", "diagnose")
_LEVELS = ("debug", "info", "warning", "error")
#: diagnose samples finer than the sidecar: a 10 s window should hold ~50 passes.
DIAGNOSE_INTERVAL_S = 0.2


@dataclass
class RecordFlags:
    """``mrc-agent record``."""

    out: str | None = setting(parse=text, commands=(RECORD,), required=True, metavar="FILE",
                              help="the trace file to write")
    duration: float | None = setting(parse=number, commands=(RECORD,), required=True,
                                     metavar="SECONDS", help="how long to record")
    interval: float = setting(0.1, parse=number, commands=(RECORD,), metavar="SECONDS",
                              help="sampling period")
    profiling: bool = setting(False, parse=yes_no, commands=(RECORD,), toggle=True,
                              help="also record CUPTI PM sampling counters")


_LOAD = (DEMO, LOADGEN)


@dataclass
class LoadFlags:
    """The load generator's flags, which ``mrc-agent demo`` shares."""

    duration: float = setting(30.0, parse=number, commands=_LOAD, metavar="SECONDS",
                              help="how long the load runs")
    rate: float = setting(2.0, parse=number, commands=_LOAD, help="requests per second")
    api: str = setting("mix", parse=text, commands=_LOAD, choices=API_CHOICES,
                       help="upload: POST /mrc/upload; chat and chat-stream: POST "
                            "/v1/chat/completions, whole or streamed; mix: the three in turn")


@dataclass
class DemoFlags(LoadFlags):
    """``mrc-agent demo``: the load's flags, and where the service and the agent listen."""

    #: More than loadgen's: the naive path's one thread keeps busy at 5 requests a second
    #: (at 2 its hottest 0.5 s windows stayed under the starvation threshold).
    rate: float = setting(5.0, parse=number, commands=(DEMO,), help="requests per second")
    port: int = setting(8000, parse=whole, commands=(DEMO,), help="the service's port")
    listen: str = setting("127.0.0.1:9478", parse=text, commands=(DEMO,), metavar="HOST:PORT",
                          help="the agent's address")
    trace: str | None = setting(
        parse=text, commands=(DEMO,), metavar="PATH",
        help="replay this GPU trace instead of NVML or the embedded synthetic one")
    preprocess: str = setting(
        "naive", parse=text, commands=(DEMO,), choices=("naive", "tuned"),
        help="the service's image preprocessing: naive (one thread decodes whole photos and "
             "converts pixels in Python, holding the GIL: the starved GPU the agent is for) "
             "or tuned (what the service runs unless told)")


@dataclass
class LoadgenFlags(LoadFlags):
    """``mrc-agent loadgen``."""

    url: str | None = setting(parse=text, commands=(LOADGEN,), required=True,
                              help="the service's base URL")
    max_new_tokens: int = setting(16, parse=whole, commands=(LOADGEN,),
                                  help="new tokens each request asks for")
    max_in_flight: int = setting(64, parse=whole, commands=(LOADGEN,),
                                 help="requests under way at most")
    seed: int = setting(1, parse=whole, commands=(LOADGEN,),
                        help="seed of the request mix")


@dataclass
class CatalogFlags:
    """``mrc-agent catalog``."""

    out: str | None = setting(parse=text, commands=(CATALOG,), metavar="FILE",
                              default_text="standard output", help="where to write")
    settings: bool = setting(False, parse=yes_no, commands=(CATALOG,), toggle=True,
                             help="the settings: key, flag, environment name, default, meaning")


_MIXIN = (ALERTS, DASHBOARDS)


@dataclass
class MixinFlags:
    """What ``alerts build`` and ``dashboards build`` share: one configuration for both."""

    selector: str | None = setting(
        parse=text, commands=_MIXIN, metavar="MATCHERS",
        help='label matchers added to every selector, e.g. namespace="mrc"')
    runbook_base: str | None = setting(parse=text, commands=_MIXIN, metavar="URL",
                                       default_text="docs/runbooks",
                                       help="base of the runbook links")


@dataclass
class AlertsFlags(MixinFlags):
    """``mrc-agent alerts build``."""

    out: str = setting("alerts/generated", parse=text, commands=(ALERTS,), metavar="DIR",
                       help="output directory")
    cluster_label: str | None = setting(
        parse=text, commands=(ALERTS,), metavar="NAME", default_text="cluster; empty: none",
        help="label that tells clusters apart, kept by the fleet rules and Alertmanager's "
             "grouping")


@dataclass
class DashboardsFlags(MixinFlags):
    """``mrc-agent dashboards build``."""

    out: str = setting("dashboards/generated", parse=text, commands=(DASHBOARDS,),
                       metavar="DIR", help="output directory")


@dataclass
class ProxyFlags:
    """``mrc-agent proxy``."""

    listen: str | None = setting(parse=text, commands=(PROXY,), required=True,
                                 metavar="HOST:PORT", help="address the clients connect to")
    upstream: str | None = setting(
        parse=text, commands=(PROXY,), required=True, metavar="URL",
        help="the server, http(s)://host:port (the request path is kept)")
    metrics_listen: str | None = setting(parse=text, commands=(PROXY,), required=True,
                                         metavar="HOST:PORT", help="address serving /metrics")
    connect_timeout: float = setting(
        10.0, parse=number, commands=(PROXY,), metavar="SECONDS",
        help="give up connecting to the upstream after this long: 502")
    drain_timeout: float = setting(
        25.0, parse=number, commands=(PROXY,), metavar="SECONDS",
        help="on SIGTERM, let answers under way finish for this long; keep it below the "
             "pod's terminationGracePeriodSeconds (30 unless set)")
    head_timeout: float = setting(
        60.0, parse=number, commands=(PROXY,), metavar="SECONDS",
        help="a client's request head must arrive whole within this long (the wait for the "
             "next request on a kept-alive connection included)")
    max_connections: int = setting(
        1024, parse=whole, commands=(PROXY,), metavar="N",
        help="client connections open at once; at the cap the one that has waited longest "
             "for a request head is closed, and when all are being answered a new one gets "
             "503 (each costs two file descriptors)")
    workers: int = setting(
        1, parse=whole, commands=(PROXY,), metavar="N",
        help="processes serving --listen together (SO_REUSEPORT: the kernel spreads the "
             "connections); --metrics-listen shows their counts merged")
    log_level: str = setting("info", parse=text, commands=(PROXY,), choices=_LEVELS,
                             help="log level")


@dataclass
class SelfcheckFlags:
    """``mrc-agent selfcheck``: ``--gpu`` or ``--dry``, one of them."""

    gpu: bool = setting(False, parse=yes_no, commands=(SELFCHECK,), toggle=True, one_of="mode",
                        help="on the local NVIDIA GPU (needs torch with CUDA)")
    dry: bool = setting(False, parse=yes_no, commands=(SELFCHECK,), toggle=True, one_of="mode",
                        help="on a simulated GPU, through the agent's real readers")
    out: str | None = setting(
        parse=text, commands=(SELFCHECK,), metavar="DIR",
        default_text="./mrc-selfcheck-TIMESTAMP",
        help="output directory for gpu_truth.txt, gpu_truth.json and the trace")
    duration: float | None = setting(
        parse=number, commands=(SELFCHECK,), metavar="SECONDS", default_text="20; 2 with --dry",
        help="length of the recorded trace; shorter also shortens the measured windows")


@dataclass
class DiagnoseFlags:
    """``mrc-agent diagnose``'s own flags, beside the sidecar settings it takes."""

    pid: int | None = setting(parse=whole, commands=(DIAGNOSE,), required=True,
                              help="the process to diagnose")
    duration: float = setting(10.0, parse=number, commands=(DIAGNOSE,), metavar="SECONDS",
                              help="length of the window")
    out: str | None = setting(parse=text, commands=(DIAGNOSE,), metavar="DIR",
                              default_text="./mrc-diagnose-PID-TIMESTAMP",
                              help="output directory")
    py_spy: str | None = setting(parse=text, commands=(DIAGNOSE,), metavar="PATH",
                                 default_text="the one beside this Python, else PATH",
                                 help="the py-spy executable")
    agent: str | None = setting(
        parse=text, commands=(DIAGNOSE,), metavar="URL",
        help="ask the agent at URL (e.g. http://127.0.0.1:9478) for the diagnosis instead: it "
             "runs it as an on-alert capture, on its own stack samples where it has them (the "
             "minute before included), and no second sampler attaches; needs "
             "--agent-token-file")
    agent_token_file: str | None = setting(
        parse=text, commands=(DIAGNOSE,), metavar="PATH",
        help="the agent's webhook token (its --webhook-token-file), for --agent")
    #: diagnose's own sampling period, not the sidecar's interval: never read from the
    #: environment or the config file, which set the sidecar's.
    interval: float = setting(
        DIAGNOSE_INTERVAL_S, parse=number, commands=(DIAGNOSE,), metavar="SECONDS",
        help="collector sampling period over the window; not read from the environment, "
             "whose MRC_AGENT_INTERVAL is the sidecar's")


RECORD_FLAGS = Declarations(RecordFlags)
DEMO_FLAGS = Declarations(DemoFlags)
LOADGEN_FLAGS = Declarations(LoadgenFlags)
CATALOG_FLAGS = Declarations(CatalogFlags)
ALERTS_FLAGS = Declarations(AlertsFlags)
DASHBOARDS_FLAGS = Declarations(DashboardsFlags)
PROXY_FLAGS = Declarations(ProxyFlags)
SELFCHECK_FLAGS = Declarations(SelfcheckFlags)
DIAGNOSE_FLAGS = Declarations(DiagnoseFlags)
