"""The MITM's vault lookup (docs/behaviour.md §10): ``GET /credential-vault/_active?clientIp=<ip>``.

Served only on a private unix socket (credential values are in the body). The decision is
transport-free (:func:`active_lookup`); :func:`active_app` is the thin aiohttp shell.

* missing or invalid ``clientIp`` -> 400; unknown IP or no vault -> 404;
* ``If-None-Match`` equal to the current tag -> 304 without a body;
* else 200 with the snapshot (``VaultSnapshot.to_json()``) and ``ETag``.

The tag changes on every vault mutation, including delete-then-recreate.

egressd extension: with ``host=<request host>&dst=<original destination ip>`` the reply (200
or 304) also carries ``X-Egressd-Destination: verified|unverified`` — whether the subject's
DNS proxy learned ``dst`` for ``host`` (or an explicit IP allow rule covers it). The MITM
injects only towards verified destinations, in the same round trip as the vault revalidation.

egressd extension (host-uid subjects, docs/behaviour.md §17): with ``port=<listener port>`` the client is
the subject that port belongs to, not the peer address (every host-uid sandbox connects from
the host's own address, and the kernel redirected each one to a MITM port of its own). A port
that is no subject's answers 404; a malformed one 400.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from egressd.mitm.wire import bare_etag
from egressd.subject.model import IPAddress, unmap_ip
from egressd.vault.store import VaultSnapshot

ACTIVE_PATH = "/credential-vault/_active"

Lookup = Callable[[IPAddress], VaultSnapshot | None]
Verify = Callable[[IPAddress, str, IPAddress], bool]
PortLookup = Callable[[int], VaultSnapshot | None]
PortVerify = Callable[[int, str, IPAddress], bool]
DESTINATION_HEADER = "X-Egressd-Destination"
READY_EVENT = "mitm.ready"  # the addon's JSON line once its listener is bound
CACHE_EVENT = "mitm.cache"  # the child's snapshot cache size, whenever it changed (docs/behaviour.md §14.9)


@dataclass(frozen=True, slots=True)
class ActiveReply:
    status: int
    etag: str | None = None
    body: dict[str, Any] | None = field(default=None, repr=False)  # holds credential values
    destination: str | None = None  # "verified" / "unverified" when host and dst were asked


@dataclass(frozen=True, slots=True)
class PortVaults:
    """Vault lookups of the MITM listeners whose port names the subject (docs/behaviour.md §17), and
    those ports (the child listens on all of them from its start)."""

    lookup: PortLookup
    verify: PortVerify
    ports: tuple[int, ...] = ()


def _port(text: str) -> int | None:
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def _quoted(tag: str) -> str:
    return f'"{tag}"'


def active_lookup(
    lookup: Lookup,
    client_ip: str | None,
    if_none_match: str | None,
    *,
    verify: Verify | None = None,
    host: str | None = None,
    dst: str | None = None,
    port: str | None = None,
    by_port: PortVaults | None = None,
) -> ActiveReply:
    if not client_ip:
        return ActiveReply(400)
    try:
        ip = unmap_ip(ipaddress.ip_address(client_ip.strip()))
        dst_ip = unmap_ip(ipaddress.ip_address(dst.strip())) if dst else None
    except ValueError:
        return ActiveReply(400)
    listener = _port(port) if port is not None else None
    if port is not None and listener is None:
        return ActiveReply(400)
    if listener is not None:
        # Never the peer address instead: it is the host's, shared by every uid sandbox.
        snapshot = by_port.lookup(listener) if by_port is not None else None
    else:
        snapshot = lookup(ip)
    if snapshot is None:
        return ActiveReply(404)
    destination = None
    if host is not None or dst_ip is not None:
        ok = False
        if host and dst_ip is not None:
            if listener is not None:
                ok = by_port is not None and by_port.verify(listener, host, dst_ip)
            else:
                ok = verify is not None and verify(ip, host, dst_ip)
        destination = "verified" if ok else "unverified"
    etag = _quoted(snapshot.tag)
    if if_none_match is not None:
        wanted = {bare_etag(part) for part in if_none_match.split(",")}
        if snapshot.tag in wanted:
            return ActiveReply(304, etag, destination=destination)
    return ActiveReply(200, etag, snapshot.to_json(), destination=destination)


def active_app(
    lookup: Lookup, verify: Verify | None = None, by_port: PortVaults | None = None
) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        if request.method != "GET":
            return web.Response(status=405, headers={"Allow": "GET"})
        reply = active_lookup(
            lookup,
            request.query.get("clientIp"),
            request.headers.get("If-None-Match"),
            verify=verify,
            host=request.query.get("host"),
            dst=request.query.get("dst"),
            port=request.query.get("port"),
            by_port=by_port,
        )
        headers = {"ETag": reply.etag} if reply.etag else {}
        if reply.destination is not None:
            headers[DESTINATION_HEADER] = reply.destination
        headers["Cache-Control"] = "no-store"
        if reply.body is None:
            return web.Response(status=reply.status, headers=headers)
        return web.Response(
            status=reply.status,
            body=json.dumps(reply.body).encode(),
            content_type="application/json",
            headers=headers,
        )

    app = web.Application()
    app.router.add_route("*", ACTIVE_PATH, handle)
    return app
