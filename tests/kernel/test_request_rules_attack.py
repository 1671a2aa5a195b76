"""Request rules (docs/reference/behaviour.md §19) against an attacker who knows how the judge
reads a request and how an upstream reads it, in the CDN-shaped topology (tests/kernel/cdn.py):
the upstream records the request line as a lenient HTTP/1 server reads it (method = first word,
path = second word), so a request the rules refuse must leave no record there.

Each test is a hole that was open: the judge read one request, the upstream another.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import XIO_IP, Webhook, allow, cdn_topology, deny, learn, mark, mitm_env, policy
from tests.kernel.test_request_rules import VECTOR, bind, h2, raw, req, statuses, upstream_paths
from tests.kernel.topology import Daemon, Topology, envelope

HTTP_PORT, WEBHOOK_PORT = 18560, 18561


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"ega{os.getpid()}", sandboxes=1)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def fleet(cdn: Topology) -> Iterator[Daemon]:
    hook = Webhook(cdn, cdn.pod, "127.0.0.1", WEBHOOK_PORT, "atk")
    env = {**mitm_env(cdn, "req"), "OPENSANDBOX_EGRESS_DENY_WEBHOOK": hook.url}
    d = Daemon(cdn, table="egt-atk", port=HTTP_PORT, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            cdn.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        cdn.stop(hook.proc)
        print(d.log_text()[-6000:])


@pytest.fixture
def subject(cdn: Topology, fleet: Daemon) -> Iterator[str]:
    yield "atk1"
    fleet.post(envelope("REMOVE_BINDING", "atk1"))


def use(cdn: Topology, fleet: Daemon, pol: object) -> None:
    bind(fleet, 1, "atk1", pol)
    learn(cdn, 1, "api.x.io", XIO_IP)


def test_a_fragment_in_the_request_target_is_refused(cdn: Topology, fleet: Daemon, subject: str) -> None:
    """The judge dropped everything from ``#`` (as a fragment), mitmproxy forwarded it: a server
    that keeps ``#`` in the path and removes dot segments (Go's path.Clean, many routers) reads
    ``/repos/#/../../user`` as ``/user``."""
    use(cdn, fleet, policy(*VECTOR))
    since = mark(cdn)
    for target in ("/repos/#/../../user", "/repos/x#/../../user", "https://api.x.io/repos/#/../../user"):
        out = raw(cdn, 1, req("GET", target))
        assert out["ok"] and statuses(out) in ([403], [400]), (target, out)
    out = h2(cdn, 1, [("GET", "/repos/#/../../user")])
    assert statuses(out) in ([403], [400]), out
    assert upstream_paths(cdn, since) == []
    assert statuses(raw(cdn, 1, req("GET", "/repos/o/r"))) == [200]


def test_whitespace_in_an_http2_path_is_refused(cdn: Topology, fleet: Daemon, subject: str) -> None:
    """HTTP/2 lets a ``:path`` carry spaces and tabs; mitmproxy writes it into the HTTP/1
    request line upstream, where ``GET /admin x HTTP/1.1`` is ``/admin`` to a server that
    splits on whitespace, while the judge compared ``/admin x`` with the deny rule's ``/admin``."""
    use(cdn, fleet, policy(deny("api.x.io", methods=["GET"], paths=["/admin"]), default="allow"))
    since = mark(cdn)
    out = h2(cdn, 1, [("GET", "/admin x"), ("GET", "/admin\tx"), ("GET", "/admin\x0bx"), ("GET", "/admin?a b")])
    assert statuses(out) == [403, 403, 403, 403], out
    assert upstream_paths(cdn, since) == []
    assert statuses(h2(cdn, 1, [("GET", "/public")])) == [200]


def test_an_http2_method_that_is_no_token_is_refused(cdn: Topology, fleet: Daemon, subject: str) -> None:
    """An HTTP/2 ``:method`` of ``GET /user`` with ``:path`` ``/repos/x`` becomes the HTTP/1
    request line ``GET /user /repos/x HTTP/1.1`` upstream: ``/user`` to a server that reads the
    second word, while the judge matched ``/repos/x`` against a rule that names no methods."""
    use(cdn, fleet, policy(allow("api.x.io", paths=["/repos/*"])))
    since = mark(cdn)
    out = h2(cdn, 1, [("GET /user", "/repos/x"), ("GET\t/user", "/repos/x"), ("GET", "/repos/x")])
    assert statuses(out) == [403, 403, 200], out
    assert upstream_paths(cdn, since) == [("api.x.io", "/repos/x")]
    # A deny rule's methods are not dodged by decorating the method either.
    use(cdn, fleet, policy(deny("api.x.io", methods=["DELETE"]), default="allow"))
    since = mark(cdn)
    out = h2(cdn, 1, [("DELETE /x", "/repos/x")])
    assert statuses(out) == [403], out
    assert upstream_paths(cdn, since) == []
