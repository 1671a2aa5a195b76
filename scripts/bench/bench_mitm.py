#!/usr/bin/env python3
"""MITM benchmark: HTTPS latency added by egressd's transparent MITM, configurations side by side.

Run as root from the repository root::

    .venv/bin/python scripts/bench/bench_mitm.py [--quick] [--workers N] [--compare 'ENV=VAL[,ENV=VAL...]' ...]
        [--subjects S] [--no-keepalive] [--n-seq N] [--n-conc N]
    .venv/bin/python scripts/bench/bench_mitm.py --request-rules [--quick]

``--request-rules`` measures only the request rules' decision cost per request in the MITM
child (docs/reference/behaviour.md §19; :mod:`request_rules`), in-process, with 1, 100 and
4096 rules on one host against no rules, same run.

Each configuration (an egressd environment) gets its own copy of the topology, namespaces
``egbm<pid>-{X}pod, {X}up, {X}sb1..`` (X = a, b, ...; common.pod_topology), with its own egressd
(``OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1``) and upstream; all daemons run at once and the
batches alternate over configurations and paths, so noise hits every configuration alike. By
default the run compares ``EGRESSD_MITM_WORKERS=1`` with the default (unset: the CPU count);
``--workers N`` sets the measured side, ``--compare`` (repeatable) defines the configurations
(one ``--compare`` is an A/B against the default environment). The kernel redirects only TCP
80/443 of MITM subjects, so the paths share the kernel dispatch and the upstream process
(scripts/fleet_upstream.py, HTTPS on 443 and 8443) and differ only by the MITM:

* ``direct`` (baseline)    sb1 -> api.example.test:8443, not intercepted;
* ``mitm+inject``          sb1 -> :443 through the MITM; sb1's vault binding matches every request;
* ``mitm decrypt, no match`` sb1 -> :443, a path outside the binding: decrypted (the SNI is a
                           binding host, docs/reference/behaviour.md §16), nothing injected;
* ``mitm passthrough``     sb2 (bound, no vault) -> :443 through the MITM: not decrypted, the
                           connection is relayed as TCP (§16); the client trusts only the
                           upstream's CA, so a decrypted connection would fail.

Phases: new TLS connection per request, sequential and 16 in flight from sb1; 16 in flight
spread over S sandboxes (sb1, sb3, ..., each with its own vault; workers are assigned per
subject, so only this phase can use several); the same over keep-alive connections. The
multi-sandbox phases measure ``direct`` and ``mitm+inject`` from the same sandboxes.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c
import mitm_stream
import request_rules

API, API_IP, DNS_IP = "api.example.test", "10.204.0.6", "10.204.0.2"
DIRECT_PORT, MITM_PORT, HTTP_PORT, TABLE = 8443, 18181, 18190, "egbm-mitm"
SECRET, PLACEHOLDER, PATH = "sk-live-BENCH-0c7e11", "PLACEHOLDER-BENCH", "/v1/models"
OTHER_PATH = "/v2/models"  # outside the binding's /v1/*
WORKERS_ENV = "EGRESSD_MITM_WORKERS"
PREFIXES = "abcd"  # one topology copy per configuration: at most four daemons on this machine
PHASE_CAP_S = 60.0
LEASE_S = 30.0  # the zone's TTL: the learned destination lives this long after a dig
T_P50_ADDED_MS, T_P99_ADDED_MS = 3.0, 15.0
T_WORKERS_FACTOR = 0.5  # issue 16: added p50 with 16 in flight at most half the one-worker figure
T_CONN_FACTOR = 2.0  # issue 16: new-connection added p50 within 2x the direct connection time
VAULT = {"credentials": [{"name": "key", "source": {"type": "inline", "value": SECRET}}],
         "bindings": [{"name": "api", "match": {"hosts": [API], "methods": ["GET", "POST"], "paths": ["/v1/*", "/_stream/*"]},
                       "auth": {"type": "bearer", "credential": "key"}}]}  # fmt: skip

# The load generator, run inside a sandbox namespace (stdin: JSON commands, stdout: JSON results).
CLIENT = r"""
import http.client, json, socket, ssl, sys, threading, time

class Conn(http.client.HTTPSConnection):
    def __init__(self, c, ctx):
        super().__init__(c["host"], c["port"], context=ctx, timeout=5.0)
        self._ip, self.conn_ms = c["ip"], None
    def connect(self):
        t0 = time.perf_counter()
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)
        self.conn_ms = (time.perf_counter() - t0) * 1000.0  # TCP connect + TLS handshake

