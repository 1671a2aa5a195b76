"""The shared transparent MITM (docs/reference/behaviour.md §10) end to end: real kernel DNAT, real mitmdump,
real HTTPS upstream echoing what arrived, clients in sandbox namespaces trusting the MITM CA.

One daemon with the MITM for the whole module (mitmdump takes ~1.5 s to start); every test
binds its own sandboxes and removes them at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egressd.mitm.seqmap import MAX_SILENCE_S
from tests.kernel.topology import GATEWAY, GATEWAY6, UPSTREAM_IPS, Daemon, Topology, decode_echo, envelope

SECRET = "sk-live-MITM-4f9a2c"  # the real key: only ever in the vault and upstream
PLACEHOLDER = "PLACEHOLDER-KEY-7"  # what the sandbox holds
SUB_SECRET = "sub-REAL-91b3"
API = "api.example.test"
API_IP = UPSTREAM_IPS[4]  # 10.204.0.6 (zone: api.example.test)
B_IP = UPSTREAM_IPS[1]  # 10.204.0.3 (zone: b.test)
MITM_PORT = 18181
DPR = "sandbox.data-plane-ready"

POLICY = {
    "defaultAction": "deny",
    "egress": [{"action": "allow", "target": API}, {"action": "allow", "target": "b.test"}],
}
VAULT: dict[str, Any] = {
    "credentials": [
        {"name": "key", "source": {"type": "inline", "value": SECRET}},
        {"name": "sub", "source": {"type": "inline", "value": SUB_SECRET}},
    ],
    "bindings": [
        {
            "name": "api",
            "match": {"hosts": [API], "methods": ["GET"], "paths": ["/v1/*"]},
            "auth": {"type": "bearer", "credential": "key"},
        },
        {
            "name": "plain",
            "match": {"hosts": [API], "schemes": ["http"], "methods": ["GET"], "paths": ["/plain/*"]},
            "auth": {"type": "bearer", "credential": "key"},
        },
        {
            "name": "subst",
            "match": {"hosts": [API], "methods": ["POST"], "paths": ["/sub/*"]},
            "auth": {
                "type": "passthrough",
                "substitutions": [
                    {"credential": "sub", "placeholder": PLACEHOLDER, "in": ["header", "body"]}
                ],
            },
        },
    ],
}


# docs/reference/behaviour.md §16: only an SNI naming an https binding host is decrypted. The tests below that
# send an SNI of b.test to check what the MITM does with the decrypted request (14.8) give m1
# a binding for b.test that no request of theirs matches.
VAULT_SNI_B: dict[str, Any] = {
    "credentials": VAULT["credentials"],
    "bindings": [
        *VAULT["bindings"],
        {
            "name": "b-unused",
            "match": {"hosts": ["b.test"], "methods": ["GET"], "paths": ["/b-only/*"]},
            "auth": {"type": "bearer", "credential": "key"},
        },
    ],
}


@pytest.fixture(scope="module")
def mitm(topo: Topology) -> Iterator[Daemon]:
    env = {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        # The injection layer's own defences (forged Host/SNI towards an address of the
        # sandbox's choice, one authority, a failed lookup) are tested beneath the name check,
        # which would refuse those connections first (tests/kernel/test_names_on_wire.py).
        "EGRESSD_NAME_CHECK": "off",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "mitm-run" / "active.sock"),
    }
    d = Daemon(topo, table="egt-mitm", port=18190, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            topo.stop(d.proc)
        d.nft("delete", "table", "inet", "egt-mitm", check=False)
        print(d.log_text()[-6000:])  # shown by pytest when a test of the module failed


def ca_file(topo: Topology) -> str:
    return str(topo.workdir / "mitm-conf" / "mitmproxy-ca-cert.pem")


def client_trust(topo: Topology) -> str:
    """What the sandbox clients trust: the MITM CA (decrypted connections, docs/reference/behaviour.md §16) and
    the upstream's test CA (connections the MITM passes through untouched)."""
    bundle = topo.workdir / "client-trust.pem"
    bundle.write_text(Path(ca_file(topo)).read_text() + (topo.tls_dir / "ca.pem").read_text())
    return str(bundle)


