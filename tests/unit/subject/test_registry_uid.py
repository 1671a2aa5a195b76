"""The registry's host-uid index (docs/reference/behaviour.md §17): by host uid, by slot, claims and slots in use."""

from __future__ import annotations

from ipaddress import ip_address

from egressd.policy import parse_policy
from egressd.subject.model import Fence
from egressd.subject.registry import (
    AddKeys,
    Binding,
    DropStaleKeys,
    Entry,
    HostBinding,
    InstallDenyFirst,
    KernelView,
    Registry,
    SetBindingRequest,
    State,
    plan_set_binding,
)

FENCE = Fence("r1", "a1")
POLICY = parse_policy('{"defaultAction":"deny"}')


def entry(uid: str, binding: Binding | HostBinding | None, state: State = State.DENYING) -> Entry:
    return Entry(uid, FENCE, state, binding, policy=POLICY if state is State.ACTIVE else None)


def test_index_by_host_uid_and_slot_follows_put_and_drop() -> None:
    reg = Registry()
    reg.put(entry("u-1", HostBinding(100001, 3)))
    assert reg.resolve_host_uid(100001) is not None and reg.resolve_slot(3) is not None
    assert reg.resolve(ip_address("10.0.0.5")) is None
    # Re-keyed to another uid on the same slot: the old uid no longer resolves.
    reg.put(entry("u-1", HostBinding(100002, 3)))
    assert reg.resolve_host_uid(100001) is None
    assert reg.resolve_slot(3) == reg.resolve_host_uid(100002)
    # And to a network binding: neither uid nor slot resolves any more.
    reg.put(entry("u-1", Binding(ip_address("10.0.0.5"), ip_address("10.0.0.1"))))
    assert reg.resolve_slot(3) is None and reg.resolve_host_uid(100002) is None
    assert reg.resolve(ip_address("10.0.0.5")) is not None
    reg.put(entry("u-1", HostBinding(100002, 3)))
    reg.drop("u-1")
    assert reg.resolve_slot(3) is None and reg.resolve_host_uid(100002) is None


def test_claims_of_a_host_uid() -> None:
    reg = Registry()
    reg.put(entry("u-1", HostBinding(100001, 0)))
    assert reg.check_claims("u-1", HostBinding(100001, 0)) is None
    assert "host uid 100001 already dispatches" in (reg.check_claims("u-2", HostBinding(100001, 1)) or "")
    # Still installed in the kernel for another subject (its removal failed half-way).
    reg.drop("u-1")
    reg.set_kernel("u-1", KernelView(objects=True, uid_keys=frozenset({(100001, 0)})))
    assert "still installed" in (reg.check_claims("u-2", HostBinding(100001, 1)) or "")
    assert reg.check_claims("u-2", HostBinding(100002, 1)) is None


def test_slots_in_use_count_the_kernel_too() -> None:
    reg = Registry()
    reg.put(entry("u-1", HostBinding(100001, 0)))
    reg.set_kernel("u-2", KernelView(objects=True, uid_keys=frozenset({(100002, 2)})))
    assert reg.slots_in_use() == {0, 2}
    assert reg.slots_in_use(excluding="u-1") == {2}


def test_plans_are_the_same_for_uid_bindings() -> None:
    host = HostBinding(100001, 0)
    new = plan_set_binding(None, SetBindingRequest("u-1", FENCE, 1, host, POLICY))
    assert new.steps == (InstallDenyFirst(host),)
    active = entry("u-1", host, State.ACTIVE)
    moved = HostBinding(100002, 0)
    rekey = plan_set_binding(active, SetBindingRequest("u-1", FENCE, 2, moved, POLICY))
    assert rekey.steps[:2] == (DropStaleKeys(None), AddKeys(moved))
    same = plan_set_binding(active, SetBindingRequest("u-1", FENCE, 2, host, POLICY))
    assert not any(isinstance(s, AddKeys | DropStaleKeys) for s in same.steps), "no re-key: applied in place"
