"""The DNS side of the fleet ControlPlane (§2, §5, §7, §9): asker, learn, renew, always-rules swap.

The kernel is the shared :data:`~tests.unit.fakekernel.FakeTx` (no table model): it records
every netlink batch, refuses batches of a given op with ``NftError`` and holds a batch until
released.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Collection
from typing import Any

import pytest

from egressd.actionhandler.api import Result
from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION, LifecycleHook, RemoveBinding, SetBinding, parse_action
from egressd.addr import IPAddress
from egressd.fleetnft.contents import dyn_add, dyn_replace, policy_swap
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.kernel import conntrack
from egressd.kernel.applier import NftError
from egressd.kernel.ops import AddIntervals, AddTimed, NetlinkBatch
from egressd.policy import (
    EMPTY_ALWAYS,
    AlwaysRules,
    Verdict,
    effective_policy,
    evaluate_domain,
    parse_always_text,
    parse_policy,
)
from egressd.subject.model import Asker, Fence
from egressd.subject.registry import State
from tests.unit.fakekernel import FakeTx

TABLE = "T"
FENCE = Fence("r1", "a1")
ALLOW_ALL = '{"defaultAction":"allow"}'
ONLY_EXAMPLE = '{"defaultAction":"deny","egress":[{"action":"allow","target":"*.example.com"}]}'
OLD = AlwaysRules(deny=parse_always_text("evil.com\n", "deny.always", Verdict.DENY), allow=())
NEW = AlwaysRules(
    deny=parse_always_text("evil.com\n1.2.3.4\nworse.com\n", "deny.always", Verdict.DENY),
    allow=parse_always_text("pypi.org\n", "allow.always", Verdict.ALLOW),
)


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


# --------------------------------------------------------------------------- fake kernel


def mirror(control: ControlPlane, uid: str = "u-1") -> dict[IPAddress, float]:
    """The subject's live leases (ip -> monotonic expiry), {} when it has none."""
    book = control.leases.get(uid)
    return book.live(time.monotonic()) if book is not None else {}


def touches(batch: NetlinkBatch, nid: str) -> bool:
    return any(getattr(o, "name", "").startswith(f"subj_{nid}_") for o in batch.ops)


# --------------------------------------------------------------------------- envelopes


def set_binding(
    uid: str = "u-1",
    policy: str | None = ALLOW_ALL,
    *,
    ip_: str = "10.0.0.5",
    rid: str = "r1",
    aid: str = "a1",
    gen: int = 1,
) -> SetBinding:
    doc: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"specGeneration": gen, "runtimeInstanceId": rid, "attachmentId": aid},
        "binding": {"input": policy},
        "attachment": {"network": {"ip": ip_, "gateway": "10.0.0.1", "hostVeth": "veth0"}},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, SetBinding)
    return action


def hook(uid: str = "u-1", *, rid: str = "r1", aid: str = "a1") -> LifecycleHook:
    doc = {
        "apiVersion": API_VERSION,
        "operation": "LIFECYCLE_HOOK",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": aid},
        "hook": {"name": "sandbox.data-plane-ready", "sequence": 1},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, LifecycleHook)
    return action


def remove(uid: str = "u-1", *, rid: str = "r1", aid: str = "a1") -> RemoveBinding:
    doc = {
        "apiVersion": API_VERSION,
        "operation": "REMOVE_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": aid},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, RemoveBinding)
    return action


def ok(result: Result) -> None:
    assert result == Result(200), result


@pytest.fixture
def tx() -> FakeTx:
    return FakeTx(table_name=TABLE)


async def make_control(tx: FakeTx, always: AlwaysRules = OLD) -> ControlPlane:
    control = ControlPlane(FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353), tx), always=always)
    await control.reset_table()
    return control


@pytest.fixture
async def control(tx: FakeTx) -> ControlPlane:
    return await make_control(tx)


async def activate(
    control: ControlPlane, uid: str = "u-1", ip_: str = "10.0.0.5", policy: str = ALLOW_ALL
) -> None:
    ok(await control.handle(set_binding(uid, policy, ip_=ip_)))
    ok(await control.handle(hook(uid)))
    entry = control.registry.get(uid)
    assert entry is not None and entry.state is State.ACTIVE


# --------------------------------------------------------------------------- asker


async def test_asker_unknown_ip_is_none(control: ControlPlane) -> None:
    assert control.asker(ip("10.0.0.5")) is None
    await activate(control)
    assert control.asker(ip("10.0.0.6")) is None
    assert control.asker(ip("fd00::5")) is None


