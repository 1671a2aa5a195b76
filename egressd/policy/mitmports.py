"""Which TCP ports of a subject pass through the MITM (docs/reference/behaviour.md §18). Pure.

Every TCP connection to 80 and 443 (and to the operator's
``OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS``) is intercepted for every subject; besides those,
a subject's connections to each port that one of its rules names with protocol ``http`` or
``https`` (allow or deny, request rules included), or that a domain rule names with ``ports``
and no ``protocol`` (any protocol: HTTPS too), are intercepted, so the name the connection asks
for is checked there as well: a rule that opens ``api.x.io`` on 8443 must not open the other
sites of api.x.io's CDN address on 8443. A ``tcp`` rule says "these bytes, whatever they
carry": its ports are not intercepted (docs/deviations.md). What the MITM admits without a
name there (neither TLS nor HTTP, or a silent client of a server-first protocol) is
:func:`egressd.policy.namecheck.check_name`'s ``Wire.TCP`` rule.

Always-rules are bare targets (no protocol, no ports): they never name a port, so an
always-rules reload never changes a subject's named ports.

DNS ports are never intercepted: TCP 53 of a sandbox is the DNS proxy's (or an exempt
nameserver's) and 853 (DNS over TLS) is refused by the kernel whatever the policy says; an
interception would carry it past that refusal. A rule with ``methods``/``paths`` on those
ports cannot be enforced (:func:`egressd.policy.requests.unenforceable_problem`).
"""

from __future__ import annotations

from typing import Final

from egressd.policy.model import NetworkPolicy, Rule, TargetKind
from egressd.policy.scope import PortRange, Scope

__all__ = ["FIXED_PORTS", "NEVER_INTERCEPTED", "intercepts", "named_ports", "never_intercepted"]

#: Intercepted for every subject, whatever its policy.
FIXED_PORTS: Final = (80, 443)
#: Never intercepted, whatever a rule names (DNS, DNS over TLS).
NEVER_INTERCEPTED: Final = Scope.of(tcp=[(53, 53), (853, 853)])


def named_ports(policy: NetworkPolicy, fixed: tuple[int, ...] = FIXED_PORTS) -> tuple[PortRange, ...]:
    """The TCP port ranges ``policy``'s ``http``/``https`` rules (and its domain rules with
    ``ports`` and no ``protocol``) name, beyond ``fixed`` (80, 443
    and the extra ports) and the DNS ports: what the kernel must send to the MITM for this
    subject on top of what it sends for everyone. Sorted, merged, disjoint."""
    named = Scope.EMPTY
    for rule in policy.egress:
        if rule.about_http or _any_protocol_on_ports(rule):
            named = named.union(Scope(tcp=rule.scope.tcp))
    rest = named.minus(NEVER_INTERCEPTED).minus(Scope.of(tcp=[(p, p) for p in fixed]))
    return rest.tcp


def _any_protocol_on_ports(rule: Rule) -> bool:
    """A domain rule with ``ports`` and no ``protocol``: HTTPS on those ports is one of the
    protocols it opens, so its name is checked there."""
    return rule.kind is TargetKind.DOMAIN and rule.protocol is None and rule.ports is not None


def intercepts(policy: NetworkPolicy | None, fixed: tuple[int, ...], port: int) -> bool:
    """Does a TCP connection to ``port`` of a subject with ``policy`` pass through the MITM
    (``fixed``: 80, 443 and the extra ports)?"""
    if port in fixed:
        return True
    return policy is not None and any(lo <= port <= hi for lo, hi in named_ports(policy, fixed))


def never_intercepted(scope: Scope) -> bool:
    """Does ``scope`` hold a TCP port that is never intercepted (53, 853)?"""
    return not scope.intersect(Scope(tcp=NEVER_INTERCEPTED.tcp)).is_empty()
