"""Every write through the HTTP API may have narrowed something: the API's writes are an owner
of state that publishes to the change feed (:mod:`egressd.feed`), both profiles' servers
install :func:`after_writes` (docs/reference/behaviour.md §10, "answered from memory")."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from egressd.feed import ApiWrite, Feed

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_READS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_UNTOUCHED: Final = "egressd.seqmap.untouched"


def refused_untouched(request: web.Request) -> None:
    """Mark a request refused before any handler could change state (a wrong token, a body
    that was never read in full): :func:`after_writes` does not void the memory for it, so a
    tenant's flood of refused writes does not turn every memory answer into a pull. Call it
    only on a return path that changed nothing."""
    request[_UNTOUCHED] = True


def _untouched(request: web.Request) -> bool:
    # A path or method no route has (404/405 from the router) never reached a handler.
    return request.get(_UNTOUCHED) is True or request.match_info.http_exception is not None


def after_writes(feed: Feed) -> Middleware:
    """The middleware that publishes every write's end to ``feed``."""

    @web.middleware
    async def after_write(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every write through the HTTP API may have narrowed something (a vault, a policy, a
        binding): the MITM's memory of every client is void before its caller hears back. Also
        when the handler failed half-way; coarse, and never less safe than the exact slots. Not
        for a request refused before any handler ran (:func:`refused_untouched`, routing errors)."""
        try:
            return await handler(request)
        finally:
            if request.method not in _READS and not _untouched(request):
                feed.publish(ApiWrite())

    return after_write
