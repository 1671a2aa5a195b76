#!/usr/bin/env python3
"""MITM benchmark: HTTPS latency added by egressd's shared transparent mitmproxy, and its RSS.

Run as root from the repository root::

    .venv/bin/python scripts/bench/bench_mitm.py [--quick] [--no-keepalive] [--out FILE]
        [--profile --py-spy PATH] [--json-out FILE] [--daemon-env KEY=VALUE ...]

Topology: tests/kernel/topology.py's :class:`Topology` (namespaces ``egbm<pid>-{pod,up,sb1,sb2}``,
nothing in the root namespace, removed in ``finally``), with the upstream echo serving HTTPS on
443 *and* 8443 from the same process and the same test-CA leaf. One egressd with
``OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1`` in the pod; the kernel redirects only TCP 80/443
of MITM subjects to mitmdump, so the three measured paths share the kernel dispatch and the
upstream process and differ only by the MITM:

* ``direct``       sb1 -> api.example.test:8443, not intercepted (trusts the upstream test CA);
* ``mitm+inject``  sb1 -> api.example.test:443 through mitmdump; sb1 has a vault whose binding
  matches every request (bearer injected; the realistic worst case: lookup + 304 revalidation +
  header rewrite + response redaction). Trusts the MITM CA;
* ``mitm pass``    sb2 (bound, no vault) -> :443 through mitmdump: lookup answers 404, pass-through.

The client is a small Python program (``CLIENT`` below) run inside the sandbox namespace with
``ip netns exec``; it reads one JSON command per line and answers one JSON line. Each request
is a GET /v1/models with ``Authorization: Bearer <placeholder>``; the response is checked
(200, and ``X-Echo-Authorization`` proves what the upstream saw: ``[redacted]`` = the real key was
injected, the placeholder = nothing injected). Failures count as +inf latency.

Phases (each: every path, in batches interleaved direct, inject, pass, pass, inject, direct, ...;
bounded in count and by a 60 s cap per path and phase):
new TLS connection per request (what an agent's curl does), sequential (300) and 16 in flight
(800); then the same over keep-alive connections (connection set up before timing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.kernel.topology import (  # noqa: E402
    UPSTREAM_IPS,
    VENV_PY,
    Daemon,
    Topology,
    envelope,
)

API = "api.example.test"
API_IP = UPSTREAM_IPS[4]  # 10.204.0.6 (zone: api.example.test)
DIRECT_PORT = 8443  # served by the same upstream process, not intercepted
MITM_PORT = 18181
HTTP_PORT = 18190
TABLE = "egbm-mitm"
SECRET = "sk-live-BENCH-0c7e11"
PLACEHOLDER = "PLACEHOLDER-BENCH"
PATH = "/v1/models"
DPR = "sandbox.data-plane-ready"
PER_PHASE_CAP_S = 60.0

# Targets (issue 5 item 7): latency added by the MITM, HTTPS, measured against direct.
T_P50_ADDED_MS = 3.0
T_P99_ADDED_MS = 15.0

POLICY = {"defaultAction": "deny", "egress": [{"action": "allow", "target": API}]}
VAULT: dict[str, Any] = {
    "credentials": [{"name": "key", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {
            "name": "api",
            "match": {"hosts": [API], "methods": ["GET"], "paths": ["/v1/*"]},
            "auth": {"type": "bearer", "credential": "key"},
        }
    ],
}

# ---------------------------------------------------------------------------------------------
# the load generator, run inside a sandbox namespace (stdin: JSON commands, stdout: JSON results)

CLIENT = r"""
import http.client, json, socket, ssl, sys, threading, time

class Conn(http.client.HTTPSConnection):
    def __init__(self, host, port, ip, ctx, timeout):
        super().__init__(host, port, context=ctx, timeout=timeout)
        self._ip = ip
    def connect(self):
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)

