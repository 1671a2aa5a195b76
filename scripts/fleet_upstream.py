#!/usr/bin/env python3
"""Upstream services for tests and demos, run inside the "upstream" network namespace.

* HTTP echo servers on the given ports (dual-stack): every request is answered with a JSON
  echo of what arrived (headers, body up to 4 KiB). The response also carries the request's
  ``Authorization`` back as ``X-Echo-Authorization`` (tests of response-header redaction).
  The echo also carries ``seen``: base64 of ``{"headers", "body"}`` as they arrived, so a test
  can read what the upstream received through a MITM that redacts its credential strings from
  response bodies (docs/reference/behaviour.md §10; an upstream that encodes a credential can always hand
  it back, which is what this does on purpose).
* Under ``/_stream/`` the streaming endpoints of ``upstream_streams.py`` (server-sent events,
  bulk bodies, split echoes, an upload sink, a WebSocket).
* With ``--tls-dir DIR``, HTTPS echo servers on ``--https-ports``: a test CA is created once
  in ``DIR/ca.pem`` (and ``DIR/trust/``, an OpenSSL hashed directory holding it), and a leaf
  for every zone name, ``*.test``, ``*.example.test`` and the upstream addresses. A TLS
  connection whose SNI starts with ``h2.`` is offered HTTP/2 (ALPN ``h2``) and served the same
  endpoints over it.
* An authoritative DNS server (UDP and TCP, dual-stack) for a zone given as JSON
  (``--zone``): ``{"records": [{"name": "a.test", "type": "A|AAAA|CNAME", "value": "...",
  "ttl": 30}]}``. Names are answered case-insensitively, CNAME chains are followed inside
  the zone, unknown names get NXDOMAIN. A record's ``"delay_s"`` holds its name's UDP answer
  back that long (a query in flight for tests of what happens meanwhile).

One JSON line per HTTP request and per DNS query is appended to ``--log``, so tests can
prove that a connection or a query never reached the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import ipaddress
import json
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import upstream_streams
from aiohttp import web
from dnslib import AAAA, CNAME, OPCODE, QTYPE, RCODE, RR, A, DNSRecord


def _client_ip(request: web.Request) -> str:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    host = str(peer[0]) if peer else "?"
    return host.removeprefix("::ffff:")


def echo_record(
    port: int, tls: bool, client: str, method: str, path: str, host: str, local: str,
    headers: dict[str, str], body: bytes, resumed: bool = False,
) -> dict[str, object]:  # fmt: skip
    seen = {"headers": headers, "body": body[:4096].decode("utf-8", "replace")}
    return {
        "ts": time.time(),
        "port": port,
        "tls": tls,
        # Whether this TLS connection resumed a session (the MITM's session resumption tests).
        "tlsResumed": resumed,
        "client": client,
        "method": method,
        "path": path,
        "host": host,
        "local": local,
        "headers": headers,
        "bodyBytes": len(body),
        "body": seen["body"],
        "seen": base64.b64encode(json.dumps(seen).encode()).decode(),
    }


def make_app(log_path: Path | None, port: int, tls: bool = False) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        ssl_obj = request.transport.get_extra_info("ssl_object") if request.transport else None
        record = echo_record(
            port,
            tls,
            _client_ip(request),
            request.method,
            request.path_qs,
            request.host,
            str(request.transport.get_extra_info("sockname")[0]).removeprefix("::ffff:")
            if request.transport
            else "?",
            dict(request.headers),
            body,
            resumed=bool(getattr(ssl_obj, "session_reused", False)) if tls else False,
        )
        _append(log_path, {k: v for k, v in record.items() if k != "seen"})
        echo_headers = {}
        if "Authorization" in request.headers:
            echo_headers["X-Echo-Authorization"] = request.headers["Authorization"]
        return web.json_response(record, headers=echo_headers)

    app = web.Application(client_max_size=64 << 20)  # large-body tests
    upstream_streams.add_routes(app, upstream_streams.write_log(log_path))
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def make_tls(tls_dir: Path, names: list[str], ips: list[str]) -> ssl.SSLContext:
    """Server context with a leaf signed by the test CA in ``tls_dir`` (created once)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    tls_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key_path, ca_path = tls_dir / "ca.key", tls_dir / "ca.pem"
    if not ca_path.exists():
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egressd test upstream CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        ca_key_path.write_bytes(
            ca_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        trust = tls_dir / "trust"
        trust.mkdir(exist_ok=True)
        (trust / "ca.pem").write_bytes(ca_path.read_bytes())
        subprocess.run(["openssl", "rehash", str(trust)], check=True, capture_output=True)
    ca_cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "upstream")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_path, key_path = tls_dir / "leaf.pem", tls_dir / "leaf.key"
    leaf_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + ca_path.read_bytes())
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(leaf_path), str(key_path))
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.sni_callback = upstream_streams.sni_switch(upstream_streams.h2_context(str(leaf_path), str(key_path)))
    return ctx


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

    def delay(self, request: DNSRecord) -> float:
        """How long this name's answer is held back (its records' ``delay_s``; 0 by default)."""
        recs = self.records.get(str(request.q.qname).lower().rstrip("."), [])
        return max((float(str(r.get("delay_s", 0))) for r in recs), default=0.0)

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
        if reply is None or self.transport is None:
            return
        try:
            delay = self.zone.delay(DNSRecord.parse(data))
        except Exception:
            delay = 0.0
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self.transport.sendto, reply, addr)
        else:
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
            # so tests can prove no UPDATE/NOTIFY (docs/reference/behaviour.md §14.3) ever reached the upstream
            "opcode": OPCODE.get(request.header.opcode, str(request.header.opcode)),
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


