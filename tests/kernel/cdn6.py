"""IPv6 for the §18 kernel tests (docs/reference/behaviour.md §18): the CDN topology of
tests/kernel/cdn.py with AAAA records (two names on one v6 upstream address, a name allowed
on one port only, a denied name, an AAAA answer that is a v4-mapped address), a TCP and UDP
echo on the upstream's v6 (and v4) addresses, and the probes and DNS look-ups the v6 tests
share (tests/kernel/test_v6_names_ports.py, tests/kernel/test_v6_names_ports_sidecar.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from tests.kernel.cdn import ZONE as CDN_ZONE
from tests.kernel.topology import GATEWAY6, UPSTREAM_IPS, UPSTREAM_IPS6, Topology

CDN6 = UPSTREAM_IPS6[1]  # fd00:204::3: a.cdn6.test, b.cdn6.test
API6 = UPSTREAM_IPS6[2]  # fd00:204::4: api6.test (tests allow it on 443 only)
EX6 = UPSTREAM_IPS6[3]  # fd00:204::5: ex6.test
DENY6 = UPSTREAM_IPS6[4]  # fd00:204::6: evil6.test, good6.test
NET6_A, NET6_B = UPSTREAM_IPS6[6], UPSTREAM_IPS6[7]  # fd00:204::8, fd00:204::9: in fd00:204::8/125
NET6 = "fd00:204::8/125"
MAPPED_V4 = UPSTREAM_IPS[5]  # 10.204.0.7: v4name.test, and mapped.test's AAAA as ::ffff:10.204.0.7
MAPPED6 = "::ffff:10.204.0.7"  # as dig prints it
MAPPED6_ZONE = "::ffff:acc:7"  # the same address as dnslib parses it

ZONE6: list[dict[str, object]] = [
    *CDN_ZONE,
    {"name": "a.cdn6.test", "type": "AAAA", "value": CDN6, "ttl": 60},
    {"name": "b.cdn6.test", "type": "AAAA", "value": CDN6, "ttl": 60},
    {"name": "api6.test", "type": "AAAA", "value": API6, "ttl": 60},
    {"name": "ex6.test", "type": "AAAA", "value": EX6, "ttl": 60},
    {"name": "evil6.test", "type": "AAAA", "value": DENY6, "ttl": 60},
    {"name": "good6.test", "type": "AAAA", "value": DENY6, "ttl": 60},
    {"name": "www6.cdn6.test", "type": "CNAME", "value": "edge6.cdnhost6.test", "ttl": 60},
    {"name": "edge6.cdnhost6.test", "type": "AAAA", "value": CDN6, "ttl": 60},
    {"name": "v4name.test", "type": "A", "value": MAPPED_V4, "ttl": 60},
    {"name": "other4.test", "type": "A", "value": MAPPED_V4, "ttl": 60},
    {"name": "mapped.test", "type": "AAAA", "value": MAPPED6_ZONE, "ttl": 60},
]

TCP_PORTS = (22, 5432, 5433, 7000, 7001)
UDP_PORTS = (443, 5432, 7000)

_ECHO = """
import socket, sys, threading
def tcp_listener(port):
    s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::", port)); s.listen(64)  # dual stack: v6 and v4 (as ::ffff:a.b.c.d)
    return s
def tcp(s):
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
def serve(c):
    try:
        while True:
            d = c.recv(65536)
            if not d:
                return
            c.sendall(d)
    except OSError:
        return
def udp_socket(ip, port):
    # One socket per address: a reply leaves from the address it was sent to.
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, port))
    return s
def udp(s):
    while True:
        d, a = s.recvfrom(65536); s.sendto(d, a)
tcps = [tcp_listener(int(p)) for p in sys.argv[1].split(",")]
udps = [udp_socket(ip, int(p)) for p in sys.argv[2].split(",") for ip in sys.argv[3].split(",")]
for s in tcps:
    threading.Thread(target=tcp, args=(s,), daemon=True).start()
