#!/usr/bin/env python3
"""MITM placement benchmark: mitmproxy in a thread of the daemon vs in a child process.

Run from the repository root (root is not needed; everything is on 127.0.0.1)::

    .venv/bin/python scripts/bench/bench_mitm_placement.py [--quick] [--rounds N]
        [--idle-s S] [--load-s S] [--rate Q] [--inflight N] [--keepalive] [--out FILE]

Question: egressd runs its shared mitmproxy as a supervised child process. What would the
in-process alternative (a ``mitmproxy.master.Master`` in a dedicated thread with its own event
loop, the only safe way to embed it, see /work/shared/notes/feasibility.md row 4b) cost the
daemon's latency-critical work, which shares the GIL with it?

Processes (all on loopback in the current namespace; no nft, no routes, no namespaces):

* ``echo``   an aiohttp HTTPS server (self-signed P-256 cert made with ``cryptography``);
* ``daemon`` a stand-in for egressd: one asyncio loop serving a UDP request/response service that
  parses every datagram with dnslib and answers an A record (the DNS proxy's kind of work), plus,
  depending on the variant,

  - ``A in-proc``  a mitmproxy Master in a thread of the daemon, with its own event loop;
  - ``B child``    the same Master in a child process the daemon spawns (as egressd's supervisor);
  - ``C none``     no MITM (baseline; its "load" phase sends the same HTTPS load straight to the
    echo server, so the machine is busy without any MITM);

  The Master is the lean one of egressd/mitm/runner.py (core, disable_h2c, proxyserver,
  next_layer, tlsconfig) with a trivial addon instead of the egressd addon (it does the addon's
  ``gc.collect(); gc.freeze()`` at start and tags responses), in ``mode=regular`` on 127.0.0.1
  with the supervisor's options (lazy upstream connection, no upstream cert sniffing,
  ``ssl_insecure`` towards the echo server);
* ``udp``    the measuring client: sends dnslib queries at a fixed rate and records each RTT;
* ``load``   the HTTPS load: one aiohttp process keeping ``--inflight`` requests in flight through
  the MITM (CONNECT, trusting the MITM CA), a new TLS connection per request unless
  ``--keepalive``; responses must be 200 and carry the addon's tag.

Each round runs the variants interleaved (order rotated per round), each with a fresh daemon:
an idle phase (UDP client only, MITM idle) and a load phase (UDP client while the HTTPS load runs).
CPU is read from /proc for the daemon process, for the MITM (its thread, or the child), and
for the whole machine over the UDP window. Every phase is bounded (hard cap 60 s); every
process is started by this script, dies with its parent (PR_SET_PDEATHSIG) and is ended by PID.
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
import platform
import select
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PHASE_CAP_S = 60.0
START_TIMEOUT_S = 20.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1
VARIANTS = ("A", "B", "C")
LABEL = {"A": "A in-proc", "B": "B child", "C": "C none"}


# ---------------------------------------------------------------------------------------------
# shared helpers


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the (single-threaded) parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _self_argv(role: str, *args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), role, *args]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _cpu_ticks(path: str) -> int | None:
    """utime + stime of /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat, in clock ticks."""
    try:
        with open(path) as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    total = sum(vals[:8])
    return total - vals[3] - vals[4], total


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


# ---------------------------------------------------------------------------------------------
# role: HTTPS echo server


def _make_cert(directory: Path) -> tuple[Path, Path]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench echo")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "echo-cert.pem", directory / "echo-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def role_echo(argv: Sequence[str]) -> int:
    from aiohttp import web

    p = argparse.ArgumentParser(prog="echo")
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    a = p.parse_args(argv)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(a.cert, a.key)

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=b'{"ok":true}\n', content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/echo", echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx, backlog=512)
        await site.start()
        port = runner.addresses[0][1]
        _emit({"ready": True, "port": port})
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())
    return 0


# ---------------------------------------------------------------------------------------------
# the MITM: egressd/mitm/runner.py's lean master, a trivial addon instead of the egressd addon


class BenchAddon:
    """Stands in for EgressInjector: its start-up gc freeze, and one cheap response hook."""

    def running(self) -> None:
        gc.collect()
        gc.freeze()

    def response(self, flow: Any) -> None:
        flow.response.headers["x-bench-mitm"] = "1"


def _build_master(port: int, confdir: str) -> Any:
    """Needs a running event loop (mitmproxy's Master takes the current one)."""
    from mitmproxy import master, options
    from mitmproxy.addons import core, disable_h2c, next_layer, proxyserver, tlsconfig

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
    opts.set(
        "mode=regular",
        "listen_host=127.0.0.1",
        f"listen_port={port}",
        f"confdir={confdir}",
        "connection_strategy=lazy",
        "upstream_cert=false",
        "stream_large_bodies=1m",
        "ssl_insecure=true",
    )
    return m


def _quiet_logging() -> None:
    import logging

    logging.getLogger().setLevel(logging.WARNING)


def role_mitm(argv: Sequence[str]) -> int:
    """Variant B's child: the master in the main thread of its own process."""
    p = argparse.ArgumentParser(prog="mitm")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--confdir", required=True)
    a = p.parse_args(argv)
    _quiet_logging()

    async def main() -> None:
        m = _build_master(a.port, a.confdir)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, m.shutdown)
        await m.run()

    asyncio.run(main())
    return 0


