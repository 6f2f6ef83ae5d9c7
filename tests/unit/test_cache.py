"""The context-aware answer cache: keys that tell questions apart, a log prefix that is always
valid UTF-8, and an LRU bounded by entries, bytes and time."""

from __future__ import annotations

import threading

import pytest

from mrc_agent.reference_service.cache import AnswerCache, CacheKey, make_key, prompt_prefix
from tests.support import Clock as FakeClock

IMG = b"\xff\xd8\xff" + bytes(range(256)) * 10
GEN = {"max_new_tokens": 64, "do_sample": False}


def key(prompt: str = "What is damaged?", image: bytes = IMG, model: str = "m",
        revision: str | None = "r1", gen: dict[str, object] | None = None) -> CacheKey:
    return make_key(image, prompt, model, revision, GEN if gen is None else gen)


# ---------------------------------------------------------------------------------------- keys


def test_same_request_same_key() -> None:
    assert key() == key()
    assert key(gen={"do_sample": False, "max_new_tokens": 64}) == key()  # key order is canonical


def test_same_image_different_question_is_a_different_key() -> None:
    assert key("Is the box damaged?").digest != key("What colour is the box?").digest


def test_prompts_sharing_the_first_32_chars_differ() -> None:
    stem = "Please look at this parcel photo and tell me "
    assert len(stem) > 32
    a, b = key(stem + "whether it is damaged."), key(stem + "who the sender is.")
    assert a.prefix == b.prefix  # the readable prefix is the same...
    assert a.digest != b.digest  # ...the key is not


@pytest.mark.parametrize("change", [
    {"image": IMG + b"\x00"},
    {"model": "other-model"},
    {"revision": "r2"},
    {"revision": None},
    {"gen": {"max_new_tokens": 65, "do_sample": False}},
    {"gen": {"max_new_tokens": 64, "do_sample": True}},
    {"gen": {"max_new_tokens": 64}},
])
def test_every_ingredient_changes_the_key(change: dict[str, object]) -> None:
    assert key(**change).digest != key().digest  # type: ignore[arg-type]


def test_fields_cannot_run_into_each_other() -> None:
    # Without length prefixes "ab"+"c" and "a"+"bc" would hash the same byte string.
    assert make_key(IMG, "p", "ab", "c", GEN).digest != make_key(IMG, "p", "a", "bc", GEN).digest


def test_lone_surrogates_hash_without_error() -> None:
    k = key("bad \ud800 prompt")
    assert k.digest != key("bad  prompt").digest
    assert "\ufffd" not in k.prefix


# -------------------------------------------------------------------------------------- prefix


@pytest.mark.parametrize("prompt", [
    "这个包裹有没有损坏？请仔细看一下照片里的每一个角落。",  # 3-byte characters
    "📦📦📦📦📦📦📦📦📦📦 is it damaged?",  # 4-byte characters
    "ab📦" * 10,  # 4-byte characters at odd offsets
    "é" * 40,  # 2-byte characters
    "x" * 31 + "📦",  # the cut would land inside the emoji
    "👩‍👩‍👧‍👦 family ZWJ sequence and more text",
    "short",
    "",
])
def test_prefix_is_whole_characters_within_32_bytes(prompt: str) -> None:
    p = prompt_prefix(prompt)
    raw = p.encode("utf-8")  # valid UTF-8: no surrogates to refuse
    assert len(raw) <= 32
    assert "\ufffd" not in p
    assert prompt.startswith(p)
    if len(prompt.encode("utf-8")) > 32:
        # Cut back by less than one character: the next character would not have fitted.
        nxt = prompt[len(p)]
        assert len(raw) + len(nxt.encode("utf-8")) > 32
    else:
        assert p == prompt
    assert key(prompt).prefix == p


def test_prefix_examples() -> None:
    assert prompt_prefix("x" * 31 + "📦yz") == "x" * 31
    assert prompt_prefix("中" * 20) == "中" * 10  # 30 bytes; an 11th would be 33
    assert prompt_prefix("a" * 40) == "a" * 32


# ---------------------------------------------------------------------------------------- store


def test_get_put_hit_miss_and_stats() -> None:
    c: AnswerCache[str] = AnswerCache(max_entries=10, max_bytes=1000, ttl_s=60)
    assert c.get(key()) is None
    assert c.put(key(), "answer", 6)
    assert c.get(key()) == "answer"
    assert c.get(key("other question")) is None
    s = c.stats()
    assert (s.entries, s.bytes, s.hits, s.misses) == (1, 6, 1, 2)


