"""docs/reference/behaviour.md §14.3 DNS messages: only a plain QUERY is evaluated; the per-subject query budget.

Every message is built with dnslib (or byte by byte where dnslib refuses to build it) and put
through ``decide`` and a real ``DnsProxy.answer`` with a fake forwarder that records every
message it was asked to forward: "never forwarded" means that list stays empty.
"""

from __future__ import annotations

import struct

import pytest
from dnslib import EDNS0, OPCODE, QTYPE, RCODE, RD, RR, A, DNSHeader, DNSQuestion, DNSRecord

from egressd.config import ConfigError, parse_config
from egressd.dnsproxy.budget import QueryBudget, query_budget
from egressd.dnsproxy.decide import Action, check_message, decide, refusal
from egressd.dnsproxy.ede import INFO_BLOCKED, INFO_NOT_SUPPORTED, read_ede
from egressd.metrics import EgressMetrics
from egressd.subject.model import Asker
from tests.unit.dnsproxy.test_dns_proxy import (
    CLIENT,
    FENCE,
    POLICY,
    FakeForwarder,
    FakePolicies,
    active,
    dns_proxy,
    parse,
    q,
)

ALLOWED_ZONE = "www.example.com"  # POLICY allows *.example.com


def update(zone: str = ALLOWED_ZONE, *, qid: int = 99) -> DNSRecord:
    """An RFC 2136 UPDATE adding an A record in an allowed zone (what nsupdate sends)."""
    msg = DNSRecord(DNSHeader(id=qid, opcode=OPCODE.UPDATE), q=DNSQuestion(zone, QTYPE.SOA))
    msg.add_auth(RR(f"exfil.{zone}", QTYPE.A, rdata=A("192.0.2.1"), ttl=60))
    return msg


def with_opcode(opcode: int) -> DNSRecord:
    msg = q(ALLOWED_ZONE)
    msg.header.opcode = opcode
    return msg


def tsig() -> RR:
    return RR("key.example.", QTYPE.TSIG, rdata=RD(b"\x0bhmac-sha256\x00" + b"\x00" * 16))


def sig0() -> RR:
    return RR(".", QTYPE.SIG, rdata=RD(b"\x00" * 20))


def two_opts() -> DNSRecord:
    msg = q(ALLOWED_ZONE, edns=1232)
    msg.add_ar(EDNS0(udp_len=4096))
    return msg


def extra(section: str, rr: RR) -> DNSRecord:
    msg = q(ALLOWED_ZONE)
    getattr(msg, section)(rr)
    return msg


def raw_query(labels: list[bytes], *, qid: int = 5) -> bytes:
    """A QUERY whose name dnslib would refuse to build; its parser reads it without complaint."""
    head = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return head + name + struct.pack("!HH", QTYPE.A, 1)


def a_record() -> RR:
    return RR("x." + ALLOWED_ZONE, QTYPE.A, rdata=A("192.0.2.7"), ttl=60)


LONG_LABEL = [b"a" * 64, b"example", b"com"]  # length byte 0x40: dnslib reads 64 octets
LONG_NAME = [b"a" * 63, b"b" * 63, b"c" * 63, b"d" * 50, b"example", b"com"]  # 254 octets
MAX_NAME = [b"a" * 63, b"b" * 63, b"c" * 63, b"d" * 49, b"example", b"com"]  # 253: allowed
DOTTED = [b"x.allowed", b"com"]  # reads as x.allowed.com, is a name under com

# (id, message, action, reason)
CASES: list[tuple[str, bytes, Action, str]] = [
    ("update", update().pack(), Action.REFUSED, "opcode"),
    ("update-tsig", (lambda m: (m.add_ar(tsig()), m)[1])(update()).pack(), Action.REFUSED, "opcode"),
    ("notify", with_opcode(OPCODE.NOTIFY).pack(), Action.REFUSED, "opcode"),
    ("iquery", with_opcode(OPCODE.IQUERY).pack(), Action.REFUSED, "opcode"),
    ("status", with_opcode(OPCODE.STATUS).pack(), Action.REFUSED, "opcode"),
    ("dso", with_opcode(6).pack(), Action.REFUSED, "opcode"),
    ("unassigned-15", with_opcode(15).pack(), Action.REFUSED, "opcode"),
    ("answer-section", extra("add_answer", a_record()).pack(), Action.FORMERR, "answer_or_authority"),
    ("authority-section", extra("add_auth", a_record()).pack(), Action.FORMERR, "answer_or_authority"),
    ("two-opts", two_opts().pack(), Action.FORMERR, "multiple_opt"),
    ("a-in-additional", extra("add_ar", a_record()).pack(), Action.FORMERR, "additional_records"),
    ("tsig-query", extra("add_ar", tsig()).pack(), Action.REFUSED, "signed"),
    ("sig0-query", extra("add_ar", sig0()).pack(), Action.REFUSED, "signed"),
    ("label-64", raw_query(LONG_LABEL), Action.FORMERR, "label_too_long"),
    ("name-254", raw_query(LONG_NAME), Action.FORMERR, "name_too_long"),
    ("label-with-dot", raw_query(DOTTED), Action.FORMERR, "label_dot"),
]
IDS = [c[0] for c in CASES]


