"""docs/reference/behaviour.md §15 against the real kernel, both profiles: refusals counted per subject, the deny
webhook posting to a real receiver, EGRESSD_DENY_REJECT making a denied connect fail at once.

Fleet tests use the session topology (egressd in the pod namespace); the sidecar tests build
their own (egressd inside sandbox 1). Receivers are stdlib HTTP servers that append every POST
body to a file: in the pod namespace for the fleet, in the upstream namespace for the sidecar
(reachable only through the sidecar's own exemption: the sandbox's policy denies it).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kernel.sidecar import Sidecar
from tests.kernel.topology import GATEWAY, UP_NET, Daemon, Topology, cleanup_stale, envelope

DPR = "sandbox.data-plane-ready"
UP_A, UP_B, UP_C = f"{UP_NET}.2", f"{UP_NET}.3", f"{UP_NET}.4"  # a.test, b.test, deep.test
CONNECT_TIMEOUT_S = 2
_tables = itertools.count(1)
_ports = itertools.count(18400)

RECEIVER = r"""
import http.server, sys
log = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(log, "ab") as f:
            f.write(self.path.encode() + b" " + self.headers.get("Content-Type", "").encode() + b" " + body + b"\n")
        self.send_response(204)
        self.end_headers()
    def log_message(self, *args):
        pass
srv = http.server.ThreadingHTTPServer((sys.argv[2], int(sys.argv[3])), H)
print("ready", flush=True)
srv.serve_forever()
"""


class Receiver:
    def __init__(self, topo: Topology, ns: str, host: str, port: int, name: str) -> None:
        self.log = topo.workdir / f"webhook-{name}.log"
        self.log.write_text("")
        self.url = f"http://{host}:{port}/deny?token=kernel-test-secret"
        self.proc = topo.spawn(
            ns, "python3", "-c", RECEIVER, str(self.log), host, str(port), ready_line="ready"
        )
        self.topo = topo

    def posts(self) -> list[tuple[str, str, dict[str, Any]]]:
        out = []
        for line in self.log.read_text().splitlines():
            path, ctype, body = line.split(" ", 2)
            out.append((path, ctype, json.loads(body)))
        return out

    def wait_posts(self, n: int, timeout: float = 10) -> list[tuple[str, str, dict[str, Any]]]:
        deadline = time.monotonic() + timeout
        while len(self.posts()) < n:
            assert time.monotonic() < deadline, f"{len(self.posts())} of {n} webhook POSTs arrived"
            time.sleep(0.05)
        return self.posts()

    def close(self) -> None:
        self.topo.stop(self.proc)


def dropped_metric(text: str, subject: str) -> int | None:
    m = re.search(
        rf'^egressd_subject_dropped_packets_total\{{subject="{re.escape(subject)}"\}} (\d+)$', text, re.M
    )
    return int(m.group(1)) if m else None


def fleet_dropped(d: Daemon, subject: str) -> int | None:
    code, text = d.get("/metrics")
    assert code == 200, text
    return dropped_metric(text, subject)


def connect_time(topo: Topology, sb: int, url: str) -> tuple[float, int]:
    """(seconds, curl exit code) of one connection attempt from sandbox ``sb``."""
    start = time.monotonic()
    r = topo.ns(
        topo.sb(sb),
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "--connect-timeout",
        str(CONNECT_TIMEOUT_S),
        "-m",
        str(CONNECT_TIMEOUT_S + 2),
        url,
        check=False,
        timeout=30,
    )
    return time.monotonic() - start, r.returncode


UDP_PROBE = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(float(sys.argv[2]))
s.connect((sys.argv[1], 9999))
start = time.monotonic()
try:
    s.send(b"probe")
    s.recv(100)
    print("answer", time.monotonic() - start)
except socket.timeout:
    print("timeout", time.monotonic() - start)
except OSError as e:
    print("error", time.monotonic() - start, e.errno)
"""


def udp_probe(topo: Topology, sb: int, ip: str) -> tuple[str, float]:
    out = topo.ns(
        topo.sb(sb), "python3", "-c", UDP_PROBE, ip, str(CONNECT_TIMEOUT_S), check=False
    ).stdout.split()
    return out[0], float(out[1])


def bind(d: Daemon, i: int, policy: dict[str, Any], *, activate: bool = True) -> None:
    uid = f"sb{i}"
    code, body = d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(i), policy=json.dumps(policy)))
    assert (code, body) == (200, "{}"), body
    if activate:
        code, body = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
        assert (code, body) == (200, "{}"), body


