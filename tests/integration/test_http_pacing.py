"""The agent's exposition server paces each client address: a client that loops on cheap
requests is answered no faster than its budget allows — the server stops reading, it never
refuses — a client that reconnects keeps its budget, another address keeps its own, and a 503
from the full credential-check queue costs twice. Real sockets on loopback (127.0.0.2 and
127.0.0.3 are two client addresses), a small rate so that nothing waits long.

Assertions count answers within a window, never how fast one came: a busy machine only
answers fewer, and the bounds are the budget's most plus slack.
"""

from __future__ import annotations

import socket
import time

from mrc_agent.exporters.exposition.http import Authenticator, Limits
from tests.conftest import received_until, response_statuses, wait_until
from tests.integration.test_hostile_http import GatedAuth, Reader, _ask, _connect, _serve

RATE, BURST = 10.0, 5
PACED = Limits(max_connections=16, idle_timeout_s=10.0, head_timeout_s=10.0,
               pace_rate=RATE, pace_burst=BURST)
WINDOW_S = 1.0
#: The most answers a paced address can get within WINDOW_S: its burst, the rate over the
#: window, one for the reservation at the window's edge, and slack.
MOST = BURST + RATE * WINDOW_S + 1 + 3
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"




def test_a_client_looping_on_requests_is_paced_never_refused_and_others_are_not() -> None:
    srv = _serve(limits=PACED)
    try:
        start = time.monotonic()
        with _connect(srv.port, "127.0.0.2") as s:
            s.sendall(HEALTHZ * 30)  # back to back, as a flood sends them
            early = received_until(s, start + WINDOW_S)
            assert BURST <= len(response_statuses(early)) <= MOST, early  # without pacing: 30
            # Another address has a budget of its own: its burst is answered whole.
            with _connect(srv.port, "127.0.0.3") as other:
                other.sendall(HEALTHZ * BURST)
                reader = Reader(other)
                assert [reader.response()[0] for _ in range(BURST)] == [200] * BURST
            # Every request of the paced client is answered in the end, none refused.
            got = early
            deadline = time.monotonic() + 30
            while len(response_statuses(got)) < 30 and time.monotonic() < deadline:
                got += received_until(s, min(deadline, time.monotonic() + 1))
            assert response_statuses(got) == [200] * 30
    finally:
        srv.stop()


def test_a_client_that_reconnects_does_not_get_a_fresh_budget() -> None:
    srv = _serve(limits=PACED)
    try:
        start = time.monotonic()
        answered = 0
        while answered < 30 and time.monotonic() < start + WINDOW_S:
            with _connect(srv.port, "127.0.0.2") as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if response_statuses(received_until(s, start + WINDOW_S)) != [200]:
                    break  # still waiting for its turn when the window closed
                answered += 1
        assert answered <= MOST  # without pacing by address: 30
    finally:
        srv.stop()


def test_a_503_from_the_full_check_queue_costs_twice() -> None:
    """One check held running fills 127.0.0.2's queue; then every request from it with an
    unchecked credential is a cheap 503, as a flood loops on them."""
    auth = GatedAuth()
    burst, rate = 10, 2.0
    limits = Limits(max_checks_per_peer=1, head_timeout_s=10.0, idle_timeout_s=10.0,
                    pace_rate=rate, pace_burst=burst)
    srv = _serve(limits=limits, auth=auth)
    held = _ask(srv.port, "Basic held", source="127.0.0.2")
    try:
        wait_until(lambda: srv.credential_checks == 1)
        with _connect(srv.port, "127.0.0.2") as s:
            start = time.monotonic()
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic again\r\n\r\n"
                      * 20)
            statuses = response_statuses(received_until(s, start + WINDOW_S))
        assert statuses and set(statuses) == {503}, statuses
        # Two tokens each: at most (burst + rate * window) / 2 and the one at the edge; at one
        # token each it would be about 13, without pacing 20.
        assert len(statuses) <= (burst + rate * WINDOW_S) / 2 + 2, statuses
    finally:
        auth.gate.release()
        held.close()
        srv.stop()


def test_a_connection_evicted_while_it_waits_for_its_budget_ends_at_once() -> None:
    """A connection whose address owes 20 s of budget waits unread; when the cap closes it,
    its handler ends then and there. Before, it slept out its debt holding a task and a
    transport: 114,000 slow heads in 20 s left as many sleeping handlers, and the scrapes
    beside them waited up to 0.7 s on the garbage collector."""
    limits = Limits(max_connections=4, head_timeout_s=30.0, idle_timeout_s=30.0,
                    pace_rate=0.05, pace_burst=1)
    srv = _serve(limits=limits)
    held: list[socket.socket] = []
    try:
        with _connect(srv.port, "127.0.0.2") as first:
            first.sendall(HEALTHZ)  # the address's one token
            assert Reader(first).response()[0] == 200
        wait_until(lambda: srv.connections == 0)
        waiting = _connect(srv.port, "127.0.0.2")
        waiting.sendall(HEALTHZ)  # 20 s of debt: it waits, unread
        wait_until(lambda: srv.handlers == 1)
        for _ in range(limits.max_connections):  # idle ones from elsewhere; the last evicts
            held.append(_connect(srv.port, "127.0.0.3"))
            time.sleep(0.05)
        assert response_statuses(received_until(waiting, time.monotonic() + 3)) == []
        wait_until(lambda: srv.handlers == limits.max_connections, timeout=5)
        waiting.close()
    finally:
        for s in held:
            s.close()
        srv.stop()


class _Refuses(Authenticator):
    """Every credential is checked, and none passes."""

    def cached(self, authorization: str | None) -> bool | None:
        return False if authorization is None else None

    def check(self, authorization: str | None) -> bool:
        return False


def test_a_wrong_password_costs_its_address_more_than_a_request() -> None:
    """A flood of wrong passwords from one address kept the credential-check thread (a core,
    at bcrypt cost 12) busy without pause; each wrong password now costs its address
    failed_login_cost tokens. A request without credentials costs one, as any request."""
    limits = Limits(head_timeout_s=10.0, idle_timeout_s=10.0, pace_rate=5.0, pace_burst=5,
                    failed_login_cost=5.0)
    srv = _serve(limits=limits, auth=_Refuses())
    wrong = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic d3Jvbmc6cGFzcw==\r\n\r\n"
    try:
        with _connect(srv.port, "127.0.0.2") as s:
            start = time.monotonic()
            s.sendall(wrong * 6)
            statuses = response_statuses(received_until(s, start + WINDOW_S))
        # 1 + 5 tokens for the first, and the second waits for its debt: 2 or 3 in the window
        # (without the cost, 6: the burst and one more at 0.2 s).
        assert statuses and set(statuses) == {401} and len(statuses) <= 3, statuses
        with _connect(srv.port, "127.0.0.3") as s:
            start = time.monotonic()
            s.sendall(HEALTHZ * 5)
            assert response_statuses(received_until(s, start + 2 * WINDOW_S)) == [401] * 5
    finally:
        srv.stop()
