"""The MITM's vault lookup (docs/reference/behaviour.md §10): ``GET /credential-vault/_active?clientIp=<ip>``.

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

egressd extension (docs/reference/behaviour.md §10, "answered from memory"): when ``verify`` answers with the
monotonic deadline of the lease that verified the pair (a float; ``math.inf`` for an explicit
IP rule) rather than a bool, a verified reply also carries ``X-Egressd-Destination-Ttl:
<seconds left>`` (capped at :data:`MAX_DESTINATION_TTL_S`): how long the MITM may remember the
verdict, absent a narrowing (:mod:`egressd.mitm.seqmap`).

egressd extension (host-uid subjects, docs/reference/behaviour.md §17): with ``port=<listener port>`` the client is
the subject that port belongs to, not the peer address (every host-uid sandbox connects from
the host's own address, and the kernel redirected each one to a MITM port of its own). A port
that is no subject's answers 404; a malformed one 400.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from egressd.addr import IPAddress, unmap_ip
from egressd.mitm.names import NameService, add_names_route
from egressd.mitm.protocol import ACTIVE_PATH, DESTINATION_HEADER, DESTINATION_TTL_HEADER, bare_etag
from egressd.mitm.requests import add_requests_route
from egressd.vault.snapshot import VaultSnapshot

Lookup = Callable[[IPAddress], VaultSnapshot | None]
# A bool, or the deadline (monotonic) until which the pair stays verified (0.0: not verified).
Verify = Callable[[IPAddress, str, IPAddress], bool | float]
PortLookup = Callable[[int], VaultSnapshot | None]
PortVerify = Callable[[int, str, IPAddress], bool | float]
MAX_DESTINATION_TTL_S = 300.0


@dataclass(frozen=True, slots=True)
class ActiveReply:
    status: int
    etag: str | None = None
    body: dict[str, Any] | None = field(default=None, repr=False)  # holds credential values
    destination: str | None = None  # "verified" / "unverified" when host and dst were asked
    destination_ttl: float | None = None  # seconds the verdict may be remembered (verified only)


@dataclass(frozen=True, slots=True)
class PortVaults:
    """Vault lookups of the MITM listeners whose port names the subject (docs/reference/behaviour.md §17), and
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
    destination, ttl = None, None
    if host is not None or dst_ip is not None:
        verdict: bool | float = False
        if host and dst_ip is not None:
            if listener is not None:
                verdict = by_port is not None and by_port.verify(listener, host, dst_ip)
            else:
                verdict = verify is not None and verify(ip, host, dst_ip)
        ttl = _ttl(verdict)
        # A deadline already past is no verdict (a bool says nothing about time).
        ok = bool(verdict) if isinstance(verdict, bool) else ttl is not None
        destination = "verified" if ok else "unverified"
    etag = _quoted(snapshot.tag)
    if if_none_match is not None:
        wanted = {bare_etag(part) for part in if_none_match.split(",")}
        if snapshot.tag in wanted:
            return ActiveReply(304, etag, destination=destination, destination_ttl=ttl)
    return ActiveReply(200, etag, snapshot.to_json(), destination=destination, destination_ttl=ttl)


def _ttl(verdict: bool | float) -> float | None:
    """Seconds a verified verdict may be remembered: only a deadline says (a bool does not)."""
    if isinstance(verdict, bool) or not verdict:
        return None
    left = min(float(verdict) - time.monotonic(), MAX_DESTINATION_TTL_S)
    return left if left > 0 else None


def active_app(
    lookup: Lookup,
    verify: Verify | None = None,
    by_port: PortVaults | None = None,
    names: NameService | None = None,
    *,
    name_check: bool = True,
) -> web.Application:
    """The private socket's routes: ``_active`` and, with ``names``, the name check
    (:mod:`egressd.mitm.names`, docs/reference/behaviour.md §18)."""

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
        if reply.destination_ttl is not None:
            headers[DESTINATION_TTL_HEADER] = f"{reply.destination_ttl:.3f}"
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
    if names is not None and name_check:
        add_names_route(app, names.check, names.report)
    if names is not None and names.policy_of is not None:
        add_requests_route(app, names.policy_of, names.request_report)
    return app
