"""Shared scaffolding of the benchmarks in this directory.

Every benchmark runs the same way: the outer process (root namespace) only creates throwaway
network namespaces ``<tag><pid>-<role>`` (every link is created by an ``ip`` running inside one
of them, with its peer moved straight into another, and no namespace gets a default route),
re-executes the benchmark inside one of them (``--inner``), waits, and removes everything again:
on success, on error, on SIGINT/SIGTERM/SIGHUP, and, for a run killed with SIGKILL, on the next
start (owner PID gone, no processes left). The inner process checks that it sits in the new
namespace before it touches nft, starts egressd and the helpers (by PID, ended by PID), measures
and prints a report in which every figure stands next to its baseline from the same run, as a
ratio, under the exact command that reproduces it.

Exit codes: 0 the run completed (whatever the MET/MISSED verdicts), 1 it could not complete,
2 missing privileges or tools, 3 it completed but a CI guard tripped (``Report.guard``),
130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import math
import os
import platform
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV_PY = ROOT / ".venv" / "bin" / "python"
EGRESSD = ROOT / ".venv" / "bin" / "egressd"
UPSTREAM = ROOT / "scripts" / "fleet_upstream.py"
ACTIONS = "/_fastlet/v1/actions"
GATEWAY = "10.203.0.1"
UPLINK_IP = "10.204.0.1"
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_NAME = ["bench"]


class BenchError(RuntimeError):
    """The run cannot complete (a crash, a failed sanity check): exit code 1."""


class Interrupted(BaseException):  # BaseException: nothing swallows it before ``finally``
    pass


def _raise(signum: int, _frame: object) -> None:
    raise Interrupted(f"signal {signal.Signals(signum).name}")


def catch_signals() -> None:
    for sig in _SIGNALS:
        signal.signal(sig, _raise)


def ignore_signals() -> None:
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def log(msg: str) -> None:
    print(f"[{_NAME[0]} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: Sequence[str], timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)
    if check and p.returncode != 0:
        raise BenchError(f"{' '.join(cmd)}: rc={p.returncode} {p.stderr.strip()[:300]}")
    return p


# ---- statistics and /proc ---------------------------------------------------------------------


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; failures recorded as +inf count as the slowest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100.0 * len(ordered))) - 1]


def summary(ms: Sequence[float]) -> dict[str, float]:
    ok = [x for x in ms if math.isfinite(x)]
    out = {f"p{str(q).replace('.', '')}": pct(ms, q) for q in (50, 90, 99, 99.9)}
    out.update(n=len(ms), max=max(ms) if ms else math.nan, mean=sum(ok) / len(ok) if ok else math.nan)
    return out


def mean(xs: Sequence[float]) -> float:
    ok = [x for x in xs if not math.isnan(x)]
    return sum(ok) / len(ok) if ok else math.nan


def cpu_s(pid: int | None, tid: int | None = None) -> float:
    """utime + stime of a process (or one of its threads), in seconds."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_kb(pid: int | None, key: str = "VmRSS") -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs."""
    v = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(v) - v[3] - v[4], sum(v)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and re.search(rf"^PPid:\s+{pid}$", (entry / "status").read_text(), re.M):
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- processes ----------------------------------------------------------------------------------


