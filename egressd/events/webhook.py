"""``OPENSANDBOX_EGRESS_DENY_WEBHOOK``: a POST for every DNS name the policy denies (docs/reference/behaviour.md §15).

Semantics of the reference component (``components/egress/pkg/events``): the body is
``{"hostname","timestamp","source":"opensandbox-egress","sandboxId"}`` (hostname lower-cased
without the trailing dot, timestamp RFC 3339 UTC in seconds); each attempt has 5 s; 2xx ends
it, another status below 500 ends it without a retry, a 5xx or a transport error is retried
after 1 s, 2 s and 4 s; events wait in a queue of 128 that one worker drains in order, and an
event that does not fit is dropped (counted in ``egressd_deny_webhook_dropped_total``), so a
slow receiver never slows a DNS answer down. Redirects are not followed: the payload goes to
the configured address or nowhere.

The pure part (payload, retry schedule, URL check) is at the top; :class:`DenyWebhook` is the
thin aiohttp sender. The URL can carry a secret (a token in its query, user info), so it is
never logged: logs name the scheme, host and port only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime

import aiohttp
import structlog
from aiohttp.abc import AbstractResolver

from egressd.metrics import EgressMetrics

log = structlog.get_logger("egressd.webhook")

SOURCE = "opensandbox-egress"
ATTEMPT_TIMEOUT_S = 5.0
RETRY_DELAYS_S: tuple[float, ...] = (1.0, 2.0, 4.0)
QUEUE_SIZE = 128
_DROP_WARNINGS_PER_S = 1


class WebhookURLError(ValueError):
    """The configured URL cannot be posted to."""


def parse_webhook_url(text: str | None) -> str | None:
    """The URL to post to, or None when unset/blank; anything but an absolute http(s) URL with a
    host is refused (a start-up error: a webhook that can never be sent is not silently off)."""
    value = (text or "").strip()
    if not value:
        return None
    if any(c.isspace() for c in value):
        raise WebhookURLError("must not contain whitespace")
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise WebhookURLError("must be an http:// or https:// URL")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise WebhookURLError("has an invalid port") from None
    if not host:
        raise WebhookURLError("has no host")
    del port
    return value


def display_url(url: str) -> str:
    """``scheme://host[:port]``: what logs may say about the URL (no user info, path or query)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


def normalise_hostname(name: str) -> str:
    """The reference's form: lower case, no trailing dot."""
    return name.strip().rstrip(".").lower()


def timestamp(now: float) -> str:
    """RFC 3339, UTC, whole seconds (Go's ``time.RFC3339`` of a UTC time)."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def payload(
    hostname: str, when: float, sandbox_id: str, method: str | None = None, path: str | None = None
) -> bytes:
    """The POST body. Exactly these four keys: no credential, rule or address ever rides along."""
    doc = {"hostname": hostname, "timestamp": timestamp(when), "source": SOURCE, "sandboxId": sandbox_id}
    if method is not None:  # a refused request (docs/reference/behaviour.md §19)
        doc["method"] = method
        doc["path"] = path or "/"
    return json.dumps(doc, separators=(",", ":")).encode()


class Next(enum.StrEnum):
    DONE = "delivered"  # 2xx
    GIVE_UP = "rejected"  # another status below 500: the receiver said no, asking again won't help
    RETRY = "retry"  # 5xx or no answer at all


def after(status: int | None) -> Next:
    """What an attempt's outcome (an HTTP status, or None for a transport error/timeout) means."""
    if status is None or status >= 500:
        return Next.RETRY
    if 200 <= status < 300:
        return Next.DONE
    return Next.GIVE_UP


