"""``mrc-agent proxy``'s command: its flags, its checks and the process that serves the
:class:`~mrc_agent.agent.tools.proxy.Proxy` and its metrics until a signal stops it.

With ``--workers N`` (N > 1) the process is a supervisor, as gunicorn's arbiter is: it serves
``--metrics-listen`` and starts N worker processes that each serve ``--listen`` with
``SO_REUSEPORT``, so the kernel spreads the connections among them.

* **the port** — the supervisor binds ``--listen`` itself with ``SO_REUSEPORT`` (bound, never
  listening: it receives no connection) before any worker starts. That learns the port when
  ``--listen`` says port 0, reports an address in use as a bad ``--listen`` (exit 2) before any
  worker starts, and keeps the port reserved for the workers' whole life, so a restarted worker
  binds the same port even when every other worker is gone.
* **the metrics** — prometheus-client's multiprocess mode: every worker is a fresh
  ``python -m mrc_agent.agent proxy`` (a hidden flag makes it a worker) whose environment names
  the directory in ``PROMETHEUS_MULTIPROC_DIR`` from the start, so its values live in
  memory-mapped files there
  (:mod:`mrc_agent.exporters.instrumentation.multiprocess`). The directory is the user's
  ``PROMETHEUS_MULTIPROC_DIR`` when set, a private temporary one otherwise (removed at exit);
  either way the supervisor empties it once before the first worker starts. A scrape merges the
  files with prometheus-client's ``MultiProcessCollector``, and every family
  :class:`~mrc_agent.exporters.instrumentation.metrics.MRCMetrics` declares is in the exposition
  once, as with one process.
* **signals** — SIGTERM or SIGINT is passed on to every worker, which drains as one process does
  (``--drain-timeout``); the supervisor exits 0 once they have all exited, and kills one still
  running ``_EXIT_GRACE_S`` after the drain timeout.
* **a worker that dies** — the supervisor logs its exit status, drops its live gauges
  (prometheus-client's ``mark_process_dead``: in flight and queued stop counting it; its counters
  stay, as ``rate()`` needs) and starts a new one. One that dies before it is ready to serve
  (it could not bind, or it crashes at start) would only die again: the supervisor then stops the
  others and exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from mrc_agent.agent.tools.proxy import MAX_CONNECTIONS, POOL_SIZE, Proxy, run_loop
from mrc_agent.agent.tools.proxy_http import (
    ProxyError,
    Upstream,
    descriptors_for,
    split_hostport,
)
from mrc_agent.exporters.instrumentation.metrics import MRCMetrics

if TYPE_CHECKING:
    from mrc_agent.exporters.exposition.http import ExpositionServer

log = logging.getLogger(__name__)

#: The hidden flag that makes ``mrc-agent proxy`` a worker of a supervisor: the descriptor of
#: the pipe on which it says it is listening.
_WORKER_FLAG = "--worker-ready-fd"
#: How long after the drain timeout a worker still running on shutdown is killed.
_EXIT_GRACE_S = 10.0
#: How long a worker may take to start (import, bind) before the supervisor gives up on it.
_START_TIMEOUT_S = 120.0


def run_proxy(listen: str, upstream: str, metrics_listen: str,
              connect_timeout: float = 10.0, drain_timeout: float = 25.0,
              head_timeout: float = 60.0, max_connections: int = MAX_CONNECTIONS,
              workers: int = 1) -> int:
    """``mrc-agent proxy``: serve until SIGTERM or SIGINT, then let the answers under way
    finish for up to ``drain_timeout`` seconds. ``workers`` > 1: serve with that many worker
    processes (see the module's docstring)."""
    if workers > 1:
        return _supervise(listen, upstream, metrics_listen, connect_timeout, drain_timeout,
                          head_timeout, max_connections, workers)
    host, port = split_hostport(listen, "--listen")
    m_host, m_port = split_hostport(metrics_listen, "--metrics-listen")
    up = Upstream.parse(upstream)
    registry = CollectorRegistry()
    metrics = MRCMetrics(registry=registry, resolution_unknown=True)
    exposition = _exposition(registry, m_host, m_port, metrics_listen)
    proxy = Proxy(up, metrics, connect_timeout=connect_timeout, head_timeout=head_timeout,
                  max_connections=max_connections)
    descriptors_for(max_connections, POOL_SIZE)

    def started(bound: int) -> None:
        log.info("proxying %s:%d to %s://%s:%d; metrics on %s:%d", host, bound, up.scheme,
                 up.host, up.port, m_host, exposition.port)

    exposition.start()
    try:
        run_loop(_serve(proxy, listen, drain_timeout, started, reuse_port=False))
    finally:
        exposition.stop()
    return 0


def _exposition(registry: CollectorRegistry, host: str, port: int,
                metrics_listen: str) -> ExpositionServer:
    from mrc_agent.exporters.exposition.http import ExpositionServer

    try:
        return ExpositionServer(registry, host, port, version=time.monotonic_ns,
                                not_ready=lambda: None)
    except OSError as e:
        raise ProxyError(f"--metrics-listen {metrics_listen}: {e.strerror or e}") from None


async def _serve(proxy: Proxy, listen: str, drain_timeout: float,
                 started: Callable[[int], None], reuse_port: bool) -> None:
    """Serve ``listen`` until SIGTERM or SIGINT, then drain; ``started`` once listening."""
    host, port = split_hostport(listen, "--listen")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        bound = await proxy.start(host, port, reuse_port=reuse_port)
    except OSError as e:
        raise ProxyError(f"--listen {listen}: {e.strerror or e}") from None
    started(bound)
    await stop.wait()
    log.info("stopping: %d answers under way, up to %g s to finish", len(proxy._busy),
             drain_timeout)
    await proxy.stop(drain_timeout)


# -- a worker ------------------------------------------------------------------------------------
def _work(listen: str, upstream: str, connect_timeout: float, drain_timeout: float,
          head_timeout: float, max_connections: int, ready_fd: int) -> int:
    """A supervisor's worker: serve ``listen`` with ``SO_REUSEPORT``, its values in the
    multiprocess directory its environment names; write a byte on ``ready_fd`` once listening."""
    from mrc_agent.exporters.instrumentation.multiprocess import (
        mark_process_dead,
        multiprocess_enabled,
    )

    if not multiprocess_enabled():
        raise ProxyError(f"{_WORKER_FLAG} is for the workers that --workers starts")
    up = Upstream.parse(upstream)
    metrics = MRCMetrics(registry=CollectorRegistry(), resolution_unknown=True)
    proxy = Proxy(up, metrics, connect_timeout=connect_timeout, head_timeout=head_timeout,
                  max_connections=max_connections)
    descriptors_for(max_connections, POOL_SIZE)

    def started(bound: int) -> None:
        log.info("worker %d proxying port %d to %s://%s:%d", os.getpid(), bound, up.scheme,
                 up.host, up.port)
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    try:
        run_loop(_serve(proxy, listen, drain_timeout, started, reuse_port=True))
    finally:
        mark_process_dead()
    return 0


# -- the supervisor ------------------------------------------------------------------------------
def _supervise(listen: str, upstream: str, metrics_listen: str, connect_timeout: float,
               drain_timeout: float, head_timeout: float, max_connections: int,
               workers: int) -> int:
    from mrc_agent.exporters.instrumentation.multiprocess import _ENV, prepare_multiproc_dir

    host, port = split_hostport(listen, "--listen")
    m_host, m_port = split_hostport(metrics_listen, "--metrics-listen")
    up = Upstream.parse(upstream)
    reserved = _reserve(host, port, listen)
    bound = int(reserved.getsockname()[1])
    given = os.environ.get(_ENV)
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix="mrc-proxy-metrics-"))
    try:
        prepare_multiproc_dir(path)
        registry = CollectorRegistry()
        registry.register(_Merged(path))
        exposition = _exposition(registry, m_host, m_port, metrics_listen)
        addr = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        argv = [sys.executable, "-m", "mrc_agent.agent", "proxy", "--listen", addr,
                "--upstream", upstream, "--metrics-listen", metrics_listen,
                "--connect-timeout", repr(connect_timeout), "--drain-timeout",
                repr(drain_timeout), "--head-timeout", repr(head_timeout),
                "--max-connections", str(max_connections), "--log-level",
                logging.getLevelName(logging.getLogger().level).lower()]
        env = {**os.environ, _ENV: str(path)}
        log.info("proxying %s:%d to %s://%s:%d with %d workers; metrics on %s:%d", host, bound,
                 up.scheme, up.host, up.port, workers, m_host, exposition.port)
        exposition.start()
        try:
            return run_loop(_Workers(argv, env, path, drain_timeout).run(workers))
        finally:
            exposition.stop()
    finally:
        reserved.close()
        if not given:
            shutil.rmtree(path, ignore_errors=True)