class InProcMitm:
    """Variant A: the master in a dedicated thread with its own event loop (feasibility 4b)."""

    def __init__(self, port: int, confdir: str) -> None:
        self.port, self.confdir = port, confdir
        self.tid: int | None = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._master: Any = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mitm", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S) or self.error is not None:
            raise RuntimeError(f"in-process mitm did not start: {self.error!r}")

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop

        async def main() -> None:
            self._master = _build_master(self.port, self.confdir)
            self._started.set()
            await self._master.run()

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # reported to the daemon's main thread
            self.error = exc
            self._started.set()
        finally:
            loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        m, loop = self._master, self._loop
        if m is None or loop is None or loop.is_closed():
            return

        async def close() -> None:
            # Master.shutdown() alone leaves the listeners open (feasibility 4b).
            ps = m.addons.get("proxyserver")
            if ps is not None:
                await ps.servers.update([])
            m.shutdown()

        with contextlib.suppress(Exception):  # best effort; the thread is a daemon thread
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout)
        self._thread.join(timeout)


# ---------------------------------------------------------------------------------------------
# role: the daemon stand-in (UDP service + optional MITM)


class UdpService(asyncio.DatagramProtocol):
    """Parse the query with dnslib, answer one A record: a little Python work per datagram."""

    def __init__(self) -> None:
        from dnslib import QTYPE, RR, A, DNSRecord

        self._parse, self._rr, self._a, self._qtype_a = DNSRecord.parse, RR, A, QTYPE.A
        self.transport: asyncio.DatagramTransport | None = None
        self.served = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            q = self._parse(data)
        except Exception:  # garbage in, nothing out
            return
        r = q.reply()
        r.add_answer(self._rr(q.q.qname, self._qtype_a, rdata=self._a("10.1.2.3"), ttl=60))
        assert self.transport is not None
        self.transport.sendto(r.pack(), addr)
        self.served += 1


def _wait_tcp(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.02)
    return False


def role_daemon(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="daemon")
    p.add_argument("--mitm", choices=["inproc", "child", "none"], required=True)
    p.add_argument("--confdir", required=True)
    p.add_argument("--mitm-log", required=True)
    p.add_argument("--switch-interval-ms", type=float, default=0.0)
    a = p.parse_args(argv)
    _quiet_logging()
    if a.switch_interval_ms > 0:
        sys.setswitchinterval(a.switch_interval_ms / 1000)

    mitm_port = _free_port() if a.mitm != "none" else 0
    inproc: InProcMitm | None = None
    child: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = {"ready": True, "pid": os.getpid(), "mitm_port": mitm_port}
    try:
        if a.mitm == "inproc":
            inproc = InProcMitm(mitm_port, a.confdir)
            inproc.start()
            info["mitm_tid"] = inproc.tid
        elif a.mitm == "child":
            # Spawned from the main thread: PDEATHSIG fires when the forking *thread* exits.
            with open(a.mitm_log, "ab") as log:
                child = subprocess.Popen(
                    _self_argv("_mitm", "--port", str(mitm_port), "--confdir", a.confdir),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    preexec_fn=_die_with_parent,
                )
            info["mitm_pid"] = child.pid
        if a.mitm != "none" and not _wait_tcp(mitm_port, START_TIMEOUT_S):
            raise RuntimeError("mitm is not listening")

        async def main() -> None:
            loop = asyncio.get_running_loop()
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            transport, svc = await loop.create_datagram_endpoint(UdpService, local_addr=("127.0.0.1", 0))
            info["udp_port"] = transport.get_extra_info("sockname")[1]
            _emit(info)
            await stop.wait()
            transport.close()
            _emit({"served": svc.served})

        asyncio.run(main())
    finally:
        if inproc is not None:
            inproc.stop()
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(5)
    return 0


