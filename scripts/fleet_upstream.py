#!/usr/bin/env python3
"""Upstream services for tests and demos, run inside the "upstream" network namespace.

* HTTP echo servers on the given ports (dual-stack): every request is answered with a JSON
  echo of what arrived.
* An authoritative DNS server (UDP and TCP, dual-stack) for a zone given as JSON
  (``--zone``): ``{"records": [{"name": "a.test", "type": "A|AAAA|CNAME", "value": "...",
  "ttl": 30}]}``. Names are answered case-insensitively, CNAME chains are followed inside
  the zone, unknown names get NXDOMAIN.

One JSON line per HTTP request and per DNS query is appended to ``--log``, so tests can
prove that a connection or a query never reached the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import time
from pathlib import Path

from aiohttp import web
from dnslib import AAAA, CNAME, QTYPE, RCODE, RR, A, DNSRecord


def _client_ip(request: web.Request) -> str:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    host = str(peer[0]) if peer else "?"
    return host.removeprefix("::ffff:")


def make_app(log_path: Path | None, port: int) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        record = {
            "ts": time.time(),
            "port": port,
            "client": _client_ip(request),
            "method": request.method,
            "path": request.path_qs,
            "host": request.host,
            "local": str(request.transport.get_extra_info("sockname")[0]).removeprefix("::ffff:")
            if request.transport
            else "?",
            "headers": dict(request.headers),
            "bodyBytes": len(body),
        }
        _append(log_path, record)
        return web.json_response(record)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def _append(log_path: Path | None, record: dict[str, object]) -> None:
    if log_path is not None:
        with log_path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


class Zone:
    def __init__(self, records: list[dict[str, object]]) -> None:
        self.records: dict[str, list[dict[str, object]]] = {}
        for rec in records:
            name = str(rec["name"]).lower().rstrip(".")
            self.records.setdefault(name, []).append(rec)

    def answer(self, request: DNSRecord) -> DNSRecord:
        reply = request.reply()
        reply.header.ra = 0
        q = request.q
        name = str(q.qname).lower().rstrip(".")
        qtype = QTYPE[q.qtype]
        seen: set[str] = set()
        while name not in seen:
            seen.add(name)
            recs = self.records.get(name)
            if recs is None:
                if not reply.rr:
                    reply.header.rcode = RCODE.NXDOMAIN
                return reply
            cname = next((r for r in recs if r["type"] == "CNAME"), None)
            if cname is not None and qtype != "CNAME":
                reply.add_answer(
                    RR(
                        name + ".",
                        QTYPE.CNAME,
                        ttl=int(cname.get("ttl", 60)),
                        rdata=CNAME(str(cname["value"])),
                    )
                )
                name = str(cname["value"]).lower().rstrip(".")
                continue
            for r in recs:
                if r["type"] != qtype:
                    continue
                rdata = {"A": A, "AAAA": AAAA, "CNAME": CNAME}[str(r["type"])](str(r["value"]))
                reply.add_answer(
                    RR(name + ".", getattr(QTYPE, str(r["type"])), ttl=int(r.get("ttl", 60)), rdata=rdata)
                )
            return reply
        return reply


class _DnsUdp(asyncio.DatagramProtocol):
    def __init__(self, zone: Zone, log_path: Path | None) -> None:
        self.zone = zone
        self.log_path = log_path
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = _dns_reply(self.zone, self.log_path, data, addr[0], "udp")
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


def _dns_reply(zone: Zone, log_path: Path | None, data: bytes, client: str, proto: str) -> bytes | None:
    try:
        request = DNSRecord.parse(data)
    except Exception:
        return None
    _append(
        log_path,
        {
            "ts": time.time(),
            "dns": str(request.q.qname).lower().rstrip("."),
            "qtype": QTYPE[request.q.qtype],
            "client": client.removeprefix("::ffff:"),
            "proto": proto,
        },
    )
    return bytes(zone.answer(request).pack())


async def _dns_tcp(
    zone: Zone, log_path: Path | None, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    peer = writer.get_extra_info("peername")
    try:
        while True:
            head = await reader.readexactly(2)
            data = await reader.readexactly(int.from_bytes(head, "big"))
            reply = _dns_reply(zone, log_path, data, str(peer[0]), "tcp")
            if reply is None:
                break
            writer.write(len(reply).to_bytes(2, "big") + reply)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _dual_stack(kind: int, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6, kind)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("::", port))
    return sock


async def serve(
    ports: list[int], log_path: Path | None, zone: Zone | None = None, dns_port: int = 53
) -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(make_app(log_path, port), access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::", port))
        sock.listen(128)
        await web.SockSite(runner, sock).start()
        runners.append(runner)
    loop = asyncio.get_running_loop()
    closers = []
    if zone is not None:
        udp_sock = _dual_stack(socket.SOCK_DGRAM, dns_port)
        transport, _ = await loop.create_datagram_endpoint(lambda: _DnsUdp(zone, log_path), sock=udp_sock)
        closers.append(transport.close)
        tcp_sock = _dual_stack(socket.SOCK_STREAM, dns_port)
        tcp_sock.listen(64)
        server = await asyncio.start_server(lambda r, w: _dns_tcp(zone, log_path, r, w), sock=tcp_sock)
        closers.append(server.close)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for close in closers:
        close()
    for runner in runners:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http-ports", default="80", help="comma-separated HTTP echo ports")
    parser.add_argument("--log", type=Path, help="append one JSON line per request/query here")
    parser.add_argument("--zone", type=Path, help="JSON zone file; enables the DNS server")
    parser.add_argument("--dns-port", type=int, default=53)
    args = parser.parse_args()
    ports = [int(p) for p in args.http_ports.split(",") if p.strip()]
    zone = Zone(json.loads(args.zone.read_text())["records"]) if args.zone else None
    asyncio.run(serve(ports, args.log, zone, args.dns_port))


if __name__ == "__main__":
    main()
