"""docs/reference/behaviour.md §14.1 (narrowing revokes what DNS opened), 14.4 (bounded lease state) and 14.6
(a refused revocation is never reported as closed), against the fleet control plane with a
fake kernel. The same properties are tried with real packets in tests/kernel."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from dnslib import QTYPE, RR, A, DNSRecord

from egressd.actionhandler.control import ControlPlane
from egressd.addr import IPAddress
from egressd.dnsproxy.forwarder import Forwarded
from egressd.dnsproxy.server import DnsProxy
from egressd.fleet.server import FleetHTTP
from egressd.fleetnft.contents import dyn_add, dyn_replace, policy_swap, static_contents
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.kernel.applier import NftError
from egressd.kernel.ops import AddSet, AddTimed, FlushSet, NetlinkBatch
from egressd.metrics import EgressMetrics
from egressd.policy import AlwaysRules, Verdict, effective_policy, parse_always_text, parse_policy
from egressd.policy.ipsets import covered_by
from egressd.subject.leases import COUNT_GRACE_S, MAX_NAMES_PER_LEASE, LeaseBook
from egressd.subject.registry import State
from egressd.vault.store import VaultStore
from tests.unit.actionhandler.test_control_dns import (
    FENCE,
    OLD,
    TABLE,
    activate,
    fake_conntrack,
    hook,
    mirror,
    ok,
    remove,
    set_binding,
)
from tests.unit.fakekernel import FakeKernel, FakeTx, InjectedFault

API = ipaddress.ip_address("93.184.216.34")
OTHER = ipaddress.ip_address("93.184.216.35")
SRC = ipaddress.ip_address("10.0.0.5")
ALLOW_API = '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"}]}'
ALLOW_BOTH = (
    '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"},'
    '{"action":"allow","target":"cdn.x.io"}]}'
)
ALLOW_CDN = '{"defaultAction":"deny","egress":[{"action":"allow","target":"cdn.x.io"}]}'
DENY_ALL = '{"defaultAction":"deny"}'
# A swap rewrites only the sets that change: a policy with an IP rule makes a change to any
# other policy a kernel transaction, which the tests below hold or refuse.
ALLOW_API_AND_IP = (
    '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"},'
    '{"action":"allow","target":"198.51.100.7"}]}'
)


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


async def make(tx: FakeTx, **kw: Any) -> ControlPlane:
    control = ControlPlane(FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353), tx), always=OLD, **kw)
    await control.reset_table()
    return control


def dyn_ops(batch: NetlinkBatch) -> list[object]:
    return [o for o in batch.ops if getattr(o, "name", "").startswith("subj_s_u_1_dyn_")]


# --------------------------------------------------------------------------- 14.1 narrowing


async def test_narrowing_to_deny_all_revokes_every_lease_in_the_swap_transaction() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API)
    assert await control.learn("u-1", FENCE, [(API, 300)], "api.x.io") == [API]
    assert control.destination_verified(SRC, "api.x.io", API)
    tx.clear()
    ok(await control.handle(set_binding(policy=DENY_ALL, gen=2)))
    (batch,) = tx.ops("static_apply")  # one transaction: static sets and dyn sets together
    effective = effective_policy(parse_policy(DENY_ALL), OLD)
    held = static_contents(effective_policy(parse_policy(ALLOW_API), OLD))
    swap = policy_swap(TABLE, "s_u_1", effective, audit_objects=False, held=held)  # the sets that change
    assert batch == swap + dyn_replace(TABLE, "s_u_1", [], ranges=False)
    assert dyn_ops(batch) == [FlushSet("subj_s_u_1_dyn_v4"), FlushSet("subj_s_u_1_dyn_v6")]
    assert mirror(control) == {}
    assert not control.destination_verified(SRC, "api.x.io", API), "the MITM must not inject any more"
    assert control.report.explain(SRC, str(API))["decision"] == "deny"


async def test_narrowing_keeps_only_leases_of_still_allowed_names() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_BOTH)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    await control.learn("u-1", FENCE, [(OTHER, 120)], "cdn.x.io")
    tx.clear()
    ok(await control.handle(set_binding(policy=ALLOW_CDN, gen=2)))
    (batch,) = tx.ops("static_apply")
    (readd,) = [o for o in dyn_ops(batch) if isinstance(o, AddTimed)]
    assert [addr for addr, _ in readd.leases] == [OTHER]
    assert 118 <= readd.leases[0][1] <= 120  # its remaining lifetime, not a fresh one
    assert set(mirror(control)) == {OTHER}


async def test_a_lease_taught_by_two_names_survives_but_the_denied_name_is_forgotten() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_BOTH)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    await control.learn("u-1", FENCE, [(API, 300)], "cdn.x.io")  # same address, two names
    ok(await control.handle(set_binding(policy=ALLOW_CDN, gen=2)))
    assert set(mirror(control)) == {API}
    assert control.destination_verified(SRC, "cdn.x.io", API)
    assert not control.destination_verified(SRC, "api.x.io", API), "credential of a denied host"


async def test_a_lease_whose_address_the_new_policy_denies_is_revoked() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    denies_ip = (
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"},'
        '{"action":"deny","target":"93.184.216.0/24"}]}'
    )
    ok(await control.handle(set_binding(policy=denies_ip, gen=2)))
    assert mirror(control) == {}


async def test_proxy_route_policy_change_revokes_like_set_binding() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    entry = control.registry.get("u-1")
    assert entry is not None
    async with control.locks.hold("u-1"):
        result = await control.apply_user_policy_locked(entry, parse_policy(DENY_ALL))
    assert result.status == 200
    assert mirror(control) == {}
    assert FlushSet("subj_s_u_1_dyn_v4") in tx.ops("static_apply")[-1].ops


async def test_always_rules_reload_that_denies_a_name_revokes_its_leases() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_BOTH)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    await control.learn("u-1", FENCE, [(OTHER, 300)], "cdn.x.io")
    tx.clear()
    denied = AlwaysRules(deny=parse_always_text("api.x.io\n", "deny.always", Verdict.DENY), allow=())
    await control.set_always_rules(denied)
    (batch,) = tx.ops("static_apply")
    assert FlushSet("subj_s_u_1_dyn_v4") in batch.ops
    assert set(mirror(control)) == {OTHER}


async def test_always_rules_reload_refused_keeps_the_leases_and_the_old_rules() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    tx.fail(op="static_apply", kinds=("batch",), times=None)
    denied = AlwaysRules(deny=parse_always_text("api.x.io\n", "deny.always", Verdict.DENY), allow=())
    with pytest.raises(NftError):
        await control.set_always_rules(denied)
    assert set(mirror(control)) == {API}  # kernel first: it still holds the lease
    assert control.always is OLD


async def test_audit_then_enforce_never_keeps_a_lease_of_a_denied_name() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    audit = '{"defaultAction":"deny","mode":"audit"}'  # api.x.io is only would-deny now
    ok(await control.handle(set_binding(policy=audit, gen=2)))
    assert mirror(control) == {}, "an audited name passes by the audit rules, never by a lease"
    assert await control.learn("u-1", FENCE, [(API, 300)], "api.x.io") == []
    ok(await control.handle(set_binding(policy=DENY_ALL, gen=3)))
    assert mirror(control) == {}


async def test_an_answer_in_flight_during_a_narrowing_is_not_added() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API_AND_IP)  # its IP rule: the narrowing is a transaction
    tx.hold(lambda op, batch: op == "static_apply")
    change = asyncio.create_task(control.handle(set_binding(policy=DENY_ALL, gen=2)))
    await asyncio.wait_for(tx.entered.wait(), 2)  # the swap is in the kernel now
    answer = asyncio.create_task(control.learn("u-1", FENCE, [(API, 300)], "api.x.io"))
    await asyncio.sleep(0.02)
    assert not answer.done(), "learn waits for the change under the subject lock"
    tx.release()
    ok(await asyncio.wait_for(change, 2))
    assert await asyncio.wait_for(answer, 2) == []
    assert tx.ops("dynamic_add") == []
    assert mirror(control) == {}


async def test_refresh_never_renews_a_revoked_address() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_BOTH)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    await control.learn("u-1", FENCE, [(OTHER, 300)], "cdn.x.io")
    ok(await control.handle(set_binding(policy=ALLOW_CDN, gen=2)))
    tx.clear()
    await control.renew_leases("u-1", [API, OTHER], 360)
    (batch,) = tx.ops("dynamic_add")
    assert batch == dyn_add(TABLE, "s_u_1", [(OTHER, 360)])


async def test_refresh_rechecks_names_against_the_policy_in_force() -> None:
    # Even a lease the book still holds is not renewed once its name is denied (defence in depth:
    # the renewal decides again instead of trusting the narrowing).
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    entry = control.registry.get("u-1")
    assert entry is not None
    control.registry.put(entry.__class__(**{**_fields(entry), "policy": parse_policy(DENY_ALL)}))
    tx.clear()
    await control.renew_leases("u-1", [API], 360)
    assert tx.ops("dynamic_add") == []


def _fields(entry: Any) -> dict[str, Any]:
    return {f: getattr(entry, f) for f in entry.__slots__}


async def test_narrowing_cuts_established_flows_to_revoked_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx, conntrack_flush=lambda _ip: None)
    await activate(control, policy=ALLOW_BOTH)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    await control.learn("u-1", FENCE, [(OTHER, 300)], "cdn.x.io")
    cut = fake_conntrack(monkeypatch, "10.0.0.5", (str(API), str(OTHER)))
    ok(await control.handle(set_binding(policy=ALLOW_CDN, gen=2)))
    for _ in range(100):
        if cut:
            break
        await asyncio.sleep(0.01)
    assert cut == [(SRC, API)], "the revoked destination's flow is cut, the kept one runs on"


async def test_set_binding_that_uncovers_a_kept_vault_is_refused_unchanged() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API)
    store = control.vaults.setdefault("u-1", VaultStore())
    vault = {
        "credentials": [{"name": "k", "source": {"type": "inline", "value": "sk-canary-1"}}],
        "bindings": [
            {"name": "b", "match": {"hosts": ["api.x.io"]}, "auth": {"type": "bearer", "credential": "k"}}
        ],
    }
    status, _ = store.put(vault, control.credentials.coverage_policy("u-1"))
    assert status in (200, 201), store
    tx.clear()
    result = await control.handle(set_binding(policy=DENY_ALL, gen=2))
    assert result.status == 400 and "uncovers a credential binding" in result.reason
    assert "sk-canary-1" not in result.reason
    assert tx.batches == []
    entry = control.registry.get("u-1")
    assert entry is not None and entry.policy == parse_policy(ALLOW_API)


# --------------------------------------------------------------------------- 14.4 bounded state


async def test_dyn_sets_are_created_with_the_lease_cap_as_size() -> None:
    tx = FakeTx(table_name=TABLE)
    control = ControlPlane(FleetPlanKernel(TableConfig(table=TABLE, max_leases=7), tx), max_leases=7)
    await control.reset_table()
    ok(await control.handle(set_binding()))
    (create,) = tx.ops("deny_first")
    sizes = {o.name: o.size for o in create.ops if isinstance(o, AddSet) and "_dyn_" in o.name}
    assert sizes == {"subj_s_u_1_dyn_v4": 7, "subj_s_u_1_dyn_v6": 7}


async def test_an_answer_that_does_not_fit_is_trimmed_to_the_cap() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx, max_leases=3)
    await activate(control, policy='{"defaultAction":"allow"}')
    addrs = [ip(f"10.9.0.{i}") for i in range(1, 6)]
    assert await control.learn("u-1", FENCE, [(a, 60) for a in addrs], "many.x.io") == addrs[:3]
    (batch,) = tx.ops("dynamic_add")
    assert [a for op in batch.ops if isinstance(op, AddTimed) for a, _ in op.leases] == addrs[:3]
    # Full: a new address does not fit, a known one is still renewed.
    assert await control.learn("u-1", FENCE, [(addrs[4], 60)], "more.x.io") == []
    assert await control.learn("u-1", FENCE, [(addrs[0], 60)], "many.x.io") == [addrs[0]]
    assert len(mirror(control)) == 3


def test_book_frees_room_only_after_the_kernel_would_have_dropped_the_lease() -> None:
    book = LeaseBook(cap=1)
    book.record(book.admit([(API, 10)], now=0.0), "a", now=0.0)
    assert book.admit([(OTHER, 10)], now=10.0 + COUNT_GRACE_S - 0.1) == []
    assert [(g.ip, g.seconds) for g in book.admit([(OTHER, 10)], now=10.0 + COUNT_GRACE_S)] == [(OTHER, 10)]


def test_book_never_holds_more_than_the_cap_of_names_per_lease() -> None:
    book = LeaseBook()
    for i in range(1000):
        book.record(book.admit([(API, 60)], now=float(i)), f"n{i}.x.io", now=float(i))
    assert len(book.names_of(API, 999.0)) == MAX_NAMES_PER_LEASE
    assert "n999.x.io" in book.names_of(API, 999.0)


def test_covered_by_matches_prefix_membership() -> None:
    nets4 = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "10.1.0.0/16", "192.168.1.0/24", "1.2.3.4/32")]
    nets6 = [ipaddress.ip_network("fd00::/64")]
    covered = covered_by(nets4, nets6)
    for text in ("10.200.1.1", "192.168.1.255", "1.2.3.4", "fd00::1", "10.1.2.3"):
        assert covered(ip(text)), text
    for text in ("11.0.0.0", "192.168.2.0", "1.2.3.5", "fd00:0:0:1::1", "9.255.255.255"):
        assert not covered(ip(text)), text


class _Upstream:
    """A forwarder that answers every name with one A record of a fresh address."""

    def __init__(self) -> None:
        self.n = 0

    async def forward(self, query: DNSRecord, *, tcp: bool = False) -> Forwarded:
        self.n += 1
        reply = query.reply()
        addr = ipaddress.ip_address(int(ipaddress.ip_address("20.0.0.0")) + self.n)
        reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A(str(addr)), ttl=300))
        return Forwarded(reply, "", None)


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_100k_distinct_names_through_one_subject_stay_bounded() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx, max_leases=4096)
    await activate(control, policy='{"defaultAction":"allow"}')

    # The kernel takes everything and keeps no record: the daemon's own memory is measured.
    tx.recording, tx.yield_each_call = False, False
    base = int(ipaddress.ip_address("20.0.0.0"))
    start = _rss_kib()
    deadline = time.monotonic() + 120
    learned = 0
    for i in range(100_000):
        addr = ipaddress.ip_address(base + i)
        learned += len(await control.learn("u-1", FENCE, [(addr, 300)], f"n{i}.names.test"))
        if i % 10_000 == 0:
            assert time.monotonic() < deadline, "bounded in time"
    grown_mib = (_rss_kib() - start) / 1024
    book = control.leases["u-1"]
    assert learned == 4096 and len(book) == 4096
    assert grown_mib < 32, f"RSS grew {grown_mib:.1f} MiB"
    # The same address answered for 100 000 names keeps a bounded set of names.
    for i in range(100_000, 110_000):
        await control.learn("u-1", FENCE, [(ipaddress.ip_address(base), 300)], f"n{i}.names.test")
    assert len(book.names_of(ipaddress.ip_address(base), time.monotonic())) == MAX_NAMES_PER_LEASE
    assert (_rss_kib() - start) / 1024 < 32


async def test_past_the_cap_the_dns_answer_is_servfail_never_an_unheld_address() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx, max_leases=50)
    await activate(control, policy='{"defaultAction":"allow"}')
    proxy = DnsProxy(control.asker, _Upstream(), on_resolved=control.learn)  # type: ignore[arg-type]
    codes = []
    for i in range(60):
        query = DNSRecord.question(f"n{i}.names.test", "A")
        reply = DNSRecord.parse(await proxy.answer(bytes(query.pack()), "10.0.0.5", tcp=False) or b"")
        codes.append(reply.header.rcode)
        held = control.leases["u-1"].live(time.monotonic())
        assert all(ipaddress.ip_address(str(rr.rdata)) in held for rr in reply.rr)
    assert codes == [0] * 50 + [2] * 10


# --------------------------------------------------------------------------- 14.6 revocations


def flaky(op: str, n: int) -> tuple[FakeTx, InjectedFault]:
    """A kernel that refuses the first ``n`` batches of ``op``, then accepts (a test may set
    the refusals ``left``)."""
    tx = FakeTx(table_name=TABLE)
    return tx, tx.fail(op=op, kinds=("batch",), times=n)


async def _until(pred: Any, seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def health(client: TestClient[Any, Any]) -> tuple[int, str]:
    resp = await client.get("/healthz")
    return resp.status, await resp.text()


async def test_a_refused_revert_is_marked_revoking_reported_and_retried(aiohttp_client: Any) -> None:
    tx, refusals = flaky("deny_first", 0)
    metrics = EgressMetrics()
    control = await make(tx, metrics=metrics)
    control.revocations.backoff = (0.01, 0.04)
    client = await aiohttp_client(FleetHTTP(control, metrics).app())
    await activate(control, policy='{"defaultAction":"allow"}')
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    refusals.left = 3  # the revert, then two retries, are refused
    tx.clear()
    result = await control.handle(set_binding(policy=None, gen=2))
    assert result.status == 500
    assert control.revoking() == {"u-1": result.reason}
    assert await health(client) == (503, "revocation pending: s-u-1\n")
    assert "egressd_revocations_pending 1" in metrics.render()
    assert control.report.describe()[0]["revoking"] is True
    # While the kernel still holds the old allow, egressd decides as if it were gone.
    asker = control.asker(SRC)
    assert asker is not None and asker.policy is None
    assert await control.learn("u-1", FENCE, [(OTHER, 300)], "api.x.io") == []
    await _until(lambda: not control.revoking())
    # The retry that the kernel accepted emptied every set of the subject.
    (accepted,) = tx.ops("deny_first")
    flushed = {o.name for o in accepted.ops if isinstance(o, FlushSet)}
    assert {"subj_s_u_1_allow_v4", "subj_s_u_1_allow_v6", "subj_s_u_1_dyn_v4", "subj_s_u_1_dyn_v6"} <= flushed
    assert refusals.left == 0
    assert await health(client) == (200, "ok")
    assert "egressd_revocations_pending 0" in metrics.render()
    entry = control.registry.get("u-1")
    assert entry is not None and entry.state is State.DENYING and entry.policy is None


async def test_a_refused_removal_closes_dns_and_vault_and_finishes_by_itself() -> None:
    tx, _ = flaky("remove", 2)
    control = await make(tx)
    control.revocations.backoff = (0.01, 0.02)
    await activate(control, policy=ALLOW_API)
    control.vaults["u-1"] = VaultStore()
    result = await control.handle(remove())
    assert result.status == 500
    assert "u-1" in control.revoking()
    assert control.vault_for_ip(SRC) is None and "u-1" not in control.vaults
    asker = control.asker(SRC)
    assert asker is not None and asker.policy is None
    await _until(lambda: not control.revoking())
    assert control.registry.get("u-1") is None
    assert control.asker(SRC) is None
    assert len(tx.ops("remove")) == 1


async def test_a_refused_swap_keeps_the_old_policy_until_the_retry_applies_the_new() -> None:
    tx, refusals = flaky("static_apply", 0)
    control = await make(tx)
    control.revocations.backoff = (0.01, 0.02)
    await activate(control, policy=ALLOW_BOTH)
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")  # the narrowing revokes it
    refusals.left = 1
    result = await control.handle(set_binding(policy=ALLOW_CDN, gen=2))
    assert result.status == 500
    entry = control.registry.get("u-1")
    assert entry is not None and entry.policy == parse_policy(ALLOW_BOTH)  # never claims narrower
    await _until(lambda: not control.revoking())
    entry = control.registry.get("u-1")
    assert entry is not None and entry.policy == parse_policy(ALLOW_CDN)


async def test_the_fastlet_retry_also_converges_and_clears_the_revocation() -> None:
    tx, refusals = flaky("deny_first", 0)
    control = await make(tx)
    control.revocations.backoff = (5.0, 5.0)  # egressd's own retry would come much later
    await activate(control)
    refusals.left = 1
    assert (await control.handle(set_binding(policy=None, gen=2))).status == 500
    assert control.revoking()
    ok(await control.handle(set_binding(policy=None, gen=2)))
    assert control.revoking() == {}
    await control.close()


async def test_a_failed_first_install_or_activation_is_not_a_revocation() -> None:
    tx, _ = flaky("deny_first", 1)
    control = await make(tx)
    assert (await control.handle(set_binding())).status == 500
    assert control.revoking() == {}
    tx2, _ = flaky("static_apply", 1)
    control2 = await make(tx2)
    ok(await control2.handle(set_binding()))
    assert (await control2.handle(hook())).status == 500
    assert control2.revoking() == {}


def test_policy_fixture_is_valid_json() -> None:
    for text in (ALLOW_API, ALLOW_BOTH, ALLOW_CDN, DENY_ALL):
        json.loads(text)


# --------------------------------------------------------------------------- review regressions

_VAULT = {
    "credentials": [{"name": "k", "source": {"type": "inline", "value": "sk-canary-1"}}],
    "bindings": [
        {"name": "b", "match": {"hosts": ["api.x.io"]}, "auth": {"type": "bearer", "credential": "k"}}
    ],
}


async def test_a_tenant_policy_write_cannot_cancel_a_pending_removal() -> None:
    from egressd.fleet.proxyroute import ProxyRouteAPI

    tx, refusals = flaky("remove", 10_000)  # the kernel keeps refusing the removal
    control = await make(tx)
    control.revocations.backoff = (0.01, 0.02)
    proxy = ProxyRouteAPI(control)
    await activate(control, policy=ALLOW_API)
    assert (await control.handle(remove())).status == 500
    body = json.dumps(
        {"defaultAction": "deny", "egress": [{"action": "allow", "target": "api.x.io"}]}
    ).encode()
    reply = await proxy.handle("PUT", "/v1/sandboxfleets/u-1/egress/policy", {}, body)
    assert reply.status == 500
    # Nor can an in-place SET_BINDING or an activation build on the state being taken away.
    assert (await control.handle(set_binding(policy=ALLOW_API, gen=2))).status == 500
    await asyncio.sleep(0.05)
    assert "u-1" in control.revoking()
    asker = control.asker(SRC)
    assert asker is not None and asker.policy is None
    assert await control.learn("u-1", FENCE, [(API, 300)], "api.x.io") == []
    await proxy.handle(
        "PUT", "/v1/sandboxfleets/u-1/egress/credential-vault", {}, json.dumps(_VAULT).encode()
    )
    assert control.vault_for_ip(SRC) is None
    refusals.left = 0  # the kernel agrees at last: the removal finishes by itself
    await _until(lambda: not control.revoking())
    assert control.registry.get("u-1") is None and "u-1" not in control.vaults


async def test_egressds_own_retry_applies_the_inputs_vault_action_too() -> None:
    tx, refusals = flaky("static_apply", 0)
    control = await make(tx)
    control.revocations.backoff = (0.01, 0.02)
    await activate(control, policy=ALLOW_API)
    store = control.vaults.setdefault("u-1", VaultStore())
    status, _ = store.put(_VAULT, control.credentials.coverage_policy("u-1"))
    assert status in (200, 201)
    refusals.left = 1
    both = {  # its IP rule: the change is a kernel transaction, which the kernel refuses once
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "api.x.io"},
            {"action": "allow", "target": "other.io"},
            {"action": "allow", "target": "198.51.100.7"},
        ],
    }
    wrapper = json.dumps({"osbEgressInput": 1, "policy": both})  # no "vault": remove it
    assert (await control.handle(set_binding(policy=wrapper, gen=2))).status == 500
    assert "u-1" not in control.vaults, "a vault removal needs no kernel: it holds at once"
    await _until(lambda: not control.revoking())
    entry = control.registry.get("u-1")
    assert entry is not None and entry.policy == parse_policy(json.dumps(both))
    assert "u-1" not in control.vaults


async def test_an_always_rules_reload_never_widens_a_subject_being_closed() -> None:
    from egressd.kernel.ops import AddIntervals

    tx, refusals = flaky("deny_first", 0)
    control = await make(tx)
    control.revocations.backoff = (30.0, 30.0)  # keep egressd's own retry out of the way
    await activate(control, policy=ALLOW_API)
    refusals.left = 1
    assert (await control.handle(set_binding(policy=None, gen=2))).status == 500
    tx.clear()
    new = AlwaysRules(
        deny=parse_always_text("1.2.3.4\n", "deny.always", Verdict.DENY),
        allow=parse_always_text("8.8.8.0/24\n", "allow.always", Verdict.ALLOW),
    )
    await control.set_always_rules(new)
    (batch,) = tx.ops("static_apply")
    adds = {o.name: o.nets for o in batch.ops if isinstance(o, AddIntervals)}
    assert ipaddress.ip_network("8.8.8.0/24") not in adds.get("subj_s_u_1_allow_v4", ()), "widened"
    assert ipaddress.ip_network("1.2.3.4/32") in adds.get("subj_s_u_1_deny_v4", ()), "the new deny holds"
    await control.close()


async def test_a_sidecar_learn_whose_caller_left_still_records_what_the_kernel_took() -> None:
    from egressd.sidecar.engine import SidecarEngine
    from egressd.sidecarnft.ruleset import SidecarTable

    kernel = FakeKernel(latency=0.1)  # a slow libnftables call
    engine = SidecarEngine(SidecarTable(table="T", max_leases=4), kernel, parse_policy(ALLOW_API))
    await engine.install()
    kernel.clear()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(engine.learn("sidecar", engine.fence, [(API, 300)], "api.x.io"), 0.02)
    await _until(lambda: bool(kernel.scripts))
    await asyncio.sleep(0)
    assert API in engine.leases.live(time.monotonic()), "the kernel holds a lease the book does not know"


async def test_a_fleet_learn_whose_caller_left_still_records_what_the_kernel_took() -> None:
    tx = FakeTx(table_name=TABLE)
    control = await make(tx)
    await activate(control, policy=ALLOW_API)
    tx.hold(lambda op, batch: op == "dynamic_add")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(control.learn("u-1", FENCE, [(API, 300)], "api.x.io"), 0.02)
    tx.release()
    await _until(lambda: bool(tx.ops("dynamic_add")))
    await asyncio.sleep(0)
    assert set(mirror(control)) == {API}


async def test_a_sidecar_learn_after_a_rebuild_in_doubt_never_takes_the_hash_path() -> None:
    """The sidecar's side of the range hash path's finding A: a rebuild applied with its
    answer lost leaves the engine on the old policy and the kernel on the new one's shared
    ranges; until a rebuild succeeds, a lease's ranges are written as their own elements
    (``dyn_allowr`` would open whatever the kernel's shared ranges are)."""
    from egressd.sidecar.engine import SidecarEngine
    from egressd.sidecarnft.ruleset import SidecarTable

    ranged = parse_policy(
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io","protocol":"tcp",'
        '"ports":["8000-8100"]}]}'
    )
    wide = parse_policy(
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"b.x.io","protocol":"tcp",'
        '"ports":["1-65535"]},{"action":"allow","target":"api.x.io","protocol":"tcp","ports":[443]}]}'
    )
    kernel = FakeKernel()
    engine = SidecarEngine(SidecarTable(table="T", max_leases=4), kernel, ranged)
    await engine.install()
    await engine.learn("sidecar", engine.fence, [(API, 300)], "api.x.io")
    kernel.clear()
    kernel.fail(op="static_apply", fault="late_ack")
    assert (await engine.set_policy(wide)).status == 500
    kernel.clear()
    await engine.learn("sidecar", engine.fence, [(API, 300)], "api.x.io")
    (learned,) = [text for op, text in kernel.scripts if op == "dynamic_add"]
    assert "dyn_allowr" not in learned and "8000-8100" in learned, learned
    # A rebuild that succeeds settles it: the hash path again.
    assert (await engine.set_policy(ranged)).status == 200
    kernel.clear()
    await engine.learn("sidecar", engine.fence, [(API, 300)], "api.x.io")
    (learned,) = [text for op, text in kernel.scripts if op == "dynamic_add"]
    assert "dyn_allowr" in learned, learned
