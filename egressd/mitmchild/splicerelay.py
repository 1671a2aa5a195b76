"""Passed-through TLS moved in the kernel (issue 25 item 5): the upstream's bytes of an admitted,
relayed (not decrypted) TLS connection go to the client by splice(2) through a pipe, in a thread
per connection, instead of through mitmproxy's Python relay.

What stays as it was: the name check and every other decision (nothing here runs before
:class:`egressd.mitmchild.interception.Interception` let the connection through and mitmproxy
opened the upstream connection); the client's bytes (the ClientHello first) still go upstream
through mitmproxy; mitmproxy's hooks, half-close and teardown (this relay only stands in for the
upstream connection's reader: at the upstream's end of file its ``read`` says so, on an error
it raises ``OSError``, exactly what mitmproxy's read loop expects from a stream reader); the
relay watch's cut (``Interception.check_relayed`` stops the splice, then resets the client).

How it takes over, in order, so that no byte is lost or reordered: mitmproxy's ``server_connected``
hook (after the upstream socket opened, before mitmproxy reads it) swaps the connection's reader
for :class:`SpliceReader`. Its first ``read`` stops asyncio reading that socket (a holding
protocol keeps anything that still arrives), hands back what asyncio had already read, then
waits until mitmproxy has written everything it owed the client, and only then splices from
the upstream socket to the client's. Nothing else writes to the client meanwhile (a relayed
connection's client hears only its upstream).

It reaches into mitmproxy 12 in three places, checked by :func:`check` when the child starts
(and pinned by tests/unit/mitm/test_splicerelay.py): ``Proxyserver.connections`` by client id,
``ConnectionHandler.transports`` (``ConnectionIO.reader``/``writer``, read by its
``handle_connection`` after the ``server_connected`` hook) and the inactivity watchdog. When any
of them moved, or the connection is not a plain asyncio TCP stream, or too many relays run,
nothing is swapped: mitmproxy relays as before (never an unchecked connection: the swap happens
after every check, on a connection mitmproxy itself opened).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import inspect
import os
import select
import threading
from typing import Any, Final

from mitmproxy import connection, ctx
from mitmproxy.proxy import server, server_hooks
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.tls import ClientTLSLayer
from mitmproxy.version import VERSION as MITMPROXY_VERSION

from egressd.mitmchild.shared import emit

#: Pipe between the two sockets (F_SETPIPE_SZ; the default /proc/sys/fs/pipe-max-size).
PIPE_BYTES: Final = 1 << 20
#: Relays at once per child; beyond it mitmproxy relays (a thread, two pipes and two duplicate
#: descriptors each).
MAX_RELAYS: Final = 128
#: How often a moving relay tells mitmproxy's inactivity watchdog (seconds).
ACTIVITY_S: Final = 1.0
#: How often the take-over looks again whether mitmproxy's writes to the client are out.
DRAIN_POLL_S: Final = 0.002
_F_SETPIPE_SZ: Final = 1031
_FLAGS: Final = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK if hasattr(os, "splice") else 0


def outer_hello(context: Context) -> bool:
    """Is this ClientHello the client's outermost TLS (so its socket carries the upstream's
    bytes as they are)? A ClientTLSLayer is in ``context.layers`` from its construction, before
    its ClientHello hook; a second one is TLS inside a stream mitmproxy decrypts (or TLS to an
    HTTPS proxy), whose client socket carries the outer TLS that only mitmproxy may write."""
    return sum(isinstance(layer, ClientTLSLayer) for layer in context.layers) == 1


def check() -> str | None:
    """Why the kernel relay cannot run with this mitmproxy and Python (None: it can)."""
    if not hasattr(os, "splice"):
        return "no os.splice"
    if MITMPROXY_VERSION.split(".")[0] != "12":
        return f"mitmproxy {MITMPROXY_VERSION}"
    try:
        loop_src = inspect.getsource(server.ConnectionHandler.handle_connection)
        open_src = inspect.getsource(server.ConnectionHandler.open_connection)
    except (OSError, TypeError):
        return "mitmproxy's source is not readable"
    needed = (
        "reader = self.transports[connection].reader" in loop_src
        and "data = await reader.read(" in loop_src
        and "except OSError:" in loop_src
        and 0
        <= open_src.find("ServerConnectedHook")
        < open_src.rfind("self.handle_connection(command.connection)")
        and {"reader", "writer"} <= set(getattr(server.ConnectionIO, "__dataclass_fields__", {}))
        and callable(getattr(server.TimeoutWatchdog, "register_activity", None))
    )
    return None if needed else "mitmproxy's connection handler moved"


class _Hold(asyncio.Protocol):
    """The upstream socket's protocol once the relay took it: keeps what asyncio still reads
    (nothing, unless something resumed reading), passes write flow control and the end on."""

    def __init__(self, inner: asyncio.BaseProtocol, transport: asyncio.Transport) -> None:
        self.inner, self.transport = inner, transport
        self.data = bytearray()
        self.eof = False

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        return True  # the client's bytes may still go up (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _Splice:
    """``src`` -> pipe -> ``dst`` in a thread of its own (the GIL is free during each system call;
    an event-loop version cost twice the CPU per MiB, scripts/bench/relay_ceiling.py). ``done``
    (a future of the loop) is None at the source's end of file, once the pipe is empty, or the
    error; ``moved`` counts bytes. The descriptors are duplicates (the sockets stay asyncio's,
    non-blocking: the thread polls), all closed when it ends."""

    def __init__(self, src: int, dst: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.fds: list[int] = []
        self.moved = 0
        self.stopping: BaseException | None = None
        self.done: asyncio.Future[None] = self.loop.create_future()
        wake: list[int] = []
        try:
            self.src, self.dst = self._dup(src), self._dup(dst)
            self.r, self.w = self._pipe()
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.w, _F_SETPIPE_SZ, PIPE_BYTES)
            wake += os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # stop(): a byte
            self.wake_r, self.wake_w = wake
            threading.Thread(target=self._run, name="egressd-splice", daemon=True).start()  # last
        except Exception as exc:
            # Part way (EMFILE, no thread): no thread owns these yet, so they are closed here,
            # and the take-over fails as a reset (an OSError, which mitmproxy's read loop takes as
            # this connection's end) rather than leaking or leaving the connection half-owned.
            for fd in self.fds + wake:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise ConnectionResetError(f"kernel relay could not start: {exc!r}") from exc

    def _dup(self, fd: int) -> int:
        new = os.dup(fd)
        self.fds.append(new)
        return new

    def _pipe(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.fds += [r, w]
        return r, w

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            self._pump()
        except OSError as exc:
            error = exc
        except Exception as exc:  # never an end of file the upstream did not send
            error = ConnectionResetError(f"kernel relay failed: {exc!r}")
        finally:
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(RuntimeError):  # the loop is closed: the child is ending
                self.loop.call_soon_threadsafe(self._settle, error)

    def _pump(self) -> None:
        readable, writable = select.poll(), select.poll()
        readable.register(self.src, select.POLLIN)
        writable.register(self.dst, select.POLLOUT)
        for p in (readable, writable):
            p.register(self.wake_r, select.POLLIN)
        while self._wait(readable):
            try:
                n = os.splice(self.src, self.w, PIPE_BYTES, flags=_FLAGS)
            except BlockingIOError:
                continue
            if n == 0:
                return  # the upstream's end of file, everything before it passed on
            while n:
                try:
                    sent = os.splice(self.r, self.dst, n, flags=_FLAGS)
                except BlockingIOError:  # the client's socket is full
                    if not self._wait(writable):
                        return
                    continue
                n -= sent
                self.moved += sent

    def _wait(self, poller: select.poll) -> bool:
        """Until the socket is ready; False once stop() was called."""
        return all(fd != self.wake_r for fd, _ in poller.poll())

    def _settle(self, error: BaseException | None) -> None:
        os.close(self.wake_r)
        os.close(self.wake_w)
        error = self.stopping or error
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)

    def stop(self, error: BaseException) -> None:
        """End the thread (from the loop; idempotent): ``done`` then fails with ``error``."""
        if self.stopping is None and not self.done.done():
            self.stopping = error
            with contextlib.suppress(OSError):
                os.write(self.wake_w, b"x")


class SpliceReader:
    """Stands in for the upstream connection's stream reader in mitmproxy's read loop."""

    def __init__(self, relay: SpliceRelay, client: connection.Client, handler: Any, server_io: Any) -> None:
        self.relay, self.client, self.handler = relay, client, handler
        self.inner: asyncio.StreamReader = server_io.reader
        self.server_writer: asyncio.StreamWriter = server_io.writer
        self.client_writer: asyncio.StreamWriter = handler.transports[handler.client].writer
        self.hold: _Hold | None = None
        self.splice: _Splice | None = None
        self.ended = False
        relay.active[client.id] = self

    async def read(self, n: int = -1) -> bytes:
        if self.ended:
            return b""
        if self.hold is None:
            self._detach()
        data = await self.inner.read(n)  # what asyncio had read (end of file fed: never waits)
        if data:
            return data
        if held := self._held(n):
            return held
        if self.hold is not None and self.hold.eof:
            self._end()  # the upstream ended before the take-over: mitmproxy closes
            return b""
        try:
            await self._client_drained()
        except ConnectionResetError:
            self._end()  # its slot given back now, like the other failed take-overs
            raise
        if self.ended:
            raise ConnectionResetError("cut")
        if held := self._held(n):  # (nothing can arrive any more: reading stays paused)
            return held
        return await self._kernel()

    def _end(self) -> None:
        self.ended = True
        if self.relay.active.get(self.client.id) is self:
            del self.relay.active[self.client.id]

    def _detach(self) -> None:
        transport = self.server_writer.transport
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        self.hold = _Hold(transport.get_protocol(), transport)
        transport.set_protocol(self.hold)
        self.inner.feed_eof()  # its buffer is read out below, then it answers b"" at once

    def _held(self, n: int) -> bytes:
        assert self.hold is not None
        size = len(self.hold.data) if n < 0 else min(n, len(self.hold.data))
        out = bytes(self.hold.data[:size])
        del self.hold.data[:size]
        return out

    async def _client_drained(self) -> None:
        """Until mitmproxy's writes to the client are out of asyncio's buffer (bounded by the
        client: a client that reads nothing holds its relay, as it would mitmproxy's)."""
        transport = self.client_writer.transport
        while transport.get_write_buffer_size() and not transport.is_closing():
            await asyncio.sleep(DRAIN_POLL_S)
        if transport.is_closing():
            raise ConnectionResetError("client gone before the kernel relay started")

    async def _kernel(self) -> bytes:
        src = self.server_writer.get_extra_info("socket")
        dst = self.client_writer.get_extra_info("socket")
        if src is None or dst is None:
            self._end()  # the read loop ends here: give the relay slot back now
            raise ConnectionResetError("no socket")
        try:
            splice = self.splice = _Splice(src.fileno(), dst.fileno())
        except BaseException:
            self._end()  # nothing runs: give the slot back now (the finally below is not reached)
            raise
        self.relay.kernel += 1
        seen = 0
        try:
            while not splice.done.done():
                await asyncio.wait([splice.done], timeout=ACTIVITY_S)
                if splice.moved != seen:  # bytes moved: not idle for mitmproxy's watchdog
                    seen = splice.moved
                    self.handler.timeout_watchdog.register_activity()
            splice.done.result()
        finally:
            splice.stop(ConnectionResetError("relay ended"))
            self._end()
        return b""  # the upstream's end of file: mitmproxy half-closes the client

    def cut(self) -> None:
        """The relay watch resets this connection (or its client went): stop moving bytes now."""
        self._end()
        if self.splice is not None:
            self.splice.stop(ConnectionResetError("cut"))


class SpliceRelay:
    """Option ``egressd_kernel_relay``; hook ``server_connected``: swaps in :class:`SpliceReader`
    for the clients :meth:`want` named (admitted TLS relayed unopened)."""

    def __init__(self) -> None:
        self.enabled = True
        self.unusable = check()
        self.wanted: set[str] = set()
        self.active: dict[str, SpliceReader] = {}
        self.swapped = 0  # upstream readers swapped (tests, diagnostics)
        self.kernel = 0  # of which reached the kernel phase

    def load(self, loader: Any) -> None:
        loader.add_option(
            "egressd_kernel_relay", bool, True, "relay passed-through TLS from the upstream by splice(2)"
        )

    def configure(self, updated: set[str]) -> None:
        if "egressd_kernel_relay" in updated:
            self.enabled = ctx.options.egressd_kernel_relay
            if self.enabled and self.unusable:
                emit("mitm.kernel_relay", enabled=False, why=self.unusable)

    def want(self, client: connection.Client) -> None:
        if self.enabled and self.unusable is None and len(self.active) < MAX_RELAYS:
            self.wanted.add(client.id)

    def forget(self, client: connection.Client) -> None:
        """``client`` is gone (NameGate's client_disconnected)."""
        self.wanted.discard(client.id)
        self.cut(client)

    def cut(self, client: connection.Client) -> None:
        relay = self.active.get(client.id)
        if relay is not None:
            relay.cut()

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        if data.client.id not in self.wanted:
            return
        self.wanted.discard(data.client.id)
        # Again at the take-over: a burst of ClientHellos is all wanted before any relay is
        # active, and the option may have changed since. Over the limit, mitmproxy relays it.
        if not self.enabled or self.unusable is not None or len(self.active) >= MAX_RELAYS:
            return
        proxy = ctx.master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
        handler = getattr(proxy, "connections", {}).get(data.client.id)
        transports = getattr(handler, "transports", None)
        if not isinstance(transports, dict) or data.server.transport_protocol != "tcp":
            return
        server_io, client_io = transports.get(data.server), transports.get(data.client)
        if not all(
            isinstance(getattr(io, "reader", None), asyncio.StreamReader)
            and isinstance(getattr(io, "writer", None), asyncio.StreamWriter)
            for io in (server_io, client_io)
        ):
            return
        assert server_io is not None
        server_io.reader = SpliceReader(self, data.client, handler, server_io)
        self.swapped += 1
