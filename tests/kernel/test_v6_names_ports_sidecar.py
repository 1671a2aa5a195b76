"""§18 over IPv6, sidecar profile (docs/reference/behaviour.md §18, with §14.1): the fleet's v6
probes (tests/kernel/test_v6_names_ports.py) against a sidecar with the MITM on in the sandbox's
own namespace; the app looks names up over IPv6 (``dig AAAA @fd00:204::2``, redirected to the
sidecar's DNS proxy) and connects to the v6 upstream addresses of the CDN topology."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import (
    accepts,
    allow,
    cdn_topology,
    deny,
    http,
    mark,
    policy,
    requests,
    tls,
    upstream_ca,
    wait_refusal,
)
from tests.kernel.cdn6 import (
    API6,
    CDN6,
    DENY6,
    EX6,
    HOLD,
    MAPPED6,
    MAPPED_V4,
    NET6,
    NET6_A,
    NET6_B,
    ZONE6,
    atomic_udp,
    conntrack,
    echo,
    learn6,
    probe,
    raw6,
)
from tests.kernel.keepalive import KeepAlive, second_reached
from tests.kernel.sidecar import TABLE, Sidecar
from tests.kernel.topology import UPSTREAM_IPS6, Topology

DNS6 = UPSTREAM_IPS6[0]  # fd00:204::2: the upstream resolver's v6 address (redirected to the proxy)


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"eg6s{os.getpid()}", sandboxes=1, zone=ZONE6)
    try:
        with echo(t):
            yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def sidecar(cdn: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(cdn, sb=1).with_mitm()
    sc.env["OPENSANDBOX_EGRESS_POLICY_FILE"] = str(cdn.workdir / "v6-sidecar-policy.json")
    sc.start()
    try:
        yield sc
    finally:
        print(sc.log_text()[-6000:])
        sc.cleanup()


def learn(t: Topology, name: str, expect: str) -> None:
    learn6(t, 1, name, expect, server=DNS6)


def evidence(t: Topology) -> str:
    table = t.ns(t.sb(1), "nft", "list", "table", "inet", TABLE, check=False).stdout
    return "conntrack:\n" + conntrack(t, t.sb(1))[-3000:] + "\nnft:\n" + table[-6000:]


# ---- 1. port scoping ----------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [None, "tcp"])
def test_an_aaaa_lease_opens_only_the_rules_ports(
    cdn: Topology, sidecar: Sidecar, protocol: str | None
) -> None:
    sidecar.set_policy(
        policy(allow("api6.test", ports=[443], **({"protocol": protocol} if protocol else {})))
    )
    assert not probe(cdn, 1, "tcp", API6, 7000)
    learn(cdn, "api6.test", API6)
    ok = tls(cdn, 1, API6, "api6.test")
    assert ok["ok"] and ok["responses"][0]["body"]["sni"] == "api6.test", ok
    since = mark(cdn)
    plain = http(cdn, 1, API6, "api6.test")
    assert not plain["responses"] or plain["responses"][0]["status"] == 403, plain
    assert not http(cdn, 1, API6, "api6.test", port=8080)["ok"]
    assert accepts(cdn, since) == [], evidence(cdn)
    assert not probe(cdn, 1, "tcp", API6, 7000), evidence(cdn)
    assert not probe(cdn, 1, "tcp", API6, 22)
    assert not probe(cdn, 1, "udp", API6, 443), evidence(cdn)
    for shape in ("dstopts", "hbh", "big"):
        assert not probe(cdn, 1, "tcp", API6, 7000, shape), (shape, evidence(cdn))
        assert not probe(cdn, 1, "udp", API6, 443, shape), (shape, evidence(cdn))


def test_a_v6_cidr_rule_with_protocol_and_ports(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(allow(NET6, protocol="tcp", ports=["5432-5433"])))
    assert probe(cdn, 1, "tcp", NET6_A, 5432), evidence(cdn)
    assert probe(cdn, 1, "tcp", NET6_B, 5433)
    assert not probe(cdn, 1, "tcp", NET6_A, 22), evidence(cdn)
    assert not probe(cdn, 1, "udp", NET6_A, 5432), evidence(cdn)
    assert not probe(cdn, 1, "tcp", EX6, 5432)
    since = mark(cdn)
    out = http(cdn, 1, NET6_A, "x")  # port 80: dropped, or the MITM's 403 (port_not_allowed)
    assert not out["responses"] or out["responses"][0]["status"] == 403, out
    assert accepts(cdn, since) == [], evidence(cdn)


# ---- 2. names on the wire -----------------------------------------------------------------------


def test_another_name_on_the_shared_v6_address_is_refused_before_the_upstream(
    cdn: Topology, sidecar: Sidecar
) -> None:
    sidecar.set_policy(policy(allow("a.cdn6.test")))
    learn(cdn, "a.cdn6.test", CDN6)
    ok = tls(cdn, 1, CDN6, "a.cdn6.test")
    assert ok["ok"] and ok["responses"][0]["body"]["sni"] == "a.cdn6.test", ok
    since, log_mark = mark(cdn), len(sidecar.log_text())
    assert not tls(cdn, 1, CDN6, "b.cdn6.test")["ok"]
    event = wait_refusal(sidecar.log_text, log_mark, name="b.cdn6.test", port=443)
    assert (event["dst"], event["reason"], event["subject"]) == (CDN6, "sni_not_allowed", "s-sidecar"), event
    out = http(cdn, 1, CDN6, "b.cdn6.test", "a.cdn6.test")
    assert [r["status"] for r in out["responses"]] == [403, 200], out
    assert out["responses"][0]["body"]["reason"] == "host_not_allowed"
    assert not tls(cdn, 1, CDN6, None, host="a.cdn6.test")["ok"]
    wait_refusal(sidecar.log_text, log_mark, reason="no_sni", dst=CDN6)
    assert len(accepts(cdn, since)) == 1, evidence(cdn)  # the admitted request's connection only
    assert [r["host"] for r in requests(cdn, since)] == ["a.cdn6.test"]


def test_a_denied_name_is_refused_on_any_v6_address_under_default_allow(
    cdn: Topology, sidecar: Sidecar
) -> None:
    sidecar.set_policy(policy(deny("evil6.test"), default="allow"))
    since, log_mark = mark(cdn), len(sidecar.log_text())
    for ip in (DENY6, CDN6):
        assert not tls(cdn, 1, ip, "evil6.test")["ok"], ip
        out = http(cdn, 1, ip, "evil6.test")
        assert out["responses"] and out["responses"][0]["status"] == 403, out
    assert accepts(cdn, since) == [], evidence(cdn)
    assert (
        wait_refusal(sidecar.log_text, log_mark, name="evil6.test", port=443)["reason"] == "sni_not_allowed"
    )
    assert tls(cdn, 1, DENY6, "good6.test")["ok"]
    assert http(cdn, 1, DENY6, "good6.test")["responses"][0]["status"] == 200


# ---- 3. QUIC ------------------------------------------------------------------------------------


def test_udp_443_of_a_v6_address_open_only_by_learning_is_dropped(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(allow("ex6.test"), allow(f"{NET6_A}/128")))
    learn(cdn, "ex6.test", EX6)
    assert probe(cdn, 1, "udp", EX6, 7000) and probe(cdn, 1, "tcp", EX6, 7000)
    assert not probe(cdn, 1, "udp", EX6, 443), evidence(cdn)
    assert probe(cdn, 1, "udp", NET6_A, 443)
    for shape in ("dstopts", "hbh", "big"):
        assert probe(cdn, 1, "udp", NET6_A, 443, shape), shape
        assert not probe(cdn, 1, "udp", EX6, 443, shape), (shape, evidence(cdn))
    assert atomic_udp(cdn, 1, NET6_A, 443)
    assert not atomic_udp(cdn, 1, EX6, 443), evidence(cdn)


# ---- 4. §14.1 by port over v6 -------------------------------------------------------------------


def test_a_narrowing_that_takes_a_port_away_cuts_the_v6_flow_on_it(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(allow("ex6.test", protocol="tcp", ports=[7000, 7001])))
    learn(cdn, "ex6.test", EX6)
    holder = cdn.spawn(cdn.sb(1), "python3", "-c", HOLD, EX6, "7000,7001", "6", ready_line="up")
    time.sleep(0.6)
    sidecar.set_policy(policy(allow("ex6.test", protocol="tcp", ports=[7001])))
    out, _ = holder.communicate(timeout=30)
    by_port: dict[str, list[str]] = {"7000": [], "7001": []}
    for line in out.split("\n"):
        if line.strip():
            port, verdict = line.split()
            by_port[port].append(verdict)
    assert by_port["7000"][-1] == "dead", "a v6 flow on a port the policy took away survived: " + out
    assert by_port["7001"] and "dead" not in by_port["7001"], (
        "a v6 flow on a still-allowed port was cut: " + out
    )
    assert not probe(cdn, 1, "tcp", EX6, 7000)
    assert probe(cdn, 1, "tcp", EX6, 7001)


# ---- 5. v4-mapped forms -------------------------------------------------------------------------


def test_mapped_forms(cdn: Topology, sidecar: Sidecar) -> None:
    """A v6 socket dialling ``::ffff:<v4 lease>`` gets only the lease's ports; an AAAA answer
    that is a v4-mapped address opens 10.204.0.7 at most on its rule's port, for its name."""
    sidecar.set_policy(policy(allow("v4name.test", ports=[443]), allow("mapped.test", ports=[443])))
    assert sidecar.dig("v4name.test") == ("NOERROR", [MAPPED_V4])
    assert tls(cdn, 1, MAPPED6, "v4name.test")["ok"]
    since = mark(cdn)
    assert not probe(cdn, 1, "tcp", MAPPED6, 7000), evidence(cdn)
    assert not probe(cdn, 1, "udp", MAPPED6, 443)
    assert not tls(cdn, 1, MAPPED6, "other4.test")["ok"]
    learn(cdn, "mapped.test", MAPPED6)
    for target in (MAPPED_V4, MAPPED6):
        assert not probe(cdn, 1, "tcp", target, 7000), (target, evidence(cdn))
        assert not probe(cdn, 1, "udp", target, 443), target
        assert not tls(cdn, 1, target, "other4.test")["ok"], target
    assert accepts(cdn, since) == [], evidence(cdn)


