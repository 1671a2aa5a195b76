"""The lease book against a model, under random answers (seeded): group-commit batches of
answers of random names (each with its own ports and protocols) and refreshes for a few
addresses, at random times around their lifetimes and the count grace, policy changes that
narrow (egressd.subject.leases.narrowed_for), all learned as the fleet learns them
(egressd.engine.learning.learn_many: decided, merged into one kernel step, recorded), that
kernel step applied to a model kernel (tests/unit/subject/dynkernel.py) that refuses what
nf_tables refuses. After every step:

(a) no live lease opens more than the union of the scopes of the names that taught it during
    its current life (a lease that ended lends nothing to the next answer, docs/reference/behaviour.md §18),
    and it names no other name;
(b) the book's ``held`` for each address is exactly the port elements the kernel has written for
    it and not deleted (expired ones included: the kernel step replaces them), and the kernel
    holds nothing live for an address the book's live lease does not open;
(c) the lease cap holds in the book and the kernel, and neither a learn nor a narrowing takes
    the book past its port element budget (a narrowing that gives a lease which lost its whole
    name its other names' elements back included), nor the kernel's port-scoped sets past
    their size.

A kernel step the model refuses fails the test too (the learn would fail closed, but only
because the book disagreed with the kernel)."""

from __future__ import annotations

import functools
import ipaddress
import json
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import cast

import pytest

from egressd.addr import IPAddress
from egressd.engine import learning
from egressd.fleetnft.contents import dyn_add, dyn_replace
from egressd.policy import NetworkPolicy, parse_policy
from egressd.policy.scope import Scope
from egressd.subject.leases import Grant, LeaseBook, narrowed_for, port_elems_cap
from egressd.subject.scopes import EMPTY, LeaseScope, lease_scope
from tests.unit.subject.dynkernel import DynKernel, expected_port_keys

ADDRS: tuple[IPAddress, ...] = tuple(ipaddress.ip_address(f"93.184.216.{n}") for n in (1, 2, 3))
CAP = 2  # fewer places than addresses, and a port element budget of 4
# name -> its rule's protocol and ports (None: every port): single ports, ranges that overlap,
# adjoin or nest, a whole name and an explicit udp/443 (a whole lease's one port element).
RULES: dict[str, tuple[str | None, list[object] | None]] = {
    "w.test": (None, None),
    "q.test": ("udp", [443]),
    "s22.test": ("tcp", [22]),
    "s23.test": ("tcp", [23]),
    "s443.test": ("tcp", [443]),
    "r1.test": ("tcp", ["1000-2000"]),  # the first range rule: the shared ranges (dynr)
    "r2.test": ("tcp", ["1500-3000"]),
    "r3.test": ("tcp", ["2001-2500"]),
    "u.test": ("udp", ["5000-5100"]),
    "two.test": ("tcp", [22, 24]),
}
NAMES = sorted(RULES)
TTLS = (1, 2, 3, 5, 8)


@functools.cache
def policy(names: frozenset[str]) -> NetworkPolicy:
    egress = []
    for name in NAMES:  # rule order fixed: the shared ranges follow from it
        if name not in names:
            continue
        proto, ports = RULES[name]
        rule: dict[str, object] = {"action": "allow", "target": name}
        if proto is not None:
            rule |= {"protocol": proto, "ports": ports}
        egress.append(rule)
    return parse_policy(json.dumps({"defaultAction": "deny", "egress": egress}))


def _done[T](step: Coroutine[object, None, T]) -> T:
    """The value of a coroutine that never waits (the model kernel answers at once): no event
    loop per step, so the model runs thousands of steps in a few seconds."""
    try:
        step.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    raise AssertionError("the learn waited")


@functools.cache
def _scope(allowed: frozenset[str], name: str) -> LeaseScope:
    return lease_scope(policy(allowed), name, name_check=False)


def covered(inner: LeaseScope, outer: LeaseScope) -> bool:
    """Does ``outer`` open everything ``inner`` opens? (the name check off: whole is all)"""
    if outer.whole:
        return True
    return not inner.whole and inner.ports.minus(outer.ports).is_empty()


@dataclass
class ModelLease:
    expiry: int
    names: set[str] = field(default_factory=set)


