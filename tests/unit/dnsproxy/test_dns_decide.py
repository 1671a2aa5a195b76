"""§5 DNS evaluation and §7 per-query decisions, leases and reply inspection (pure functions)."""

from __future__ import annotations

import ipaddress

import pytest
from dnslib import AAAA, CNAME, EDNS0, MX, NS, QTYPE, RCODE, RR, SOA, TXT, A, DNSHeader, DNSRecord

from egressd.dnsproxy.decide import (
    EDNS_UDP_SIZE,
    Action,
    Decision,
    answer_addresses,
    decide,
    final_rcode,
    lease_seconds,
    refusal,
    with_edns,
)
from egressd.policy import DENY_ALL, NetworkPolicy, parse_policy

P1 = parse_policy(
    '{"defaultAction":"deny","egress":['
    '{"action":"allow","target":"*.example.com"},'
    '{"action":"deny","target":"api.example.com"},'
    '{"action":"allow","target":"*.internal.example.com"},'
    '{"action":"deny","target":"10.0.0.1"},'
    '{"action":"allow","target":"10.0.0.0/24"}]}'
)
# An explicit deny before the wildcard that would allow it (first match wins).
DENY_API = parse_policy(
    '{"defaultAction":"deny","egress":['
    '{"action":"deny","target":"api.example.com"},'
    '{"action":"allow","target":"*.example.com"}]}'
)
ALLOW_ALL_BUT_EVIL = parse_policy(
    '{"defaultAction":"allow","egress":[{"action":"deny","target":"evil.com"}]}'
)


def query(name: str = "www.example.com", qtype: str = "A") -> DNSRecord:
    return DNSRecord.question(name, qtype)


def roundtrip(record: DNSRecord) -> DNSRecord:
    return DNSRecord.parse(bytes(record.pack()))


# --------------------------------------------------------------------------- leases


@pytest.mark.parametrize(
    ("ttl", "lease"),
    [(0, 60), (1, 61), (30, 90), (299, 359), (300, 360), (301, 360), (86400, 360)],
)
def test_lease_clamp_vectors(ttl: int, lease: int) -> None:
    assert lease_seconds(ttl) == lease


def test_lease_clamp_negative_ttl_is_treated_as_zero() -> None:
    assert lease_seconds(-5) == 60


@pytest.mark.parametrize(
    ("ttl", "lo", "hi", "lease"),
    [
        (0, 90, 200, 90),  # TTL+60 below the floor
        (100, 90, 200, 160),
        (140, 90, 200, 200),
        (86400, 90, 200, 200),
        (0, 10, 30, 30),  # TTL+60 above the ceiling already
        (5, 1, 86400, 65),
        (86400, 1, 86400, 86400),
        (0, 120, 120, 120),
        (10_000, 120, 120, 120),
    ],
)
def test_lease_clamp_custom_bounds(ttl: int, lo: int, hi: int, lease: int) -> None:
    assert lease_seconds(ttl, lo, hi) == lease


# --------------------------------------------------------------------------- decide


def test_unknown_source_is_nxdomain_even_when_a_policy_would_allow() -> None:
    d = decide(query(), ALLOW_ALL_BUT_EVIL, known_source=False)
    assert d.action is Action.NXDOMAIN
    assert d.reason == "unknown_source"


def test_unknown_source_without_policy_is_nxdomain() -> None:
    d = decide(query(), None, known_source=False)
    assert (d.action, d.reason) == (Action.NXDOMAIN, "unknown_source")


def test_denying_subject_is_nxdomain() -> None:
    d = decide(query(), None, known_source=True)
    assert (d.action, d.reason) == (Action.NXDOMAIN, "denying")


def test_denied_name_is_nxdomain() -> None:
    d = decide(query("api.example.com"), DENY_API, known_source=True)
    assert d == Decision(Action.NXDOMAIN, "policy", "api.example.com.", rule="egress[0]")


def test_allowed_name_is_forwarded() -> None:
    d = decide(query("www.example.com"), P1, known_source=True)
    assert d == Decision(Action.FORWARD, "allowed", "www.example.com.")


def test_no_question_is_formerr() -> None:
    q = roundtrip(DNSRecord(DNSHeader(id=7)))
    assert q.questions == []
    for policy, known in ((P1, True), (None, True), (None, False)):
        d = decide(q, policy, known_source=known)
        assert (d.action, d.reason) == (Action.FORMERR, "no_question")


