"""Upstream TLS session resumption in the MITM child (``EGRESSD_MITM_TLS_RESUME``, docs/reference/behaviour.md
§10) end to end: real kernel redirect, real MITM child, the real HTTPS upstream
(scripts/fleet_upstream.py), which reports per request whether its TLS connection resumed a
session (``tlsResumed``, Python's ``SSLObject.session_reused`` on the server side).

The property under attack: a session never links two sandboxes' connections at the upstream,
and a sandbox that took over a removed one's address does not inherit its sessions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.kernel.test_mitm_selective import API, API_IP, POLICY, VAULT, get, learn, vault_call
from tests.kernel.topology import Daemon, Topology, envelope

MITM_PORT, HTTP_PORT, TABLE = 18581, 18590, "egt-tlsr"
MITM_PORT_OFF, HTTP_PORT_OFF, TABLE_OFF = 18583, 18592, "egt-tlsr-off"
DPR = "sandbox.data-plane-ready"


def _env(topo: Topology, port: int, tag: str, resume: str) -> dict[str, str]:
    return {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(port),
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / f"{tag}-mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / f"{tag}-mitm-run" / "active.sock"),
        "EGRESSD_MITM_TLS_RESUME": resume,
    }


def _daemon(topo: Topology, port: int, http: int, table: str, tag: str, resume: str) -> Iterator[Daemon]:
    d = Daemon(topo, table=table, port=http, env=_env(topo, port, tag, resume))
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            topo.stop(d.proc)
        d.nft("delete", "table", "inet", table, check=False)
        print(d.log_text()[-4000:])


@pytest.fixture(scope="module")
def resuming(topo: Topology) -> Iterator[Daemon]:
    yield from _daemon(topo, MITM_PORT, HTTP_PORT, TABLE, "tlsr", "on")


def _bind(d: Daemon, i: int, uid: str) -> None:
    assert d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(i), policy=POLICY)) == (200, "{}")
    assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")
    assert vault_call(d, uid, "PUT", VAULT)[0] == 201
    learn(d.topo, i, API)


def _decrypted(topo: Topology, d: Daemon, i: int) -> dict[str, Any]:
    """One new HTTPS connection from sandbox ``i`` to the bound host, through the MITM: the
    upstream's echo (the credential was injected, so the connection was decrypted)."""
    ca = topo.workdir / f"{d.env['EGRESSD_MITM_CONFDIR'].rsplit('/', 1)[-1]}" / "mitmproxy-ca-cert.pem"
    status, echo = get(topo, i, API, API_IP, ca)
    assert status == 200, echo
    assert echo["tls"] is True and echo["port"] == 443
    assert any(k.lower() == "authorization" and "sk-live" in v for k, v in echo["headers"].items())
    return echo


def test_off_never_resumes(topo: Topology) -> None:
    # First in the module, before the resuming daemon exists: two daemons would share the DNS
    # port and the host-uid port block.
    for d in _daemon(topo, MITM_PORT_OFF, HTTP_PORT_OFF, TABLE_OFF, "tlsr-off", "off"):
        _bind(d, 4, "tlsr-off")
        assert [_decrypted(topo, d, 4)["tlsResumed"] for _ in range(3)] == [False, False, False]


def test_the_same_sandbox_resumes_another_does_not(topo: Topology, resuming: Daemon) -> None:
    _bind(resuming, 1, "tlsr-a")
    _bind(resuming, 2, "tlsr-b")
    assert _decrypted(topo, resuming, 1)["tlsResumed"] is False, "the first connection is a full handshake"
    assert _decrypted(topo, resuming, 1)["tlsResumed"] is True, "the same sandbox resumes"
    # sb1 holds a fresh session for exactly this SNI and upstream now; sb2 must not get it.
    assert _decrypted(topo, resuming, 2)["tlsResumed"] is False, "a session crossed sandboxes"
    assert _decrypted(topo, resuming, 2)["tlsResumed"] is True
    assert _decrypted(topo, resuming, 1)["tlsResumed"] is True


def test_a_sandbox_on_a_removed_ones_address_gets_no_session(topo: Topology, resuming: Daemon) -> None:
    _bind(resuming, 3, "tlsr-old")
    _decrypted(topo, resuming, 3)
    assert _decrypted(topo, resuming, 3)["tlsResumed"] is True
    assert resuming.post(envelope("REMOVE_BINDING", "tlsr-old"))[0] == 200
    # No wait for the forget line: the removal bumped the address's slot in the sequence map
    # (EGRESSD_MITM_VAULT_PUSH, on by default) before it was answered, so the next connection
    # from this address starts in a newer epoch whatever the child has read of its stdin.
    _bind(resuming, 3, "tlsr-new")  # another sandbox, the same address
    assert _decrypted(topo, resuming, 3)["tlsResumed"] is False, "the old subject's session was inherited"
