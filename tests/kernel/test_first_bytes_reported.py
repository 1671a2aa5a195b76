"""Refusals the MITM makes from a connection's first bytes alone (docs/reference/behaviour.md §18,
"connections that carry no name"): a ClientHello in a record version mitmproxy does not read,
a request line only a lenient server reads, either after a silence. No name was asked about,
yet each is a refusal like any other: counted in the subject's drop counter, logged as
``mitm.name_refused`` with its reason and posted to the deny webhook. Real packets through the
real MITM in the CDN-shaped topology of tests/kernel/cdn.py; each test fails when the MITM only
resets the connection and egressd never hears of it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    Webhook,
    allow,
    bind_subject,
    cdn_topology,
    deny,
    dropped,
    learn,
    mark,
    mitm_env,
    mitm_fleet,
    policy,
    requests,
    wait_refusal,
)
from tests.kernel.rawtcp import ECHO_PORT, raw, start_raw_server
from tests.kernel.topology import Daemon, Topology, envelope

HTTP_PORT = 18573
WEBHOOK_PORT = 18574

#: A TLS record header in version 03 04, then bytes: OpenSSL reads it, mitmproxy calls it not TLS.
ODD_TLS = "\\x16\\x03\\x04\\x00\\x2a\\x01\\x00\\x00\\x26\\x03\\x03" + "\\x00" * 32
LENIENT_HTTP = " GET / HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n"


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egf{os.getpid()}", sandboxes=1, http_ports="80,8081", https_ports="443,8443")
    try:
        start_raw_server(t)
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def hook(cdn: Topology) -> Iterator[Webhook]:
    w = Webhook(cdn, cdn.pod, "127.0.0.1", WEBHOOK_PORT, "firstbytes")
    yield w
    cdn.stop(w.proc)


@pytest.fixture(scope="module")
def fleet(cdn: Topology, hook: Webhook) -> Iterator[Daemon]:
    env = {**mitm_env(cdn, "firstbytes"), "OPENSANDBOX_EGRESS_DENY_WEBHOOK": hook.url}
    with mitm_fleet(cdn, "egt-firstbytes", HTTP_PORT, env) as d:
        yield d


def posts_for(hook: Webhook, sandbox: str) -> int:
    return sum(1 for p in hook.posts() if p.get("sandboxId") == sandbox and p.get("hostname") == CDN_IP)


def assert_reported(
    fleet: Daemon, hook: Webhook, uid: str, port: int, reason: str, log_at: int, drops: int
) -> None:
    event = wait_refusal(fleet.log_text, log_at, subject=f"s-{uid}", reason=reason, port=port)
    assert (event["dst"], event["rule"], event["name"]) == (CDN_IP, "first-bytes", None), event
    assert dropped(fleet, f"s-{uid}") >= drops + 1
    deadline = time.monotonic() + 10
    while posts_for(hook, uid) == 0:
        assert time.monotonic() < deadline, hook.posts()
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("port", "send", "reason"),
    [
        pytest.param(443, ODD_TLS, "no_sni", id="odd-tls-record-443"),
        pytest.param(80, LENIENT_HTTP, "host_not_allowed", id="lenient-request-line-80"),
    ],
)
def test_a_first_bytes_refusal_is_counted_logged_and_posted(
    cdn: Topology, fleet: Daemon, hook: Webhook, port: int, send: str, reason: str
) -> None:
    uid = f"fb{port}"
    bind_subject(fleet, 1, uid, policy(deny("b.cdn.test"), default="allow"))
    try:
        drops, log_at, since = dropped(fleet, f"s-{uid}"), len(fleet.log_text()), mark(cdn)
        out = raw(cdn, port, send=send, read_s=1.5)
        assert "200 OK" not in out["got"], out
        assert requests(cdn, since) == []
        assert_reported(fleet, hook, uid, port, reason, log_at, drops)
    finally:
        fleet.post(envelope("REMOVE_BINDING", uid))


@pytest.mark.parametrize(
    ("send", "reason"),
    [
        pytest.param(ODD_TLS, "no_sni", id="odd-tls-record"),
        pytest.param(LENIENT_HTTP, "host_not_allowed", id="lenient-request-line"),
    ],
)
def test_a_first_bytes_refusal_after_a_silence_is_counted_logged_and_posted(
    cdn: Topology, fleet: Daemon, hook: Webhook, send: str, reason: str
) -> None:
    """On a named port other than 80/443 a silent client is admitted without a name, then its
    bytes are looked at (firstbytes.after_silence): a refusal there is reported too."""
    uid = f"fbs{reason[:4]}"
    bind_subject(fleet, 1, uid, policy(allow("a.cdn.test", ports=["8000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        drops, log_at = dropped(fleet, f"s-{uid}"), len(fleet.log_text())
        out = raw(cdn, 8081, wait=1.2, send=send, read_s=1.5)
        assert "200 OK" not in out["got"], out
        assert_reported(fleet, hook, uid, 8081, reason, log_at, drops)
    finally:
        fleet.post(envelope("REMOVE_BINDING", uid))


def test_an_admitted_nameless_relay_is_not_reported(cdn: Topology, fleet: Daemon, hook: Webhook) -> None:
    """The control: bytes that carry no name on a port an any-protocol lease opens pass, and
    nothing is counted or posted for them."""
    uid = "fbok"
    bind_subject(fleet, 1, uid, policy(allow("a.cdn.test", ports=["2000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        drops, posts = dropped(fleet, f"s-{uid}"), posts_for(hook, uid)
        out = raw(cdn, ECHO_PORT, send="\\x00\\x01binary\\n", read_s=1.5)
        assert "binary" in out["got"], out
        assert dropped(fleet, f"s-{uid}") == drops
        assert posts_for(hook, uid) == posts
    finally:
        fleet.post(envelope("REMOVE_BINDING", uid))
