"""§7 DNS proxy: DnsProxy.answer against fakes, and the Forwarder against real local upstreams.

Every DNS message is built with dnslib. The upstream servers are asyncio UDP/TCP servers on
127.0.0.1 with random ports; the Forwarder gets ``mark=None`` except in the SO_MARK test.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from dnslib import AAAA, CNAME, EDNS0, QTYPE, RCODE, RR, TXT, A, DNSHeader, DNSRecord

import egressd.dnsproxy.forwarder as forwarder_mod
import egressd.dnsproxy.server as server_mod
from egressd.addr import IPAddress
from egressd.dnsproxy.forwarder import Forwarded, Forwarder
from egressd.dnsproxy.server import DnsProxy
from egressd.dnsproxy.upstreams import Upstream
from egressd.kernel.applier import NftError
from egressd.metrics import EgressMetrics
from egressd.nftsyntax import FORWARDER_MARK
from egressd.policy import parse_policy
from egressd.subject.model import Asker, Fence

FENCE = Fence("r1", "a1")
CLIENT = "10.0.0.5"
POLICY = parse_policy(
    '{"defaultAction":"deny","egress":['
    '{"action":"deny","target":"api.example.com"},'
    '{"action":"allow","target":"*.example.com"}]}'
)


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def q(
    name: str = "www.example.com", qtype: str = "A", *, qid: int = 4321, edns: int | None = None
) -> DNSRecord:
    query = DNSRecord.question(name, qtype)
    query.header.id = qid
    if edns is not None:
        query.add_ar(EDNS0(udp_len=edns))
    return query


def wire(record: DNSRecord) -> bytes:
    return bytes(record.pack())


def parse(data: bytes | None) -> DNSRecord:
    assert data is not None
    return DNSRecord.parse(data)


def opts(record: DNSRecord) -> list[RR]:
    return [rr for rr in record.ar if rr.rtype == QTYPE.OPT]


def a_reply(query: DNSRecord, *addrs: tuple[str, int], rcode: int = RCODE.NOERROR) -> DNSRecord:
    """What an upstream answers: A/AAAA records for the question, echoing an OPT like real servers."""
    reply = query.reply()
    reply.header.rcode = rcode
    for addr, ttl in addrs:
        rtype, rdata = (QTYPE.AAAA, AAAA(addr)) if ":" in addr else (QTYPE.A, A(addr))
        reply.add_answer(RR(query.q.qname, rtype, rdata=rdata, ttl=ttl))
    reply.add_ar(EDNS0(udp_len=4096))
    return reply


def big_reply(query: DNSRecord, records: int) -> DNSRecord:
    reply = query.reply()
    for i in range(records):
        reply.add_answer(RR(query.q.qname, QTYPE.TXT, rdata=TXT(f"{i:03d}" + "x" * 240), ttl=60))
    reply.add_ar(EDNS0(udp_len=4096))
    return reply


# --------------------------------------------------------------------------- fakes


class FakeForwarder:
    """Has ``async forward(query, tcp=...)`` like Forwarder; records a snapshot of each query."""

    def __init__(self, respond: Callable[[DNSRecord], DNSRecord | None] | None = None) -> None:
        self.respond = respond or (lambda query: a_reply(query, ("93.184.216.34", 30)))
        self.calls: list[tuple[DNSRecord, bool]] = []
        self.failure = "upstream_error"

    async def forward(self, query: DNSRecord, *, tcp: bool = False) -> Forwarded:
        self.calls.append((DNSRecord.parse(wire(query)), tcp))
        reply = self.respond(query)
        if reply is None:
            return Forwarded(None, self.failure)
        return Forwarded(DNSRecord.parse(wire(reply)))  # as if it came off the wire


class FakePolicies:
    def __init__(self, askers: dict[str, Asker] | None = None) -> None:
        self.askers = {ip(k): v for k, v in (askers or {}).items()}
        self.lookups: list[IPAddress] = []
        self.learned: list[tuple[str, Fence, list[tuple[IPAddress, int]]]] = []
        self.events: list[str] = []
        self.learn_error: Exception | None = None
        self.learn_gate: asyncio.Event | None = None
        self.learn_started = asyncio.Event()
        self.refused: set[IPAddress] = set()  # addresses the "kernel" does not take (cap full)

    def asker(self, source_ip: IPAddress) -> Asker | None:
        self.lookups.append(source_ip)
        return self.askers.get(source_ip)

    async def learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None = None
    ) -> list[IPAddress]:
        self.events.append("learn:start")
        self.learn_started.set()
        if self.learn_gate is not None:
            await self.learn_gate.wait()
        await asyncio.sleep(0.01)  # a real kernel transaction takes a while
        if self.learn_error is not None:
            self.events.append("learn:failed")
            raise self.learn_error
        self.learned.append((uid, fence, list(leases)))
        self.events.append("learn:done")
        return [addr for addr, _ in leases if addr not in self.refused]


def dns_proxy(policies: FakePolicies, forwarder: Any, *args: Any, **kw: Any) -> DnsProxy:
    """A proxy wired to the fake's asker and learn, as the composition root wires the real ones."""
    return DnsProxy(policies.asker, forwarder, *args, on_resolved=policies.learn, **kw)


