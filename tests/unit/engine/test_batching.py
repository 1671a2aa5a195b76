"""The group commit of DNS learning: the pure core (egressd.engine.batching, LeaseBook.admit_many)
and its asyncio shell (egressd.engine.groupcommit.GroupCommit)."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from egressd.addr import IPAddress
from egressd.engine.batching import GroupQueue, merge_grants
from egressd.engine.errors import RulesetRefused
from egressd.engine.groupcommit import GroupCommit
from egressd.policy.scope import Scope
from egressd.subject.leases import Grant, LeaseBook
from egressd.subject.scopes import WHOLE, LeaseScope, normalised

A, B, C = (ipaddress.ip_address(f"93.184.216.{n}") for n in (1, 2, 3))
NOW = 1000.0
P80 = normalised(False, Scope(((80, 80),), (), False))
P8000 = normalised(False, Scope(((8000, 9000),), (), False))


# --------------------------------------------------------------------------- pure: merge


def test_merge_keeps_first_appearance_order_longest_life_last_scope_first_held() -> None:
    first = [Grant(A, 60, P80, Scope.EMPTY), Grant(B, 300, WHOLE)]
    second = [Grant(C, 90, WHOLE), Grant(A, 30, P80.union(P8000), P80.ports)]
    assert merge_grants([first, second]) == [
        Grant(A, 60, P80.union(P8000), Scope.EMPTY),
        Grant(B, 300, WHOLE),
        Grant(C, 90, WHOLE),
    ]
    assert merge_grants([[], []]) == []


# --------------------------------------------------------------------------- pure: admit_many


def test_admit_many_decides_as_admit_then_record_in_order() -> None:
    asks: list[tuple[list[tuple[IPAddress, int]], LeaseScope]] = [
        ([(A, 60), (B, 60)], P80),
        ([(A, 300), (C, 60)], P8000),
        ([(B, 10)], P80),
    ]
    batched = LeaseBook(cap=2).admit_many(list(asks), NOW)
    one_by_one = LeaseBook(cap=2)
    expected = []
    for leases, scope in asks:
        grants = one_by_one.admit(leases, NOW, scope)
        one_by_one.record(grants, "n", NOW)
        expected.append(grants)
    # Which addresses, for how long, opening what: as if each earlier answer were recorded.
    assert [[(g.ip, g.seconds, g.scope) for g in gs] for gs in batched] == [
        [(g.ip, g.seconds, g.scope) for g in gs] for gs in expected
    ]
    # The cap carried over: C (a third new address) did not fit; A's scope grew, and its held
    # elements are what the kernel holds before the one merged step (none), not the P80 an
    # earlier answer of the same step would have written on its own.
    assert [g.ip for g in batched[1]] == [A]
    assert batched[1][0].scope == P80.union(P8000) and batched[1][0].held == Scope.EMPTY
    assert batched[1][0].seconds == 300


def test_admit_is_admit_many_of_one() -> None:
    book = LeaseBook()
    book.record([Grant(A, 100, P80, Scope.EMPTY)], "a", NOW)
    assert book.admit([(A, 10), (B, 20)], NOW, P8000) == book.admit_many([([(A, 10), (B, 20)], P8000)], NOW)[0]


# --------------------------------------------------------------------------- pure: queue


def test_queue_starts_one_committer_per_key_and_takes_in_order() -> None:
    q: GroupQueue[str, int] = GroupQueue(max_items=10)
    assert q.put("s", 1) is True
    assert q.put("s", 2) is False and q.put("s", 3) is False
    assert q.put("t", 9) is True  # another subject, its own committer
    assert q.take("s") == [1, 2, 3]
    assert q.running("s")
    assert q.take("s") == []  # empty: idle
    assert not q.running("s")
    assert q.put("s", 4) is True


def test_queue_batches_are_bounded_by_items_and_weight() -> None:
    q: GroupQueue[str, int] = GroupQueue(max_items=3, max_weight=10, weight=lambda n: n)
    for n in (1, 1, 1, 1, 8, 3, 20, 1):
        q.put("s", n)
    assert q.take("s") == [1, 1, 1]  # items
    assert q.take("s") == [1, 8]  # weight 9; +3 would be 12
    assert q.take("s") == [3]  # +20 would pass the weight
    assert q.take("s") == [20]  # the first is always taken, whatever its weight
    assert q.take("s") == [1]
    assert q.take("s") == []
    with pytest.raises(ValueError):
        GroupQueue(max_items=0)


def test_queue_drain_fails_everything_waiting() -> None:
    q: GroupQueue[str, int] = GroupQueue()
    q.put("s", 1)
    q.put("s", 2)
    assert q.drain("s") == [1, 2]
    assert not q.running("s") and q.waiting("s") == 0


# --------------------------------------------------------------------------- shell


class Kernel:
    """A commit that records each batch and holds until released (the transaction in flight)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: BaseException | None = None
        self.entered = asyncio.Event()

    async def commit(self, key: str, requests: list[str]) -> list[str]:
        self.batches.append(list(requests))
        self.entered.set()
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return [f"{key}:{r}" for r in requests]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_concurrent_requests_wait_and_go_in_one_transaction_in_order() -> None:
    kernel = Kernel()
    kernel.gate.clear()
    group: GroupCommit[str, str, str] = GroupCommit(kernel.commit)
    first = asyncio.create_task(group.submit("s", "a"))
    await kernel.entered.wait()
    rest = [asyncio.create_task(group.submit("s", r)) for r in ("b", "c", "d")]
    await _settle()
    # No reply before its transaction committed: nobody is released while it is in flight.
    assert not any(t.done() for t in [first, *rest])
    kernel.gate.set()
    assert await first == "s:a"
    assert [await t for t in rest] == ["s:b", "s:c", "s:d"]
    assert kernel.batches == [["a"], ["b", "c", "d"]]
    assert (group.batches, group.requests) == (2, 4)