def test_lru_bound_by_entries() -> None:
    c: AnswerCache[int] = AnswerCache(max_entries=3, max_bytes=10**6, ttl_s=60)
    keys = [key(f"q{i}") for i in range(4)]
    for i, k in enumerate(keys[:3]):
        c.put(k, i, 1)
    assert c.get(keys[0]) == 0  # touch: q1 is now least recently used
    c.put(keys[3], 3, 1)
    assert c.get(keys[1]) is None
    assert [c.get(k) for k in (keys[0], keys[2], keys[3])] == [0, 2, 3]
    assert len(c) == 3 and c.stats().evictions == 1


def test_lru_bound_by_bytes() -> None:
    c: AnswerCache[str] = AnswerCache(max_entries=100, max_bytes=100, ttl_s=60)
    c.put(key("a"), "a", 40)
    c.put(key("b"), "b", 40)
    c.put(key("c"), "c", 40)  # 120 > 100: "a" goes
    assert c.get(key("a")) is None
    assert c.stats().bytes == 80
    assert not c.put(key("huge"), "h", 101)  # larger than the whole cache: not stored
    assert c.get(key("b")) == "b" and c.get(key("c")) == "c"
    c.put(key("b"), "b2", 10)  # replacing an entry re-counts its bytes
    assert c.stats().bytes == 50 and c.get(key("b")) == "b2"


def test_ttl_expiry_with_a_fake_clock() -> None:
    clock = FakeClock()
    c: AnswerCache[str] = AnswerCache(max_entries=10, max_bytes=1000, ttl_s=30, clock=clock)
    c.put(key("a"), "A", 1)
    clock.now += 10
    c.put(key("b"), "B", 1)
    clock.now += 19.9
    assert c.get(key("a")) == "A"  # 29.9 s old
    clock.now += 0.1
    assert c.get(key("a")) is None  # 30 s: gone, even though it was just read
    assert c.get(key("b")) == "B"
    clock.now += 20
    assert c.purge_expired() == 1
    s = c.stats()
    assert (s.entries, s.bytes, s.expirations) == (0, 0, 2)


def test_disabled_by_zero_bounds() -> None:
    c: AnswerCache[str] = AnswerCache(max_entries=0, max_bytes=1000, ttl_s=30)
    assert not c.put(key(), "x", 1) and c.get(key()) is None


def test_thread_safety_keeps_bounds() -> None:
    c: AnswerCache[int] = AnswerCache(max_entries=50, max_bytes=500, ttl_s=60)
    keys = [key(f"q{i}") for i in range(200)]

    def work(offset: int) -> None:
        for i in range(2000):
            k = keys[(i * 7 + offset) % len(keys)]
            if c.get(k) is None:
                c.put(k, i, 1 + i % 20)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = c.stats()
    assert s.entries <= 50 and s.bytes <= 500
    assert s.hits + s.misses == 8 * 2000


# ------------------------------------------------------------- boundaries and counters, exactly


def test_the_counters_count_one_by_one() -> None:
    clock = FakeClock()
    c: AnswerCache[str] = AnswerCache(2, 1000, 10.0, clock=clock)
    assert c.get(key("a")) is None and c.get(key("b")) is None
    c.put(key("a"), "A", 10)
    c.put(key("b"), "B", 10)
    assert c.get(key("a")) == "A"
    c.put(key("c"), "C", 10)  # evicts b, the least recently used
    clock.now += 10.0  # exactly the TTL: expired
    assert c.get(key("a")) is None
    s = c.stats()
    assert (s.hits, s.misses, s.evictions, s.expirations) == (1, 3, 1, 1)
    assert (s.entries, s.bytes) == (1, 10)
    c.put(key("d"), "D", 10)
    c.put(key("e"), "E", 10)  # c (expired) makes room: an expiration, not an eviction
    s = c.stats()
    assert (s.evictions, s.expirations) == (1, 2)


