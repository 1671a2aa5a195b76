"""The sidecar's DNS guard against the real kernel (docs/reference/behaviour.md §8.6, docs/security.md).

The redirect to the DNS proxy is NAT, decided on a flow's first packet only. A packet that
matches a tracked flow which was never redirected (one of the forwarder's own upstream queries,
whose socket has since closed: a timeout, a pool overflow, a crash) would go to the resolver as
addressed, past the DNS policy. These tests try exactly that from the app.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from egressd.sidecarnft.ruleset import FWD_ZONE_CHAIN
from tests.kernel.sidecar import TABLE, Sidecar
from tests.kernel.topology import DNS_UPSTREAM, UP_NET, ZONE, Topology, cleanup_stale

UP6 = "fd00:204::2"  # the upstream (its DNS server answers on every upstream address)
UP6_NEVER = "fd00:204::9"  # never allowed
BURST_N = 64  # the DNS proxy's in-flight cap per client (dnsproxy/server.py)
# Answered after a while, so a burst's questions are all in flight at once: the forwarder opens
# sockets beyond its pool (32).
SLOW = [
    {"name": f"n{i}.slow.example.test", "type": "A", "value": f"{UP_NET}.5", "ttl": 30, "delay_s": 0.5}
    for i in range(BURST_N)
]

# Every ephemeral source port, each sending a denied name to the resolver's port 53.
_SPRAY = (
    "import socket\n"
    "from dnslib import DNSRecord\n"
    "q = DNSRecord.question('%(name)s').pack()\n"
    "sent = 0\n"
    "for port in range(32768, 61000):\n"
    "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "    try:\n"
    "        s.bind(('0.0.0.0', port)); s.sendto(q, ('%(up)s', 53)); sent += 1\n"
    "    except OSError:\n"
    "        pass\n"
    "    s.close()\n"
    "print('sent', sent)\n"
)

# The forwarder's way (SO_MARK 0x1, so not redirected; the harness is root) for one query,
# socket closed; then the app, unmarked, from the same source port.
_RIDE = (
    "import socket\n"
    "from dnslib import DNSRecord\n"
    "f = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); f.settimeout(2)\n"
    "f.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 1)\n"
    "f.bind(('0.0.0.0', 0)); port = f.getsockname()[1]\n"
    "f.sendto(DNSRecord.question('a.test').pack(), ('%(up)s', 53)); f.recv(4096); f.close()\n"
    "a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); a.settimeout(2)\n"
    "a.bind(('0.0.0.0', port))\n"
    "try:\n"
    "    a.sendto(DNSRecord.question('%(name)s').pack(), ('%(up)s', 53))\n"
    "except PermissionError:\n"
    "    print('refused')\n"  # the output hook dropped it: sendto() fails with EPERM
    "else:\n"
    "    try:\n"
    "        print('answered', DNSRecord.parse(a.recv(4096)).header.rcode)\n"
    "    except OSError:\n"
    "        print('no answer')\n"
)


@pytest.fixture(scope="module")
def gtopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egg{os.getpid()}", sandboxes=1, zone=[*ZONE, *SLOW]).up_()
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(gtopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(gtopo, sb=1)
    try:
        yield sc
    finally:
        sc.cleanup()
        gtopo.ns(sc.ns, "conntrack", "-F", check=False)  # the next test starts without our entries


def _policy() -> str:
    return json.dumps(
        {
            "defaultAction": "deny",
            "egress": [
                {"action": "allow", "target": "a.test"},
                {"action": "allow", "target": "*.example.test"},
            ],
        }
    )


def _dropped(topo: Topology, sc: Sidecar) -> int:
    out = topo.ns(sc.ns, "nft", "-j", "list", "counter", "inet", TABLE, "dropped").stdout
    for item in json.loads(out)["nftables"]:
        if "counter" in item:
            return int(item["counter"]["packets"])
    raise AssertionError(out)


def _unredirected_dns_flows(topo: Topology, sc: Sidecar) -> list[str]:
    """Tracked udp flows to port 53 answered from where they were sent (not the proxy)."""
    out = topo.ns(sc.ns, "conntrack", "-L", "-p", "udp", "--dport", "53", check=False).stdout
    return [ln for ln in out.splitlines() if "dport=53" in ln and "src=127.0.0.1" not in ln]


@pytest.mark.parametrize("zone", [True, False], ids=["zone", "guard-only"])
@pytest.mark.parametrize("mode", ["dns", "dns+nft"])
def test_an_app_riding_a_closed_forwarder_sockets_flow_never_reaches_the_resolver(
    sidecar: Sidecar, gtopo: Topology, mode: str, zone: bool
) -> None:
    """``zone``: the forwarder's flow is in its own conntrack zone, so the app's packet from its
    port is a flow of its own, redirected (the proxy answers NXDOMAIN by the policy).
    ``guard-only``: the zone rule taken out, the packet rides the flow and the guard refuses it
    (defence in depth)."""
    sidecar.env["OPENSANDBOX_EGRESS_MODE"] = mode
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = _policy()
    sidecar.start()
    if not zone:
        gtopo.ns(sidecar.ns, "nft", "flush", "chain", "inet", TABLE, FWD_ZONE_CHAIN)
    before = _dropped(gtopo, sidecar)
    r = sidecar.python(_RIDE % {"up": DNS_UPSTREAM, "name": "exfil-by-collision.test"})
    assert "exfil-by-collision.test" not in gtopo.upstream_queries()
    if zone:
        assert r.stdout.strip() == "answered 3", r.stdout + r.stderr[-500:]
        assert _dropped(gtopo, sidecar) == before
    else:
        # Not the proxy's NXDOMAIN either: the packet never met the redirect, the guard drops it.
        assert r.stdout.strip() == "refused", r.stdout + r.stderr[-500:]
        assert _dropped(gtopo, sidecar) == before + 1  # counted as a refusal (§15)
    # DNS itself still works, by the policy.
    assert sidecar.dig("a.test")[0] == "NOERROR"
    assert sidecar.dig("b.test")[0] == "NXDOMAIN"


@pytest.mark.parametrize("mode", ["dns", "dns+nft"])
def test_after_a_crash_the_old_forwarders_flows_are_no_way_past_the_proxy(
    sidecar: Sidecar, gtopo: Topology, mode: str
) -> None:
    sidecar.env["OPENSANDBOX_EGRESS_MODE"] = mode
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = _policy()
    sidecar.start()
    # The forwarder's pooled socket: a tracked flow that was never redirected.
    for name in ("a.test", "api.example.test"):
        assert sidecar.dig(name)[0] == "NOERROR"
    assert _unredirected_dns_flows(gtopo, sidecar)
    sidecar.kill(signal.SIGKILL)  # its sockets close; their conntrack entries stay
    sidecar.start()
    # Forgotten at start-up: an app reusing such a port (by chance, or on purpose) is redirected
    # like any other, rather than refused by the guard.
    assert _unredirected_dns_flows(gtopo, sidecar) == []
    spray = sidecar.python(_SPRAY % {"up": DNS_UPSTREAM, "name": "exfil-after-crash.test"}, timeout=120)
    assert spray.stdout.startswith("sent"), spray.stderr[-500:]
    time.sleep(0.5)
    assert "exfil-after-crash.test" not in gtopo.upstream_queries()


# A spoofed "answer" first (IPV6_FREEBIND needs no capability): resolver:53 -> the app's own
# address, over loopback. Then the app's query from that port rides the entry as its reply.
_SPOOF = (
    "import socket\n"
    "from dnslib import DNSRecord\n"
    "IPV6_FREEBIND = 78\n"
    "me, up, port = '%(me)s', '%(up)s', 40053\n"
    "out = []\n"
    "try:\n"
    "    f = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n"
    "    f.setsockopt(socket.IPPROTO_IPV6, IPV6_FREEBIND, 1)\n"
    "    f.bind((up, 53)); f.sendto(b'x', (me, port)); f.close(); out.append('spoofed')\n"
    "except OSError as e:\n"
    "    out.append('spoof refused')\n"
    "a = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); a.settimeout(2)\n"
    "a.bind((me, port))\n"
    "try:\n"
    "    a.sendto(DNSRecord.question('%(name)s').pack(), (up, 53))\n"
    "    out.append('answered %%d' %% DNSRecord.parse(a.recv(4096)).header.rcode)\n"
    "except PermissionError:\n"
    "    out.append('refused')\n"
    "except OSError:\n"
    "    out.append('no answer')\n"
    "print(', '.join(out))\n"
)


@pytest.mark.parametrize("mode", ["dns", "dns+nft"])
def test_a_spoofed_answer_opens_no_way_to_the_resolver(sidecar: Sidecar, gtopo: Topology, mode: str) -> None:
    sidecar.env["OPENSANDBOX_EGRESS_MODE"] = mode
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = _policy()
    sidecar.start()
    r = sidecar.python(_SPOOF % {"me": gtopo.sb_ip6(1), "up": UP6, "name": "exfil-by-spoof.test"})
    assert r.returncode == 0, r.stderr[-500:]
    assert "exfil-by-spoof.test" not in gtopo.upstream_queries(), r.stdout
    # The forged packet is refused at once (its source is not this namespace's), so the query
    # is a flow of its own: redirected, and the proxy answers NXDOMAIN by the policy.
    assert r.stdout.strip() == "spoof refused, answered 3", r.stdout


# Allowed slow questions at once, each answer judged (JSON counts by outcome). From ports below
# the ephemeral range: a late answer to the spray would otherwise reach a burst socket that
# reuses its port.
_BURST = (
    "import json, socket, time\n"
    "from dnslib import DNSRecord\n"
    "socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(%(n)d)]\n"
    "for i, s in enumerate(socks):\n"
    "    s.bind(('0.0.0.0', 20000 + i))\n"
    "    s.sendto(DNSRecord.question(f'n{i}.slow.example.test').pack(), ('%(up)s', 53))\n"
    "end, out = time.monotonic() + 8, {}\n"
    "for s in socks:\n"
    "    s.settimeout(max(0.01, end - time.monotonic()))\n"
    "    try:\n"
    "        r = DNSRecord.parse(s.recv(4096))\n"
    "    except OSError:\n"
    "        k = 'timeout'\n"
    "    else:\n"
    "        ok = r.header.rcode == 0 and [str(a.rdata) for a in r.rr] == ['%(want)s']\n"
    "        k = 'ok' if ok else f'rcode-{r.header.rcode}'\n"
    "    out[k] = out.get(k, 0) + 1\n"
    "print(json.dumps(out))\n"
)


# Echo replies arriving at the upstream that carry the app's payload (a raw socket: the harness is root).
_ECHO_LISTENER = (
    "import socket, time\n"
    "s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6); s.settimeout(0.2)\n"
    "print('listening', flush=True)\n"
    "end, n = time.time() + 4, 0\n"
    "while time.time() < end:\n"
    "    try:\n"
    "        data = s.recv(4096)\n"
    "    except OSError:\n"
    "        continue\n"
    "    n += data[0] == 129 and b'exfil-by-echo' in data\n"
    "print('echo replies', n, flush=True)\n"
)

# An echo request forged from a never-allowed address to the app's own: the kernel's echo reply
# (the app's payload) would be that flow's reply direction, accepted as established.
_FORGED_ECHO = (
    "import socket\n"
    "s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6)\n"
    "s.setsockopt(socket.IPPROTO_IPV6, 78, 1)\n"  # IPV6_FREEBIND
    "s.bind(('%(forged)s', 0))\n"
    "try:\n"
    "    s.sendto(b'\\x80\\x00\\x00\\x00\\x00\\x01\\x00\\x01exfil-by-echo', ('%(me)s', 0)); print('sent')\n"
    "except PermissionError:\n"
    "    print('refused')\n"
)


def test_a_forged_source_opens_no_established_way_out(sidecar: Sidecar, gtopo: Topology) -> None:
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = _policy()
    sidecar.start()
    # Ping sockets for every group (runtimes that let the app bind low ports often allow them).
    gtopo.ns(sidecar.ns, "sysctl", "-qw", "net.ipv4.ping_group_range=0 2147483647")
    before = _dropped(gtopo, sidecar)
    listener = gtopo.spawn(gtopo.up, sys.executable, "-c", _ECHO_LISTENER, ready_line="listening")
    try:
        r = sidecar.python(_FORGED_ECHO % {"forged": UP6_NEVER, "me": gtopo.sb_ip6(1)})
        out, _ = listener.communicate(timeout=20)
    finally:
        gtopo.stop(listener)
    assert r.returncode == 0, r.stderr[-500:]
    assert out.strip().endswith("echo replies 0"), out
    assert _dropped(gtopo, sidecar) > before  # the forged request itself was refused (§15)


_FOREIGN_RESOLVER = (
    "import socket, time\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', 5399)); s.settimeout(0.2)\n"
    "print('listening', flush=True)\n"
    "end, n = time.time() + 4, 0\n"
    "while time.time() < end:\n"
    "    try:\n"
    "        n += b'exfil-foreign' in s.recv(4096)\n"
    "    except OSError:\n"
    "        pass\n"
    "print('queries', n, flush=True)\n"
)


@pytest.mark.parametrize("mode", ["dns", "dns+nft"])
def test_dns_another_table_rewrites_first_is_refused(sidecar: Sidecar, gtopo: Topology, mode: str) -> None:
    """A container runtime's embedded DNS is a NAT rule of its own at the same hook: when it
    runs first, ours does not, and the query would go where it points, past the proxy (mode
    dns has no other filter; in dns+nft the egress chain also refuses the destination)."""
    sidecar.env["OPENSANDBOX_EGRESS_MODE"] = mode
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = _policy()
    sidecar.start()
    foreign = (
        "table ip egressd_test_foreign {\n"
        "  chain out { type nat hook output priority -101; policy accept;\n"
        "    udp dport 53 dnat to 127.0.0.1:5399\n"
        "  }\n"
        "}\n"
    )
    script = gtopo.workdir / "foreign-nat.nft"
    script.write_text(foreign)
    gtopo.ns(sidecar.ns, "nft", "-f", str(script))
    listener = gtopo.spawn(sidecar.ns, sys.executable, "-c", _FOREIGN_RESOLVER, ready_line="listening")
    try:
        before = _dropped(gtopo, sidecar)
        assert sidecar.dig("exfil-foreign.test")[0] == "TIMEOUT"
        out, _ = listener.communicate(timeout=20)
    finally:
        gtopo.stop(listener)
        gtopo.ns(sidecar.ns, "nft", "delete", "table", "ip", "egressd_test_foreign", check=False)
    assert out.strip().endswith("queries 0"), out
    assert _dropped(gtopo, sidecar) > before


def test_the_guard_lets_the_deny_reject_reset_through(sidecar: Sidecar) -> None:
    """EGRESSD_DENY_REJECT's TCP reset comes from the refused destination (not a local
    address) and belongs to no socket: the source check must not swallow it."""
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = _policy()
    sidecar.env["EGRESSD_DENY_REJECT"] = "1"
    sidecar.start()
    r = sidecar.python(
        "import socket, time\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    socket.create_connection(('10.204.0.9', 80), timeout=5)\n"
        "except ConnectionRefusedError:\n"
        "    print('refused', round(time.monotonic() - t, 1))\n"
        "except OSError as e:\n"
        "    print('other', type(e).__name__)\n"
    )
    word, _, seconds = r.stdout.strip().partition(" ")
    assert word == "refused" and float(seconds) < 2, r.stdout + r.stderr[-300:]


@pytest.mark.parametrize("mode", ["dns", "dns+nft"])
def test_the_apps_spray_does_not_capture_the_forwarders_next_sockets(
    sidecar: Sidecar, gtopo: Topology, mode: str
) -> None:
    """The app's entries ``app:P -> resolver:53`` (redirected to the proxy), one per ephemeral
    port, must not catch the first packet of the forwarder's next socket on P: that query would
    loop back to the proxy. The forwarder's flows are in their own conntrack zone
    (nftsyntax.forwarder_zone)."""
    sidecar.env["OPENSANDBOX_EGRESS_MODE"] = mode
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = _policy()
    sidecar.env["EGRESSD_DNS_QPS_PER_SUBJECT"] = "0"  # the spray would spend the budget (§14.3)
    sidecar.start()
    spray = sidecar.python(_SPRAY % {"up": DNS_UPSTREAM, "name": "b.test"}, timeout=120)
    assert spray.stdout.startswith("sent"), spray.stderr[-500:]
    r = sidecar.python(_BURST % {"n": BURST_N, "up": DNS_UPSTREAM, "want": f"{UP_NET}.5"})
    assert r.returncode == 0, r.stderr[-500:]
    assert json.loads(r.stdout) == {"ok": BURST_N}, r.stdout
