"""What the kernel's sets decide for one destination address of a subject. Pure.

Used by enforcement (flow cuts after a narrowing, both profiles) and by ``egressctl explain``.
"""

from __future__ import annotations

from egressd.addr import IPAddress
from egressd.policy import NetworkPolicy, Verdict
from egressd.policy.audit import AuditDenySets, audit_deny_sets
from egressd.policy.ipsets import IpSets, ip_sets


def hard_denied(effective: NetworkPolicy, ip: IPAddress, split: AuditDenySets | None = None) -> bool:
    """Denied by always-deny (audit never softens it). ``split`` (``audit_deny_sets(effective)``)
    may be passed in when deciding many destinations."""
    split = split if split is not None else audit_deny_sets(effective)
    hard = split.hard_v4 if ip.version == 4 else split.hard_v6
    return any(ip in net for net in hard)


def ip_decision(
    effective: NetworkPolicy,
    leases: dict[IPAddress, float],
    ip: IPAddress,
    now: float,
    sets: IpSets | None = None,
) -> tuple[Verdict, str, str]:
    """What the kernel sets decide for a destination: (verdict, set, reason).

    ``sets`` (``ip_sets(effective)``) may be passed in when deciding many destinations."""
    sets = sets if sets is not None else ip_sets(effective)
    hit = sets.deny_hit(ip)
    if hit is not None:
        return Verdict.DENY, "deny", f"in the deny set ({hit}); deny beats allow"
    hit = sets.allow_hit(ip)
    if hit is not None:
        return Verdict.ALLOW, "allow", f"in the allow set ({hit})"
    expiry = leases.get(ip)
    if expiry is not None and expiry > now:
        return Verdict.ALLOW, "dyn", f"DNS-learned lease, {int(expiry - now)} s left"
    if effective.default_action is Verdict.ALLOW:
        return Verdict.ALLOW, "allow", "defaultAction allow (0.0.0.0/0, ::/0 in the allow set)"
    return Verdict.DENY, "", "not allowed and not learned through DNS: unmarked, dropped"
