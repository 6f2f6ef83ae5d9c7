"""What one client of the agent's exposition server may cost: the connection policy's limits
and timeouts, each with why it is what it is. :class:`~mrc_agent.exporters.exposition.http.
ExpositionServer` enforces them; tests build smaller ones."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one client may cost, and why these values.

    ``max_connections`` 256: Prometheus holds one kept-alive connection per scraper and a handful of
    people and tools a few more; each open connection costs a few kilobytes. ``idle_timeout_s`` 120:
    longer than any sane scrape interval (Prometheus reuses the connection between scrapes), short
    enough that abandoned connections go. ``head_timeout_s`` 10 and ``max_head_bytes`` 16 KiB: a
    request line and headers arrive at once from real clients; a slow-loris client is cut.
    ``body_timeout_s`` 10: a webhook body of at most 1 MiB arrives in well under a second.
    ``write_timeout_s`` 10: a client that does not read its answer is dropped.
    ``linger_s``/``linger_bytes``: how long, and how much, of an unread request body is drained
    after an early error answer. ``max_skipped_body_bytes`` 64 KiB: a body sent with a GET or DELETE
    means nothing here; one that small is read and dropped (some clients send ``Content-Length`` on
    everything), a bigger one is refused rather than read. ``max_checks_per_peer`` 4 and
    ``max_checks`` 16: credential checks waiting or running, per client address and in all (see
    :mod:`mrc_agent.exporters.exposition.checks`). Four lets a scraper and a few people behind one
    address log in at once; sixteen keeps the last in line within ~4 s at cost 12 (~0.24 s a check),
    under Prometheus's 10 s scrape timeout, even when sixteen addresses flood at once. Past either:
    503 at once. ``pace_rate`` 20/s and ``pace_burst`` 40, per client address
    (:mod:`mrc_agent.exporters.pacing`): once a request line arrives, the rest of the request waits
    until the address's budget allows it (unread; the connection idle and evictable meanwhile).
    Prometheus asks each target once per scrape interval (15 s or more; 1 s at the most eager),
    people and tools a few times a second; a dashboard opening 40 requests at once passes untouched.
    A client looping on cheap requests (a 16 KiB head, a 503) is held to 20 a second instead of
    thousands. ``max_paced_addresses`` 1024: addresses remembered without an open connection (a
    bucket still in debt), a few hundred bytes each. ``failed_login_cost`` 40: a wrong password
    costs its address two seconds of that budget, so a person who mistypes waits two seconds and a
    password flood gets one bcrypt check every two seconds per address (a check at cost 12 is a
    quarter of a second of a core: 48 connections of one address had kept the check thread, one
    core, busy without pause).
    """

    max_connections: int = 256
    idle_timeout_s: float = 120.0
    head_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    write_timeout_s: float = 10.0
    max_head_bytes: int = 16 * 1024
    max_headers: int = 100
    linger_s: float = 2.0
    linger_bytes: int = 16 << 20
    max_skipped_body_bytes: int = 64 * 1024
    max_checks_per_peer: int = 4
    max_checks: int = 16
    pace_rate: float = 20.0
    pace_burst: int = 40
    max_paced_addresses: int = 1024
    failed_login_cost: float = 40.0