def active(policy: object = POLICY) -> dict[str, Asker]:
    return {CLIENT: Asker("u-1", FENCE, policy)}  # type: ignore[arg-type]


# --------------------------------------------------------------------------- denial


@pytest.mark.parametrize(
    ("askers", "name"),
    [
        ({}, "www.example.com"),  # unknown source
        ({CLIENT: Asker("u-1", FENCE, None)}, "www.example.com"),  # denying subject
        (active(), "api.example.com"),  # denied name
        (active(), "example.com"),  # wildcard never matches the apex
        (active(), "unknown.test"),  # default deny
    ],
    ids=["unknown", "denying", "denied", "apex", "default"],
)
@pytest.mark.parametrize("tcp", [False, True])
async def test_denied_query_is_nxdomain_and_never_forwarded(
    askers: dict[str, Asker], name: str, tcp: bool
) -> None:
    policies, fwd = FakePolicies(askers), FakeForwarder()
    metrics = EgressMetrics()
    proxy = dns_proxy(policies, fwd, metrics)
    reply = parse(await proxy.answer(wire(q(name, qid=777)), CLIENT, tcp=tcp))
    assert fwd.calls == []
    assert policies.learned == [] and policies.events == []
    assert reply.header.id == 777
    assert reply.header.qr == 1
    assert reply.header.rcode == RCODE.NXDOMAIN
    assert reply.rr == [] and reply.auth == []
    assert str(reply.q.qname) == f"{name}."
    assert metrics.policy_denied.value() == 1