# --------------------------------------------------------------------------- decide (pure)


@pytest.mark.parametrize(("case", "data", "action", "reason"), CASES, ids=IDS)
@pytest.mark.parametrize("known", [True, False])
def test_every_refused_message_shape(
    case: str, data: bytes, action: Action, reason: str, known: bool
) -> None:
    msg = DNSRecord.parse(data)  # dnslib parses every one of them: the proxy must check
    d = decide(msg, POLICY, known_source=known)
    assert (d.action, d.reason) == (action, reason), case
    assert check_message(msg) == d


def test_refusal_rcodes_and_no_reflected_sections() -> None:
    msg = update()
    msg.add_ar(tsig())
    r = DNSRecord.parse(refusal(DNSRecord.parse(msg.pack()), Action.REFUSED).pack())
    assert r.header.rcode == RCODE.REFUSED and r.header.qr == 1
    assert (r.rr, r.auth, r.ar) == ([], [], [])
    r = DNSRecord.parse(refusal(two_opts(), Action.FORMERR).pack())
    assert r.header.rcode == RCODE.FORMERR and r.ar == []


@pytest.mark.parametrize(
    "msg",
    [
        q(ALLOWED_ZONE),
        q(ALLOWED_ZONE, edns=1232),
        DNSRecord.parse(raw_query(MAX_NAME)),
        DNSRecord.parse(raw_query([b"a" * 63, b"example", b"com"])),
    ],
    ids=["plain", "one-opt", "name-253", "label-63"],
)
def test_plain_queries_pass_the_message_checks(msg: DNSRecord) -> None:
    assert check_message(msg) is None


def test_opcode_rule_label_is_bounded() -> None:
    assert decide(update(), POLICY, known_source=True).rule == "opcode-update"
    assert decide(with_opcode(13), POLICY, known_source=True).rule == "opcode-13"


# --------------------------------------------------------------------------- the proxy


@pytest.mark.parametrize(("case", "data", "action", "reason"), CASES, ids=IDS)
@pytest.mark.parametrize("tcp", [False, True])
async def test_refused_messages_are_answered_locally_and_never_forwarded(
    case: str, data: bytes, action: Action, reason: str, tcp: bool
) -> None:
    policies, fwd, metrics = FakePolicies(active()), FakeForwarder(), EgressMetrics()
    proxy = dns_proxy(policies, fwd, metrics)
    reply = parse(await proxy.answer(data, CLIENT, tcp=tcp))  # never silence: a reply comes back
    want = RCODE.REFUSED if action is Action.REFUSED else RCODE.FORMERR
    assert reply.header.rcode == want, case
    assert reply.header.id == DNSRecord.parse(data).header.id
    assert fwd.calls == [], f"{case} was forwarded"
    assert policies.learned == [] and policies.events == []
    assert metrics.policy_denied.value() == 1  # answered locally, counted like a denial