def _h2_fallback(port: int, log_path: Path | None) -> upstream_streams.Echo:
    """The plain echo over HTTP/2 (paths outside ``/_stream/``)."""

    def echo(headers: dict[str, str], body: bytes) -> dict[str, object]:
        plain = {k: v for k, v in headers.items() if not k.startswith(":")}
        record = echo_record(port, True, "?", headers.get(":method", "?"), headers.get(":path", "/"),
                             headers.get(":authority", ""), "?", plain, body)  # fmt: skip
        _append(log_path, {k: v for k, v in record.items() if k != "seen"})
        return record

    return echo


async def serve(
    ports: list[int],
    log_path: Path | None,
    zone: Zone | None = None,
    dns_port: int = 53,
    https: dict[int, ssl.SSLContext] | None = None,
) -> None:
    runners = []
    https = https or {}
    loop = asyncio.get_running_loop()
    closers = []
    log = upstream_streams.write_log(log_path)
    for port in ports:
        runner = web.AppRunner(make_app(log_path, port, tls=port in https), access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::", port))
        sock.listen(128)
        if port in https:
            # One TLS listener for both protocols: ALPN (h2 only for SNI h2.*) picks the server.
            server, fallback = runner.server, _h2_fallback(port, log_path)
            assert server is not None
            tls_server = await loop.create_server(
                lambda s=server, f=fallback: upstream_streams.AlpnDispatch(
                    s, lambda: upstream_streams.H2Server(log, f)
                ),
                sock=sock,
                ssl=https[port],
            )
            closers.append(tls_server.close)
        else:
            await web.SockSite(runner, sock).start()
        runners.append(runner)
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
    parser.add_argument("--tls-dir", type=Path, help="test CA + leaf here; enables --https-ports")
    parser.add_argument("--https-ports", default="443", help="comma-separated HTTPS echo ports")
    parser.add_argument("--tls-ips", default="", help="comma-separated IP SANs for the leaf")
    args = parser.parse_args()
    ports = [int(p) for p in args.http_ports.split(",") if p.strip()]
    records = json.loads(args.zone.read_text())["records"] if args.zone else []
    zone = Zone(records) if args.zone else None
    https: dict[int, ssl.SSLContext] = {}
    if args.tls_dir:
        names = sorted({str(r["name"]).lower() for r in records} | {"*.test", "*.example.test"})
        ctx = make_tls(args.tls_dir, names, [i for i in args.tls_ips.split(",") if i.strip()])
        for p in args.https_ports.split(","):
            if p.strip():
                https[int(p)] = ctx
                if int(p) not in ports:
                    ports.append(int(p))
    asyncio.run(serve(ports, args.log, zone, args.dns_port, https))


if __name__ == "__main__":
    main()