for s in udps:
    threading.Thread(target=udp, args=(s,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

# One TCP connection or one UDP datagram that must come back; a literal with ":" is dialled
# from an AF_INET6 socket (so ::ffff:a.b.c.d is a v4-mapped destination of a v6 socket).
# ``shape``: "dstopts" (a Destination Options extension header, PadN, before the transport
# header: CAP_NET_RAW, which a sandbox root has in its namespace), "hbh" (Hop-by-Hop Options),
# "big" (a payload over the MTU: IPv6 fragments).
PROBE = """
import socket, sys
proto, host, port, shape = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
payload = b"ping" * (1000 if shape == "big" else 1)
try:
    s = socket.socket(fam, socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM); s.settimeout(2.0)
    if shape in ("dstopts", "hbh"):
        opt = socket.IPV6_DSTOPTS if shape == "dstopts" else socket.IPV6_HOPOPTS
        s.setsockopt(socket.IPPROTO_IPV6, opt, bytes([0, 0, 1, 4, 0, 0, 0, 0]))
    if proto == "tcp":
        s.connect((host, port))
        s.sendall(payload); got = b""
        while len(got) < len(payload):
            d = s.recv(65536)
            if not d:
                break
            got += d
        ok = got == payload
    else:
        s.sendto(payload, (host, port)); ok = s.recvfrom(65536)[0] == payload
except OSError:
    ok = False
print("open" if ok else "closed")
"""

# One connection per port, each pinged every 0.2 s; prints "<port> ok|dead" per ping.
HOLD = """
import socket, sys, time
host, ports, seconds = sys.argv[1], [int(p) for p in sys.argv[2].split(",")], float(sys.argv[3])
socks = {p: socket.create_connection((host, p), timeout=2.0) for p in ports}
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


@contextmanager
def echo(t: Topology) -> Iterator[subprocess.Popen[str]]:
    """TCP echo (dual stack) and UDP echo on every upstream address, on the probed ports."""
    proc = t.spawn(
        t.up,
        "python3",
        "-c",
        _ECHO,
        ",".join(map(str, TCP_PORTS)),
        ",".join(map(str, UDP_PORTS)),
        ",".join(UPSTREAM_IPS + UPSTREAM_IPS6),
        ready_line="ready",
    )
    try:
        yield proc
    finally:
        t.stop(proc)


def probe(t: Topology, sb: int, proto: str, ip: str, port: int, shape: str = "plain") -> bool:
    out = t.ns(t.sb(sb), "python3", "-c", PROBE, proto, ip, str(port), shape, check=False, timeout=15).stdout
    return out.strip() == "open"


def learn6(t: Topology, sb: int, name: str, expect: str, *, server: str = GATEWAY6) -> None:
    """``dig AAAA name`` from sandbox ``sb`` over IPv6; ``expect`` among the answers."""
    status, answers = t.dig(sb, name, "AAAA", server=server)
    assert status == "NOERROR" and expect in answers, (name, status, answers)


def conntrack(t: Topology, ns: str) -> str:
    """The namespace's conntrack table (evidence for a failure message)."""
    r = t.ns(ns, "conntrack", "-L", "-f", "ipv6", check=False)
    return r.stdout + r.stderr


RAW = r"""
import socket, sys, time
ip, port, data, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode().decode("unicode_escape").encode("latin-1"), float(sys.argv[4])
s = socket.create_connection((ip, port), timeout=4)
if data:
    s.sendall(data)
time.sleep(wait)
s.settimeout(3)
got = b""
try:
    while True:
        d = s.recv(65536)
        if not d:
            break
        got += d
except OSError:
    pass
print(repr(got[:400]))
"""


# One TCP connection: ``data`` (escapes decoded) sent, ``wait`` seconds, then what came back (repr).
def raw6(t: Topology, sb: int, ip: str, port: int, data: str, wait: float = 0.5) -> str:
    return t.ns(
        t.sb(sb), "python3", "-c", RAW, ip, str(port), data, str(wait), check=False, timeout=30
    ).stdout


# A UDP datagram in an IPv6 atomic fragment (a Fragment header, offset 0, no more fragments:
# RFC 6946), sent on a raw socket (CAP_NET_RAW: a sandbox root has it in its namespace); the
# echo's answer is read on an ordinary UDP socket bound to the same source port.
ATOMIC = r"""
import socket, struct, sys
host, port = sys.argv[1], int(sys.argv[2])
rx = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); rx.bind(("::", 0)); rx.settimeout(2.0)
rx.connect((host, port)); src = rx.getsockname()[0]; sport = rx.getsockname()[1]
payload = b"ping"
length = 8 + len(payload)
def csum(data):
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return (~s) & 0xFFFF
pseudo = socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, host) + struct.pack("!I3xB", length, 17)
udp = struct.pack("!HHHH", sport, port, length, 0) + payload
c = csum(pseudo + udp) or 0xFFFF
udp = struct.pack("!HHHH", sport, port, length, c) + payload
frag = struct.pack("!BBHI", 17, 0, 0, 0x5EC7)  # next header UDP, offset 0, M=0
raw = socket.socket(socket.AF_INET6, socket.SOCK_RAW, 44)  # the kernel writes next header 44
raw.sendto(frag + udp, (host, 0))
try:
    ok = rx.recv(16) == payload
except OSError:
    ok = False
print("open" if ok else "closed")
"""


def atomic_udp(t: Topology, sb: int, ip: str, port: int) -> bool:
    out = t.ns(t.sb(sb), "python3", "-c", ATOMIC, ip, str(port), check=False, timeout=15)
    return out.stdout.strip() == "open"