@dataclass
class World:
    rng: random.Random
    book: LeaseBook = field(default_factory=lambda: LeaseBook(CAP))
    kernel: DynKernel = field(default_factory=lambda: DynKernel(port_size=port_elems_cap(CAP)))
    allowed: frozenset[str] = frozenset(NAMES)
    leases: dict[IPAddress, ModelLease] = field(default_factory=dict)
    now: int = 0

    @property
    def effective(self) -> NetworkPolicy:
        return policy(self.allowed)

    def scope(self, name: str) -> LeaseScope:
        return _scope(self.allowed, name)

    # ---- steps -------------------------------------------------------------------------------

    def learn(self) -> None:
        asks: list[learning.Ask] = []
        for _ in range(self.rng.randint(1, 4)):
            ips = self.rng.sample(ADDRS, self.rng.randint(1, 2))
            name = None if self.rng.random() < 0.15 else self.rng.choice(NAMES)
            asks.append(([(ip, self.rng.choice(TTLS)) for ip in ips], name))
        now = self.now
        self.sync()

        async def add(grants: list[Grant]) -> None:
            self.kernel.apply(dyn_add("T", self.kernel.nft_id, grants), now)

        got = _done(learning.learn_many(self.book, self.effective, asks, now, add))
        # (c) a learn never takes the book past its element budget.
        assert self.book._elems <= self.book.elem_cap, self.book._elems
        # The model: an answer the book took joins its address's lease, or starts a new one
        # when the lease ended (or never was); a refresh only renews a live one.
        for (leases, name), ips in zip(asks, got, strict=True):
            for ip, ttl in leases:
                if ip not in ips:
                    continue
                lease = self.leases.get(ip)
                if lease is None or lease.expiry <= now:
                    assert name is not None, f"a refresh renewed {ip}, which had ended"
                    lease = self.leases[ip] = ModelLease(now + ttl)
                lease.expiry = max(lease.expiry, now + ttl)
                if name is not None:
                    lease.names.add(name)

    def sync(self) -> None:
        """The book forgets what ended past its grace; the kernel's elements of those ended
        before (their timeouts are the lease's), so it holds nothing of them any more."""
        self.kernel.now = self.now
        self.book.expire(self.now)
        for ip in ADDRS:
            if ip not in self.book._leases:
                self.kernel.forget(ip)

    def change_policy(self) -> None:
        self.allowed = frozenset(self.rng.sample(NAMES, self.rng.randint(len(NAMES) // 2, len(NAMES))))
        narrowed = narrowed_for(self.book, self.effective, (), (), self.now)
        if not narrowed.intact:
            # (the model kernel refuses a refill past the port-scoped sets' size, as nf_tables does)
            self.kernel.apply(dyn_replace("T", self.kernel.nft_id, narrowed.kept, ranges=True), self.now)
        # (c) nor does a narrowing, whose kept leases' elements the refill writes.
        assert narrowed.book._elems <= narrowed.book.elem_cap, narrowed.book._elems
        assert narrowed.book._elems == sum(len(g.scope.ports.elements()) for g in narrowed.kept)
        self.book = narrowed.book
        kept = {g.ip for g in narrowed.kept}
        self.leases = {ip: lease for ip, lease in self.leases.items() if ip in kept}
        for lease in self.leases.values():
            lease.names &= self.allowed

    # ---- invariants --------------------------------------------------------------------------

    def check(self) -> None:
        book, now = self.book, self.now
        self.sync()
        assert len(book) <= CAP
        held_total = 0
        for ip in ADDRS:
            entry = book._leases.get(ip)
            model = self.leases.get(ip)
            if entry is None:
                continue  # (b) sync() found the kernel holds nothing live for it
            held_total += len(entry.held.elements())
            # (b) held is what the kernel wrote and did not delete.
            written = self.kernel.port_keys_of(ip, written=True)
            assert written == expected_port_keys(ip, entry.held, book.shared), (ip, entry, written)
            if entry.expiry <= now:
                assert not book.names_of(ip, now) and book.scope_of(ip, now) == EMPTY
                assert not self.kernel.keys_of(ip), (ip, self.kernel.keys_of(ip))
                continue
            # (a) the live lease opens no more than its names of this life taught.
            assert model is not None and model.expiry == entry.expiry, (ip, model, entry)
            taught = EMPTY
            for name in model.names:
                taught = taught.union(self.scope(name))
            assert covered(entry.scope, taught), (ip, entry.scope, model.names, taught)
            assert book.names_of(ip, now) <= model.names, (ip, book.names_of(ip, now), model.names)
            # (b) ... and the kernel opens nothing live for it beyond the lease's scope.
            live = self.kernel.keys_of(ip)
            if not entry.scope.whole:
                assert not {k for k in live if k[0].startswith("dyn_")}, (ip, live)
                assert live <= expected_port_keys(ip, entry.scope.ports, book.shared), (ip, live)
        # (c) the book counts the elements it holds (the kernel's, by (b)), within its budget;
        # the address sets hold no more addresses than the cap.
        assert book._elems == held_total <= book.elem_cap, (held_total, book.elem_cap)
        for name in self.kernel.live:
            if "_dyn_" in name or "_dynr_" in name:
                assert self.kernel.live_count(name) <= CAP, (name, self.kernel.live[name])


def run(seed: int, steps: int = 150) -> None:
    world = World(random.Random(seed))
    for _ in range(steps):
        world.now += world.rng.choice((0, 0, 1, 1, 2, 3, 5))
        roll = world.rng.random()
        if roll < 0.8:
            world.learn()
        elif roll < 0.9:
            world.change_policy()
        world.check()  # (its sync() is the book's expire at this time)


@pytest.mark.parametrize("seed", range(30))
def test_the_lease_book_agrees_with_its_model_and_the_kernel(seed: int) -> None:
    run(seed)


def test_the_scopes_of_the_model_are_what_the_rules_say() -> None:
    """The model's names exercise what it is for: overlapping, adjoining and nested ranges,
    single ports, a whole name, and udp/443 that a whole lease keeps as its one element."""
    world = World(random.Random(0))
    r1, r2, r3 = (world.scope(n).ports for n in ("r1.test", "r2.test", "r3.test"))
    assert r1.union(r2).elements() == (("tcp", 1000, 3000),)
    assert r1.union(r3).elements() == (("tcp", 1000, 2500),)
    assert world.scope("w.test").union(world.scope("q.test")) == LeaseScope(True, Scope.of(udp=[(443, 443)]))
    assert world.scope("s22.test").union(world.scope("s23.test")).ports.elements() == (("tcp", 22, 23),)