def mitm_env(topo: Topology, port: int) -> dict[str, str]:
    return {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(port),
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / f"vis-mitm-{port}"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / f"vis-run-{port}" / "a.sock"),
    }


@pytest.fixture
def make_daemon(topo: Topology) -> Iterator[Any]:
    started: list[Daemon] = []

    def make(env: dict[str, str] | None = None) -> Daemon:
        d = Daemon(topo, table=f"egv-{next(_tables)}", port=next(_ports), env=env or {})
        d.start(wait=False)
        started.append(d)
        d.wait_ready(timeout=30)
        return d

    try:
        yield make
    finally:
        for d in started:
            d.kill(15)
            topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)


# ---------------------------------------------------------------- fleet: counters


def test_every_refusal_is_counted_for_its_subject(topo: Topology, make_daemon: Any) -> None:
    d = make_daemon()
    bind(d, 1, {"defaultAction": "allow", "egress": [{"action": "deny", "target": UP_C}]})
    bind(d, 2, {"defaultAction": "allow", "egress": []})
    bind(d, 4, {"defaultAction": "allow"}, activate=False)  # deny-first
    assert topo.reaches(1, UP_A)
    before = fleet_dropped(d, "s-sb1")
    assert before == 0

    def refused_and_counted(probe: Any) -> None:
        prior = fleet_dropped(d, "s-sb1")
        assert prior is not None
        probe()
        after = fleet_dropped(d, "s-sb1")
        assert after is not None and after > prior

    refused_and_counted(lambda: not topo.reaches(1, UP_C))  # the subject's deny set
    refused_and_counted(lambda: topo.curl(1, f"http://{topo.sb_ip(2)}:80/", 0.5))  # lateral (forward)
    refused_and_counted(lambda: topo.curl(1, f"http://{UP_A}:853/", 0.5))  # DoT
    refused_and_counted(lambda: topo.curl(1, f"http://{GATEWAY}:15353/", 0.5))  # a direct pod port
    # Someone else's refusals are not sb1's.
    sb1 = fleet_dropped(d, "s-sb1")
    unattributed = fleet_dropped(d, "-")
    assert unattributed is not None
    assert not topo.reaches(3, UP_A)  # unknown source
    assert not topo.reaches(4, UP_A)  # deny-first: the unmarked tail
    assert fleet_dropped(d, "s-sb1") == sb1
    assert (fleet_dropped(d, "-") or 0) > unattributed
    assert (fleet_dropped(d, "s-sb4") or 0) > 0
    # /v1/subjects reads the same counters (egressctl subjects / status / watch).
    doc = json.loads(d.get("/v1/subjects")[1])
    by_uid = {s["uid"]: s for s in doc["subjects"]}
    assert by_uid["sb1"]["droppedPackets"] == sb1
    assert by_uid["sb2"]["droppedPackets"] == 0
    assert doc["unattributedDroppedPackets"] >= unattributed
    # The kernel object itself: a named counter per subject.
    assert "subj_s_sb1_dropped" in d.nft("list", "counters", "table", "inet", d.table)
    # Removal takes the counter (and the metric series) with the subject.
    code, _ = d.post(envelope("REMOVE_BINDING", "sb1"))
    assert code == 200
    assert fleet_dropped(d, "s-sb1") is None
    assert "subj_s_sb1_dropped" not in d.nft("list", "counters", "table", "inet", d.table)


def test_intercepted_refusals_are_counted_too(topo: Topology, make_daemon: Any) -> None:
    d = make_daemon(mitm_env(topo, 18481))
    bind(d, 1, {"defaultAction": "deny", "egress": [{"action": "allow", "target": UP_A}]})
    assert topo.reaches(1, UP_A)
    prior = fleet_dropped(d, "s-sb1")
    assert prior is not None
    # Port 80 is REDIRECTed to the MITM; the input hook judges the original destination.
    assert not topo.reaches(1, UP_B)
    after = fleet_dropped(d, "s-sb1")
    assert after is not None and after > prior


# ---------------------------------------------------------------- fleet: reject


