"""Selective interception (docs/reference/behaviour.md §16) and the CA export (``EGRESSD_MITM_CA_EXPORT_DIR``)
end to end: real kernel redirect, real MITM child, real HTTPS upstream with its own test CA.

The point of §16 is what a client that does *not* trust the MITM CA sees: for every host
that needs no credential, the upstream's own certificate (issuer "egressd test upstream CA")
and a working request; only an SNI naming an https binding host of that subject's vault is
decrypted (issuer "egressd MITM CA") and gets its credential.
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

from tests.kernel.topology import REPO, UPSTREAM_IPS, Daemon, Topology, decode_echo, envelope

SECRET = "sk-live-SELECTIVE-51c0"
API, API_IP = "api.example.test", UPSTREAM_IPS[4]  # 10.204.0.6
B, B_IP = "b.test", UPSTREAM_IPS[1]  # 10.204.0.3
SKIP, SKIP_IP = "x.y.example.test", UPSTREAM_IPS[5]  # 10.204.0.7: in the ignore list below
MITM_PORT, HTTP_PORT, TABLE = 18381, 18390, "egt-sel"
DPR = "sandbox.data-plane-ready"
UPSTREAM_ISSUER, MITM_ISSUER = "egressd test upstream CA", "egressd MITM CA"
IGNORE = r"^x\.y\.example\.test$"

POLICY = {
    "defaultAction": "deny",
    "egress": [{"action": "allow", "target": "*.example.test"}, {"action": "allow", "target": B}],
}
VAULT: dict[str, Any] = {
    "credentials": [{"name": "key", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {"name": "api", "match": {"hosts": [API]}, "auth": {"type": "bearer", "credential": "key"}},
    ],
}
# A wildcard binding whose hosts include the ignored one (the vault check probes
# probe.example.test, which the pattern does not match, so the vault is accepted).
WILDCARD_VAULT: dict[str, Any] = {
    "credentials": VAULT["credentials"],
    "bindings": [
        {
            "name": "all",
            "match": {"hosts": ["*.example.test"]},
            "auth": {"type": "bearer", "credential": "key"},
        },
    ],
}


@pytest.fixture(scope="module")
def sel(topo: Topology) -> Iterator[Daemon]:
    env = {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        # §16's selection as such: with the name check (§18) every port-80 connection is
        # parsed and no-SNI TLS needs an address rule (tests/kernel/test_names_on_wire.py).
        "EGRESSD_NAME_CHECK": "off",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS": IGNORE,
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "sel-mitm-conf"),
        "EGRESSD_MITM_CA_EXPORT_DIR": str(topo.workdir / "sel-ca-export"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "sel-mitm-run" / "active.sock"),
    }
    d = Daemon(topo, table=TABLE, port=HTTP_PORT, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            topo.stop(d.proc)
        d.nft("delete", "table", "inet", TABLE, check=False)
        print(d.log_text()[-6000:])


def mitm_ca(topo: Topology) -> Path:
    return topo.workdir / "sel-mitm-conf" / "mitmproxy-ca-cert.pem"


def upstream_ca(topo: Topology) -> Path:
    return topo.tls_dir / "ca.pem"


def export_dir(topo: Topology) -> Path:
    return topo.workdir / "sel-ca-export"


def bind(d: Daemon, i: int, uid: str, vault: dict[str, Any] | None = VAULT) -> None:
    assert d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(i), policy=POLICY)) == (200, "{}")
    assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")
    if vault is not None:
        assert vault_call(d, uid, "PUT", vault)[0] == 201


def unbind(d: Daemon, uid: str) -> None:
    d.post(envelope("REMOVE_BINDING", uid))


def vault_call(d: Daemon, uid: str, method: str, doc: object | None = None) -> tuple[int, str]:
    args = ["-X", method]
    if doc is not None:
        path = d.topo.workdir / "sel-vault.json"
        path.write_text(json.dumps(doc))
        args += ["-H", "Content-Type: application/json", "--data-binary", f"@{path}"]
    return d._curl(*args, f"http://127.0.0.1:{d.port}/v1/sandboxfleets/{uid}/egress/credential-vault")


def learn(topo: Topology, i: int, name: str) -> None:
    status, answers = topo.dig(i, name)
    assert status == "NOERROR" and answers, (name, status)


# One TLS handshake from a sandbox that trusts exactly one CA: the issuer of what it saw.
_PEER = r"""
import json, socket, ssl, sys
ip, sni, ca = sys.argv[1], sys.argv[2], sys.argv[3]
ctx = ssl.create_default_context(cafile=ca)
try:
    with socket.create_connection((ip, 443), timeout=3) as raw:
        with ctx.wrap_socket(raw, server_hostname=sni) as tls:
            issuer = dict(x[0] for x in tls.getpeercert()["issuer"])
            print(json.dumps({"ok": True, "issuer": issuer.get("commonName")}))
