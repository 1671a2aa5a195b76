"""The kernel relay of admitted, passed-through TLS (egressd.mitmchild.splicerelay, issue 25 item 5)
end to end: real kernel redirect, the real MITM child, the CDN-shaped topology of
tests/kernel/cdn.py. The client sends a real ClientHello for ``a.cdn.test`` (admitted on port
9443 by its policy, no vault: relayed unopened), then raw bytes: the relay is TCP from there
on, so the tests choose sizes, directions, half-closes and resets freely.

* Bytes intact both ways at once, 64 MiB down and 16 MiB up, the upstream ending its side
  first and still hearing the client afterwards; and the client ending its side first, then a
  32 MiB download.
* A narrowing that takes the name away cuts an idle relayed connection the kernel holds.
* A client or an upstream that vanishes (a reset) mid-transfer ends the relay on both sides,
  and the MITM child keeps no pipe of it.
* All of it again with ``EGRESSD_MITM_KERNEL_RELAY=off`` (mitmproxy's relay, the fallback): the
  same behaviour, and no pipe in the child while a connection is relayed. With it on, the child
  holds the relay's pipe while the connection is open: the kernel path was taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kernel.cdn import CDN_IP, allow, bind_subject, cdn_topology, learn, mitm_env, mitm_fleet, policy
from tests.kernel.test_mitm_stream import mitm_pid
from tests.kernel.topology import Daemon, Topology, envelope

HTTP_PORT = 18577
PORT = 9443
MIB = 1 << 20

PATTERN = r"""
import hashlib
def pattern(n, seed):
    block = hashlib.shake_256(seed.encode()).digest(1 << 20)
    while n > 0:
        piece = block[: min(n, len(block))]
        n -= len(piece)
        yield piece
def pattern_sha(n, seed):
    h = hashlib.sha256()
    for piece in pattern(n, seed):
        h.update(piece)
    return h.hexdigest()
"""

SERVER = (
    PATTERN
    + r"""
import json, socket, struct, sys, threading
log, port = sys.argv[1], int(sys.argv[2])
lock = threading.Lock()
def record(doc):
    with lock, open(log, "a") as fh:
        fh.write(json.dumps(doc) + "\n")
def exact(c, n):
    out = bytearray()
    while len(out) < n:
        got = c.recv(min(n - len(out), 1 << 20))
        if not got:
            raise EOFError("short")
        out += got
    return bytes(out)
def to_eof(c):
    h, n = hashlib.sha256(), 0
    while True:
        got = c.recv(1 << 20)
        if not got:
            return h.hexdigest(), n
        h.update(got); n += len(got)
def send(c, n, seed):
    for piece in pattern(n, seed):
        c.sendall(piece)
def serve(c):
    mode = "?"
    try:
        head = exact(c, 5)
        exact(c, struct.unpack("!H", head[3:5])[0])  # the ClientHello
        line = b""
        while not line.endswith(b"\n"):
            line += exact(c, 1)
        mode, down, up = line.decode().split()
        down, up = int(down), int(up)
        if mode == "both":  # both ways at once; this side ends first, the client's tail after it
            t = threading.Thread(target=send, args=(c, down, "down"))
            t.start()
            h = hashlib.sha256(exact(c, up)).hexdigest()
            t.join()
            c.sendall(f"sha {h}\n".encode())
            c.shutdown(socket.SHUT_WR)
            tail = to_eof(c)
            record({"mode": mode, "tail_sha": tail[0], "tail": tail[1]})
        elif mode == "upfirst":  # the client ends its side first, then the download
            h, n = to_eof(c)
            c.sendall(f"sha {h} {n}\n".encode())
            send(c, down, "down")
            c.shutdown(socket.SHUT_WR)
            record({"mode": mode, "n": n})
        elif mode == "wait":  # idle until the other side goes
            c.sendall(b"ready\n")
            to_eof(c)
            record({"mode": mode, "end": "eof"})
        elif mode == "endless":  # until the client vanishes
            for _ in range(100000):
                c.sendall(b"x" * 65536)
        elif mode == "vanish":  # some bytes, then a reset
            send(c, down, "down")
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            record({"mode": mode, "end": "reset"})
    except (OSError, EOFError) as exc:
        record({"mode": mode, "error": type(exc).__name__})
    finally:
        c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.listen(16)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""
)