@pytest.mark.parametrize("qtype", ["TXT", "MX", "ANY", "AAAA", "CNAME", "SRV", "HTTPS"])
async def test_every_qtype_of_a_denied_name_is_nxdomain(qtype: str) -> None:
    fwd = FakeForwarder()
    proxy = dns_proxy(FakePolicies(active()), fwd)
    reply = parse(await proxy.answer(wire(q("api.example.com", qtype)), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.NXDOMAIN
    assert reply.rr == []
    assert fwd.calls == []


async def test_no_question_is_formerr_and_not_forwarded() -> None:
    fwd = FakeForwarder()
    proxy = dns_proxy(FakePolicies(active()), fwd)
    reply = parse(await proxy.answer(wire(DNSRecord(DNSHeader(id=99))), CLIENT, tcp=False))
    assert reply.header.id == 99
    assert reply.header.rcode == RCODE.FORMERR
    assert fwd.calls == []


async def test_denied_reply_to_an_edns_client_is_still_nxdomain() -> None:
    fwd = FakeForwarder()
    proxy = dns_proxy(FakePolicies(active()), fwd)
    reply = parse(await proxy.answer(wire(q("api.example.com", edns=1232)), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.NXDOMAIN
    assert reply.rr == []
    assert fwd.calls == []


# --------------------------------------------------------------------------- silence


async def test_a_response_packet_gets_no_answer() -> None:
    policies, fwd = FakePolicies(active()), FakeForwarder()
    proxy = dns_proxy(policies, fwd)
    response = a_reply(q(), ("1.2.3.4", 5))
    assert response.header.qr == 1
    assert await proxy.answer(wire(response), CLIENT, tcp=False) is None
    assert fwd.calls == [] and policies.lookups == []


@pytest.mark.parametrize(
    "data",
    [b"", b"not a dns packet at all", wire(q())[:7], wire(q())[:-3]],
    ids=["empty", "text", "short-header", "cut-question"],
)
async def test_garbage_gets_no_answer(data: bytes) -> None:
    policies, fwd = FakePolicies(active()), FakeForwarder()
    proxy = dns_proxy(policies, fwd)
    assert await proxy.answer(data, CLIENT, tcp=False) is None
    assert fwd.calls == []


async def test_unparseable_client_address_gets_no_answer() -> None:
    proxy = dns_proxy(FakePolicies(active()), FakeForwarder())
    assert await proxy.answer(wire(q()), "not-an-ip", tcp=False) is None


# --------------------------------------------------------------------------- client address


@pytest.mark.parametrize(
    ("client", "looked_up"),
    [
        ("::ffff:10.0.0.5", "10.0.0.5"),
        ("10.0.0.5", "10.0.0.5"),
        ("fd00::5", "fd00::5"),
        ("fe80::5%eth0", "fe80::5"),
    ],
)
async def test_client_address_is_unmapped_before_lookup(client: str, looked_up: str) -> None:
    askers = {looked_up: Asker("u-1", FENCE, POLICY)}
    policies, fwd = FakePolicies(askers), FakeForwarder()
    proxy = dns_proxy(policies, fwd)
    reply = parse(await proxy.answer(wire(q()), client, tcp=False))
    assert policies.lookups == [ip(looked_up)]
    assert isinstance(policies.lookups[0], type(ip(looked_up)))
    assert reply.header.rcode == RCODE.NOERROR
    assert len(fwd.calls) == 1


# --------------------------------------------------------------------------- allowed


async def test_allowed_query_is_forwarded_and_answered() -> None:
    policies, fwd = FakePolicies(active()), FakeForwarder()
    proxy = dns_proxy(policies, fwd)
    reply = parse(await proxy.answer(wire(q(qid=1234)), CLIENT, tcp=False))
    assert reply.header.id == 1234
    assert reply.header.rcode == RCODE.NOERROR
    assert [str(rr.rdata) for rr in reply.rr] == ["93.184.216.34"]
    ((sent, tcp),) = fwd.calls
    assert tcp is False
    assert str(sent.q.qname) == "www.example.com."
    assert sent.header.id == 1234


async def test_tcp_flag_is_passed_to_the_forwarder() -> None:
    fwd = FakeForwarder()
    proxy = dns_proxy(FakePolicies(active()), fwd)
    await proxy.answer(wire(q()), CLIENT, tcp=True)
    assert [tcp for _, tcp in fwd.calls] == [True]


async def test_learn_gets_clamped_leases_of_every_answer_address() -> None:
    def respond(query: DNSRecord) -> DNSRecord:
        reply = query.reply()
        reply.add_answer(RR(query.q.qname, QTYPE.CNAME, rdata=CNAME("edge.cdn.test"), ttl=300))
        reply.add_answer(RR("edge.cdn.test", QTYPE.A, rdata=A("93.184.216.34"), ttl=30))
        reply.add_answer(RR("edge.cdn.test", QTYPE.A, rdata=A("93.184.216.35"), ttl=0))
        reply.add_answer(RR("edge.cdn.test", QTYPE.AAAA, rdata=AAAA("2606:2800::1"), ttl=86400))
        reply.add_answer(RR("edge.cdn.test", QTYPE.A, rdata=A("93.184.216.36"), ttl=299))
        reply.add_ar(RR("ns.cdn.test", QTYPE.A, rdata=A("6.6.6.6"), ttl=5))  # never learned
        return reply

    policies = FakePolicies(active())
    proxy = dns_proxy(policies, FakeForwarder(respond))
    await proxy.answer(wire(q()), CLIENT, tcp=False)
    assert policies.learned == [
        (
            "u-1",
            FENCE,
            [
                (ip("93.184.216.34"), 90),
                (ip("93.184.216.35"), 60),
                (ip("2606:2800::1"), 360),
                (ip("93.184.216.36"), 359),
            ],
        )
    ]


async def test_learn_uses_the_configured_lease_bounds() -> None:
    policies = FakePolicies(active())
    fwd = FakeForwarder(lambda query: a_reply(query, ("1.1.1.1", 0), ("1.1.1.2", 86400), ("1.1.1.3", 50)))
    proxy = dns_proxy(policies, fwd, lease_bounds=(90, 120))
    await proxy.answer(wire(q()), CLIENT, tcp=False)
    assert policies.learned[0][2] == [(ip("1.1.1.1"), 90), (ip("1.1.1.2"), 120), (ip("1.1.1.3"), 110)]


@pytest.mark.parametrize(
    "respond",
    [
        lambda query: a_reply(query),  # NOERROR, no data
        lambda query: a_reply(query, rcode=RCODE.NXDOMAIN),
        lambda query: big_reply(query, 1),  # TXT only
    ],
    ids=["nodata", "nxdomain", "txt"],
)
async def test_no_addresses_no_learn(respond: Callable[[DNSRecord], DNSRecord]) -> None:
    policies = FakePolicies(active())
    proxy = dns_proxy(policies, FakeForwarder(respond))
    assert await proxy.answer(wire(q()), CLIENT, tcp=False) is not None
    assert policies.events == []


async def test_learn_completes_before_answer_returns() -> None:
    policies = FakePolicies(active())
    proxy = dns_proxy(policies, FakeForwarder())
    out = await proxy.answer(wire(q()), CLIENT, tcp=False)
    policies.events.append("answer:returned")
    assert out is not None
    assert policies.events == ["learn:start", "learn:done", "answer:returned"]


async def test_answer_waits_for_a_slow_learn() -> None:
    policies = FakePolicies(active())
    policies.learn_gate = asyncio.Event()
    proxy = dns_proxy(policies, FakeForwarder())
    task = asyncio.create_task(proxy.answer(wire(q()), CLIENT, tcp=False))
    await asyncio.wait_for(policies.learn_started.wait(), 2)
    await asyncio.sleep(0.05)
    assert not task.done(), "the reply must not be released before the kernel knows the addresses"
    policies.learn_gate.set()
    reply = parse(await asyncio.wait_for(task, 2))
    assert policies.events == ["learn:start", "learn:done"]
    assert [str(rr.rdata) for rr in reply.rr] == ["93.184.216.34"]


async def test_failing_learn_answers_servfail_without_the_addresses() -> None:
    # docs/reference/behaviour.md §14.4: the reply carries only addresses that are in the kernel set.
    policies = FakePolicies(active())
    policies.learn_error = NftError("nft refused")
    metrics = EgressMetrics()
    proxy = dns_proxy(policies, FakeForwarder(), metrics)
    reply = parse(await proxy.answer(wire(q(qid=55)), CLIENT, tcp=False))
    assert policies.events == ["learn:start", "learn:failed"]
    assert reply.header.id == 55
    assert reply.header.rcode == RCODE.SERVFAIL
    assert reply.rr == []
    assert metrics.dns_failed.value("not_learned") == 1
    # Counted once, by the kernel shell that failed (not by the proxy too).
    assert metrics.nft_failures.value("dynamic_add") == 0


async def test_hanging_learn_is_bounded_and_answered_servfail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_mod, "_LEARN_TIMEOUT_S", 0.1)
    policies = FakePolicies(active())
    policies.learn_gate = asyncio.Event()  # never set
    proxy = dns_proxy(policies, FakeForwarder())
    reply = parse(await asyncio.wait_for(proxy.answer(wire(q()), CLIENT, tcp=False), 2))
    assert reply.header.rcode == RCODE.SERVFAIL
    assert policies.learned == []


# --------------------------------------------------------------------------- failure


@pytest.mark.parametrize("tcp", [False, True])
async def test_all_upstreams_failing_is_servfail(tcp: bool) -> None:
    policies = FakePolicies(active())
    fwd = FakeForwarder(lambda query: None)
    fwd.failure = "rcode"
    metrics = EgressMetrics()
    proxy = dns_proxy(policies, fwd, metrics)
    reply = parse(await proxy.answer(wire(q(qid=31337)), CLIENT, tcp=tcp))
    assert reply.header.id == 31337
    assert reply.header.qr == 1
    assert reply.header.rcode == RCODE.SERVFAIL
    assert reply.rr == []
    assert str(reply.q.qname) == "www.example.com."
    assert policies.events == []
    assert opts(reply) == []
    assert metrics.dns_failed.value("rcode") == 1


async def test_nxdomain_from_upstream_is_passed_through() -> None:
    fwd = FakeForwarder(lambda query: a_reply(query, rcode=RCODE.NXDOMAIN))
    proxy = dns_proxy(FakePolicies(active()), fwd)
    reply = parse(await proxy.answer(wire(q()), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.NXDOMAIN


# --------------------------------------------------------------------------- EDNS and size


async def test_query_without_edns_is_forwarded_with_opt_4096_and_reply_has_no_opt() -> None:
    fwd = FakeForwarder()
    proxy = dns_proxy(FakePolicies(active()), fwd)
    reply = parse(await proxy.answer(wire(q()), CLIENT, tcp=False))
    ((sent, _),) = fwd.calls
    (opt,) = opts(sent)
    assert int(opt.rclass) == 4096
    assert opts(reply) == []
    assert reply.header.rcode == RCODE.NOERROR


async def test_client_edns_is_forwarded_unchanged_and_the_reply_keeps_opt() -> None:
    fwd = FakeForwarder()
    proxy = dns_proxy(FakePolicies(active()), fwd)
    reply = parse(await proxy.answer(wire(q(edns=1232)), CLIENT, tcp=False))
    ((sent, _),) = fwd.calls
    assert [int(o.rclass) for o in opts(sent)] == [1232]
    assert len(opts(reply)) == 1


async def test_big_reply_to_a_non_edns_udp_client_is_truncated() -> None:
    fwd = FakeForwarder(lambda query: big_reply(query, 5))  # ~1.3 KB
    proxy = dns_proxy(FakePolicies(active()), fwd)
    out = await proxy.answer(wire(q("www.example.com", "TXT", qid=8)), CLIENT, tcp=False)
    assert out is not None
    assert len(out) <= 512
    reply = parse(out)
    assert reply.header.tc == 1
    assert reply.header.id == 8


async def test_huge_reply_to_a_non_edns_udp_client_is_truncated() -> None:
    fwd = FakeForwarder(lambda query: big_reply(query, 20))  # > 4096 bytes
    proxy = dns_proxy(FakePolicies(active()), fwd)
    out = await proxy.answer(wire(q("www.example.com", "TXT", qid=8)), CLIENT, tcp=False)
    assert out is not None
    assert len(out) <= 512
    reply = parse(out)
    assert reply.header.tc == 1
    assert reply.header.id == 8


async def test_reply_over_the_clients_edns_size_is_truncated() -> None:
    fwd = FakeForwarder(lambda query: big_reply(query, 5))  # ~1.3 KB
    proxy = dns_proxy(FakePolicies(active()), fwd)
    out = await proxy.answer(wire(q("www.example.com", "TXT", edns=1232)), CLIENT, tcp=False)
    assert out is not None
    assert len(out) <= 1232
    assert parse(out).header.tc == 1


async def test_reply_within_the_clients_edns_size_is_not_truncated() -> None:
    fwd = FakeForwarder(lambda query: big_reply(query, 5))
    proxy = dns_proxy(FakePolicies(active()), fwd)
    out = await proxy.answer(wire(q("www.example.com", "TXT", edns=4096)), CLIENT, tcp=False)
    reply = parse(out)
    assert reply.header.tc == 0
    assert len(reply.rr) == 5


@pytest.mark.parametrize("edns", [None, 512, 1232])
async def test_tcp_replies_are_never_truncated(edns: int | None) -> None:
    fwd = FakeForwarder(lambda query: big_reply(query, 20))
    proxy = dns_proxy(FakePolicies(active()), fwd)
    out = await proxy.answer(wire(q("www.example.com", "TXT", edns=edns)), CLIENT, tcp=True)
    assert out is not None and len(out) > 4096
    reply = parse(out)
    assert reply.header.tc == 0
    assert len(reply.rr) == 20


# --------------------------------------------------------------------------- listeners


def _free_port() -> int:
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            t.bind(("127.0.0.1", 0))
            port: int = t.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                try:
                    u.bind(("127.0.0.1", port))
                except OSError:
                    continue
        return port
    raise RuntimeError("no port free for both UDP and TCP")


async def test_listeners_answer_over_udp_and_tcp() -> None:
    policies = FakePolicies({"127.0.0.1": Asker("u-1", FENCE, POLICY)})
    fwd = FakeForwarder()
    proxy = dns_proxy(policies, fwd)
    port = _free_port()
    await proxy.start("127.0.0.1", port)
    try:
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", port))
            await loop.sock_sendall(s, wire(q("api.example.com", qid=11)))
            udp = DNSRecord.parse(await asyncio.wait_for(loop.sock_recv(s, 4096), 2))
        assert (udp.header.id, udp.header.rcode) == (11, RCODE.NXDOMAIN)

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for qid in (12, 13):  # two queries on one connection
                data = wire(q(qid=qid))
                writer.write(struct.pack("!H", len(data)) + data)
                await writer.drain()
                (n,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 2))
                tcp = DNSRecord.parse(await reader.readexactly(n))
                assert (tcp.header.id, tcp.header.rcode) == (qid, RCODE.NOERROR)
        finally:
            writer.close()
        assert [t for _, t in fwd.calls] == [True, True]
    finally:
        await proxy.close()


# =========================================================================== Forwarder

Handler = Callable[[DNSRecord], list[bytes]]


def answer_with(addr: str = "1.2.3.4", *, rcode: int = RCODE.NOERROR, tc: bool = False) -> Handler:
    def handle(query: DNSRecord) -> list[bytes]:
        reply = a_reply(query, *([(addr, 60)] if rcode == RCODE.NOERROR and not tc else []), rcode=rcode)
        reply.header.tc = int(tc)
        return [wire(reply)]

    return handle


def silent(query: DNSRecord) -> list[bytes]:
    return []


class _UdpUpstream(asyncio.DatagramProtocol):
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.queries: list[DNSRecord] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        query = DNSRecord.parse(data)
        self.queries.append(query)
        assert self.transport is not None
        for out in self.handler(query):
            self.transport.sendto(out, addr)


class _TcpUpstream:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.queries: list[DNSRecord] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = struct.unpack("!H", await reader.readexactly(2))
                query = DNSRecord.parse(await reader.readexactly(n))
                self.queries.append(query)
                for out in self.handler(query):
                    writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class Upstreams:
    """Local upstream DNS servers on 127.0.0.1, closed at the end of the test."""

    def __init__(self) -> None:
        self._closers: list[Callable[[], object]] = []
        self.udp_servers: dict[int, _UdpUpstream] = {}
        self.tcp_servers: dict[int, _TcpUpstream] = {}

    async def udp(self, handler: Handler, port: int = 0) -> Upstream:
        loop = asyncio.get_running_loop()
        proto = _UdpUpstream(handler)
        transport, _ = await loop.create_datagram_endpoint(lambda: proto, local_addr=("127.0.0.1", port))
        self._closers.append(transport.close)
        port = transport.get_extra_info("sockname")[1]
        self.udp_servers[port] = proto
        return Upstream("127.0.0.1", port)

    async def tcp(self, handler: Handler, port: int = 0) -> Upstream:
        srv = _TcpUpstream(handler)
        server = await asyncio.start_server(srv.serve, "127.0.0.1", port)
        self._closers.append(server.close)
        port = server.sockets[0].getsockname()[1]
        self.tcp_servers[port] = srv
        return Upstream("127.0.0.1", port)

    async def pair(self, udp: Handler, tcp: Handler) -> Upstream:
        """UDP and TCP servers on the same port (the Forwarder retries TC over TCP there)."""
        for _ in range(50):
            up = await self.tcp(tcp)
            try:
                return await self.udp(udp, up.port)
            except OSError:
                continue
        raise RuntimeError("no port free for both UDP and TCP")

    @staticmethod
    def dead() -> Upstream:
        """A port nothing listens on (UDP: ICMP port unreachable; TCP: RST)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return Upstream("127.0.0.1", port)

    def udp_queries(self, up: Upstream) -> list[DNSRecord]:
        return self.udp_servers[up.port].queries if up.port in self.udp_servers else []

    def tcp_queries(self, up: Upstream) -> list[DNSRecord]:
        return self.tcp_servers[up.port].queries if up.port in self.tcp_servers else []

    def close(self) -> None:
        for close in self._closers:
            with contextlib.suppress(Exception):
                close()


@pytest.fixture
async def ups() -> AsyncIterator[Upstreams]:
    u = Upstreams()
    try:
        yield u
    finally:
        u.close()
        await asyncio.sleep(0)


def addresses(reply: DNSRecord | None) -> list[str]:
    assert reply is not None
    return [str(rr.rdata) for rr in reply.rr]


async def test_forward_over_udp(ups: Upstreams) -> None:
    up = await ups.udp(answer_with("1.2.3.4"))
    res = await Forwarder([up], 2.0, mark=None).forward(q(qid=5))
    assert res.failure == ""
    assert res.reply is not None and res.reply.header.id == 5
    assert addresses(res.reply) == ["1.2.3.4"]
    assert len(ups.udp_queries(up)) == 1


async def test_forward_over_tcp(ups: Upstreams) -> None:
    up = await ups.pair(answer_with("9.9.9.9"), answer_with("1.2.3.4"))
    res = await Forwarder([up], 2.0, mark=None).forward(q(), tcp=True)
    assert addresses(res.reply) == ["1.2.3.4"]
    assert len(ups.tcp_queries(up)) == 1
    assert ups.udp_queries(up) == []


async def test_failover_from_a_closed_port_to_the_next_upstream(ups: Upstreams) -> None:
    dead = ups.dead()
    good = await ups.udp(answer_with("1.2.3.4"))
    start = time.monotonic()
    res = await Forwarder([dead, good], 5.0, mark=None).forward(q())
    assert addresses(res.reply) == ["1.2.3.4"]
    assert time.monotonic() - start < 2.0, "a refused port must fail fast, not wait for the timeout"


async def test_failover_over_tcp_from_a_closed_port(ups: Upstreams) -> None:
    dead = ups.dead()
    good = await ups.tcp(answer_with("1.2.3.4"))
    res = await Forwarder([dead, good], 5.0, mark=None).forward(q(), tcp=True)
    assert addresses(res.reply) == ["1.2.3.4"]


@pytest.mark.parametrize("tcp", [False, True])
async def test_all_upstreams_dead_is_forwarded_none(tcp: bool) -> None:
    res = await Forwarder([Upstreams.dead(), Upstreams.dead()], 2.0, mark=None).forward(q(), tcp=tcp)
    assert res == Forwarded(None, "upstream_error")


async def test_no_upstreams() -> None:
    assert await Forwarder([], 1.0, mark=None).forward(q()) == Forwarded(None, "no_upstreams")


async def test_per_attempt_timeout_then_next_upstream(ups: Upstreams) -> None:
    mute = await ups.udp(silent)
    good = await ups.udp(answer_with("1.2.3.4"))
    start = time.monotonic()
    res = await Forwarder([mute, good], 0.2, mark=None).forward(q())
    elapsed = time.monotonic() - start
    assert addresses(res.reply) == ["1.2.3.4"]
    assert 0.18 <= elapsed < 1.5
    assert len(ups.udp_queries(mute)) == 1 and len(ups.udp_queries(good)) == 1


async def test_timeout_of_every_upstream_is_a_failure(ups: Upstreams) -> None:
    mute1, mute2 = await ups.udp(silent), await ups.udp(silent)
    start = time.monotonic()
    res = await Forwarder([mute1, mute2], 0.2, mark=None).forward(q())
    elapsed = time.monotonic() - start
    assert res == Forwarded(None, "upstream_error")
    assert 0.36 <= elapsed < 2.0  # one timeout per attempt, not one overall


@pytest.mark.parametrize("rcode", [RCODE.SERVFAIL, RCODE.REFUSED, RCODE.FORMERR, RCODE.NOTIMP])
async def test_non_final_rcode_tries_the_next_upstream(ups: Upstreams, rcode: int) -> None:
    bad = await ups.udp(answer_with(rcode=rcode))
    good = await ups.udp(answer_with("1.2.3.4"))
    res = await Forwarder([bad, good], 2.0, mark=None).forward(q())
    assert res.reply is not None and res.reply.header.rcode == RCODE.NOERROR
    assert addresses(res.reply) == ["1.2.3.4"]
    assert len(ups.udp_queries(bad)) == 1


async def test_servfail_everywhere_is_a_failure_with_reason_rcode(ups: Upstreams) -> None:
    bad1 = await ups.udp(answer_with(rcode=RCODE.SERVFAIL))
    bad2 = await ups.udp(answer_with(rcode=RCODE.SERVFAIL))
    assert await Forwarder([bad1, bad2], 2.0, mark=None).forward(q()) == Forwarded(None, "rcode")


async def test_nxdomain_is_final(ups: Upstreams) -> None:
    first = await ups.udp(answer_with(rcode=RCODE.NXDOMAIN))
    second = await ups.udp(answer_with("1.2.3.4"))
    res = await Forwarder([first, second], 2.0, mark=None).forward(q())
    assert res.reply is not None and res.reply.header.rcode == RCODE.NXDOMAIN
    assert ups.udp_queries(second) == []


async def test_noerror_is_final(ups: Upstreams) -> None:
    first = await ups.udp(answer_with("1.1.1.1"))
    second = await ups.udp(answer_with("2.2.2.2"))
    res = await Forwarder([first, second], 2.0, mark=None).forward(q())
    assert addresses(res.reply) == ["1.1.1.1"]
    assert ups.udp_queries(second) == []


async def test_reply_with_wrong_id_is_ignored(ups: Upstreams) -> None:
    def spoof_then_answer(query: DNSRecord) -> list[bytes]:
        spoof = a_reply(query, ("6.6.6.6", 60))
        spoof.header.id = (query.header.id + 1) % 65536
        return [wire(spoof), *answer_with("1.2.3.4")(query)]

    up = await ups.udp(spoof_then_answer)
    res = await Forwarder([up], 2.0, mark=None).forward(q(qid=100))
    assert res.reply is not None and res.reply.header.id == 100
    assert addresses(res.reply) == ["1.2.3.4"]


async def test_reply_for_another_question_or_a_query_or_garbage_is_ignored(ups: Upstreams) -> None:
    def noise_then_answer(query: DNSRecord) -> list[bytes]:
        other = a_reply(DNSRecord.question("evil.test"), ("6.6.6.6", 60))
        other.header.id = query.header.id  # right id, wrong question
        other_type = a_reply(DNSRecord.question(str(query.q.qname), "AAAA"), ("::6", 60))
        other_type.header.id = query.header.id
        echoed = DNSRecord.parse(wire(query))  # QR=0: not a reply
        return [wire(other), wire(other_type), wire(echoed), b"garbage", *answer_with("1.2.3.4")(query)]

    up = await ups.udp(noise_then_answer)
    res = await Forwarder([up], 2.0, mark=None).forward(q())
    assert addresses(res.reply) == ["1.2.3.4"]


async def test_only_wrong_id_replies_time_out(ups: Upstreams) -> None:
    def spoof(query: DNSRecord) -> list[bytes]:
        bad = a_reply(query, ("6.6.6.6", 60))
        bad.header.id = (query.header.id + 1) % 65536
        return [wire(bad)]

    up = await ups.udp(spoof)
    assert await Forwarder([up], 0.2, mark=None).forward(q()) == Forwarded(None, "upstream_error")


async def test_truncated_udp_reply_is_retried_over_tcp(ups: Upstreams) -> None:
    up = await ups.pair(udp=answer_with(tc=True), tcp=answer_with("1.2.3.4"))
    res = await Forwarder([up], 2.0, mark=None).forward(q(qid=77))
    assert res.reply is not None
    assert res.reply.header.tc == 0
    assert res.reply.header.id == 77
    assert addresses(res.reply) == ["1.2.3.4"]
    assert len(ups.udp_queries(up)) == 1
    assert len(ups.tcp_queries(up)) == 1


async def test_truncated_reply_without_tcp_falls_over_to_the_next_upstream(ups: Upstreams) -> None:
    tc_only = await ups.udp(answer_with(tc=True))  # no TCP listener on that port (most likely)
    good = await ups.udp(answer_with("1.2.3.4"))
    res = await Forwarder([tc_only, good], 2.0, mark=None).forward(q())
    assert addresses(res.reply) == ["1.2.3.4"]


async def test_forwarded_query_keeps_question_and_edns(ups: Upstreams) -> None:
    up = await ups.udp(answer_with("1.2.3.4"))
    await Forwarder([up], 2.0, mark=None).forward(q("www.example.com", "AAAA", qid=3, edns=4096))
    (seen,) = ups.udp_queries(up)
    assert seen.header.id == 3
    assert str(seen.q.qname) == "www.example.com."
    assert seen.q.qtype == QTYPE.AAAA
    assert [int(o.rclass) for o in opts(seen)] == [4096]


# --------------------------------------------------------------------------- SO_MARK


def _spy_sockets(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    real = forwarder_mod._socket

    def spy(up: Upstream, kind: int, mark: int | None) -> socket.socket:
        sock = real(up, kind, mark)
        seen.append((kind, sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK)))
        return sock

    monkeypatch.setattr(forwarder_mod, "_socket", spy)
    return seen


def _can_set_mark() -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, FORWARDER_MARK)
    except PermissionError:
        return False
    return True


async def test_mark_none_sets_no_mark(ups: Upstreams, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy_sockets(monkeypatch)
    up = await ups.pair(answer_with(tc=True), answer_with("1.2.3.4"))
    res = await Forwarder([up], 2.0, mark=None).forward(q())
    assert addresses(res.reply) == ["1.2.3.4"]
    assert seen == [(socket.SOCK_DGRAM, 0), (socket.SOCK_STREAM, 0)]


@pytest.mark.skipif(
    not hasattr(socket, "SO_MARK") or not _can_set_mark(), reason="SO_MARK needs root (CAP_NET_ADMIN)"
)
async def test_default_mark_is_applied_to_udp_and_tcp_sockets(
    ups: Upstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _spy_sockets(monkeypatch)
    up = await ups.pair(answer_with(tc=True), answer_with("1.2.3.4"))
    fwd = Forwarder([up], 2.0)  # default mark
    assert fwd.mark == FORWARDER_MARK == 0x1
    res = await fwd.forward(q())
    assert addresses(res.reply) == ["1.2.3.4"]
    assert seen == [(socket.SOCK_DGRAM, 0x1), (socket.SOCK_STREAM, 0x1)]
    seen.clear()
    res = await fwd.forward(q(), tcp=True)
    assert addresses(res.reply) == ["1.2.3.4"]
    assert seen == [(socket.SOCK_STREAM, 0x1)]


# --------------------------------------------------------------------------- 14.4 trimming


async def test_reply_carries_only_the_addresses_the_kernel_took() -> None:
    def two(query: DNSRecord) -> DNSRecord:
        return a_reply(query, ("10.9.0.1", 30), ("10.9.0.2", 30))

    policies = FakePolicies(active())
    policies.refused = {ip("10.9.0.2")}
    for tcp in (False, True):
        proxy = dns_proxy(policies, FakeForwarder(two))
        reply = parse(await proxy.answer(wire(q(edns=1232)), CLIENT, tcp=tcp))
        assert reply.header.rcode == RCODE.NOERROR
        assert [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A] == ["10.9.0.1"]


async def test_no_address_fits_is_servfail() -> None:
    policies = FakePolicies(active())
    policies.refused = {ip("93.184.216.34")}
    proxy = dns_proxy(policies, FakeForwarder())
    reply = parse(await proxy.answer(wire(q()), CLIENT, tcp=False))
    assert reply.header.rcode == RCODE.SERVFAIL
    assert reply.rr == []
