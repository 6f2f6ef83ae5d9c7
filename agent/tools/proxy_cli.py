"""``mrc-agent proxy``'s command: its flags, its checks and the process that serves the
:class:`~mrc_agent.agent.tools.proxy.Proxy` and its metrics until a signal stops it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time

from mrc_agent.agent.tools.proxy import MAX_CONNECTIONS, POOL_SIZE, Proxy
from mrc_agent.agent.tools.proxy_http import (
    ProxyError,
    Upstream,
    descriptors_for,
    split_hostport,
)
from mrc_agent.exporters.instrumentation.metrics import MRCMetrics

log = logging.getLogger(__name__)


def run_proxy(listen: str, upstream: str, metrics_listen: str,
              connect_timeout: float = 10.0, drain_timeout: float = 25.0,
              head_timeout: float = 60.0, max_connections: int = MAX_CONNECTIONS) -> int:
    """``mrc-agent proxy``: serve until SIGTERM or SIGINT, then let the answers under way
    finish for up to ``drain_timeout`` seconds."""
    from prometheus_client import CollectorRegistry

    from mrc_agent.exporters.exposition.http import ExpositionServer

    host, port = split_hostport(listen, "--listen")
    m_host, m_port = split_hostport(metrics_listen, "--metrics-listen")
    up = Upstream.parse(upstream)
    registry = CollectorRegistry()
    metrics = MRCMetrics(registry=registry, resolution_unknown=True)
    try:
        exposition = ExpositionServer(registry, m_host, m_port, version=time.monotonic_ns,
                                      not_ready=lambda: None)
    except OSError as e:
        raise ProxyError(f"--metrics-listen {metrics_listen}: {e.strerror or e}") from None
    proxy = Proxy(up, metrics, connect_timeout=connect_timeout, head_timeout=head_timeout,
                  max_connections=max_connections)
    descriptors_for(max_connections, POOL_SIZE)

    async def main() -> None:
        try:
            bound = await proxy.start(host, port)
        except OSError as e:
            raise ProxyError(f"--listen {listen}: {e.strerror or e}") from None
        log.info("proxying %s:%d to %s://%s:%d; metrics on %s:%d", host, bound, up.scheme,
                 up.host, up.port, m_host, exposition.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping: %d answers under way, up to %g s to finish", len(proxy._busy),
                 drain_timeout)
        await proxy.stop(drain_timeout)

    exposition.start()
    try:
        asyncio.run(main())
    finally:
        exposition.stop()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import PROXY, PROXY_FLAGS

    PROXY_FLAGS.add_flags(parser, PROXY)


def run(args: argparse.Namespace) -> int:
    from mrc_agent.agent.core.config import ConfigError
    from mrc_agent.agent.tools.sidecar import setup_logging

    setup_logging(args.log_level)
    if not args.connect_timeout > 0 or not args.drain_timeout >= 0 \
            or not args.head_timeout > 0:
        raise ConfigError("--connect-timeout and --head-timeout must be > 0 and "
                          "--drain-timeout >= 0")
    if args.max_connections < 1:
        raise ConfigError(f"--max-connections {args.max_connections} must be at least 1")
    try:
        return run_proxy(args.listen, args.upstream, args.metrics_listen,
                         args.connect_timeout, args.drain_timeout, args.head_timeout,
                         args.max_connections)
    except ProxyError as exc:
        raise ConfigError(str(exc)) from exc
