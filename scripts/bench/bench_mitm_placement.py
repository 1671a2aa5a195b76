#!/usr/bin/env python3
"""MITM placement benchmark: mitmproxy in a thread of the daemon vs in a child process.

Run as root from the repository root::

    .venv/bin/python scripts/bench/bench_mitm_placement.py [--quick] [--rounds N] [--keepalive]

egressd runs its shared mitmproxy as a supervised child. What would the in-process alternative
(a ``mitmproxy.master.Master`` in a dedicated thread with its own event loop) cost the daemon's
latency-critical work, which shares the GIL with it? Everything runs on 127.0.0.1 inside one
throwaway namespace ``egbp<pid>-ns`` (no nft, no routes):

* ``echo``    an aiohttp HTTPS server (self-signed P-256 certificate);
* ``daemon``  a stand-in for egressd: an asyncio UDP service answering dnslib A records (the DNS
  proxy's kind of work), plus **A in-proc** the lean Master of egressd/mitmchild/runner.py in a
  thread, **B child** the same Master in a child process, or **C none** (baseline; its load
  phase sends the same HTTPS load straight to the echo server);
* ``udp``     the measuring client: queries at a fixed rate, RTT of each;
* ``load``    aiohttp keeping ``--inflight`` HTTPS requests in flight through the MITM.

Each round runs A, B, C (order rotated) with a fresh daemon: an idle window, then a window under
load. Every process dies with its parent (PR_SET_PDEATHSIG) and is ended by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import gc
import json
import math
import os
import select
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c

CAP_S, START_S = 60.0, 20.0
LABEL = {"A": "A in-proc", "B": "B child", "C": "C none"}


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _self(role: str, *args: object) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), role, *map(str, args)]


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, separators=(",", ":")), flush=True)


def _on_signals(loop: asyncio.AbstractEventLoop, fn: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, fn)


# ---- roles --------------------------------------------------------------------------------------


def role_echo(cert: str, key: str) -> int:
    from aiohttp import web

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)

    async def echo(_r: web.Request) -> web.Response:
        return web.Response(body=b'{"ok":true}\n', content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/echo", echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx, backlog=512).start()
        _emit({"port": runner.addresses[0][1]})
        stop = asyncio.Event()
        _on_signals(asyncio.get_running_loop(), stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())
    return 0


class BenchAddon:
    """Stands in for the egressd addon: its start-up gc freeze, and one cheap response hook."""

    def running(self) -> None:
        gc.collect()
        gc.freeze()

    def response(self, flow: Any) -> None:
        flow.response.headers["x-bench-mitm"] = "1"


def _master(port: int, confdir: str) -> Any:
    """egressd/mitmchild/runner.py's lean master with the supervisor's options (needs a running loop)."""
    import logging

    from mitmproxy import master, options
    from mitmproxy.addons import core, disable_h2c, next_layer, proxyserver, tlsconfig

    logging.getLogger().setLevel(logging.WARNING)
    opts = options.Options()
    m = master.Master(opts, with_termlog=False)
    m.addons.add(
        core.Core(),
        disable_h2c.DisableH2C(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        tlsconfig.TlsConfig(),
        BenchAddon(),
    )
    opts.set("mode=regular", "listen_host=127.0.0.1", f"listen_port={port}", f"confdir={confdir}", "connection_strategy=lazy",
             "upstream_cert=false", "stream_large_bodies=1m", "ssl_insecure=true")  # fmt: skip
    return m


def role_mitm(port: str, confdir: str) -> int:
    """B's child: the master in the main thread of its own process."""

    async def main() -> None:
        m = _master(int(port), confdir)
        _on_signals(asyncio.get_running_loop(), m.shutdown)
        await m.run()

    asyncio.run(main())
    return 0


