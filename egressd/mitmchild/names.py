"""Names on the wire in the MITM child (docs/reference/behaviour.md §18): the addon that asks egressd
whether a connection's SNI (or a plain-HTTP request's ``Host``) may reach its original
destination, and refuses before anything reaches the upstream.

egressd decides (``GET /_names`` on the private socket, :mod:`egressd.mitm.names`: the policy,
the subject's leases and the pure rule of :mod:`egressd.policy.namecheck`) and reports the
refusal (count, log line, webhook). This side only asks and acts:

* TLS (:meth:`NameGate.tls`, from the interception addon's ``tls_clienthello``, for decrypted
  and passed-through connections alike): a refusal resets the client connection (RST) and
  marks it, so that no upstream connection is ever opened for it (:meth:`server_connect`).
* Plain HTTP (:meth:`NameGate.http`, from the injection addon's ``requestheaders``, for every
  request): a refusal is answered 403 with a JSON body; the connection may stay.
* Anything else (neither TLS nor HTTP): checked without a name. Every port the kernel sends
  to the MITM is checked: 80, 443, the extra ports, and the ports a subject's ``http``/``https``
  rules name (:mod:`egressd.policy.mitmports`).

Fail closed: a check that cannot be answered (timeout, refused, a bad reply) refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlencode

from mitmproxy import connection, ctx
from mitmproxy.addonmanager import Loader
from mitmproxy.proxy import server_hooks

from egressd.feed import port_key
from egressd.mitm.protocol import NAMES_PATH
from egressd.mitm.seqmap import Stamp
from egressd.mitmchild.shared import emit, listen_port
from egressd.mitmchild.vaults import VaultLookup

#: The reason the child gives when egressd's answer could not be had (never an admission).
LOOKUP_FAILED: Final = "name_check_unavailable"
#: Clients refused and not yet gone: their server connections are refused too.
MAX_REFUSED: Final = 65536
#: Refusal reports on their way to egressd at once; beyond it a flood of refused connections
#: loses reports (never connections: each is refused before its report is sent).
MAX_PENDING_REPORTS: Final = 256


#: Admissions remembered per worker (least recently used evicted first; eviction costs a pull).
MAX_REMEMBERED: Final = 16384
MAX_REMEMBER_S: Final = 300.0


@dataclass(frozen=True, slots=True)
class NameAnswer:
    admit: bool
    reason: str | None
    ttl: float | None = None  # seconds an admission may be remembered, absent a narrowing


def interpret(status: int, body: bytes) -> NameAnswer:
    """One ``_names`` reply; anything but a well-formed 200 refuses (fail closed)."""
    if status != 200:
        return NameAnswer(False, LOOKUP_FAILED)
    try:
        doc = json.loads(body)
    except ValueError:
        return NameAnswer(False, LOOKUP_FAILED)
    if not isinstance(doc, dict) or not isinstance(doc.get("admit"), bool):
        return NameAnswer(False, LOOKUP_FAILED)
    reason = doc.get("reason")
    if doc["admit"]:
        ttl = doc.get("ttl")
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and 0 < ttl < float("inf"):
            return NameAnswer(True, None, min(float(ttl), MAX_REMEMBER_S))
        return NameAnswer(True, None)
    return NameAnswer(False, reason if isinstance(reason, str) and reason else LOOKUP_FAILED)


Key = tuple[str, str, str, str, int]  # (client key, wire, name, destination, port)


class Remembered:
    """Admissions a worker may repeat without a round trip (docs/reference/behaviour.md §10,
    "answered from memory"): each only under the narrowing stamp it was pulled under (read
    before the pull) and until its lease ends. Refusals are never remembered: a new DNS answer
    can admit a name without any narrowing."""

    def __init__(self, max_entries: int = MAX_REMEMBERED) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[Key, tuple[float, Stamp]] = OrderedDict()

    def recall(self, key: Key, stamp: Stamp | None, now: float) -> bool:
        if stamp is None:
            return False
        hit = self.entries.get(key)
        if hit is None or hit[1] != stamp or hit[0] <= now:
            return False
        self.entries.move_to_end(key)
        return True

    def learn(self, key: Key, answer: NameAnswer, stamp: Stamp | None, sent_at: float) -> None:
        if stamp is None or not answer.admit or answer.ttl is None:
            return
        self.entries[key] = (sent_at + answer.ttl, stamp)
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


def as_name(host: str | None) -> str | None:
    """The name a connection asks for, as the check takes it: None for none and for an IP
    literal (an address names no name: only an address rule opens it)."""
    if not host:
        return None
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host
    return None


def reset(client: connection.Client) -> bool:
    """Abort ``client``'s TCP connection with a reset (SO_LINGER 0). False when it is gone."""
    server = ctx.master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
    handler = getattr(server, "connections", {}).get(client.id) if server is not None else None
    io = handler.transports.get(handler.client) if handler is not None else None
    writer = io.writer if io is not None else None
    if writer is None or not hasattr(writer, "transport"):
        return False
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    return True