def run(c):
    ctx = ssl.create_default_context(cafile=c["ca"])
    n, conc, keep, expect = c["n"], c["conc"], c["keepalive"], c["expect_echo_auth"]
    hdrs = {"Authorization": "Bearer " + c["placeholder"], "Connection": "keep-alive" if keep else "close"}
    lock = threading.Lock()
    state = {"next": 0}
    lat, errors, sample = [], {}, {}
    deadline = time.monotonic() + c["deadline_s"]
    conns = [None] * conc
    if keep:  # connection set up outside the timed loop
        for i in range(conc):
            conns[i] = Conn(c["host"], c["port"], c["ip"], ctx, 5.0)
            conns[i].connect()
    start = threading.Barrier(conc + 1)

    def err(kind):
        with lock:
            errors[kind] = errors.get(kind, 0) + 1

    def worker(i):
        conn = conns[i]
        start.wait()
        while True:
            with lock:
                if state["next"] >= n or time.monotonic() > deadline:
                    return
                state["next"] += 1
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = Conn(c["host"], c["port"], c["ip"], ctx, 5.0)
                conn.request("GET", c["path"], headers=hdrs)
                r = conn.getresponse()
                body = r.read()
                t1 = time.perf_counter()
                got = r.getheader("X-Echo-Authorization")
                if r.status != 200:
                    err("status %d" % r.status)
                elif got != expect:
                    err("upstream saw %r" % (got,))
                else:
                    with lock:
                        lat.append((t1 - t0) * 1000.0)
                        if not sample:
                            echo = json.loads(body)
                            sample.update(port=echo.get("port"), tls=echo.get("tls"), local=echo.get("local"))
            except Exception as exc:
                err(type(exc).__name__)
                if conn is not None:
                    conn.close()
                conn = None
                continue
            if not keep:
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(conc)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join(c["deadline_s"] + 10)
    wall = time.perf_counter() - t0
    return {"lat_ms": lat, "errors": errors, "attempted": state["next"], "wall_s": wall, "sample": sample}

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    if not line.strip():
        continue
    try:
        out = run(json.loads(line))
    except Exception as exc:
        out = {"fatal": "%s: %s" % (type(exc).__name__, exc)}
    print(json.dumps(out), flush=True)
"""


class BenchError(RuntimeError):
    pass


class Interrupted(BaseException):  # BaseException so nothing swallows it before ``finally``
    pass


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(f"signal {signal.Signals(signum).name}")


def log(msg: str) -> None:
    print(f"[bench-mitm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# statistics and /proc


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; failed requests are +inf, so they count as the slowest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100.0 * len(ordered))) - 1]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM in KiB."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        m = re.search(r"^PPid:\s+(\d+)", status, re.M)
        if m and int(m.group(1)) == pid:
            out.append(int(entry.name))
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


# ---------------------------------------------------------------------------------------------
# topology


class LogTail:
    """New text of a growing log file since the last :meth:`read`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def read(self) -> str:
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        return data.decode("utf-8", "replace")


def lookup_ms(text: str) -> list[float]:
    return [
        float(m.group(1))
        for line in text.splitlines()
        if "mitm.injected" in line
        for m in [re.search(r'"lookup_ms":\s*([0-9.]+)', line)]
        if m
    ]


class BenchTopology(Topology):
    """The kernel tests' topology, with the upstream also serving HTTPS on ``DIRECT_PORT``."""

    def spawn(self, ns: str, *cmd: str, **kw: Any) -> subprocess.Popen[str]:
        args = list(cmd)
        if any(a.endswith("fleet_upstream.py") for a in args) and "--https-ports" in args:
            i = args.index("--https-ports")
            args[i + 1] = f"443,{DIRECT_PORT}"
        return super().spawn(ns, *args, **kw)


@dataclass
class PathSpec:
    name: str
    sb: int
    port: int
    ca: str
    expect_echo_auth: str  # X-Echo-Authorization the client must see
    lat: dict[str, list[float]] = field(default_factory=dict)  # phase -> samples (inf = failed)
    errors: dict[str, dict[str, int]] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> process -> s
    lookup: dict[str, list[float]] = field(default_factory=dict)  # phase -> addon lookup_ms


class Client:
    def __init__(self, topo: Topology, sb: int) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", topo.sb(sb), str(VENV_PY), "-c", CLIENT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        topo.procs.append(self.proc)  # stopped by Topology.down
        if json.loads(self._readline(20)).get("ready") is not True:
            raise BenchError(f"client in sb{sb} did not start")

    def _readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise BenchError("client did not answer in time")
        line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"client exited ({self.proc.poll()})")
        return line

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self._readline(float(cmd["deadline_s"]) + 30))
        if "fatal" in out:
            raise BenchError(f"client: {out['fatal']}")
        return dict(out)


