"""§2 subject registry: the pure plan_* transition functions row by row, and the Registry index."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address, ip_address

import pytest

from egressd.policy import DENY_ALL, NetworkPolicy, parse_policy
from egressd.subject.model import Fence, nft_id, subject_for_uid
from egressd.subject.registry import (
    AddKeys,
    ApplyPolicy,
    Binding,
    DropStaleKeys,
    Entry,
    InstallDenyFirst,
    KernelView,
    Plan,
    Registry,
    RemoveAll,
    SetBindingRequest,
    State,
    plan_data_plane_ready,
    plan_hook_fence,
    plan_remove,
    plan_set_binding,
)
from egressd.subject.registry import (
    PlanOutcome as Outcome,
)

UID = "u-1"
FENCE = Fence("r1", "a1")
OTHER_FENCE = Fence("r2", "a2")
IP = ip_address("10.0.0.5")
GW = ip_address("10.0.0.1")
BINDING = Binding(IP, GW)
NEW_BINDING = Binding(ip_address("10.0.0.6"), GW)

P_OLD = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"old.example.com"}]}')
P_NEW = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"new.example.com"}]}')
P_ALLOW = parse_policy('{"defaultAction":"allow"}')


def req(
    policy: NetworkPolicy | None,
    *,
    binding: Binding | None = BINDING,
    fence: Fence = FENCE,
    gen: int = 1,
    uid: str = UID,
) -> SetBindingRequest:
    return SetBindingRequest(uid, fence, gen, binding, policy)


def denying(pending: NetworkPolicy | None = P_OLD, *, binding: Binding | None = BINDING) -> Entry:
    return Entry(UID, FENCE, State.DENYING, binding, 1, pending=pending)


def active(policy: NetworkPolicy = P_OLD, *, binding: Binding | None = BINDING) -> Entry:
    return Entry(UID, FENCE, State.ACTIVE, binding, 1, policy=policy)


def assert_closed_on_failure(plan: Plan) -> None:
    """Rows whose steps include a deny-first install: a failure leaves the subject denying."""
    assert plan.on_failure is not None
    assert plan.on_failure.state is State.DENYING
    assert plan.on_failure.policy is None


# --------------------------------------------------------------------------- nft id / subject


@pytest.mark.parametrize(
    ("uid", "expected"),
    [("u-1", "s_u_1"), ("abc:def", "s_abc_def"), ("UPPER.Case", "s_upper_case"), ("a_b", "s_a_b")],
)
def test_nft_id(uid: str, expected: str) -> None:
    assert subject_for_uid(uid) == "s-" + uid
    assert nft_id(subject_for_uid(uid)) == expected


def test_entry_subject_and_nft_id() -> None:
    e = denying()
    assert e.subject == "s-u-1"
    assert e.nft_id == "s_u_1"


# --------------------------------------------------------------------------- SET_BINDING, absent


def test_absent_string_installs_deny_first_and_parks_the_policy() -> None:
    plan = plan_set_binding(None, req(P_NEW))
    assert plan.outcome is Outcome.OK
    assert plan.steps == (InstallDenyFirst(BINDING),)
    assert plan.on_success == Entry(UID, FENCE, State.DENYING, BINDING, 1, pending=P_NEW, policy=None)
    assert not plan.rebind
    assert_closed_on_failure(plan)
    # A failed first install registers the subject (so the retry resumes) with nothing pending.
    assert plan.on_failure == replace(plan.on_success, pending=None)


def test_absent_null_with_attachment_installs_deny_first_with_nothing_pending() -> None:
    plan = plan_set_binding(None, req(None))
    assert plan.outcome is Outcome.OK
    assert plan.steps == (InstallDenyFirst(BINDING),)
    assert plan.on_success is not None
    assert plan.on_success.state is State.DENYING
    assert plan.on_success.pending is None
    assert plan.on_success.policy is None
    assert_closed_on_failure(plan)


def test_absent_null_without_attachment_is_a_noop() -> None:
    plan = plan_set_binding(None, req(None, binding=None))
    assert plan.outcome is Outcome.NOOP
    assert plan.steps == ()
    assert plan.on_success is None


def test_absent_deny_all_string_is_pending_deny_all() -> None:
    plan = plan_set_binding(None, req(parse_policy("")))
    assert plan.on_success is not None
    assert plan.on_success.pending == DENY_ALL


# --------------------------------------------------------------------------- SET_BINDING, denying


def test_denying_same_fence_reruns_deny_first_and_replaces_pending() -> None:
    plan = plan_set_binding(denying(P_OLD), req(P_NEW, gen=2))
    assert plan.outcome is Outcome.OK
    assert plan.steps == (InstallDenyFirst(BINDING), DropStaleKeys(BINDING))
    assert plan.on_success is not None
    assert plan.on_success.state is State.DENYING
    assert plan.on_success.pending == P_NEW
    assert plan.on_success.policy is None
    assert plan.on_success.spec_generation == 2
    assert not plan.rebind
    assert_closed_on_failure(plan)
    assert plan.on_failure is not None
    assert plan.on_failure.fence == FENCE


def test_denying_same_fence_null_clears_pending() -> None:
    plan = plan_set_binding(denying(P_OLD), req(None))
    assert plan.steps[0] == InstallDenyFirst(BINDING)
    assert plan.on_success is not None
    assert plan.on_success.pending is None
    assert plan.on_success.state is State.DENYING


def test_denying_same_fence_null_without_attachment_keeps_binding() -> None:
    plan = plan_set_binding(denying(P_OLD), req(None, binding=None))
    assert plan.steps == (InstallDenyFirst(BINDING), DropStaleKeys(BINDING))
    assert plan.on_success is not None
    assert plan.on_success.binding == BINDING


def test_denying_same_fence_new_ip_installs_new_key_then_drops_the_old() -> None:
    plan = plan_set_binding(denying(P_OLD), req(P_NEW, binding=NEW_BINDING))
    assert plan.steps == (InstallDenyFirst(NEW_BINDING), DropStaleKeys(NEW_BINDING))
    assert plan.on_success is not None
    assert plan.on_success.binding == NEW_BINDING
    assert_closed_on_failure(plan)


# --------------------------------------------------------------------------- data-plane-ready


def test_data_plane_ready_with_pending_activates() -> None:
    entry = denying(P_NEW)
    plan = plan_data_plane_ready(entry, FENCE, kernel_objects=True)
    assert plan.outcome is Outcome.OK
    assert plan.steps == (ApplyPolicy(P_NEW),)
    assert plan.on_success == replace(entry, state=State.ACTIVE, policy=P_NEW, pending=None)
    # Failure keeps the pending policy so the retried hook succeeds.
    assert plan.on_failure == entry


def test_data_plane_ready_without_kernel_objects_installs_deny_first_first() -> None:
    entry = denying(P_NEW)
    plan = plan_data_plane_ready(entry, FENCE, kernel_objects=False)
    assert plan.steps == (InstallDenyFirst(BINDING), ApplyPolicy(P_NEW))
    assert plan.on_failure == entry
    assert plan.on_failure.state is State.DENYING


def test_data_plane_ready_without_pending_while_denying_is_409() -> None:
    plan = plan_data_plane_ready(denying(None), FENCE, kernel_objects=True)
    assert plan.outcome is Outcome.CONFLICT
    assert plan.steps == ()


def test_data_plane_ready_without_pending_while_active_is_idempotent() -> None:
    plan = plan_data_plane_ready(active(), FENCE, kernel_objects=True)
    assert plan.outcome is Outcome.NOOP
    assert plan.steps == ()


@pytest.mark.parametrize("hook", ["runtime-ready", "data-plane-ready"])
def test_hook_for_absent_subject_is_409(hook: str) -> None:
    plan = (
        plan_hook_fence(None, FENCE)
        if hook == "runtime-ready"
        else plan_data_plane_ready(None, FENCE, kernel_objects=False)
    )
    assert plan.outcome is Outcome.CONFLICT
    assert plan.steps == ()


@pytest.mark.parametrize("entry", [denying(P_NEW), active()], ids=["denying", "active"])
@pytest.mark.parametrize("hook", ["runtime-ready", "data-plane-ready"])
def test_hook_with_stale_fence_is_409(entry: Entry, hook: str) -> None:
    plan = (
        plan_hook_fence(entry, OTHER_FENCE)
        if hook == "runtime-ready"
        else plan_data_plane_ready(entry, OTHER_FENCE, kernel_objects=True)
    )
    assert plan.outcome is Outcome.CONFLICT
    assert plan.steps == ()


def test_stale_data_plane_ready_never_consumes_the_new_pending_policy() -> None:
    entry = Entry(UID, OTHER_FENCE, State.DENYING, BINDING, 2, pending=P_NEW)
    plan = plan_data_plane_ready(entry, FENCE, kernel_objects=True)
    assert plan.outcome is Outcome.CONFLICT
    assert plan.on_success is None


@pytest.mark.parametrize(
    "entry", [denying(P_NEW), denying(None), active()], ids=["pending", "empty", "active"]
)
def test_runtime_ready_same_fence_is_a_noop(entry: Entry) -> None:
    plan = plan_hook_fence(entry, FENCE)
    assert plan.outcome is Outcome.NOOP
    assert plan.steps == ()


# --------------------------------------------------------------------------- SET_BINDING, active


def test_active_same_fence_string_applies_in_place() -> None:
    entry = active(P_OLD)
    plan = plan_set_binding(entry, req(P_NEW, gen=7))
    assert plan.outcome is Outcome.OK
    assert plan.steps == (ApplyPolicy(P_NEW),)
    assert plan.on_success == replace(entry, policy=P_NEW, spec_generation=7)
    assert not plan.rebind
    # Kernel first, registry second: a failed apply keeps the old policy in force.
    assert plan.on_failure is not None
    assert plan.on_failure.state is State.ACTIVE
    assert plan.on_failure.policy == P_OLD


def test_spec_generation_is_not_part_of_the_fence() -> None:
    plan = plan_set_binding(active(P_OLD), req(P_NEW, gen=99))
    assert not plan.rebind
    assert not any(isinstance(s, InstallDenyFirst) for s in plan.steps)


def test_active_same_fence_null_reverts_to_deny_first() -> None:
    entry = active(P_OLD)
    plan = plan_set_binding(entry, req(None))
    assert plan.outcome is Outcome.OK
    assert plan.steps[0] == InstallDenyFirst(BINDING)
    assert plan.steps == (InstallDenyFirst(BINDING), DropStaleKeys(BINDING))
    assert plan.on_success is not None
    assert plan.on_success.state is State.DENYING
    assert plan.on_success.policy is None
    assert plan.on_success.pending is None
    assert_closed_on_failure(plan)


def test_active_null_without_attachment_reverts_on_the_registered_binding() -> None:
    plan = plan_set_binding(active(P_OLD), req(None, binding=None))
    assert plan.steps[0] == InstallDenyFirst(BINDING)


def test_active_rekey_drops_old_keys_before_adding_new_ones() -> None:
    entry = active(P_OLD)
    plan = plan_set_binding(entry, req(P_NEW, binding=NEW_BINDING))
    assert plan.outcome is Outcome.OK
    assert plan.steps == (DropStaleKeys(None), AddKeys(NEW_BINDING), ApplyPolicy(P_NEW))
    kinds = [type(s) for s in plan.steps]
    assert kinds.index(DropStaleKeys) < kinds.index(AddKeys)
    assert not any(isinstance(s, InstallDenyFirst) for s in plan.steps)  # policy kept, no reset
    assert plan.on_success is not None
    assert plan.on_success.binding == NEW_BINDING
    assert plan.on_success.state is State.ACTIVE
    assert plan.on_success.policy == P_NEW
    assert plan.on_failure is not None
    assert plan.on_failure.binding == BINDING
    assert plan.on_failure.policy == P_OLD


def test_active_gateway_only_change_is_a_rekey() -> None:
    moved = Binding(IP, ip_address("10.0.0.254"))
    plan = plan_set_binding(active(P_OLD), req(P_OLD, binding=moved))
    assert plan.steps == (DropStaleKeys(None), AddKeys(moved), ApplyPolicy(P_OLD))


# --------------------------------------------------------------------------- rebind


@pytest.mark.parametrize("entry", [denying(P_OLD), active(P_OLD)], ids=["from-denying", "from-active"])
def test_rebind_resets_to_denying_with_the_new_input_pending(entry: Entry) -> None:
    plan = plan_set_binding(entry, req(P_NEW, fence=OTHER_FENCE, binding=NEW_BINDING, gen=3))
    assert plan.outcome is Outcome.OK
    assert plan.rebind
    assert plan.steps == (InstallDenyFirst(NEW_BINDING), DropStaleKeys(NEW_BINDING))
    assert plan.on_success == Entry(UID, OTHER_FENCE, State.DENYING, NEW_BINDING, 3, pending=P_NEW)
    assert plan.on_success.policy is None
    assert_closed_on_failure(plan)
    # Nothing of the old attachment survives a failure either.
    assert plan.on_failure is not None
    assert plan.on_failure.fence == OTHER_FENCE
    assert plan.on_failure.pending is None


@pytest.mark.parametrize("entry", [denying(P_OLD), active(P_OLD)], ids=["from-denying", "from-active"])
def test_rebind_with_null_input_has_nothing_pending(entry: Entry) -> None:
    plan = plan_set_binding(entry, req(None, fence=OTHER_FENCE))
    assert plan.rebind
    assert plan.on_success is not None
    assert plan.on_success.state is State.DENYING
    assert plan.on_success.pending is None
    assert plan.on_success.policy is None


def test_rebind_same_ip_still_reinstalls_deny_first() -> None:
    plan = plan_set_binding(active(P_OLD), req(P_OLD, fence=OTHER_FENCE))
    assert plan.steps[0] == InstallDenyFirst(BINDING)


# --------------------------------------------------------------------------- deny-first failure rows


FAILURE_ROWS = {
    "absent-string": (None, req(P_NEW)),
    "absent-null": (None, req(None)),
    "denying-rerun": (denying(P_OLD), req(P_NEW)),
    "denying-rekey": (denying(P_OLD), req(P_NEW, binding=NEW_BINDING)),
    "active-null": (active(P_OLD), req(None)),
    "rebind-denying": (denying(P_OLD), req(P_NEW, fence=OTHER_FENCE)),
    "rebind-active": (active(P_ALLOW), req(P_ALLOW, fence=OTHER_FENCE, binding=NEW_BINDING)),
}


@pytest.mark.parametrize("row", FAILURE_ROWS.values(), ids=FAILURE_ROWS.keys())
def test_deny_first_failure_keeps_the_subject_denying(row: tuple[Entry | None, SetBindingRequest]) -> None:
    entry, request = row
    plan = plan_set_binding(entry, request)
    assert any(isinstance(s, InstallDenyFirst) for s in plan.steps)
    assert_closed_on_failure(plan)
    assert plan.on_failure is not None
    assert plan.on_failure.uid == UID


def test_failed_data_plane_ready_never_activates() -> None:
    for objects in (True, False):
        plan = plan_data_plane_ready(denying(P_NEW), FENCE, kernel_objects=objects)
        assert plan.on_failure is not None
        assert plan.on_failure.state is State.DENYING
        assert plan.on_failure.policy is None


# --------------------------------------------------------------------------- REMOVE_BINDING


@pytest.mark.parametrize("entry", [denying(P_OLD), active(P_OLD)], ids=["denying", "active"])
def test_remove_same_fence_removes_everything(entry: Entry) -> None:
    plan = plan_remove(entry, FENCE)
    assert plan.outcome is Outcome.OK
    assert plan.steps == (RemoveAll(),)
    assert plan.on_success is None
    assert plan.on_failure == entry  # stays registered so the retry resumes
    assert plan.removed


def test_remove_other_fence_is_ignored() -> None:
    plan = plan_remove(active(P_OLD), OTHER_FENCE)
    assert plan.outcome is Outcome.NOOP
    assert plan.steps == ()
    assert not plan.removed


def test_remove_absent_is_a_noop_that_still_counts_as_removed() -> None:
    plan = plan_remove(None, FENCE)
    assert plan.outcome is Outcome.NOOP
    assert plan.steps == ()
    assert plan.removed


# --------------------------------------------------------------------------- Registry


def entry_for(uid: str, ip: str | None, *, gw: str = "10.0.0.1", state: State = State.DENYING) -> Entry:
    binding = None if ip is None else Binding(ip_address(ip), ip_address(gw))
    return Entry(uid, FENCE, state, binding)


def test_registry_resolve_by_ip() -> None:
    reg = Registry()
    a = entry_for("a", "10.0.0.5")
    b = entry_for("b", "fd00::5", gw="fd00::1")
    reg.put(a)
    reg.put(b)
    assert reg.resolve(IPv4Address("10.0.0.5")) == a
    assert reg.resolve(ip_address("fd00::5")) == b
    assert reg.resolve(ip_address("10.0.0.99")) is None
    assert reg.get("a") == a
    assert reg.get("zzz") is None
    assert len(reg) == 2
    assert {e.uid for e in reg} == {"a", "b"}


def test_registry_put_rekey_moves_the_ip_index() -> None:
    reg = Registry()
    reg.put(entry_for("a", "10.0.0.5"))
    moved = entry_for("a", "10.0.0.6", state=State.ACTIVE)
    reg.put(moved)
    assert reg.resolve(ip_address("10.0.0.5")) is None
    assert reg.resolve(ip_address("10.0.0.6")) == moved
    assert len(reg) == 1
    # The old address is free for another sandbox (nothing left in the kernel view either).
    assert reg.check_claims("b", Binding(ip_address("10.0.0.5"), GW)) is None


def test_registry_put_without_binding_keeps_no_ip() -> None:
    reg = Registry()
    reg.put(entry_for("a", None))
    assert reg.get("a") is not None
    assert reg.resolve(IP) is None


def test_registry_drop_clears_every_index() -> None:
    reg = Registry()
    reg.put(entry_for("a-b", "10.0.0.5"))
    reg.drop("a-b")
    assert reg.get("a-b") is None
    assert reg.resolve(IP) is None
    assert len(reg) == 0
    # Both the ip and the nft id are free again.
    assert reg.check_claims("a_b", BINDING) is None
    reg.drop("a-b")  # idempotent
    reg.drop("never-there")


def test_registry_drop_does_not_steal_another_subjects_ip() -> None:
    reg = Registry()
    reg.put(entry_for("a", "10.0.0.5"))
    reg.put(entry_for("a", "10.0.0.6"))
    reg.put(entry_for("b", "10.0.0.5"))
    reg.drop("a")
    assert reg.resolve(ip_address("10.0.0.5")) == reg.get("b")


def test_check_claims_same_ip_for_another_uid() -> None:
    reg = Registry()
    reg.put(entry_for("a", "10.0.0.5"))
    why = reg.check_claims("b", BINDING)
    assert why is not None
    assert "10.0.0.5" in why
    assert reg.check_claims("a", BINDING) is None  # its own key
    assert reg.check_claims("b", NEW_BINDING) is None
    assert reg.check_claims("b", None) is None


def test_check_claims_nft_id_collision() -> None:
    reg = Registry()
    reg.put(entry_for("a-b", "10.0.0.5"))
    why = reg.check_claims("a_b", NEW_BINDING)
    assert why is not None
    assert "a-b" in why
    assert reg.check_claims("a_b", None) is not None
    assert reg.check_claims("A-B", None) is not None  # lower-cased ids collide too
    assert reg.check_claims("a-b", BINDING) is None


def test_check_claims_ip_still_installed_for_another_uid() -> None:
    reg = Registry()
    reg.put(entry_for("a", "10.0.0.6"))
    # "a" moved to .6 in the registry but its old key .5 is still in the kernel.
    reg.set_kernel("a", KernelView(True, frozenset({(IP, GW), (ip_address("10.0.0.6"), GW)})))
    why = reg.check_claims("b", BINDING)
    assert why is not None
    assert "10.0.0.5" in why


def test_kernel_views_and_gateway_in_use() -> None:
    reg = Registry()
    assert reg.kernel("a") == KernelView()
    assert not reg.kernel("a").objects
    view_a = KernelView(True, frozenset({(IP, GW)}))
    reg.set_kernel("a", view_a)
    assert reg.kernel("a") == view_a
    assert reg.gateway_in_use(GW, excluding="b")
    assert not reg.gateway_in_use(GW, excluding="a")
    assert not reg.gateway_in_use(ip_address("10.9.9.9"), excluding="b")
    assert reg.ip_in_use(IP, excluding="b")
    assert not reg.ip_in_use(IP, excluding="a")

    reg.set_kernel("b", KernelView(True, frozenset({(ip_address("10.0.0.6"), GW)})))
    assert reg.gateway_in_use(GW, excluding="a")  # still used by b

    reg.set_kernel("a", KernelView())  # empty view forgets the subject
    assert reg.kernel("a") == KernelView()
    assert not reg.ip_in_use(IP, excluding="b")
    reg.set_kernel("b", KernelView(True))  # objects but no keys: gateway unused
    assert not reg.gateway_in_use(GW, excluding="x")


def test_registry_counts() -> None:
    reg = Registry()
    assert reg.counts() == {State.DENYING: 0, State.ACTIVE: 0}
    reg.put(entry_for("a", "10.0.0.5"))
    reg.put(entry_for("b", "10.0.0.6", state=State.ACTIVE))
    reg.put(entry_for("c", "10.0.0.7", state=State.ACTIVE))
    assert reg.counts() == {State.DENYING: 1, State.ACTIVE: 2}
