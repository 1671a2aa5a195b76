"""docs/reference/behaviour.md §14.2, no lateral movement on any hook, tried with real packets.

Runs in two shapes, each its own throwaway topology: the bridged one (all sandboxes on br0)
and a routed one (one veth per sandbox, /32 routes, the gateway address on every pod-side
veth, no bridge; Kata/TAP-like). In the routed shape sibling traffic crosses the pod's nat
and input hooks exactly like upstream traffic, which is where the MITM used to carry a
sandbox to its sibling's :80. Each shape runs once without and once with the transparent MITM.

Attacker: sandbox 1 with ``defaultAction: allow`` (the widest policy there is). Victims: a
TCP listener in sibling sandbox 2 (also allow-all, so it is registered), and a TCP listener
in the pod on every pod address. Listeners log every accepted connection: a connect that
ends at the MITM is not proof of anything, an accept at the victim is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kernel.test_mitm import API, API_IP, SECRET, VAULT, call, vault_call
from tests.kernel.topology import GATEWAY, GATEWAY6, UP_NET, UPSTREAM_IPS, Daemon, Topology, envelope

DPR = "sandbox.data-plane-ready"
ALLOW_ALL = {"defaultAction": "allow", "egress": []}
# Vault bindings need an explicit allow for their hosts (§6 coverage); still allow-all.
ALLOW_ALL_API = {"defaultAction": "allow", "egress": [{"action": "allow", "target": API}]}
MITM_PORT = 18281
DNS_PORT = 15353
POD_UPLINK = f"{UP_NET}.1"
POD_PORTS = (8000, 80, 443)  # some other service, and the ports the MITM intercepts
SIBLING_PORTS = (80, 443, 8000)

# A dual-stack TCP listener that logs "<port> <peer>" per accepted connection and answers
# like an HTTP server, so a curl through any path would show it was reached.
LISTENER = r"""
import socket, sys, threading
log, ports = sys.argv[1], [int(p) for p in sys.argv[2].split(",")]
lock = threading.Lock()
def serve(s, port):
    while True:
        c, peer = s.accept()
        with lock, open(log, "a") as f:
            f.write(f"{port} {peer[0]}\n")
        try:
            c.settimeout(1)
            try:
                c.recv(4096)
            except OSError:
                pass
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 7\r\n\r\nLATERAL")
        except OSError:
            pass
        finally:
            c.close()
