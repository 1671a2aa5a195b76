"""docs/reference/behaviour.md §10, "answered from memory", against the fleet control plane (fake kernel): every
narrowing bumps the sequence map before the call that made it returns, and the destination
deadline egressd hands out ends with the lease."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egressd.actionhandler.control import ControlPlane
from egressd.feed import Feed
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from egressd.mitm.seqmap import MitmMemory, SeqReader, SeqWriter
from egressd.policy import AlwaysRules, Verdict, parse_always_text, parse_policy
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.http import SidecarHTTP
from egressd.sidecarnft.backend import SIDECAR_UID
from egressd.sidecarnft.ruleset import SidecarTable
from tests.unit.actionhandler.test_control_dns import FENCE, OLD, TABLE, activate, ok, remove, set_binding
from tests.unit.fakekernel import FakeTx
from tests.unit.sidecar.test_sidecar_http import ready_prereqs

SRC = "10.0.0.5"
API = ipaddress.ip_address("93.184.216.34")
ALLOW_API = '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"}]}'
ALLOW_OTHER = '{"defaultAction":"deny","egress":[{"action":"allow","target":"cdn.x.io"}]}'


# The daemon's change feed (egressd.feed): the owners below publish to it, the memory subscribes.
FEED = Feed()


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[SeqReader]:
    writer = SeqWriter(tmp_path / "a.sock.seq")
    writer.beat()
    unsubscribe = FEED.subscribe(MitmMemory(writer))
    r = SeqReader(str(writer.path), max_silence=60)
    try:
        yield r
    finally:
        r.close()
        unsubscribe()
        writer.close()


async def _control() -> ControlPlane:
    kernel = FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353), FakeTx(table_name=TABLE))
    control = ControlPlane(kernel, always=OLD, feed=FEED)
    await control.reset_table()
    return control


def _until(control: ControlPlane) -> float:
    return control.learning.destination_verified_until(ipaddress.ip_address(SRC), "api.x.io", API)


async def test_a_learned_destination_is_handed_out_with_its_lease_deadline(reader: SeqReader) -> None:
    control = await _control()
    await activate(control, policy=ALLOW_API)
    assert _until(control) == 0.0
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    left = _until(control) - time.monotonic()
    assert 0 < left <= 360, "the lease's own lifetime (clamped TTL + 60)"
    assert control.learning.destination_verified(ipaddress.ip_address(SRC), "api.x.io", API)


async def test_a_policy_narrowing_bumps_before_it_returns(reader: SeqReader) -> None:
    control = await _control()
    await activate(control, policy=ALLOW_API)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    before = reader.stamp(SRC)
    ok(await control.handle(set_binding("u-1", ALLOW_OTHER)))
    assert reader.stamp(SRC) != before
    assert _until(control) == 0.0, "the name no longer verifies: nothing may remember it"


async def test_an_always_rules_reload_bumps_every_client(reader: SeqReader) -> None:
    control = await _control()
    await activate(control, policy=ALLOW_API)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    before = reader.stamp(SRC)
    denied = AlwaysRules(deny=parse_always_text("api.x.io\n", "deny.always", Verdict.DENY), allow=())
    await control.set_always_rules(denied)
    assert reader.stamp(SRC) != before and reader.stamp("10.9.9.9") != before
    assert _until(control) == 0.0


async def test_a_removal_bumps_before_it_returns(reader: SeqReader) -> None:
    control = await _control()
    await activate(control, policy=ALLOW_API)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    before = reader.stamp(SRC)
    ok(await control.handle(remove("u-1")))
    assert reader.stamp(SRC) != before
    assert _until(control) == 0.0


async def test_a_dns_answer_does_not_bump(reader: SeqReader) -> None:
    """A widening: the worker does not remember unverified pairs, so it needs no signal."""
    control = await _control()
    await activate(control, policy=ALLOW_API)
    before = reader.stamp(SRC)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    assert reader.stamp(SRC) == before


# --------------------------------------------------------------------------- the sidecar profile


async def test_sidecar_policy_changes_bump_with_and_without_http(
    reader: SeqReader, aiohttp_client: Any, tmp_path: Path
) -> None:
    engine = SidecarEngine(SidecarTable(table="T"), FakeTx(yield_each_call=False), parse_policy(ALLOW_API), feed=FEED)
    await engine.install()
    await engine.learn(SIDECAR_UID, engine.fence, [(API, 300)], "api.x.io")
    assert engine.destination_verified_until(ipaddress.ip_address(SRC), "api.x.io", API) > time.monotonic()
    before = reader.stamp(SRC)
    assert (await engine.set_policy(parse_policy(ALLOW_OTHER))).status == 200
    assert reader.stamp(SRC) != before, "the engine bumps itself (an always-rules reload has no HTTP caller)"
    assert engine.destination_verified_until(ipaddress.ip_address(SRC), "api.x.io", API) == 0.0
    http = SidecarHTTP(engine, EgressMetrics(), token=None, max_rules=4096, prerequisites=ready_prereqs())
    client = await aiohttp_client(http.app())
    mid = reader.stamp(SRC)
    assert (await client.get("/policy")).status == 200
    assert reader.stamp(SRC) == mid
    await client.post("/policy", data=b"{}")
    assert reader.stamp(SRC) != mid, "any write through the API, whatever it answered"


async def test_a_vault_installed_after_its_validation_bumps_again(
    reader: SeqReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of issue 16: an activation that validates off the loop (the always-rules
    changed since the input arrived, or the revocation retry, with no HTTP middleware after
    it) bumped before the await only. A pull during the await learned "no vault" (a 404 the
    worker remembers) under the new stamp, so the subject ran without its credential until
    an unrelated narrowing. The install bumps too."""
    from egressd.actionhandler import vaults
    from egressd.actionhandler.inputs import BindingInput, VaultAction
    from egressd.vault.offload import off_loop as real_off_loop
    from egressd.vault.parse import parse_create

    control = await _control()
    await activate(control, policy=ALLOW_API)
    during: list[tuple[Any, Any]] = []

    async def pull_meanwhile(fn: Any, *args: Any) -> Any:
        during.append((reader.stamp(SRC), control.credentials.vault_for_ip(ipaddress.ip_address(SRC))))
        return await real_off_loop(fn, *args)

    monkeypatch.setattr(vaults, "off_loop", pull_meanwhile)
    content = parse_create(
        {
            "credentials": [{"name": "key", "source": {"type": "inline", "value": "sk-live-1"}}],
            "bindings": [
                {
                    "name": "api",
                    "match": {"hosts": ["api.x.io"]},
                    "auth": {"type": "bearer", "credential": "key"},
                }
            ],
        }
    )
    parsed = BindingInput(parse_policy(ALLOW_API), VaultAction.SET, content, validated_against=None)
    await control.credentials.activate("u-1", parsed)
    assert len(during) == 1
    stamp_then, snapshot_then = during[0]
    assert snapshot_then is None, "the pull meanwhile saw no vault (and would remember it)"
    assert control.credentials.vault_for_ip(ipaddress.ip_address(SRC)) is not None
    assert reader.stamp(SRC) != stamp_then, "the remembered 404 outlived the new vault"


