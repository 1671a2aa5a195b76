"""Request bodies and plain-text answers, the same in both profiles' HTTP surfaces."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from egressd.actionhandler.envelope import MAX_BODY_BYTES
from egressd.web.serving import BodyIncomplete


class BodyTooLarge(Exception):
    pass


async def read_limited(request: web.Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """Read the body, refusing (before buffering it whole) anything over ``limit`` bytes.

    :class:`BodyIncomplete` if the client went away before the body was complete: nothing may
    be applied from a part of a body.
    """
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
    except BodyIncomplete:
        raise
    except ConnectionError as exc:  # aiohttp's "Connection lost" when the client reset/closed
        raise BodyIncomplete(str(exc)) from None
    return b"".join(chunks)


def incomplete() -> web.Response:
    """The answer to a body cut short (read only by a client that half-closed)."""
    return text(400, "request body incomplete; nothing applied", headers={"Connection": "close"})


def text(status: int, message: str, **kw: Any) -> web.Response:
    return web.Response(
        status=status, text=message.replace("\n", " ") + "\n", content_type="text/plain", **kw
    )
