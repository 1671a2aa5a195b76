"""mitmproxy's self-connect check, answered from an index of the listeners.

mitmproxy refuses a server connection to one of its own listeners (in transparent mode a
connection that reached the MITM port without NAT would otherwise connect to itself in a loop,
docs/reference/behaviour.md §10). Its ``Proxyserver.server_connect`` walks every listener and calls
``getsockname`` on each of their sockets for every upstream connection: with the per-subject
listeners of host-uid subjects (docs/reference/behaviour.md §17; 256 by default, besides the shared one)
that walk was ~1.5 ms of every new connection (measured, scripts/bench/results/report-mitm-2026-12-03.md). The
same check, with the same answers, from a dictionary built once per listener change.

Fail closed: while the listeners change, mitmproxy's own walk answers; an index that outlived a
listener only refuses more (a connection to a port that no longer listens).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from mitmproxy.addons import proxyserver
from mitmproxy.proxy import server_hooks

#: The names mitmproxy counts as its own host whatever a listener is bound to.
LOCAL_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1"})
#: mitmproxy's own error text for a self-connect.
SELF_CONNECT_ERROR: Final = (
    "Request destination unknown. Unable to figure out where this request should be forwarded to."
)


class ListenIndex:
    """The listeners by (port, transport): the hosts they are bound to."""

    def __init__(self, listeners: Iterable[tuple[str, int, str]]) -> None:
        by: dict[tuple[int, str], set[str]] = {}
        for host, port, transport in listeners:
            by.setdefault((port, transport), set()).add(host)
        self._by = {key: frozenset(hosts) for key, hosts in by.items()}

    def self_connect(self, host: str, port: int, transport: str) -> bool:
        """mitmproxy's rule: the same port and transport as a listener, and the host is a
        local name or the listener's own host."""
        hosts = self._by.get((port, transport))
        return hosts is not None and (host in LOCAL_NAMES or host in hosts)


class IndexedProxyserver(proxyserver.Proxyserver):
    """mitmproxy's proxy server addon with the indexed self-connect check."""

    name = "proxyserver"  # what mitmproxy and the egressd addon look it up by

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mitmproxy's is untyped
        self._index: ListenIndex | None = None
        # Sent when the new servers are created and again once they listen.
        self.servers.changed.connect(self._servers_changed)

    def _servers_changed(self) -> None:
        self._index = None

    def _listen_index(self) -> ListenIndex:
        if self._index is None:
            self._index = ListenIndex(
                (str(addr[0]), int(addr[1]), server.mode.transport_protocol)
                for server in self.servers
                for addr in server.listen_addrs
            )
        return self._index

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if self.servers.is_updating:
            super().server_connect(data)
            return
        if data.server.sockname is None:
            data.server.sockname = self._connect_addr
        assert data.server.address
        host, port, *_ = data.server.address
        if self._listen_index().self_connect(host, port, data.server.transport_protocol):
            data.server.error = SELF_CONNECT_ERROR