def post_ok(d: Daemon, body: dict[str, object]) -> None:
    code, text = d.post(body)
    if (code, text) != (200, "{}"):
        raise BenchError(f"action {body['operation']}: {code} {text[:300]}")


def put_vault(d: Daemon, uid: str) -> None:
    path = d.topo.workdir / "vault.json"
    path.write_text(json.dumps(VAULT))
    code, text = d._curl(
        "-X",
        "PUT",
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        f"@{path}",
        f"http://127.0.0.1:{d.port}/v1/sandboxfleets/{uid}/egress/credential-vault",
    )
    if code != 201:
        raise BenchError(f"vault PUT: {code} {text[:300]}")


def learn(topo: Topology, sb: int) -> None:
    status, answers = topo.dig(sb, API)
    if status != "NOERROR" or API_IP not in answers:
        raise BenchError(f"sb{sb} could not resolve {API}: {status} {answers}")


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Phase:
    key: str
    label: str
    keepalive: bool
    conc: int
    n: int


def phases(args: argparse.Namespace) -> list[Phase]:
    out = [
        Phase("new-seq", "new conn, sequential", False, 1, args.n_seq),
        Phase(f"new-c{args.conc}", f"new conn, {args.conc} in flight", False, args.conc, args.n_conc),
    ]
    if args.keepalive:
        out += [
            Phase("ka-seq", "keep-alive, sequential", True, 1, args.n_seq),
            Phase(f"ka-c{args.conc}", f"keep-alive, {args.conc} in flight", True, args.conc, args.n_conc),
        ]
    return out


