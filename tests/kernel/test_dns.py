"""The shared DNS proxy against the real kernel: dig and curl from sandbox namespaces."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.kernel.topology import GATEWAY6, UP_NET, Daemon, Topology, envelope

DPR = "sandbox.data-plane-ready"
A_IP, B_IP, DEEP_IP = f"{UP_NET}.2", f"{UP_NET}.3", f"{UP_NET}.4"
APEX_IP, API_IP, NESTED_IP = f"{UP_NET}.5", f"{UP_NET}.6", f"{UP_NET}.7"
BLOCKED_IP, SHORT_IP = f"{UP_NET}.8", f"{UP_NET}.9"


def rules(*allow: str, deny: tuple[str, ...] = (), default: str = "deny") -> dict[str, object]:
    egress = [{"action": "deny", "target": t} for t in deny] + [
        {"action": "allow", "target": t} for t in allow
    ]
    return {"defaultAction": default, "egress": egress}


def activate(d: Daemon, i: int, policy: dict[str, object], uid: str | None = None, **kw: Any) -> str:
    uid = uid or f"sb{i}"
    ip = kw.pop("ip", Topology.sb_ip(i))
    code, body = d.post(envelope("SET_BINDING", uid, ip=ip, policy=json.dumps(policy), **kw))
    assert code == 200, body
    code, body = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
    assert code == 200, body
    return uid


def test_allowed_name_resolves_then_connects(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("a.test"))
    assert not topo.reaches(1, A_IP), "an address must not pass before the sandbox resolved it"
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.reaches(1, A_IP)
    # Only the address the name resolved to: a neighbour stays closed.
    assert not topo.reaches(1, B_IP)


def test_denied_name_is_nxdomain_and_never_reaches_upstream(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("a.test"))
    before = len(topo.upstream_queries())  # the upstream's log is shared by the session's tests
    for qtype in ("A", "AAAA", "TXT", "MX"):
        assert topo.dig(1, "secret-exfil.test", qtype) == ("NXDOMAIN", [])
    assert "secret-exfil.test" not in topo.upstream_queries()[before:]
    assert not topo.reaches(1, B_IP)


def test_unknown_and_denying_sources_get_nxdomain_unforwarded(topo: Topology, daemon: Daemon) -> None:
    # sb2 is bound but not data-plane-ready; sb3 is unknown.
    code, _ = daemon.post(
        envelope("SET_BINDING", "sb2", ip=topo.sb_ip(2), policy=json.dumps(rules("b.test")))
    )
    assert code == 200
    before = len(topo.upstream_queries())
    assert topo.dig(2, "b.test") == ("NXDOMAIN", [])
    assert topo.dig(3, "b.test") == ("NXDOMAIN", [])
    assert topo.dig(3, "b.test", tcp=True) == ("NXDOMAIN", [])
    assert len(topo.upstream_queries()) == before


def test_learned_address_is_not_usable_by_a_sibling(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("a.test"))
    activate(daemon, 2, rules("b.test"))
    assert topo.dig(1, "a.test")[1] == [A_IP]
    assert topo.reaches(1, A_IP)
    assert not topo.reaches(2, A_IP)
    # sb2 may not even learn it by asking: its policy does not allow the name.
    assert topo.dig(2, "a.test") == ("NXDOMAIN", [])
    assert not topo.reaches(2, A_IP)


def test_wildcard_matches_subdomains_not_apex(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("*.example.test"))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert topo.dig(1, "x.y.example.test") == ("NOERROR", [NESTED_IP])
    assert topo.dig(1, "example.test") == ("NXDOMAIN", [])
    assert topo.dig(1, "API.Example.Test.")[0] == "NOERROR"
    assert topo.reaches(1, API_IP) and not topo.reaches(1, APEX_IP)


def test_allowed_name_resolving_into_the_deny_set_stays_blocked(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("blocked-ip.test", deny=(BLOCKED_IP,)))
    assert topo.dig(1, "blocked-ip.test") == ("NOERROR", [BLOCKED_IP])
    assert not topo.reaches(1, BLOCKED_IP)


def test_cname_chain_targets_are_learned(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("www.a.test"))
    status, answers = topo.dig(1, "www.a.test")
    assert status == "NOERROR" and answers[-1] == DEEP_IP
    assert topo.reaches(1, DEEP_IP)


def test_tcp_dns(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("b.test"))
    assert topo.dig(1, "b.test", tcp=True) == ("NOERROR", [B_IP])
    assert topo.reaches(1, B_IP)


def test_dot_is_blocked_even_to_allowed_addresses(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules(A_IP))
    assert topo.reaches(1, A_IP, port=80)
    assert not topo.reaches(1, A_IP, port=853)


def test_ipv6_aaaa_is_learned_and_usable(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("v6.test"), uid="v6", ip=topo.sb_ip6(1), gateway=GATEWAY6)
    assert not topo.reaches(1, "fd00:204::2")
    assert topo.dig(1, "v6.test", "AAAA", server=GATEWAY6) == ("NOERROR", ["fd00:204::2"])
    assert topo.reaches(1, "fd00:204::2")


def test_revert_forgets_learned_addresses(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("a.test"))
    topo.dig(1, "a.test")
    assert topo.reaches(1, A_IP)
    code, _ = daemon.post(envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=None))
    assert code == 200
    assert not topo.reaches(1, A_IP)
    assert topo.dig(1, "a.test") == ("NXDOMAIN", [])


def test_upstream_failover_and_servfail(topo: Topology) -> None:
    # First upstream has nothing listening; the second answers.
    d = Daemon(
        topo,
        table="egt-dnsfail",
        port=18190,
        env={
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM": f"{UP_NET}.9:5353,{UP_NET}.2:53",
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT": "1",
        },
    ).start()
    try:
        activate(d, 1, rules("a.test"))
        assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)
    d = Daemon(
        topo,
        table="egt-dnsdead",
        port=18191,
        env={
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM": f"{UP_NET}.9:5353",
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT": "1",
        },
    ).start()
    try:
        activate(d, 1, rules("a.test"))
        assert topo.dig(1, "a.test")[0] == "SERVFAIL"
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)


@pytest.fixture
def short_leases(topo: Topology) -> Daemon:
    return Daemon(
        topo,
        table="egt-lease",
        port=18192,
        env={"EGRESSD_DNS_LEASE_MIN": "3", "EGRESSD_DNS_LEASE_MAX": "3", "EGRESSD_REFRESH_INTERVAL": "1"},
    )


def test_lease_expiry_closes_idle_addresses_and_refresh_keeps_live_flows(
    topo: Topology, short_leases: Daemon
) -> None:
    d = short_leases.start()
    try:
        activate(d, 1, rules("a.test", "b.test"))
        assert topo.dig(1, "a.test")[1] == [A_IP]
        assert topo.dig(1, "b.test")[1] == [B_IP]
        # A long-lived connection to a.test's address keeps that lease alive.
        holder = topo.spawn(
            topo.sb(1),
            "python3",
            "-c",
            (
                "import socket,time\n"
                f"s=socket.create_connection(('{A_IP}',8080),timeout=2)\n"
                "s.sendall(b'GET /hold HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'); s.recv(4096)\n"
                "print('held',flush=True); time.sleep(8)\n"
            ),
            ready_line="held",
        )
        time.sleep(5.5)  # > the 3 s lease, several refresh ticks
        assert topo.reaches(1, A_IP), "the lease of an address with a live flow must be renewed"
        assert not topo.reaches(1, B_IP), "an idle address must expire after its lease"
        topo.stop(holder)
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)


def test_always_rules_hot_reload(topo: Topology) -> None:
    rules_dir = topo.workdir / "always-hot"
    rules_dir.mkdir(exist_ok=True)
    d = Daemon(
        topo,
        table="egt-always",
        port=18193,
        env={"EGRESSD_ALWAYS_RULES_DIR": str(rules_dir), "EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL": "1"},
    )
    d.start()
    try:
        activate(d, 1, rules("a.test", A_IP))
        assert topo.dig(1, "a.test")[0] == "NOERROR"
        assert topo.reaches(1, A_IP)
        (rules_dir / "deny.always").write_text("# operator block\na.test\n" + A_IP + "\n")
        deadline = time.monotonic() + 6
        while topo.dig(1, "a.test")[0] != "NXDOMAIN":
            assert time.monotonic() < deadline, d.log_text()[-2000:]
            time.sleep(0.3)
        assert not topo.reaches(1, A_IP)  # the IP deny reached the kernel too
        # A broken file keeps the last good rules.
        (rules_dir / "deny.always").write_text("a.test\n*broken*\n")
        time.sleep(2.5)
        assert topo.dig(1, "a.test")[0] == "NXDOMAIN"
        assert "always_rules.invalid_kept_last_good" in d.log_text()
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)


def test_junk_and_floods_from_one_sandbox_do_not_stall_another(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, 1, rules("a.test"))
    activate(daemon, 2, rules("b.test"))
    flood = (
        "import socket,struct,time\n"
        "from dnslib import DNSRecord\n"
        "gw=('10.203.0.1',53)\n"
        "u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
        "junk=[b'',b'\\x00',b'\\xff'*11,b'\\x12\\x34'+b'\\x00'*10,DNSRecord.question('a.test').pack()[:14]]\n"
        "end=time.time()+3; n=0\n"
        "while time.time()<end and n<20000:\n"
        "  u.sendto(junk[n%len(junk)] if n%3 else DNSRecord.question(f'x{n}.a.test').pack(), gw); n+=1\n"
        "for _ in range(5):\n"
        "  t=socket.create_connection(gw,timeout=2); t.sendall(struct.pack('!H',65535)+b'\\x01'*100); t.close()\n"
        "print('sent',n,flush=True)\n"
    )
    flooder = topo.spawn(topo.sb(1), str(topo_python()), "-c", flood)
    time.sleep(0.5)
    started = time.monotonic()
    for _ in range(5):
        # One retry, as every stub resolver does: the flood shares the proxy's UDP socket, and on a
        # loaded machine it can overflow that socket's receive buffer before egressd's per-source
        # budget sees it (docs/security.md, known limitations). A stall would fail every try.
        assert topo.dig(2, "b.test", tries=2) == ("NOERROR", [B_IP])
    assert time.monotonic() - started < 20
    flooder.communicate(timeout=30)
    # The proxy is still healthy for the flooder too, and never learned junk.
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "a.test", tcp=True) == ("NOERROR", [A_IP])


def topo_python() -> str:
    from tests.kernel.topology import VENV_PY

    return str(VENV_PY)


def test_doh_blocklist_drops_443_to_listed_addresses_only(topo: Topology) -> None:
    d = Daemon(
        topo,
        table="egt-doh",
        port=18194,
        env={
            "OPENSANDBOX_EGRESS_BLOCK_DOH_443": "1",
            "OPENSANDBOX_EGRESS_DOH_BLOCKLIST": f"{B_IP},fd00:204::9/128",
        },
    )
    d.start()
    try:
        activate(d, 1, rules(A_IP, B_IP))
        assert topo.reaches(1, A_IP, port=443)
        assert not topo.reaches(1, B_IP, port=443)
        assert topo.reaches(1, B_IP, port=80)
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)
    d = Daemon(topo, table="egt-doh-all", port=18195, env={"OPENSANDBOX_EGRESS_BLOCK_DOH_443": "1"})
    d.start()
    try:
        activate(d, 1, rules(default="allow"))
        assert not topo.reaches(1, A_IP, port=443), "with no blocklist every TCP 443 is dropped"
        assert topo.reaches(1, A_IP, port=80)
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)


# ---- docs/reference/behaviour.md §14.3: DNS messages, the per-subject budget, IDNA ------------------------------

# Run inside a sandbox: every message of MESSAGES (dnslib-built) to the gateway over UDP and
# TCP, printing one JSON object {label: [rcode, [EDE info-codes]]}. Bounded: one reply or a
# 2 s timeout per message.
_SEND = r"""
import json, socket, struct, sys
from dnslib import EDNS0, OPCODE, QTYPE, RCODE, RD, RR, A, DNSHeader, DNSQuestion, DNSRecord
from egressd.dnsproxy.ede import read_ede
gw = (sys.argv[1], 53)
zone = sys.argv[2]
def update(tsig=False):
    m = DNSRecord(DNSHeader(id=7, opcode=OPCODE.UPDATE), q=DNSQuestion(zone, QTYPE.SOA))
    m.add_auth(RR("exfil." + zone, QTYPE.A, rdata=A("192.0.2.1"), ttl=60))
    if tsig:
        m.add_ar(RR("key.", QTYPE.TSIG, rdata=RD(b"\x0bhmac-sha256\x00" + b"\x00" * 16)))
    return m
