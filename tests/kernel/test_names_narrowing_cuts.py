"""A narrowing that takes a name away cuts the connections already open for it (docs/reference/
behaviour.md §18 with §14.1), also where the address stays open for another name: the kernel's
flow cut judges addresses and ports and keeps such a connection, so the MITM must end it.

Real packets through the real MITM in the CDN-shaped topology of tests/kernel/cdn.py (a.cdn.test
and b.cdn.test on one address). A keep-alive TLS client sends one request, waits while the test
changes the policy, and sends a second on the same connection: relayed (passed through) and
decrypted (a vault binding) connections; the sidecar's case is in
tests/kernel/test_names_named_ports_sidecar.py. Each test fails when the second
request still reaches the upstream.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    allow,
    bind_subject,
    cdn_topology,
    learn,
    mark,
    mitm_env,
    mitm_fleet,
    policy,
    upstream_ca,
)
from tests.kernel.keepalive import KeepAlive, second_reached
from tests.kernel.topology import Daemon, Topology, envelope

HTTP_PORT = 18575


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egk{os.getpid()}", sandboxes=1)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def fleet(cdn: Topology) -> Iterator[Daemon]:
    with mitm_fleet(cdn, "egt-namecut", HTTP_PORT, mitm_env(cdn, "namecut")) as d:
        yield d


BOTH = policy(allow("a.cdn.test"), allow("b.cdn.test"))
ONLY_B = policy(allow("b.cdn.test"))


def put_vault(fleet: Daemon, t: Topology, uid: str, *, binding: bool = True) -> Path:
    """A vault binding a.cdn.test (``binding``): its connections are decrypted (§16). Returns
    the CA bundle a client must trust (the MITM's)."""
    vault: dict[str, Any] = {
        "credentials": [{"name": "key", "source": {"type": "inline", "value": "sk-namecut-7731"}}],
        "bindings": [
            {"name": "a", "match": {"hosts": ["a.cdn.test"]}, "auth": {"type": "bearer", "credential": "key"}}
        ]
        if binding
        else [],
    }
    path = t.workdir / "namecut-vault.json"
    path.write_text(json.dumps(vault))
    code, text = fleet._curl(
        "-X", "PUT", "-H", "Content-Type: application/json", "--data-binary", f"@{path}",
        f"http://127.0.0.1:{fleet.port}/v1/sandboxfleets/{uid}/egress/credential-vault",
    )  # fmt: skip
    assert code in (200, 201), text  # 201 created, 200 replaced
    bundle = t.workdir / "namecut-bundle.pem"
    bundle.write_text((t.workdir / "namecut-mitm-conf" / "mitmproxy-ca-cert.pem").read_text())
    return bundle


@pytest.mark.parametrize("decrypted", [False, True], ids=["relayed", "decrypted"])
def test_a_narrowing_that_takes_the_name_away_cuts_its_open_connection(
    cdn: Topology, fleet: Daemon, decrypted: bool
) -> None:
    uid = f"cut{int(decrypted)}"
    bind_subject(fleet, 1, uid, BOTH)
    client = None
    try:
        ca = put_vault(fleet, cdn, uid) if decrypted else upstream_ca(cdn)
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        learn(cdn, 1, "b.cdn.test", CDN_IP)  # the address stays open for b after the change
        client = KeepAlive(cdn, 1, "a.cdn.test", ca)
        assert client.line() == {"first": 200}
        since = mark(cdn)
        if decrypted:  # a policy may not uncover a binding: the binding goes first (the open
            put_vault(fleet, cdn, uid, binding=False)  # connection stays decrypted)
        bind_subject(fleet, 1, uid, ONLY_B)
        second = client.second()
        assert second != 200, second
        assert not second_reached(cdn, since, "a.cdn.test")
    finally:
        if client is not None:
            client.stop()
        fleet.post(envelope("REMOVE_BINDING", uid))


def test_a_change_that_keeps_the_name_keeps_the_connection(cdn: Topology, fleet: Daemon) -> None:
    """The control: a policy change (a narrowing elsewhere) leaves an admitted name's relay alone."""
    uid = "cutkeep"
    bind_subject(fleet, 1, uid, BOTH)
    client = None
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        client = KeepAlive(cdn, 1, "a.cdn.test", upstream_ca(cdn))
        assert client.line() == {"first": 200}
        bind_subject(fleet, 1, uid, policy(allow("a.cdn.test")))
        assert client.second() == 200
    finally:
        if client is not None:
            client.stop()
        fleet.post(envelope("REMOVE_BINDING", uid))
