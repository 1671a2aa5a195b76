"""The kernel relay of passed-through TLS (egressd.mitmchild.splicerelay, issue 25 item 5).

* The mitmproxy internals it relies on are where it expects them (this fails on a mitmproxy
  that moved them: then the child falls back to mitmproxy's relay, and these pins say why).
* :class:`SpliceReader` on real loopback sockets, driven by a copy of mitmproxy's read loop:
  the bytes asyncio had already read go first, then the kernel's, intact, then the end of
  file; an upstream or client that vanishes ends the loop with ``OSError``; the relay watch's
  cut ends it at once; every descriptor it opened is closed again.
* The fallback: a connection the relay cannot take stays mitmproxy's (also one wanted in a
  burst past the limit, or after the option went off); a take-over that fails part way closes
  what it opened and resets the connection.
* Only the outermost ClientHello is wanted, never TLS inside a stream mitmproxy decrypts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import os
import socket
import struct
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy import options
from mitmproxy.addons import proxyserver
from mitmproxy.proxy import layer, layers, mode_servers, server
from mitmproxy.proxy.context import Context
from mitmproxy.test import taddons, tflow

from egressd.mitmchild import splicerelay
from egressd.mitmchild.interception import Interception
from egressd.mitmchild.names import NameGate
from egressd.mitmchild.splicerelay import SpliceReader, SpliceRelay, check
from egressd.mitmchild.vaults import VaultLookup

# ---- the pins ----------------------------------------------------------------------------------


def test_the_internals_it_uses_are_where_it_expects_them() -> None:
    assert check() is None
    # names.reset and the relay find a client's handler by its connection id
    assert "register_connection(handler.layer.context.client.id" in inspect.getsource(
        mode_servers.AsyncioServerInstance.handle_stream
    )
    assert isinstance(proxyserver.Proxyserver().connections, dict)  # type: ignore[no-untyped-call]
    # the read loop treats b"" and OSError as the end, and the reader is read per connection
    loop = inspect.getsource(server.ConnectionHandler.handle_connection)
    assert 'raise OSError("Connection closed by peer.")' in loop
    assert "await self.drain_writers()" in loop


def test_a_moved_internal_disables_it(monkeypatch: pytest.MonkeyPatch) -> None:
    async def handle_connection(self: Any, connection: Any) -> None:
        pass

    monkeypatch.setattr(server.ConnectionHandler, "handle_connection", handle_connection)
    assert check() == "mitmproxy's connection handler moved"
    relay = SpliceRelay()
    relay.want(SimpleNamespace(id="c1"))  # type: ignore[arg-type]
    assert not relay.wanted


def test_another_mitmproxy_disables_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(splicerelay, "MITMPROXY_VERSION", "13.0.0")
    assert check() == "mitmproxy 13.0.0"


def test_switched_off_it_wants_nothing() -> None:
    relay = SpliceRelay()
    relay.enabled = False
    relay.want(SimpleNamespace(id="c1"))  # type: ignore[arg-type]
    assert not relay.wanted


async def test_a_connection_it_cannot_take_stays_mitmproxys() -> None:
    relay = SpliceRelay()
    client = SimpleNamespace(id="c1")
    relay.want(client)  # type: ignore[arg-type]
    with taddons.context(relay):  # type: ignore[no-untyped-call]  # no proxy server: no handler
        data = SimpleNamespace(client=client, server=SimpleNamespace(transport_protocol="tcp"))
        relay.server_connected(data)  # type: ignore[arg-type]
    assert relay.swapped == 0 and not relay.wanted


# ---- SpliceReader on real sockets ----------------------------------------------------------------


@dataclass(frozen=True)
class Conn:
    id: str
    transport_protocol: str = "tcp"


@dataclass
class IO:
    reader: Any
    writer: Any
    handler: Any = None


class Watchdog:
    def __init__(self) -> None:
        self.calls = 0

    def register_activity(self) -> None:
        self.calls += 1


@dataclass
class Rig:
    """MITM side: ``handler`` (client and server streams); far side: ``peer`` (the client's socket)
    and ``up`` (the upstream's socket)."""

    handler: Any
    relay: SpliceRelay
    reader: SpliceReader
    peer: socket.socket
    up: socket.socket
    client_conn: Any
    server_conn: Any = None


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _settled(want: int) -> int:
    """The descriptor count once the relay's thread has closed its own (bounded)."""
    for _ in range(200):
        if _fds() == want:
            break
        await asyncio.sleep(0.01)
    return _fds()


def _pipes() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    return n


async def _pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, socket.socket]:
    """An asyncio stream and the plain socket at its other end."""
    ls = socket.create_server(("127.0.0.1", 0))
    try:
        reader, writer = await asyncio.open_connection(*ls.getsockname())
        far, _ = ls.accept()
    finally:
        ls.close()
    far.setblocking(False)
    return reader, writer, far


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    creader, cwriter, peer = await _pair()
    sreader, swriter, up = await _pair()
    client_conn, server_conn = Conn("c1"), Conn("s1")
    handler = SimpleNamespace(
        client=client_conn,
        transports={client_conn: IO(creader, cwriter), server_conn: IO(sreader, swriter)},
        timeout_watchdog=Watchdog(),
    )
    relay = SpliceRelay()
    r = Rig(handler, relay, None, peer, up, client_conn, server_conn)  # type: ignore[arg-type]
    r.reader = SpliceReader(relay, client_conn, handler, handler.transports[server_conn])  # type: ignore[arg-type]
    try:
        yield r
    finally:
        for w in (cwriter, swriter):
            w.close()
        peer.close()
        up.close()


async def mitmproxy_loop(rig: Rig) -> str:
    """mitmproxy's read loop of the upstream connection, in short: what it does with the data
    and how it ends (the end of file half-closes the client)."""
    writer = rig.handler.transports[rig.client_conn].writer
    while True:
        try:
            data = await rig.reader.read(65535)
            if not data:
                raise OSError("Connection closed by peer.")
        except OSError as exc:
            if str(exc) == "Connection closed by peer.":
                writer.write_eof()
                return "eof"
            return f"error: {type(exc).__name__}"
        writer.write(data)
        await writer.drain()


async def send_all(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)


async def recv_all(sock: socket.socket, limit: int) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while len(out) <= limit:
        chunk = await loop.sock_recv(sock, 1 << 20)
        if not chunk:
            break
        out += chunk
    return bytes(out)


async def test_buffered_bytes_first_then_the_kernels_intact_then_the_end(rig: Rig) -> None:
    before = _fds()
    early = b"ServerHello-and-more" * 100
    await send_all(rig.up, early)
    await asyncio.sleep(0.05)  # read by asyncio into the stream reader before the take-over
    body = os.urandom(24 << 20)

    async def upstream() -> None:
        await send_all(rig.up, body)
        rig.up.shutdown(socket.SHUT_WR)

    got, ended, _ = await asyncio.wait_for(
        asyncio.gather(recv_all(rig.peer, len(early) + len(body)), mitmproxy_loop(rig), upstream()), 60
    )
    assert got == early + body  # the end of file reached the client too (recv_all returned)
    assert ended == "eof"
    assert rig.relay.kernel == 1 and not rig.relay.active
    assert rig.handler.timeout_watchdog.calls >= 1
    assert await _settled(before) == before  # pipes and duplicates closed


async def test_the_client_direction_and_half_close_are_untouched(rig: Rig) -> None:
    """The upstream ends its side first; the client's bytes still reach it afterwards."""
    loop_task = asyncio.ensure_future(mitmproxy_loop(rig))
    await send_all(rig.up, b"last words")
    rig.up.shutdown(socket.SHUT_WR)
    assert await asyncio.wait_for(recv_all(rig.peer, 1 << 20), 10) == b"last words"
    assert await asyncio.wait_for(loop_task, 10) == "eof"
    swriter = rig.handler.transports[rig.server_conn].writer
    swriter.write(b"late request")  # mitmproxy's client-to-upstream direction, after the half-close
    await swriter.drain()
    assert await asyncio.wait_for(asyncio.get_running_loop().sock_recv(rig.up, 100), 10) == b"late request"


async def test_an_upstream_that_vanishes_ends_the_loop(rig: Rig) -> None:
    loop_task = asyncio.ensure_future(mitmproxy_loop(rig))
    await send_all(rig.up, os.urandom(1 << 20))
    await asyncio.sleep(0.1)
    rig.up.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    rig.up.close()  # a reset
    assert (await asyncio.wait_for(loop_task, 10)).startswith(("error", "eof"))
    assert not rig.relay.active


async def test_a_client_that_vanishes_ends_the_loop(rig: Rig) -> None:
    before, pipes = _fds(), _pipes()
    loop_task = asyncio.ensure_future(mitmproxy_loop(rig))
    await asyncio.sleep(0.05)
    rig.peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    rig.peer.close()

    async def upstream() -> None:  # keeps sending until the relay gives up
        for _ in range(200):
            try:
                await asyncio.wait_for(send_all(rig.up, b"x" * 65536), 0.2)
            except (TimeoutError, OSError):
                return

    await asyncio.gather(upstream(), return_exceptions=True)
    assert (await asyncio.wait_for(loop_task, 10)).startswith("error")
    # the vanished client's sockets (ours, and asyncio's once it read the reset) and the relay's
    for _ in range(200):
        if _pipes() == pipes:
            break
        await asyncio.sleep(0.01)
    assert _pipes() == pipes and _fds() <= before - 1


async def test_the_relay_watch_cut_ends_it_at_once(rig: Rig) -> None:
    before = _fds()
    loop_task = asyncio.ensure_future(mitmproxy_loop(rig))
    await send_all(rig.up, b"hello")
    assert await asyncio.wait_for(asyncio.get_running_loop().sock_recv(rig.peer, 100), 10) == b"hello"
    assert rig.relay.active  # in the kernel phase, waiting for the upstream
    rig.relay.cut(rig.client_conn)
    assert await asyncio.wait_for(loop_task, 2) == "error: ConnectionResetError"
    assert not rig.relay.active and await _settled(before) == before


async def test_a_cancelled_loop_closes_what_it_opened(rig: Rig) -> None:
    before = _fds()
    loop_task = asyncio.ensure_future(mitmproxy_loop(rig))
    await send_all(rig.up, b"hello")
    await asyncio.wait_for(asyncio.get_running_loop().sock_recv(rig.peer, 100), 10)
    loop_task.cancel()  # mitmproxy's teardown (the client went, the inactivity timeout)
    with pytest.raises(asyncio.CancelledError):
        await loop_task
    assert await _settled(before) == before
    rig.relay.forget(rig.client_conn)  # the client_disconnected hook
    assert not rig.relay.active


# ---- what it takes, and when ---------------------------------------------------------------------


async def test_only_the_outermost_clienthello_is_wanted() -> None:
    """TLS inside a stream mitmproxy decrypts (its next layers: TLS again) is relayed as mitmproxy
    decided, but its client socket carries the outer TLS: never spliced."""
    # mitmproxy puts a layer in its context when it is built (before its ClientHello hook runs)
    assert "self.context.layers.append(self)" in inspect.getsource(layer.Layer.__init__)
    assert "ClientHelloData(self.context," in inspect.getsource(layers.ClientTLSLayer.receive_handshake_data)
    relay = SpliceRelay()
    addon = Interception(VaultLookup(), NameGate(VaultLookup()), splice=relay)
    ctx = Context(tflow.tclient_conn(), options.Options())
    ctx.client.peername, ctx.server.address = ("10.203.0.11", 40000), ("10.204.0.6", 8443)
    layers.ServerTLSLayer(ctx)
    layers.ClientTLSLayer(ctx)  # in ctx.layers from here on, as at mitmproxy's hook

    async def hello() -> Any:
        data = SimpleNamespace(
            context=ctx, client_hello=SimpleNamespace(sni="x.example.com"), ignore_connection=False
        )
        await addon.tls_clienthello(data)  # type: ignore[arg-type]
        return data

    layers.ServerTLSLayer(ctx)  # the decrypted stream's next layers: TLS inside TLS
    layers.ClientTLSLayer(ctx)
    inner = await hello()
    assert inner.ignore_connection  # relayed by mitmproxy (port 8443: no vault asked) ...
    assert not relay.wanted  # ... but not by splice
    del ctx.layers[2:]  # the outer hello alone (the control)
    assert (await hello()).ignore_connection and relay.wanted == {ctx.client.id}


class FakeProxyserver:
    name = "proxyserver"

    def __init__(self, connections: dict[str, Any]) -> None:
        self.connections = connections


async def test_a_burst_of_hellos_takes_no_more_than_the_limit(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(splicerelay, "MAX_RELAYS", 1)
    creader, cwriter, peer = await _pair()
    sreader, swriter, up = await _pair()
    c2, s2 = Conn("c2"), Conn("s2")
    other = SimpleNamespace(
        client=c2,
        transports={c2: IO(creader, cwriter), s2: IO(sreader, swriter)},
        timeout_watchdog=Watchdog(),
    )
    relay = SpliceRelay()
    try:
        # both hellos before either upstream connected: both under the limit then
        relay.want(rig.client_conn)
        relay.want(c2)  # type: ignore[arg-type]
        assert relay.wanted == {"c1", "c2"}
        with taddons.context(relay, FakeProxyserver({"c1": rig.handler, "c2": other})):  # type: ignore[no-untyped-call]
            relay.server_connected(SimpleNamespace(client=rig.client_conn, server=rig.server_conn))  # type: ignore[arg-type]
            relay.server_connected(SimpleNamespace(client=c2, server=s2))  # type: ignore[arg-type]
        assert relay.swapped == 1 and list(relay.active) == ["c1"] and not relay.wanted
        assert other.transports[s2].reader is sreader  # the second stays mitmproxy's
    finally:
        for w in (cwriter, swriter):
            w.close()
        peer.close()
        up.close()


async def test_switched_off_after_the_hello_it_takes_nothing(rig: Rig) -> None:
    relay = SpliceRelay()
    relay.want(rig.client_conn)
    relay.enabled = False  # the option went off between the hello and the upstream connection
    with taddons.context(relay, FakeProxyserver({"c1": rig.handler})):  # type: ignore[no-untyped-call]
        relay.server_connected(SimpleNamespace(client=rig.client_conn, server=rig.server_conn))  # type: ignore[arg-type]
    assert relay.swapped == 0 and not relay.wanted
    assert isinstance(rig.handler.transports[rig.server_conn].reader, asyncio.StreamReader)


@pytest.mark.parametrize("fails", ["pipe", "thread"])
async def test_a_take_over_that_fails_part_way_closes_what_it_opened(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    before = _fds()
    if fails == "pipe":  # the relay's pipe opens, the wake-up pipe does not (EMFILE)
        pipe2, calls = os.pipe2, []

        def pipe2_then_emfile(flags: int) -> tuple[int, int]:
            calls.append(flags)
            if len(calls) > 1:
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return pipe2(flags)

        monkeypatch.setattr(os, "pipe2", pipe2_then_emfile)
    else:  # every descriptor open, no thread

        def no_thread(self: Any) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", no_thread)
    assert await asyncio.wait_for(mitmproxy_loop(rig), 10) == "error: ConnectionResetError"
    monkeypatch.undo()
    assert _fds() == before and rig.relay.kernel == 0  # no duplicate or pipe left open
    assert not rig.relay.active  # its slot given back at once, not at the client's disconnect


async def test_a_client_gone_before_the_take_over_frees_its_slot(rig: Rig) -> None:
    """The client's side closing before the kernel phase ends the loop and gives its relay
    slot back at once (not at mitmproxy's later disconnect hook)."""
    rig.handler.transports[rig.client_conn].writer.close()
    assert await asyncio.wait_for(mitmproxy_loop(rig), 10) == "error: ConnectionResetError"
    assert not rig.relay.active