class Proc:
    """A child of this run, optionally in a namespace; line-wise JSON I/O with deadlines."""

    def __init__(self, argv: Sequence[str], *, ns: str | None = None, log_path: Path | None = None,
                 env: dict[str, str] | None = None, stdin: bool = True, preexec: Callable[[], None] | None = None) -> None:  # fmt: skip
        cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
        err = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.p = subprocess.Popen(
                cmd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=err, cwd=ROOT, env={**os.environ, **(env or {})}, preexec_fn=preexec,
            )  # fmt: skip
        finally:
            if log_path:
                err.close()  # type: ignore[union-attr]
        self.pid, self.buf, self.what = self.p.pid, b"", Path(argv[1] if len(argv) > 1 else argv[0]).name

    def readline(self, timeout: float) -> str:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{self.what} (pid {self.pid}): no answer within {timeout:.0f}s")
            if select.select([self.p.stdout], [], [], min(left, 1.0))[0]:
                chunk = os.read(self.p.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise BenchError(f"{self.what} (pid {self.pid}) exited (rc={self.p.wait(5)})")
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    def read_json(self, timeout: float) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.readline(timeout))
        if "error" in out or "fatal" in out:
            raise BenchError(f"{self.what}: {out.get('error') or out.get('fatal')}")
        return out

    def send(self, cmd: dict[str, Any]) -> None:
        """One command without waiting for its answer (several clients then run at once)."""
        assert self.p.stdin is not None
        self.p.stdin.write((json.dumps(cmd) + "\n").encode())
        self.p.stdin.flush()

    def call(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.send(cmd)
        return self.read_json(timeout)

    def stop(self, grace: float = 10) -> None:
        """TERM, wait, KILL: only this process, by its PID."""
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.p.terminate()
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)


# ---- namespaces ---------------------------------------------------------------------------------


def _root_links() -> set[str]:
    return {ln.split(":")[1].strip().split("@")[0] for ln in run(["ip", "-o", "link"]).stdout.splitlines()}


def netns_pids(ns: str) -> list[int]:
    return [int(x) for x in run(["ip", "netns", "pids", ns]).stdout.split() if x.isdigit()]


