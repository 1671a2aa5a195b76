"""Named ports and the protocols that carry no name (docs/reference/behaviour.md §18), fleet
profile, real packets through the real MITM in the CDN-shaped topology of tests/kernel/cdn.py.

* A domain rule with ``ports`` and no ``protocol`` opens HTTPS there too: its ports are
  name-checked (SNI spoofing on them is refused).
* A server-first protocol (the server greets first) on a name-checked port gets its banner:
  after a short silence the connection is decided without a name, admitted where an address
  rule, ``defaultAction: allow`` or a ``tcp``/any-protocol rule's lease opens it, refused (with
  no upstream connection) where only an ``https`` rule's lease would.
* A ``tcp`` rule keeps its bytes on a port another rule makes name-checked.
* A client that goes silent first and then sends TLS or HTTP is still name-checked.
* A request line behind empty lines (servers skip them) is refused, not relayed.

Besides the CDN upstream (tests/kernel/cdn_upstream.py), the upstream namespace runs a raw TCP
server here: a greeting one (server-first) and a line echo (client-first), on the CDN address,
recording every accepted connection at accept.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    accepts,
    allow,
    bind_subject,
    cdn_topology,
    deny,
    learn,
    mark,
    mitm_env,
    mitm_fleet,
    policy,
    requests,
    set_elements,
    tls,
    wait_refusal,
)
from tests.kernel.rawtcp import BANNER_PORT, ECHO_PORT, raw, raw_records, start_raw_server
from tests.kernel.topology import Daemon, Topology, envelope

HTTP_PORT = 18560


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egs{os.getpid()}", sandboxes=1, http_ports="80,8081", https_ports="443,8443")
    try:
        start_raw_server(t)
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def fleet(cdn: Topology) -> Iterator[Daemon]:
    with mitm_fleet(cdn, "egt-silent", HTTP_PORT, mitm_env(cdn, "silent")) as d:
        yield d


def bind(d: Daemon, uid: str, pol: object) -> None:
    bind_subject(d, 1, uid, pol)


def unbind(d: Daemon, uid: str) -> None:
    d.post(envelope("REMOVE_BINDING", uid))


# ---- any-protocol rules with ports are name-checked -----------------------------------------------


def test_a_rule_with_ports_and_no_protocol_has_its_names_checked_there(cdn: Topology, fleet: Daemon) -> None:
    bind(fleet, "sl1", policy(allow("a.cdn.test", ports=[8443])))
    try:
        assert "8443" in set_elements(fleet, "mitm_ports_v4")
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        assert tls(cdn, 1, CDN_IP, "a.cdn.test", port=8443)["ok"]
        since, log_mark = mark(cdn), len(fleet.log_text())
        assert not tls(cdn, 1, CDN_IP, "b.cdn.test", port=8443)["ok"]  # a neighbour on the CDN address
        assert accepts(cdn, since) == []
        wait_refusal(fleet.log_text, log_mark, name="b.cdn.test", port=8443, reason="sni_not_allowed")
    finally:
        unbind(fleet, "sl1")


# ---- server-first protocols on name-checked ports -------------------------------------------------


def test_a_server_first_protocol_gets_its_banner_where_a_rule_opens_it_for_any_protocol(
    cdn: Topology, fleet: Daemon
) -> None:
    bind(fleet, "sl2", policy(allow("a.cdn.test", ports=["2000-9000"])))
    try:
        assert "2000" in set_elements(fleet, "mitm_ports_v4")
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        out = raw(cdn, BANNER_PORT, greeted=True, send="EHLO me\\r\\n")
        assert out["got"].startswith("220 cdn.test ESMTP ready"), out
        assert "echo EHLO me" in out["got"], out  # the client's text after the greeting passes
        assert out["t"] is not None and out["t"] < 3.0, out
    finally:
        unbind(fleet, "sl2")


def test_a_server_first_protocol_gets_its_banner_where_an_address_rule_opens_it(
    cdn: Topology, fleet: Daemon
) -> None:
    # The https rule names 2525 (so it is name-checked); the address rule opens it for TCP.
    pol = policy(
        allow("a.cdn.test", protocol="https", ports=[BANNER_PORT]),
        allow(CDN_IP, protocol="tcp", ports=[BANNER_PORT]),
    )
    bind(fleet, "sl3", pol)
    try:
        assert str(BANNER_PORT) in set_elements(fleet, "mitm_ports_v4")
        out = raw(cdn, BANNER_PORT, greeted=True)
        assert out["got"].startswith("220 "), out
    finally:
        unbind(fleet, "sl3")


def test_a_silent_client_only_an_https_lease_would_admit_gets_no_upstream_connection(
    cdn: Topology, fleet: Daemon
) -> None:
    """No name does not do there: the client is waited for (a slow TLS client may still speak:
    test_silence_attack.py), nothing reaches the upstream, and then what it sends is checked."""
    bind(fleet, "sl4", policy(allow("a.cdn.test", protocol="https", ports=[BANNER_PORT])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since, log_mark = len(raw_records(cdn)), len(fleet.log_text())
        out = raw(cdn, BANNER_PORT, greeted=True, read_s=2.0)
        assert out["got"] == "", out  # no greeting
        assert [r for r in raw_records(cdn)[since:] if r["event"] == "accept"] == []
        assert '"mitm.name_refused"' not in fleet.log_text()[log_mark:]  # a question, not a refusal
        # What it then sends is decided on its own: a line that looks like a request is parsed
        # as HTTP (and fails there); nothing unchecked reaches the upstream.
        out = raw(cdn, BANNER_PORT, wait=1.0, send="HELO x\\r\\n", read_s=2.0)
        assert not out["got"].startswith("220"), out
        assert [r for r in raw_records(cdn)[since:] if r["event"] == "accept"] == []
    finally:
        unbind(fleet, "sl4")


# ---- tcp rules keep their bytes -------------------------------------------------------------------


def test_a_tcp_rule_keeps_its_bytes_on_a_port_a_deny_https_rule_names(cdn: Topology, fleet: Daemon) -> None:
    pol = policy(
        deny("b.cdn.test", protocol="https", ports=["1-65535"]),
        allow("a.cdn.test", protocol="tcp", ports=[ECHO_PORT]),
    )
    bind(fleet, "sl5", pol)
    try:
        assert set_elements(fleet, "mitm_ports_v4") != "[]"  # the deny rule's ports are name-checked
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        out = raw(cdn, ECHO_PORT, send="SSH-2.0-client\\r\\n")
        assert "echo SSH-2.0-client" in out["got"], out
        # ... and the server-first one on another port the tcp rule does not open stays closed.
        assert raw(cdn, BANNER_PORT, greeted=True, read_s=2.0)["got"] == ""
    finally:
        unbind(fleet, "sl5")


# ---- silence, then a name -------------------------------------------------------------------------


def test_tls_sent_after_a_silence_is_still_name_checked(cdn: Topology, fleet: Daemon) -> None:
    """Admitted without a name after its silence, the connection's first bytes are a
    ClientHello: its SNI is checked before anything of it leaves."""
    bind(fleet, "sl6", policy(allow("a.cdn.test", ports=["8000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        script = Path(cdn.workdir / "late_tls.py")
        script.write_text(LATE_TLS)
        ca = str(cdn.workdir / "upstream-ca.pem")
        since, log_mark = mark(cdn), len(fleet.log_text())
        r = cdn.ns(
            cdn.sb(1), sys.executable, str(script), CDN_IP, "8443", "b.cdn.test", ca, check=False, timeout=30
        )
        assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] is False, r.stdout
        assert requests(cdn, since) == []
        wait_refusal(fleet.log_text, log_mark, name="b.cdn.test", port=8443, reason="sni_not_allowed")
        r = cdn.ns(
            cdn.sb(1), sys.executable, str(script), CDN_IP, "8443", "a.cdn.test", ca, check=False, timeout=30
        )
        assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] is True, r.stdout
    finally:
        unbind(fleet, "sl6")


LATE_TLS = r"""
import json, socket, ssl, sys, time
ip, port, sni, ca = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
try:
    s = socket.create_connection((ip, port), timeout=4)
    time.sleep(1.2)  # longer than the MITM's silence
    c = ssl.create_default_context(cafile=ca).wrap_socket(s, server_hostname=sni)
    c.sendall(f"GET /late HTTP/1.1\r\nHost: {sni}\r\n\r\n".encode())
    print(json.dumps({"ok": c.recv(4096).startswith(b"HTTP/1.1 200")}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": type(exc).__name__}))
"""


def test_http_sent_after_a_silence_is_refused(cdn: Topology, fleet: Daemon) -> None:
    bind(fleet, "sl7", policy(allow("a.cdn.test", ports=["8000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = raw(cdn, 8081, wait=1.2, send="GET / HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", read_s=2.0)
        assert out["got"] == "", out
        assert requests(cdn, since) == []
        # Without the silence, the same request is parsed and its Host checked (403), and the
        # allowed name passes.
        assert "403" in raw(cdn, 8081, send="GET / HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n")["got"]
        assert "200 OK" in raw(cdn, 8081, send="GET / HTTP/1.1\\r\\nHost: a.cdn.test\\r\\n\\r\\n")["got"]
    finally:
        unbind(fleet, "sl7")


# ---- a request line behind empty lines ------------------------------------------------------------


def test_a_request_line_behind_empty_lines_is_refused_not_relayed(cdn: Topology, fleet: Daemon) -> None:
    """Under defaultAction allow a denied name is refused on the wire; servers skip empty lines
    before a request line, mitmproxy's HTTP test does not: relayed as "not HTTP", its Host
    would never have been checked."""
    bind(fleet, "sl8", policy(deny("b.cdn.test"), default="allow"))
    try:
        since = mark(cdn)
        out = raw(cdn, 80, send="\\r\\nGET / HTTP/1.1\\r\\nHost: b.cdn.test\\r\\n\\r\\n", read_s=2.0)
        assert "200 OK" not in out["got"], out
        assert requests(cdn, since) == []
        assert "200 OK" in raw(cdn, 80, send="GET / HTTP/1.1\\r\\nHost: a.cdn.test\\r\\n\\r\\n")["got"]
    finally:
        unbind(fleet, "sl8")


def test_a_silent_client_on_80_is_waited_for(cdn: Topology, fleet: Daemon) -> None:
    """80 and 443 are client-first: a client that connects and speaks later is not decided
    by its silence (a connection pool's early connect keeps working)."""
    bind(fleet, "sl9", policy(allow("a.cdn.test")))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        out = raw(cdn, 80, wait=1.2, send="GET / HTTP/1.1\\r\\nHost: a.cdn.test\\r\\n\\r\\n")
        assert "200 OK" in out["got"], out
    finally:
        unbind(fleet, "sl9")


SPLIT_REQUEST = r"""
import json, socket, sys, time
ip, port, host = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.create_connection((ip, port), timeout=4)
s.sendall(b"GET")
time.sleep(1.2)  # stalled on the method: longer than the MITM's silence
try:
    s.sendall(f" / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    s.settimeout(2)
    got = s.recv(4096)
except OSError as exc:
    got = type(exc).__name__.encode()
print(json.dumps({"got": got.decode("latin-1")}))
"""


def test_a_request_line_stalled_after_its_method_is_still_refused(cdn: Topology, fleet: Daemon) -> None:
    """A client that stalls on "GET" is decided without a name (no request yet); the rest of its
    request line, naming a neighbour, is refused before it leaves."""
    bind(fleet, "sl10", policy(allow("a.cdn.test", ports=["8000-9000"])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        r = cdn.ns(
            cdn.sb(1),
            sys.executable,
            "-c",
            SPLIT_REQUEST,
            CDN_IP,
            "8081",
            "b.cdn.test",
            check=False,
            timeout=30,
        )
        assert "200 OK" not in r.stdout, r.stdout
        assert requests(cdn, since) == []
    finally:
        unbind(fleet, "sl10")


def test_a_client_first_word_without_a_line_end_is_relayed_after_a_stall(
    cdn: Topology, fleet: Daemon
) -> None:
    """``ping`` (no line end, then the client waits for its answer) could be the start of a
    request line: after the stall it is decided without a name, relayed and watched."""
    bind(fleet, "sl11", policy(allow("a.cdn.test", ports=[ECHO_PORT])))
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        out = raw(cdn, ECHO_PORT, send="ping", read_s=3.0)
        assert out["got"] == "echo ping", out
    finally:
        unbind(fleet, "sl11")
