#!/usr/bin/env python3
"""DNS proxy benchmark: added latency and maximum throughput of egressd's shared DNS proxy.

Run as root from the repository root::

    .venv/bin/python scripts/bench/bench_dns.py [--quick] [--json-out FILE]

Topology (all in namespaces this script creates, ``egbdns-<pid>-{pod,sb,up}``; no namespace
gets a route out, the root namespace gets no link, route or nft table)::

    sb  eth0 10.203.0.11 ---- vsb -- br0 10.203.0.1 (pod: egressd) uplink 10.204.0.1 ---- eth0 10.204.0.2 (up)
        client (this script,                                                         scripts/fleet_upstream.py
        --client)                                                                    authoritative zone

The outer process creates the namespaces and links (every ``ip`` command that adds something
runs inside one of them) and re-executes itself inside the pod namespace (``--inner``), which
starts the upstream in ``up``, egressd in ``pod`` and the DNS client in ``sb``, registers the
subjects through egressd's HTTP action API and drives the client. See README.md next to this file.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import ipaddress
import json
import math
import os
import platform
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EGRESSD = ROOT / ".venv" / "bin" / "egressd"
UPSTREAM_SCRIPT = ROOT / "scripts" / "fleet_upstream.py"
NS_PREFIX = "egbdns-"
ROLES = ("pod", "up", "sb")
HTTP_PORT = 18580
DNS_PORT = 15353
TABLE = "egbench_dns"
ACTIONS = "/_fastlet/v1/actions"
API = "sandbox.fast.io/actions/v1"

GATEWAY = "10.203.0.1"
SANDBOX_IP = "10.203.0.11"
POD_UPLINK_IP = "10.204.0.1"
UPSTREAM_IP = "10.204.0.2"
MEASURED_UID = "dnsbench-sb"
OUR_LINKS = ("br0", "vsb", "uplink")  # names created in the pod (their peers are eth0 in sb/up)

# Zone: new names v<k>.v.bench.test -> 10.210.0.0 + k + 1; repeated names r<j>.r.bench.test.
V_SUFFIX = "v.bench.test"
R_SUFFIX = "r.bench.test"
V_BASE = int(ipaddress.IPv4Address("10.210.0.0"))
R_BASE = int(ipaddress.IPv4Address("10.212.0.0"))
REPEAT_NAMES = 16
DENIED_NAME = "exfil.bench.test"  # in the zone, denied by the measured subject's policy
ZONE_TTL = 300  # lease 360 s: nothing expires during a run

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; not exported by Python 3.12

# Targets (from the brief).
T_RATE = 1000.0
T_P50_ADDED_MS = 0.5
T_P99_ADDED_MS = 3.0
PER_CLIENT_CAP = 64  # egressd.dnsproxy.server.MAX_IN_FLIGHT_PER_CLIENT

PARAMS_FULL: dict[str, Any] = {
    "subjects": 1000,
    "rate": 1000.0,
    "paced_s": 10.0,  # per side
    "slice_s": 2.0,  # the sides alternate in slices of this length
    "warmup_s": 0.5,
    "sockets": 8,
    "closed_s": 5.0,  # per side, in 2 slices
    "concurrency": 32,
    "closed_max_per_slice": 40000,
    "splits_s": 5.0,
    "splits_refresh_s": 2,  # EGRESSD_REFRESH_INTERVAL of the instrumented run: ticks inside the window
    "zone_names": 40000,
}
PARAMS_QUICK: dict[str, Any] = {
    **PARAMS_FULL,
    "subjects": 50,
    "paced_s": 3.0,
    "slice_s": 1.0,
    "warmup_s": 0.3,
    "closed_s": 2.0,
    "splits_s": 2.0,
    "splits_refresh_s": 1,
    "zone_names": 12000,
}


class BenchError(RuntimeError):
    pass


class Interrupted(BaseException):  # BaseException so nothing swallows it
    pass


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(f"signal {signal.Signals(signum).name}")


def install_signal_handlers() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)


def ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def log(msg: str) -> None:
    print(f"[bench-dns {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


# ---------------------------------------------------------------------------------------------
# statistics


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; unanswered queries are +inf, so they count as the slowest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summary(ms: Sequence[float]) -> dict[str, float]:
    finite = [x for x in ms if math.isfinite(x)]
    return {
        "n": len(ms),
        "p50_ms": pct(ms, 50),
        "p90_ms": pct(ms, 90),
        "p99_ms": pct(ms, 99),
        "p999_ms": pct(ms, 99.9),
        "max_ms": max(ms) if ms else math.nan,
        "mean_ms": sum(finite) / len(finite) if finite else math.nan,
    }


# ---------------------------------------------------------------------------------------------
# names, zone, policies


def v_name(k: int) -> str:
    return f"v{k}.{V_SUFFIX}"


def v_addr(k: int) -> str:
    return str(ipaddress.IPv4Address(V_BASE + k + 1))


def r_name(j: int) -> str:
    return f"r{j}.{R_SUFFIX}"


def r_addr(j: int) -> str:
    return str(ipaddress.IPv4Address(R_BASE + j + 1))


def zone_records(n_names: int) -> list[dict[str, object]]:
    recs: list[dict[str, object]] = [
        {"name": v_name(k), "type": "A", "value": v_addr(k), "ttl": ZONE_TTL} for k in range(n_names)
    ]
    recs += [
        {"name": r_name(j), "type": "A", "value": r_addr(j), "ttl": ZONE_TTL} for j in range(REPEAT_NAMES)
    ]
    recs.append({"name": DENIED_NAME, "type": "A", "value": "10.213.0.1", "ttl": ZONE_TTL})
    return recs


def measured_policy() -> str:
    """Deny by default; the benchmark's names match the 8th and 9th domain rule (first match wins)."""
    rules = [
        ("deny", DENIED_NAME),
        ("allow", "pypi.org"),
        ("allow", "files.pythonhosted.org"),
        ("allow", "*.github.com"),
        ("allow", "api.openai.com"),
        ("allow", "*.googleapis.com"),
        ("allow", "registry.npmjs.org"),
        ("allow", f"*.{R_SUFFIX}"),
        ("allow", f"*.{V_SUFFIX}"),
        ("allow", UPSTREAM_IP),  # IP rule: lets the direct baseline through the pod's forward hook
    ]
    return json.dumps(
        {"defaultAction": "deny", "egress": [{"action": a, "target": t} for a, t in rules]},
        separators=(",", ":"),
    )


def background_policy(k: int) -> str:
    return json.dumps(
        {
            "defaultAction": "deny",
            "egress": [
                {"action": "allow", "target": f"svc{k}.bench.test"},
                {"action": "allow", "target": f"*.{V_SUFFIX}"},
                {"action": "allow", "target": f"203.0.113.{k % 250 + 1}"},
            ],
        },
        separators=(",", ":"),
    )


def background_ip(k: int) -> str:
    """Fake sandbox addresses 10.203.1.2 ... (they only need to be registered and active)."""
    return f"10.203.{1 + k // 250}.{k % 250 + 2}"


def envelope(op: str, uid: str, **extra: Any) -> bytes:
    env: dict[str, Any] = {
        "apiVersion": API,
        "operation": op,
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": f"rt-{uid}", "attachmentId": "att-1", "specGeneration": 1},
        **extra,
    }
    return json.dumps(env).encode()


def set_binding_body(uid: str, ip: str, policy: str) -> bytes:
    return envelope(
        "SET_BINDING",
        uid,
        attachment={"network": {"ip": ip, "gateway": GATEWAY, "hostVeth": f"vh-{uid}"[:15]}},
        binding={"input": policy},
    )


def hook_body(uid: str) -> bytes:
    return envelope("LIFECYCLE_HOOK", uid, hook={"name": "sandbox.data-plane-ready", "sequence": 1})


# ---------------------------------------------------------------------------------------------
# client side: runs in the sandbox namespace, one JSON command per stdin line, one result per line


def _kernel_ns(anc: list[tuple[int, int, bytes]]) -> int:
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])  # struct timespec (kernel ancillary data)
            return sec * 1_000_000_000 + nsec
    return 0