async def test_unknown_source_update_is_refused_too() -> None:
    fwd = FakeForwarder()
    proxy = dns_proxy(FakePolicies({}), fwd)
    reply = parse(await proxy.answer(update().pack(), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.REFUSED and fwd.calls == []


async def test_refused_opcode_carries_ede_not_supported_to_edns_clients() -> None:
    msg = update()
    msg.add_ar(EDNS0(udp_len=1232))
    proxy = dns_proxy(FakePolicies(active()), FakeForwarder())
    reply = parse(await proxy.answer(msg.pack(), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.REFUSED
    [(code, text)] = read_ede(reply)
    assert code == INFO_NOT_SUPPORTED and "rule=opcode-update" in text
    # Without an OPT in the query, no OPT in the reply (RFC 6891 §7).
    reply = parse(await proxy.answer(update().pack(), CLIENT, tcp=False))
    assert not [rr for rr in reply.ar if rr.rtype == QTYPE.OPT]


async def test_a_plain_query_is_still_forwarded() -> None:
    fwd = FakeForwarder()
    proxy = dns_proxy(FakePolicies(active()), fwd, budget=QueryBudget(200))
    reply = parse(await proxy.answer(q(ALLOWED_ZONE, edns=1232).pack(), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.NOERROR and len(fwd.calls) == 1


# --------------------------------------------------------------------------- budget in the proxy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


OTHER = "10.0.0.6"


async def test_over_budget_is_refused_with_ede_15_unforwarded_and_counted() -> None:
    clock = Clock()
    askers = {**active(), OTHER: Asker("u-2", FENCE, POLICY)}
    policies, fwd, metrics = FakePolicies(askers), FakeForwarder(), EgressMetrics()
    budget = QueryBudget(2, clock=clock)  # burst 4
    proxy = dns_proxy(policies, fwd, metrics, budget=budget)
    rcodes = []
    for i in range(10):
        reply = parse(await proxy.answer(q(ALLOWED_ZONE, qid=i, edns=1232).pack(), CLIENT, tcp=False))
        rcodes.append(reply.header.rcode)
        if reply.header.rcode == RCODE.REFUSED:
            [(code, text)] = read_ede(reply)
            assert code == INFO_BLOCKED and "subject=s-u-1 rule=dns-budget" in text
            assert reply.header.id == i
    assert rcodes == [RCODE.NOERROR] * 4 + [RCODE.REFUSED] * 6
    assert len(fwd.calls) == 4, "an over-budget query must not be forwarded"
    assert metrics.dns_rate_limited.value("s-u-1") == 6
    assert metrics.policy_denied.value() == 0  # not a policy decision
    # Another subject is untouched by u-1's flood.
    reply = parse(await proxy.answer(q(ALLOWED_ZONE).pack(), OTHER, tcp=True))
    assert reply.header.rcode == RCODE.NOERROR
    # Half a second refills one token at 2/s: exactly one more query.
    clock.now += 0.5
    assert parse(await proxy.answer(q(ALLOWED_ZONE).pack(), CLIENT, tcp=False)).header.rcode == RCODE.NOERROR
    assert parse(await proxy.answer(q(ALLOWED_ZONE).pack(), CLIENT, tcp=False)).header.rcode == RCODE.REFUSED


async def test_over_budget_without_edns_has_no_opt() -> None:
    budget = QueryBudget(1, burst=1, clock=Clock())
    proxy = dns_proxy(FakePolicies(active()), FakeForwarder(), budget=budget)
    await proxy.answer(q(ALLOWED_ZONE).pack(), CLIENT, tcp=False)
    reply = parse(await proxy.answer(q(ALLOWED_ZONE).pack(), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.REFUSED and reply.ar == []


async def test_denied_and_malformed_queries_cost_budget_too() -> None:
    fwd, metrics = FakeForwarder(), EgressMetrics()
    proxy = dns_proxy(FakePolicies(active()), fwd, metrics, budget=QueryBudget(1, clock=Clock()))
    await proxy.answer(q("api.example.com").pack(), CLIENT, tcp=False)  # denied by policy
    await proxy.answer(update().pack(), CLIENT, tcp=False)  # refused message
    reply = parse(await proxy.answer(q(ALLOWED_ZONE).pack(), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.REFUSED and fwd.calls == []
    assert metrics.dns_rate_limited.value("s-u-1") == 1


async def test_unknown_sources_are_budgeted_per_address_under_one_label() -> None:
    metrics = EgressMetrics()
    proxy = dns_proxy(FakePolicies(active()), FakeForwarder(), metrics, budget=QueryBudget(1, clock=Clock()))
    for _ in range(3):
        await proxy.answer(q(ALLOWED_ZONE).pack(), "10.9.9.9", tcp=False)
    last = parse(await proxy.answer(q(ALLOWED_ZONE).pack(), "10.9.9.9", tcp=False))
    assert last.header.rcode == RCODE.REFUSED
    assert metrics.dns_rate_limited.value("-") == 2
    # The known subject has its own bucket.
    assert parse(await proxy.answer(q(ALLOWED_ZONE).pack(), CLIENT, tcp=False)).header.rcode == RCODE.NOERROR


async def test_no_budget_means_unlimited() -> None:
    fwd = FakeForwarder(respond=lambda query: query.reply())  # no addresses: nothing to learn
    proxy = dns_proxy(FakePolicies(active()), fwd, budget=query_budget(0))
    for _ in range(1000):
        await proxy.answer(q(ALLOWED_ZONE).pack(), CLIENT, tcp=False)
    assert len(fwd.calls) == 1000


# --------------------------------------------------------------------------- config


def test_qps_per_subject_config_default_env_flag_and_limits() -> None:
    base = {"OPENSANDBOX_EGRESS_PROFILE": "fleet"}
    assert parse_config(base).dns.qps_per_subject == 200
    assert parse_config({**base, "EGRESSD_DNS_QPS_PER_SUBJECT": "50"}).dns.qps_per_subject == 50
    assert parse_config(base, ["--dns-qps-per-subject", "7"]).dns.qps_per_subject == 7
    assert parse_config({**base, "EGRESSD_DNS_QPS_PER_SUBJECT": "0"}).dns.qps_per_subject == 0
    assert parse_config({"OPENSANDBOX_EGRESS_PROFILE": "sidecar"}).dns.qps_per_subject == 200
    for bad in ("-1", "fast", "1.5"):
        with pytest.raises(ConfigError, match="EGRESSD_DNS_QPS_PER_SUBJECT"):
            parse_config({**base, "EGRESSD_DNS_QPS_PER_SUBJECT": bad})
    budget = query_budget(200)
    assert budget is not None and (budget.qps, budget.burst) == (200.0, 400.0)
    assert query_budget(0) is None


@pytest.mark.parametrize("labels", [LONG_LABEL, LONG_NAME], ids=["label-64", "name-254"])
def test_formerr_for_an_over_long_name_packs_without_the_question(labels: list[bytes]) -> None:
    msg = DNSRecord.parse(raw_query(labels))
    r = DNSRecord.parse(refusal(msg, Action.FORMERR).pack())
    assert r.header.rcode == RCODE.FORMERR and r.questions == []
