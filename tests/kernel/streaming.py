"""Upstreams that keep talking, and sandbox clients that keep answering, for the flow-cut
tests of a narrowing (docs/reference/behaviour.md §14.1): a cut flow must stay cut while the
upstream goes on sending (its packets arrive inbound; a deleted conntrack entry would be
rebuilt by them in reverse, with the app's side as the "established" reply direction).

Run as ``python3 -c SOURCE ...`` in the namespace they belong to (stdlib only)."""

from __future__ import annotations

#: argv: addresses (comma-separated), TCP port, UDP port. TCP: each accepted connection gets
#: 200 bytes every 5 ms. UDP: a client's first datagram starts 200-byte datagrams to it every
#: 5 ms for 30 s, and each datagram ``<n>`` it sends is answered ``a<n>``.
STREAM_SERVER = """
import socket, sys, threading, time
ips, tport, uport = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
def talk(c):
    try:
        while True:
            c.sendall(b"x" * 200); time.sleep(0.005)
    except OSError:
        pass
def accept(s):
    while True:
        c, _ = s.accept(); threading.Thread(target=talk, args=(c,), daemon=True).start()
def stream_to(u, peer):
    end = time.time() + 30
    while time.time() < end:
        try:
            u.sendto(b"s" * 200, peer)
        except OSError:
            pass
        time.sleep(0.005)
def serve_udp(u):
    seen = set()
    while True:
        data, peer = u.recvfrom(2048)
        if peer not in seen:
            seen.add(peer); threading.Thread(target=stream_to, args=(u, peer), daemon=True).start()
        u.sendto(b"a" + data, peer)
for ip in ips:
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    t = socket.socket(fam); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind((ip, tport)); t.listen(16)
    threading.Thread(target=accept, args=(t,), daemon=True).start()
    u = socket.socket(fam, socket.SOCK_DGRAM); u.bind((ip, uport))
    threading.Thread(target=serve_udp, args=(u,), daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""

#: argv: address, port, seconds. Reads the stream and answers one byte per read, every 50 ms;
#: prints "up", then one "ok" (data read) or "dead" (nothing for a second) per round.
TCP_READER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0)
print("up", flush=True)
end = time.time() + float(sys.argv[3])
while time.time() < end:
    try:
        ok = bool(s.recv(65536)); s.sendall(b"a")
    except OSError:
        ok = False
    print("ok" if ok else "dead", flush=True)
    time.sleep(0.05)
"""

#: argv: address, port, seconds. Sends datagram ``<n>`` every 50 ms and drains what comes
#: back; prints "up" after the first answer, then per round "<n> <answered>" where answered
#: is 1 when the upstream acknowledged datagram n (``a<n>``) by the end of the run.
UDP_TALKER = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
u = socket.socket(fam, socket.SOCK_DGRAM); u.connect((host, port)); u.settimeout(1.0)
acked = set()
def drain():
    u.setblocking(False)
    try:
        while True:
            d = u.recv(2048)
            if d.startswith(b"a"):
                acked.add(int(d[1:]))
    except (BlockingIOError, ValueError, OSError):
        pass
    u.settimeout(1.0)
u.send(b"0")
while 0 not in acked:
    d = u.recv(2048)
    if d == b"a0":
        acked.add(0)
print("up", flush=True)
n, end = 0, time.time() + seconds
while time.time() < end:
    n += 1
    try:
        u.send(str(n).encode())
    except OSError:
        pass
    time.sleep(0.05)
    drain()
time.sleep(0.3); drain()
for i in range(1, n + 1):
    print(i, int(i in acked), flush=True)
"""