def run(c):
    ctx = ssl.create_default_context(cafile=c["ca"])
    n, conc, keep = c["n"], c["conc"], c["keepalive"]
    hdrs = {"Authorization": "Bearer " + c["placeholder"], "Connection": "keep-alive" if keep else "close"}
    lock, state, lat, conn_lat, errors, sample = threading.Lock(), {"next": 0}, [], [], {}, {}
    deadline = time.monotonic() + c["deadline_s"]
    conns = [Conn(c, ctx) if keep else None for _ in range(conc)]
    for x in conns:
        if x is not None:
            x.connect()  # connection set up outside the timed loop
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
                    break
                state["next"] += 1
            t0 = time.perf_counter()
            try:
                conn = conn or Conn(c, ctx)
                conn.request("GET", c["path"], headers=hdrs)
                r = conn.getresponse()
                body = r.read()
                t1 = time.perf_counter()
                got = r.getheader("X-Echo-Authorization")
                if r.status != 200:
                    err("status %d" % r.status)
                elif got != c["expect_echo_auth"]:
                    err("upstream saw %r" % (got,))
                else:
                    with lock:
                        lat.append((t1 - t0) * 1000.0)
                        if not keep and conn.conn_ms is not None:
                            conn_lat.append(conn.conn_ms)
                        if not sample:
                            e = json.loads(body)
                            sample.update(port=e.get("port"), tls=e.get("tls"), local=e.get("local"))
            except Exception as exc:
                err(type(exc).__name__)
                conn = conn.close() if conn is not None else None
                continue
            if not keep:
                conn = conn.close()
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(conc)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join(c["deadline_s"] + 10)
    return {"lat_ms": lat, "conn_ms": conn_lat, "errors": errors, "attempted": state["next"], "wall_s": time.perf_counter() - t0, "sample": sample}

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    try:
        out = run(json.loads(line))
    except Exception as exc:
        out = {"fatal": "%s: %s" % (type(exc).__name__, exc)}
    print(json.dumps(out), flush=True)
"""


# ---- pure: configurations, schedule, verdicts ------------------------------------------------------

_ENV_KEY = re.compile(r"[A-Z_][A-Z0-9_]*")


def parse_env_spec(spec: str) -> dict[str, str]:
    """``'A=1,B=2'`` -> ``{'A': '1', 'B': '2'}``; ``''`` is the default environment."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            raise ValueError(f"not ENV=VALUE: {item!r}")
        if key in out:
            raise ValueError(f"{key} given twice")
        out[key] = val
    return out


