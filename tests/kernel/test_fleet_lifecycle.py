"""Daemon lifecycle against the real kernel: start-up refusals, IPv6, removal failures, shutdown."""

from __future__ import annotations

import json
import signal
import subprocess

from tests.kernel.topology import GATEWAY6, REPO, UPSTREAM_IPS, UPSTREAM_IPS6, Daemon, Topology, envelope

DPR = "sandbox.data-plane-ready"


def _run_egressd(topo: Topology, env: dict[str, str], *pre: str) -> subprocess.CompletedProcess[str]:
    rules = topo.workdir / "rules"
    rules.mkdir(exist_ok=True)
    full = {
        "OPENSANDBOX_EGRESS_PROFILE": "fleet",
        "EGRESSD_ALWAYS_RULES_DIR": str(rules),
        "OPENSANDBOX_EGRESS_HTTP_ADDR": "127.0.0.1:18199",
        "EGRESSD_NFT_TABLE": "egt-refuse",
        **env,
    }
    cmd = ["ip", "netns", "exec", topo.pod, *pre, str(REPO / ".venv" / "bin" / "egressd")]
    import os

    return subprocess.run(cmd, env={**os.environ, **full}, capture_output=True, text=True, timeout=30)


def test_startup_refused_without_net_admin(topo: Topology) -> None:
    r = _run_egressd(topo, {}, "setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin", "--")
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("egressd: nftables unusable"), r.stderr
    assert "Traceback" not in r.stderr


def test_startup_refused_when_bridge_traffic_bypasses_the_hook(topo: Topology) -> None:
    topo.ns(topo.pod, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0")
    try:
        r = _run_egressd(topo, {})
        assert r.returncode != 0
        assert "bridge-nf-call-iptables" in r.stderr.splitlines()[-1]
    finally:
        topo.ns(topo.pod, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")


def test_startup_refused_when_bridged_ipv6_bypasses_the_hook(topo: Topology) -> None:
    topo.ns(topo.pod, "sysctl", "-qw", "net.bridge.bridge-nf-call-ip6tables=0")
    try:
        r = _run_egressd(topo, {})
        assert r.returncode == 1
        last = r.stderr.splitlines()[-1]
        assert "bridge-nf-call-ip6tables" in last and "bridge-nf-call-iptables " not in last
    finally:
        topo.ns(topo.pod, "sysctl", "-qw", "net.bridge.bridge-nf-call-ip6tables=1")


def test_startup_refuses_bad_config_with_one_line(topo: Topology) -> None:
    r = _run_egressd(topo, {"OPENSANDBOX_EGRESS_HTTP_ADDR": "0.0.0.0:18199"})
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "loopback" in r.stderr
    bad_rules = topo.workdir / "badrules"
    bad_rules.mkdir(exist_ok=True)
    (bad_rules / "deny.always").write_text("ok.example.com\n*bad*\n")
    r = _run_egressd(topo, {"EGRESSD_ALWAYS_RULES_DIR": str(bad_rules)})
    assert r.returncode == 1
    assert "deny.always:2" in r.stderr


def test_ipv6_sandbox_dispatch(topo: Topology, daemon: Daemon) -> None:
    ip6 = topo.sb_ip6(1)
    policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": UPSTREAM_IPS6[0]}]}
    code, body = daemon.post(
        envelope("SET_BINDING", "v6sb", ip=ip6, gateway=GATEWAY6, policy=json.dumps(policy))
    )
    assert code == 200, body
    assert not topo.reaches(1, UPSTREAM_IPS6[0])
    assert daemon.post(envelope("LIFECYCLE_HOOK", "v6sb", hook=DPR))[0] == 200
    assert topo.reaches(1, UPSTREAM_IPS6[0])
    assert not topo.reaches(1, UPSTREAM_IPS6[1])
    # The v4 address of the same namespace is a different, unknown source.
    assert not topo.reaches(1, UPSTREAM_IPS[0])
    assert ip6 in daemon.map_keys("dispatch_v6")
    assert daemon.post(envelope("REMOVE_BINDING", "v6sb"))[0] == 200
    assert daemon.map_keys("dispatch_v6") == set()


def test_failed_removal_keeps_subject_registered_and_retry_resumes(topo: Topology, daemon: Daemon) -> None:
    policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": UPSTREAM_IPS[0]}]}
    assert daemon.post(envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=json.dumps(policy)))[0] == 200
    assert daemon.post(envelope("LIFECYCLE_HOOK", "sb1", hook=DPR))[0] == 200
    # Someone else's rule references the subject's set: the kernel refuses to delete it.
    daemon.nft("add", "chain", "inet", daemon.table, "sabotage")
    daemon.nft("add", "rule", "inet", daemon.table, "sabotage", "ip", "daddr", "@subj_s_sb1_allow_v4", "drop")
    code, body = daemon.post(envelope("REMOVE_BINDING", "sb1"))
    assert code == 500, body
    # Still registered, still enforcing exactly as before (the batch was atomic).
    assert "subj_s_sb1" in daemon.object_names()
    assert topo.reaches(1, UPSTREAM_IPS[0])
    subjects = json.loads(daemon.get("/v1/subjects")[1])["subjects"]
    assert [s["uid"] for s in subjects] == ["sb1"]
    daemon.nft("delete", "chain", "inet", daemon.table, "sabotage")
    assert daemon.post(envelope("REMOVE_BINDING", "sb1")) == (200, "{}")
    assert not any("sb1" in n for n in daemon.object_names())
    assert not topo.reaches(1, UPSTREAM_IPS[0])


def test_sigterm_exits_cleanly_and_keeps_the_table(topo: Topology, daemon: Daemon) -> None:
    policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": UPSTREAM_IPS[0]}]}
    assert daemon.post(envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=json.dumps(policy)))[0] == 200
    proc = daemon.proc
    assert proc is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    daemon.proc = None
    # Still denying after the daemon is gone: the next start resets it.
    assert "subj_s_sb1" in daemon.object_names()
    assert not topo.reaches(1, UPSTREAM_IPS[0])


def test_no_binding_input_in_logs(topo: Topology, daemon: Daemon) -> None:
    planted = "planted-value-7f3a"
    policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": f"{planted}.example.com"}]}
    assert daemon.post(envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=json.dumps(policy)))[0] == 200
    assert (
        daemon.post(envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy="not-json " + planted))[0] == 400
    )
    assert daemon.post(envelope("LIFECYCLE_HOOK", "sb1", hook=DPR))[0] == 200
    assert planted not in daemon.log_text()
    assert planted not in daemon.get("/metrics")[1]
