"""Selective interception (docs/reference/behaviour.md §16): the addon that opens a redirected connection
(decrypts TLS, parses plain HTTP) or relays it unopened, a thin shell around the pure
:mod:`egressd.mitmchild.intercept`.

A connection is relayed unopened only on a positive answer (no vault, no binding for its SNI,
an ignored host); when the connection-time lookup fails it is opened, so that the request
path (:mod:`egressd.mitmchild.injection`) refuses its requests.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

from mitmproxy import connection, ctx, tcp, tls
from mitmproxy.addons.next_layer import stack_match
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import parse_client_hello

from egressd.mitm.protocol import CONNECTION_EVENT
from egressd.mitmchild.firstbytes import REASON_NO_SNI, looks_like_http, refusal, undecided
from egressd.mitmchild.intercept import (
    REASON_LOOKUP_FAILED,
    REASON_NAME_CHECK,
    REASON_REQUEST_RULES,
    REASON_REQUESTS_LATER,
    REASON_REQUESTS_UNSEEN,
    Decision,
    Verdict,
    http_by_vault,
    http_early,
    sni_name,
    tls_by_vault,
    tls_early,
)
from egressd.mitmchild.lookup import LookupFailed
from egressd.mitmchild.names import LOOKUP_FAILED, NameAnswer, NameGate, as_name, reset
from egressd.mitmchild.requestgate import RequestGate
from egressd.mitmchild.shared import address_of, emit, ip_of
from egressd.mitmchild.silence import SilentClients
from egressd.mitmchild.splicerelay import SpliceRelay, outer_hello
from egressd.mitmchild.vaults import VaultLookup
from egressd.vault.snapshot import VaultSnapshot


class Interception:
    """``tls_clienthello`` (TLS) and ``next_layer`` (plain HTTP): open the connection or relay it."""

    def __init__(
        self,
        vaults: VaultLookup,
        names: NameGate,
        requests: RequestGate | None = None,
        splice: SpliceRelay | None = None,
    ) -> None:
        self.vaults = vaults
        self.names = names
        self.requests = requests
        # Admitted TLS relayed unopened: the upstream's bytes to the client by splice(2).
        self.splice = splice
        if splice is not None:
            names.on_disconnect.append(splice.forget)
        self.ignore: tuple[re.Pattern[str], ...] = ()
        # TLS relayed unopened, by client connection id: (client, client ip, SNI name, stamp,
        # original destination). Once the client's narrowing stamp moves, such a connection is
        # reset when the name check no longer admits its SNI there (§14.1: a narrowing cuts the
        # flows it no longer allows) or request rules now judge its name (they would never see
        # its requests).
        self.relayed: dict[
            str, tuple[connection.Client, str | None, str | None, object, tuple[str, int] | None]
        ] = {}
        self._watch: asyncio.Task[None] | None = None
        self.silent = SilentClients(names, requests, self._connection)
        names.on_disconnect.append(self.silent.client_disconnected)

    def client_connected(self, client: connection.Client) -> None:
        self.silent.client_connected(client)

    async def tcp_message(self, flow: tcp.TCPFlow) -> None:
        await self.silent.tcp_message(flow)

    def configure(self, updated: set[str]) -> None:
        if "ignore_hosts" in updated:
            # mitmproxy's own option (its next_layer tries it on address:port, Host, SNI:port);
            # kept here for the bare SNI (intercept.ignored).
            self.ignore = tuple(re.compile(p, re.IGNORECASE) for p in ctx.options.ignore_hosts)

    async def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        try:
            await self._tls_clienthello(data)
        except Exception as exc:
            # Left opened, not relayed: every request on it is decided (and refused when the
            # vault cannot be read) by the request hooks below. Undecided by the name check
            # (docs/reference/behaviour.md §18): refused, never relayed.
            emit("mitm.error", hook="tls_clienthello", error=type(exc).__name__)
            if self.names.enabled:
                self.names.refuse_connection(data.context.client, LOOKUP_FAILED)

    async def _tls_clienthello(self, data: tls.ClientHelloData) -> None:
        context = data.context
        client_ip = ip_of(context.client.peername)
        dest = address_of(context.server.address)
        sni = data.client_hello.sni
        started = time.perf_counter()
        if await self._name_refused(
            "tls", context, client_ip, as_name(sni_name(sni)), dest, started, sni=sni
        ):
            return
        verdict = tls_early(sni, dest[1] if dest else None, self.ignore)
        if verdict is None:
            verdict = await self._vault_verdict(
                context.client, client_ip, lambda snap: tls_by_vault(snap, sni), "decrypt"
            )
        if not verdict.opens and await self._judged(context, client_ip, sni_name(sni)):
            verdict = Verdict("decrypt", REASON_REQUEST_RULES)
        self._connection("tls", verdict, started, client=client_ip, sni=(sni or "")[:255] or None, dest=dest)
        if not verdict.opens:
            # mitmproxy relays the ClientHello and everything after it to the original
            # destination, the address the kernel's input chain judged (transparent mode).
            data.ignore_connection = True
            self._relaying(context.client, client_ip, as_name(sni_name(sni)), dest)
            # Only the outermost hello: an inner one's client is the decrypted outer connection.
            if self.splice is not None and outer_hello(context):
                self.splice.want(context.client)

    def _relaying(
        self, client: connection.Client, client_ip: str | None, name: str | None, dest: tuple[str, int] | None
    ) -> None:
        """Watch a relayed TLS connection: a policy change that takes its name away there
        (docs/reference/behaviour.md §18, §14.1) or makes its name judged (§19: requests after
        a policy change on a kept-alive connection are judged, or the connection is gone)
        resets it."""
        if self.requests is None or (name is None and not self.names.enabled):
            return
        self.relayed[client.id] = (client, client_ip, name, self.requests.stamp(client, client_ip), dest)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_relayed())

    async def _watch_relayed(self) -> None:
        while self.relayed:
            await asyncio.sleep(RELAY_WATCH_S)
            await self.check_relayed()

    async def check_relayed(self) -> None:
        """One pass over the relayed connections: forget the closed ones, reset those whose
        SNI the name check no longer admits there or whose name a policy change made judged.
        Only a moved stamp asks egressd (one question per client and name, cached): while
        egressd is silent (no stamp), nothing is asked and nothing reset; the kernel keeps
        policing the address, and the first stamp after it is back differs from the one the
        connection was admitted under."""
        gate = self.requests
        if gate is None:
            return
        for cid, (client, client_ip, name, stamp, dest) in list(self.relayed.items()):
            if not client.connected:  # gone (no client_disconnected hook here: one addon per event)
                del self.relayed[cid]
                continue
            now = gate.stamp(client, client_ip)
            if now is None or now == stamp:
                continue
            refused = await self._refused_now(client, client_ip, name, dest)
            if cid not in self.relayed:
                continue
            if refused is not None:
                del self.relayed[cid]
                if self.splice is not None:
                    self.splice.cut(client)  # first the kernel stops moving its bytes
                reset(client)
                self._connection(
                    "tls",
                    Verdict("refuse", refused),
                    time.perf_counter(),
                    client=client_ip,
                    sni=name,
                    dest=dest,
                )
            else:
                self.relayed[cid] = (client, client_ip, name, now, dest)

    async def _refused_now(
        self, client: connection.Client, client_ip: str | None, name: str | None, dest: tuple[str, int] | None
    ) -> str | None:
        """Why a relayed TLS connection must go after a policy change (None: it stays): its SNI
        no longer admitted there (the name check's reason, counted and reported by egressd like
        any refusal), or its name judged by request rules. Undecidable: it goes (closed)."""
        if self.names.enabled:
            if dest is None:
                return LOOKUP_FAILED
            answer = await self.names.ask(client, client_ip, "tls", name, dest[0], dest[1])
            if not answer.admit:
                return answer.reason or LOOKUP_FAILED
        if name is None or self.requests is None:
            return None
        try:
            judged = await self.requests.judged(client, client_ip, name)
        except Exception as exc:  # fail closed: an undecidable relay is cut
            emit("mitm.error", hook="relay_watch", error=type(exc).__name__)
            judged = True
        return REASON_REQUESTS_LATER if judged else None

    async def _name_refused(
        self,
        wire: str,
        context: Context,
        client_ip: str | None,
        name: str | None,
        dest: tuple[str, int] | None,
        started: float,
        *,
        sni: str | None = None,
    ) -> bool:
        """Ask egressd whether ``name`` may reach the connection's original destination
        (docs/reference/behaviour.md §18); on a refusal reset the client (no upstream connection
        is ever opened for it) and say True. Every port the kernel sends here is checked (80,
        443, the extra ports and the ports the subject's http/https rules name:
        egressd.policy.mitmports)."""
        if not self.names.enabled:
            return False
        if dest is None:
            answer = NameAnswer(False, LOOKUP_FAILED)
        else:
            answer = await self.names.ask(context.client, client_ip, wire, name, dest[0], dest[1])
        if answer.admit:
            return False
        self._refuse(
            wire, context.client, answer.reason or LOOKUP_FAILED, started, client_ip, dest, sni or name
        )
        return True

    def _refuse(
        self,
        wire: str,
        client: connection.Client,
        reason: str,
        started: float,
        client_ip: str | None,
        dest: tuple[str, int] | None,
        sni: str | None = None,
    ) -> None:
        """Reset ``client`` (no upstream connection is ever opened for it) and log the refusal."""
        self.names.refuse_connection(client, reason)
        self._connection(
            wire,
            Verdict("refuse", reason),
            started,
            client=client_ip,
            sni=(sni or "")[:255] or None,
            dest=dest,
        )

    async def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """Plain HTTP straight on the redirected connection (not inside TLS): relayed as TCP
        for a subject without an http binding. mitmproxy's NextLayer chose the layer already."""
        try:
            await self._next_layer(nextlayer)
        except Exception as exc:
            # The HTTP layer stays: its requests are decided by the request hooks. A relay the
            # name check could not decide is refused.
            emit("mitm.error", hook="next_layer", error=type(exc).__name__)
            # Request rules (§19) may judge it too: undecided, it is refused either way.
            undecided = self.names.enabled or self.requests is not None
            if undecided and isinstance(nextlayer.layer, layers.TCPLayer):
                self.names.refuse_connection(nextlayer.context.client, LOOKUP_FAILED)

    async def _next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        chosen = nextlayer.layer
        data = nextlayer.data_client()
        if data and not undecided(data):
            self.silent.spoke(context.client)
        outermost = len(context.layers) <= 2 and isinstance(context.layers[0], modes.TransparentProxy)
        if self.names.enabled and outermost and self.silent.is_woken(context.client, data):
            # A client that stayed silent (a server-first protocol waits for its server):
            # decided without a name (egressd.mitmchild.silence).
            if chosen is not None and context.layers[-1] is chosen:
                context.layers.remove(chosen)
            nextlayer.layer = None
            await self.silent.decide(nextlayer)
            return
        # The layer NextLayer built for the redirected connection itself has just joined the
        # stack behind the mode layer; HTTP inside decrypted TLS sits deeper and is not ours.
        if context.layers[-1] is not chosen:
            return
        if isinstance(chosen, layers.TCPLayer) and stack_match(
            context, [modes.TransparentProxy, layers.TCPLayer]
        ):
            await self._raw_relay(nextlayer, chosen)
            return
        if not isinstance(chosen, layers.HttpLayer) or not stack_match(
            context, [modes.TransparentProxy, layers.HttpLayer]
        ):
            return
        client_ip = ip_of(context.client.peername)
        dest = address_of(context.server.address)
        started = time.perf_counter()
        verdict: Verdict | None
        if self.names.enabled:
            # Every request's Host is checked (docs/reference/behaviour.md §18), on every
            # intercepted port (plain HTTP on 443 too).
            verdict = Verdict("parse", REASON_NAME_CHECK)
        else:
            verdict = http_early(dest[1] if dest else None)
        if verdict is None:
            verdict = await self._vault_verdict(context.client, client_ip, http_by_vault, "parse")
        if not verdict.opens and await self._judged(context, client_ip, None, wire="http"):
            verdict = Verdict("parse", REASON_REQUEST_RULES)
        self._connection("http", verdict, started, client=client_ip, sni=None, dest=dest)
        if not verdict.opens:
            context.layers.remove(chosen)  # the relay replaces it (a layer joins on creation)
            nextlayer.layer = layers.TCPLayer(context, ignore=True)

    async def _raw_relay(self, nextlayer: layer.NextLayer, chosen: layers.TCPLayer) -> None:
        """A redirected connection mitmproxy relays as TCP from the start (an ignored host, or
        not HTTP): with the name check on, TLS is checked by its ClientHello's SNI, plain HTTP
        is parsed instead (every request's Host is checked), anything else without a name."""
        context = nextlayer.context
        dest = address_of(context.server.address)
        started = time.perf_counter()
        client_ip = ip_of(context.client.peername)
        data = nextlayer.data_client()
        checks = self.names.enabled
        if checks and undecided(data):
            # Too few bytes to tell TLS or HTTP from anything else (a ClientHello or a request
            # line split after its first bytes): decide nothing yet. mitmproxy asks again when
            # more data arrives; no upstream connection is opened meanwhile.
            context.layers.remove(chosen)
            nextlayer.layer = None
            return
        if await self._relay_judged(nextlayer, chosen, data, client_ip, dest, started):
            return
        if not checks:
            return
        if starts_like_tls_record(data):
            try:
                hello = parse_client_hello(data)
            except ValueError:
                hello = None
            sni = hello.sni if hello is not None else None
            await self._name_refused(
                "tls", context, client_ip, as_name(sni_name(sni)), dest, started, sni=sni
            )
            return
        if looks_like_http(data):
            context.layers.remove(chosen)
            nextlayer.layer = layers.HttpLayer(context, HTTPMode.transparent)
            self._connection(
                "http", Verdict("parse", REASON_NAME_CHECK), started, client=client_ip, sni=None, dest=dest
            )
            return
        refused = refusal(data)
        if refused is not None:
            # TLS or a request line that mitmproxy's tests miss but a server reads (an odd
            # record version, whitespace before or inside a request line): never "no name".
            wire = "tls" if refused == REASON_NO_SNI else "http"
            self._refuse(wire, context.client, refused, started, client_ip, dest)
            if dest is not None:  # counted, logged and posted by egressd like any refusal
                self.names.report_refusal(context.client, client_ip, wire, refused, dest[0], dest[1])
            return
        # Neither TLS nor HTTP: no name to check; egressd admits it where the destination is
        # open without one (an address rule, defaultAction allow, a tcp rule's lease).
        if await self._name_refused("tcp", context, client_ip, None, dest, started):
            return
        if chosen.flow is not None:  # relayed as it is: no flow keeping every message
            context.layers.remove(chosen)
            nextlayer.layer = layers.TCPLayer(context, ignore=True)

    async def _judged(
        self, context: Context, client_ip: str | None, name: str | None, *, wire: str = "tls"
    ) -> bool:
        """Request rules (docs/reference/behaviour.md §19): must this connection be opened so
        that its requests are judged? TLS: some rule with methods/paths matches its SNI (no
        SNI: no domain rule can be about it); plain HTTP (its Host comes later): the subject
        has such a rule. egressd unreachable: opened (its requests are then refused)."""
        if self.requests is None or (wire == "tls" and as_name(name) is None):
            return False
        return await self.requests.judged(context.client, client_ip, name)

    async def _relay_judged(
        self,
        nextlayer: layer.NextLayer,
        chosen: layers.TCPLayer,
        data: bytes,
        client_ip: str | None,
        dest: tuple[str, int] | None,
        started: float,
    ) -> bool:
        """Request rules (docs/reference/behaviour.md §19) on a connection mitmproxy would relay
        from its first byte (an ``ignore_hosts`` match): plain HTTP of a subject with request
        rules is parsed instead, so its requests are judged; TLS to a judged name cannot be, and
        is refused (reset) rather than relayed unjudged. True when it decided."""
        if self.requests is None:
            return False
        context = nextlayer.context
        if starts_like_tls_record(data):
            try:
                hello = parse_client_hello(data)
            except ValueError:
                hello = None
            sni = hello.sni if hello is not None else None
            name = as_name(sni_name(sni))
            if name is None or not await self.requests.judged(context.client, client_ip, name):
                return False
            self._refuse("tls", context.client, REASON_REQUESTS_UNSEEN, started, client_ip, dest, name)
            return True
        if not looks_like_http(data) or not await self.requests.judged(context.client, client_ip, None):
            return False
        context.layers.remove(chosen)
        nextlayer.layer = layers.HttpLayer(context, HTTPMode.transparent)
        self._connection(
            "http", Verdict("parse", REASON_REQUEST_RULES), started, client=client_ip, sni=None, dest=dest
        )
        return True

    async def _vault_verdict(
        self,
        conn: object,
        client_ip: str | None,
        decide: Callable[[VaultSnapshot | None], Verdict],
        opened: Decision,
    ) -> Verdict:
        """Decide with the client's vault; a failed lookup opens the connection (fail closed:
        its requests then meet the same failure and are refused before the upstream)."""
        try:
            view = await self.vaults.lookup(conn, client_ip, None, None)
        except LookupFailed:
            return Verdict(opened, REASON_LOOKUP_FAILED)
        return decide(view.snapshot)

    @staticmethod
    def _connection(
        protocol: str,
        verdict: Verdict,
        started: float,
        *,
        client: str | None,
        sni: str | None,
        dest: tuple[str, int] | None,
    ) -> None:
        emit(
            CONNECTION_EVENT,
            protocol=protocol,
            decision=verdict.decision,
            reason=verdict.reason,
            binding=verdict.binding,
            client=client,
            sni=sni,
            dst=dest[0] if dest else None,
            port=dest[1] if dest else None,
            lookup_ms=round((time.perf_counter() - started) * 1000, 3),
        )

    def tls_failed_client(self, data: tls.TlsData) -> None:
        """A client that does not trust the CA, or speaks no TLS the proxy accepts."""
        emit("mitm.tls_failed", client=ip_of(data.context.client.peername), sni=data.context.client.sni)


#: How often relayed TLS connections are checked against a changed policy (seconds).
RELAY_WATCH_S = 0.2
