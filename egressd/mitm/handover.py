"""Listening sockets bound by egressd and handed to the MITM child (docs/behaviour.md §20.1).

The child runs without capabilities, so it cannot give its listeners the owner mark
(``SO_MARK`` needs ``CAP_NET_ADMIN``) by which the fleet's input chain tells egressd's sockets
from a squatter's. The supervisor binds them instead, before each start (a worker's ports are
held by exactly one process at a time: the child that serves them), passes them as inherited
descriptors named in :data:`LISTEN_FDS_ENV`, and the child's transparent-mode servers listen on
them instead of binding their own. A port without a handed-over socket (the variable absent:
a child started by hand, a test) is bound by mitmproxy as before; in the fleet such a socket
would carry no mark, so the kernel would let nothing reach it (closed, never open).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

#: The child's environment variable naming the inherited listening descriptors (comma list).
LISTEN_FDS_ENV: Final = "EGRESSD_MITM_LISTEN_FDS"


@dataclass(frozen=True, slots=True)
class Listen:
    """The ports a child listens on (its worker port first, then its subject ports) and the
    SO_MARK they carry (None: unmarked, the sidecar)."""

    ports: tuple[int, ...]
    mark: int | None = None


def handover_env(socks: Sequence[socket.socket]) -> dict[str, str]:
    """The child's environment: the parent's, plus the inherited descriptors."""
    return {**os.environ, LISTEN_FDS_ENV: ",".join(str(s.fileno()) for s in socks)}


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
