"""Request rules in the MITM child (docs/reference/behaviour.md §19): the shell that fetches a
subject's view for a name (``GET /_requests``, :mod:`egressd.mitm.requests`), keeps it under the
narrowing map's stamp (no round trip per request; a policy change bumps the client's slot, so
the next request pulls), and reports refusals (``POST /_requests``) after answering them.

Fail closed: a view that cannot be had (timeout, refused, 404, a bad body) is None, and the
callers then decrypt / parse the connection and refuse its requests.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import Final
from urllib.parse import urlencode

from egressd.feed import port_key
from egressd.mitm.protocol import REQUESTS_PATH
from egressd.mitm.seqmap import Stamp
from egressd.mitmchild.reqview import RuleView, parse_view
from egressd.mitmchild.shared import emit, listen_port
from egressd.mitmchild.vaults import VaultLookup

MAX_VIEWS: Final = 4096

Key = tuple[str, str]  # (client key, name or "")


class RequestGate:
    def __init__(self, vaults: VaultLookup) -> None:
        self.vaults = vaults
        self.views: OrderedDict[Key, tuple[RuleView, Stamp]] = OrderedDict()
        self.pulls = 0  # views fetched (tests, diagnostics)
        self._reports: set[asyncio.Task[None]] = set()

    def _query(self, conn: object, client_ip: str) -> tuple[dict[str, str], str]:
        query = {"clientIp": client_ip}
        listen = listen_port(conn, self.vaults.shared_port)
        if listen is not None:
            query["port"] = str(listen)
        return query, (client_ip if listen is None else port_key(listen))

    async def view(self, conn: object, client_ip: str | None, name: str | None) -> RuleView | None:
        """The subject's view for ``name`` (None: whether the subject has any request rule);
        None when it cannot be had."""
        client = self.vaults.client
        if client is None or not client_ip:
            return None
        query, owner = self._query(conn, client_ip)
        key: Key = (owner, name or "")
        stamp = self._stamp(owner)
        hit = self.views.get(key)
        if hit is not None and stamp is not None and hit[1] == stamp:
            self.views.move_to_end(key)
            return hit[0]
        if name:
            query["name"] = name
        try:
            async with client.session().get(f"http://egressd{REQUESTS_PATH}?{urlencode(query)}") as resp:
                body = await resp.read()
                status = resp.status
        except Exception as exc:  # timeout, refused, reset: closed
            emit("mitm.error", hook="request_rules", error=type(exc).__name__)
            return None
        self.pulls += 1
        view = parse_view(body) if status == 200 else None
        if view is not None and stamp is not None:
            self.views[key] = (view, stamp)
            self.views.move_to_end(key)
            while len(self.views) > MAX_VIEWS:
                self.views.popitem(last=False)
        return view

    def stamp(self, conn: object, client_ip: str | None) -> Stamp | None:
        """The client's narrowing stamp now (None: not known)."""
        return self._stamp(self._query(conn, client_ip)[1]) if client_ip else None

    def _stamp(self, owner: str) -> Stamp | None:
        client = self.vaults.client
        return client.seq.stamp(owner) if client is not None and client.seq is not None else None

    async def judged(self, conn: object, client_ip: str | None, name: str | None) -> bool:
        """Must the connection be opened for the request rules? True when egressd cannot say
        (its requests are then refused)."""
        view = await self.view(conn, client_ip, name)
        return view is None or view.judged

    def report(self, conn: object, client_ip: str | None, doc: dict[str, object]) -> None:
        """Tell egressd of a refused (or audit would-refuse) request, after it was answered."""
        client = self.vaults.client
        if client is None or not client_ip:
            return
        query, _ = self._query(conn, client_ip)

        async def send() -> None:
            try:
                url = f"http://egressd{REQUESTS_PATH}?{urlencode(query)}"
                async with client.session().post(url, data=json.dumps(doc).encode()) as resp:
                    await resp.read()
            except Exception as exc:
                emit("mitm.error", hook="request_report", error=type(exc).__name__)

        task = asyncio.get_running_loop().create_task(send())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)