@pytest.mark.parametrize(
    ("name", "action"),
    [
        # §5 vectors for P1 (first match wins: *.example.com precedes the api deny)
        ("api.example.com.", Action.FORWARD),
        ("WWW.Example.COM", Action.FORWARD),
        ("example.com", Action.NXDOMAIN),
        ("a.internal.example.com", Action.FORWARD),
        ("unknown.test.", Action.NXDOMAIN),
        ("API.EXAMPLE.COM", Action.FORWARD),
        ("a.b.example.com", Action.FORWARD),
        # IP/CIDR rules never affect DNS
        ("10.0.0.1", Action.NXDOMAIN),
        ("notexample.com", Action.NXDOMAIN),
        ("example.com.evil.test", Action.NXDOMAIN),
    ],
)
def test_p1_vectors(name: str, action: Action) -> None:
    assert decide(query(name), P1, known_source=True).action is action


@pytest.mark.parametrize(
    ("name", "action"),
    [("evil.com", Action.NXDOMAIN), ("EVIL.COM.", Action.NXDOMAIN), ("x.com", Action.FORWARD)],
)
def test_default_allow_with_a_deny(name: str, action: Action) -> None:
    assert decide(query(name), ALLOW_ALL_BUT_EVIL, known_source=True).action is action


def test_deny_all_policy_denies_everything() -> None:
    assert decide(query("example.com"), DENY_ALL, known_source=True).action is Action.NXDOMAIN


@pytest.mark.parametrize("qtype", ["A", "AAAA", "TXT", "MX", "ANY", "CNAME", "NS", "SRV", "PTR", "HTTPS"])
def test_every_qtype_is_filtered_by_name(qtype: str) -> None:
    denied = decide(query("api.example.com", qtype), DENY_API, known_source=True)
    assert (denied.action, denied.reason) == (Action.NXDOMAIN, "policy")
    allowed = decide(query("www.example.com", qtype), DENY_API, known_source=True)
    assert allowed.action is Action.FORWARD


def test_wildcard_never_matches_its_apex() -> None:
    policy = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"*.x.com"}]}')
    assert decide(query("x.com"), policy, known_source=True).action is Action.NXDOMAIN
    assert decide(query("X.COM."), policy, known_source=True).action is Action.NXDOMAIN
    assert decide(query("a.x.com"), policy, known_source=True).action is Action.FORWARD
    assert decide(query("a.b.x.com"), policy, known_source=True).action is Action.FORWARD
    assert decide(query("ax.com"), policy, known_source=True).action is Action.NXDOMAIN


@pytest.mark.parametrize("name", ["good.com", "good.com.", "GOOD.COM", "Good.Com."])
def test_trailing_dot_and_case_do_not_matter(name: str) -> None:
    policy = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"Good.COM."}]}')
    assert decide(query(name), policy, known_source=True).action is Action.FORWARD


def test_more_than_one_question_is_formerr() -> None:
    """Only one name can be policy-checked; a second question must not smuggle a denied name
    (and its answers into the learned set) past the policy. §7 evaluates the first question;
    egressd refuses multi-question queries outright."""
    q = query("www.example.com")
    q.add_question(*query("api.example.com").questions)
    d = decide(roundtrip(q), DENY_API, known_source=True)
    assert d.action is Action.FORMERR and d.reason == "multiple_questions"
    q2 = query("api.example.com")
    q2.add_question(*query("www.example.com").questions)
    assert decide(roundtrip(q2), DENY_API, known_source=True).action is Action.FORMERR


# --------------------------------------------------------------------------- refusal


def test_refusal_nxdomain_keeps_id_and_question_and_drops_everything_else() -> None:
    q = query("api.example.com", "TXT")
    q.header.id = 4242
    q.add_ar(EDNS0(udp_len=1232))
    r = roundtrip(refusal(q, Action.NXDOMAIN))
    assert r.header.id == 4242
    assert r.header.qr == 1
    assert r.header.rcode == RCODE.NXDOMAIN == 3
    assert r.rr == [] and r.auth == [] and r.ar == []
    assert str(r.q.qname) == "api.example.com."
    assert r.q.qtype == QTYPE.TXT


def test_refusal_formerr() -> None:
    q = roundtrip(DNSRecord(DNSHeader(id=9)))
    r = roundtrip(refusal(q, Action.FORMERR))
    assert r.header.id == 9
    assert r.header.rcode == RCODE.FORMERR
    assert r.rr == []