except (ssl.SSLError, OSError) as exc:
    print(json.dumps({"ok": False, "error": type(exc).__name__}))
"""


def peer(topo: Topology, i: int, ip: str, sni: str, ca: Path) -> dict[str, Any]:
    r = topo.ns(topo.sb(i), sys.executable, "-c", _PEER, ip, sni, str(ca), check=False, timeout=20)
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
    assert out, r.stderr
    return out


def get(
    topo: Topology, i: int, host: str, ip: str, ca: Path, path: str = "/v1/x"
) -> tuple[int, dict[str, Any]]:
    """One HTTPS GET from sandbox ``i`` trusting only ``ca``: (status, the upstream's echo)."""
    r = topo.ns(
        topo.sb(i),
        "curl",
        "-s",
        "-m",
        "3",
        "--cacert",
        str(ca),
        "--resolve",
        f"{host}:443:{ip}",
        "-w",
        "\n%{http_code}",
        f"https://{host}{path}",
        check=False,
        timeout=15,
    )
    body, _, code = r.stdout.rpartition("\n")
    echo = decode_echo(body)  # what the upstream received (the MITM redacts the plain fields)
    return (int(code) if code.strip().isdigit() else 0), echo


def authorization(echo: dict[str, Any]) -> str | None:
    for k, v in echo.get("headers", {}).items():
        if k.lower() == "authorization":
            return str(v)
    return None


def connection_events(d: Daemon, since: int) -> list[dict[str, Any]]:
    out = []
    for line in d.log_text()[since:].splitlines():
        if '"mitm.connection"' in line:
            out.append(json.loads(line))
    return out


def wait_for_events(d: Daemon, since: int, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 3
    while len(got := connection_events(d, since)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


# ---------------------------------------------------------------------------------------------


def test_a_host_without_binding_is_passed_through_with_the_upstreams_certificate(
    topo: Topology, sel: Daemon
) -> None:
    bind(sel, 1, "s1")
    try:
        learn(topo, 1, B)
        mark = len(sel.log_text())
        assert peer(topo, 1, B_IP, B, upstream_ca(topo)) == {"ok": True, "issuer": UPSTREAM_ISSUER}
        # The MITM CA alone is not enough any more: nothing minted a leaf for b.test.
        assert peer(topo, 1, B_IP, B, mitm_ca(topo))["ok"] is False
        code, echo = get(topo, 1, B, B_IP, upstream_ca(topo))
        assert code == 200 and echo["tls"] is True and echo["local"] == B_IP
        assert authorization(echo) is None
        events = wait_for_events(sel, mark, 3)
        assert {(e["protocol"], e["decision"], e["reason"]) for e in events} == {
            ("tls", "passthrough", "no https binding names the SNI")
        }, events
    finally:
        unbind(sel, "s1")


def test_the_bound_host_is_decrypted_and_gets_its_credential(topo: Topology, sel: Daemon) -> None:
    bind(sel, 1, "s1")
    try:
        learn(topo, 1, API)
        assert peer(topo, 1, API_IP, API, mitm_ca(topo)) == {"ok": True, "issuer": MITM_ISSUER}
        assert peer(topo, 1, API_IP, API, upstream_ca(topo))["ok"] is False
        code, echo = get(topo, 1, API, API_IP, mitm_ca(topo))
        assert code == 200 and authorization(echo) == f"Bearer {SECRET}"
        # Same subject, same upstream address, another allowed name with no binding: relayed.
        learn(topo, 1, B)
        code, echo = get(topo, 1, B, B_IP, upstream_ca(topo))
        assert code == 200 and authorization(echo) is None
    finally:
        unbind(sel, "s1")


def test_a_subject_without_vault_is_never_decrypted(topo: Topology, sel: Daemon) -> None:
    bind(sel, 1, "s1")  # a sibling that binds API: its vault is not s2's
    bind(sel, 2, "s2", vault=None)
    try:
        learn(topo, 2, API)
        mark = len(sel.log_text())
        assert peer(topo, 2, API_IP, API, upstream_ca(topo)) == {"ok": True, "issuer": UPSTREAM_ISSUER}
        code, echo = get(topo, 2, API, API_IP, upstream_ca(topo))
        assert code == 200 and authorization(echo) is None
        # Plain HTTP without an http binding: relayed as TCP, not parsed.
        r = topo.ns(
            topo.sb(2), "curl", "-s", "-m", "3", "-w", "\n%{http_code}", f"http://{API_IP}/v1/x", check=False
        )
        assert r.stdout.rpartition("\n")[2] == "200"
        events = wait_for_events(sel, mark, 3)
        seen = {(e["protocol"], e["decision"], e["reason"]) for e in events}
        assert seen == {
            ("tls", "passthrough", "no credential vault"),
            ("http", "passthrough", "no credential vault"),
        }
        assert all(e["client"] == Topology.sb_ip(2) for e in events)
    finally:
        unbind(sel, "s1")
        unbind(sel, "s2")


def test_plain_http_is_parsed_only_with_an_http_binding(topo: Topology, sel: Daemon) -> None:
    http_vault = {
        "credentials": VAULT["credentials"],
        "bindings": [
            {
                "name": "plain",
                "match": {"hosts": [API], "schemes": ["http"]},
                "auth": {"type": "bearer", "credential": "key"},
            }
        ],
    }
    bind(sel, 1, "s1")  # https binding only
    bind(sel, 3, "s3", vault=http_vault)
    try:
        learn(topo, 1, API)
        learn(topo, 3, API)
        mark = len(sel.log_text())
        url = f"http://{API}/v1/x"
        for i in (1, 3):
            r = topo.ns(
                topo.sb(i), "curl", "-s", "-m", "3", "--resolve", f"{API}:80:{API_IP}", url, check=False
            )
            echo = decode_echo(r.stdout)
            assert echo.get("port") == 80, r.stdout
            assert authorization(echo) == (f"Bearer {SECRET}" if i == 3 else None)
        events = {
            (e["client"], e["decision"]) for e in wait_for_events(sel, mark, 2) if e["protocol"] == "http"
        }
        assert events == {(Topology.sb_ip(1), "passthrough"), (Topology.sb_ip(3), "parse")}
    finally:
        unbind(sel, "s1")
        unbind(sel, "s3")


def test_a_vault_added_or_deleted_changes_interception_on_the_next_connection(
    topo: Topology, sel: Daemon
) -> None:
    bind(sel, 3, "s3", vault=None)
    try:
        learn(topo, 3, API)
        assert peer(topo, 3, API_IP, API, upstream_ca(topo))["issuer"] == UPSTREAM_ISSUER
        assert vault_call(sel, "s3", "PUT", VAULT)[0] == 201
        assert peer(topo, 3, API_IP, API, mitm_ca(topo)) == {"ok": True, "issuer": MITM_ISSUER}
        code, echo = get(topo, 3, API, API_IP, mitm_ca(topo))
        assert code == 200 and authorization(echo) == f"Bearer {SECRET}"
        assert vault_call(sel, "s3", "DELETE")[0] == 204
        assert peer(topo, 3, API_IP, API, upstream_ca(topo)) == {"ok": True, "issuer": UPSTREAM_ISSUER}
        code, echo = get(topo, 3, API, API_IP, upstream_ca(topo))
        assert code == 200 and authorization(echo) is None
        # A binding that drops the host (PUT with another host) stops decrypting it too.
        other = {
            **VAULT,
            "bindings": [{**VAULT["bindings"][0], "match": {"hosts": [SKIP.replace("x.y", "z")]}}],
        }
        assert vault_call(sel, "s3", "PUT", VAULT)[0] == 201
        assert peer(topo, 3, API_IP, API, mitm_ca(topo))["issuer"] == MITM_ISSUER
        assert vault_call(sel, "s3", "PUT", other)[0] == 200
        assert peer(topo, 3, API_IP, API, upstream_ca(topo))["issuer"] == UPSTREAM_ISSUER
    finally:
        unbind(sel, "s3")


def test_an_ignored_host_is_passed_through_even_with_a_binding(topo: Topology, sel: Daemon) -> None:
    # A binding naming the ignored host itself is refused at the write (§6: never injectable).
    exact = {**VAULT, "bindings": [{**VAULT["bindings"][0], "match": {"hosts": [SKIP]}}]}
    bind(sel, 4, "s4", vault=None)
    try:
        code, body = vault_call(sel, "s4", "PUT", exact)
        assert code == 400 and "ignore_hosts" in body, body
        assert vault_call(sel, "s4", "PUT", WILDCARD_VAULT)[0] == 201
        learn(topo, 4, SKIP)
        learn(topo, 4, API)
        mark = len(sel.log_text())
        assert peer(topo, 4, SKIP_IP, SKIP, upstream_ca(topo)) == {"ok": True, "issuer": UPSTREAM_ISSUER}
        code, echo = get(topo, 4, SKIP, SKIP_IP, upstream_ca(topo))
        assert code == 200 and authorization(echo) is None
        # The same wildcard binding still decrypts and injects the hosts that are not ignored.
        code, echo = get(topo, 4, API, API_IP, mitm_ca(topo))
        assert code == 200 and authorization(echo) == f"Bearer {SECRET}"
        reasons = {e["sni"]: e["reason"] for e in wait_for_events(sel, mark, 3)}
        assert reasons[SKIP] == "host matches OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS"
        assert reasons[API] == "SNI is a host of an https binding"
    finally:
        unbind(sel, "s4")


def test_the_exported_ca_is_the_public_certificate_and_sandboxes_can_use_it(
    topo: Topology, sel: Daemon
) -> None:
    code, pem = sel.get("/v1/mitm/ca")
    assert code == 200
    names = sorted(p.name for p in export_dir(topo).iterdir())
    assert names == ["egressd-ca.crt", "egressd-ca.pem"]
    for name in names:
        path = export_dir(topo) / name
        assert path.read_text() == pem
        assert os.stat(path).st_mode & 0o777 == 0o644
        assert "PRIVATE KEY" not in path.read_text()
    bind(sel, 1, "s1")
    try:
        learn(topo, 1, API)
        code, echo = get(topo, 1, API, API_IP, export_dir(topo) / "egressd-ca.pem")
        assert code == 200 and authorization(echo) == f"Bearer {SECRET}"
    finally:
        unbind(sel, "s1")


def test_a_bad_export_dir_refuses_start_up_in_one_line(topo: Topology) -> None:
    not_a_dir = topo.workdir / "sel-export-is-a-file"
    not_a_dir.write_text("x")
    rules = topo.workdir / "rules"
    rules.mkdir(exist_ok=True)
    env = {
        "OPENSANDBOX_EGRESS_PROFILE": "fleet",
        "EGRESSD_ALWAYS_RULES_DIR": str(rules),
        "OPENSANDBOX_EGRESS_HTTP_ADDR": "127.0.0.1:18391",
        "EGRESSD_NFT_TABLE": "egt-sel-refuse",
        "EGRESSD_DNS_ADDR": "0.0.0.0:15391",  # the module's daemon holds 15353
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": "18392",
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "sel-refuse-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "sel-refuse-run" / "active.sock"),
        "EGRESSD_MITM_CA_EXPORT_DIR": str(not_a_dir),
    }
    cmd = ["ip", "netns", "exec", topo.pod, str(REPO / ".venv" / "bin" / "egressd")]
    try:
        r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1, r.stderr
        # The reason is one line, the last (structured start-up logs go to stderr before it).
        last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
        assert last.startswith("egressd: EGRESSD_MITM_CA_EXPORT_DIR:") and "not a directory" in last, r.stderr
        assert "Traceback" not in r.stderr
        assert not_a_dir.read_text() == "x"
    finally:
        topo.ns(topo.pod, "nft", "delete", "table", "inet", "egt-sel-refuse", check=False)


def test_zz_metrics_count_decrypted_and_relayed_connections(sel: Daemon) -> None:
    code, text = sel.get("/metrics")
    assert code == 200
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("egressd_mitm_connections_total{")
    }
    for labels in ('protocol="tls",decision="decrypt"', 'protocol="tls",decision="passthrough"',
                   'protocol="http",decision="parse"', 'protocol="http",decision="passthrough"'):  # fmt: skip
        assert samples[f'egressd_mitm_connections_total{{worker="0",{labels}}}'] > 0, samples


def test_zzz_a_replaced_ca_is_exported_when_the_child_restarts(topo: Topology, sel: Daemon) -> None:
    """The child reads the CA at every start: a pinned CA replaced in the confdir is checked,
    served and exported before the next child runs (runs last: it changes the module's CA)."""
    before = sel.status()["mitmCaFingerprint"]
    conf = topo.workdir / "sel-mitm-conf"
    fresh = topo.workdir / "sel-fresh-ca"
    # A second CA, generated the way egressd generates one, pinned in place of the first.
    script = (
        "import sys, pathlib; from egressd.mitm.ca import ensure_ca; ensure_ca(pathlib.Path(sys.argv[1]))"
    )
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", script, str(fresh)], check=True, timeout=30)
    (conf / "mitmproxy-ca.pem").write_bytes((fresh / "mitmproxy-ca.pem").read_bytes())
    child = _mitm_pid(topo, sel)
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        sel.status().get("mitmCaFingerprint") == before or sel.get("/healthz")[0] != 200
    ):
        time.sleep(0.1)
    after = sel.status()["mitmCaFingerprint"]
    assert after != before
    new_pem = (fresh / "mitmproxy-ca-cert.pem").read_text()
    assert sel.get("/v1/mitm/ca") == (200, new_pem)
    assert (export_dir(topo) / "egressd-ca.pem").read_text() == new_pem
    assert (export_dir(topo) / "egressd-ca.crt").read_text() == new_pem
    assert '"mitm.ca_changed"' in sel.log_text()


def _mitm_pid(topo: Topology, d: Daemon) -> int:
    assert d.proc is not None
    out = topo.ns(topo.pod, "ps", "-o", "pid=,args=", "--ppid", str(d.proc.pid), check=False).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if "egressd.mitmchild.runner" in line]
    assert len(pids) == 1, out
    return pids[0]
