#!/usr/bin/env python3
"""DNS proxy benchmark: latency added by egressd's shared DNS proxy, and its maximum throughput.

Run as root from the repository root::

    .venv/bin/python scripts/bench/bench_dns.py [--quick] [--subjects N] [--duration S] [--splits auto|always|never]

Namespaces ``egbd<pid>-{pod,up,sb1}`` (common.pod_topology): the client in sb1 (10.203.0.11)
asks either egressd's proxy on the gateway 10.203.0.1:53 or the upstream 10.204.0.2:53
directly, through the same pod (the baseline). (1) paced 1000 q/s open loop: new names (every
answer is learned), repeated names and direct, interleaved in slices; (2) closed loop, 32
outstanding: max q/s; (3) where the time goes: egressd's own main() with a few methods wrapped
by perf_counter calls, new names and then new names under the port-scoped rule, side by side
(--splits; always with --quick, so CI notices when the wrappers no longer fit egressd). See
README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gc
import http.client
import inspect
import ipaddress
import json
import math
import os
import select
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c

HTTP_PORT, DNS_PORT, TABLE = 18580, 15353, "egbench_dns"
SANDBOX_IP, UPSTREAM_IP, MEASURED_UID = "10.203.0.11", "10.204.0.2", "dnsbench-sb"
V_SUFFIX, R_SUFFIX, DENIED = "v.bench.test", "r.bench.test", "exfil.bench.test"
P_SUFFIX = "p.bench.test"  # new names under a port-scoped rule (docs/reference/behaviour.md §18)
V_BASE, R_BASE = int(ipaddress.IPv4Address("10.210.0.0")), int(ipaddress.IPv4Address("10.212.0.0"))
P_BASE = int(ipaddress.IPv4Address("10.214.0.0"))
T_PORTS_RATIO = 1.10  # new names under a port-scoped rule: p50 and p99 within 10 % of today's shape
REPEAT, TTL = 16, 300  # lease 360 s: nothing expires during a run
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
T_P50_ADDED_MS, T_P99_ADDED_MS = 0.5, 3.0
FULL: dict[str, Any] = {"subjects": 1000, "rate": 1000.0, "paced_s": 10.0, "slice_s": 2.0, "warmup_s": 0.5, "sockets": 8,
                        "closed_s": 5.0, "concurrency": 32, "splits_s": 5.0, "refresh_s": 2, "zone_names": 40000}  # fmt: skip
QUICK: dict[str, Any] = {**FULL, "subjects": 50, "paced_s": 3.0, "slice_s": 1.0, "warmup_s": 0.3, "closed_s": 2.0,
                         "splits_s": 2.0, "refresh_s": 1, "zone_names": 12000}  # fmt: skip
PACED, CLOSED = ("direct", "proxy_new", "proxy_repeat", "proxy_ports"), ("direct", "proxy_new")
SPLIT_SIDES = ("proxy_new", "proxy_ports")  # (3): today's shape, then the port-scoped rule
LABELS = {
    "direct": "direct (baseline)",
    "proxy_new": "proxy, new names",
    "proxy_repeat": "proxy, repeated names",
    "proxy_ports": "proxy, new names, port-scoped rule",
}


def v_name(k: int) -> tuple[str, str]:
    return f"v{k}.{V_SUFFIX}", str(ipaddress.IPv4Address(V_BASE + k + 1))


def p_name(k: int) -> tuple[str, str]:
    return f"p{k}.{P_SUFFIX}", str(ipaddress.IPv4Address(P_BASE + k + 1))


def r_name(j: int) -> tuple[str, str]:
    return f"r{j}.{R_SUFFIX}", str(ipaddress.IPv4Address(R_BASE + j + 1))


def zone(n: int) -> list[dict[str, object]]:
    pairs = [v_name(k) for k in range(n)] + [r_name(j) for j in range(REPEAT)] + [(DENIED, "10.213.0.1")]
    pairs += [p_name(k) for k in range(n)]
    return [{"name": name, "type": "A", "value": addr, "ttl": TTL} for name, addr in pairs]


# The measured subject: deny by default; the benchmark's names match the 8th, 9th and 10th
# domain rule (the 10th with ports: its leases are port-scoped, docs/reference/behaviour.md §18).
MEASURED_POLICY = c.policy(
    "deny",
    ("deny", DENIED),
    ("allow", "pypi.org"),
    ("allow", "files.pythonhosted.org"),
    ("allow", "*.github.com"),
    ("allow", "api.openai.com"),
    ("allow", "*.googleapis.com"),
    ("allow", "registry.npmjs.org"),
    ("allow", f"*.{R_SUFFIX}"),
    ("allow", f"*.{V_SUFFIX}"),
    ("allow", f"*.{P_SUFFIX}", {"ports": [443, "8000-8999"]}),
    ("allow", UPSTREAM_IP),
)  # fmt: skip  (the IP rule lets the direct baseline through)


# ---- the client (sandbox namespace): one JSON command per stdin line, one result per line --------


def _kernel_ns(anc: list[tuple[int, int, bytes]]) -> int:
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            return int(sec) * 1_000_000_000 + int(nsec)
    return 0


class DnsClient:
    """Prebuilt dnslib queries over connected UDP sockets. Latency: ``time_ns()`` right before
    ``send()`` to the kernel's receive timestamp of the reply (SO_TIMESTAMPNS), so a client that
    wakes up late does not inflate it. Every reply is checked (NOERROR, question, exact A)."""

    ANC = socket.CMSG_SPACE(16)

    def __init__(self, targets: dict[str, tuple[str, int]], zone_names: int) -> None:
        self.targets, self.zone_names = targets, zone_names
        self.socks: dict[tuple[str, int], list[socket.socket]] = {}

    def sockets(self, target: str, count: int) -> list[socket.socket]:
        if (target, count) not in self.socks:
            out = []
            for _ in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                s.connect(self.targets[target])
                s.setblocking(False)
                out.append(s)
            self.socks[(target, count)] = out
        for s in self.socks[(target, count)]:  # drain stale replies
            with contextlib.suppress(OSError):
                while s.recv(4096):
                    pass
        return self.socks[(target, count)]

    def names(self, spec: dict[str, Any], n: int) -> tuple[list[str], list[str], list[bytes]]:
        from dnslib import DNSRecord

        fresh = {"new": v_name, "ports": p_name}.get(spec["kind"])
        pairs = [
            fresh((spec["start"] + i) % self.zone_names) if fresh else r_name(i % REPEAT) for i in range(n)
        ]
        wires = []
        for i, (name, _) in enumerate(pairs):
            q = DNSRecord.question(name, "A")
            q.header.id = i & 0xFFFF
            wires.append(bytes(q.pack()))
        return [p[0] for p in pairs], [p[1] for p in pairs], wires

    @staticmethod
    def check(data: bytes, name: str, addr: str) -> str:
        from dnslib import QTYPE, RCODE, DNSRecord

        try:
            rep = DNSRecord.parse(data)
        except Exception as exc:
            return f"unparseable: {exc}"[:40]
        if rep.header.rcode != RCODE.NOERROR:
            return f"rcode {RCODE[rep.header.rcode]}"
        if str(rep.q.qname).rstrip(".").lower() != name:
            return "wrong question"
        got = [str(rr.rdata) for rr in rep.rr if rr.rtype == QTYPE.A]
        return "" if got == [addr] else f"answer {got}"[:40]

    def query(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from dnslib import QTYPE, RCODE, DNSRecord

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(3.0)
            s.connect(self.targets[cmd["target"]])
            s.send(bytes(DNSRecord.question(cmd["name"], "A").pack()))
            try:
                rep = DNSRecord.parse(s.recv(4096))
            except TimeoutError:
                return {"rcode": "TIMEOUT", "answers": []}
        return {
            "rcode": RCODE[rep.header.rcode],
            "answers": [str(r.rdata) for r in rep.rr if r.rtype == QTYPE.A],
        }

    def _recv(self, s: socket.socket, out: list[tuple[int, int, bytes]], k: int) -> int:
        errors = 0
        while True:
            try:
                data, anc, _f, _a = s.recvmsg(4096, self.ANC)
            except BlockingIOError:
                return errors
            except OSError:
                errors += 1
                continue
            out.append((k, _kernel_ns(anc) or time.time_ns(), data))

    def paced(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Open loop: send times fixed in advance (a late send does not delay the next ones)."""
        rate, n = float(cmd["rate"]), round(float(cmd["rate"]) * float(cmd["duration"]))
        if n > 65536:
            raise ValueError("paced slice too long: query ids must stay unique")
        socks = self.sockets(cmd["target"], int(cmd["sockets"]))
        names, addrs, wires = self.names(cmd["names"], n)
        fd = {s.fileno(): k for k, s in enumerate(socks)}
        ep = select.epoll()
        for s in socks:
            ep.register(s.fileno(), select.EPOLLIN)
        sent, lag, rx, errors = [0] * n, [0.0] * n, [], 0  # type: ignore[var-annotated]
        t0 = time.perf_counter() + 0.005
        for i in range(n):
            for f, _ev in ep.poll(0):
                errors += self._recv(socks[fd[f]], rx, fd[f])
            due = t0 + i / rate
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            lag[i], sent[i] = time.perf_counter() - due, time.time_ns()
            try:
                socks[i % len(socks)].send(wires[i])
            except OSError:
                errors, sent[i] = errors + 1, 0
        send_s, expected = time.perf_counter() - t0, sum(1 for t in sent if t)
        deadline = time.perf_counter() + 2.0
        while len(rx) < expected and time.perf_counter() < deadline:
            for f, _ev in ep.poll(0.02):
                errors += self._recv(socks[fd[f]], rx, fd[f])
        ep.close()
        lat, bad = [math.inf] * n, {}  # type: ignore[var-annotated]
        for k, t_rx, data in rx:
            i = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else n
            why = (
                "unknown id"
                if i >= n or i % len(socks) != k or not sent[i] or math.isfinite(lat[i])
                else self.check(data, names[i], addrs[i])
            )
            if why:
                bad[why] = bad.get(why, 0) + 1
            else:
                lat[i] = (t_rx - sent[i]) / 1e6
        return {"sent": expected, "lat_ms": [round(x, 4) if math.isfinite(x) else None for x in lat], "bad": bad,
                "errors": errors, "send_s": send_s, "lag_p99_ms": c.pct([x * 1000 for x in lag], 99)}  # fmt: skip

    def closed(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Closed loop: one query outstanding per socket; a reply (or a 1 s timeout) sends the next."""
        return _ClosedLoop(self, cmd).run()


class _ClosedLoop:
    """The state of one :meth:`DnsClient.closed` run: per socket the query outstanding."""

    def __init__(self, client: DnsClient, cmd: dict[str, Any]) -> None:
        self.client = client
        conc, self.max_q = int(cmd["concurrency"]), min(int(cmd["max_queries"]), 65536)
        self.socks = client.sockets(cmd["target"], conc)
        self.names, self.addrs, self.wires = client.names(cmd["names"], self.max_q)
        self.cur, self.sent_ns, self.deadline = [-1] * conc, [0] * conc, [0.0] * conc
        self.lat: list[float] = []
        self.done_at: list[float] = []
        self.bad: dict[str, int] = {}
        self.counter = self.timeouts = 0
        self.duration = float(cmd["duration"])
        self.start = self.stop_at = 0.0
        self.issuing = True

    def run(self) -> dict[str, Any]:
        slot_of = {s.fileno(): k for k, s in enumerate(self.socks)}
        ep = select.epoll()
        for s in self.socks:
            ep.register(s.fileno(), select.EPOLLIN)
        self.start = time.perf_counter()
        self.stop_at = self.start + self.duration
        for k in range(len(self.socks)):
            self.issue(k)
        while time.perf_counter() < self.stop_at + 2.0:
            self.issuing = time.perf_counter() < self.stop_at and self.counter < self.max_q
            if not self.issuing and all(x < 0 for x in self.cur):
                break
            for f, _ev in ep.poll(0.01):
                self.receive(slot_of[f])
            self.expire()
        window = min(time.perf_counter(), self.stop_at) - self.start
        in_window = sum(1 for t in self.done_at if t <= self.start + window)
        return {"issued": self.counter, "answered": len(self.lat), "qps": in_window / window, "timeouts": self.timeouts,
                "bad": self.bad, "lat_ms": [round(x, 4) for x in self.lat], "window_s": window}  # fmt: skip

    def issue(self, k: int) -> None:
        if self.issuing and self.counter < self.max_q and time.perf_counter() < self.stop_at:
            self.cur[k], self.deadline[k], self.sent_ns[k] = (
                self.counter,
                time.perf_counter() + 1.0,
                time.time_ns(),
            )
            self.counter += 1
            with contextlib.suppress(OSError):
                self.socks[k].send(self.wires[self.cur[k]])

    def receive(self, k: int) -> None:
        rx: list[tuple[int, int, bytes]] = []
        self.client._recv(self.socks[k], rx, k)
        for _k, t_rx, data in rx:
            i = self.cur[k]
            if i < 0 or len(data) < 2 or struct.unpack("!H", data[:2])[0] != i & 0xFFFF:
                continue  # stale
            if why := self.client.check(data, self.names[i], self.addrs[i]):
                self.bad[why] = self.bad.get(why, 0) + 1
            self.lat.append((t_rx - self.sent_ns[k]) / 1e6)
            self.done_at.append(time.perf_counter())
            self.cur[k] = -1
            self.issue(k)

    def expire(self) -> None:
        """A query unanswered for a second counts as a timeout; the socket sends the next."""
        now = time.perf_counter()
        for k in range(len(self.socks)):
            if self.cur[k] >= 0 and now > self.deadline[k]:
                self.timeouts, self.cur[k] = self.timeouts + 1, -1
                self.issue(k)


def client_main(argv: list[str]) -> int:
    c.ignore_signals()  # the orchestrator ends us by closing stdin (or by PID)
    targets = {
        n: (a.rpartition(":")[0], int(a.rpartition(":")[2]))
        for n, _, a in (t.partition("=") for t in argv[0].split(","))
    }
    client = DnsClient(targets, int(argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            res = getattr(client, cmd["op"])(cmd)
        except Exception as exc:
            res = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(res), flush=True)
    return 0


# ---- (3) instrumented egressd: its own main() with perf_counter wrappers; records written at exit --


def wrap_targets() -> tuple[list[tuple[Any, str, str]], list[tuple[Any, str, str]]]:
    """What (3) times: (owner, attribute, key) per query, and as background events."""
    from egressd.actionhandler.learning import DnsLearning
    from egressd.dnsproxy import forwarder as dfwd
    from egressd.dnsproxy import server as dsrv
    from egressd.engine import learning as elearn
    from egressd.engine.subjects import SubjectEngine
    from egressd.fleetnft import backend as fbackend
    from egressd.kernel import refresh as frefresh
    from egressd.kernel.applier import KernelTransactions
    from egressd.policy.reload import AlwaysRulesReloader
    from egressd.subject.leases import LeaseBook

    # The learn path's parts run in the group commit's committer task, whose context is its
    # first waiter's: with one answer per transaction (the paced load) they are that query's.
    return ([(dsrv.DnsProxy, "answer", "answer"), (DnsLearning, "asker", "decide"), (dsrv, "decide", "decide"),
             (dfwd, "_socket", "fwd_sock"), (dfwd.Forwarder, "forward", "fwd"), (DnsLearning, "learn", "learn"),
             (DnsLearning, "_commit", "commit"), (SubjectEngine, "learn_many", "learn_many"),
             (elearn, "admissible_many", "admit"), (LeaseBook, "record", "record"), (fbackend, "dyn_add", "encode"),
             (KernelTransactions, "run_batch", "nl"), (KernelTransactions, "run_batch_inline", "nl_inline"),
             (KernelTransactions, "_call", "nl_thread")],
            [(frefresh.LeaseRefresher, "tick", "refresh_tick"), (frefresh, "parse_conntrack", "conntrack_parse"),
             (AlwaysRulesReloader, "check", "always_rules_check")])  # fmt: skip


def wrap(owner: Any, attr: str, done: Any) -> None:
    """Replace ``owner.attr`` (sync or async, any signature) by a pass-through that calls
    ``done(start)`` when it returns or raises."""
    orig = getattr(owner, attr)
    if inspect.iscoroutinefunction(orig):

        async def w_async(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return await orig(*a, **kw)
            finally:
                done(t)

        setattr(owner, attr, w_async)
    else:

        def w_sync(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                done(t)

        setattr(owner, attr, w_sync)


class _Splits:
    """What the instrumented egressd records: per query (the reply task's context holds its
    record) the time in each wrapped call, and background events (GC, refresher ticks,
    always-rules checks, event-loop stalls)."""

    def __init__(self) -> None:
        self.cur: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("q", default=None)
        self.arrival: contextvars.ContextVar[float] = contextvars.ContextVar("arrival", default=0.0)
        self.records: list[dict[str, float]] = []
        self.bg: list[dict[str, Any]] = []
        self.tasks: list[Any] = []
        self._gc_t: dict[str, float] = {}

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t["t"] = time.perf_counter()
        elif "t" in self._gc_t:
            t = self._gc_t.pop("t")
            self.bg.append(
                {"kind": f"gc{info.get('generation', -1)}", "t": t, "dur": time.perf_counter() - t}
            )

    def note(self, key: str, t: float) -> None:
        rec = self.cur.get()
        if rec is not None:
            rec.setdefault(key + "0", t)
            rec[key] = rec.get(key, 0.0) + time.perf_counter() - t

    def event(self, kind: str, t: float) -> None:
        self.bg.append({"kind": kind, "t": t, "dur": time.perf_counter() - t})

    def timed_parse(self, key: str) -> Any:
        """A DNSRecord whose ``parse`` is timed as ``key``."""
        from dnslib import DNSRecord

        note = self.note

        class Timed(DNSRecord):  # type: ignore[misc]  # dnslib has no type information
            @classmethod
            def parse(cls, packet: bytes) -> DNSRecord:
                t = time.perf_counter()
                try:
                    return DNSRecord.parse(packet)
                finally:
                    note(key, t)

        return Timed

    async def stall_watch(self) -> None:  # event-loop stalls: a 5 ms sleep that overshoots by > 2 ms
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            if (late := time.perf_counter() - t - 0.005) > 0.002:
                self.bg.append({"kind": "loop_stall", "t": t + 0.005, "dur": late})


def _instrument_proxy(sp: _Splits) -> None:
    """Per query: its arrival, its record, and the reply's send; the stall watch from start()."""
    from egressd.dnsproxy import forwarder as dfwd
    from egressd.dnsproxy import server as dsrv

    orig_received, orig_reply, orig_start = dsrv._Udp.datagram_received, dsrv._Udp._reply, dsrv.DnsProxy.start

    def datagram_received(self: Any, *a: Any) -> None:
        token = sp.arrival.set(time.perf_counter())  # the reply task copies this context
        try:
            orig_received(self, *a)
        finally:
            sp.arrival.reset(token)

    async def reply(self: Any, *a: Any) -> None:
        rec: dict[str, float] = {"arr": sp.arrival.get()}
        sp.cur.set(rec)  # the task's own context: visible to everything this query awaits
        await orig_reply(self, *a)
        rec["sent"] = time.perf_counter()
        if "fwd" in rec and len(sp.records) < 200_000:
            sp.records.append(rec)

    async def start(self: Any, *a: Any, **kw: Any) -> None:
        await orig_start(self, *a, **kw)
        sp.tasks.append(asyncio.get_running_loop().create_task(sp.stall_watch()))

    for owner, attr, fn in ((dsrv._Udp, "datagram_received", datagram_received), (dsrv._Udp, "_reply", reply), (dsrv.DnsProxy, "start", start),
                            (dsrv, "DNSRecord", sp.timed_parse("q_parse")), (dfwd, "DNSRecord", sp.timed_parse("fwd_parse"))):  # fmt: skip
        setattr(owner, attr, fn)


def instrumented_main(out_path: str) -> int:
    from egressd import main as emain

    sp = _Splits()
    gc.callbacks.append(sp.on_gc)
    _instrument_proxy(sp)
    per_query, events = wrap_targets()
    for owner, attr, key in per_query:
        wrap(owner, attr, lambda t, k=key: sp.note(k, t))
    for owner, attr, key in events:
        wrap(owner, attr, lambda t, k=key: sp.event(k, t))
    try:
        return emain.main([])
    finally:
        Path(out_path).write_text(json.dumps({"records": sp.records, "bg": sp.bg}))


SPLITS = (
    ("queue", "loop: datagram_received -> answer() starts"),
    ("pre", "before forwarding, except the decision"),
    ("q_parse", "  of which: DNSRecord.parse of the query"),
    ("decide", "subject lookup + policy decision"),
    ("fwd", "upstream round trip (Forwarder.forward)"),
    ("fwd_sock", "  of which: new socket + SO_MARK"),
    ("fwd_parse", "  of which: DNSRecord.parse of the upstream reply"),
    ("between", "answer addresses + leases"),
    ("learn", "learn total (DnsLearning.learn)"),
    ("gc_wait", "  of which: waiting for the group commit (learn -> its commit starts)"),
    ("commit", "  of which: the commit (DnsLearning._commit)"),
    ("learn_many", "    of which: SubjectEngine.learn_many"),
    ("admit", "      of which: the decision (admissible_many)"),
    ("encode", "      of which: building the batch (dyn_add)"),
    ("nl", "      of which: the dynamic_add netlink batch (run_batch)"),
    ("nl_inline", "        of which: applied on the event loop (run_batch_inline)"),
    ("nl_thread", "        of which: applied on the kernel thread (hop there and back)"),
    ("record", "      of which: LeaseBook.record"),
    ("post", "pack reply"),
    ("send", "answer() returns -> sendto done"),
    ("total", "total in egressd: datagram_received -> sendto"),
)


def analyse(data: dict[str, Any], window: tuple[float, float]) -> dict[str, Any]:
    recs = [
        r
        for r in data.get("records", [])
        if all(k in r for k in ("answer0", "fwd0", "sent")) and window[0] <= r["arr"] <= window[1]
    ]
    per_q: list[dict[str, float]] = []
    hits: list[set[str]] = []
    bg = data.get("bg", [])
    for r in recs:
        a1, f1 = r["answer0"] + r["answer"], r["fwd0"] + r["fwd"]
        end = r["learn0"] + r["learn"] if "learn" in r else f1
        ms = {"queue": r["answer0"] - r["arr"], "decide": r.get("decide", 0.0), "fwd": r["fwd"], "post": a1 - end,
              "send": r["sent"] - a1, "total": r["sent"] - r["arr"], "q_parse": r.get("q_parse", 0.0),
              "fwd_sock": r.get("fwd_sock", 0.0), "fwd_parse": r.get("fwd_parse", 0.0)}  # fmt: skip
        ms["pre"] = r["fwd0"] - r["answer0"] - ms["decide"]
        if "learn" in r:
            ms.update(between=r["learn0"] - f1, learn=r["learn"])
            ms.update({k: r.get(k, 0.0) for k in ("commit", "learn_many", "admit", "encode", "nl", "record")})
            ms.update({k: r[k] for k in ("nl_inline", "nl_thread") if k in r})
            if "commit0" in r:
                ms["gc_wait"] = r["commit0"] - r["learn0"]
        per_q.append({k: v * 1000.0 for k, v in ms.items()})
        hits.append(
            {str(e["kind"]).rstrip("012") for e in bg if e["t"] < r["sent"] and e["t"] + e["dur"] > r["arr"]}
        )
    parts = {k: [q[k] for q in per_q if k in q] for k, _ in SPLITS}
    cut = c.pct(parts["total"], 99)
    tail = [q for q in per_q if q["total"] >= cut]
    overlap: dict[str, int] = {}
    for q, hit in zip(per_q, hits, strict=True):
        for kind in (hit or {"nothing recorded"}) if q["total"] >= cut else ():
            overlap[kind] = overlap.get(kind, 0) + 1
    events: dict[str, dict[str, float]] = {}
    lo, hi = (min(r["arr"] for r in recs), max(r["sent"] for r in recs)) if recs else (0, 0)
    for e in bg:
        if lo <= e["t"] <= hi:
            ev = events.setdefault(str(e["kind"]), {"n": 0, "max_ms": 0.0, "sum_ms": 0.0})
            ev["n"], ev["max_ms"], ev["sum_ms"] = (
                ev["n"] + 1,
                max(ev["max_ms"], 1000 * e["dur"]),
                ev["sum_ms"] + 1000 * e["dur"],
            )
    return {"queries": len(recs), "tail": len(tail), "tail_overlap": overlap, "events": events,
            "parts": {k: {**c.summary(v), "tail_mean": c.mean([q.get(k, 0.0) for q in tail])} for k, v in parts.items() if v}}  # fmt: skip


# ---- the run (pod namespace) ---------------------------------------------------------------------


class Runner:
    """Drives the client; per command: egressd metrics, CPU of our processes and of the machine."""

    def __init__(self, client: c.Proc, prm: dict[str, Any], pids: dict[str, int]) -> None:
        self.client, self.prm, self.pids = client, prm, {**pids, "client": client.pid}
        self.next_new, self.next_direct, self.next_ports = 0, prm["zone_names"] // 2, 0
        self.ticks: list[tuple[float, float]] = []  # when egressd's lease refresher may tick

    def expect_ticks(self, spawned: float, ready: float, interval: float) -> None:
        self.ticks = [
            (spawned + k * interval, ready + k * interval + 0.3) for k in range(1, int(3600 / interval))
        ]

    def cmd(self, h: c.Http | None, side: str, op: str, duration: float, **kw: Any) -> dict[str, Any]:
        start = {"direct": self.next_direct, "proxy_ports": self.next_ports}.get(side, self.next_new)
        kind = "repeat" if side.endswith("repeat") else "ports" if side == "proxy_ports" else "new"
        cmd = {"op": op, "target": "direct" if side == "direct" else "proxy", "duration": duration,
               "names": {"kind": kind, "start": start}, **kw}  # fmt: skip
        m0, c0, mc0, w0 = (
            c.scrape(h) if h else {},
            {k: c.cpu_s(p) for k, p in self.pids.items()},
            c.machine_cpu(),
            time.perf_counter(),
        )
        res = self.client.call(cmd, duration + 60)
        w1 = time.perf_counter()
        mc1, wall = c.machine_cpu(), w1 - w0
        res["cpu_s"] = {k: c.cpu_s(p) - c0[k] for k, p in self.pids.items()}
        busy = 100.0 * (mc1[0] - mc0[0]) / max(1.0, mc1[1] - mc0[1]) * (os.cpu_count() or 1)
        res["others_pct"] = busy - 100.0 * sum(v for v in res["cpu_s"].values() if math.isfinite(v)) / wall
        res["tick"] = any(lo < w1 and hi > w0 for lo, hi in self.ticks)
        res["metrics"] = c.delta(m0, c.scrape(h)) if h else {}
        used = res.get("issued", len(res.get("lat_ms", [])))
        if side == "proxy_new":
            self.next_new += used
        elif side == "proxy_ports":
            self.next_ports += used
        elif side == "direct":
            self.next_direct += used
        return res

    def paced(self, h: c.Http | None, side: str, duration: float) -> dict[str, Any]:
        return self.cmd(h, side, "paced", duration, rate=self.prm["rate"], sockets=self.prm["sockets"])

    def closed(self, h: c.Http | None, side: str, duration: float) -> dict[str, Any]:
        return self.cmd(
            h,
            side,
            "closed",
            duration,
            concurrency=self.prm["concurrency"],
            max_queries=int(duration * 20000) + 100,
        )


def aggregate(slices: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [math.inf if x is None else x for s in slices for x in s["lat_ms"]]
    wall = sum(s.get("send_s", s.get("window_s", 0.0)) for s in slices)
    m: dict[str, float] = {}
    for s in slices:
        for k, v in s["metrics"].items():
            m[k] = m.get(k, 0.0) + v
    n_q = m.get("egress_dns_query_duration_seconds_count", 0.0)
    add_ms, add_n = c.nft_ms(m, "dynamic_add")
    bad: dict[str, int] = {}
    for s in slices:
        for k, v in s["bad"].items():
            bad[k] = bad.get(k, 0) + v
    return {"lat": c.summary(lat), "sent": sum(s.get("sent", s.get("issued", 0)) for s in slices), "bad": bad,
            "answered": sum(1 for x in lat if math.isfinite(x)), "timeouts": sum(s.get("timeouts", 0) for s in slices),
            "lost": sum(1 for x in lat if not math.isfinite(x)), "qps": sum(s.get("qps", 0.0) for s in slices) / len(slices),
            "cpu_pct": {k: 100.0 * sum(s["cpu_s"][k] for s in slices) / wall for k in slices[0]["cpu_s"]},
            "others_pct": c.mean([s["others_pct"] for s in slices]), "ticks": sum(1 for s in slices if s["tick"]),
            "per_slice": [(c.pct([math.inf if x is None else x for x in s["lat_ms"]], 50), c.pct([math.inf if x is None else x for x in s["lat_ms"]], 99), s["tick"]) for s in slices],
            "lag_p99": max(s.get("lag_p99_ms", 0.0) for s in slices),
            "egressd_query_ms": 1000.0 * m.get("egress_dns_query_duration_seconds_sum", 0.0) / n_q if n_q else math.nan,
            "dynamic_add_ms": add_ms / add_n if add_n else math.nan, "dynamic_add": add_n,
            "failed": {k: v for k, v in m.items() if k.startswith("egress_dns_query_failed_total")}}  # fmt: skip


def register(h: c.Http, n: int, measured_first: bool) -> float:
    """n-1 active background subjects (fake IPs 10.203.1.2...) and the measured one."""
    order = [(f"dnsbg-{k}", f"10.203.{1 + k // 250}.{k % 250 + 2}",
              c.policy("deny", ("allow", f"svc{k}.bench.test"), ("allow", f"*.{V_SUFFIX}"), ("allow", f"203.0.113.{k % 250 + 1}")))
             for k in range(n - 1)]  # fmt: skip
    order.insert(0 if measured_first else len(order), (MEASURED_UID, SANDBOX_IP, MEASURED_POLICY))
    t0 = time.perf_counter()
    for uid, ip, pol in order:
        h.action(c.envelope("SET_BINDING", uid, ip=ip, policy=pol), f"SET_BINDING {uid}")
        h.action(c.envelope("LIFECYCLE_HOOK", uid, hook=True), f"data-plane-ready {uid}")
    return time.perf_counter() - t0


def sanity(run: Runner) -> None:
    """The proxy path really is the proxy: an allowed name resolves and is learned, the denied one is NXDOMAIN."""
    from egressd.subject.model import nft_id, subject_for_uid

    name, addr = v_name(run.next_new)
    run.next_new += 1
    got = run.client.call({"op": "query", "target": "proxy", "name": name}, 15)
    if got != {"rcode": "NOERROR", "answers": [addr]}:
        raise c.BenchError(f"proxy query {name}: {got}")
    dyn = f"subj_{nft_id(subject_for_uid(MEASURED_UID))}_dyn_v4"
    if addr not in (listing := c.run(["nft", "list", "set", "inet", TABLE, dyn]).stdout):
        raise c.BenchError(f"{addr} not learned into {dyn}: {listing[:300]}")
    # A name under the port-scoped rule is learned into the port-scoped set, not the address-only one.
    name, addr = p_name(run.next_ports)
    run.next_ports += 1
    got = run.client.call({"op": "query", "target": "proxy", "name": name}, 15)
    if got != {"rcode": "NOERROR", "answers": [addr]}:
        raise c.BenchError(f"proxy query {name}: {got}")
    # Its port scope is the subject's shared one (the first ranged domain rule's, single ports
    # and ranges): the address alone goes to the hash set dynr, not to dynpx nor to pipapo dynp.
    for kind, held in (("dynr", True), ("dynpx", False), ("dynp", False)):
        dynp = f"subj_{nft_id(subject_for_uid(MEASURED_UID))}_{kind}_v4"
        listing = c.run(["nft", "list", "set", "inet", TABLE, dynp]).stdout
        if (addr in listing) != held:
            raise c.BenchError(f"{addr} {'not ' if held else ''}learned into {dynp}: {listing[:300]}")
    if addr in c.run(["nft", "list", "set", "inet", TABLE, dyn]).stdout:
        raise c.BenchError(f"{addr} of a port-scoped name is in {dyn}: it would open every port")
    for target, want in (("proxy", "NXDOMAIN"), ("direct", "NOERROR")):
        if (got := run.client.call({"op": "query", "target": target, "name": DENIED}, 15))["rcode"] != want:
            raise c.BenchError(f"{target} query for {DENIED}: {got}, want {want}")


def conntrack_count() -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/netfilter/nf_conntrack_count").read_text())
    return -1


def inner(args: argparse.Namespace, topo: c.Topology, workdir: Path, rep: c.Report) -> dict[str, Any]:
    prm = dict(QUICK if args.quick else FULL)
    for key in ("subjects", "rate", "concurrency", "sockets"):
        prm[key] = getattr(args, key) or prm[key]
    prm["paced_s"], prm["closed_s"] = args.duration or prm["paced_s"], args.closed_duration or prm["closed_s"]
    splits = args.splits or ("always" if args.quick else "auto")
    (workdir / "zone.json").write_text(json.dumps({"records": zone(prm["zone_names"])}))
    py = [str(c.VENV_PY), str(Path(__file__).resolve())]
    up = c.Proc(
        [
            str(c.VENV_PY),
            str(c.UPSTREAM),
            "--http-ports",
            "",
            "--zone",
            str(workdir / "zone.json"),
            "--dns-port",
            "53",
        ],
        ns=topo.ns("up"),
    )
    client = c.Proc(
        [*py, "_client", f"proxy={c.GATEWAY}:53,direct={UPSTREAM_IP}:53", str(prm["zone_names"])],
        ns=topo.ns("sb1"),
    )
    d = c.Egressd(workdir, HTTP_PORT, TABLE, egressd_env())
    h: c.Http | None = None
    out: dict[str, Any] = {"prm": prm}
    try:
        if "ready" not in up.readline(60):
            raise c.BenchError("upstream DNS server did not start")
        client.read_json(30)
        t_spawn = time.perf_counter()
        d.start()
        t_ready, h = time.perf_counter(), c.Http(HTTP_PORT)
        out["register_s"] = register(h, prm["subjects"], args.measured_first)
        c.log(f"egressd ready, {prm['subjects']} subjects registered in {out['register_s']:.1f}s")
        run = Runner(client, prm, {"egressd": d.pid, "upstream": up.pid})
        run.expect_ticks(t_spawn, t_ready, 30.0)  # EGRESSD_REFRESH_INTERVAL's default
        sanity(run)
        out["paced"] = paced_phase(run, h, d, prm)
        out["conntrack_paced"] = conntrack_count()
        out["closed"] = closed_phase(run, h, prm)
        check_answers(out["paced"], out["closed"])
        out["conntrack_closed"], out["rss_kb"], out["names_used"] = (
            conntrack_count(),
            c.mem_kb(d.pid),
            run.next_new,
        )
        d.check_alive()
        c.log("closed: " + ", ".join(f"{s} {v['qps']:.0f} q/s" for s, v in out["closed"].items()))
        missed = any(out["paced"][s]["lat"][q] - out["paced"]["direct"]["lat"][q] > lim
                     for s in PACED[1:] for q, lim in (("p50", T_P50_ADDED_MS), ("p99", T_P99_ADDED_MS)))  # fmt: skip
        if splits == "always" or (splits == "auto" and missed):
            h.close()
            h = None
            out["splits"] = splits_phase(d, client, up.pid, py, workdir, prm, args.measured_first)
    except (OSError, http.client.HTTPException, c.BenchError) as exc:
        raise c.BenchError(f"{exc}\n--- egressd log tail ---\n{d.log_tail()}") from None
    finally:
        if h is not None:
            h.close()
        with contextlib.suppress(OSError):
            if client.p.stdin is not None:
                client.p.stdin.close()  # the client ends at EOF
        client.stop(5)
        d.stop()
        up.stop()
    report(rep, prm, out, args.measured_first)
    return out


def egressd_env() -> dict[str, str]:
    env = {"EGRESSD_DNS_ADDR": f"0.0.0.0:{DNS_PORT}", "OPENSANDBOX_EGRESS_DNS_UPSTREAM": f"{UPSTREAM_IP}:53",
           # The per-subject budget (200 q/s) would REFUSE the load, the lease cap (4096) SERVFAIL new names.
           "EGRESSD_DNS_QPS_PER_SUBJECT": "0", "EGRESSD_MAX_LEASES_PER_SUBJECT": "65536"}  # fmt: skip
    bnf = Path(
        "/proc/sys/net/bridge/bridge-nf-call-iptables"
    )  # set by pod_topology where br_netfilter exists
    if not (bnf.exists() and bnf.read_text().strip() == "1"):
        env["EGRESSD_ALLOW_BRIDGE_BYPASS"] = "1"
    return env


def paced_phase(run: Runner, h: c.Http, d: c.Egressd, prm: dict[str, Any]) -> dict[str, Any]:
    """(1): the paced sides interleaved in slices."""
    for side in PACED:
        run.paced(h, side, prm["warmup_s"])
    n_sl = max(1, round(prm["paced_s"] / prm["slice_s"]))
    per: dict[str, list[dict[str, Any]]] = {s: [] for s in PACED}
    for r in range(n_sl):  # sides interleaved in slices, rotating order: drift hits all alike
        order = PACED[r % len(PACED) :] + PACED[: r % len(PACED)]
        for side in reversed(order) if r % 2 else order:
            per[side].append(run.paced(h, side, prm["paced_s"] / n_sl))
        d.check_alive()
    paced = {s: aggregate(v) for s, v in per.items()}
    c.log(
        "paced: "
        + ", ".join(f"{s} p50 {v['lat']['p50']:.3f} p99 {v['lat']['p99']:.3f} ms" for s, v in paced.items())
    )
    return paced


def closed_phase(run: Runner, h: c.Http, prm: dict[str, Any]) -> dict[str, Any]:
    """(2): closed loop, ABBA."""
    for side in CLOSED:
        run.closed(h, side, 0.3)
    per: dict[str, list[dict[str, Any]]] = {s: [] for s in CLOSED}
    for side in (*CLOSED, *reversed(CLOSED)):  # ABBA
        per[side].append(run.closed(h, side, prm["closed_s"] / 2))
    return {s: aggregate(v) for s, v in per.items()}


def check_answers(*phases: dict[str, Any]) -> None:
    for s, x in (item for phase in phases for item in phase.items()):
        if sum(x["bad"].values()) > 0.1 * max(1, x["sent"]):
            raise c.BenchError(
                f"{s}: {x['bad']} wrong answers out of {x['sent']}: the set-up is broken, not slow"
            )


def splits_phase(
    d: c.Egressd,
    client: c.Proc,
    upstream_pid: int,
    py: list[str],
    workdir: Path,
    prm: dict[str, Any],
    measured_first: bool,
) -> dict[str, Any]:
    """(3): egressd restarted with its own main() instrumented; proxy (new names), then direct."""
    d.stop()
    c.log("splits: egressd restarted instrumented; registering the subjects again")
    d.env["EGRESSD_REFRESH_INTERVAL"] = str(prm["refresh_s"])
    d.start([*py, "_egressd", str(workdir / "splits.json")])
    h = c.Http(HTTP_PORT)
    try:
        register(h, prm["subjects"], measured_first)
        run2 = Runner(client, prm, {"egressd": d.pid, "upstream": upstream_pid})
        run2.next_new = prm["zone_names"] // 4  # a fresh table: every name is new to it
        sanity(run2)
        for side in (*SPLIT_SIDES, "direct"):
            run2.paced(h, side, prm["warmup_s"])
        lat: dict[str, Any] = {}
        windows: dict[str, tuple[float, float]] = {}
        for side in SPLIT_SIDES:  # one window each: the records are told apart by their time
            t0 = time.perf_counter()  # CLOCK_MONOTONIC is shared by every process: it delimits the window
            lat[side] = aggregate([run2.paced(h, side, prm["splits_s"])])["lat"]
            windows[side] = (t0, time.perf_counter())
        dire = aggregate([run2.paced(h, "direct", prm["splits_s"])])
    finally:
        h.close()
    d.stop()  # SIGTERM: the instrumented main writes its records on the way out
    f = workdir / "splits.json"
    data = json.loads(f.read_text()) if f.exists() else {}
    sides = {side: {"rtt": lat[side], **analyse(data, windows[side])} for side in SPLIT_SIDES}
    # The first side's figures at the top level, as before the port-scoped side was added.
    out = {"proxy": lat[SPLIT_SIDES[0]], "direct": dire["lat"], **sides[SPLIT_SIDES[0]], "sides": sides}
    for side, sp in sides.items():
        if not sp["queries"]:
            raise c.BenchError(
                f"splits: the instrumented egressd recorded no forwarded query of {side} (do the wrappers still fit?)"
            )
    c.log(
        "splits: "
        + ", ".join(f"{side} {sp['queries']}" for side, sp in sides.items())
        + " forwarded queries recorded"
    )
    return out


def report(rep: c.Report, prm: dict[str, Any], out: dict[str, Any], first: bool) -> None:
    p, cl = out["paced"], out["closed"]
    base = p["direct"]["lat"]
    rep.add(f"{prm['subjects']} active subjects (registered in {out['register_s']:.1f}s), the measured one {SANDBOX_IP}"
            f" registered {'first' if first else 'last'}; its policy: 10 domain rules + 1 IP rule, the names match the 8th/9th/10th (the 10th with ports)")  # fmt: skip
    rep.add(
        "latency = client send() -> kernel receive timestamp of the reply; baseline: the same client asking the upstream directly"
    )
    rep.add("")
    rep.add(
        f"(1) paced {prm['rate']:.0f} q/s open loop, {prm['sockets']} sockets, {prm['paced_s']:g}s per side in {prm['slice_s']:g}s slices, interleaved; ms"
    )
    rep.table(["side", "sent", "lost", "bad", "p50", "p90", "p99", "p99.9", "max", "+p50", "+p99", "p50 ratio", "p99 ratio", "CPU egressd/up/client %", "egressd query / dynamic_add ms"],
              [[LABELS[s], x["sent"], x["lost"], sum(x["bad"].values()), *(x["lat"][q] for q in ("p50", "p90", "p99", "p999", "max")),
                x["lat"]["p50"] - base["p50"], x["lat"]["p99"] - base["p99"], c.ratio(x["lat"]["p50"], base["p50"]), c.ratio(x["lat"]["p99"], base["p99"]),
                "/".join(f"{x['cpu_pct'][k]:.0f}" for k in ("egressd", "upstream", "client")),
                f"{x['egressd_query_ms']:.3f} / {x['dynamic_add_ms']:.3f} ({x['dynamic_add']})" if s != "direct" else "-"] for s, x in p.items()])  # fmt: skip
    for s, x in p.items():
        rep.add(f"  {LABELS[s]}: per slice p50/p99 " + ", ".join(f"{a:.2f}/{b:.2f}{'*' if t else ''}" for a, b, t in x["per_slice"])
                + f"; send lag p99 {x['lag_p99']:.2f} ms; CPU of everything else {x['others_pct']:.0f}% of a core"
                + (f"; bad {x['bad']}" if x["bad"] else "") + (f"; egressd failures {x['failed']}" if x["failed"] else ""))  # fmt: skip
    rep.add(f"  (* = the slice contained an egressd lease-refresher tick, every 30 s); conntrack entries in the pod after (1)"
            f" {out['conntrack_paced']}, after (2) {out['conntrack_closed']}; egressd RSS {out['rss_kb'] / 1024:.0f} MiB")  # fmt: skip
    rep.add("")
    rep.add(
        f"(2) closed loop, {prm['concurrency']} outstanding, {prm['closed_s']:g}s per side (ABBA), new names"
    )
    rep.table(["side", "answered", "timeouts", "bad", "q/s", "ratio", "p50 ms", "p99 ms", "CPU egressd/up/client %"],
              [[LABELS[s], x["answered"], x["timeouts"], sum(x["bad"].values()), x["qps"], c.ratio(x["qps"], cl["direct"]["qps"]), x["lat"]["p50"], x["lat"]["p99"],
                "/".join(f"{x['cpu_pct'][k]:.0f}" for k in ("egressd", "upstream", "client"))] for s, x in cl.items()])  # fmt: skip
    rep.add(
        f"  distinct new names asked through the proxy in (1)+(2): {out['names_used']} (zone {prm['zone_names']})"
    )
    if sp := out.get("splits"):
        report_splits(rep, prm, sp)
    for s in PACED[1:]:
        for q, lim in (("p50", T_P50_ADDED_MS), ("p99", T_P99_ADDED_MS)):
            added = p[s]["lat"][q] - base[q]
            rep.target(f"added {q} at {prm['rate']:.0f} q/s, {LABELS[s]}", added <= lim,
                       f"{added:+.3f} ms ({p[s]['lat'][q]:.3f} vs direct {base[q]:.3f}, {c.ratio(p[s]['lat'][q], base[q])})", f"<= +{lim} ms")  # fmt: skip
    for q in ("p50", "p99"):
        ratio = p["proxy_ports"]["lat"][q] / p["proxy_new"]["lat"][q]
        rep.target(f"{q} of new names under a port-scoped rule vs today's shape (same run, interleaved)", ratio <= T_PORTS_RATIO,
                   f"{ratio:.2f}x ({p['proxy_ports']['lat'][q]:.3f} vs {p['proxy_new']['lat'][q]:.3f} ms)", f"<= {T_PORTS_RATIO}x")  # fmt: skip
    rep.add("")
    rep.add(f"  [info  ] max sustained q/s through the proxy: {cl['proxy_new']['qps']:.0f} vs direct {cl['direct']['qps']:.0f}"
            f" ({c.ratio(cl['proxy_new']['qps'], cl['direct']['qps'])}); no target")  # fmt: skip


def report_splits(rep: c.Report, prm: dict[str, Any], sp: dict[str, Any]) -> None:
    """(3): each side's split next to the other's (same instrumented daemon, one window each)."""
    sides: dict[str, Any] = sp.get("sides") or {SPLIT_SIDES[0]: {**sp, "rtt": sp["proxy"]}}
    rep.add("")
    rep.add(f"(3) where the time goes: egressd's main() with perf_counter wrappers, {prm['splits_s']:g}s per side, one after the other;"
            f" client RTT p50 " + ", ".join(f"{s} {x['rtt']['p50']:.3f}" for s, x in sides.items())
            + f" vs direct {sp['direct']['p50']:.3f} ms; forwarded queries recorded "
            + ", ".join(f"{s} {x['queries']}" for s, x in sides.items()) + "; ms")  # fmt: skip
    keys = [k for k, _ in SPLITS if any(k in x["parts"] for x in sides.values())]
    rep.table(["component (per forwarded query)"] + [f"{s} {q}" for s in sides for q in ("p50", "p99", "mean", "mean slowest 1%")],
              [[lbl, *(x["parts"][k][q] if k in x["parts"] else "-" for x in sides.values() for q in ("p50", "p99", "mean", "tail_mean"))]
               for k, lbl in SPLITS if k in keys])  # fmt: skip
    rep.add("  the commit's parts run once per transaction and count for its first answer (read their means: per query);"
            " learn -> commit: the group commit's task starting, the subject's lock")  # fmt: skip
    rep.add("  transactions applied on the event loop / on the kernel thread: "
            + ", ".join(f"{s} {x['parts'].get('nl_inline', {}).get('n', 0)} / {x['parts'].get('nl_thread', {}).get('n', 0)}" for s, x in sides.items()))  # fmt: skip
    for s, x in sides.items():
        rep.add(f"  {s}: background events in the window (EGRESSD_REFRESH_INTERVAL={prm['refresh_s']} s): "
                + ("; ".join(f"{k} {e['n']:.0f}x, max {e['max_ms']:.1f} ms" for k, e in sorted(x["events"].items())) or "-")
                + f"; the slowest 1% ({x['tail']}) overlapped: " + (", ".join(f"{k} {v}" for k, v in sorted(x["tail_overlap"].items())) or "-"))  # fmt: skip


def build(topo: c.Topology) -> None:
    c.pod_topology(topo, 1, [UPSTREAM_IP])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        return client_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "_egressd":
        return instrumented_main(sys.argv[2])
    p = c.parser(__doc__, "50 subjects, 3 s per side, the instrumented run always")
    p.add_argument("--subjects", type=int, default=0, help="active subjects incl. the measured one (1000)")
    p.add_argument("--rate", type=float, default=0, help="paced queries per second (1000)")
    p.add_argument("--duration", type=float, default=0, help="paced seconds per side (10; quick 3)")
    p.add_argument(
        "--closed-duration", type=float, default=0, help="closed-loop seconds per side (5; quick 2)"
    )
    p.add_argument("--concurrency", type=int, default=0, help="closed-loop queries outstanding (32)")
    p.add_argument("--sockets", type=int, default=0, help="client sockets of the paced run (8)")
    p.add_argument(
        "--splits",
        choices=("auto", "always", "never"),
        help="(3): when a target is missed (auto, default), always (quick), never",
    )
    p.add_argument(
        "--measured-first",
        action="store_true",
        help="register the measured subject first (its sets head the kernel's list)",
    )
    return c.main("dns", "egbd", ["pod", "up", "sb1"], "pod", p.parse_args(), inner, build)


if __name__ == "__main__":
    sys.exit(main())