class InProcMitm(threading.Thread):
    """A: the master in a dedicated thread with its own event loop."""

    def __init__(self, port: int, confdir: str) -> None:
        super().__init__(name="mitm", daemon=True)
        self.port, self.confdir, self.tid = port, confdir, 0
        self.error: BaseException | None = None
        self.m: Any = None
        self.loop, self.ready = asyncio.new_event_loop(), threading.Event()

    def run(self) -> None:
        self.tid = threading.get_native_id()

        async def main() -> None:
            self.m = _master(self.port, self.confdir)
            self.ready.set()
            await self.m.run()

        try:
            self.loop.run_until_complete(main())
        except BaseException as exc:  # reported to the daemon's main thread
            self.error = exc
            self.ready.set()

    def stop(self) -> None:
        async def close() -> None:  # Master.shutdown() alone leaves the listeners open
            if (ps := self.m.addons.get("proxyserver")) is not None:
                await ps.servers.update([])
            self.m.shutdown()

        if self.m is not None and not self.loop.is_closed():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.join(5)


class UdpService(asyncio.DatagramProtocol):
    """Parse the query with dnslib, answer one A record: a little Python work per datagram."""

    def __init__(self) -> None:
        from dnslib import QTYPE, RR, A, DNSRecord

        self.parse, self.rr, self.a, self.qa, self.tr, self.served = DNSRecord.parse, RR, A, QTYPE.A, None, 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        with contextlib.suppress(Exception):
            q = self.parse(data)
            r = q.reply()
            r.add_answer(self.rr(q.q.qname, self.qa, rdata=self.a("10.1.2.3"), ttl=60))
            self.tr.sendto(r.pack(), addr)  # type: ignore[attr-defined]
            self.served += 1


def _wait_tcp(port: int) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.02)
    raise RuntimeError("mitm is not listening")


def role_daemon(mode: str, confdir: str, mitm_log: str, switch_ms: str) -> int:
    if float(switch_ms) > 0:
        sys.setswitchinterval(float(switch_ms) / 1000)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info: dict[str, Any] = {"pid": os.getpid(), "mitm_port": port}
    inproc, child = None, None
    try:
        if mode == "A":
            inproc = InProcMitm(port, confdir)
            inproc.start()
            if not inproc.ready.wait(START_S) or inproc.error:
                raise RuntimeError(f"in-process mitm did not start: {inproc.error!r}")
            info["mitm_tid"] = inproc.tid
        elif mode == "B":  # spawned from the main thread: PDEATHSIG fires when the forking *thread* exits
            with open(mitm_log, "ab") as log:
                child = subprocess.Popen(
                    _self("_mitm", port, confdir),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    preexec_fn=_die_with_parent,
                )
            info["mitm_pid"] = child.pid
        if mode != "C":
            _wait_tcp(port)

        async def main() -> None:
            loop, stop = asyncio.get_running_loop(), asyncio.Event()
            _on_signals(loop, stop.set)
            transport, _svc = await loop.create_datagram_endpoint(UdpService, local_addr=("127.0.0.1", 0))
            _emit({**info, "udp_port": transport.get_extra_info("sockname")[1]})
            await stop.wait()
            transport.close()

        asyncio.run(main())
    finally:
        if inproc is not None:
            inproc.stop()
        if child is not None and child.poll() is None:
            child.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(5)
            child.kill()
    return 0


def role_udp(port: str, rate_s: str, seconds: str) -> int:
    from dnslib import DNSRecord

    rate = float(rate_s)
    n = min(65535, int(rate * min(float(seconds), CAP_S)))
    packets = []
    for i in range(n):
        q = DNSRecord.question(f"q{i}.bench.test")
        q.header.id = i
        packets.append(q.pack())
    sent, lag = [0.0] * n, []
    rtt: list[float | None] = [None] * n
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(("127.0.0.1", int(port)))
    sock.setblocking(False)

    def drain() -> None:
        now = time.perf_counter()
        with contextlib.suppress(BlockingIOError):
            while True:
                data = sock.recv(4096)
                qid = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else n
                if qid < n and rtt[qid] is None and sent[qid]:
                    rtt[qid] = (now - sent[qid]) * 1000.0

    t0, i = time.perf_counter() + 0.05, 0
    while i < n:
        now, due = time.perf_counter(), t0 + i / rate
        if now >= due:
            sent[i] = time.perf_counter()
            sock.send(packets[i])
            lag.append((sent[i] - due) * 1000.0)
            i += 1
        elif select.select([sock], [], [], due - now)[0]:
            drain()
    end = time.perf_counter() + 1.0  # stragglers
    while time.perf_counter() < end and any(x is None for x in rtt[-50:]):
        if select.select([sock], [], [], max(0.0, end - time.perf_counter()))[0]:
            drain()
    drain()
    _emit(
        {
            "rtt_ms": [round(x, 4) if x is not None else None for x in rtt],
            "lag_p99_ms": round(c.pct(lag, 99), 3),
        }
    )
    return 0


