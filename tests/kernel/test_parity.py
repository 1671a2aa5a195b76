"""Reference parity on the real kernel, fleet profile (issue 15 items 3 and 4):
OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS intercepts more ports through the real MITM with the
input policing of 80/443; OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT lets a registered sandbox
query the real upstream DNS directly, port 53 only, never past the lateral drops; the
start-up self-test reports how this kernel renews a lease, and the delete+add renewal works
on it too.

One daemon (with the MITM) for the whole module; every test binds its own sandboxes.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.kernel.topology import (
    GATEWAY,
    UP_NET,
    VENV_PY,
    Daemon,
    Topology,
    envelope,
)

DPR = "sandbox.data-plane-ready"
MITM_PORT = 18182
UP_A = f"{UP_NET}.2"  # a.test, the daemon's DNS upstream
UP_B = f"{UP_NET}.3"  # b.test
UP_EX = f"{UP_NET}.5"  # example.test: never allowed here
# The upstream's DNS socket is bound to the wildcard and answers from the primary address of
# each family: 10.204.0.2 and fd00:204::9 are the only addresses a direct query works with.
NS = UP_A  # exempt
NS6_NOT_EXEMPT = "fd00:204::9"
POD_UPLINK = f"{UP_NET}.1"  # what the upstream sees when the pod (the MITM) connects
POLICY = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "b.test"}]}


@pytest.fixture(scope="module")
def parity(topo: Topology) -> Iterator[Daemon]:
    env = {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
        "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": "8080",
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR": str(topo.workdir / "parity-mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "parity-run" / "active.sock"),
        # A sandbox address too: the exemption must never open lateral movement (14.2).
        "OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT": f"{NS},{Topology.sb_ip(2)}",
        "OPENSANDBOX_EGRESS_PROFILE": "fast-sandbox",
        "OPENSANDBOX_EGRESS_SANDBOX_ID": "pool-7",
        "OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS": "team=blue,k8s.node=n1",
    }
    d = Daemon(topo, table="egt-parity", port=18195, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            topo.stop(d.proc)
        d.nft("delete", "table", "inet", "egt-parity", check=False)
        print(d.log_text()[-6000:])


def bind(d: Daemon, i: int, uid: str, policy: object = POLICY) -> None:
    code, body = d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(i), policy=policy))
    assert (code, body) == (200, "{}"), body
    code, body = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
    assert (code, body) == (200, "{}"), body


def unbind(d: Daemon, uid: str) -> None:
    d.post(envelope("REMOVE_BINDING", uid))


def last_request(topo: Topology, since: int, port: int) -> dict[str, object]:
    hits = [r for r in topo.upstream_requests()[since:] if r.get("port") == port and "dns" not in r]
    assert hits, f"the upstream saw no request on port {port}"
    return hits[-1]


def log_events(d: Daemon, event: str) -> list[dict[str, object]]:
    out = []
    for line in d.log_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == event:
            out.append(doc)
    return out


# --------------------------------------------------------------------------- extra ports


def test_extra_port_is_intercepted_like_80(topo: Topology, parity: Daemon) -> None:
    bind(parity, 1, "px-1")
    try:
        status, answers = topo.dig(1, "b.test")
        assert (status, answers) == ("NOERROR", [UP_B])
        for port in (80, 8080):
            since = len(topo.upstream_requests())
            # By name: with the name check (docs/reference/behaviour.md §18) a Host that names no name
            # that taught the address is refused on port 80.
            assert topo.curl(1, f"http://{UP_B}:{port}/probe", timeout=3, extra=("-H", "Host: b.test")) == 200
            # Through the MITM: the upstream is connected to by the pod, not the sandbox.
            assert last_request(topo, since, port)["client"] == POD_UPLINK
        nat = parity.nft("list", "chain", "inet", "egt-parity", "nat")
        assert "tcp dport { 80, 443, 8080 }" in nat and "tcp dport { 80, 443 }" not in nat
    finally:
        unbind(parity, "px-1")


def test_extra_port_is_policed_like_80(topo: Topology, parity: Daemon) -> None:
    """The intercepted flow is judged by the subject's input chain on the conntrack original
    destination, as for 80/443: a destination the policy does not allow never reaches the
    MITM's upstream leg."""
    bind(parity, 1, "px-2")
    try:
        since = len(topo.upstream_requests())
        for port in (80, 8080):
            assert topo.curl(1, f"http://{UP_EX}:{port}/probe", timeout=1) == 0
        assert not [r for r in topo.upstream_requests()[since:] if r.get("local") == UP_EX]
        # An unregistered sandbox is intercepted nowhere and forwarded nowhere.
        assert topo.curl(4, f"http://{UP_B}:8080/probe", timeout=1) == 0
    finally:
        unbind(parity, "px-2")


# --------------------------------------------------------------------------- nameserver exempt


def test_exempt_nameserver_is_queried_directly(topo: Topology, parity: Daemon) -> None:
    bind(parity, 1, "ns-1")
    try:
        since = len(topo.upstream_requests())
        # a.test is not allowed by the policy: only the real upstream would answer it.
        assert topo.dig(1, "a.test", server=NS) == ("NOERROR", [UP_A])
        assert topo.dig(1, "a.test", server=NS, tcp=True) == ("NOERROR", [UP_A])
        asked = [r for r in topo.upstream_requests()[since:] if r.get("dns") == "a.test"]
        assert len(asked) == 2 and all(r["client"] == Topology.sb_ip(1) for r in asked)
        # The gateway's proxy still filters, and nothing else of the nameserver is reachable.
        assert topo.dig(1, "a.test", server=GATEWAY)[0] == "NXDOMAIN"
        assert not topo.reaches(1, NS, 80)
        assert not topo.reaches(1, NS, 8080)
        # A nameserver that is not exempt is not reachable directly.
        assert topo.dig(1, "a.test", server=NS6_NOT_EXEMPT)[0] == "TIMEOUT"
    finally:
        unbind(parity, "ns-1")


