"""§18 over IPv6, fleet profile (docs/reference/behaviour.md §18, with §14.1): name-exact,
port-scoped rules must hold for subjects attached by their IPv6 address exactly as for IPv4
ones, with real packets and the real MITM in the CDN topology (tests/kernel/cdn.py) given AAAA
records (tests/kernel/cdn6.py).

* An AAAA-learned lease opens its address only for the ports and protocols of the rules that
  allowed its name; an allow v6 CIDR rule with ``protocol: tcp`` and ports opens only there.
* Names on the wire: with two names on one v6 address and only one allowed, the other's SNI,
  the other's Host and no SNI are refused before any upstream connection; a denied name is
  refused by SNI/Host on any v6 address under ``defaultAction: allow``.
* UDP 443 to a v6 address open only by learning is dropped.
* A narrowing that takes a port away cuts the established v6 flow on it (§14.1).
* Odd forms: a v6 socket dialling ``::ffff:<v4 lease>``, and an AAAA answer that is a
  v4-mapped address.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import (
    SYSTEM_PYTHON,
    accepts,
    allow,
    cdn_topology,
    client_argv,
    deny,
    http,
    learn,
    mark,
    mitm_env,
    parse_client,
    policy,
    requests,
    set_elements,
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
    PROBE,
    ZONE6,
    atomic_udp,
    conntrack,
    echo,
    learn6,
    probe,
    raw6,
)
from tests.kernel.keepalive import KeepAlive, second_reached
from tests.kernel.topology import GATEWAY6, Daemon, Topology, envelope

HTTP_PORT = 18560
DPR = "sandbox.data-plane-ready"


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"eg6f{os.getpid()}", sandboxes=3, zone=ZONE6)
    try:
        with echo(t):
            yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def fleet(cdn: Topology) -> Iterator[Daemon]:
    env = {**mitm_env(cdn, "v6names"), "EGRESSD_UID_MAX_SUBJECTS": "2", "EGRESSD_UID_DNS_PORT_BASE": "16600"}
    d = Daemon(cdn, table="egt-v6names", port=HTTP_PORT, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            cdn.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        print(d.log_text()[-8000:])


def bind6(d: Daemon, sb: int, uid: str, pol: object) -> None:
    """Sandbox ``sb`` as subject ``uid`` by its IPv6 address (gateway fd00:203::1)."""
    env = envelope("SET_BINDING", uid, ip=Topology.sb_ip6(sb), gateway=GATEWAY6, policy=pol)
    assert d.post(env) == (200, "{}")
    assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")


def bind4(d: Daemon, sb: int, uid: str, pol: object) -> None:
    assert d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(sb), policy=pol)) == (200, "{}")
    assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")


@pytest.fixture
def subject(fleet: Daemon) -> Iterator[list[str]]:
    """Uids bound by a test (removed afterwards)."""
    uids: list[str] = []
    yield uids
    for uid in uids:
        fleet.post(envelope("REMOVE_BINDING", uid))


def evidence(t: Topology, d: Daemon) -> str:
    return (
        "conntrack:\n"
        + conntrack(t, t.pod)[-3000:]
        + "\nnft:\n"
        + d.nft("list", "table", "inet", d.table)[-6000:]
    )


# ---- 1. port scoping ----------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [None, "tcp"])
def test_an_aaaa_lease_opens_only_the_rules_ports(
    cdn: Topology, fleet: Daemon, subject: list[str], protocol: str | None
) -> None:
    uid = f"v6p-{protocol or 'any'}"
    subject.append(uid)
    rule = allow("api6.test", ports=[443], **({"protocol": protocol} if protocol else {}))
    bind6(fleet, 1, uid, policy(rule))
    assert not probe(cdn, 1, "tcp", API6, 7000)  # nothing before the lookup
    learn6(cdn, 1, "api6.test", API6)
    ok = tls(cdn, 1, API6, "api6.test")
    assert ok["ok"] and ok["responses"][0]["body"]["sni"] == "api6.test", ok
    since = mark(cdn)
    plain = http(cdn, 1, API6, "api6.test")
    assert not plain["responses"] or plain["responses"][0]["status"] == 403, plain
    alt = http(cdn, 1, API6, "api6.test", port=8080)
    assert not alt["ok"], alt
    assert accepts(cdn, since) == [], evidence(cdn, fleet)
    assert not probe(cdn, 1, "tcp", API6, 7000), evidence(cdn, fleet)
    assert not probe(cdn, 1, "tcp", API6, 22)
    assert not probe(cdn, 1, "udp", API6, 443), evidence(cdn, fleet)
    assert not probe(cdn, 1, "udp", API6, 7000)
    # Extension headers before the transport header, and fragments: still only TCP 443.
    for shape in ("dstopts", "hbh", "big"):
        assert not probe(cdn, 1, "tcp", API6, 7000, shape), (shape, evidence(cdn, fleet))
        assert not probe(cdn, 1, "udp", API6, 443, shape), (shape, evidence(cdn, fleet))


def test_a_v6_cidr_rule_with_protocol_and_ports(cdn: Topology, fleet: Daemon, subject: list[str]) -> None:
    """The §18 vector over v6: ``{"target": "fd00:204::8/125", "protocol": "tcp", "ports": ["5432-5433"]}``."""
    subject.append("v6cidr")
    bind6(fleet, 1, "v6cidr", policy(allow(NET6, protocol="tcp", ports=["5432-5433"])))
    assert probe(cdn, 1, "tcp", NET6_A, 5432), evidence(cdn, fleet)
    assert probe(cdn, 1, "tcp", NET6_B, 5433)
    assert not probe(cdn, 1, "tcp", NET6_A, 22), evidence(cdn, fleet)
    assert not probe(cdn, 1, "tcp", NET6_A, 7000)
    assert not probe(cdn, 1, "udp", NET6_A, 5432), evidence(cdn, fleet)
    since = mark(cdn)
    assert not http(cdn, 1, NET6_A, "x")["ok"]
    assert not probe(cdn, 1, "tcp", EX6, 5432)  # outside the prefix
    assert accepts(cdn, since) == []


# ---- 2. names on the wire -----------------------------------------------------------------------


def test_another_name_on_the_shared_v6_address_is_refused_before_the_upstream(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    subject.append("v6names")
    bind6(fleet, 2, "v6names", policy(allow("a.cdn6.test")))
    assert cdn.dig(2, "b.cdn6.test", "AAAA", server=GATEWAY6)[1] == []  # not answered: not allowed
    learn6(cdn, 2, "a.cdn6.test", CDN6)
    ok = tls(cdn, 2, CDN6, "a.cdn6.test")
    assert ok["ok"] and ok["responses"][0]["body"]["sni"] == "a.cdn6.test", ok
    assert http(cdn, 2, CDN6, "a.cdn6.test")["responses"][0]["status"] == 200

    since, log_mark = mark(cdn), len(fleet.log_text())
    bad = tls(cdn, 2, CDN6, "b.cdn6.test")
    assert not bad["ok"], bad
    event = wait_refusal(fleet.log_text, log_mark, name="b.cdn6.test", port=443)
    assert (event["dst"], event["reason"], event["subject"]) == (CDN6, "sni_not_allowed", "s-v6names"), event
    spoofed = http(cdn, 2, CDN6, "b.cdn6.test", "a.cdn6.test")
    assert [r["status"] for r in spoofed["responses"]][:1] == [403], spoofed
    assert spoofed["responses"][0]["body"]["reason"] == "host_not_allowed"
    # Host b first: no upstream connection for it (a later admitted request may open one).
    assert http(cdn, 2, CDN6, "b.cdn6.test")["responses"][0]["status"] == 403
    nosni = tls(cdn, 2, CDN6, None, host="a.cdn6.test")
    assert not nosni["ok"], nosni
    wait_refusal(fleet.log_text, log_mark, reason="no_sni", dst=CDN6)
    # One upstream connection only: the spoofed-then-allowed connection's, opened for its
    # admitted second request (Host a.cdn6.test).
    got = accepts(cdn, since)
    assert len(got) <= 1, (got, evidence(cdn, fleet))
    assert [r["host"] for r in requests(cdn, since)] == ["a.cdn6.test"], requests(cdn, since)
    since = mark(cdn)
    assert not tls(cdn, 2, CDN6, "b.cdn6.test")["ok"]
    assert not tls(cdn, 2, CDN6, None, host="b.cdn6.test")["ok"]
    assert http(cdn, 2, CDN6, "b.cdn6.test")["responses"][0]["status"] == 403
    assert accepts(cdn, since) == [], evidence(cdn, fleet)


def test_a_denied_name_is_refused_on_any_v6_address_under_default_allow(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    subject.append("v6deny")
    bind6(fleet, 2, "v6deny", policy(deny("evil6.test"), default="allow"))
    since, log_mark = mark(cdn), len(fleet.log_text())
    for ip in (DENY6, CDN6):
        assert not tls(cdn, 2, ip, "evil6.test")["ok"], ip
        out = http(cdn, 2, ip, "evil6.test")
        assert out["responses"] and out["responses"][0]["status"] == 403, out
    assert accepts(cdn, since) == [], evidence(cdn, fleet)
    event = wait_refusal(fleet.log_text, log_mark, name="evil6.test", port=443)
    assert event["reason"] == "sni_not_allowed" and event["dst"] in (DENY6, CDN6)
    assert tls(cdn, 2, DENY6, "good6.test")["ok"]
    assert tls(cdn, 2, DENY6, None, host="good6.test")["ok"]
    assert http(cdn, 2, DENY6, "good6.test")["responses"][0]["status"] == 200


# ---- 3. QUIC ------------------------------------------------------------------------------------


def test_udp_443_of_a_v6_address_open_only_by_learning_is_dropped(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    subject.append("v6quic")
    bind6(fleet, 1, "v6quic", policy(allow("ex6.test"), allow(f"{NET6_A}/128")))
    learn6(cdn, 1, "ex6.test", EX6)
    assert probe(cdn, 1, "udp", EX6, 7000) and probe(cdn, 1, "tcp", EX6, 7000)  # the lease is whole
    assert not probe(cdn, 1, "udp", EX6, 443), evidence(cdn, fleet)  # but never QUIC
    assert probe(cdn, 1, "udp", NET6_A, 443)  # an address rule opens it (the echo answers on v6 443)
    # QUIC-shaped datagrams behind extension headers, or fragmented: dropped all the same
    # (each shape passes where an address rule opens UDP 443: the probe itself works).
    for shape in ("dstopts", "hbh", "big"):
        assert probe(cdn, 1, "udp", NET6_A, 443, shape), shape
        assert not probe(cdn, 1, "udp", EX6, 443, shape), (shape, evidence(cdn, fleet))
    # In an atomic fragment (a Fragment header before UDP, RFC 6946): the same.
    assert atomic_udp(cdn, 1, NET6_A, 443)
    assert not atomic_udp(cdn, 1, EX6, 443), evidence(cdn, fleet)


# ---- 4. §14.1 by port over v6 -------------------------------------------------------------------


def test_a_narrowing_that_takes_a_port_away_cuts_the_v6_flow_on_it(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    subject.append("v6cut")
    bind6(fleet, 1, "v6cut", policy(allow("ex6.test", protocol="tcp", ports=[7000, 7001])))
    learn6(cdn, 1, "ex6.test", EX6)
    holder = cdn.spawn(cdn.sb(1), "python3", "-c", HOLD, EX6, "7000,7001", "6", ready_line="up")
    time.sleep(0.6)
    bind6(fleet, 1, "v6cut", policy(allow("ex6.test", protocol="tcp", ports=[7001])))
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


def test_a_v6_socket_dialling_a_mapped_v4_lease_gets_only_its_ports(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    """A dual-stack socket connecting to ``::ffff:a.b.c.d`` sends IPv4: the v4 subject's lease
    scope and name check apply to it like to an AF_INET socket."""
    subject.append("v4mapped")
    bind4(fleet, 3, "v4mapped", policy(allow("v4name.test", ports=[443])))
    learn(cdn, 3, "v4name.test", MAPPED_V4)
    assert tls(cdn, 3, MAPPED6, "v4name.test")["ok"]  # the CLIENT dials the literal over AF_INET6
    since = mark(cdn)
    assert not probe(cdn, 3, "tcp", MAPPED6, 7000), evidence(cdn, fleet)
    assert not probe(cdn, 3, "udp", MAPPED6, 443)
    assert not probe(cdn, 3, "udp", MAPPED6, 7000)
    assert not tls(cdn, 3, MAPPED6, "other4.test")["ok"]
    assert not tls(cdn, 3, MAPPED6, None, host="v4name.test")["ok"]
    plain = http(cdn, 3, MAPPED6, "v4name.test")  # port 80: not the rule's port
    assert not plain["responses"] or plain["responses"][0]["status"] == 403, plain
    assert accepts(cdn, since) == [], evidence(cdn, fleet)


def test_an_aaaa_answer_that_is_a_mapped_v4_address_opens_no_more_than_its_rule(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    """``mapped.test AAAA ::ffff:10.204.0.7`` learned by a v4 subject (asking over v4) and by a
    v6 subject: whatever egressd makes of the answer, 10.204.0.7 is open at most on the rule's
    port 443 and only for that name, and nothing opens v4 traffic of the v6 subject."""
    subject += ["mapped4", "mapped6"]
    pol = policy(allow("mapped.test", ports=[443]))
    bind4(fleet, 3, "mapped4", pol)
    bind6(fleet, 1, "mapped6", pol)
    status, answers = cdn.dig(3, "mapped.test", "AAAA")
    assert status == "NOERROR", (status, answers)
    learn6(cdn, 1, "mapped.test", MAPPED6)
    for uid in ("mapped4", "mapped6"):  # what egressd made of the answer (shown with -s)
        for kind in ("dyn_v4", "dyn_v6", "dynp_v4", "dynp_v6", "dynpx_v4", "dynpx_v6"):
            print(uid, kind, set_elements(fleet, f"subj_s_{uid}_{kind}"))
    since = mark(cdn)
    for sb in (3, 1):
        for target in (MAPPED_V4, MAPPED6):
            if sb == 3 and target == MAPPED6:
                continue  # the same packets as MAPPED_V4 from a v4 subject
            assert not probe(cdn, sb, "tcp", target, 7000), (sb, target, evidence(cdn, fleet))
            assert not probe(cdn, sb, "udp", target, 443), (sb, target)
            assert not tls(cdn, sb, target, "other4.test")["ok"], (sb, target)
    assert not probe(cdn, 1, "tcp", MAPPED_V4, 7000)
    assert accepts(cdn, since) == [], evidence(cdn, fleet)


# ---- more: named ports, deny by port, literal names ---------------------------------------------


def test_a_v6_http_rule_on_another_port_is_name_checked_there(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    """``protocol: http`` on 8080 puts the subject's v6 source . tcp . 8080 in the MITM's named
    ports: the other name's Host on 8080 is answered 403 there, nothing forwarded."""
    subject.append("v6named")
    bind6(fleet, 2, "v6named", policy(allow("a.cdn6.test", protocol="http", ports=[8080])))
    learn6(cdn, 2, "a.cdn6.test", CDN6)
    since, log_mark = mark(cdn), len(fleet.log_text())
    out = http(cdn, 2, CDN6, "b.cdn6.test", "a.cdn6.test", port=8080)
    assert [r["status"] for r in out["responses"]] == [403, 200], (out, evidence(cdn, fleet))
    assert [r["host"] for r in requests(cdn, since)] == ["a.cdn6.test"]
    event = wait_refusal(fleet.log_text, log_mark, name="b.cdn6.test", port=8080)
    assert (event["dst"], event["reason"]) == (CDN6, "host_not_allowed")
    assert not tls(cdn, 2, CDN6, "a.cdn6.test")["ok"]  # 443: not the rule's port


