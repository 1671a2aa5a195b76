"""Per-query decisions of the DNS proxy (BEHAVIOUR §7), pure: parsed query + policy in, verdict out."""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from dnslib import EDNS0, QTYPE, RCODE, DNSRecord

from egressd.policy import NetworkPolicy, Verdict, judge_domain
from egressd.subject.model import IPAddress

LEASE_MIN_S = 60
LEASE_MAX_S = 360
LEASE_SLACK_S = 60
EDNS_UDP_SIZE = 4096


class Action(enum.StrEnum):
    FORWARD = "forward"
    NXDOMAIN = "nxdomain"
    FORMERR = "formerr"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    # for logs and metrics: "allowed", "would_deny", "unknown_source", "denying", "policy", "no_question"
    reason: str
    name: str = ""
    rule: str = ""  # which rule decided a denial or would-deny ("egress[2]", "default", "denying", ...)
    would_deny: bool = False  # FORWARD only because the subject audits: its policy denies the name


def lease_seconds(ttl: int, lo: int = LEASE_MIN_S, hi: int = LEASE_MAX_S) -> int:
    """clamp(TTL + 60, 60, 360): TTL 0 -> 60, 30 -> 90, 300 -> 360, 86400 -> 360."""
    return max(lo, min(hi, max(0, ttl) + LEASE_SLACK_S))


def decide(query: DNSRecord, policy: NetworkPolicy | None, *, known_source: bool) -> Decision:
    """``policy`` is the subject's effective policy, or None when it has none (denying)."""
    if len(query.questions) != 1:
        # Only the first question would be policy-checked, but every answer would be learned:
        # a second question could smuggle a denied name past the policy. Real clients send one.
        return Decision(Action.FORMERR, "no_question" if not query.questions else "multiple_questions")
    name = str(query.q.qname)
    if not known_source:
        return Decision(Action.NXDOMAIN, "unknown_source", name, rule="unknown-source")
    if policy is None:
        # Deny-first is never audited: audit is part of a policy, and there is none yet.
        return Decision(Action.NXDOMAIN, "denying", name, rule="denying")
    judged = judge_domain(policy, name)
    if judged.verdict is not Verdict.ALLOW:
        return Decision(Action.NXDOMAIN, "policy", name, rule=judged.rule)
    if judged.would_deny:
        return Decision(Action.FORWARD, "would_deny", name, rule=judged.rule, would_deny=True)
    return Decision(Action.FORWARD, "allowed", name)


def refusal(query: DNSRecord, action: Action) -> DNSRecord:
    """NXDOMAIN (rcode 3, empty answer) or FORMERR for a query we do not forward."""
    reply = query.reply()
    reply.rr = []
    reply.auth = []
    reply.ar = []
    reply.header.rcode = RCODE.NXDOMAIN if action is Action.NXDOMAIN else RCODE.FORMERR
    return reply


def with_edns(query: DNSRecord) -> DNSRecord:
    """Add an EDNS0 OPT record advertising 4096-byte UDP answers when the query has none."""
    if any(rr.rtype == QTYPE.OPT for rr in query.ar):
        return query
    query.add_ar(EDNS0(udp_len=EDNS_UDP_SIZE))
    return query


def answer_addresses(reply: DNSRecord) -> list[tuple[IPAddress, int]]:
    """Every A/AAAA in the answer section (any owner name: CNAME targets too) with its TTL."""
    out: list[tuple[IPAddress, int]] = []
    for rr in reply.rr:
        if rr.rtype in (QTYPE.A, QTYPE.AAAA):
            try:
                out.append((ipaddress.ip_address(str(rr.rdata)), int(rr.ttl)))
            except ValueError:
                continue
    return out


def final_rcode(reply: DNSRecord) -> bool:
    """NOERROR and NXDOMAIN end the failover; any other rcode tries the next upstream."""
    return reply.header.rcode in (RCODE.NOERROR, RCODE.NXDOMAIN)
