"""An upstream that keeps sending and a sandbox client that keeps answering, for the flow-cut
tests of a narrowing (docs/reference/behaviour.md §14.1): a flow the narrowing cut must stay
cut while the upstream goes on sending. The upstream's packets keep arriving after the cut;
if they could rebuild the flow's conntrack entry in reverse (upstream -> sandbox), the
sandbox's packets would be its reply direction, "established", and a streamed download (or a
channel out) would outlive the narrowing. Used by tests/kernel/test_cut_streaming.py (fleet)
and tests/kernel/test_sidecar_cut_streaming.py (sidecar).

* :data:`CHATTER`, the upstream's server (:func:`start_chatter`): streams to every client
  and logs each receipt from one (:func:`chatter_log`), so a test sees whether anything of a
  flow still reached the upstream, and when.
* :data:`READER`, one flow from the sandbox to it (:func:`start_reader`): per round, whether
  anything arrived; every round sends one byte back.
* :func:`finish` collects both sides of a flow (:class:`Outcome`); :func:`check` asserts
  that a cut flow is cut and a kept one is not.

The scripts are stdlib only, run as ``python3 -c SOURCE ...`` in their namespace.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.kernel.topology import Topology

TCP_PORT, UDP_PORT = 9107, 9108
READ_S = 8.0  # how long each reader runs
NARROW_AFTER_S = 1.0  # the narrowing, this long after the readers are up
# After the narrowing returns, time for the background cut (a conntrack read, then a delete or
# a mark) and for what was already in flight; nothing may arrive on either side of a cut flow
# after it.
MARGIN_S = 2.0

#: The upstream's streaming server. argv: addresses (comma-separated), TCP port, UDP port,
#: receipt log. TCP: 200 bytes every 5 ms on every accepted connection. UDP: 200-byte
#: datagrams every 5 ms for 30 s to each client after its first datagram. Every receipt from
#: a client is logged as ``<tcp|udp> <address>:<port> <time>``. Prints "ready".
CHATTER = r"""
import socket, sys, threading, time
ips, tport, uport = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
log = open(sys.argv[4], "a", buffering=1)
lock = threading.Lock()

def note(proto, peer):
    with lock:
        log.write(f"{proto} {peer[0]}:{peer[1]} {time.time():.3f}\n")

def tcp_read(c, peer):
    try:
        while c.recv(65536):
            note("tcp", peer)
    except OSError:
        pass

def tcp_serve(c, peer):
    threading.Thread(target=tcp_read, args=(c, peer), daemon=True).start()
    try:
        while True:
            c.sendall(b"x" * 200)
            time.sleep(0.005)
    except OSError:
        pass

def tcp_accept(s):
    while True:
        c, peer = s.accept()
        threading.Thread(target=tcp_serve, args=(c, peer), daemon=True).start()

def udp_stream(s, peer):
    end = time.time() + 30
    while time.time() < end:
        try:
            s.sendto(b"y" * 200, peer)
        except OSError:
            pass
        time.sleep(0.005)

def udp_serve(s):
    streaming = set()
    while True:
        _, peer = s.recvfrom(65536)
        note("udp", peer)
        if peer not in streaming:
            streaming.add(peer)
            threading.Thread(target=udp_stream, args=(s, peer), daemon=True).start()

