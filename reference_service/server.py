"""How the reference service meets the network: its uvicorn configuration, built here once for
the single-process and the ``--workers`` paths, and an h11 protocol that bounds how long a
connection may take to say what it wants.

uvicorn, left to itself, times out one thing: a keep-alive connection idle between two
requests, and any byte resets that timer. A fresh connection that never sends a request head,
or sends it a byte at a time (slowloris), or a request whose body stops arriving, is held for
ever: 1,500 of them were 1,500 file descriptors and event-loop entries until the clients chose
to leave. :class:`ServiceH11Protocol` adds the two deadlines uvicorn lacks, and a pace:

* **header timeout** — the request head (request line and headers) must be complete within
  ``http_header_timeout_s`` of the connection opening, or of the previous response on a
  keep-alive connection. Only a complete head stops this clock, so dripping bytes does not
  help. The connection is then closed without an answer (there is no request to answer).
* **body timeout** — while a request body arrives, at most ``http_body_timeout_s`` may pass
  between two chunks. Past that the client gets 408 with the service's JSON error and
  ``Connection: close`` (or only the close, when its response has already begun). Time the
  service itself stops reading — uvicorn's flow control pauses the socket while the
  application has not taken the last 64 KiB — or the client waits for ``100 Continue`` does not
  count: the wait is then the service's, not the client's.

* **pacing** — each connection has a budget of ``http_pace_rate`` requests a second and
  ``http_pace_burst`` at once (:class:`mrc_agent.exporters.pacing.TokenBucket`). When a response
  completes with the budget spent, the next request is not taken until it allows: the socket is not
  read meanwhile (uvicorn's own flow control; h11 stays paused between two cycles, so not even a
  pipelined request already received is started), TCP holds the client back, and it costs one timer,
  never an error. The header timeout and uvicorn's keep-alive timer start when the wait ends. Per
  connection, not per address: behind an ingress or load balancer many users share one peer address,
  but each upstream connection carries one request at a time. So pacing bounds what one connection
  costs, not a client that opens many (the connection cap bounds those) nor one with many addresses.

The connection cap is uvicorn's ``limit_concurrency``, per process: from ``max_connections``
open connections (or running requests) on, a new request gets 503 and ``Connection: close``.
With the two deadlines, a connection that says nothing useful frees its place within seconds,
so the cap holds off a flood without starving real clients for long.

Why a subclass of uvicorn's h11 protocol rather than ASGI middleware: an ASGI application sees
nothing before the head is complete, and cannot tell a stalled client from a paused socket.
The subclass hooks four methods of ``H11Protocol`` (``connection_made``, ``handle_events``,
``on_response_complete``, ``connection_lost``) and leaves the rest of uvicorn's code alone;
``tests/integration/test_service_connections.py`` drives it through real sockets, so an
uvicorn upgrade that moves those hooks fails there. ``http="h11"`` is forced (the class *is*
the h11 protocol): httptools, when installed, would otherwise be chosen and none of this
would apply.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mrc_agent.exporters.pacing import TokenBucket
from mrc_agent.reference_service.errors import error_json
from mrc_agent.reference_service.settings import Settings

log = logging.getLogger(__name__)

#: The largest request head accepted (h11's own default, written here so the bound is
#: visible): a head is a few hundred bytes; past this uvicorn answers 400.
MAX_HEAD_BYTES = 16 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """The deadlines :class:`ServiceH11Protocol` enforces, in seconds, and its pace (requests
    a second, and at once, per connection)."""

    header_timeout_s: float
    body_timeout_s: float
    pace_rate: float
    pace_burst: int


class ServiceH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout, a body timeout and a pace (see the
    module)."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._pace_timer: asyncio.TimerHandle | None = None
        self._budget = TokenBucket(limits.pace_rate, limits.pace_burst)

    # --- uvicorn's hooks ---

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._budget.reserve()  # the first request's token (a fresh bucket: no wait)
        self._arm_head_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            # Closed (a malformed request got its 400), or handed over (a WebSocket upgrade).
            self._cancel_timers()
            return
        if self.cycle is not cycle:  # a complete request head arrived
            self._cancel(self._head_timer)
            self._head_timer = None
        self._watch_body()

    def on_response_complete(self) -> None:
        # uvicorn's cycle.send calls this last, once the response is written. Until the
        # original runs, h11 is not restarted for the next cycle: a request already received
        # waits (handle_events sees PAUSED), and reading stays paused below.
        pause = self._budget.reserve() if not self.transport.is_closing() else 0.0
        if not pause:
            self._next_request()
            return
        self.flow.pause_reading()  # also a body the application never read: it waits too
        self._pace_timer = self.loop.call_later(pause, self._paced, self.cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    # --- the pace ---

    def _paced(self, cycle: Any) -> None:
        self._pace_timer = None
        if self.transport.is_closing() or self.cycle is not cycle:
            return  # closed meanwhile (connection_lost ran), or uvicorn moved on by itself
        self._next_request()

    def _next_request(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        # Waiting for the next request head, unless uvicorn just took a pipelined one.
        if not self.transport.is_closing() and self.cycle is cycle:
            self._arm_head_timer()

    # --- the deadlines ---

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    def _cancel_timers(self) -> None:
        self._cancel(self._head_timer)
        self._cancel(self._body_timer)
        self._cancel(self._pace_timer)
        self._head_timer = self._body_timer = self._pace_timer = None

    def _arm_head_timer(self) -> None:
        self._cancel(self._head_timer)
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        # As many as a flood opens: DEBUG, like uvicorn's own keep-alive closes (silent).
        log.debug("%s: no complete request head within %g s: closed", self._peer(),
                  self.limits.header_timeout_s)
        self.transport.close()

    def _watch_body(self) -> None:
        """(Re)start the body clock while a body is due, stop it once it is complete."""
        self._cancel(self._body_timer)
        self._body_timer = None
        if self.conn.their_state is h11.SEND_BODY:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s,
                                                    self._body_stalled)

    def _body_stalled(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.flow.read_paused or self.conn.they_are_waiting_for_100_continue:
            self._watch_body()  # the service is the one not reading: not the client's stall
            return
        cycle = self.cycle
        answered = cycle is None or cycle.response_started
        log.info("%s: request body stalled for more than %g s: %s", self._peer(),
                 self.limits.body_timeout_s, "closed" if answered else "408, closed")
        if cycle is not None and not cycle.response_complete:
            # The application's receive() now says http.disconnect and its send() is dropped,
            # so nothing it does can interleave with the 408 below.
            cycle.disconnected = True
            cycle.message_event.set()
        if not answered:
            try:
                self.transport.write(self._timeout_response())
            except h11.LocalProtocolError as exc:  # h11 says no answer fits now: close only
                log.debug("%s: no 408 sent: %s", self._peer(), exc)
        self.transport.close()

    def _timeout_response(self) -> bytes:
        path = str(self.cycle.scope.get("path", "")) if self.cycle is not None else ""
        body = json.dumps(error_json(
            path, 408, "request_timeout", f"the request body stalled for more than "
            f"{self.limits.body_timeout_s:g} s")).encode()
        headers = [*self.server_state.default_headers,
                   (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        return b"".join([
            self.conn.send(h11.Response(status_code=408, headers=headers,
                                        reason=b"Request Timeout")),
            self.conn.send(h11.Data(data=body)),
            self.conn.send(h11.EndOfMessage()),
        ])


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The connection-handling arguments of ``uvicorn.run`` for these settings.

    The protocol travels as a ``functools.partial`` of the class with its limits: uvicorn calls
    it like the class, and it pickles by reference, so ``--workers`` processes (started with
    multiprocessing's spawn) get the same limits.
    """
    limits = ConnectionLimits(header_timeout_s=settings.http_header_timeout_s,
                              body_timeout_s=settings.http_body_timeout_s,
                              pace_rate=settings.http_pace_rate,
                              pace_burst=settings.http_pace_burst)
    return {
        "http": functools.partial(ServiceH11Protocol, limits=limits),
        # uvicorn annotates int seconds; it only hands the value to loop.call_later.
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "limit_concurrency": settings.max_connections,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }


def _ensure_fd_headroom(max_connections: int) -> None:
    """Raise the soft open-file limit so that the cap, not EMFILE, is what a flood meets."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    need = max_connections + 256  # model files, the decode pool, logs, the listening socket
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:  # a sandbox that forbids it: say so, carry on
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
        target = soft
    if target < need:
        log.warning("--max-connections %d: the open-file limit is %d, so connections may be "
                    "refused (EMFILE) before the cap is reached", max_connections, target)


def run(app: Any, settings: Settings, *, host: str, port: int, log_level: str,
        workers: int | None = None, factory: bool = False) -> None:
    """Serve ``app`` (an ASGI app, or an import string with ``factory`` or ``workers``)."""
    _ensure_fd_headroom(settings.max_connections)
    import uvicorn

    uvicorn.run(app, host=host, port=port, workers=workers, factory=factory,
                log_level=log_level, access_log=False, **uvicorn_options(settings))
