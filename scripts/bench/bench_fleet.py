#!/usr/bin/env python3
"""Fleet-profile benchmark: action latency, removal scaling, update throughput, in-process vs exec.

Run as root from the repository root::

    .venv/bin/python scripts/bench/bench_fleet.py [--sizes 10,100,1000] [--quick] [--json-out FILE]

Everything kernel-related happens in a network namespace this script creates (``egbench-<pid>``,
loopback only, no route out) and deletes again, also on failure or SIGINT/SIGTERM/SIGHUP. The
script re-executes itself inside that namespace (``--inner``); the outer process only creates
and deletes the namespace, forwards signals and prints the report. The root namespace never
gets an nft table, route or link. See README.md next to this file.
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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EGRESSD = ROOT / ".venv" / "bin" / "egressd"
NS_PREFIX = "egbench-"
HTTP_PORT = 18480
ACTIONS = "/_fastlet/v1/actions"
API = "sandbox.fast.io/actions/v1"
DAEMON_TABLE = "egbench_fleet"
DIRECT_TABLE = "egbench_direct"
GATEWAY = "10.100.0.1"
BG_BASE = int(ipaddress.IPv4Address("10.100.0.16"))
MEASURED_BASE = int(ipaddress.IPv4Address("10.101.0.16"))
HTTP_TIMEOUT_S = 120.0
CONCURRENCY = 8

# Targets (from the brief); printed next to the figures.
T_SET_P99_MS = 5.0
T_SET_AT = 1000
T_REMOVE_RATIO = 2.0
T_UPDATES_PER_S = 1000.0
T_UPDATES_AT = 100
T_INPROC_SPEEDUP = 10.0


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
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# statistics


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p99 of 30 samples is the maximum)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": pct(ms, 50),
        "p99_ms": pct(ms, 99),
        "mean_ms": sum(ms) / len(ms) if ms else math.nan,
        "min_ms": min(ms) if ms else math.nan,
        "max_ms": max(ms) if ms else math.nan,
    }


# ---------------------------------------------------------------------------------------------
# workload: subjects, policies, envelopes


def bg_ip(i: int) -> str:
    return str(ipaddress.IPv4Address(BG_BASE + i))


def measured_ip(i: int) -> str:
    return str(ipaddress.IPv4Address(MEASURED_BASE + i))


def policy_text(k: int, variant: int) -> str:
    """A few IP/CIDR rules (v4 + v6) plus one domain rule; ``variant`` changes the content."""
    return json.dumps(
        {
            "defaultAction": "deny",
            "egress": [
                {"action": "allow", "target": f"203.0.113.{k % 250 + 1}"},
                {"action": "allow", "target": f"198.51.{variant % 250}.0/24"},
                {"action": "deny", "target": f"192.0.2.{variant % 250 + 1}"},
                {"action": "allow", "target": f"2001:db8:{k % 65535:x}::/48"},
                {"action": "allow", "target": "pypi.org"},
            ],
        },
        separators=(",", ":"),
    )


def _revision(uid: str, generation: int | None = None) -> dict[str, Any]:
    rev: dict[str, Any] = {"runtimeInstanceId": f"rt-{uid}", "attachmentId": "att-1"}
    if generation is not None:
        rev["specGeneration"] = generation
    return rev


def set_binding_body(uid: str, ip: str, policy: str, generation: int = 1) -> bytes:
    return json.dumps(
        {
            "apiVersion": API,
            "operation": "SET_BINDING",
            "sandbox": {"uid": uid},
            "revision": _revision(uid, generation),
            "attachment": {"network": {"ip": ip, "gateway": GATEWAY, "hostVeth": f"vh-{uid}"[:15]}},
            "binding": {"input": policy},
        }
    ).encode()


def hook_body(uid: str) -> bytes:
    return json.dumps(
        {
            "apiVersion": API,
            "operation": "LIFECYCLE_HOOK",
            "sandbox": {"uid": uid},
            "revision": _revision(uid),
            "hook": {"name": "sandbox.data-plane-ready", "sequence": 1},
        }
    ).encode()


def remove_body(uid: str) -> bytes:
    return json.dumps(
        {
            "apiVersion": API,
            "operation": "REMOVE_BINDING",
            "sandbox": {"uid": uid},
            "revision": _revision(uid),
        }
    ).encode()


# ---------------------------------------------------------------------------------------------
# inner side (runs inside the namespace)


def assert_in_bench_netns(ns: str, outer_ino: int) -> None:
    """Refuse to touch nft unless this process sits in the namespace the outer side created."""
    mine = os.stat("/proc/self/ns/net").st_ino
    expected = os.stat(f"/run/netns/{ns}").st_ino
    if mine == outer_ino or mine != expected:
        raise BenchError(f"safety: not inside netns {ns} (self={mine} outer={outer_ino} expected={expected})")


class Client:
    """One keep-alive HTTP/1.1 connection to the daemon (http.client)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, float]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        t0 = time.perf_counter()
        self.conn.request(method, path, body=body, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        return resp.status, data, time.perf_counter() - t0

    def action(self, body: bytes, what: str) -> float:
        status, data, dt = self.request("POST", ACTIONS, body)
        if status != 200:
            raise BenchError(f"{what}: HTTP {status}: {data.decode(errors='replace').strip()[:300]}")
        return dt

    def close(self) -> None:
        self.conn.close()


_METRIC_RE = re.compile(
    r'^egressd_nft_transaction_duration_seconds_(sum|count)\{operation="([a-z_]+)"\} ([0-9.eE+-]+)$'
)


def nft_metrics(client: Client) -> dict[str, dict[str, float]]:
    status, data, _ = client.request("GET", "/metrics")
    if status != 200:
        raise BenchError(f"/metrics: HTTP {status}")
    out: dict[str, dict[str, float]] = {}
    for line in data.decode().splitlines():
        m = _METRIC_RE.match(line)
        if m:
            out.setdefault(m.group(2), {"sum": 0.0, "count": 0.0})[m.group(1)] = float(m.group(3))
    return out


def nft_delta_ms(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Mean server-side nft transaction time per operation between two scrapes."""
    out: dict[str, Any] = {}
    for op, a in after.items():
        b = before.get(op, {"sum": 0.0, "count": 0.0})
        n = a["count"] - b["count"]
        if n > 0:
            d = (a["sum"] - b["sum"]) * 1000.0
            out[op] = {"count": int(n), "sum_ms": d, "mean_ms": d / n}
    return out


def path_without(tool: str) -> str:
    """``$PATH`` minus every directory holding ``tool`` (diagnostic: egressd then cannot exec it)."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    return os.pathsep.join(d for d in dirs if not os.access(os.path.join(d, tool), os.X_OK))


class Daemon:
    def __init__(self, workdir: Path, port: int, table: str, *, hide_conntrack: bool = False) -> None:
        self.port = port
        self.table = table
        self.hide_conntrack = hide_conntrack
        self.rules_dir = workdir / "always-rules"
        self.rules_dir.mkdir(exist_ok=True)
        self.log_path = workdir / "egressd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 60.0) -> float:
        env = dict(os.environ)
        env.update(
            {
                "OPENSANDBOX_EGRESS_PROFILE": "fleet",
                "EGRESSD_ALWAYS_RULES_DIR": str(self.rules_dir),
                "EGRESSD_NFT_TABLE": self.table,
                "OPENSANDBOX_EGRESS_HTTP_ADDR": f"127.0.0.1:{self.port}",
                "EGRESSD_LOG_FORMAT": "json",
            }
        )
        if self.hide_conntrack:
            env["PATH"] = path_without("conntrack")
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [str(EGRESSD)], env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(
                    f"egressd exited with {self.proc.returncode} during start:\n{self.log_tail()}"
                )
            try:
                c = Client(self.port)
                try:
                    status, _, _ = c.request("GET", "/healthz")
                finally:
                    c.close()
                if status == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.05)
        raise BenchError(f"egressd not ready after {ready_timeout_s}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


def nft_delete_table(table: str) -> None:
    subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, timeout=120, check=False)


# ---- (a) (b) (c): through the daemon -----------------------------------------------------------


class FleetRun:
    def __init__(self, client: Client, port: int) -> None:
        self.client = client
        self.port = port
        self.registered = 0
        self.generation: dict[int, int] = {}  # bg index -> last policy variant / specGeneration
        self.measured_seq = 0

    def register_background(self, upto: int) -> dict[str, Any]:
        """SET_BINDING + data-plane-ready for bg-<i> until ``upto`` active subjects exist."""
        start_n = self.registered
        t0 = time.perf_counter()
        set_t: list[float] = []
        hook_t: list[float] = []
        while self.registered < upto:
            i = self.registered
            uid = f"bg-{i}"
            set_t.append(
                self.client.action(set_binding_body(uid, bg_ip(i), policy_text(i, 0)), f"SET_BINDING {uid}")
            )
            hook_t.append(self.client.action(hook_body(uid), f"data-plane-ready {uid}"))
            self.generation[i] = 1
            self.registered += 1
            if self.registered % 100 == 0:
                log(f"  registered {self.registered}/{upto} background subjects")
        wall = time.perf_counter() - t0
        return {
            "from": start_n,
            "to": upto,
            "wall_s": wall,
            "set_binding": summary_ms(set_t) if set_t else None,
            "activate": summary_ms(hook_t) if hook_t else None,
        }

    def measure_lifecycle(self, size: int, samples: int, warmup: int) -> dict[str, Any]:
        """(a) + (b): per sample a NEW subject: SET_BINDING, data-plane-ready, REMOVE_BINDING."""
        set_t: list[float] = []
        hook_t: list[float] = []
        rem_t: list[float] = []
        before = None
        for j in range(warmup + samples):
            if j == warmup:
                before = nft_metrics(self.client)
            idx = self.measured_seq
            self.measured_seq += 1
            uid = f"m{size}-{j}"
            ip = measured_ip(idx)
            body_set = set_binding_body(uid, ip, policy_text(100000 + idx, idx))
            body_hook = hook_body(uid)
            body_rem = remove_body(uid)
            a = self.client.action(body_set, f"SET_BINDING {uid}")
            b = self.client.action(body_hook, f"data-plane-ready {uid}")
            c = self.client.action(body_rem, f"REMOVE_BINDING {uid}")
            if j >= warmup:
                set_t.append(a)
                hook_t.append(b)
                rem_t.append(c)
        after = nft_metrics(self.client)
        # HTTP + handler floor: REMOVE_BINDING of a uid that was never registered (no nft work).
        floor = [self.client.action(remove_body(f"absent-{size}-{k}"), "noop remove") for k in range(samples)]
        return {
            "size": size,
            "set_binding": summary_ms(set_t),
            "activate": summary_ms(hook_t),
            "remove": summary_ms(rem_t),
            "noop_action": summary_ms(floor),
            "server_nft": nft_delta_ms(before or {}, after),
        }

    def _update_body(self, i: int) -> bytes:
        gen = self.generation[i] + 1
        self.generation[i] = gen
        return set_binding_body(f"bg-{i}", bg_ip(i), policy_text(i, gen), gen)

    def measure_updates(self, size: int, sequential: int, concurrent: int) -> dict[str, Any]:
        """(c): SET_BINDING with a changed policy, same fence, to active subjects."""
        n_subj = min(size, self.registered)
        # Sequential, one keep-alive connection.
        bodies = [self._update_body(k % n_subj) for k in range(sequential)]
        before = nft_metrics(self.client)
        lat: list[float] = []
        t0 = time.perf_counter()
        for k, body in enumerate(bodies):
            lat.append(self.client.action(body, f"policy update #{k}"))
        seq_wall = time.perf_counter() - t0
        mid = nft_metrics(self.client)

        # CONCURRENCY requests in flight: one thread + connection each, disjoint subjects.
        per_thread: list[list[bytes]] = [[] for _ in range(CONCURRENCY)]
        per_thread_n = max(1, concurrent // CONCURRENCY)
        for t in range(CONCURRENCY):
            mine = [i for i in range(n_subj) if i % CONCURRENCY == t] or [t % n_subj]
            per_thread[t] = [self._update_body(mine[k % len(mine)]) for k in range(per_thread_n)]
        results: list[list[float]] = [[] for _ in range(CONCURRENCY)]
        errors: list[str] = []
        barrier = threading.Barrier(CONCURRENCY + 1)

        def worker(t: int) -> None:
            c = Client(self.port)
            try:
                c.request("GET", "/healthz")  # open the connection before the clock starts
                barrier.wait()
                for body in per_thread[t]:
                    results[t].append(c.action(body, f"concurrent update (thread {t})"))
            except BaseException as exc:
                errors.append(str(exc)[:300])
                with contextlib.suppress(threading.BrokenBarrierError):
                    barrier.abort()
            finally:
                c.close()

        threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(CONCURRENCY)]
        for th in threads:
            th.start()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=60)
        t1 = time.perf_counter()
        for th in threads:
            th.join(timeout=600)
        conc_wall = time.perf_counter() - t1
        if errors or any(th.is_alive() for th in threads):
            raise BenchError(f"concurrent updates failed: {errors[:3] or 'worker thread did not finish'}")
        after = nft_metrics(self.client)
        conc_lat = [x for r in results for x in r]
        return {
            "size": size,
            "subjects_updated": n_subj,
            "sequential": {
                "requests": len(lat),
                "wall_s": seq_wall,
                "per_s": len(lat) / seq_wall,
                "latency": summary_ms(lat),
                "server_nft": nft_delta_ms(before, mid),
            },
            "concurrent": {
                "in_flight": CONCURRENCY,
                "requests": len(conc_lat),
                "wall_s": conc_wall,
                "per_s": len(conc_lat) / conc_wall,
                "latency": summary_ms(conc_lat),
                "server_nft": nft_delta_ms(mid, after),
            },
        }


