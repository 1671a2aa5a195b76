"""docs/reference/behaviour.md §14.3 per-subject DNS query budget: the token buckets, with an injected clock (no sleeps)."""

from __future__ import annotations

import ipaddress

import pytest

from egressd.dnsproxy.budget import QueryBudget, TokenBucket, query_budget

SRC = ipaddress.ip_address("10.0.0.5")


class Clock:
    def __init__(self, now: float = 50.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def admitted(budget: QueryBudget, n: int, uid: str | None = "u-1", source: object = SRC) -> int:
    return sum(budget.admit(uid, source) for _ in range(n))  # type: ignore[arg-type]


def test_default_is_200_per_second_burst_400() -> None:
    clock = Clock()
    budget = query_budget(200)
    assert budget is not None
    budget.clock = clock
    assert admitted(budget, 1000) == 400
    clock.now += 1.0
    assert admitted(budget, 1000) == 200
    clock.now += 10.0  # idle: refills to the burst, never beyond it
    assert admitted(budget, 1000) == 400


def test_refill_is_proportional_to_elapsed_time() -> None:
    clock = Clock()
    budget = QueryBudget(4, clock=clock)  # times below are exact in binary floating point
    assert admitted(budget, 100) == 8
    clock.now += 0.625
    assert admitted(budget, 100) == 2  # 2.5 tokens: two whole queries
    clock.now += 0.125
    assert admitted(budget, 100) == 1  # the half token left over plus 0.5


def test_subjects_and_sources_have_their_own_buckets() -> None:
    clock = Clock()
    budget = QueryBudget(5, clock=clock)
    assert admitted(budget, 100, "u-1") == 10
    assert admitted(budget, 100, "u-2") == 10
    # A subject keeps its bucket when it asks from another address (rebound, IPv6).
    assert admitted(budget, 100, "u-1", ipaddress.ip_address("fd00::5")) == 0
    # An unknown source is keyed by address, apart from the subject that used to have it.
    assert admitted(budget, 100, None, SRC) == 10
    assert admitted(budget, 100, None, ipaddress.ip_address("10.0.0.6")) == 10


def test_a_clock_stepping_back_mints_no_tokens() -> None:
    clock = Clock(100.0)
    budget = QueryBudget(5, clock=clock)
    assert admitted(budget, 100) == 10
    clock.now = 40.0
    assert admitted(budget, 100) == 0
    clock.now = 100.2  # forward again from the latest stamp: 0.2 s -> 1 token
    assert admitted(budget, 100) == 1


def test_cycling_source_addresses_neither_grows_memory_nor_buys_fresh_bursts() -> None:
    clock = Clock()
    budget = QueryBudget(5, clock=clock, max_sources=64)
    total = 0
    for i in range(2_000):
        total += admitted(budget, 20, None, ipaddress.ip_address(f"10.1.{i >> 8}.{i & 255}"))
    assert budget.tracked() <= 64
    # 64 tracked addresses got their burst of 10; every later address shared one overflow bucket.
    assert total == 64 * 10 + 10


def test_full_map_evicts_a_refilled_entry_instead_of_overflowing() -> None:
    clock = Clock()
    budget = QueryBudget(5, clock=clock, max_sources=2)
    a, b, c = (ipaddress.ip_address(f"10.0.0.{i}") for i in (1, 2, 3))
    budget.admit(None, a)
    budget.admit(None, b)
    clock.now += 2.0  # both refilled to the burst: forgetting one changes nothing
    assert admitted(budget, 100, None, c) == 10
    assert budget.tracked() == 2
    assert str(a) not in budget.sources.buckets


def test_subject_map_is_bounded_too() -> None:
    budget = QueryBudget(1, clock=Clock(), max_subjects=8)
    for i in range(1000):
        budget.admit(f"u-{i}", SRC)
    assert budget.tracked() <= 8


def test_zero_means_no_budget_and_bad_values_are_refused() -> None:
    assert query_budget(0) is None
    with pytest.raises(ValueError):
        QueryBudget(0)
    with pytest.raises(ValueError):
        QueryBudget(1, burst=0.5)


def test_bucket_take() -> None:
    bucket = TokenBucket(1.0, 0.0)
    assert bucket.take(0.0, 1.0, 1.0)
    assert not bucket.take(0.5, 1.0, 1.0)
    assert bucket.take(1.0, 1.0, 1.0)
