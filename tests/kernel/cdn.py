"""A CDN-shaped topology for the name-check tests (docs/reference/behaviour.md §18): one upstream
address serving several names (TLS with one certificate per name chosen by SNI, HTTP by
``Host``), an upstream that records every TCP connection at accept
(``tests/kernel/cdn_upstream.py``), and the clients and probes the tests share."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.kernel.topology import REPO, UPSTREAM_IPS, Daemon, Topology, cleanup_stale, envelope

CDN_IP = UPSTREAM_IPS[1]  # 10.204.0.3: a.cdn.test, b.cdn.test, www.cdn.test (via CNAME)
OTHER_IP = UPSTREAM_IPS[2]  # 10.204.0.4: c.cdn.test
XIO_IP = UPSTREAM_IPS[3]  # 10.204.0.5: api.x.io, w.x.io
DENY_IP = UPSTREAM_IPS[4]  # 10.204.0.6: evil.test, good.test

ZONE: list[dict[str, object]] = [
    {"name": "a.cdn.test", "type": "A", "value": CDN_IP, "ttl": 60},
    {"name": "b.cdn.test", "type": "A", "value": CDN_IP, "ttl": 60},
    {"name": "c.cdn.test", "type": "A", "value": OTHER_IP, "ttl": 60},
    {"name": "www.cdn.test", "type": "CNAME", "value": "edge.cdnhost.test", "ttl": 60},
    {"name": "edge.cdnhost.test", "type": "A", "value": CDN_IP, "ttl": 60},
    {"name": "api.x.io", "type": "A", "value": XIO_IP, "ttl": 60},
    {"name": "w.x.io", "type": "A", "value": XIO_IP, "ttl": 60},
    {"name": "evil.test", "type": "A", "value": DENY_IP, "ttl": 60},
    {"name": "good.test", "type": "A", "value": DENY_IP, "ttl": 60},
    # Answered 1.2 s late over UDP (inside the proxy's 2 s upstream timeout in the tests): a
    # query in flight across a policy change.
    {"name": "slow.cdn.test", "type": "A", "value": CDN_IP, "ttl": 60, "delay_s": 1.2},
]

DPR = "sandbox.data-plane-ready"


def allow(target: str, **extra: object) -> dict[str, object]:
    return {"action": "allow", "target": target, **extra}


def deny(target: str, **extra: object) -> dict[str, object]:
    return {"action": "deny", "target": target, **extra}


def policy(*rules: dict[str, object], default: str = "deny") -> dict[str, object]:
    return {"defaultAction": default, "egress": list(rules)}


#: Allows a.cdn.test (not b.cdn.test on the same address), c.cdn.test (another address),
#: www.cdn.test (a CNAME to edge.cdnhost.test, which no rule names) and *.x.io.
CDN_RULES = (allow("a.cdn.test"), allow("c.cdn.test"), allow("www.cdn.test"), allow("*.x.io"))
CDN_POLICY = policy(*CDN_RULES)


def cdn_topology(
    prefix: str,
    sandboxes: int,
    *,
    http_ports: str = "80,8080,853",
    https_ports: str = "443",
    zone: list[dict[str, object]] | None = None,
) -> Topology:
    """The CDN topology; ``zone``: another zone than :data:`ZONE` (tests/kernel/cdn6.py's, with
    AAAA records)."""
    cleanup_stale()
    t = Topology(
        prefix=prefix,
        sandboxes=sandboxes,
        upstream_script=REPO / "tests" / "kernel" / "cdn_upstream.py",
        zone=ZONE if zone is None else zone,
        http_ports=http_ports,
        https_ports=https_ports,
    ).up_()
    os.chmod(t.workdir, 0o755)  # host-uid sandboxes read the upstream CA from here
    ca = t.workdir / "upstream-ca.pem"
    shutil.copy(t.tls_dir / "ca.pem", ca)
    os.chmod(ca, 0o644)
    return t


def upstream_ca(t: Topology) -> Path:
    return t.workdir / "upstream-ca.pem"


def mitm_env(t: Topology, tag: str) -> dict[str, str]:
    return {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(t.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(t.workdir / f"{tag}-mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(t.workdir / f"{tag}-mitm-run" / "active.sock"),
    }


# ---- a fleet daemon with the MITM ---------------------------------------------------------------


@contextmanager
def mitm_fleet(t: Topology, table: str, port: int, env: dict[str, str]) -> Iterator[Daemon]:
    """A fleet egressd (MITM on) in ``t``'s pod, stopped and its table deleted afterwards."""
    d = Daemon(t, table=table, port=port, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            t.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        print(d.log_text()[-8000:])


def bind_subject(d: Daemon, sb: int, uid: str, pol: object, *, activate: bool = True) -> None:
    """SET_BINDING sandbox ``sb`` as ``uid`` with ``pol`` (and data-plane-ready)."""
    assert d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(sb), policy=pol)) == (200, "{}")
    if activate:
        assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")


def set_elements(d: Daemon, name: str) -> str:
    """The elements of one of the daemon's table's sets, as nft lists them (JSON)."""
    out = d.nft("-j", "list", "set", "inet", d.table, name)
    for item in json.loads(out)["nftables"]:
        if "set" in item:
            return json.dumps(item["set"].get("elem", []))
    return "[]"


# ---- what the upstream saw ---------------------------------------------------------------------


def upstream_records(t: Topology) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in t.upstream_log.read_text().splitlines() if ln.strip()]


def mark(t: Topology) -> int:
    return len(upstream_records(t))


def accepts(t: Topology, since: int, ip: str | None = None) -> list[dict[str, Any]]:
    """TCP connections the upstream accepted after ``since`` (to ``ip``, when given)."""
    return [
        r
        for r in upstream_records(t)[since:]
        if r.get("event") == "accept" and (ip is None or r.get("local") == ip)
    ]


