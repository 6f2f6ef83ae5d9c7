"""``mrc-agent run``: the sidecar's life — build from the config, sample, serve, re-read the
configuration on SIGHUP (as Prometheus does), stop on SIGTERM/SIGINT and close what was opened.
SIGHUP also re-reads the web configuration file (TLS, basic auth, headers).

Extra routes (the on-alert capture endpoints of :mod:`mrc_agent.agent.tools.capture`) come in
through ``routes_factory``, so the core never imports a tool.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from mrc_agent.agent import __version__
from mrc_agent.agent.core.config import AgentConfig, ConfigError, clipped
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.core.wiring import build_runner, build_server, make_sources
from mrc_agent.exporters.exposition.http import ExpositionServer, Routes
from mrc_agent.exporters.exposition.http.webconfig import (
    WebConfig,
    load_web_config,
    reload_web_config,
)

log = logging.getLogger(__name__)


#: Builds the extra routes for a config and its runner (or None); raises ConfigError.
RoutesFactory = Callable[[AgentConfig, Runner], Routes | None]
#: Reads the configuration again (file < environment < the flags given); raises ConfigError.
Reloader = Callable[[], AgentConfig]

#: Settings SIGHUP applies to the running agent: which processes to watch, how much to log and
#: the web configuration file (read again even when its path stays: certificates rotate).
#: Every other setting shapes what was built at start (collectors, sources, the listening
#: socket, captures) and needs a restart.
RELOADABLE = ("pids", "pidfile", "process_name", "log_level", "web_config_file")


def apply_reload(cfg: AgentConfig, new: AgentConfig, runner: Runner) -> list[str]:
    """Apply ``new``'s reloadable settings to the running agent; returns the names of the
    other settings that changed (they take effect at the next restart)."""
    from mrc_agent.agent.core.targets import TargetResolver

    if (new.pids, new.pidfile, new.process_name) != (cfg.pids, cfg.pidfile, cfg.process_name):
        runner.targets = TargetResolver(new.pids, new.pidfile, new.process_name)
    if new.log_level != cfg.log_level:
        logging.getLogger().setLevel(new.log_level.upper())
    for name in RELOADABLE:
        setattr(cfg, name, getattr(new, name))
    return [name for name in vars(cfg) if getattr(new, name) != getattr(cfg, name)]


def _apply_web(server: ExpositionServer, running: WebConfig, new: WebConfig) -> WebConfig:
    """Serve with ``new`` from the next connection (TLS) or request (auth, headers) on."""
    server.reconfigure(new.tls, new.auth, new.headers)
    if new.path or running.path:
        log.info("web config file %s re-read: %s", new.path or "-", new.summary())
    return new


def run_agent(cfg: AgentConfig, routes_factory: RoutesFactory | None = None,
              reload: Reloader | None = None) -> int:
    """Run until SIGTERM or SIGINT, re-reading the configuration through ``reload`` on
    SIGHUP; bad input at start raises ConfigError (exit 2 in the CLI), at a reload it is
    logged in one line and the running configuration kept — whatever the reload raised."""
    from mrc_agent.agent.core.hw.replay import ReplayFormatError
    from mrc_agent.agent.core.targets import PidfileError, read_pidfile

    web = load_web_config(cfg.web_config_file)  # before anything is opened
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
    routes = routes_factory(cfg, runner) if routes_factory is not None else None
    host, port = cfg.host_port
    try:
        server = build_server(cfg, runner, routes, web)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    if not runner.targets.configured:
        log.warning("no target configured (--pid, --pidfile or --process-name): "
                    "only GPU series will be exported")

    wake = threading.Event()
    pending: set[int] = set()

    def on_signal(signum: int, _frame: Any) -> None:
        pending.add(signum)
        wake.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    runner.start()
    server.start()
    shown = f"[{host}]" if ":" in host else host
    log.info("mrc-agent %s listening on %s://%s:%d/metrics (interval %.3gs, collectors %s, "
             "gpu backend %s)", __version__, "https" if web.tls else "http", shown, server.port,
             cfg.interval, ",".join(cfg.enabled), cfg.gpu_backend)
    if web.path:
        log.info("web config file %s: %s", web.path, web.summary())
    # The main thread sleeps until a signal comes (no periodic wake-up).
    while True:
        wake.wait()
        wake.clear()
        got = set(pending)
        pending.difference_update(got)
        stopping = next((s for s in got if s != signal.SIGHUP), None)
        if stopping is not None:
            log.info("received %s, shutting down", signal.Signals(stopping).name)
            break
        if reload is None:
            log.info("received SIGHUP; nothing to re-read")
            continue
        try:
            new = reload()
            new_web = reload_web_config(web, new.web_config_file)
        except ConfigError as exc:
            log.warning("received SIGHUP; configuration not reloaded, keeping the running "
                        "one: %s", exc)
            continue
        except Exception as exc:  # noqa: BLE001 - whatever a file holds, a reload never stops
            # the agent (the docs promise the running configuration is kept); one line.
            log.warning("received SIGHUP; configuration not reloaded, keeping the running "
                        "one: %s: %s", type(exc).__name__, clipped(str(exc)))
            continue
        later = apply_reload(cfg, new, runner)
        web = _apply_web(server, web, new_web)
        log.info("received SIGHUP; configuration reloaded (targets: pids %s, pidfile %s, "
                 "process name %s; log level %s)%s", cfg.pids or "-", cfg.pidfile or "-",
                 cfg.process_name or "-", cfg.log_level,
                 f"; restart to apply {', '.join(later)}" if later else "")
    server.stop()
    # Routes that own background work (a capture in progress) stop it here.
    if routes is not None:
        routes.stop()
    runner.stop()
    sources.close()
    log.info("stopped")
    return 0
