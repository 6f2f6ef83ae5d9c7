"""The request budget both servers pace with (``exporters/pacing.py``), on a clock the test
moves: a token bucket that goes into debt rather than refusing, and the per-address table of
them whose memory stays bounded whatever addresses come and go."""

from __future__ import annotations

import pytest

from mrc_agent.exporters.pacing import AddressBudgets, TokenBucket
from tests.support import Clock


def test_a_burst_passes_then_each_request_waits_its_turn() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=5, burst=3, clock=clock)
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    # In debt: the 4th may go in 0.2 s, the 5th in 0.4 s (each waits for its own token).
    assert bucket.reserve() == pytest.approx(0.2)
    assert bucket.reserve() == pytest.approx(0.4)
    clock.now += 0.4
    assert bucket.tokens() == pytest.approx(0.0)
    assert bucket.reserve() == pytest.approx(0.2)


def test_the_bucket_refills_at_the_rate_and_never_past_the_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=10, burst=4, clock=clock)
    for _ in range(4):
        bucket.reserve()
    assert not bucket.full()
    clock.now += 0.25
    assert bucket.tokens() == pytest.approx(2.5)
    clock.now += 60
    assert bucket.full() and bucket.tokens() == 4
    assert [bucket.reserve() for _ in range(4)] == [0.0] * 4  # an hour idle saves 4, not 600


def test_a_reservation_may_cost_more_than_one() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2, burst=2, clock=clock)
    assert bucket.reserve(2) == 0.0
    assert bucket.reserve(2) == pytest.approx(1.0)


@pytest.mark.parametrize(("rate", "burst"), [(0, 5), (-1, 5), (float("nan"), 5), (5, 0.5)])
def test_a_bucket_that_could_never_pass_a_request_is_refused(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match="pacing"):
        TokenBucket(rate, burst)


def _spent(budgets: AddressBudgets, address: str, requests: int) -> TokenBucket:
    """``address``'s bucket once it opened and passed ``requests`` requests, one at a time as
    a client sends them."""
    bucket = budgets.opened(address)
    for _ in range(requests):
        bucket.reserve()
    return bucket


def test_an_address_that_reconnects_keeps_its_debt() -> None:
    budgets = AddressBudgets(rate=1, burst=2, max_keys=8, clock=Clock())
    bucket = _spent(budgets, "203.0.113.1", 5)
    budgets.closed("203.0.113.1")
    again = budgets.opened("203.0.113.1")
    assert again is bucket and again.reserve() == pytest.approx(4.0)
    # Two connections of one address share one budget.
    assert budgets.opened("203.0.113.1") is bucket
    assert budgets.opened("203.0.113.2") is not bucket


def test_an_address_is_forgotten_once_closed_with_a_full_bucket() -> None:
    clock = Clock()
    budgets = AddressBudgets(rate=1, burst=2, max_keys=8, clock=clock)
    budgets.opened("a").reserve()
    budgets.opened("a")
    budgets.closed("a")
    assert len(budgets) == 1  # one connection still open
    clock.now += 5
    budgets.closed("a")
    assert len(budgets) == 0
    budgets.opened("b").reserve()
    budgets.closed("b")
    assert len(budgets) == 1  # in debt: kept, or a reconnect would be a fresh budget


def test_the_table_stays_bounded_and_drops_the_fullest_idle_addresses_first() -> None:
    budgets = AddressBudgets(rate=1, burst=10, max_keys=8, clock=Clock())
    held = _spent(budgets, "held", 30)
    for i in range(7):  # idle addresses, address i spent i + 1 tokens
        _spent(budgets, f"idle{i}", i + 1)
        budgets.closed(f"idle{i}")
    assert len(budgets) == 8
    budgets.opened("new")
    # Down to 3/4 of the cap before the newcomer: the fullest idle ones went, the deepest in
    # debt stayed, and the address with a connection open stays whatever its debt.
    assert len(budgets) == 7
    assert budgets.opened("held") is held
    assert budgets.opened("idle6").tokens() < 4  # kept its debt: not a fresh bucket
    assert budgets.opened("idle0").full()  # was dropped: a fresh bucket
    for i in range(10_000):  # addresses that come and go never grow it past the cap
        budgets.opened(f"x{i}").reserve()
        budgets.closed(f"x{i}")
    assert len(budgets) <= 8