async def test_asker_of_a_denying_subject_has_no_policy(control: ControlPlane) -> None:
    ok(await control.handle(set_binding()))
    assert control.asker(ip("10.0.0.5")) == Asker("u-1", FENCE, None)


async def test_asker_of_an_active_subject_has_the_effective_policy(control: ControlPlane) -> None:
    await activate(control, policy=ALLOW_ALL)
    asker = control.asker(ip("10.0.0.5"))
    assert asker is not None
    assert (asker.uid, asker.fence) == ("u-1", FENCE)
    assert asker.policy is not None
    assert asker.policy == effective_policy(parse_policy(ALLOW_ALL), OLD)
    assert [r.target for r in asker.policy.egress] == ["evil.com"]
    assert evaluate_domain(asker.policy, "evil.com").verdict is Verdict.DENY  # always-rule
    assert evaluate_domain(asker.policy, "anything.org").verdict is Verdict.ALLOW  # user default


async def test_asker_policy_is_cached(control: ControlPlane) -> None:
    await activate(control)
    first = control.asker(ip("10.0.0.5"))
    second = control.asker(ip("10.0.0.5"))
    assert first is not None and second is not None
    assert first.policy is not None
    assert first.policy is second.policy
    entry = control.registry.get("u-1")
    assert entry is not None
    assert control.policies.effective_for(entry) is first.policy


async def test_asker_policy_is_refreshed_after_an_in_place_update(control: ControlPlane) -> None:
    await activate(control, policy=ALLOW_ALL)
    before = control.asker(ip("10.0.0.5"))
    assert before is not None and before.policy is not None
    assert evaluate_domain(before.policy, "other.org").verdict is Verdict.ALLOW
    ok(await control.handle(set_binding(policy=ONLY_EXAMPLE, gen=2)))
    after = control.asker(ip("10.0.0.5"))
    assert after is not None and after.policy is not None
    assert after.policy is not before.policy
    assert after.policy == effective_policy(parse_policy(ONLY_EXAMPLE), OLD)
    assert evaluate_domain(after.policy, "other.org").verdict is Verdict.DENY
    assert evaluate_domain(after.policy, "www.example.com").verdict is Verdict.ALLOW
    assert after.fence == FENCE


async def test_failed_in_place_update_keeps_the_old_policy_for_dns(control: ControlPlane, tx: FakeTx) -> None:
    await activate(control, policy=ALLOW_ALL)
    tx.fail(op="static_apply", kinds=("batch",), times=None)
    result = await control.handle(set_binding(policy=ONLY_EXAMPLE, gen=2))
    assert result.status == 500
    assert "u-1" in control.revoking()  # retried by egressd itself (docs/reference/behaviour.md §14.6)
    asker = control.asker(ip("10.0.0.5"))
    assert asker is not None and asker.policy is not None
    assert evaluate_domain(asker.policy, "other.org").verdict is Verdict.ALLOW


async def test_asker_after_revert_and_removal(control: ControlPlane) -> None:
    await activate(control)
    ok(await control.handle(set_binding(policy=None)))
    assert control.asker(ip("10.0.0.5")) == Asker("u-1", FENCE, None)
    ok(await control.handle(remove()))
    assert control.asker(ip("10.0.0.5")) is None


async def test_effective_for_is_none_unless_active(control: ControlPlane) -> None:
    ok(await control.handle(set_binding()))
    entry = control.registry.get("u-1")
    assert entry is not None and entry.state is State.DENYING
    assert control.policies.effective_for(entry) is None


async def test_uid_for(control: ControlPlane) -> None:
    ok(await control.handle(set_binding()))
    assert control.learning.uid_for(ip("10.0.0.5")) == "u-1"
    assert control.learning.uid_for(ip("10.0.0.9")) is None


# --------------------------------------------------------------------------- learn


LEASES = [(ip("93.184.216.34"), 90), (ip("2606:2800::1"), 60), (ip("93.184.216.35"), 360)]


async def test_learn_adds_timed_elements_for_an_active_subject(control: ControlPlane, tx: FakeTx) -> None:
    await activate(control)
    tx.clear()
    start = time.monotonic()
    await control.learn("u-1", FENCE, LEASES, "www.example.com")
    assert [op for op, _ in tx.batches] == ["dynamic_add"]
    (batch,) = tx.ops("dynamic_add")
    assert batch == dyn_add(TABLE, "s_u_1", LEASES)
    assert set(batch.ops) == {
        AddTimed("subj_s_u_1_dyn_v4", "v4", ((ip("93.184.216.34"), 90), (ip("93.184.216.35"), 360))),
        AddTimed("subj_s_u_1_dyn_v6", "v6", ((ip("2606:2800::1"), 60),)),
    }
    assert tx.scripts == []
    live = mirror(control)
    assert set(live) == {addr for addr, _ in LEASES}
    for addr, seconds in LEASES:
        assert start + seconds <= live[addr] <= time.monotonic() + seconds


