"""Names on the wire on every intercepted port (docs/reference/behaviour.md §18), sidecar
profile: the ports the policy's ``http``/``https`` rules name are redirected to the MITM with
80 and 443 (the sidecar rebuilds its table with each policy) and name-checked there; a policy
change that drops the rule stops the interception. Real packets, the real MITM, the CDN-shaped
topology of tests/kernel/cdn.py with TLS on 8443 and plain HTTP on 8081."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    accepts,
    allow,
    cdn_topology,
    deny,
    http,
    learn,
    mark,
    policy,
    requests,
    tls,
    upstream_ca,
    wait_refusal,
)
from tests.kernel.keepalive import KeepAlive, second_reached
from tests.kernel.rawtcp import BANNER_PORT, ECHO_PORT, raw, start_raw_server
from tests.kernel.sidecar import Sidecar
from tests.kernel.topology import Topology


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egq{os.getpid()}", sandboxes=1, http_ports="80,8081", https_ports="443,8443")
    try:
        start_raw_server(t)
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(cdn: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(cdn, sb=1).with_mitm()
    sc.env["OPENSANDBOX_EGRESS_POLICY_FILE"] = str(cdn.workdir / "named-sidecar-policy.json")
    sc.start()
    try:
        yield sc
    finally:
        print(sc.log_text()[-6000:])
        sc.cleanup()


def test_the_sidecar_name_checks_the_ports_its_rules_name(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(
        policy(
            allow("a.cdn.test", protocol="https", ports=[443, 8443]),
            allow("a.cdn.test", protocol="http", ports=[8081]),
        )
    )
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    assert tls(cdn, 1, CDN_IP, "a.cdn.test", port=8443)["ok"]
    since, log_mark = mark(cdn), len(sidecar.log_text())
    assert not tls(cdn, 1, CDN_IP, "b.cdn.test", port=8443)["ok"]
    out = http(cdn, 1, CDN_IP, "b.cdn.test", "a.cdn.test", port=8081)
    assert [r["status"] for r in out["responses"]] == [403, 200], out
    assert len(accepts(cdn, since)) == 1  # the admitted request's connection only
    assert [r["host"] for r in requests(cdn, since)] == ["a.cdn.test"]
    event = wait_refusal(sidecar.log_text, log_mark, name="b.cdn.test", port=8443)
    assert (event["subject"], event["dst"], event["reason"]) == ("s-sidecar", CDN_IP, "sni_not_allowed")

    # A tcp rule on the same port: address-level again (§18 names http/https ports only), so
    # the redirect is gone with the rebuilt table.
    sidecar.set_policy(policy(allow("a.cdn.test", protocol="tcp", ports=[8443])))
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    assert tls(cdn, 1, CDN_IP, "b.cdn.test", port=8443)["ok"]


def test_the_sidecar_checks_names_on_any_protocol_ports_and_keeps_other_protocols(
    cdn: Topology, sidecar: Sidecar
) -> None:
    """A rule with ports and no protocol opens HTTPS there too: its names are checked; a
    server-first protocol still gets its greeting (decided without a name after a short
    silence), a client-first one its bytes."""
    sidecar.set_policy(policy(allow("a.cdn.test", ports=["2000-9000"])))
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    since, log_mark = mark(cdn), len(sidecar.log_text())
    assert not tls(cdn, 1, CDN_IP, "b.cdn.test", port=8443)["ok"]
    assert accepts(cdn, since) == []
    wait_refusal(sidecar.log_text, log_mark, name="b.cdn.test", port=8443, reason="sni_not_allowed")
    assert tls(cdn, 1, CDN_IP, "a.cdn.test", port=8443)["ok"]
    greeted = raw(cdn, BANNER_PORT, greeted=True, send="EHLO me\\r\\n")
    assert greeted["got"].startswith("220 ") and "echo EHLO me" in greeted["got"], greeted
    assert "echo SSH-2.0-x" in raw(cdn, ECHO_PORT, send="SSH-2.0-x\\r\\n")["got"]


def test_the_sidecar_counts_a_refusal_made_from_the_first_bytes(cdn: Topology, sidecar: Sidecar) -> None:
    """A request line only a lenient server reads (leading space) carries no name the MITM
    reads: refused from its bytes alone, and reported like any refusal (tests/kernel/
    test_first_bytes_reported.py has the fleet's cases): the subject's log line and count."""
    sidecar.set_policy(policy(deny("b.cdn.test"), default="allow"))
    log_at, since = len(sidecar.log_text()), mark(cdn)
    out = raw(cdn, 80, send=" GET / HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", read_s=1.5)
    assert "200 OK" not in out["got"], out
    assert requests(cdn, since) == []
    event = wait_refusal(sidecar.log_text, log_at, subject="s-sidecar", reason="host_not_allowed", port=80)
    assert (event["dst"], event["rule"]) == (CDN_IP, "first-bytes"), event
    code, text = sidecar.api("GET", "/metrics")
    assert code == 200 and re.search(
        r'^egressd_subject_dropped_packets_total\{subject="s-sidecar"[^}]*\} [1-9]', text, re.M
    ), text


def test_the_sidecar_cuts_a_relayed_connection_whose_name_went(cdn: Topology, sidecar: Sidecar) -> None:
    """A narrowing that takes a name away cuts its open (passed-through) TLS connection while
    the address stays open for another name (tests/kernel/test_names_narrowing_cuts.py has the
    fleet's cases)."""
    both = policy(allow("a.cdn.test"), allow("b.cdn.test"))
    sidecar.set_policy(both)
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    learn(cdn, 1, "b.cdn.test", CDN_IP)
    client = KeepAlive(cdn, 1, "a.cdn.test", upstream_ca(cdn))
    try:
        assert client.line() == {"first": 200}
        since = mark(cdn)
        sidecar.set_policy(policy(allow("b.cdn.test")))
        second = client.second()
        assert second != 200, second
        assert not second_reached(cdn, since, "a.cdn.test")
    finally:
        client.stop()


def test_a_narrowing_leaves_the_dns_the_proxy_answers(cdn: Topology, sidecar: Sidecar) -> None:
    """The app's DNS, to any address, is redirected to the sidecar's proxy: a narrowing's flow
    cut (§14.1) must leave it alone. Cutting its conntrack entry lost the answer to a query in
    flight (its reply could not be mapped back: a DNS timeout right after a policy change, as
    CI saw); here the upstream holds the answer back 1.2 s, so the change lands mid-query."""
    import subprocess
    import time

    from tests.kernel.topology import GATEWAY

    sidecar.set_policy(policy(allow("slow.cdn.test"), allow("good.test")))
    query = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            sidecar.ns,
            "dig",
            f"@{GATEWAY}",
            "slow.cdn.test",
            "A",
            "+time=6",
            "+tries=1",
            "+noall",
            "+comments",
            "+answer",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.4)  # the query waits for the upstream (1.2 s) now
        # Narrower (good.test goes), and nothing opens the gateway's port 53: only the redirect
        # reaches the proxy, so a cut that judged the DNS flow by its address would delete it.
        sidecar.set_policy(policy(allow("slow.cdn.test")))
        out, _ = query.communicate(timeout=15)
    finally:
        if query.poll() is None:
            query.kill()
            query.wait(timeout=10)
    assert "status: NOERROR" in out and CDN_IP in out, out
