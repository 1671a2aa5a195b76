"""One request whose names disagree, for the one-authority tests (docs/reference/behaviour.md §14.8).

Run inside a sandbox namespace (``ip netns exec <sb> <venv python> authority_client.py ...``)
with the venv's interpreter: HTTP/2 frames are crafted with the ``h2`` library mitmproxy
ships, because curl folds a custom ``Host`` into ``:authority`` and never sends both.
It only talks to the address it is given. Prints one JSON line:
``{"status": <int, 0 = no HTTP reply>, "error": <str>, "head": <str>}``.

  --raw FILE      HTTP/1: send FILE's bytes verbatim (the caller writes the request line,
                  e.g. an absolute-form target, and any Host headers, duplicates included)
  --h2 JSON       HTTP/2: a JSON list of [name, value] header pairs, pseudo-headers first
  --tls --sni N   wrap in TLS with SNI N (omit --sni for none), verifying with --ca
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import sys
import time
from pathlib import Path


def _connect(args: argparse.Namespace, alpn: list[str]) -> socket.socket:
    sock = socket.create_connection((args.ip, args.port), timeout=args.timeout)
    if not args.tls:
        return sock
    ctx = ssl.create_default_context(cafile=args.ca)
    ctx.check_hostname = False  # the MITM leaf is minted for the SNI; names are the point here
    ctx.set_alpn_protocols(alpn)
    return ctx.wrap_socket(sock, server_hostname=args.sni or None)


def _http1(args: argparse.Namespace) -> dict[str, object]:
    sock = _connect(args, ["http/1.1"])
    sock.sendall(Path(args.raw).read_bytes())
    data = b""
    deadline = time.monotonic() + args.timeout
    try:
        while b"\r\n\r\n" not in data and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, OSError) as exc:
        if not data:
            return {"status": 0, "error": type(exc).__name__, "head": ""}
    finally:
        sock.close()
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    parts = head.split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return {"status": status, "error": "", "head": head}


def _http2(args: argparse.Namespace) -> dict[str, object]:
    import h2.config
    import h2.connection
    import h2.events

    headers = [(str(n), str(v)) for n, v in json.loads(args.h2)]
    sock = _connect(args, ["h2"])
    if getattr(sock, "selected_alpn_protocol", lambda: None)() != "h2":
        return {"status": 0, "error": "no h2", "head": ""}
    # Outbound validation off: sending a Host beside a different :authority is the test.
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, validate_outbound_headers=False)
    )
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    conn.send_headers(stream, headers, end_stream=True)
    sock.sendall(conn.data_to_send())
    deadline = time.monotonic() + args.timeout
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return {"status": 0, "error": "closed", "head": ""}
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream:
                    got = {k.decode(): v.decode() for k, v in event.headers}
                    return {"status": int(got.get(":status", "0")), "error": "", "head": json.dumps(got)}
                if isinstance(event, h2.events.StreamReset):
                    return {"status": 0, "error": f"reset {event.error_code!s}", "head": ""}
                if isinstance(event, h2.events.ConnectionTerminated):
                    return {"status": 0, "error": f"goaway {event.error_code!s}", "head": ""}
            sock.sendall(conn.data_to_send())
    except (TimeoutError, OSError) as exc:
        return {"status": 0, "error": type(exc).__name__, "head": ""}
    finally:
        sock.close()
    return {"status": 0, "error": "timeout", "head": ""}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ip", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--sni", default="")
    ap.add_argument("--ca", default=None)
    ap.add_argument("--raw", default=None)
    ap.add_argument("--h2", default=None)
    ap.add_argument("--timeout", type=float, default=3.0)
    args = ap.parse_args()
    out = _http2(args) if args.h2 is not None else _http1(args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
