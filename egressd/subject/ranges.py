"""Where a DNS lease's port ranges live in the kernel (docs/concepts/ruleset.md, "port-scoped
sets"): the hash path or the pipapo set. Pure; both profiles.

A lease's port elements (:class:`egressd.subject.scopes.LeaseScope` ``ports``) split by shape:
single ports go to a hash set keyed ``addr . proto . port`` (``dynpx``); ranges go either

* to the *hash path*: the address alone in a timeout hash set (``dynr``), looked up with the
  subject's *shared ranges* (``dynrports``, ``proto . lo-hi`` elements written with the
  policy): an address there opens exactly the shared ranges. Taken when the lease's range
  part equals the shared ranges exactly;
* or, otherwise, to the pipapo set ``dynp`` (``addr . proto . lo-hi``), as before.

The shared ranges are a function of the effective policy alone (:func:`shared_ranges`), so
they change only with the policy, and a policy change that changes them rewrites every lease
in the same transaction (the lease book's narrowing counts it as a change,
:meth:`egressd.subject.leases.LeaseBook.narrowed`). A lease's range elements are therefore
held where :func:`on_hash_path` says under the shared ranges in force.
"""

from __future__ import annotations

from dataclasses import dataclass

from egressd.policy import NetworkPolicy, Verdict
from egressd.policy.model import TargetKind
from egressd.policy.scope import Scope
from egressd.subject.scopes import QUIC


def range_part(ports: Scope) -> Scope:
    """The ranges of ``ports`` (``lo < hi``); single ports and ``other`` left out."""
    return Scope(
        tuple((lo, hi) for lo, hi in ports.tcp if lo < hi),
        tuple((lo, hi) for lo, hi in ports.udp if lo < hi),
    )


def shared_ranges(policy: NetworkPolicy, *, name_check: bool) -> Scope:
    """The subject's shared ranges under ``policy``: the range part of the first domain allow
    rule (in rule order) that has one, as a lease decided by that rule alone holds it (with
    the name check on, UDP 443 only for a ``protocol: udp`` rule, as
    :func:`egressd.subject.scopes.lease_scope` cuts it). Empty when no such rule.

    The first such rule, not the most frequent range: any choice is correct (a lease whose
    ranges differ takes the pipapo path), the first is the one rule-order readers expect and
    costs one pass; policies with several distinct ranges are rare."""
    for rule in policy.egress:
        if rule.kind is not TargetKind.DOMAIN or rule.action is not Verdict.ALLOW:
            continue
        if rule.scope.is_whole() or rule.judges_requests:
            continue
        scope = rule.scope
        if name_check and rule.protocol != "udp":
            scope = scope.minus(QUIC)
        ranges = range_part(scope)
        if not ranges.is_empty():
            return ranges
    return Scope.EMPTY


def on_hash_path(ports: Scope, shared: Scope) -> bool:
    """Are a lease's ranges (of its port scope ``ports``) held as its address in ``dynr``?"""
    return not shared.is_empty() and range_part(ports) == shared


def pipapo_elements(ports: Scope, shared: Scope) -> tuple[tuple[str, int, int], ...]:
    """The ``(proto, lo, hi)`` elements of ``ports`` the pipapo ``dynp`` set holds: its ranges,
    unless they take the hash path."""
    if on_hash_path(ports, shared):
        return ()
    return range_part(ports).elements()


def single_elements(ports: Scope) -> tuple[tuple[str, int, int], ...]:
    """The single-port elements of ``ports`` (the hash set ``dynpx``)."""
    return tuple(e for e in ports.elements() if e[1] == e[2])


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one port scope's elements live under the shared ranges: ``single`` in the hash
    set ``dynpx`` (:func:`single_elements`), ``pipapo`` in ``dynp`` (:func:`pipapo_elements`),
    and ``hashed``: the address in ``dynr`` (:func:`on_hash_path`)."""

    single: tuple[tuple[str, int, int], ...] = ()
    pipapo: tuple[tuple[str, int, int], ...] = ()
    hashed: bool = False


NOWHERE = Placement()


def placement(ports: Scope, shared: Scope) -> Placement:
    """The three answers for ``ports`` at once, its ranges taken apart once (the DNS reply
    path asks them for every port-scoped lease, for what it gets and what it held)."""
    if ports.is_empty():
        return NOWHERE
    ranges = range_part(ports)
    hashed = not shared.is_empty() and ranges == shared
    return Placement(single_elements(ports), () if hashed else ranges.elements(), hashed)