def test_refusal_is_never_refused() -> None:
    for action in (Action.NXDOMAIN, Action.FORMERR):
        assert refusal(query(), action).header.rcode != RCODE.REFUSED


# --------------------------------------------------------------------------- EDNS


def _opts(record: DNSRecord) -> list[RR]:
    return [rr for rr in record.ar if rr.rtype == QTYPE.OPT]


def test_with_edns_adds_opt_4096_when_absent() -> None:
    q = with_edns(query())
    (opt,) = _opts(roundtrip(q))
    assert int(opt.rclass) == EDNS_UDP_SIZE == 4096


def test_with_edns_keeps_the_clients_opt() -> None:
    q = query()
    q.add_ar(EDNS0(udp_len=1232))
    (opt,) = _opts(roundtrip(with_edns(q)))
    assert int(opt.rclass) == 1232


def test_with_edns_is_idempotent() -> None:
    q = with_edns(with_edns(query()))
    assert len(_opts(q)) == 1


# --------------------------------------------------------------------------- answer_addresses


def test_answer_addresses_collects_a_and_aaaa_of_any_owner() -> None:
    q = query("www.example.com")
    r = q.reply()
    r.add_answer(RR("www.example.com", QTYPE.CNAME, rdata=CNAME("edge.cdn.test"), ttl=300))
    r.add_answer(RR("edge.cdn.test", QTYPE.CNAME, rdata=CNAME("e1.cdn.test"), ttl=300))
    r.add_answer(RR("e1.cdn.test", QTYPE.A, rdata=A("93.184.216.34"), ttl=30))
    r.add_answer(RR("e1.cdn.test", QTYPE.AAAA, rdata=AAAA("2606:2800:220:1::1946"), ttl=0))
    r.add_answer(RR("www.example.com", QTYPE.A, rdata=A("1.2.3.4"), ttl=86400))
    r.add_answer(RR("www.example.com", QTYPE.TXT, rdata=TXT("v=spf1 -all"), ttl=5))
    r.add_answer(RR("www.example.com", QTYPE.MX, rdata=MX("mail.example.com"), ttl=5))
    # authority and additional sections are never learned
    r.add_auth(RR("example.com", QTYPE.NS, rdata=NS("ns1.example.com"), ttl=5))
    r.add_auth(RR("example.com", QTYPE.SOA, rdata=SOA("ns1.example.com", "h.example.com"), ttl=5))
    r.add_ar(RR("ns1.example.com", QTYPE.A, rdata=A("6.6.6.6"), ttl=5))
    r.add_ar(RR("ns1.example.com", QTYPE.AAAA, rdata=AAAA("2001:db8::6"), ttl=5))
    r.add_ar(EDNS0(udp_len=4096))
    assert answer_addresses(roundtrip(r)) == [
        (ipaddress.ip_address("93.184.216.34"), 30),
        (ipaddress.ip_address("2606:2800:220:1::1946"), 0),
        (ipaddress.ip_address("1.2.3.4"), 86400),
    ]


def test_answer_addresses_of_an_empty_or_nxdomain_reply() -> None:
    r = query().reply()
    assert answer_addresses(r) == []
    r.header.rcode = RCODE.NXDOMAIN
    r.add_auth(RR("example.com", QTYPE.SOA, rdata=SOA("ns1.example.com", "h.example.com"), ttl=5))
    assert answer_addresses(roundtrip(r)) == []


def test_answer_addresses_returns_ip_objects() -> None:
    r = query().reply()
    r.add_answer(RR("www.example.com", QTYPE.A, rdata=A("10.9.8.7"), ttl=1))
    ((addr, ttl),) = answer_addresses(roundtrip(r))
    assert isinstance(addr, ipaddress.IPv4Address)
    assert ttl == 1


# --------------------------------------------------------------------------- final_rcode


@pytest.mark.parametrize(
    ("rcode", "final"),
    [
        (RCODE.NOERROR, True),
        (RCODE.NXDOMAIN, True),
        (RCODE.SERVFAIL, False),
        (RCODE.REFUSED, False),
        (RCODE.FORMERR, False),
        (RCODE.NOTIMP, False),
    ],
)
def test_final_rcode(rcode: int, final: bool) -> None:
    r = query().reply()
    r.header.rcode = rcode
    assert final_rcode(roundtrip(r)) is final


def test_policy_type_is_network_policy() -> None:
    # Sanity: the fixtures are real parsed policies, not mocks.
    assert isinstance(P1, NetworkPolicy)
