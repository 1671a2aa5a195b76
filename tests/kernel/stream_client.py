"""Clients for the MITM's response-path tests (docs/reference/behaviour.md §10), run inside a sandbox
namespace with the venv's interpreter (``ip netns exec <sb> <venv python> stream_client.py ...``).
They only talk to the address they are given (``--ip``; the name is pinned to it, as curl's
``--resolve`` does). Every line on stdout is one JSON object.

  sse     an SDK-shaped reader of server-sent events: httpx (what the OpenAI and Anthropic SDKs
          are built on) with httpx-sse, HTTP/1.1 or ``--http2``; one line per event
          ``{"event": <data>, "recv": <epoch s>}``, then ``{"done": true}``
  ws      a WebSocket (aiohttp): the first message, then ``--send`` and its echo
          ``{"first": ..., "echo": ...}``
  h2slow  a hostile HTTP/2 reader: GET ``--path``, grant the MITM only ``--window`` bytes of
          flow-control window, then top it up at ``--rate`` bytes/s for ``--seconds``;
          ``{"received": n}`` at the end
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import sys
import time
from typing import Any


def _pin(host: str, ip: str) -> None:
    """Resolve ``host`` to ``ip`` in this process (the sandbox has no resolver of its own here)."""
    real = socket.getaddrinfo

    def getaddrinfo(name: Any, *args: Any, **kw: Any) -> Any:
        return real(ip if name == host else name, *args, **kw)

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]


def _out(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _H2First(ssl.SSLContext):
    """httpx offers ``http/1.1, h2`` and mitmproxy honours the client's order (most servers
    pick h2 by their own): a client that prefers HTTP/2 offers it first."""

    def set_alpn_protocols(self, protocols: Any) -> None:
        super().set_alpn_protocols(sorted(protocols, key=lambda p: p != "h2"))


def sse(args: argparse.Namespace) -> None:
    import httpx
    from httpx_sse import connect_sse

    ctx = _H2First(ssl.PROTOCOL_TLS_CLIENT) if args.http2 else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=args.ca)
    with (
        httpx.Client(verify=ctx, http2=args.http2, timeout=args.timeout) as client,
        connect_sse(client, "GET", args.url, headers=dict(h.split(": ", 1) for h in args.header)) as source,
    ):
        _out({"status": source.response.status_code, "version": source.response.http_version})
        for event in source.iter_sse():
            _out({"event": event.data, "recv": time.time()})
    _out({"done": True})


async def _ws(args: argparse.Namespace) -> None:
    import aiohttp

    ctx = ssl.create_default_context(cafile=args.ca)
    headers = dict(h.split(": ", 1) for h in args.header)
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(
            args.url, ssl=ctx, headers=headers, timeout=aiohttp.ClientWSTimeout(ws_close=5)
        ) as ws,
    ):
        first = await ws.receive(timeout=args.timeout)
        await ws.send_str(args.send)
        echo = await ws.receive(timeout=args.timeout)
        _out({"first": first.data, "echo": echo.data})


def h2slow(args: argparse.Namespace) -> None:
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    ctx = ssl.create_default_context(cafile=args.ca)
    ctx.set_alpn_protocols(["h2"])
    sock = ctx.wrap_socket(socket.create_connection((args.ip, 443), timeout=5), server_hostname=args.host)
    assert sock.selected_alpn_protocol() == "h2", sock.selected_alpn_protocol()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: args.window}
    )
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(
        sid,
        [(":method", "GET"), (":scheme", "https"), (":authority", args.host), (":path", args.path)],
        end_stream=True,
    )
    sock.sendall(conn.data_to_send())
    received, owed, credit = 0, 0, 0.0
    start = last = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - start < args.seconds:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            data = b""
        else:
            if not data:
                break
        for ev in conn.receive_data(data) if data else ():
            if isinstance(ev, h2.events.DataReceived):
                received += len(ev.data)
                owed += ev.flow_controlled_length
        now = time.monotonic()
        credit += (now - last) * args.rate
        last = now
        grant = min(owed, int(credit))
        if grant > 0:  # the window comes back only as fast as the "application" reads
            conn.acknowledge_received_data(grant, sid)
            owed -= grant
            credit -= grant
        if out := conn.data_to_send():
            sock.sendall(out)
    _out({"received": received})
    sock.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("sse", "ws", "h2slow"))
    p.add_argument("--url", default="")
    p.add_argument("--host", default="")
    p.add_argument("--ip", required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--header", action="append", default=[])
    p.add_argument("--http2", action="store_true")
    p.add_argument("--send", default="")
    p.add_argument("--path", default="/")
    p.add_argument("--window", type=int, default=65535)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    host = args.host or (args.url.split("/")[2].split(":")[0] if args.url else "")
    _pin(host, args.ip)
    if args.mode == "sse":
        sse(args)
    elif args.mode == "ws":
        asyncio.run(_ws(args))
    else:
        h2slow(args)


if __name__ == "__main__":
    main()
