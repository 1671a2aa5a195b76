"""The MITM's response path, measured by ``bench_mitm.py`` (issue 23, docs/reference/behaviour.md §10).

Side by side in one run, on configuration A's topology copy and daemon (and one more egressd,
"R", the same environment with ``EGRESSD_MITM_BODY_REDACTION=off``):

* **time to first byte of a server-sent-events answer**: request written on an open keep-alive
  connection -> first event byte read, client-side; the upstream sends the event at once. Paths
  ``direct`` (sb1 -> :8443, not intercepted), ``relayed`` (sb2, no vault: the MITM relays the TCP
  stream, docs/reference/behaviour.md §16), ``decrypted`` (sb1 -> :443, its vault's binding matches: injected,
  the body through the redactor), ``decrypted, redaction off`` (the same on R). Also each event's
  delivery delay: the client's receive time minus the upstream's send time in the event.
* **bulk throughput** of a download with a Content-Length, MiB/s, the same four paths.
* **memory** (what must not break): a body of ``--bulk-mib`` with and without Content-Length
  and an upload of ``--upload-mib`` through the decrypting, redacting MITM: the MITM child's
  VmRSS sampled every 20 ms, growth = peak - before; the bytes hash-compared end to end
  (a mismatch fails the run).

Pure helpers (rounds, verdicts) first, then the shell.
"""

from __future__ import annotations

import argparse
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import common as c

BODY_REDACTION_ENV = "EGRESSD_MITM_BODY_REDACTION"
T_TTFB_ADDED_MS = 2.0  # decrypted TTFB p50 within 2 ms of relayed
T_THROUGHPUT_FACTOR = 0.5  # decrypted throughput at least half of direct
T_RELAYED_FACTOR = 0.8  # issue 25: relayed (name-checked) throughput at least 80 % of direct
T_GROWTH_MIB = 64.0  # MITM growth for the large transfers
RSS_PERIOD_S = 0.02

# The client, run in a sandbox namespace (stdin: JSON commands, stdout: one JSON answer each).
STREAM_CLIENT = r"""
import hashlib, http.client, json, socket, ssl, sys, time

PATTERN = hashlib.shake_256(b"egressd stream pattern").digest(1 << 20)
conns = {}

class Conn(http.client.HTTPSConnection):
    def __init__(self, c):
        super().__init__(c["host"], c["port"], context=ssl.create_default_context(cafile=c["ca"]), timeout=60)
        self._ip = c["ip"]
    def connect(self):
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)

def conn(c):
    key = (c["port"], c["ca"])
    if key not in conns:
        conns[key] = Conn(c)
    return conns[key]

def hdrs(c):
    return {"Authorization": "Bearer " + c["placeholder"], "Connection": "keep-alive"}

def sse(c):
    x = conn(c)
    t0 = time.perf_counter()
    x.request("GET", "/_stream/sse?n=2&gap=0&id=bench", headers=hdrs(c))
    r = x.getresponse()
    buf = b""
    while b"data:" not in buf:
        got = r.read1(65536)
        if not got:
            raise RuntimeError("no event")
        buf += got
    t1, wall = time.perf_counter(), time.time()
    rest = r.read()
    first = (buf + rest).split(b"data: ", 1)[1].split(b"\n", 1)[0]
    return {"ttfb_ms": (t1 - t0) * 1000.0, "delay_ms": (wall - json.loads(first)["sent"]) * 1000.0, "status": r.status}

def download(c):
    x = conn(c)
    buf = memoryview(bytearray(1 << 20))
    h = hashlib.sha256() if c.get("hash") else None
    t0 = time.perf_counter()
    x.request("GET", "/_stream/bytes?size=%d&framing=%s&chunk=262144" % (c["size"], c["framing"]), headers=hdrs(c))
    r = x.getresponse()
    n = 0
    while True:
        k = r.readinto(buf)
        if not k:
            break
        n += k
        if h is not None:
            h.update(buf[:k])
    t1 = time.perf_counter()
    return {"bytes": n, "s": t1 - t0, "status": r.status, "sha256": h.hexdigest() if h else None,
            "announced": r.getheader("X-Body-Sha256"), "encoding": r.getheader("Content-Encoding")}

def upload(c):
    x = conn(c)
    size, h = c["size"], hashlib.sha256()
    def body():
        sent = 0
        while sent < size:
            piece = PATTERN[: min(len(PATTERN), size - sent)]
            h.update(piece)
            sent += len(piece)
            yield piece
    t0 = time.perf_counter()
    x.request("POST", "/_stream/upload", body=body(), headers={**hdrs(c), "Content-Length": str(size),
              "Content-Type": "application/octet-stream"})
    r = x.getresponse()
    got = json.loads(r.read())
    return {"s": time.perf_counter() - t0, "status": r.status, "sent_sha256": h.hexdigest(), "upstream": got}

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    c = json.loads(line)
    try:
        out = {"sse": sse, "download": download, "upload": upload}[c["op"]](c)
    except Exception as exc:
        conns.clear()
        out = {"error": "%s: %s" % (type(exc).__name__, exc)}
    print(json.dumps(out), flush=True)
"""


