"""OPENSANDBOX_EGRESS_DENY_WEBHOOK (docs/reference/behaviour.md §15): the pure payload / retry rules, and the
sender against a real aiohttp receiver on 127.0.0.1 (retry waits are recorded, not slept)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from egressd.config import ConfigError, parse_config
from egressd.events.webhook import (
    RETRY_DELAYS_S,
    SOURCE,
    DenyWebhook,
    Next,
    WebhookURLError,
    after,
    display_url,
    normalise_hostname,
    parse_webhook_url,
    payload,
    timestamp,
)
from egressd.metrics import EgressMetrics

# ---------------------------------------------------------------- pure part


def test_payload_is_exactly_the_reference_document() -> None:
    doc = json.loads(payload("evil.test", 1767225600.9, "u-1"))
    assert doc == {
        "hostname": "evil.test",
        "timestamp": "2026-01-01T00:00:00Z",
        "source": "opensandbox-egress",
        "sandboxId": "u-1",
    }
    assert SOURCE == "opensandbox-egress"
    assert json.loads(payload("x.test", 0, ""))["sandboxId"] == ""


def test_timestamp_is_rfc3339_utc_seconds() -> None:
    assert timestamp(0) == "1970-01-01T00:00:00Z"
    assert timestamp(1_700_000_000.999) == "2023-11-14T22:13:20Z"


@pytest.mark.parametrize(
    ("name", "expected"), [("Evil.Test.", "evil.test"), ("a.b", "a.b"), (".", ""), (" X. ", "x")]
)
def test_hostname_normalisation(name: str, expected: str) -> None:
    assert normalise_hostname(name) == expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (None, Next.RETRY),
        (500, Next.RETRY),
        (503, Next.RETRY),
        (599, Next.RETRY),
        (200, Next.DONE),
        (204, Next.DONE),
        (299, Next.DONE),
        (301, Next.GIVE_UP),
        (400, Next.GIVE_UP),
        (404, Next.GIVE_UP),
        (429, Next.GIVE_UP),
        (499, Next.GIVE_UP),
    ],
)
def test_retry_rules(status: int | None, expected: Next) -> None:
    assert after(status) is expected


def test_retry_schedule_is_one_two_four_seconds() -> None:
    assert RETRY_DELAYS_S == (1.0, 2.0, 4.0)


@pytest.mark.parametrize(
    "url", ["http://hooks.test/x", "https://10.0.0.1:8443/deny?t=1", "http://[fd00::1]:80/", "https://u:p@h/"]
)
def test_valid_urls(url: str) -> None:
    assert parse_webhook_url(f"  {url} ") == url


@pytest.mark.parametrize("url", ["ftp://h/", "hooks.test/x", "http://", "http://h:99999/", "http://a b/"])
def test_invalid_urls_are_refused(url: str) -> None:
    with pytest.raises(WebhookURLError):
        parse_webhook_url(url)


def test_unset_is_off() -> None:
    assert parse_webhook_url(None) is None
    assert parse_webhook_url("  ") is None


def test_display_url_hides_user_info_path_and_query() -> None:
    assert display_url("https://user:secret@hooks.test:8443/p/x?token=abc") == "https://hooks.test:8443"
    assert display_url("http://[fd00::1]/x") == "http://[fd00::1]"


def test_config_refuses_a_bad_url_in_one_line_and_never_shows_the_url() -> None:
    env = {"OPENSANDBOX_EGRESS_PROFILE": "fleet"}
    with pytest.raises(ConfigError) as err:
        parse_config({**env, "OPENSANDBOX_EGRESS_DENY_WEBHOOK": "ftp://u:secret@h/"})
    assert str(err.value).startswith("OPENSANDBOX_EGRESS_DENY_WEBHOOK: ")
    assert "secret" not in str(err.value)
    cfg = parse_config({**env, "OPENSANDBOX_EGRESS_DENY_WEBHOOK": "https://u:secret@h/x"})
    assert cfg.common.deny_webhook == "https://u:secret@h/x"
    assert "secret" not in repr(cfg)
    assert cfg.kernel.deny_reject is False and cfg.common.sandbox_id is None  # unset (main: None; the webhook still sends "")
    cfg = parse_config({**env, "OPENSANDBOX_EGRESS_DENY_WEBHOOK": "", "EGRESSD_DENY_REJECT": "1"})
    assert cfg.common.deny_webhook is None and cfg.kernel.deny_reject is True
    assert parse_config({**env, "OPENSANDBOX_EGRESS_SANDBOX_ID": " sb-7 "}).common.sandbox_id == "sb-7"
    with pytest.raises(ConfigError):
        parse_config({**env, "EGRESSD_DENY_REJECT": "maybe"})


# ---------------------------------------------------------------- the sender, real receiver


@dataclass
class Receiver:
    """An aiohttp app answering each POST with the next status of ``statuses`` (then 200)."""

    statuses: list[int] = field(default_factory=list)
    delay: float = 0.0
    bodies: list[dict[str, str]] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(json.loads(await request.read()))
        self.content_types.append(request.headers.get("Content-Type", ""))
        self.arrived.set()
        if self.delay:
            await asyncio.sleep(self.delay)
        status = self.statuses.pop(0) if self.statuses else 200
        return web.Response(status=status, text="x")


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/deny", rec.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    rec.url = f"http://127.0.0.1:{port}/deny?token=very-secret"
    try:
        yield rec
    finally:
        await runner.cleanup()


class Sleeps:
    """Records the retry waits instead of sleeping them."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_5xx_is_retried_until_200(receiver: Receiver) -> None:
    receiver.statuses = [500, 503]
    sleeps = Sleeps()
    metrics = EgressMetrics()
    hook = DenyWebhook(receiver.url, metrics, sleep=sleeps, clock=lambda: 1767225600.0)
    hook.start()
    try:
        assert hook.publish("Evil.Test.", "u-1")
        await wait_for(lambda: metrics.deny_webhook_deliveries.value("delivered") == 1)
    finally:
        await hook.close()
    expected = {
        "hostname": "evil.test",
        "timestamp": "2026-01-01T00:00:00Z",
        "source": "opensandbox-egress",
        "sandboxId": "u-1",
    }
    assert receiver.bodies == [expected] * 3  # the same event, three attempts
    assert receiver.content_types == ["application/json"] * 3
    assert sleeps.waits == [1.0, 2.0]