CLIENT = (
    PATTERN
    + r"""
import json, socket, ssl, struct, sys, threading, time
ip, port, sni, mode, down, up = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
bio_in, bio_out = ssl.MemoryBIO(), ssl.MemoryBIO()
tls = ctx.wrap_bio(bio_in, bio_out, server_hostname=sni)
try:
    tls.do_handshake()
except ssl.SSLWantReadError:
    pass
out = {}
s = socket.create_connection((ip, port), timeout=30)
wire_mode = "endless" if mode == "vanish-client" else mode  # the upstream sends until it fails
s.sendall(bio_out.read() + f"{wire_mode} {down} {up}\n".encode())
def line():
    b = b""
    while not b.endswith(b"\n"):
        got = s.recv(1)
        if not got:
            raise EOFError("closed")
        b += got
    return b.decode().strip()
def sha_of(n):
    h, left = hashlib.sha256(), n
    while left:
        got = s.recv(min(left, 1 << 20))
        if not got:
            raise EOFError("short")
        h.update(got); left -= len(got)
    return h.hexdigest()
try:
    if mode == "both":
        def upload():
            for piece in pattern(up, "up"):
                s.sendall(piece)
        t = threading.Thread(target=upload)
        t.start()
        out["down_sha"] = sha_of(down)
        out["line"] = line()
        t.join()
        out["eof"] = s.recv(1) == b""
        for piece in pattern(3 * 1024 * 1024, "tail"):  # after the upstream's end of file
            s.sendall(piece)
        s.shutdown(socket.SHUT_WR)
    elif mode == "upfirst":
        for piece in pattern(up, "up"):
            s.sendall(piece)
        s.shutdown(socket.SHUT_WR)
        out["line"] = line()
        out["down_sha"] = sha_of(down)
        out["eof"] = s.recv(1) == b""
    elif mode == "wait":
        out["ready"] = line()
        print(json.dumps(out), flush=True)
        s.settimeout(30)
        got = s.recv(65536)
        out["end"] = "eof" if got == b"" else "data"
    elif mode == "vanish-client":
        n = 0
        while n < 4 * 1024 * 1024:
            n += len(s.recv(1 << 20))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        out["read"] = n
    elif mode == "vanish":
        n = 0
        while True:
            got = s.recv(1 << 20)
            if not got:
                out["end"] = "eof"
                break
            n += len(got)
        out["read"] = n
except Exception as exc:
    out["end"] = type(exc).__name__
finally:
    s.close()
print(json.dumps(out), flush=True)
"""
)

_NS: dict[str, Any] = {}
exec(PATTERN, _NS)