def run_daemon_phases(
    workdir: Path, sizes: list[int], updates_at: int, prm: dict[str, int]
) -> dict[str, Any]:
    daemon = Daemon(workdir, HTTP_PORT, DAEMON_TABLE, hide_conntrack=bool(prm.get("no_conntrack")))
    out: dict[str, Any] = {"lifecycle": [], "registration": [], "updates": None}
    try:
        out["daemon_start_s"] = daemon.start()
        log(
            f"egressd ready after {out['daemon_start_s']:.2f}s (pid {daemon.proc.pid if daemon.proc else '?'})"
        )
        client = Client(HTTP_PORT)
        try:
            run = FleetRun(client, HTTP_PORT)
            for size in sizes:
                log(f"daemon: growing to {size} active background subjects")
                reg = run.register_background(size)
                out["registration"].append(reg)
                log(
                    f"daemon: {size} subjects registered ({reg['wall_s']:.1f}s); measuring {prm['samples']} samples"
                )
                res = run.measure_lifecycle(size, prm["samples"], prm["warmup"])
                out["lifecycle"].append(res)
                log(
                    f"  size {size}: SET_BINDING p50 {res['set_binding']['p50_ms']:.2f} ms "
                    f"p99 {res['set_binding']['p99_ms']:.2f} ms; REMOVE p50 {res['remove']['p50_ms']:.2f} ms"
                )
                if size == updates_at:
                    log(f"daemon: policy updates at {size} subjects")
                    out["updates"] = run.measure_updates(size, prm["updates_seq"], prm["updates_conc"])
                    u = out["updates"]
                    log(
                        f"  sequential {u['sequential']['per_s']:.0f}/s, "
                        f"{CONCURRENCY} in flight {u['concurrent']['per_s']:.0f}/s"
                    )
                if not daemon.alive():
                    raise BenchError(f"egressd died:\n{daemon.log_tail()}")
        finally:
            client.close()
    except (BenchError, OSError, http.client.HTTPException) as exc:
        tail = daemon.log_tail()
        raise BenchError(f"{exc}\n--- egressd log tail ---\n{tail}") from None
    finally:
        daemon.stop()
        nft_delete_table(DAEMON_TABLE)  # shutdown keeps the table; it would skew later phases
    return out


