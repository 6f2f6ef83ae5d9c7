"""Context-aware answer cache: the same image asked a different question is a different entry.

The key is a SHA-256 over everything that changes the answer — the image bytes, the *whole*
prompt, the model id and revision, and the generation parameters — each hashed or
length-prefixed so no two different inputs can run together into the same byte string. A
readable prompt prefix rides along for logs only and never takes part in lookups: keying on a
prompt prefix (the design's first sketch) would hand one user's answer to another whose question
merely starts the same way.

The store is an LRU bounded by entry count *and* by the bytes of the stored answers, with a TTL,
safe to share between the event loop and worker threads.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

V = TypeVar("V")

#: Bumped when the key layout changes, so old and new keys can never collide.
KEY_VERSION = b"mrc-answer-cache/v1"
PREFIX_BYTES = 32


@dataclass(frozen=True)
class CacheKey:
    """``digest`` identifies the request; ``prefix`` is only for humans reading logs."""

    digest: str
    prefix: str


def prompt_prefix(prompt: str, max_bytes: int = PREFIX_BYTES) -> str:
    """The prompt's first ``max_bytes`` bytes of UTF-8, cut back to a whole code point.

    Never half a character and never U+FFFD: the cut moves back over UTF-8 continuation bytes
    (``0b10xxxxxx``) to the start of the character it would have split. Lone surrogates (which
    JSON can smuggle in as ``\\ud800``) are not UTF-8; they appear backslash-escaped. The result
    is raw text — a log formatter must still escape newlines and delimiters in it.
    """
    raw = prompt.encode("utf-8", "backslashreplace")
    if len(raw) <= max_bytes:
        return raw.decode("utf-8")
    cut = max_bytes
    while cut > 0 and (raw[cut] & 0xC0) == 0x80:
        cut -= 1
    return raw[:cut].decode("utf-8")


def _field(h: Any, data: bytes) -> None:
    # Length-prefixing makes the concatenation unambiguous: ("ab", "c") != ("a", "bc").
    h.update(len(data).to_bytes(8, "big"))
    h.update(data)


def canonical_params(gen_params: Mapping[str, Any]) -> bytes:
    """Generation parameters as canonical JSON: sorted keys, no spaces, NaN refused.

    ``1`` and ``1.0`` stay different keys: a spurious miss is harmless, a wrong hit is not.
    """
    return json.dumps(dict(gen_params), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False).encode("utf-8")


def make_key(image_bytes: bytes, prompt: str, model_id: str, revision: str | None,
             gen_params: Mapping[str, Any]) -> CacheKey:
    """The cache key of one request (see the module docstring for what goes in and why)."""
    h = hashlib.sha256()
    h.update(KEY_VERSION)
    _field(h, hashlib.sha256(image_bytes).digest())
    # surrogatepass: a prompt with lone surrogates still hashes (distinctly) instead of raising.
    _field(h, hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest())
    _field(h, model_id.encode("utf-8", "surrogatepass"))
    _field(h, (revision or "").encode("utf-8", "surrogatepass"))
    _field(h, canonical_params(gen_params))
    return CacheKey(digest=h.hexdigest(), prefix=prompt_prefix(prompt))


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    expirations: int


@dataclass
class _Entry(Generic[V]):
    value: V
    size: int
    expires_at: float


class AnswerCache(Generic[V]):
    """LRU of answers bounded by ``max_entries`` and ``max_bytes``, each entry living ``ttl_s``.

    ``size_bytes`` passed to :meth:`put` is the caller's measure of the stored payload (e.g. the
    UTF-8 length of the answer JSON). An entry larger than ``max_bytes`` is not stored at all.
    ``clock`` is injectable so tests drive time by hand.
    """

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("cache bounds must be >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._data: OrderedDict[str, _Entry[V]] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._expirations = 0

    def _drop(self, digest: str) -> None:
        entry = self._data.pop(digest)
        self._bytes -= entry.size

    def get(self, key: CacheKey) -> V | None:
        """The cached value, or None on a miss or an expired entry (which is then removed)."""
        with self._lock:
            entry = self._data.get(key.digest)
            if entry is None:
                self._misses += 1
                return None
            if self._clock() >= entry.expires_at:
                self._drop(key.digest)
                self._expirations += 1
                self._misses += 1
                return None
            self._data.move_to_end(key.digest)
            self._hits += 1
            return entry.value

    def put(self, key: CacheKey, value: V, size_bytes: int) -> bool:
        """Store ``value``; evicts least recently used entries to fit. False if not stored."""
        if size_bytes < 0:
            raise ValueError("size_bytes must be >= 0")
        with self._lock:
            if key.digest in self._data:
                self._drop(key.digest)
            if size_bytes > self.max_bytes or self.max_entries == 0 or self.ttl_s <= 0:
                return False
            now = self._clock()
            while self._data and (len(self._data) >= self.max_entries
                                  or self._bytes + size_bytes > self.max_bytes):
                digest, entry = next(iter(self._data.items()))
                self._drop(digest)
                if now >= entry.expires_at:
                    self._expirations += 1
                else:
                    self._evictions += 1
            self._data[key.digest] = _Entry(value, size_bytes, now + self.ttl_s)
            self._bytes += size_bytes
            return True

    def purge_expired(self) -> int:
        """Remove every expired entry now (O(n)); returns how many."""
        with self._lock:
            now = self._clock()
            dead = [d for d, e in self._data.items() if now >= e.expires_at]
            for d in dead:
                self._drop(d)
            self._expirations += len(dead)
            return len(dead)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def stats(self) -> CacheStats:
        """Current size and lifetime counters (hits/misses feed the cache metrics)."""
        with self._lock:
            return CacheStats(entries=len(self._data), bytes=self._bytes, hits=self._hits,
                              misses=self._misses, evictions=self._evictions,
                              expirations=self._expirations)
