"""A sidecar narrowing's cut against a peer that works to bring the flow back
(docs/reference/behaviour.md §8.6, §14.1), and the ingress the sidecar does not police.

The cut marks a refused flow's conntrack entry; the mark lives on the entry only. A peer that
ends the entry (a RST conntrack takes while the app's stack ignores it: the app has
delayed-ACKed newer bytes, so the RST's sequence number is in conntrack's window but not the
app's) waits for it to expire, then sends again: conntrack would pick its next packet up as a
new flow in reverse (peer -> app), unmarked, whose reply direction, the app's packets, the
egress chain accepts as established. The sidecar's ``inbound`` chain marks such a pickup
(conntrack mark bit 0x20000000), and the egress chain judges the app's packets on it by the
policy; a peer's SYN on the old 4-tuple starts an unmarked entry, and the egress chain refuses
the app's TCP on a flow a peer started until its handshake is done (found by attacker reviews).
A flow picked up from an allowed peer goes on (the last test).

A flow the peer opens (a SYN to a listener, a datagram, a simultaneous open) is ingress: the
sidecar hooks the app's output and does not decide who may reach the app (docs/security.md,
Known limitations), so that case is a strict xfail here."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.kernel.sidecar import Sidecar
from tests.kernel.topology import UP_NET, Topology, cleanup_stale

CDN_IP = f"{UP_NET}.6"  # api.example.test
NEVER_IP = f"{UP_NET}.9"  # never allowed by any policy here
ALLOWED = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "api.example.test"}]}
NARROWED = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "example.test"}]}


@pytest.fixture(scope="module")
def rtopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egr{os.getpid()}", sandboxes=1).up_()
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(rtopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(rtopo, sb=1)
    sc.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(ALLOWED)
    try:
        sc.start()
        assert sc.dig("api.example.test") == ("NOERROR", [CDN_IP])
        yield sc
    finally:
        sc.cleanup()


# ---- the same 4-tuple: a peer's RST that conntrack takes (CLOSE) and the app ignores ---------

UP_RST = r"""
import socket, struct, sys, threading, time
me, port = sys.argv[1], int(sys.argv[2])
last = {}
def sniff():
    p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003)); p.bind(("eth0", 0))
    while True:
        f, addr = p.recvfrom(65535)
        if f[12:14] != b"\x08\x00": continue
        ip = f[14:]; ihl = (ip[0] & 15) * 4
        if ip[9] != 6: continue
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        t = ip[ihl:]; sp, dp, seq, ack = struct.unpack("!HHII", t[:12]); off = (t[12] >> 4) * 4
        tot = struct.unpack("!H", ip[2:4])[0]; ln = tot - ihl - off
        if src == me and sp == port:
            last["out"] = (dst, dp, seq, ack, ln, t[13])
        elif dst == me and dp == port:
            last["in"] = (src, sp, seq, ack, ln, t[13])
threading.Thread(target=sniff, daemon=True).start()
def csum(b):
    if len(b) % 2: b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b)); s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
def rst(dst, dp, seq, ack):
    hdr = struct.pack("!HHIIBBHHH", port, dp, seq, ack, 5 << 4, 0x14, 0, 0, 0)
    ph = socket.inet_aton(me) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(hdr))
    hdr = hdr[:16] + struct.pack("!H", csum(ph + hdr)) + hdr[18:]
    r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP); r.bind((me, 0)); r.sendto(hdr, (dst, 0))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((me, port)); s.listen(1)
print("ready", flush=True)
c, a = s.accept(); t0 = time.time()
def log(*x): print("%.2f" % (time.time() - t0), *x, flush=True)
c.settimeout(0.5)
def reader():
    while True:
        try:
            d = c.recv(1000)
        except socket.timeout:
            continue
        except OSError as e:
            log("recv error", e); return
        if not d:
            log("eof"); return
        log("got", d)
        if d.startswith(b"ping"):
            c.sendall(b"pong")
