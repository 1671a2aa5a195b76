"""Listening sockets bound by egressd and handed to the MITM child (docs/reference/behaviour.md §20.1).

The child runs without capabilities, so it cannot give its listeners the owner mark
(``SO_MARK`` needs ``CAP_NET_ADMIN``) by which the fleet's input chain tells egressd's sockets
from a squatter's. The supervisor binds them instead, before each start (a worker's ports are
held by exactly one process at a time: the child that serves them), passes them as inherited
descriptors named in :data:`~egressd.mitm.protocol.LISTEN_FDS_ENV`, and the child's transparent-mode servers listen on
them instead of binding their own. A port without a handed-over socket (the variable absent:
a child started by hand, a test) is bound by mitmproxy as before; in the fleet such a socket
would carry no mark, so the kernel would let nothing reach it (closed, never open).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from egressd.mitm.protocol import LISTEN_FDS_ENV


def adopt(environ: Mapping[str, str]) -> dict[int, list[socket.socket]]:
    """The handed-over listening sockets by port (child side); descriptors that are not
    listening TCP sockets are ignored (closed)."""
    by_port: dict[int, list[socket.socket]] = {}
    for text in environ.get(LISTEN_FDS_ENV, "").split(","):
        if not text.strip().isdigit():
            continue
        try:
            sock = socket.socket(fileno=int(text))
        except OSError:
            continue
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.close()
            continue
        by_port.setdefault(int(sock.getsockname()[1]), []).append(sock)
    return by_port


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def listen_on_adopted(by_port: dict[int, list[socket.socket]]) -> None:
    """Make mitmproxy's transparent-mode servers serve the adopted sockets of their port.

    Each port's sockets are used once: a server that mitmproxy stops closes them, and a later
    start of the same port binds its own (unmarked) socket as mitmproxy always did."""
    from mitmproxy.proxy import mode_servers

    own = mode_servers.TransparentInstance.listen

    async def listen(self: Any, host: str, port: int) -> list[Any]:
        socks = by_port.pop(port, None)
        if not socks:
            return await own(self, host, port)
        handler: Handler = self.handle_stream
        return [await asyncio.start_server(handler, sock=s) for s in socks]

    setattr(mode_servers.TransparentInstance, "listen", listen)  # noqa: B010  # mitmproxy's class
