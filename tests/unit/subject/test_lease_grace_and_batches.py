"""Two ways the lease book once drifted from what a lease may open or what the kernel holds
(docs/reference/behaviour.md §18, §14.4):

* an ended lease still in the book for its count grace (``COUNT_GRACE_S``) lent its old scope,
  names and lifetime to the next answer for its address: an address a tcp/22-only name had
  taught opened tcp/22 again under a tcp/443-only name's answer, renewed by every later one;
* in one group-commit batch (egressd.engine.batching), a port-scoped answer then a whole one
  for the same address: the kernel got the merged grant (whole: no port element written) but
  the book, recording each answer in turn, booked the first answer's port elements as held. A
  later change of scope then replaced elements the kernel did not hold while keeping one it did,
  and the kernel refused the transaction (a partly overlapping range): every learn of that
  address failed until the stale element expired.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence

import pytest

from egressd.addr import IPAddress, host_network
from egressd.engine import learning
from egressd.fleetnft.contents import dyn_add
from egressd.policy import NetworkPolicy, parse_policy
from egressd.policy.scope import Scope
from egressd.subject.leases import COUNT_GRACE_S, Grant, LeaseBook, admissible_many
from egressd.subject.scopes import WHOLE, LeaseScope
from tests.unit.subject.dynkernel import DynKernel

X = ipaddress.ip_address("93.184.216.34")
Y = ipaddress.ip_address("93.184.216.35")
TCP22 = LeaseScope(False, Scope.of(tcp=[(22, 22)]))
TCP443 = LeaseScope(False, Scope.of(tcp=[(443, 443)]))
UDP443 = LeaseScope(False, Scope.of(udp=[(443, 443)]))

POLICY = parse_policy(
    '{"defaultAction":"deny","egress":['
    '{"action":"allow","target":"a.test","protocol":"tcp","ports":[22]},'
    '{"action":"allow","target":"b.test","protocol":"tcp","ports":[443]},'
    '{"action":"allow","target":"c.test","protocol":"tcp","ports":["1000-2000"]},'
    '{"action":"allow","target":"r.test","protocol":"tcp","ports":["1500-3000"]},'
    '{"action":"allow","target":"w.test"},'
    '{"action":"allow","target":"q.test","protocol":"udp","ports":[443]}]}'
)


def _learn(
    book: LeaseBook,
    kernel: DynKernel,
    asks: Sequence[learning.Ask],
    now: float,
    policy: NetworkPolicy = POLICY,
) -> list[list[IPAddress]]:
    """learn_many as the fleet runs it, its kernel step applied to the model kernel."""

    async def add(grants: list[Grant]) -> None:
        kernel.apply(dyn_add("T", kernel.nft_id, grants), now)

    return asyncio.run(learning.learn_many(book, policy, asks, now, add, hash_ranges=False))


# --------------------------------------------------------------------------- an ended lease


def test_an_ended_lease_in_its_grace_lends_a_new_answer_no_scope_names_or_lifetime() -> None:
    book = LeaseBook()
    book.record(book.admit([(X, 60)], 0.0, TCP22), "a.test", 0.0)
    now = 61.0  # ended at 60, still counted until 62
    assert now < 60.0 + COUNT_GRACE_S and X in book
    (grant,) = book.admit([(X, 30)], now, TCP443)
    # Only the new name's ports, for the new answer's lifetime; tcp/22, which the kernel may
    # still hold, is replaced (the step adds it so it exists, deletes it, adds tcp/443).
    assert grant.scope == TCP443 and grant.seconds == 30 and grant.held == TCP22.ports
    book.record([grant], "b.test", now)
    assert book.scope_of(X, now) == TCP443
    assert book.names_of(X, now) == {"b.test"}
    assert not book.verified(X, "a.test", now)
    assert book.live(now) == {X: now + 30}
    # ... and later answers renew tcp/443 alone (never the union, never udp/443 with it).
    book.record(book.admit([(X, 30)], 80.0, TCP443), "b.test", 80.0)
    assert book.scope_of(X, 80.0) == TCP443
    assert book._leases[X].held == TCP443.ports


def test_an_ended_lease_still_counts_against_the_cap_and_is_not_renewed_by_a_refresh() -> None:
    book = LeaseBook(cap=1)
    book.record(book.admit([(X, 60)], 0.0, TCP22), "a.test", 0.0)
    # In its grace it still holds the cap's only place: a new address does not fit ...
    assert book.admit([(Y, 60)], 61.0, TCP443) == []
    # ... its own address does, in the same place, opening only the new scope.
    (grant,) = book.admit([(X, 60)], 61.0, TCP443)
    assert grant.scope == TCP443
    # A refresh (scope None) renews nothing of an ended lease.
    assert book.admit([(X, 600)], 61.0, None) == []
    # A refresh recorded anyway revives none of its names.
    book.record([(X, 600)], None, 61.0)
    assert book.names_of(X, 61.0) == frozenset() and not book.verified(X, "a.test", 61.0)


def test_a_recorded_refresh_revives_no_ended_name() -> None:
    """record() on its own (no admit, whose expire() would have dropped them first): a refresh
    keeps the names that still run for as long as the lease, never one that ended."""
    book = LeaseBook()
    book.record([Grant(X, 10, TCP22)], "a.test", 0.0)
    book.record([Grant(X, 60, TCP22)], "b.test", 0.0)
    book.record([(X, 60)], None, 30.0)  # a.test ended at 10
    assert book.names_of(X, 30.0) == {"b.test"} and not book.verified(X, "a.test", 30.0)
    ended = LeaseBook()
    ended.record([Grant(X, 60, TCP22)], "a.test", 0.0)
    ended.record([(X, 60)], None, 61.0)  # the lease ended at 60
    assert ended.names_of(X, 61.0) == frozenset() and not ended.verified(X, "a.test", 100.0)


def test_learning_after_an_ended_lease_opens_only_the_new_name_s_ports_in_the_kernel() -> None:
    book, kernel = LeaseBook(), DynKernel()
    assert _learn(book, kernel, [([(X, 60)], "a.test")], 0.0) == [[X]]
    # A refresh of the ended lease, in its grace: nothing admissible.
    assert admissible_many(book, POLICY, [([(X, 600)], None)], 61.0) == [[]]
    assert _learn(book, kernel, [([(X, 60)], "b.test")], 61.0) == [[X]]
    net = host_network(X)
    assert kernel.port_keys_of(X) == {("dynpx_v4", (net, "tcp", 443, 443))}
    assert book.scope_of(X, 61.0) == TCP443 and book.names_of(X, 61.0) == {"b.test"}
    assert _learn(book, kernel, [([(X, 60)], "b.test")], 100.0) == [[X]]
    assert kernel.port_keys_of(X) == {("dynpx_v4", (net, "tcp", 443, 443))}


# --------------------------------------------------------------------------- one batch, merged


def test_a_batch_ending_whole_books_the_port_elements_the_kernel_holds() -> None:
    """c.test (tcp 1000-2000) taught X; then one batch: r.test (tcp 1500-3000), w.test (every
    port). The merged step writes X whole and no port element: the kernel keeps tcp 1000-2000.
    The book must say so, or q.test's answer (udp/443: a new port element) replaces tcp
    1000-3000, which the kernel refuses beside tcp 1000-2000."""
    book, kernel = LeaseBook(), DynKernel()
    net = host_network(X)
    assert _learn(book, kernel, [([(X, 60)], "c.test")], 0.0) == [[X]]
    assert _learn(book, kernel, [([(X, 60)], "r.test"), ([(X, 60)], "w.test")], 1.0) == [[X], [X]]
    assert kernel.port_keys_of(X) == {("dynp_v4", (net, "tcp", 1000, 2000))}
    assert book.scope_of(X, 1.0) == WHOLE
    assert book._leases[X].held == Scope.of(tcp=[(1000, 2000)])
    assert book.names_of(X, 1.0) == {"c.test", "r.test", "w.test"}
    # The next change of scope replaces what the kernel holds, and the learn succeeds.
    assert _learn(book, kernel, [([(X, 60)], "q.test")], 2.0) == [[X]]
    assert kernel.port_keys_of(X) == {("dynpx_v4", (net, "udp", 443, 443))}
    assert book._leases[X].held == UDP443.ports


@pytest.mark.parametrize("order", ["ports-then-whole", "whole-then-ports"])
def test_a_new_address_in_a_batch_of_a_port_scoped_and_a_whole_answer(order: str) -> None:
    book, kernel = LeaseBook(), DynKernel()
    names = ["r.test", "w.test"] if order == "ports-then-whole" else ["w.test", "r.test"]
    assert _learn(book, kernel, [([(X, 60)], n) for n in names], 0.0) == [[X], [X]]
    # Whole either way: no port element written, none booked.
    assert kernel.port_keys_of(X, written=True) == set()
    assert book.scope_of(X, 0.0) == WHOLE and book._leases[X].held == Scope.EMPTY
    assert _learn(book, kernel, [([(X, 60)], "q.test")], 1.0) == [[X]]
    assert kernel.port_keys_of(X) == {("dynpx_v4", (host_network(X), "udp", 443, 443))}


def test_a_batch_s_element_budget_is_what_the_merged_step_writes() -> None:
    """X holds tcp 22 and tcp 24 (2 of the 4 elements a cap of 2 leases allows). One batch:
    tcp 23 for X (its scope becomes one range, tcp 22-24: one element), then a whole answer
    for X (the merged step writes no port element: X keeps its 2), then Y with 3 elements.
    Counting X's one-range step, which never runs, would let Y's 3 in beside X's 2: 5 in a set
    of 4, which the kernel refuses for the whole batch."""
    s22 = LeaseScope(False, Scope.of(tcp=[(22, 22), (24, 24)]))
    s23 = LeaseScope(False, Scope.of(tcp=[(23, 23)]))
    three = LeaseScope(False, Scope.of(tcp=[(80, 80), (90, 90), (100, 100)]))
    book = LeaseBook(cap=2)
    book.record(book.admit([(X, 60)], 0.0, s22), "two.test", 0.0)
    per = book.admit_many([([(X, 60)], s23), ([(X, 60)], WHOLE), ([(Y, 60)], three)], 1.0)
    assert [[g.ip for g in grants] for grants in per] == [[X], [X], []]
    assert all(g.held == s22.ports for grants in per for g in grants)


def test_a_refresh_in_a_batch_renews_what_an_earlier_answer_of_it_granted() -> None:
    """Answers decided as if the earlier ones of the batch were recorded: a refresh after an
    answer for a new address renews it (the book only records after the kernel step)."""
    book = LeaseBook()
    per = book.admit_many([([(X, 60)], TCP22), ([(X, 90)], None)], 0.0)
    assert [[(g.ip, g.seconds, g.scope) for g in grants] for grants in per] == [
        [(X, 60, TCP22)],
        [(X, 90, TCP22)],
    ]
    assert book.admit_many([([(X, 90)], None)], 0.0) == [[]]  # nothing recorded