async def test_a_refused_binding_that_takes_the_vault_bumps(reader: SeqReader) -> None:
    from egressd.actionhandler.inputs import BindingInput, VaultAction

    control = await _control()
    await activate(control, policy=ALLOW_API)
    before = reader.stamp(SRC)
    control.credentials.refused("u-1", BindingInput(parse_policy(ALLOW_API), VaultAction.REMOVE))
    assert reader.stamp(SRC) != before


async def test_sidecar_writes_refused_before_any_handler_do_not_void_the_memory(
    reader: SeqReader, aiohttp_client: Any
) -> None:
    """Review of issue 16: the sidecar API listens on the sandbox's side; a flood of refused
    writes (wrong token, no such path) turned every memory answer into a pull. Only those
    skip the bump: an authorised write still bumps whatever it answers."""
    from egressd.sidecar.http import AUTH_HEADER

    engine = SidecarEngine(SidecarTable(table="T"), FakeTx(yield_each_call=False), parse_policy(ALLOW_API), feed=FEED)
    await engine.install()
    http = SidecarHTTP(engine, EgressMetrics(), token="s3cret", max_rules=4096, prerequisites=ready_prereqs())
    client = await aiohttp_client(http.app())
    before = reader.stamp(SRC)
    assert (await client.post("/policy", data=b"{}")).status == 401
    assert (await client.put("/policy", data=b"{}", headers={AUTH_HEADER: "wrong"})).status == 401
    assert (await client.delete("/credential-vault/x", headers={AUTH_HEADER: "wrong"})).status == 401
    assert (await client.post("/no-such-path", data=b"{}")).status == 404
    assert reader.stamp(SRC) == before
    await client.post("/policy", data=b"{}", headers={AUTH_HEADER: "s3cret"})
    assert reader.stamp(SRC) != before, "an authorised write bumps, whatever it answered"
    mid = reader.stamp(SRC)
    await client.post("/healthz", data=b"{}")  # a handler ran (and refused): still bumps
    assert reader.stamp(SRC) != mid


@pytest.mark.parametrize("change", ["remove", "rebind"])
async def test_a_removal_or_rebind_moves_the_clients_own_slot_before_it_returns(
    reader: SeqReader, change: str
) -> None:
    """The MITM's TLS resumption epoch is the client's own slot (not slot 0, which every API
    write moves): the old address's slot must move before the action returns, so a sandbox
    that gets the address next never resumes the old subject's session."""
    control = await _control()
    await activate(control, policy=ALLOW_API)
    before = reader.value(SRC)
    if change == "remove":
        ok(await control.handle(remove("u-1")))
    else:
        ok(await control.handle(set_binding("u-1", ALLOW_API, ip_="10.0.0.6", rid="r2", aid="a2")))
        assert control.registry.resolve(ipaddress.ip_address(SRC)) is None
    assert reader.value(SRC) != before