threading.Thread(target=reader, daemon=True).start()
sys.stdin.readline()  # the test says: the cut is done
log("last", last)
dst, dp, seq, ack, ln, fl = last["out"]
a_seq = seq + ln
c.sendall(b"S" * 10)
rst(dst, dp, a_seq, last["in"][2] + last["in"][4])
log("sent S and RST seq", a_seq)
time.sleep(60)
"""

APP_RST = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
t0 = time.time()
def log(*x): print("%.2f" % (time.time() - t0), *x, flush=True)
for i in range(5):
    s.sendall(b"ping%d" % i); log("app got", s.recv(100)); time.sleep(0.1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)
print("up", flush=True)
s.settimeout(0.2)
end = time.time() + float(sys.argv[3]); sent = 0; next_send = time.time() + float(sys.argv[4])
while time.time() < end:
    try:
        d = s.recv(100)
        if d: log("app got", d)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)
    except socket.timeout:
        pass
    except OSError as e:
        log("app error", e); break
    if time.time() > next_send:
        try:
            s.sendall(b"EXFIL-%d" % sent); log("app sent EXFIL-%d" % sent); sent += 1
        except OSError as e:
            log("app send error", e)
        next_send = time.time() + 3
"""


def _ct(rtopo: Topology, port: int) -> str:
    r = rtopo.ns(rtopo.sb(1), "conntrack", "-L", "-p", "tcp", check=False)
    return "\n".join(ln for ln in r.stdout.splitlines() if f"port={port}" in ln)


def _started_by_peer(snapshots: list[str], state: str) -> list[str]:
    """Entries in ``state`` whose original direction is the peer's (peer -> app)."""
    return [
        ln
        for snap in snapshots
        for ln in snap.splitlines()
        if f" {state} " in f" {ln} " and ln.split("src=", 1)[-1].startswith(f"{CDN_IP} ")
    ]


def _narrow_and_wait_for_the_mark(sidecar: Sidecar, rtopo: Topology, port: int) -> None:
    sidecar.set_policy(NARROWED)
    deadline = time.monotonic() + 10
    while "mark=1073741824" not in _ct(rtopo, port):
        assert time.monotonic() < deadline, f"the cut did not mark the flow: {_ct(rtopo, port)}"
        time.sleep(0.2)


