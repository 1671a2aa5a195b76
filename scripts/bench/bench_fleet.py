#!/usr/bin/env python3
"""Fleet-profile benchmark: action latency, removal scaling, update throughput, in-process vs exec.

Run as root from the repository root::

    .venv/bin/python scripts/bench/bench_fleet.py [--quick] [--sizes 10,100,1000] [--samples N]

One namespace ``egbf<pid>-ns`` (loopback only, no route out); see common.py and README.md.
(a)/(b) SET_BINDING / data-plane-ready / REMOVE_BINDING of a new subject per sample with N
active subjects registered (baseline: the smallest size and a no-op action); (c) policy updates
per second at 100 subjects, sequential and 8 in flight (baseline: no-op actions per second);
(d) the same nftables transaction through egressd's netlink applier, libnftables text and
``nft -f -`` (baseline: ``nft -f -``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import ipaddress
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c
import fleet_instrument as fi

from egressd.fleetnft.contents import policy_swap
from egressd.fleetnft.header import header_script
from egressd.fleetnft.subject import removal_batch, subject_create, subject_objects_script, subject_rules
from egressd.fleetnft.table import Names, SubjectNft, TableConfig, drop_counter_map
from egressd.kernel.ops import NetlinkBatch

PORT = 18480
DAEMON_TABLE, DIRECT_TABLE = "egbench_fleet", "egbench_direct"
GATEWAY = "10.100.0.1"
BG_BASE, MEASURED_BASE, FRESH_BASE = (
    int(ipaddress.IPv4Address(a)) for a in ("10.100.0.16", "10.101.0.16", "10.102.0.16")
)
CONC = 8
# The --quick CI guards (README, "CI guards"), chosen from repeated --quick runs under load.
GUARD_UPDATES = {"seq": 0.30, "conc": 0.30}  # updates/s vs no-op actions/s, at least
GUARD_SET_RATIO = 1.6  # SET_BINDING p50 at the largest quick size vs the smallest, at most
T_SET_P99_MS, T_SET_AT, T_REMOVE_RATIO, T_UPDATES, T_UPDATES_AT, T_SPEEDUP = 5.0, 1000, 2.0, 1000.0, 100, 10.0
T_PORTS_RATIO = 1.10  # port-scoped policies: SET_BINDING/activation p99 within 10 % of today's shape (§18)
METHODS, TXNS = ("netlink", "libnft", "exec"), ("policy_swap", "create")
ORDERS = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (2, 1, 0), (1, 0, 2))  # drift favours no method


def ip_of(base: int, i: int) -> str:
    return str(ipaddress.IPv4Address(base + i))


def policy_text(k: int, variant: int) -> str:
    """4 IP/CIDR rules (v4 + v6) and a domain rule; ``variant`` changes the content."""
    return c.policy("deny", ("allow", f"203.0.113.{k % 250 + 1}"), ("allow", f"198.51.{variant % 250}.0/24"),
                    ("deny", f"192.0.2.{variant % 250 + 1}"), ("allow", f"2001:db8:{k % 65535:x}::/48"), ("allow", "pypi.org"))  # fmt: skip


def ports_policy_text(k: int, variant: int) -> str:
    """:func:`policy_text`'s rules with ports and protocols (docs/reference/behaviour.md §18):
    the same targets, so the two shapes differ only in what the kernel holds per rule."""
    return c.policy("deny", ("allow", f"203.0.113.{k % 250 + 1}", {"ports": [443]}),
                    ("allow", f"198.51.{variant % 250}.0/24", {"protocol": "tcp", "ports": ["5432-5433"]}),
                    ("deny", f"192.0.2.{variant % 250 + 1}", {"protocol": "udp"}),
                    ("allow", f"2001:db8:{k % 65535:x}::/48", {"ports": [443, "8000-8999"]}),
                    ("allow", "pypi.org", {"protocol": "https"}))  # fmt: skip


def set_body(uid: str, ip: str, pol: str, gen: int = 1) -> bytes:
    return c.envelope("SET_BINDING", uid, ip=ip, policy=pol, generation=gen, gateway=GATEWAY)


def ms(xs: list[float]) -> dict[str, float]:
    return c.summary([x * 1000.0 for x in xs])


# ---- (a) (b) (c): through the daemon ------------------------------------------------------------


def subject_objects(cfg: TableConfig, s: SubjectNft) -> str:
    """The libnftables path's objects plus what the netlink path adds to a subject: its drop
    counter and the counter-map key (docs/reference/behaviour.md §15), so removals find them."""
    n = Names(s.nft_id)
    fam = "v4" if s.ip.version == 4 else "v6"
    return (
        subject_objects_script(cfg, s)
        + f"add counter inet {cfg.table} {n.dropped_counter}\n"
        + f'add element inet {cfg.table} {drop_counter_map(fam)} {{ {s.ip} : "{n.dropped_counter}" }}\n'
    )


class FleetRun:
    def __init__(self, h: c.Http, pid: int = 0, port: int = PORT) -> None:
        self.h, self.registered, self.seq, self.pid, self.port = h, 0, 0, pid, port
        self.gen: dict[int, int] = {}

    def grow(self, upto: int) -> dict[str, Any]:
        t0, start, set_t = time.perf_counter(), self.registered, []
        while self.registered < upto:
            i, uid = self.registered, f"bg-{self.registered}"
            set_t.append(
                self.h.action(set_body(uid, ip_of(BG_BASE, i), policy_text(i, 0)), f"SET_BINDING {uid}")
            )
            self.h.action(c.envelope("LIFECYCLE_HOOK", uid, hook=True), f"data-plane-ready {uid}")
            self.gen[i], self.registered = 1, i + 1
        return {
            "from": start,
            "to": upto,
            "wall_s": time.perf_counter() - t0,
            "set": ms(set_t) if set_t else None,
        }

    def lifecycle(self, size: int, samples: int, warmup: int, scoped_too: bool = True) -> dict[str, Any]:
        """(a)/(b); each sample is followed by a no-op action, so the no-op baseline of this
        size is measured under the same load as its samples. (f), unless ``scoped_too`` is off
        (a baseline older than port-scoped rules refuses them): each sample also binds and
        activates one subject with :func:`ports_policy_text`, the two shapes taking turns to go
        first, so both meet the same load."""
        t: dict[str, list[float]] = {"set": [], "activate": [], "remove": [], "noop": []}
        scoped: dict[str, list[float]] = {"set": [], "activate": []}
        before: dict[str, float] = {}
        for j in range(warmup + samples):
            if j == warmup:
                before = c.scrape(self.h)
            idx, uid = self.seq, f"m{size}-{j}"
            self.seq += 2
            sp = sa = 0.0
            if scoped_too and j % 2:
                sp, sa, _ = self.scoped_sample(size, j, idx + 1)
            a = self.h.action(
                set_body(uid, ip_of(MEASURED_BASE, idx), policy_text(100000 + idx, idx)), "SET_BINDING"
            )
            b = self.h.action(c.envelope("LIFECYCLE_HOOK", uid, hook=True), "data-plane-ready")
            r = self.h.action(c.envelope("REMOVE_BINDING", uid), "REMOVE_BINDING")
            if scoped_too and not j % 2:
                sp, sa, _ = self.scoped_sample(size, j, idx + 1)
            z = self.h.action(c.envelope("REMOVE_BINDING", f"absent-{size}-{j}"), "no-op")
            if j >= warmup:
                for k, v in zip(t, (a, b, r, z), strict=True):
                    t[k].append(v)
                if scoped_too:
                    scoped["set"].append(sp)
                    scoped["activate"].append(sa)
        d = c.delta(before, c.scrape(self.h))
        out: dict[str, Any] = {k: ms(v) for k, v in t.items()}
        if scoped_too:
            out["ports"] = {k: ms(v) for k, v in scoped.items()}
        out["nft"] = {op: c.nft_ms(d, op) for op in ("deny_first", "static_apply", "remove")}
        return out

    def scoped_sample(self, size: int, j: int, idx: int) -> tuple[float, float, float]:
        """One subject with the port-scoped shape: SET_BINDING, data-plane-ready, removal."""
        uid = f"p{size}-{j}"
        a = self.h.action(
            set_body(uid, ip_of(MEASURED_BASE, idx), ports_policy_text(100000 + idx, idx)),
            "SET_BINDING (ports)",
        )
        b = self.h.action(c.envelope("LIFECYCLE_HOOK", uid, hook=True), "data-plane-ready (ports)")
        r = self.h.action(c.envelope("REMOVE_BINDING", uid), "REMOVE_BINDING (ports)")
        return a, b, r

    def update_body(self, i: int) -> bytes:
        self.gen[i] += 1
        return set_body(f"bg-{i}", ip_of(BG_BASE, i), policy_text(i, self.gen[i]), self.gen[i])

    def updates(self, n_seq: int, n_conc: int, rounds: int) -> dict[str, Any]:
        """(c) in ``rounds`` rounds of four blocks: no-op actions, sequential updates, no-op
        actions, updates with 8 in flight. Each update block is set against the no-op block
        just before it (the round's ratio), so a change of the machine's load hits both sides
        alike; the CI guard takes the median of the rounds' ratios."""
        n, out = self.registered, {k: Side() for k in ("noop", "seq", "conc")}
        owned = [[i for i in range(n) if i % CONC == t] or [t % n] for t in range(CONC)]
        ratios: dict[str, list[float]] = {"seq": [], "conc": []}
        for r, (k, kc) in enumerate(zip(split(n_seq, rounds), split(n_conc, rounds), strict=True)):
            for mode in ("seq", "conc"):
                noop = [c.envelope("REMOVE_BINDING", f"absent-u{r}{mode}-{j}") for j in range(k)]
                base = out["noop"].sequential(self.pid, self.h, noop)
                m0 = c.scrape(self.h)
                if mode == "seq":
                    bodies = [self.update_body((out["seq"].n + j) % n) for j in range(k)]
                    rate = out["seq"].sequential(self.pid, self.h, bodies)
                else:
                    per = [[self.update_body(mine[(r * kc + j) % len(mine)]) for j in range(max(1, kc // CONC))]
                           for mine in owned]  # fmt: skip
                    rate = out["conc"].concurrent(self.pid, per, self.port)
                out[mode].nft_add(c.nft_ms(c.delta(m0, c.scrape(self.h)), "static_apply"))
                ratios[mode].append(rate / base)
        return {"size": n, "noop_per_s": out["noop"].per_s, "noop_cpu_ms": out["noop"].cpu_ms,
                **{m: {**out[m].summary(), "ratio_median": statistics.median(ratios[m]), "ratios": ratios[m]}
                   for m in ("seq", "conc")}}  # fmt: skip


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


class Side:
    """One kind of block of (c): its actions' latencies, wall and CPU time, nft time."""

    def __init__(self) -> None:
        self.n, self.wall, self.cpu = 0, 0.0, 0.0
        self.lat: list[float] = []
        self.nft = (0.0, 0)

    def _add(self, lat: list[float], wall: float, cpu: float) -> float:
        self.n, self.wall, self.cpu, self.lat = (
            self.n + len(lat),
            self.wall + wall,
            self.cpu + cpu,
            self.lat + lat,
        )
        return len(lat) / wall

    def sequential(self, pid: int, h: c.Http, bodies: list[bytes]) -> float:
        """One block on one connection; its rate (actions/s)."""
        cpu0, t0 = c.cpu_s(pid), time.perf_counter()
        lat = [h.action(b, "action") for b in bodies]
        return self._add(lat, time.perf_counter() - t0, c.cpu_s(pid) - cpu0)

    def concurrent(self, pid: int, per: list[list[bytes]], port: int = PORT) -> float:
        cpu0 = c.cpu_s(pid)
        results, wall = in_flight(per, port)
        return self._add([x for r in results for x in r], wall, c.cpu_s(pid) - cpu0)

    def nft_add(self, d: tuple[float, int]) -> None:
        self.nft = (self.nft[0] + d[0], self.nft[1] + d[1])

    @property
    def per_s(self) -> float:
        return self.n / self.wall

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu / self.n

    def summary(self) -> dict[str, Any]:
        return {"n": self.n, "per_s": self.per_s, "lat": ms(self.lat), "nft": self.nft, "cpu_ms": self.cpu_ms}


def inject(run: FleetRun, control: Path, kind: str, factor: float, n: int = 30) -> None:
    """``--inject-slowdown``: measure ``n`` in-place updates, then make the daemon spend
    (factor - 1) times their median latency more on each: updates then take ``factor`` times as long."""
    lat = [run.h.action(run.update_body(j % run.registered), "policy update") for j in range(n)]
    fi.set_extra(control, kind, (factor - 1) * statistics.median(lat))
    c.log(f"injected: {kind} +{(factor - 1) * statistics.median(lat) * 1000:.2f} ms (x{factor})")


def in_flight(per: list[list[bytes]], port: int = PORT) -> tuple[list[list[float]], float]:
    """Each list of actions on its own connection and thread, all started at a barrier; the
    latencies per thread and the wall time until the last one finished."""
    results: list[list[float]] = [[] for _ in per]
    errors: list[str] = []
    barrier = threading.Barrier(len(per) + 1)

    def worker(t: int) -> None:
        h = c.Http(port)
        try:
            h.request("GET", "/healthz")  # connection open before the clock starts
            barrier.wait()
            results[t] = [h.action(b, f"update (thread {t})") for b in per[t]]
        except BaseException as exc:
            errors.append(str(exc)[:300])
            barrier.abort()
        finally:
            h.close()

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(len(per))]
    for th in threads:
        th.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait(timeout=60)
    t1 = time.perf_counter()
    for th in threads:
        th.join(timeout=600)
    wall = time.perf_counter() - t1
    if errors or any(th.is_alive() for th in threads):
        raise c.BenchError(f"concurrent updates failed: {errors[:3] or 'a worker did not finish'}")
    return results, wall


def daemon_phases(workdir: Path, sizes: list[int], prm: dict[str, Any]) -> dict[str, Any]:
    env = (
        {"PATH": ":".join(d for d in os.environ["PATH"].split(":") if not Path(d, "conntrack").exists())}
        if prm["no_conntrack"]
        else {}
    )
    d = c.Egressd(workdir, PORT, DAEMON_TABLE, env)
    out: dict[str, Any] = {"life": {}, "grow": [], "updates": None}
    control = workdir / "inject-main.json"
    try:
        out["start_s"] = d.start(
            [*SELF, "_egressd_slow", str(control), str(max(sizes))] if prm["slowdown"] else None
        )
        h = c.Http(PORT)
        try:
            run = FleetRun(h, d.pid)
            for size in sizes:
                out["grow"].append(run.grow(size))
                c.log(
                    f"daemon: {size} subjects registered ({out['grow'][-1]['wall_s']:.1f}s); {prm['samples']} samples"
                )
                out["life"][size] = r = run.lifecycle(size, prm["samples"], prm["warmup"])
                c.log(
                    f"  SET_BINDING p50 {r['set']['p50']:.2f} p99 {r['set']['p99']:.2f} ms; REMOVE p50 {r['remove']['p50']:.2f} ms"
                )
                if size == prm["updates_at"]:
                    if "update" in prm["slowdown"]:
                        inject(run, control, "update", prm["slowdown"]["update"])
                    with profiled(d.pid, prm["profile"]):
                        out["updates"] = u = run.updates(prm["upd_seq"], prm["upd_conc"], prm["rounds"])
                    c.log(
                        f"  updates: sequential {u['seq']['per_s']:.0f}/s, {CONC} in flight {u['conc']['per_s']:.0f}/s"
                    )
                d.check_alive()
        finally:
            h.close()
    except (OSError, http.client.HTTPException, c.BenchError) as exc:
        raise c.BenchError(f"{exc}\n--- egressd log tail ---\n{d.log_tail()}") from None
    finally:
        d.stop()
    return out


SELF = [sys.executable, str(Path(__file__).resolve())]


@contextlib.contextmanager
def profiled(pid: int, out: Path | None) -> Iterator[None]:
    """``--profile``: py-spy samples the daemon (GIL-holding stacks, folded) while (c) runs."""
    if out is None:
        yield
        return
    spy = shutil.which("py-spy") or str(c.ROOT / ".venv" / "bin" / "py-spy")
    p = c.Proc([spy, "record", "--pid", str(pid), "--gil", "--format", "raw", "--rate", "250",
                "--output", str(out)], stdin=False, log_path=out.with_name(out.name + ".log"))  # fmt: skip
    time.sleep(1.0)  # attached before the first update
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            p.p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.p.wait(30)
        p.stop(5)
        c.log(f"profile: {out}")


# ---- the SET_BINDING guard: two daemons side by side --------------------------------------------


def set_guard_phase(workdir: Path, sizes: list[int], samples: int, slow: dict[str, float]) -> dict[str, Any]:
    """``--quick``'s SET_BINDING guard: a daemon with the smallest and one with the largest
    size, each in its own table, their samples alternating (one sample = SET_BINDING of a new
    subject, data-plane-ready, REMOVE_BINDING), so both sizes meet the same load."""
    small, big = min(sizes), max(sizes)
    daemons, conns, runs = [], [], []
    try:
        for k, size in enumerate((small, big)):
            env = {"EGRESSD_DNS_ADDR": f"127.0.0.1:{25300 + k}", "EGRESSD_UID_DNS_PORT_BASE": str(26000 + 100 * k),
                   "EGRESSD_UID_MAX_SUBJECTS": "16"}  # fmt: skip
            d = c.Egressd(workdir, PORT + 1 + k, f"{DAEMON_TABLE}_g{k}", env)
            daemons.append(d)
            control = workdir / f"inject-g{k}.json"
            d.start([*SELF, "_egressd_slow", str(control), str(big)] if slow else None)
            conns.append(c.Http(PORT + 1 + k))
            runs.append(FleetRun(conns[-1], d.pid))
            runs[-1].grow(size)
        for run, size in zip(runs, (small, big), strict=True):
            run.lifecycle(size, 0, 3)  # warm-up
        if "create" in slow:
            lat = [runs[1].lifecycle(big, 1, 0)["set"]["p50"] for _ in range(10)]
            fi.set_extra(
                workdir / "inject-g1.json", "create", (slow["create"] - 1) * statistics.median(lat) / 1000
            )
        t: dict[int, list[float]] = {small: [], big: []}
        pairs = list(zip(runs, (small, big), strict=True))
        for j in range(samples):
            for run, size in pairs if j % 2 == 0 else pairs[::-1]:
                t[size].append(run.lifecycle(size, 1, 0)["set"]["p50"])
    except (OSError, http.client.HTTPException, c.BenchError) as exc:
        raise c.BenchError(f"SET_BINDING guard: {exc}") from None
    finally:
        for h in conns:
            h.close()
        for d in daemons:
            d.stop()
    return {"small": small, "big": big, "p50": {s: statistics.median(v) for s, v in t.items()}}


# ---- (e): where an in-place update spends its time, in an instrumented daemon --------------------


def splits_phase(workdir: Path, prm: dict[str, Any]) -> dict[str, Any]:
    """egressd's own main() with perf_counter wrappers (fleet_instrument.py), ``updates_at``
    active subjects: no-op actions, sequential updates, updates with 8 in flight."""
    records = workdir / "splits.json"
    d = c.Egressd(workdir, PORT, DAEMON_TABLE, {})
    windows: dict[str, tuple[float, float]] = {}
    lat: dict[str, list[float]] = {}
    try:
        d.start([*SELF, "_egressd", str(records)])
        h = c.Http(PORT)
        try:
            run = FleetRun(h)
            run.grow(prm["updates_at"])
            n, k = run.registered, prm["split_n"]
            for j in range(k):  # warm-up
                h.action(run.update_body(j % n), "policy update")
            for phase in ("noop", "seq"):
                bodies = ([c.envelope("REMOVE_BINDING", f"absent-s{j}") for j in range(k)] if phase == "noop"
                          else [run.update_body(j % n) for j in range(k)])  # fmt: skip
                t0 = time.perf_counter()  # CLOCK_MONOTONIC is one clock for every process
                lat[phase] = [h.action(b, phase) for b in bodies]
                windows[phase] = (t0, time.perf_counter())
            per = [[run.update_body(i) for i in range(t, n, CONC)][: max(1, k // CONC)] for t in range(CONC)]
            t0 = time.perf_counter()
            results, _wall = in_flight(per)
            windows["conc"] = (t0, time.perf_counter())
            lat["conc"] = [x for r in results for x in r]
            time.sleep(0.3)  # background cuts of the last updates finish
            d.check_alive()
        finally:
            h.close()
    except (OSError, http.client.HTTPException, c.BenchError) as exc:
        raise c.BenchError(f"splits: {exc}\n--- egressd log tail ---\n{d.log_tail()}") from None
    finally:
        d.stop()  # SIGTERM: the instrumented main writes its records on the way out
    if not records.exists():
        raise c.BenchError("splits: the instrumented egressd wrote no records")
    data = json.loads(records.read_text())
    out: dict[str, Any] = {}
    for phase, op in (("noop", "RemoveBinding"), ("seq", "SetBinding"), ("conc", "SetBinding")):
        out[phase] = fi.analyse(data, windows[phase], op)
        out[phase]["client"] = ms(lat[phase])
        if out[phase]["n"] < len(lat[phase]) // 2:
            raise c.BenchError(f"splits: {out[phase]['n']} of {len(lat[phase])} {phase} actions recorded"
                               " (do the wrappers in fleet_instrument.targets still fit egressd?)")  # fmt: skip
    return out


# ---- (d): the same transaction three ways, no daemon ---------------------------------------------


def direct_phase(sizes: list[int], reps: int) -> dict[int, dict[str, Any]]:
    run = DirectRun()
    results: dict[int, dict[str, Any]] = {}
    try:
        for size in sizes:
            c.run(["nft", "delete", "table", "inet", DIRECT_TABLE])
            build_s = run.build(size)
            c.log(f"direct: {size} subjects built in {build_s:.2f}s; {reps} reps per method and transaction")
            times: dict[str, dict[str, list[float]]] = {t: {m: [] for m in METHODS} for t in TXNS}
            run.check_swaps(size)
            for r in range(reps):  # subjects spread over the table: the kernel walks its set list by name
                for k in ORDERS[r % 6]:
                    times["policy_swap"][METHODS[k]].append(
                        run.swap(METHODS[k], (r * 3 + k) * size // (3 * reps))
                    )
            run.drop([run.create(m)[0] for m in METHODS])  # warm-up
            for r in range(reps):
                made = []
                for k in ORDERS[r % 6]:
                    s, dt = run.create(METHODS[k])
                    made.append(s)
                    times["create"][METHODS[k]].append(dt)
                run.drop(made)
            results[size] = {
                "build_s": build_s,
                **{t: {m: ms(v) for m, v in by.items()} for t, by in times.items()},
            }
            c.run(["nft", "delete", "table", "inet", DIRECT_TABLE])
    finally:
        run.nl.close()
        c.run(["nft", "delete", "table", "inet", DIRECT_TABLE])
    return results


class DirectRun:
    """(d)'s table, and one transaction applied by each method: egressd's netlink applier,
    libnftables (a context created inside the namespace: bound to it) and ``nft -f -``."""

    def __init__(self) -> None:
        import nftables

        from egressd.kernel.applier import _Netlink

        self.cfg, self.gw = TableConfig(table=DIRECT_TABLE), ipaddress.ip_address(GATEWAY)
        self.ctx = nftables.Nftables()
        self.ctx.set_echo_output(False)  # as in the daemon: echo forces a full cache fill
        self.ctx.set_handle_output(False)
        self.nl = _Netlink()
        self.fresh = self.variant = 0

    # -- the three methods

    def libnft(self, script: str) -> None:
        rc, _o, err = self.ctx.cmd(script)
        if rc != 0:
            raise c.BenchError(f"libnftables rc={rc}: {str(err).strip()[:300]}\n{script[:400]}")

    @staticmethod
    def execd(script: str) -> None:
        p = subprocess.run(
            ["nft", "-f", "-"], input=script.encode(), capture_output=True, timeout=120, check=False
        )
        if p.returncode != 0:
            raise c.BenchError(f"nft -f - rc={p.returncode}: {p.stderr.decode(errors='replace')[:300]}")

    def netlink(self, batch: NetlinkBatch) -> None:
        from egressd.kernel.applier import NftError

        try:
            self.nl.run(batch)
        except NftError as exc:
            raise c.BenchError(f"netlink: {exc}\n{batch.describe()[:400]}") from None

    def apply(self, method: str, batch: NetlinkBatch | None, text: str) -> float:
        """Seconds ``method`` took: the batch for netlink, the text for the others."""
        t0 = time.perf_counter()
        if method == "netlink":
            assert batch is not None
            self.netlink(batch)
        else:
            (self.libnft if method == "libnft" else self.execd)(text)
        return time.perf_counter() - t0

    # -- subjects

    def subj(self, uid: str, ip: str) -> SubjectNft:
        from egressd.subject.model import nft_id, subject_for_uid

        return SubjectNft(nft_id(subject_for_uid(uid)), ipaddress.ip_address(ip), self.gw)

    def bg(self, i: int) -> SubjectNft:
        return self.subj(f"bg-{i}", ip_of(BG_BASE, i))

    @staticmethod
    def pol(i: int, v: int) -> Any:
        from egressd.actionhandler.inputs import parse_binding_input

        return parse_binding_input(policy_text(i, v)).policy

    # -- the transactions

    def build(self, size: int) -> float:
        """The header and ``size`` subjects, 50 per build transaction; seconds taken."""
        t0 = time.perf_counter()
        self.libnft(header_script(self.cfg, delete_existing=False))
        for lo in range(0, size, 50):
            ids = range(lo, min(size, lo + 50))
            self.libnft("".join(subject_objects(self.cfg, self.bg(i)) for i in ids))
            batch = NetlinkBatch(DIRECT_TABLE)
            for i in ids:
                batch = (
                    batch
                    + subject_rules(self.cfg, self.bg(i).nft_id)
                    + policy_swap(DIRECT_TABLE, self.bg(i).nft_id, self.pol(i, 0), audit_objects=False)
                )
            self.netlink(batch)
        return time.perf_counter() - t0

    def swap(self, method: str, i: int) -> float:
        self.variant += 1
        b = policy_swap(DIRECT_TABLE, self.bg(i).nft_id, self.pol(i, self.variant), audit_objects=False)
        return self.apply(method, b, b.describe())

    def check_swaps(self, size: int) -> None:
        """Warm-up, then: each method really swapped the set."""
        for k, m in enumerate(METHODS):
            self.swap(m, k % size)
            self.swap(m, (k + 1) % size)
            got = c.run(
                [
                    "nft",
                    "list",
                    "set",
                    "inet",
                    DIRECT_TABLE,
                    f"subj_{self.bg((k + 1) % size).nft_id}_allow_v4",
                ]
            ).stdout
            if f"198.51.{self.variant % 250}.0/24" not in got:
                raise c.BenchError(f"{m} policy swap not applied: {got[:300]!r}")

    def create(self, method: str) -> tuple[SubjectNft, float]:
        s = self.subj(f"new-{self.fresh}", ip_of(FRESH_BASE, self.fresh))
        self.fresh += 1
        return s, self.apply(
            method,
            subject_create(self.cfg, s),
            subject_objects(self.cfg, s) + subject_rules(self.cfg, s.nft_id).describe(),
        )

    def drop(self, created: list[SubjectNft]) -> None:
        """Untimed: the table keeps its size."""
        batch = NetlinkBatch(DIRECT_TABLE)
        for s in created:
            batch = batch + removal_batch(self.cfg, s.nft_id, s.ip, release_gateway=None, audit=False, ranges=False)
        self.netlink(batch)
        time.sleep(0.01)  # the kernel's deferred clean-up of the deleted objects


def exec_floors(reps: int) -> dict[str, float]:
    """What one process spawn costs here, and the ``conntrack -D`` egressd runs when access narrows."""
    out = {}
    for name, cmd in {
        "true": ["true"],
        "conntrack -D -s <ip>": ["conntrack", "-D", "-f", "ipv4", "-s", "10.101.255.254"],
    }.items():
        if shutil.which(cmd[0]):
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                subprocess.run(cmd, capture_output=True, timeout=30, check=False)
                ts.append(time.perf_counter() - t0)
            out[name] = ms(ts)["p50"]
    return out


# ---- the run and its report ---------------------------------------------------------------------


def inner(args: argparse.Namespace, _topo: c.Topology, workdir: Path, rep: c.Report) -> dict[str, Any]:
    prm: dict[str, Any]
    if args.quick:
        sizes = [10, 100]
        prm = {
            "samples": 20,
            "warmup": 3,
            "upd_seq": 480,
            "upd_conc": 1024,
            "reps": 10,
            "split_n": 100,
            "rounds": 16,
            "guard_samples": 50,
        }
    else:
        sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
        prm = {
            "samples": 30,
            "warmup": 3,
            "upd_seq": 500,
            "upd_conc": 800,
            "reps": 30,
            "split_n": 300,
            "rounds": 10,
        }
    if args.samples:
        prm["samples"] = prm["reps"] = args.samples
    if min(sizes) < 1:
        raise c.BenchError("sizes must be >= 1")
    under = [s for s in sizes if s <= T_UPDATES_AT]
    prm.update(updates_at=max(under) if under else min(sizes), no_conntrack=args.no_conntrack,
               profile=args.profile, quick=args.quick)  # fmt: skip
    try:
        prm["slowdown"] = fi.parse_slowdown(args.inject_slowdown or "")
    except ValueError as exc:
        raise c.BenchError(str(exc)) from None
    c.log(f"sizes {sizes}, {prm}")
    res = {"floors": exec_floors(prm["reps"]), "direct": direct_phase(sizes, prm["reps"])}
    res["daemon"] = daemon_phases(workdir, sizes, prm)
    if not args.no_splits:
        res["splits"] = splits_phase(workdir, prm)
    if args.quick:
        res["set_guard"] = set_guard_phase(workdir, sizes, prm["guard_samples"], prm["slowdown"])
    report(rep, sizes, prm, res)
    if args.quick:
        guards(rep, res)
    return res


def guards(rep: c.Report, res: dict[str, Any]) -> None:
    """The CI guards of ``--quick`` (README, "CI guards"): ratios of this run only."""
    upd = res["daemon"]["updates"]
    for lbl, key in (("sequential", "seq"), (f"{CONC} in flight", "conc")):
        r = upd[key]["ratio_median"]
        rep.guard(f"policy updates/s at {upd['size']} subjects, {lbl}, vs no-op actions/s (median of {len(upd[key]['ratios'])} rounds)",
                  r >= GUARD_UPDATES[key], f"{r:.3f}x (all rounds: {upd[key]['per_s']:.0f} vs {upd['noop_per_s']:.0f}/s)",
                  f">= {GUARD_UPDATES[key]}x")  # fmt: skip
    g = res["set_guard"]
    small, big, p50 = g["small"], g["big"], g["p50"]
    r = p50[big] / p50[small]
    rep.guard(f"SET_BINDING p50 at {big} subjects vs at {small} (two daemons side by side, samples alternating)",
              r <= GUARD_SET_RATIO, f"{r:.3f}x ({p50[big]:.2f} vs {p50[small]:.2f} ms)", f"<= {GUARD_SET_RATIO}x")  # fmt: skip


def report_splits(rep: c.Report, prm: dict[str, Any], sp: dict[str, Any]) -> None:
    rep.add("")
    rep.add(f"(e) where an action spends its time: egressd's main() with perf_counter wrappers (fleet_instrument.py),"
            f" {prm['updates_at']} active subjects; ms per action, mean; each step exclusive of the steps inside it")  # fmt: skip
    cols = (("noop", "no-op"), ("seq", "update, sequential"), ("conc", f"update, {CONC} in flight"))
    rows: list[list[object]] = [["client latency (mean)", *(sp[k]["client"]["mean"] for k, _ in cols)],
                                ["  HTTP: aiohttp, loopback, client", *(sp[k]["client"]["mean"] - sp[k]["handler_incl"] - sp[k]["outside"] for k, _ in cols)],
                                ["  egressd's action handler", *(sp[k]["handler_incl"] for k, _ in cols)]]  # fmt: skip
    rows += [[f"    {label}", *(sp[k].get(key, 0.0) for k, _ in cols)] for key, label in fi.STEPS]
    rows += [["  after the handler: MITM memory bump", *(sp[k]["outside"] for k, _ in cols)]]
    rows += [[f"{label}", *(sp[k].get(key, 0.0) for k, _ in cols)] for key, label in fi.BACKGROUND]
    rows += [["  (background work started in the phase's window, per action of the phase)", "", "", ""]]
    rep.table(["step", *(lbl for _, lbl in cols)], rows)
    rep.add(f"  actions recorded: {', '.join(f'{lbl} {sp[k]['n']}' for k, lbl in cols)}; with {CONC} in flight a step's time"
            " includes the other actions' work interleaved with it (awaits), and the locks' waits are in 'rest of the handler'")  # fmt: skip


def report(rep: c.Report, sizes: list[int], prm: dict[str, Any], res: dict[str, Any]) -> None:
    life, direct, upd = res["daemon"]["life"], res["direct"], res["daemon"]["updates"]
    small, big = min(sizes), max(sizes)
    base = life[small]
    rep.add(f"one namespace, loopback only; {prm['samples']} samples per size (+{prm['warmup']} warm-up)"
            + ("; DIAGNOSTIC: egressd without conntrack on its PATH" if prm["no_conntrack"] else ""))  # fmt: skip
    rep.add("")
    rep.add(f"(a)/(b) one NEW subject per sample via the daemon, ms; ratio vs {small} subjects (baseline)")
    rows = []
    for size in sizes:
        r = life[size]
        for op, label in (
            ("set", "SET_BINDING"),
            ("activate", "data-plane-ready"),
            ("remove", "REMOVE_BINDING"),
        ):
            rows.append([f"{size} {label}", r[op]["p50"], r[op]["p99"], c.ratio(r[op]["p50"], base[op]["p50"]),
                         c.ratio(r[op]["p99"], base[op]["p99"]), c.ratio(r[op]["p50"], r["noop"]["p50"])])  # fmt: skip
    rep.table(["subjects / action", "p50", "p99", "p50 ratio", "p99 ratio", "p50 / no-op"], rows)
    rep.add(
        "  no-op action (REMOVE_BINDING of an unknown uid) p50 ms: "
        + ", ".join(f"{s}: {life[s]['noop']['p50']:.2f}" for s in sizes)
    )
    rep.add("  egressd nft ms per action (transactions): " + "; ".join(
        f"{s}: " + " / ".join(f"{op} {sm / prm['samples']:.2f} ({n / prm['samples']:g})" for op, (sm, n) in life[s]["nft"].items())
        for s in sizes))  # fmt: skip
    rep.add("  registration (SET_BINDING + data-plane-ready each): " + "; ".join(
        f"{g['from']}->{g['to']} {g['wall_s']:.1f}s (SET p50 {g['set']['p50']:.2f} max {g['set']['max']:.1f} ms)"
        for g in res["daemon"]["grow"] if g["set"]))  # fmt: skip
    rep.add("")
    rep.add("(f) port-scoped policies (the same rules with ports and protocols, docs/reference/behaviour.md §18),"
            " samples alternating with (a)/(b)'s, ms; ratio vs today's shape")  # fmt: skip
    rep.table(["subjects / action", "p50", "p99", "today p50", "today p99", "p50 ratio", "p99 ratio"],
              [[f"{s} {label}", life[s]["ports"][op]["p50"], life[s]["ports"][op]["p99"], life[s][op]["p50"], life[s][op]["p99"],
                c.ratio(life[s]["ports"][op]["p50"], life[s][op]["p50"]), c.ratio(life[s]["ports"][op]["p99"], life[s][op]["p99"])]
               for s in sizes for op, label in (("set", "SET_BINDING"), ("activate", "data-plane-ready"))])  # fmt: skip
    if upd:
        rep.add("")
        rep.add(
            f"(c) policy updates at {upd['size']} active subjects; baseline: {upd['noop_per_s']:.0f} no-op actions/s sequential"
        )
        rep.table(["mode", "requests", "per s", "vs no-op", "p50 ms", "p99 ms", "nft static_apply ms", "egressd CPU ms", "CPU vs no-op"],
                  [[lbl, u["n"], u["per_s"], c.ratio(u["per_s"], upd["noop_per_s"]), u["lat"]["p50"], u["lat"]["p99"], u["nft"][0] / max(1, u["nft"][1]),
                    u["cpu_ms"], c.ratio(u["cpu_ms"], upd["noop_cpu_ms"])]
                   for lbl, u in (("sequential", upd["seq"]), (f"{CONC} in flight", upd["conc"]))])  # fmt: skip
        rep.add(f"  egressd CPU (utime + stime, all threads) per no-op action: {upd['noop_cpu_ms']:.3f} ms; {len(upd['seq']['ratios'])} rounds"
                " of no-op, sequential, no-op, 8-in-flight blocks; per round, update rate / no-op rate: "
                + "; ".join(f"{m} median {upd[m]['ratio_median']:.3f}x (min {min(upd[m]['ratios']):.3f}, max {max(upd[m]['ratios']):.3f})" for m in ("seq", "conc")))  # fmt: skip
    if prm["profile"] is not None and Path(prm["profile"]).exists():
        total, per = fi.profile_summary(Path(prm["profile"]).read_text())
        rep.add("")
        rep.add(
            f"profile of the daemon during (c) (py-spy --gil, {total} samples, {prm['profile']}): share of the GIL-holding samples"
        )
        rep.table(["step", "share"], [[step, f"{100 * n / max(1, total):.1f} %"] for step, n in per.items()])
    if "splits" in res:
        report_splits(rep, prm, res["splits"])
    rep.add("")
    rep.add("(d) the same transaction three ways, no daemon, ms; baseline: `nft -f -` (exec)")
    rep.table(["subjects / txn", "netlink p50", "p99", "libnft p50", "p99", "exec p50", "p99", "exec/netlink", "exec/libnft"],
              [[f"{s} {t}", *(direct[s][t][m][q] for m in METHODS for q in ("p50", "p99")),
                c.ratio(direct[s][t]["exec"]["p50"], direct[s][t]["netlink"]["p50"]), c.ratio(direct[s][t]["exec"]["p50"], direct[s][t]["libnft"]["p50"])]
               for s in sizes for t in TXNS])  # fmt: skip
    rep.add(
        "  netlink = egressd's applier (creation: one subject_create batch); libnft = libnftables in-process,"
    )
    rep.add("  exec = one `nft -f -`, both with the same change as nft text. Table build: "
            + ", ".join(f"{s}: {direct[s]['build_s']:.2f}s" for s in sizes)
            + "; spawn floors p50: " + ", ".join(f"`{k}` {v:.2f} ms" for k, v in res["floors"].items()))  # fmt: skip
    at = T_SET_AT if T_SET_AT in life else big
    note = "" if at == T_SET_AT else f" (measured at {at}: target size not run)"
    rep.target(f"SET_BINDING p99 at {at} subjects{note}", life[at]["set"]["p99"] <= T_SET_P99_MS,
               f"{life[at]['set']['p99']:.2f} ms ({c.ratio(life[at]['set']['p99'], base['set']['p99'])} of {small})", f"<= {T_SET_P99_MS} ms at 1000")  # fmt: skip
    for op, label in (("set", "SET_BINDING"), ("activate", "data-plane-ready")):
        ratio = life[big]["ports"][op]["p99"] / life[big][op]["p99"]
        rep.target(f"{label} p99 at {big} subjects, port-scoped vs today's shape", ratio <= T_PORTS_RATIO,
                   f"{ratio:.2f}x ({life[big]['ports'][op]['p99']:.2f} vs {life[big][op]['p99']:.2f} ms)", f"<= {T_PORTS_RATIO}x")  # fmt: skip
    r50 = life[big]["remove"]["p50"] / base["remove"]["p50"]
    rep.target(
        f"REMOVE_BINDING p50 at {big} / at {small}",
        r50 <= T_REMOVE_RATIO,
        f"{r50:.2f}x",
        f"<= {T_REMOVE_RATIO}x, 1000 vs 10",
    )
    if upd:
        for lbl, u in (("sequential", upd["seq"]), (f"{CONC} in flight", upd["conc"])):
            rep.target(f"policy updates/s at {upd['size']} subjects, {lbl}", u["per_s"] >= T_UPDATES,
                       f"{u['per_s']:.0f}/s ({c.ratio(u['per_s'], upd['noop_per_s'])} of no-op)", f">= {T_UPDATES:.0f}/s at {T_UPDATES_AT}")  # fmt: skip
    for m in ("netlink", "libnft"):
        for s in sizes:
            per = {t: direct[s][t]["exec"]["p50"] / direct[s][t][m]["p50"] for t in TXNS}
            rep.target(f"in-process ({m}{', the daemon path' if m == 'netlink' else ', comparison'}) vs exec at {s}, worse txn",
                       min(per.values()) >= T_SPEEDUP, f"swap {per['policy_swap']:.1f}x, creation {per['create']:.1f}x", f">= {T_SPEEDUP:.0f}x")  # fmt: skip


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "_egressd":
        return fi.instrumented_main(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[1] == "_egressd_slow":
        return fi.slow_main(sys.argv[2], int(sys.argv[3]))
    p = c.parser(__doc__, "sizes 10,100, 20 samples, fewer updates; the CI guards")
    p.add_argument("--sizes", default="10,100,1000", help="background subject counts (default 10,100,1000)")
    p.add_argument("--samples", type=int, default=0, help="samples per size and repetitions per method")
    p.add_argument(
        "--no-conntrack", action="store_true", help="diagnostic: egressd without conntrack on its PATH"
    )
    p.add_argument("--no-splits", action="store_true", help="skip (e), the instrumented daemon")
    p.add_argument(
        "--profile", type=Path, help="py-spy (GIL-holding stacks, folded) of the daemon during (c)"
    )
    p.add_argument("--inject-slowdown", metavar="update=F,create=F",
                   help="diagnostic: the daemon's in-place updates / new subjects at the largest size F times slower"
                        " (checks that the --quick guards trip)")  # fmt: skip
    return c.main("fleet", "egbf", ["ns"], "ns", p.parse_args(), inner, tools=("ip", "nft"))


if __name__ == "__main__":
    sys.exit(main())