async def test_learn_keeps_the_later_expiry_in_the_mirror(control: ControlPlane) -> None:
    await activate(control)
    addr = ip("93.184.216.34")
    await control.learn("u-1", FENCE, [(addr, 360)], "www.example.com")
    long = mirror(control)[addr]
    await control.learn("u-1", FENCE, [(addr, 60)], "www.example.com")
    # Never shortened; the kernel element gets the remaining lifetime rounded up to a second.
    assert long <= mirror(control)[addr] <= long + 1


@pytest.mark.parametrize(
    "fence",
    [Fence("r0", "a1"), Fence("r1", "a0"), Fence("r2", "a2")],
    ids=["old-instance", "old-attachment", "other"],
)
async def test_learn_with_a_stale_fence_adds_nothing(control: ControlPlane, tx: FakeTx, fence: Fence) -> None:
    await activate(control)
    tx.clear()
    await control.learn("u-1", fence, LEASES)
    assert tx.batches == []
    assert mirror(control) == {}


async def test_learn_for_a_denying_subject_adds_nothing(control: ControlPlane, tx: FakeTx) -> None:
    ok(await control.handle(set_binding()))
    tx.clear()
    await control.learn("u-1", FENCE, LEASES)
    assert tx.batches == []
    assert mirror(control) == {}


async def test_learn_for_a_removed_or_unknown_subject_adds_nothing(control: ControlPlane, tx: FakeTx) -> None:
    await activate(control)
    ok(await control.handle(remove()))
    tx.clear()
    await control.learn("u-1", FENCE, LEASES)
    await control.learn("never", FENCE, LEASES)
    assert tx.batches == []
    assert "u-1" not in control.leases


async def test_learn_after_a_revert_adds_nothing(control: ControlPlane, tx: FakeTx) -> None:
    await activate(control)
    ok(await control.handle(set_binding(policy=None)))
    tx.clear()
    await control.learn("u-1", FENCE, LEASES)
    assert tx.batches == []


async def test_learn_failure_propagates_and_leaves_the_mirror(control: ControlPlane, tx: FakeTx) -> None:
    await activate(control)
    tx.fail(op="dynamic_add", kinds=("batch",), times=None)
    with pytest.raises(NftError):
        await control.learn("u-1", FENCE, LEASES, "www.example.com")
    assert mirror(control) == {}


async def test_revert_clears_the_lease_mirror(control: ControlPlane) -> None:
    await activate(control)
    await control.learn("u-1", FENCE, LEASES, "www.example.com")
    assert mirror(control)
    ok(await control.handle(set_binding(policy=None)))
    assert mirror(control) == {}


async def test_rebind_clears_the_lease_mirror(control: ControlPlane) -> None:
    await activate(control)
    await control.learn("u-1", FENCE, LEASES, "www.example.com")
    ok(await control.handle(set_binding(rid="r2")))
    assert mirror(control) == {}


async def test_removal_clears_the_lease_mirror(control: ControlPlane) -> None:
    await activate(control)
    await control.learn("u-1", FENCE, LEASES, "www.example.com")
    ok(await control.handle(remove()))
    assert "u-1" not in control.leases


async def test_in_place_update_keeps_the_lease_mirror(control: ControlPlane) -> None:
    await activate(control)
    await control.learn("u-1", FENCE, LEASES, "www.example.com")
    before = mirror(control)
    ok(await control.handle(set_binding(policy=ONLY_EXAMPLE, gen=2)))
    assert mirror(control) == before  # www.example.com is still allowed


async def test_learn_is_per_subject(control: ControlPlane, tx: FakeTx) -> None:
    await activate(control, "u-1", "10.0.0.5")
    await activate(control, "u-2", "10.0.0.6")
    tx.clear()
    await control.learn("u-2", FENCE, LEASES[:1], "www.example.com")
    (batch,) = tx.ops("dynamic_add")
    assert touches(batch, "s_u_2") and not touches(batch, "s_u_1")
    assert "u-1" not in control.leases


# --------------------------------------------------------------------------- renew_leases