class DnsClient:
    """Prebuilt dnslib queries over connected UDP sockets; receive times from SO_TIMESTAMPNS.

    Send time is ``time.time_ns()`` right before ``send()``; receive time is the kernel's
    timestamp of the reply, so a client that wakes up late does not inflate the latency.
    """

    ANC = socket.CMSG_SPACE(16)

    def __init__(self, targets: dict[str, tuple[str, int]], zone_names: int) -> None:
        self.targets = targets
        self.zone_names = zone_names
        self._socks: dict[tuple[str, int], list[socket.socket]] = {}

    def sockets(self, target: str, count: int) -> list[socket.socket]:
        key = (target, count)
        if key not in self._socks:
            socks = []
            for _ in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                s.connect(self.targets[target])
                s.setblocking(False)
                socks.append(s)
            self._socks[key] = socks
        return self._socks[key]

    def names(self, spec: dict[str, Any], n: int) -> tuple[list[str], list[str]]:
        if spec["kind"] == "new":
            ks = [(spec["start"] + i) % self.zone_names for i in range(n)]
            return [v_name(k) for k in ks], [v_addr(k) for k in ks]
        if spec["kind"] == "repeat":
            return [r_name(i % REPEAT_NAMES) for i in range(n)], [r_addr(i % REPEAT_NAMES) for i in range(n)]
        raise ValueError(spec)

    @staticmethod
    def wires(names: list[str]) -> list[bytes]:
        from dnslib import DNSRecord

        out = []
        for i, name in enumerate(names):
            q = DNSRecord.question(name, "A")
            q.header.id = i & 0xFFFF
            out.append(bytes(q.pack()))
        return out

    @staticmethod
    def _drain(socks: list[socket.socket]) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                while True:
                    s.recv(4096)

    @staticmethod
    def check(data: bytes, name: str, addr: str) -> str:
        """'' if the reply is NOERROR with exactly the expected A record, else a reason."""
        from dnslib import QTYPE, RCODE, DNSRecord

        try:
            rep = DNSRecord.parse(data)
        except Exception as exc:
            return f"unparseable: {exc}"
        if rep.header.rcode != RCODE.NOERROR:
            return f"rcode {RCODE[rep.header.rcode]}"
        if str(rep.q.qname).rstrip(".").lower() != name:
            return f"question {rep.q.qname}"
        got = [str(rr.rdata) for rr in rep.rr if rr.rtype == QTYPE.A]
        return "" if got == [addr] else f"answer {got}"

    # ---- one query (sanity checks) ---------------------------------------------------------

    def query(self, target: str, name: str, timeout: float = 3.0) -> dict[str, Any]:
        from dnslib import QTYPE, RCODE, DNSRecord

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            s.connect(self.targets[target])
            q = DNSRecord.question(name, "A")
            s.send(bytes(q.pack()))
            try:
                rep = DNSRecord.parse(s.recv(4096))
            except TimeoutError:
                return {"rcode": "TIMEOUT", "answers": []}
        return {
            "rcode": RCODE[rep.header.rcode],
            "answers": [str(r.rdata) for r in rep.rr if r.rtype == QTYPE.A],
        }

    # ---- open loop -------------------------------------------------------------------------

    def paced(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from dnslib import DNSBuffer, DNSHeader

        rate, duration = float(cmd["rate"]), float(cmd["duration"])
        n = round(rate * duration)
        if n > 65536:
            raise ValueError("paced slice too long: query ids must stay unique")
        socks = self.sockets(cmd["target"], int(cmd["sockets"]))
        nsock = len(socks)
        names, addrs = self.names(cmd["names"], n)
        wires = self.wires(names)
        fd_index = {s.fileno(): i for i, s in enumerate(socks)}
        ep = select.epoll()
        for s in socks:
            ep.register(s.fileno(), select.EPOLLIN)
        self._drain(socks)
        sent = [0] * n
        lag = [0.0] * n
        rx: list[tuple[int, int, int, bytes]] = []
        errors = 0
        anc = self.ANC

        def receive() -> None:
            nonlocal errors
            for fd, _ev in ep.poll(0):
                s = socks[fd_index[fd]]
                while True:
                    try:
                        data, ad, _fl, _addr = s.recvmsg(4096, anc)
                    except BlockingIOError:
                        break
                    except OSError:
                        errors += 1
                        continue
                    rx.append((fd_index[fd], _kernel_ns(ad), time.time_ns(), data))

        interval = 1.0 / rate
        cpu0 = time.process_time()
        t0 = time.perf_counter() + 0.005
        for i in range(n):
            due = t0 + i * interval
            receive()
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            lag[i] = time.perf_counter() - due
            sent[i] = time.time_ns()
            try:
                socks[i % nsock].send(wires[i])
            except OSError:
                errors += 1
                sent[i] = 0
        t_send_end = time.perf_counter()
        expected = sum(1 for t in sent if t)
        deadline = t_send_end + float(cmd.get("drain", 2.0))
        while len(rx) < expected and time.perf_counter() < deadline:
            ep.poll(0.02)
            receive()
        cpu = time.process_time() - cpu0
        ep.close()

        lat_ms = [math.inf] * n
        bad: dict[str, int] = {}
        fallback = dupes = 0
        for sock_i, kns, uns, data in rx:
            try:
                i = DNSHeader.parse(DNSBuffer(data)).id
            except Exception:
                bad["unparseable"] = bad.get("unparseable", 0) + 1
                continue
            if i >= n or i % nsock != sock_i or not sent[i]:
                bad["unknown id"] = bad.get("unknown id", 0) + 1
                continue
            if math.isfinite(lat_ms[i]):
                dupes += 1
                continue
            why = self.check(data, names[i], addrs[i])
            if why:
                bad[why[:40]] = bad.get(why[:40], 0) + 1
                continue
            t_rx = kns
            if not kns or kns < sent[i] or kns > uns:
                fallback += 1
                t_rx = uns
            lat_ms[i] = (t_rx - sent[i]) / 1e6
        answered = sum(1 for x in lat_ms if math.isfinite(x))
        lag_ms = [x * 1000.0 for x in lag]
        return {
            "n": n,
            "sent": expected,
            "answered": answered,
            "bad": bad,
            "errors": errors,
            "duplicates": dupes,
            "kernel_ts_fallback": fallback,
            "send_s": t_send_end - t0,
            "cpu_s": cpu,
            "lat_ms": [round(x, 4) if math.isfinite(x) else None for x in lat_ms],
            "lag_p50_ms": pct(lag_ms, 50),
            "lag_p99_ms": pct(lag_ms, 99),
            "lag_max_ms": max(lag_ms) if lag_ms else math.nan,
        }

    # ---- closed loop -----------------------------------------------------------------------

    def closed(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from dnslib import DNSBuffer, DNSHeader

        conc, duration = int(cmd["concurrency"]), float(cmd["duration"])
        max_q = min(int(cmd["max_queries"]), 65536)
        timeout = float(cmd.get("timeout", 1.0))
        socks = self.sockets(cmd["target"], conc)
        names, addrs = self.names(cmd["names"], max_q)
        wires = self.wires(names)
        slot_of = {s.fileno(): k for k, s in enumerate(socks)}
        ep = select.epoll()
        for s in socks:
            ep.register(s.fileno(), select.EPOLLIN)
        self._drain(socks)
        cur = [-1] * conc
        sent_ns = [0] * conc
        deadline = [0.0] * conc
        lat_ms: list[float] = []
        done_at: list[float] = []
        replies: list[tuple[int, bytes]] = []
        counter = 0
        timeouts = stale = errors = 0
        anc = self.ANC

        def issue(slot: int) -> None:
            nonlocal counter, errors
            i = counter
            counter += 1
            cur[slot] = i
            deadline[slot] = time.perf_counter() + timeout
            sent_ns[slot] = time.time_ns()
            try:
                socks[slot].send(wires[i])
            except OSError:
                errors += 1

        cpu0 = time.process_time()
        start = time.perf_counter()
        stop_at = start + duration
        issuing = True
        issue_end = stop_at
        for slot in range(conc):
            issue(slot)
        next_timeout_scan = start + 0.01
        hard_end = stop_at + timeout + 1.0
        while True:
            now = time.perf_counter()
            if issuing and (now >= stop_at or counter >= max_q):
                issuing = False
                issue_end = min(now, stop_at)
            if (not issuing and all(c < 0 for c in cur)) or now > hard_end:
                break
            for fd, _ev in ep.poll(0.01):
                slot = slot_of[fd]
                s = socks[slot]
                while True:
                    try:
                        data, ad, _fl, _addr = s.recvmsg(4096, anc)
                    except BlockingIOError:
                        break
                    except OSError:
                        errors += 1
                        continue
                    i = cur[slot]
                    try:
                        rid = DNSHeader.parse(DNSBuffer(data)).id
                    except Exception:
                        rid = -1
                    if i < 0 or rid != (i & 0xFFFF):
                        stale += 1
                        continue
                    kns = _kernel_ns(ad) or time.time_ns()
                    lat_ms.append((kns - sent_ns[slot]) / 1e6)
                    t_done = time.perf_counter()
                    done_at.append(t_done)
                    replies.append((i, data))
                    cur[slot] = -1
                    if issuing and counter < max_q and t_done < stop_at:
                        issue(slot)
            now = time.perf_counter()
            if now >= next_timeout_scan:
                next_timeout_scan = now + 0.01
                for slot in range(conc):
                    if cur[slot] >= 0 and now > deadline[slot]:
                        timeouts += 1
                        cur[slot] = -1
                        if issuing and counter < max_q and now < stop_at:
                            issue(slot)
        cpu = time.process_time() - cpu0
        ep.close()
        bad: dict[str, int] = {}
        for i, data in replies:
            why = self.check(data, names[i], addrs[i])
            if why:
                bad[why[:40]] = bad.get(why[:40], 0) + 1
        in_window = sum(1 for t in done_at if t <= issue_end)
        wall = issue_end - start
        return {
            "concurrency": conc,
            "issued": counter,
            "answered": len(lat_ms),
            "answered_in_window": in_window,
            "window_s": wall,
            "qps": in_window / wall if wall > 0 else math.nan,
            "timeouts": timeouts,
            "stale": stale,
            "errors": errors,
            "bad": bad,
            "cpu_s": cpu,
            "lat_ms": [round(x, 4) for x in lat_ms],
        }

    def close(self) -> None:
        for socks in self._socks.values():
            for s in socks:
                s.close()


def client_main(args: argparse.Namespace) -> int:
    ignore_signals()  # the orchestrator ends us by closing stdin (or by PID)
    targets = {}
    for item in args.targets.split(","):
        name, _, addr = item.partition("=")
        host, _, port = addr.rpartition(":")
        targets[name] = (host, int(port))
    client = DnsClient(targets, args.zone_names)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            op = cmd.get("op")
            try:
                if op == "quit":
                    break
                if op == "query":
                    res = client.query(cmd["target"], cmd["name"])
                elif op == "paced":
                    res = client.paced(cmd)
                elif op == "closed":
                    res = client.closed(cmd)
                else:
                    res = {"error": f"unknown op {op!r}"}
            except Exception as exc:
                res = {"error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(res) + "\n")
            out.flush()
    finally:
        client.close()
    return 0


# ---------------------------------------------------------------------------------------------
# instrumented egressd (diagnostic "where the time goes" run): egressd's own main() with a few
# methods wrapped by perf_counter calls; one record per forwarded UDP query, written at exit.


def egressd_instrumented_main(out_path: str) -> int:
    import contextvars
    import gc

    from dnslib import DNSRecord

    from egressd import main as emain
    from egressd.dnsproxy import forwarder as dfwd
    from egressd.dnsproxy import server as dsrv
    from egressd.dnsproxy.forwarder import Forwarder
    from egressd.fleet import refresh as frefresh
    from egressd.fleet.always_reload import AlwaysRulesReloader
    from egressd.fleet.control import ControlPlane
    from egressd.fleetnft.applier import KernelTransactions

    pc = time.perf_counter
    cur: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("bench_q", default=None)
    arrival: contextvars.ContextVar[float] = contextvars.ContextVar("bench_arrival", default=0.0)
    records: list[dict[str, float]] = []
    gc_events: list[tuple[float, float, int]] = []
    gc_start: dict[str, float] = {}
    limit = 200_000

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start["t"] = pc()
        elif "t" in gc_start:
            t = gc_start.pop("t")
            gc_events.append((t, pc() - t, info.get("generation", -1)))

    gc.callbacks.append(on_gc)

    bg_events: list[dict[str, float | str]] = []  # refresher ticks, always-rules checks, loop stalls

    def conntrack_count() -> float:
        try:
            return float(Path("/proc/sys/net/netfilter/nf_conntrack_count").read_text())
        except (OSError, ValueError):
            return math.nan

    orig_tick = frefresh.LeaseRefresher.tick
    orig_parse_ct = frefresh.parse_conntrack

    def parse_conntrack(lines: Any) -> Any:
        t = pc()
        try:
            return orig_parse_ct(lines)
        finally:
            bg_events.append({"kind": "conntrack_parse", "t": t, "dur": pc() - t})

    class TimedPath:
        """Stands in for the refresher's conntrack path: times the read on the worker thread."""

        def __init__(self, path: Path) -> None:
            self.path = path

        def read_text(self) -> str:
            t = pc()
            try:
                return self.path.read_text()
            finally:
                bg_events.append({"kind": "conntrack_read", "t": t, "dur": pc() - t})

    async def tick(self: Any) -> None:
        if not isinstance(self.path, TimedPath):
            self.path = TimedPath(self.path)
        entries = conntrack_count()
        t = pc()
        try:
            await orig_tick(self)
        finally:
            bg_events.append({"kind": "refresh_tick", "t": t, "dur": pc() - t, "conntrack": entries})

    orig_check = AlwaysRulesReloader.check

    async def check(self: Any) -> bool:
        t = pc()
        try:
            return await orig_check(self)
        finally:
            bg_events.append({"kind": "always_rules_check", "t": t, "dur": pc() - t})

    async def stall_watch() -> None:
        """Event-loop stalls: a 5 ms sleep that overshoots by more than 2 ms."""
        import asyncio

        while True:
            t = pc()
            await asyncio.sleep(0.005)
            late = pc() - t - 0.005
            if late > 0.002:
                bg_events.append({"kind": "loop_stall", "t": t + 0.005, "dur": late})

    orig_start = dsrv.DnsProxy.start
    watchers: list[Any] = []

    async def start(self: Any, host: str, port: int) -> None:
        import asyncio

        await orig_start(self, host, port)
        watchers.append(asyncio.get_running_loop().create_task(stall_watch()))

    orig_received = dsrv._Udp.datagram_received

    def datagram_received(self: Any, data: bytes, addr: Any) -> None:
        token = arrival.set(pc())  # the reply task copies this context
        try:
            orig_received(self, data, addr)
        finally:
            arrival.reset(token)

    orig_reply = dsrv._Udp._reply

    async def _reply(self: Any, data: bytes, addr: Any) -> None:
        rec: dict[str, float] = {"arr": arrival.get()}
        cur.set(rec)  # the task's own context: visible to everything this query awaits
        await orig_reply(self, data, addr)
        rec["sent"] = pc()
        if "fwd" in rec and len(records) < limit:
            records.append(rec)

    orig_answer = dsrv.DnsProxy.answer

    async def answer(self: Any, data: bytes, client: str, *, tcp: bool) -> bytes | None:
        rec = cur.get()
        if rec is not None:
            rec["a0"] = pc()
        try:
            return await orig_answer(self, data, client, tcp=tcp)
        finally:
            if rec is not None:
                rec["a1"] = pc()

    orig_asker = ControlPlane.asker
    orig_decide = dsrv.decide

    def asker(self: Any, source_ip: Any) -> Any:
        t = pc()
        try:
            return orig_asker(self, source_ip)
        finally:
            rec = cur.get()
            if rec is not None:
                rec["dec"] = rec.get("dec", 0.0) + pc() - t

    def decide(*a: Any, **kw: Any) -> Any:
        t = pc()
        try:
            return orig_decide(*a, **kw)
        finally:
            rec = cur.get()
            if rec is not None:
                rec["dec"] = rec.get("dec", 0.0) + pc() - t

    def add(key: str, dt: float) -> None:
        rec = cur.get()
        if rec is not None:
            rec[key] = rec.get(key, 0.0) + dt

    def timed_parse(key: str) -> type[DNSRecord]:
        class Timed(DNSRecord):
            @classmethod
            def parse(cls, packet: bytes) -> DNSRecord:  # type: ignore[override]
                t = pc()
                try:
                    return DNSRecord.parse(packet)
                finally:
                    add(key, pc() - t)

        return Timed

    orig_socket = dfwd._socket

    def _socket(*a: Any, **kw: Any) -> Any:
        t = pc()
        try:
            return orig_socket(*a, **kw)
        finally:
            add("fwd_sock", pc() - t)

    orig_forward = Forwarder.forward

    async def forward(self: Any, query: Any, *, tcp: bool = False) -> Any:
        t = pc()
        try:
            return await orig_forward(self, query, tcp=tcp)
        finally:
            rec = cur.get()
            if rec is not None:
                rec["fwd0"], rec["fwd"] = t, pc() - t

    orig_learn = ControlPlane.learn

    async def learn(self: Any, uid: str, fence: Any, leases: Any) -> None:
        t = pc()
        try:
            return await orig_learn(self, uid, fence, leases)
        finally:
            rec = cur.get()
            if rec is not None:
                rec["learn0"], rec["learn"] = t, pc() - t

    async def run_batch(self: Any, batch: Any, *, op: str) -> None:
        # Same as KernelTransactions.run_batch (``await self._call(op, self._batch, batch)``),
        # with the worker-thread part timed separately.
        rec = cur.get()
        if rec is None or op != "dynamic_add":
            return await self._call(op, self._batch, batch)
        box: dict[str, float] = {}

        def timed(b: Any) -> None:
            box["s"] = pc()
            try:
                self._batch(b)
            finally:
                box["e"] = pc()

        t = pc()
        try:
            await self._call(op, timed, batch)
        finally:
            rec["nl_submit"], rec["nl_back"] = t, pc()
            if "s" in box and "e" in box:
                rec["nl_start"], rec["nl_end"] = box["s"], box["e"]

    dsrv._Udp.datagram_received = datagram_received  # type: ignore[method-assign]
    dsrv._Udp._reply = _reply  # type: ignore[method-assign]
    dsrv.DnsProxy.answer = answer  # type: ignore[method-assign]
    dsrv.decide = decide  # type: ignore[assignment]
    dsrv.DNSRecord = timed_parse("q_parse")  # type: ignore[misc]
    dfwd.DNSRecord = timed_parse("fwd_parse")  # type: ignore[misc]
    dfwd._socket = _socket
    ControlPlane.asker = asker  # type: ignore[method-assign]
    ControlPlane.learn = learn  # type: ignore[method-assign]
    Forwarder.forward = forward  # type: ignore[method-assign]
    KernelTransactions.run_batch = run_batch  # type: ignore[method-assign]
    frefresh.LeaseRefresher.tick = tick  # type: ignore[method-assign]
    frefresh.parse_conntrack = parse_conntrack
    AlwaysRulesReloader.check = check  # type: ignore[method-assign]
    dsrv.DnsProxy.start = start  # type: ignore[method-assign]
    try:
        return emain.main([])
    finally:
        Path(out_path).write_text(json.dumps({"records": records, "gc": gc_events, "bg": bg_events}))


SPLIT_PARTS = (
    ("queue", "loop: datagram_received -> answer() starts"),
    ("parse", "before forwarding, except the decision"),
    ("q_parse", "  of which: DNSRecord.parse of the query"),
    ("decide", "subject lookup + policy decision"),
    ("fwd", "upstream round trip (Forwarder.forward)"),
    ("fwd_sock", "  of which: new socket + SO_MARK (one per query)"),
    ("fwd_parse", "  of which: DNSRecord.parse of the upstream reply"),
    ("fwd_rest", "  of which: connect, send, wait, receive (network + loop)"),
    ("between", "answer addresses + leases"),
    ("learn", "learn total (ControlPlane.learn)"),
    ("learn_locks", "  of which: locks + batch build before submit"),
    ("learn_queue", "  of which: wait for the nft worker thread"),
    ("learn_netlink", "  of which: netlink batch on the worker thread (encode + kernel)"),
    ("learn_back", "  of which: worker done -> coroutine resumes"),
    ("learn_tail", "  of which: lease mirror + lock release"),
    ("post", "pack reply (+ strip OPT)"),
    ("send", "answer() returns -> sendto done"),
    ("total", "total in egressd: datagram_received -> sendto"),
)


def analyse_splits(data: dict[str, Any], window: tuple[float, float]) -> dict[str, Any]:
    """Per-query components of the queries that arrived inside ``window`` (perf_counter)."""
    recs = [
        r
        for r in data.get("records", [])
        if all(k in r for k in ("a0", "a1", "fwd0", "sent")) and window[0] <= r["arr"] <= window[1]
    ]
    parts: dict[str, list[float]] = {k: [] for k, _ in SPLIT_PARTS}
    gc_events = data.get("gc", [])
    bg = data.get("bg", [])
    gc_hits = 0
    per_query: list[dict[str, float]] = []
    overlaps: list[set[str]] = []
    for r in recs:
        ms = {
            "queue": r["a0"] - r["arr"],
            "decide": r.get("dec", 0.0),
            "fwd": r["fwd"],
            "post": r["a1"] - (r["learn0"] + r["learn"] if "learn" in r else r["fwd0"] + r["fwd"]),
            "send": r["sent"] - r["a1"],
            "total": r["sent"] - r["arr"],
        }
        ms["parse"] = r["fwd0"] - r["a0"] - ms["decide"]
        ms["q_parse"] = r.get("q_parse", 0.0)
        ms["fwd_sock"] = r.get("fwd_sock", 0.0)
        ms["fwd_parse"] = r.get("fwd_parse", 0.0)
        ms["fwd_rest"] = r["fwd"] - ms["fwd_sock"] - ms["fwd_parse"]
        if "learn" in r:
            ms["between"] = r["learn0"] - (r["fwd0"] + r["fwd"])
            ms["learn"] = r["learn"]
            if "nl_start" in r:
                ms["learn_locks"] = r["nl_submit"] - r["learn0"]
                ms["learn_queue"] = r["nl_start"] - r["nl_submit"]
                ms["learn_netlink"] = r["nl_end"] - r["nl_start"]
                ms["learn_back"] = r["nl_back"] - r["nl_end"]
                ms["learn_tail"] = r["learn0"] + r["learn"] - r["nl_back"]
        for k, v in ms.items():
            parts[k].append(v * 1000.0)
        per_query.append(ms)
        hit = {str(e["kind"]) for e in bg if e["t"] < r["sent"] and e["t"] + e["dur"] > r["arr"]}
        if any(t < r["sent"] and t + d > r["arr"] for t, d, _g in gc_events):
            gc_hits += 1
            hit.add("gc")
        overlaps.append(hit)
    # The slowest 1% by total time: which component made them slow.
    cut = pct([q["total"] for q in per_query], 99) if per_query else math.inf
    tail_idx = [i for i, q in enumerate(per_query) if q["total"] >= cut]
    tail = [per_query[i] for i in tail_idx]
    tail_mean = {k: 1000.0 * sum(q.get(k, 0.0) for q in tail) / len(tail) for k in parts} if tail else {}
    tail_overlaps: dict[str, int] = {}
    for i in tail_idx:
        for kind in overlaps[i] or {"nothing recorded"}:
            tail_overlaps[kind] = tail_overlaps.get(kind, 0) + 1
    all_overlaps: dict[str, int] = {}
    for hit in overlaps:
        for kind in hit:
            all_overlaps[kind] = all_overlaps.get(kind, 0) + 1
    if recs:  # events during the measured queries only (not start-up or registration)
        lo, hi = min(r["arr"] for r in recs), max(r["sent"] for r in recs)
        gc_events = [e for e in gc_events if lo <= e[0] <= hi]
        bg = [e for e in bg if lo <= e["t"] <= hi]
    events: dict[str, dict[str, float]] = {}
    for e in bg:
        k = str(e["kind"])
        ev = events.setdefault(k, {"count": 0, "max_ms": 0.0, "sum_ms": 0.0})
        ev["count"] += 1
        ev["max_ms"] = max(ev["max_ms"], 1000.0 * e["dur"])
        ev["sum_ms"] += 1000.0 * e["dur"]
        if "conntrack" in e:
            ev["conntrack_max"] = max(ev.get("conntrack_max", 0.0), float(e["conntrack"]))
    gen2 = [d * 1000.0 for _t, d, g in gc_events if g == 2]
    gc_max = {
        str(g): max(1000.0 * d for _t, d, gg in gc_events if gg == g) for g in {e[2] for e in gc_events}
    }
    return {
        "gc_max_ms_by_generation": gc_max,
        "queries": len(recs),
        "parts": {
            k: {**summary(v), "tail_mean_ms": tail_mean.get(k, math.nan)} for k, v in parts.items() if v
        },
        "tail_queries": len(tail),
        "tail_overlaps": tail_overlaps,
        "overlaps": all_overlaps,
        "events": events,
        "gc_collections": len(gc_events),
        "gc_gen2": len(gen2),
        "gc_gen2_max_ms": max(gen2) if gen2 else 0.0,
        "queries_overlapping_gc": gc_hits,
    }


# ---------------------------------------------------------------------------------------------
# inner side: the pod namespace


def assert_in_netns(ns: str, outer_ino: int) -> None:
    """Refuse to touch nft unless this process sits in the namespace the outer side created."""
    mine = os.stat("/proc/self/ns/net").st_ino
    expected = os.stat(f"/run/netns/{ns}").st_ino
    if mine == outer_ino or mine != expected:
        raise BenchError(f"safety: not inside netns {ns} (self={mine} outer={outer_ino} expected={expected})")


class Http:
    """One keep-alive HTTP/1.1 connection to egressd on 127.0.0.1 (pod namespace)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            self.conn.request(method, path, body=body, headers=headers)
            resp = self.conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise

    def action(self, body: bytes, what: str) -> None:
        status, data = self.request("POST", ACTIONS, body)
        if status != 200:
            raise BenchError(f"{what}: HTTP {status}: {data.decode(errors='replace').strip()[:300]}")

    def close(self) -> None:
        self.conn.close()


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([0-9.eE+-]+|NaN|[+-]Inf)$")


def scrape(http_: Http) -> dict[str, float]:
    status, data = http_.request("GET", "/metrics")
    if status != 200:
        raise BenchError(f"/metrics: HTTP {status}")
    out: dict[str, float] = {}
    for line in data.decode().splitlines():
        m = _METRIC_LINE.match(line)
        if m and "_bucket" not in m.group(1):
            out[m.group(1)] = float(m.group(2))
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def proc_cpu_s(pid: int | None) -> float:
    if not pid:
        return math.nan
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float, float]:
    """(busy, steal, total) jiffies over all CPUs from /proc/stat (busy includes steal)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return (math.nan, math.nan, math.nan)
    v = [float(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(v)
    return (total - v[3] - v[4], v[7], total)


class LineReader:
    """Read whole lines from a child's stdout with a deadline (no unbounded blocking)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.fd = proc.stdout.fileno()
        self.buf = b""

    def readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"no output from pid {self.proc.pid} within {timeout:.0f}s")
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    raise BenchError(f"pid {self.proc.pid} closed its output (exit {self.proc.poll()})")
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()


def stop_proc(proc: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
    """TERM, wait, KILL: only this process, by its PID."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class Client:
    """The DNS client process in the sandbox namespace."""

    def __init__(self, ns: str, zone_names: int) -> None:
        targets = f"proxy={GATEWAY}:53,direct={UPSTREAM_IP}:53"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve()), "--client",
             "--targets", targets, "--zone-names", str(zone_names)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        self.reader = LineReader(self.proc)
        hello = json.loads(self.reader.readline(30))
        self.pid = int(hello["pid"])

    def call(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        res: dict[str, Any] = json.loads(self.reader.readline(timeout))
        if "error" in res:
            raise BenchError(f"client {cmd.get('op')}: {res['error']}")
        return res

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b'{"op":"quit"}\n')
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                stop_proc(self.proc)


class Daemon:
    def __init__(self, workdir: Path, env_extra: dict[str, str]) -> None:
        self.workdir = workdir
        self.rules_dir = workdir / "always-rules"
        self.rules_dir.mkdir(exist_ok=True)
        self.env_extra = env_extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "egressd.log"

    def start(self, instrumented_out: Path | None = None) -> float:
        env = dict(os.environ)
        env.update(
            {
                "OPENSANDBOX_EGRESS_PROFILE": "fleet",
                "EGRESSD_NFT_TABLE": TABLE,
                "OPENSANDBOX_EGRESS_HTTP_ADDR": f"127.0.0.1:{HTTP_PORT}",
                "EGRESSD_ALWAYS_RULES_DIR": str(self.rules_dir),
                "EGRESSD_DNS_ADDR": f"0.0.0.0:{DNS_PORT}",
                "OPENSANDBOX_EGRESS_DNS_UPSTREAM": f"{UPSTREAM_IP}:53",
                "EGRESSD_LOG_FORMAT": "json",
                **self.env_extra,
            }
        )
        if instrumented_out is None:
            cmd = [str(EGRESSD)]
        else:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--egressd-instrumented",
                str(instrumented_out),
            ]
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"egressd exited with {self.proc.returncode}:\n{self.log_tail()}")
            h = Http(HTTP_PORT)
            try:
                if h.request("GET", "/healthz")[0] == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass
            finally:
                h.close()
            time.sleep(0.05)
        raise BenchError(f"egressd not ready after 60s:\n{self.log_tail()}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        stop_proc(self.proc, 15)
        self.proc = None


def nft_delete_table() -> None:
    _run(["nft", "delete", "table", "inet", TABLE], timeout=60)


def register(http_: Http, n_subjects: int, measured_first: bool) -> dict[str, Any]:
    """SET_BINDING + data-plane-ready for every subject: n-1 background ones and the measured one."""
    order: list[tuple[str, str, str]] = [
        (f"dnsbg-{k}", background_ip(k), background_policy(k)) for k in range(n_subjects - 1)
    ]
    measured = (MEASURED_UID, SANDBOX_IP, measured_policy())
    order = [measured, *order] if measured_first else [*order, measured]
    t0 = time.perf_counter()
    for n, (uid, ip, pol) in enumerate(order, 1):
        http_.action(set_binding_body(uid, ip, pol), f"SET_BINDING {uid}")
        http_.action(hook_body(uid), f"data-plane-ready {uid}")
        if n % 250 == 0:
            log(f"  registered {n}/{len(order)} subjects")
    return {"subjects": len(order), "wall_s": time.perf_counter() - t0, "measured_first": measured_first}


def measured_dyn_set() -> str:
    from egressd.subject.model import nft_id, subject_for_uid

    return f"subj_{nft_id(subject_for_uid(MEASURED_UID))}_dyn_v4"


class Runner:
    """Drives the client and keeps per-side aggregates (latencies, egressd metrics, CPU)."""

    def __init__(self, client: Client, prm: dict[str, Any], pids: dict[str, int | None]) -> None:
        self.client = client
        self.prm = prm
        self.pids = pids
        self.next_new = 0  # proxy side: zone index of the next never-asked name
        self.next_direct = prm["zone_names"] // 2
        self.ticks: list[tuple[float, float]] = []  # when egressd's lease refresher may tick

    def expect_ticks(self, spawned: float, ready: float, interval: float, horizon: float = 3600) -> None:
        """The refresher sleeps ``interval`` from just before egressd becomes ready, then ticks."""
        self.ticks = [
            (spawned + k * interval, ready + k * interval + 0.3)
            for k in range(1, int(horizon / interval) + 1)
        ]

    def names(self, side: str, count: int) -> dict[str, Any]:
        if side.endswith("repeat"):
            return {"kind": "repeat"}
        if side.startswith("proxy"):
            spec = {"kind": "new", "start": self.next_new}
            self.next_new += count
        else:
            spec = {"kind": "new", "start": self.next_direct}
            self.next_direct += count
        return spec

    def _cpu(self) -> dict[str, float]:
        return {k: proc_cpu_s(p) for k, p in {**self.pids, "client_proc": self.client.pid}.items()}

    def run(self, http_: Http | None, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        m0 = scrape(http_) if http_ else {}
        c0 = self._cpu()
        mc0 = machine_cpu()
        w0 = time.perf_counter()
        res = self.client.call(cmd, timeout)
        wall = time.perf_counter() - w0
        res["window"] = (w0, w0 + wall)
        res["refresh_tick"] = any(lo < w0 + wall and hi > w0 for lo, hi in self.ticks)
        c1 = self._cpu()
        mc1 = machine_cpu()
        span = mc1[2] - mc0[2]
        res["machine_busy_pct"] = 100.0 * (mc1[0] - mc0[0]) / span if span > 0 else math.nan
        res["machine_steal_pct"] = 100.0 * (mc1[1] - mc0[1]) / span if span > 0 else math.nan
        # Everything else on the machine, in % of one CPU: busy time minus our three processes
        # (kernel networking in softirq context may land on either side).
        ours = sum(c1[k] - c0[k] for k in c0 if math.isfinite(c1[k] - c0[k]))
        ncpu = os.cpu_count() or 1
        res["others_cpu_pct"] = res["machine_busy_pct"] * ncpu - 100.0 * ours / wall
        res["proc_cpu_s"] = {k: c1[k] - c0[k] for k in c0 if k != "client_proc"}
        res["proc_cpu_s"]["client"] = res["cpu_s"]
        res["wall_s"] = wall
        res["metrics"] = metrics_delta(m0, scrape(http_)) if http_ else {}
        return res

    def paced(self, http_: Http | None, side: str, duration: float) -> dict[str, Any]:
        rate = self.prm["rate"]
        n = round(rate * duration)
        cmd = {
            "op": "paced",
            "target": "proxy" if side.startswith("proxy") else "direct",
            "names": self.names(side, n),
            "rate": rate,
            "duration": duration,
            "sockets": self.prm["sockets"],
            "drain": 2.0,
        }
        return self.run(http_, cmd, timeout=duration + 60)

    def closed(self, http_: Http | None, side: str, duration: float) -> dict[str, Any]:
        max_q = min(self.prm["closed_max_per_slice"], int(duration * 20000) + 100)
        cmd = {
            "op": "closed",
            "target": "proxy" if side.startswith("proxy") else "direct",
            "names": self.names(side, 0),  # advanced below by the queries actually issued
            "concurrency": self.prm["concurrency"],
            "duration": duration,
            "max_queries": max_q,
            "timeout": 1.0,
        }
        res = self.run(http_, cmd, timeout=duration + 60)
        if side.startswith("proxy"):
            self.next_new += res["issued"]
        else:
            self.next_direct += res["issued"]
        return res


def _sum_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _merge_bad(ds: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def aggregate_paced(slices: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [math.inf if x is None else x for s in slices for x in s["lat_ms"]]
    cpu = _sum_dicts([s["proc_cpu_s"] for s in slices])
    wall = sum(s["send_s"] for s in slices)
    met = _sum_dicts([s["metrics"] for s in slices])
    calm = [s for s in slices if not s.get("refresh_tick")]
    calm_lat = [math.inf if x is None else x for s in calm for x in s["lat_ms"]]
    return {
        "slices": len(slices),
        "slices_with_refresh_tick": len(slices) - len(calm),
        "latency_without_tick_slices": summary(calm_lat) if calm and len(calm) < len(slices) else None,
        "sent": sum(s["sent"] for s in slices),
        "answered": sum(s["answered"] for s in slices),
        "lost": sum(s["sent"] - s["answered"] for s in slices),
        "bad": _merge_bad([s["bad"] for s in slices]),
        "errors": sum(s["errors"] for s in slices),
        "kernel_ts_fallback": sum(s["kernel_ts_fallback"] for s in slices),
        "achieved_rate": sum(s["sent"] for s in slices) / wall if wall else math.nan,
        "latency": summary(lat),
        "send_lag_p99_ms": max(s["lag_p99_ms"] for s in slices),
        "per_slice": [
            {
                "p50_ms": pct([math.inf if x is None else x for x in s["lat_ms"]], 50),
                "p99_ms": pct([math.inf if x is None else x for x in s["lat_ms"]], 99),
                "lost": s["sent"] - s["answered"],
                "refresh_tick": bool(s.get("refresh_tick")),
                "machine_busy_pct": s.get("machine_busy_pct", math.nan),
                "machine_steal_pct": s.get("machine_steal_pct", math.nan),
                "others_cpu_pct": s.get("others_cpu_pct", math.nan),
            }
            for s in slices
        ],
        "machine_busy_pct": sum(s.get("machine_busy_pct", math.nan) for s in slices) / len(slices),
        "machine_steal_pct": sum(s.get("machine_steal_pct", math.nan) for s in slices) / len(slices),
        "others_cpu_pct": sum(s.get("others_cpu_pct", math.nan) for s in slices) / len(slices),
        "send_lag_max_ms": max(s["lag_max_ms"] for s in slices),
        "cpu_pct": {k: 100.0 * v / wall for k, v in cpu.items()} if wall else {},
        "egressd": _egressd_metrics(met),
    }


def aggregate_closed(slices: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for s in slices for x in s["lat_ms"]]
    window = sum(s["window_s"] for s in slices)
    done = sum(s["answered_in_window"] for s in slices)
    cpu = _sum_dicts([s["proc_cpu_s"] for s in slices])
    return {
        "slices": len(slices),
        "concurrency": slices[0]["concurrency"],
        "answered": sum(s["answered"] for s in slices),
        "timeouts": sum(s["timeouts"] for s in slices),
        "bad": _merge_bad([s["bad"] for s in slices]),
        "window_s": window,
        "qps": done / window if window else math.nan,
        "qps_per_slice": [s["qps"] for s in slices],
        "machine_busy_pct": sum(s.get("machine_busy_pct", math.nan) for s in slices) / len(slices),
        "machine_steal_pct": sum(s.get("machine_steal_pct", math.nan) for s in slices) / len(slices),
        "others_cpu_pct": sum(s.get("others_cpu_pct", math.nan) for s in slices) / len(slices),
        "latency": summary(lat),
        "cpu_pct": {k: 100.0 * v / window for k, v in cpu.items()} if window else {},
        "egressd": _egressd_metrics(_sum_dicts([s["metrics"] for s in slices])),
    }


def _egressd_metrics(d: dict[str, float]) -> dict[str, Any]:
    n = d.get("egress_dns_query_duration_seconds_count", 0.0)
    s = d.get("egress_dns_query_duration_seconds_sum", 0.0)
    key = 'egressd_nft_transaction_duration_seconds_{}{{operation="dynamic_add"}}'
    dn, ds = d.get(key.format("count"), 0.0), d.get(key.format("sum"), 0.0)
    failed = {k: v for k, v in d.items() if k.startswith("egress_dns_query_failed_total")}
    return {
        "queries": int(n),
        "query_mean_ms": 1000.0 * s / n if n else math.nan,
        "dynamic_add": int(dn),
        "dynamic_add_mean_ms": 1000.0 * ds / dn if dn else math.nan,
        "denied": int(d.get("egress_policy_denied_total", 0.0)),
        "nft_failed": int(d.get('egress_nftables_updates_failed_total{operation="dynamic_add"}', 0.0)),
        "failed": failed,
    }


def sanity(runner: Runner, client: Client) -> dict[str, Any]:
    """The proxy path really is the proxy: allowed name resolves and is learned, denied is NXDOMAIN."""
    k = runner.next_new
    runner.next_new += 1
    got = client.call({"op": "query", "target": "proxy", "name": v_name(k)}, 15)
    if got != {"rcode": "NOERROR", "answers": [v_addr(k)]}:
        raise BenchError(f"proxy query {v_name(k)}: {got}")
    listing = _run(["nft", "list", "set", "inet", TABLE, measured_dyn_set()]).stdout
    if v_addr(k) not in listing:
        raise BenchError(f"{v_addr(k)} not learned into {measured_dyn_set()}: {listing[:300]}")
    got = client.call({"op": "query", "target": "proxy", "name": DENIED_NAME}, 15)
    if got["rcode"] != "NXDOMAIN":
        raise BenchError(f"proxy query for the denied name: {got}")
    got = client.call({"op": "query", "target": "direct", "name": DENIED_NAME}, 15)
    if got["rcode"] != "NOERROR":
        raise BenchError(f"direct query for {DENIED_NAME}: {got} (forward path blocked?)")
    return {"learned": v_addr(k), "denied_via_proxy": "NXDOMAIN", "denied_direct": "NOERROR"}


PACED_SIDES = ("direct", "proxy_new", "proxy_repeat")
CLOSED_SIDES = ("direct", "proxy_new")


def run_main_phases(
    ns: dict[str, str], workdir: Path, prm: dict[str, Any], env_extra: dict[str, str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    upstream: subprocess.Popen[bytes] | None = None
    client: Client | None = None
    daemon = Daemon(workdir, env_extra)
    http_: Http | None = None
    try:
        zone = workdir / "zone.json"
        zone.write_text(json.dumps({"records": zone_records(prm["zone_names"])}))
        upstream = subprocess.Popen(
            ["ip", "netns", "exec", ns["up"], sys.executable, str(UPSTREAM_SCRIPT), "--http-ports", "",
             "--zone", str(zone), "--dns-port", "53"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
        )  # fmt: skip
        if "ready" not in LineReader(upstream).readline(60):
            raise BenchError("upstream DNS server did not start")
        log(f"upstream DNS ready in {ns['up']} (pid {upstream.pid}, {prm['zone_names']} new-name records)")
        client = Client(ns["sb"], prm["zone_names"])
        t_spawn = time.perf_counter()
        out["daemon_start_s"] = daemon.start()
        t_ready = time.perf_counter()
        log(f"egressd ready after {out['daemon_start_s']:.2f}s (pid {daemon.pid})")
        http_ = Http(HTTP_PORT)
        log(f"registering {prm['subjects']} active subjects through the daemon")
        out["registration"] = register(http_, prm["subjects"], prm["measured_first"])
        log(f"  registered in {out['registration']['wall_s']:.1f}s")
        pids = {"egressd": daemon.pid, "upstream": upstream.pid}
        runner = Runner(client, prm, pids)
        runner.expect_ticks(t_spawn, t_ready, 30.0)  # EGRESSD_REFRESH_INTERVAL default
        out["sanity"] = sanity(runner, client)

        # ---- (1) paced open loop, sides interleaved in slices --------------------------------
        log(f"warm-up {prm['warmup_s']}s per side")
        for side in PACED_SIDES:
            runner.paced(http_, side, prm["warmup_s"])
        n_slices = max(1, round(prm["paced_s"] / prm["slice_s"]))
        slice_s = prm["paced_s"] / n_slices
        per_side: dict[str, list[dict[str, Any]]] = {s: [] for s in PACED_SIDES}
        log(f"paced {prm['rate']:.0f} q/s: {n_slices} x {slice_s:.1f}s slices per side, sides rotating")
        for r in range(n_slices):
            order = PACED_SIDES[r % 3 :] + PACED_SIDES[: r % 3]
            if r % 2:
                order = tuple(reversed(order))
            for side in order:
                res = runner.paced(http_, side, slice_s)
                per_side[side].append(res)
                lat = [math.inf if x is None else x for x in res["lat_ms"]]
                log(
                    f"  slice {r + 1}/{n_slices} {side:<12} p50 {pct(lat, 50):.3f} ms p99 {pct(lat, 99):.3f} ms"
                    f" answered {res['answered']}/{res['sent']}"
                )
            if not daemon.alive():
                raise BenchError(f"egressd died:\n{daemon.log_tail()}")
        out["paced"] = {side: aggregate_paced(v) for side, v in per_side.items()}
        out["conntrack_after_paced"] = conntrack_count()

        # ---- (2) closed loop: max sustained q/s ----------------------------------------------
        log(f"closed loop, {prm['concurrency']} outstanding: warm-up")
        for side in CLOSED_SIDES:
            runner.closed(http_, side, 0.3)
        closed: dict[str, list[dict[str, Any]]] = {s: [] for s in CLOSED_SIDES}
        half = prm["closed_s"] / 2
        for side in (*CLOSED_SIDES, *reversed(CLOSED_SIDES)):  # ABBA
            res = runner.closed(http_, side, half)
            closed[side].append(res)
            log(f"  {side:<10} {res['qps']:.0f} q/s, timeouts {res['timeouts']}")
        out["closed"] = {side: aggregate_closed(v) for side, v in closed.items()}
        out["conntrack_after_closed"] = conntrack_count()
        out["proxy_new_names_used"] = runner.next_new
        if not daemon.alive():
            raise BenchError(f"egressd died:\n{daemon.log_tail()}")
        out["egressd_rss_kb"] = _rss_kb(daemon.pid)

        # ---- (3) optional: instrumented egressd, where the time goes --------------------------
        if prm["splits"] == "always" or (prm["splits"] == "auto" and _misses(out["paced"])):
            http_.close()
            http_ = None
            daemon.stop()
            nft_delete_table()
            splits_file = workdir / "splits.json"
            log("splits: restarting egressd instrumented; registering the subjects again")
            daemon.env_extra = {**env_extra, "EGRESSD_REFRESH_INTERVAL": str(prm["splits_refresh_s"])}
            daemon.start(instrumented_out=splits_file)
            http_ = Http(HTTP_PORT)
            register(http_, prm["subjects"], prm["measured_first"])
            runner2 = Runner(client, prm, {"egressd": daemon.pid, "upstream": upstream.pid})
            runner2.next_new = prm["zone_names"] // 4  # fresh table: any name is new to it
            sanity(runner2, client)
            for side in ("direct", "proxy_new"):
                runner2.paced(http_, side, prm["warmup_s"])
            # CLOCK_MONOTONIC (perf_counter) is shared by every process: it delimits the window.
            window = (time.perf_counter(), 0.0)
            proxied = runner2.paced(http_, "proxy_new", prm["splits_s"])
            window = (window[0], time.perf_counter())
            sp = {
                "proxy_new": aggregate_paced([proxied]),
                "direct": aggregate_paced([runner2.paced(http_, "direct", prm["splits_s"])]),
            }
            http_.close()
            http_ = None
            daemon.stop()  # SIGTERM: the instrumented main writes its records on the way out
            data = json.loads(splits_file.read_text()) if splits_file.exists() else {}
            out["splits"] = {"client": sp, "server": analyse_splits(data, window)}
            log(f"splits: {out['splits']['server']['queries']} forwarded queries recorded")
    except (BenchError, OSError, http.client.HTTPException) as exc:
        raise BenchError(f"{exc}\n--- egressd log tail ---\n{daemon.log_tail()}") from None
    finally:
        if http_ is not None:
            http_.close()
        if client is not None:
            client.close()
        daemon.stop()
        stop_proc(upstream)
        nft_delete_table()
    return out


def conntrack_count() -> int:
    """Conntrack entries in this (the pod) namespace."""
    try:
        return int(Path("/proc/sys/net/netfilter/nf_conntrack_count").read_text())
    except (OSError, ValueError):
        return -1


def _rss_kb(pid: int | None) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _misses(paced: dict[str, Any]) -> bool:
    d = paced["direct"]["latency"]
    for side in ("proxy_new", "proxy_repeat"):
        p = paced[side]["latency"]
        if not (p["p50_ms"] - d["p50_ms"] <= T_P50_ADDED_MS and p["p99_ms"] - d["p99_ms"] <= T_P99_ADDED_MS):
            return True
    return False


def inner_main(args: argparse.Namespace) -> int:
    install_signal_handlers()
    workdir = Path(args.workdir)
    prm = json.loads(args.params)
    ns = {role: f"{args.ns_base}-{role}" for role in ROLES}
    results: dict[str, Any] = {}
    rc = 0
    try:
        assert_in_netns(ns["pod"], args.outer_netns)
        env_extra = {} if args.bridge_nf else {"EGRESSD_ALLOW_BRIDGE_BYPASS": "1"}
        results = run_main_phases(ns, workdir, prm, env_extra)
    except BenchError as exc:
        print(f"bench-dns: FAILED: {exc}", file=sys.stderr, flush=True)
        results["error"] = str(exc)
        rc = 1
    except Interrupted as exc:
        print(f"bench-dns: interrupted ({exc})", file=sys.stderr, flush=True)
        rc = 130
    finally:
        nft_delete_table()
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    return rc


# ---------------------------------------------------------------------------------------------
# outer side (root netns): `ip netns add/exec/pids/del` only; links are created from inside


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_pids(ns: str) -> list[int]:
    p = _run(["ip", "netns", "pids", ns])
    return [int(x) for x in p.stdout.split() if x.strip().isdigit()]


def kill_netns_pids(ns: str) -> None:
    """Everything left in our namespace was started by this run: TERM, wait, KILL, by PID."""
    pids = netns_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(p)]
        time.sleep(0.1)
    for pid in netns_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def cleanup_stale_namespaces() -> None:
    """Namespaces of an earlier run killed before it could clean up (owner PID dead, no processes)."""
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return
    for name in names:
        m = re.fullmatch(rf"{re.escape(NS_PREFIX)}(\d+)-(pod|up|sb)", name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        if netns_pids(name):
            log(f"stale namespace {name} still has processes; leaving it alone")
            continue
        log(f"removing stale namespace {name} (owner {m.group(1)} is gone)")
        _run(["ip", "netns", "del", name])


def _root_links() -> set[str]:
    out = _run(["ip", "-o", "link", "show"]).stdout
    return {ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines() if ":" in ln}


@contextlib.contextmanager
def bench_topology() -> Iterator[tuple[str, bool]]:
    """Create pod/up/sb; yields (name base, bridge-nf-call-iptables set). Always torn down."""
    base = f"{NS_PREFIX}{os.getpid()}"
    ns = {role: f"{base}-{role}" for role in ROLES}
    created: list[str] = []
    root_before = _root_links()

    def x(role: str, *cmd: str) -> str:
        p = _run(["ip", "netns", "exec", ns[role], *cmd])
        if p.returncode != 0:
            raise BenchError(f"[{role}] {' '.join(cmd)}: {p.stderr.strip()}")
        return p.stdout

    try:
        for role in ROLES:
            p = _run(["ip", "netns", "add", ns[role]])
            if p.returncode != 0:
                raise BenchError(f"ip netns add {ns[role]}: {p.stderr.strip()}")
            created.append(ns[role])
            x(role, "ip", "link", "set", "lo", "up")
        # Every link is created by an `ip` running inside the pod namespace, peers straight into sb/up.
        x("pod", "sysctl", "-qw", "net.ipv4.ip_forward=1")
        x("pod", "ip", "link", "add", "br0", "type", "bridge")
        x("pod", "ip", "addr", "add", f"{GATEWAY}/16", "dev", "br0")
        x("pod", "ip", "link", "set", "br0", "up")
        bridge_nf = (
            _run(
                ["ip", "netns", "exec", ns["pod"], "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"]
            ).returncode
            == 0
        )
        x("pod", "ip", "link", "add", "vsb", "type", "veth", "peer", "name", "eth0", "netns", ns["sb"])
        x("pod", "ip", "link", "set", "vsb", "master", "br0")
        x("pod", "ip", "link", "set", "vsb", "up")
        x("pod", "ip", "link", "add", "uplink", "type", "veth", "peer", "name", "eth0", "netns", ns["up"])
        x("pod", "ip", "addr", "add", f"{POD_UPLINK_IP}/24", "dev", "uplink")
        x("pod", "ip", "link", "set", "uplink", "up")
        x("sb", "ip", "addr", "add", f"{SANDBOX_IP}/16", "dev", "eth0")
        x("sb", "ip", "link", "set", "eth0", "up")
        x("sb", "ip", "route", "add", "10.204.0.0/24", "via", GATEWAY)  # the upstream only, no default
        x("up", "ip", "addr", "add", f"{UPSTREAM_IP}/24", "dev", "eth0")
        x("up", "ip", "link", "set", "eth0", "up")
        x("up", "ip", "route", "add", "10.203.0.0/16", "via", POD_UPLINK_IP)  # back to the sandboxes only
        for role in ROLES:
            if (
                x(role, "ip", "route", "show", "default").strip()
                or x(role, "ip", "-6", "route", "show", "default").strip()
            ):
                raise BenchError(f"safety: {ns[role]} has a default route")
        leaked = (_root_links() - root_before) & {*OUR_LINKS, "eth0"}
        if leaked:
            raise BenchError(f"safety: root namespace gained links {sorted(leaked)}")
        yield base, bridge_nf
    finally:
        ignore_signals()
        for name in reversed(created):
            kill_netns_pids(name)
            p = _run(["ip", "netns", "del", name])
            if p.returncode != 0:
                log(f"WARNING: ip netns del {name} failed: {p.stderr.strip()}")


def stop_inner(inner: subprocess.Popen[bytes]) -> None:
    """Let the inner side stop its processes and drop the table; KILL it if it hangs."""
    if inner.poll() is not None:
        return
    ignore_signals()
    inner.send_signal(signal.SIGTERM)
    try:
        inner.wait(40)
    except subprocess.TimeoutExpired:
        inner.kill()
        inner.wait(10)


def outer_main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench-dns: must run as root (network namespaces, nftables)", file=sys.stderr)
        return 2
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            print(f"bench-dns: {tool} not found", file=sys.stderr)
            return 2
    if not EGRESSD.exists():
        print(f"bench-dns: {EGRESSD} missing (run scripts/install.sh)", file=sys.stderr)
        return 2
    prm = dict(PARAMS_QUICK if args.quick else PARAMS_FULL)
    for key in ("subjects", "rate", "concurrency", "sockets"):
        if getattr(args, key):
            prm[key] = getattr(args, key)
    if args.duration:
        prm["paced_s"] = args.duration
    if args.closed_duration:
        prm["closed_s"] = args.closed_duration
    prm["splits"] = args.splits
    prm["measured_first"] = bool(args.measured_first)
    if prm["subjects"] < 1:
        raise SystemExit("bench-dns: --subjects must be >= 1")
    if prm["concurrency"] > PER_CLIENT_CAP:
        log(f"note: egressd drops queries beyond {PER_CLIENT_CAP} in flight per source IP")
    prm["loadavg_start"] = list(os.getloadavg())

    install_signal_handlers()
    workdir = Path(tempfile.mkdtemp(prefix="egbdns-"))
    inner: subprocess.Popen[bytes] | None = None
    rc = 1
    started = time.time()
    try:
        cleanup_stale_namespaces()
        with bench_topology() as (base, bridge_nf):
            log(f"namespaces {base}-{{pod,up,sb}}, workdir {workdir}, params {prm}")
            cmd = [
                "ip", "netns", "exec", f"{base}-pod", sys.executable, str(Path(__file__).resolve()),
                "--inner", "--ns-base", base, "--workdir", str(workdir),
                "--outer-netns", str(os.stat("/proc/self/ns/net").st_ino), "--params", json.dumps(prm),
            ]  # fmt: skip
            if bridge_nf:
                cmd.append("--bridge-nf")
            inner = subprocess.Popen(cmd, cwd=ROOT)
            try:
                rc = inner.wait()
            finally:
                stop_inner(inner)
            res_path = workdir / "results.json"
            results = json.loads(res_path.read_text()) if res_path.exists() else {}
            if rc == 0:
                report = build_report(results, prm, quick=args.quick, started=started)
                print(render_report(report))
                if args.json_out:
                    Path(args.json_out).write_text(json.dumps(json_safe(report), indent=2) + "\n")
                    log(f"JSON written to {args.json_out}")
            else:
                print(f"bench-dns: inner run failed (rc={rc})", file=sys.stderr)
    except Interrupted as exc:
        log(f"interrupted ({exc}); cleaning up")
        rc = 130
    except BenchError as exc:
        print(f"bench-dns: {exc}", file=sys.stderr)
        rc = 1
    finally:
        ignore_signals()
        if inner is not None:
            stop_inner(inner)
        shutil.rmtree(workdir, ignore_errors=True)
    log(f"total {time.time() - started:.1f}s")
    return rc


# ---------------------------------------------------------------------------------------------
# report


def build_report(
    results: dict[str, Any], prm: dict[str, Any], *, quick: bool, started: float
) -> dict[str, Any]:
    paced = results["paced"]
    closed = results["closed"]
    d = paced["direct"]["latency"]
    targets = []
    for side, label in (("proxy_new", "new names"), ("proxy_repeat", "repeated names")):
        p = paced[side]["latency"]
        for q, limit in (("p50", T_P50_ADDED_MS), ("p99", T_P99_ADDED_MS)):
            added = p[f"{q}_ms"] - d[f"{q}_ms"]
            targets.append(
                {
                    "name": f"added {q} latency at {prm['rate']:.0f} q/s, {label}",
                    "value": added,
                    "unit": "ms",
                    "target": f"<= +{limit} ms",
                    "met": added <= limit,
                    "note": f"proxy {p[f'{q}_ms']:.3f} ms vs direct {d[f'{q}_ms']:.3f} ms"
                    f" ({p[f'{q}_ms'] / d[f'{q}_ms']:.1f}x)",
                }
            )
    ratios = {
        side: {
            "p50": paced[side]["latency"]["p50_ms"] / d["p50_ms"],
            "p99": paced[side]["latency"]["p99_ms"] / d["p99_ms"],
        }
        for side in ("proxy_new", "proxy_repeat")
    }
    ratios["qps"] = closed["proxy_new"]["qps"] / closed["direct"]["qps"]
    return {
        "meta": {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": time.time() - started,
            "quick": quick,
            "params": prm,
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "percentiles": "nearest rank over all sent queries; unanswered = +inf",
            "git": _git_state(),
            "loadavg_start": prm.get("loadavg_start"),
            "loadavg_end": list(os.getloadavg()),
        },
        "registration": results.get("registration"),
        "daemon_start_s": results.get("daemon_start_s"),
        "sanity": results.get("sanity"),
        "paced": paced,
        "closed": closed,
        "ratios": ratios,
        "splits": results.get("splits"),
        "proxy_new_names_used": results.get("proxy_new_names_used"),
        "egressd_rss_kb": results.get("egressd_rss_kb"),
        "conntrack_after_paced": results.get("conntrack_after_paced"),
        "conntrack_after_closed": results.get("conntrack_after_closed"),
        "targets": targets,
    }


def json_safe(x: Any) -> Any:
    """Strict JSON for --json-out: non-finite numbers (+inf = unanswered queries) become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def _git_state() -> str:
    """Commit plus the number of changed files under egressd/ (the tree may be shared and edited)."""
    head = _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).stdout.strip() or "?"
    dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "egressd"]).stdout.splitlines()
    return f"{head}" + (f" + {len(dirty)} changed/untracked paths under egressd/" if dirty else "")


def _cpu_text(c: dict[str, float]) -> str:
    return " / ".join(f"{c.get(k, math.nan):.0f}%" for k in ("egressd", "upstream", "client"))


def render_report(rep: dict[str, Any]) -> str:
    m = rep["meta"]
    prm = m["params"]
    reg = rep["registration"]
    lines = [
        "",
        f"egressd DNS proxy benchmark  ({m['started']}, {m['cpus']} CPUs, kernel {m['kernel']}, "
        f"Python {m['python']}{', QUICK' if m['quick'] else ''})",
        f"{reg['subjects']} active subjects registered through the daemon in {reg['wall_s']:.1f}s; measured sandbox"
        f" {SANDBOX_IP} registered {'first' if reg['measured_first'] else 'last'}; its policy has 9 domain rules"
        " + 1 IP rule, the benchmark's names match the 8th/9th",
        "load average (1/5/15 min) at start "
        + "/".join(f"{x:.2f}" for x in m["loadavg_start"] or [])
        + ", at end "
        + "/".join(f"{x:.2f}" for x in m["loadavg_end"])
        + " (other work on this machine skews the figures)",
        f"egressd from git {m['git']}",
        f"latency = client send() -> kernel receive timestamp of the reply; percentiles: {m['percentiles']}",
        "",
        f"(1) paced {prm['rate']:.0f} q/s open loop, {prm['sockets']} sockets, {prm['paced_s']:.0f}s per side in"
        f" {prm['slice_s']:.1f}s slices, sides interleaved; ms",
        f"{'side':<22} {'sent':>6} {'lost':>5} {'bad':>4} {'p50':>7} {'p90':>7} {'p99':>7} {'p99.9':>7}"
        f" {'max':>7} | {'+p50':>6} {'+p99':>7} | lag p99 | CPU egressd/upstream/client | egressd mean query /"
        " dynamic_add",
    ]
    d = rep["paced"]["direct"]["latency"]
    labels = {
        "direct": "direct (upstream)",
        "proxy_new": "proxy, new names",
        "proxy_repeat": "proxy, repeated names",
    }
    for side in PACED_SIDES:
        x = rep["paced"][side]
        lat = x["latency"]
        added = (
            ""
            if side == "direct"
            else f"{lat['p50_ms'] - d['p50_ms']:+6.3f} {lat['p99_ms'] - d['p99_ms']:+7.3f}"
        )
        eg = x["egressd"]
        egs = (
            f"{eg['query_mean_ms']:.3f} / {eg['dynamic_add_mean_ms']:.3f} ms ({eg['dynamic_add']} txns)"
            if side != "direct"
            else "-"
        )
        bad = sum(x["bad"].values())
        lines.append(
            f"{labels[side]:<22} {x['sent']:>6} {x['lost']:>5} {bad:>4} {lat['p50_ms']:7.3f} {lat['p90_ms']:7.3f}"
            f" {lat['p99_ms']:7.3f} {lat['p999_ms']:7.3f} {lat['max_ms']:7.2f} | {added:>14} |"
            f" {x['send_lag_p99_ms']:7.2f} | {_cpu_text(x['cpu_pct']):>27} | {egs}"
        )
        if x["bad"] or x["errors"]:
            lines.append(f"    bad answers {x['bad']}, socket errors {x['errors']}")
        if eg.get("failed") or eg.get("nft_failed"):
            lines.append(f"    egressd failures: {eg['failed']} nft dynamic_add failed {eg['nft_failed']}")
    lines.append(
        "    achieved send rate: "
        + ", ".join(f"{labels[s]} {rep['paced'][s]['achieved_rate']:.0f}/s" for s in PACED_SIDES)
    )
    for side in PACED_SIDES:
        x = rep["paced"][side]
        calm = x.get("latency_without_tick_slices")
        if x.get("slices_with_refresh_tick") and calm:
            lines.append(
                f"    {labels[side]}: {x['slices_with_refresh_tick']} of {x['slices']} slices contained an egressd"
                f" lease-refresher tick (every 30 s); without those slices p50 {calm['p50_ms']:.3f}"
                f" p99 {calm['p99_ms']:.3f} p99.9 {calm['p999_ms']:.3f} ms (diagnostic only; verdicts use all slices)"
            )
    for side in PACED_SIDES:
        x = rep["paced"][side]
        lines.append(
            f"    per slice p50/p99 {labels[side]}: "
            + ", ".join(
                f"{q['p50_ms']:.2f}/{q['p99_ms']:.2f}" + ("*" if q["refresh_tick"] else "")
                for q in x["per_slice"]
            )
            + f"   machine busy {x['machine_busy_pct']:.0f}% of {os.cpu_count()} CPUs, steal"
            f" {x['machine_steal_pct']:.1f}%, other than our 3 processes {x['others_cpu_pct']:.0f}% of a CPU"
        )
    lines.append("    (* = slice contained an egressd lease-refresher tick)")
    lines.append(
        f"    conntrack entries in the pod namespace after (1): {rep.get('conntrack_after_paced')},"
        f" after (2): {rep.get('conntrack_after_closed')} (UDP entries live 30 s)"
    )
    lines.append("")
    c = rep["closed"]
    lines.append(
        f"(2) closed loop, {c['direct']['concurrency']} queries outstanding, {prm['closed_s']:.0f}s per side"
        " (2 slices, ABBA), new names"
    )
    lines.append(
        f"{'side':<22} {'answered':>8} {'timeouts':>8} {'q/s':>8} {'p50':>7} {'p99':>7} | CPU egressd/upstream/client"
        " | egressd mean query / dynamic_add"
    )
    for side in CLOSED_SIDES:
        x = c[side]
        eg = x["egressd"]
        egs = f"{eg['query_mean_ms']:.3f} / {eg['dynamic_add_mean_ms']:.3f} ms" if side != "direct" else "-"
        lines.append(
            f"{labels[side]:<22} {x['answered']:>8} {x['timeouts']:>8} {x['qps']:8.0f}"
            f" {x['latency']['p50_ms']:7.3f} {x['latency']['p99_ms']:7.3f} | {_cpu_text(x['cpu_pct']):>27} | {egs}"
            + (f"   bad {x['bad']}" if x["bad"] else "")
        )
        lines.append(
            f"    per slice q/s: {', '.join(f'{q:.0f}' for q in x['qps_per_slice'])}; machine busy"
            f" {x['machine_busy_pct']:.0f}%, steal {x['machine_steal_pct']:.1f}%, other than our 3 processes"
            f" {x['others_cpu_pct']:.0f}% of a CPU"
        )
    used, zone = rep.get("proxy_new_names_used") or 0, prm["zone_names"]
    lines.append(
        f"    the proxy was asked {used} distinct new names in (1)+(2) (zone: {zone})"
        + ("" if used <= zone else "; MORE than the zone holds: later 'new' names repeated earlier ones")
    )
    r = rep["ratios"]
    lines.append("")
    lines.append("ratios (proxy / direct):")
    for side in ("proxy_new", "proxy_repeat"):
        lines.append(f"  paced {labels[side]:<22} p50 {r[side]['p50']:.2f}x  p99 {r[side]['p99']:.2f}x")
    lines.append(
        f"  max sustained q/s      {r['qps']:.2f}x ({c['proxy_new']['qps']:.0f} vs {c['direct']['qps']:.0f})"
    )

    sp = rep.get("splits")
    if sp:
        srv = sp["server"]
        cl = sp["client"]
        lines.append("")
        lines.append(
            f"(3) where the time goes: a separate run with egressd's main() wrapped by perf_counter calls,"
            f" same subjects, {prm['rate']:.0f} q/s new names, {srv['queries']} forwarded queries; ms"
        )
        lines.append(
            f"{'component (per forwarded query)':<60} {'p50':>7} {'p99':>7} {'max':>7} {'mean':>7}"
            f" | mean in slowest 1% ({srv['tail_queries']})"
        )
        for key, label in SPLIT_PARTS:
            s = srv["parts"].get(key)
            if s:
                lines.append(
                    f"  {label:<58} {s['p50_ms']:7.3f} {s['p99_ms']:7.3f} {s['max_ms']:7.2f} {s['mean_ms']:7.3f}"
                    f" | {s['tail_mean_ms']:7.3f}"
                )
        pl, dl = cl["proxy_new"]["latency"], cl["direct"]["latency"]
        tot = srv["parts"].get("total", {})
        lines.append(
            f"  client RTT in this run: proxy {pl['p50_ms']:.3f} / {pl['p99_ms']:.3f}, direct {dl['p50_ms']:.3f} /"
            f" {dl['p99_ms']:.3f} (p50 / p99); RTT minus time in egressd (p50): "
            f"{pl['p50_ms'] - tot.get('p50_ms', math.nan):.3f}"
        )
        lines.append(
            f"  GC during the run: {srv['gc_collections']} collections, {srv['gc_gen2']} gen-2 (max"
            f" {srv['gc_gen2_max_ms']:.1f} ms); longest by generation "
            + (
                ", ".join(
                    f"gen{g} {v:.1f} ms" for g, v in sorted(srv.get("gc_max_ms_by_generation", {}).items())
                )
                or "-"
            )
            + f"; {srv['queries_overlapping_gc']} queries overlapped a collection"
        )
        ev = srv.get("events", {})
        names = {
            "refresh_tick": f"lease-refresher ticks (EGRESSD_REFRESH_INTERVAL={prm.get('splits_refresh_s')} s here)",
            "conntrack_read": "  of which reading /proc/net/nf_conntrack (worker thread)",
            "conntrack_parse": "  of which parse_conntrack (on the event loop)",
            "always_rules_check": "always-rules checks",
            "loop_stall": "event-loop stalls > 2 ms (5 ms probe)",
        }
        for key, label in names.items():
            e = ev.get(key)
            if e:
                extra = f", {e['conntrack_max']:.0f} conntrack entries" if "conntrack_max" in e else ""
                lines.append(
                    f"  {label}: {e['count']:.0f}, longest {e['max_ms']:.1f} ms, total {e['sum_ms']:.1f} ms{extra}"
                )
        lines.append(
            f"  the slowest 1% ({srv['tail_queries']}) overlapped: "
            + (", ".join(f"{k} {v}" for k, v in sorted(srv.get("tail_overlaps", {}).items())) or "-")
            + "; all queries overlapping: "
            + (", ".join(f"{k} {v}" for k, v in sorted(srv.get("overlaps", {}).items())) or "-")
        )
    lines.append("")
    lines.append("targets:")
    for t in rep["targets"]:
        lines.append(
            f"  [{'MET' if t['met'] else 'MISSED':<6}] {t['name']}: {t['value']:+.3f} {t['unit']}   target"
            f" {t['target']}  ({t['note']})"
        )
    lines.append(
        f"  [info  ] max sustained q/s through the proxy: {c['proxy_new']['qps']:.0f}/s vs direct"
        f" {c['direct']['qps']:.0f}/s ({r['qps']:.2f}x); no target"
    )
    lines.append(f"\ntotal {m['duration_s']:.0f}s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="50 subjects, 3 s per side (CI, < 60 s)")
    p.add_argument("--subjects", type=int, default=0, help="active subjects incl. the measured one (1000)")
    p.add_argument("--rate", type=float, default=0, help="paced queries per second (1000)")
    p.add_argument("--duration", type=float, default=0, help="paced seconds per side (10; quick 3)")
    p.add_argument(
        "--closed-duration", type=float, default=0, help="closed-loop seconds per side (5; quick 2)"
    )
    p.add_argument("--concurrency", type=int, default=0, help="closed-loop queries outstanding (32)")
    p.add_argument("--sockets", type=int, default=0, help="client sockets for the paced run (8)")
    p.add_argument(
        "--splits",
        choices=("auto", "always", "never"),
        default="auto",
        help="instrumented 'where the time goes' run: when a latency target is missed (auto), always, never",
    )
    p.add_argument(
        "--measured-first",
        action="store_true",
        help="register the measured subject first instead of last (its sets head the kernel's set list)",
    )
    p.add_argument("--json-out", help="also write the report as JSON here")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--egressd-instrumented", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--targets", help=argparse.SUPPRESS)
    p.add_argument("--zone-names", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ns-base", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--params", help=argparse.SUPPRESS)
    p.add_argument("--bridge-nf", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--outer-netns", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.egressd_instrumented:
        return egressd_instrumented_main(args.egressd_instrumented)
    if args.client:
        return client_main(args)
    if args.inner:
        return inner_main(args)
    return outer_main(args)


if __name__ == "__main__":
    sys.exit(main())
