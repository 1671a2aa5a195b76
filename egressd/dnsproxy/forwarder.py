"""Forwarding allowed queries upstream: in order, per-attempt timeout, failover, SO_MARK 0x1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from dnslib import DNSRecord

from egressd.dnsproxy.decide import final_rcode
from egressd.dnsproxy.upstreams import Upstream
from egressd.nftsyntax import FORWARDER_MARK

_MAX_UDP = 65535
_POOL_PER_UPSTREAM = 32


@dataclass(frozen=True, slots=True)
class Forwarded:
    reply: DNSRecord | None  # None: every upstream failed -> SERVFAIL
    failure: str = ""  # last failure reason: upstream_error | empty_response | rcode | no_upstreams
    wire: bytes | None = None  # the reply exactly as received (UDP), when available


def _socket(up: Upstream, kind: int, mark: int | None) -> socket.socket:
    fam = socket.AF_INET if up.family == 4 else socket.AF_INET6
    sock = socket.socket(fam, kind)
    try:
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _matches(query: DNSRecord, reply: DNSRecord) -> bool:
    if reply.header.id != query.header.id or not reply.header.qr:
        return False
    if not query.questions:
        return True
    return bool(reply.questions) and reply.q.qname == query.q.qname and reply.q.qtype == query.q.qtype


class Forwarder:
    def __init__(
        self, upstreams: Sequence[Upstream], timeout: float, *, mark: int | None = FORWARDER_MARK
    ) -> None:
        self.upstreams = tuple(upstreams)
        self.timeout = timeout
        self.mark = mark
        self._pool: dict[Upstream, list[socket.socket]] = {}

    async def forward(self, query: DNSRecord, *, tcp: bool = False) -> Forwarded:
        if not self.upstreams:
            return Forwarded(None, "no_upstreams")
        wire = bytes(query.pack())
        failure = "upstream_error"
        for up in self.upstreams:
            raw: bytes | None = None
            try:
                if tcp:
                    reply = await asyncio.wait_for(self._tcp(up, wire, query), self.timeout)
                else:
                    got = await asyncio.wait_for(self._udp(up, wire, query), self.timeout)
                    reply, raw = got if got is not None else (None, None)
                    if reply is not None and reply.header.tc:
                        raw = None
                        reply = await asyncio.wait_for(self._tcp(up, wire, query), self.timeout)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                failure = "upstream_error"
                continue
            if reply is None:
                failure = "empty_response"
                continue
            if not final_rcode(reply):
                failure = "rcode"
                continue
            return Forwarded(reply, wire=raw)
        return Forwarded(None, failure)

    async def _udp(self, up: Upstream, wire: bytes, query: DNSRecord) -> tuple[DNSRecord, bytes] | None:
        loop = asyncio.get_running_loop()
        sock = await self._checkout(up)
        clean = False
        try:
            await loop.sock_sendall(sock, wire)
            while True:  # ignore stray, late or spoofed datagrams until the timeout
                data = await loop.sock_recv(sock, _MAX_UDP)
                if not data:
                    return None
                try:
                    reply = DNSRecord.parse(data)
                except Exception:
                    continue
                if _matches(query, reply):
                    clean = True
                    return reply, data
        finally:
            # Only a socket whose exchange completed goes back: a timed-out one may still get
            # the late answer, which must never be read as the next query's.
            if clean and len(self._pool.get(up, ())) < _POOL_PER_UPSTREAM:
                self._pool.setdefault(up, []).append(sock)
            else:
                sock.close()

    async def _checkout(self, up: Upstream) -> socket.socket:
        """A connected UDP socket to ``up``: reused from the pool (no socket and no new
        conntrack entry per query) or made on demand."""
        pool = self._pool.get(up)
        if pool:
            return pool.pop()
        sock = _socket(up, socket.SOCK_DGRAM, self.mark)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (up.host, up.port))
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        for pool in self._pool.values():
            for sock in pool:
                sock.close()
        self._pool.clear()

    async def _tcp(self, up: Upstream, wire: bytes, query: DNSRecord) -> DNSRecord | None:
        loop = asyncio.get_running_loop()
        sock = _socket(up, socket.SOCK_STREAM, self.mark)
        try:
            await loop.sock_connect(sock, (up.host, up.port))
        except BaseException:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(struct.pack("!H", len(wire)) + wire)
            await writer.drain()
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            if length == 0:
                return None
            reply = DNSRecord.parse(await reader.readexactly(length))
            return reply if _matches(query, reply) else None
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