for ip in ips:  # one socket per address: a UDP reply leaves from the address it was sent to
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    t = socket.socket(fam)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind((ip, tport))
    t.listen(16)
    threading.Thread(target=tcp_accept, args=(t,), daemon=True).start()
    u = socket.socket(fam, socket.SOCK_DGRAM)
    u.bind((ip, uport))
    threading.Thread(target=udp_serve, args=(u,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

#: One flow to the chatter server. argv: tcp|udp, address, port, seconds. Prints "up <local
#: address:port>", then per round (at most 1 s waiting for data): "ok|dead <time>", "ok" when
#: anything arrived in that round; every round sends one byte, whatever arrived.
READER = r"""
import select, socket, sys, time
proto, ip, port, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if proto == "tcp":
    s = socket.create_connection((ip, port), timeout=2)
else:
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((ip, port))
    s.send(b"hello")
host, lport = s.getsockname()[:2]
print(f"up {host}:{lport}", flush=True)
s.setblocking(False)
end = time.time() + secs
while time.time() < end:
    select.select([s], [], [], 1.0)
    got = 0
    while True:  # drain: what waits in the socket buffer is not news of the flow
        try:
            d = s.recv(65536)
        except OSError:  # nothing more (or an error: nothing arrived either)
            break
        if not d:
            break
        got += len(d)
    try:
        s.send(b"a")
    except OSError:
        pass
    print("ok" if got else "dead", f"{time.time():.3f}", flush=True)
    time.sleep(0.05)
"""


def port_of(proto: str) -> int:
    return TCP_PORT if proto == "tcp" else UDP_PORT


def chatter_log(topo: Topology) -> Path:
    return topo.workdir / "chatter.log"


def start_chatter(topo: Topology, ips: Sequence[str]) -> subprocess.Popen[str]:
    """The chatter server in the upstream namespace, on TCP_PORT and UDP_PORT of ``ips``."""
    return topo.spawn(
        topo.up,
        "python3",
        "-c",
        CHATTER,
        ",".join(ips),
        str(TCP_PORT),
        str(UDP_PORT),
        str(chatter_log(topo)),
        ready_line="ready",
    )


@dataclass
class Reader:
    proc: subprocess.Popen[str]
    proto: str
    local: str  # its address:port, as the server sees it (nothing between them NATs)


@dataclass
class Outcome:
    verdicts: list[tuple[str, float]]
    receipts: list[float]  # when the server received something of this flow
    text: str

    def summary(self) -> str:
        """The verdicts run-length encoded: ``ok x22 dead x7``."""
        return " ".join(f"{v} x{len(list(g))}" for v, g in itertools.groupby(v for v, _ in self.verdicts))

    def late(self, after: float) -> list[str]:
        return [v for v, t in self.verdicts if t > after]

    def worked_before(self, t: float) -> bool:
        return any(v == "ok" and at < t for v, at in self.verdicts) and any(r < t for r in self.receipts)


def start_reader(
    topo: Topology,
    ns: str,
    proto: str,
    ip: str,
    prefix: tuple[str, ...] = (),
    python: str = "python3",
) -> Reader:
    """A :data:`READER` in ``ns`` (after ``prefix``, e.g. setpriv …), connected to ``ip``."""
    proc = topo.spawn(ns, *prefix, python, "-c", READER, proto, ip, str(port_of(proto)), str(READ_S))
    assert proc.stdout is not None
    first = proc.stdout.readline().split()  # the connect times out in 2 s: bounded
    assert first[:1] == ["up"], f"the reader to {ip} did not connect: {first}"
    return Reader(proc, proto, first[1])


def finish(topo: Topology, r: Reader) -> Outcome:
    """Wait for the reader's end; its rounds, and the server's receipts of its flow."""
    out, _ = r.proc.communicate(timeout=READ_S + 15)
    verdicts = [(ln.split()[0], float(ln.split()[1])) for ln in out.splitlines() if ln.strip()]
    receipts = []
    for line in chatter_log(topo).read_text().splitlines():
        p, peer, at = line.split()
        if p == r.proto and peer == r.local:
            receipts.append(float(at))
    return Outcome(verdicts, receipts, out)


def conntrack(topo: Topology, ns: str, proto: str) -> str:
    """The entries of ``ns`` to the chatter port (shown when an assertion fails)."""
    port = str(port_of(proto))
    lines = topo.ns(ns, "conntrack", "-L", "-p", proto, check=False).stdout.splitlines()
    return "\n".join(ln for ln in lines if f"port={port} " in ln)


def check(cut: Outcome, kept: Outcome, narrowed: float, ct: str, *, inbound_cut: bool = True) -> None:
    """Both flows worked before the narrowing; after it (and the margin) the kept one still
    works both ways and nothing of the cut one reaches the server (nor, with ``inbound_cut``,
    the sandbox), while its reader still ran and sent."""
    after = narrowed + MARGIN_S
    diag = f"\ncut: {cut.summary()}\nkept: {kept.summary()}\nconntrack:\n{ct}\n"
    for name, o in (("cut", cut), ("kept", kept)):  # shown by pytest when the test failed
        n = sum(r > after for r in o.receipts)
        last_ok = max((t for v, t in o.verdicts if v == "ok"), default=narrowed) - narrowed
        last_rx = max(o.receipts, default=narrowed) - narrowed
        print(
            f"{name}: {o.summary()}; server receipts: {len(o.receipts) - n}, after the margin {n}; "
            f"last ok {last_ok:+.2f} s, last receipt {last_rx:+.2f} s from the narrowing"
        )
    print(diag)
    assert cut.worked_before(narrowed), "the cut flow never worked" + diag
    assert kept.worked_before(narrowed), "the kept flow never worked" + diag
    kept_late = kept.late(after)  # a round without data may happen on a loaded machine
    assert kept_late[-1:] == ["ok"], "an allowed flow was cut" + diag
    assert any(r > after for r in kept.receipts), "the kept flow no longer reaches the server" + diag
    cut_late = cut.late(after)
    assert len(cut_late) >= 2, "the reader did not run past the margin" + diag
    sent_late = [r for r in cut.receipts if r > after]
    assert not sent_late, f"the sandbox still reaches the refused server ({len(sent_late)} receipts)" + diag
    if inbound_cut:
        assert all(v == "dead" for v in cut_late), "the refused flow survived the narrowing" + diag
