#!/usr/bin/env python3
"""How fast can a relay that terminates TCP be on this machine? (issue 25 item 5, the ceiling)

No egressd, no MITM: three namespaces ``egbr<pid>-{cl,gw,up}`` over two veths, the same
HTTPS download bench_mitm measures (the stream client of ``mitm_stream.py`` in ``cl``,
``scripts/fleet_upstream.py`` on :8443 in ``up``), over these paths, side by side,
interleaved, one kept-alive connection per path:

* ``direct``   cl -> up:8443, forwarded by the kernel in ``gw`` (the baseline);
* ``asyncio``  cl -> gw:9001, a Python asyncio relay (protocols, flow control) in ``gw``;
* ``splice``   cl -> gw:9002, splice(2) through a pipe (F_SETPIPE_SZ 1 MiB), one thread per
  direction on blocking sockets, in ``gw``;
* ``loop-splice`` cl -> gw:9003, the upstream's bytes by splice(2) driven by the asyncio event
  loop (add_reader / add_writer on duplicated descriptors), the client's by asyncio streams;
* ``egressd-shape`` cl -> gw:9004, the ``splice`` thread as egressd's kernel relay runs it:
  both sockets with TCP_NODELAY (asyncio sets it on every TCP transport), the upstream's
  socket non-blocking, poll(2) before each splice.

egressd's kernel relay (egressd/mitmchild/splicerelay.py) is the ``splice`` shape for the
upstream's bytes (a thread per connection; the event-loop shape cost about twice the CPU per
MiB here), the client's bytes staying in mitmproxy. A ratio here is what a relay that
terminates TCP can reach on this machine at best: the relayed path adds a TCP receive and send
in the gateway, on the same CPUs as client and upstream.

Both relays read the client's first bytes (the ClientHello) before they connect upstream,
as a relay that checks the SNI must, then forward those bytes first. For each path: MiB/s
(median), CPU ms per MiB of the client, the upstream, the relay process and the whole
machine (softirq included), from /proc, and the packets (skbs) the client's interface received
per MiB. Direct fills both CPUs; a relayed MiB costs the machine more (a TCP receive and send
in the gateway), so on this machine the ratio follows the machine column.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import common as c
import mitm_stream

TAG = "egbr"
CL_IP, GW_CL, GW_UP, UP_IP = "10.211.0.2", "10.211.0.1", "10.212.0.1", "10.212.0.2"
HOST = "api.example.test"
PORTS = {"direct": (UP_IP, 8443), "asyncio": (GW_CL, 9001), "splice": (GW_CL, 9002), "loop-splice": (GW_CL, 9003),
         "egressd-shape": (GW_CL, 9004)}
TARGET = 0.8

RELAY = r"""
import asyncio, fcntl, json, os, select, socket, sys, threading

UP = (sys.argv[1], int(sys.argv[2]))
PIPE = 1 << 20
FLAGS = os.SPLICE_F_MOVE  # no SPLICE_F_MORE: it corks the last segment of a burst
F_SETPIPE_SZ = 1031

def first_bytes(sock):
    data = sock.recv(65536)  # the ClientHello, before any upstream connection
    return data

# ---- splice: one thread per direction, blocking sockets
def pump(src, dst):
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, PIPE)
        while True:
            n = os.splice(src.fileno(), w, PIPE, flags=FLAGS)
            if n == 0:
                break
            while n:
                n -= os.splice(r, dst.fileno(), n, flags=FLAGS)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        os.close(r); os.close(w)

def splice_conn(cl, shape=False):
    try:
        hello = first_bytes(cl)
        up = socket.create_connection(UP)
        if shape:
            for s in (cl, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up.sendall(hello)
    except OSError:
        cl.close(); return
    if shape:
        up.setblocking(False)
    t = threading.Thread(target=pump_polled if shape else pump, args=(up, cl), daemon=True)
    t.start()
    pump(cl, up)
    t.join()
    cl.close(); up.close()

def splice_server(port, shape=False):
    ls = socket.create_server(("0.0.0.0", port), backlog=64)
    while True:
        cl, _ = ls.accept()
        threading.Thread(target=splice_conn, args=(cl, shape), daemon=True).start()

# ---- egressd-shape: TCP_NODELAY, a non-blocking source, poll(2) before each splice
def pump_polled(src, dst):
    r, w = os.pipe()
    flags = FLAGS | os.SPLICE_F_NONBLOCK
    readable, writable = select.poll(), select.poll()
    readable.register(src.fileno(), select.POLLIN)
    writable.register(dst.fileno(), select.POLLOUT)
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, PIPE)
        while True:
            readable.poll()
            try:
                n = os.splice(src.fileno(), w, PIPE, flags=flags)
            except BlockingIOError:
                continue
            if n == 0:
                break
            while n:
                try:
                    n -= os.splice(r, dst.fileno(), n, flags=flags)
                except BlockingIOError:
                    writable.poll()
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        os.close(r); os.close(w)

