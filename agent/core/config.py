"""The agent's configuration: one typed object whose fields are the settings of ``mrc-agent run``,
``doctor`` and ``diagnose``.

Each field of :class:`AgentConfig` is declared once with :func:`setting`: its default, how a
value from the config file, the environment or a flag is read, its range, flag, ``--help`` text
and subcommands. The mechanism that reads those declarations (coercion, the environment names
``MRC_AGENT_<NAME>``, the flags and their help) is :mod:`mrc_agent.exporters.settings`, shared
with the tools and the reference service; this module holds the agent's declarations, its config
file and the precedence of its sources. The on-alert captures contribute their settings as a
group of their own (:class:`CaptureSettings`), composed into :class:`AgentConfig`.

Precedence is config file < environment < command-line flags. Every problem becomes a
:class:`ConfigError` with one line of text; ``agent/cli.py`` turns it into exit code 2.

The config file is read as plain data, not as all of YAML (:mod:`mrc_agent.exporters.plainyaml`,
which reads the web configuration file too). A key given no
value (``listen:``, ``listen: null``) is refused rather than read as the default: a template that
rendered nothing should be seen, as Prometheus and exporter-toolkit see it; leave the key out
for the default. Every value shown in an error is cut to :data:`SHOWN_CHARS`.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mrc_agent.agent.core.attribution import GPU_MODES, MODE_TARGETS
from mrc_agent.agent.core.collectors import COLLECTOR_NAMES, DEFAULT_ON
from mrc_agent.agent.core.collectors.base import DerivedThresholds
from mrc_agent.agent.core.units import parse_bytes, parse_duration
from mrc_agent.exporters import plainyaml
from mrc_agent.exporters.files import describe, read_bounded
from mrc_agent.exporters.settings import (
    ConfigError,
    Declarations,
    Setting,
    between,
    clipped,
    default_shown,
    nonempty,
    number,
    setting,
    shown,
    switch,
    text,
    whole,
)

#: 9478 is not a free number: the Prometheus default port allocation list gives it to another
#: exporter, and the list's range (9100-9999) is full. The sidecar listens in the pod's network
#: namespace beside the serving containers (8000-8002, 80, 3000, 8080), not the node's, where
#: that exporter would run (README, `mrc-agent run`).
DEFAULT_PORT = 9478
DEFAULT_LISTEN = f"0.0.0.0:{DEFAULT_PORT}"
MIN_INTERVAL, MAX_INTERVAL = 0.05, 60.0
ENV_PREFIX = "MRC_AGENT_"
#: The environment variable that names the config file (it is not a setting itself).
CONFIG_ENV = ENV_PREFIX + "CONFIG"
#: A shared webhook token shorter than this is too easy to guess (16 characters of a random
#: hex or base64 string are 64 bits or more).
MIN_TOKEN_LENGTH = 16
#: Where on-alert captures go unless told otherwise: a tmpfs/emptyDir in a pod whose root
#: filesystem is read-only.
DEFAULT_CAPTURE_DIR = os.path.join(tempfile.gettempdir(), "mrc-agent-captures")
#: The bounds of one capture's window, seconds (``capture_duration``, and what ``POST
#: /captures`` may ask for).
CAPTURE_DURATION_RANGE = (1.0, 120.0)
GPU_BACKENDS = "auto, nvml, replay:PATH, none"

#: Subcommands whose flags a setting appears among.
RUN, DOCTOR, DIAGNOSE = "run", "doctor", "diagnose"
#: The ``--help`` group of the capture settings.
CAPTURES_GROUP = "on-alert captures (off unless a webhook token is given)"

# -- parsers: (value, current config) -> typed value ------------------------------------------

#: Linux's PID_MAX_LIMIT: no PID is larger.
MAX_PID = 1 << 22


def _bytes(value: Any, _cfg: Any) -> int:
    return parse_bytes(value)


def _seconds(value: Any, _cfg: Any) -> float:
    return parse_duration(value)


def _pids(value: Any, _cfg: Any) -> list[int]:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", ",").split(",") if v]
    if not isinstance(value, list):
        value = [value]
    pids = [whole(v, None) if not isinstance(v, str) else int(v) for v in value]
    if any(p <= 0 for p in pids):
        raise ValueError("PIDs are positive")
    if any(p > MAX_PID for p in pids):
        raise ValueError(f"PIDs are at most {MAX_PID}")
    return pids


def _unknown_collector(name: object) -> ConfigError:
    return ConfigError(f"unknown collector {shown(name)} (known: {', '.join(COLLECTOR_NAMES)})")


def _collectors(value: Any, cfg: Any) -> dict[str, bool]:
    """A mapping ``{gpm: false}`` or a list ``"profiling,-gpm"`` (``-name`` switches off)."""
    out = dict(cfg.collectors)
    if isinstance(value, Mapping):
        for name, on in value.items():
            if name not in COLLECTOR_NAMES:
                raise _unknown_collector(name)
            out[name] = switch(on, name)
        return out
    for raw in value.split(",") if isinstance(value, str) else list(value):
        item = str(raw).strip()
        if not item:
            continue
        name = item.lstrip("-+")
        if name not in COLLECTOR_NAMES:
            raise _unknown_collector(name)
        out[name] = not item.startswith("-")
    return out


# -- checks: (value, setting name) -> None or ConfigError -------------------------------------

def _check_interval(value: float, _name: str) -> None:
    if not MIN_INTERVAL <= value <= MAX_INTERVAL:
        raise ConfigError(
            f"interval {value} is out of range ({MIN_INTERVAL}-{MAX_INTERVAL} seconds)")


def _check_ratio(high: float) -> Callable[[Any, str], None]:
    def check(value: float, name: str) -> None:
        if not 0.0 <= value <= high:
            raise ConfigError(f"{name.replace('_', '-')} {value} is out of range")
    return check


def _check_listen(value: str, _name: str) -> None:
    parse_listen(value)


def _check_regex(value: str | None, _name: str) -> None:
    if value is None:
        return
    try:
        re.compile(value)
    except re.error as exc:
        raise ConfigError(f"process-name regex {shown(value)} does not compile: "
                          f"{clipped(str(exc))}") from exc


def _check_backend(value: str, _name: str) -> None:
    if value not in ("auto", "nvml", "none") and not (
            value.startswith("replay:") and len(value) > len("replay:")):
        raise ConfigError(f"gpu-backend {shown(value)} is not one of {GPU_BACKENDS}")


def _check_gpus(value: str, _name: str) -> None:
    if value not in GPU_MODES:
        raise ConfigError(f"gpus {shown(value)} is not {' or '.join(GPU_MODES)}")


def _check_log_level(value: str, _name: str) -> None:
    if value.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log-level {shown(value)} is not debug, info, warning or error")


def _check_token(value: str | None, _name: str) -> None:
    if value is not None:
        check_token(value, "MRC_AGENT_WEBHOOK_TOKEN")


def _collector_flags(target: Any, spec: Setting, default: str) -> None:
    """The collectors' two flags, ``--collector NAME`` and ``--no-collector NAME``."""
    names = list(COLLECTOR_NAMES)
    target.add_argument("--collector", dest="enable", action="append", default=[],
                        choices=names, metavar="NAME",
                        help=f"switch a collector on (repeatable: {', '.join(names)}; "
                             f"default {default}; env {spec.env}=profiling,-gpm)")
    target.add_argument("--no-collector", dest="disable", action="append", default=[],
                        choices=names, metavar="NAME",
                        help=f"switch a collector off (repeatable; env {spec.env})")