async def test_renew_leases_re_adds_with_the_given_timeout(control: ControlPlane, tx: FakeTx) -> None:
    await activate(control)
    addrs = [ip("93.184.216.34"), ip("2606:2800::1")]
    await control.learn("u-1", FENCE, [(a, 60) for a in addrs], "www.example.com")
    tx.clear()
    await control.renew_leases("u-1", [*addrs, ip("10.9.9.9")], 360)  # 10.9.9.9: never learned
    (batch,) = tx.ops("dynamic_add")
    assert batch == dyn_add(TABLE, "s_u_1", [(a, 360) for a in addrs])
    assert set(mirror(control)) == set(addrs)


async def test_renew_leases_for_unknown_or_denying_subject_does_nothing(
    control: ControlPlane, tx: FakeTx
) -> None:
    await control.renew_leases("nobody", [ip("1.2.3.4")], 360)
    ok(await control.handle(set_binding()))
    tx.clear()
    await control.renew_leases("u-1", [ip("1.2.3.4")], 360)
    assert tx.batches == []


# --------------------------------------------------------------------------- set_always_rules


async def test_set_always_rules_is_one_batch_over_all_active_subjects(
    control: ControlPlane, tx: FakeTx
) -> None:
    await activate(control, "u-1", "10.0.0.5", ALLOW_ALL)
    await activate(control, "u-2", "10.0.0.6", ONLY_EXAMPLE)
    ok(await control.handle(set_binding("u-3", ALLOW_ALL, ip_="10.0.0.7")))  # denying
    tx.clear()
    await control.set_always_rules(NEW)
    assert len(tx.batches) == 1
    op, batch = tx.batches[0]
    assert op == "static_apply"
    # Each subject's static swap, then its dyn sets emptied and refilled with what survives
    # (none learned here), all in the one batch (docs/reference/behaviour.md §14.1).
    assert batch == (
        policy_swap(TABLE, "s_u_1", effective_policy(parse_policy(ALLOW_ALL), NEW), audit_objects=False)
        + dyn_replace(TABLE, "s_u_1", [], ranges=False)
        + policy_swap(TABLE, "s_u_2", effective_policy(parse_policy(ONLY_EXAMPLE), NEW), audit_objects=False)
        + dyn_replace(TABLE, "s_u_2", [], ranges=False)
    )
    assert not touches(batch, "s_u_3")
    assert tx.scripts == []
    deny_v4 = [o for o in batch.ops if isinstance(o, AddIntervals) and o.name == "subj_s_u_1_deny_v4"]
    assert [str(n) for o in deny_v4 for n in o.nets] == ["1.2.3.4/32"]
    assert control.always is NEW


async def test_set_always_rules_changes_what_dns_sees(control: ControlPlane) -> None:
    await activate(control, policy=ALLOW_ALL)
    before = control.asker(ip("10.0.0.5"))
    assert before is not None and before.policy is not None
    assert evaluate_domain(before.policy, "worse.com").verdict is Verdict.ALLOW
    await control.set_always_rules(NEW)
    after = control.asker(ip("10.0.0.5"))
    assert after is not None and after.policy is not None
    assert after.policy == effective_policy(parse_policy(ALLOW_ALL), NEW)
    assert evaluate_domain(after.policy, "worse.com").verdict is Verdict.DENY
    again = control.asker(ip("10.0.0.5"))
    assert again is not None and again.policy is after.policy


async def test_set_always_rules_refused_by_the_kernel_keeps_the_old_rules(
    control: ControlPlane, tx: FakeTx
) -> None:
    await activate(control, "u-1", "10.0.0.5")
    await activate(control, "u-2", "10.0.0.6")
    tx.clear()
    tx.fail(op="static_apply", kinds=("batch",), times=None)
    with pytest.raises(NftError):
        await control.set_always_rules(NEW)
    assert control.always is OLD
    assert tx.batches == []
    asker = control.asker(ip("10.0.0.5"))
    assert asker is not None and asker.policy is not None
    assert asker.policy == effective_policy(parse_policy(ALLOW_ALL), OLD)
    assert evaluate_domain(asker.policy, "worse.com").verdict is Verdict.ALLOW
    # A later retry succeeds in one batch.
    tx.heal()
    await control.set_always_rules(NEW)
    assert control.always is NEW
    assert len(tx.batches) == 1