# ---- asyncio: protocols with flow control
class Side(asyncio.Protocol):
    def __init__(self):
        self.peer = None; self.transport = None; self.pending = []
    def connection_made(self, t):
        self.transport = t
    def data_received(self, data):
        if self.peer is None or self.peer.transport is None:
            self.pending.append(data)
        else:
            self.peer.transport.write(data)
    def eof_received(self):
        if self.peer is not None and self.peer.transport is not None and self.peer.transport.can_write_eof():
            self.peer.transport.write_eof()
        return True
    def connection_lost(self, exc):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
    def pause_writing(self):
        self.peer.transport.pause_reading()
    def resume_writing(self):
        self.peer.transport.resume_reading()

class ClientSide(Side):
    def connection_made(self, t):
        super().connection_made(t)
        self.hello = None
    def data_received(self, data):
        if self.hello is None:
            self.hello = data
            self.transport.pause_reading()
            asyncio.get_running_loop().create_task(self.connect())
            return
        super().data_received(data)
    async def connect(self):
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(Side, *UP)
        except OSError:
            self.transport.close(); return
        up.peer, self.peer = self, up
        up.transport.write(self.hello)
        for d in self.pending:
            up.transport.write(d)
        self.transport.resume_reading()

# ---- loop-splice: the upstream's bytes by splice(2) driven by the event loop (egressd's kernel
# relay), the client's by the asyncio protocols above
class LoopSplice:
    def __init__(self, src, dst, done):
        self.loop = asyncio.get_running_loop()
        self.src, self.dst, self.done = os.dup(src), os.dup(dst), done
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.fcntl(self.w, F_SETPIPE_SZ, PIPE)
        self.pending, self.eof = 0, False
        self.loop.add_reader(self.src, self.readable)
    def readable(self):
        try:
            n = os.splice(self.src, self.w, PIPE, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except BlockingIOError:
            return
        except OSError:
            return self.finish()
        self.eof = n == 0
        self.pending += n
        self.flush()
    def flush(self):
        while self.pending:
            try:
                self.pending -= os.splice(self.r, self.dst, self.pending, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                self.loop.remove_reader(self.src)
                self.loop.add_writer(self.dst, self.flush)
                return
            except OSError:
                return self.finish()
        if self.eof:
            return self.finish()
        if self.loop.remove_writer(self.dst):
            self.loop.add_reader(self.src, self.readable)
    def finish(self):
        self.loop.remove_reader(self.src); self.loop.remove_writer(self.dst)
        for fd in (self.src, self.dst, self.r, self.w):
            os.close(fd)
        self.done()

async def loop_splice_conn(reader, writer):
    hello = await reader.read(65536)
    ur, uw = await asyncio.open_connection(*UP)
    uw.write(hello)
    async def up():
        while data := await reader.read(65536):
            uw.write(data)
            await uw.drain()
        uw.write_eof()
    t = asyncio.ensure_future(up())
    ended = asyncio.get_running_loop().create_future()
    uw.transport.pause_reading()
    src, dst = uw.get_extra_info("socket").fileno(), writer.get_extra_info("socket").fileno()
    LoopSplice(src, dst, lambda: ended.done() or ended.set_result(None))
    await ended
    writer.write_eof()
    await t
    writer.close(); uw.close()

async def asyncio_main(port):
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(ClientSide, "0.0.0.0", port, backlog=64)
    srv2 = await asyncio.start_server(loop_splice_conn, "0.0.0.0", port + 2, backlog=64)
    async with srv, srv2:
        await srv.serve_forever()

threading.Thread(target=splice_server, args=(int(sys.argv[4]),), daemon=True).start()
threading.Thread(target=splice_server, args=(int(sys.argv[4]) + 2, True), daemon=True).start()
print(json.dumps({"ready": True}), flush=True)
asyncio.run(asyncio_main(int(sys.argv[3])))
"""


def build(topo: c.Topology) -> None:
    topo.x("gw", "sysctl", "-qw", "net.ipv4.ip_forward=1")
    topo.veth("gw", "vcl", "cl", "eth0", f"{GW_CL}/24")
    topo.veth("gw", "vup", "up", "eth0", f"{GW_UP}/24")
    topo.x("cl", "ip", "addr", "add", f"{CL_IP}/24", "dev", "eth0")
    topo.x("cl", "ip", "link", "set", "eth0", "up")
    topo.x("cl", "ip", "route", "add", "10.212.0.0/24", "via", GW_CL)
    topo.x("up", "ip", "addr", "add", f"{UP_IP}/24", "dev", "eth0")
    topo.x("up", "ip", "link", "set", "eth0", "up")
    topo.x("up", "ip", "route", "add", "10.211.0.0/24", "via", GW_UP)


def inner(args: Any, topo: c.Topology, workdir: Path, rep: c.Report) -> dict[str, Any]:
    mib = min(args.mib, 24) if args.quick else args.mib
    rounds = min(args.rounds, 2) if args.quick else args.rounds
    zone = workdir / "zone.json"
    zone.write_text(json.dumps({"records": [{"name": HOST, "type": "A", "value": UP_IP, "ttl": 30}]}))
    procs: list[c.Proc] = []
    try:
        up = c.Proc([str(c.VENV_PY), str(c.UPSTREAM), "--http-ports", "", "--https-ports", "8443",
                     "--tls-dir", str(workdir / "tls"), "--tls-ips", UP_IP, "--zone", str(zone),
                     "--dns-port", "5353"], ns=topo.ns("up"))  # fmt: skip
        procs.append(up)
        if "ready" not in up.readline(60):
            raise c.BenchError("upstream did not start")
        relay = c.Proc([str(c.VENV_PY), "-c", RELAY, UP_IP, "8443", "9001", "9002"], ns=topo.ns("gw"))
        procs.append(relay)
        relay.read_json(20)
        client = c.Proc([str(c.VENV_PY), "-c", mitm_stream.STREAM_CLIENT], ns=topo.ns("cl"))
        procs.append(client)
        client.read_json(20)
        ca = str(workdir / "tls" / "ca.pem")
        pids = {"client": client.pid, "upstream": up.pid, "relay": relay.pid}

        def download(path: str, size: int) -> dict[str, Any]:
            ip, port = PORTS[path]
            cmd = {"host": HOST, "ip": ip, "port": port, "ca": ca, "placeholder": "x",
                   "op": "download", "size": size, "framing": "length"}  # fmt: skip
            return client.call(cmd, 600)

        paths = [p for p in PORTS if p in args.paths]
        for p in paths:  # warm-up
            download(p, 1 << 20)
        tput: dict[str, list[float]] = {p: [] for p in paths}
        cpu: dict[str, dict[str, float]] = {p: {k: 0.0 for k in (*pids, "machine")} for p in paths}
        rx = {p: 0.0 for p in paths}

        def rx_packets() -> int:
            return int(topo.x("cl", "cat", "/sys/class/net/eth0/statistics/rx_packets"))

        for lbl in mitm_stream.interleaved(paths, rounds):
            c.log(f"{lbl}: {mib} MiB")
            before = {k: c.cpu_s(pid) for k, pid in pids.items()}
            m0 = c.machine_cpu()
            rx0 = rx_packets()
            r = download(lbl, mib << 20)
            m1 = c.machine_cpu()
            rx[lbl] += (rx_packets() - rx0) / (mib * rounds)
            after = {k: c.cpu_s(pid) for k, pid in pids.items()}
            if r.get("bytes") != mib << 20:
                raise c.BenchError(f"{lbl}: {r.get('bytes')} bytes of {mib << 20}: {r}")
            tput[lbl].append(mib / r["s"])
            for k in pids:
                cpu[lbl][k] += (after[k] - before[k]) * 1000.0 / (mib * rounds)
            cpu[lbl]["machine"] += (m1[0] - m0[0]) / os.sysconf("SC_CLK_TCK") * 1000.0 / (mib * rounds)
    finally:
        for p in reversed(procs):
            p.stop(5)
    direct = mitm_stream.median(tput.get("direct", []))
    rep.add(f"  HTTPS download, {mib} MiB x {rounds} per path, one kept-alive connection per path; MiB/s median (all);"
            " CPU ms per MiB (machine: all CPUs, softirq included)")  # fmt: skip
    rows = []
    for p in paths:
        med = mitm_stream.median(tput[p])
        rows.append([p, med, c.ratio(med, direct), " ".join(f"{x:.0f}" for x in tput[p]),
                     cpu[p]["client"], cpu[p]["upstream"], cpu[p]["relay"], cpu[p]["machine"], rx[p]])  # fmt: skip
    rep.table(["path", "MiB/s", "vs direct", "all", "client", "upstream", "relay", "machine", "client rx pkts/MiB"], rows)
    for p in paths:
        if p != "direct" and "direct" in paths:
            med = mitm_stream.median(tput[p])
            ok = math.isfinite(med) and med >= TARGET * direct
            rep.target(f"{p} relay at least {TARGET:.0%} of direct", ok, c.ratio(med, direct), f">= {TARGET}x")
    return {"throughput": tput, "cpu_ms_per_mib": cpu, "client_rx_packets_per_mib": rx, "mib": mib, "rounds": rounds}


def main() -> int:
    p = c.parser(__doc__, "24 MiB x 2 rounds per path")
    p.add_argument("--mib", type=int, default=256, help="download size, MiB (256; --quick 24)")
    p.add_argument("--rounds", type=int, default=5, help="downloads per path (5; --quick 2)")
    p.add_argument("--paths", default="direct,asyncio,splice,loop-splice,egressd-shape", help="comma-separated subset of " + ",".join(PORTS))
    args = p.parse_args()
    args.paths = args.paths.split(",")
    return c.main("relay_ceiling", TAG, ("cl", "gw", "up"), "gw", args, inner, build)


if __name__ == "__main__":
    sys.exit(main())
