"""The agent's configuration: one typed, validated object.

Precedence is config file < environment (``MRC_AGENT_*``) < command-line flags. Every problem
becomes a :class:`ConfigError` with one line of text; ``cli.py`` turns it into exit code 2.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from agent.core.catalog import COLLECTORS, DEFAULT_ON
from agent.core.collectors.derived import Thresholds

#: 9478: clear of dcgm-exporter (9400), node_exporter (9100), the OpenTelemetry Prometheus
#: exporter (9464) and the Prometheus stack's own 9090-9094.
DEFAULT_PORT = 9478
DEFAULT_LISTEN = f"0.0.0.0:{DEFAULT_PORT}"
MIN_INTERVAL, MAX_INTERVAL = 0.05, 60.0
ENV_PREFIX = "MRC_AGENT_"
#: A shared webhook token shorter than this is too easy to guess (16 characters of a random
#: hex or base64 string are 64 bits or more).
MIN_TOKEN_LENGTH = 16
#: Where on-alert captures go unless told otherwise: a tmpfs/emptyDir in a pod whose root
#: filesystem is read-only.
DEFAULT_CAPTURE_DIR = os.path.join(tempfile.gettempdir(), "mrc-agent-captures")
#: Capture settings -> (lowest, highest) accepted value.
CAPTURE_RANGES: dict[str, tuple[float, float]] = {
    "capture_duration": (1.0, 120.0),
    "capture_max_per_hour": (1, 60),
    "capture_max_count": (1, 1000),
    "capture_max_bytes": (1 << 20, 1 << 40),
    "capture_retention": (60.0, 365 * 86400.0),
}
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2,
          "gi": 1024**3}
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class ConfigError(Exception):
    """A bad flag, environment variable or config file entry."""


@dataclass
class AgentConfig:
    pids: list[int] = field(default_factory=list)
    pidfile: str | None = None
    process_name: str | None = None
    listen: str = DEFAULT_LISTEN
    interval: float = 1.0
    gpu_backend: str = "auto"
    collectors: dict[str, bool] = field(default_factory=lambda: dict(DEFAULT_ON))
    idle_util_threshold: float = Thresholds.idle_util
    starvation_cpu_threshold: float = Thresholds.starved_cpu
    starvation_gpu_threshold: float = Thresholds.starved_gpu
    log_level: str = "info"
    #: The Alertmanager webhook (``POST /hooks/alertmanager``) and the captures endpoints are
    #: served only when a shared token is given: a file (``--webhook-token-file``, mounted from
    #: a Secret) or ``MRC_AGENT_WEBHOOK_TOKEN``. Never on the command line or in the config
    #: file, where it would be visible in ``ps`` or a ConfigMap.
    webhook_token_file: str | None = None
    webhook_token: str | None = None
    capture_dir: str = DEFAULT_CAPTURE_DIR
    #: Seconds one on-alert capture samples for: long enough for a few hundred stacks and a
    #: few GPU idle windows, short enough that the moment the alert caught is still going on.
    capture_duration: float = 10.0
    #: At most this many captures start per rolling hour (and only one runs at a time): an
    #: alert that re-fires every group_interval must not keep py-spy attached all day.
    capture_max_per_hour: int = 6
    #: Bounds of the captures directory; the oldest captures are deleted first.
    capture_max_count: int = 20
    capture_max_bytes: int = 100 * 1024 * 1024
    #: Captures older than this many seconds are deleted (7 days).
    capture_retention: float = 7 * 86400.0

    @property
    def host_port(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.idle_util_threshold, self.starvation_cpu_threshold,
                          self.starvation_gpu_threshold)

    @property
    def replay_path(self) -> str | None:
        return self.gpu_backend[len("replay:"):] if self.gpu_backend.startswith("replay:") else None

    @property
    def webhook_enabled(self) -> bool:
        return bool(self.webhook_token_file or self.webhook_token)

    @property
    def enabled(self) -> list[str]:
        """Enabled collector names in sampling order."""
        return [name for name in COLLECTORS if self.collectors.get(name)]


KEYS = {f.name for f in fields(AgentConfig)}


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` (all interfaces) or ``[::1]:PORT``."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {value!r} is not HOST:PORT")
    return (host or "0.0.0.0", int(port))


def parse_bytes(value: Any) -> int:
    """``104857600``, ``100Mi``, ``100MiB``, ``1G``, ``500k`` -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?)?b?\s*", str(value), re.IGNORECASE)
    if m is None:
        raise ValueError("expected bytes such as 104857600, 100Mi or 1G")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_seconds(value: Any) -> float:
    """``3600``, ``90s``, ``30m``, ``24h``, ``7d`` -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(value), re.IGNORECASE)
    if m is None:
        raise ValueError("expected a duration such as 3600, 90s, 30m, 24h or 7d")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]


def read_token_file(path: str) -> str:
    """The webhook token in ``path`` (surrounding whitespace removed), checked."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read webhook token file {path}: {why}") from exc
    check_token(token, f"webhook token file {path}")
    return token


def check_token(token: str, origin: str) -> None:
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"{origin}: the token must be at least {MIN_TOKEN_LENGTH} characters")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ConfigError(f"{origin}: the token must be one word of printable characters")


