"""Per-query decisions of the DNS proxy (docs/reference/behaviour.md §7), pure: parsed query + policy in, verdict out."""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from dnslib import EDNS0, OPCODE, QTYPE, RCODE, DNSRecord

from egressd.addr import IPAddress
from egressd.policy import NetworkPolicy, Verdict, judge_domain

LEASE_MIN_S = 60
LEASE_MAX_S = 360
LEASE_SLACK_S = 60
EDNS_UDP_SIZE = 4096
MAX_NAME_OCTETS = 253  # presentation form without the root dot (255 on the wire)
MAX_LABEL_OCTETS = 63
# Additional records that authenticate a message to the upstream (TSIG, SIG(0)): the
# sandbox's key material has no business reaching a server from the pod's address, and they
# are the tools of UPDATE/transfer abuse. Refused rather than FORMERR: the message is well
# formed, we will not carry it.
_SIGNATURE_TYPES = frozenset({QTYPE.TSIG, QTYPE.SIG})


class Action(enum.StrEnum):
    FORWARD = "forward"
    NXDOMAIN = "nxdomain"
    FORMERR = "formerr"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    # for logs and metrics: "allowed", "would_deny", "unknown_source", "denying", "policy", or a
    # message problem (see check_message): "no_question", "multiple_questions", "opcode",
    # "answer_or_authority", "multiple_opt", "signed", "additional_records", "label_too_long",
    # "name_too_long", "label_dot"
    reason: str
    name: str = ""
    rule: str = ""  # which rule decided a denial or would-deny ("egress[2]", "default", "denying", ...)
    would_deny: bool = False  # FORWARD only because the subject audits: its policy denies the name


def lease_seconds(ttl: int, lo: int = LEASE_MIN_S, hi: int = LEASE_MAX_S) -> int:
    """clamp(TTL + 60, 60, 360): TTL 0 -> 60, 30 -> 90, 300 -> 360, 86400 -> 360."""
    return max(lo, min(hi, max(0, ttl) + LEASE_SLACK_S))


def check_message(query: DNSRecord) -> Decision | None:
    """docs/reference/behaviour.md §14.3: None for the only shape the policy can judge, a plain QUERY with exactly
    one question, empty answer and authority sections and at most one OPT record; else the
    FORMERR or REFUSED to answer with (never forwarded, whatever the name).

    The rule for the rcode: REFUSED when the message is well formed but asks for something the
    proxy will not do on the sandbox's behalf (another opcode, a signed message); FORMERR when
    it is not a well-formed query (RFC 1035 §4.1.1: "unable to interpret the query").
    """
    opcode = query.header.opcode
    if opcode != OPCODE.QUERY:
        # UPDATE/NOTIFY/IQUERY/STATUS/DSO and unassigned codes. RFC 2136 would have a server
        # without UPDATE say NOTIMP; the spec allows only FORMERR or REFUSED, and REFUSED
        # ("will not, for policy reasons") is what this is: an UPDATE for an allowed zone
        # would otherwise reach the upstream from the pod's address. Only the first section's
        # name is ever checked against a policy, and an UPDATE's names live elsewhere.
        return Decision(Action.REFUSED, "opcode", rule=f"opcode-{OPCODE.get(opcode, opcode)}".lower())
    if len(query.questions) != 1:
        # Only the first question would be policy-checked, but every answer would be learned:
        # a second question could smuggle a denied name past the policy. Real clients send one.
        reason = "no_question" if not query.questions else "multiple_questions"
        return Decision(Action.FORMERR, reason, rule=reason)
    name = str(query.q.qname)
    if query.rr or query.auth:
        # A query carries no answers or authority (RFC 1035 §4.1): records there are either
        # junk or a payload for the upstream (prerequisites of an UPDATE in disguise).
        return Decision(Action.FORMERR, "answer_or_authority", name, rule="answer_or_authority")
    opts = 0
    for rr in query.ar:
        if rr.rtype == QTYPE.OPT:
            opts += 1
        elif rr.rtype in _SIGNATURE_TYPES:
            return Decision(Action.REFUSED, "signed", name, rule="signed")
        else:
            # Real stub resolvers put only an OPT in a query's additional section; anything
            # else would be forwarded unread to the upstream.
            return Decision(Action.FORMERR, "additional_records", name, rule="additional_records")
    if opts > 1:
        return Decision(Action.FORMERR, "multiple_opt", name, rule="multiple_opt")  # RFC 6891 §6.1.1
    return check_name(query.q.qname.label, name)


def check_name(labels: tuple[bytes, ...], name: str) -> Decision | None:
    """RFC 1035 limits, which dnslib's parser does not enforce (it reads a 64-octet label and a
    300-octet name without complaint), and no '.' inside a label.

    dnslib prints a label containing a '.' unescaped, so ``[b"x.allowed", b"com"]`` would read
    as ``x.allowed.com`` to the policy while the upstream resolves a name under ``com``: the
    policy must see the name the DNS sees.
    """
    name = name[: MAX_NAME_OCTETS + 2]  # a refused name goes into a log line: keep it bounded
    if any(len(label) > MAX_LABEL_OCTETS for label in labels):
        return Decision(Action.FORMERR, "label_too_long", name, rule="label_too_long")
    if sum(len(label) for label in labels) + max(0, len(labels) - 1) > MAX_NAME_OCTETS:
        return Decision(Action.FORMERR, "name_too_long", name, rule="name_too_long")
    if any(b"." in label for label in labels):
        return Decision(Action.FORMERR, "label_dot", name, rule="label_dot")
    return None


def decide(query: DNSRecord, policy: NetworkPolicy | None, *, known_source: bool) -> Decision:
    """``policy`` is the subject's effective policy, or None when it has none (denying).

    The message checks come first: a malformed or non-QUERY message is refused the same way
    for known and unknown sources, so the answer tells an unknown source nothing more.
    """
    problem = check_message(query)
    if problem is not None:
        return problem
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


_RCODES = {Action.NXDOMAIN: RCODE.NXDOMAIN, Action.FORMERR: RCODE.FORMERR, Action.REFUSED: RCODE.REFUSED}


def refusal(query: DNSRecord, action: Action) -> DNSRecord:
    """NXDOMAIN (rcode 3, empty answer), FORMERR or REFUSED for a query we do not forward.

    Only the first question is echoed (dnslib's ``reply()``), and no record of the client's
    other sections: a refusal never reflects what the client sent beyond the question.
    """
    reply = query.reply()
    reply.rr = []
    reply.auth = []
    reply.ar = []
    if query.questions and check_name(query.q.qname.label, "") is not None:
        # A name over the RFC 1035 limits cannot be packed again (dnslib raises), and a
        # FORMERR need not echo what it could not interpret: answer without a question.
        reply.questions = []
    reply.header.rcode = _RCODES[action]
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
