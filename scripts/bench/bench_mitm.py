#!/usr/bin/env python3
"""MITM benchmark: HTTPS latency added by egressd's shared transparent mitmproxy, and its RSS.

Run as root from the repository root::

    .venv/bin/python scripts/bench/bench_mitm.py [--quick] [--no-keepalive] [--n-seq N] [--n-conc N]

Namespaces ``egbm<pid>-{pod,up,sb1,sb2}`` (common.pod_topology). One egressd with
``OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1`` in the pod; the kernel redirects only TCP 80/443
of MITM subjects to the MITM child, so the paths share the kernel dispatch and the upstream
process (scripts/fleet_upstream.py, HTTPS on 443 and 8443) and differ only by the MITM:

* ``direct`` (baseline)    sb1 -> api.example.test:8443, not intercepted;
* ``mitm+inject``          sb1 -> :443 through the MITM; sb1's vault binding matches every request;
* ``mitm decrypt, no match`` sb1 -> :443, a path outside the binding: decrypted (the SNI is a
                           binding host, docs/behaviour.md §16), nothing injected;
* ``mitm passthrough``     sb2 (bound, no vault) -> :443 through the MITM: not decrypted, the
                           connection is relayed as TCP (§16); the client trusts only the
                           upstream's CA, so a decrypted connection would fail.

Phases: new TLS connection per request, sequential and 16 in flight; the same over keep-alive
connections. The paths alternate in batches (forwards, then backwards, ...).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c

API, API_IP, DNS_IP = "api.example.test", "10.204.0.6", "10.204.0.2"
DIRECT_PORT, MITM_PORT, HTTP_PORT, TABLE = 8443, 18181, 18190, "egbm-mitm"
SECRET, PLACEHOLDER, PATH = "sk-live-BENCH-0c7e11", "PLACEHOLDER-BENCH", "/v1/models"
OTHER_PATH = "/v2/models"  # outside the binding's /v1/*
PHASE_CAP_S = 60.0
T_P50_ADDED_MS, T_P99_ADDED_MS = 3.0, 15.0
VAULT = {"credentials": [{"name": "key", "source": {"type": "inline", "value": SECRET}}],
         "bindings": [{"name": "api", "match": {"hosts": [API], "methods": ["GET"], "paths": ["/v1/*"]},
                       "auth": {"type": "bearer", "credential": "key"}}]}  # fmt: skip

# The load generator, run inside a sandbox namespace (stdin: JSON commands, stdout: JSON results).
CLIENT = r"""
import http.client, json, socket, ssl, sys, threading, time

class Conn(http.client.HTTPSConnection):
    def __init__(self, c, ctx):
        super().__init__(c["host"], c["port"], context=ctx, timeout=5.0)
        self._ip = c["ip"]
    def connect(self):
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)

def run(c):
    ctx = ssl.create_default_context(cafile=c["ca"])
    n, conc, keep = c["n"], c["conc"], c["keepalive"]
    hdrs = {"Authorization": "Bearer " + c["placeholder"], "Connection": "keep-alive" if keep else "close"}
    lock, state, lat, errors, sample = threading.Lock(), {"next": 0}, [], {}, {}
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
    return {"lat_ms": lat, "errors": errors, "attempted": state["next"], "wall_s": time.perf_counter() - t0, "sample": sample}

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    try:
        out = run(json.loads(line))
    except Exception as exc:
        out = {"fatal": "%s: %s" % (type(exc).__name__, exc)}
    print(json.dumps(out), flush=True)
"""


def dig(topo: c.Topology, sb: int) -> None:
    """Learn API's address for sb<N> through the proxy (repeated before every batch: the lease lives 30 s)."""
    out = c.run(
        [
            "ip",
            "netns",
            "exec",
            topo.ns(f"sb{sb}"),
            "dig",
            f"@{c.GATEWAY}",
            API,
            "+time=2",
            "+tries=1",
            "+short",
        ],
        timeout=15,
    ).stdout
    if API_IP not in out.split():
        raise c.BenchError(f"sb{sb} could not resolve {API}: {out.strip()!r}")


#: (label, sandbox, port, CA file, the Authorization the upstream must see, request path)
BenchPath = tuple[str, int, int, str, str, str]