def _collector_switches(args: argparse.Namespace) -> str | None:
    switches = [*getattr(args, "enable", []), *(f"-{n}" for n in getattr(args, "disable", []))]
    return ",".join(switches) if switches else None


_AGENT = (RUN, DOCTOR)


@dataclass
class SamplingSettings:
    """The sidecar's own settings: what it samples, how often, and where it serves."""

    pids: list[int] = setting(
        default_factory=list, parse=_pids, commands=_AGENT, flag="--pid", metavar="PID",
        aliases=(ENV_PREFIX + "PID",), repeatable=True, flag_type=int,
        help="target process ID (repeatable; in the environment a list such as 1,2)")
    pidfile: str | None = setting(
        parse=text, commands=_AGENT, metavar="PATH",
        help="file holding the target PID, re-read every interval")
    process_name: str | None = setting(
        parse=text, check=_check_regex, commands=_AGENT, metavar="REGEX",
        help="regex matched against command lines every interval; every match is a target "
             "(a process that execs into a match is found within 5 s)")
    listen: str = setting(
        DEFAULT_LISTEN, parse=text, check=_check_listen, commands=(RUN,), metavar="HOST:PORT",
        help="address to serve on: HOST:PORT, :PORT or [::1]:PORT")
    interval: float = setting(
        1.0, parse=number, check=_check_interval, commands=(RUN,), metavar="SECONDS",
        help="sampling period")
    gpu_backend: str = setting(
        "auto", parse=text, check=_check_backend, commands=(RUN, DOCTOR, DIAGNOSE),
        metavar="auto|nvml|replay:PATH|none", help="where GPU samples come from")
    #: Which GPUs' series to export (docs/attribution.md): the targets' (by their environment
    #: and NVML's process lists; every GPU while no target says) or every GPU the agent sees.
    gpus: str = setting(
        MODE_TARGETS, parse=text, check=_check_gpus, commands=(RUN, DOCTOR),
        metavar="|".join(GPU_MODES),
        help="GPUs to report: targets (those the target processes can use; every GPU while "
             "none says which) or all")
    #: PM sampling shuts every other profiler out of a GPU, so with attribution "unknown" a
    #: node of several GPUs is not profiled unless this allows it (docs/attribution.md).
    profile_unattributed: bool = setting(
        False, parse=lambda value, _cfg: switch(value, "profile_unattributed", "setting"),
        commands=(RUN, DOCTOR), metavar="true|false", default_text="false",
        help="let the profiling collector profile every GPU of the node while no target says "
             "which GPUs it uses (it holds their performance monitors)")
    #: GPM's own window: NVML wants more than 100 ms between two GPM samples, and a second
    #: averages out a decode loop's bursts; the sampler reuses the last window in between.
    gpm_interval: float = setting(
        1.0, parse=number, check=between(0.2, 60.0, "seconds"), commands=(RUN,),
        metavar="SECONDS", help="GPM sampling window (0.2-60 s); shorter sampling intervals "
                                "reuse the last window's values")
    stacks_interval: float = setting(0.1, parse=number, check=between(0.01, 1.0, "seconds"),
                                     commands=(RUN,), metavar="SECONDS",
                                     help="seconds between two stack samples of a target")
    stacks_top_k: int = setting(5, parse=whole, check=between(1, 100), commands=(RUN,),
                                metavar="N", help="functions per target with a label of their own")
    collectors: dict[str, bool] = setting(
        default_factory=lambda: dict(DEFAULT_ON), parse=_collectors, commands=_AGENT,
        metavar="NAME", add_flag=_collector_flags, read_flag=_collector_switches,
        help="collectors on or off: a list such as profiling,-gpm, or a mapping in the file")
    idle_util_threshold: float = setting(
        DerivedThresholds.idle_util, parse=number, check=_check_ratio(1.0),
        commands=(RUN, DOCTOR, DIAGNOSE), metavar="RATIO",
        help="GPU utilisation at or below which the GPU counts as idle")
    starvation_cpu_threshold: float = setting(
        DerivedThresholds.starved_cpu, parse=number, check=_check_ratio(64.0),
        commands=(RUN, DOCTOR, DIAGNOSE), metavar="RATIO",
        help="target user CPU (cores) at or above which it counts as hot")
    starvation_gpu_threshold: float = setting(
        DerivedThresholds.starved_gpu, parse=number, check=_check_ratio(1.0), commands=_AGENT,
        metavar="RATIO", help="GPU utilisation at or below which a hot target is starved")
    log_level: str = setting(
        "info", parse=text, check=_check_log_level, commands=_AGENT, metavar="LEVEL",
        help="debug, info, warning or error")
    #: TLS, client certificates, basic auth and response headers for every endpoint, in the
    #: Prometheus exporter-toolkit format (node_exporter's --web.config.file); read by
    #: exporters/exposition/http/webconfig.py at start and again on SIGHUP. Empty means none,
    #: as there.
    web_config_file: str | None = setting(
        parse=text, commands=(RUN,), metavar="PATH",
        help="Prometheus exporter-toolkit web configuration file (as node_exporter's "
             "--web.config.file): TLS, client certificates, basic auth, response headers")