def requests(t: Topology, since: int) -> list[dict[str, Any]]:
    return [r for r in upstream_records(t)[since:] if r.get("event") == "request"]


# ---- clients -------------------------------------------------------------------------------------

# One TCP connection to ip:port, TLS (with SNI ``sni``, or none for "-"; "+plain": no TLS) when port is 443 or 8443, then
# one HTTP/1.1 GET per Host on the same connection. JSON: ok, the responses, or the error.
CLIENT = r"""
import json, socket, ssl, sys
ip, port, sni, ca, hosts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
out = []
def response(f):
    line = f.readline()
    if not line:
        raise ConnectionError("closed")
    status = int(line.split()[1])
    length = 0
    while True:
        h = f.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        k, _, v = h.decode("latin-1").partition(":")
        if k.strip().lower() == "content-length":
            length = int(v.strip())
    body = f.read(length) if length else b""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = body.decode("latin-1")
    return {"status": status, "body": doc}
try:
    conn = socket.create_connection((ip, port), timeout=4)
    if port in (443, 8443) and sni != "+plain":
        ctx = ssl.create_default_context(cafile=ca)
        if sni == "-":
            ctx.check_hostname = False
        conn = ctx.wrap_socket(conn, server_hostname=None if sni == "-" else sni)
    f = conn.makefile("rb")
    for host in hosts:
        conn.sendall(f"GET /x HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        out.append(response(f))
    print(json.dumps({"ok": True, "responses": out}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": type(exc).__name__, "responses": out}))
"""

# An interpreter another uid may run (a pyenv under /root is not one).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "python3"


def client_argv(
    t: Topology, ip: str, port: int, sni: str | None, hosts: tuple[str, ...], ca: Path | None = None
) -> list[str]:
    return ["-c", CLIENT, ip, str(port), sni or "-", str(ca or upstream_ca(t)), *hosts]


def parse_client(stdout: str, stderr: str) -> dict[str, Any]:
    lines = stdout.strip().splitlines()
    assert lines, stderr
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


def tls(
    t: Topology,
    sb: int,
    ip: str,
    sni: str | None,
    host: str | None = None,
    ca: Path | None = None,
    port: int = 443,
) -> dict[str, Any]:
    """One TLS connection from sandbox ``sb`` to ``ip``:``port`` (443 or 8443) with ``sni`` (None:
    no SNI) and one GET for ``host`` (default: the SNI), trusting ``ca`` (default: the upstream's CA)."""
    hosts = (host or sni or ip,)
    r = t.ns(t.sb(sb), sys.executable, *client_argv(t, ip, port, sni, hosts, ca), check=False, timeout=30)
    return parse_client(r.stdout, r.stderr)


def http(t: Topology, sb: int, ip: str, *hosts: str, port: int = 80) -> dict[str, Any]:
    """One plain-HTTP connection from sandbox ``sb`` to ``ip``:``port``, one GET per Host on it."""
    sni = "+plain" if port in (443, 8443) else None
    r = t.ns(t.sb(sb), sys.executable, *client_argv(t, ip, port, sni, hosts), check=False, timeout=30)
    return parse_client(r.stdout, r.stderr)


def learn(t: Topology, sb: int, name: str, expect: str) -> None:
    status, answers = t.dig(sb, name)
    assert status == "NOERROR" and expect in answers, (name, status, answers)


# ---- what egressd reported -------------------------------------------------------------------------


def dropped(d: Daemon, subject: str) -> int:
    code, text = d.get("/metrics")
    assert code == 200, text
    m = re.search(
        rf'^egressd_subject_dropped_packets_total\{{subject="{re.escape(subject)}"[^}}]*\}} (\d+)', text, re.M
    )
    return int(m.group(1)) if m else 0


def refusals(log_text: str, since: int = 0) -> list[dict[str, Any]]:
    out = []
    for line in log_text[since:].splitlines():
        if '"mitm.name_refused"' in line:
            out.append(json.loads(line))
    return out


def wait_refusal(read_log: Any, since: int, **want: object) -> dict[str, Any]:
    """The first ``mitm.name_refused`` line after ``since`` carrying every field of ``want``."""
    deadline = time.monotonic() + 5
    while True:
        for event in refusals(read_log(), since):
            if all(event.get(k) == v for k, v in want.items()):
                return event
        assert time.monotonic() < deadline, (want, refusals(read_log(), since))
        time.sleep(0.05)


RECEIVER = r"""
import http.server, sys
log = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(log, "ab") as f:
            f.write(body + b"\n")
        self.send_response(204)
        self.end_headers()
    def log_message(self, *args):
        pass
srv = http.server.ThreadingHTTPServer((sys.argv[2], int(sys.argv[3])), H)
print("ready", flush=True)
srv.serve_forever()
"""


class Webhook:
    """A deny-webhook receiver in namespace ``ns``: one JSON body per line."""

    def __init__(self, t: Topology, ns: str, host: str, port: int, name: str) -> None:
        self.log = t.workdir / f"webhook-{name}.log"
        self.log.write_text("")
        self.url = f"http://{host}:{port}/deny"
        self.proc = t.spawn(
            ns, sys.executable, "-c", RECEIVER, str(self.log), host, str(port), ready_line="ready"
        )

    def posts(self) -> list[dict[str, Any]]:
        return [json.loads(ln) for ln in self.log.read_text().splitlines() if ln.strip()]

    def wait_for(self, hostname: str, timeout: float = 10) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for post in self.posts():
                if post.get("hostname") == hostname:
                    return post
            assert time.monotonic() < deadline, (hostname, self.posts())
            time.sleep(0.05)