# ---------------------------------------------------------------------------------------------
# role: UDP measuring client (fixed rate, RTT per query)


def role_udp(argv: Sequence[str]) -> int:
    from dnslib import DNSRecord

    p = argparse.ArgumentParser(prog="udp")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--seconds", type=float, required=True)
    a = p.parse_args(argv)
    n = min(65535, int(a.rate * min(a.seconds, PHASE_CAP_S)))
    packets = []
    for i in range(n):
        q = DNSRecord.question(f"q{i}.bench.test")
        q.header.id = i
        packets.append(q.pack())
    sent = [0.0] * n
    rtt: list[float | None] = [None] * n
    lag: list[float] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(("127.0.0.1", a.port))
    sock.setblocking(False)
    interval = 1.0 / a.rate

    def drain() -> None:
        now = time.perf_counter()
        while True:
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                return
            if len(data) >= 2:
                (qid,) = struct.unpack("!H", data[:2])
                if qid < n and rtt[qid] is None and sent[qid]:
                    rtt[qid] = (now - sent[qid]) * 1000.0

    t0 = time.perf_counter() + 0.05
    i = 0
    while i < n:
        now = time.perf_counter()
        due = t0 + i * interval
        if now >= due:
            sent[i] = time.perf_counter()
            sock.send(packets[i])
            lag.append((sent[i] - due) * 1000.0)
            i += 1
            continue
        r, _, _ = select.select([sock], [], [], due - now)
        if r:
            drain()
    end = time.perf_counter() + 1.0  # stragglers
    while time.perf_counter() < end and any(x is None for x in rtt[-50:]):
        r, _, _ = select.select([sock], [], [], max(0.0, end - time.perf_counter()))
        if r:
            drain()
    drain()
    sock.close()
    _emit(
        {
            "rtt_ms": [round(x, 4) if x is not None else None for x in rtt],
            "send_lag_p99_ms": round(_pct(lag, 99), 3),
        }
    )
    return 0


# ---------------------------------------------------------------------------------------------
# role: HTTPS load generator


