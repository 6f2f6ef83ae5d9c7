"""The agent's configuration: one typed, validated object.

Precedence is config file < environment (``MRC_AGENT_*``) < command-line flags. Every problem
becomes a :class:`ConfigError` with one line of text; ``cli.py`` turns it into exit code 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from agent.catalog import COLLECTORS, DEFAULT_ON
from agent.collectors.derived import Thresholds

#: 9478: clear of dcgm-exporter (9400), node_exporter (9100), the OpenTelemetry Prometheus
#: exporter (9464) and the Prometheus stack's own 9090-9094.
DEFAULT_PORT = 9478
DEFAULT_LISTEN = f"0.0.0.0:{DEFAULT_PORT}"
MIN_INTERVAL, MAX_INTERVAL = 0.05, 60.0
ENV_PREFIX = "MRC_AGENT_"


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
                   "starvation_gpu_threshold"):
            return float(value)
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
    return {str(k).replace("-", "_"): v for k, v in data.items()}


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