def _kill_netns(ns: str) -> None:
    """Everything left in our namespace was started by this run: TERM, wait, KILL, by PID."""
    pids = netns_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    for pid in netns_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Topology:
    """Namespaces ``<tag><pid>-<role>``; build with :meth:`x` / :meth:`veth`, always :meth:`down`."""

    def __init__(self, tag: str, roles: Sequence[str]) -> None:
        self.tag, self.roles, self.base = tag, tuple(roles), f"{tag}{os.getpid()}"
        self.created: list[str] = []

    def ns(self, role: str) -> str:
        return f"{self.base}-{role}"

    def x(self, role: str, *cmd: str) -> str:
        return run(["ip", "netns", "exec", self.ns(role), *cmd], check=True).stdout

    def veth(self, role: str, name: str, peer_role: str, peer: str, *addrs: str) -> None:
        """A veth pair made inside ``role``'s namespace, its peer moved straight into ``peer_role``'s."""
        self.x(
            role, "ip", "link", "add", name, "type", "veth", "peer", "name", peer, "netns", self.ns(peer_role)
        )
        for addr in addrs:
            self.x(role, "ip", "addr", "add", addr, "dev", name)
        self.x(role, "ip", "link", "set", name, "up")

    def cleanup_stale(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir("/run/netns"):
                m = re.fullmatch(rf"{re.escape(self.tag)}(\d+)-[a-z0-9]+", name)
                if m and not _alive(int(m.group(1))):
                    if netns_pids(name):
                        log(f"stale namespace {name} still has processes; leaving it alone")
                    else:
                        log(f"removing stale namespace {name} (owner {m.group(1)} is gone)")
                        run(["ip", "netns", "del", name])

    @contextlib.contextmanager
    def up(self, build: Callable[[Topology], None] | None = None) -> Iterator[Topology]:
        before = _root_links()
        try:
            for role in self.roles:
                run(["ip", "netns", "add", self.ns(role)], check=True)
                self.created.append(self.ns(role))
                self.x(role, "ip", "link", "set", "lo", "up")
            if build:
                build(self)
            for role in self.roles:
                if self.x(role, "ip", "route", "show", "default") + self.x(
                    role, "ip", "-6", "route", "show", "default"
                ):
                    raise BenchError(f"safety: {self.ns(role)} has a default route")
            if _root_links() - before:
                raise BenchError(f"safety: the root namespace gained links {sorted(_root_links() - before)}")
            yield self
        finally:
            ignore_signals()
            for name in reversed(self.created):
                _kill_netns(name)
                if run(["ip", "netns", "del", name]).returncode != 0:
                    log(f"WARNING: ip netns del {name} failed")
            self.created.clear()


def pod_topology(topo: Topology, sandboxes: int, upstream_ips: Sequence[str], prefix: str = "") -> None:
    """pod: bridge br0 10.203.0.1/16 + uplink 10.204.0.1; sandboxes sb<i> 10.203.0.(10+i);
    upstream ``up`` with ``upstream_ips`` (/24). sb<i> routes only 10.204.0.0/24 via the pod,
    ``up`` only 10.203.0.0/16 back: no default route anywhere. With ``prefix`` the roles are
    ``<prefix>pod``, ``<prefix>up``, ``<prefix>sb<i>``: copies with the same addresses side by side."""
    pod, up = f"{prefix}pod", f"{prefix}up"
    topo.x(pod, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    topo.x(pod, "ip", "link", "add", "br0", "type", "bridge")
    topo.x(pod, "ip", "addr", "add", f"{GATEWAY}/16", "dev", "br0")
    topo.x(pod, "ip", "link", "set", "br0", "up")
    run(
        ["ip", "netns", "exec", topo.ns(pod), "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"]
    )  # best effort
    for i in range(1, sandboxes + 1):
        sb = f"{prefix}sb{i}"
        topo.veth(pod, f"vh{i}", sb, "eth0")
        topo.x(pod, "ip", "link", "set", f"vh{i}", "master", "br0")
        topo.x(sb, "ip", "addr", "add", f"10.203.0.{10 + i}/16", "dev", "eth0")
        topo.x(sb, "ip", "link", "set", "eth0", "up")
        topo.x(sb, "ip", "route", "add", "10.204.0.0/24", "via", GATEWAY)
    topo.veth(pod, "uplink", up, "eth0", f"{UPLINK_IP}/24")
    for ip in upstream_ips:
        topo.x(up, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
    topo.x(up, "ip", "link", "set", "eth0", "up")
    topo.x(up, "ip", "route", "add", "10.203.0.0/16", "via", UPLINK_IP)


def assert_in(ns: str, outer_ino: int) -> None:
    """Refuse to touch nft unless this process sits in the namespace the outer side created."""
    mine, expected = os.stat("/proc/self/ns/net").st_ino, os.stat(f"/run/netns/{ns}").st_ino
    if mine == outer_ino or mine != expected:
        raise BenchError(f"safety: not inside netns {ns} (self={mine} outer={outer_ino} expected={expected})")


@contextlib.contextmanager
def in_netns(ns: str | None) -> Iterator[None]:
    """This thread inside ``ns`` (one of this run's namespaces) for the block, then back home.

    A socket keeps the namespace it was created in, so a loopback connection to a daemon in a
    sibling namespace is made this way; nothing else runs while the thread is away."""
    if ns is None:
        yield
        return
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{ns}") as there:
        os.setns(there.fileno(), os.CLONE_NEWNET)
        try:
            yield
        finally:
            os.setns(home.fileno(), os.CLONE_NEWNET)


# ---- egressd ------------------------------------------------------------------------------------


class _NsConnection(http.client.HTTPConnection):
    def __init__(self, port: int, timeout: float, netns: str | None) -> None:
        super().__init__("127.0.0.1", port, timeout=timeout)
        self._netns = netns

    def connect(self) -> None:
        with in_netns(self._netns):
            super().connect()


class Http:
    """One keep-alive HTTP/1.1 connection to 127.0.0.1 (inside the namespace, or ``netns``)."""

    def __init__(self, port: int, timeout: float = 120, netns: str | None = None) -> None:
        self.conn: http.client.HTTPConnection = _NsConnection(port, timeout, netns)

    def request(self, method: str, path: str, body: bytes | None = None,
                ctype: str = "application/json") -> tuple[int, bytes, float]:  # fmt: skip
        t0 = time.perf_counter()
        try:
            self.conn.request(
                method, path, body=body, headers={"Content-Type": ctype} if body is not None else {}
            )
            resp = self.conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise
        return resp.status, data, time.perf_counter() - t0

    def action(self, body: bytes, what: str = "") -> float:
        status, data, dt = self.request("POST", ACTIONS, body)
        if status != 200:
            raise BenchError(f"{what or 'action'}: HTTP {status}: {data.decode(errors='replace')[:300]}")
        return dt

    def close(self) -> None:
        self.conn.close()


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([0-9.eE+-]+|NaN|[+-]Inf)$")


def scrape(h: Http) -> dict[str, float]:
    """egressd's /metrics without histogram buckets."""
    status, data, _ = h.request("GET", "/metrics")
    if status != 200:
        raise BenchError(f"/metrics: HTTP {status}")
    return {
        m[1]: float(m[2])
        for ln in data.decode().splitlines()
        if (m := _METRIC.match(ln)) and "_bucket" not in m[1]
    }


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def nft_ms(d: dict[str, float], op: str) -> tuple[float, int]:
    """(sum ms, count) of egressd's nft transactions of ``op`` in a metrics delta."""
    key = 'egressd_nft_transaction_duration_seconds_{}{{operation="' + op + '"}}'
    return 1000.0 * d.get(key.format("sum"), 0.0), int(d.get(key.format("count"), 0.0))


class Egressd:
    """The real ``.venv/bin/egressd`` (fleet profile) in this namespace (or ``netns``), ended by PID."""

    def __init__(self, workdir: Path, port: int, table: str, env: dict[str, str] | None = None,
                 netns: str | None = None) -> None:  # fmt: skip
        self.workdir, self.port, self.table, self.env = workdir, port, table, dict(env or {})
        self.netns = netns
        self.log_path = workdir / f"egressd-{table}.log"
        (workdir / "always-rules").mkdir(exist_ok=True)
        self.proc: Proc | None = None

    def start(self, argv: Sequence[str] | None = None, timeout: float = 60) -> float:
        env = {
            "OPENSANDBOX_EGRESS_PROFILE": "fleet", "EGRESSD_NFT_TABLE": self.table,
            "OPENSANDBOX_EGRESS_HTTP_ADDR": f"127.0.0.1:{self.port}", "EGRESSD_LOG_FORMAT": "json",
            "EGRESSD_ALWAYS_RULES_DIR": str(self.workdir / "always-rules"), **self.env,
        }  # fmt: skip
        t0 = time.perf_counter()
        self.proc = Proc(argv or [str(EGRESSD)], ns=self.netns, log_path=self.log_path, env=env, stdin=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.p.poll() is not None:
                raise BenchError(f"egressd exited with {self.proc.p.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                h = Http(self.port, 2, self.netns)
                try:
                    if h.request("GET", "/healthz")[0] == 200:
                        return time.perf_counter() - t0
                finally:
                    h.close()
            time.sleep(0.05)
        raise BenchError(f"egressd not ready after {timeout:.0f}s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def check_alive(self) -> None:
        if self.proc is None or self.proc.p.poll() is not None:
            raise BenchError(f"egressd died:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(15)
        self.proc = None
        # shutdown keeps it; later phases must not see it
        run(
            [
                *(["ip", "netns", "exec", self.netns] if self.netns else []),
                "nft",
                "delete",
                "table",
                "inet",
                self.table,
            ]
        )


def envelope(op: str, uid: str, *, ip: str | None = None, policy: str | None = None, hook: bool = False,
             generation: int = 1, gateway: str = GATEWAY) -> bytes:  # fmt: skip
    """A Fastlet action envelope: SET_BINDING with ip + policy, data-plane-ready, REMOVE_BINDING."""
    env: dict[str, Any] = {
        "apiVersion": "sandbox.fast.io/actions/v1", "operation": op, "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": f"rt-{uid}", "attachmentId": "att-1", "specGeneration": generation},
    }  # fmt: skip
    if ip is not None:
        env["attachment"] = {"network": {"ip": ip, "gateway": gateway, "hostVeth": f"vh-{uid}"[:15]}}
    if policy is not None:
        env["binding"] = {"input": policy}
    if hook:
        env["hook"] = {"name": "sandbox.data-plane-ready", "sequence": 1}
    return json.dumps(env).encode()


def policy(default: str = "deny", *rules: tuple[str, str] | tuple[str, str, dict[str, Any]]) -> str:
    """A policy document; a rule is ``(action, target)`` or ``(action, target, extra fields)``
    (``{"ports": [443]}``, docs/reference/behaviour.md §18)."""
    egress = [{"action": r[0], "target": r[1], **(r[2] if len(r) > 2 else {})} for r in rules]
    return json.dumps({"defaultAction": default, "egress": egress}, separators=(",", ":"))


# ---- report -------------------------------------------------------------------------------------


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base and math.isfinite(value) and math.isfinite(base) else "-"


class Report:
    """Header (machine, load, git, the reproducing command), free lines, tables, targets."""

    def __init__(self, title: str, command: str) -> None:
        self.command, self.lines = command, [title]
        self.targets: list[str] = []
        self.guards: list[str] = []
        self.tripped = False
        self.started, self.load0 = time.monotonic(), os.getloadavg()
        head = run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).stdout.strip() or "?"
        dirty = run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "egressd"]).stdout.splitlines()
        self.add(
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%SZ}, {os.cpu_count()} CPUs, kernel"
            f" {platform.release()}, Python {platform.python_version()}, egressd {head}"
            + (f" + {len(dirty)} changed paths under egressd/" if dirty else "")
        )
        self.add(f"reproduce: {command}")
        self.add("percentiles: nearest rank, failures count as +inf; ratio = value / baseline of this run")

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def table(self, head: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        cells = [[_cell(c) for c in r] for r in [head, *rows]]
        widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(head))]
        for k, r in enumerate(cells):
            self.add(
                "  "
                + "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=False))
                )
            )
            if k == 0:
                self.add("  " + "  ".join("-" * w for w in widths))

    def target(self, name: str, met: bool, measured: str, target: str) -> None:
        self.targets.append(f"  [{'MET' if met else 'MISSED':<6}] {name}: {measured}   (target {target})")

    def unjudged(self, name: str, why: str, target: str) -> None:
        """A target this run cannot judge (its comparison is missing): neither MET nor MISSED."""
        self.targets.append(f"  [{'n/a':<6}] {name}: {why}   (target {target})")

    def guard(self, name: str, ok: bool, measured: str, limit: str) -> None:
        """A CI guard: unlike a target, a tripped guard makes the run exit with 3 (after the report)."""
        self.guards.append(f"  [{'ok' if ok else 'TRIPPED':<7}] {name}: {measured}   (guard {limit})")
        self.tripped = self.tripped or not ok

    def text(self) -> str:
        load1 = os.getloadavg()
        tail = ["", "targets (a MISSED target does not fail the run):", *self.targets] if self.targets else []
        if self.guards:
            tail += ["", "CI guards (a TRIPPED guard fails the run: exit 3):", *self.guards]
        return "\n".join([
            *self.lines[:2],
            "load average (1/5/15 min) at start " + "/".join(f"{x:.2f}" for x in self.load0)
            + ", at end " + "/".join(f"{x:.2f}" for x in load1) + " (other work on this machine skews the figures)",
            *self.lines[2:], *tail, "", f"total {time.monotonic() - self.started:.0f}s; reproduce: {self.command}", "",
        ])  # fmt: skip


