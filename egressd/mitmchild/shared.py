"""What the MITM child's egressd addons share (:mod:`egressd.mitmchild.runner` loads them): the
JSON line each decision is logged as (names, binding, revision, host, method, header names;
never values), which the daemon's supervisor re-emits through its own logger; addresses as
egressd prints them; the flow metadata the addons pass on to each other.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from typing import Any

from mitmproxy import http

from egressd.addr import unmap_ip

META = "egressd"  # the flow's vault snapshot (set by the injection addon, read by the response addon)
BINDING_META = META + ".binding"  # the name of the binding injected into the flow


def emit(event: str, **fields: Any) -> None:
    """One JSON line for the supervisor (stdout is a pipe it reads)."""
    sys.stdout.write(json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def ip_of(addr: tuple[str, int] | tuple[str, int, int, int] | None) -> str | None:
    if not addr:
        return None
    try:
        return str(unmap_ip(ipaddress.ip_address(addr[0])))
    except ValueError:
        return None


def address_of(addr: tuple[str, int] | tuple[str, int, int, int] | None) -> tuple[str, int] | None:
    ip = ip_of(addr)
    return None if ip is None or addr is None else (ip, int(addr[1]))


def peer_ip(flow: http.HTTPFlow) -> str | None:
    return ip_of(flow.client_conn.peername)


def listen_port(client: object, shared: int | None) -> int | None:
    """The per-subject port the client connection came in on (host-uid subjects, docs/reference/behaviour.md
    §17), or None on the shared listener (port ``shared``): there the peer address names the
    subject, here the port does. Read from the listener's mode (``transparent@<port>``): in
    transparent mode mitmproxy overwrites the client's ``sockname`` with the original
    destination."""
    mode = getattr(client, "proxy_mode", None)
    port = getattr(mode, "custom_listen_port", None)
    if not isinstance(port, int) or port == shared:
        return None
    return port


def wire_headers(pairs: list[tuple[str, str]]) -> http.Headers:
    out = http.Headers()
    for name, value in pairs:
        out.add(name, value)  # str in, encoded the way mitmproxy decoded it
    return out