# ---- more: named ports, deny by port, literal names ---------------------------------------------


def test_a_v6_http_rule_on_another_port_is_name_checked_there(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(allow("a.cdn6.test", protocol="http", ports=[8080])))
    learn(cdn, "a.cdn6.test", CDN6)
    since, log_mark = mark(cdn), len(sidecar.log_text())
    out = http(cdn, 1, CDN6, "b.cdn6.test", "a.cdn6.test", port=8080)
    assert [r["status"] for r in out["responses"]] == [403, 200], (out, evidence(cdn))
    assert [r["host"] for r in requests(cdn, since)] == ["a.cdn6.test"]
    event = wait_refusal(sidecar.log_text, log_mark, name="b.cdn6.test", port=8080)
    assert (event["dst"], event["reason"]) == (CDN6, "host_not_allowed")


def test_a_v6_deny_rule_with_ports_refuses_only_there(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(deny(NET6, protocol="tcp", ports=[5432]), default="allow"))
    assert not probe(cdn, 1, "tcp", NET6_A, 5432), evidence(cdn)
    assert probe(cdn, 1, "tcp", NET6_A, 5433)
    assert probe(cdn, 1, "udp", NET6_A, 5432)
    for shape in ("dstopts", "hbh"):
        assert not probe(cdn, 1, "tcp", NET6_A, 5432, shape), shape


