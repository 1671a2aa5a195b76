"""Silent clients on name-checked ports (docs/reference/behaviour.md §18).

The MITM opens no upstream connection before the name check decides, and the name check waits
for the client's first bytes (a ClientHello, a request line). A server-first protocol (SMTP,
FTP, MySQL, POP3) sends nothing until its server greets it, and a client may stall on bytes that
could still start a request line (``ping`` and no line end, waiting for its answer): on a port a
rule names either would wait forever. So on every intercepted port but 80 and 443 (where clients
speak first), a connection still undecided :data:`SILENT_CLIENT_S` after it was accepted is
decided without a name (``wire=tcp``): egressd admits it where an address rule,
``defaultAction: allow`` or a ``tcp`` (or any-protocol) rule's lease opens the destination;
otherwise it is waited for (asked without a report: a slow TLS client or a pool's early connect
may still speak, and is then decided by what it sends).

An admitted connection is relayed, but its client's bytes are still looked at before they leave
until the server speaks first (a server-first protocol, not TLS or HTTP) or they can no longer
start a request (:func:`egressd.mitmchild.firstbytes.after_silence`): TLS is name-checked by the
SNI of its ClientHello (held back until whole, up to 64 KiB), a request line is refused however
it is split, since a relay never sees a request's ``Host``; letters and empty
lines alone are relayed meanwhile. Waiting costs such a connection :data:`SILENT_CLIENT_S` once;
a client that speaks first pays nothing.

mitmproxy asks its ``next_layer`` hook only when data arrives: waking it needs an event, so the
watcher feeds the undecided connection an empty ``DataReceived`` (read from the connection
handler's layers; if mitmproxy's shape differs, nothing is fed and the connection waits, as
before).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from mitmproxy import connection, ctx, tcp
from mitmproxy.proxy import events, layer, layers

from egressd.mitmchild.firstbytes import REASON_NO_SNI, after_silence, undecided
from egressd.mitmchild.intercept import REASON_REQUESTS_UNSEEN, Verdict
from egressd.mitmchild.names import LOOKUP_FAILED, NameGate
from egressd.mitmchild.requestgate import RequestGate
from egressd.mitmchild.shared import address_of, emit, ip_of

__all__ = ["CLIENT_FIRST_PORTS", "SILENT_CLIENT_S", "SilentClients"]

#: How long a client may stay silent before its connection is decided without a name.
SILENT_CLIENT_S: Final = 0.5
#: Ports whose clients speak first (HTTP, HTTPS): a silent client there is only waited for.
CLIENT_FIRST_PORTS: Final = frozenset({80, 443})
#: How often a wake-up is retried while mitmproxy is busy with the connection, and how many times.
_RETRY_S: Final = 0.05
_RETRIES: Final = 20

#: What a connection event reports (the interception addon's ``_connection``).
Report = Callable[..., None]


@dataclass(slots=True)
class _Watched:
    """An admitted silent connection whose first client bytes are still to be looked at."""

    client: connection.Client
    client_ip: str | None
    dest: tuple[str, int]
    head: bytes = b""  # client bytes so far: relayed text, or (holding) a ClientHello held back
    holding: bool = False


class SilentClients:
    """Wakes undecided connections after :data:`SILENT_CLIENT_S` and decides them without a
    name; watches the first client bytes of those it admitted."""

    def __init__(self, names: NameGate, requests: RequestGate | None, report: Report) -> None:
        self.names = names
        self.requests = requests
        self.report = report
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.woken: set[str] = set()  # client ids fed the empty event, not yet decided
        self.watched: dict[str, _Watched] = {}

    # ---- mitmproxy hooks (called by the interception addon) -----------------------------------

    def client_connected(self, client: connection.Client) -> None:
        if not self.names.enabled:
            return
        loop = asyncio.get_running_loop()
        self.timers[client.id] = loop.call_later(SILENT_CLIENT_S, self._wake, client, _RETRIES)

    def spoke(self, client: connection.Client) -> None:
        """The client sent its first bytes: no wake-up is needed."""
        timer = self.timers.pop(client.id, None)
        if timer is not None:
            timer.cancel()
        self.woken.discard(client.id)

    def client_disconnected(self, client: connection.Client) -> None:
        timer = self.timers.pop(client.id, None)
        if timer is not None:
            timer.cancel()
        self.woken.discard(client.id)
        self.watched.pop(client.id, None)

    def is_woken(self, client: connection.Client, data: bytes) -> bool:
        """Is this ``next_layer`` call the wake-up of a client that stayed silent, or stalled on
        bytes that cannot be told from the start of TLS or a request line (``ping``)?"""
        return client.id in self.woken and undecided(data)

    async def decide(self, nextlayer: layer.NextLayer) -> None:
        """A silent client: admit it without a name (relayed, its first bytes watched) or refuse."""
        context = nextlayer.context
        client = context.client
        self.woken.discard(client.id)
        client_ip = ip_of(client.peername)
        dest = address_of(context.server.address)
        started = time.perf_counter()
        if dest is None:
            self._refuse(client, client_ip, None, LOOKUP_FAILED, started)
            return
        # Asked without a report: a refusal here only means "no name does not do"; the client
        # may still speak (a slow TLS client, a pool's early connect) and is then decided, and
        # reported, by what it sends.
        answer = await self.names.ask(client, client_ip, "tcp", None, dest[0], dest[1], report=False)
        if not answer.admit:
            nextlayer.layer = None  # keep waiting: no upstream connection, nothing relayed
            return
        # A flow, so that tcp_message sees the first bytes (its messages are dropped as they pass).
        nextlayer.layer = layers.TCPLayer(context)
        self.watched[client.id] = _Watched(client, client_ip, dest)
        self.report(
            "tcp",
            Verdict("passthrough", "a silent client, admitted without a name"),
            started,
            client=client_ip,
            sni=None,
            dest=dest,
        )

    async def tcp_message(self, flow: tcp.TCPFlow) -> None:
        message = flow.messages[-1] if flow.messages else None
        flow.messages.clear()  # a relay keeps nothing: memory stays flat on long connections
        cid = flow.client_conn.id
        watched = self.watched.get(cid)
        if watched is None or message is None or not message.content:
            return
        try:
            await self._look(cid, watched, message)
        except Exception as exc:  # fail closed: nothing of it leaves, the client is reset
            emit("mitm.error", hook="silent_tcp_message", error=type(exc).__name__)
            self.watched.pop(cid, None)
            message.content = b""
            self._refuse(watched.client, watched.client_ip, watched.dest, LOOKUP_FAILED, time.perf_counter())

    async def _look(self, cid: str, watched: _Watched, message: tcp.TCPMessage) -> None:
        """One client (or server) read of a watched connection, before it is relayed."""
        if not message.from_client:
            if watched.holding:  # a server does not answer half a ClientHello
                raise RuntimeError("server data while a ClientHello is held")
            del self.watched[cid]
            return  # the server spoke first: a server-first protocol, relayed as it is
        verdict = after_silence(watched.head, message.content, holding=watched.holding)
        if verdict[0] == "hold":
            watched.head, watched.holding = verdict[1], True
            message.content = b""  # kept back until the ClientHello is whole and checked
            return
        if verdict[0] == "more":
            watched.head, watched.holding = verdict[1], False
            return
        del self.watched[cid]
        if verdict[0] == "pass":
            return
        started = time.perf_counter()
        if verdict[0] == "tls":
            whole = watched.head + message.content if watched.holding else message.content
            reason = await self._tls_refusal(watched, verdict[1])
            if reason is None:
                message.content = whole  # the held part leaves with the rest, in order
                return
        else:
            reason = verdict[1]
        message.content = b""  # nothing of it leaves
        self._refuse(watched.client, watched.client_ip, watched.dest, reason, started)
        if verdict[0] == "refuse":
            # Refused from its bytes alone (no name egressd was asked about): egressd counts,
            # logs and posts it like any refusal.
            wire = "tls" if reason == REASON_NO_SNI else "http"
            dst, dport = watched.dest
            self.names.report_refusal(watched.client, watched.client_ip, wire, reason, dst, dport)

    # ---- internals ------------------------------------------------------------------------------

    async def _tls_refusal(self, watched: _Watched, name: str | None) -> str | None:
        """Why a ClientHello sent after silence is refused (None: it may pass)."""
        answer = await self.names.ask(
            watched.client, watched.client_ip, "tls", name, watched.dest[0], watched.dest[1]
        )
        if not answer.admit:
            return answer.reason or LOOKUP_FAILED
        # Request rules (§19) cannot judge a relay: a judged name is refused, not relayed.
        if self.requests is not None and name is not None:
            try:
                judged = await self.requests.judged(watched.client, watched.client_ip, name)
            except Exception as exc:  # fail closed
                emit("mitm.error", hook="silent_tls", error=type(exc).__name__)
                judged = True
            if judged:
                return REASON_REQUESTS_UNSEEN
        return None

    def _refuse(
        self,
        client: connection.Client,
        client_ip: str | None,
        dest: tuple[str, int] | None,
        reason: str,
        started: float,
    ) -> None:
        self.names.refuse_connection(client, reason)
        self.report("tcp", Verdict("refuse", reason), started, client=client_ip, sni=None, dest=dest)

    def _wake(self, client: connection.Client, retries: int) -> None:
        self.timers.pop(client.id, None)
        if not client.connected:
            return
        asyncio.get_running_loop().create_task(self._poke(client, retries))

    async def _poke(self, client: connection.Client, retries: int) -> None:
        """Feed a still undecided connection (on a port other than 80/443) an empty read, so
        that mitmproxy asks ``next_layer`` again and :meth:`decide` runs."""
        try:
            handler, child = _undecided_handler(client)
        except Exception as exc:  # mitmproxy's shape changed: the connection waits, as before
            emit("mitm.error", hook="silent_client", error=type(exc).__name__)
            return
        if handler is None or child is None:
            return
        dest = address_of(child.context.server.address)
        if dest is None or dest[1] in CLIENT_FIRST_PORTS:
            return
        lock = getattr(handler, "_server_event_lock", None)
        if lock is not None and lock.locked():
            # Busy with this connection: the event would land after whatever it decides.
            if retries > 0:
                loop = asyncio.get_running_loop()
                self.timers[client.id] = loop.call_later(_RETRY_S, self._wake, client, retries - 1)
            return
        self.woken.add(client.id)
        await handler.server_event(events.DataReceived(client, b""))


def _undecided_handler(client: connection.Client) -> tuple[Any, layer.NextLayer | None]:
    """The connection handler of ``client`` and its transparent mode's NextLayer, when that has
    chosen no layer yet (else ``(handler, None)``)."""
    server = ctx.master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
    handler = getattr(server, "connections", {}).get(client.id) if server is not None else None
    if handler is None:
        return None, None
    top = handler.layer  # the mode layer (TransparentProxy), or the NextLayer that chose it
    mode = top.layer if isinstance(top, layer.NextLayer) else top
    child = getattr(mode, "child_layer", None)
    if not isinstance(child, layer.NextLayer) or child.layer is not None:
        return handler, None
    return handler, child
