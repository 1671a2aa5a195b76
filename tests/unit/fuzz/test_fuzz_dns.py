"""Fuzzing DNS messages into the proxy (docs/reference/behaviour.md §7, 14.3, 14.4): ``DnsProxy.answer``.

Queries are built with dnslib (names inside and outside the policy, every qtype, EDNS, extra
sections, several questions, other opcodes), then optionally mutated byte-wise, or replaced by
raw bytes. The sources are an active subject, a denying subject and unknown addresses. The
upstream is a fake forwarder whose replies are themselves fuzzed (genuine answers, CNAME
chains, mutated wire bytes, failures), as a hostile resolver would send them.

Oracles: no exception; a reply is a parseable DNS response with the query's id, within the
client's UDP size; nothing is forwarded unless the source is an active subject and the policy
allows the (single) question; everything learned into the dyn sets came from the upstream's
answer; a non-forwarded query gets NXDOMAIN, REFUSED or FORMERR.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Collection
from dataclasses import dataclass, field

from dnslib import AAAA, CNAME, EDNS0, QTYPE, RCODE, RR, A, DNSHeader, DNSQuestion, DNSRecord
from hypothesis import event, example, given
from hypothesis import strategies as st

from egressd.addr import IPAddress
from egressd.dnsproxy.forwarder import Forwarded
from egressd.dnsproxy.server import DnsProxy
from egressd.policy import Verdict, judge_domain, parse_policy
from egressd.subject.model import Asker, Fence
from tests.unit.fuzz.strategies import domains, mutate_bytes
from tests.unit.fuzz.support import fuzz, hit, run

POLICY = parse_policy(
    '{"defaultAction":"deny","egress":[{"action":"deny","target":"bad.example.com"},'
    '{"action":"allow","target":"*.example.com"},{"action":"allow","target":"api.test"}]}'
)
ACTIVE_IP, DENYING_IP = "10.0.0.5", "10.0.0.6"
NAMES = [
    "www.example.com",
    "bad.example.com",
    "example.com",
    "api.test",
    "API.TEST.",
    "evil.org",
    "a.b.example.com",
]
QTYPES = ["A", "AAAA", "CNAME", "TXT", "MX", "ANY", "SRV", "HTTPS", "PTR", "NS", "SOA", "OPT", "AXFR"]


@dataclass
class FakePolicies:
    learned: list[tuple[IPAddress, int]] = field(default_factory=list)
    refuse_all: bool = False

    def asker(self, source_ip: IPAddress) -> Asker | None:
        if source_ip == ipaddress.ip_address(ACTIVE_IP):
            return Asker("u-1", Fence("r1", "a1"), POLICY)
        if source_ip == ipaddress.ip_address(DENYING_IP):
            return Asker("u-2", Fence("r1", "a1"), None)
        return None

    async def learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None = None
    ) -> Collection[IPAddress]:
        self.learned.extend(leases)
        return [] if self.refuse_all else [ip for ip, _ in leases]


@dataclass
class FakeForwarder:
    """Answers from a script drawn by the test; records what it was asked."""

    script: str
    mutation: bytes | None = None
    addresses: list[str] = field(default_factory=list)
    calls: list[DNSRecord] = field(default_factory=list)
    answered: set[IPAddress] = field(default_factory=set)

    async def forward(self, query: DNSRecord, *, tcp: bool = False) -> Forwarded:
        self.calls.append(DNSRecord.parse(bytes(query.pack())))
        if self.script == "fail":
            return Forwarded(None, "upstream_error")
        reply = query.reply()
        if self.script == "cname":
            target = "cdn.elsewhere.net"
            reply.add_answer(RR(query.q.qname, QTYPE.CNAME, rdata=CNAME(target), ttl=30))
            owner = target
        else:
            owner = str(query.q.qname)
        for addr in self.addresses:
            rtype, rdata = (QTYPE.AAAA, AAAA(addr)) if ":" in addr else (QTYPE.A, A(addr))
            reply.add_answer(RR(owner, rtype, rdata=rdata, ttl=300))
        if self.script == "nxdomain":
            reply.header.rcode = RCODE.NXDOMAIN
        wire = bytes(reply.pack())
        if self.mutation is not None:
            wire = self.mutation  # a hostile upstream: whatever bytes it likes
        try:
            parsed = DNSRecord.parse(wire)
        except Exception:
            return Forwarded(None, "upstream_error")
        if parsed.header.id != query.header.id or not parsed.header.qr:
            # The real Forwarder drops such a datagram (a spoofed or stray reply) before the
            # proxy sees it; the fake must too, or the oracle blames the proxy for it.
            return Forwarded(None, "upstream_error")
        for rr in parsed.rr:
            if rr.rtype in (QTYPE.A, QTYPE.AAAA):
                with contextlib.suppress(ValueError):
                    self.answered.add(ipaddress.ip_address(str(rr.rdata)))
        return Forwarded(parsed, wire=wire)


@st.composite
def queries(draw: st.DrawFn) -> bytes:
    name = draw(
        st.one_of(
            st.sampled_from(NAMES), domains.map(lambda d: d + ".example.com"), domains, st.text(max_size=70)
        )
    )
    # Built by hand: DNSRecord.question() draws its id from `random`, which hypothesis forbids.
    header = DNSHeader(id=draw(st.integers(0, 65535)), rd=1)
    try:
        q = DNSRecord(header, q=DNSQuestion(name, getattr(QTYPE, draw(st.sampled_from(QTYPES)))))
        q.pack()
    except Exception:
        q = DNSRecord(header, q=DNSQuestion("www.example.com"))
    if draw(st.booleans()):
        q.add_ar(EDNS0(udp_len=draw(st.sampled_from([0, 512, 1232, 4096, 65535]))))
    extra = draw(st.sampled_from(["none", "none", "question", "answer", "opcode", "qr", "edns2"]))
    if extra == "question":
        q.add_question(DNSQuestion("evil.org"))
    elif extra == "answer":
        q.add_answer(RR("www.example.com", QTYPE.A, rdata=A("1.2.3.4")))
    elif extra == "opcode":
        q.header.opcode = draw(st.integers(1, 15))
    elif extra == "qr":
        q.header.qr = 1
    elif extra == "edns2":
        q.add_ar(EDNS0(udp_len=4096))
        q.add_ar(EDNS0(udp_len=512))
    try:
        wire = bytes(q.pack())
    except Exception:
        wire = bytes(DNSRecord(header, q=DNSQuestion("www.example.com")).pack())
    mode = draw(st.integers(0, 5))
    if mode == 0:
        wire = draw(mutate_bytes(wire, max_steps=6))
    elif mode == 1:
        wire = draw(st.binary(max_size=64))
    return wire


def _udp_limit(wire: bytes) -> int:
    try:
        q = DNSRecord.parse(wire)
    except Exception:
        return 512
    for rr in q.ar:
        if rr.rtype == QTYPE.OPT:
            return max(512, int(rr.rclass))
    return 512


@fuzz("dns", ci=500, campaign=60_000)
@given(
    wire=queries(),
    client=st.sampled_from(
        [ACTIVE_IP, ACTIVE_IP, DENYING_IP, "10.0.0.9", "::ffff:10.0.0.5", "fe80::1%eth0", "junk"]
    ),
    tcp=st.booleans(),
    script=st.sampled_from(["answer", "answer", "cname", "nxdomain", "fail", "mutated"]),
    addresses=st.lists(st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)).map(str), max_size=4),
    upstream_mutation=st.binary(max_size=8),
    refuse_all=st.booleans(),
    data=st.data(),
)
@example(
    wire=bytes(DNSRecord.question("www.example.com").pack()),
    client=ACTIVE_IP,
    tcp=False,
    script="answer",
    addresses=["93.184.216.34"],
    upstream_mutation=b"",
    refuse_all=False,
    data=None,
)
def test_dns_answers_are_policy_bound(
    wire: bytes,
    client: str,
    tcp: bool,
    script: str,
    addresses: list[str],
    upstream_mutation: bytes,
    refuse_all: bool,
    data: st.DataObject | None,
) -> None:
    hit("dns")
    policies = FakePolicies(refuse_all=refuse_all)
    mutation = None
    if script == "mutated" and data is not None:
        genuine = DNSRecord(DNSHeader(id=7, rd=1), q=DNSQuestion("www.example.com")).reply()
        genuine.add_answer(RR("www.example.com", QTYPE.A, rdata=A("93.184.216.34"), ttl=60))
        mutation = data.draw(mutate_bytes(bytes(genuine.pack()) + upstream_mutation, max_steps=6))
    forwarder = FakeForwarder(script, mutation, addresses)
    proxy = DnsProxy(policies.asker, forwarder, on_resolved=policies.learn)  # type: ignore[arg-type]
    reply = run(proxy.answer(wire, client, tcp=tcp))
    event(f"forwarded={bool(forwarder.calls)} reply={reply is not None}")
    # Forwarded only for an active subject, one question, and a name the policy allows.
    for fwd in forwarder.calls:
        assert client in (ACTIVE_IP, "::ffff:10.0.0.5"), f"forwarded for {client}"
        assert len(fwd.questions) == 1
        assert judge_domain(POLICY, str(fwd.q.qname)).verdict is Verdict.ALLOW, str(fwd.q.qname)
    # Learned only what the upstream answered.
    for addr, seconds in policies.learned:
        assert addr in forwarder.answered
        assert 60 <= seconds <= 360
    if reply is None:
        return
    parsed = DNSRecord.parse(reply)
    query = DNSRecord.parse(wire)  # a reply implies the query parsed
    assert parsed.header.qr == 1 and parsed.header.id == query.header.id
    if not tcp:
        assert len(reply) <= max(_udp_limit(wire), 512)
    if not forwarder.calls:
        assert parsed.header.rcode in (RCODE.NXDOMAIN, RCODE.REFUSED, RCODE.FORMERR), parsed.header.rcode
        assert not parsed.rr
    if refuse_all and policies.learned:
        # Nothing the client could use reached the kernel: no address may be answered.
        assert not [rr for rr in parsed.rr if rr.rtype in (QTYPE.A, QTYPE.AAAA)]