@dataclass
class CaptureSettings:
    """The on-alert captures' settings (``agent/tools/capture``): one ``--help`` group of
    ``mrc-agent run``, composed into :class:`AgentConfig`."""

    GROUP: ClassVar[str] = CAPTURES_GROUP

    #: The Alertmanager webhook (``POST /hooks/alertmanager``) and the captures endpoints are
    #: served only when a shared token is given: a file (``--webhook-token-file``, mounted from
    #: a Secret) or ``MRC_AGENT_WEBHOOK_TOKEN``. Never on the command line or in the config
    #: file, where it would be visible in ``ps`` or a ConfigMap.
    webhook_token_file: str | None = setting(
        parse=text, commands=(RUN,), metavar="PATH",
        help="file holding the shared token that enables POST /hooks/alertmanager and "
             "GET /captures (or the token itself in MRC_AGENT_WEBHOOK_TOKEN)")
    webhook_token: str | None = setting(
        parse=text, check=_check_token, flag=None, env_only=True,
        help="the shared webhook token itself (environment only)")
    capture_dir: str = setting(
        DEFAULT_CAPTURE_DIR, parse=text, check=nonempty, commands=(RUN,), metavar="DIR",
        default_text="$TMPDIR/mrc-agent-captures",
        help="where captures are kept ($TMPDIR is /tmp when unset)")
    #: Seconds one on-alert capture samples for: long enough for a few hundred stacks and a
    #: few GPU idle windows, short enough that the moment the alert caught is still going on.
    capture_duration: float = setting(
        10.0, parse=number, check=between(*CAPTURE_DURATION_RANGE), commands=(RUN,),
        metavar="SECONDS",
        help="how long one capture samples")
    #: At most this many captures start per rolling hour (and only one runs at a time): an
    #: alert that re-fires every group_interval must not keep py-spy attached all day.
    capture_max_per_hour: int = setting(
        6, parse=whole, check=between(1, 60), commands=(RUN,), metavar="N",
        help="captures started per rolling hour at most")
    #: Bounds of the captures directory; the oldest captures are deleted first.
    capture_max_count: int = setting(
        20, parse=whole, check=between(1, 1000), commands=(RUN,), metavar="N",
        help="captures kept at most, oldest deleted first")
    capture_max_bytes: int = setting(
        100 * 1024 * 1024, parse=_bytes, check=between(1 << 20, 1 << 40), commands=(RUN,),
        metavar="BYTES", default_text="100Mi",
        help="bytes the captures may use, e.g. 100Mi")
    #: Captures older than this many seconds are deleted (7 days).
    capture_retention: float = setting(
        7 * 86400.0, parse=_seconds, check=between(60.0, 365 * 86400.0), commands=(RUN,),
        metavar="DURATION", default_text="7d",
        help="delete captures older than this, e.g. 24h or 7d")

    @property
    def webhook_enabled(self) -> bool:
        return bool(self.webhook_token_file or self.webhook_token)