def _collectors_from_list(spec: str | list[str], base: dict[str, bool]) -> dict[str, bool]:
    """``"profiling,-gpm"``: names to switch on, ``-name`` to switch off."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = dict(base)
    for raw in items:
        item = str(raw).strip()
        if not item:
            continue
        on = not item.startswith("-")
        name = item.lstrip("-+")
        if name not in COLLECTORS:
            raise ConfigError(f"unknown collector {name!r} (known: {', '.join(COLLECTORS)})")
        out[name] = on
    return out


def _coerce(key: str, value: Any, current: AgentConfig, origin: str) -> Any:
    try:
        if key == "pids":
            if isinstance(value, str):
                value = [v for v in value.replace(" ", ",").split(",") if v]
            if not isinstance(value, list):
                value = [value]
            pids = [int(v) for v in value]
            if any(p <= 0 for p in pids):
                raise ValueError("PIDs are positive")
            return pids
        if key == "collectors":
            if isinstance(value, Mapping):
                out = dict(current.collectors)
                for name, on in value.items():
                    if name not in COLLECTORS:
                        raise ConfigError(f"{origin}: unknown collector {name!r} "
                                          f"(known: {', '.join(COLLECTORS)})")
                    out[name] = bool(on)
                return out
            return _collectors_from_list(value, current.collectors)
        if key in ("interval", "idle_util_threshold", "starvation_cpu_threshold",
                   "starvation_gpu_threshold", "capture_duration"):
            return float(value)
        if key in ("capture_max_per_hour", "capture_max_count"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("expected a whole number")
            return int(value)
        if key == "capture_max_bytes":
            return parse_bytes(value)
        if key == "capture_retention":
            return parse_seconds(value)
        return None if value is None else str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{origin}: invalid value {value!r} for {key} ({exc})") from exc


def apply(cfg: AgentConfig, values: Mapping[str, Any], origin: str) -> None:
    """Overlay ``values`` (already keyed by field name) onto ``cfg``."""
    for key, value in values.items():
        if key not in KEYS:
            raise ConfigError(f"{origin}: unknown setting {key!r}")
        setattr(cfg, key, _coerce(key, value, cfg, origin))


def from_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    out = {str(k).replace("-", "_"): v for k, v in data.items()}
    if "webhook_token" in out:
        raise ConfigError(f"config file {path}: do not put the webhook token in the config file; "
                          "use webhook_token_file or MRC_AGENT_WEBHOOK_TOKEN")
    return out


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """``MRC_AGENT_PIDS`` (or ``MRC_AGENT_PID``), ``MRC_AGENT_INTERVAL``, … ;
    ``MRC_AGENT_CONFIG`` names the file and is not a setting."""
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        key = name[len(ENV_PREFIX):].lower()
        key = "pids" if key == "pid" else key
        if key not in KEYS:
            raise ConfigError(f"environment: unknown setting {name}")
        out[key] = value
    return out


def validate(cfg: AgentConfig) -> AgentConfig:
    """Check every setting; the first problem raises ConfigError."""
    parse_listen(cfg.listen)
    if not MIN_INTERVAL <= cfg.interval <= MAX_INTERVAL:
        raise ConfigError(
            f"interval {cfg.interval} is out of range ({MIN_INTERVAL}-{MAX_INTERVAL} seconds)")
    if cfg.process_name is not None:
        try:
            re.compile(cfg.process_name)
        except re.error as exc:
            raise ConfigError(f"process-name regex {cfg.process_name!r} does not compile: "
                              f"{exc}") from exc
    backend = cfg.gpu_backend
    if backend not in ("auto", "nvml", "none") and not (
            backend.startswith("replay:") and len(backend) > len("replay:")):
        raise ConfigError(f"gpu-backend {backend!r} is not one of auto, nvml, replay:PATH, none")
    for key in ("idle_util_threshold", "starvation_cpu_threshold", "starvation_gpu_threshold"):
        value = getattr(cfg, key)
        if not 0.0 <= value <= (64.0 if key == "starvation_cpu_threshold" else 1.0):
            raise ConfigError(f"{key.replace('_', '-')} {value} is out of range")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log-level {cfg.log_level!r} is not debug, info, warning or error")
    if cfg.webhook_token_file and cfg.webhook_token:
        raise ConfigError("give the webhook token once: webhook-token-file or "
                          "MRC_AGENT_WEBHOOK_TOKEN, not both")
    if cfg.webhook_token:
        check_token(cfg.webhook_token, "MRC_AGENT_WEBHOOK_TOKEN")
    for key, (low, high) in CAPTURE_RANGES.items():
        value = getattr(cfg, key)
        if not low <= value <= high:
            raise ConfigError(f"{key.replace('_', '-')} {value:g} is out of range "
                              f"({low:g}-{high:g})")
    if not cfg.capture_dir:
        raise ConfigError("capture-dir must not be empty")
    return cfg


def load(cli: Mapping[str, Any], env: Mapping[str, str] | None = None,
         config_path: str | None = None) -> AgentConfig:
    """Build the config from file < env < CLI (``cli`` holds only the flags given)."""
    env = os.environ if env is None else env
    cfg = AgentConfig()
    path = config_path or env.get(ENV_PREFIX + "CONFIG")
    if path:
        apply(cfg, from_file(path), f"config file {path}")
    apply(cfg, from_env(env), "environment")
    apply(cfg, {k: v for k, v in cli.items() if v is not None}, "command line")
    return validate(cfg)
