"""The lease book: one subject's DNS-learned addresses, who taught them, and until when.

Pure bookkeeping (no I/O, time passed in). Both profiles use it for the same four questions:
which addresses of an answer may enter the kernel's dyn sets (the per-subject cap,
docs/reference/behaviour.md §14.4), which leases survive a narrowing policy change (14.1), which live
addresses the connection refresh may renew (§9, 14.1), and whether the MITM may send a
host's credential to an address (§10: only to an address the DNS proxy answered for that
host). Those questions are answered here once, for both (:func:`admissible`,
:func:`narrowed_for`, :func:`destination_verified`); the profiles only apply the answers to
their kernels.

A lease lives as long as the longest answer that carried it; the kernel element gets that
same lifetime (callers send :meth:`LeaseBook.admit`'s seconds), so the book never believes
an address is closed while the kernel still has it, nor the other way round for longer than
the clock difference covered by ``COUNT_GRACE_S``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from egressd.addr import IPAddress
from egressd.policy import IpSets, NetworkPolicy, Verdict, judge_domain
from egressd.policy.ipsets import Prefix, covered_by
from egressd.policy.scope import Scope
from egressd.subject.ranges import shared_ranges
from egressd.subject.scopes import EMPTY, WHOLE, LeaseScope, lease_scope

DEFAULT_MAX_LEASES = 4096
# One address answered for many names (a CDN, or a sandbox cycling names on purpose) keeps
# only its most recently renewed names: forgetting one can only refuse an injection or revoke
# a lease early, both closed.
MAX_NAMES_PER_LEASE = 16
# An expired entry still counts against the cap this long, so the book never admits an
# address the kernel's set (created with the same size) would refuse with ENFILE.
COUNT_GRACE_S = 2.0
#: Port-scoped elements per lease the port-scoped dyn sets are sized for (docs/reference/behaviour.md
#: §14.4: a full book of leases with typical scopes, one or two port ranges each, fits). A
#: lease whose elements do not fit beside the others is trimmed from the answer like one over
#: the cap. Kept small on purpose: the kernel's concatenated interval sets (pipapo) empty in
#: time quadratic in their size (measured on 6.18: 4096 elements 0.5 s, 8192 1.4 s, 16384
#: about 8 s), and a narrowing flushes the set in the subject's transaction.
PORT_ELEMS_PER_LEASE = 2


def port_elems_cap(cap: int) -> int:
    """The port-scoped dyn sets' size (and the book's element budget) for a lease cap."""
    return cap * PORT_ELEMS_PER_LEASE


@dataclass(slots=True)
class Lease:
    expiry: float  # monotonic seconds
    names: dict[str, float] = field(default_factory=dict)  # name -> expiry (<= lease expiry)
    # What it opens: the union of its names' scopes (docs/reference/behaviour.md §18).
    scope: LeaseScope = WHOLE
    # The port-scoped elements the kernel may hold for it (written, not yet expired or
    # flushed): a scope change deletes exactly these before adding the new ones.
    held: Scope = Scope.EMPTY


@dataclass(frozen=True, slots=True)
class Grant:
    """One lease as the kernel step writes it: the address for ``seconds``, with ``scope``
    (whole: the address-only dyn set; its port elements in the port-scoped one), replacing
    the port elements ``held`` (those the kernel may hold for it now, when they differ).
    ``shared``: the subject's shared ranges under the policy the grant was decided with, which
    is the policy its transaction applies under (egressd.subject.ranges): where its ranges, and
    those it holds, live in the kernel."""

    ip: IPAddress
    seconds: int
    scope: LeaseScope = WHOLE
    held: Scope = Scope.EMPTY
    shared: Scope = Scope.EMPTY


#: A lease as callers may hand it to the kernel steps: a :class:`Grant`, or a plain
#: (address, seconds) pair, which is a whole-scope lease (every port and protocol: today's path).
LeaseLike = Grant | tuple[IPAddress, int] | tuple[IPAddress, float]


def as_grants(leases: Iterable[LeaseLike]) -> list[Grant]:
    """``leases`` as grants (a plain pair: a whole-scope lease holding no port elements)."""
    return [g if isinstance(g, Grant) else Grant(g[0], math.ceil(g[1])) for g in leases]


@dataclass(frozen=True, slots=True)
class Narrowed:
    """The outcome of a policy change for the dyn sets: what stays (with its remaining
    lifetime and its scope under the new policy, for re-adding after a flush) and what leaves."""

    book: LeaseBook
    kept: tuple[Grant, ...]
    revoked: tuple[IPAddress, ...]
    # Every lease of the old book stays with the same scope (none revoked, none ended, none
    # narrowed) and the shared ranges stay: the kernel's dyn sets, never wider than the book,
    # need no rewrite.
    intact: bool = False


class LeaseBook:
    def __init__(self, cap: int = DEFAULT_MAX_LEASES) -> None:
        self.cap = cap
        self.elem_cap = port_elems_cap(cap)
        self._leases: dict[IPAddress, Lease] = {}
        # Port-scoped elements the kernel may hold over all leases (their ``held``).
        self._elems = 0
        # Nothing can end before this (monotonic): expire() skips its walk until then, so a
        # full book answered at DNS rates costs O(1) per answer, not O(leases).
        self._next_end = math.inf
        # The shared ranges the kernel's elements for these leases were written under
        # (egressd.subject.ranges): a change of them rewrites the dyn sets (narrowed()).
        self.shared = Scope.EMPTY

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[IPAddress]:
        return iter(list(self._leases))

    def expire(self, now: float) -> None:
        """Drop what ended (names first); an entry counts against the cap a little longer."""
        if now < self._next_end:
            return
        for ip in [ip for ip, lease in self._leases.items() if lease.expiry + COUNT_GRACE_S <= now]:
            self._elems -= len(self._leases[ip].held.elements())
            del self._leases[ip]
        next_end = math.inf
        for lease in self._leases.values():
            for name in [n for n, exp in lease.names.items() if exp <= now]:
                del lease.names[name]
            ends = [exp for exp in lease.names.values()]
            ends.append(lease.expiry + COUNT_GRACE_S)
            next_end = min(next_end, *ends)
        self._next_end = next_end

    def live(self, now: float) -> dict[IPAddress, float]:
        """Unexpired addresses -> expiry (explain, the refresh mirror, flow cuts)."""
        return {ip: lease.expiry for ip, lease in self._leases.items() if lease.expiry > now}

    def scope_of(self, ip: IPAddress, now: float) -> LeaseScope:
        """What the live lease of ``ip`` opens (nothing when there is none)."""
        lease = self._leases.get(ip)
        if lease is None or lease.expiry <= now:
            return EMPTY
        return lease.scope

    def names_of(self, ip: IPAddress, now: float) -> frozenset[str]:
        lease = self._leases.get(ip)
        if lease is None or lease.expiry <= now:
            return frozenset()
        return frozenset(n for n, exp in lease.names.items() if exp > now)

    def verified(self, ip: IPAddress, name: str, now: float) -> bool:
        """Did the DNS proxy answer ``name`` with ``ip``, and does that lease still run?"""
        lease = self._leases.get(ip)
        if lease is None or lease.expiry <= now:
            return False
        expiry = lease.names.get(name)
        return expiry is not None and expiry > now

    def verified_until(self, ip: IPAddress, name: str, now: float) -> float:
        """When :meth:`verified` stops holding (monotonic), absent a narrowing; 0.0 if it does not."""
        lease = self._leases.get(ip)
        if lease is None or lease.expiry <= now:
            return 0.0
        expiry = lease.names.get(name)
        return min(expiry, lease.expiry) if expiry is not None and expiry > now else 0.0

    def admit(
        self,
        leases: Iterable[tuple[IPAddress, int]],
        now: float,
        scope: LeaseScope | None = WHOLE,
        shared: Scope = Scope.EMPTY,
    ) -> list[Grant]:
        """The addresses of an answer that fit, with the seconds the kernel element must get
        and the scope it opens: the live lease's scope widened by ``scope`` (None: a refresh, which
        renews a live lease's scope, never more; a lease that ended opens nothing of its own).

        Known addresses are renewals and always fit, unless their scope grows past the port
        element budget; new ones only while the subject holds fewer than ``cap`` leases and
        their port elements fit. A renewal never shortens a lease another answer granted.
        Nothing is recorded: call :meth:`record` once the kernel took them.
        """
        return self.admit_many([(leases, scope)], now, shared)[0]

    def admit_many(
        self,
        asks: Sequence[tuple[Iterable[tuple[IPAddress, int]], LeaseScope | None]],
        now: float,
        shared: Scope = Scope.EMPTY,
    ) -> list[list[Grant]]:
        """:meth:`admit` for several answers, in order, that one kernel transaction carries
        merged (:func:`egressd.engine.batching.merge_grants`): each decided as if the earlier
        ones were recorded for the cap and each address's scope and lifetime; the element
        budget and ``held`` (what the kernel may hold before the step, which the merged step
        replaces) are the merged step's. Nothing is recorded: :meth:`record_batch` the merged
        grants once the kernel took them (or :meth:`record` a single answer's)."""
        self.expire(now)
        room = self.cap - len(self._leases) if self.cap > 0 else math.inf
        elems = self.elem_cap - self._elems if self.cap > 0 else math.inf
        # An address granted by an earlier answer of this call: (scope, expiry) so far. Its held
        # elements stay the book's: the kernel never sees the answers one by one, so the port
        # elements of a scope a later answer replaced (whole: none) are never written.
        pending: dict[IPAddress, tuple[LeaseScope, float]] = {}
        out: list[list[Grant]] = []
        for leases, scope in asks:
            grants: list[Grant] = []
            seen: set[IPAddress] = set()
            for ip, seconds in leases:
                if ip in seen:
                    continue
                seen.add(ip)
                lease = self._leases.get(ip)
                held = lease.held if lease is not None else Scope.EMPTY
                prior = pending.get(ip)
                live = lease is not None and lease.expiry > now
                if prior is not None:
                    old, expiry = prior
                elif lease is not None and live:
                    old, expiry = lease.scope, lease.expiry
                else:
                    # New, or ended and still in its grace: it opens only this answer's scope
                    # for this answer's lifetime (an ended lease's names no longer allow
                    # anything, §18). An ended one's entry still counts against the cap, and its
                    # held elements (the kernel may still have them) are the step's to replace.
                    old, expiry = EMPTY, now
                known = prior is not None or live
                new = old if scope is None else (old.union(scope) if known else scope)
                if new.is_empty():
                    continue
                # The elements the merged step needs beyond what the address holds now,
                # less what this call's earlier answers already took for it.
                grow = _growth(new.ports, held) - (_growth(old.ports, held) if prior is not None else 0)
                if grow > elems:
                    continue
                if lease is None and prior is None:
                    if room <= 0:
                        continue
                    room -= 1
                grant = Grant(ip, max(1, seconds, math.ceil(expiry - now)), new, held, shared)
                grants.append(grant)
                elems -= grow
                pending[ip] = (new, max(expiry, now + grant.seconds))
            out.append(grants)
        return out

    def record(self, admitted: Iterable[LeaseLike], name: str | None, now: float) -> None:
        """The kernel holds ``admitted`` (one answer's grants, the step that wrote them):
        remember them, taught by ``name`` (None: a refresh, which keeps the names a lease
        already has for as long as the lease)."""
        for item in admitted:
            grant = as_grants((item,))[0]
            if isinstance(item, Grant):
                self.shared = item.shared  # decided under the policy in force (admissible_many)
            self._teach(self._hold(grant, now), name, now + grant.seconds, now)

    def record_batch(
        self,
        merged: Iterable[Grant],
        per_answer: Iterable[tuple[Iterable[Grant], str | None]],
        now: float,
    ) -> None:
        """The kernel holds ``merged``, the one step that carried several answers' grants
        (:func:`egressd.engine.batching.merge_grants` of ``per_answer``'s): each lease's
        lifetime, scope and held elements as that step wrote them, then the names as
        :meth:`record` teaches each answer's. Recording the answers one by one instead would
        book port elements of a scope a later answer of the batch replaced, which the kernel
        never got: the book would then disagree with the kernel on what it holds, and a later
        change of scope would fail the kernel transaction on the elements it really holds."""
        for grant in merged:
            self.shared = grant.shared  # decided under the policy in force (admissible_many)
            self._hold(grant, now)
        for admitted, name in per_answer:
            for grant in admitted:
                lease = self._leases.get(grant.ip)
                if lease is not None:
                    self._teach(lease, name, now + grant.seconds, now)

    def _hold(self, grant: Grant, now: float) -> Lease:
        """The kernel step wrote ``grant``: the lease's lifetime, scope and held elements."""
        expiry = now + grant.seconds
        lease = self._leases.get(grant.ip)
        if lease is None:
            lease = self._leases[grant.ip] = Lease(expiry)
        elif lease.expiry <= now:
            # Ended (in its grace): no name that taught it teaches anything any more.
            lease.names.clear()
        lease.expiry = max(lease.expiry, expiry)
        lease.scope = grant.scope
        if grant.scope.ports != lease.held and not grant.scope.ports.is_empty():
            self._elems += len(grant.scope.ports.elements()) - len(lease.held.elements())
            lease.held = grant.scope.ports
        self._next_end = min(self._next_end, lease.expiry + COUNT_GRACE_S)
        return lease

    def _teach(self, lease: Lease, name: str | None, expiry: float, now: float) -> None:
        """``name`` taught ``lease`` until ``expiry`` (None: a refresh, renewing its names)."""
        if name is None:
            for known, exp in lease.names.items():
                if exp > now:  # a refresh renews a live name, never revives an ended one
                    lease.names[known] = lease.expiry
            return
        lease.names[name] = max(lease.names.get(name, 0.0), expiry)
        self._next_end = min(self._next_end, lease.names[name])
        if len(lease.names) > MAX_NAMES_PER_LEASE:
            oldest = min(lease.names, key=lambda n: lease.names[n])
            del lease.names[oldest]

    def renewable(
        self, ips: Iterable[IPAddress], allowed: Callable[[str], bool], now: float
    ) -> list[IPAddress]:
        """Live addresses among ``ips`` that some still-allowed name taught (the refresh)."""
        return [ip for ip in ips if any(allowed(n) for n in self.names_of(ip, now))]

    def narrowed(
        self,
        allowed: Callable[[str], bool],
        denied: Callable[[IPAddress], bool],
        now: float,
        scope_of: Callable[[str], LeaseScope] | None = None,
        shared: Scope | None = None,
    ) -> Narrowed:
        """The book after a policy change: a lease stays only if a name that taught it is
        still allowed and its address is not denied, with the union of those names' scopes
        under the new policy (``scope_of``; None: each keeps its scope); names no longer
        allowed are forgotten (the MITM must not verify them). ``self`` is left as it was
        (kernel first). The kernel's dyn sets are rewritten from ``kept`` (flushed and
        refilled), so a kept lease's port elements are exactly its new scope's. ``shared``: the
        shared ranges under the new policy (None: unchanged); a change makes the book not
        intact, so the dyn sets are rewritten with the static swap that changes them.

        The port element budget holds here as in :meth:`admit_many`: a lease whose new scope's
        port elements do not fit beside those of the leases kept before it is revoked (the
        refill would otherwise exceed the port-scoped dyn sets' size, which the kernel refuses
        with ENFILE, failing the whole swap and leaving the wider policy in force). A lease
        that lost a whole-scope name gets its other names' elements back here, so a narrowing
        can need more elements than the book held.

        Kept in the book's order (the order its entries were learned), not, say, fewest
        elements first: an older lease keeps its place as it does when learning (a newcomer
        over the budget is refused, the leases already held are not), the outcome does not
        depend on which names a sandbox made cheap, and a narrowing that repeats keeps the
        same leases. Either way nothing is kept that the new policy does not allow: revoking
        is the closed side."""
        shared = self.shared if shared is None else shared
        book = LeaseBook(self.cap)
        book.shared = shared
        kept: list[Grant] = []
        revoked: list[IPAddress] = []
        same = True
        for ip, lease in self._leases.items():
            if lease.expiry <= now:
                continue  # ended: the flush removes any kernel leftover, the book forgets it
            names = {n: exp for n, exp in lease.names.items() if exp > now and allowed(n)}
            scope = lease.scope
            if scope_of is not None and names:
                scope = EMPTY
                for n in names:
                    scope = scope.union(scope_of(n))
            need = len(scope.ports.elements())
            over = self.cap > 0 and book._elems + need > book.elem_cap
            if not names or denied(ip) or scope.is_empty() or over:
                revoked.append(ip)
                continue
            same = same and scope == lease.scope and lease.held == scope.ports
            book._leases[ip] = Lease(lease.expiry, names, scope, scope.ports)
            book._elems += need
            book._next_end = min(book._next_end, lease.expiry + COUNT_GRACE_S, *names.values())
            kept.append(Grant(ip, max(1, math.ceil(lease.expiry - now)), scope, shared=shared))
        intact = same and len(kept) == len(self._leases) and shared == self.shared
        return Narrowed(book, tuple(kept), tuple(revoked), intact=intact)


def _growth(ports: Scope, held: Scope) -> int:
    """The port elements a step that writes ``ports`` over ``held`` adds (negative: frees): a
    changed, non-empty scope replaces the held elements; an empty one leaves them to expire."""
    if ports == held or ports.is_empty():
        return 0
    return len(ports.elements()) - len(held.elements())


def admissible(
    book: LeaseBook,
    effective: NetworkPolicy,
    leases: Sequence[tuple[IPAddress, int]],
    name: str | None,
    now: float,
    *,
    name_check: bool = False,
) -> list[Grant]:
    """What of one answer may enter the subject's dyn sets now, with the seconds the kernel
    elements must get; nothing is recorded (:meth:`LeaseBook.record` once the kernel took it).

    Decided against the policy in force now (docs/reference/behaviour.md §14.1): an answer (``name``, normalised,
    the question it was for) only while that name is admitted; a connection refresh (``name``
    None) only for addresses a still-admitted name taught, never wider than its scope. An
    answer's leases open the name's scope (docs/reference/behaviour.md §18; ``name_check``: the
    name check is on, UDP 443 only by an explicit udp rule). Then the lease cap (14.4).
    """
    return admissible_many(book, effective, [(leases, name)], now, name_check=name_check)[0]


def admissible_many(
    book: LeaseBook,
    effective: NetworkPolicy,
    asks: Sequence[tuple[Sequence[tuple[IPAddress, int]], str | None]],
    now: float,
    *,
    name_check: bool = False,
    hash_ranges: bool = True,
) -> list[list[Grant]]:
    """:func:`admissible` for several answers (``(leases, name)`` each) that one kernel
    transaction will carry, in order: each decided as if the earlier ones were recorded
    (:meth:`LeaseBook.admit_many`).

    ``hash_ranges`` False: no lease takes the hash path (every range as its own pipapo
    element). For a kernel in doubt after an unanswered policy step: it may hold the new
    policy's shared ranges while ``effective`` is the old one, and an address in ``dynr``
    opens whatever the kernel's ``dynrports`` holds; a pipapo element opens only its own
    ports, whichever policy the kernel holds. The book then records no shared ranges, so
    the next policy step rewrites the dyn sets."""
    plans: list[tuple[Iterable[tuple[IPAddress, int]], LeaseScope | None]] = []
    shared = shared_ranges(effective, name_check=name_check) if hash_ranges else Scope.EMPTY
    renewing: Callable[[str], bool] | None = None
    for leases, name in asks:
        if name is not None:
            if not name_admitted(effective, name):
                plans.append(((), WHOLE))
                continue
            scope = lease_scope(effective, name, name_check=name_check)
            plans.append(((), scope) if scope.is_empty() else (leases, scope))
            continue
        if renewing is None:
            renewing = names_admitted(effective)
        renew = set(book.renewable((ip for ip, _ in leases), renewing, now))
        plans.append(([(ip, sec) for ip, sec in leases if ip in renew], None))
    return book.admit_many(plans, now, shared)


def narrowed_for(
    book: LeaseBook,
    effective: NetworkPolicy,
    deny_v4: Sequence[Prefix],
    deny_v6: Sequence[Prefix],
    now: float,
    *,
    name_check: bool = False,
) -> Narrowed:
    """The book under a new effective policy whose deny sets the kernel will hold are
    ``deny_v4``/``deny_v6``: a lease stays only if a name that taught it is still admitted
    and no deny prefix covers it (docs/reference/behaviour.md §14.1), opening the union of
    those names' scopes under the new policy (§18)."""
    memo: dict[str, LeaseScope] = {}

    def scope_of(name: str) -> LeaseScope:
        hit = memo.get(name)
        if hit is None:
            hit = memo[name] = lease_scope(effective, name, name_check=name_check)
        return hit

    shared = shared_ranges(effective, name_check=name_check)
    return book.narrowed(names_admitted(effective), covered_by(deny_v4, deny_v6), now, scope_of, shared)


def destination_verified(
    book: LeaseBook | None, sets: IpSets | None, name: str, dst: IPAddress, now: float
) -> bool:
    """May the MITM send ``name``'s credentials to ``dst`` (§10)?

    Only if the DNS proxy answered ``name`` (normalised) with ``dst`` and that lease still
    runs, or an explicit IP/CIDR allow rule of the subject's effective policy (``sets``; not
    ``defaultAction: allow``) covers ``dst`` and no deny rule does. A sandbox that forges
    Host/SNI towards an address of its choice therefore never receives a credential.
    """
    if book is not None and book.verified(dst, name, now):
        return True
    return sets is not None and sets.explicitly_allows(dst)


def destination_verified_until(
    book: LeaseBook | None, sets: IpSets | None, name: str, dst: IPAddress, now: float
) -> float:
    """:func:`destination_verified` with its deadline (monotonic; ``math.inf`` for an explicit IP
    rule, 0.0 when not verified): until then only a narrowing can end it (docs/reference/behaviour.md §10, "answered
    from memory")."""
    until = book.verified_until(dst, name, now) if book is not None else 0.0
    if until > now:
        return until
    return math.inf if sets is not None and sets.explicitly_allows(dst) else 0.0


def name_admitted(effective: NetworkPolicy, name: str) -> bool:
    """May an answer for ``name`` (normalised) be learned? Allowed and not merely audited: an
    audit would-deny is answered but never learned."""
    judged = judge_domain(effective, name)
    return judged.verdict is Verdict.ALLOW and not judged.would_deny


def names_admitted(effective: NetworkPolicy) -> Callable[[str], bool]:
    """:func:`name_admitted` for many leases at once: each distinct name judged once."""
    memo: dict[str, bool] = {}

    def admitted(name: str) -> bool:
        hit = memo.get(name)
        if hit is None:
            hit = memo[name] = name_admitted(effective, name)
        return hit

    return admitted
