"""docs/behaviour.md §20.2: the attachments' hostVeths in the kernel's set ``sandbox_ifaces``, in
the subject's own transactions, against the text fake kernel."""

from __future__ import annotations

import json
from typing import Any

import pytest

from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION, RemoveBinding, SetBinding, parse_action
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from tests.unit.fakekernel import TextKernel, text_kernel

POLICY = '{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.8"}]}'


def set_binding(uid: str, ip: str, veth: str, *, rid: str = "r1") -> SetBinding:
    net: dict[str, Any] = {"ip": ip, "gateway": "10.0.0.1", "hostVeth": veth}
    doc = {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"specGeneration": 1, "runtimeInstanceId": rid, "attachmentId": "a1"},
        "binding": {"input": POLICY},
        "attachment": {"network": net},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, SetBinding)
    return action


def remove(uid: str, *, rid: str = "r1") -> RemoveBinding:
    doc = {
        "apiVersion": API_VERSION,
        "operation": "REMOVE_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": "a1"},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, RemoveBinding)
    return action


async def ok(control: ControlPlane, action: SetBinding | RemoveBinding) -> None:
    res = await control.handle(action)
    assert res is None or getattr(res, "status", 200) == 200, res


@pytest.fixture
def kernel() -> TextKernel:
    return text_kernel("T")


@pytest.fixture
async def control(kernel: TextKernel) -> ControlPlane:
    c = ControlPlane(FleetPlanKernel(TableConfig(table="T", dns_port=15353), kernel))
    await c.reset_table()
    return c


def ifaces(kernel: TextKernel) -> set[str]:
    return {k.strip('"') for k in kernel.elements("sandbox_ifaces")}


async def test_a_subjects_host_veth_is_in_the_set_while_it_is_registered(
    control: ControlPlane, kernel: TextKernel
) -> None:
    mark = kernel.mark()
    await ok(control, set_binding("u-1", "10.0.0.5", "vh-u1"))
    assert ifaces(kernel) == {"vh-u1"}
    # In the deny-first transaction itself: never a moment with the subject and without its veth.
    [deny_first] = kernel.applied_since(mark, "deny_first")
    assert 'add element inet T sandbox_ifaces { "vh-u1" }' in deny_first
    await ok(control, remove("u-1"))
    assert ifaces(kernel) == set()


async def test_a_name_two_subjects_share_stays_until_the_last_leaves(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await ok(control, set_binding("u-1", "10.0.0.5", "br-sandboxes"))
    await ok(control, set_binding("u-2", "10.0.0.6", "br-sandboxes"))
    await ok(control, remove("u-1"))
    assert ifaces(kernel) == {"br-sandboxes"}
    await ok(control, remove("u-2"))
    assert ifaces(kernel) == set()


async def test_a_rebind_to_another_veth_moves_the_entry(control: ControlPlane, kernel: TextKernel) -> None:
    await ok(control, set_binding("u-1", "10.0.0.5", "vh-old"))
    await ok(control, set_binding("u-1", "10.0.0.5", "vh-new", rid="r2"))
    assert ifaces(kernel) == {"vh-new"}


@pytest.mark.parametrize("veth", ["lo", "a-name-far-too-long-for-linux", 'vh"1', "vh 1"])
async def test_a_name_that_can_be_no_sandbox_interface_is_not_used(
    control: ControlPlane, kernel: TextKernel, veth: str
) -> None:
    await ok(control, set_binding("u-1", "10.0.0.5", veth))
    assert ifaces(kernel) == set(), "recognised by its addresses only"
    await ok(control, remove("u-1"))


async def test_a_restart_resets_the_set_and_the_replay_fills_it(control: ControlPlane, kernel: TextKernel) -> None:
    await ok(control, set_binding("u-1", "10.0.0.5", "vh-u1"))
    await ok(control, set_binding("u-2", "10.0.0.6", "vh-u2"))
    # kill -9, start again
    restarted = ControlPlane(FleetPlanKernel(TableConfig(table="T", dns_port=15353), kernel))
    await restarted.reset_table()
    assert ifaces(kernel) == set()
    await ok(restarted, set_binding("u-2", "10.0.0.6", "vh-u2"))  # the Fastlet's replay
    assert ifaces(kernel) == {"vh-u2"}
    await ok(restarted, remove("u-2"))
    assert ifaces(kernel) == set()