async def test_a_failed_transaction_fails_every_waiter_of_its_batch_only() -> None:
    kernel = Kernel()
    kernel.gate.clear()
    group: GroupCommit[str, str, str] = GroupCommit(kernel.commit)
    first = asyncio.create_task(group.submit("s", "a"))
    await kernel.entered.wait()
    waiters = [asyncio.create_task(group.submit("s", r)) for r in ("b", "c")]
    await _settle()
    kernel.fail = RulesetRefused("refused")
    kernel.gate.set()
    for task in [first, *waiters]:
        with pytest.raises(RulesetRefused):
            await task
    kernel.fail = None
    assert await group.submit("s", "e") == "s:e"  # the key's next batch is unaffected


async def test_a_waiter_that_leaves_does_not_break_the_batch() -> None:
    kernel = Kernel()
    kernel.gate.clear()
    group: GroupCommit[str, str, str] = GroupCommit(kernel.commit)
    first = asyncio.create_task(group.submit("s", "a"))
    await kernel.entered.wait()
    leaver = asyncio.create_task(group.submit("s", "b"))
    stayer = asyncio.create_task(group.submit("s", "c"))
    await _settle()
    leaver.cancel()
    await _settle()
    kernel.gate.set()
    assert await first == "s:a"
    assert await stayer == "s:c"
    assert leaver.cancelled()
    # Its request still went to the kernel (the book must record what the kernel took).
    assert kernel.batches == [["a"], ["b", "c"]]
    # A waiter that times out (the DNS proxy's bound) likewise.
    kernel.gate.clear()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(group.submit("s", "x"), 0.01)
    kernel.gate.set()
    assert await group.submit("s", "y") == "s:y"
    assert ["x"] in kernel.batches


async def test_batches_are_bounded() -> None:
    kernel = Kernel()
    kernel.gate.clear()
    group: GroupCommit[str, str, str] = GroupCommit(kernel.commit, max_items=3)
    tasks = [asyncio.create_task(group.submit("s", str(n))) for n in range(8)]
    await kernel.entered.wait()
    kernel.gate.set()
    assert [await t for t in tasks] == [f"s:{n}" for n in range(8)]
    assert [len(b) for b in kernel.batches] == [3, 3, 2]
    assert all(len(b) <= 3 for b in kernel.batches)


async def test_keys_commit_independently_and_the_batch_is_taken_under_the_guard() -> None:
    kernel = Kernel()
    lock = asyncio.Lock()

    def guard(_key: str) -> asyncio.Lock:
        return lock

    group: GroupCommit[str, str, str] = GroupCommit(kernel.commit, guard=guard)
    async with lock:  # someone else (a policy change) holds the subject's lock
        tasks = [asyncio.create_task(group.submit(k, r)) for k, r in (("s", "a"), ("t", "z"), ("s", "b"))]
        await _settle()
        assert kernel.batches == []
    assert [await t for t in tasks] == ["s:a", "t:z", "s:b"]
    assert sorted(kernel.batches) == [["a", "b"], ["z"]]


async def test_close_fails_the_waiters() -> None:
    kernel = Kernel()
    kernel.gate.clear()
    group: GroupCommit[str, str, str] = GroupCommit(kernel.commit)
    first = asyncio.create_task(group.submit("s", "a"))
    await kernel.entered.wait()
    second = asyncio.create_task(group.submit("s", "b"))
    await _settle()
    await group.close()
    for task in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await task