def run_bench(args: argparse.Namespace, out: list[str]) -> None:
    def emit(line: str = "") -> None:
        out.append(line)
        print(line, flush=True)

    topo = BenchTopology(prefix=f"egbm{os.getpid()}", sandboxes=2)
    started = time.monotonic()
    load0 = os.getloadavg()
    topo.up_()
    try:
        upstream_pid = topo.procs[0].pid
        env = {
            "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
            "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
            "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
            "EGRESSD_MITM_CONFDIR": str(topo.workdir / "mitm-conf"),
            "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "mitm-run" / "active.sock"),
            **dict(kv.split("=", 1) for kv in args.daemon_env),
        }
        d = Daemon(topo, table=TABLE, port=HTTP_PORT, env=env)
        d.start(wait=False)
        d.wait_ready(timeout=30)
        assert d.proc is not None
        egressd_pid = d.proc.pid
        kids = children(egressd_pid)
        if len(kids) != 1:
            raise BenchError(f"expected one mitmdump child of egressd {egressd_pid}, got {kids}")
        mitm_pid = kids[0]
        log(
            f"egressd pid {egressd_pid} ({comm(egressd_pid)}), mitmdump pid {mitm_pid}, upstream {upstream_pid}"
        )

        post_ok(d, envelope("SET_BINDING", "bm1", ip=Topology.sb_ip(1), policy=POLICY))
        post_ok(d, envelope("LIFECYCLE_HOOK", "bm1", hook=DPR))
        put_vault(d, "bm1")
        post_ok(d, envelope("SET_BINDING", "bm2", ip=Topology.sb_ip(2), policy=POLICY))
        post_ok(d, envelope("LIFECYCLE_HOOK", "bm2", hook=DPR))
        learn(topo, 1)
        learn(topo, 2)

        mitm_ca = str(topo.workdir / "mitm-conf" / "mitmproxy-ca-cert.pem")
        up_ca = str(topo.tls_dir / "ca.pem")
        paths = [
            PathSpec("direct", 1, DIRECT_PORT, up_ca, f"Bearer {PLACEHOLDER}"),
            PathSpec("mitm+inject", 1, 443, mitm_ca, "[REDACTED]"),
            PathSpec("mitm pass", 2, 443, mitm_ca, f"Bearer {PLACEHOLDER}"),
        ]
        clients = {1: Client(topo, 1), 2: Client(topo, 2)}
        procs = {"egressd": egressd_pid, "mitmdump": mitm_pid, "upstream": upstream_pid}
        for sb, c in clients.items():
            procs[f"client{sb}"] = c.proc.pid
        rss_before = {
            name: proc_status(pid) for name, pid in procs.items() if name in ("egressd", "mitmdump")
        }
        assert d.log is not None
        daemon_log = LogTail(d.log)
        rss_phase: dict[str, dict[str, int]] = {}
        raw_batches: list[dict[str, Any]] = []

        def batch(p: PathSpec, n: int, conc: int, keepalive: bool, deadline: float) -> dict[str, Any]:
            return clients[p.sb].run(
                {
                    "host": API,
                    "ip": API_IP,
                    "port": p.port,
                    "ca": p.ca,
                    "path": PATH,
                    "placeholder": PLACEHOLDER,
                    "expect_echo_auth": p.expect_echo_auth,
                    "n": n,
                    "conc": conc,
                    "keepalive": keepalive,
                    "deadline_s": deadline,
                }
            )

        # Warm-up (not recorded): leaf certificate minted, vault snapshot cached, code paths hot.
        for p in paths:
            r = batch(p, args.warmup, 1, False, 20)
            if r["errors"] or len(r["lat_ms"]) != args.warmup:
                raise BenchError(f"warm-up {p.name}: {r['errors']} ({len(r['lat_ms'])} ok)")
            s = r["sample"]
            if s.get("port") != p.port or s.get("tls") is not True or s.get("local") != API_IP:
                raise BenchError(f"warm-up {p.name}: upstream saw {s}")
        log("warm-up ok: direct reaches :8443, both MITM paths :443, key injected on mitm+inject only")

        for ph in phases(args):
            k = args.batches
            order: list[PathSpec] = []
            for r_ in range(k):
                order += paths if r_ % 2 == 0 else list(reversed(paths))
            for p in paths:
                p.lat[ph.key], p.errors[ph.key], p.wall[ph.key] = [], {}, 0.0
                p.cpu[ph.key] = dict.fromkeys(procs, 0.0)
                p.lookup[ph.key] = []
            for i, p in enumerate(order):
                n = ph.n // k + (1 if (i // len(paths)) < ph.n % k else 0)
                learn(topo, p.sb)  # keep the DNS lease fresh (zone TTL 30 s), outside the timing
                daemon_log.read()
                c0 = {name: cpu_s(pid) for name, pid in procs.items()}
                r = batch(p, n, ph.conc, ph.keepalive, PER_PHASE_CAP_S / k)
                c1 = {name: cpu_s(pid) for name, pid in procs.items()}
                time.sleep(0.05)  # the supervisor re-logs the addon's last lines
                p.lookup[ph.key] += lookup_ms(daemon_log.read())
                failed = r["attempted"] - len(r["lat_ms"])
                p.lat[ph.key] += r["lat_ms"] + [math.inf] * failed + [math.inf] * (n - r["attempted"])
                for kind, cnt in r["errors"].items():
                    p.errors[ph.key][kind] = p.errors[ph.key].get(kind, 0) + cnt
                if r["attempted"] < n:
                    p.errors[ph.key]["not sent (time cap)"] = p.errors[ph.key].get(
                        "not sent (time cap)", 0
                    ) + (n - r["attempted"])
                p.wall[ph.key] += r["wall_s"]
                raw_batches.append(
                    {
                        "phase": ph.key,
                        "path": p.name,
                        "t": time.time(),
                        "lat_ms": r["lat_ms"],
                        "errors": r["errors"],
                    }
                )
                for name in procs:
                    p.cpu[ph.key][name] += c1[name] - c0[name]
            rss_phase[ph.key] = {n: proc_status(procs[n]).get("VmRSS", 0) for n in ("egressd", "mitmdump")}
            log(f"{ph.label}: done")

        rss_after = {name: proc_status(pid) for name, pid in procs.items() if name in ("egressd", "mitmdump")}
        if children(egressd_pid) != [mitm_pid]:
            raise BenchError("mitmdump was restarted during the run: figures not comparable")
        if args.json_out:
            args.json_out.write_text(json.dumps({"batches": raw_batches}))
        whole = d.log_text()
        refused, mitm_errors = whole.count("mitm.refused"), whole.count("mitm.error")

        profile_lines = profile(args, topo, clients[1], paths[1], procs) if args.profile else []
        report(args, emit, paths, procs, rss_before, rss_after, rss_phase, refused, mitm_errors, load0)
        for line in profile_lines:
            emit(line)
        emit()
        emit(f"total {time.monotonic() - started:.0f}s")
    finally:
        topo.down()


