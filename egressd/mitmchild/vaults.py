"""The vault of a connection's client, for the other addons (docs/reference/behaviour.md §10, §17): the
``_active`` client (:class:`~egressd.mitmchild.lookup.ActiveClient`, with its cache and the
narrowing sequence map) built from the egressd options, and the rule that names the client:
its listener port on a host-uid subject's port, else its peer address.
"""

from __future__ import annotations

from mitmproxy import ctx
from mitmproxy.addonmanager import Loader

from egressd.mitm.seqmap import SeqReader
from egressd.mitmchild.lookup import ActiveClient, View
from egressd.mitmchild.shared import emit, listen_port


def _sequence_reader(path: str) -> SeqReader | None:
    """The map egressd bumps on every narrowing; without it every lookup is a pull (closed)."""
    if not path:
        return None
    try:
        return SeqReader(path)
    except OSError as exc:
        emit("mitm.error", hook="configure", error=f"vault push: {type(exc).__name__}")
        return None


class VaultLookup:
    """No hook of its own but configuration: the other addons ask it for a client's vault."""

    def __init__(self) -> None:
        self.client: ActiveClient | None = None
        self.shared_port: int | None = None  # the shared listener's port (``listen_port``)

    def load(self, loader: Loader) -> None:
        loader.add_option("egressd_active_socket", str, "", "egressd's private _active unix socket")
        loader.add_option("egressd_lookup_timeout_ms", int, 250, "milliseconds per _active lookup")
        loader.add_option("egressd_vault_push", str, "", "egressd's narrowing sequence map (empty: pull always)")

    def configure(self, updated: set[str]) -> None:
        if "listen_port" in updated:
            self.shared_port = ctx.options.listen_port
        if updated & {"egressd_active_socket", "egressd_lookup_timeout_ms", "egressd_vault_push"}:
            self.client = ActiveClient(
                ctx.options.egressd_active_socket,
                ctx.options.egressd_lookup_timeout_ms / 1000,
                seq=_sequence_reader(ctx.options.egressd_vault_push),
            )

    async def done(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def lookup(self, conn: object, client_ip: str | None, host: str | None, dst: str | None) -> View:
        """The vault of the connection's client: by its listener port on a host-uid subject's
        port (docs/reference/behaviour.md §17), else by its peer address."""
        assert self.client is not None
        listen = listen_port(conn, self.shared_port)
        if listen is None:
            return await self.client.lookup(client_ip, host, dst)
        return await self.client.lookup(client_ip, host, dst, listen_port=listen)

