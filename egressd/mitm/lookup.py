"""The MITM side of the ``_active`` vault lookup (BEHAVIOUR §10): cache, revalidation, failure.

One lookup per intercepted request: ``GET /credential-vault/_active?clientIp=…&host=…&dst=…``
with ``If-None-Match`` when a snapshot of that client is cached, over the daemon's private
unix socket. :func:`interpret` (pure) turns a reply into a :class:`View` or raises
:class:`LookupFailed`; :class:`ActiveClient` is the thin aiohttp shell with a per-client-IP cache.
Unchanged vaults cost a 304 and no copying.

Failure (timeout 0.25 s, refused, 5xx, bad JSON/schema/ETag, 304 without a cached tag, 200
carrying the tag we already hold) drops the client's cache and raises: the caller then blocks
the request before anything reaches the upstream. 404 drops the cache: no vault, no injection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlencode

import aiohttp

from egressd.mitm.active import ACTIVE_PATH, DESTINATION_HEADER
from egressd.mitm.wire import WireError, bare_etag, snapshot_from_active
from egressd.vault.store import VaultSnapshot

LOOKUP_TIMEOUT_S: Final = 0.25


class LookupFailed(Exception):
    """The vault of this client is unknown: block its intercepted requests (reason is value-free)."""


@dataclass(frozen=True, slots=True)
class View:
    snapshot: VaultSnapshot | None
    destination_ok: bool


def interpret(
    status: int, etag: str | None, destination: str | None, body: bytes, cached: VaultSnapshot | None
) -> View:
    """What one ``_active`` reply means for the client whose cached snapshot is ``cached``."""
    verified = destination == "verified"
    if status == 404:
        return View(None, False)
    if status == 304:
        if cached is None or etag is None or bare_etag(etag) != cached.tag:
            raise LookupFailed("304 without a matching cached tag")
        return View(cached, verified)
    if status != 200:
        raise LookupFailed(f"status {status}")
    if etag is None:
        raise LookupFailed("200 without ETag")
    if cached is not None and bare_etag(etag) == cached.tag:
        raise LookupFailed("200 with the tag already cached")
    try:
        snapshot = snapshot_from_active(json.loads(body), etag)
    except (ValueError, WireError) as exc:  # json.JSONDecodeError is a ValueError
        raise LookupFailed(f"bad body: {type(exc).__name__}") from None
    return View(snapshot, verified)


class ActiveClient:
    """Per-client-IP snapshot cache over the daemon's ``_active`` unix socket."""

    def __init__(self, socket_path: str, timeout: float = LOOKUP_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.cache: dict[str, VaultSnapshot] = {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path, limit=64),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
        return self._session

    async def lookup(self, client_ip: str | None, host: str | None, dst: str | None) -> View:
        if not client_ip:
            raise LookupFailed("no peer address")
        cached = self.cache.get(client_ip)
        query = {"clientIp": client_ip}
        if host and dst:
            query.update(host=host, dst=dst)
        headers = {"If-None-Match": f'"{cached.tag}"'} if cached is not None else {}
        try:
            async with self._client().get(
                f"http://egressd{ACTIVE_PATH}?{urlencode(query)}", headers=headers
            ) as resp:
                body = await resp.read()
                view = interpret(
                    resp.status, resp.headers.get("ETag"), resp.headers.get(DESTINATION_HEADER), body, cached
                )
        except LookupFailed:
            self.cache.pop(client_ip, None)
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.cache.pop(client_ip, None)
            raise LookupFailed(type(exc).__name__) from None
        if view.snapshot is None:
            self.cache.pop(client_ip, None)
        else:
            self.cache[client_ip] = view.snapshot
        return view

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