# ---- (d): the same transaction three ways: netlink (daemon path), libnftables text, nft -f - -----

DIRECT_METHODS = ("netlink", "libnft", "exec")
DIRECT_TXNS = ("policy_swap", "create")
FRESH_BASE = int(ipaddress.IPv4Address("10.102.0.16"))
BUILD_CHUNK = 50  # subjects per build transaction (one libnftables script + one netlink batch)


def _permutations3(r: int) -> tuple[int, int, int]:
    """Method order for repetition ``r``: all six orders in turn, so drift favours no method."""
    orders = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (2, 1, 0), (1, 0, 2))
    return orders[r % len(orders)]


def run_direct_phase(sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """(d) without a daemon, in table ``egbench_direct``.

    Two transactions, each applied three ways at every table size:

    * ``netlink``: egressd's own applier class (``applier._Netlink().run(batch)``, its own
      nf_tables encoder, socket reused), which is what the daemon does; a subject is created
      with one ``subject_create`` batch, as in the daemon.
    * ``libnft``: libnftables in-process (context created in the netns and reused) with the
      same change as nft text (``batch.describe()``; for creation, script + rules text).
    * ``exec``: one ``nft -f -`` per transaction with that same text.

    Policy swaps go to background subjects spread over the whole table. Every creation uses a
    fresh subject id (its rules are added exactly once); after each round the round's three
    fresh subjects are removed again in one untimed netlink batch, so the table keeps its size.
    """
    import nftables

    from egressd.fleet.inputs import parse_binding_input
    from egressd.fleetnft.applier import NftError, _Netlink
    from egressd.fleetnft.builder import (
        SubjectNft,
        TableConfig,
        header_script,
        policy_swap,
        removal_batch,
        subject_create,
        subject_objects_script,
        subject_rules,
    )
    from egressd.fleetnft.ops import NetlinkBatch
    from egressd.subject.model import nft_id, subject_for_uid

    cfg = TableConfig(table=DIRECT_TABLE)
    gateway = ipaddress.ip_address(GATEWAY)
    ctx = nftables.Nftables()  # created inside the netns: bound to it
    ctx.set_echo_output(False)  # as in the daemon: echo forces a full cache fill
    ctx.set_handle_output(False)

    def libnft(script: str) -> float:
        t0 = time.perf_counter()
        rc, _out, err = ctx.cmd(script)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise BenchError(f"libnftables rc={rc}: {str(err).strip()[:400]}\n--- script ---\n{script[:600]}")
        return dt

    def execd(script: str) -> float:
        t0 = time.perf_counter()
        p = subprocess.run(
            ["nft", "-f", "-"], input=script.encode(), capture_output=True, timeout=120, check=False
        )
        dt = time.perf_counter() - t0
        if p.returncode != 0:
            raise BenchError(f"nft -f - rc={p.returncode}: {p.stderr.decode(errors='replace').strip()[:400]}")
        return dt

    def subj(i: int) -> SubjectNft:
        return SubjectNft(nft_id(subject_for_uid(f"bg-{i}")), ipaddress.ip_address(bg_ip(i)), gateway)

    def pol(i: int, variant: int) -> Any:
        return parse_binding_input(policy_text(i, variant)).policy

    def elements(set_name: str) -> str:
        p = _run(["nft", "list", "set", "inet", DIRECT_TABLE, set_name])
        m = re.search(r"elements = \{([^}]*)\}", p.stdout)
        return " ".join(m.group(1).split()) if m else ""

    results = []
    nl = _Netlink()  # created inside the netns: bound to it
    try:

        def netlink(batch: NetlinkBatch) -> float:
            t0 = time.perf_counter()
            try:
                nl.run(batch)
            except NftError as exc:
                raise BenchError(f"netlink: {exc}\n--- batch ---\n{batch.describe()[:600]}") from None
            return time.perf_counter() - t0

        fresh_seq = 0
        for size in sizes:
            nft_delete_table(DIRECT_TABLE)
            t0 = time.perf_counter()
            libnft(header_script(cfg, delete_existing=False))
            for lo in range(0, size, BUILD_CHUNK):
                ids = range(lo, min(size, lo + BUILD_CHUNK))
                libnft("".join(subject_objects_script(cfg, subj(i)) for i in ids))
                batch = NetlinkBatch(DIRECT_TABLE)
                for i in ids:
                    batch = (
                        batch
                        + subject_rules(cfg, subj(i).nft_id)
                        + policy_swap(DIRECT_TABLE, subj(i).nft_id, pol(i, 0))
                    )
                netlink(batch)
            build_s = time.perf_counter() - t0
            log(f"direct: table with {size} subjects built in {build_s:.2f}s; {reps} reps per method and txn")

            times: dict[str, dict[str, list[float]]] = {
                t: {m: [] for m in DIRECT_METHODS} for t in DIRECT_TXNS
            }
            split: dict[str, list[float]] = {"script": [], "rules": []}

            # -- policy swap: a changed policy for an existing active subject (§8.3).
            variant = 1

            def swap(method: str, i: int) -> float:
                nonlocal variant
                variant += 1
                batch = policy_swap(DIRECT_TABLE, subj(i).nft_id, pol(i, variant))
                if method == "netlink":
                    return netlink(batch)
                if method == "libnft":
                    return libnft(batch.describe())
                return execd(batch.describe())

            for k, m in enumerate(DIRECT_METHODS):  # warm-up, not recorded
                swap(m, k % size)
            # Sanity check: each method really swapped the set contents.
            for k, m in enumerate(DIRECT_METHODS):
                i = (k + 1) % size
                swap(m, i)
                want = f"198.51.{variant % 250}.0/24"
                got = elements(f"subj_{subj(i).nft_id}_allow_v4")
                if want not in got:
                    raise BenchError(f"{m} policy swap not applied: want {want} in allow_v4, got {got!r}")
            # Subjects spread over the whole table: the kernel finds a set by name with a linear
            # walk of the table's set list, so a subject added late costs more than an early one.
            for r in range(reps):
                for k in _permutations3(r):
                    m = DIRECT_METHODS[k]
                    times["policy_swap"][m].append(swap(m, (r * 3 + k) * size // (3 * reps)))

            # -- subject creation: declarations + the fixed rules, each time on a fresh subject id.
            def create(method: str) -> tuple[SubjectNft, float, tuple[float, float] | None]:
                nonlocal fresh_seq
                s = SubjectNft(
                    nft_id(subject_for_uid(f"new-{fresh_seq}")),
                    ipaddress.ip_address(FRESH_BASE + fresh_seq),
                    gateway,
                )
                fresh_seq += 1
                script, rules = subject_objects_script(cfg, s), subject_rules(cfg, s.nft_id)
                if method == "netlink":
                    # The daemon's path: the whole subject in one netlink batch.
                    return s, netlink(subject_create(cfg, s)), None
                if method == "libnft":
                    return s, libnft(script + rules.describe()), None
                return s, execd(script + rules.describe()), None

            def drop(created: list[SubjectNft]) -> None:
                """Remove this round's fresh subjects (untimed), so the table stays at ``size``."""
                batch = NetlinkBatch(DIRECT_TABLE)
                for s in created:
                    batch = batch + removal_batch(cfg, s.nft_id, s.ip, release_gateway=None)
                netlink(batch)
                time.sleep(0.01)  # let the kernel's deferred cleanup of the deleted objects run

            drop([create(m)[0] for m in DIRECT_METHODS])  # warm-up
            for r in range(reps):
                created = []
                for k in _permutations3(r):
                    m = DIRECT_METHODS[k]
                    s, dt, parts = create(m)
                    created.append(s)
                    times["create"][m].append(dt)
                    if parts is not None:
                        split["script"].append(parts[0])
                        split["rules"].append(parts[1])
                drop(created)

            row: dict[str, Any] = {"size": size, "build_s": build_s}
            for txn, by in times.items():
                summ = {m: summary_ms(v) for m, v in by.items()}
                ex = summ["exec"]["p50_ms"]
                row[txn] = {
                    **summ,
                    "speedup_netlink_p50": ex / summ["netlink"]["p50_ms"],
                    "speedup_libnft_p50": ex / summ["libnft"]["p50_ms"],
                }
            if split["script"]:
                row["create"]["netlink_split"] = {k: summary_ms(v) for k, v in split.items()}
            results.append(row)
            for txn in DIRECT_TXNS:
                x = row[txn]
                log(
                    f"  size {size} {txn}: p50 netlink {x['netlink']['p50_ms']:.2f} ms, libnft "
                    f"{x['libnft']['p50_ms']:.2f} ms, exec {x['exec']['p50_ms']:.2f} ms"
                )
            nft_delete_table(DIRECT_TABLE)
    finally:
        nl.close()
    return results


def run_exec_floors(reps: int) -> dict[str, Any]:
    """Diagnostics: what one process spawn costs here, and the `conntrack -D` egressd runs per removal."""
    out: dict[str, Any] = {}
    cmds = {
        "true": ["true"],
        "conntrack -D -s <ip>": ["conntrack", "-D", "-f", "ipv4", "-s", "10.101.255.254"],
    }
    for name, cmd in cmds.items():
        if shutil.which(cmd[0]) is None:
            continue
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, timeout=30, check=False)
            ts.append(time.perf_counter() - t0)
        out[name] = summary_ms(ts)
    return out


def inner_main(args: argparse.Namespace) -> int:
    install_signal_handlers()
    workdir = Path(args.workdir)
    sizes = [int(x) for x in args.sizes.split(",")]
    prm = json.loads(args.params)
    results: dict[str, Any] = {}
    try:
        assert_in_bench_netns(args.ns, args.outer_netns)
        t0 = time.perf_counter()
        results["exec_floors"] = run_exec_floors(prm["direct_reps"])
        results["direct"] = run_direct_phase(sizes, prm["direct_reps"])
        results["direct_wall_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        results["daemon"] = run_daemon_phases(workdir, sizes, prm["updates_at"], prm)
        results["daemon_wall_s"] = time.perf_counter() - t1
    except BenchError as exc:
        print(f"bench: FAILED: {exc}", file=sys.stderr, flush=True)
        results["error"] = str(exc)
        (workdir / "results.json").write_text(json.dumps(results, indent=2))
        return 1
    except Interrupted as exc:
        print(f"bench: interrupted ({exc})", file=sys.stderr, flush=True)
        return 130
    finally:
        nft_delete_table(DIRECT_TABLE)
        nft_delete_table(DAEMON_TABLE)
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    return 0


# ---------------------------------------------------------------------------------------------
# outer side (root netns: only `ip netns add/exec/pids/del`, never nft)


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


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
    """Everything left in our namespace was started by this run: TERM, wait, KILL, by pid."""
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
    """Namespaces of an earlier run that was killed before it could clean up (owner pid dead)."""
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(NS_PREFIX):
            continue
        owner = name[len(NS_PREFIX) :]
        if owner.isdigit() and not _pid_alive(int(owner)):
            if netns_pids(name):
                log(f"stale namespace {name} still has processes; leaving it alone")
                continue
            log(f"removing stale namespace {name} (owner {owner} is gone)")
            _run(["ip", "netns", "del", name])


@contextlib.contextmanager
def bench_namespace() -> Iterator[str]:
    ns = f"{NS_PREFIX}{os.getpid()}"
    created = False
    try:
        p = _run(["ip", "netns", "add", ns])
        if p.returncode != 0:
            raise BenchError(f"ip netns add {ns}: {p.stderr.strip()}")
        created = True
        p = _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
        if p.returncode != 0:
            raise BenchError(f"lo up in {ns}: {p.stderr.strip()}")
        routes = _run(["ip", "netns", "exec", ns, "ip", "-4", "route", "show", "default"]).stdout.strip()
        if routes:
            raise BenchError(f"safety: new namespace has a default route: {routes}")
        yield ns
    finally:
        if created:
            ignore_signals()
            kill_netns_pids(ns)
            p = _run(["ip", "netns", "del", ns])
            if p.returncode != 0:
                log(f"WARNING: ip netns del {ns} failed: {p.stderr.strip()}")


def stop_inner(inner: subprocess.Popen[bytes]) -> None:
    """Let the inner side stop egressd and drop its tables; KILL it if it hangs."""
    if inner.poll() is not None:
        return
    ignore_signals()
    inner.send_signal(signal.SIGTERM)
    try:
        inner.wait(30)
    except subprocess.TimeoutExpired:
        inner.kill()
        inner.wait(10)


def outer_main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench: must run as root (network namespaces, nftables)", file=sys.stderr)
        return 2
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            print(f"bench: {tool} not found", file=sys.stderr)
            return 2
    if not EGRESSD.exists():
        print(f"bench: {EGRESSD} missing (run scripts/install.sh)", file=sys.stderr)
        return 2

    if args.quick:
        sizes = [10, 50]
        prm: dict[str, Any] = {
            "samples": 10,
            "warmup": 2,
            "updates_seq": 100,
            "updates_conc": 160,
            "direct_reps": 10,
        }
    else:
        sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
        prm = {"samples": 30, "warmup": 3, "updates_seq": 500, "updates_conc": 800, "direct_reps": 30}
    if args.samples:
        prm["samples"] = args.samples
        prm["direct_reps"] = args.samples
    if any(s < 1 for s in sizes):
        raise SystemExit("bench: sizes must be >= 1")
    under = [s for s in sizes if s <= T_UPDATES_AT]
    prm["updates_at"] = T_UPDATES_AT if T_UPDATES_AT in sizes else (max(under) if under else min(sizes))

    prm["no_conntrack"] = bool(args.no_conntrack)
    prm["loadavg_start"] = list(os.getloadavg())
    install_signal_handlers()
    workdir = Path(tempfile.mkdtemp(prefix="egbench-"))
    inner: subprocess.Popen[bytes] | None = None
    rc = 1
    started = time.time()
    try:
        cleanup_stale_namespaces()
        with bench_namespace() as ns:
            log(f"namespace {ns}, workdir {workdir}, sizes {sizes}, params {prm}")
            cmd = [
                "ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve()),
                "--inner", "--ns", ns, "--workdir", str(workdir),
                "--outer-netns", str(os.stat("/proc/self/ns/net").st_ino),
                "--sizes", ",".join(map(str, sizes)), "--params", json.dumps(prm),
            ]  # fmt: skip
            inner = subprocess.Popen(cmd, cwd=ROOT)
            try:
                rc = inner.wait()
            finally:
                stop_inner(inner)
            res_path = workdir / "results.json"
            results = json.loads(res_path.read_text()) if res_path.exists() else {}
            if rc == 0:
                report = build_report(results, sizes, prm, quick=args.quick, started=started)
                print(render_report(report))
                if args.json_out:
                    Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
                    log(f"JSON written to {args.json_out}")
            else:
                print(f"bench: inner run failed (rc={rc})", file=sys.stderr)
    except Interrupted as exc:
        log(f"interrupted ({exc}); cleaning up")
        rc = 130
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
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


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def build_report(
    results: dict[str, Any], sizes: list[int], prm: dict[str, Any], *, quick: bool, started: float
) -> dict[str, Any]:
    daemon = results["daemon"]
    life = {r["size"]: r for r in daemon["lifecycle"]}
    direct = {r["size"]: r for r in results["direct"]}
    targets: list[dict[str, Any]] = []

    big, small = max(sizes), min(sizes)
    set_at = T_SET_AT if T_SET_AT in life else big
    p99 = life[set_at]["set_binding"]["p99_ms"]
    targets.append(
        {
            "name": f"SET_BINDING p99 at {set_at} subjects",
            "value": p99,
            "unit": "ms",
            "target": f"<= {T_SET_P99_MS} ms at {T_SET_AT}",
            "met": p99 <= T_SET_P99_MS,
            "note": "" if set_at == T_SET_AT else f"target size {T_SET_AT} not run; measured at {set_at}",
        }
    )
    ratio50 = life[big]["remove"]["p50_ms"] / life[small]["remove"]["p50_ms"]
    ratio99 = life[big]["remove"]["p99_ms"] / life[small]["remove"]["p99_ms"]
    targets.append(
        {
            "name": f"REMOVE_BINDING p50 at {big} / at {small}",
            "value": ratio50,
            "unit": "x",
            "target": f"<= {T_REMOVE_RATIO}x (1000 vs 10)",
            "met": ratio50 <= T_REMOVE_RATIO,
            "note": f"p99 ratio {ratio99:.2f}x"
            + ("" if (big, small) == (1000, 10) else f"; target is 1000 vs 10, measured {big} vs {small}"),
        }
    )
    upd = daemon.get("updates")
    if upd:
        for mode in ("sequential", "concurrent"):
            label = "1 connection, sequential" if mode == "sequential" else f"{CONCURRENCY} in flight"
            v = upd[mode]["per_s"]
            targets.append(
                {
                    "name": f"policy updates/s at {upd['size']} subjects ({label})",
                    "value": v,
                    "unit": "/s",
                    "target": f">= {T_UPDATES_PER_S:.0f}/s at {T_UPDATES_AT}",
                    "met": v >= T_UPDATES_PER_S,
                    "note": "" if upd["size"] == T_UPDATES_AT else f"target size {T_UPDATES_AT} not run",
                }
            )
    for method, label in (
        ("netlink", "daemon path: netlink"),
        ("libnft", "libnftables text, for comparison"),
    ):
        for size in sorted(direct):
            d = direct[size]
            per = {txn: d[txn][f"speedup_{method}_p50"] for txn in DIRECT_TXNS}
            worst = min(per.values())
            targets.append(
                {
                    "name": f"in-process ({label}) vs nft -f - at {size} subjects (p50, worse txn)",
                    "value": worst,
                    "unit": "x",
                    "target": f">= {T_INPROC_SPEEDUP:.0f}x",
                    "met": worst >= T_INPROC_SPEEDUP,
                    "note": f"policy swap {per['policy_swap']:.1f}x, subject creation {per['create']:.1f}x",
                }
            )

    nft_v = _run(["nft", "--version"]).stdout.strip()
    return {
        "meta": {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": time.time() - started,
            "quick": quick,
            "sizes": sizes,
            "params": prm,
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "nft": nft_v,
            "percentiles": "nearest rank; p99 of n<=100 samples is the maximum",
            "loadavg_start": prm.get("loadavg_start"),
            "loadavg_end": list(os.getloadavg()),
        },
        "lifecycle": daemon["lifecycle"],
        "registration": daemon["registration"],
        "updates": upd,
        "direct": results["direct"],
        "exec_floors": results.get("exec_floors", {}),
        "daemon_start_s": daemon.get("daemon_start_s"),
        "targets": targets,
    }


def _pp(s: dict[str, Any]) -> str:
    return f"{s['p50_ms']:8.2f} {s['p99_ms']:8.2f}"


def render_report(rep: dict[str, Any]) -> str:
    m = rep["meta"]
    lines = [
        "",
        f"egressd fleet benchmark  ({m['started']}, {m['cpus']} CPUs, kernel {m['kernel']}, {m['nft']}, "
        f"Python {m['python']}{', QUICK' if m['quick'] else ''})",
        f"samples per size {m['params']['samples']} (+{m['params']['warmup']} warm-up); "
        f"percentiles: {m['percentiles']}",
        *(
            ["DIAGNOSTIC: egressd ran without conntrack on its PATH (no flow cutting on removal)"]
            if m["params"].get("no_conntrack")
            else []
        ),
        "load average (1/5/15 min) at start "
        + "/".join(f"{x:.2f}" for x in m["loadavg_start"] or [])
        + ", at end "
        + "/".join(f"{x:.2f}" for x in m["loadavg_end"])
        + " (other work on this machine skews the figures)",
        "",
        "(a)/(b) one NEW subject per sample via the daemon (HTTP keep-alive, inside the netns); ms",
        f"{'subjects':>8} | {'SET_BINDING':>17} | {'data-plane-ready':>17} | {'REMOVE_BINDING':>17} |"
        f" {'no-op action':>8} | server nft ms per action (transactions)",
        f"{'':>8} | {'p50':>8} {'p99':>8} | {'p50':>8} {'p99':>8} | {'p50':>8} {'p99':>8} | {'p50':>8} |"
        " deny_first / static_apply / remove",
    ]
    for r in rep["lifecycle"]:
        sn = r["server_nft"]
        n_act = r["set_binding"]["n"]

        def mean(op: str, sn: dict[str, Any] = sn, n_act: int = n_act) -> str:
            if op not in sn or not n_act:
                return "-"
            return f"{sn[op]['sum_ms'] / n_act:.2f} ({sn[op]['count'] / n_act:g})"

        lines.append(
            f"{r['size']:>8} | {_pp(r['set_binding'])} | {_pp(r['activate'])} | {_pp(r['remove'])} |"
            f" {r['noop_action']['p50_ms']:8.2f} | {mean('deny_first')} / {mean('static_apply')} / {mean('remove')}"
        )
    lines.append("")
    lines.append("background registration (SET_BINDING + data-plane-ready per subject, sequential):")
    for g in rep["registration"]:
        if g["set_binding"]:
            lines.append(
                f"  {g['from']:>5} -> {g['to']:<5} {g['wall_s']:7.1f}s   SET_BINDING p50 {g['set_binding']['p50_ms']:.2f}"
                f" max {g['set_binding']['max_ms']:.2f} ms; activate p50 {g['activate']['p50_ms']:.2f}"
                f" max {g['activate']['max_ms']:.2f} ms"
            )
    u = rep["updates"]
    if u:
        lines.append("")
        lines.append(
            f"(c) policy updates at {u['size']} active subjects (SET_BINDING, same fence, changed policy)"
        )
        for mode in ("sequential", "concurrent"):
            x = u[mode]
            label = (
                "sequential, 1 connection"
                if mode == "sequential"
                else f"{x['in_flight']} in flight (threads)"
            )
            nft = x["server_nft"].get("static_apply", {}).get("mean_ms", math.nan)
            lines.append(
                f"  {label:<26} {x['requests']:>5} req in {x['wall_s']:6.2f}s = {x['per_s']:7.0f}/s"
                f"   latency p50 {x['latency']['p50_ms']:.2f} p99 {x['latency']['p99_ms']:.2f} ms"
                f"   server nft static_apply mean {nft:.2f} ms"
            )
    lines.append("")
    lines.append(
        "(d) the same transaction three ways, no daemon; ms. netlink = egressd's applier (own encoder; creation:"
    )
    lines.append("    one subject_create batch), libnft = libnftables in-process with the same change")
    lines.append("    as nft text, exec = one `nft -f -` with that text")
    lines.append(
        f"{'subjects':>8} | {'txn':<11} | {'netlink':>17} | {'libnft text':>17} | {'nft -f -':>17} |"
        f" exec/netlink | exec/libnft | table build"
    )
    lines.append(
        f"{'':>8} | {'':<11} | {'p50':>8} {'p99':>8} | {'p50':>8} {'p99':>8} | {'p50':>8} {'p99':>8} |"
        f" {'p50':>12} | {'p50':>11} |"
    )
    for d in rep["direct"]:
        for txn in DIRECT_TXNS:
            t = d[txn]
            lines.append(
                f"{d['size']:>8} | {txn:<11} | {_pp(t['netlink'])} | {_pp(t['libnft'])} | {_pp(t['exec'])} |"
                f" {t['speedup_netlink_p50']:11.1f}x | {t['speedup_libnft_p50']:10.1f}x |"
                + (f" {d['build_s']:.2f}s" if txn == "policy_swap" else "")
            )
    lines.append(
        "    creation: netlink = egressd's single batch (subject_create); the text methods run the"
        " equivalent cache-free declarations + rules as nft text"
    )
    fl = rep.get("exec_floors") or {}
    if fl:
        lines.append(
            "    process-spawn floors in the netns (subprocess.run): "
            + ", ".join(f"`{k}` p50 {v['p50_ms']:.2f} ms" for k, v in fl.items())
        )
    lines.append("")
    lines.append("ratios:")
    life = {r["size"]: r for r in rep["lifecycle"]}
    sz = sorted(life)
    base = life[sz[0]]
    for s in sz[1:]:
        lines.append(
            f"  {s} vs {sz[0]} subjects: SET_BINDING p50 {life[s]['set_binding']['p50_ms'] / base['set_binding']['p50_ms']:.2f}x"
            f" p99 {life[s]['set_binding']['p99_ms'] / base['set_binding']['p99_ms']:.2f}x;"
            f" REMOVE p50 {life[s]['remove']['p50_ms'] / base['remove']['p50_ms']:.2f}x"
            f" p99 {life[s]['remove']['p99_ms'] / base['remove']['p99_ms']:.2f}x"
        )
    lines.append("")
    lines.append("targets:")
    for t in rep["targets"]:
        val = f"{t['value']:.2f} {t['unit']}" if t["unit"] != "/s" else f"{t['value']:.0f}/s"
        note = f"  ({t['note']})" if t["note"] else ""
        lines.append(f"  [{_verdict(t['met']):<6}] {t['name']}: {val}   target {t['target']}{note}")
    lines.append(f"\ntotal {m['duration_s']:.0f}s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,100,1000", help="background subject counts (default 10,100,1000)")
    p.add_argument("--quick", action="store_true", help="sizes 10,50 and fewer samples (CI, < 60 s)")
    p.add_argument("--samples", type=int, default=0, help="override samples per size")
    p.add_argument(
        "--no-conntrack",
        action="store_true",
        help="diagnostic: start egressd with conntrack off its PATH (removal without the conntrack exec)",
    )
    p.add_argument("--json-out", help="also write the results as JSON here")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ns", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--params", help=argparse.SUPPRESS)
    p.add_argument("--outer-netns", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.inner:
        return inner_main(args)
    return outer_main(args)


if __name__ == "__main__":
    sys.exit(main())