def bind(d: Daemon, i: int, uid: str, policy: object = POLICY, vault: dict[str, Any] | None = VAULT) -> None:
    code, body = d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(i), policy=policy))
    assert (code, body) == (200, "{}"), body
    code, body = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
    assert (code, body) == (200, "{}"), body
    if vault is not None:
        assert vault_call(d, uid, "PUT", vault)[0] == 201


def unbind(d: Daemon, uid: str) -> None:
    d.post(envelope("REMOVE_BINDING", uid))


def vault_call(d: Daemon, uid: str, method: str, doc: object | None = None) -> tuple[int, str]:
    args = ["-X", method]
    if doc is not None:
        path = d.topo.workdir / "vault.json"
        path.write_text(json.dumps(doc))
        args += ["-H", "Content-Type: application/json", "--data-binary", f"@{path}"]
    return d._curl(*args, f"http://127.0.0.1:{d.port}/v1/sandboxfleets/{uid}/egress/credential-vault")


def learn(topo: Topology, i: int, name: str) -> None:
    status, answers = topo.dig(i, name)
    assert status == "NOERROR" and answers, (name, status)


class Reply:
    def __init__(self, code: int, body: str, headers: str) -> None:
        self.code = code
        self.text = body
        self.headers = headers.lower()
        self.echo: dict[str, Any] = decode_echo(body)  # what the upstream received

    def upstream_header(self, name: str) -> str | None:
        for k, v in self.echo.get("headers", {}).items():
            if k.lower() == name.lower():
                return str(v)
        return None


def call(
    topo: Topology,
    i: int,
    url: str,
    *,
    resolve: str | None = None,
    method: str = "GET",
    headers: tuple[str, ...] = (),
    data: str | None = None,
    extra: tuple[str, ...] = (),
    timeout: float = 3.0,
) -> Reply:
    """One curl from sandbox ``i`` trusting both CAs (:func:`client_trust`); ``resolve`` pins
    host:port:ip."""
    hdr_file = topo.workdir / f"hdr-{i}.txt"
    trust = client_trust(topo)
    args = ["curl", "-s", "-X", method, "--cacert", trust, "-D", str(hdr_file), "-m", str(timeout)]
    args += ["-w", "\n%{http_code}"]
    if resolve:
        args += ["--resolve", resolve]
    for h in headers:
        args += ["-H", h]
    if data is not None:
        body = topo.workdir / f"body-{i}.bin"
        body.write_text(data)
        args += ["--data-binary", f"@{body}"]
    args += [*extra, url]
    r = topo.ns(topo.sb(i), *args, check=False, timeout=timeout + 10)
    text, _, code = r.stdout.rpartition("\n")
    got = hdr_file.read_text() if hdr_file.exists() else ""
    hdr_file.unlink(missing_ok=True)
    return Reply(int(code or 0) if code.strip().isdigit() else 0, text, got)


def api(topo: Topology, i: int, path: str = "/v1/models", **kw: Any) -> Reply:
    return call(topo, i, f"https://{API}{path}", resolve=f"{API}:443:{API_IP}", **kw)


def upstream_saw_secret(topo: Topology, since: int) -> bool:
    return any(SECRET in json.dumps(r) for r in topo.upstream_requests()[since:])


# ---------------------------------------------------------------------------------------------


def test_status_and_healthz_carry_the_ca_fingerprint(topo: Topology, mitm: Daemon) -> None:
    status = mitm.status()
    fp = status["mitmCaFingerprint"]
    assert isinstance(fp, str) and len(fp) == 64
    assert status["ready"] is True
    code, pem = mitm.get("/v1/mitm/ca")
    assert code == 200 and pem.startswith("-----BEGIN CERTIFICATE-----")
    assert pem.strip() == Path(ca_file(topo)).read_text().strip()
    r = topo.ns(topo.pod, "curl", "-s", "-D", "-", "-o", "/dev/null", f"http://127.0.0.1:{mitm.port}/healthz")
    assert f"x-egressd-mitm-ca-fingerprint: {fp}" in r.stdout.lower()
    # The CA key stays private.
    mode = os.stat(topo.workdir / "mitm-conf" / "mitmproxy-ca.pem").st_mode & 0o777
    assert mode == 0o600