def _env_arg(spec: str) -> dict[str, str]:
    try:
        return parse_env_spec(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured egressd environment (on top of the benchmark's own)."""

    label: str
    env: Mapping[str, str]


def describe(env: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(env.items())) or "defaults"


def configurations(compare: Sequence[Mapping[str, str]], workers: int | None) -> list[Config]:
    """No ``--compare``: one worker against the default (or ``--workers N``); one: the default
    environment against it; several: exactly those. ``--workers`` fills in every configuration
    that does not set the variable itself."""
    if not compare:
        base: list[Mapping[str, str]] = [{WORKERS_ENV: "1"}, {}]
    elif len(compare) == 1:
        base = [{}, compare[0]]
    else:
        base = list(compare)
    if len(base) > len(PREFIXES):
        raise ValueError(f"at most {len(PREFIXES)} configurations")
    envs = [
        {WORKERS_ENV: str(workers), **e} if workers is not None and WORKERS_ENV not in e else dict(e)
        for e in base
    ]
    return [Config(f"{PREFIXES[i].upper()}: {describe(e)}", e) for i, e in enumerate(envs)]


def expected_workers(env: Mapping[str, str], cpus: int) -> int:
    """What the spec says the variable gives: the CPU count when unset, clamped to 1..16."""
    raw = env.get(WORKERS_ENV, "").strip()
    n = int(raw) if raw.isdigit() else cpus
    return max(1, min(16, n))


def split(n: int, k: int) -> list[int]:
    """``n`` as ``k`` near-equal parts, the larger first."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def batch_order(n_configs: int, paths: Sequence[str], rounds: int) -> list[tuple[int, int, str]]:
    """(round, configuration, path) of every batch: all pairs forwards, then backwards, ..."""
    pairs = [(ci, p) for ci in range(n_configs) for p in paths]
    return [(r, ci, p) for r in range(rounds) for ci, p in (pairs if r % 2 == 0 else pairs[::-1])]


def merge(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The clients' answers of one batch as one (they ran at the same time)."""
    errors: dict[str, int] = {}
    for r in results:
        for kind, cnt in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + cnt
    return {
        "lat_ms": [x for r in results for x in r["lat_ms"]],
        "conn_ms": [x for r in results for x in r.get("conn_ms", [])],
        "errors": errors,
        "attempted": sum(r["attempted"] for r in results),
        "wall_s": max((r["wall_s"] for r in results), default=0.0),
        "sample": next((r["sample"] for r in results if r["sample"]), {}),
    }


def workers_met(ref_added_p50: float, added_p50: float) -> bool:
    """Issue 16 target 1; a reference that adds nothing (or failed) cannot be halved: MISSED."""
    return (
        math.isfinite(ref_added_p50)
        and math.isfinite(added_p50)
        and ref_added_p50 > 0
        and added_p50 <= T_WORKERS_FACTOR * ref_added_p50
    )


def conn_met(added_p50: float, direct_conn_p50: float) -> bool:
    """Issue 16 target 2: added p50 (mitm new-conn) <= 2 x direct connection time."""
    return (
        math.isfinite(added_p50)
        and math.isfinite(direct_conn_p50)
        and added_p50 <= T_CONN_FACTOR * direct_conn_p50
    )


def workers_pairs(found: Sequence[int]) -> list[tuple[int, int]]:
    """(reference, compared) configuration indexes for the workers target, by the MITM children
    actually found: the first one-worker configuration against every one with more."""
    ref = next((i for i, n in enumerate(found) if n == 1), None)
    return [] if ref is None else [(ref, i) for i, n in enumerate(found) if n > 1]


class Phase(NamedTuple):
    label: str
    keep: bool
    conc: int
    n: int
    multi: bool  # spread over the multi-sandbox set


def phases(args: argparse.Namespace) -> list[Phase]:
    spread = f"{args.conc} in flight over {args.subjects} sandboxes"
    out = [
        Phase("new conn, sequential", False, 1, args.n_seq, False),
        Phase(f"new conn, {args.conc} in flight", False, args.conc, args.n_conc, False),
        Phase(f"new conn, {spread}", False, args.conc, args.n_conc, True),
    ]
    if args.keepalive:
        out += [
            Phase("keep-alive, sequential", True, 1, args.n_seq, False),
            Phase(f"keep-alive, {args.conc} in flight", True, args.conc, args.n_conc, False),
            Phase(f"keep-alive, {spread}", True, args.conc, args.n_conc, True),
        ]
    return out


def multi_sandboxes(subjects: int) -> tuple[int, ...]:
    """sb1 plus sb3.. (sb2 is the vault-less pass-through sandbox)."""
    return (1, *range(3, subjects + 2))


def roles(n_configs: int, subjects: int) -> list[str]:
    return [
        f"{x}{r}"
        for x in PREFIXES[:n_configs]
        for r in ("pod", "up", *(f"sb{k}" for k in range(1, subjects + 2)))
    ]


# ---- the shell: one topology copy, its daemon, upstream and clients --------------------------------


class BenchPath(NamedTuple):
    label: str
    sandboxes: tuple[int, ...]
    port: int
    ca: str
    expect_echo_auth: str  # what the upstream must see: "[REDACTED]" = the real key was injected
    path: str


class LogTail:
    """What egressd logged since the last read (the addon's lookup times)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, path.stat().st_size

    def read(self) -> str:
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            new = fh.read().decode(errors="replace")
        self.offset += len(new.encode())
        return new


class Pod:
    """One configuration: namespaces ``<prefix>*``, its egressd, upstream and one client per sandbox."""

    def __init__(
        self, cfg: Config, prefix: str, topo: c.Topology, workdir: Path, args: argparse.Namespace
    ) -> None:
        self.cfg, self.prefix, self.topo, self.args = cfg, prefix, topo, args
        self.workdir = workdir / prefix
        self.workdir.mkdir()
        self.netns = topo.ns(f"{prefix}pod")
        self.sandboxes = (1, 2, *range(3, args.subjects + 2))
        self.vaults = multi_sandboxes(args.subjects)
        tls = self.workdir / "upstream-tls"
        env = {"EGRESSD_DNS_ADDR": "0.0.0.0:15353", "OPENSANDBOX_EGRESS_DNS_UPSTREAM": f"{DNS_IP}:53",
               "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1", "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
               "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(tls / "trust"),
               "EGRESSD_MITM_CONFDIR": str(self.workdir / "mitm-conf"),
               "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(self.workdir / "mitm-run" / "active.sock"),
               **dict(kv.split("=", 1) for kv in args.daemon_env), **cfg.env}  # fmt: skip
        self.d = c.Egressd(self.workdir, HTTP_PORT, TABLE, env, netns=self.netns)
        self.up: c.Proc | None = None
        self.h: c.Http | None = None
        self.clients: dict[int, c.Proc] = {}
        self.mitm: list[int] = []
        self.dug: dict[int, float] = {}
        mitm_ca, up_ca = str(self.workdir / "mitm-conf" / "mitmproxy-ca-cert.pem"), str(tls / "ca.pem")
        self.mitm_ca, self.upstream_ca = mitm_ca, up_ca  # the response-path part (mitm_stream.py)
        self.api, self.api_ip, self.placeholder = API, API_IP, PLACEHOLDER
        self.paths = [BenchPath("direct", (1,), DIRECT_PORT, up_ca, f"Bearer {PLACEHOLDER}", PATH),
                      BenchPath("mitm+inject", (1,), 443, mitm_ca, "[REDACTED]", PATH),
                      BenchPath("mitm decrypt, no match", (1,), 443, mitm_ca, f"Bearer {PLACEHOLDER}", OTHER_PATH),
                      BenchPath("mitm passthrough", (2,), 443, up_ca, f"Bearer {PLACEHOLDER}", PATH)]  # fmt: skip
        self.multi_paths = [p._replace(sandboxes=self.vaults) for p in self.paths[:2]]

    def start_upstream(self) -> None:
        zone = self.workdir / "zone.json"
        zone.write_text(json.dumps({"records": [{"name": API, "type": "A", "value": API_IP, "ttl": 30}]}))
        self.up = c.Proc([str(c.VENV_PY), str(c.UPSTREAM), "--http-ports", "", "--https-ports", f"443,{DIRECT_PORT}",
                          "--tls-dir", str(self.workdir / "upstream-tls"), "--tls-ips", API_IP, "--zone", str(zone)],
                         ns=self.topo.ns(f"{self.prefix}up"))  # fmt: skip

    def start(self) -> None:
        assert self.up is not None
        if "ready" not in self.up.readline(60):
            raise c.BenchError(f"{self.prefix}: upstream did not start")
        self.d.start(timeout=30)
        self.h = c.Http(HTTP_PORT, 30, self.netns)
        self.register(self.h)
        for k in self.sandboxes:
            self.dig(k)
            self.clients[k] = c.Proc([str(c.VENV_PY), "-c", CLIENT], ns=self.topo.ns(f"{self.prefix}sb{k}"))
        for cl in self.clients.values():
            cl.read_json(20)

    def register(self, h: c.Http) -> None:
        """Every sandbox active with the same policy; all but sb2 with their own vault.

        The spread sandboxes first: egressd gives a new subject the least loaded MITM worker, so
        registered in a row they land on the workers in turn, not with sb2 in the middle."""
        pol = c.policy("deny", ("allow", API))
        for k in (*self.vaults, 2):
            h.action(
                c.envelope("SET_BINDING", f"bm{k}", ip=f"10.203.0.{10 + k}", policy=pol), f"SET_BINDING bm{k}"
            )
            h.action(c.envelope("LIFECYCLE_HOOK", f"bm{k}", hook=True), f"data-plane-ready bm{k}")
        for k in self.vaults:
            url = f"/v1/sandboxfleets/bm{k}/egress/credential-vault"
            code, text, _ = h.request("PUT", url, json.dumps(VAULT).encode())
            if code != 201:
                raise c.BenchError(f"{self.prefix}: vault PUT bm{k}: {code} {text[:300]!r}")

    def dig(self, sb: int) -> None:
        """Learn API's address for sb<N> through the proxy (again before a batch when it is getting old)."""
        # A batch may run PHASE_CAP_S / batches: the lease must outlive it, with 5 s to spare.
        if time.monotonic() - self.dug.get(sb, -math.inf) < LEASE_S - 5.0 - PHASE_CAP_S / self.args.batches:
            return
        out = c.run(["ip", "netns", "exec", self.topo.ns(f"{self.prefix}sb{sb}"), "dig", f"@{c.GATEWAY}", API,
                     "+time=2", "+tries=1", "+short"], timeout=15).stdout  # fmt: skip
        if API_IP not in out.split():
            raise c.BenchError(f"{self.prefix}sb{sb} could not resolve {API}: {out.strip()!r}")
        self.dug[sb] = time.monotonic()

    def batch(self, p: BenchPath, n: int, conc: int, keep: bool, deadline: float) -> dict[str, Any]:
        """``n`` requests, ``conc`` in flight, split over the path's sandboxes, which run at once."""
        parts = [(k, ni, ci) for k, ni, ci in zip(p.sandboxes, split(n, len(p.sandboxes)),
                                                    split(conc, len(p.sandboxes)), strict=True) if ni]  # fmt: skip
        for k, _, _ in parts:
            self.dig(k)
        for k, ni, ci in parts:
            self.clients[k].send({"host": API, "ip": API_IP, "port": p.port, "ca": p.ca, "path": p.path,
                                  "placeholder": PLACEHOLDER, "expect_echo_auth": p.expect_echo_auth, "n": ni,
                                  "conc": max(1, ci), "keepalive": keep, "deadline_s": deadline})  # fmt: skip
        return merge([self.clients[k].read_json(deadline + 30) for k, _, _ in parts])

    def warm_up(self, n: int) -> None:
        """Leaf minted, vault snapshots cached; the upstream saw what it should on every path."""
        for p in [*self.paths, *self.multi_paths]:
            m = max(n, len(p.sandboxes))
            r = self.batch(p, m, len(p.sandboxes), False, 20)
            s = r["sample"]
            if (
                r["errors"]
                or len(r["lat_ms"]) != m
                or (s.get("port"), s.get("tls"), s.get("local")) != (p.port, True, API_IP)
            ):
                raise c.BenchError(f"{self.prefix} warm-up {p.label} {p.sandboxes}: errors {r['errors']},"
                                   f" {len(r['lat_ms'])} ok, upstream saw {s}")  # fmt: skip

    def mitm_children(self) -> list[int]:
        """egressd's children that run the MITM (not a passing helper such as ``conntrack``)."""
        return sorted(k for k in c.children(self.d.pid) if "mitm" in cmdline(k))

    def find_mitm(self) -> None:
        """egressd's MITM children (the workers): all that are up, waiting a little for the expected count."""
        want, deadline = expected_workers(self.d.env, os.cpu_count() or 1), time.monotonic() + 20
        while not (kids := self.mitm_children()) and time.monotonic() < deadline:
            time.sleep(0.1)
        settle = time.monotonic() + 2
        while len(kids) < want and time.monotonic() < settle:
            time.sleep(0.1)
            kids = self.mitm_children()
        if not kids:
            raise c.BenchError(f"{self.prefix}: no MITM child of egressd {self.d.pid}")
        self.mitm = sorted(kids)

    def workers_of(self) -> dict[int, Any]:
        """Each sandbox's MITM worker as egressd reports it (``mitmWorker`` of /v1/subjects; absent
        on an egressd without workers)."""
        assert self.h is not None
        code, text, _ = self.h.request("GET", "/v1/subjects")
        if code != 200:
            raise c.BenchError(f"{self.prefix}: /v1/subjects: HTTP {code}")
        by_uid = {e.get("uid"): e for e in json.loads(text).get("subjects", [])}
        return {k: by_uid.get(f"bm{k}", {}).get("mitmWorker", "-") for k in self.sandboxes}

    def procs(self) -> dict[str, list[int]]:
        """The processes whose CPU is counted: each MITM worker on its own."""
        return {"egressd": [self.d.pid], **{f"mitm{i + 1}": [pid] for i, pid in enumerate(self.mitm)},
                "upstream": [self.up.pid if self.up else 0], "clients": [x.pid for x in self.clients.values()]}  # fmt: skip

    def rss_kb(self, key: str = "VmRSS") -> dict[str, int]:
        return {
            "egressd": c.mem_kb(self.d.pid, key),
            **{f"mitm{i + 1}": c.mem_kb(pid, key) for i, pid in enumerate(self.mitm)},
        }

    def stop(self) -> None:
        if self.h is not None:
            self.h.close()
        for cl in self.clients.values():
            cl.stop(5)
        self.d.stop()
        if self.up is not None:
            self.up.stop()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cpu_now(procs: Mapping[str, Sequence[int]]) -> dict[str, float]:
    return {name: sum(c.cpu_s(pid) for pid in pids) for name, pids in procs.items()}


def log_ms(text: str, event: str, also: str = "") -> list[float]:
    """``lookup_ms`` of the daemon's log lines of ``event`` (that also contain ``also``)."""
    return [
        float(m[1])
        for ln in text.splitlines()
        if event in ln and also in ln and (m := re.search(r'"lookup_ms":\s*([0-9.]+)', ln))
    ]


def new_stats(procs: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    return {
        "lat": [],
        "conn": [],
        "errors": {},
        "wall": 0.0,
        "cpu": dict.fromkeys(procs, 0.0),
        "lookup": [],
        "decide": [],
    }


def measure(pod: Pod, log: LogTail, p: BenchPath, ph: Phase, n: int, x: dict[str, Any]) -> None:
    """One batch of one path on one configuration, added into ``x``."""
    procs = pod.procs()
    c0 = cpu_now(procs)
    r = pod.batch(p, n, ph.conc, ph.keep, PHASE_CAP_S / pod.args.batches)
    for name, v in cpu_now(procs).items():
        x["cpu"][name] += v - c0[name]
    time.sleep(0.05)  # the supervisor re-logs the addon's last lines
    new = log.read()
    x["lookup"] += log_ms(new, "mitm.injected")
    x["decide"] += log_ms(new, "mitm.connection", '"passthrough"')  # §16: one lookup per relayed connection
    x["lat"] += r["lat_ms"] + [math.inf] * (n - len(r["lat_ms"]))
    x["conn"] += r["conn_ms"]
    missing = {"not sent (time cap)": n - r["attempted"]} if r["attempted"] < n else {}
    for kind, cnt in {**r["errors"], **missing}.items():
        x["errors"][kind] = x["errors"].get(kind, 0) + cnt
    x["wall"] += r["wall_s"]


def run_phase(
    args: argparse.Namespace, pods: Sequence[Pod], logs: Sequence[LogTail], ph: Phase
) -> list[dict[str, Any]]:
    """One phase on every configuration: (configuration, path) pairs in interleaved batches."""
    labels = [p.label for p in (pods[0].multi_paths if ph.multi else pods[0].paths)]
    res: list[dict[str, Any]] = [{lbl: new_stats(pod.procs()) for lbl in labels} for pod in pods]
    per_round = split(ph.n, args.batches)
    for r, ci, lbl in batch_order(len(pods), labels, args.batches):
        pod = pods[ci]
        p = next(q for q in (pod.multi_paths if ph.multi else pod.paths) if q.label == lbl)
        measure(pod, logs[ci], p, ph, per_round[r], res[ci][lbl])
    return [{"paths": x, "rss_kb": pod.rss_kb()} for pod, x in zip(pods, res, strict=True)]


def all_configurations(args: argparse.Namespace) -> list[Config]:
    """The measured configurations, plus R (A's environment with body redaction off) for the
    response-path part when it runs and a topology copy is left for it."""
    cfgs = configurations(args.compare, args.workers)
    if args.stream and len(cfgs) < len(PREFIXES):
        env = {**cfgs[0].env, mitm_stream.BODY_REDACTION_ENV: "off"}
        cfgs.append(Config(f"R: {describe(env)} (response path only)", env))
    return cfgs


def inner(args: argparse.Namespace, topo: c.Topology, workdir: Path, rep: c.Report) -> dict[str, Any]:
    if args.quick:
        args.n_seq, args.n_conc, args.warmup = min(args.n_seq, 32), min(args.n_conc, 96), min(args.warmup, 6)
        args.batches = min(args.batches, 4)  # each batch costs ~60 ms of round trips and log settling
    cfgs = all_configurations(args)
    pods = [Pod(cfg, PREFIXES[i], topo, workdir, args) for i, cfg in enumerate(cfgs)]
    try:
        out = measure_all(args, pods, topo)
    except (OSError, http.client.HTTPException, c.BenchError) as exc:
        tails = "\n".join(f"--- egressd log tail, {pod.cfg.label} ---\n{pod.d.log_tail()}" for pod in pods)
        raise c.BenchError(f"{exc}\n{tails}") from None
    finally:
        for pod in pods:
            pod.stop()
    report(rep, args, out)
    return out


def measure_all(args: argparse.Namespace, pods: Sequence[Pod], topo: c.Topology) -> dict[str, Any]:
    for pod in pods:
        pod.start_upstream()
    for pod in pods:
        pod.start()
    for pod in pods:
        pod.warm_up(args.warmup)
        pod.find_mitm()
    c.log(
        "warm-up ok on every configuration: direct reaches :8443, the MITM paths :443, the key injected on mitm+inject only"
    )
    stream_pods = [pods[0], *pods[len(configurations(args.compare, args.workers)) :]]
    pods = pods[: len(configurations(args.compare, args.workers))]  # the latency phases' configurations
    rss0 = [pod.rss_kb() for pod in pods]
    logs = [LogTail(pod.d.log_path) for pod in pods]
    res: dict[str, list[dict[str, Any]]] = {}
    for ph in [] if args.stream_only else phases(args):
        res[ph.label] = run_phase(args, pods, logs, ph)
        c.log(f"{ph.label}: done")
    stream = mitm_stream.run(args, stream_pods, topo) if args.stream else None
    for pod in [*pods, *stream_pods[1:]]:
        if pod.mitm_children() != pod.mitm:
            raise c.BenchError(
                f"{pod.cfg.label}: a MITM child was restarted during the run: figures not comparable"
            )
    whole = [pod.d.log_path.read_text(errors="replace") for pod in pods]
    assigned = [pod.workers_of() for pod in pods]
    return {
        "configs": [{"label": p.cfg.label, "env": dict(p.cfg.env), "mitm_children": len(p.mitm), "workers_of": w,
                     "expected_workers": expected_workers(p.d.env, os.cpu_count() or 1)} for p, w in zip(pods, assigned, strict=True)],
        "phases": res,
        "rss_before_kb": rss0, "hwm_kb": [pod.rss_kb("VmHWM") for pod in pods],
        "refused": [w.count("mitm.refused") for w in whole], "mitm_errors": [w.count("mitm.error") for w in whole],
        "stream": stream,
    }  # fmt: skip


# ---- the report ---------------------------------------------------------------------------------


def letter(i: int) -> str:
    return PREFIXES[i].upper()


def added(by: Mapping[str, Any], name: str) -> tuple[float, float]:
    """(added p50, added p99) of path ``name`` over direct in the same phase and configuration."""
    s, b = c.summary(by[name]["lat"]), c.summary(by["direct"]["lat"])
    return s["p50"] - b["p50"], s["p99"] - b["p99"]


def report(rep: c.Report, args: argparse.Namespace, out: dict[str, Any]) -> None:
    rep.add(f"GET https://{API}{PATH} from sandbox namespaces; {args.batches} interleaved batches per configuration, path"
            " and phase; latency = connect + TLS + request + full response, client-side; baseline: direct (:8443, not"
            " intercepted) of the same configuration and phase")  # fmt: skip
    rep.add("configurations (one topology copy and one egressd each, all running, batches alternating):")
    for cf in out["configs"]:
        rep.add(f"  {cf['label']}: {cf['mitm_children']} MITM child(ren) of egressd found"
                f" (the spec's {WORKERS_ENV} gives {cf['expected_workers']}); each sandbox's worker (mitmWorker"
                " of /v1/subjects): " + ", ".join(f"sb{k} {w}" for k, w in cf["workers_of"].items()))  # fmt: skip
    rep.add("")
    if out.get("phases"):
        latency_table(rep, out)
        conn_table(rep, out)
        cpu_table(rep, out)
        rss_lines(rep, out)
        lookup_lines(rep, out)
        side_by_side(rep, out)
        latency_targets(rep, out)
        workers_targets(rep, out)
        conn_targets(rep, out)
    if out.get("stream") is not None:
        mitm_stream.report(rep, out["stream"])


def latency_table(rep: c.Report, out: dict[str, Any]) -> None:
    rows, errs = [], []
    for label, per in out["phases"].items():
        for ci, cf in enumerate(per):
            by = cf["paths"]
            b = c.summary(by["direct"]["lat"])
            for name, x in by.items():
                s, ok = c.summary(x["lat"]), sum(1 for v in x["lat"] if math.isfinite(v)) or 1
                rows.append([letter(ci), label, name, s["n"], ok / x["wall"] if x["wall"] else math.nan, s["p50"], s["p90"],
                             s["p99"], s["max"], s["p50"] - b["p50"], s["p99"] - b["p99"], c.ratio(s["p50"], b["p50"]),
                             c.ratio(s["p99"], b["p99"])])  # fmt: skip
                if x["errors"]:
                    errs.append(
                        f"  {letter(ci)}, {label}, {name}: failed requests (counted as +inf) {x['errors']}"
                    )
    rep.add("(1) latency, ms")
    rep.table(["cfg", "phase", "path", "n", "req/s", "p50", "p90", "p99", "max", "+p50", "+p99", "p50 ratio", "p99 ratio"],
              rows)  # fmt: skip
    for e in errs:
        rep.add(e)
    rep.add("")


def conn_table(rep: c.Report, out: dict[str, Any]) -> None:
    rows = [
        [letter(ci), label, name, len(x["conn"]), c.pct(x["conn"], 50), c.pct(x["conn"], 99)]
        for label, per in out["phases"].items()
        for ci, cf in enumerate(per)
        for name, x in cf["paths"].items()
        if x["conn"]
    ]
    rep.add("(2) connection time in the client (TCP connect + TLS handshake of each new connection), ms")
    rep.table(["cfg", "phase", "path", "n", "p50", "p99"], rows)
    rep.add("")


def cpu_table(rep: c.Report, out: dict[str, Any]) -> None:
    rows = []
    for label, per in out["phases"].items():
        for ci, cf in enumerate(per):
            for name, x in cf["paths"].items():
                ok = sum(1 for v in x["lat"] if math.isfinite(v)) or 1
                ms = {k: v * 1000.0 / ok for k, v in x["cpu"].items()}
                workers = [v for k, v in ms.items() if k.startswith("mitm")]
                rows.append([letter(ci), label, name, ms["egressd"], sum(workers), "/".join(f"{w:.2f}" for w in workers),
                             ms["upstream"], ms["clients"]])  # fmt: skip
    rep.add(
        "(3) CPU per successful request, ms (utime+stime around the path's batches; MITM = all worker children)"
    )
    rep.table(["cfg", "phase", "path", "egressd", "MITM", "per worker", "upstream", "clients"], rows)
    rep.add("")


def _mib(kb: Mapping[str, int]) -> str:
    workers = [v for k, v in kb.items() if k.startswith("mitm")]
    return f"{kb['egressd'] / 1024:.1f} / {sum(workers) / 1024:.1f} ({'+'.join(f'{w / 1024:.1f}' for w in workers)})"


def rss_lines(rep: c.Report, out: dict[str, Any]) -> None:
    rep.add("(4) RSS, MiB: egressd / MITM children (each worker)")
    for ci, cf in enumerate(out["configs"]):
        after = "; ".join(f"{lbl} {_mib(per[ci]['rss_kb'])}" for lbl, per in out["phases"].items())
        rep.add(f"  {cf['label']}: before the load {_mib(out['rss_before_kb'][ci])}; after {after};"
                f" peak {_mib(out['hwm_kb'][ci])}")  # fmt: skip


def lookup_lines(rep: c.Report, out: dict[str, Any]) -> None:
    rep.add("(5) the addon's vault lookup + decision (lookup_ms of mitm.injected) and, for mitm passthrough, its"
            " connection decision (lookup_ms of mitm.connection), ms")  # fmt: skip
    for ci, cf in enumerate(out["configs"]):
        parts = []
        for lbl, per in out["phases"].items():
            by = per[ci]["paths"]
            if lk := by["mitm+inject"]["lookup"]:
                parts.append(f"{lbl} inject p50 {c.pct(lk, 50):.2f} p99 {c.pct(lk, 99):.2f} (n {len(lk)})")
            if "mitm passthrough" in by and (dk := by["mitm passthrough"]["decide"]):
                parts.append(
                    f"{lbl} passthrough p50 {c.pct(dk, 50):.2f} p99 {c.pct(dk, 99):.2f} (n {len(dk)})"
                )
        rep.add(f"  {cf['label']}: " + "; ".join(parts))
        rep.add(
            f"    whole daemon log: mitm.refused {out['refused'][ci]}, mitm.error {out['mitm_errors'][ci]}"
        )
    rep.add("")


def side_by_side(rep: c.Report, out: dict[str, Any]) -> None:
    """Each configuration's added p50 / p99 next to configuration A's: the comparison of this run."""
    n = len(out["configs"])
    rows = []
    for label, per in out["phases"].items():
        for name in per[0]["paths"]:
            if name == "direct":
                continue
            a = [added(per[ci]["paths"], name) for ci in range(n)]
            rows.append([label, name, *(f"{x[0]:+.2f} / {x[1]:+.2f}" for x in a),
                         *(c.ratio(x[0], a[0][0]) for x in a[1:])])  # fmt: skip
    rep.add("(6) side by side: added p50 / p99 (ms) per configuration, and each one's added p50 over A's")
    rep.table(
        ["phase", "path", *(letter(i) for i in range(n)), *(f"{letter(i)}/A" for i in range(1, n))], rows
    )


def latency_targets(rep: c.Report, out: dict[str, Any]) -> None:
    for label, per in out["phases"].items():
        for ci, cf in enumerate(per):
            for name in cf["paths"]:
                if name == "direct":
                    continue
                a50, a99 = added(cf["paths"], name)
                rep.target(f"{letter(ci)}, {label}, {name}", a50 <= T_P50_ADDED_MS and a99 <= T_P99_ADDED_MS,
                           f"+p50 {a50:+.2f} ms, +p99 {a99:+.2f} ms", f"+p50 <= {T_P50_ADDED_MS:g}, +p99 <= {T_P99_ADDED_MS:g} ms")  # fmt: skip


def workers_targets(rep: c.Report, out: dict[str, Any]) -> None:
    """Issue 16 target 1 on the multi-sandbox in-flight phases (one sandbox stays on one worker)."""
    cfgs = out["configs"]
    pairs = workers_pairs([cf["mitm_children"] for cf in cfgs])
    if not pairs:
        rep.unjudged("issue 16 workers, in flight over several sandboxes",
                     "no pair of a 1-worker and a multi-worker configuration (MITM children found: "
                     + ", ".join(f"{letter(i)} {cf['mitm_children']}" for i, cf in enumerate(cfgs)) + ")",
                     f"added p50 <= {T_WORKERS_FACTOR:g} x the 1-worker figure")  # fmt: skip
        return
    for label, per in out["phases"].items():
        if "sandboxes" not in label:
            continue
        for ref, ci in pairs:
            r50, a50 = added(per[ref]["paths"], "mitm+inject")[0], added(per[ci]["paths"], "mitm+inject")[0]
            rep.target(f"issue 16 workers, {label}, mitm+inject: {letter(ci)} ({cfgs[ci]['mitm_children']} workers) vs {letter(ref)} (1)",
                       workers_met(r50, a50), f"added p50 {a50:+.2f} ms vs {r50:+.2f} ms ({c.ratio(a50, r50)})",
                       f"added p50 <= {T_WORKERS_FACTOR:g} x the 1-worker figure")  # fmt: skip


def conn_targets(rep: c.Report, out: dict[str, Any]) -> None:
    """Issue 16 target 2: the sequential new-connection phase of every configuration."""
    per = out["phases"]["new conn, sequential"]
    for ci, cf in enumerate(per):
        by = cf["paths"]
        a50, conn = added(by, "mitm+inject")[0], c.pct(by["direct"]["conn"], 50)
        rep.target(f"issue 16 connection, {letter(ci)}, new conn, sequential, mitm+inject", conn_met(a50, conn),
                   f"added p50 {a50:+.2f} ms vs direct connection time p50 {conn:.2f} ms ({c.ratio(a50, conn)})",
                   f"added p50 (mitm new-conn) <= {T_CONN_FACTOR:g} x direct connection time")  # fmt: skip


def build(args: argparse.Namespace) -> Callable[[c.Topology], None]:
    """One topology copy per configuration."""

    def _build(topo: c.Topology) -> None:
        for x in PREFIXES[: len(all_configurations(args))]:
            c.pod_topology(topo, args.subjects + 1, [DNS_IP, API_IP], prefix=x)

    return _build


def main() -> int:
    p = c.parser(
        __doc__, "32 sequential / 96 concurrent requests per path, phase and configuration, 4 batches"
    )
    p.add_argument("--n-seq", type=int, default=300, help="sequential requests per path and phase (300)")
    p.add_argument("--n-conc", type=int, default=800, help="concurrent requests per path and phase (800)")
    p.add_argument("--conc", type=int, default=16, help="requests in flight (16)")
    p.add_argument(
        "--subjects", type=int, default=4, help="sandboxes the multi-sandbox phases spread over (4)"
    )
    p.add_argument(
        "--batches", type=int, default=8, help="interleaved batches per configuration, path and phase (8)"
    )
    p.add_argument("--warmup", type=int, default=30, help="unrecorded requests per path first (30)")
    p.add_argument(
        "--workers", type=int, help=f"{WORKERS_ENV} of the measured configuration(s) (default: unset)"
    )
    p.add_argument("--compare", type=_env_arg, action="append", default=[], metavar="ENV=VAL[,ENV=VAL...]",
                   help="a configuration (repeatable; one: A/B against the defaults; '' = the defaults;"
                        f" none: {WORKERS_ENV}=1 against the default)")  # fmt: skip
    p.add_argument(
        "--no-keepalive", dest="keepalive", action="store_false", help="only the new-connection phases"
    )
    p.add_argument("--daemon-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra egressd environment of every configuration (experiments)")  # fmt: skip
    mitm_stream.add_arguments(p)
    p.add_argument("--request-rules", action="store_true",
                   help="only the request rules' per-request decision cost with 1, 100 and 4096 rules on"
                        " one host, ratio to no rules (scripts/bench/request_rules.py; in-process, no topology)")  # fmt: skip
    args = p.parse_args()
    if args.request_rules:
        print(json.dumps(request_rules.measure(args.quick), indent=2))
        return 0
    if args.stream_only and not args.stream:
        p.error("--stream-only and --no-stream exclude each other")
    try:
        n = len(all_configurations(args))
    except ValueError as exc:
        p.error(str(exc))
    if args.workers is not None and not 1 <= args.workers <= 16:
        p.error(f"--workers must be 1..16 (what {WORKERS_ENV} accepts)")
    if not 1 <= args.subjects <= args.conc or args.subjects > 8:
        p.error("--subjects must be 1..8 and at most --conc")
    return c.main(
        "mitm", "egbm", roles(n, args.subjects), "apod", args, inner, build(args), ("ip", "nft", "dig")
    )


if __name__ == "__main__":
    sys.exit(main())
