"""Two things mitmproxy 12 lacks on the streamed response path, added to the MITM child.

1. **Aborting a streamed response.** mitmproxy cannot kill a flow in transit (its issue #4711):
   once a response streams, ``flow.kill()`` is only noticed after the body ended. A body that
   cannot be passed on (a decompression bomb, a corrupt coding: :class:`egressd.mitmchild.respbody.BodyFilter`
   sets ``failed``) must end now, not after the upstream finished sending whatever it wants:
   after each chunk, a failed filter resets the stream on both sides, as mitmproxy does itself
   for a body over ``body_size_limit``. Empty data events in the middle of a stream (an empty
   HTTP/2 DATA frame) are not handed to the callable, for which ``b""`` means "the end".

2. **Backpressure from an HTTP/2 client.** mitmproxy reads the next upstream chunk once its
   socket writers have drained, but data an HTTP/2 client has no flow-control window for is
   queued inside the connection object (``BufferedH2Connection.stream_buffers``), not in a
   writer, so a client that stops granting window (or grants it slowly) made the MITM read the
   whole upstream body into memory. Now an upstream connection's read loop also waits while
   the client's HTTP/2 queue holds more than :data:`H2_QUEUE_HIGH` bytes; the client's own read
   loop (which brings the window updates) never waits for it.

:func:`install` is called once by the child's runner before the proxy starts; it checks that
the mitmproxy internals it wraps are where it expects them (a mitmproxy upgrade that moved
them fails the child's start, it does not silently lose the protection).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Generator
from typing import Any, Final

from mitmproxy import flow as mflow
from mitmproxy.connection import Connection
from mitmproxy.proxy import server
from mitmproxy.proxy.layers import http as mhttp
from mitmproxy.proxy.layers.http import _http2, _http_h2
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    RequestProtocolError,
    ResponseData,
    ResponseProtocolError,
)
from mitmproxy.proxy.layers.http._hooks import HttpErrorHook

#: Bytes an HTTP/2 client may have queued for it in the MITM before upstream reads pause.
H2_QUEUE_HIGH: Final = 1 << 20
#: How often a paused upstream read loop looks at the queue again.
H2_POLL_S: Final = 0.005
ABORT_MESSAGE: Final = "response body refused by egressd"

_client_h2: weakref.WeakKeyDictionary[Connection, _http_h2.BufferedH2Connection] = weakref.WeakKeyDictionary()
_installed = False


def _failed(stream: object) -> str | None:
    reason = getattr(stream, "failed", None)
    return reason if isinstance(reason, str) else None


def _wrap_stream_response_body(
    original: Callable[[Any, Any], Generator[Any, Any, None]],
) -> Callable[[Any, Any], Generator[Any, Any, None]]:
    def state_stream_response_body(self: Any, event: Any) -> Generator[Any, Any, None]:
        if isinstance(event, ResponseData) and not event.data:
            return  # b"" means "the end" to the stream callable
        yield from original(self, event)
        reason = _failed(self.flow.response.stream) if self.flow.response is not None else None
        if reason is None or not isinstance(event, ResponseData):
            return  # at the end the addon's response hook kills the flow instead
        self.flow.error = mflow.Error(f"{ABORT_MESSAGE}: {reason}")
        yield HttpErrorHook(self.flow)
        yield mhttp.SendHttp(
            ResponseProtocolError(self.stream_id, ABORT_MESSAGE, ErrorCode.KILL), self.context.client
        )
        yield mhttp.SendHttp(
            RequestProtocolError(self.stream_id, ABORT_MESSAGE, ErrorCode.KILL), self.context.server
        )
        self.client_state = self.server_state = self.state_errored
        self.flow.live = False
        yield mhttp.DropStream(self.stream_id)

    state_stream_response_body.__wrapped__ = original  # type: ignore[attr-defined]
    return state_stream_response_body


def queued(h2: _http_h2.BufferedH2Connection) -> int:
    """Bytes waiting in ``h2`` for the peer's flow-control window."""
    return sum(len(item.data) for q in h2.stream_buffers.values() for item in q)


def _wrap_h2_server_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, context: Any) -> None:
        original(self, context)
        _client_h2[context.client] = self.h2_conn

    return __init__


def _wrap_drain_writers(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    async def drain_writers(self: Any) -> None:
        await original(self)
        h2 = _client_h2.get(self.client)
        if h2 is None:
            return
        client_io = self.transports.get(self.client)
        if client_io is None or client_io.handler is asyncio.current_task():
            return  # the client's own loop: it reads the window updates, it must not wait
        while queued(h2) > H2_QUEUE_HIGH and self.client in self.transports:
            await asyncio.sleep(H2_POLL_S)

    return drain_writers


def install() -> None:
    """Wrap the three mitmproxy internals (once per process)."""
    global _installed
    if _installed:
        return
    stream = mhttp.HttpStream.state_stream_response_body
    h2_init = _http2.Http2Server.__init__
    drain = server.ConnectionHandler.drain_writers
    if not (callable(stream) and callable(h2_init) and asyncio.iscoroutinefunction(drain)):
        raise RuntimeError("mitmproxy internals moved: streamed-response guards cannot be installed")
    if not hasattr(_http_h2.BufferedH2Connection, "stream_buffers") and "stream_buffers" not in getattr(
        _http_h2.BufferedH2Connection, "__annotations__", {}
    ):
        raise RuntimeError("mitmproxy internals moved: no HTTP/2 send queue")
    mhttp.HttpStream.state_stream_response_body = _wrap_stream_response_body(stream)  # type: ignore[method-assign]
    _http2.Http2Server.__init__ = _wrap_h2_server_init(h2_init)  # type: ignore[method-assign]
    server.ConnectionHandler.drain_writers = _wrap_drain_writers(drain)  # type: ignore[method-assign]
    _installed = True