def _reserve(host: str, port: int, listen: str) -> socket.socket:
    """``host:port`` bound with ``SO_REUSEPORT`` and not listening: the port for the workers."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ProxyError(f"--listen {listen}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ProxyError(f"--listen {listen}: {e.strerror or e}") from None
    return sock


class _Merged(Collector):
    """The workers' values, merged by prometheus-client's ``MultiProcessCollector``, with every
    family of :class:`MRCMetrics` in the exposition once, as with one process: a family no worker
    has written yet (``mrc_model_info`` before any model is seen) is shown empty."""

    def __init__(self, path: Path) -> None:
        self._path = str(path)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.multiprocess import MultiProcessCollector

        from mrc_agent.exporters.instrumentation.families import FAMILIES
        from mrc_agent.exporters.instrumentation.stores import empty_family

        merged = {m.name: m for m in MultiProcessCollector(None, self._path).collect()}
        for f in FAMILIES:
            name = f.name.removesuffix("_total") if f.kind == "counter" else f.name
            found = merged.pop(name, None)
            yield found if found is not None else empty_family(f)
        yield from merged.values()


class _Workers:
    """The worker processes: started, watched, restarted, stopped."""

    def __init__(self, argv: list[str], env: dict[str, str], path: Path,
                 drain_timeout: float) -> None:
        self._argv, self._env, self._path = argv, env, path
        self._drain_timeout = drain_timeout
        self._procs: dict[asyncio.Task[int], asyncio.subprocess.Process] = {}
        self._signal: signal.Signals | None = None
        self._stop = asyncio.Event()

    async def run(self, count: int) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping, sig)
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            started = await asyncio.gather(*(self._start() for _ in range(count)))
            if not all(started):
                return await self._give_up()
            while True:
                done, _ = await asyncio.wait({*self._procs, stopping},
                                             return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:
                    return await self._shutdown()
                for task in [t for t in self._procs if t in done]:
                    proc = self._procs.pop(task)
                    log.warning("worker %d exited unexpectedly (%s); starting another",
                                proc.pid, _status(task.result()))
                    self._dead(proc.pid)
                    if not await self._start():
                        return await self._give_up()
        finally:
            stopping.cancel()
            for proc in self._procs.values():  # only on an error of the supervisor's own
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            for task, proc in list(self._procs.items()):
                await task
                self._dead(proc.pid)

    def _stopping(self, sig: signal.Signals) -> None:
        self._signal = self._signal or sig
        self._stop.set()

    async def _start(self) -> bool:
        """Start a worker and wait until it listens (True), or dies or a signal comes first
        (False: the worker, if still running, is stopped and reaped)."""
        r, w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv, _WORKER_FLAG, str(w), env=self._env, pass_fds=(w,))
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        waiting = asyncio.ensure_future(proc.wait())
        self._procs[waiting] = proc
        ready = asyncio.ensure_future(_read_ready(r))
        stopping = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait({ready, stopping}, timeout=_START_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if ready in done and ready.result():
            log.info("worker %d ready", proc.pid)
            return True
        ready.cancel()
        if not self._stop.is_set():
            log.error("worker %d did not become ready (%s)", proc.pid,
                      "timed out" if not done else _status(await waiting))
        return False

    async def _give_up(self) -> int:
        """A start did not end ready. After a signal: stop as usual. Otherwise the worker died
        or hung as it started: stop the others and exit non-zero (another start would most
        likely fail the same way)."""
        code = await self._shutdown()
        return code if self._stop.is_set() else 1

    async def _shutdown(self) -> int:
        sig = self._signal or signal.SIGTERM
        log.info("%s: stopping %d workers", sig.name, len(self._procs))
        for proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        if self._procs:
            _, late = await asyncio.wait(set(self._procs),
                                         timeout=self._drain_timeout + _EXIT_GRACE_S)
            for task in late:
                log.warning("worker %d still running; killing it", self._procs[task].pid)
                with contextlib.suppress(ProcessLookupError):
                    self._procs[task].kill()
        for task, proc in list(self._procs.items()):
            code = await task
            if code != 0:
                log.warning("worker %d exited %s", proc.pid, _status(code))
            self._dead(proc.pid)
            del self._procs[task]
        return 0

    def _dead(self, pid: int) -> None:
        # prometheus-client was imported in this process before the directory was chosen, so it
        # is not in multiprocess mode here: name the directory instead of relying on the
        # environment as the project's mark_process_dead does.
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, str(self._path))


async def _read_ready(fd: int) -> bool:
    """True once the worker wrote its byte on the pipe ``fd``; False when it closed it first."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    try:
        return await reader.read(1) == b"1"
    finally:
        transport.close()


def _status(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import PROXY, PROXY_FLAGS

    PROXY_FLAGS.add_flags(parser, PROXY)
    parser.add_argument(_WORKER_FLAG, type=int, default=None, dest="worker_ready_fd",
                        help=argparse.SUPPRESS)


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
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers} must be at least 1")
    try:
        if args.worker_ready_fd is not None:
            return _work(args.listen, args.upstream, args.connect_timeout, args.drain_timeout,
                         args.head_timeout, args.max_connections, args.worker_ready_fd)
        return run_proxy(args.listen, args.upstream, args.metrics_listen,
                         args.connect_timeout, args.drain_timeout, args.head_timeout,
                         args.max_connections, args.workers)
    except ProxyError as exc:
        raise ConfigError(str(exc)) from exc