def test_an_address_literal_as_the_name_is_no_name(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(allow("a.cdn6.test")))
    learn(cdn, "a.cdn6.test", CDN6)
    since = mark(cdn)
    for host in (f"[{CDN6}]", f"[{CDN6}]:80", CDN6, f"[::ffff:{MAPPED_V4}]"):
        out = http(cdn, 1, CDN6, host)
        # 403 (no name), or for the unbracketed literal mitmproxy's own 400 (ambiguous authority)
        assert out["responses"] and out["responses"][0]["status"] in (400, 403), (host, out)
        assert out["responses"][0]["status"] == 403 or host == CDN6, (host, out)
    assert not tls(cdn, 1, CDN6, CDN6, host="a.cdn6.test")["ok"]
    assert accepts(cdn, since) == [], evidence(cdn)


def test_a_narrowing_that_takes_the_name_away_cuts_its_open_v6_tls_connection(
    cdn: Topology, sidecar: Sidecar
) -> None:
    sidecar.set_policy(policy(allow("a.cdn6.test"), allow("b.cdn6.test")))
    learn(cdn, "a.cdn6.test", CDN6)
    learn(cdn, "b.cdn6.test", CDN6)
    client = KeepAlive(cdn, 1, "a.cdn6.test", upstream_ca(cdn), ip=CDN6)
    try:
        assert client.line() == {"first": 200}
        since = mark(cdn)
        sidecar.set_policy(policy(allow("b.cdn6.test")))
        second = client.second()
        assert second != 200, (second, evidence(cdn))
        assert not second_reached(cdn, since, "a.cdn6.test")
    finally:
        client.stop()
    assert tls(cdn, 1, CDN6, "b.cdn6.test")["ok"]