def notify():
    m = DNSRecord.question(zone, "SOA"); m.header.opcode = OPCODE.NOTIFY; return m
def with_answer():
    m = DNSRecord.question(zone); m.add_answer(RR(zone, QTYPE.A, rdata=A("192.0.2.2"))); return m
def two_opts():
    m = DNSRecord.question(zone); m.add_ar(EDNS0(udp_len=1232)); m.add_ar(EDNS0(udp_len=4096)); return m
def update_edns():
    m = update(); m.add_ar(EDNS0(udp_len=1232)); return m
def long_label():
    head = struct.pack("!HHHHHH", 9, 0x0100, 1, 0, 0, 0)
    return head + bytes([64]) + b"a" * 64 + b"".join(bytes([len(x)]) + x for x in zone.encode().split(b".")) + b"\0" + struct.pack("!HH", 1, 1)
MESSAGES = {
    "update": update().pack(), "update_tsig": update(True).pack(), "update_edns": update_edns().pack(),
    "notify": notify().pack(), "answer": with_answer().pack(), "two_opts": two_opts().pack(),
    "long_label": long_label(),
}
out = {}
for label, data in MESSAGES.items():
    for proto in ("udp", "tcp"):
        try:
            if proto == "udp":
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
                s.sendto(data, gw); reply = s.recv(65535)
            else:
                s = socket.create_connection(gw, timeout=2)
                s.sendall(struct.pack("!H", len(data)) + data)
                head = s.recv(2)
                if len(head) < 2:
                    raise ConnectionResetError("closed without a reply")
                n = struct.unpack("!H", head)[0]; reply = b""
                while len(reply) < n:
                    chunk = s.recv(n - len(reply))
                    if not chunk:
                        raise ConnectionResetError("short reply")
                    reply += chunk
            s.close()
            r = DNSRecord.parse(reply)
            out[f"{label}/{proto}"] = [RCODE[r.header.rcode], [c for c, _ in read_ede(r)]]
        except OSError as exc:
            out[f"{label}/{proto}"] = ["ERROR " + type(exc).__name__, []]
