"""Requests on one connection, for the request-rule tests (docs/reference/behaviour.md §19).

Run inside a sandbox namespace with the venv's interpreter (HTTP/2 frames come from the ``h2``
library mitmproxy ships). It only talks to the address it is given. Prints one JSON line:
``{"ok": bool, "error": str, "responses": [{"status": int, "body": object}, …]}``.

  --raw FILE    HTTP/1: send FILE's bytes verbatim in one write (pipelining: several requests
                in it), then read --expect responses
  --h2 JSON     HTTP/2: a JSON list of requests, each a list of [name, value] header pairs
                (pseudo-headers first), each on its own stream, optional "body" as a third item
  --tls --sni N wrap in TLS with SNI N, verifying with --ca (the MITM's CA)
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import sys
import time
from pathlib import Path
from typing import Any


def _connect(args: argparse.Namespace, alpn: list[str]) -> socket.socket:
    sock = socket.create_connection((args.ip, args.port), timeout=args.timeout)
    if not args.tls:
        return sock
    ctx = ssl.create_default_context(cafile=args.ca)
    ctx.set_alpn_protocols(alpn)
    return ctx.wrap_socket(sock, server_hostname=args.sni or None)


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("latin-1")


def _http1(args: argparse.Namespace) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    try:
        sock = _connect(args, ["http/1.1"])
        sock.sendall(Path(args.raw).read_bytes())
        f = sock.makefile("rb")
        for _ in range(args.expect):
            line = f.readline()
            if not line:
                raise ConnectionError("closed")
            status = int(line.split()[1])
            length = 0
            headers: dict[str, str] = {}
            while True:
                h = f.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
                k, _, v = h.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
                if k.strip().lower() == "content-length":
                    length = int(v.strip())
            body = f.read(length) if length and not args.head else b""
            out.append({"status": status, "body": _body(body), "headers": headers})
            if status == 101:
                break
        return {"ok": True, "error": "", "responses": out}
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__, "responses": out}


def _h2_event(
    conn: Any, event: Any, out: dict[int, dict[str, Any]], bodies: dict[int, bytes], done: set[int]
) -> None:
    import h2.events

    if isinstance(event, h2.events.ResponseReceived):
        got = {k.decode(): v.decode() for k, v in event.headers}
        out[event.stream_id] = {"status": int(got.get(":status", "0"))}
    elif isinstance(event, h2.events.DataReceived):
        bodies[event.stream_id] = bodies.get(event.stream_id, b"") + event.data
        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
    elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
        done.add(event.stream_id)
        if isinstance(event, h2.events.StreamReset):
            out.setdefault(event.stream_id, {"status": 0})


def _http2(args: argparse.Namespace) -> dict[str, Any]:
    import h2.config
    import h2.connection

    wanted = json.loads(args.h2)
    out: dict[int, dict[str, Any]] = {}
    bodies: dict[int, bytes] = {}
    try:
        sock = _connect(args, ["h2"])
        if sock.selected_alpn_protocol() != "h2":  # type: ignore[attr-defined]
            return {"ok": False, "error": "no h2", "responses": []}
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, validate_outbound_headers=False)
        )
        conn.initiate_connection()
        streams = []
        for item in wanted:
            stream = conn.get_next_available_stream_id()
            streams.append(stream)
            headers = [(str(n), str(v)) for n, v in item[0]]
            body = item[1].encode() if len(item) > 1 and item[1] else None
            conn.send_headers(stream, headers, end_stream=body is None)
            if body is not None:
                conn.send_data(stream, body, end_stream=True)
            sock.sendall(conn.data_to_send())
        done: set[int] = set()
        deadline = time.monotonic() + args.timeout
        while len(done) < len(streams) and time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                _h2_event(conn, event, out, bodies, done)
            sock.sendall(conn.data_to_send())
        sock.close()
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__, "responses": []}
    responses = []
    for stream in streams:
        r = out.get(stream, {"status": 0})
        r["body"] = _body(bodies.get(stream, b""))
        responses.append(r)
    return {"ok": True, "error": "", "responses": responses}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ip", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--sni", default="")
    ap.add_argument("--ca", default=None)
    ap.add_argument("--raw", default=None)
    ap.add_argument("--expect", type=int, default=1)
    ap.add_argument("--head", action="store_true")
    ap.add_argument("--h2", default=None)
    ap.add_argument("--timeout", type=float, default=4.0)
    args = ap.parse_args()
    print(json.dumps(_http2(args) if args.h2 is not None else _http1(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