def _cell(c: object) -> str:
    if isinstance(c, float):
        return (
            "-" if math.isnan(c) else ("inf" if math.isinf(c) else f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}")
        )
    return str(c)


# ---- the outer / inner driver -------------------------------------------------------------------


def parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"CI size, < 60 s: {quick_help}")
    p.add_argument("--out", type=Path, help="also write the report to this file")
    p.add_argument("--json-out", type=Path, help="also write the raw results as JSON")
    for hidden in ("--inner", "--workdir", "--outer-ino"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    return p


def json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    return [json_safe(v) for v in x] if isinstance(x, list | tuple) else x


Inner = Callable[[argparse.Namespace, Topology, Path, Report], dict[str, Any] | None]


def main(name: str, tag: str, roles: Sequence[str], inner_role: str, args: argparse.Namespace, inner: Inner,
         build: Callable[[Topology], None] | None = None, tools: Sequence[str] = ("ip", "nft")) -> int:  # fmt: skip
    """Outer side: topology up, this script again inside ``inner_role``'s namespace, topology down."""
    _NAME[0] = name
    topo = Topology(tag, roles)
    argv = sys.argv[1:]
    if args.inner:
        topo.base = args.inner
        return _inner_main(args, topo, inner, inner_role, argv)
    if os.geteuid() != 0:
        print(f"{name}: needs root (network namespaces, nftables)", file=sys.stderr)
        return 2
    missing = [t for t in tools if shutil.which(t) is None] + (
        [] if EGRESSD.exists() else ["scripts/install.sh"]
    )
    if missing:
        print(f"{name}: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    catch_signals()
    workdir = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
    rc, t0 = 1, time.monotonic()
    try:
        topo.cleanup_stale()
        with topo.up(build):
            log(f"namespaces {topo.base}-{{{','.join(roles)}}}, workdir {workdir}")
            proc = subprocess.Popen(
                ["ip", "netns", "exec", topo.ns(inner_role), sys.executable, str(Path(sys.argv[0]).resolve()), *argv,
                 "--inner", topo.base, "--workdir", str(workdir), "--outer-ino", str(os.stat("/proc/self/ns/net").st_ino)],
            )  # fmt: skip
            try:
                rc = proc.wait()
            finally:  # first the inner side stops its processes and drops its tables, then the teardown
                ignore_signals()
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(40)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(10)
    except Interrupted as exc:
        log(f"interrupted ({exc}); cleaned up")
        rc = 130
    except (BenchError, OSError, subprocess.SubprocessError) as exc:
        print(f"{name}: FAILED: {exc}", file=sys.stderr)
        rc = 1
    finally:
        ignore_signals()
        shutil.rmtree(workdir, ignore_errors=True)
    log(f"{'completed' if rc == 0 else f'FAILED (rc={rc})'} in {time.monotonic() - t0:.1f}s")
    return rc


_DROP = ("--out", "--json-out", "--inner", "--workdir", "--outer-ino")


def _inner_main(args: argparse.Namespace, topo: Topology, inner: Inner, role: str, argv: list[str]) -> int:
    catch_signals()
    keep, skip = [], False
    for a in argv:  # the reproducing command: the user's arguments without output files and hidden ones
        if skip or a in _DROP:
            skip = not skip
        elif a.split("=", 1)[0] not in _DROP:
            keep.append(a)
    report = Report(
        f"egressd {_NAME[0]} benchmark",
        shlex.join([".venv/bin/python", os.path.relpath(sys.argv[0], ROOT), *keep]),
    )
    try:
        assert_in(topo.ns(role), int(args.outer_ino))
        raw = inner(args, topo, Path(args.workdir), report)
    except BenchError as exc:
        print(f"{_NAME[0]}: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    except Interrupted as exc:
        print(f"{_NAME[0]}: interrupted ({exc})", file=sys.stderr, flush=True)
        return 130
    text = report.text()
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json_out and raw is not None:
        args.json_out.write_text(json.dumps(json_safe(raw), indent=1) + "\n")
    if report.tripped:
        print(f"{_NAME[0]}: a CI guard tripped (see the report)", file=sys.stderr, flush=True)
        return 3
    return 0
