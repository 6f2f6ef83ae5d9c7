"""Pacing: a client that sends requests faster than any real client of a server is slowed down
by not reading its next request until its budget allows, never refused.

A request that is valid and cheap still costs a parse and an answer; sent back to back by the
thousand a second it costs a core, and the clients beside it wait. Refusing it (429, 503)
would cost as much as answering it, so here the server simply does not read the next request
yet: the bytes wait in the socket, TCP's flow control holds the client back, and the wait
costs the server one timer. A legitimate burst within ``burst`` requests is untouched, and
nobody ever gets an error for sending fast.

:class:`TokenBucket` is the budget: ``rate`` requests a second sustained, ``burst`` at once.
A request *reserves* its token: when the bucket is empty it goes into debt and the request
waits until the debt is paid, so several connections sharing one bucket are served in the
order they asked, each waking once, and a client cannot escape a debt by closing and
reconnecting. :class:`AddressBudgets` keeps one bucket per key (the agent: a client address)
with bounded memory. The clock is injected (``time.monotonic`` by default) so that both are
tested without waiting.

Used by the agent's exposition server (a budget per client address) and by the reference
service's h11 protocol (a budget per connection): this module imports nothing of either.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved; starts full."""

    def __init__(self, rate: float, burst: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not burst >= 1:
            raise ValueError(f"pacing needs a rate above 0 and a burst of at least 1 "
                             f"(got {rate:g}, {burst:g})")
        self.rate, self.burst = float(rate), float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._stamp = clock()

    def tokens(self) -> float:
        """Tokens saved now; below 0 while requests wait for tokens they reserved."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        return self._tokens

    def full(self) -> bool:
        """Whether nothing has been spent that the rate has not given back."""
        return self.tokens() >= self.burst

    def reserve(self, cost: float = 1.0) -> float:
        """Spend ``cost`` tokens now, going into debt when there are too few; the seconds the
        caller must wait before it acts on them (0 when the tokens were there)."""
        left = self.tokens() - cost
        self._tokens = left
        return 0.0 if left >= 0 else -left / self.rate


class AddressBudgets:
    """One :class:`TokenBucket` per key, for as long as a connection from that key is open or
    its bucket is not full again; at most about ``max_keys`` of them.

    A key whose last connection closes with a full bucket is forgotten at once. One in debt is
    kept, or a client could close and reconnect for a fresh budget; when ``max_keys`` is
    reached, buckets of keys without a connection are dropped, full ones first and then the
    fullest, down to three quarters of ``max_keys`` (so a full table costs one sort per
    quarter of it, not one per connection). Keys with connections are never dropped: their
    number is bounded by the server's connection cap.
    """

    def __init__(self, rate: float, burst: float, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        TokenBucket(rate, burst, clock)  # the same checks, at construction
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._open: dict[str, int] = {}  # key -> connections open

    def __len__(self) -> int:
        """Keys remembered now."""
        return len(self._buckets)

    def opened(self, key: str) -> TokenBucket:
        """A connection from ``key`` opened: its bucket, shared with the key's others."""
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._prune()
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, self._clock)
        self._open[key] = self._open.get(key, 0) + 1
        return bucket

    def connections(self, key: str) -> int:
        """Connections from ``key`` open now."""
        return self._open.get(key, 0)

    def closed(self, key: str) -> None:
        """A connection from ``key`` closed."""
        left = self._open.get(key, 0) - 1
        if left > 0:
            self._open[key] = left
            return
        self._open.pop(key, None)
        bucket = self._buckets.get(key)
        if bucket is not None and bucket.full():
            del self._buckets[key]

    def _prune(self) -> None:
        idle = sorted((k for k in self._buckets if k not in self._open),
                      key=lambda k: -self._buckets[k].tokens())
        excess = len(self._buckets) - self.max_keys * 3 // 4
        for key in idle:
            if excess <= 0 and not self._buckets[key].full():
                break
            del self._buckets[key]
            excess -= 1