def test_a_cut_flow_ended_by_the_peers_rst_does_not_come_back_in_reverse(
    sidecar: Sidecar, rtopo: Topology
) -> None:
    port = 7101
    up = subprocess.Popen(
        ["ip", "netns", "exec", rtopo.up, "python3", "-c", UP_RST, CDN_IP, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None and "ready" in up.stdout.readline()
        # App: quiet after its pings until t=40 s, then sends EXFIL every 3 s until t=55 s.
        app = rtopo.spawn(
            rtopo.sb(1), "python3", "-c", APP_RST, CDN_IP, str(port), "55", "40", ready_line="up"
        )
        time.sleep(0.5)
        _narrow_and_wait_for_the_mark(sidecar, rtopo, port)
        assert up.stdin is not None
        up.stdin.write("go\n")
        up.stdin.flush()
        time.sleep(0.5)
        seen = []
        for _ in range(12):
            time.sleep(4)
            seen.append(_ct(rtopo, port))
        app_out = app.communicate(timeout=30)[0]
        up.kill()
        up_out = up.communicate(timeout=5)[0]
        report = f"UP:\n{up_out}\nAPP:\n{app_out}\nconntrack every 4 s:\n" + "\n".join(seen)
        assert "app sent EXFIL" in app_out, f"the app never tried: {report}"
        # The attack happened: the RST closed the marked entry, and the peer's retransmission
        # was picked up in reverse, where the inbound chain marked it.
        assert any(" CLOSE " in snap and "mark=1073741824" in snap for snap in seen), report
        picked = _started_by_peer(seen, "ESTABLISHED")
        assert picked and all("mark=536870912" in ln for ln in picked), report
        assert "EXFIL" not in up_out, (
            "the app's data reached the narrowed upstream on the cut flow's own 4-tuple:\n" + report
        )
    finally:
        if up.poll() is None:
            up.kill()


# Same upstream as the RST test, but ~13 s after its RST (the CLOSE entry has expired) it
# sends one SYN on the old 4-tuple, reverse direction (peer -> app): a "new" SYN the inbound
# chain lets through, whose entry makes the app's packets its reply direction.
UP_SYN = UP_RST.replace(
    "time.sleep(60)\n",
    """
def syn(dst, dp, seq):
    hdr = struct.pack("!HHIIBBHHH", port, dp, seq, 0, 5 << 4, 0x02, 64240, 0, 0)
    ph = socket.inet_aton(me) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(hdr))
    hdr = hdr[:16] + struct.pack("!H", csum(ph + hdr)) + hdr[18:]
    r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP); r.bind((me, 0)); r.sendto(hdr, (dst, 0))
time.sleep(13)
syn(dst, dp, a_seq + 100000)
log("sent SYN on the old 4-tuple")
for i in range(8):
    time.sleep(12); syn(dst, dp, a_seq + 100000)
time.sleep(60)
""",
)


def test_a_peers_syn_on_the_old_4_tuple_does_not_revive_a_cut_flow(sidecar: Sidecar, rtopo: Topology) -> None:
    """The peer's SYN starts an unmarked entry (peer -> app, SYN_SENT) whose reply direction is
    the app's old connection; conntrack calls those packets established. The egress chain
    refuses the app's TCP on a peer's flow until its handshake is done (ct status assured),
    bar a SYN-ACK or RST (found by an attacker review)."""
    port = 7111
    up = subprocess.Popen(
        ["ip", "netns", "exec", rtopo.up, "python3", "-c", UP_SYN, CDN_IP, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None and "ready" in up.stdout.readline()
        app = rtopo.spawn(
            rtopo.sb(1), "python3", "-c", APP_RST, CDN_IP, str(port), "55", "40", ready_line="up"
        )
        time.sleep(0.5)
        _narrow_and_wait_for_the_mark(sidecar, rtopo, port)
        assert up.stdin is not None
        up.stdin.write("go\n")
        up.stdin.flush()
        seen = []
        for _ in range(13):
            time.sleep(4)
            seen.append(_ct(rtopo, port))
        app_out = app.communicate(timeout=30)[0]
        up.kill()
        up_out = up.communicate(timeout=5)[0]
        report = f"UP:\n{up_out}\nAPP:\n{app_out}\nCT:\n" + "\n--\n".join(seen)
        assert "app sent EXFIL" in app_out, report
        # The attack happened: the peer's SYN started an entry of its own (SYN_SENT), unmarked.
        started = _started_by_peer(seen, "SYN_SENT")
        assert started and not any("mark=1073741824" in ln for ln in started), report
        assert "EXFIL" not in up_out, report
    finally:
        if up.poll() is None:
            up.kill()


# ---- ingress: flows the peer opens ---------------------------------------------------------

# The app: listens on TCP and UDP, and simultaneously "connects" (simultaneous open) from a
# bound port; whatever peer it gets, it sends EXFIL-<kind>.
APP = r"""
import socket, sys, threading, time
me, peer = sys.argv[1], sys.argv[2]
def tcp_listen():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((me, 7001)); s.listen(4); s.settimeout(12)
    try:
        c, a = s.accept(); c.sendall(b"EXFIL-listen"); time.sleep(0.5); print("listen-accepted", a, flush=True)
    except OSError as e:
        print("listen", e, flush=True)
def udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((me, 7002)); u.settimeout(12)
    try:
        d, a = u.recvfrom(100); u.sendto(b"EXFIL-udp", a); print("udp-got", d, a, flush=True)
    except OSError as e:
        print("udp", e, flush=True)
def simopen():
    end = time.time() + 12
    while time.time() < end:
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((me, 7003)); s.settimeout(1.5)
        try:
            s.connect((peer, 7004)); s.sendall(b"EXFIL-simopen"); time.sleep(0.5); print("simopen-connected", flush=True); return
        except OSError as e:
            s.close(); time.sleep(0.1)
    print("simopen failed", flush=True)
ts = [threading.Thread(target=f) for f in (tcp_listen, udp, simopen)]
[t.start() for t in ts]; print("up", flush=True); [t.join() for t in ts]
"""

PEER = r"""
import socket, sys, threading, time
src, app = sys.argv[1], sys.argv[2]
got = []
def tcp_connect():
    for _ in range(20):
        try:
            s = socket.create_connection((app, 7001), timeout=1, source_address=(src, 0))
            got.append(s.recv(100)); return
        except OSError:
            time.sleep(0.3)
def udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((src, 0)); u.settimeout(1)
    for _ in range(10):
        u.sendto(b"hi", (app, 7002))
        try:
            got.append(u.recv(100)); return
        except OSError:
            pass
def simopen():
    end = time.time() + 10
    while time.time() < end:
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((src, 7004)); s.settimeout(1)
        try:
            s.connect((app, 7003)); got.append(s.recv(100)); return
        except OSError:
            s.close(); time.sleep(0.37)
ts = [threading.Thread(target=f) for f in (tcp_connect, udp, simopen)]
[t.start() for t in ts]; [t.join() for t in ts]
print(repr(got), flush=True)
"""


def _run_pair(rtopo: Topology, peer_ip: str) -> tuple[str, str]:
    app = rtopo.spawn(rtopo.sb(1), "python3", "-c", APP, rtopo.sb_ip(1), peer_ip, ready_line="up")
    time.sleep(0.3)
    peer = rtopo.ns(rtopo.up, "python3", "-c", PEER, peer_ip, rtopo.sb_ip(1), timeout=40, check=False)
    out = app.communicate(timeout=30)[0]
    return peer.stdout, out


@pytest.mark.xfail(
    strict=True, reason="ingress is not the sidecar's: a flow the peer opens is answered (docs/security.md)"
)
def test_flows_a_never_allowed_peer_opens_are_not_policed(sidecar: Sidecar, rtopo: Topology) -> None:
    """Default deny, NEVER_IP never allowed: a listener, a UDP answer and a simultaneous open
    reach it. Passing would need ingress control the sidecar does not have."""
    assert not sidecar.reaches(NEVER_IP, 80)
    peer_out, _ = _run_pair(rtopo, NEVER_IP)
    assert "EXFIL" not in peer_out, f"data reached a never-allowed host: {peer_out}"


# ---- what the refusals must not break: a connection a peer opens to the app ----------------

SERVE = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7201)); s.listen(4); s.settimeout(20)
print("up", flush=True)
c, _ = s.accept(); c.settimeout(10)
for _ in range(10):  # ten exchanges, then a large answer
    want, got = 65536, b""
    while len(got) < want:
        got += c.recv(want - len(got))
    c.sendall(got[::-1])
c.sendall(bytes(range(256)) * 16384)  # 4 MiB
c.close()
print("served", flush=True)
"""

CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], 7201), timeout=10)
ok = 0
for i in range(10):
    msg = bytes([i]) * 65535 + b"!"
    c.sendall(msg)
    want, got = len(msg), b""
    while len(got) < want:
        got += c.recv(want - len(got))
    ok += got == msg[::-1]
big = b""
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    big += d
print(ok, big == bytes(range(256)) * 16384, flush=True)
"""


def test_a_connection_a_peer_opens_to_the_app_still_works(sidecar: Sidecar, rtopo: Topology) -> None:
    """The sandbox serves (its API, its exposed ports): a peer the egress policy never names
    connects to a listener of the app, and every byte goes both ways. The refusals above
    (no mid-stream pickup, no answer on a flow whose handshake is not done) must not touch it."""
    assert not sidecar.reaches(NEVER_IP, 80)
    server = rtopo.spawn(rtopo.sb(1), "python3", "-c", SERVE, rtopo.sb_ip(1), ready_line="up")
    client = rtopo.ns(rtopo.up, "python3", "-c", CLIENT, rtopo.sb_ip(1), timeout=40, check=False)
    assert client.stdout.split() == ["10", "True"], client.stdout + client.stderr
    assert "served" in server.communicate(timeout=20)[0]