@pytest.mark.parametrize("mitm", [False, True], ids=["forward", "intercepted"])
def test_deny_reject_makes_a_denied_connect_fail_at_once(
    topo: Topology, make_daemon: Any, mitm: bool
) -> None:
    policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": UP_A}]}
    silent = make_daemon(mitm_env(topo, 18482) if mitm else {})
    bind(silent, 1, policy)
    assert topo.reaches(1, UP_A)
    took, code = connect_time(topo, 1, f"http://{UP_B}/")
    assert code == 28 and took >= CONNECT_TIMEOUT_S, (code, took)  # dropped: curl's own timeout
    silent.kill(15)
    topo.ns(topo.pod, "nft", "delete", "table", "inet", silent.table, check=False)

    loud = make_daemon({**(mitm_env(topo, 18483) if mitm else {}), "EGRESSD_DENY_REJECT": "1"})
    bind(loud, 1, policy)
    assert topo.reaches(1, UP_A)
    prior = fleet_dropped(loud, "s-sb1") or 0
    took, code = connect_time(topo, 1, f"http://{UP_B}/")
    # A TCP reset ("connection refused"); an intercepted connection gets ICMP admin-prohibited
    # ("no route to host"): curl fails to connect at once either way.
    assert code == 7 and took < 1.0, (code, took)
    assert (fleet_dropped(loud, "s-sb1") or 0) > prior  # still counted
    if not mitm:
        # Other protocols: ICMP admin-prohibited, a connected UDP socket learns at once.
        kind, took = udp_probe(topo, 1, UP_B)
        assert kind == "error" and took < 1.0, (kind, took)
    # Allowed traffic is untouched.
    assert topo.reaches(1, UP_A)


def test_without_the_knob_udp_times_out(topo: Topology, make_daemon: Any) -> None:
    d = make_daemon()
    bind(d, 1, {"defaultAction": "deny", "egress": [{"action": "allow", "target": UP_A}]})
    kind, took = udp_probe(topo, 1, UP_B)
    assert kind == "timeout" and took >= CONNECT_TIMEOUT_S - 0.1, (kind, took)


# ---------------------------------------------------------------- fleet: webhook and events


def test_a_denied_name_posts_exactly_once_to_the_webhook(topo: Topology, make_daemon: Any) -> None:
    rec = Receiver(topo, topo.pod, "127.0.0.1", 18499, "fleet")
    try:
        d = make_daemon({"OPENSANDBOX_EGRESS_DENY_WEBHOOK": rec.url})
        bind(d, 1, {"defaultAction": "deny", "egress": [{"action": "allow", "target": "a.test"}]})
        assert topo.dig(1, "a.test") == ("NOERROR", [UP_A])
        assert topo.dig(1, "B.Test") == ("NXDOMAIN", [])
        ((path, ctype, body),) = rec.wait_posts(1)
        time.sleep(1.0)  # nothing else follows: not the allowed name, not a retry
        assert len(rec.posts()) == 1
        assert path == "/deny?token=kernel-test-secret"
        assert ctype == "application/json"
        assert set(body) == {"hostname", "timestamp", "source", "sandboxId"}
        assert (body["hostname"], body["source"], body["sandboxId"]) == (
            "b.test",
            "opensandbox-egress",
            "sb1",
        )
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", body["timestamp"])
        # The recent denial is in /v1/subjects; the allowed answer is an egress.outbound line.
        (subject,) = json.loads(d.get("/v1/subjects")[1])["subjects"]
        assert [x["name"] for x in subject["recentDenials"]] == ["b.test"]
        events = [json.loads(ln) for ln in d.log_text().splitlines() if '"egress.outbound"' in ln]
        assert any(
            e.get("target.host") == "a.test" and e.get("target.ips") == [UP_A] and e.get("subject") == "s-sb1"
            for e in events
        ), events
        assert "kernel-test-secret" not in d.log_text()
        _, text = d.get("/metrics")
        assert 'egressd_deny_webhook_deliveries_total{result="delivered"} 1' in text
        assert "egressd_deny_webhook_dropped_total 0" in text
    finally:
        rec.close()


# ---------------------------------------------------------------- sidecar


