"""egressd's own listening sockets, made so that no sandbox uid can take their traffic
(docs/reference/behaviour.md §20.1).

Two properties, one per protocol family of attack:

* **UDP ports are never shared.** A UDP socket with ``SO_REUSEADDR`` lets any later socket
  that also sets it bind the same port, with no uid check, and the more specific (or, on a
  tie, the newest) bind receives the datagrams. egressd's UDP sockets therefore never set it:
  while egressd holds a port, a bind of it by anyone else fails (``EADDRINUSE``). UDP has no
  TIME_WAIT, so a restarted egressd rebinds at once without it. TCP listeners keep
  ``SO_REUSEADDR`` (rebinding over TIME_WAIT after a restart); on TCP it never lets a second
  socket listen beside a listening one.
* **Ownership is visible to the kernel.** Every listener carries ``SO_MARK`` :data:`OWNER_MARK`
  (setting a socket mark needs ``CAP_NET_ADMIN``, which no sandbox holds), and the accepted
  connections inherit it. The fleet table's input chain refuses every packet addressed to one of
  egressd's ports that would land on a full socket without that mark
  (:func:`egressd.fleetnft.header.header_script`, chain ``owned_in``): a squatter that bound a
  port egressd is not using at that instant (a worker restarting, egressd itself down) receives
  no byte, SYN-cookie handshakes and not-yet-accepted children included.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import socket
from typing import Final

#: The socket mark of every egressd listener (and of the connections they accept). Not a bit
#: any rule of egressd's tables sets on packets (0x1: the DNS forwarder, 0x2: the allow mark).
OWNER_MARK: Final = 0x45470000

#: Errors that mean "this host has no IPv6 here": the IPv6 half of a listener is then skipped.
NO_IPV6: Final = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def bound_socket(
    host: str, port: int, kind: socket.SocketKind, *, mark: int | None, backlog: int | None = None
) -> socket.socket:
    """A socket of ``kind`` bound to ``host:port`` (listening with ``backlog`` when given).

    UDP never sets ``SO_REUSEADDR`` (see the module docstring); IPv6 sockets are IPv6-only, so
    the IPv4 half of a wildcard listener is its own socket. ``mark`` (:data:`OWNER_MARK` in the
    fleet) failing to apply is an error, never a silently unmarked socket: the kernel would
    refuse everything sent to it."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, kind)
    try:
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        if fam == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        if backlog is not None:
            sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def wildcard_listeners(ports: tuple[int, ...], *, mark: int | None, backlog: int = 100) -> list[socket.socket]:
    """Listening TCP sockets on ``0.0.0.0`` and ``[::]`` for each port (the IPv6 ones only where
    the host has IPv6), as mitmproxy binds its own for a transparent mode; every socket is
    closed again when one port cannot be bound."""
    out: list[socket.socket] = []
    try:
        for port in ports:
            out.append(bound_socket("0.0.0.0", port, socket.SOCK_STREAM, mark=mark, backlog=backlog))
            try:
                out.append(bound_socket("::", port, socket.SOCK_STREAM, mark=mark, backlog=backlog))
            except OSError as exc:
                if exc.errno not in NO_IPV6:
                    raise
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


def raise_fd_limit() -> None:
    """The soft open-files limit up to the hard one: every per-subject port (host-uid
    subjects) is one or two listening sockets, and the connections need room beside them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
