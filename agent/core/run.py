"""``mrc-agent run``: the sidecar's life — build from the config, sample, serve, stop on
SIGTERM/SIGINT and close what was opened.

Extra routes (the on-alert capture endpoints of :mod:`agent.tools.capture`) come in through
``routes_factory``, so the core never imports a tool.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from agent import __version__
from agent.core.config import AgentConfig, ConfigError
from agent.core.runner import Runner
from agent.core.wiring import build_runner, build_server, make_sources
from exporters.exposition.http import Routes

log = logging.getLogger("agent")


@runtime_checkable
class _Stoppable(Protocol):
    def stop(self) -> None: ...


#: Builds the extra routes for a config and its runner (or None); raises ConfigError.
RoutesFactory = Callable[[AgentConfig, Runner], Routes | None]


def run_agent(cfg: AgentConfig, routes_factory: RoutesFactory | None = None) -> int:
    """Run until SIGTERM or SIGINT; bad input raises ConfigError (exit 2 in the CLI)."""
    from agent.core.hw.replay import ReplayFormatError
    from agent.core.targets import PidfileError, read_pidfile

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
        server = build_server(cfg, runner, routes)
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
    shown = f"[{host}]" if ":" in host else host
    log.info("mrc-agent %s listening on http://%s:%d/metrics (interval %.3gs, collectors %s, "
             "gpu backend %s)", __version__, shown, server.port, cfg.interval,
             ",".join(cfg.enabled), cfg.gpu_backend)
    while not stop.wait(1.0):
        pass
    server.stop()
    # Routes that own background work (a capture in progress) stop it here.
    if isinstance(routes, _Stoppable):
        routes.stop()
    runner.stop()
    sources.close()
    log.info("stopped")
    return 0