@pytest.fixture(scope="module")
def vtopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egv{os.getpid()}", sandboxes=1).up_()
    try:
        wait_for_mld_quiet(t, t.sb(1))
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(vtopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(vtopo, sb=1)
    try:
        yield sc
    finally:
        sc.cleanup()


def mld_reports_sent(topo: Topology, ns: str) -> int:
    for line in topo.ns(ns, "cat", "/proc/net/snmp6").stdout.splitlines():
        name, _, value = line.partition(" ")
        if name == "Icmp6OutMLDv2Reports":
            return int(value.strip())
    return 0


def wait_for_mld_quiet(topo: Topology, ns: str, quiet_s: float = 2.5, limit_s: float = 20.0) -> None:
    """Wait until the sandbox's kernel has stopped announcing its multicast groups.

    A new interface sends unsolicited MLDv2 reports for a few seconds after it comes up (hop
    limit 1, not neighbour discovery): the sidecar's table drops them as it drops anything else
    the policy does not allow, and counts them. The tests below count the sandbox's own
    refusals, so they start once the kernel's announcements are over (CI once saw one land
    between the sidecar's start and the first read of the counter).
    """
    deadline = time.monotonic() + limit_s
    last, since = mld_reports_sent(topo, ns), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = mld_reports_sent(topo, ns)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
    raise AssertionError(f"{ns}: MLD reports still being sent after {limit_s} s")


def sidecar_dropped(sc: Sidecar) -> int:
    code, text = sc.api("GET", "/metrics")
    assert code == 200, text
    value = dropped_metric(text, "s-sidecar")
    assert value is not None, text
    return value


def test_sidecar_counts_refusals_across_rebuilds(sidecar: Sidecar, vtopo: Topology) -> None:
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(
        {"defaultAction": "deny", "egress": [{"action": "allow", "target": UP_C}]}
    )
    sidecar.start()
    assert sidecar.reaches(UP_C)
    assert sidecar_dropped(sidecar) == 0
    assert not sidecar.reaches(UP_B)
    first = sidecar_dropped(sidecar)
    assert first > 0
    # A policy change rebuilds the table: the count is carried over, never reset.
    sidecar.set_policy({"defaultAction": "deny", "egress": [{"action": "allow", "target": UP_A}]})
    assert sidecar_dropped(sidecar) >= first
    assert not sidecar.reaches(UP_C)
    assert sidecar_dropped(sidecar) > first
    listing = vtopo.ns(sidecar.ns, "nft", "list", "counter", "inet", "opensandbox", "dropped").stdout
    assert "packets" in listing


@pytest.mark.parametrize("reject", [False, True], ids=["drop", "reject"])
def test_sidecar_deny_reject(sidecar: Sidecar, vtopo: Topology, reject: bool) -> None:
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps({"defaultAction": "deny", "egress": []})
    if reject:
        sidecar.env["EGRESSD_DENY_REJECT"] = "1"
    sidecar.start()
    took, code = connect_time(vtopo, 1, f"http://{UP_B}/")
    if reject:
        assert code == 7 and took < 1.0, (code, took)
        kind, took = udp_probe(vtopo, 1, UP_B)
        assert kind == "error" and took < 1.0, (kind, took)
    else:
        assert code == 28 and took >= CONNECT_TIMEOUT_S, (code, took)
    assert sidecar_dropped(sidecar) > 0


def test_sidecar_webhook_reports_its_sandbox_id_past_its_own_policy(
    sidecar: Sidecar, vtopo: Topology
) -> None:
    # The receiver is on b.test's address, which the sandbox's policy denies (name and IP):
    # the webhook resolves and connects through the sidecar's own exemption (SO_MARK 0x1).
    rec = Receiver(vtopo, vtopo.up, UP_B, 18498, "sidecar")
    try:
        sidecar.env |= {
            "OPENSANDBOX_EGRESS_RULES": json.dumps(
                {"defaultAction": "deny", "egress": [{"action": "allow", "target": "a.test"}]}
            ),
            "OPENSANDBOX_EGRESS_DENY_WEBHOOK": rec.url.replace(UP_B, "b.test"),
            "OPENSANDBOX_EGRESS_SANDBOX_ID": "sb-sidecar-7",
        }
        sidecar.start()
        assert sidecar.dig("evil.test") == ("NXDOMAIN", [])
        ((path, _, body),) = rec.wait_posts(1)
        time.sleep(0.5)
        assert len(rec.posts()) == 1  # the webhook's own lookup of b.test was no denial
        assert body["hostname"] == "evil.test" and body["sandboxId"] == "sb-sidecar-7"
        assert path.startswith("/deny")
        # The app itself still cannot reach the receiver's address.
        assert not sidecar.reaches(UP_B)
        assert "kernel-test-secret" not in sidecar.log_text()
    finally:
        rec.close()