# ---- pure ---------------------------------------------------------------------------------------


class StreamPath(NamedTuple):
    label: str
    pod: int  # 0: configuration A's copy, 1: the redaction-off copy R
    sandbox: int
    port: int
    mitm_ca: bool  # the client trusts the MITM CA (decrypted) or the upstream's (direct, relayed)


PATHS = (
    StreamPath("direct", 0, 1, 8443, False),
    StreamPath("relayed", 0, 2, 443, False),
    StreamPath("decrypted", 0, 1, 443, True),
    StreamPath("decrypted, redaction off", 1, 1, 443, True),
)


def interleaved(labels: Sequence[str], rounds: int) -> list[str]:
    """Every label once per round, the order reversed every other round."""
    return [lbl for r in range(rounds) for lbl in (labels if r % 2 == 0 else list(reversed(labels)))]


def ttfb_met(decrypted_p50: float, relayed_p50: float) -> bool:
    return math.isfinite(decrypted_p50) and math.isfinite(relayed_p50) and decrypted_p50 - relayed_p50 <= T_TTFB_ADDED_MS


def throughput_met(decrypted: float, direct: float) -> bool:
    return direct > 0 and decrypted >= T_THROUGHPUT_FACTOR * direct


def median(xs: Sequence[float]) -> float:
    return c.pct(list(xs), 50) if xs else math.nan


