"""The named-port interception (docs/reference/behaviour.md §18) through the control plane: a
subject's ``mitm_ports`` elements follow its policy (activation, in-place update), its keys
(re-key) and its removal, and the kernel failing a transaction never leaves them wedged (the
next change refills the set from what is known)."""

from __future__ import annotations

import json

from egressd.actionhandler.api import Result
from egressd.actionhandler.control import ControlPlane
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.subject.hostuid import UidPorts, UidRange
from tests.unit.actionhandler.test_control import hook, remove, set_binding
from tests.unit.fakekernel import TextKernel, text_kernel

TABLE = "T"


def named(*ports: object) -> str:
    rule = {"action": "allow", "target": "a.io", "protocol": "https", "ports": list(ports)}
    return json.dumps({"defaultAction": "deny", "egress": [rule]})


async def make() -> tuple[ControlPlane, TextKernel]:
    kernel = text_kernel(TABLE)
    cfg = TableConfig(table=TABLE, mitm=True, uids=UidPorts(UidRange(100000, 165535), 16000, 4))
    control = ControlPlane(FleetPlanKernel(cfg, kernel))
    await control.reset_table()
    return control, kernel


def ok(result: Result) -> None:
    assert result == Result(200), result


def held(kernel: TextKernel) -> set[str]:
    return set(kernel.elements("mitm_ports_v4"))


async def test_the_elements_follow_policy_keys_and_removal() -> None:
    control, kernel = await make()
    ok(await control.handle(set_binding("u-1", named(8443), ip="10.0.0.5")))
    assert held(kernel) == set()  # deny-first: nothing of the policy yet
    ok(await control.handle(hook("u-1")))
    assert held(kernel) == {"10.0.0.5 . tcp . 8443"}
    ok(await control.handle(set_binding("u-1", named("8000-8999", 443), ip="10.0.0.5", gen=2)))
    assert held(kernel) == {"10.0.0.5 . tcp . 8000-8999"}
    ok(await control.handle(set_binding("u-1", named("8000-8999"), ip="10.0.0.9", gen=3)))
    ok(await control.handle(hook("u-1")))
    assert held(kernel) == {"10.0.0.9 . tcp . 8000-8999"}
    ok(await control.handle(remove("u-1")))
    assert held(kernel) == set()


async def test_a_refused_or_unanswered_transaction_does_not_wedge_the_set() -> None:
    control, kernel = await make()
    ok(await control.handle(set_binding("u-1", named(8443), ip="10.0.0.5")))
    ok(await control.handle(hook("u-1")))
    ok(await control.handle(set_binding("u-2", named(9443), ip="10.0.0.6")))
    ok(await control.handle(hook("u-2")))
    gen = 2
    # Refused (nothing applied), timed out, or applied with its answer lost: either state.
    for fault in ("refused", "timeout", "late_ack", "late_timeout"):
        kernel.fail(op="static_apply", fault=fault)
        result = await control.handle(set_binding("u-1", named(7443), ip="10.0.0.5", gen=gen))
        assert result.status >= 500, (fault, result)
        # Whatever the kernel holds now, the next change goes through and leaves exactly
        # the subjects' current ports.
        ok(await control.handle(set_binding("u-1", named(6443), ip="10.0.0.5", gen=gen + 1)))
        assert held(kernel) == {"10.0.0.5 . tcp . 6443", "10.0.0.6 . tcp . 9443"}, fault
        gen += 2
