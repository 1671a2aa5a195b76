"""Attacker review of the named ports' nameless bytes and silent clients (helper review of 050e694), real packets through
the real MITM in the CDN-shaped topology of tests/kernel/cdn.py.

Each test asserts the secure behaviour: a test that fails shows a hole.

* A ClientHello in a TLS record whose legacy version byte is not 0x00..0x03 (``16 03 04``):
  mitmproxy's ``starts_like_tls_record`` says "not TLS", the MITM decides it without a name
  (``wire=tcp``), and OpenSSL (like Go, BoringSSL) accepts any ``03 xx`` on the first record:
  the SNI of a neighbour on the CDN address is never checked.
* A request line the MITM's tests miss but a lenient server reads (leading space, ``\\x1c``
  between the words: Python's ``str.split()``), like the tab the commit already refuses.
* Regressions: a client-first TLS client on a named port, HTTP keep-alive, a big download over
  a relay admitted after silence.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    allow,
    bind_subject,
    cdn_topology,
    deny,
    http,
    learn,
    mark,
    mitm_env,
    mitm_fleet,
    policy,
    requests,
    tls,
)
from tests.kernel.rawtcp import ECHO_PORT, raw, start_raw_server
from tests.kernel.topology import Daemon, Topology, envelope

HTTP_PORT = 18571


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"ega{os.getpid()}", sandboxes=1, http_ports="80,8081", https_ports="443,8443")
    try:
        start_raw_server(t)
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def fleet(cdn: Topology) -> Iterator[Daemon]:
    with mitm_fleet(cdn, "egt-silatk", HTTP_PORT, mitm_env(cdn, "silatk")) as d:
        yield d


def bind(d: Daemon, uid: str, pol: object) -> None:
    bind_subject(d, 1, uid, pol)


def unbind(d: Daemon, uid: str) -> None:
    d.post(envelope("REMOVE_BINDING", uid))


def mitm_errors(d: Daemon, since: int = 0) -> list[str]:
    return [ln for ln in d.log_text()[since:].splitlines() if '"mitm.error"' in ln]


# A TLS client whose first record's legacy version byte is patched (16 03 01 -> 16 03 <ver>),
# optionally after a silence, then one GET for Host = SNI. JSON: ok, status, body.
ODD_TLS = r"""
import json, socket, ssl, sys, time
ip, port, sni, ca, ver, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6])
out = {"ok": False}
try:
    s = socket.create_connection((ip, port), timeout=4)
    time.sleep(wait)
    ctx = ssl.create_default_context(cafile=ca)
    inc, outg = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, outg, server_hostname=sni)
    first = True
    while True:
        try:
            obj.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        data = outg.read()
        if data:
            if first:
                data = data[:2] + bytes([ver]) + data[3:]
                first = False
            s.sendall(data)
        if done:
            break
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        inc.write(chunk)
    obj.write(f"GET /odd HTTP/1.1\r\nHost: {sni}\r\n\r\n".encode())
    s.sendall(outg.read())
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        inc.write(chunk)
        try:
            got += obj.read(65536)
        except ssl.SSLWantReadError:
            pass
    out = {"ok": got.startswith(b"HTTP/1.1 200"), "got": got.decode("latin-1")[:400]}
except Exception as exc:
    out = {"ok": False, "error": type(exc).__name__ + ": " + str(exc)[:200]}
