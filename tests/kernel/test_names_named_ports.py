"""Names on the wire on every intercepted port (docs/reference/behaviour.md §18), fleet profile:
the ports a subject's ``http``/``https`` rules name pass through the MITM for that subject (the
kernel's ``mitm_ports_v4``/``uid_mitm_ports`` elements), and so do the operator's extra ports;
each is name-checked like 80 and 443. Real packets through the real MITM in the CDN-shaped
topology of tests/kernel/cdn.py, whose upstream also serves TLS on 8443 and plain HTTP on
8080 and 8081. A refusal never reaches the upstream (it records every accepted connection).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    CDN_POLICY,
    DPR,
    SYSTEM_PYTHON,
    accepts,
    allow,
    bind_subject,
    cdn_topology,
    client_argv,
    http,
    learn,
    mark,
    mitm_env,
    mitm_fleet,
    parse_client,
    policy,
    requests,
    set_elements,
    tls,
    wait_refusal,
)
from tests.kernel.topology import Daemon, Topology, envelope

HTTP_PORT = 18540
EXTRA_PORT = 8080  # OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS
UID_N = 100021  # a host-uid sandbox (docs/reference/behaviour.md §17)


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egp{os.getpid()}", sandboxes=2, http_ports="80,8080,8081,853", https_ports="443,8443")
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def fleet(cdn: Topology) -> Iterator[Daemon]:
    env = {
        **mitm_env(cdn, "named"),
        "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": str(EXTRA_PORT),
        "EGRESSD_UID_MAX_SUBJECTS": "4",
        "EGRESSD_UID_DNS_PORT_BASE": "16300",
    }
    with mitm_fleet(cdn, "egt-named", HTTP_PORT, env) as d:
        yield d


def unbind(d: Daemon, uid: str) -> None:
    d.post(envelope("REMOVE_BINDING", uid))


HTTPS_8443 = policy(allow("a.cdn.test", protocol="https", ports=[443, 8443]))


def test_sni_spoofing_on_a_port_an_https_rule_names_is_refused_before_the_upstream(
    cdn: Topology, fleet: Daemon
) -> None:
    bind_subject(fleet, 1, "np1", HTTPS_8443)
    try:
        assert "8443" in set_elements(fleet, "mitm_ports_v4")
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        ok = tls(cdn, 1, CDN_IP, "a.cdn.test", port=8443)
        assert ok["ok"] and ok["responses"][0]["body"]["sni"] == "a.cdn.test", ok
        since, log_mark = mark(cdn), len(fleet.log_text())
        spoofed = tls(cdn, 1, CDN_IP, "b.cdn.test", port=8443)
        assert not spoofed["ok"], spoofed
        assert not tls(cdn, 1, CDN_IP, None, host="a.cdn.test", port=8443)["ok"]  # no SNI, no address rule
        assert accepts(cdn, since) == []  # no upstream connection was ever opened
        event = wait_refusal(fleet.log_text, log_mark, name="b.cdn.test", port=8443)
        assert (event["subject"], event["dst"], event["reason"]) == ("s-np1", CDN_IP, "sni_not_allowed")
        wait_refusal(fleet.log_text, log_mark, reason="no_sni", port=8443)
    finally:
        unbind(fleet, "np1")
    assert set_elements(fleet, "mitm_ports_v4") == "[]"  # removal takes the subject's elements


def test_host_spoofing_on_a_port_an_http_rule_names_is_answered_403(cdn: Topology, fleet: Daemon) -> None:
    bind_subject(fleet, 1, "np2", policy(allow("a.cdn.test", protocol="http", ports=[8081])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = http(cdn, 1, CDN_IP, "b.cdn.test", "a.cdn.test", port=8081)
        assert [r["status"] for r in out["responses"]] == [403, 200], out
        assert out["responses"][0]["body"]["reason"] == "host_not_allowed"
        assert [r["host"] for r in requests(cdn, since)] == ["a.cdn.test"]
    finally:
        unbind(fleet, "np2")


def test_the_extra_ports_are_name_checked(cdn: Topology, fleet: Daemon) -> None:
    """OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS are intercepted for every subject: the Host of
    every request there is checked like on 80."""
    bind_subject(fleet, 1, "np3", CDN_POLICY)  # a.cdn.test on every port
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = http(cdn, 1, CDN_IP, "b.cdn.test", "a.cdn.test", port=EXTRA_PORT)
        assert [r["status"] for r in out["responses"]] == [403, 200], out
        assert [r["host"] for r in requests(cdn, since)] == ["a.cdn.test"]
    finally:
        unbind(fleet, "np3")


def test_named_ports_follow_each_policy_change(cdn: Topology, fleet: Daemon) -> None:
    """A ``tcp`` rule opens the port at the address level (no name is checked there: §18 names
    http/https ports only); the same port under an ``https`` rule is name-checked from the
    next connection on; deny-first and removal take the elements away again."""
    tcp_only = policy(allow("a.cdn.test", protocol="tcp", ports=[8443]))
    bind_subject(fleet, 2, "np4", tcp_only)
    try:
        learn(cdn, 2, "a.cdn.test", CDN_IP)
        assert set_elements(fleet, "mitm_ports_v4") == "[]"
        assert tls(cdn, 2, CDN_IP, "b.cdn.test", port=8443)["ok"]  # address-level, as the spec says
        bind_subject(fleet, 2, "np4", policy(allow("a.cdn.test", protocol="https", ports=["8000-8999"])), activate=False)
        assert "8000" in set_elements(fleet, "mitm_ports_v4")
        learn(cdn, 2, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        assert not tls(cdn, 2, CDN_IP, "b.cdn.test", port=8443)["ok"]
        assert accepts(cdn, since) == []
        assert tls(cdn, 2, CDN_IP, "a.cdn.test", port=8443)["ok"]
    finally:
        unbind(fleet, "np4")
    assert set_elements(fleet, "mitm_ports_v4") == "[]"


def test_dns_over_tls_is_never_intercepted(cdn: Topology, fleet: Daemon) -> None:
    """A rule naming 853 with https does not carry DNS over TLS past the kernel's refusal: 853
    is never sent to the MITM (its elements skip it) and the forward hook drops it."""
    bind_subject(fleet, 1, "np5", policy(allow("a.cdn.test", protocol="https", ports=["800-900"])))
    try:
        listed = set_elements(fleet, "mitm_ports_v4")
        assert "852" in listed and "854" in listed and "853" not in listed, listed
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        assert not http(cdn, 1, CDN_IP, "a.cdn.test", port=853)["ok"]
        assert accepts(cdn, since) == []
    finally:
        unbind(fleet, "np5")


def test_request_rules_on_a_named_port_are_enforced(cdn: Topology, fleet: Daemon) -> None:
    """A rule with methods/paths on 8443 was refused (400) when only 80/443 were intercepted;
    now its port is intercepted for the subject and its requests are judged there."""
    mitm_ca = cdn.workdir / "named-mitm-conf" / "mitmproxy-ca-cert.pem"
    pol = policy(allow("a.cdn.test", protocol="https", ports=[8443], methods=["GET"], paths=["/y"]))
    bind_subject(fleet, 1, "np6", pol)
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = tls(cdn, 1, CDN_IP, "a.cdn.test", ca=mitm_ca, port=8443)  # GET /x
        assert out["ok"] and out["responses"][0]["status"] == 403, out
        assert out["responses"][0]["body"]["error"] == "egress_denied"
        assert requests(cdn, since) == []
    finally:
        unbind(fleet, "np6")


def test_host_uid_subjects_have_their_named_ports_intercepted(cdn: Topology, fleet: Daemon) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    env = envelope("SET_BINDING", "np-uid", ip=None, policy=json.dumps(HTTPS_8443))
    env["attachment"] = {"process": {"uid": UID_N}}
    assert fleet.post(env) == (200, "{}")
    assert fleet.post(envelope("LIFECYCLE_HOOK", "np-uid", hook=DPR)) == (200, "{}")

    def as_uid(*cmd: str) -> dict[str, object]:
        r = cdn.ns(
            cdn.pod, "setpriv", f"--reuid={UID_N}", f"--regid={UID_N}", "--clear-groups", *cmd, check=False, timeout=30
        )
        return parse_client(r.stdout, r.stderr)

    try:
        r = cdn.ns(
            cdn.pod, "setpriv", f"--reuid={UID_N}", f"--regid={UID_N}", "--clear-groups",
            "dig", "@10.204.0.9", "a.cdn.test", "+short", "+time=2", "+tries=1", check=False, timeout=30,
        )
        assert CDN_IP in r.stdout, r
        assert "8443" in set_elements(fleet, "uid_mitm_ports")
        assert as_uid(SYSTEM_PYTHON, *client_argv(cdn, CDN_IP, 8443, "a.cdn.test", ("a.cdn.test",)))["ok"]
        since, log_mark = mark(cdn), len(fleet.log_text())
        assert not as_uid(SYSTEM_PYTHON, *client_argv(cdn, CDN_IP, 8443, "b.cdn.test", ("b.cdn.test",)))["ok"]
        assert accepts(cdn, since) == []
        event = wait_refusal(fleet.log_text, log_mark, name="b.cdn.test", port=8443)
        assert event["subject"] == "s-np-uid" and event["reason"] == "sni_not_allowed"
    finally:
        unbind(fleet, "np-uid")
    assert set_elements(fleet, "uid_mitm_ports") == "[]"