async def test_set_always_rules_without_active_subjects_issues_no_batch(tx: FakeTx) -> None:
    control = await make_control(tx, always=EMPTY_ALWAYS)
    ok(await control.handle(set_binding()))  # denying only
    tx.clear()
    await control.set_always_rules(NEW)
    assert tx.batches == []
    assert control.always is NEW


async def test_activation_after_set_always_rules_uses_the_new_rules(
    control: ControlPlane, tx: FakeTx
) -> None:
    ok(await control.handle(set_binding()))
    await control.set_always_rules(NEW)
    tx.clear()
    ok(await control.handle(hook()))
    assert tx.ops("static_apply") == [
        policy_swap(TABLE, "s_u_1", effective_policy(parse_policy(ALLOW_ALL), NEW), audit_objects=False, known_empty=True)
    ]


async def test_activation_racing_an_always_rules_swap_ends_on_the_new_rules(
    control: ControlPlane, tx: FakeTx
) -> None:
    await activate(control, "u-1", "10.0.0.5")
    ok(await control.handle(set_binding("u-2", ALLOW_ALL, ip_="10.0.0.6")))  # denying, pending
    tx.hold(lambda op, batch: op == "static_apply" and batch is not None and touches(batch, "s_u_2"))
    activation = asyncio.create_task(control.handle(hook("u-2")))
    await asyncio.wait_for(tx.entered.wait(), 2)  # u-2's activation is in the kernel now
    swap = asyncio.create_task(control.set_always_rules(NEW))
    await asyncio.sleep(0.01)
    tx.release()
    ok(await asyncio.wait_for(activation, 2))
    await asyncio.wait_for(swap, 2)
    assert control.always is NEW
    last_for_u2 = [b for b in tx.ops("static_apply") if touches(b, "s_u_2")][-1]
    expected = policy_swap(TABLE, "s_u_2", effective_policy(parse_policy(ALLOW_ALL), NEW), audit_objects=False, known_empty=True)
    assert all(op in last_for_u2.ops for op in expected.ops)


# --------------------------------------------------------------------------- MITM destination check

STATIC = (
    '{"defaultAction":"allow","egress":[{"action":"allow","target":"api.example.com"},'
    '{"action":"allow","target":"10.9.0.0/24"},{"action":"deny","target":"10.9.0.7"}]}'
)


async def test_destination_verified_only_for_the_learned_name(control: ControlPlane) -> None:
    await activate(control, policy=STATIC)
    src, dst = ip("10.0.0.5"), ip("93.184.216.34")
    assert not control.destination_verified(src, "api.example.com", dst)
    await control.learn("u-1", FENCE, [(dst, 90)], "API.Example.com.")
    assert control.destination_verified(src, "api.example.com", dst)
    assert control.destination_verified(src, "API.EXAMPLE.COM.", dst)
    assert not control.destination_verified(src, "other.example.com", dst), "learned for another name"
    assert not control.destination_verified(src, "api.example.com", ip("93.184.216.35"))
    # defaultAction allow does not make every address a verified destination; explicit rules do.
    assert not control.destination_verified(src, "api.example.com", ip("1.1.1.1"))
    assert control.destination_verified(src, "anything.test", ip("10.9.0.5"))
    assert not control.destination_verified(src, "anything.test", ip("10.9.0.7")), "deny beats allow"
    # Another sandbox, or an unknown source, never borrows it.
    assert not control.destination_verified(ip("10.0.0.6"), "api.example.com", dst)


async def test_destination_learned_names_expire_and_follow_the_lifecycle(control: ControlPlane) -> None:
    await activate(control, policy=STATIC)
    src, dst = ip("10.0.0.5"), ip("93.184.216.34")
    await control.learn("u-1", FENCE, [(dst, 60)], "api.example.com")
    lease = control.leases["u-1"]._leases[dst]
    lease.names["api.example.com"] = time.monotonic() - 1  # the name's lease ran out
    assert not control.destination_verified(src, "api.example.com", dst)
    lease.names["api.example.com"] = time.monotonic() + 5
    # Connection refresh (no name) extends the names an address was learned for.
    await control.renew_leases("u-1", [dst], 360)
    assert lease.names["api.example.com"] > time.monotonic() + 300
    assert control.destination_verified(src, "api.example.com", dst)
    # A rebind forgets them.
    ok(await control.handle(set_binding("u-1", STATIC, rid="r2")))
    assert "u-1" not in control.leases
    assert not control.destination_verified(src, "api.example.com", dst)