print(json.dumps(out))
"""


def odd_tls(t: Topology, port: int, sni: str, ver: int, wait: float = 0.0) -> dict[str, Any]:
    script = Path(t.workdir / "odd_tls.py")
    script.write_text(ODD_TLS)
    ca = str(t.workdir / "upstream-ca.pem")
    r = t.ns(
        t.sb(1), sys.executable, str(script), CDN_IP, str(port), sni, ca, str(ver), str(wait),
        check=False, timeout=30,
    )
    doc: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return doc


def reached(t: Topology, since: int, name: str) -> list[dict[str, Any]]:
    return [r for r in requests(t, since) if name in (r.get("sni"), r.get("host"))]


# ---- 1. a ClientHello mitmproxy does not recognise as TLS ------------------------------------------


def test_odd_record_version_control_a_normal_hello_from_the_same_client_is_checked(
    cdn: Topology, fleet: Daemon
) -> None:
    """The client works (allowed name passes) and a normal record with a neighbour SNI is refused."""
    bind(fleet, "at0", policy(allow("a.cdn.test", ports=[8443])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        assert odd_tls(cdn, 8443, "a.cdn.test", 0x01)["ok"]
        since = mark(cdn)
        assert not odd_tls(cdn, 8443, "b.cdn.test", 0x01)["ok"]
        assert reached(cdn, since, "b.cdn.test") == []
    finally:
        unbind(fleet, "at0")


@pytest.mark.parametrize("ver", [0x04, 0xFF])
def test_odd_record_version_does_not_bypass_the_sni_check_under_an_any_protocol_rule(
    cdn: Topology, fleet: Daemon, ver: int
) -> None:
    """allow a.cdn.test ports [8443] (no protocol): its lease opens the CDN address for nameless
    bytes; a ClientHello in a ``16 03 04`` record is nameless to the MITM, not to OpenSSL."""
    bind(fleet, "at1", policy(allow("a.cdn.test", ports=[8443])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = odd_tls(cdn, 8443, "b.cdn.test", ver)
        assert not out["ok"], out
        assert reached(cdn, since, "b.cdn.test") == []
    finally:
        unbind(fleet, "at1")


def test_odd_record_version_does_not_bypass_a_deny_rule_under_default_allow_on_443(
    cdn: Topology, fleet: Daemon
) -> None:
    bind(fleet, "at2", policy(deny("b.cdn.test"), default="allow"))
    try:
        assert not tls(cdn, 1, CDN_IP, "b.cdn.test")["ok"]  # the normal client is refused
        since = mark(cdn)
        out = odd_tls(cdn, 443, "b.cdn.test", 0x04)
        assert not out["ok"], out
        assert reached(cdn, since, "b.cdn.test") == []
    finally:
        unbind(fleet, "at2")


def test_odd_record_version_after_a_silence_is_still_name_checked(cdn: Topology, fleet: Daemon) -> None:
    bind(fleet, "at3", policy(allow("a.cdn.test", ports=["8000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = odd_tls(cdn, 8443, "b.cdn.test", 0x04, wait=1.2)
        assert not out["ok"], out
        assert reached(cdn, since, "b.cdn.test") == []
    finally:
        unbind(fleet, "at3")


# ---- 2. request lines only a lenient server reads ---------------------------------------------------

LENIENT = [
    pytest.param(" GET / HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", id="leading-space"),
    pytest.param("\\r\\n GET / HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", id="crlf-then-space"),
    pytest.param("GET\\x1c/\\x1cHTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", id="x1c-separator"),
    pytest.param("GET\\x85/\\x85HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", id="x85-separator"),
    pytest.param("GET\\t/\\tHTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", id="tab-only"),
]
#: After a silence the first bytes are judged by firstbytes.after_silence (a different test).
LENIENT_LATE = [
    *LENIENT,
    pytest.param("GET\\t/ HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", id="tab-after-method"),
]


@pytest.mark.parametrize("send", LENIENT)
def test_a_lenient_request_line_is_not_relayed_under_default_allow(
    cdn: Topology, fleet: Daemon, send: str
) -> None:
    bind(fleet, "at4", policy(deny("b.cdn.test"), default="allow"))
    try:
        since = mark(cdn)
        out = raw(cdn, 80, send=send, read_s=2.0)
        assert "200 OK" not in out["got"], out
        assert reached(cdn, since, "b.cdn.test") == []
    finally:
        unbind(fleet, "at4")


@pytest.mark.parametrize("send", LENIENT)
def test_a_lenient_request_line_is_not_relayed_under_an_any_protocol_rule(
    cdn: Topology, fleet: Daemon, send: str
) -> None:
    bind(fleet, "at5", policy(allow("a.cdn.test", ports=["8000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = raw(cdn, 8081, send=send, read_s=2.0)
        assert "200 OK" not in out["got"], out
        assert reached(cdn, since, "b.cdn.test") == []
    finally:
        unbind(fleet, "at5")


@pytest.mark.parametrize("send", LENIENT_LATE)
def test_a_lenient_request_line_after_a_silence_is_not_relayed(cdn: Topology, fleet: Daemon, send: str) -> None:
    bind(fleet, "at8", policy(allow("a.cdn.test", ports=["8000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = raw(cdn, 8081, wait=1.2, send=send, read_s=2.0)
        assert "200 OK" not in out["got"], out
        assert reached(cdn, since, "b.cdn.test") == []
    finally:
        unbind(fleet, "at8")


# ---- 3. regressions -----------------------------------------------------------------------------------


def test_client_first_tls_and_keep_alive_on_a_named_port_still_work(cdn: Topology, fleet: Daemon) -> None:
    bind(fleet, "at6", policy(allow("a.cdn.test", ports=["8000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        assert tls(cdn, 1, CDN_IP, "a.cdn.test", port=8443)["ok"]
        out = http(cdn, 1, CDN_IP, "a.cdn.test", "a.cdn.test", "a.cdn.test", port=8081)
        assert out["ok"] and [r["status"] for r in out["responses"]] == [200, 200, 200], out
    finally:
        unbind(fleet, "at6")


def test_a_silent_then_server_first_echo_relay_carries_a_lot(cdn: Topology, fleet: Daemon) -> None:
    """Admitted after silence (tcp lease), then many lines through the echo server: all come back
    and the MITM logs no error."""
    bind(fleet, "at7", policy(allow("a.cdn.test", ports=[ECHO_PORT])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        log_mark = len(fleet.log_text())
        lines = "".join(f"line{i:05d}-" + "x" * 200 + "\\n" for i in range(200))
        out = raw(cdn, ECHO_PORT, wait=1.0, send="SSH-2.0-x\\n" + lines, read_s=5.0)
        assert "echo SSH-2.0-x" in out["got"], out
        assert mitm_errors(fleet, log_mark) == []
    finally:
        unbind(fleet, "at7")


# A TLS client that connects, waits, then does the handshake (its ClientHello in one write, or
# split in two writes 0.1 s apart), then one GET. JSON: ok.
SLOW_TLS = r"""
import json, socket, ssl, sys, time
ip, port, sni, ca, wait, split = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5]), sys.argv[6] == "1"
try:
    s = socket.create_connection((ip, port), timeout=4)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    time.sleep(wait)
    ctx = ssl.create_default_context(cafile=ca)
    inc, outg = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, outg, server_hostname=sni)
    first = True
    while True:
        try:
            obj.do_handshake(); done = True
        except ssl.SSLWantReadError:
            done = False
        data = outg.read()
        if data and first and split:
            s.sendall(data[:100]); time.sleep(0.1); s.sendall(data[100:])
        elif data:
            s.sendall(data)
        first = False
        if done:
            break
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        inc.write(chunk)
    obj.write(f"GET /slow HTTP/1.1\r\nHost: {sni}\r\n\r\n".encode())
    s.sendall(outg.read())
    got = b""
    while b"\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        inc.write(chunk)
        try:
            got += obj.read(65536)
        except ssl.SSLWantReadError:
            pass
    print(json.dumps({"ok": got.startswith(b"HTTP/1.1 200")}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": type(exc).__name__}))
"""


def slow_tls(t: Topology, port: int, sni: str, wait: float, split: bool = False) -> dict[str, Any]:
    script = Path(t.workdir / "slow_tls.py")
    script.write_text(SLOW_TLS)
    ca = str(t.workdir / "upstream-ca.pem")
    r = t.ns(
        t.sb(1), sys.executable, str(script), CDN_IP, str(port), sni, ca, str(wait), "1" if split else "0",
        check=False, timeout=30,
    )
    doc: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return doc


def test_a_slow_tls_client_on_an_https_rules_port_is_served(cdn: Topology, fleet: Daemon) -> None:
    """Regression: an allowed name over HTTPS on 8443, the client connects early (a pool's
    pre-connect, a slow start) and sends its ClientHello after 1 s: on 443 it is waited for, on a
    port an https rule names it is refused as a silent client."""
    bind(fleet, "at9", policy(allow("a.cdn.test", protocol="https", ports=[8443])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        assert slow_tls(cdn, 8443, "a.cdn.test", 0.0)["ok"]  # control
        out = slow_tls(cdn, 8443, "a.cdn.test", 1.0)
        assert out["ok"], out
    finally:
        unbind(fleet, "at9")


def test_a_split_clienthello_after_a_silence_of_an_allowed_name_is_served(cdn: Topology, fleet: Daemon) -> None:
    """Regression: after a silence, a ClientHello of an allowed name in two TCP reads (a large,
    post-quantum hello crosses the MSS) is refused as "no SNI"."""
    bind(fleet, "at10", policy(allow("a.cdn.test", ports=[8443])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        assert slow_tls(cdn, 8443, "a.cdn.test", 1.0)["ok"]  # control: one read
        out = slow_tls(cdn, 8443, "a.cdn.test", 1.0, split=True)
        assert out["ok"], out
    finally:
        unbind(fleet, "at10")


FLOOD = r"""
import socket, sys, time
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for _ in range(n):
    try:
        s = socket.create_connection((ip, port), timeout=2)
        socks.append(s)
    except OSError:
        pass
time.sleep(2.0)
print(len(socks))
for s in socks:
    s.close()
"""


def test_a_flood_of_silent_connections_leaves_the_mitm_working(cdn: Topology, fleet: Daemon) -> None:
    """300 silent connections on a port only an https lease opens: all refused, no MITM error,
    and an allowed client is served right after."""
    from tests.kernel.rawtcp import BANNER_PORT

    bind(fleet, "at11", policy(allow("a.cdn.test", protocol="https", ports=[BANNER_PORT, 8443])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        log_mark = len(fleet.log_text())
        r = cdn.ns(cdn.sb(1), sys.executable, "-c", FLOOD, CDN_IP, str(BANNER_PORT), "300", check=False, timeout=60)
        assert r.stdout.strip(), r.stderr
        assert mitm_errors(fleet, log_mark) == []
        assert tls(cdn, 1, CDN_IP, "a.cdn.test", port=8443)["ok"]
    finally:
        unbind(fleet, "at11")