def test_credential_only_for_the_matching_binding(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1", vault=VAULT_SNI_B)
    try:
        learn(topo, 1, API)
        r = api(topo, 1, headers=("Authorization: Bearer " + PLACEHOLDER,))
        assert r.code == 200, r.text
        assert r.upstream_header("Authorization") == f"Bearer {SECRET}", "same-name header replaced"
        assert r.echo["tls"] is True
        # The response echoes the credential in a header: redacted before it reaches the sandbox.
        assert "x-echo-authorization: [redacted]" in r.headers
        assert SECRET not in r.headers and SECRET.lower() not in r.headers
        # Wrong method, wrong path, wrong scheme: nothing injected.
        r = api(topo, 1, method="DELETE")
        assert r.code == 200 and r.upstream_header("Authorization") is None
        r = api(topo, 1, path="/v2/models")
        assert r.code == 200 and r.upstream_header("Authorization") is None
        r = call(topo, 1, f"http://{API}/v1/models", resolve=f"{API}:80:{API_IP}")
        assert r.code == 200 and r.upstream_header("Authorization") is None
        # Query strings do not change the path match.
        r = api(topo, 1, path="/v1/models?x=1")
        assert r.upstream_header("Authorization") == f"Bearer {SECRET}"
        # SNI other than the Host, which names the bound host: refused (one authority, 14.8).
        r = call(
            topo, 1, "https://b.test/v1/models", resolve=f"b.test:443:{API_IP}", headers=(f"Host: {API}",)
        )
        assert r.code == 400, r.text
        # Path tricks are refused before the upstream.
        r = api(topo, 1, path="/v1/%2e%2e/admin", extra=("--path-as-is",))
        assert r.code == 403, r.text
    finally:
        unbind(mitm, "m1")


def test_sibling_without_vault_gets_nothing(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    bind(mitm, 2, "m2", vault=None)
    try:
        learn(topo, 1, API)
        learn(topo, 2, API)
        mark = len(topo.upstream_requests())
        r = api(topo, 2)
        assert r.code == 200 and r.upstream_header("Authorization") is None
        assert not upstream_saw_secret(topo, mark)
        assert api(topo, 1).upstream_header("Authorization") == f"Bearer {SECRET}"
    finally:
        unbind(mitm, "m1")
        unbind(mitm, "m2")


def test_forged_host_towards_a_non_learned_address_gets_nothing(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, "b.test")  # allowed and learned, but for b.test
        mark = len(topo.upstream_requests())
        r = call(topo, 1, f"https://{API}/v1/models", resolve=f"{API}:443:{B_IP}")
        assert r.code == 200, r.text
        assert r.echo["local"] == B_IP
        assert r.upstream_header("Authorization") is None
        assert not upstream_saw_secret(topo, mark)
        # Not learned at all: the input chain drops it (policy on the original destination).
        r = call(topo, 1, f"https://{API}/v1/models", resolve=f"{API}:443:{UPSTREAM_IPS[6]}", timeout=1.5)
        assert r.code == 0
    finally:
        unbind(mitm, "m1")


def test_placeholder_substituted_and_never_sent_upstream(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        mark = len(topo.upstream_requests())
        r = api(
            topo,
            1,
            path="/sub/x",
            method="POST",
            headers=(f"X-Api-Key: {PLACEHOLDER}", "Content-Type: application/json"),
            data=json.dumps({"key": PLACEHOLDER}),
        )
        assert r.code == 200, r.text
        assert r.upstream_header("X-Api-Key") == SUB_SECRET
        assert json.loads(r.echo["body"]) == {"key": SUB_SECRET}
        assert all(PLACEHOLDER not in json.dumps(x) for x in topo.upstream_requests()[mark:])
    finally:
        unbind(mitm, "m1")


def test_vault_removal_applies_to_the_next_request(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        assert api(topo, 1).upstream_header("Authorization") == f"Bearer {SECRET}"
        assert vault_call(mitm, "m1", "DELETE")[0] == 204
        r = api(topo, 1)
        assert r.code == 200 and r.upstream_header("Authorization") is None
        changed = json.loads(json.dumps(VAULT))
        changed["credentials"][0]["source"]["value"] = SECRET + "-v2"
        assert vault_call(mitm, "m1", "PUT", changed)[0] == 201
        assert api(topo, 1).upstream_header("Authorization") == f"Bearer {SECRET}-v2"
    finally:
        unbind(mitm, "m1")


KEEPALIVE_CLIENT = r"""
import http.client, json, socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[1])
class Conn(http.client.HTTPSConnection):
    def connect(self):
        raw = socket.create_connection((sys.argv[2], 443), 5)
        self.sock = ctx.wrap_socket(raw, server_hostname=self.host)
conn = Conn(sys.argv[3], 443, context=ctx, timeout=5)
for line in sys.stdin:
    conn.request("GET", line.strip(), headers={"Connection": "keep-alive"})
    r = conn.getresponse()
    body = r.read().decode(errors="replace")
    print(json.dumps({"status": r.status, "body": body, "port": conn.sock.getsockname()[1]}), flush=True)
"""


def test_vault_changes_reach_the_next_request_on_a_kept_alive_connection(
    topo: Topology, mitm: Daemon
) -> None:
    """docs/reference/behaviour.md §10, "answered from memory": the worker answers from memory between changes, and a
    delete or a change is honoured by the very next request on the same connection."""
    bind(mitm, 1, "m1")
    proc = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            topo.sb(1),
            sys.executable,
            "-c",
            KEEPALIVE_CLIENT,
            client_trust(topo),
            API_IP,
            API,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def get() -> tuple[int, str | None, int]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("/v1/models\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        return (
            out["status"],
            Reply(out["status"], out["body"], "").upstream_header("Authorization"),
            out["port"],
        )

    try:
        learn(topo, 1, API)
        first = get()
        assert first[:2] == (200, f"Bearer {SECRET}")
        assert get() == first and get() == first, "from memory: still injected"
        assert vault_call(mitm, "m1", "DELETE")[0] == 204
        assert get() == (200, None, first[2]), "the very next request, same connection"
        changed = json.loads(json.dumps(VAULT))
        changed["credentials"][0]["source"]["value"] = SECRET + "-v3"
        assert vault_call(mitm, "m1", "PUT", changed)[0] == 201
        assert get() == (200, f"Bearer {SECRET}-v3", first[2])
        changed["credentials"][0]["source"]["value"] = SECRET + "-v4"
        assert vault_call(mitm, "m1", "PUT", changed)[0] == 200  # replaced
        assert get() == (200, f"Bearer {SECRET}-v4", first[2]), "a changed credential, not the remembered one"
    finally:
        proc.kill()
        proc.wait(5)
        unbind(mitm, "m1")


def test_lookup_failure_blocks_before_the_upstream(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        assert api(topo, 1).code == 200
        mark = len(topo.upstream_requests())
        assert mitm.proc is not None
        os.kill(mitm.proc.pid, signal.SIGSTOP)  # the vault lookup times out (0.25 s)
        # The worker's memory outlives a silent egressd by at most its heartbeat's bound
        # (docs/reference/behaviour.md §10, "answered from memory"); then it pulls, and the pull times out.
        time.sleep(2 * MAX_SILENCE_S)
        try:
            r = api(topo, 1)
            assert r.code == 503, r.text
            r = api(topo, 1, path="/other")  # every intercepted request of that client
            assert r.code == 503
            r = api(topo, 1, method="POST", path="/v1/x", data="y" * 100)
            assert r.code == 503
        finally:
            os.kill(mitm.proc.pid, signal.SIGCONT)
        assert len(topo.upstream_requests()) == mark, "nothing reached the upstream"
        assert api(topo, 1).upstream_header("Authorization") == f"Bearer {SECRET}"
    finally:
        unbind(mitm, "m1")


def test_direct_connection_to_the_mitm_port_is_dropped(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    try:
        # docs/concepts/ruleset.md names: the per-subject input chain and the input hook chain exist.
        assert {"subj_s_m1_in", "input", "subj_s_m1", "mark_s_m1"} <= mitm.object_names()
        assert topo.curl(1, f"http://{GATEWAY}:{MITM_PORT}/", timeout=1.0) == 0
        # Denying subjects reach nothing through the MITM either.
        code, body = mitm.post(envelope("SET_BINDING", "m3", ip=Topology.sb_ip(3), policy=POLICY))
        assert code == 200, body
        assert call(topo, 3, f"https://{API}/v1/models", resolve=f"{API}:443:{API_IP}", timeout=1.5).code == 0
    finally:
        unbind(mitm, "m1")
        unbind(mitm, "m3")
    # Removal leaves no per-subject MITM objects.
    names = mitm.object_names()
    assert not any("m1" in n or "m3" in n for n in names), names


def test_odd_traffic_neither_crashes_nor_leaks(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        mark = len(topo.upstream_requests())
        # TLS without SNI (IP literal URL) + a matching Host: passed through without credentials.
        r = call(topo, 1, f"https://{API_IP}/v1/models", headers=(f"Host: {API}",))
        assert r.code == 200 and r.upstream_header("Authorization") is None, r.text
        # HTTP/2 from the client: injected like HTTP/1.1.
        r = api(topo, 1, extra=("--http2",))
        assert r.code == 200 and r.upstream_header("Authorization") == f"Bearer {SECRET}"
        # A large streamed body (above stream_large_bodies): headers injected, body untouched.
        r = api(topo, 1, method="POST", path="/sub/big", data="z" * (3 << 20), timeout=20)
        assert r.code == 200 and r.echo["bodyBytes"] == 3 << 20
        # Websocket upgrade request: forwarded (the echo server answers plain HTTP).
        r = api(topo, 1, headers=("Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13"))
        assert r.code in (200, 400, 426, 502)
        # Malformed HTTP over the intercepted port 80: raw junk (not HTTP: relayed as TCP) and
        # an HTTP request with a broken header (refused by mitmproxy before any flow exists).
        for junk in (
            "b'\\x00\\x01GARBAGE\\r\\n\\r\\n'",
            "b'GET /v1/x HTTP/1.1\\r\\nHost: a\\r\\nContent-Length: zz-PH\\r\\n\\r\\n'",
        ):
            raw = topo.ns(
                topo.sb(1),
                "python3",
                "-c",
                "import socket,sys;s=socket.create_connection((sys.argv[1],80),2);"
                f"s.sendall({junk});s.settimeout(2);print(s.recv(100))",
                API_IP,
                check=False,
                timeout=10,
            )
            assert "400" in raw.stdout or raw.stdout.strip() in ("b''", ""), raw.stdout
        assert not upstream_saw_secret(topo, mark + 10**6)  # nothing odd carried the key
        # The proxy is still serving.
        assert api(topo, 1).upstream_header("Authorization") == f"Bearer {SECRET}"
        assert "zz-PH" not in mitm.log_text(), "the refused request's bytes are not logged"
        # A client that does not trust the CA: the handshake fails, logged as such.
        assert topo.curl(1, f"https://{API}/", extra=("--resolve", f"{API}:443:{API_IP}")) == 0
        deadline = time.monotonic() + 5
        while '"mitm.tls_failed"' not in mitm.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert '"mitm.tls_failed"' in mitm.log_text()
    finally:
        unbind(mitm, "m1")


def test_mitm_killed_blocks_then_recovers(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        assert api(topo, 1).code == 200
        pid = _mitm_pid(topo, mitm)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        assert api(topo, 1, timeout=1.5).code == 0, "nothing listens: the connection is refused"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and mitm.get("/healthz")[0] != 200:
            time.sleep(0.1)
        assert mitm.get("/healthz")[0] == 200
        assert _mitm_pid(topo, mitm) != pid
        r = api(topo, 1)
        assert r.code == 200 and r.upstream_header("Authorization") == f"Bearer {SECRET}"
    finally:
        unbind(mitm, "m1")


def test_the_mitm_child_has_no_capabilities(topo: Topology, mitm: Daemon) -> None:
    """It parses untrusted TLS and HTTP: a compromise must not reach the nft table."""
    status = Path(f"/proc/{_mitm_pid(topo, mitm)}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert int(fields["CapEff"].strip(), 16) == 0 and int(fields["CapPrm"].strip(), 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"


def _mitm_pid(topo: Topology, d: Daemon) -> int:
    assert d.proc is not None
    out = topo.ns(topo.pod, "ps", "-o", "pid=,args=", "--ppid", str(d.proc.pid), check=False).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if "egressd.mitmchild.runner" in line]
    assert len(pids) == 1, out
    return pids[0]


def test_ipv6_subject_is_intercepted_and_injected(topo: Topology, mitm: Daemon) -> None:
    vault = {
        "credentials": [{"name": "key", "source": {"type": "inline", "value": SECRET}}],
        "bindings": [
            {"name": "v6", "match": {"hosts": ["v6.test"]}, "auth": {"type": "bearer", "credential": "key"}}
        ],
    }
    policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "v6.test"}]}
    code, body = mitm.post(
        envelope("SET_BINDING", "m6", ip=Topology.sb_ip6(4), gateway=GATEWAY6, policy=policy)
    )
    assert code == 200, body
    assert mitm.post(envelope("LIFECYCLE_HOOK", "m6", hook=DPR))[0] == 200
    assert vault_call(mitm, "m6", "PUT", vault)[0] == 201
    try:
        assert topo.dig(4, "v6.test", "AAAA", server=GATEWAY6) == ("NOERROR", ["fd00:204::2"])
        r = call(topo, 4, "https://v6.test/v1/x", resolve="v6.test:443:[fd00:204::2]")
        assert r.code == 200, r.text
        assert r.upstream_header("Authorization") == f"Bearer {SECRET}"
        assert r.echo["local"] == "fd00:204::2"
    finally:
        unbind(mitm, "m6")


AUTHORITY_CLIENT = Path(__file__).with_name("authority_client.py")


def authority_call(
    topo: Topology,
    i: int,
    *,
    ip: str,
    port: int,
    tls: bool,
    sni: str = "",
    raw: bytes | None = None,
    h2: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """One crafted request from sandbox ``i`` (tests/kernel/authority_client.py)."""
    args = [sys.executable, str(AUTHORITY_CLIENT), "--ip", ip, "--port", str(port), "--timeout", "3"]
    if tls:
        args += ["--tls", "--ca", client_trust(topo)] + (["--sni", sni] if sni else [])
    if raw is not None:
        path = topo.workdir / f"raw-{i}.bin"
        path.write_bytes(raw)
        args += ["--raw", str(path)]
    if h2 is not None:
        args += ["--h2", json.dumps(h2)]
    r = topo.ns(topo.sb(i), *args, check=False, timeout=20)
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
    assert out, r.stderr
    return out


def _h1(target: str, *hosts: str, extra: str = "") -> bytes:
    lines = [f"GET {target} HTTP/1.1", *(f"Host: {h}" for h in hosts), "Connection: close"]
    if extra:
        lines.append(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _assert_refused_as_ambiguous(d: Daemon, log_mark: int) -> None:
    """The MITM itself refused it (an upstream that rejects duplicate Host would answer 400
    too, after the credential reached it): a 400 refusal event, no injection."""
    deadline = time.monotonic() + 3
    while "request authority is ambiguous" not in d.log_text()[log_mark:] and time.monotonic() < deadline:
        time.sleep(0.05)
    text = d.log_text()[log_mark:]
    assert '"mitm.refused"' in text and "request authority is ambiguous" in text, text[-2000:]
    assert '"mitm.injected"' not in text


def _assert_nothing_upstream(topo: Topology, mark: int) -> None:
    seen = topo.upstream_requests()[mark:]
    assert [r for r in seen if "dns" not in r] == [], "nothing reached the upstream"


H1_DISAGREE = {
    # id: (tls, raw request); SNI is the bound host for TLS.
    "http-absolute-attacker-host-bound": (False, _h1("http://b.test/plain/x", API)),
    "http-absolute-bound-host-attacker": (False, _h1(f"http://{API}/plain/x", "b.test")),
    "https-absolute-attacker-host-bound": (True, _h1("https://b.test/v1/models", API)),
    "https-absolute-bound-host-attacker": (True, _h1(f"https://{API}/v1/models", "b.test")),
    "https-absolute-foreign-port": (True, _h1(f"https://{API}:8443/v1/models", API)),
    "https-duplicate-host": (True, _h1("/v1/models", API, "b.test")),
    "https-duplicate-host-equal": (True, _h1("/v1/models", API, API)),
    "http-duplicate-host": (False, _h1("/plain/x", API, "b.test")),
    "https-host-foreign-port": (True, _h1("/v1/models", f"{API}:8443")),
    "http-host-port-443": (False, _h1("/plain/x", f"{API}:443")),
}


@pytest.mark.parametrize("case", sorted(H1_DISAGREE))
def test_one_authority_http1_names_disagree(topo: Topology, mitm: Daemon, case: str) -> None:
    """14.8: ``GET https://attacker/... HTTP/1.1`` with ``Host: <bound host>`` used to get the
    bound credential and be forwarded with the attacker's authority. Refused with 400 before
    the upstream, over HTTP and HTTPS, either way round; also duplicate Host headers and a
    Host (or absolute-form) port other than the connection's."""
    tls, raw = H1_DISAGREE[case]
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        learn(topo, 1, "b.test")
        mark, log_mark = len(topo.upstream_requests()), len(mitm.log_text())
        got = authority_call(topo, 1, ip=API_IP, port=443 if tls else 80, tls=tls, sni=API, raw=raw)
        assert got["status"] == 400, got
        assert SECRET not in json.dumps(got)
        _assert_nothing_upstream(topo, mark)
        _assert_refused_as_ambiguous(mitm, log_mark)
    finally:
        unbind(mitm, "m1")


def test_one_authority_http1_spelled_differently_is_injected_once(topo: Topology, mitm: Daemon) -> None:
    """One authority spelled differently (case, trailing dot, explicit default port) is
    decided on, injected, and forwarded in origin-form with the one Host; absolute-form
    without Host gets its Host from the target."""
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        mark = len(topo.upstream_requests())
        got = authority_call(
            topo,
            1,
            ip=API_IP,
            port=443,
            tls=True,
            sni=API,
            raw=_h1(f"https://{API.upper()}.:443/v1/models", API),
        )
        assert got["status"] == 200, got
        seen = [r for r in topo.upstream_requests()[mark:] if "dns" not in r]
        assert len(seen) == 1 and seen[0]["path"] == "/v1/models"
        headers = {str(k).lower(): v for k, v in dict(seen[0]["headers"]).items()}
        assert headers["host"] == API and headers["authorization"] == f"Bearer {SECRET}"
        got = authority_call(topo, 1, ip=API_IP, port=80, tls=False, raw=_h1(f"http://{API}/plain/x"))
        assert got["status"] == 200, got
        assert topo.upstream_requests()[-1]["host"] == API
    finally:
        unbind(mitm, "m1")


def test_one_authority_sni_and_host_disagree(topo: Topology, mitm: Daemon) -> None:
    """14.8: an SNI other than the request's authority is refused (400), either way round,
    with curl's own TLS (``--connect-to`` keeps the URL's SNI, ``-H Host`` names another)."""
    bind(mitm, 1, "m1", vault=VAULT_SNI_B)
    try:
        learn(topo, 1, API)
        learn(topo, 1, "b.test")
        mark = len(topo.upstream_requests())
        for url, host in ((f"https://{API}/v1/models", "b.test"), ("https://b.test/v1/models", API)):
            r = call(topo, 1, url, headers=(f"Host: {host}",), extra=("--connect-to", f"::{API_IP}:443"))
            assert r.code == 400, r.text
            r = call(
                topo, 1, url, headers=(f"Host: {host}",), extra=("--connect-to", f"::{API_IP}:443", "--http2")
            )
            assert r.code == 400, r.text
        got = authority_call(topo, 1, ip=API_IP, port=443, tls=True, sni="b.test", raw=_h1("/v1/models", API))
        assert got["status"] == 400, got
        _assert_nothing_upstream(topo, mark)
        assert not upstream_saw_secret(topo, mark)
    finally:
        unbind(mitm, "m1")


def _h2(authority: str, *hosts: str) -> list[tuple[str, str]]:
    pseudo = [(":method", "GET"), (":scheme", "https"), (":path", "/v1/models")]
    return [*pseudo, (":authority", authority)] + [("host", h) for h in hosts]


H2_DISAGREE = {
    "authority-bound-host-attacker": _h2(API, "b.test"),
    "authority-attacker-host-bound": _h2("b.test", API),
    "duplicate-host": _h2(API, API, "b.test"),
    "host-foreign-port": _h2(API, f"{API}:8443"),
    "authority-foreign-port": _h2(f"{API}:8443", API),
    "authority-only-foreign-port": _h2(f"{API}:8443"),  # no Host: h2 has nothing to compare
    # An absolute :path reaches the HTTP/1 upstream as "GET https://b.test/... HTTP/1.1".
    "path-absolute-form": [
        (":method", "GET"),
        (":scheme", "https"),
        (":path", "https://b.test/v1/models"),
        (":authority", API),
    ],
}


@pytest.mark.parametrize("case", sorted(H2_DISAGREE))
def test_one_authority_http2_authority_and_host_disagree(topo: Topology, mitm: Daemon, case: str) -> None:
    """14.8: HTTP/2 with ``:authority`` and a different ``Host`` (crafted with h2: curl never
    sends both). Refused before the upstream: h2's own inbound validation already resets a
    stream whose names differ byte for byte (so these pass on main too); the addon's 400
    stands behind it (``validate_inbound_headers`` off, a port h2 does not compare)."""
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        learn(topo, 1, "b.test")
        mark = len(topo.upstream_requests())
        got = authority_call(topo, 1, ip=API_IP, port=443, tls=True, sni=API, h2=H2_DISAGREE[case])
        assert got["status"] in (0, 400), got
        assert SECRET not in json.dumps(got)
        _assert_nothing_upstream(topo, mark)
    finally:
        unbind(mitm, "m1")


def test_one_authority_http2_agreeing_names_injected_with_one_host(topo: Topology, mitm: Daemon) -> None:
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        mark = len(topo.upstream_requests())
        for h2 in (_h2(API, API), _h2(API)):
            got = authority_call(topo, 1, ip=API_IP, port=443, tls=True, sni=API, h2=h2)
            assert got["status"] == 200, got
        seen = [r for r in topo.upstream_requests()[mark:] if "dns" not in r]
        assert len(seen) == 2
        for record in seen:
            headers = {str(k).lower(): v for k, v in dict(record["headers"]).items()}
            assert headers["host"] == API and headers["authorization"] == f"Bearer {SECRET}"
    finally:
        unbind(mitm, "m1")


def test_attacker_headers_refused_before_the_upstream(topo: Topology, mitm: Daemon) -> None:
    """Issue 12 item 5: ``Connection`` naming a header the next hop must see (smuggling via
    ``Connection: content-length``, dropping Host or the injected header) -> 400; a header
    that overrides the method/path/host the binding names -> 403; nothing upstream."""
    bind(mitm, 1, "m1")
    try:
        learn(topo, 1, API)
        mark = len(topo.upstream_requests())
        for header, code in (
            ("Connection: keep-alive, Content-Length", 400),
            ("Connection: Authorization", 400),
            ("X-HTTP-Method-Override: DELETE", 403),
            ("X-Original-URL: /admin", 403),
            ("X-Forwarded-Host: b.test", 403),
        ):
            # HTTP/1.1: curl drops connection-specific headers itself over HTTP/2.
            r = api(topo, 1, headers=(header,), extra=("--http1.1",))
            assert r.code == code, (header, r.text)
        _assert_nothing_upstream(topo, mark)
        assert api(topo, 1, headers=("Connection: keep-alive",)).upstream_header("Authorization") == (
            f"Bearer {SECRET}"
        )
    finally:
        unbind(mitm, "m1")


def test_zz_no_credential_value_ever_reached_the_daemon_log(topo: Topology, mitm: Daemon) -> None:
    """Runs last in this module: every injection above is in the log, no value is."""
    text = mitm.log_text()
    assert '"mitm.injected"' in text and '"mitm.refused"' in text
    for value in (SECRET, SUB_SECRET, PLACEHOLDER, f"{SECRET}-v2"):
        assert value not in text


def test_zz_mitm_metrics(mitm: Daemon) -> None:
    code, text = mitm.get("/metrics")
    assert code == 200
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("egressd_mitm_")
    }
    assert samples['egressd_mitm_ready{worker="0"}'] == 1
    assert samples['egressd_mitm_starts_total{worker="0"}'] >= 2, "the kill test restarted it"
    assert samples['egressd_mitm_requests_total{worker="0",outcome="injected"}'] > 0
    assert samples['egressd_mitm_requests_total{worker="0",outcome="refused"}'] > 0
    assert SECRET not in text