def sizes(args: argparse.Namespace) -> dict[str, int]:
    """MiB of each transfer (``--quick``: CI-sized)."""
    q = args.quick
    return {
        "bulk": min(args.bulk_mib, 48) if q else args.bulk_mib,
        "upload": min(args.upload_mib, 16) if q else args.upload_mib,
        "throughput": min(args.throughput_mib, 24) if q else args.throughput_mib,
        "rounds": min(args.throughput_rounds, 2) if q else args.throughput_rounds,
        "sse": min(args.sse_rounds, 8) if q else args.sse_rounds,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-only", action="store_true", help="only the response-path part (issue 23)")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="skip the response-path part")
    p.add_argument("--bulk-mib", type=int, default=1024, help="memory check: body size, MiB (1024; --quick 48)")
    p.add_argument("--upload-mib", type=int, default=256, help="memory check: upload size, MiB (256; --quick 16)")
    p.add_argument("--throughput-mib", type=int, default=256, help="throughput: download size, MiB (256; --quick 16)")
    p.add_argument("--throughput-rounds", type=int, default=3, help="throughput: downloads per path (3; --quick 2)")
    p.add_argument("--sse-rounds", type=int, default=40, help="SSE time to first byte: samples per path (40; --quick 8)")


# ---- the shell ----------------------------------------------------------------------------------


class RssPeak:
    """VmRSS of some pids sampled every 20 ms in a thread: each one's growth (MiB) over the block."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.before = {p: c.mem_kb(p) for p in self.pids}
        self.peak = dict(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for p in self.pids:
            self.peak[p] = max(self.peak[p], c.mem_kb(p))

    def _run(self) -> None:
        while not self._stop.wait(RSS_PERIOD_S):
            self._sample()

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()

    def growth_mib(self) -> float:
        return max((self.peak[p] - self.before[p]) / 1024 for p in self.pids) if self.pids else math.nan


class Clients:
    """One stream client per (copy, sandbox) in use."""

    def __init__(self, pods: Sequence[Any], topo: c.Topology) -> None:
        self.pods = pods
        self.procs: dict[tuple[int, int], c.Proc] = {}
        for path in PATHS:
            if path.pod < len(pods) and (path.pod, path.sandbox) not in self.procs:
                ns = topo.ns(f"{pods[path.pod].prefix}sb{path.sandbox}")
                self.procs[(path.pod, path.sandbox)] = c.Proc([str(c.VENV_PY), "-c", STREAM_CLIENT], ns=ns)
        for proc in self.procs.values():
            proc.read_json(20)

    def call(self, path: StreamPath, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        pod = self.pods[path.pod]
        ca = pod.mitm_ca if path.mitm_ca else pod.upstream_ca
        pod.dig(path.sandbox)
        full = {"host": pod.api, "ip": pod.api_ip, "port": path.port, "ca": ca, "placeholder": pod.placeholder, **cmd}
        out = self.procs[(path.pod, path.sandbox)].call(full, timeout)
        if out.get("status") not in (200, None):
            raise c.BenchError(f"{path.label}: HTTP {out.get('status')}")
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop(5)


def _paths(pods: Sequence[Any]) -> list[StreamPath]:
    return [p for p in PATHS if p.pod < len(pods)]


def measure_ttfb(clients: Clients, paths: Sequence[StreamPath], rounds: int) -> dict[str, dict[str, list[float]]]:
    by = {p.label: p for p in paths}
    for p in paths:  # connections opened, the MITM's upstream connection too
        for _ in range(3):
            clients.call(p, {"op": "sse"}, 30)
    out: dict[str, dict[str, list[float]]] = {p.label: {"ttfb": [], "delay": []} for p in paths}
    for lbl in interleaved(list(by), rounds):
        r = clients.call(by[lbl], {"op": "sse"}, 30)
        out[lbl]["ttfb"].append(r["ttfb_ms"])
        out[lbl]["delay"].append(r["delay_ms"])
    return out


def _cpu(clients: Clients, path: StreamPath) -> dict[str, float]:
    """CPU seconds so far of the processes a download on ``path`` runs through."""
    pod = clients.pods[path.pod]
    return {
        "MITM": sum(c.cpu_s(pid) for pid in pod.mitm),
        "upstream": c.cpu_s(pod.up.pid if pod.up else 0),
        "client": c.cpu_s(clients.procs[(path.pod, path.sandbox)].pid),
        # every CPU, softirq included: on a saturated machine the ratio to direct follows it
        "machine": c.machine_cpu()[0] / os.sysconf("SC_CLK_TCK"),
    }


def measure_throughput(
    clients: Clients, paths: Sequence[StreamPath], mib: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """MiB/s of each download, and CPU ms per MiB of each process on the path (summed)."""
    by = {p.label: p for p in paths}
    out: dict[str, list[float]] = {p.label: [] for p in paths}
    cpu: dict[str, dict[str, float]] = {p.label: {"MITM": 0.0, "upstream": 0.0, "client": 0.0, "machine": 0.0} for p in paths}
    for lbl in interleaved(list(by), rounds):
        before = _cpu(clients, by[lbl])
        r = clients.call(by[lbl], {"op": "download", "size": mib << 20, "framing": "length"}, 600)
        after = _cpu(clients, by[lbl])
        if r["bytes"] != mib << 20:
            raise c.BenchError(f"{lbl}: {r['bytes']} bytes of {mib << 20}")
        out[lbl].append(mib / r["s"])
        for k in cpu[lbl]:
            cpu[lbl][k] += (after[k] - before[k]) * 1000.0 / (mib * rounds)
    return out, cpu


def measure_memory(clients: Clients, pod: Any, sz: dict[str, int]) -> list[dict[str, Any]]:
    """The large transfers through the decrypting, redacting MITM (configuration A), hashes checked."""
    path = next(p for p in PATHS if p.label == "decrypted")
    out = []
    transfers: list[tuple[str, dict[str, Any]]] = [
        (f"{sz['bulk']} MiB response, Content-Length", {"op": "download", "size": sz["bulk"] << 20, "framing": "length", "hash": True}),
        (f"{sz['bulk']} MiB response, chunked", {"op": "download", "size": sz["bulk"] << 20, "framing": "chunked", "hash": True}),
        (f"{sz['upload']} MiB request body", {"op": "upload", "size": sz["upload"] << 20}),
    ]  # fmt: skip
    for what, cmd in transfers:
        with RssPeak(pod.mitm) as rss:
            r = clients.call(path, cmd, 900)
        if cmd["op"] == "download":
            intact = r["bytes"] == cmd["size"] and r["sha256"] == r["announced"]
        else:
            intact = r["upstream"] == {"bytes": cmd["size"], "sha256": r["sent_sha256"]}
        if not intact:
            raise c.BenchError(f"memory check, {what}: the bytes did not arrive intact: {r}")
        out.append({"what": what, "growth_mib": rss.growth_mib(), "mib_s": cmd["size"] / (1 << 20) / r["s"],
                    "before_mib": max(rss.before.values()) / 1024})  # fmt: skip
        c.log(f"memory check, {what}: MITM +{out[-1]['growth_mib']:.1f} MiB, intact")
    return out


def run(args: argparse.Namespace, pods: Sequence[Any], topo: c.Topology) -> dict[str, Any]:
    """The response-path part: ``pods[0]`` is configuration A, ``pods[1]`` (if any) R."""
    sz = sizes(args)
    clients = Clients(pods, topo)
    try:
        paths = _paths(pods)
        ttfb = measure_ttfb(clients, paths, sz["sse"])
        c.log("stream: SSE time to first byte done")
        throughput, cpu = measure_throughput(clients, paths, sz["throughput"], sz["rounds"])
        c.log("stream: throughput done")
        memory = measure_memory(clients, pods[0], sz)
    finally:
        clients.stop()
    return {"sizes": sz, "ttfb": ttfb, "throughput": throughput, "cpu_ms_per_mib": cpu, "memory": memory}


# ---- the report ---------------------------------------------------------------------------------


def report(rep: c.Report, out: Mapping[str, Any]) -> None:
    sz, ttfb, tput = out["sizes"], out["ttfb"], out["throughput"]
    rep.add("")
    rep.add(f"(7) response path (issue 23), configuration A's copy; 'redaction off' = the same daemon environment"
            f" + {BODY_REDACTION_ENV}=off on its own copy")  # fmt: skip
    rep.add(f"  SSE time to first byte on an open connection ({sz['sse']} samples per path, interleaved), ms;"
            " delay = client receive time - upstream send time of the first event")  # fmt: skip
    relayed = c.pct(ttfb["relayed"]["ttfb"], 50)
    rows = []
    for lbl, x in ttfb.items():
        s = c.summary(x["ttfb"])
        rows.append([lbl, s["n"], s["p50"], s["p90"], s["p99"], s["p50"] - relayed, c.pct(x["delay"], 50), c.pct(x["delay"], 99)])
    rep.table(["path", "n", "p50", "p90", "p99", "+p50 vs relayed", "delay p50", "delay p99"], rows)
    rep.add(f"  bulk download with Content-Length, {sz['throughput']} MiB x {sz['rounds']} per path, MiB/s (median; all)")
    direct = median(tput["direct"])
    cpu = out.get("cpu_ms_per_mib", {})
    rows = []
    for lbl, v in tput.items():
        u = cpu.get(lbl, {})
        rows.append([lbl, median(v), c.ratio(median(v), direct), " ".join(f"{x:.0f}" for x in v),
                     u.get("MITM", math.nan), u.get("upstream", math.nan), u.get("client", math.nan),
                     u.get("machine", math.nan)])  # fmt: skip
    rep.table(["path", "median MiB/s", "vs direct", "all", "CPU ms/MiB: MITM", "upstream", "client", "machine"], rows)
    paired = sorted(r / d for r, d in zip(tput.get("relayed", []), tput["direct"], strict=False) if d > 0)
    if paired:  # each round's relayed download next to its direct one: drift of the machine cancels
        rep.add(f"  relayed / direct per round: median {median(paired):.2f}x, lowest {paired[0]:.2f}x,"
                f" highest {paired[-1]:.2f}x")  # fmt: skip
    rep.add("  memory (what must not break): decrypted + redacted, MITM child VmRSS peak - before, sampled every 20 ms;"
            " bytes hash-compared end to end")  # fmt: skip
    rep.table(["transfer", "MITM growth MiB", "MITM RSS before MiB", "MiB/s"],
              [[m["what"], m["growth_mib"], m["before_mib"], m["mib_s"]] for m in out["memory"]])  # fmt: skip
    targets(rep, out)


def targets(rep: c.Report, out: Mapping[str, Any]) -> None:
    ttfb, tput = out["ttfb"], out["throughput"]
    d50, r50 = c.pct(ttfb["decrypted"]["ttfb"], 50), c.pct(ttfb["relayed"]["ttfb"], 50)
    rep.target("issue 23 SSE time to first byte: decrypted within 2 ms of relayed", ttfb_met(d50, r50),
               f"p50 {d50:.2f} vs {r50:.2f} ms ({d50 - r50:+.2f})", f"<= +{T_TTFB_ADDED_MS:g} ms")  # fmt: skip
    direct = median(tput["direct"])
    got = median(tput["relayed"])
    rep.target("issue 25 throughput: relayed (SNI name-checked, docs/reference/behaviour.md §18) at least 80 % of direct",
               math.isfinite(got) and math.isfinite(direct) and got >= T_RELAYED_FACTOR * direct,
               f"{got:.0f} vs {direct:.0f} MiB/s ({c.ratio(got, direct)})", f">= {T_RELAYED_FACTOR:g}x direct")  # fmt: skip
    for lbl in ("decrypted", "decrypted, redaction off"):
        if lbl in tput:
            got = median(tput[lbl])
            rep.target(f"issue 23 throughput: {lbl} at least half of direct", throughput_met(got, direct),
                       f"{got:.0f} vs {direct:.0f} MiB/s ({c.ratio(got, direct)})", f">= {T_THROUGHPUT_FACTOR:g}x direct")  # fmt: skip
    if "decrypted, redaction off" not in tput:
        rep.unjudged("issue 23 throughput: decrypted, redaction off", "no topology copy left for it (4 configurations)",
                     f">= {T_THROUGHPUT_FACTOR:g}x direct")  # fmt: skip
    for m in out["memory"]:
        rep.target(f"issue 23 memory: {m['what']}", m["growth_mib"] <= T_GROWTH_MIB,
                   f"MITM +{m['growth_mib']:.1f} MiB, intact", f"<= {T_GROWTH_MIB:g} MiB")  # fmt: skip