def role_load(
    echo_port: str, proxy_port: str, inflight_s: str, max_req: str, deadline_s: str, keep: str, *cafiles: str
) -> int:
    import aiohttp

    ctx = ssl.create_default_context()
    for ca in cafiles:
        ctx.load_verify_locations(ca)
    url, proxy, inflight = (
        f"https://127.0.0.1:{echo_port}/echo",
        f"http://127.0.0.1:{proxy_port}" if proxy_port != "0" else None,
        int(inflight_s),
    )

    async def main() -> None:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        lat: list[float] = []
        errors: dict[str, int] = {}
        conn = aiohttp.TCPConnector(ssl=ctx, force_close=keep != "1", limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=10)) as session:

            async def one(record: bool) -> None:
                t = time.perf_counter()
                try:
                    async with session.get(url, proxy=proxy) as resp:
                        await resp.read()
                        if resp.status != 200 or (proxy and resp.headers.get("x-bench-mitm") != "1"):
                            raise RuntimeError(f"status {resp.status} / untagged")
                except Exception as exc:  # counted and reported
                    key = f"{type(exc).__name__}: {str(exc)[:80]}"
                    errors[key] = errors.get(key, 0) + 1
                    return
                if record:
                    lat.append((time.perf_counter() - t) * 1000.0)

            await asyncio.gather(*(one(False) for _ in range(inflight)))  # warm-up
            if errors:
                _emit({"error": f"load warm-up failed: {errors}"})
                return

            def on_stdin() -> None:  # a line on stdin (or EOF) stops the load
                loop.remove_reader(0)
                stop.set()

            loop.add_reader(0, on_stdin)
            deadline, issued, t0 = time.monotonic() + min(float(deadline_s), CAP_S), 0, time.perf_counter()
            _emit({"started": True})

            async def worker() -> None:
                nonlocal issued
                while not stop.is_set() and issued < int(max_req) and time.monotonic() < deadline:
                    issued += 1
                    await one(True)

            await asyncio.gather(*(worker() for _ in range(inflight)))
            el = time.perf_counter() - t0
        _emit(
            {
                "done": len(lat),
                "errors": errors,
                "rps": round(len(lat) / el, 1),
                "p50_ms": round(c.pct(lat, 50), 2),
            }
        )

    asyncio.run(main())
    return 0


# ---- the orchestrator (inside the namespace) ---------------------------------------------------


