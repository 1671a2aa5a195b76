"""The MITM's vault lookup (BEHAVIOUR §10): ``GET /credential-vault/_active?clientIp=<ip>``.

Served only on a private unix socket (credential values are in the body). The decision is
transport-free (:func:`active_lookup`); :func:`active_app` is the thin aiohttp shell.

* missing or invalid ``clientIp`` -> 400; unknown IP or no vault -> 404;
* ``If-None-Match`` equal to the current tag -> 304 without a body;
* else 200 with the snapshot (``VaultSnapshot.to_json()``) and ``ETag``.

The tag changes on every vault mutation, including delete-then-recreate.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from egressd.subject.model import IPAddress, unmap_ip
from egressd.vault.store import VaultSnapshot

ACTIVE_PATH = "/credential-vault/_active"

Lookup = Callable[[IPAddress], VaultSnapshot | None]


@dataclass(frozen=True, slots=True)
class ActiveReply:
    status: int
    etag: str | None = None
    body: dict[str, Any] | None = field(default=None, repr=False)  # holds credential values


def _quoted(tag: str) -> str:
    return f'"{tag}"'


def _unquote(value: str) -> str:
    v = value.strip()
    if v.startswith("W/"):
        v = v[2:]
    return v[1:-1] if len(v) >= 2 and v[0] == v[-1] == '"' else v


def active_lookup(lookup: Lookup, client_ip: str | None, if_none_match: str | None) -> ActiveReply:
    if not client_ip:
        return ActiveReply(400)
    try:
        ip = unmap_ip(ipaddress.ip_address(client_ip.strip()))
    except ValueError:
        return ActiveReply(400)
    snapshot = lookup(ip)
    if snapshot is None:
        return ActiveReply(404)
    etag = _quoted(snapshot.tag)
    if if_none_match is not None:
        wanted = {_unquote(part) for part in if_none_match.split(",")}
        if snapshot.tag in wanted:
            return ActiveReply(304, etag)
    return ActiveReply(200, etag, snapshot.to_json())


def active_app(lookup: Lookup) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        if request.method != "GET":
            return web.Response(status=405, headers={"Allow": "GET"})
        reply = active_lookup(lookup, request.query.get("clientIp"), request.headers.get("If-None-Match"))
        headers = {"ETag": reply.etag} if reply.etag else {}
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