def inner(args: argparse.Namespace, topo: c.Topology, workdir: Path, rep: c.Report) -> dict[str, Any]:
    if args.quick:
        args.n_seq, args.n_conc, args.warmup = (
            min(args.n_seq, 60),
            min(args.n_conc, 200),
            min(args.warmup, 10),
        )
    tls = workdir / "upstream-tls"
    (workdir / "zone.json").write_text(
        json.dumps({"records": [{"name": API, "type": "A", "value": API_IP, "ttl": 30}]})
    )
    up = c.Proc([str(c.VENV_PY), str(c.UPSTREAM), "--http-ports", "", "--https-ports", f"443,{DIRECT_PORT}", "--tls-dir", str(tls),
                 "--tls-ips", API_IP, "--zone", str(workdir / "zone.json")], ns=topo.ns("up"))  # fmt: skip
    env = {"EGRESSD_DNS_ADDR": "0.0.0.0:15353", "OPENSANDBOX_EGRESS_DNS_UPSTREAM": f"{DNS_IP}:53",
           "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1", "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
           "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(tls / "trust"), "EGRESSD_MITM_CONFDIR": str(workdir / "mitm-conf"),
           "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(workdir / "mitm-run" / "active.sock"), **dict(kv.split("=", 1) for kv in args.daemon_env)}  # fmt: skip
    d = c.Egressd(workdir, HTTP_PORT, TABLE, env)
    clients: dict[int, c.Proc] = {}
    h: c.Http | None = None
    try:
        if "ready" not in up.readline(60):
            raise c.BenchError("upstream did not start")
        d.start(timeout=30)
        h = c.Http(HTTP_PORT, 30)
        mitm = mitm_child(d)
        register(h)
        mitm_ca, up_ca = str(workdir / "mitm-conf" / "mitmproxy-ca-cert.pem"), str(tls / "ca.pem")
        paths: list[BenchPath] = [("direct", 1, DIRECT_PORT, up_ca, f"Bearer {PLACEHOLDER}", PATH),
                                  ("mitm+inject", 1, 443, mitm_ca, "[REDACTED]", PATH),
                                  ("mitm decrypt, no match", 1, 443, mitm_ca, f"Bearer {PLACEHOLDER}", OTHER_PATH),
                                  ("mitm passthrough", 2, 443, up_ca, f"Bearer {PLACEHOLDER}", PATH)]  # fmt: skip
        for k in (1, 2):
            dig(topo, k)
            clients[k] = c.Proc([str(c.VENV_PY), "-c", CLIENT], ns=topo.ns(f"sb{k}"))
            clients[k].read_json(20)
        procs = {
            "egressd": d.pid,
            "mitm": mitm,
            "upstream": up.pid,
            "client1": clients[1].pid,
            "client2": clients[2].pid,
        }
        warm_up(clients, paths, args.warmup)
        c.log("warm-up ok: direct reaches :8443, the MITM paths :443, the key injected on mitm+inject only")
        rss0 = {k: (c.mem_kb(procs[k]), 0) for k in ("egressd", "mitm")}
        log = LogTail(d.log_path)
        res: dict[str, dict[str, Any]] = {}
        for label, keep, conc, n_total in phases(args):
            res[label] = run_phase(args, topo, clients, paths, procs, log, keep, conc, n_total)
            c.log(f"{label}: done")
        if c.children(d.pid) != [mitm]:
            raise c.BenchError("the MITM child was restarted during the run: figures not comparable")
        whole = d.log_path.read_text(errors="replace")
        out = {"phases": res, "rss_before_kb": rss0, "hwm_kb": {k: c.mem_kb(procs[k], "VmHWM") for k in ("egressd", "mitm")},
               "refused": whole.count("mitm.refused"), "mitm_errors": whole.count("mitm.error")}  # fmt: skip
    except (OSError, http.client.HTTPException, c.BenchError) as exc:
        raise c.BenchError(f"{exc}\n--- egressd log tail ---\n{d.log_tail()}") from None
    finally:
        if h is not None:
            h.close()
        for cl in clients.values():
            cl.stop(5)
        d.stop()
        up.stop()
    report(rep, args, out, [p[0] for p in paths])
    return out


def mitm_child(d: c.Egressd) -> int:
    """The PID of egressd's one MITM child (the benchmark times it on its own)."""
    deadline = time.monotonic() + 20
    while len(kids := c.children(d.pid)) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    if len(kids) != 1:
        raise c.BenchError(f"expected one MITM child of egressd {d.pid}, got {kids}")
    return kids[0]


def register(h: c.Http) -> None:
    """bm1 and bm2 active with the same policy; only bm1 has the vault."""
    pol = c.policy("deny", ("allow", API))
    for k in (1, 2):
        h.action(
            c.envelope("SET_BINDING", f"bm{k}", ip=f"10.203.0.{10 + k}", policy=pol), f"SET_BINDING bm{k}"
        )
        h.action(c.envelope("LIFECYCLE_HOOK", f"bm{k}", hook=True), f"data-plane-ready bm{k}")
    code, text, _ = h.request(
        "PUT", "/v1/sandboxfleets/bm1/egress/credential-vault", json.dumps(VAULT).encode()
    )
    if code != 201:
        raise c.BenchError(f"vault PUT: {code} {text[:300]!r}")


def batch(
    clients: dict[int, c.Proc], p: BenchPath, n: int, conc: int, keep: bool, deadline: float
) -> dict[str, Any]:
    return clients[p[1]].call({"host": API, "ip": API_IP, "port": p[2], "ca": p[3], "path": p[5], "placeholder": PLACEHOLDER,
                               "expect_echo_auth": p[4], "n": n, "conc": conc, "keepalive": keep, "deadline_s": deadline}, deadline + 30)  # fmt: skip


def warm_up(clients: dict[int, c.Proc], paths: list[BenchPath], n: int) -> None:
    """Warm-up and sanity: leaf minted, vault snapshot cached; the upstream saw what it should."""
    for p in paths:
        r = batch(clients, p, n, 1, False, 20)
        s = r["sample"]
        if (
            r["errors"]
            or len(r["lat_ms"]) != n
            or (s.get("port"), s.get("tls"), s.get("local")) != (p[2], True, API_IP)
        ):
            raise c.BenchError(
                f"warm-up {p[0]}: errors {r['errors']}, {len(r['lat_ms'])} ok, upstream saw {s}"
            )


def phases(args: argparse.Namespace) -> list[tuple[str, bool, int, int]]:
    """(label, keep-alive, in flight, requests) of each measured phase."""
    out = [
        ("new conn, sequential", False, 1, args.n_seq),
        (f"new conn, {args.conc} in flight", False, args.conc, args.n_conc),
    ]
    if args.keepalive:
        out += [
            ("keep-alive, sequential", True, 1, args.n_seq),
            (f"keep-alive, {args.conc} in flight", True, args.conc, args.n_conc),
        ]
    return out


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


def run_phase(
    args: argparse.Namespace,
    topo: c.Topology,
    clients: dict[int, c.Proc],
    paths: list[BenchPath],
    procs: dict[str, int],
    log: LogTail,
    keep: bool,
    conc: int,
    n_total: int,
) -> dict[str, Any]:
    """One phase: the paths in interleaved batches (ABBA...), CPU per process, lookup times."""
    k = args.batches
    order = [p for r_ in range(k) for p in (paths if r_ % 2 == 0 else paths[::-1])]
    res: dict[str, Any] = {
        p[0]: {"lat": [], "errors": {}, "wall": 0.0, "cpu": dict.fromkeys(procs, 0.0), "lookup": [], "decide": []}
        for p in paths
    }  # fmt: skip
    for i, p in enumerate(order):
        x = res[p[0]]
        n = n_total // k + (1 if i // len(paths) < n_total % k else 0)
        dig(topo, p[1])
        c0 = {name: c.cpu_s(pid) for name, pid in procs.items()}
        r = batch(clients, p, n, conc, keep, PHASE_CAP_S / k)
        for name, pid in procs.items():
            x["cpu"][name] += c.cpu_s(pid) - c0[name]
        time.sleep(0.05)  # the supervisor re-logs the addon's last lines
        new = log.read()
        x["lookup"] += [
            float(m[1])
            for ln in new.splitlines()
            if "mitm.injected" in ln and (m := re.search(r'"lookup_ms":\s*([0-9.]+)', ln))
        ]
        # The connection-time decision of a relayed connection (§16: one vault lookup).
        x["decide"] += [
            float(m[1])
            for ln in new.splitlines()
            if "mitm.connection" in ln and '"passthrough"' in ln
            and (m := re.search(r'"lookup_ms":\s*([0-9.]+)', ln))
        ]  # fmt: skip
        x["lat"] += r["lat_ms"] + [math.inf] * (n - len(r["lat_ms"]))
        for kind, cnt in {
            **r["errors"],
            **({"not sent (time cap)": n - r["attempted"]} if r["attempted"] < n else {}),
        }.items():
            x["errors"][kind] = x["errors"].get(kind, 0) + cnt
        x["wall"] += r["wall_s"]
    for name in ("egressd", "mitm"):
        res[name + "_rss_kb"] = {"kb": c.mem_kb(procs[name])}
    return res


def report(rep: c.Report, args: argparse.Namespace, out: dict[str, Any], names: list[str]) -> None:
    rep.add(f"GET https://{API}{PATH} from sandbox namespaces; {args.batches} interleaved batches per path and phase;"
            " latency = connect + TLS + request + full response, client-side; baseline: direct (:8443, not intercepted)")  # fmt: skip
    rep.add("")
    rows, cpu_rows, errs = [], [], []
    for label, by in out["phases"].items():
        b = c.summary(by["direct"]["lat"])
        for name in names:
            x = by[name]
            s, ok = c.summary(x["lat"]), sum(1 for v in x["lat"] if math.isfinite(v)) or 1
            rows.append([label, name, s["n"], ok / x["wall"] if x["wall"] else math.nan, s["p50"], s["p90"], s["p99"], s["max"],
                         s["p50"] - b["p50"], s["p99"] - b["p99"], c.ratio(s["p50"], b["p50"]), c.ratio(s["p99"], b["p99"])])  # fmt: skip
            cpu_rows.append([label, name, *(x["cpu"][k] * 1000.0 / ok for k in x["cpu"])])
            if name != "direct":
                a50, a99 = s["p50"] - b["p50"], s["p99"] - b["p99"]
                rep.target(f"{label}, {name}", a50 <= T_P50_ADDED_MS and a99 <= T_P99_ADDED_MS,
                           f"+p50 {a50:+.2f} ms ({c.ratio(s['p50'], b['p50'])}), +p99 {a99:+.2f} ms ({c.ratio(s['p99'], b['p99'])})",
                           f"+p50 <= {T_P50_ADDED_MS:g}, +p99 <= {T_P99_ADDED_MS:g} ms")  # fmt: skip
            if x["errors"]:
                errs.append(f"  {label}, {name}: failed requests (counted as +inf) {x['errors']}")
    rep.add("(1) latency, ms")
    rep.table(
        ["phase", "path", "n", "req/s", "p50", "p90", "p99", "max", "+p50", "+p99", "p50 ratio", "p99 ratio"],
        rows,
    )
    for e in errs:
        rep.add(e)
    rep.add("")
    rep.add("(2) CPU per successful request, ms (utime+stime around the path's batches)")
    rep.table(["phase", "path", *next(iter(out["phases"].values()))["direct"]["cpu"]], cpu_rows)
    rep.add("")
    rb = out["rss_before_kb"]
    rep.add("(3) RSS, MiB: egressd / MITM child before the load " + f"{rb['egressd'][0] / 1024:.1f} / {rb['mitm'][0] / 1024:.1f}; after "
            + "; ".join(f"{lbl} {by['egressd_rss_kb']['kb'] / 1024:.1f} / {by['mitm_rss_kb']['kb'] / 1024:.1f}" for lbl, by in out["phases"].items())
            + f"; peak {out['hwm_kb']['egressd'] / 1024:.1f} / {out['hwm_kb']['mitm'] / 1024:.1f}")  # fmt: skip
    rep.add("(4) the addon's vault lookup + decision (lookup_ms of mitm.injected), ms: " + "; ".join(
        f"{lbl} p50 {c.pct(lk, 50):.2f} p99 {c.pct(lk, 99):.2f} (n {len(lk)})" for lbl, by in out["phases"].items() if (lk := by["mitm+inject"]["lookup"])))  # fmt: skip
    rep.add("(5) the addon's connection decision for mitm passthrough (lookup_ms of mitm.connection), ms: " + "; ".join(
        f"{lbl} p50 {c.pct(dk, 50):.2f} p99 {c.pct(dk, 99):.2f} (n {len(dk)})" for lbl, by in out["phases"].items() if (dk := by["mitm passthrough"]["decide"])))  # fmt: skip
    rep.add(f"    whole daemon log: mitm.refused {out['refused']}, mitm.error {out['mitm_errors']}")


def build(topo: c.Topology) -> None:
    c.pod_topology(topo, 2, [DNS_IP, API_IP])


def main() -> int:
    p = c.parser(__doc__, "60 sequential / 200 concurrent requests per path and phase")
    p.add_argument("--n-seq", type=int, default=300, help="sequential requests per path and phase (300)")
    p.add_argument("--n-conc", type=int, default=800, help="concurrent requests per path and phase (800)")
    p.add_argument("--conc", type=int, default=16, help="requests in flight (16)")
    p.add_argument("--batches", type=int, default=4, help="interleaved batches per path and phase (4)")
    p.add_argument("--warmup", type=int, default=30, help="unrecorded requests per path first (30)")
    p.add_argument(
        "--no-keepalive", dest="keepalive", action="store_false", help="only the new-connection phases"
    )
    p.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra egressd environment (experiments)",
    )
    return c.main(
        "mitm", "egbm", ["pod", "up", "sb1", "sb2"], "pod", p.parse_args(), inner, build, ("ip", "nft", "dig")
    )


if __name__ == "__main__":
    sys.exit(main())