print(json.dumps(out), flush=True)
"""


def _run_in_sandbox(topo: Topology, sb: int, script: str, *args: str) -> dict[str, object]:
    """Run a venv Python script in sandbox ``sb``; its last stdout line is a JSON object."""
    r = topo.ns(topo.sb(sb), topo_python(), "-c", script, *args, check=False, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_update_notify_and_malformed_messages_for_an_allowed_zone_never_reach_upstream(
    topo: Topology, daemon: Daemon
) -> None:
    zone = "upd-zone.test"
    activate(daemon, 1, rules(zone, f"*.{zone}"))
    before = len(topo.upstream_requests())
    got = _run_in_sandbox(topo, 1, _SEND, "10.203.0.1", zone)
    expected = {
        "update": "REFUSED",
        "update_tsig": "REFUSED",
        "update_edns": "REFUSED",
        "notify": "REFUSED",
        "answer": "FORMERR",
        "two_opts": "FORMERR",
        "long_label": "FORMERR",
    }
    for label, rcode in expected.items():
        for proto in ("udp", "tcp"):
            assert got[f"{label}/{proto}"][0] == rcode, (label, proto, got)  # type: ignore[index]
    assert got["update_edns/udp"] == ["REFUSED", [21]]  # EDE "Not Supported" to an EDNS client
    # dig's own UPDATE (opcode 5) too.
    out = topo.ns(
        topo.sb(1), "dig", "@10.203.0.1", "+opcode=update", zone, "SOA", "+time=2", "+tries=1", check=False
    ).stdout
    assert "status: REFUSED" in out, out
    seen = topo.upstream_requests()[before:]
    assert not [r for r in seen if "dns" in r and (r.get("opcode") != "QUERY" or zone in str(r["dns"]))], seen
    # Control: the same zone's plain query is forwarded, so the log would have shown the others.
    assert topo.dig(1, zone, "SOA")[0] == "NXDOMAIN"
    assert zone in topo.upstream_queries()


# Run inside a sandbox: N sequential EDNS queries for distinct allowed names, printing
# {"rcodes": [...], "ede": [[codes] per reply], "names": [...], "elapsed": s}.
_BURST = r"""
import json, socket, sys, time
from dnslib import EDNS0, RCODE, DNSRecord
from egressd.dnsproxy.ede import read_ede
gw, n, suffix = (sys.argv[1], 53), int(sys.argv[2]), sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
rcodes, ede, names = [], [], []
start = time.monotonic()
for i in range(n):
    name = f"n{i}.{suffix}"
    q = DNSRecord.question(name); q.header.id = i; q.add_ar(EDNS0(udp_len=1232))
    s.sendto(q.pack(), gw)
    try:
        r = DNSRecord.parse(s.recv(65535))
    except OSError:
        rcodes.append("TIMEOUT"); ede.append([]); names.append(name); continue
    rcodes.append(RCODE[r.header.rcode]); ede.append([c for c, _ in read_ede(r)]); names.append(name)
