"""Where a DNS lease's port elements live in the kernel (docs/concepts/ruleset.md, "port-scoped
sets"): the hash path, or the hash set and the pipapo set. Pure; both profiles.

A lease's port elements (:class:`egressd.subject.scopes.LeaseScope` ``ports``) go either

* to the *hash path*: the address alone in a timeout hash set (``dynr``), looked up with the
  subject's *shared scope* (``dynrports``, ``proto . lo-hi`` elements written with the
  policy): an address there opens exactly the shared scope, its single ports and its ranges.
  Taken when the lease's port scope equals the shared scope exactly: one element, one set,
  like an address-only lease in ``dyn``;
* or, otherwise, by shape: single ports to a hash set keyed ``addr . proto . port``
  (``dynpx``), ranges to the pipapo set ``dynp`` (``addr . proto . lo-hi``), as before.

The shared scope is a function of the effective policy alone (:func:`shared_ranges`), so it
changes only with the policy, and a policy change that changes it rewrites every lease in the
same transaction (the lease book's narrowing counts it as a change,
:meth:`egressd.subject.leases.LeaseBook.narrowed`). A lease's elements are therefore held
where :func:`placement` says under the shared scope in force.
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
    """The subject's shared scope under ``policy``: the port scope (TCP and UDP ports, single
    ones and ranges) of the first domain allow rule (in rule order) that has a range, as a
    lease decided by that rule alone holds it (with the name check on, UDP 443 only for a
    ``protocol: udp`` rule, as :func:`egressd.subject.scopes.lease_scope` cuts it). Empty when
    no such rule: a policy of single ports only needs no hash path (``dynpx`` is one).

    The first such rule, not the most frequent scope: any choice is correct (a lease whose
    scope differs takes ``dynpx`` and ``dynp``), the first is the one rule-order readers
    expect and costs one pass; policies with several distinct ranged scopes are rare."""
    for rule in policy.egress:
        if rule.kind is not TargetKind.DOMAIN or rule.action is not Verdict.ALLOW:
            continue
        if rule.scope.is_whole() or rule.judges_requests:
            continue
        scope = rule.scope
        if name_check and rule.protocol != "udp":
            scope = scope.minus(QUIC)
        if not range_part(scope).is_empty():
            # Ports only: ``dynrports`` holds ``proto . port`` elements (a lease's ``other``
            # is never on the hash path, as it is in no port set).
            return Scope(scope.tcp, scope.udp)
    return Scope.EMPTY


def on_hash_path(ports: Scope, shared: Scope) -> bool:
    """Is a lease of port scope ``ports`` held as its address alone in ``dynr``?"""
    return not shared.is_empty() and ports == shared


def pipapo_elements(ports: Scope, shared: Scope) -> tuple[tuple[str, int, int], ...]:
    """The ``(proto, lo, hi)`` elements of ``ports`` the pipapo ``dynp`` set holds: its ranges,
    unless it takes the hash path."""
    if on_hash_path(ports, shared):
        return ()
    return range_part(ports).elements()


def single_elements(ports: Scope, shared: Scope = Scope.EMPTY) -> tuple[tuple[str, int, int], ...]:
    """The single-port elements of ``ports`` the hash set ``dynpx`` holds, unless it takes the
    hash path."""
    if on_hash_path(ports, shared):
        return ()
    return tuple(e for e in ports.elements() if e[1] == e[2])


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one port scope's elements live under the shared scope: ``single`` in the hash
    set ``dynpx`` (:func:`single_elements`), ``pipapo`` in ``dynp`` (:func:`pipapo_elements`),
    and ``hashed``: the address in ``dynr`` (:func:`on_hash_path`)."""

    single: tuple[tuple[str, int, int], ...] = ()
    pipapo: tuple[tuple[str, int, int], ...] = ()
    hashed: bool = False


NOWHERE = Placement()
HASHED = Placement(hashed=True)


def placement(ports: Scope, shared: Scope) -> Placement:
    """The three answers for ``ports`` at once (the DNS reply path asks them for every
    port-scoped lease, for what it gets and what it held)."""
    if ports.is_empty():
        return NOWHERE
    if on_hash_path(ports, shared):
        return HASHED
    return Placement(single_elements(ports), range_part(ports).elements())