def role_load(argv: Sequence[str]) -> int:
    import aiohttp

    p = argparse.ArgumentParser(prog="load")
    p.add_argument("--echo-port", type=int, required=True)
    p.add_argument("--proxy-port", type=int, default=0)
    p.add_argument("--cafile", action="append", default=[])
    p.add_argument("--inflight", type=int, required=True)
    p.add_argument("--max-requests", type=int, required=True)
    p.add_argument("--deadline-s", type=float, required=True)
    p.add_argument("--keepalive", action="store_true")
    a = p.parse_args(argv)
    ctx = ssl.create_default_context()
    for ca in a.cafile:
        ctx.load_verify_locations(ca)
    url = f"https://127.0.0.1:{a.echo_port}/echo"
    proxy = f"http://127.0.0.1:{a.proxy_port}" if a.proxy_port else None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_stdin() -> None:
            try:
                data = os.read(0, 4096)
            except OSError:
                data = b""
            if not data or b"stop" in data:
                loop.remove_reader(0)
                stop.set()

        lat: list[float] = []
        errors: dict[str, int] = {}
        timeout = aiohttp.ClientTimeout(total=10)
        conn = aiohttp.TCPConnector(ssl=ctx, force_close=not a.keepalive, limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

            async def one(record: bool) -> None:
                t = time.perf_counter()
                try:
                    async with session.get(url, proxy=proxy) as resp:
                        await resp.read()
                        ok = resp.status == 200 and (proxy is None or resp.headers.get("x-bench-mitm") == "1")
                        if not ok:
                            raise RuntimeError(f"status {resp.status} / untagged")
                except Exception as exc:  # counted and reported
                    key = type(exc).__name__ + ": " + str(exc)[:80]
                    errors[key] = errors.get(key, 0) + 1
                    return
                if record:
                    lat.append((time.perf_counter() - t) * 1000.0)

            await asyncio.gather(*(one(False) for _ in range(a.inflight)))  # warm-up
            if errors:
                _emit({"started": False, "errors": errors})
                return
            loop.add_reader(0, on_stdin)
            deadline = time.monotonic() + min(a.deadline_s, PHASE_CAP_S)
            issued = 0
            t0 = time.perf_counter()
            _emit({"started": True})

            async def worker() -> None:
                nonlocal issued
                while not stop.is_set() and issued < a.max_requests:
                    if time.monotonic() > deadline:
                        return
                    issued += 1
                    await one(True)

            await asyncio.gather(*(worker() for _ in range(a.inflight)))
            elapsed = time.perf_counter() - t0
        _emit(
            {
                "done": len(lat),
                "errors": errors,
                "elapsed_s": round(elapsed, 3),
                "rps": round(len(lat) / elapsed, 1) if elapsed > 0 else 0.0,
                "p50_ms": round(_pct(lat, 50), 2),
                "p99_ms": round(_pct(lat, 99), 2),
            }
        )

    asyncio.run(main())
    return 0


# ---------------------------------------------------------------------------------------------
# the orchestrator


class Procs:
    """Every process this script starts; ended by PID in :meth:`close`."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, argv: list[str], stderr_path: Path) -> subprocess.Popen[bytes]:
        with open(stderr_path, "ab") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                preexec_fn=_die_with_parent,
                cwd=ROOT,
            )
        self.procs.append(proc)
        return proc

    @staticmethod
    def end(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):  # a stdin whose reader is gone
                    f.close()

    def close(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):  # keep ending the others
                self.end(proc, grace=3.0)
        self.procs.clear()


def _read_json(proc: subprocess.Popen[bytes], timeout: float, what: str) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{what}: no answer within {timeout:.0f} s")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            raise RuntimeError(f"{what}: exited (rc={proc.wait()}) without answering")
        buf += chunk
        if buf.endswith(b"\n"):
            return dict(json.loads(buf.splitlines()[-1]))


@dataclass
class Sample:
    variant: str
    round: int
    phase: str  # idle | load
    rtt_ms: list[float]
    lost: int
    send_lag_p99_ms: float
    wall_s: float
    daemon_cpu: float  # % of one core, whole daemon process
    mitm_cpu: float  # % of one core, MITM thread (A) or child (B); nan for C
    machine_cpu: float  # % of all cores
    daemon_rss: float | None
    load: dict[str, Any] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, procs: Procs) -> None:
        self.a, self.work, self.procs = args, work, procs
        self.confdir = work / "mitm-confdir"
        self.confdir.mkdir()
        self.samples: list[Sample] = []
        self.echo_port = 0
        self.echo_cert = Path()

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def setup(self) -> None:
        sys.path.insert(0, str(ROOT))
        from egressd.mitm.ca import ensure_ca

        # egressd's own CA (ECDSA P-256; mitmproxy's leaves reuse its key), made once before
        # any master starts, so every variant signs the same way and nothing races to make it.
        ensure_ca(self.confdir)
        self.echo_cert, key = _make_cert(self.work)
        echo = self.procs.spawn(
            _self_argv("_echo", "--cert", str(self.echo_cert), "--key", str(key)),
            self.work / "echo.err",
        )
        self.echo_port = int(_read_json(echo, START_TIMEOUT_S, "echo")["port"])

    def _udp(self, port: int, seconds: float) -> dict[str, Any]:
        proc = self.procs.spawn(
            _self_argv("_udp", "--port", str(port), "--rate", str(self.a.rate), "--seconds", str(seconds)),
            self.work / "udp.err",
        )
        try:
            return _read_json(proc, seconds + 20, "udp client")
        finally:
            self.procs.end(proc)

    def _measure(self, variant: str, rnd: int, phase: str, daemon: dict[str, Any], seconds: float) -> Sample:
        pid = int(daemon["pid"])
        if variant == "A":
            mitm_path = f"/proc/{pid}/task/{daemon['mitm_tid']}/stat"
        elif variant == "B":
            mitm_path = f"/proc/{daemon['mitm_pid']}/stat"
        else:
            mitm_path = ""
        d0, m0, mach0 = _cpu_ticks(f"/proc/{pid}/stat"), _cpu_ticks(mitm_path), _machine_ticks()
        t0 = time.monotonic()
        res = self._udp(int(daemon["udp_port"]), seconds)
        wall = time.monotonic() - t0
        d1, m1, mach1 = _cpu_ticks(f"/proc/{pid}/stat"), _cpu_ticks(mitm_path), _machine_ticks()

        def pct(x0: int | None, x1: int | None) -> float:
            if x0 is None or x1 is None:
                return math.nan
            return 100.0 * (x1 - x0) / CLK_TCK / wall

        rtts = [x if x is not None else math.inf for x in res["rtt_ms"]]
        return Sample(
            variant=variant,
            round=rnd,
            phase=phase,
            rtt_ms=rtts,
            lost=sum(1 for x in res["rtt_ms"] if x is None),
            send_lag_p99_ms=float(res["send_lag_p99_ms"]),
            wall_s=wall,
            daemon_cpu=pct(d0, d1),
            mitm_cpu=pct(m0, m1),
            machine_cpu=100.0 * (mach1[0] - mach0[0]) / max(1, mach1[1] - mach0[1]),
            daemon_rss=_rss_mib(pid),
        )

    def run_variant(self, variant: str, rnd: int) -> None:
        mode = {"A": "inproc", "B": "child", "C": "none"}[variant]
        self.log(f"round {rnd}: {LABEL[variant]}")
        daemon_proc = self.procs.spawn(
            _self_argv(
                "_daemon",
                "--mitm",
                mode,
                "--confdir",
                str(self.confdir),
                "--mitm-log",
                str(self.work / "mitm-child.log"),
                "--switch-interval-ms",
                str(self.a.switch_interval_ms),
            ),
            self.work / "daemon.err",
        )
        load: subprocess.Popen[bytes] | None = None
        try:
            daemon = _read_json(daemon_proc, START_TIMEOUT_S + 10, "daemon")
            time.sleep(0.5)  # let start-up work (gc freeze, imports) settle
            idle = self._measure(variant, rnd, "idle", daemon, self.a.idle_s)
            self.samples.append(idle)

            argv = [
                "--echo-port",
                str(self.echo_port),
                "--inflight",
                str(self.a.inflight),
                "--max-requests",
                str(self.a.max_requests),
                "--deadline-s",
                str(min(PHASE_CAP_S, self.a.load_s + 20)),
                "--cafile",
                str(self.echo_cert),
            ]
            if variant != "C":
                argv += ["--proxy-port", str(daemon["mitm_port"])]
                argv += ["--cafile", str(self.confdir / "mitmproxy-ca-cert.pem")]
            if self.a.keepalive:
                argv.append("--keepalive")
            load = self.procs.spawn(_self_argv("_load", *argv), self.work / "load.err")
            started = _read_json(load, START_TIMEOUT_S, "load generator")
            if not started.get("started"):
                raise RuntimeError(f"load generator failed its warm-up: {started}")
            sample = self._measure(variant, rnd, "load", daemon, self.a.load_s)
            assert load.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it may have hit --max-requests
                load.stdin.write(b"stop\n")
                load.stdin.flush()
            sample.load = _read_json(load, 30, "load generator")
            self.samples.append(sample)
            self.log(
                f"  idle p50 {_pct(idle.rtt_ms, 50):.3f} p99 {_pct(idle.rtt_ms, 99):.3f} ms; "
                f"load p50 {_pct(sample.rtt_ms, 50):.3f} p99 {_pct(sample.rtt_ms, 99):.3f} "
                f"max {max(sample.rtt_ms):.1f} ms; {sample.load.get('rps')} req/s; "
                f"daemon cpu {sample.daemon_cpu:.0f}%"
            )
        finally:
            if load is not None:
                self.procs.end(load)
            self.procs.end(daemon_proc, grace=8.0)

    # ---- report ------------------------------------------------------------------------------

    def report(self) -> str:
        a = self.a
        lines: list[str] = []
        w = lines.append
        w("MITM placement benchmark: in-process thread vs child process")
        w(
            f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%SZ}; host {platform.node()}; "
            f"{os.cpu_count()} CPUs; Python {platform.python_version()}; "
            f"mitmproxy {_mitmproxy_version()}; daemon switch interval "
            f"{a.switch_interval_ms or sys.getswitchinterval() * 1000:g} ms"
        )
        w(
            f"rounds {a.rounds} (variants interleaved, order rotated per round); UDP {a.rate:g} q/s, "
            f"idle {a.idle_s:g} s + load {a.load_s:g} s per variant and round; HTTPS load "
            f"{a.inflight} in flight, {'keep-alive' if a.keepalive else 'new TLS connection per request'}"
        )
        w("C's load phase sends the same HTTPS load straight to the echo server (no MITM).")
        w("")
        w("Pooled over rounds. RTT in ms (UDP request -> dnslib answer, client-side); CPU in % of")
        w("one core over the UDP window (daemon = whole daemon process, A's MITM thread included);")
        w("machine = % of all cores.")
        w("")
        hdr = (
            f"{'variant':<10} {'phase':<5} {'n':>6} {'lost':>4} {'p50':>7} {'p90':>7} {'p99':>7} "
            f"{'p99.9':>7} {'max':>7} {'>5ms':>6} {'req/s':>6} {'req p50':>7} {'daemon':>6} "
            f"{'mitm':>5} {'machine':>7} {'RSS MiB':>7}"
        )
        w(hdr)
        w("-" * len(hdr))
        for v in VARIANTS:
            for phase in ("idle", "load"):
                ss = [s for s in self.samples if s.variant == v and s.phase == phase]
                if not ss:
                    continue
                r = [x for s in ss for x in s.rtt_ms]
                over5 = 100.0 * sum(1 for x in r if x > 5.0) / len(r)
                rps = [float(s.load["rps"]) for s in ss if s.load]
                rp50 = [float(s.load["p50_ms"]) for s in ss if s.load]
                rss = [s.daemon_rss for s in ss if s.daemon_rss is not None]
                w(
                    f"{LABEL[v]:<10} {phase:<5} {len(r):>6} {sum(s.lost for s in ss):>4} "
                    f"{_pct(r, 50):>7.3f} {_pct(r, 90):>7.3f} {_pct(r, 99):>7.3f} "
                    f"{_pct(r, 99.9):>7.2f} {max(r):>7.2f} {over5:>5.1f}% "
                    f"{_fmt(_mean(rps), '.0f'):>6} {_fmt(_mean(rp50), '.1f'):>7} "
                    f"{_mean([s.daemon_cpu for s in ss]):>5.0f}% "
                    f"{_fmt(_mean([s.mitm_cpu for s in ss]), '.0f', '%'):>5} "
                    f"{_mean([s.machine_cpu for s in ss]):>6.0f}% {_fmt(_mean(rss), '.0f'):>7}"
                )
        w("")
        w("Per round (load phase): UDP p50 / p99 / max ms, MITM req/s, daemon CPU %")
        for v in VARIANTS:
            parts = []
            for s in self.samples:
                if s.variant == v and s.phase == "load":
                    parts.append(
                        f"r{s.round}: {_pct(s.rtt_ms, 50):.3f} / {_pct(s.rtt_ms, 99):.2f} / "
                        f"{max(s.rtt_ms):.1f}, {s.load.get('rps')}/s, {s.daemon_cpu:.0f}%"
                    )
            w(f"  {LABEL[v]:<10} " + "; ".join(parts))
        w("")
        w("Comparison, load phase, pooled (A in-proc minus B child; each minus its own idle):")
        pooled = {
            (v, ph): [x for s in self.samples if s.variant == v and s.phase == ph for x in s.rtt_ms]
            for v in VARIANTS
            for ph in ("idle", "load")
        }
        if pooled[("A", "load")] and pooled[("B", "load")]:
            for q in (50, 99):
                pa, pb = _pct(pooled[("A", "load")], q), _pct(pooled[("B", "load")], q)
                ia, ib = _pct(pooled[("A", "idle")], q), _pct(pooled[("B", "idle")], q)
                w(
                    f"  p{q}: A {pa:.3f} ms vs B {pb:.3f} ms -> A - B = {pa - pb:+.3f} ms "
                    f"(A x{pa / pb:.1f}); load - idle: A {pa - ia:+.3f}, B {pb - ib:+.3f} ms"
                )
            rps_a = _mean([float(s.load["rps"]) for s in self.samples if s.variant == "A" and s.load])
            rps_b = _mean([float(s.load["rps"]) for s in self.samples if s.variant == "B" and s.load])
            w(f"  MITM throughput: A {rps_a:.0f} req/s vs B {rps_b:.0f} req/s")
        extra = [
            f"{LABEL[s.variant]} r{s.round} {s.phase}: send lag p99 {s.send_lag_p99_ms} ms, "
            f"load {json.dumps(s.load) if s.load else '-'}"
            for s in self.samples
        ]
        w("")
        w("Raw per phase (client send lag = how late the UDP client itself sent, a noise check):")
        lines.extend("  " + e for e in extra)
        return "\n".join(lines) + "\n"


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _fmt(x: float, spec: str, suffix: str = "") -> str:
    return "-" if math.isnan(x) else format(x, spec) + suffix


def _mitmproxy_version() -> str:
    try:
        from mitmproxy import version

        return str(version.VERSION)
    except Exception:
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    roles: dict[str, Callable[[Sequence[str]], int]] = {
        "_echo": role_echo,
        "_mitm": role_mitm,
        "_daemon": role_daemon,
        "_udp": role_udp,
        "_load": role_load,
    }
    if argv and argv[0] in roles:
        return roles[argv[0]](argv[1:])

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=4, help="A/B/C rounds (default 4)")
    p.add_argument("--idle-s", type=float, default=4.0, help="idle UDP window per variant")
    p.add_argument("--load-s", type=float, default=8.0, help="UDP window under HTTPS load")
    p.add_argument("--rate", type=float, default=500.0, help="UDP queries per second")
    p.add_argument("--inflight", type=int, default=8, help="HTTPS requests in flight")
    p.add_argument("--max-requests", type=int, default=200000, help="HTTPS requests cap per phase")
    p.add_argument("--keepalive", action="store_true", help="reuse HTTPS connections")
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="diagnostic: sys.setswitchinterval in the daemon (default: Python's 5 ms)",
    )
    p.add_argument("--quick", action="store_true", help="1 round, 2 s idle, 3 s load")
    p.add_argument("--out", type=Path, help="write the report here too")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.idle_s, a.load_s = 1, 2.0, 3.0
    a.idle_s = min(a.idle_s, PHASE_CAP_S - 5)
    a.load_s = min(a.load_s, PHASE_CAP_S - 25)
    if a.rate * max(a.idle_s, a.load_s) > 65535:
        p.error("rate x window must stay under 65536 queries (16-bit ids)")

    procs = Procs()
    work = Path(tempfile.mkdtemp(prefix="egbm-mitmpl-"))

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        bench = Bench(a, work, procs)
        bench.setup()
        for rnd in range(1, a.rounds + 1):
            k = (rnd - 1) % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                bench.run_variant(v, rnd)
        text = bench.report()
        sys.stdout.write(text)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(text)
            bench.log(f"report written to {a.out}")
        return 0
    except (RuntimeError, OSError) as exc:
        print(f"bench_mitm_placement: {exc}", file=sys.stderr)
        for name in ("daemon.err", "mitm-child.log", "load.err", "echo.err", "udp.err"):
            f = work / name
            if f.exists() and f.stat().st_size:
                print(f"--- {name} (tail)\n{f.read_text()[-2000:]}", file=sys.stderr)
        return 1
    finally:
        procs.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
