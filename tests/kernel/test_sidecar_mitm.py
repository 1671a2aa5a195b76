"""Sidecar profile with the transparent MITM: the app's own HTTPS is intercepted in its
namespace (nat output redirect), the vault's credential is injected for the bound host only,
the MITM's upstream leg is still policed by the output filter, and nothing reaches the MITM
port without the redirect."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.sidecar import Sidecar
from tests.kernel.test_mitm_stream import assert_as_produced, sent_times, timed_lines
from tests.kernel.topology import UP_NET, Topology, cleanup_stale, decode_echo

SECRET = "sk-sidecar-MITM-5e1d"
API, API_IP = "api.example.test", f"{UP_NET}.6"
B_IP = f"{UP_NET}.3"  # b.test
X_IP = f"{UP_NET}.9"  # never allowed
VAULT = {
    "credentials": [{"name": "key", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [{"name": "api", "match": {"hosts": [API]}, "auth": {"type": "bearer", "credential": "key"}}],
}
POLICY = {
    "defaultAction": "deny",
    "egress": [{"action": "allow", "target": API}, {"action": "allow", "target": "b.test"}],
}
# docs/reference/behaviour.md §16: an SNI of b.test is decrypted only with a binding naming b.test (unused here).
VAULT_SNI_B = {
    "credentials": VAULT["credentials"],
    "bindings": [
        *VAULT["bindings"],
        {
            "name": "b",
            "match": {"hosts": ["b.test"], "paths": ["/b-only/*"]},
            "auth": {"type": "bearer", "credential": "key"},
        },
    ],
}


def client_trust(sc: Sidecar) -> Path:
    """The MITM CA (decrypted connections) and the upstream's (connections passed through)."""
    bundle = sc.topo.workdir / "sidecar-client-trust.pem"
    bundle.write_text(
        (sc.mitm_confdir / "mitmproxy-ca-cert.pem").read_text() + (sc.topo.tls_dir / "ca.pem").read_text()
    )
    return bundle


