"""What both profiles' shells do the same way: bind the HTTP API, wait for SIGTERM/SIGINT, and
carry every mutating request to its end whatever its client does (docs/reference/behaviour.md §14.10)."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from egressd.feed import ApiWrite, Feed
from egressd.kernel.listeners import NO_IPV6, bound_socket

log = structlog.get_logger("egressd.http")

T = TypeVar("T")

# Bounded wait, on shutdown, for actions whose body was read. A kernel step takes
# milliseconds; this only has to outlast a slow one, not a hung one.
DRAIN_TIMEOUT = 10.0


class ListenError(Exception):
    """One-line reason the HTTP listener could not be bound."""


class BodyIncomplete(ConnectionResetError):
    """The client went away (half-close, close, reset) before its request body was complete."""


class _HalfCloseHandler(RequestHandler):
    """aiohttp's handler, except that a client's FIN does not close the connection under a
    request that is being served.

    asyncio closes the transport when ``eof_received`` returns a false value, which aiohttp's
    does: a client that sends its action and then ``shutdown(SHUT_WR)`` (a legitimate HTTP/1.1
    client, still reading) would never see the reply. Here, with a request in progress or
    queued, the write half stays open: the reply is written, then the connection closes
    (nothing can follow a FIN). A body that the FIN cut short fails its reader with
    :class:`BodyIncomplete`, so the handler applies nothing. An idle connection closes as before.
    Requests pipelined behind the one in progress are neither answered nor applied (the
    connection closes after the first reply): the client sees no reply and retries them.
    """

    # asyncio.Protocol.eof_received returns bool | None (True = keep the transport open);
    # aiohttp annotates its override as None because it never keeps it.
    def eof_received(self) -> bool | None:  # type: ignore[override]
        queued = [payload for _, payload in self._messages]
        request = self._current_request
        if not self._request_in_progress and not queued:
            return None
        self.close()  # answer what is in progress, then close
        payloads = [request.content] if request is not None else []
        for payload in [*payloads, *queued]:
            if not payload.is_eof():
                payload.set_exception(BodyIncomplete("client closed before the request body was complete"))
        return True


class _HalfCloseServer(Server):
    def __call__(self) -> RequestHandler:
        return _HalfCloseHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        # Same object, same configuration; only the protocol it makes per connection differs.
        server.__class__ = _HalfCloseServer
        return server


def make_runner(app: web.Application) -> web.AppRunner:
    # handler_cancellation stays off (aiohttp's default, pinned here): a disconnect must not
    # cancel a handler. The actions are shielded anyway (InFlight), this keeps the rest of a
    # handler (metrics, logs) running too.
    # shutdown_timeout bounds aiohttp's own wait for handlers still connected; InFlight.drain
    # (on_shutdown, before it) bounds the wait for the actions of clients that left.
    return _Runner(
        app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=False,
        shutdown_timeout=DRAIN_TIMEOUT,
    )


async def start_http(app: web.Application, host: str, port: int, *, mark: int | None = None) -> web.AppRunner:
    """The running site's runner (the caller cleans it up); :class:`ListenError` if the address
    cannot be bound (nothing is left running then). ``mark``: the listener's SO_MARK (the fleet
    marks its sockets as egressd's own, docs/reference/behaviour.md §20.1)."""
    runner = make_runner(app)
    await runner.setup()
    socks: list[socket.socket] = []
    try:
        for h in ("127.0.0.1", "::1") if host == "localhost" else (host,):
            try:
                socks.append(bound_socket(h, port, socket.SOCK_STREAM, mark=mark, backlog=128))
            except OSError as exc:
                if not (host == "localhost" and ":" in h and exc.errno in NO_IPV6):
                    raise
        for sock in socks:
            await web.SockSite(runner, sock).start()
    except OSError as exc:
        for sock in socks:
            sock.close()
        await runner.cleanup()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return runner


class InFlight:
    """Mutations whose request body was read, run to their end whatever the client does.

    Each runs in its own task, kept here (so it is neither garbage-collected nor lost when its
    handler is cancelled by a disconnect or by aiohttp's shutdown) and awaited through
    ``asyncio.shield``: the state is committed, or its failure plan committed, never left in
    between. :meth:`attach` makes the application's shutdown wait for them (bounded).
    """

    def __init__(self, drain_timeout: float = DRAIN_TIMEOUT, *, feed: Feed | None = None) -> None:
        self.feed = feed if feed is not None else Feed()  # where a late end is announced
        self._tasks: set[asyncio.Task[Any]] = set()
        self._orphans: set[asyncio.Task[Any]] = set()  # their handler was cancelled
        self.drain_timeout = drain_timeout

    def __len__(self) -> int:
        return len(self._tasks)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        task: asyncio.Task[T] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        # A cancelled handler stops waiting here; the task itself goes on.
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._orphans.add(task)
            raise

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task in self._orphans:
            # It ended after its handler (and the write middleware's bump) was gone: what it
            # changed must void the MITM's memory too (docs/reference/behaviour.md §10, "answered from memory").
            self._orphans.discard(task)
            self.feed.publish(ApiWrite())
        # The mutations catch their own errors; one that escapes is a bug, and with its
        # handler gone (shield marks the exception retrieved) nobody else would see it.
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("action.task_failed", error=type(exc).__name__, exc_info=exc)

    async def drain(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout``) for the running mutations; the number still unfinished."""
        if not self._tasks:
            return 0
        _, pending = await asyncio.wait(
            set(self._tasks), timeout=self.drain_timeout if timeout is None else timeout
        )
        if pending:
            log.error("shutdown.actions_unfinished", count=len(pending))
        return len(pending)

    def attach(self, app: web.Application) -> None:
        # on_shutdown runs after the listener is closed (no new action can start) and before
        # the daemon closes its kernel connection.
        async def _drain(_: web.Application) -> None:
            await self.drain()

        app.on_shutdown.append(_drain)


async def wait_for_stop(stop: asyncio.Event | None = None) -> None:
    """Until ``stop`` is set, or SIGTERM/SIGINT arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
