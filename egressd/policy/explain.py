"""Why a destination is allowed or blocked for a sandbox (``egressctl explain``). Pure."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Collection
from typing import Any

from egressd.addr import IPAddress, unmap_ip
from egressd.policy import NetworkPolicy, TargetKind, Verdict, evaluate_domain, judge_domain, parse_target
from egressd.policy.decide import hard_denied, ip_decision
from egressd.policy.evaluate import name_scope
from egressd.policy.ipsets import ip_sets
from egressd.policy.mitmports import FIXED_PORTS, intercepts
from egressd.policy.namecheck import Wire, address_opens, address_scope, check_name, denied_by_rule
from egressd.policy.requests import daemon_intercepted_ports


def _rule_json(action: Verdict, target: str) -> dict[str, str]:
    return {"action": action.value, "target": target}


def explain(
    *,
    state: str | None,
    effective: NetworkPolicy | None,
    leases: dict[IPAddress, float],
    target: str,
    now: float,
    port: int | None = None,
    name_check: bool = False,
    taught: Callable[[IPAddress], Collection[str]] | None = None,
) -> dict[str, Any]:
    """The decision for ``target`` (a name or an IP) under a subject's effective policy.

    ``state`` None means no subject has that source IP. Names are decided by the DNS proxy
    (first matching rule, else defaultAction); addresses by the kernel sets (deny beats
    allow, then DNS-learned leases, then defaultAction). With ``port`` (TCP), the answer says
    what that port gets, and with ``name_check`` (the MITM's, docs/reference/behaviour.md §18)
    which TLS SNI / HTTP Host names a connection there is admitted with (``taught``: the names
    that taught the subject an address).
    """
    out: dict[str, Any] = {"target": target, "state": state or "absent", "port": port}
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
        if port is not None:
            _name_port(out, effective, text, port)
        out["nameCheck"] = _name_check_for_name(effective, text, port, name_check)
    else:
        out.update(_explain_address(effective, leases, text, now))
        ip = unmap_ip(ipaddress.ip_address(text.split("/", 1)[0]))
        if port is not None and out["decision"] == "allow":
            _address_port(out, effective, leases, ip, port, now)
        names = taught(ip) if taught is not None else ()
        out["nameCheck"] = _name_check_for_address(effective, ip, port, name_check, names, out["decision"])
    return out


def _name_port(out: dict[str, Any], effective: NetworkPolicy, name: str, port: int) -> None:
    """A name allowed somewhere but not on ``port`` (TCP): denied there (§18)."""
    scope = name_scope(effective, name)
    out["scope"] = scope.describe()
    if out["decision"] == "allow" and not scope.admits("tcp", port):
        out["decision"] = "deny"
        out["reason"] += f"; but not on tcp {port}: the name is open on {scope.describe()} only"


def _address_port(
    out: dict[str, Any], effective: NetworkPolicy, leases: dict[IPAddress, float], ip: IPAddress, port: int, now: float
) -> None:
    """An address whose address rules open other ports only, and no lease: denied on ``port``."""
    if out.get("set") == "dyn" or (ip in leases and leases[ip] > now):
        return  # a lease: the ports of the names that taught it (the kernel's dyn set)
    if not address_opens(effective, ip_sets(effective), ip, port):
        scope = address_scope(effective, ip_sets(effective), ip)
        out["decision"] = "deny"
        out["reason"] += f"; but not on tcp {port}: address rules open {scope.describe()} only"


_NOT_CHECKED = "off: TLS and HTTP to this destination are admitted at the address level"


def _checked(effective: NetworkPolicy, enabled: bool, port: int | None) -> str | None:
    if not enabled:
        return _NOT_CHECKED
    fixed = tuple(sorted(daemon_intercepted_ports() or FIXED_PORTS))
    if port is not None and not intercepts(effective, fixed, port):
        return (
            f"not checked on port {port} (the MITM intercepts TCP 80, 443, the extra ports and "
            "the ports this policy's http/https rules and its domain rules with ports and no protocol name)"
        )
    return None


def _name_check_for_name(effective: NetworkPolicy, name: str, port: int | None, enabled: bool) -> dict[str, Any]:
    skipped = _checked(effective, enabled, port)
    if skipped is not None:
        return {"enabled": enabled, "outcome": skipped}
    ports = [port] if port is not None else list(FIXED_PORTS)
    if all(denied_by_rule(effective, name, p) is not None for p in ports):
        outcome = "a TLS SNI or HTTP Host naming it is refused on any address (a deny rule matches it)"
    elif any(name_scope(effective, name).admits("tcp", p) for p in ports):
        outcome = (
            "a TLS SNI or HTTP Host naming it is admitted towards addresses this subject learned for it "
            "through DNS, and wherever an address rule or defaultAction allow opens the destination"
        )
    else:
        outcome = "admitted only where an address rule or defaultAction allow opens the destination"
    return {"enabled": True, "outcome": outcome}


def _name_check_for_address(
    effective: NetworkPolicy,
    ip: IPAddress,
    port: int | None,
    enabled: bool,
    taught: Collection[str],
    decision: str,
) -> dict[str, Any]:
    skipped = _checked(effective, enabled, port)
    if skipped is not None:
        return {"enabled": enabled, "outcome": skipped}
    if decision != "allow":
        return {"enabled": True, "outcome": "nothing: the destination is not open"}
    ports = [port] if port is not None else list(FIXED_PORTS)
    if any(address_opens(effective, ip_sets(effective), ip, p) for p in ports):
        outcome = "any SNI or Host that no deny rule refuses, and none, are admitted (an address rule opens it)"
        return {"enabled": True, "outcome": outcome}
    names = sorted(taught)
    sets = ip_sets(effective)
    nameless = all(
        check_name(effective, sets, wire=Wire.TCP, name=None, dst=ip, port=p, taught=frozenset(taught)).admit
        for p in ports
    )
    bytes_ = (
        "bytes that are neither TLS nor HTTP are admitted (a tcp or any-protocol rule allows a name that taught it)"
        if nameless
        else "no name (and bytes that are neither TLS nor HTTP): refused"
    )
    return {
        "enabled": True,
        "outcome": "only an SNI or Host naming a name that taught this subject the address (and that the "
        f"policy allows on the port); {bytes_}",
        "names": names,
    }


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