def test_ttl_and_size_boundaries() -> None:
    clock = FakeClock()
    c: AnswerCache[str] = AnswerCache(10, 100, 5.0, clock=clock)
    assert c.put(key("exactly"), "x", 100)  # exactly max_bytes fits
    assert not c.put(key("over"), "x", 101)
    assert c.put(key("zero"), "x", 0)  # a zero-byte payload is fine
    assert len(c) == 2 and c.stats().bytes == 100
    clock.now += 4.999
    assert c.get(key("exactly")) == "x"
    assert c.purge_expired() == 0
    clock.now += 0.001  # exactly ttl_s after the put
    assert c.purge_expired() == 2 and len(c) == 0
    with pytest.raises(ValueError, match="size_bytes"):
        c.put(key("negative"), "x", -1)


def test_bounds_are_checked_each() -> None:
    with pytest.raises(ValueError, match="bounds"):
        AnswerCache(-1, 100, 1.0)
    with pytest.raises(ValueError, match="bounds"):
        AnswerCache(10, -1, 1.0)
    off: AnswerCache[str] = AnswerCache(10, 0, 1.0)  # zero bytes: nothing but empty payloads
    assert off.put(key(), "x", 0) and not off.put(key("b"), "x", 1)
    no_lifetime: AnswerCache[str] = AnswerCache(10, 100, 0.0)
    assert not no_lifetime.put(key(), "x", 1)  # no lifetime: never stored
    tiny: AnswerCache[str] = AnswerCache(10, 100, 0.001)
    assert tiny.put(key(), "x", 1)


def test_counters_keep_counting_past_one() -> None:
    clock = FakeClock()
    c: AnswerCache[str] = AnswerCache(1, 1000, 10.0, clock=clock)
    for name in "abc":  # one entry of room: b evicts a, c evicts b
        c.put(key(name), name, 1)
    assert c.stats().evictions == 2
    big: AnswerCache[str] = AnswerCache(10, 1000, 10.0, clock=clock)
    big.put(key("a"), "A", 1)
    big.put(key("b"), "B", 1)
    clock.now += 10.0
    assert big.get(key("a")) is None and big.get(key("b")) is None  # both found expired
    s = big.stats()
    assert (s.expirations, s.misses, s.entries, s.bytes) == (2, 2, 0, 0)


def test_clear_empties_the_store_and_its_byte_count() -> None:
    c: AnswerCache[str] = AnswerCache(10, 100, 60.0)
    c.put(key("a"), "A", 30)
    c.put(key("b"), "B", 30)
    c.clear()
    assert len(c) == 0 and c.stats().bytes == 0 and c.get(key("a")) is None
    assert c.put(key("c"), "C", 100)  # the whole budget is free again
    assert c.stats().bytes == 100


@pytest.mark.parametrize(("prompt", "max_bytes", "want"), [
    ("abcd", 4, "abcd"), ("abcde", 4, "abcd"), ("ééé", 6, "ééé"), ("ééé", 5, "éé"),
    ("ééé", 1, ""), ("é", 1, ""), ("aé", 2, "a"), ("€uro", 3, "€"), ("€uro", 2, ""),
])
def test_prefix_boundaries(prompt: str, max_bytes: int, want: str) -> None:
    assert prompt_prefix(prompt, max_bytes) == want


def test_key_fields_cannot_run_into_each_other() -> None:
    # Length-prefixed fields: moving bytes between model and revision changes the key.
    assert key(model="ab", revision="c") != key(model="a", revision="bc")
    assert key(revision=None) == key(revision="")
    assert key(model="m\ud800") != key(model="m")  # lone surrogates hash, distinctly
    assert len({key(revision="r\ud800"), key(revision="r\udc00"), key(revision="r")}) == 3
    assert key(gen={"t": "é"}) != key(gen={"t": "e"})
    with pytest.raises(ValueError):
        key(gen={"temperature": float("nan")})


def test_the_key_format_is_pinned() -> None:
    """A changed key layout (field framing, JSON form of the parameters, text encoding) turns
    every cached answer into a miss after a deploy and breaks shared caches between versions:
    it must come with a new KEY_VERSION and a new digest here."""
    k = make_key(IMG, "What is damaged? é", "m", "r1",
                 {"max_new_tokens": 64, "do_sample": False, "stop": ["é", "x"]})
    assert k.digest == "6b560e1c916ed53f320a77ff8e525056873ebf7eaa608f1b5afe551f481be241"
    no_revision = make_key(IMG, "What is damaged? é", "m", None,
                           {"max_new_tokens": 64, "do_sample": False, "stop": ["é", "x"]})
    assert no_revision.digest == (
        "f481961541061c87a90cb16ebc7820c8fd75e5fe9c86228488ef469ce965911d")
