"""Why a destination is allowed or blocked for a sandbox (``egressctl explain``). Pure."""

from __future__ import annotations

import ipaddress
from typing import Any

from egressd.addr import IPAddress, unmap_ip
from egressd.policy import NetworkPolicy, TargetKind, Verdict, evaluate_domain, judge_domain, parse_target
from egressd.policy.decide import hard_denied, ip_decision


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
        out.update(_explain_name(effective, text))
    else:
        out.update(_explain_address(effective, leases, text, now))
    return out


def _explain_name(effective: NetworkPolicy, name: str) -> dict[str, Any]:
    """What the DNS proxy does with a query for ``name``."""
    d = evaluate_domain(effective, name)
    judged = judge_domain(effective, name)
    if judged.would_deny:
        outcome = "; audit mode: would-deny, logged and counted, answered (not learned)"
    elif d.verdict is Verdict.ALLOW:
        outcome = "; the name resolves (answers become leases)"
    else:
        outcome = "; NXDOMAIN, never forwarded"
    out: dict[str, Any] = dict(
        layer="dns",
        decision=d.verdict.value,
        rule=_rule_json(d.rule.action, d.rule.target) if d.rule else None,
        ruleLabel=judged.rule,
        reason=(
            "first matching rule" if d.rule else f"no rule matches: defaultAction {effective.default_action}"
        )
        + outcome,
    )
    if judged.would_deny:
        out["wouldDeny"] = True
    return out


def _explain_address(
    effective: NetworkPolicy, leases: dict[IPAddress, float], text: str, now: float
) -> dict[str, Any]:
    """What the kernel sets do with a flow to the address (or a network's first address)."""
    out: dict[str, Any] = {}
    ip = unmap_ip(ipaddress.ip_address(text.split("/", 1)[0]))
    verdict, where, reason = ip_decision(effective, leases, ip, now)
    if verdict is Verdict.DENY and effective.audit and not hard_denied(effective, ip):
        out["wouldDeny"] = True
        reason += "; audit mode: would-deny, logged and counted, passes"
    out.update(layer="ip", decision=verdict.value, reason=reason)
    if where:
        out["set"] = where
    return out
