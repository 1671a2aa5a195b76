"""Audit (shadow) mode, profile-independent and pure: who decided, would it be enforced, and the
one evidence string that the DNS log line, the EDE text and the metric exemplar all share.

In audit mode (``"mode": "audit"`` in the policy) a denial by the *user's* policy (a deny rule
or the defaultAction) is a **would-deny**: logged and counted, but the traffic passes. Operator
always-deny rules stay hard: audit is the sandbox owner's switch and must never widen what the
operator forbids. Everything outside the policy (deny-first, unknown sources, lateral and
DoT/DoH drops) never reaches this module and is never audited.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network

from egressd.policy.evaluate import evaluate_domain
from egressd.policy.ipsets import ip_sets
from egressd.policy.model import NetworkPolicy, Verdict

DEFAULT_RULE = "default"
DECISION_ID_BYTES = 6  # 12 hex characters: short enough to grep, 2^48 values per process


def new_decision_id() -> str:
    return secrets.token_hex(DECISION_ID_BYTES)


def rule_label(policy: NetworkPolicy, index: int | None) -> str:
    """A bounded label for the rule at ``index`` of an effective policy's ``egress``.

    ``always-deny[i]`` / ``always-allow[i]`` for operator rules (index within their file),
    ``egress[i]`` for the user's (index in the user's own list, as they wrote it), ``default``
    when no rule matched. Never the target itself: labels must not carry names or addresses.
    """
    if index is None:
        return DEFAULT_RULE
    if index < policy.always_deny:
        return f"always-deny[{index}]"
    index -= policy.always_deny
    if index < policy.always_allow:
        return f"always-allow[{index}]"
    return f"egress[{index - policy.always_allow}]"


def is_hard(policy: NetworkPolicy, index: int | None) -> bool:
    """Is the rule at ``index`` enforced even in audit mode (an operator always-deny rule)?"""
    return index is not None and index < policy.always_deny


@dataclass(frozen=True, slots=True)
class Judgement:
    """``verdict`` is what happens; ``would_deny`` marks an audit pass the policy would have denied."""

    verdict: Verdict
    rule: str
    would_deny: bool = False


def judge_domain(policy: NetworkPolicy, name: str) -> Judgement:
    """The DNS-layer decision for ``name`` under an effective policy, audit mode included."""
    d = evaluate_domain(policy, name)
    label = rule_label(policy, d.index)
    if d.verdict is Verdict.ALLOW:
        return Judgement(Verdict.ALLOW, label)
    if policy.audit and not is_hard(policy, d.index):
        return Judgement(Verdict.ALLOW, label, would_deny=True)
    return Judgement(Verdict.DENY, label)


@dataclass(frozen=True, slots=True)
class AuditDenySets:
    """IP-layer split of an audit policy's deny prefixes: ``hard`` (always-deny, dropped) and
    ``soft`` (the user's deny rules: logged as would-deny, then passed)."""

    hard_v4: tuple[IPv4Network, ...]
    hard_v6: tuple[IPv6Network, ...]
    soft_v4: tuple[IPv4Network, ...]
    soft_v6: tuple[IPv6Network, ...]


def audit_deny_sets(policy: NetworkPolicy) -> AuditDenySets:
    hard = ip_sets(NetworkPolicy(Verdict.DENY, policy.egress[: policy.always_deny]))
    soft = ip_sets(NetworkPolicy(Verdict.DENY, policy.egress[policy.always_deny :]))
    return AuditDenySets(hard.deny_v4, hard.deny_v6, soft.deny_v4, soft.deny_v6)


def safe_token(text: str, limit: int = 160) -> str:
    """``text`` as one token for logs, EDE text and kernel log prefixes: printable ASCII without
    spaces or quotes (others become ``_``), so no subject name can forge a line or a field."""
    out = "".join(c if "!" <= c <= "~" and c not in "\"'\\" else "_" for c in text)
    return out[:limit]


def evidence(decision_id: str, subject: str, rule: str) -> str:
    """``decision=<id> subject=<s-uid> rule=<label>``: identical in the log line, the DNS
    answer's Extended DNS Error text and (as exemplar labels) the metric."""
    return f"decision={decision_id} subject={safe_token(subject) or '-'} rule={rule}"