async def test_4xx_is_not_retried(receiver: Receiver) -> None:
    receiver.statuses = [400]
    sleeps = Sleeps()
    metrics = EgressMetrics()
    hook = DenyWebhook(receiver.url, metrics, sleep=sleeps)
    hook.start()
    try:
        with capture_logs() as logs:
            hook.publish("a.test", "u-1")
            await wait_for(lambda: metrics.deny_webhook_deliveries.value("rejected") == 1)
    finally:
        await hook.close()
    assert len(receiver.bodies) == 1
    assert sleeps.waits == []
    # The URL's query (a token) is never logged; scheme, host and port are.
    assert "very-secret" not in repr(logs)
    assert [e["status"] for e in logs if e["event"] == "webhook.rejected"] == [400]


async def test_transport_errors_are_retried_three_times_then_given_up() -> None:
    sleeps = Sleeps()
    metrics = EgressMetrics()
    hook = DenyWebhook(f"http://127.0.0.1:{closed_port()}/x?token=very-secret", metrics, sleep=sleeps)
    hook.start()
    try:
        with capture_logs() as logs:
            hook.publish("a.test", "u-1")
            await wait_for(lambda: metrics.deny_webhook_deliveries.value("failed") == 1)
    finally:
        await hook.close()
    assert sleeps.waits == [1.0, 2.0, 4.0]
    failed = [e for e in logs if e["event"] == "webhook.failed"]
    assert failed and failed[0]["attempts"] == 4 and failed[0]["error"]
    assert "very-secret" not in repr(logs)


async def test_an_attempt_that_outlives_its_timeout_is_retried(receiver: Receiver) -> None:
    receiver.delay = 0.5
    sleeps = Sleeps()
    metrics = EgressMetrics()
    hook = DenyWebhook(receiver.url, metrics, sleep=sleeps, attempt_timeout=0.1, retry_delays=(0.0,))
    hook.start()
    try:
        hook.publish("a.test", "u-1")
        await wait_for(lambda: metrics.deny_webhook_deliveries.value("failed") == 1)
    finally:
        await hook.close()
    assert len(receiver.bodies) == 2
    assert sleeps.waits == [0.0]


async def test_a_full_queue_drops_and_counts_and_never_waits(receiver: Receiver) -> None:
    receiver.delay = 1.0  # a slow receiver: the worker is stuck on the first event
    metrics = EgressMetrics()
    hook = DenyWebhook(receiver.url, metrics, queue_size=4, sleep=Sleeps())
    hook.start()
    try:
        assert hook.publish("first.test", "u-1")
        await asyncio.wait_for(receiver.arrived.wait(), 5)  # taken off the queue, being posted
        start = time.perf_counter()
        results = [hook.publish(f"n{i}.test", "u-1") for i in range(10)]
        elapsed = time.perf_counter() - start
    finally:
        await hook.close()
    assert results == [True] * 4 + [False] * 6
    assert metrics.deny_webhook_dropped.value() == 6
    assert hook.dropped == 6
    assert elapsed < 0.05  # publish never waits for the receiver
    assert "egressd_deny_webhook_dropped_total 6" in metrics.render()


async def test_events_are_delivered_in_order(receiver: Receiver) -> None:
    metrics = EgressMetrics()
    hook = DenyWebhook(receiver.url, metrics, sleep=Sleeps())
    hook.start()
    try:
        for i in range(5):
            hook.publish(f"n{i}.test", f"u-{i}")
        await wait_for(lambda: metrics.deny_webhook_deliveries.value("delivered") == 5)
    finally:
        await hook.close()
    assert [(b["hostname"], b["sandboxId"]) for b in receiver.bodies] == [
        (f"n{i}.test", f"u-{i}") for i in range(5)
    ]


def test_an_empty_name_is_not_published() -> None:
    hook = DenyWebhook("http://127.0.0.1:1/x")
    assert not hook.publish(".", "u-1")
    assert hook.pending == 0
