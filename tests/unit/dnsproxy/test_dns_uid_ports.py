"""The DNS proxy's per-subject ports (docs/reference/behaviour.md §17): the asker is known by the port the kernel
redirected the query to, never by the source address (every host-uid sandbox asks from the
host's own address)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct

from dnslib import QTYPE, RCODE, RR, A, DNSRecord

from egressd.addr import IPAddress
from egressd.dnsproxy.forwarder import Forwarded
from egressd.dnsproxy.server import MAX_IN_FLIGHT_PER_CLIENT, DnsProxy, PortAsker
from egressd.policy import parse_policy
from egressd.subject.model import Asker, Fence

HOST = "10.77.0.1"  # the host's own address: where every redirected query comes from
FENCE = Fence("r1", "a1")
POLICY = parse_policy(
    '{"defaultAction":"deny","egress":[{"action":"deny","target":"api.example.com"},'
    '{"action":"allow","target":"*.example.com"}]}'
)


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def q(name: str, *, qid: int = 4321) -> DNSRecord:
    query = DNSRecord.question(name, "A")
    query.header.id = qid
    return query


def wire(record: DNSRecord) -> bytes:
    return bytes(record.pack())


def parse(data: bytes | None) -> DNSRecord:
    assert data is not None
    return DNSRecord.parse(data)


class FakeForwarder:
    def __init__(self) -> None:
        self.calls: list[DNSRecord] = []

    async def forward(self, query: DNSRecord, *, tcp: bool = False) -> Forwarded:
        self.calls.append(query)
        reply = query.reply()
        reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A("93.184.216.34"), ttl=30))
        return Forwarded(DNSRecord.parse(wire(reply)))


class FakePolicies:
    """Source-address askers; records every address lookup and every learn."""

    def __init__(self, askers: dict[str, Asker] | None = None) -> None:
        self.askers = {ip(k): v for k, v in (askers or {}).items()}
        self.lookups: list[IPAddress] = []
        self.learned: list[tuple[str, Fence, list[tuple[IPAddress, int]]]] = []
        self.learn_gate: asyncio.Event | None = None

    def asker(self, source_ip: IPAddress) -> Asker | None:
        self.lookups.append(source_ip)
        return self.askers.get(source_ip)

    async def learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None = None
    ) -> list[IPAddress]:
        if self.learn_gate is not None:
            await self.learn_gate.wait()
        self.learned.append((uid, fence, list(leases)))
        return [addr for addr, _ in leases]


def make(policies: FakePolicies, fwd: FakeForwarder) -> DnsProxy:
    return DnsProxy(policies.asker, fwd, on_resolved=policies.learn)  # type: ignore[arg-type]


def free_port() -> int:
    """A port free for UDP *and* TCP on 127.0.0.1 (the listener binds both; a UDP-free port can be
    some TCP connection's local port, which made this flaky under a busy machine)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("127.0.0.1", 0))
            port = int(u.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind(("127.0.0.1", port))
                except OSError:
                    continue
        return port
    raise RuntimeError("no port free for both UDP and TCP")


async def test_the_port_names_the_asker_not_the_source_address() -> None:
    # The source address belongs to a network subject; the port to host-uid subject u-2.
    policies = FakePolicies({HOST: Asker("u-1", FENCE, POLICY)})
    fwd = FakeForwarder()
    proxy = make(policies, fwd)
    by_port = PortAsker(16001, lambda: Asker("u-2", FENCE, POLICY))
    reply = parse(await proxy.answer(wire(q("www.example.com")), HOST, tcp=False, by_port=by_port))
    assert reply.header.rcode == RCODE.NOERROR
    assert policies.lookups == []  # the source address was never looked up
    assert [uid for uid, _, _ in policies.learned] == ["u-2"]


async def test_a_port_nobody_holds_is_an_unknown_source() -> None:
    policies, fwd = FakePolicies({HOST: Asker("u-1", FENCE, POLICY)}), FakeForwarder()
    proxy = make(policies, fwd)
    reply = parse(
        await proxy.answer(
            wire(q("www.example.com")), HOST, tcp=False, by_port=PortAsker(16256, lambda: None)
        )
    )
    assert reply.header.rcode == RCODE.NXDOMAIN
    assert fwd.calls == [] and policies.learned == []


async def test_a_denying_port_subject_is_nxdomain() -> None:
    fwd = FakeForwarder()
    proxy = make(FakePolicies(), fwd)
    by_port = PortAsker(16001, lambda: Asker("u-2", FENCE, None))
    reply = parse(await proxy.answer(wire(q("www.example.com")), HOST, tcp=False, by_port=by_port))
    assert reply.header.rcode == RCODE.NXDOMAIN and fwd.calls == []


async def test_the_asker_is_read_per_query() -> None:
    # A removal or rebind between two queries of one socket takes effect on the second.
    holder: list[Asker | None] = [Asker("u-2", FENCE, POLICY)]
    proxy = make(FakePolicies(), FakeForwarder())
    by_port = PortAsker(16001, lambda: holder[0])
    first = parse(await proxy.answer(wire(q("www.example.com")), HOST, tcp=False, by_port=by_port))
    holder[0] = None
    second = parse(await proxy.answer(wire(q("www.example.com")), HOST, tcp=False, by_port=by_port))
    assert (first.header.rcode, second.header.rcode) == (RCODE.NOERROR, RCODE.NXDOMAIN)


async def test_in_flight_bound_is_per_port() -> None:
    policies = FakePolicies()
    policies.learn_gate = asyncio.Event()
    proxy = make(policies, FakeForwarder())
    flood = PortAsker(16001, lambda: Asker("u-2", FENCE, POLICY))
    other = PortAsker(16002, lambda: Asker("u-3", FENCE, POLICY))
    tasks = [
        asyncio.create_task(
            proxy.bounded_answer(wire(q("www.example.com", qid=i)), HOST, tcp=False, by_port=flood)
        )
        for i in range(MAX_IN_FLIGHT_PER_CLIENT + 1)
    ]
    await asyncio.sleep(0.05)
    # u-2's own bound is full (the 65th was dropped), u-3 from the same address still gets in.
    victim = asyncio.create_task(
        proxy.bounded_answer(wire(q("www.example.com")), HOST, tcp=False, by_port=other)
    )
    await asyncio.sleep(0.05)
    policies.learn_gate.set()
    answers = await asyncio.gather(*tasks)
    assert sum(a is None for a in answers) == 1
    assert parse(await victim).header.rcode == RCODE.NOERROR


async def test_start_and_stop_a_port_listener_udp_and_tcp() -> None:
    proxy = make(FakePolicies(), FakeForwarder())
    port = free_port()
    await proxy.start_port(PortAsker(port, lambda: Asker("u-2", FENCE, POLICY)), hosts=("127.0.0.1",))
    await proxy.start_port(PortAsker(port, lambda: None), hosts=("127.0.0.1",))  # already open: no-op
    assert proxy.listening_ports() == [port]
    loop = asyncio.get_running_loop()
    try:
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.setblocking(False)
        await loop.sock_connect(udp, ("127.0.0.1", port))
        await loop.sock_sendall(udp, wire(q("www.example.com", qid=11)))
        got = DNSRecord.parse(await asyncio.wait_for(loop.sock_recv(udp, 4096), 2))
        assert (got.header.id, got.header.rcode) == (11, RCODE.NOERROR)
        udp.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = wire(q("api.example.com", qid=12))
        writer.write(struct.pack("!H", len(data)) + data)
        (length,) = struct.unpack("!H", await reader.readexactly(2))
        got = DNSRecord.parse(await reader.readexactly(length))
        assert (got.header.id, got.header.rcode) == (12, RCODE.NXDOMAIN)  # denied name, via TCP
        writer.close()
    finally:
        await proxy.stop_port(port)
    assert proxy.listening_ports() == []
    # Closed at once: the port can be bound again right away.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    await proxy.close()


async def test_a_port_taken_by_someone_else_raises_and_leaves_nothing_open() -> None:
    proxy = make(FakePolicies(), FakeForwarder())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        try:
            await proxy.start_port(PortAsker(port, lambda: None), hosts=("127.0.0.1",))
        except OSError:
            pass
        else:
            raise AssertionError("bound a port somebody else listens on")
    assert proxy.listening_ports() == []
    assert ip("127.0.0.1").is_loopback