def report(
    args: argparse.Namespace,
    emit: Any,
    paths: list[PathSpec],
    procs: dict[str, int],
    rss_before: dict[str, dict[str, int]],
    rss_after: dict[str, dict[str, int]],
    rss_phase: dict[str, dict[str, int]],
    refused: int,
    mitm_errors: int,
    load0: tuple[float, float, float],
) -> None:
    import mitmproxy.version

    load1 = os.getloadavg()
    emit(
        f"egressd MITM benchmark  ({datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%dT%H:%M:%S+0000')}, "
        f"{os.cpu_count()} CPUs, kernel {platform.release()}, Python {platform.python_version()}, "
        f"mitmproxy {mitmproxy.version.VERSION}, egressd {git_rev()})"
    )
    emit(
        f"load average (1/5/15 min) at start {'/'.join(f'{x:.2f}' for x in load0)}, "
        f"at end {'/'.join(f'{x:.2f}' for x in load1)} (other work on this machine skews the figures)"
    )
    emit(
        f"GET https://{API}{PATH} from sandbox namespaces; {args.batches} batches per path and phase, "
        "interleaved direct/inject/pass/pass/inject/direct...; percentiles: nearest rank, failures = +inf"
    )
    emit(
        "direct = :8443 on the same upstream process (not intercepted); mitm+inject = :443 via mitmdump, "
        "vault binding matches (bearer injected); mitm pass = :443 via mitmdump, subject without vault"
    )
    emit()
    head = (
        f"{'phase':<26} {'path':<12} {'n':>5} {'req/s':>7} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7} "
        f"{'mean':>7} {'+p50':>7} {'+p99':>7}  verdict (+p50<={T_P50_ADDED_MS:g}, +p99<={T_P99_ADDED_MS:g} ms)"
    )
    emit("(1) latency, ms (client-side, connect + TLS + request + full response)")
    emit(head)
    verdicts: list[tuple[str, str, float, float]] = []
    for ph in phases(args):
        base = paths[0].lat[ph.key]
        b50, b99 = pct(base, 50), pct(base, 99)
        for p in paths:
            lat = p.lat[ph.key]
            ok = [x for x in lat if math.isfinite(x)]
            mean = sum(ok) / len(ok) if ok else math.nan
            rate = len(ok) / p.wall[ph.key] if p.wall[ph.key] else math.nan
            row = (
                f"{ph.label:<26} {p.name:<12} {len(lat):>5} {rate:>7.0f} {pct(lat, 50):>7.2f} {pct(lat, 90):>7.2f} "
                f"{pct(lat, 99):>7.2f} {max(lat):>7.2f} {mean:>7.2f}"
            )
            if p is paths[0]:
                emit(row)
                continue
            a50, a99 = pct(lat, 50) - b50, pct(lat, 99) - b99
            met = a50 <= T_P50_ADDED_MS and a99 <= T_P99_ADDED_MS
            emit(f"{row} {a50:>+7.2f} {a99:>+7.2f}  {'MET' if met else 'MISSED'}")
            verdicts.append((f"{ph.label}, {p.name}", "MET" if met else "MISSED", a50, a99))
        errs = {p.name: p.errors[ph.key] for p in paths if p.errors[ph.key]}
        if errs:
            emit(f"{'':<26} errors: {errs}")
    emit()
    emit("(2) CPU per request, ms (utime+stime over the batches of that path / successful requests)")
    names = list(procs)
    emit(f"{'phase':<26} {'path':<12} " + " ".join(f"{n:>9}" for n in names))
    for ph in phases(args):
        for p in paths:
            ok = sum(1 for x in p.lat[ph.key] if math.isfinite(x)) or 1
            emit(
                f"{ph.label:<26} {p.name:<12} "
                + " ".join(f"{p.cpu[ph.key][n] * 1000 / ok:>9.3f}" for n in names)
            )
    emit()
    emit("(3) RSS, MiB (VmRSS before the load -> after; VmHWM = peak)")
    for name in ("egressd", "mitmdump"):
        b, a = rss_before.get(name, {}), rss_after.get(name, {})
        emit(
            f"  {name:<9} pid {procs[name]:>7}  {b.get('VmRSS', 0) / 1024:7.1f} -> {a.get('VmRSS', 0) / 1024:7.1f}"
            f"   peak {a.get('VmHWM', 0) / 1024:7.1f}"
        )
    total_b = sum(rss_before.get(n, {}).get("VmRSS", 0) for n in ("egressd", "mitmdump")) / 1024
    total_a = sum(rss_after.get(n, {}).get("VmRSS", 0) for n in ("egressd", "mitmdump")) / 1024
    emit(f"  {'together':<9} {'':>11}  {total_b:7.1f} -> {total_a:7.1f}")
    emit(
        "  after each phase (egressd / mitmdump): "
        + "; ".join(
            f"{ph.label} {rss_phase[ph.key]['egressd'] / 1024:.1f} / {rss_phase[ph.key]['mitmdump'] / 1024:.1f}"
            for ph in phases(args)
            if ph.key in rss_phase
        )
    )
    emit()
    emit(
        "(4) addon `_active` lookup + decision as the addon times it (lookup_ms of mitm.injected, "
        "inside mitmdump's event loop), ms"
    )
    for ph in phases(args):
        lk = paths[1].lookup[ph.key]
        ok = sum(1 for x in paths[1].lat[ph.key] if math.isfinite(x))
        if lk:
            emit(
                f"  {ph.label:<26} n {len(lk):>5} (requests ok {ok:>5})  p50 {pct(lk, 50):6.2f}  "
                f"p90 {pct(lk, 90):6.2f}  p99 {pct(lk, 99):6.2f}  max {max(lk):6.2f}"
            )
    emit(f"  whole daemon log: mitm.refused {refused}, mitm.error {mitm_errors}")
    emit()
    emit("targets (added = MITM path minus direct, same phase):")
    for label, verdict, a50, a99 in verdicts:
        emit(f"  [{verdict:<6}] {label}: +p50 {a50:+.2f} ms, +p99 {a99:+.2f} ms")


