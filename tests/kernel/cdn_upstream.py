#!/usr/bin/env python3
"""A CDN-shaped upstream for the name-check tests (docs/reference/behaviour.md §18), run in the
upstream namespace instead of ``scripts/fleet_upstream.py`` (same command line).

* DNS: ``fleet_upstream``'s authoritative server for ``--zone`` (CNAME chains followed).
* TLS on ``--https-ports``: one certificate per name, chosen by SNI (every zone name has its
  own leaf; no SNI gets a leaf for the addresses), HTTP/1.1 echo by ``Host``.
* Plain HTTP on ``--http-ports``: an HTTP/1.1 keep-alive echo by ``Host``.

Every accepted TCP connection is recorded **at accept**, before a byte is read
(``{"event": "accept", "port", "peer", "local"}``), and every request after it
(``{"event": "request", "port", "sni", "host", "path"}``): a test proves that a refused
connection never reached the upstream by finding no accept for it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import socket
import ssl
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

# scripts/ is not a package: the shared DNS server and test CA are imported by path.
fleet_upstream: Any = importlib.import_module("fleet_upstream")

_lock = threading.Lock()


def record(log: Path, doc: dict[str, object]) -> None:
    with _lock, log.open("a") as fh:
        fh.write(json.dumps(doc) + "\n")


def contexts(tls_dir: Path, names: list[str], ips: list[str]) -> ssl.SSLContext:
    """The default context (a leaf for the addresses) switching to each name's own leaf by SNI."""
    by_name: dict[str, ssl.SSLContext] = {}
    for name in names:
        ctx = fleet_upstream.make_tls(tls_dir, [name], [])
        ctx.sni_callback = None
        by_name[name] = ctx
    default: ssl.SSLContext = fleet_upstream.make_tls(tls_dir, ["upstream"], ips)

    def switch(sock: Any, name: str | None, _ctx: ssl.SSLContext) -> None:
        sock.sni = name  # read back by the handler
        chosen = by_name.get((name or "").lower())
        if chosen is not None:
            sock.context = chosen

    default.sni_callback = switch
    return default


def _read_request(reader: Any) -> tuple[str, str, dict[str, str]] | None:
    line = reader.readline()
    while line in (b"\r\n", b"\n"):  # empty lines before a request line are skipped (RFC 9112 §2.2)
        line = reader.readline()
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) < 2:
        return None
    headers: dict[str, str] = {}
    while True:
        h = reader.readline()
        if not h or h in (b"\r\n", b"\n"):
            break
        k, _, v = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0") or 0)
    if length:
        reader.read(length)
    return parts[0], parts[1], headers


def serve_conn(conn: socket.socket, port: int, log: Path, tls: ssl.SSLContext | None) -> None:
    sni: str | None = None
    try:
        if tls is not None:
            conn = tls.wrap_socket(conn, server_side=True)
            sni = getattr(conn, "sni", None)
        reader = conn.makefile("rb")
        while True:
            req = _read_request(reader)
            if req is None:
                return
            method, path, headers = req
            host = headers.get("host", "")
            record(log, {"event": "request", "port": port, "sni": sni, "host": host, "path": path})
            body = json.dumps({"sni": sni, "host": host, "path": path, "method": method}).encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
    except (OSError, ssl.SSLError):
        return
    finally:
        conn.close()


def listen(port: int, log: Path, tls: ssl.SSLContext | None) -> None:
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("::", port))
    sock.listen(128)

    def loop() -> None:
        while True:
            conn, peer = sock.accept()
            local = conn.getsockname()
            record(
                log,
                {
                    "event": "accept",
                    "port": port,
                    "peer": str(peer[0]).removeprefix("::ffff:"),
                    "local": str(local[0]).removeprefix("::ffff:"),
                },
            )
            threading.Thread(target=serve_conn, args=(conn, port, log, tls), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()


async def dns(zone: Any, log: Path) -> None:
    loop = asyncio.get_running_loop()
    udp = fleet_upstream._dual_stack(socket.SOCK_DGRAM, 53)
    await loop.create_datagram_endpoint(lambda: fleet_upstream._DnsUdp(zone, log), sock=udp)
    tcp = fleet_upstream._dual_stack(socket.SOCK_STREAM, 53)
    tcp.listen(64)
    await asyncio.start_server(lambda r, w: fleet_upstream._dns_tcp(zone, log, r, w), sock=tcp)
    print("ready", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http-ports", default="80")
    parser.add_argument("--https-ports", default="443")
    parser.add_argument("--tls-dir", type=Path, required=True)
    parser.add_argument("--tls-ips", default="")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--zone", type=Path, required=True)
    args = parser.parse_args()
    records = json.loads(args.zone.read_text())["records"]
    names = sorted({str(r["name"]).lower() for r in records})
    tls = contexts(args.tls_dir, names, [i for i in args.tls_ips.split(",") if i.strip()])
    for p in args.http_ports.split(","):
        if p.strip():
            listen(int(p), args.log, None)
    for p in args.https_ports.split(","):
        if p.strip():
            listen(int(p), args.log, tls)
    asyncio.run(dns(fleet_upstream.Zone(records), args.log))


if __name__ == "__main__":
    main()