@dataclass
class AgentConfig(CaptureSettings, SamplingSettings):
    """Every setting of the agent, in the order ``--help`` lists them: a dataclass lists the
    fields of its last base first, so the sidecar's come before the captures'."""

    @property
    def host_port(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def thresholds(self) -> DerivedThresholds:
        return DerivedThresholds(self.idle_util_threshold, self.starvation_cpu_threshold,
                                 self.starvation_gpu_threshold)

    @property
    def replay_path(self) -> str | None:
        return self.gpu_backend[len("replay:"):] if self.gpu_backend.startswith("replay:") else None

    @property
    def enabled(self) -> list[str]:
        """Enabled collector names in sampling order."""
        return [name for name in COLLECTOR_NAMES if self.collectors.get(name)]


#: The agent's settings, read by the shared mechanism; environment names MRC_AGENT_<NAME>.
DECLARATIONS = Declarations(AgentConfig, ENV_PREFIX)
#: Every setting, by field name, in declaration order.
SETTINGS: dict[str, Setting] = DECLARATIONS.specs


def default_of(name: str) -> Any:
    """The default value of setting ``name``."""
    return DECLARATIONS.default_of(name)


# -- values ------------------------------------------------------------------------------------

def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` (all interfaces) or ``[::1]:PORT`` -> (host, port); an IPv6
    host comes back without its brackets."""
    host, sep, port = value.rpartition(":")
    # ASCII digits only: str.isdigit() also passes "²", which int() refuses.
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {shown(value)} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if "[" in host or "]" in host:
        raise ConfigError(f"listen address {shown(value)} is not HOST:PORT")
    return (host or "0.0.0.0", int(port))


def read_token_file(path: str) -> str:
    """The webhook token in ``path`` (surrounding whitespace removed), checked."""
    try:
        token = read_bounded(path, 4096, "webhook token file", truncate=True).decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = describe(exc) if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read webhook token file {path}: {why}") from exc
    check_token(token, f"webhook token file {path}")
    return token


def check_token(token: str, origin: str) -> None:
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"{origin}: the token must be at least {MIN_TOKEN_LENGTH} characters")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ConfigError(f"{origin}: the token must be one word of printable characters")


# -- sources -----------------------------------------------------------------------------------

def apply(cfg: AgentConfig, values: Mapping[str, Any], origin: str) -> None:
    """Overlay ``values`` (already keyed by field name) onto ``cfg``."""
    DECLARATIONS.apply(cfg, values, origin)


def from_file(path: str) -> dict[str, Any]:
    data = plainyaml.load_yaml_mapping(path, "config file", "a mapping of settings")
    # A key that is not text is no setting; shown() names it even where str() cannot (an
    # integer too long to print).
    out = {(k if isinstance(k, str) else shown(k)).replace("-", "_"): v for k, v in data.items()}
    for key, value in out.items():
        spec = SETTINGS.get(key)
        if spec is not None and spec.env_only:
            raise ConfigError(f"config file {path}: do not put the {key.replace('_', ' ')} in "
                              f"the config file; use {spec.name}_file or {spec.env}")
        if spec is not None and value is None:
            raise ConfigError(f"config file {path}: {key} has no value (give one, or leave "
                              "the key out for the default)")
    return out


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """``MRC_AGENT_<SETTING>`` for every setting (``MRC_AGENT_PID`` for ``pids`` too);
    ``MRC_AGENT_CONFIG`` names the file and is not a setting."""
    return DECLARATIONS.from_env(env, ignore=(CONFIG_ENV,))


def validate(cfg: AgentConfig) -> AgentConfig:
    """Check every setting; the first problem raises ConfigError."""
    DECLARATIONS.check(cfg)
    if cfg.webhook_token_file and cfg.webhook_token:
        raise ConfigError("give the webhook token once: webhook-token-file or "
                          "MRC_AGENT_WEBHOOK_TOKEN, not both")
    return cfg


def load(cli: Mapping[str, Any], env: Mapping[str, str] | None = None,
         config_path: str | None = None) -> AgentConfig:
    """Build the config from file < env < CLI (``cli`` holds only the flags given)."""
    env = os.environ if env is None else env
    cfg = AgentConfig()
    path = config_path or env.get(CONFIG_ENV)
    if path:
        apply(cfg, from_file(path), f"config file {path}")
    apply(cfg, from_env(env), "environment")
    apply(cfg, {k: v for k, v in cli.items() if v is not None}, "command line")
    return validate(cfg)


# -- flags -------------------------------------------------------------------------------------

def default_text(name: str) -> str | None:
    """How ``--help`` and ``docs/settings.md`` show setting ``name``'s default; None when it
    has none."""
    return default_shown(SETTINGS[name], default_of(name))


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add ``command``'s setting flags (and ``--config``) to ``parser``. Flag defaults are None,
    so only the flags given override the environment and the file."""
    parser.add_argument("--config", metavar="PATH",
                        help=f"YAML config file (env {CONFIG_ENV})")
    DECLARATIONS.add_flags(parser, command)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags in ``args`` (as :func:`add_flags` declared them)."""
    return DECLARATIONS.flag_values(args)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> AgentConfig:
    """The config for a subcommand: file < env < its flags < ``overrides``."""
    cli = {**flag_values(args), **{k: v for k, v in overrides.items() if v is not None}}
    return load(cli, config_path=getattr(args, "config", None))