def profile(
    args: argparse.Namespace, topo: Topology, client: Client, p: PathSpec, procs: dict[str, int]
) -> list[str]:
    """py-spy (if found) on mitmdump and egressd during an extra new-conn, 16-in-flight inject load."""
    spy = args.py_spy or shutil.which("py-spy")
    if not spy:
        return ["", "(5) profile: py-spy not found (--py-spy PATH)"]
    lines = [
        "",
        f"(5) py-spy --nonblocking, {args.profile_s:g} s of new conn x {args.conc} in flight, mitm+inject",
    ]
    raws = {name: topo.workdir / f"spy-{name}.txt" for name in ("mitmdump", "egressd")}
    spies = [
        subprocess.Popen(
            [
                spy,
                "record",
                "--nonblocking",
                "-r",
                "200",
                "-d",
                str(math.ceil(args.profile_s)),
                "-f",
                "raw",
                "-o",
                str(raw),
                "-p",
                str(procs[name]),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(raw.with_suffix(".err"), "w"),  # noqa: SIM115
        )
        for name, raw in raws.items()
    ]
    time.sleep(0.5)
    learn(topo, p.sb)
    client.run(
        {
            "host": API,
            "ip": API_IP,
            "port": p.port,
            "ca": p.ca,
            "path": PATH,
            "placeholder": PLACEHOLDER,
            "expect_echo_auth": p.expect_echo_auth,
            "n": 100000,
            "conc": args.conc,
            "keepalive": False,
            "deadline_s": args.profile_s - 1,
        }
    )
    for s in spies:
        try:
            s.wait(args.profile_s + 20)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait(5)
    for name, raw in raws.items():
        lines += summarise_profile(name, raw, 200, math.ceil(args.profile_s))
        if args.profile_keep:
            args.profile_keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(raw, args.profile_keep / raw.name)
    return lines


# Frames whose inclusive share is printed (substring of py-spy's "function (file:line)").
FOCUS = {
    "mitmdump": [
        ("TLS handshakes (pyOpenSSL do_handshake, both sides)", "Connection.do_handshake ("),
        ("socket writes (incl. the kernel's veth/nft path)", "_SelectorSocketTransport.write ("),
        ("mitmproxy hook dispatch (all addons)", "AddonManager.trigger_event ("),
        ("  egressd addon requestheaders (total)", "EgressInjector.requestheaders ("),
        ("    _active lookup (aiohttp client)", "ActiveClient.lookup ("),
        ("    decision (inject.decide)", "decide (egressd/mitm/inject.py"),
        ("    emit (JSON line to the supervisor)", "emit (egressd/mitm/addon.py"),
        ("  egressd addon responseheaders (redaction)", "EgressInjector.responseheaders ("),
        ("mitmproxy HTTP message field type checks", "check_option_type ("),
        ("upstream connection open (connect + TLS start)", "ConnectionHandler.open_connection ("),
    ],
    "egressd": [
        ("_active handler (aiohttp server + lookup)", "RequestHandler.start ("),
        ("  active_lookup", "active_lookup ("),
        ("supervisor re-logging the addon's lines (_pump)", "MitmSupervisor._pump ("),
        ("event loop idle (select)", "EpollSelector.select ("),
    ],
}


def summarise_profile(name: str, raw: Path, rate: int, seconds: float) -> list[str]:
    if not raw.exists():
        err = raw.with_suffix(".err")
        return [f"  {name}: no samples: {err.read_text()[-300:] if err.exists() else ''}"]
    total = 0
    by_file: dict[str, int] = {}
    incl: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        m = re.search(r"\(([^()]*?)(?::\d+)?\)$", frames[-1])
        fname = m.group(1) if m else "?"
        by_file[fname] = by_file.get(fname, 0) + n
        for label, sub in FOCUS.get(name, []):
            if any(sub in f for f in frames):
                incl[label] = incl.get(label, 0) + n
    if not total:
        return [f"  {name}: no samples"]
    busy = 100 * total / (rate * seconds)
    out = [
        f"  {name}: {total} samples (~{busy:.0f}% of one CPU in Python frames); inclusive share of samples:"
    ]
    for label, _ in FOCUS.get(name, []):
        out.append(f"    {100 * incl.get(label, 0) / total:5.1f}%  {label}")
    top = sorted(by_file.items(), key=lambda kv: -kv[1])[:6]
    out.append("    self time by file: " + "; ".join(f"{f} {100 * n / total:.1f}%" for f, n in top))
    return out


def git_rev() -> str:
    try:
        r = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return r.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests (60 sequential, 200 in flight)")
    parser.add_argument("--n-seq", type=int, default=300, help="sequential requests per path and phase")
    parser.add_argument("--n-conc", type=int, default=800, help="concurrent requests per path and phase")
    parser.add_argument("--conc", type=int, default=16, help="requests in flight")
    parser.add_argument("--batches", type=int, default=4, help="interleaved batches per path and phase")
    parser.add_argument("--warmup", type=int, default=30, help="unrecorded requests per path first")
    parser.add_argument(
        "--no-keepalive", dest="keepalive", action="store_false", help="skip keep-alive phases"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy mitmdump and egressd under extra load")
    parser.add_argument("--profile-s", type=float, default=8.0)
    parser.add_argument("--py-spy", help="path of py-spy (default: PATH)")
    parser.add_argument("--profile-keep", type=Path, help="copy py-spy's raw stacks into this directory")
    parser.add_argument(
        "--out", type=Path, help="also write the report here (e.g. scripts/bench/results/...)"
    )
    parser.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra egressd env (experiments)",
    )
    parser.add_argument("--json-out", type=Path, help="raw per-batch latencies (in completion order) as JSON")
    args = parser.parse_args()
    if args.quick:
        args.n_seq, args.n_conc = min(args.n_seq, 60), min(args.n_conc, 200)
    if os.geteuid() != 0:
        print("bench_mitm.py needs root (network namespaces, nftables)", file=sys.stderr)
        return 2
    missing = [t for t in ("ip", "nft", "curl", "dig") if shutil.which(t) is None]
    if missing:
        print(f"bench_mitm.py needs {', '.join(missing)}", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    out: list[str] = []
    try:
        run_bench(args, out)
    except (BenchError, Interrupted) as exc:
        print(f"bench_mitm.py: {exc}", file=sys.stderr)
        return 1
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(out) + "\n")
        log(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