for p in ports:
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", p))
    s.listen(16)
    threading.Thread(target=serve, args=(s, p), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture(scope="module", params=["bridged", "routed"])
def net(request: pytest.FixtureRequest) -> Iterator[Topology]:
    routed = request.param == "routed"
    t = Topology(prefix=f"egl{os.getpid()}{request.param[0]}", sandboxes=3, routed=routed).up_()
    try:
        yield t
    finally:
        t.down()


def sandbox_ifaces(topo: Topology) -> str:
    """EGRESSD_SANDBOX_IFACES of each shape (docs/reference/behaviour.md §20.2): the bridge by a prefix; in
    the routed shape sandbox 3's veth by name (it is never registered here, so no hostVeth
    names it), sandboxes 1 and 2 by their attachments' hostVeth."""
    return "vh3" if topo.routed else "br*"


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "mitm"])
def lat(request: pytest.FixtureRequest, net: Topology) -> Iterator[Daemon]:
    env: dict[str, str] = {"EGRESSD_DNS_ADDR": f"0.0.0.0:{DNS_PORT}", "EGRESSD_SANDBOX_IFACES": sandbox_ifaces(net)}
    if request.param:
        env |= {
            "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
            "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
            "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(net.tls_dir / "trust"),
            "EGRESSD_MITM_CONFDIR": str(net.workdir / "mitm-conf"),  # where test_mitm.call looks
            "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(net.workdir / "mitm-run" / "active.sock"),
        }
    table = f"egl-{'mitm' if request.param else 'plain'}"
    d = Daemon(net, table=table, port=18290, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            net.stop(d.proc)
        d.nft("delete", "table", "inet", table, check=False)
        print(d.log_text()[-4000:])  # shown by pytest when a test of this module failed


def mitm_on(d: Daemon) -> bool:
    return d.env.get("OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT") == "1"


class Listener:
    def __init__(self, topo: Topology, ns: str, ports: tuple[int, ...], name: str) -> None:
        self.topo = topo
        self.log = topo.workdir / f"accepts-{name}.log"
        self.log.write_text("")
        self.proc = topo.spawn(
            ns, "python3", "-c", LISTENER, str(self.log), ",".join(map(str, ports)), ready_line="ready"
        )

    def accepts(self) -> list[str]:
        return self.log.read_text().splitlines()

    def stop(self) -> None:
        self.topo.stop(self.proc)


def bind(d: Daemon, i: int, uid: str, *, v6: bool = False, policy: object = ALLOW_ALL) -> None:
    """Register sandbox ``i`` (hostVeth: its real pod-side veth) and activate its policy."""
    ip, gw = (Topology.sb_ip6(i), GATEWAY6) if v6 else (Topology.sb_ip(i), GATEWAY)
    env = envelope("SET_BINDING", uid, ip=ip, gateway=gw, policy=policy)
    env["attachment"]["network"]["hostVeth"] = f"vh{i}"  # type: ignore[index]
    code, body = d.post(env)
    assert (code, body) == (200, "{}"), body
    code, body = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
    assert (code, body) == (200, "{}"), body


def unbind(d: Daemon, *uids: str) -> None:
    for uid in uids:
        d.post(envelope("REMOVE_BINDING", uid))


def connects(topo: Topology, sb: int, host: str, port: int, timeout: float = 1.0) -> bool:
    """A TCP handshake from sandbox ``sb`` completes (with the MITM, maybe only with the MITM)."""
    code = f"import socket; socket.create_connection(({host!r}, {port}), {timeout}).close()"
    r = topo.ns(topo.sb(sb), "python3", "-c", code, check=False, timeout=timeout + 10)
    return r.returncode == 0


def fetch(topo: Topology, sb: int, host: str, port: int) -> str:
    """The body of an HTTP(S) GET from sandbox ``sb`` ('' when nothing answered)."""
    h = f"[{host}]" if ":" in host else host
    url = f"https://{h}/" if port == 443 else f"http://{h}:{port}/"
    r = topo.ns(topo.sb(sb), "curl", "-sk", "--connect-timeout", "1", "-m", "3", url, check=False, timeout=15)
    return r.stdout


def dig_port(topo: Topology, sb: int, server: str, port: int, *, tcp: bool = False) -> str:
    args = ["dig", f"@{server}", "-p", str(port), "a.test", "A", "+time=1", "+tries=1", "+noall", "+comments"]
    if tcp:
        args.append("+tcp")
    out = topo.ns(topo.sb(sb), *args, check=False, timeout=15).stdout
    for line in out.splitlines():
        if "status:" in line:
            return line.split("status:", 1)[1].split(",", 1)[0].strip()
    return "TIMEOUT"


# ---------------------------------------------------------------------------------------------


def test_sibling_sandbox_is_unreachable_on_every_port(net: Topology, lat: Daemon) -> None:
    victim = Listener(net, net.sb(2), SIBLING_PORTS, "sibling")
    try:
        bind(lat, 1, "a1")
        bind(lat, 2, "a2")
        time.sleep(0.2)
        sibling = Topology.sb_ip(2)
        for port in SIBLING_PORTS:
            assert "LATERAL" not in fetch(net, 1, sibling, port), port
        if not mitm_on(lat):
            # Without an interceptor a completed handshake can only be the sibling's.
            assert not any(connects(net, 1, sibling, p) for p in SIBLING_PORTS)
        assert victim.accepts() == [], "a sibling sandbox was reached"
        # The attacker's egress itself is open (the drop is not just a broken sandbox).
        assert net.reaches(1, UPSTREAM_IPS[0])
    finally:
        unbind(lat, "a1", "a2")
        victim.stop()


def test_pod_listeners_are_unreachable_from_a_sandbox(net: Topology, lat: Daemon) -> None:
    pod = Listener(net, net.pod, POD_PORTS, "pod")
    try:
        bind(lat, 1, "a1")
        bind(lat, 3, "a3", v6=True)  # a v6 subject: the same holds for ip6
        time.sleep(0.2)
        for host in (GATEWAY, POD_UPLINK):
            for port in POD_PORTS:
                assert "LATERAL" not in fetch(net, 1, host, port), (host, port)
                if not mitm_on(lat) or port not in (80, 443):
                    assert not connects(net, 1, host, port), (host, port)
        for host in (GATEWAY6, "fd00:204::1"):
            assert not connects(net, 3, host, 8000), host
            assert "LATERAL" not in fetch(net, 3, host, 80), host
        assert pod.accepts() == [], "a pod listener was reached from a sandbox"
        # The pod's own loopback still reaches its listeners (the input hook only polices
        # sandbox sources), and so does the upstream side.
        r = net.ns(net.pod, "curl", "-s", "-m", "3", f"http://{GATEWAY}:8000/", check=False)
        assert r.stdout == "LATERAL"
        r = net.ns(net.up, "curl", "-s", "-m", "3", f"http://{POD_UPLINK}:8000/", check=False)
        assert r.stdout == "LATERAL"
    finally:
        unbind(lat, "a1", "a3")
        pod.stop()


def pod_link_local(topo: Topology, i: int) -> str:
    """The pod's IPv6 link-local address on the interface sandbox ``i`` faces."""
    dev = f"vh{i}" if topo.routed else "br0"
    out = topo.ns(topo.pod, "ip", "-6", "-o", "addr", "show", "dev", dev, "scope", "link").stdout
    return out.split("inet6 ", 1)[1].split("/", 1)[0]


def connects_v6_link_local(topo: Topology, sb: int, host: str, port: int) -> bool:
    code = (
        "import socket; s = socket.socket(socket.AF_INET6); s.settimeout(1.0); "
        f"s.connect(({host!r}, {port}, 0, socket.if_nametoindex('eth0'))); s.close()"
    )
    return topo.ns(topo.sb(sb), "python3", "-c", code, check=False, timeout=15).returncode == 0


def test_an_unregistered_address_of_a_sandbox_reaches_no_pod_listener(net: Topology, lat: Daemon) -> None:
    """docs/reference/behaviour.md §20.2 (was a strict xfail): sandbox 1 is registered with its IPv4 address
    only. From its IPv6 address, its automatic link-local one and an IPv4 address it gave
    itself (no privateCidr names it), it reaches no pod listener bound to the wildcard."""
    pod = Listener(net, net.pod, (8000,), "pod-unregistered")
    spoofed = "10.203.0.98"
    net.ns(net.sb(1), "ip", "addr", "add", f"{spoofed}/32", "dev", "eth0", check=False)
    try:
        bind(lat, 1, "a1")
        time.sleep(0.2)
        assert not connects(net, 1, GATEWAY6, 8000), "from the global IPv6 address"
        assert not connects_v6_link_local(net, 1, pod_link_local(net, 1), 8000), "from fe80::"
        assert not connects_from(net, 1, spoofed, GATEWAY, 8000), "from an address it gave itself"
        assert pod.accepts() == [], "a pod listener was reached from a sandbox interface"
        # What egressd redirected still answers from the registered address.
        assert dig_port(net, 1, GATEWAY, 53) == "NOERROR"
        if net.routed:  # the hostVeth is what names vh1 in this shape
            assert '"vh1"' in lat.nft("list", "set", "inet", lat.table, "sandbox_ifaces")
    finally:
        unbind(lat, "a1")
        net.ns(net.sb(1), "ip", "addr", "del", f"{spoofed}/32", "dev", "eth0", check=False)
        pod.stop()
    # The subject's hostVeth leaves with it (no other subject names it).
    assert '"vh1"' not in lat.nft("list", "set", "inet", lat.table, "sandbox_ifaces")


def test_a_sandbox_that_is_not_registered_reaches_no_pod_listener(net: Topology, lat: Daemon) -> None:
    """docs/reference/behaviour.md §20.2: sandbox 3 has no subject (not yet, or any more). Its interface is
    sandbox-facing by EGRESSD_SANDBOX_IFACES (a bridge prefix, or its veth's name), so neither
    the gateway's IPv4 nor its IPv6 address answers it, on any port but what egressd redirected."""
    pod = Listener(net, net.pod, (8000, 80), "pod-unknown")
    try:
        for host in (GATEWAY, GATEWAY6, POD_UPLINK):
            for port in (8000, 80, DNS_PORT):
                assert not connects(net, 3, host, port), (host, port)
        assert not connects_v6_link_local(net, 3, pod_link_local(net, 3), 8000)
        assert pod.accepts() == [], "a pod listener was reached from an unregistered sandbox"
    finally:
        pod.stop()


PRIVATE_CIDR = "10.203.0.0/24"
EXTRA_SRC = "10.203.0.99"  # an address sandbox 1 gives itself: in the CIDR, never registered


def bind_cidr(d: Daemon, i: int, uid: str) -> None:
    """Like :func:`bind`, with ``attachment.network.privateCidr`` (docs/reference/behaviour.md §14.2)."""
    env = envelope("SET_BINDING", uid, ip=Topology.sb_ip(i), gateway=GATEWAY, policy=ALLOW_ALL)
    env["attachment"]["network"]["privateCidr"] = PRIVATE_CIDR  # type: ignore[index]
    code, body = d.post(env)
    assert (code, body) == (200, "{}"), body
    code, body = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
    assert (code, body) == (200, "{}"), body


def connects_from(topo: Topology, sb: int, src: str, host: str, port: int) -> bool:
    code = (
        "import socket; socket.create_connection("
        f"({host!r}, {port}), 1.0, source_address=({src!r}, 0)).close()"
    )
    return topo.ns(topo.sb(sb), "python3", "-c", code, check=False, timeout=15).returncode == 0


def test_an_address_inside_a_private_cidr_is_a_sandbox_on_every_hook(net: Topology, lat: Daemon) -> None:
    """Sandbox 1 (privateCidr 10.203.0.0/24) sends from an address it gave itself, and
    towards sandbox 3, which is in the CIDR but has no subject: neither the pod's listeners
    nor the unregistered sibling are reached, even with defaultAction allow and the MITM."""
    pod = Listener(net, net.pod, (8000,), "pod-cidr")
    victim = Listener(net, net.sb(3), SIBLING_PORTS, "unregistered-sibling")
    net.ns(net.sb(1), "ip", "addr", "add", f"{EXTRA_SRC}/32", "dev", "eth0", check=False)
    try:
        bind_cidr(lat, 1, "a1")
        time.sleep(0.2)
        assert not connects_from(net, 1, EXTRA_SRC, GATEWAY, 8000)
        assert not connects_from(net, 1, EXTRA_SRC, GATEWAY, DNS_PORT)
        for port in SIBLING_PORTS:
            assert "LATERAL" not in fetch(net, 1, Topology.sb_ip(3), port), port
        assert pod.accepts() == [], "a pod listener was reached from an unregistered sandbox address"
        assert victim.accepts() == [], "an unregistered sandbox in the CIDR was reached"
        # The registered address still resolves through the redirect and reaches upstream.
        assert dig_port(net, 1, GATEWAY, 53) == "NOERROR"
        nets = lat.nft("list", "set", "inet", lat.table, "sandbox_nets_v4")
        assert PRIVATE_CIDR in nets
    finally:
        unbind(lat, "a1")
        net.ns(net.sb(1), "ip", "addr", "del", f"{EXTRA_SRC}/32", "dev", "eth0", check=False)
        pod.stop()
        victim.stop()
    # Removal takes the CIDR out again: the union follows the registered attachments.
    assert PRIVATE_CIDR not in lat.nft("list", "set", "inet", lat.table, "sandbox_nets_v4")


def test_direct_dns_and_mitm_ports_are_dropped(net: Topology, lat: Daemon) -> None:
    bind(lat, 1, "a1")
    try:
        assert dig_port(net, 1, GATEWAY, DNS_PORT) == "TIMEOUT"
        assert dig_port(net, 1, GATEWAY, DNS_PORT, tcp=True) == "TIMEOUT"
        assert not connects(net, 1, GATEWAY, DNS_PORT)
        assert not connects(net, 1, POD_UPLINK, DNS_PORT)
        assert not connects(net, 1, GATEWAY, MITM_PORT)
        assert not connects(net, 1, POD_UPLINK, MITM_PORT)
        assert not connects(net, 1, GATEWAY, lat.port)  # the actions API (loopback-only anyway)
        # The redirected DNS keeps working, over UDP and TCP.
        assert dig_port(net, 1, GATEWAY, 53) == "NOERROR"
        assert dig_port(net, 1, GATEWAY, 53, tcp=True) == "NOERROR"
    finally:
        unbind(lat, "a1")


def test_redirected_dns_and_mitm_keep_working(net: Topology, lat: Daemon) -> None:
    bind(lat, 1, "a1", policy=ALLOW_ALL_API)
    bind(lat, 3, "a3", v6=True)
    try:
        assert net.dig(1, "a.test") == ("NOERROR", [UPSTREAM_IPS[0]])
        assert net.dig(1, "a.test", tcp=True) == ("NOERROR", [UPSTREAM_IPS[0]])
        # IPv6: neighbour discovery with the gateway and DNS over ip6 still pass sandbox_in.
        assert net.dig(3, "v6.test", "AAAA", server=GATEWAY6) == ("NOERROR", ["fd00:204::2"])
        assert net.reaches(1, UPSTREAM_IPS[1]) and net.reaches(1, UPSTREAM_IPS[1], port=443)
        assert net.reaches(3, "fd00:204::3")
        if mitm_on(lat):
            code, body = vault_call(lat, "a1", "PUT", VAULT)
            assert code == 201, body
            assert net.dig(1, API)[0] == "NOERROR"  # the MITM injects only towards learned addresses
            r: Any = call(net, 1, f"https://{API}/v1/models", resolve=f"{API}:443:{API_IP}")
            assert r.code == 200, r.text
            assert r.upstream_header("Authorization") == f"Bearer {SECRET}"
    finally:
        unbind(lat, "a1", "a3")


def test_zz_the_table_keeps_the_lateral_guards(lat: Daemon) -> None:
    """The guards are header objects: subject churn above never removed them."""
    names = lat.object_names()
    assert {"input", "sandbox_in", "dispatch", "sandboxes_v4", "sandboxes_v6"} <= names
    listing = lat.nft("list", "chain", "inet", lat.table, "sandbox_in")
    assert listing.count("goto denied") >= 1  # every refusal is counted (docs/reference/behaviour.md §15)