@pytest.fixture(scope="module")
def mtopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egm{os.getpid()}", sandboxes=1).up_()
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(mtopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(mtopo, sb=1).with_mitm()
    # The injection layer's defences beneath the name check (forged Host, one authority),
    # which would refuse those connections first (tests/kernel/test_names_on_wire_more.py).
    sc.env["EGRESSD_NAME_CHECK"] = "off"
    sc.start()
    try:
        yield sc
    finally:
        print(sc.log_text()[-4000:])
        sc.cleanup()


def https(
    sc: Sidecar, host: str, ip: str, path: str = "/v1/x", timeout: float = 3.0
) -> tuple[int, dict[str, Any]]:
    ca = client_trust(sc)
    r = sc.topo.ns(
        sc.ns,
        "curl",
        "-s",
        "-m",
        str(timeout),
        "--cacert",
        str(ca),
        "--resolve",
        f"{host}:443:{ip}",
        "-w",
        "\n%{http_code}",
        f"https://{host}{path}",
        check=False,
        timeout=timeout + 10,
    )
    body, _, code = r.stdout.rpartition("\n")
    echo = decode_echo(body)  # what the upstream received (the MITM redacts the plain fields)
    return (int(code) if code.strip().isdigit() else 0), echo


def test_app_https_gets_the_credential_for_the_bound_host_only(sidecar: Sidecar) -> None:
    sidecar.set_policy(POLICY)
    code, text = sidecar.api("PUT", "/credential-vault", VAULT)
    assert code == 201, text
    assert sidecar.dig(API)[0] == "NOERROR"
    assert sidecar.dig("b.test")[0] == "NOERROR"
    code, echo = https(sidecar, API, API_IP)
    assert code == 200, echo
    assert echo["headers"].get("Authorization") == f"Bearer {SECRET}"
    # Another allowed host: through the MITM, but no credential.
    code, echo = https(sidecar, "b.test", B_IP)
    assert code == 200 and "Authorization" not in echo["headers"]
    # A forged Host towards an address learned for another name: no credential.
    code, echo = https(sidecar, API, B_IP)
    assert code == 200 and "Authorization" not in echo["headers"]
    # The MITM's upstream leg is still policed: a never-allowed address is not reached.
    before = len(sidecar.topo.upstream_requests())
    code, _ = https(sidecar, API, X_IP, timeout=2.0)
    assert code != 200
    assert len(sidecar.topo.upstream_requests()) == before
    assert SECRET not in sidecar.log_text()


def _crafted(sc: Sidecar, raw: bytes, sni: str = API) -> dict[str, Any]:
    """One raw HTTPS/1.1 request from the app's namespace (tests/kernel/authority_client.py)."""
    path = sc.topo.workdir / "sidecar-raw.bin"
    path.write_bytes(raw)
    client = Path(__file__).with_name("authority_client.py")
    ca = client_trust(sc)
    args = [sys.executable, str(client), "--ip", API_IP, "--port", "443", "--tls", "--ca", str(ca)]
    r = sc.topo.ns(sc.ns, *args, "--sni", sni, "--raw", str(path), check=False, timeout=20)
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
    assert out, r.stderr
    return out


def test_one_authority_in_the_sidecar(sidecar: Sidecar) -> None:
    """14.8 in the sidecar profile: an absolute-form target, a second Host or an SNI naming
    another host than the bound Host is refused (400) before the upstream, no credential."""
    sidecar.set_policy(POLICY)
    assert sidecar.api("PUT", "/credential-vault", VAULT_SNI_B)[0] == 201
    assert sidecar.dig(API)[0] == "NOERROR" and sidecar.dig("b.test")[0] == "NOERROR"
    before = len(sidecar.topo.upstream_requests())
    for raw, sni in (
        (f"GET https://b.test/v1/x HTTP/1.1\r\nHost: {API}\r\nConnection: close\r\n\r\n".encode(), API),
        (f"GET /v1/x HTTP/1.1\r\nHost: {API}\r\nHost: b.test\r\nConnection: close\r\n\r\n".encode(), API),
        (f"GET /v1/x HTTP/1.1\r\nHost: {API}\r\nConnection: close\r\n\r\n".encode(), "b.test"),
    ):
        got = _crafted(sidecar, raw, sni)
        assert got["status"] == 400, (raw, got)
    assert [r for r in sidecar.topo.upstream_requests()[before:] if "dns" not in r] == []
    # The same names agreeing: injected.
    got = _crafted(
        sidecar, f"GET https://{API}/v1/x HTTP/1.1\r\nHost: {API}\r\nConnection: close\r\n\r\n".encode()
    )
    assert got["status"] == 200, got
    assert sidecar.topo.upstream_requests()[-1]["headers"].get("Authorization") == f"Bearer {SECRET}"
    assert SECRET not in sidecar.log_text()


def test_direct_connections_to_the_mitm_port_are_dropped(sidecar: Sidecar) -> None:
    r = sidecar.topo.ns(
        sidecar.ns,
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-m",
        "2",
        "http://127.0.0.1:18081/",
        check=False,
    )
    assert r.stdout.strip() in ("000", "")
    # The MITM is still healthy (it did not loop on itself).
    assert sidecar.api("GET", "/healthz") == (200, "ok")
    fp = sidecar.topo.ns(
        sidecar.ns, "curl", "-s", "-D", "-", "-o", "/dev/null", "http://127.0.0.1:18080/healthz", check=False
    ).stdout.lower()
    assert "x-egressd-mitm-ca-fingerprint:" in fp


def test_refuses_to_start_the_mitm_without_setgid(mtopo: Topology) -> None:
    sc = Sidecar(mtopo, sb=1).with_mitm()
    try:
        r = sc.run_to_exit("setpriv", "--bounding-set", "-setgid", "--inh-caps", "-setgid")
        assert r.returncode == 1, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "CAP_SETGID" in lines[0], r.stderr
    finally:
        sc.cleanup()


def test_the_mitm_child_runs_without_capabilities(sidecar: Sidecar) -> None:
    assert sidecar.proc is not None
    pids = sidecar.topo.ns(
        sidecar.ns, "ps", "-o", "pid=", "--ppid", str(sidecar.proc.pid), check=False
    ).stdout.split()
    assert len(pids) == 1
    status = Path(f"/proc/{pids[0]}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert int(fields["CapEff"].strip(), 16) == 0 and int(fields["CapPrm"].strip(), 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Gid"].split()[0] == "18081"


# ---- the response path in the sidecar profile (docs/reference/behaviour.md §10; the fleet's are in
# tests/kernel/test_mitm_stream.py) ---------------------------------------------------------------

H2_HOST = "h2.example.test"  # the upstream offers HTTP/2 to SNIs h2.* (same address as API)
STREAM_POLICY = {
    "defaultAction": "deny",
    "egress": [{"action": "allow", "target": API}, {"action": "allow", "target": H2_HOST}],
}
STREAM_VAULT = {
    "credentials": VAULT["credentials"],
    "bindings": [
        {"name": "api", "match": {"hosts": [API, H2_HOST]}, "auth": {"type": "bearer", "credential": "key"}}
    ],
}


def _stream_ready(sc: Sidecar) -> None:
    sc.set_policy(STREAM_POLICY)
    code, text = sc.api("PUT", "/credential-vault", STREAM_VAULT)
    assert code == 201, text
    assert sc.dig(API)[0] == "NOERROR" and sc.dig(H2_HOST)[0] == "NOERROR"


def _curl(sc: Sidecar, host: str, http2: bool) -> list[str]:
    return ["curl", "-s", "-N", "--http2" if http2 else "--http1.1", "--cacert", str(client_trust(sc)),
            "--resolve", f"{host}:443:{API_IP}", "-m", "15"]  # fmt: skip


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_sidecar_streams_events_as_produced_and_redacts_them(sidecar: Sidecar, http2: bool) -> None:
    """An SSE answer reaches the app while the upstream still sends it, with the injected key
    echoed inside the events redacted."""
    _stream_ready(sidecar)
    ident = f"sc-{os.getpid()}-{int(http2)}"
    host = H2_HOST if http2 else API
    url = f"https://{host}/_stream/sse?n=5&gap=400&id={ident}&echo=authorization"
    lines = timed_lines(sidecar.topo, [*_curl(sidecar, host, http2), url])
    events = [(t, line) for t, line in lines if line.startswith("data:")]
    assert_as_produced([t for t, _ in events], sent_times(sidecar.topo, ident))
    assert all('"echo": "[REDACTED]"' in line for _, line in events), events
    assert SECRET not in sidecar.log_text()


@pytest.mark.parametrize(("http2", "ce"), [(False, "identity"), (False, "gzip"), (True, "zstd")])
def test_sidecar_redacts_a_credential_split_across_chunks(sidecar: Sidecar, http2: bool, ce: str) -> None:
    _stream_ready(sidecar)
    host = H2_HOST if http2 else API
    r = sidecar.topo.ns(
        sidecar.ns, *_curl(sidecar, host, http2), f"https://{host}/_stream/echo?fmt=raw&split=mid&gap=150&ce={ce}",
        check=False, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("<<<[REDACTED]>>>"), r.stdout[:100]
    assert SECRET not in r.stdout
