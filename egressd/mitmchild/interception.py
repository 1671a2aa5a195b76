"""Selective interception (docs/reference/behaviour.md §16): the addon that opens a redirected connection
(decrypts TLS, parses plain HTTP) or relays it unopened, a thin shell around the pure
:mod:`egressd.mitmchild.intercept`.

A connection is relayed unopened only on a positive answer (no vault, no binding for its SNI,
an ignored host); when the connection-time lookup fails it is opened, so that the request
path (:mod:`egressd.mitmchild.injection`) refuses its requests.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from mitmproxy import ctx, tls
from mitmproxy.addons.next_layer import stack_match
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.layers import modes

from egressd.mitm.protocol import CONNECTION_EVENT
from egressd.mitmchild.intercept import (
    REASON_LOOKUP_FAILED,
    Decision,
    Verdict,
    http_by_vault,
    http_early,
    tls_by_vault,
    tls_early,
)
from egressd.mitmchild.lookup import LookupFailed
from egressd.mitmchild.shared import address_of, emit, ip_of
from egressd.mitmchild.vaults import VaultLookup
from egressd.vault.snapshot import VaultSnapshot


class Interception:
    """``tls_clienthello`` (TLS) and ``next_layer`` (plain HTTP): open the connection or relay it."""

    def __init__(self, vaults: VaultLookup) -> None:
        self.vaults = vaults
        self.ignore: tuple[re.Pattern[str], ...] = ()

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
            # vault cannot be read) by the request hooks below.
            emit("mitm.error", hook="tls_clienthello", error=type(exc).__name__)

    async def _tls_clienthello(self, data: tls.ClientHelloData) -> None:
        context = data.context
        client_ip = ip_of(context.client.peername)
        dest = address_of(context.server.address)
        sni = data.client_hello.sni
        verdict = tls_early(sni, dest[1] if dest else None, self.ignore)
        started = time.perf_counter()
        if verdict is None:
            verdict = await self._vault_verdict(
                context.client, client_ip, lambda snap: tls_by_vault(snap, sni), "decrypt"
            )
        self._connection("tls", verdict, started, client=client_ip, sni=(sni or "")[:255] or None, dest=dest)
        if not verdict.opens:
            # mitmproxy relays the ClientHello and everything after it to the original
            # destination, the address the kernel's input chain judged (transparent mode).
            data.ignore_connection = True

    async def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """Plain HTTP straight on the redirected connection (not inside TLS): relayed as TCP
        for a subject without an http binding. mitmproxy's NextLayer chose the layer already."""
        try:
            await self._next_layer(nextlayer)
        except Exception as exc:
            # The HTTP layer stays: its requests are decided by the request hooks.
            emit("mitm.error", hook="next_layer", error=type(exc).__name__)

    async def _next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        chosen = nextlayer.layer
        # The layer NextLayer built for the redirected connection itself has just joined the
        # stack behind the mode layer; HTTP inside decrypted TLS sits deeper and is not ours.
        if (
            not isinstance(chosen, layers.HttpLayer)
            or not stack_match(context, [modes.TransparentProxy, layers.HttpLayer])
            or context.layers[-1] is not chosen
        ):
            return
        client_ip = ip_of(context.client.peername)
        dest = address_of(context.server.address)
        started = time.perf_counter()
        verdict = http_early(dest[1] if dest else None)
        if verdict is None:
            verdict = await self._vault_verdict(context.client, client_ip, http_by_vault, "parse")
        self._connection("http", verdict, started, client=client_ip, sni=None, dest=dest)
        if not verdict.opens:
            context.layers.remove(chosen)  # the relay replaces it (a layer joins on creation)
            nextlayer.layer = layers.TCPLayer(context, ignore=True)

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
