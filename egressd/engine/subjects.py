"""The subject engine both profiles run: learn, narrow, cut flows, verify destinations.

One instance holds every subject's DNS leases (a :class:`~egressd.subject.leases.LeaseBook` per
uid, with the names that taught them) over one :class:`~egressd.engine.backend.RulesetBackend`.
The fleet runs it with many subjects (``egressd.actionhandler``: registry states, fences,
revocations and the subject's lock are its guards); the sidecar is this engine with one implicit
subject (``egressd.sidecar.engine``: readiness and the policy generation are its guards). The
callers hold their locks; the engine decides against the policy they pass, which is the policy
in force at that moment.

Narrowing events stay with the operation that commits a narrowed book (``PolicyApplied``,
``AlwaysRulesChanged``), published before it returns; :meth:`forget` publishes its own
``LeasesNarrowed`` (tests/unit/test_feed.py).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from egressd.addr import IPAddress
from egressd.engine import learning
from egressd.engine.backend import Flow, RulesetBackend
from egressd.engine.errors import RulesetRefused, RulesetUncertain
from egressd.engine.flows import cut_refused
from egressd.feed import Feed, LeasesNarrowed
from egressd.policy import IpSets, NetworkPolicy, Verdict, audit_deny_sets, ip_sets, normalise_name
from egressd.policy.decide import hard_denied, ip_decision
from egressd.policy.namecheck import NameVerdict, Wire, check_name
from egressd.policy.portmatch import address_rules_admit
from egressd.subject.leases import DEFAULT_MAX_LEASES, LeaseBook, Narrowed, narrowed_for


class Judge(Protocol):
    """Does the ruleset accept a new connection to ``dst`` (on ``proto``/``port``)?"""

    def __call__(self, dst: IPAddress, proto: str = "", port: int | None = None) -> bool: ...


@dataclass(frozen=True, slots=True)
class CutOrder:
    """One subject's share of a flow cut: its sources, the effective policy that judges its
    flows, and the destinations it reaches whatever that policy says (``reachable``: the
    fleet's gateways) or unless a deny rule covers them (``unless_denied``: the sidecar's
    upstream resolvers)."""

    sources: Collection[IPAddress]
    effective: NetworkPolicy
    reachable: Collection[IPAddress] = ()
    unless_denied: Collection[IPAddress] = ()


def unless_refused(exc: BaseException) -> bool:
    """A kernel step that raised anything but a refusal may still have been committed (an
    unanswered step, a timeout, a cancellation): the fleet's :meth:`RulesetBackend.may_hold`."""
    return not isinstance(exc, RulesetRefused) or isinstance(exc, RulesetUncertain)