print(json.dumps({"rcodes": rcodes, "ede": ede, "names": names, "elapsed": time.monotonic() - start}), flush=True)
"""


def test_query_budget_refuses_a_burst_while_another_subject_is_answered(topo: Topology) -> None:
    qps = 5  # burst 10
    d = Daemon(topo, table="egt-qps", port=18196, env={"EGRESSD_DNS_QPS_PER_SUBJECT": str(qps)}).start()
    try:
        activate(d, 1, rules("*.burst.test"))
        activate(d, 2, rules("b.test"))
        before = len(topo.upstream_requests())
        got = _run_in_sandbox(topo, 1, _BURST, "10.203.0.1", "60", "burst.test")
        # sb2 is answered right after sb1 drained its bucket: budgets are per subject.
        assert topo.dig(2, "b.test") == ("NOERROR", [B_IP])
        rcodes = list(got["rcodes"])  # type: ignore[call-overload]
        ede = list(got["ede"])  # type: ignore[call-overload]
        names = list(got["names"])  # type: ignore[call-overload]
        elapsed = float(got["elapsed"])  # type: ignore[arg-type]
        answered = [n for n, rc in zip(names, rcodes, strict=True) if rc != "REFUSED"]
        refused = [n for n, rc in zip(names, rcodes, strict=True) if rc == "REFUSED"]
        assert "TIMEOUT" not in rcodes, rcodes
        assert rcodes[:10] == ["NXDOMAIN"] * 10, rcodes  # the burst is forwarded (upstream: no such name)
        assert len(answered) <= 2 * qps + qps * elapsed + 1, (elapsed, rcodes)
        assert len(refused) >= 60 - (2 * qps + qps * elapsed + 1)
        assert all(e == [15] for e, rc in zip(ede, rcodes, strict=True) if rc == "REFUSED"), ede
        upstream = {str(r["dns"]) for r in topo.upstream_requests()[before:] if "dns" in r}
        assert not upstream & set(refused), "an over-budget query reached the upstream"
        assert set(answered) <= upstream
        code, metrics = d.get("/metrics")
        assert code == 200
        line = next(ln for ln in metrics.splitlines() if ln.startswith("egressd_dns_rate_limited_total"))
        assert 's-sb1"' in line and float(line.split()[-1]) == len(refused), line
        # The bucket refills: after a second sb1 is answered again.
        time.sleep(1.0)
        assert topo.dig(1, "again.burst.test")[0] == "NXDOMAIN"
        assert "again.burst.test" in topo.upstream_queries()
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)


def test_unicode_deny_blocks_its_a_label_query(topo: Topology, daemon: Daemon) -> None:
    a_label = "xn--vil-9la.test"
    activate(daemon, 1, {"defaultAction": "allow", "egress": [{"action": "deny", "target": "Évil.test"}]})
    activate(daemon, 2, {"defaultAction": "allow", "egress": [{"action": "deny", "target": "other.test"}]})
    before = len(topo.upstream_queries())
    assert topo.dig(1, a_label) == ("NXDOMAIN", [])
    assert topo.dig(1, a_label.upper() + ".", tcp=True) == ("NXDOMAIN", [])
    assert a_label not in topo.upstream_queries()[before:]
    # Control: the name resolves for a subject that does not deny it, and sb1 resolves others.
    assert topo.dig(2, a_label) == ("NOERROR", [B_IP])
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
