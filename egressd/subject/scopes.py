"""What a DNS lease opens (docs/reference/behaviour.md §18): the ports and protocols of the names that
taught it, as the kernel holds them. Pure; both profiles.

A name's scope is :func:`egressd.policy.scope.name_scope`. The kernel holds a lease in one of
two shapes, so the cheap path of today stays for rules without ports:

* *whole* (some teaching name's scope is every port and protocol): the address alone, in the
  address-only dyn set. With the name check on (``EGRESSD_NAME_CHECK``), the dyn set's rules do
  not open UDP 443 (QUIC: no name egressd can check), so the only port element such a lease can
  need is UDP 443, opened when an explicit ``protocol: udp`` rule decided that name's UDP 443;
* otherwise *ports*: ``address . proto . port-range`` elements in the port-scoped dyn set, one per
  range of the scope (a scope that is not whole never opens other protocols).

With the name check on, a name's UDP 443 counts only when an explicit ``protocol: udp`` rule
decides it, whatever the name's scope says.
"""

from __future__ import annotations

from dataclasses import dataclass

from egressd.policy import NetworkPolicy, Verdict, name_scope
from egressd.policy.evaluate import domain_matches
from egressd.policy.model import TargetKind
from egressd.policy.scope import Scope

#: UDP 443: QUIC, refused to DNS-learned addresses unless an explicit udp rule opens it.
QUIC = Scope(udp=((443, 443),))


@dataclass(frozen=True, slots=True)
class LeaseScope:
    """What a lease opens. ``whole``: the address on every port and protocol (the address-only
    dyn set; with the name check on, UDP 443 only if ``ports`` admits it). ``ports``: the
    port-scoped elements the kernel holds for it (for a whole lease at most UDP 443)."""

    whole: bool
    ports: Scope

    def union(self, other: LeaseScope) -> LeaseScope:
        return normalised(self.whole or other.whole, self.ports.union(other.ports))

    def is_empty(self) -> bool:
        return not self.whole and self.ports.is_empty()

    def admits(self, proto: str, port: int | None, *, name_check: bool) -> bool:
        """Does the kernel's rule for this lease accept ``proto``/``port``?"""
        if self.ports.admits(proto, port):
            return True
        if not self.whole:
            return False
        return not (name_check and proto == "udp" and port == 443)

    def elements(self) -> tuple[tuple[str, int, int], ...]:
        """The port-scoped elements the kernel holds for the lease (besides its address in
        the address-only set when ``whole``)."""
        return self.ports.elements()


EMPTY = LeaseScope(False, Scope.EMPTY)
WHOLE = LeaseScope(True, Scope.EMPTY)


def normalised(whole: bool, ports: Scope) -> LeaseScope:
    """A whole lease needs no port element but UDP 443 (the only thing its rule refuses)."""
    return LeaseScope(True, ports.intersect(QUIC)) if whole else LeaseScope(False, ports)


def explicit_udp(policy: NetworkPolicy, name: str, port: int = 443) -> bool:
    """Is ``name``'s UDP ``port`` decided by an allow rule that names ``protocol: udp``?
    (First match per port and protocol, as :func:`name_scope` decides; none: the
    defaultAction decides, which is not explicit.)"""
    for rule in policy.egress:
        if rule.kind is not TargetKind.DOMAIN or not domain_matches(rule.target, name):
            continue
        if rule.scope.admits("udp", port):
            return rule.action is Verdict.ALLOW and rule.protocol == "udp"
    return False


def lease_scope(policy: NetworkPolicy, name: str, *, name_check: bool) -> LeaseScope:
    """What an answer for ``name`` (normalised, admitted) opens under ``policy``."""
    scope = name_scope(policy, name)
    quic = name_check and scope.admits("udp", 443) and explicit_udp(policy, name)
    if scope.is_whole():
        return normalised(True, QUIC if quic else Scope.EMPTY)
    if name_check and not quic:
        scope = scope.minus(QUIC)
    return LeaseScope(False, scope)
