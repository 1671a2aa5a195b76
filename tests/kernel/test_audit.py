"""Audit (shadow) mode against the real kernel: real dig/curl from sandbox namespaces, the
daemon's own log, its /metrics and the kernel's counters."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.test_fleet_enforcement import _keepalive
from tests.kernel.topology import GATEWAY, UP_NET, Daemon, Topology, envelope

DPR = "sandbox.data-plane-ready"
A_IP, B_IP, APEX_IP, API_IP = f"{UP_NET}.2", f"{UP_NET}.3", f"{UP_NET}.5", f"{UP_NET}.6"
NESTED_IP, BLOCKED_IP = f"{UP_NET}.7", f"{UP_NET}.8"
EVIDENCE = r"decision=([0-9a-f]{12}) subject=(\S+) rule=(\S+)"


def audit_policy(*allow: str, deny: tuple[str, ...] = (), mode: str = "audit") -> dict[str, object]:
    egress = [{"action": "allow", "target": t} for t in allow] + [
        {"action": "deny", "target": t} for t in deny
    ]
    return {"defaultAction": "deny", "mode": mode, "egress": egress}


def bind(d: Daemon, i: int, policy: object, *, uid: str | None = None) -> str:
    uid = uid or f"sb{i}"
    code, body = d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(i), policy=policy))
    assert (code, body) == (200, "{}"), body
    return uid


def activate(d: Daemon, uid: str) -> None:
    code, body = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
    assert (code, body) == (200, "{}"), body


def dig_ede(topo: Topology, sb: int, name: str) -> tuple[str, list[str], list[tuple[int, str]]]:
    """(status, answers, [(EDE info code, extra text)]) of a real dig (EDNS on, as by default)."""
    args = ["dig", f"@{GATEWAY}", name, "A", "+time=2", "+tries=1", "+noall", "+comments", "+answer"]
    out = topo.ns(topo.sb(sb), *args, check=False, timeout=15).stdout
    status, answers, edes = "TIMEOUT", [], []
    for line in out.splitlines():
        if "status:" in line:
            status = line.split("status:", 1)[1].split(",", 1)[0].strip()
        elif m := re.match(r"; EDE: (\d+) \([^)]*\): \((.*)\)$", line):
            edes.append((int(m.group(1)), m.group(2)))
        elif line and not line.startswith(";"):
            answers.append(line.split()[-1])
    return status, answers, edes


def openmetrics(d: Daemon) -> str:
    code, body = d._curl("-H", "Accept: application/openmetrics-text", f"http://127.0.0.1:{d.port}/metrics")
    assert code == 200
    return body


def counter_packets(d: Daemon, name: str) -> int:
    r = d.topo.ns(d.topo.pod, "nft", "-j", "list", "counter", "inet", d.table, name, check=False)
    assert r.returncode == 0, r.stderr
    listing = json.loads(r.stdout)
    return int(next(i["counter"]["packets"] for i in listing["nftables"] if "counter" in i))


def log_lines_with(d: Daemon, needle: str) -> list[dict[str, object]]:
    out = []
    for line in d.log_text().splitlines():
        if needle in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def wait_for(pred: object, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_audit_subject_passes_would_deny_names_and_ips_and_one_id_explains_it(
    topo: Topology, daemon: Daemon
) -> None:
    bind(daemon, 1, audit_policy("a.test", deny=(API_IP,)))
    activate(daemon, "sb1")

    # DNS: a name the policy would deny is forwarded and answered, with EDE 0 "Other".
    status, answers, edes = dig_ede(topo, 1, "b.test")
    assert (status, answers) == ("NOERROR", [B_IP])
    assert "b.test" in topo.upstream_queries()
    [(code, text)] = edes
    assert code == 0
    m = re.fullmatch(EVIDENCE, text)
    assert m is not None and m.group(2, 3) == ("s-sb1", "default")
    decision_id = m.group(1)
    # The same id, subject and rule in the daemon's log line ...
    assert wait_for(lambda: log_lines_with(daemon, decision_id))
    [line] = log_lines_with(daemon, decision_id)
    assert str(line["event"]).startswith("[dns] would-deny query (remote=10.203.0.11 question=b.test.")
    assert text in str(line["event"])
    assert (line["decision_id"], line["subject"], line["rule"], line["audit"]) == (
        decision_id,
        "s-sb1",
        "default",
        True,
    )
    # ... and as the exemplar of the would-deny metric.
    assert (
        f'egressd_policy_would_deny_total{{subject="s-sb1",layer="dns",rule="default"}} 1 '
        f'# {{decision_id="{decision_id}"}}'
    ) in openmetrics(daemon)

    # An allowed name: no EDE, nothing counted.
    assert dig_ede(topo, 1, "a.test") == ("NOERROR", [A_IP], [])

    # IP layer: the would-deny name's address, any other address and a user-denied address pass.
    assert topo.reaches(1, B_IP)
    assert topo.reaches(1, APEX_IP)
    assert topo.reaches(1, API_IP)
    assert topo.reaches(1, A_IP)
    # Evidence: per-subject kernel counters (new flows), exported as the ip layer of the metric.
    assert counter_packets(daemon, "subj_s_sb1_audit_default") >= 2
    assert counter_packets(daemon, "subj_s_sb1_audit_deny") >= 1
    text_metrics = daemon.get("/metrics")[1]
    assert re.search(
        r'egressd_policy_would_deny_total\{subject="s-sb1",layer="ip",rule="default"\} [1-9]', text_metrics
    )
    assert re.search(
        r'egressd_policy_would_deny_total\{subject="s-sb1",layer="ip",rule="egress-deny"\} [1-9]',
        text_metrics,
    )
    assert "# {" not in text_metrics  # exemplars only in OpenMetrics
    # Reported as audit mode, without touching the SDK's "mode" field.
    code, body = daemon.get("/v1/subjects")
    assert json.loads(body)["subjects"][0]["auditMode"] is True


def test_enforcing_denial_is_nxdomain_with_ede_blocked_and_the_logged_id(
    topo: Topology, daemon: Daemon
) -> None:
    bind(daemon, 2, audit_policy("a.test", mode="enforce"))
    activate(daemon, "sb2")
    # The upstream's log is the session's: earlier modules (test_hardening_leases) ask it this name.
    asked_before = len(topo.upstream_queries())
    status, answers, edes = dig_ede(topo, 2, "secret-exfil.test")
    assert (status, answers) == ("NXDOMAIN", [])
    assert "secret-exfil.test" not in topo.upstream_queries()[asked_before:]
    [(code, text)] = edes
    assert code == 15  # Blocked
    m = re.fullmatch(EVIDENCE, text)
    assert m is not None and m.group(2, 3) == ("s-sb2", "default")
    assert wait_for(lambda: log_lines_with(daemon, m.group(1)))
    [line] = log_lines_with(daemon, m.group(1))
    assert str(line["event"]).startswith("[dns] denied query (remote=10.203.0.12 question=secret-exfil.test.")
    assert (
        f'egress_policy_denied_total 1 # {{decision_id="{m.group(1)}",rule="default",subject="s-sb2"}}'
        in (openmetrics(daemon))
    )
    assert not topo.reaches(2, B_IP)
    assert counter_packets(daemon, "subj_s_sb2_audit_default") == 0
    code, body = daemon.get("/v1/subjects")
    assert json.loads(body)["subjects"][0]["auditMode"] is False


def test_switching_audit_to_enforce_cuts_the_would_deny_access(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, audit_policy("a.test"))
    activate(daemon, "sb1")
    assert dig_ede(topo, 1, "b.test")[:2] == ("NOERROR", [B_IP])
    assert topo.reaches(1, B_IP) and topo.reaches(1, APEX_IP)
    holder = _keepalive(topo, 1, APEX_IP)  # an established would-deny flow
    time.sleep(1.0)
    bind(daemon, 1, audit_policy("a.test", mode="enforce"))  # same fence: in place
    out, _ = holder.communicate(timeout=15)
    assert out.split()[-1] == "dead", "an audited flow survived the switch to enforce: " + out
    status, _, edes = dig_ede(topo, 1, "b.test")
    assert status == "NXDOMAIN" and edes[0][0] == 15
    assert not topo.reaches(1, B_IP), "an address answered in audit mode outlived it"
    assert not topo.reaches(1, APEX_IP)
    assert dig_ede(topo, 1, "a.test")[:2] == ("NOERROR", [A_IP])
    assert topo.reaches(1, A_IP)


def test_denying_subject_with_an_audit_policy_pending_stays_fully_closed(
    topo: Topology, daemon: Daemon
) -> None:
    wide = {"defaultAction": "allow", "mode": "audit", "egress": []}
    bind(daemon, 1, wide)  # no data-plane-ready: deny-first
    status, _, edes = dig_ede(topo, 1, "a.test")
    assert status == "NXDOMAIN" and edes == [(15, edes[0][1])] and edes[0][1].endswith("rule=denying")
    assert not topo.reaches(1, A_IP)
    assert not topo.reaches(1, B_IP)
    assert counter_packets(daemon, "subj_s_sb1_audit_default") == 0
    assert json.loads(daemon.get("/v1/subjects")[1])["subjects"][0]["auditMode"] is False
    # Active in audit, then reverted by SET_BINDING(null): closed again at once.
    bind(daemon, 1, audit_policy("a.test"))
    activate(daemon, "sb1")
    assert topo.reaches(1, B_IP)
    bind(daemon, 1, None)
    assert not topo.reaches(1, B_IP)
    assert dig_ede(topo, 1, "a.test")[0] == "NXDOMAIN"


@pytest.fixture
def always_daemon(topo: Topology) -> Iterator[Daemon]:
    rules = Path(topo.workdir) / "always-audit"
    rules.mkdir(exist_ok=True)
    (rules / "deny.always").write_text(f"example.test\n{NESTED_IP}\n")
    d = Daemon(topo, table="egt-audit-always", port=18196, env={"EGRESSD_ALWAYS_RULES_DIR": str(rules)})
    d.start()
    try:
        yield d
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)


def test_audit_never_opens_always_deny_lateral_or_dot(topo: Topology, always_daemon: Daemon) -> None:
    d = always_daemon
    topo.spawn(topo.sb(3), "python3", "-m", "http.server", "8000", "--bind", topo.sb_ip(3))
    bind(d, 1, {"defaultAction": "allow", "mode": "audit", "egress": [{"action": "deny", "target": A_IP}]})
    activate(d, "sb1")
    bind(d, 3, audit_policy())
    activate(d, "sb3")
    time.sleep(0.3)
    # Operator always-deny: hard, at both layers, and not counted as a would-deny.
    status, _, edes = dig_ede(topo, 1, "example.test")
    assert status == "NXDOMAIN" and edes[0][0] == 15 and edes[0][1].endswith("rule=always-deny[0]")
    assert not topo.reaches(1, NESTED_IP)
    # The header's drops: sandbox to sandbox, DoT.
    assert topo.curl(1, f"http://{topo.sb_ip(3)}:8000/") == 0
    assert not topo.reaches(1, A_IP, port=853)
    # What audit does open: the user's own deny rule (counted as egress-deny).
    assert topo.reaches(1, A_IP)
    assert topo.reaches(1, BLOCKED_IP)
    assert counter_packets(d, "subj_s_sb1_audit_deny") >= 1