def _cert(d: Path) -> tuple[Path, Path]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key, now = ec.generate_private_key(ec.SECP256R1()), datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench echo")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False).sign(key, hashes.SHA256()))  # fmt: skip
    (d / "echo-cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "echo-key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return d / "echo-cert.pem", d / "echo-key.pem"


def measure(
    a: argparse.Namespace, work: Path, v: str, daemon: dict[str, Any], seconds: float
) -> dict[str, Any]:
    pid, tid = int(daemon["pid"]), daemon.get("mitm_tid")

    def mitm() -> float:  # A: its thread; B: the child; C: none
        return c.cpu_s(pid, tid) if v == "A" else c.cpu_s(daemon["mitm_pid"]) if v == "B" else math.nan

    d0, m0, mc0, t0 = c.cpu_s(pid), mitm(), c.machine_cpu(), time.monotonic()
    udp = c.Proc(
        _self("_udp", daemon["udp_port"], a.rate, seconds),
        log_path=work / "udp.err",
        preexec=_die_with_parent,
    )
    try:
        res = udp.read_json(seconds + 20)
    finally:
        udp.stop(5)
    wall, mc1 = time.monotonic() - t0, c.machine_cpu()
    return {"rtt": [math.inf if x is None else x for x in res["rtt_ms"]], "lag_p99": res["lag_p99_ms"], "daemon_cpu": 100 * (c.cpu_s(pid) - d0) / wall,
            "mitm_cpu": 100 * (mitm() - m0) / wall, "machine_cpu": 100 * (mc1[0] - mc0[0]) / max(1.0, mc1[1] - mc0[1]), "rss_mib": c.mem_kb(pid) / 1024}  # fmt: skip


def inner(a: argparse.Namespace, _topo: c.Topology, work: Path, rep: c.Report) -> dict[str, Any]:
    if a.quick:
        a.rounds, a.idle_s, a.load_s = 1, 2.0, 3.0
    a.idle_s, a.load_s = min(a.idle_s, CAP_S - 5), min(a.load_s, CAP_S - 25)
    if a.rate * max(a.idle_s, a.load_s) > 65535:
        raise c.BenchError("rate x window must stay under 65536 queries (16-bit ids)")
    sys.path.insert(0, str(c.ROOT))
    from egressd.mitm.ca import ensure_ca

    confdir = work / "mitm-confdir"
    ensure_ca(confdir)  # egressd's own P-256 CA, made once before any master starts
    cert, key = _cert(work)
    procs = [c.Proc(_self("_echo", cert, key), log_path=work / "echo.err", preexec=_die_with_parent)]
    samples: list[dict[str, Any]] = []
    try:
        echo_port = procs[0].read_json(START_S)["port"]
        for rnd in range(1, a.rounds + 1):
            k = (rnd - 1) % 3
            for v in "ABC"[k:] + "ABC"[:k]:
                c.log(f"round {rnd}: {LABEL[v]}")
                dp = c.Proc(
                    _self("_daemon", v, confdir, work / "mitm-child.log", a.switch_interval_ms),
                    log_path=work / "daemon.err",
                    preexec=_die_with_parent,
                )
                procs.append(dp)
                load = None
                try:
                    daemon = dp.read_json(START_S + 10)
                    time.sleep(0.5)  # start-up work (gc freeze, imports) settles
                    samples.append(
                        {"v": v, "round": rnd, "phase": "idle", **measure(a, work, v, daemon, a.idle_s)}
                    )
                    ca = [str(cert)] + ([str(confdir / "mitmproxy-ca-cert.pem")] if v != "C" else [])
                    load = c.Proc(_self("_load", echo_port, daemon["mitm_port"] if v != "C" else 0, a.inflight, a.max_requests,
                                        min(CAP_S, a.load_s + 20), int(a.keepalive), *ca), log_path=work / "load.err", preexec=_die_with_parent)  # fmt: skip
                    load.read_json(START_S)
                    s = {"v": v, "round": rnd, "phase": "load", **measure(a, work, v, daemon, a.load_s)}
                    with contextlib.suppress(BrokenPipeError):  # it may have hit --max-requests
                        load.p.stdin.write(b"stop\n")  # type: ignore[union-attr]
                        load.p.stdin.flush()  # type: ignore[union-attr]
                    s["load"] = load.read_json(30)
                    samples.append(s)
                    c.log(
                        f"  load p50 {c.pct(s['rtt'], 50):.3f} p99 {c.pct(s['rtt'], 99):.3f} max {max(s['rtt']):.1f} ms; {s['load']['rps']} req/s"
                    )
                finally:
                    if load is not None:
                        load.stop(5)
                    dp.stop(8)
    except (OSError, RuntimeError) as exc:
        tails = "".join(
            f"\n--- {f.name}\n{f.read_text()[-1500:]}" for f in work.glob("*.err") if f.stat().st_size
        )
        raise c.BenchError(f"{exc}{tails}") from None
    finally:
        for p in procs:
            p.stop(5)
    report(a, rep, samples)
    return {"samples": samples}


def report(a: argparse.Namespace, rep: c.Report, samples: list[dict[str, Any]]) -> None:
    import mitmproxy.version

    rep.add(f"mitmproxy {mitmproxy.version.VERSION}; rounds {a.rounds} (A/B/C interleaved, order rotated); UDP {a.rate:g} q/s, idle {a.idle_s:g}s"
            f" + load {a.load_s:g}s per variant and round; HTTPS load {a.inflight} in flight, {'keep-alive' if a.keepalive else 'new TLS connection per request'}")  # fmt: skip
    rep.add(
        "UDP RTT in ms, pooled over rounds; CPU in % of one core (daemon = whole process, A's MITM thread included); baseline: C none, same phase"
    )
    pool = {
        (v, ph): [x for s in samples if s["v"] == v and s["phase"] == ph for x in s["rtt"]]
        for v in "ABC"
        for ph in ("idle", "load")
    }
    rows = []
    for v in "ABC":
        for ph in ("idle", "load"):
            ss, r, base = (
                [s for s in samples if s["v"] == v and s["phase"] == ph],
                pool[(v, ph)],
                pool[("C", ph)],
            )
            if not r:
                continue
            rps = [s["load"]["rps"] for s in ss if "load" in s]
            rows.append([LABEL[v], ph, len(r), sum(1 for x in r if math.isinf(x)), *(c.pct(r, q) for q in (50, 90, 99, 99.9)), max(r),
                         f"{100 * sum(1 for x in r if x > 5) / len(r):.1f}%", c.ratio(c.pct(r, 50), c.pct(base, 50)), c.ratio(c.pct(r, 99), c.pct(base, 99)),
                         c.mean(rps) if rps else "-", *(f"{c.mean([s[k] for s in ss]):.0f}" for k in ("daemon_cpu", "mitm_cpu", "machine_cpu")),
                         f"{c.mean([s['rss_mib'] for s in ss]):.0f}"])  # fmt: skip
    rep.table(
        [
            "variant",
            "phase",
            "n",
            "lost",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "max",
            ">5ms",
            "p50 ratio",
            "p99 ratio",
            "req/s",
            "daemon",
            "mitm",
            "machine",
            "RSS MiB",
        ],
        rows,
    )
    rep.add("per round, load phase (UDP p50 / p99 / max ms, req/s): " + "; ".join(
        f"{LABEL[s['v']]} r{s['round']} {c.pct(s['rtt'], 50):.3f} / {c.pct(s['rtt'], 99):.2f} / {max(s['rtt']):.1f}, {s['load']['rps']}" for s in samples if "load" in s))  # fmt: skip
    la, lb = pool[("A", "load")], pool[("B", "load")]
    for q in (50, 99):
        rep.add(f"  p{q} under load: A {c.pct(la, q):.3f} vs B {c.pct(lb, q):.3f} ms = A/B {c.ratio(c.pct(la, q), c.pct(lb, q))}; "
                f"load/idle: A {c.ratio(c.pct(la, q), c.pct(pool[('A', 'idle')], q))}, B {c.ratio(c.pct(lb, q), c.pct(pool[('B', 'idle')], q))}")  # fmt: skip
    rep.add(
        "  client send lag p99 per phase (noise check), ms: "
        + ", ".join(f"{s['v']}{s['round']}{s['phase'][0]} {s['lag_p99']}" for s in samples)
    )


def main(argv: Sequence[str] | None = None) -> int:
    roles: dict[str, Any] = {
        "_echo": role_echo,
        "_mitm": role_mitm,
        "_daemon": role_daemon,
        "_udp": role_udp,
        "_load": role_load,
    }
    if len(sys.argv) > 1 and sys.argv[1] in roles:
        return int(roles[sys.argv[1]](*sys.argv[2:]))
    p = c.parser(__doc__, "1 round, 2 s idle, 3 s load")
    p.add_argument("--rounds", type=int, default=4, help="A/B/C rounds (4)")
    p.add_argument("--idle-s", type=float, default=4.0, help="idle UDP window per variant (4)")
    p.add_argument("--load-s", type=float, default=8.0, help="UDP window under HTTPS load (8)")
    p.add_argument("--rate", type=float, default=500.0, help="UDP queries per second (500)")
    p.add_argument("--inflight", type=int, default=8, help="HTTPS requests in flight (8)")
    p.add_argument("--max-requests", type=int, default=200000, help="HTTPS requests cap per phase")
    p.add_argument("--keepalive", action="store_true", help="reuse HTTPS connections")
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="diagnostic: sys.setswitchinterval in the daemon",
    )
    return c.main("mitm-placement", "egbp", ["ns"], "ns", p.parse_args(argv), inner, tools=("ip",))


if __name__ == "__main__":
    sys.exit(main())
