"""A fleet control plane on a never-failing kernel, seeded with subjects in every state, and a
snapshot of everything a refused request must leave alone."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION
from egressd.fleet.proxyroute import ProxyRouteAPI
from egressd.fleet.server import FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from egressd.vault.keys import KeyStore
from tests.unit.fakekernel import FakeTx

KID = "k1"
KEY = bytes(range(32))
_KEYS_DIR = Path(tempfile.mkdtemp(prefix="egressd-fuzz-keys-"))
(_KEYS_DIR / f"{KID}.key").write_bytes(KEY)

POLICY: dict[str, Any] = {
    "defaultAction": "deny",
    "egress": [
        {"action": "allow", "target": "api.example.com"},
        {"action": "allow", "target": "*.svc.example.org"},
        {"action": "allow", "target": "9.9.9.9"},
        {"action": "deny", "target": "10.0.0.0/8"},
    ],
}
POLICY_TEXT = json.dumps(POLICY)

#: Seeded subjects: uid -> (ip, gateway, final state). "u-vault" is active with a vault.
ACTIVE, DENYING, WITH_VAULT, ABSENT = "u-act", "u-deny", "u-vault", "u-absent"
SEED_VALUE = "zzSEEDVALUEzz"  # the seeded vault's credential: must never be logged either


def make_keystore() -> KeyStore:
    """The harness key directory; never rescanned (nothing changes it)."""
    return KeyStore(_KEYS_DIR, rescan_interval=1e9)


def set_binding(
    uid: str, ip: str, gw: str = "10.0.0.1", input: str | None = POLICY_TEXT, gen: int = 1
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"specGeneration": gen, "runtimeInstanceId": "r1", "attachmentId": "a1"},
        "attachment": {"network": {"ip": ip, "gateway": gw, "hostVeth": f"veth-{uid}"}},
        "binding": {"input": input},
    }


def hook(uid: str, name: str = "sandbox.data-plane-ready") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "operation": "LIFECYCLE_HOOK",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": "r1", "attachmentId": "a1"},
        "hook": {"name": name},
    }


def remove(uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "operation": "REMOVE_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": "r1", "attachmentId": "a1"},
    }


def seed_vault(value: str = SEED_VALUE) -> dict[str, Any]:
    return {
        "credentials": [{"name": "tok", "source": {"type": "inline", "value": value}}],
        "bindings": [
            {
                "name": "b1",
                "match": {"hosts": ["api.example.com"]},
                "auth": {"type": "bearer", "credential": "tok"},
            }
        ],
    }


@dataclass
class Fleet:
    control: ControlPlane
    tx: FakeTx
    http: FleetHTTP
    proxy: ProxyRouteAPI

    async def act(self, doc: object) -> tuple[int, str]:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        resp = await self.http._act(body)  # transport-free core of POST /_fastlet/v1/actions
        return resp.status, resp.text or ""


async def make_fleet() -> Fleet:
    # Never failing: a 5xx can then have no kernel cause, so any 5xx the fuzzers see is a finding.
    tx = FakeTx(yield_each_call=False)
    metrics = EgressMetrics()
    control = ControlPlane(FleetPlanKernel(TableConfig(), tx), metrics=metrics, keys=make_keystore())
    await control.reset_table()
    proxy = ProxyRouteAPI(control, clock=lambda: 1000.0)
    http = FleetHTTP(control, metrics, proxy=proxy)
    fleet = Fleet(control, tx, http, proxy)
    for uid, ip, active in (
        (ACTIVE, "10.0.0.5", True),
        (DENYING, "10.0.0.6", False),
        (WITH_VAULT, "10.0.0.7", True),
    ):
        status, text = await fleet.act(set_binding(uid, ip))
        assert status == 200, text
        if active:
            status, text = await fleet.act(hook(uid))
            assert status == 200, text
    reply = await proxy.handle(
        "PUT",
        f"/v1/sandboxfleets/{WITH_VAULT}/egress/credential-vault",
        {},
        json.dumps(seed_vault()).encode(),
    )
    assert reply.status in (200, 201), reply
    return fleet


def snapshot(fleet: Fleet) -> Any:
    """Everything observable a refused request must leave exactly as it was: registry entries
    and indexes, the kernel views, vault stores (content included), pending vaults and pushes,
    claims, revocations, leases, and the list of transactions sent to the kernel. Caches
    (effective policies, ip sets) are left out: rebuilding them changes nothing."""
    c = fleet.control
    reg = c.registry
    vaults = {}
    for uid, store in c.vaults.items():
        snap = store.snapshot()
        vaults[uid] = (
            store.tag,
            None if store.vault is None else store.vault.state(),
            snap and snap.to_json(),
        )
    pushes = {
        uid: [(p.method, p.suffix, p.body, p.generation, p.deadline) for p in queue]
        for uid, queue in c.credentials.pending_pushes._by_uid.items()
    }
    return (
        dict(reg._by_uid),
        dict(reg._kernel),
        dict(reg._by_ip),
        dict(reg._by_nft_id),
        vaults,
        {uid: (b.policy, b.vault, b.content) for uid, b in c.credentials.pending_inputs.items()},
        pushes,
        dict(c.claims.ips),
        dict(c.claims.nft_ids),
        dict(c.kernel.steps.nets.held) if isinstance(c.kernel, FleetPlanKernel) else None,
        sorted(c.revocations.pending),
        {uid: dict(book._leases) for uid, book in c.leases.items()},
        list(fleet.tx.calls),
    )
