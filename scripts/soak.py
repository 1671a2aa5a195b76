#!/usr/bin/env python3
"""Soak: the real fleet daemon under sustained policy churn and DNS, checked for flat resources.

Run as root from the repository root (not in CI: the default run takes 10 minutes)::

    .venv/bin/python scripts/soak.py                 # 10 minutes, results to scripts/bench/results/soak-<date>.*
    .venv/bin/python scripts/soak.py --quick         # 1 minute, results under /tmp (smoke)
    .venv/bin/python scripts/soak.py --minutes 30 --out-prefix /tmp/soak30

What runs (all inside throwaway namespaces built by ``tests/kernel/topology.py``; the root
namespace gets no link, route or nft table, and everything is removed on exit, error or
SIGINT/SIGTERM/SIGHUP):

* egressd (fleet profile) in the pod namespace, the upstream (``scripts/fleet_upstream.py``,
  authoritative DNS) in the upstream namespace, ``--netns`` sandbox namespaces on the bridge;
* a load process started in the pod namespace (``--load``, internal) that registers
  ``--subjects`` subjects (SET_BINDING + data-plane-ready; subjects beyond ``--netns`` are bound
  to addresses of the sandbox subnet that no namespace holds), then, in two paced threads with a
  fixed number of iterations each: exactly ``minutes x 60 x --rate`` in-place SET_BINDINGs
  cycling every subject through ``POLICIES``, and ``minutes x 60 x --dns-rate`` DNS queries
  from the sandbox namespaces to the gateway (a fresh UDP socket per query, opened in the
  sandbox's namespace by ``setns`` in that process's DNS thread, so one process speaks for all);
* this process samples the daemon every ``--interval`` seconds: RSS and open descriptors
  (``/proc/<pid>``), nft rules, sets and set elements of its table and the pod's conntrack
  entries, plus the load's progress and failed actions.

Verdict (exit code 0 = PASS, 1 = FAIL, 2 = could not run): every series is fitted by least
squares over the samples after ``--warmup`` seconds; its growth (slope x fitted span) must stay
below ``max(5 % of its mean, an absolute floor)`` (``FLOORS``), and no action may fail (any
non-200 answer, a transport error, or a request not sent before the time limit). Shrinking is
never a failure. DNS timeouts and SERVFAILs are reported but do not fail the run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.kernel.topology is the project's namespace toolkit

from tests.kernel.topology import (  # noqa: E402
    GATEWAY,
    SB_NET,
    UP_NET,
    VENV_PY,
    Daemon,
    Topology,
    cleanup_stale,
    envelope,
    sh,
)

DPR = "sandbox.data-plane-ready"
TABLE = "egsoak"
HTTP_PORT = 18990
ACTIONS = "/_fastlet/v1/actions"

# Policies every subject cycles through. They differ in what the kernel must hold for them
# (static IPs/CIDRs, wildcard and exact names, default allow, audit mode with its own rules and
# counters, IPv6), so the swaps add and drop rules, sets and elements all the time.
POLICIES: list[dict[str, object]] = [
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "a.test"},
            {"action": "allow", "target": "b.test"},
            {"action": "allow", "target": f"{UP_NET}.2"},
        ],
    },
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "*.example.test"},
            {"action": "allow", "target": "example.test"},
            {"action": "allow", "target": f"{UP_NET}.0/29"},
            {"action": "deny", "target": f"{UP_NET}.3"},
        ],
    },
    {
        "defaultAction": "allow",
        "egress": [
            {"action": "deny", "target": "secret-exfil.test"},
            {"action": "deny", "target": f"{UP_NET}.8"},
        ],
    },
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "www.a.test"},
            {"action": "allow", "target": "multi.test"},
            {"action": "allow", "target": "short.test"},
            {"action": "allow", "target": "v6.test"},
            {"action": "allow", "target": "fd00:204::2"},
        ],
    },
    {
        "defaultAction": "deny",
        "mode": "audit",
        "egress": [
            {"action": "allow", "target": "a.test"},
            {"action": "allow", "target": "api.example.test"},
            {"action": "deny", "target": "b.test"},
            {"action": "allow", "target": f"{UP_NET}.4/31"},
        ],
    },
    {
        "defaultAction": "deny",
        "egress": [
            *({"action": "allow", "target": f"10.220.{j}.0/24"} for j in range(16)),
            {"action": "allow", "target": "*.example.test"},
        ],
    },
]

# (name, qtype). Allowed or denied depending on the subject's policy at that instant; every
# fourth query is instead a never-seen name under example.test (see dns_name), so per-name
# state in the proxy would grow if it were unbounded.
DNS_NAMES: list[tuple[str, str]] = [
    ("a.test", "A"),
    ("b.test", "A"),
    ("www.a.test", "A"),
    ("example.test", "A"),
    ("api.example.test", "A"),
    ("x.y.example.test", "A"),
    ("multi.test", "A"),
    ("short.test", "A"),
    ("v6.test", "AAAA"),
    ("secret-exfil.test", "A"),
]

# Growth limit per series is max(REL_LIMIT x mean, floor): the floor keeps tiny series (a few
# descriptors, a handful of conntrack entries) from failing on one unit of noise.
REL_LIMIT = 0.05
FLOORS: dict[str, float] = {
    "rss_kib": 2048.0,
    "fds": 2.0,
    "nft_rules": 4.0,
    "nft_sets": 2.0,
    "nft_elements": 20.0,
    "conntrack": 50.0,
    "threads": 2.0,
    "children": 1.0,  # conntrack/nft execs that were never reaped would pile up here
}
SERIES = list(FLOORS)


def _ns_inode(path: str) -> int:
    return os.stat(path).st_ino


# ---- load process (runs inside the pod namespace) ------------------------------------------


@dataclass
class LoadStats:
    actions_sent: int = 0
    actions_failed: int = 0
    failures: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    max_lag_s: float = 0.0
    dns_sent: int = 0
    dns_rcodes: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, what: str) -> None:
        with self.lock:
            self.actions_failed += 1
            if len(self.failures) < 20:  # enough to diagnose, bounded memory
                self.failures.append(what)

    def progress(self) -> dict[str, object]:
        with self.lock:
            return {
                "actions_sent": self.actions_sent,
                "actions_failed": self.actions_failed,
                "dns_sent": self.dns_sent,
                "dns_timeouts": self.dns_rcodes.get("TIMEOUT", 0),
            }


class Actions:
    """Keep-alive HTTP client for the daemon's action endpoint (one connection, reconnects)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def post(self, body: dict[str, object]) -> tuple[int, str]:
        data = json.dumps(body).encode()
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                self.conn.request("POST", ACTIONS, data, {"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                return resp.status, resp.read().decode("utf-8", "replace")
            except (OSError, http.client.HTTPException) as e:
                self.conn.close()
                self.conn = None
                # Only a request the server never answered is retried (a keep-alive connection
                # it closed); the retry is the same in-place SET_BINDING, so it is idempotent.
                if attempt == 2:
                    return 0, f"{type(e).__name__}: {e}"
        return 0, "unreachable"


def subject_uid(k: int) -> str:
    return f"soak-{k}"


def subject_ip(k: int) -> str:
    # Topology.sb_ip(k) = 10.203.0.(10+k): the namespaces' addresses; subjects beyond --netns
    # get the same scheme, addresses on the bridge's subnet that no namespace holds.
    return f"{SB_NET}.{10 + k}"


def policy_for(n: int, subjects: int) -> tuple[int, int]:
    """(subject, policy index) of update ``n``: subjects round-robin; each round shifts every
    subject to its next policy, and subjects are spread over all policies at any instant."""
    k = n % subjects + 1
    return k, (n // subjects + k) % len(POLICIES)


def dns_name(q: int) -> tuple[str, str]:
    if q % 4 == 3:
        return f"s{q}.example.test", "A"
    return DNS_NAMES[q % len(DNS_NAMES)]


def run_actions(cfg: dict[str, Any], stats: LoadStats, deadline: float) -> None:
    client = Actions(int(cfg["port"]))
    subjects, rate = int(cfg["subjects"]), float(cfg["rate"])
    total = int(cfg["actions"])
    t0 = time.monotonic()
    for n in range(total):
        due = t0 + n / rate
        now = time.monotonic()
        if now > deadline:
            stats.fail(f"{total - n} actions not sent before the time limit")
            with stats.lock:
                stats.actions_failed += total - n - 1
            return
        if due > now:
            time.sleep(due - now)
        else:
            stats.max_lag_s = max(stats.max_lag_s, now - due)
        k, p = policy_for(n, subjects)
        env = envelope(
            "SET_BINDING",
            subject_uid(k),
            ip=subject_ip(k),
            policy=json.dumps(POLICIES[p]),
            generation=2 + n // subjects,
        )
        start = time.monotonic()
        code, body = client.post(env)
        took = (time.monotonic() - start) * 1000
        with stats.lock:
            stats.actions_sent += 1
            stats.latencies_ms.append(took)
        if code != 200:
            stats.fail(f"#{n} {subject_uid(k)} policy {p}: {code} {body[:200]}")


class SandboxSockets:
    """Fresh UDP sockets in sandbox namespaces, as a stub resolver uses (a new source port per
    query, so the pod's conntrack table sees a realistic flow churn). A socket stays in the
    namespace it was created in, so the calling thread enters a sandbox namespace only for
    socket() and returns to its own at once (checked). setns(2) moves the calling thread only;
    the actions thread, with its connection to the daemon, stays in the pod namespace."""

    def __init__(self, names: Sequence[str]) -> None:
        self.fds = [os.open(f"/run/netns/{name}", os.O_RDONLY) for name in names]
        self.home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        self.home_ino = os.fstat(self.home).st_ino

    def open(self, i: int) -> socket.socket:
        try:
            os.setns(self.fds[i % len(self.fds)], os.CLONE_NEWNET)
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        finally:
            os.setns(self.home, os.CLONE_NEWNET)
            if _ns_inode("/proc/thread-self/ns/net") != self.home_ino:
                os._exit(3)  # never go on outside the pod namespace
        s.settimeout(1.0)
        return s

    def close(self) -> None:
        for fd in [*self.fds, self.home]:
            os.close(fd)


def run_dns(cfg: dict[str, Any], stats: LoadStats, deadline: float) -> None:
    from dnslib import RCODE, DNSRecord

    total, rate = int(cfg["dns_queries"]), float(cfg["dns_rate"])
    # Opened in this thread: its home namespace is the one it must return to.
    sandboxes = SandboxSockets(cfg["sandbox_netns"])
    t0 = time.monotonic()
    try:
        for q in range(total):
            due = t0 + q / rate
            now = time.monotonic()
            if now > deadline:
                return
            if due > now:
                time.sleep(due - now)
            name, qtype = dns_name(q)
            query = DNSRecord.question(name, qtype)
            rcode = "TIMEOUT"
            with sandboxes.open(q) as sock:
                try:
                    sock.sendto(query.pack(), (GATEWAY, 53))
                    reply = DNSRecord.parse(sock.recv(65535))
                    rcode = RCODE.get(reply.header.rcode) if reply.header.id == query.header.id else "BADID"
                except TimeoutError:
                    pass
                except OSError as e:
                    rcode = f"ERR-{e.errno}"
            with stats.lock:
                stats.dns_sent += 1
                stats.dns_rcodes[str(rcode)] += 1
    finally:
        sandboxes.close()


def load_main(cfg_path: Path) -> int:
    cfg = json.loads(cfg_path.read_text())
    # Refuse to run in the caller's (root) namespace: the daemon's port and the sockets must be
    # the pod's. (/proc/1/ns is not readable in every container, so the caller passes its own.)
    if _ns_inode("/proc/self/ns/net") == int(cfg["outer_netns"]):
        print("load: refusing to run in the root network namespace", file=sys.stderr)
        return 2
    if _ns_inode("/proc/self/ns/net") != _ns_inode(f"/run/netns/{cfg['pod']}"):
        print("load: not in the pod namespace", file=sys.stderr)
        return 2
    stats = LoadStats()
    client = Actions(int(cfg["port"]))
    subjects = int(cfg["subjects"])
    for k in range(1, subjects + 1):
        env = envelope(
            "SET_BINDING",
            subject_uid(k),
            ip=subject_ip(k),
            policy=json.dumps(POLICIES[k % len(POLICIES)]),
            generation=1,
        )
        for what, body in (("bind", env), ("activate", envelope("LIFECYCLE_HOOK", subject_uid(k), hook=DPR))):
            code, text = client.post(body)
            if code != 200:
                print(f"load: {what} {subject_uid(k)}: {code} {text[:300]}", file=sys.stderr)
                return 2
    if client.conn is not None:
        client.conn.close()
    progress = Path(cfg["progress"])
    started = time.time()
    duration = float(cfg["duration"])
    # Hard stop for both loops: the run may lag on a busy machine, but never runs away.
    deadline = time.monotonic() + duration * 1.5 + 60
    threads = [
        threading.Thread(target=run_actions, args=(cfg, stats, deadline), name="actions"),
        threading.Thread(target=run_dns, args=(cfg, stats, deadline), name="dns"),
    ]
    Path(cfg["started"]).write_text(json.dumps({"wall": started}))
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        tmp = progress.with_suffix(".tmp")
        tmp.write_text(json.dumps(stats.progress()))
        tmp.replace(progress)  # atomic, so the sampler never reads half a file
        for t in threads:
            t.join(timeout=0.5)
    lat = sorted(stats.latencies_ms) or [0.0]
    result = {
        **stats.progress(),
        "actions_planned": int(cfg["actions"]),
        "dns_planned": int(cfg["dns_queries"]),
        "failures": stats.failures,
        "latency_ms": {
            "p50": lat[len(lat) // 2],
            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "max": lat[-1],
        },
        "max_lag_s": stats.max_lag_s,
        "elapsed_s": time.time() - started,
        "dns_rcodes": dict(stats.dns_rcodes),
    }
    Path(cfg["result"]).write_text(json.dumps(result))
    return 0


# ---- sampler and verdict (root namespace: reads only) --------------------------------------


def _children(pid: int) -> int:
    """Processes whose parent is ``pid``, zombies included (a scan: /proc/<pid>/task/*/children
    is not in every kernel build)."""
    n = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                # The parent pid is the 2nd field after the command, which may hold spaces.
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    n += 1
    return n


def sample(topo: Topology, daemon: Daemon, pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
    rss = int(fields["VmRSS"].split()[0])
    threads = int(fields["Threads"])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rules = sets = elements = 0
    for item in daemon.table_json():
        if "rule" in item:
            rules += 1
        for kind in ("set", "map"):
            obj = item.get(kind)
            if isinstance(obj, dict):
                sets += 1
                elements += len(obj.get("elem", []))
    ct = topo.ns(topo.pod, "conntrack", "-C", check=False).stdout.strip()
    return {
        "rss_kib": float(rss),
        "fds": float(fds),
        "nft_rules": float(rules),
        "nft_sets": float(sets),
        "nft_elements": float(elements),
        "conntrack": float(ct) if ct.isdigit() else float("nan"),
        "threads": float(threads),
        "children": float(_children(pid)),
    }


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


@dataclass
class Verdict:
    series: str
    mean: float
    slope_per_min: float
    growth: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.growth <= self.limit


def judge(rows: list[dict[str, float]], warmup: float) -> list[Verdict]:
    fitted = [r for r in rows if r["t"] >= warmup] or rows
    xs = [r["t"] for r in fitted]
    span = xs[-1] - xs[0]
    out = []
    for s in SERIES:
        pts = [(r["t"], r[s]) for r in fitted if r[s] == r[s]]  # drop NaN (conntrack unreadable)
        if len(pts) < 2:
            out.append(Verdict(s, float("nan"), float("nan"), float("inf"), 0.0))
            continue
        slope, _ = fit([p[0] for p in pts], [p[1] for p in pts])
        mean = statistics.fmean(p[1] for p in pts)
        out.append(Verdict(s, mean, slope * 60, slope * span, max(REL_LIMIT * mean, FLOORS[s])))
    return out


def plot(
    rows: list[dict[str, float]], verdicts: list[Verdict], warmup: float, path: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; files only
    import matplotlib.pyplot as plt

    scale = {"rss_kib": 1 / 1024}
    label = {
        "rss_kib": "RSS (MiB)",
        "fds": "open fds",
        "nft_rules": "nft rules",
        "nft_sets": "nft sets+maps",
        "nft_elements": "nft elements",
        "conntrack": "conntrack entries",
        "threads": "threads",
        "children": "child processes",
    }
    fig, axes = plt.subplots(4, 2, figsize=(8, 7.6), sharex=True)
    for ax, v in zip(axes.flat, verdicts, strict=True):
        f = scale.get(v.series, 1.0)
        t = [r["t"] / 60 for r in rows]
        ax.plot(t, [r[v.series] * f for r in rows], ".-", ms=3, lw=0.8)
        fitted = [r for r in rows if r["t"] >= warmup and r[v.series] == r[v.series]]
        if len(fitted) >= 2:
            slope, icpt = fit([r["t"] for r in fitted], [r[v.series] for r in fitted])
            ends = [fitted[0]["t"], fitted[-1]["t"]]
            ax.plot([e / 60 for e in ends], [(icpt + slope * e) * f for e in ends], "r--", lw=1)
        ax.set_title(f"{label[v.series]}: {'ok' if v.ok else 'GROWS'}", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("minutes", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


_interrupted = False


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt(f"signal {signum}")


def _cell(v: float | None) -> str:
    if v is None or v != v:  # absent or NaN (an unreadable conntrack count)
        return ""
    return f"{v:g}" if v != int(v) else str(int(v))


def _root_snapshot() -> str:
    # Read-only view of the root namespace (tables and routes) to prove we left it as it was.
    return sh("nft", "list", "tables", check=False).stdout + sh("ip", "route", "show", "table", "all").stdout


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    duration = float(args.minutes) * 60
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    prefix = Path(
        args.out_prefix or (f"/tmp/egressd-soak-quick-{date}" if args.quick else f"scripts/bench/results/soak-{date}")
    )
    # Thread-pool workers, malloc arenas and the conntrack table (UDP entries live 30 s) settle in
    # the first half minute or so; a leak is what keeps growing after that.
    warmup = args.warmup if args.warmup is not None else min(60.0, duration / 2)
    cleanup_stale()
    root_before = _root_snapshot()
    topo = Topology(prefix=f"egsoak{os.getpid()}", sandboxes=args.netns)
    try:
        rows, result, daemon_errors = _soak(args, topo, duration)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # let the teardown finish
        topo.down()
        if _root_snapshot() != root_before:
            log("WARNING: the root namespace's tables or routes changed during the run (another job?)")
    return _verdict(args, rows, result, daemon_errors, warmup, date, prefix)


def _soak(
    args: argparse.Namespace, topo: Topology, duration: float
) -> tuple[list[dict[str, float]], dict[str, Any], list[str]]:
    """Start egressd and the load, sample until the load is done: (samples, the load's result,
    the daemon's error lines)."""
    t_build = time.monotonic()
    topo.up_()
    log(f"topology up: {args.netns} sandbox namespaces in {time.monotonic() - t_build:.1f} s")
    daemon = Daemon(topo, table=TABLE, port=HTTP_PORT).start()
    assert daemon.proc is not None
    cfg = {
        "pod": topo.pod,
        "outer_netns": _ns_inode("/proc/self/ns/net"),
        "port": HTTP_PORT,
        "subjects": args.subjects,
        "sandbox_netns": [topo.sb(i) for i in range(1, args.netns + 1)],
        "rate": args.rate,
        "actions": round(duration * args.rate),
        "dns_rate": args.dns_rate,
        "dns_queries": round(duration * args.dns_rate),
        "duration": duration,
        "progress": str(topo.workdir / "progress.json"),
        "started": str(topo.workdir / "started.json"),
        "result": str(topo.workdir / "result.json"),
    }
    load = _start_load(topo, cfg)
    log(f"{args.subjects} subjects active; daemon pid {daemon.proc.pid}; soaking {duration:.0f} s")
    rows = _sample_loop(topo, daemon, Path(str(cfg["progress"])), duration, args.interval)
    try:
        load.wait(duration * 0.5 + 90)  # its own deadline is 1.5 x duration + 60 from start
    except Exception as e:
        raise RuntimeError("load did not finish") from e
    result_path = Path(str(cfg["result"]))
    if load.returncode != 0 or not result_path.exists():
        raise RuntimeError(
            f"load exited {load.returncode}: {(topo.workdir / 'load.log').read_text()[-2000:]}"
        )
    result = json.loads(result_path.read_text())
    daemon_errors = [ln for ln in daemon.log_text().splitlines() if '"error"' in ln or "Traceback" in ln]
    return rows, result, daemon_errors


def _start_load(topo: Topology, cfg: dict[str, Any]) -> subprocess.Popen[str]:
    """The load process in the pod namespace, once it has registered every subject."""
    cfg_path = topo.workdir / "load.json"
    cfg_path.write_text(json.dumps(cfg))
    load = topo.spawn(
        topo.pod,
        str(VENV_PY),
        str(Path(__file__).resolve()),
        "--load",
        str(cfg_path),
        log=topo.workdir / "load.log",
    )
    started = Path(str(cfg["started"]))
    deadline = time.monotonic() + 180  # 64 registrations take seconds; a busy host, more
    while not started.exists():
        if load.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("load did not start: " + (topo.workdir / "load.log").read_text()[-2000:])
        time.sleep(0.2)
    return load


def _sample_loop(
    topo: Topology, daemon: Daemon, progress: Path, duration: float, interval: float
) -> list[dict[str, float]]:
    assert daemon.proc is not None
    pid = daemon.proc.pid
    rows: list[dict[str, float]] = []
    t0 = time.monotonic()
    n_samples = int(duration // interval) + 1
    for k in range(n_samples):
        due = t0 + k * interval
        time.sleep(max(0.0, due - time.monotonic()))
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"egressd exited {daemon.proc.returncode}: {daemon.log_text()[-2000:]}")
        row: dict[str, float] = {"t": round(time.monotonic() - t0, 2), **sample(topo, daemon, pid)}
        with contextlib.suppress(OSError, ValueError):
            row.update({key: float(v) for key, v in json.loads(progress.read_text()).items()})
        rows.append(row)
        log(
            f"t={row['t']:.0f}s rss={row['rss_kib'] / 1024:.1f}MiB fds={row['fds']:.0f} "
            f"rules={row['nft_rules']:.0f} sets={row['nft_sets']:.0f} elems={row['nft_elements']:.0f} "
            f"ct={row['conntrack']:.0f} thr={row['threads']:.0f} ch={row['children']:.0f} actions={row.get('actions_sent', 0):.0f} "
            f"failed={row.get('actions_failed', 0):.0f} dns={row.get('dns_sent', 0):.0f}"
        )
    return rows


def _verdict(
    args: argparse.Namespace,
    rows: list[dict[str, float]],
    result: dict[str, Any],
    daemon_errors: list[str],
    warmup: float,
    date: str,
    prefix: Path,
) -> int:
    """Fit, judge and write the CSV, the plot and the text report; 0 = PASS."""
    verdicts = judge(rows, warmup)
    failed = int(result["actions_failed"]) + (int(result["actions_planned"]) - int(result["actions_sent"]))
    ok = failed == 0 and all(v.ok for v in verdicts)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    csv_path, png_path, txt_path = (prefix.with_suffix(s) for s in (".csv", ".png", ".txt"))
    cols = ["t", *SERIES, "actions_sent", "actions_failed", "dns_sent", "dns_timeouts"]
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _cell(r.get(c)) for c in cols})
    title = (
        f"egressd soak {date}: {args.subjects} subjects, {args.rate:g} SET_BINDING/s, "
        f"{args.dns_rate:g} DNS q/s, {args.minutes:g} min"
    )
    plot(rows, verdicts, warmup, png_path, title)
    lines = [
        f"command: .venv/bin/python scripts/soak.py {' '.join(sys.argv[1:])}".rstrip(),
        f"{title}; {args.netns} sandbox namespaces; samples every {args.interval:g} s, fitted from t >= {warmup:g} s",
        f"actions: {result['actions_sent']}/{result['actions_planned']} sent, {failed} failed; "
        f"latency p50 {result['latency_ms']['p50']:.2f} ms, p99 {result['latency_ms']['p99']:.2f} ms, "
        f"max {result['latency_ms']['max']:.1f} ms; max pacing lag {result['max_lag_s']:.2f} s; "
        f"load ran {result['elapsed_s']:.1f} s",
        f"dns: {result['dns_sent']}/{result['dns_planned']} queries, rcodes {json.dumps(result['dns_rcodes'], sort_keys=True)}",
        f"daemon log lines at error level or with a traceback: {len(daemon_errors)}",
        "",
        f"{'series':<14}{'mean':>12}{'slope/min':>12}{'growth':>12}{'limit':>12}  verdict",
    ]
    for v in verdicts:
        lines.append(
            f"{v.series:<14}{v.mean:>12.1f}{v.slope_per_min:>12.3f}{v.growth:>12.1f}{v.limit:>12.1f}  "
            f"{'ok' if v.ok else 'GROWS'}"
        )
    lines += ["", f"verdict: {'PASS' if ok else 'FAIL'}"]
    for fl in result.get("failures", []):
        lines.append(f"failed action: {fl}")
    for ln in daemon_errors[:10]:
        lines.append(f"daemon: {ln[:300]}")
    txt_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"wrote {csv_path}, {png_path}, {txt_path}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--minutes", type=float, default=10.0, help="soak duration (default 10)")
    ap.add_argument(
        "--quick", action="store_true", help="1 minute, results under /tmp (a smoke of this script)"
    )
    ap.add_argument("--subjects", type=int, default=64, help="active subjects (default 64)")
    ap.add_argument(
        "--netns", type=int, default=None, help="sandbox namespaces sending DNS (default: --subjects)"
    )
    ap.add_argument(
        "--rate", type=float, default=100.0, help="in-place SET_BINDINGs per second (default 100)"
    )
    ap.add_argument(
        "--dns-rate", type=float, default=20.0, help="DNS queries per second, all sandboxes (default 20)"
    )
    ap.add_argument("--interval", type=float, default=10.0, help="sampling interval in seconds (default 10)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds excluded from the fit (default min(60, duration/2))",
    )
    ap.add_argument(
        "--out-prefix", default=None, help="CSV/PNG/TXT path prefix (default scripts/bench/results/soak-<date>; --quick: /tmp)"
    )
    ap.add_argument("--load", type=Path, help=argparse.SUPPRESS)  # internal: the load process
    args = ap.parse_args(argv)
    if args.load is not None:
        return load_main(args.load)
    if args.quick:
        args.minutes = 1.0
    if args.netns is None:
        args.netns = args.subjects
    if not (1 <= args.netns <= args.subjects <= 200):  # addresses 10.203.0.11..210 of the /24
        ap.error("need 1 <= --netns <= --subjects <= 200")
    if not (0 < args.rate <= 1000 and 0 < args.dns_rate <= 500 and args.minutes > 0 and args.interval > 0):
        ap.error("rates must be in (0, 1000] and (0, 500], minutes and interval positive")
    if os.geteuid() != 0:
        print("soak: needs root (network namespaces, nft)", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("soak: interrupted; namespaces removed", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