def test_a_v6_deny_rule_with_ports_refuses_only_there(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    subject.append("v6denyp")
    bind6(fleet, 1, "v6denyp", policy(deny(NET6, protocol="tcp", ports=[5432]), default="allow"))
    assert not probe(cdn, 1, "tcp", NET6_A, 5432), evidence(cdn, fleet)
    assert probe(cdn, 1, "tcp", NET6_A, 5433)
    assert probe(cdn, 1, "udp", NET6_A, 5432)
    assert probe(cdn, 1, "tcp", EX6, 5432)
    for shape in ("dstopts", "hbh"):
        assert not probe(cdn, 1, "tcp", NET6_A, 5432, shape), shape


def test_an_address_literal_as_the_name_is_no_name(cdn: Topology, fleet: Daemon, subject: list[str]) -> None:
    """A v6 literal as the Host (bracketed, with or without a port) or as the SNI names no name:
    refused on an address open only by learning."""
    subject.append("v6lit")
    bind6(fleet, 2, "v6lit", policy(allow("a.cdn6.test")))
    learn6(cdn, 2, "a.cdn6.test", CDN6)
    since = mark(cdn)
    for host in (f"[{CDN6}]", f"[{CDN6}]:80", CDN6, f"[::ffff:{MAPPED_V4}]"):
        out = http(cdn, 2, CDN6, host)
        # 403 (no name), or for the unbracketed literal mitmproxy's own 400 (ambiguous authority)
        assert out["responses"] and out["responses"][0]["status"] in (400, 403), (host, out)
        assert out["responses"][0]["status"] == 403 or host == CDN6, (host, out)
    assert not tls(cdn, 2, CDN6, CDN6, host="a.cdn6.test")["ok"]
    assert accepts(cdn, since) == [], evidence(cdn, fleet)


def test_a_narrowing_that_takes_the_name_away_cuts_its_open_v6_tls_connection(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    """tests/kernel/test_names_narrowing_cuts.py over v6: a relayed TLS connection whose name
    a narrowing takes away is cut, although the v6 address stays open for the other name."""
    subject.append("v6namecut")
    bind6(fleet, 1, "v6namecut", policy(allow("a.cdn6.test"), allow("b.cdn6.test")))
    learn6(cdn, 1, "a.cdn6.test", CDN6)
    learn6(cdn, 1, "b.cdn6.test", CDN6)
    client = KeepAlive(cdn, 1, "a.cdn6.test", upstream_ca(cdn), ip=CDN6)
    try:
        assert client.line() == {"first": 200}
        since = mark(cdn)
        bind6(fleet, 1, "v6namecut", policy(allow("b.cdn6.test")))
        second = client.second()
        assert second != 200, (second, evidence(cdn, fleet))
        assert not second_reached(cdn, since, "a.cdn6.test")
    finally:
        client.stop()
    assert tls(cdn, 1, CDN6, "b.cdn6.test")["ok"]


def test_v6_cname_chain_other_address_and_address_rules(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    """Over v6: a CNAME chain admits the query name only; an allowed name learned on one v6
    address does not open another; an allow v6 CIDR rule admits any SNI (and none) but a
    denied one."""
    subject.append("v6chain")
    bind6(fleet, 2, "v6chain", policy(allow("www6.cdn6.test"), allow("good6.test")))
    learn6(cdn, 2, "www6.cdn6.test", CDN6)
    assert tls(cdn, 2, CDN6, "www6.cdn6.test")["ok"]
    since = mark(cdn)
    assert not tls(cdn, 2, CDN6, "edge6.cdnhost6.test")["ok"]
    assert not tls(cdn, 2, CDN6, "b.cdn6.test")["ok"]
    assert not tls(cdn, 2, DENY6, "www6.cdn6.test")["ok"]  # learned on CDN6, not on DENY6
    assert not tls(cdn, 2, DENY6, "good6.test")["ok"]  # allowed, not learned yet
    assert accepts(cdn, since) == [], evidence(cdn, fleet)
    bind6(fleet, 2, "v6chain", policy(deny("evil6.test"), allow("fd00:204::/64")))
    assert tls(cdn, 2, DENY6, "good6.test")["ok"]
    assert tls(cdn, 2, DENY6, None, host="good6.test")["ok"]
    since = mark(cdn)
    assert not tls(cdn, 2, DENY6, "evil6.test")["ok"]
    assert http(cdn, 2, DENY6, "evil6.test")["responses"][0]["status"] == 403
    assert accepts(cdn, since) == [], evidence(cdn, fleet)


def test_nameless_and_absolute_form_bytes_on_a_learned_v6_address(
    cdn: Topology, fleet: Daemon, subject: list[str]
) -> None:
    """On an address open only by an ``https`` rule's lease (docs/reference/behaviour.md, "connections
    that carry no name"): bytes that are neither TLS nor HTTP are refused (``no_sni``), a silent
    client on 443 is only waited for; a rule without ``protocol`` admits them (the control). An
    absolute-form request naming the other name with the allowed Host forwards nothing for the
    other name."""
    subject.append("v6raw")
    bind6(fleet, 2, "v6raw", policy(allow("a.cdn6.test", protocol="https"), allow("a.cdn6.test", ports=[80])))
    learn6(cdn, 2, "a.cdn6.test", CDN6)
    since, log_mark = mark(cdn), len(fleet.log_text())
    assert raw6(cdn, 2, CDN6, 443, "SSH-2.0-x\\r\\n").strip() == "b''"
    assert raw6(cdn, 2, CDN6, 443, "", wait=2).strip() == "b''"
    assert accepts(cdn, since) == [], evidence(cdn, fleet)
    wait_refusal(fleet.log_text, log_mark, reason="no_sni", dst=CDN6, port=443)
    since = mark(cdn)
    out = raw6(cdn, 2, CDN6, 80, "GET http://b.cdn6.test/abs HTTP/1.1\\r\\nHost: a.cdn6.test\\r\\n\\r\\n")
    seen = requests(cdn, since)
    assert all("b.cdn6.test" not in (r.get("host", "") + r.get("path", "")) for r in seen), (out, seen)
    bind6(fleet, 2, "v6raw", policy(allow("a.cdn6.test")))  # the control: any protocol
    learn6(cdn, 2, "a.cdn6.test", CDN6)
    since = mark(cdn)
    raw6(cdn, 2, CDN6, 443, "SSH-2.0-x\\r\\n")
    assert len(accepts(cdn, since)) == 1


UID_V6 = 100061  # a host-uid subject (docs/reference/behaviour.md §17)


def as_uid(t: Topology, *cmd: str) -> subprocess.CompletedProcess[str]:
    return t.ns(
        t.pod,
        "setpriv",
        f"--reuid={UID_V6}",
        f"--regid={UID_V6}",
        "--clear-groups",
        *cmd,
        check=False,
        timeout=30,
    )


def test_a_host_uid_subject_over_v6(cdn: Topology, fleet: Daemon, subject: list[str]) -> None:
    """§17 x §18 over v6: a host-uid subject's AAAA lease opens only its rule's port, and the
    other name on the shared v6 address is refused by SNI before the upstream."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    subject.append("v6uid")
    env = envelope(
        "SET_BINDING", "v6uid", ip=None, policy=json.dumps(policy(allow("a.cdn6.test", ports=[443])))
    )
    env["attachment"] = {"process": {"uid": UID_V6}}
    assert fleet.post(env) == (200, "{}")
    assert fleet.post(envelope("LIFECYCLE_HOOK", "v6uid", hook=DPR)) == (200, "{}")
    r = as_uid(cdn, "dig", "@fd00:204::9", "a.cdn6.test", "AAAA", "+short", "+time=2", "+tries=1")
    assert CDN6 in r.stdout, r
    ok = as_uid(cdn, SYSTEM_PYTHON, *client_argv(cdn, CDN6, 443, "a.cdn6.test", ("a.cdn6.test",)))
    assert parse_client(ok.stdout, ok.stderr)["ok"], ok
    since = mark(cdn)
    bad = as_uid(cdn, SYSTEM_PYTHON, *client_argv(cdn, CDN6, 443, "b.cdn6.test", ("b.cdn6.test",)))
    assert not parse_client(bad.stdout, bad.stderr)["ok"], bad
    plain = as_uid(cdn, SYSTEM_PYTHON, *client_argv(cdn, CDN6, 80, None, ("a.cdn6.test",)))
    out = parse_client(plain.stdout, plain.stderr)
    assert not out["responses"] or out["responses"][0]["status"] == 403, out
    for proto, port in (("tcp", 7000), ("udp", 443), ("udp", 7000)):
        got = as_uid(cdn, SYSTEM_PYTHON, "-c", PROBE, proto, CDN6, str(port), "plain").stdout.strip()
        assert got == "closed", (proto, port, got, evidence(cdn, fleet))
    assert accepts(cdn, since) == [], evidence(cdn, fleet)
    # The control: the same name on every port opens TCP 7000 for the uid (the probe works).
    env = envelope("SET_BINDING", "v6uid", ip=None, policy=json.dumps(policy(allow("a.cdn6.test"))))
    env["attachment"] = {"process": {"uid": UID_V6}}
    assert fleet.post(env) == (200, "{}")
    r = as_uid(cdn, "dig", "@fd00:204::9", "a.cdn6.test", "AAAA", "+short", "+time=2", "+tries=1")
    assert CDN6 in r.stdout, r
    assert as_uid(cdn, SYSTEM_PYTHON, "-c", PROBE, "tcp", CDN6, "7000", "plain").stdout.strip() == "open"