def test_exempt_nameserver_is_not_for_unregistered_or_denying_sources(topo: Topology, parity: Daemon) -> None:
    assert topo.dig(4, "a.test", server=NS)[0] == "TIMEOUT"  # sb4: no binding at all
    deny_ns = {"defaultAction": "allow", "egress": [{"action": "deny", "target": f"{NS}/32"}]}
    bind(parity, 3, "ns-3", deny_ns)
    try:
        # The subject's deny sets are judged before the exemption's mark counts.
        assert topo.dig(3, "a.test", server=NS)[0] == "TIMEOUT"
        assert topo.reaches(3, UP_B, 80)  # the subject is active: default allow
    finally:
        unbind(parity, "ns-3")


def _udp_echo(topo: Topology, ns: str, port: int) -> subprocess.Popen[str]:
    code = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
        f"s.bind(('0.0.0.0',{port}))\n"
        "print('ready',flush=True)\n"
        "while True:\n"
        "    d,a=s.recvfrom(512)\n"
        "    s.sendto(d,a)\n"
    )
    return topo.spawn(ns, str(VENV_PY), "-c", code, ready_line="ready")


def _udp_asks(topo: Topology, ns: str, dst: str, port: int) -> bool:
    code = (
        "import socket\n"
        "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
        "s.settimeout(1.5)\n"
        f"s.sendto(b'ping',('{dst}',{port}))\n"
        "try:\n"
        "    print(s.recvfrom(512)[0].decode())\n"
        "except OSError:\n"
        "    print('none')\n"
    )
    return topo.ns(ns, str(VENV_PY), "-c", code, check=False).stdout.strip() == "ping"


def test_an_exempt_sandbox_address_stays_unreachable(topo: Topology, parity: Daemon) -> None:
    """A sandbox address in the exempt list (a misconfiguration) opens no lateral path."""
    bind(parity, 1, "ns-l1")
    bind(parity, 2, "ns-l2", {"defaultAction": "allow"})
    echo = _udp_echo(topo, topo.sb(2), 53)
    try:
        assert _udp_asks(topo, topo.pod, Topology.sb_ip(2), 53)  # the responder answers
        assert not _udp_asks(topo, topo.sb(1), Topology.sb_ip(2), 53)
    finally:
        topo.stop(echo)
        unbind(parity, "ns-l1")
        unbind(parity, "ns-l2")


# --------------------------------------------------------------------------- labels and logs


def test_metrics_carry_the_constant_labels_and_logs_the_fields(parity: Daemon) -> None:
    code, text = parity.get("/metrics")
    assert code == 200
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert samples
    for line in samples:
        assert '{sandbox_id="pool-7",team="blue",k8s_node="n1"' in line, line
    (selftest,) = log_events(parity, "kernel.selftest_passed")
    assert selftest["sandbox_id"] == "pool-7" and selftest["k8s.node"] == "n1"


# --------------------------------------------------------------------------- lease renewal (item 4)


def test_selftest_reports_how_this_kernel_renews_leases(parity: Daemon) -> None:
    (line,) = log_events(parity, "kernel.selftest_passed")
    assert line["lease_renewal"] in ("re-add", "delete+add")
    print(f"this kernel: lease_renewal={line['lease_renewal']}")


_RENEW_SCRIPT = """
import ipaddress, json, sys, time
from egressd.fleetnft.contents import dyn_add
from egressd.fleetnft.selftest import probe_lease_renewal
from egressd.kernel.netlink import NfTablesSocket
from egressd.kernel.ops import AddSet, NetlinkBatch

T = sys.argv[1]
sock = NfTablesSocket()
sock.run(NetlinkBatch(T, (AddSet("subj_p_dyn_v4", "v4", "timeout", 360),)))
live, gone, new = (ipaddress.ip_address(a) for a in ("192.0.2.1", "192.0.2.2", "192.0.2.3"))
sock.run(dyn_add(T, "p", [(live, 20), (gone, 1)]))
time.sleep(1.5)  # "gone" has expired (maybe not yet collected)
# One transaction: an existing, an expired and a missing element all renewed by delete+add.
sock.run(dyn_add(T, "p", [(live, 300), (gone, 300), (new, 300)], replace=True))
out = {str(ipaddress.ip_address(e.key)): e.expires_ms for e in sock.set_elements(T, "subj_p_dyn_v4")}
probe = probe_lease_renewal(sock.run, sock.set_elements, T)
print(json.dumps({"expires": out, "probe": probe.value}))
"""


def test_delete_and_add_renewal_works_on_this_kernel(topo: Topology) -> None:
    """Whatever the probe finds here, the renewal the daemon falls back to must work on this
    kernel too: an existing, an expired and a missing element in one batch."""
    table = "egt-renew"
    topo.ns(topo.pod, "nft", "add", "table", "inet", table)
    try:
        r = topo.ns(topo.pod, str(VENV_PY), "-c", _RENEW_SCRIPT, table, check=False, timeout=30)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        expires = doc["expires"]
        assert set(expires) == {"192.0.2.1", "192.0.2.2", "192.0.2.3"}
        assert all(250_000 < ms <= 300_000 for ms in expires.values()), expires
        assert doc["probe"] in ("re-add", "delete+add")
        print(f"this kernel: probe={doc['probe']}")
    finally:
        topo.ns(topo.pod, "nft", "delete", "table", "inet", table, check=False)
