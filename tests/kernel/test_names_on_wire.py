"""Names on the wire, fleet profile (docs/reference/behaviour.md §18), with real packets through
the real MITM in a CDN-shaped topology (tests/kernel/cdn.py): one upstream address serves
a.cdn.test and b.cdn.test; a policy that allows only a.cdn.test must not let a sandbox reach
b.cdn.test by resolving the allowed name and naming the other in its SNI or Host.

A refusal must never reach the upstream: the upstream records every TCP connection at
accept, and a refused one leaves no record. It is counted in the subject's drop counter,
logged as ``mitm.name_refused`` (subject, name, address, port, reason) and posted to the deny
webhook.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    CDN_POLICY,
    CDN_RULES,
    DENY_IP,
    DPR,
    OTHER_IP,
    SYSTEM_PYTHON,
    XIO_IP,
    Webhook,
    accepts,
    allow,
    cdn_topology,
    client_argv,
    deny,
    dropped,
    http,
    learn,
    mark,
    mitm_env,
    parse_client,
    policy,
    requests,
    tls,
    wait_refusal,
)
from tests.kernel.topology import REPO, Daemon, Topology, envelope

HTTP_PORT, WEBHOOK_PORT = 18520, 18521
UID_A = 100011  # a host-uid sandbox (docs/reference/behaviour.md §17)


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egn{os.getpid()}", sandboxes=3)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def hook(cdn: Topology) -> Iterator[Webhook]:
    w = Webhook(cdn, cdn.pod, "127.0.0.1", WEBHOOK_PORT, "names")
    yield w
    cdn.stop(w.proc)


@pytest.fixture(scope="module")
def fleet(cdn: Topology, hook: Webhook) -> Iterator[Daemon]:
    env = {
        **mitm_env(cdn, "names"),
        "OPENSANDBOX_EGRESS_DENY_WEBHOOK": hook.url,
        # An ignored host is relayed by mitmproxy from the first byte (docs/reference/behaviour.md §16):
        # its name is checked all the same (the wildcard test below).
        "OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS": r"^w\.x\.io$",
        "EGRESSD_UID_MAX_SUBJECTS": "4",
        "EGRESSD_UID_DNS_PORT_BASE": "16100",
    }
    d = Daemon(cdn, table="egt-names", port=HTTP_PORT, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            cdn.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        print(d.log_text()[-8000:])


def bind(d: Daemon, sb: int, uid: str, pol: object) -> None:
    assert d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(sb), policy=pol)) == (200, "{}")
    assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")


def unbind(d: Daemon, uid: str) -> None:
    d.post(envelope("REMOVE_BINDING", uid))


@pytest.fixture
def sb1(fleet: Daemon) -> Iterator[str]:
    bind(fleet, 1, "names1", CDN_POLICY)
    yield "names1"
    unbind(fleet, "names1")


# ---------------------------------------------------------------------------------------------


def test_sni_of_another_name_on_the_shared_address_is_refused_before_the_upstream(
    cdn: Topology, fleet: Daemon, hook: Webhook, sb1: str
) -> None:
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    since = mark(cdn)
    ok = tls(cdn, 1, CDN_IP, "a.cdn.test")
    assert ok["ok"] and ok["responses"][0]["body"]["sni"] == "a.cdn.test", ok
    assert len(accepts(cdn, since, CDN_IP)) == 1

    drops_before = dropped(fleet, "s-names1")
    log_mark = len(fleet.log_text())
    since = mark(cdn)
    spoofed = tls(cdn, 1, CDN_IP, "b.cdn.test")
    assert not spoofed["ok"] and spoofed["error"] in ("ConnectionResetError", "SSLEOFError", "SSLError"), spoofed
    assert accepts(cdn, since) == []  # no upstream connection was ever opened
    event = wait_refusal(fleet.log_text, log_mark, name="b.cdn.test")
    assert (event["subject"], event["dst"], event["port"], event["reason"]) == (
        "s-names1",
        CDN_IP,
        443,
        "sni_not_allowed",
    )
    assert dropped(fleet, "s-names1") >= drops_before + 1
    post = hook.wait_for("b.cdn.test")
    assert post["sandboxId"] == "names1" and post["source"] == "opensandbox-egress"
    # egressctl subjects' document: the same count, and the name among the recent denials.
    (doc,) = [d for d in json.loads(fleet.get("/v1/subjects")[1])["subjects"] if d["uid"] == "names1"]
    assert doc["droppedPackets"] >= 1 and "b.cdn.test" in [x["name"] for x in doc["recentDenials"]]
    # The allowed name still passes on the same address afterwards.
    assert tls(cdn, 1, CDN_IP, "a.cdn.test")["ok"]


def test_a_narrowing_applies_to_the_next_connection(cdn: Topology, fleet: Daemon) -> None:
    """Workers remember admissions (answered from memory, docs/reference/behaviour.md §10): a policy
    change that denies a name must still refuse it on the very next connection, also while the
    address stays open for another name that taught it."""
    bind(fleet, 2, "names-narrow", policy(allow("a.cdn.test"), allow("b.cdn.test")))
    try:
        learn(cdn, 2, "a.cdn.test", CDN_IP)
        learn(cdn, 2, "b.cdn.test", CDN_IP)
        for _ in range(2):
            assert tls(cdn, 2, CDN_IP, "a.cdn.test")["ok"]
            assert http(cdn, 2, CDN_IP, "a.cdn.test")["responses"][0]["status"] == 200
        bind(fleet, 2, "names-narrow", policy(allow("b.cdn.test")))
        since = mark(cdn)
        assert not tls(cdn, 2, CDN_IP, "a.cdn.test")["ok"]
        assert http(cdn, 2, CDN_IP, "a.cdn.test")["responses"][0]["status"] == 403
        assert accepts(cdn, since) == []
        assert tls(cdn, 2, CDN_IP, "b.cdn.test")["ok"]  # the lease b.cdn.test taught stays
    finally:
        unbind(fleet, "names-narrow")


def test_host_spoofing_on_port_80_is_answered_403_and_the_connection_stays(
    cdn: Topology, fleet: Daemon, sb1: str
) -> None:
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    since, log_mark = mark(cdn), len(fleet.log_text())
    out = http(cdn, 1, CDN_IP, "a.cdn.test", "b.cdn.test", "a.cdn.test")
    assert out["ok"], out
    first, spoofed, again = out["responses"]
    assert first["status"] == 200 and first["body"]["host"] == "a.cdn.test"
    assert spoofed["status"] == 403
    assert spoofed["body"]["reason"] == "host_not_allowed" and spoofed["body"]["host"] == "b.cdn.test"
    assert again["status"] == 200  # the connection stayed
    assert [r["host"] for r in requests(cdn, since)] == ["a.cdn.test", "a.cdn.test"]
    event = wait_refusal(fleet.log_text, log_mark, name="b.cdn.test")
    assert (event["reason"], event["port"], event["dst"]) == ("host_not_allowed", 80, CDN_IP)

    # A connection whose first request is spoofed opens nothing upstream; plain HTTP on 443 too.
    since = mark(cdn)
    out = http(cdn, 1, CDN_IP, "b.cdn.test")
    assert out["responses"][0]["status"] == 403
    out = http(cdn, 1, CDN_IP, "b.cdn.test", port=443)
    assert out["responses"][0]["status"] == 403, out
    assert out["responses"][0]["body"]["reason"] == "host_not_allowed"
    assert accepts(cdn, since) == []


def test_tls_without_sni_needs_an_address_rule(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    since, log_mark = mark(cdn), len(fleet.log_text())
    out = tls(cdn, 1, CDN_IP, None, host="a.cdn.test")
    assert not out["ok"], out
    assert accepts(cdn, since) == []
    event = wait_refusal(fleet.log_text, log_mark, reason="no_sni")
    assert event["dst"] == CDN_IP and event["name"] is None
    # An allow CIDR rule opens the address itself: any name, and no name, pass.
    bind(fleet, 1, "names1", policy(*CDN_RULES, allow(f"{CDN_IP}/32")))
    out = tls(cdn, 1, CDN_IP, None, host="a.cdn.test")
    assert out["ok"] and out["responses"][0]["body"]["sni"] is None, out
    assert tls(cdn, 1, CDN_IP, "b.cdn.test")["ok"]


def test_a_cname_chain_admits_the_query_name_and_nothing_else(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    learn(cdn, 1, "www.cdn.test", CDN_IP)  # www.cdn.test -> edge.cdnhost.test -> 10.204.0.3
    out = tls(cdn, 1, CDN_IP, "www.cdn.test")
    assert out["ok"] and out["responses"][0]["body"]["sni"] == "www.cdn.test", out
    since = mark(cdn)
    assert not tls(cdn, 1, CDN_IP, "edge.cdnhost.test")["ok"]  # the chain's target: no rule allows it
    assert not tls(cdn, 1, CDN_IP, "b.cdn.test")["ok"]
    assert accepts(cdn, since) == []


def test_a_wildcard_rule_admits_only_names_that_taught_the_address(
    cdn: Topology, fleet: Daemon, sb1: str
) -> None:
    learn(cdn, 1, "api.x.io", XIO_IP)
    assert tls(cdn, 1, XIO_IP, "api.x.io")["ok"]
    since, log_mark = mark(cdn), len(fleet.log_text())
    # w.x.io is in the ignore list too: relayed from the first byte, checked all the same.
    assert not tls(cdn, 1, XIO_IP, "w.x.io")["ok"]  # allowed by *.x.io, but not what taught it
    assert http(cdn, 1, XIO_IP, "w.x.io")["responses"][0]["status"] == 403
    assert accepts(cdn, since) == []
    assert wait_refusal(fleet.log_text, log_mark, name="w.x.io")["reason"] == "sni_not_learned"
    learn(cdn, 1, "w.x.io", XIO_IP)
    assert tls(cdn, 1, XIO_IP, "w.x.io")["ok"]
    assert http(cdn, 1, XIO_IP, "w.x.io")["responses"][0]["status"] == 200
    # An allowed name learned on another address does not open this one.
    learn(cdn, 1, "c.cdn.test", OTHER_IP)
    assert not tls(cdn, 1, CDN_IP, "c.cdn.test")["ok"]


def test_a_name_allowed_on_443_only_is_refused_on_80(cdn: Topology, fleet: Daemon) -> None:
    bind(fleet, 2, "names-port", policy(allow("a.cdn.test", ports=[443])))
    try:
        learn(cdn, 2, "a.cdn.test", CDN_IP)
        assert tls(cdn, 2, CDN_IP, "a.cdn.test")["ok"]
        since, log_mark = mark(cdn), len(fleet.log_text())
        out = http(cdn, 2, CDN_IP, "a.cdn.test")
        assert accepts(cdn, since) == []
        if out["responses"]:  # the MITM's answer (a kernel that scopes the lease to 443 drops it first)
            assert out["responses"][0]["status"] == 403
            assert out["responses"][0]["body"]["reason"] == "port_not_allowed"
            assert wait_refusal(fleet.log_text, log_mark, name="a.cdn.test")["port"] == 80
        else:
            assert not out["ok"], out
    finally:
        unbind(fleet, "names-port")


def test_a_denied_name_is_refused_by_sni_and_host_on_any_address_under_default_allow(
    cdn: Topology, fleet: Daemon
) -> None:
    bind(fleet, 2, "names2", policy(deny("evil.test"), default="allow"))
    try:
        since, log_mark = mark(cdn), len(fleet.log_text())
        for ip in (DENY_IP, CDN_IP):
            assert not tls(cdn, 2, ip, "evil.test")["ok"]
            out = http(cdn, 2, ip, "evil.test")
            assert out["responses"][0]["status"] == 403, out
        assert accepts(cdn, since) == []
        event = wait_refusal(fleet.log_text, log_mark, name="evil.test", port=443)
        assert event["reason"] == "sni_not_allowed" and event["subject"] == "s-names2"
        # Any other name (and no name) passes: defaultAction allow opens the addresses.
        assert tls(cdn, 2, DENY_IP, "good.test")["ok"]
        assert tls(cdn, 2, DENY_IP, None, host="good.test")["ok"]
        assert http(cdn, 2, DENY_IP, "good.test")["responses"][0]["status"] == 200
    finally:
        unbind(fleet, "names2")


def test_status_and_egressctl_say_the_name_check_is_on(fleet: Daemon) -> None:
    status = fleet.status()
    assert status["nameCheck"] is True
    r = fleet.topo.ns(
        fleet.topo.pod,
        str(REPO / ".venv" / "bin" / "egressctl"),
        "--addr",
        f"127.0.0.1:{fleet.port}",
        "status",
        check=False,
    )
    assert "name-check" in r.stdout and "on" in r.stdout.split("name-check", 1)[1].splitlines()[0], r.stdout


def test_decrypted_connections_are_name_checked_too(cdn: Topology, fleet: Daemon) -> None:
    """A subject whose vault binds a.cdn.test gets that name decrypted (docs/reference/behaviour.md §16);
    another name on the same address is refused before any upstream connection all the same."""
    bind(fleet, 3, "names3", CDN_POLICY)
    try:
        vault = {
            "credentials": [{"name": "key", "source": {"type": "inline", "value": "sk-names-5150"}}],
            "bindings": [
                {"name": "a", "match": {"hosts": ["a.cdn.test"]}, "auth": {"type": "bearer", "credential": "key"}}
            ],
        }
        path = cdn.workdir / "names-vault.json"
        path.write_text(json.dumps(vault))
        code, text = fleet._curl(
            "-X", "PUT", "-H", "Content-Type: application/json", "--data-binary", f"@{path}",
            f"http://127.0.0.1:{fleet.port}/v1/sandboxfleets/names3/egress/credential-vault",
        )  # fmt: skip
        assert code == 201, text
        bundle = cdn.workdir / "names-bundle.pem"
        bundle.write_text((cdn.workdir / "names-mitm-conf" / "mitmproxy-ca-cert.pem").read_text())
        learn(cdn, 3, "a.cdn.test", CDN_IP)
        ok = tls(cdn, 3, CDN_IP, "a.cdn.test", ca=bundle)  # only the MITM CA: decrypted
        assert ok["ok"] and ok["responses"][0]["body"]["sni"] == "a.cdn.test", ok
        since, log_mark = mark(cdn), len(fleet.log_text())
        assert not tls(cdn, 3, CDN_IP, "b.cdn.test")["ok"]
        assert accepts(cdn, since) == []
        assert wait_refusal(fleet.log_text, log_mark, name="b.cdn.test")["subject"] == "s-names3"
    finally:
        unbind(fleet, "names3")


def as_uid(t: Topology, uid: int, *cmd: str) -> subprocess.CompletedProcess[str]:
    return t.ns(
        t.pod, "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd, check=False, timeout=30
    )


def test_host_uid_subjects_are_name_checked(cdn: Topology, fleet: Daemon) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    body = json.dumps(CDN_POLICY)
    env = envelope("SET_BINDING", "names-uid", ip=None, policy=body)
    env["attachment"] = {"process": {"uid": UID_A}}
    assert fleet.post(env) == (200, "{}")
    assert fleet.post(envelope("LIFECYCLE_HOOK", "names-uid", hook=DPR)) == (200, "{}")
    try:
        r = as_uid(cdn, UID_A, "dig", "@10.204.0.9", "a.cdn.test", "+short", "+time=2", "+tries=1")
        assert CDN_IP in r.stdout, r
        ok = as_uid(cdn, UID_A, SYSTEM_PYTHON, *client_argv(cdn, CDN_IP, 443, "a.cdn.test", ("a.cdn.test",)))
        assert parse_client(ok.stdout, ok.stderr)["ok"], ok
        since, log_mark = mark(cdn), len(fleet.log_text())
        bad = as_uid(cdn, UID_A, SYSTEM_PYTHON, *client_argv(cdn, CDN_IP, 443, "b.cdn.test", ("b.cdn.test",)))
        assert not parse_client(bad.stdout, bad.stderr)["ok"]
        spoofed = as_uid(cdn, UID_A, SYSTEM_PYTHON, *client_argv(cdn, CDN_IP, 80, None, ("b.cdn.test",)))
        assert parse_client(spoofed.stdout, spoofed.stderr)["responses"][0]["status"] == 403
        assert accepts(cdn, since) == []
        event = wait_refusal(fleet.log_text, log_mark, name="b.cdn.test", port=443)
        assert event["subject"] == "s-names-uid" and event["reason"] == "sni_not_allowed"
    finally:
        unbind(fleet, "names-uid")