def test_v6_cname_chain_other_address_and_address_rules(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(allow("www6.cdn6.test"), allow("good6.test")))
    learn(cdn, "www6.cdn6.test", CDN6)
    assert tls(cdn, 1, CDN6, "www6.cdn6.test")["ok"]
    since = mark(cdn)
    assert not tls(cdn, 1, CDN6, "edge6.cdnhost6.test")["ok"]
    assert not tls(cdn, 1, CDN6, "b.cdn6.test")["ok"]
    assert not tls(cdn, 1, DENY6, "www6.cdn6.test")["ok"]
    assert not tls(cdn, 1, DENY6, "good6.test")["ok"]
    assert accepts(cdn, since) == [], evidence(cdn)
    sidecar.set_policy(policy(deny("evil6.test"), allow("fd00:204::/64")))
    assert tls(cdn, 1, DENY6, "good6.test")["ok"]
    assert tls(cdn, 1, DENY6, None, host="good6.test")["ok"]
    since = mark(cdn)
    assert not tls(cdn, 1, DENY6, "evil6.test")["ok"]
    assert http(cdn, 1, DENY6, "evil6.test")["responses"][0]["status"] == 403
    assert accepts(cdn, since) == [], evidence(cdn)


def test_nameless_and_absolute_form_bytes_on_a_learned_v6_address(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(allow("a.cdn6.test", protocol="https"), allow("a.cdn6.test", ports=[80])))
    learn(cdn, "a.cdn6.test", CDN6)
    since, log_mark = mark(cdn), len(sidecar.log_text())
    assert raw6(cdn, 1, CDN6, 443, "SSH-2.0-x\\r\\n").strip() == "b''"
    assert raw6(cdn, 1, CDN6, 443, "", wait=2).strip() == "b''"
    assert accepts(cdn, since) == [], evidence(cdn)
    wait_refusal(sidecar.log_text, log_mark, reason="no_sni", dst=CDN6, port=443)
    since = mark(cdn)
    out = raw6(cdn, 1, CDN6, 80, "GET http://b.cdn6.test/abs HTTP/1.1\\r\\nHost: a.cdn6.test\\r\\n\\r\\n")
    seen = requests(cdn, since)
    assert all("b.cdn6.test" not in (r.get("host", "") + r.get("path", "")) for r in seen), (out, seen)
