"""Ports and protocols in the kernel (docs/reference/behaviour.md §18, with §14.1 and §9), fleet profile,
with real TCP and UDP packets from sandbox namespaces.

An IP/CIDR rule with ``protocol``/``ports`` opens (or denies) its prefix only there; a DNS lease
opens its address only for the ports and protocols of the names that taught it (two names on
one CDN address, one name on several addresses); with the name check on (the MITM), UDP 443 of
a DNS-learned address is dropped unless an explicit ``protocol: udp`` rule opens it; a
narrowing that takes a port away cuts the established flow on it and keeps the one on a port
still allowed.

The upstream namespace gets a small TCP and UDP echo server on the ports these tests probe
(:func:`echo`); a probe is one connection (TCP) or one datagram (UDP) that must come back.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator, Mapping

import pytest

from tests.kernel.topology import UP_NET, UPSTREAM_IPS, Daemon, Topology, envelope

DPR = "sandbox.data-plane-ready"
API_IP = f"{UP_NET}.6"  # api.example.test and h2.example.test: one CDN address (topology.ZONE)
EX_IP = f"{UP_NET}.5"  # example.test (and multi.test)
MULTI_IPS = [f"{UP_NET}.5", f"{UP_NET}.6", f"{UP_NET}.7"]  # multi.test
OTHER_IP = f"{UP_NET}.7"
TCP_PORTS = (22, 5432, 5433, 7000, 7001)
UDP_PORTS = (443, 5432, 7000)

_ECHO = """
import socket, sys, threading
# Every socket is bound before "ready": a port another test left taken fails the fixture
# (the process exits early) instead of a probe later on.
def tcp_listener(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    return s
def tcp(s):
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
def serve(c):
    try:
        while True:
            d = c.recv(4096)
            if not d:
                return
            c.sendall(d)
    except OSError:
        return
def udp_socket(ip, port):
    # One socket per address: a reply must leave from the address it was sent to, or the
    # pod's conntrack would not see it as the reply (and drop it as a new flow).
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((ip, port))
    return s
def udp(s):
    while True:
        d, a = s.recvfrom(4096); s.sendto(d, a)
tcps = [tcp_listener(int(p)) for p in sys.argv[1].split(",")]
udps = [udp_socket(ip, int(p)) for p in sys.argv[2].split(",") for ip in sys.argv[3].split(",")]
for s in tcps:
    threading.Thread(target=tcp, args=(s,), daemon=True).start()
for s in udps:
    threading.Thread(target=udp, args=(s,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

_PROBE = """
import socket, sys
proto, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    if proto == "tcp":
        s = socket.create_connection((host, port), timeout=1.0)
        s.sendall(b"ping"); ok = s.recv(16) == b"ping"
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1.0)
        s.sendto(b"ping", (host, port)); ok = s.recvfrom(16)[0] == b"ping"
except OSError:
    ok = False
print("open" if ok else "closed")
"""

# One connection per port, each pinged every 0.2 s; prints "<port> ok|dead" per ping.
_HOLD = """
import socket, sys, time
host, ports, seconds = sys.argv[1], [int(p) for p in sys.argv[2].split(",")], float(sys.argv[3])
socks = {p: socket.create_connection((host, p), timeout=1.0) for p in ports}
print("up", flush=True)
end = time.time() + seconds
dead = set()
while time.time() < end:
    for p, s in socks.items():
        if p in dead:
            continue
        try:
            s.sendall(b"ping"); ok = s.recv(16) == b"ping"
        except OSError:
            ok = False
        if not ok:
            dead.add(p)
        print(p, "ok" if ok else "dead", flush=True)
    time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def echo(topo: Topology) -> Iterator[subprocess.Popen[str]]:
    """TCP and UDP echo on every upstream address, on the ports the tests probe."""
    proc = topo.spawn(
        topo.up,
        "python3",
        "-c",
        _ECHO,
        ",".join(map(str, TCP_PORTS)),
        ",".join(map(str, UDP_PORTS)),
        ",".join(UPSTREAM_IPS),
        ready_line="ready",
    )
    try:
        yield proc
    finally:
        topo.stop(proc)


def probe(topo: Topology, sb: int, proto: str, ip: str, port: int) -> bool:
    out = topo.ns(topo.sb(sb), "python3", "-c", _PROBE, proto, ip, str(port), check=False, timeout=10).stdout
    return out.strip() == "open"


def reaches_as(topo: Topology, sb: int, name: str, ip: str, port: int) -> bool:
    """HTTP(S) to ``ip``:``port`` asking for ``name`` (SNI and Host): what the name check admits."""
    scheme = "https" if port == 443 else "http"
    url = f"{scheme}://{name}:{port}/probe"
    return topo.curl(sb, url, 2.0, extra=("-k", "--resolve", f"{name}:{port}:{ip}")) == 200


def bind(d: Daemon, policy: object, i: int = 1) -> None:
    text = json.dumps(policy)
    code, body = d.post(envelope("SET_BINDING", f"sb{i}", ip=Topology.sb_ip(i), policy=text))
    assert (code, body) == (200, "{}"), body


def activate(d: Daemon, policy: object, i: int = 1) -> None:
    bind(d, policy, i)
    assert d.post(envelope("LIFECYCLE_HOOK", f"sb{i}", hook=DPR)) == (200, "{}")


def deny_default(*rules: Mapping[str, object]) -> dict[str, object]:
    return {"defaultAction": "deny", "egress": list(rules)}


@pytest.fixture
def checked(topo: Topology) -> Iterator[Daemon]:
    """A daemon with the MITM on, and so the name check (EGRESSD_NAME_CHECK's default)."""
    env = {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": "18381",
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "ports-mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "ports-mitm-run" / "active.sock"),
    }
    with Daemon(topo, table="egt-ports-mitm", port=18380, env=env).running() as d:
        yield d


# ---- §18 vectors ---------------------------------------------------------------------------------


def test_a_name_with_ports_opens_its_address_only_there(
    topo: Topology, checked: Daemon, echo: subprocess.Popen[str]
) -> None:
    """``{"action":"allow","target":"api.x.io","ports":[443]}``: TCP 443 allow, 80 deny, UDP 443
    deny (the name check is on: QUIC has no name to check); an explicit udp rule opens UDP 443."""
    activate(checked, deny_default({"action": "allow", "target": "api.example.test", "ports": [443]}))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert reaches_as(topo, 1, "api.example.test", API_IP, 443)  # through the MITM, by the original port
    assert not topo.reaches(1, API_IP, 80)  # intercepted too: refused on input by port
    assert not topo.reaches(1, API_IP, 8080)
    assert not probe(topo, 1, "udp", API_IP, 443)
    assert not probe(topo, 1, "tcp", API_IP, 7000)
    # An explicit protocol: udp rule for the name opens its UDP 443 (first match per port).
    bind(
        checked,
        deny_default(
            {"action": "allow", "target": "api.example.test", "protocol": "udp", "ports": [443]},
            {"action": "allow", "target": "api.example.test", "ports": [443]},
        ),
    )
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert probe(topo, 1, "udp", API_IP, 443)
    assert reaches_as(topo, 1, "api.example.test", API_IP, 443)
    assert not topo.reaches(1, API_IP, 80)


def test_a_learned_address_without_ports_opens_all_but_quic_under_the_name_check(
    topo: Topology, checked: Daemon, echo: subprocess.Popen[str]
) -> None:
    activate(
        checked,
        deny_default({"action": "allow", "target": "example.test"}, {"action": "allow", "target": OTHER_IP}),
    )
    assert topo.dig(1, "example.test") == ("NOERROR", [EX_IP])
    assert probe(topo, 1, "tcp", EX_IP, 7000) and probe(topo, 1, "udp", EX_IP, 7000)
    assert reaches_as(topo, 1, "example.test", EX_IP, 80)
    assert not probe(topo, 1, "udp", EX_IP, 443)  # DNS learning alone never opens QUIC
    assert probe(topo, 1, "udp", OTHER_IP, 443)  # an address rule does


def test_an_address_rule_with_protocol_and_ports(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    """``{"action":"allow","target":"10.0.0.0/8","protocol":"tcp","ports":["5432-5433"]}``."""
    rule = {"action": "allow", "target": f"{UP_NET}.0/24", "protocol": "tcp", "ports": ["5432-5433"]}
    activate(daemon, deny_default(rule))
    assert probe(topo, 1, "tcp", EX_IP, 5432)
    assert probe(topo, 1, "tcp", OTHER_IP, 5433)
    assert not probe(topo, 1, "udp", EX_IP, 5432)
    assert not probe(topo, 1, "tcp", EX_IP, 22)
    assert not topo.reaches(1, EX_IP, 80)


def test_a_deny_rule_with_ports_refuses_only_there(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    egress: list[dict[str, object]] = [
        {"action": "deny", "target": EX_IP, "protocol": "tcp", "ports": [80, "7000-7001"]},
        {"action": "deny", "target": f"{UP_NET}.0/24", "protocol": "udp", "ports": [7000]},
    ]
    activate(daemon, {"defaultAction": "allow", "egress": egress})
    assert not topo.reaches(1, EX_IP, 80)
    assert not probe(topo, 1, "tcp", EX_IP, 7001)
    assert topo.reaches(1, EX_IP, 8080)
    assert probe(topo, 1, "tcp", EX_IP, 5432)
    assert topo.reaches(1, OTHER_IP, 80)
    assert not probe(topo, 1, "udp", OTHER_IP, 7000)
    assert probe(topo, 1, "tcp", OTHER_IP, 7000)
    # Deny beats allow, by port too: an allow rule for the address does not reopen it.
    bind(daemon, {"defaultAction": "allow", "egress": [*egress, {"action": "allow", "target": EX_IP}]})
    assert not topo.reaches(1, EX_IP, 80)
    assert topo.reaches(1, EX_IP, 8080)


# ---- leases: CDN-shaped -------------------------------------------------------------------------


def test_two_names_on_one_address_open_each_its_own_ports(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    activate(
        daemon,
        deny_default(
            {"action": "allow", "target": "api.example.test", "ports": [8080]},
            {"action": "allow", "target": "h2.example.test", "protocol": "tcp", "ports": [80, 7000]},
            {"action": "allow", "target": "multi.test", "protocol": "udp", "ports": [7000]},
        ),
    )
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert topo.reaches(1, API_IP, 8080)
    assert not topo.reaches(1, API_IP, 80)  # h2.example.test's port: not asked for yet
    assert not probe(topo, 1, "tcp", API_IP, 7000)
    assert probe(topo, 1, "udp", API_IP, 7000) is False
    assert topo.dig(1, "h2.example.test") == ("NOERROR", [API_IP])
    # The lease is now the union of both names' scopes, nothing more.
    assert topo.reaches(1, API_IP, 80) and topo.reaches(1, API_IP, 8080)
    assert probe(topo, 1, "tcp", API_IP, 7000)
    assert not probe(topo, 1, "tcp", API_IP, 7001)
    assert not probe(topo, 1, "udp", API_IP, 7000)
    # One name on several addresses: each opens the name's ports only.
    status, answers = topo.dig(1, "multi.test")
    assert status == "NOERROR" and sorted(answers) == MULTI_IPS
    for ip in MULTI_IPS:
        assert probe(topo, 1, "udp", ip, 7000), ip
    assert not probe(topo, 1, "tcp", EX_IP, 7000)
    assert not topo.reaches(1, OTHER_IP, 8080)
    assert topo.reaches(1, API_IP, 8080)  # the CDN address keeps what the other names opened


# ---- §14.1 by port ------------------------------------------------------------------------------


def test_a_narrowing_that_takes_a_port_away_cuts_only_the_flow_on_it(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    wide = deny_default(
        {"action": "allow", "target": "example.test", "protocol": "tcp", "ports": [7000, 7001]}
    )
    activate(daemon, wide)
    assert topo.dig(1, "example.test") == ("NOERROR", [EX_IP])
    holder = topo.spawn(topo.sb(1), "python3", "-c", _HOLD, EX_IP, "7000,7001", "6", ready_line="up")
    time.sleep(0.6)
    bind(
        daemon,
        deny_default({"action": "allow", "target": "example.test", "protocol": "tcp", "ports": [7001]}),
    )
    out, _ = holder.communicate(timeout=30)
    by_port: dict[str, list[str]] = {"7000": [], "7001": []}
    for line in out.split("\n"):
        if line.strip():
            port, verdict = line.split()
            by_port[port].append(verdict)
    assert by_port["7000"][-1] == "dead", "a flow on a port the policy took away survived: " + out
    assert by_port["7001"] and "dead" not in by_port["7001"], "a flow on a still-allowed port was cut: " + out
    assert not probe(topo, 1, "tcp", EX_IP, 7000)
    assert probe(topo, 1, "tcp", EX_IP, 7001)


def test_audit_mode_logs_counts_and_passes_a_would_deny_by_port(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    """Audit mode (docs/reference/policy-language.md): a deny rule with ports is a would-deny
    there, like one without; a port no rule opens is the default's would-deny."""
    policy = {
        "defaultAction": "deny",
        "mode": "audit",
        "egress": [
            {"action": "deny", "target": EX_IP, "protocol": "tcp", "ports": [7000]},
            {"action": "allow", "target": EX_IP, "protocol": "tcp", "ports": ["7000-7001"]},
        ],
    }
    activate(daemon, policy)

    def counted(kind: str) -> int:
        out = daemon.nft("-j", "list", "counter", "inet", daemon.table, f"subj_s_sb1_audit_{kind}")
        return int(next(i["counter"]["packets"] for i in json.loads(out)["nftables"] if "counter" in i))

    deny0, default0 = counted("deny"), counted("default")
    assert probe(topo, 1, "tcp", EX_IP, 7000)  # would-deny by the rule: passed
    assert counted("deny") == deny0 + 1
    assert probe(topo, 1, "tcp", EX_IP, 7001)  # allowed: neither
    assert counted("deny") == deny0 + 1 and counted("default") == default0
    assert probe(topo, 1, "udp", EX_IP, 7000)  # no rule opens it: the default's would-deny
    assert counted("default") == default0 + 1
    # Enforcing again: the same rules refuse.
    bind(daemon, {**policy, "mode": "enforce"})
    assert not probe(topo, 1, "tcp", EX_IP, 7000) and probe(topo, 1, "tcp", EX_IP, 7001)
    assert not probe(topo, 1, "udp", EX_IP, 7000)


def test_the_vector_holds_without_the_mitm_and_off_lifts_the_quic_drop(
    topo: Topology, daemon: Daemon, echo: subprocess.Popen[str]
) -> None:
    """The §18 vector without the MITM (no name check): ``ports: [443]`` opens TCP 443 only;
    UDP 443 of a learned address stays closed (egressd: the QUIC drop holds unless
    ``EGRESSD_NAME_CHECK=off``)."""
    activate(daemon, deny_default({"action": "allow", "target": "api.example.test", "ports": [443]}))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
    assert topo.reaches(1, API_IP, 443)
    assert not topo.reaches(1, API_IP, 80)
    assert not probe(topo, 1, "udp", API_IP, 443)


def test_name_check_off_opens_quic_of_a_learned_address(topo: Topology, echo: subprocess.Popen[str]) -> None:
    with Daemon(topo, table="egt-ports-off", port=18382, env={"EGRESSD_NAME_CHECK": "off"}).running() as d:
        activate(d, deny_default({"action": "allow", "target": "api.example.test", "ports": [443]}))
        assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
        assert probe(topo, 1, "udp", API_IP, 443) and topo.reaches(1, API_IP, 443)
        assert not topo.reaches(1, API_IP, 80)


def test_a_narrowing_past_the_port_element_budget_revokes_what_does_not_fit(
    topo: Topology, echo: subprocess.Popen[str]
) -> None:
    """Two leases learned whole (a name allowed on every port) that the same names also teach on
    three single ports each: narrowing away the whole rule would refill six port elements into
    port-scoped dyn sets sized for four (2 leases x PORT_ELEMS_PER_LEASE). The kernel would refuse
    that transaction (ENFILE) and the subject keep its wider policy; instead the narrowing keeps
    what fits (the first lease, on its three ports) and revokes the other."""
    ports: list[object] = [22, 5432, 7000]

    def policy(*, whole: bool) -> dict[str, object]:
        rules: list[dict[str, object]] = []
        for name in ("example.test", "api.example.test"):
            if whole:
                rules.append({"action": "allow", "target": name})
            rules.append({"action": "allow", "target": name, "protocol": "tcp", "ports": ports})
        return deny_default(*rules)

    env = {"EGRESSD_MAX_LEASES_PER_SUBJECT": "2"}
    with Daemon(topo, table="egt-ports-budget", port=18383, env=env).running() as d:
        activate(d, policy(whole=True))
        assert topo.dig(1, "example.test") == ("NOERROR", [EX_IP])
        assert topo.dig(1, "api.example.test") == ("NOERROR", [API_IP])
        assert probe(topo, 1, "tcp", EX_IP, 5433) and probe(topo, 1, "tcp", API_IP, 5433)
        # A flow to each address on a port the narrowed rule still allows: only the budget
        # revokes the second lease, whose flow must be cut like any revoked lease's.
        holders = {
            ip: topo.spawn(topo.sb(1), "python3", "-c", _HOLD, ip, "22", "6", ready_line="up")
            for ip in (EX_IP, API_IP)
        }
        time.sleep(0.6)
        narrow = json.dumps(policy(whole=False))
        code, body = d.post(envelope("SET_BINDING", "sb1", ip=Topology.sb_ip(1), policy=narrow))
        wide = probe(topo, 1, "tcp", EX_IP, 5433) or probe(topo, 1, "tcp", API_IP, 5433)
        verdicts = {ip: holder.communicate(timeout=30)[0].split() for ip, holder in holders.items()}
        assert (code, body) == (200, "{}"), (
            f"narrowing refused ({code} {body}); healthz {d.get('/healthz')}; old wide policy still in force: {wide}; "
            + d.log_text()[-1500:]
        )
        assert d.get("/healthz")[0] == 200
        assert not wide, "the whole rule's ports stayed open after the narrowing"
        assert probe(topo, 1, "tcp", EX_IP, 22) and probe(topo, 1, "tcp", EX_IP, 7000)
        assert not any(probe(topo, 1, "tcp", API_IP, p) for p in (22, 5432, 7000)), (
            "a lease over the budget stayed"
        )
        assert verdicts[API_IP][-1] == "dead", f"the revoked lease's flow survived: {verdicts}"
        assert verdicts[EX_IP][1::2] and "dead" not in verdicts[EX_IP], (
            f"the kept lease's flow was cut: {verdicts}"
        )
