"""The MITM side of the ``_active`` vault lookup (docs/reference/behaviour.md §10): cache, revalidation, failure.

One lookup per intercepted request: ``GET /credential-vault/_active?clientIp=…&host=…&dst=…``
with ``If-None-Match`` when a snapshot of that client is cached, over the daemon's private
unix socket. :func:`interpret` (pure) turns a reply into a :class:`View` or raises
:class:`LookupFailed`; :class:`ActiveClient` is the thin aiohttp shell with a per-client-IP cache.
Unchanged vaults cost a 304 and no copying.

Failure (timeout 0.25 s, refused, 5xx, bad JSON/schema/ETag, 304 without a cached tag, 200
carrying the tag we already hold) drops the client's cache and raises: the caller then blocks
the request before anything reaches the upstream. 404 drops the cache: no vault, no injection.

The cache is bounded (docs/reference/behaviour.md §14.9): at most :data:`~egressd.mitm.protocol.CACHE_MAX_ENTRIES` clients, least
recently used evicted first. Eviction only costs the evicted client one full (200) lookup.
egressd also tells the child to *forget* clients whose snapshot it must no longer hold
(subject removed or rebound, vault deleted or changed): one JSON line per batch on the
child's stdin, :func:`~egressd.mitm.protocol.forget_message` / :func:`~egressd.mitm.protocol.parse_forget`. Without that, a removed
sandbox's credentials would stay in the child until its address sent another request.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlencode

import aiohttp

from egressd.feed import port_key
from egressd.mitm.protocol import (
    ACTIVE_PATH,
    CACHE_MAX_ENTRIES,
    DESTINATION_HEADER,
    DESTINATION_TTL_HEADER,
    bare_etag,
)
from egressd.mitm.seqmap import SeqReader
from egressd.mitmchild.memo import Memo, parse_ttl
from egressd.mitmchild.wire import WireError, snapshot_from_active
from egressd.vault.snapshot import VaultSnapshot

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
    """Per-client-IP snapshot cache over the daemon's ``_active`` unix socket (bounded, LRU)."""

    def __init__(
        self,
        socket_path: str,
        timeout: float = LOOKUP_TIMEOUT_S,
        max_entries: int = CACHE_MAX_ENTRIES,
        seq: SeqReader | None = None,
    ) -> None:
        """``seq``: egressd's narrowing sequence map (docs/reference/behaviour.md §10): with it, answers
        still stamped with its current values come from :attr:`memo`, without a round trip."""
        self.socket_path = socket_path
        self.seq = seq
        self.memo = Memo(max_clients=max(1, max_entries))
        self.recalled = 0  # lookups answered from memory (tests, diagnostics)
        self.timeout = timeout
        self.max_entries = max(1, max_entries)
        self.cache: OrderedDict[str, VaultSnapshot] = OrderedDict()
        self.evictions = 0
        self._forgets = 0  # bumped by every forget: a lookup in flight across one is not cached
        self._session: aiohttp.ClientSession | None = None

    def _store(self, client_ip: str, snapshot: VaultSnapshot) -> None:
        self.cache[client_ip] = snapshot
        self.cache.move_to_end(client_ip)
        while len(self.cache) > self.max_entries:
            self.cache.popitem(last=False)
            self.evictions += 1

    def forget(self, ips: Iterable[str] | None) -> None:
        """Drop these clients' snapshots (None: all). Their next request does a full lookup."""
        self._forgets += 1
        if ips is None:
            self.cache.clear()
            self.memo.forget(None)
            return
        for ip in ips:
            self.cache.pop(ip, None)
            self.memo.forget(ip)

    def session(self) -> aiohttp.ClientSession:
        """The session over egressd's private socket (the name check asks through it too)."""
        return self._client()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path, limit=64),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
        return self._session

    async def lookup(
        self, client_ip: str | None, host: str | None, dst: str | None, listen_port: int | None = None
    ) -> View:
        """``listen_port``: the flow came in on a per-subject port (docs/reference/behaviour.md §17), whose
        subject is the client; its snapshot is cached under :func:`port_key`."""
        if not client_ip:
            raise LookupFailed("no peer address")
        query = {"clientIp": client_ip}
        if listen_port is not None:
            query["port"] = str(listen_port)
        if host and dst:
            query.update(host=host, dst=dst)
        key = client_ip if listen_port is None else port_key(listen_port)
        stamp = self.seq.stamp(key) if self.seq is not None else None
        sent_at = time.monotonic()
        remembered = self.memo.recall(key, host, dst, stamp, sent_at)
        if remembered is not None:
            self.recalled += 1
            return View(remembered[0], remembered[1])
        cached = self.cache.get(key)
        forgets = self._forgets
        ttl: float | None = None
        headers = {"If-None-Match": f'"{cached.tag}"'} if cached is not None else {}
        try:
            async with self._client().get(
                f"http://egressd{ACTIVE_PATH}?{urlencode(query)}", headers=headers
            ) as resp:
                body = await resp.read()
                view = interpret(
                    resp.status, resp.headers.get("ETag"), resp.headers.get(DESTINATION_HEADER), body, cached
                )
                ttl = parse_ttl(resp.headers.get(DESTINATION_TTL_HEADER)) if view.destination_ok else None
        except LookupFailed:
            self.cache.pop(key, None)
            self.memo.forget(key)
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.cache.pop(key, None)
            self.memo.forget(key)
            raise LookupFailed(type(exc).__name__) from None
        if forgets != self._forgets:
            # A forget arrived while this reply was on its way: egressd may have answered
            # before the change it then announced, so the reply serves this request only and
            # is not kept (the forget and the reply travel on different channels).
            self.cache.pop(key, None)
            return view
        if view.snapshot is None:
            self.cache.pop(key, None)
        else:
            self._store(key, view.snapshot)
        # Stamped with what was read before the request: a narrowing egressd made while it
        # was on its way has changed the stamp already, and the next lookup pulls.
        self.memo.learn(key, host, dst, view.snapshot, ttl, stamp, sent_at)
        return view

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
