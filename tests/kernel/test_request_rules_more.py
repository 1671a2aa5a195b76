"""Request rules (docs/reference/behaviour.md §19): the sidecar profile, and a fleet with
``EGRESSD_NAME_CHECK=off`` (request rules are enforced whether or not names are checked), in
the CDN-shaped topology of tests/kernel/cdn.py (one daemon at a time: each test starts its own)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import DPR, XIO_IP, Webhook, cdn_topology, learn, mark, mitm_env, policy
from tests.kernel.sidecar import Sidecar
from tests.kernel.test_request_rules import HTTP_RULE, VECTOR, raw, req, statuses, upstream_paths
from tests.kernel.topology import Daemon, Topology, envelope


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egr{os.getpid()}", sandboxes=1)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(cdn: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(cdn, sb=1).with_mitm()
    sc.env["OPENSANDBOX_EGRESS_POLICY_FILE"] = str(cdn.workdir / "req-sidecar-policy.json")
    sc.start()
    try:
        yield sc
    finally:
        print(sc.log_text()[-6000:])
        sc.cleanup()


def test_the_sidecar_judges_requests(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(policy(*VECTOR))
    learn(cdn, 1, "api.x.io", XIO_IP)
    ca = sidecar.mitm_confdir / "mitmproxy-ca-cert.pem"
    since, log_mark = mark(cdn), len(sidecar.log_text())
    data = b"".join(
        [
            req("GET", "/repos/o/r"),
            req("POST", "/repos/o/r/issues", body=b"{}"),
            req("POST", "/repos/o/r/pulls", body=b"{}"),
            req("DELETE", "/repos/o/r"),
            req("GET", "/user"),
        ]
    )
    out = raw(cdn, 1, data, expect=5, ca=ca)
    assert statuses(out) == [200, 200, 403, 403, 403], out
    assert out["responses"][4]["body"]["subject"] == "s-sidecar"
    assert upstream_paths(cdn, since) == [("api.x.io", "/repos/o/r"), ("api.x.io", "/repos/o/r/issues")]
    assert statuses(raw(cdn, 1, req("GET", "/repos/%2e%2e/user"), ca=ca)) == [403]
    assert upstream_paths(cdn, since)[2:] == []
    # A narrowing through the sidecar's own API applies to the next request.
    sidecar.set_policy(policy(VECTOR[1]))
    assert statuses(raw(cdn, 1, req("GET", "/repos/o/r"), ca=ca)) == [403]
    assert "mitm.request_refused" in sidecar.log_text()[log_mark:]
    code, text = sidecar.api("GET", "/metrics")
    m = re.search(r'^egressd_subject_dropped_packets_total\{subject="s-sidecar"[^}]*\} (\d+)', text, re.M)
    assert code == 200 and m is not None and int(m.group(1)) >= 4, text


def test_request_rules_are_enforced_with_the_name_check_off(cdn: Topology) -> None:
    hook = Webhook(cdn, cdn.pod, "127.0.0.1", 18551, "req-off")
    env = {**mitm_env(cdn, "req"), "EGRESSD_NAME_CHECK": "off", "OPENSANDBOX_EGRESS_DENY_WEBHOOK": hook.url}
    d = Daemon(cdn, table="egt-req-off", port=18550, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        pol = policy(*VECTOR, HTTP_RULE)  # port 80 open only by a rule that names http (§18)
        assert d.post(envelope("SET_BINDING", "off1", ip=Topology.sb_ip(1), policy=pol)) == (200, "{}")
        assert d.post(envelope("LIFECYCLE_HOOK", "off1", hook=DPR)) == (200, "{}")
        learn(cdn, 1, "api.x.io", XIO_IP)
        since = mark(cdn)
        out = raw(cdn, 1, req("GET", "/repos/o/r") + req("DELETE", "/repos/o/r"), expect=2)
        assert statuses(out) == [200, 403], out
        out = raw(cdn, 1, req("GET", "/user"), port=80)
        assert statuses(out) == [403], out
        out = raw(cdn, 1, b"GET /repos/o/r HTTP/1.0\r\n\r\n", port=80)  # no host at all
        assert statuses(out) == [403] and out["responses"][0]["body"]["reason"] == "no_host", out
        assert upstream_paths(cdn, since) == [("api.x.io", "/repos/o/r")]
        post = hook.wait_for("api.x.io")
        assert post["method"] in ("DELETE", "GET") and post["sandboxId"] == "off1"
    finally:
        if d.proc is not None:
            cdn.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        cdn.stop(hook.proc)
        print(d.log_text()[-4000:])


def test_without_the_mitm_request_rules_are_refused(cdn: Topology) -> None:
    with Daemon(cdn, table="egt-req-nomitm", port=18552, env={}).running() as d:
        code, text = d.post(envelope("SET_BINDING", "nomitm", ip=Topology.sb_ip(1), policy=policy(*VECTOR)))
        assert code == 400 and "need the MITM" in text, text
        assert d.post(envelope("SET_BINDING", "nomitm", ip=Topology.sb_ip(1), policy=policy())) == (200, "{}")


def test_an_ignored_host_is_never_relayed_unjudged(cdn: Topology) -> None:
    """OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS makes mitmproxy relay a host from its first
    byte; request rules on it must still hold: plain HTTP is parsed and judged, TLS (which cannot
    be judged without decryption) is refused before any upstream connection."""
    env = {**mitm_env(cdn, "req"), "EGRESSD_NAME_CHECK": "off",
           "OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS": r"^api\.x\.io"}  # fmt: skip
    with Daemon(cdn, table="egt-req-ign", port=18553, env=env).running() as d:
        pol = policy(*VECTOR, HTTP_RULE)
        assert d.post(envelope("SET_BINDING", "ign1", ip=Topology.sb_ip(1), policy=pol)) == (200, "{}")
        assert d.post(envelope("LIFECYCLE_HOOK", "ign1", hook=DPR)) == (200, "{}")
        learn(cdn, 1, "api.x.io", XIO_IP)
        since = mark(cdn)
        # Plain HTTP on 80 (open by the http rule) is parsed and judged, not relayed.
        assert statuses(raw(cdn, 1, req("GET", "/user"), port=80)) == [403]
        assert statuses(raw(cdn, 1, req("DELETE", "/repos/o/r"), port=80)) == [403]
        # TLS: judged (decrypted) or refused, never relayed unjudged.
        out = raw(cdn, 1, req("GET", "/user") + req("DELETE", "/repos/o/r"), expect=2)
        assert not out["ok"] or statuses(out) == [403, 403], out
        assert upstream_paths(cdn, since) == []
