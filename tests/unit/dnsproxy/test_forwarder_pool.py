"""Upstream UDP sockets are reused after a clean exchange and never after a timeout."""

from __future__ import annotations

import asyncio

from dnslib import RR, A, DNSRecord

from egressd.dnsproxy.forwarder import Forwarder
from egressd.dnsproxy.upstreams import Upstream


class _Server(asyncio.DatagramProtocol):
    def __init__(self, silent: set[str]) -> None:
        self.silent = silent
        self.peers: list[tuple[str, int]] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        q = DNSRecord.parse(data)
        self.peers.append(addr)
        if str(q.q.qname).rstrip(".") in self.silent:
            return
        r = q.reply()
        r.add_answer(RR(q.q.qname, rdata=A("192.0.2.1"), ttl=30))
        assert self.transport is not None
        self.transport.sendto(r.pack(), addr)


async def test_pool_reuses_clean_sockets_only() -> None:
    loop = asyncio.get_running_loop()
    server = _Server(silent={"slow.test"})
    transport, _ = await loop.create_datagram_endpoint(lambda: server, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    fwd = Forwarder([Upstream("127.0.0.1", port)], timeout=0.2, mark=None)
    try:
        for name in ("a.test", "b.test", "c.test"):
            assert (await fwd.forward(DNSRecord.question(name))).reply is not None
        # Sequential clean exchanges share one socket: one source port at the upstream.
        assert len({p for p in server.peers}) == 1
        assert (await fwd.forward(DNSRecord.question("slow.test"))).reply is None
        assert (await fwd.forward(DNSRecord.question("d.test"))).reply is not None
        # The socket that timed out was dropped, so the next exchange used a fresh port.
        assert server.peers[-1] != server.peers[0]
        assert server.peers[-2] == server.peers[0]
    finally:
        fwd.close()
        transport.close()


async def test_concurrent_queries_use_separate_sockets() -> None:
    loop = asyncio.get_running_loop()
    server = _Server(silent=set())
    transport, _ = await loop.create_datagram_endpoint(lambda: server, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    fwd = Forwarder([Upstream("127.0.0.1", port)], timeout=1.0, mark=None)
    try:
        queries = [DNSRecord.question(f"n{i}.test") for i in range(8)]
        results = await asyncio.gather(*(fwd.forward(q) for q in queries))
        for q, res in zip(queries, results, strict=True):
            assert res.reply is not None and res.reply.header.id == q.header.id
    finally:
        fwd.close()
        transport.close()