class NameGate:
    """Option ``egressd_name_check``; asks egressd; keeps refused clients off the upstream."""

    def __init__(self, vaults: VaultLookup) -> None:
        self.vaults = vaults
        self.enabled = False
        self.refused: OrderedDict[str, str] = OrderedDict()  # client connection id -> reason
        self._reports: set[asyncio.Task[None]] = set()
        self.remembered = Remembered()
        self.recalled = 0  # checks answered from memory (tests, diagnostics)
        # Other addons' per-client state to drop when a client goes (one addon per mitmproxy
        # event: this one handles client_disconnected for all of them).
        self.on_disconnect: list[Callable[[connection.Client], None]] = []

    def load(self, loader: Loader) -> None:
        loader.add_option(
            "egressd_name_check", bool, False, "check TLS SNI / HTTP Host against the policy (§18)"
        )

    def configure(self, updated: set[str]) -> None:
        if "egressd_name_check" in updated:
            self.enabled = ctx.options.egressd_name_check

    async def ask(
        self,
        conn: object,
        client_ip: str | None,
        wire: str,
        name: str | None,
        dst: str,
        dport: int,
        *,
        report: bool = True,
    ) -> NameAnswer:
        """egressd's verdict for one name; a refusal when it cannot be had. ``report`` False:
        egressd does not count, log or post a refusal (a question, not a decision)."""
        client = self.vaults.client
        if client is None or not client_ip:
            return NameAnswer(False, LOOKUP_FAILED)
        query, listen = self._query(conn, client_ip, wire, dst, dport)
        if name:
            query["name"] = name
        if not report:
            query["report"] = "0"
        owner = client_ip if listen is None else port_key(listen)
        key: Key = (owner, wire, name or "", dst, dport)
        stamp = client.seq.stamp(owner) if client.seq is not None else None
        sent_at = time.monotonic()
        if self.remembered.recall(key, stamp, sent_at):
            self.recalled += 1
            return NameAnswer(True, None)
        try:
            async with client.session().get(f"http://egressd{NAMES_PATH}?{urlencode(query)}") as resp:
                body = await resp.read()
                answer = interpret(resp.status, body)
        except Exception as exc:  # timeout, refused, reset: closed
            emit("mitm.error", hook="name_check", error=type(exc).__name__)
            return NameAnswer(False, LOOKUP_FAILED)
        self.remembered.learn(key, answer, stamp, sent_at)
        return answer

    def _query(
        self, conn: object, client_ip: str, wire: str, dst: str, dport: int
    ) -> tuple[dict[str, str], int | None]:
        """The ``_names`` query naming the client (and a host-uid subject's MITM port, also
        returned) and the connection's destination."""
        query = {"clientIp": client_ip, "wire": wire, "dst": dst, "dport": str(dport)}
        listen = listen_port(conn, self.vaults.shared_port)
        if listen is not None:
            query["port"] = str(listen)
        return query, listen

    def report_refusal(
        self, conn: object, client_ip: str | None, wire: str, reason: str, dst: str, dport: int
    ) -> None:
        """Tell egressd of a connection refused from its first bytes alone (no name to ask
        about), so that it is counted, logged and posted like any refusal (§18). In the
        background: the connection is refused already, whatever egressd answers."""
        client = self.vaults.client
        if client is None or not client_ip:
            return
        query, _ = self._query(conn, client_ip, wire, dst, dport)
        query["refused"] = reason
        url = f"http://egressd{NAMES_PATH}?{urlencode(query)}"

        async def send() -> None:
            try:
                async with client.session().get(url) as resp:
                    await resp.read()
            except Exception as exc:  # the count is lost; the connection was refused anyway
                emit("mitm.error", hook="refusal_report", error=type(exc).__name__)

        if len(self._reports) >= MAX_PENDING_REPORTS:
            emit("mitm.error", hook="refusal_report", error="backlog")
            return
        task = asyncio.get_running_loop().create_task(send())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def refuse_connection(self, client: connection.Client, reason: str) -> None:
        """Mark ``client`` refused (no server connection for it, ever) and reset it."""
        self.refused[client.id] = reason
        while len(self.refused) > MAX_REFUSED:
            self.refused.popitem(last=False)
        reset(client)

    # ---- hooks ------------------------------------------------------------------------------------

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """No upstream connection for a refused client (whatever layer would open one)."""
        reason = self.refused.get(data.client.id)
        if reason is not None:
            data.server.error = f"refused by the name check: {reason}"

    def client_disconnected(self, client: connection.Client) -> None:
        self.refused.pop(client.id, None)
        for forget in self.on_disconnect:
            forget(client)