def marked_socket_factory(
    mark: int,
) -> Callable[[tuple[int, int, int, str, tuple[object, ...]]], socket.socket]:
    """Sockets with ``SO_MARK``: the sidecar's own traffic, exempt from its redirect and filter
    like the DNS forwarder's (the receiver is the operator's, not the sandbox's, destination)."""

    def factory(addr_info: tuple[int, int, int, str, tuple[object, ...]]) -> socket.socket:
        family, kind, proto = addr_info[0], addr_info[1], addr_info[2]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        except OSError:
            sock.close()
            raise
        return sock

    return factory


class DenyWebhook:
    """The bounded queue and its one worker. ``publish`` never waits and never raises."""

    def __init__(
        self,
        url: str,
        metrics: EgressMetrics | None = None,
        *,
        queue_size: int = QUEUE_SIZE,
        attempt_timeout: float = ATTEMPT_TIMEOUT_S,
        retry_delays: Sequence[float] = RETRY_DELAYS_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
        socket_mark: int | None = None,
        resolver: AbstractResolver | None = None,
    ) -> None:
        self.url = url
        self.metrics = metrics
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=queue_size)
        self._timeout = attempt_timeout
        self._delays = tuple(retry_delays)
        self._sleep = sleep
        self._clock = clock
        self._mark = socket_mark
        self._resolver = resolver
        self._session: aiohttp.ClientSession | None = None
        self._worker: asyncio.Task[None] | None = None
        self._warned_at = 0.0
        self.dropped = 0

    # ---- producer side (the DNS proxy, on the event loop) --------------------------------------

    def publish(
        self, hostname: str, sandbox_id: str, method: str | None = None, path: str | None = None
    ) -> bool:
        """Queue one event; False (counted, at most one warning a second) when the queue is full."""
        host = normalise_hostname(hostname)
        if not host:
            return False
        try:
            self._queue.put_nowait(payload(host, self._clock(), sandbox_id, method, path))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.metrics is not None:
                self.metrics.deny_webhook_dropped.inc()
            now = time.monotonic()
            if now - self._warned_at >= 1 / _DROP_WARNINGS_PER_S:
                self._warned_at = now
                log.warning("webhook.queue_full", webhook=display_url(self.url), dropped_total=self.dropped)
            return False
        return True

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    # ---- worker --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker (on the running loop)."""
        if self._worker is None:
            connector = aiohttp.TCPConnector(
                limit=2,
                resolver=self._resolver,
                socket_factory=marked_socket_factory(self._mark) if self._mark is not None else None,
            )
            self._session = aiohttp.ClientSession(connector=connector)
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop; events still queued are dropped (they describe denials that already happened)."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            body = await self._queue.get()
            try:
                outcome = await self.deliver(body)
            except Exception as exc:
                # The class only, no traceback: its text or locals could carry the URL.
                log.error("webhook.crashed", webhook=display_url(self.url), error=type(exc).__name__)
                outcome = "failed"
            if self.metrics is not None:
                self.metrics.deny_webhook_deliveries.inc(outcome)

    async def _attempt(self, body: bytes) -> tuple[int | None, str]:
        assert self._session is not None
        try:
            async with self._session.post(
                self.url,
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self._timeout),
                allow_redirects=False,
            ) as resp:
                return resp.status, ""
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # The class only: some aiohttp messages quote the URL, which may carry a secret.
            return None, type(exc).__name__

    async def deliver(self, body: bytes) -> str:
        """One event to its end: ``delivered``, ``rejected`` (non-retriable status) or ``failed``."""
        status: int | None = None
        error = ""
        for attempt in range(len(self._delays) + 1):
            status, error = await self._attempt(body)
            step = after(status)
            if step is Next.DONE:
                return str(step)
            if step is Next.GIVE_UP:
                log.warning("webhook.rejected", webhook=display_url(self.url), status=status)
                return str(step)
            if attempt < len(self._delays):
                await self._sleep(self._delays[attempt])
        log.warning(
            "webhook.failed",
            webhook=display_url(self.url),
            attempts=len(self._delays) + 1,
            status=status,
            error=error or None,
        )
        return "failed"
