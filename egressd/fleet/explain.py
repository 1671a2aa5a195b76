"""Why a destination is allowed or blocked for a sandbox (``egressctl explain``). Pure."""

from __future__ import annotations

import ipaddress
from typing import Any

from egressd.policy import NetworkPolicy, TargetKind, Verdict, evaluate_domain, judge_domain, parse_target
from egressd.policy.audit import AuditDenySets, audit_deny_sets
from egressd.policy.ipsets import IpSets, ip_sets
from egressd.subject.model import IPAddress, unmap_ip


def _rule_json(action: Verdict, target: str) -> dict[str, str]:
    return {"action": action.value, "target": target}


def explain(
    *,
    state: str | None,
    effective: NetworkPolicy | None,
    leases: dict[IPAddress, float],
    target: str,
    now: float,
) -> dict[str, Any]:
    """The decision for ``target`` (a name or an IP) under a subject's effective policy.

    ``state`` None means no subject has that source IP. Names are decided by the DNS proxy
    (first matching rule, else defaultAction); addresses by the kernel sets (deny beats
    allow, then DNS-learned leases, then defaultAction).
    """
    out: dict[str, Any] = {"target": target, "state": state or "absent"}
    if state is None:
        out.update(
            decision="deny", layer="dispatch", reason="no subject has this source IP: unmarked, dropped"
        )
        return out
    if effective is None:
        out.update(
            decision="deny", layer="dispatch", reason="subject is denying (deny-first): everything dropped"
        )
        return out
    try:
        text, kind, _ = parse_target(target)
    except ValueError as exc:
        out.update(decision="invalid", reason=str(exc))
        return out
    out["auditMode"] = effective.audit
    if kind is TargetKind.DOMAIN:
        d = evaluate_domain(effective, text)
        judged = judge_domain(effective, text)
        if judged.would_deny:
            outcome = "; audit mode: would-deny, logged and counted, answered (not learned)"
        elif d.verdict is Verdict.ALLOW:
            outcome = "; the name resolves (answers become leases)"
        else:
            outcome = "; NXDOMAIN, never forwarded"
        out.update(
            layer="dns",
            decision=d.verdict.value,
            rule=_rule_json(d.rule.action, d.rule.target) if d.rule else None,
            ruleLabel=judged.rule,
            reason=(
                "first matching rule"
                if d.rule
                else f"no rule matches: defaultAction {effective.default_action}"
            )
            + outcome,
        )
        if judged.would_deny:
            out["wouldDeny"] = True
        return out
    ip = unmap_ip(ipaddress.ip_address(text.split("/", 1)[0]))
    verdict, where, reason = ip_decision(effective, leases, ip, now)
    if verdict is Verdict.DENY and effective.audit and not hard_denied(effective, ip):
        out["wouldDeny"] = True
        reason += "; audit mode: would-deny, logged and counted, passes"
    out.update(layer="ip", decision=verdict.value, reason=reason)
    if where:
        out["set"] = where
    return out


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
