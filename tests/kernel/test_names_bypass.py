"""Bypasses of the name check (docs/reference/behaviour.md §18) found by the attacker review,
each now a test that the bypass is closed: QUIC to a shared CDN address learned through another
name (UDP 443 is dropped), and a ClientHello or request line whose first segment is one byte
(mitmproxy would relay it as raw TCP and the check would see no name: egressd waits for enough
bytes to tell TLS or HTTP instead). A sandbox whose policy allows only a.cdn.test learns the
shared CDN address first.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import CDN_IP, CDN_POLICY, DPR, OTHER_IP, cdn_topology, learn, mitm_env
from tests.kernel.topology import Daemon, Topology, envelope

HTTP_PORT = 18590

UDP_RECV = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
s.settimeout(20)
data, peer = s.recvfrom(65535)
with open(sys.argv[3], "wb") as f:
    f.write(data)
"""

TCP_RECV = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print("ready", flush=True)
s.settimeout(20)
c, peer = s.accept()
c.settimeout(5)
data = c.recv(65535)
with open(sys.argv[3], "wb") as f:
    f.write(data)
"""

UDP_SEND = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(5):
    s.sendto(sys.argv[3].encode(), (sys.argv[1], int(sys.argv[2])))
"""

TCP_SEND = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
c.sendall(sys.argv[3].encode())
import time; time.sleep(0.5)
"""


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egr{os.getpid()}", sandboxes=1)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def fleet(cdn: Topology) -> Iterator[Daemon]:
    with Daemon(cdn, table="egt-revnames", port=HTTP_PORT, env=mitm_env(cdn, "revnames")).running() as d:
        yield d


@pytest.fixture
def sb1(fleet: Daemon, cdn: Topology) -> Iterator[str]:
    uid = "revnames1"
    assert fleet.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(1), policy=CDN_POLICY)) == (200, "{}")
    assert fleet.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")
    yield uid
    fleet.post(envelope("REMOVE_BINDING", uid))


def _arrives(cdn: Topology, recv: str, send: str, port: int, payload: str, ip: str = CDN_IP) -> bytes | None:
    out = cdn.workdir / f"review-recv-{port}.bin"
    if out.exists():
        out.unlink()
    proc = cdn.spawn(cdn.up, sys.executable, "-c", recv, ip, str(port), str(out), ready_line="ready")
    try:
        cdn.ns(cdn.sb(1), sys.executable, "-c", send, ip, str(port), payload, check=False, timeout=15)
        with contextlib.suppress(Exception):
            proc.wait(8)
    finally:
        cdn.stop(proc)
    return out.read_bytes() if out.exists() else None


def test_control_udp_443_to_an_unlearned_address_is_dropped(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    # Control: the filter is in place (c.cdn.test's address was never resolved by this sandbox).
    assert _arrives(cdn, UDP_RECV, UDP_SEND, 443, "x", ip=OTHER_IP) is None


def test_udp_443_to_a_learned_address_is_dropped(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    got = _arrives(cdn, UDP_RECV, UDP_SEND, 443, "QUIC Initial with SNI b.cdn.test")
    # The spec wants this dropped (QUIC carries a name egressd cannot check).
    assert got is None, f"UDP 443 reached the shared CDN address unchecked: {got!r}"


# ---- a first segment of 1-2 bytes: mitmproxy relays it as raw TCP, the check sees no name ----------

SPLIT_TLS = r"""
import json, socket, ssl, sys, time
ip, sni, ca = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.create_connection((ip, 443), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ctx = ssl.create_default_context(cafile=ca)
inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
obj = ctx.wrap_bio(inc, out, server_hostname=sni)
try:
    obj.do_handshake()
except ssl.SSLWantReadError:
    pass
hello = out.read()
s.sendall(hello[:1]); time.sleep(0.5); s.sendall(hello[1:])
result = {"ok": False}
try:
    while True:
        try:
            obj.do_handshake(); break
        except ssl.SSLWantReadError:
            data = s.recv(65536)
            if not data:
                raise OSError("closed")
            inc.write(data)
            pending = out.read()
            if pending:
                s.sendall(pending)
    pending = out.read()
    if pending:
        s.sendall(pending)
    obj.write(f"GET / HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode())
    s.sendall(out.read())
    body = b""
    while True:
        try:
            body += obj.read(65536)
        except ssl.SSLWantReadError:
            data = s.recv(65536)
            if not data:
                break
            inc.write(data)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            break
    result = {"ok": True, "response": body.decode(errors="replace")[-300:]}
except Exception as exc:
    result = {"ok": False, "error": repr(exc)}
print(json.dumps(result))
"""

SPLIT_HTTP = r"""
import json, socket, sys, time
ip, host = sys.argv[1], sys.argv[2]
s = socket.create_connection((ip, 80), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.sendall(b"G"); time.sleep(0.5)
s.sendall(f"ET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
data = b""
try:
    while True:
        d = s.recv(65536)
        if not d:
            break
        data += d
except OSError as exc:
    data += repr(exc).encode()
print(json.dumps({"response": data.decode(errors="replace")[-300:]}))
"""


def test_a_denied_name_is_refused_when_the_first_segment_is_one_byte(cdn: Topology, fleet: Daemon) -> None:
    import json

    from tests.kernel.cdn import DENY_IP, accepts, deny, mark, policy, requests, tls, upstream_ca

    uid = "revnames2"
    pol = policy(deny("evil.test"), default="allow")
    assert fleet.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(1), policy=pol)) == (200, "{}")
    assert fleet.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")
    try:
        # Control: the ordinary client is refused.
        since = mark(cdn)
        assert not tls(cdn, 1, DENY_IP, "evil.test")["ok"]
        assert accepts(cdn, since) == []
        # The same ClientHello, its first byte in a segment of its own., its first byte in a segment of its own.
        since = mark(cdn)
        r = cdn.ns(cdn.sb(1), sys.executable, "-c", SPLIT_TLS, DENY_IP, "evil.test", str(upstream_ca(cdn)), check=False, timeout=30)
        tls_out = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {"stderr": r.stderr}
        tls_reqs = [q for q in requests(cdn, since) if q.get("sni") == "evil.test"]
        # Plain HTTP, "G" first.
        since2 = mark(cdn)
        r = cdn.ns(cdn.sb(1), sys.executable, "-c", SPLIT_HTTP, DENY_IP, "evil.test", check=False, timeout=30)
        http_out = r.stdout.strip()
        http_reqs = [q for q in requests(cdn, since2) if q.get("host") == "evil.test"]
        assert not tls_reqs and not http_reqs, (tls_out, tls_reqs, http_out, http_reqs)
    finally:
        fleet.post(envelope("REMOVE_BINDING", uid))