def pattern_sha(n: int, seed: str) -> str:
    return str(_NS["pattern_sha"](n, seed))


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egr{os.getpid()}", sandboxes=1)
    try:
        log = t.workdir / "relay-server.jsonl"
        log.touch()
        t.spawn(t.up, sys.executable, "-c", SERVER, str(log), str(PORT), ready_line="ready")
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module", params=["kernel", "mitmproxy"])
def fleet(cdn: Topology, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    env = {
        **mitm_env(cdn, f"krelay-{request.param}"),
        "EGRESSD_MITM_WORKERS": "1",
        "EGRESSD_MITM_KERNEL_RELAY": "on" if request.param == "kernel" else "off",
    }
    with mitm_fleet(cdn, f"egt-krelay-{request.param[0]}", HTTP_PORT, env) as d:
        d.kernel_relay = request.param == "kernel"  # type: ignore[attr-defined]
        yield d


BOTH = policy(allow("a.cdn.test", ports=[PORT]), allow("b.cdn.test", ports=[PORT]))
ONLY_B = policy(allow("b.cdn.test", ports=[PORT]))


def records(t: Topology) -> list[dict[str, Any]]:
    text = (t.workdir / "relay-server.jsonl").read_text()
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def wait_record(t: Topology, since: int, timeout: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while len(records(t)) <= since:
        assert time.monotonic() < deadline, records(t)
        time.sleep(0.05)
    return records(t)[since]


def start(t: Topology, mode: str, down: int = 0, up: int = 0) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", CLIENT, CDN_IP, str(PORT), "a.cdn.test", mode, str(down), str(up)]
    return subprocess.Popen(
        ["ip", "netns", "exec", t.sb(1), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert out.strip(), err
    doc: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return doc


def pipes(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:")
    return n


@pytest.fixture
def subject(cdn: Topology, fleet: Daemon, request: pytest.FixtureRequest) -> Iterator[str]:
    uid = f"kr{abs(hash(request.node.name)) % 100000}"
    bind_subject(fleet, 1, uid, BOTH)
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    learn(cdn, 1, "b.cdn.test", CDN_IP)
    try:
        yield uid
    finally:
        fleet.post(envelope("REMOVE_BINDING", uid))


def settle_pipes(pid: int, want: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while pipes(pid) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return pipes(pid)


def test_bytes_intact_both_ways_and_the_upstream_ends_first(
    cdn: Topology, fleet: Daemon, subject: str
) -> None:
    since = len(records(cdn))
    out = finish(start(cdn, "both", 64 * MIB, 16 * MIB), 120)
    assert out.get("down_sha") == pattern_sha(64 * MIB, "down"), out
    assert out["line"] == f"sha {pattern_sha(16 * MIB, 'up')}" and out["eof"] is True, out
    rec = wait_record(cdn, since)
    assert rec == {"mode": "both", "tail_sha": pattern_sha(3 * MIB, "tail"), "tail": 3 * MIB}, rec


def test_the_client_ends_first_then_a_download(cdn: Topology, fleet: Daemon, subject: str) -> None:
    since = len(records(cdn))
    out = finish(start(cdn, "upfirst", 32 * MIB, 8 * MIB), 120)
    assert out.get("line") == f"sha {pattern_sha(8 * MIB, 'up')} {8 * MIB}", out
    assert out["down_sha"] == pattern_sha(32 * MIB, "down") and out["eof"] is True, out
    assert wait_record(cdn, since) == {"mode": "upfirst", "n": 8 * MIB}


def test_the_kernel_holds_an_open_relay_and_a_narrowing_cuts_it(
    cdn: Topology, fleet: Daemon, subject: str
) -> None:
    pid = mitm_pid(fleet)
    base = settle_pipes(pid, pipes(pid))
    since = len(records(cdn))
    proc = start(cdn, "wait")
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"ready": "ready"}
        # the relay's data pipe and its stop pipe (with mitmproxy's relay: none)
        held = settle_pipes(pid, base + 4, 5)
        assert held == (base + 4 if fleet.kernel_relay else base)  # type: ignore[attr-defined]
        bind_subject(fleet, 1, subject, ONLY_B)  # a.cdn.test goes; the address stays open for b
        out = finish(proc, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out["end"] in ("ConnectionResetError", "eof"), out
    assert wait_record(cdn, since)["mode"] == "wait"  # the upstream's side ended too
    assert settle_pipes(pid, base) == base


def test_a_client_that_vanishes_ends_both_sides(cdn: Topology, fleet: Daemon, subject: str) -> None:
    pid = mitm_pid(fleet)
    base = settle_pipes(pid, pipes(pid))
    since = len(records(cdn))
    out = finish(start(cdn, "vanish-client"), 60)
    assert out.get("read", 0) >= 4 * MIB, out
    rec = wait_record(cdn, since)
    assert rec["mode"] == "endless" and rec.get("error") in ("BrokenPipeError", "ConnectionResetError"), rec
    assert settle_pipes(pid, base) == base


def test_an_upstream_that_vanishes_ends_both_sides(cdn: Topology, fleet: Daemon, subject: str) -> None:
    pid = mitm_pid(fleet)
    base = settle_pipes(pid, pipes(pid))
    out = finish(start(cdn, "vanish", 8 * MIB), 60)
    assert out.get("end") in ("eof", "ConnectionResetError"), out
    assert out.get("read", 0) <= 8 * MIB, out
    assert settle_pipes(pid, base) == base
