"""Names on the wire (docs/reference/behaviour.md §18): may the name a connection asks for
(the TLS ClientHello SNI, the plain-HTTP ``Host``) reach that address and port? Pure.

With the MITM on, every TCP connection of a subject to ports 80 and 443 (and to the extra
ports and the ports its ``http``/``https`` rules name: :mod:`egressd.policy.mitmports`)
passes through it,
and it admits the connection (TLS) or the request (plain HTTP) only when :func:`check_name`
says so. The inputs are plain data: the subject's effective policy (always-rules included),
its IP sets, the names that taught this subject the destination through its DNS proxy
(``taught``: the questions whose answers carried it, CNAME chains included, since the
question is what a lease records) and the destination.

The rule, in order:

1. A name that a deny rule matches (first match, for TCP on that port) is refused on any
   address, also under ``defaultAction: allow``.
2. An address that an allow IP/CIDR rule or ``defaultAction: allow`` opens admits any other
   name, and no name at all (TLS without SNI, an HTTP request without ``Host``).
3. Otherwise the destination is open (if at all) only because the subject learned it: the
   name must be allowed by the policy for TCP on that port, and be one that taught this
   subject that address.

A connection that carries no name and speaks neither TLS nor HTTP (``Wire.TCP``: SSH, a
database, a server-first protocol) is judged by what opens its destination: an address rule or
``defaultAction: allow`` (rule 2), or a name that taught this subject the address and whose
deciding rule allows TCP on that port without limiting it to ``http``/``https`` (a ``tcp`` rule
or one without ``protocol``). The name check guards the names TLS and HTTP carry; it does not
take from a ``tcp`` rule the bytes its author allowed.

A refusal carries a :class:`NameReason`. In audit mode a refusal by the user's policy is a
would-deny (admitted, reported); an operator always-deny rule stays hard.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

from egressd.addr import IPAddress
from egressd.policy.audit import is_hard, rule_label
from egressd.policy.evaluate import domain_matches, name_scope, normalise_name
from egressd.policy.ipsets import IpSets
from egressd.policy.model import NetworkPolicy, TargetKind, Verdict
from egressd.policy.scope import Scope

__all__ = [
    "NameReason",
    "NameVerdict",
    "Wire",
    "address_opens",
    "address_scope",
    "check_name",
    "deciding_rule",
    "denied_by_rule",
]


class Wire(enum.StrEnum):
    """Where the name came from: a TLS ClientHello (SNI) or a plain-HTTP request (``Host``);
    ``tcp``: neither (a client whose first bytes are neither TLS nor HTTP, or one that stays
    silent while a server-first protocol waits for its server): no name at all."""

    TLS = "tls"
    HTTP = "http"
    TCP = "tcp"


class NameReason(enum.StrEnum):
    """Why a name was refused (logged, posted and returned as is)."""

    SNI_NOT_ALLOWED = "sni_not_allowed"
    SNI_NOT_LEARNED = "sni_not_learned"
    NO_SNI = "no_sni"
    HOST_NOT_ALLOWED = "host_not_allowed"
    PORT_NOT_ALLOWED = "port_not_allowed"


@dataclass(frozen=True, slots=True)
class NameVerdict:
    """``admit``: let the connection (request) through. ``reason``: why it is refused, or
    would be (``would_deny``: an audit policy lets it pass). ``rule``: the label of the rule
    that decided (``default`` for the defaultAction; ``address`` when an address rule or the
    defaultAction opened the destination; ``lease`` for a learned destination)."""

    admit: bool
    reason: NameReason | None = None
    rule: str = "default"
    would_deny: bool = False
    #: Until when (monotonic) an admission holds absent a narrowing: the lease's, or ``inf`` for
    #: an address rule; 0.0 unknown (the caller fills it in: this module has no clock).
    until: float = 0.0


def address_scope(policy: NetworkPolicy, sets: IpSets, dst: IPAddress) -> Scope:
    """What address rules open for ``dst``: the IP/CIDR allow rules (deny beats allow), and
    ``defaultAction: allow`` (0.0.0.0/0 and ::/0 in the allow set) unless a deny rule covers it."""
    opened = sets.ip_scope(dst)
    if policy.default_action is Verdict.ALLOW and sets.deny_hit(dst) is None:
        rest = Scope.WHOLE
        for net, scope in sets.deny_scoped:
            if dst.version == net.version and dst in net:
                rest = rest.minus(scope)
        opened = opened.union(rest)
    return opened


def address_opens(policy: NetworkPolicy, sets: IpSets, dst: IPAddress, port: int) -> bool:
    """Does an address rule (an allow IP/CIDR rule, or ``defaultAction: allow``) open ``dst``
    for TCP on ``port``?"""
    return address_scope(policy, sets, dst).admits("tcp", port)


def deciding_rule(policy: NetworkPolicy, name: str, port: int) -> tuple[int | None, Verdict]:
    """First match for ``name`` (normalised) and TCP on ``port``: (index of the deciding domain
    rule in ``policy.egress``, its action); (None, defaultAction) when no rule covers that port."""
    for i, rule in enumerate(policy.egress):
        if rule.action is Verdict.DENY and rule.judges_requests:
            continue  # it denies requests, not the name (§19): the request rules judge those
        if (
            rule.kind is TargetKind.DOMAIN
            and rule.scope.admits("tcp", port)
            and domain_matches(rule.target, name)
        ):
            return i, rule.action
    return None, policy.default_action


def denied_by_rule(policy: NetworkPolicy, name: str, port: int) -> int | None:
    """The index (in ``policy.egress``) of the deny rule that decides ``name`` for TCP on
    ``port``, or None when no deny rule does (an allow rule or the defaultAction decides)."""
    index, verdict = deciding_rule(policy, normalise_name(name), port)
    return index if verdict is Verdict.DENY else None


def check_name(
    policy: NetworkPolicy,
    sets: IpSets,
    *,
    wire: Wire,
    name: str | None,
    dst: IPAddress,
    port: int,
    taught: Collection[str],
) -> NameVerdict:
    """May a connection to ``dst``:``port`` (TCP) that asks for ``name`` pass (§18)?

    ``name``: the SNI or ``Host`` as a DNS name (A-labels; None when absent or not a DNS name,
    e.g. an IP literal). ``taught``: the (normalised) names that taught this subject ``dst``
    through its DNS proxy and whose leases still run.
    """
    tls = wire is Wire.TLS
    not_allowed = NameReason.SNI_NOT_ALLOWED if tls else NameReason.HOST_NOT_ALLOWED
    opened = address_opens(policy, sets, dst, port)
    if wire is Wire.TCP:
        if opened:
            return NameVerdict(True, rule="address")
        return _nameless(policy, port, taught)
    if not name:
        if opened:
            return NameVerdict(True, rule="address")
        return _refuse(policy, NameReason.NO_SNI if tls else NameReason.HOST_NOT_ALLOWED, None)
    name = normalise_name(name)
    deny_index = denied_by_rule(policy, name, port)
    if deny_index is not None:
        return _refuse(policy, not_allowed, deny_index)
    if opened:
        return NameVerdict(True, rule="address")
    index, verdict = deciding_rule(policy, name, port)
    if verdict is not Verdict.ALLOW:
        somewhere = not name_scope(policy, name).is_empty()
        return _refuse(policy, NameReason.PORT_NOT_ALLOWED if somewhere else not_allowed, index)
    if name not in taught:
        return _refuse(policy, NameReason.SNI_NOT_LEARNED if tls else NameReason.HOST_NOT_ALLOWED, index)
    return NameVerdict(True, rule="lease")


def _nameless(policy: NetworkPolicy, port: int, taught: Collection[str]) -> NameVerdict:
    """``Wire.TCP`` on a learned-only destination: admitted when a name that taught it is
    allowed for TCP on ``port`` by a rule that is not about HTTP(S) alone."""
    index: int | None = None
    for name in sorted(taught):
        index, verdict = deciding_rule(policy, normalise_name(name), port)
        if verdict is Verdict.ALLOW and index is not None and not policy.egress[index].about_http:
            return NameVerdict(True, rule="lease")
    return _refuse(policy, NameReason.NO_SNI, index)


def _refuse(policy: NetworkPolicy, reason: NameReason, index: int | None) -> NameVerdict:
    label = rule_label(policy, index)
    if policy.audit and not is_hard(policy, index):
        return NameVerdict(True, reason, label, would_deny=True)
    return NameVerdict(False, reason, label)