class SubjectEngine:
    def __init__(
        self,
        backend: RulesetBackend,
        feed: Feed,
        *,
        max_leases: int = DEFAULT_MAX_LEASES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.feed = feed
        self.max_leases = max_leases
        self.clock = clock
        # Each subject's DNS leases with the names that taught them: the refresh mirror, the
        # lease cap, narrowing, flow cuts and the MITM's destination check.
        self.books: dict[str, LeaseBook] = {}

    # ---- learn -------------------------------------------------------------------------------

    async def learn(
        self, uid: str, effective: NetworkPolicy, leases: Sequence[tuple[IPAddress, int]], name: str | None
    ) -> list[IPAddress]:
        """:meth:`learn_many` of one answer."""
        return (await self.learn_many(uid, effective, [(leases, name)]))[0]

    async def learn_many(
        self, uid: str, effective: NetworkPolicy, asks: Sequence[learning.Ask], *, hash_ranges: bool = True
    ) -> list[list[IPAddress]]:
        """Learn answers for ``uid`` (each: its addresses and its question; None: a refresh of
        live addresses) under ``effective`` in one kernel transaction (the group commit,
        :mod:`egressd.engine.groupcommit`); each answer's addresses the kernel now holds.
        ``hash_ranges`` False while the kernel may hold another policy than ``effective``
        (:func:`egressd.subject.leases.admissible_many`)."""
        book = self.books.setdefault(uid, LeaseBook(self.max_leases))
        return await learning.learn_many(
            book,
            effective,
            asks,
            self.clock(),
            functools.partial(self.backend.add_leases, uid),
            kernel_may_hold=self.backend.may_hold,
            name_check=self.backend.name_check,
            hash_ranges=hash_ranges,
        )

    # ---- narrow ------------------------------------------------------------------------------

    def narrowed(self, uid: str, effective: NetworkPolicy) -> Narrowed | None:
        """``uid``'s leases under a new effective policy, by the deny sets its kernel will hold
        (None: it has none)."""
        book = self.books.get(uid)
        if book is None or not len(book):
            return None
        deny_v4, deny_v6 = self.backend.kernel_denies(effective)
        return narrowed_for(
            book, effective, deny_v4, deny_v6, self.clock(), name_check=self.backend.name_check
        )

    def commit(self, uid: str, narrowed: Narrowed | None) -> None:
        """The kernel took a narrowing: ``uid``'s book is its narrowed book from now on."""
        if narrowed is not None:
            self.books[uid] = narrowed.book

    def forget(self, uid: str) -> None:
        """``uid`` is gone (or reset): its leases with it, and the MITM's memory of them."""
        self.books.pop(uid, None)
        self.feed.publish(LeasesNarrowed())

    # ---- verify ------------------------------------------------------------------------------

    def verified(self, uid: str, sets: IpSets | None, host: str, dst: IPAddress) -> bool:
        """May the MITM send ``host``'s credentials to ``dst`` for ``uid``? (docs/reference/behaviour.md §10)"""
        return learning.verified(self.books.get(uid), sets, host, dst, self.clock())

    def verified_until(self, uid: str, sets: IpSets | None, host: str, dst: IPAddress) -> float:
        """:meth:`verified` with its deadline (monotonic; 0.0: not verified)."""
        return learning.verified_until(self.books.get(uid), sets, host, dst, self.clock())

    def check_name(
        self,
        uid: str,
        effective: NetworkPolicy,
        sets: IpSets,
        *,
        wire: Wire,
        name: str | None,
        dst: IPAddress,
        port: int,
    ) -> NameVerdict:
        """May ``uid``'s connection to ``dst``:``port`` ask for ``name`` (docs/reference/behaviour.md §18)?
        The names that taught ``dst`` are this subject's running leases'."""
        book = self.books.get(uid)
        now = self.clock()
        taught = book.names_of(dst, now) if book is not None else frozenset()
        verdict = check_name(effective, sets, wire=wire, name=name, dst=dst, port=port, taught=taught)
        if not verdict.admit or verdict.would_deny:
            return verdict
        if verdict.rule == "lease" and book is not None and name is not None:
            # Admitted while that lease of the name runs (the MITM may remember it until then).
            return replace(verdict, until=book.verified_until(dst, normalise_name(name), now))
        return replace(verdict, until=math.inf if verdict.rule == "address" else 0.0)

    # ---- flows -------------------------------------------------------------------------------

    def judge(self, uid: str, order: CutOrder, sets: IpSets | None = None) -> Judge:
        """Whether the ruleset built from ``order.effective`` and ``uid``'s live leases accepts
        a new connection to a destination, on a protocol and port (docs/reference/behaviour.md §18;
        no protocol: the address alone, as the address-only sets decide it). In audit mode,
        where the backend's kernel lets a would-deny through, it passes (only a hard deny,
        whole or by port, refuses), so it is not cut either."""
        effective = order.effective
        now = self.clock()
        book = self.books.get(uid)
        leases = book.live(now) if book is not None else {}
        sets = sets if sets is not None else ip_sets(effective)
        split = audit_deny_sets(effective) if effective.audit and self.backend.passes_would_deny else None
        name_check = self.backend.name_check

        def allows(dst: IPAddress, proto: str = "", port: int | None = None) -> bool:
            if dst in order.reachable:
                return True
            if not proto:
                verdict, where, _ = ip_decision(effective, leases, dst, now, sets)
                if verdict is Verdict.ALLOW or (where != "deny" and dst in order.unless_denied):
                    return True
                return split is not None and not hard_denied(effective, dst, split)
            by_rules = address_rules_admit(sets, dst, proto, port)
            if by_rules is True:
                return True
            if by_rules is None:
                if book is not None and book.scope_of(dst, now).admits(proto, port, name_check=name_check):
                    return True
                if effective.default_action is Verdict.ALLOW or dst in order.unless_denied:
                    return True
            # Refused by the rules: audit mode passes what only a user deny refuses (a deny by
            # port is a user's rule: egressd.fleetnft.contents.port_contents).
            return split is not None and not hard_denied(effective, dst, split)

        return allows

    async def cut(self, due: Mapping[str, CutOrder]) -> int:
        """Cut every tracked flow of ``due``'s subjects that their order's policy refuses, with
        one read of the flow table; returns how many were cut (best effort: a failed cut is
        logged and the rest go on; the kernel already refuses new flows)."""
        flows = await self.backend.tracked_flows({uid: order.sources for uid, order in due.items()})
        if flows is None:
            return 0
        cut = 0
        for uid, order in due.items():
            allows = self.judge(uid, order)

            def allowed(flow: Flow, allows: Judge = allows) -> bool:
                return allows(flow[1], flow[2], flow[3])

            cut += await cut_refused(
                flows.get(uid, ()), allowed, self.backend.cut_flow, self.backend.flow_fields
            )
        return cut