def fake_conntrack(
    monkeypatch: pytest.MonkeyPatch, src: str, dsts: tuple[str, ...]
) -> list[tuple[IPAddress, IPAddress]]:
    """Established flows src -> each dst in the conntrack table; returns the list of flows cut."""
    import egressd.fleetnft.backend as backend_mod

    lines = [
        f"ipv4 2 tcp 6 100 ESTABLISHED src={src} dst={d} sport=1 dport=443 src={d} dst={src}" for d in dsts
    ]

    async def flows(sources: Collection[IPAddress]) -> dict[IPAddress, set[conntrack.Dest]]:
        return conntrack.flow_dests_from(lines, sources)

    cut: list[tuple[IPAddress, IPAddress]] = []

    async def flush(s: IPAddress, d: IPAddress, _proto: str = "", _port: int | None = None) -> None:
        cut.append((s, d))

    monkeypatch.setattr(backend_mod, "read_flow_dests", flows)
    monkeypatch.setattr(backend_mod, "flush_flow", flush)
    return cut


async def test_in_place_audit_change_cuts_only_hard_denied_flows(
    control: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    audit = '{"defaultAction":"deny","mode":"audit","egress":[{"action":"allow","target":"1.1.1.1"}]}'
    await activate(control, policy=audit)
    cut = fake_conntrack(monkeypatch, "10.0.0.5", ("1.1.1.1", "8.8.8.8", "1.2.3.4"))
    # Still audit after the change: 8.8.8.8 is only would-deny (passes, not cut); 1.2.3.4 is
    # denied by deny.always (hard, cut).
    control.policies.always = NEW
    entry = control.registry.get("u-1")
    assert entry is not None
    effective = control.policies.effective(parse_policy(audit))
    await control.flows.cut_disallowed("u-1", frozenset({(ip("10.0.0.5"), ip("10.0.0.1"))}), effective)
    assert cut == [(ip("10.0.0.5"), ip("1.2.3.4"))]


async def test_always_rules_reload_cuts_flows_to_newly_denied_destinations(
    tx: FakeTx, monkeypatch: pytest.MonkeyPatch
) -> None:
    control = ControlPlane(
        FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353), tx),
        always=OLD,
        conntrack_flush=lambda ip: None,
    )
    await control.reset_table()
    await activate(control, policy=ALLOW_ALL)
    cut = fake_conntrack(monkeypatch, "10.0.0.5", ("1.2.3.4", "8.8.8.8"))
    await control.set_always_rules(NEW)  # NEW adds 1.2.3.4 to deny.always
    for _ in range(50):
        if cut:
            break
        await asyncio.sleep(0.01)
    assert cut == [(ip("10.0.0.5"), ip("1.2.3.4"))], "only the newly always-denied flow is cut"


# --------------------------------------------------------------------------- group commit


async def test_concurrent_learns_of_a_subject_go_in_one_batch_each_released_after_it(
    control: ControlPlane, tx: FakeTx
) -> None:
    await activate(control)
    tx.clear()
    tx.hold(lambda op, batch: op == "dynamic_add")
    first = asyncio.create_task(control.learn("u-1", FENCE, [(ip("93.184.216.1"), 90)], "a.example.com"))
    await tx.entered.wait()
    rest = [
        asyncio.create_task(control.learn("u-1", FENCE, [(ip(f"93.184.216.{n}"), 90)], f"n{n}.example.com"))
        for n in (2, 3, 4)
    ]
    for _ in range(10):
        await asyncio.sleep(0)
    assert not any(t.done() for t in [first, *rest])  # no answer before its transaction
    tx.release()
    assert await first == [ip("93.184.216.1")]
    assert [await t for t in rest] == [[ip(f"93.184.216.{n}")] for n in (2, 3, 4)]
    batches = tx.ops("dynamic_add")
    assert len(batches) == 2
    assert batches[1] == dyn_add(TABLE, "s_u_1", [(ip(f"93.184.216.{n}"), 90) for n in (2, 3, 4)])
    assert set(mirror(control)) == {ip(f"93.184.216.{n}") for n in (1, 2, 3, 4)}


async def test_a_refused_batch_fails_every_learn_in_it_and_records_nothing(
    control: ControlPlane, tx: FakeTx
) -> None:
    await activate(control)
    tx.clear()
    tx.fail(op="dynamic_add", kinds=("batch",), times=None)
    tasks = [
        asyncio.create_task(control.learn("u-1", FENCE, [(ip(f"93.184.216.{n}"), 90)], f"n{n}.example.com"))
        for n in (1, 2, 3)
    ]
    for task in tasks:
        with pytest.raises(NftError):
            await task
    assert mirror(control) == {}
