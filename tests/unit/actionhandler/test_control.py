"""§3 operation handling: ControlPlane driven with parsed actions against a fake kernel.

The kernel is the shared :class:`~tests.unit.fakekernel.FakeKernel` with its
:class:`~tests.unit.fakekernel.TextModel`: it records every call (netlink batches as their
nft-syntax :meth:`NetlinkBatch.describe`), can be told to fail (``NftError``) on the Nth call or
on scripts/batches containing a substring, and keeps a small model of the table so tests can
look at what is "installed". The model enforces only kernel behaviour verified with nft 1.0 on
Linux (listed in its docstring): transactions are atomic, a missing object is ENOENT, a
referenced one is EBUSY, a re-pointed map key is EEXIST.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Iterable
from dataclasses import replace
from ipaddress import ip_address, ip_network
from typing import Any

import pytest

import egressd.actionhandler.control as control_mod
from egressd.actionhandler.api import Result
from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION, LifecycleHook, RemoveBinding, SetBinding, parse_action
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.subject import subject_sets
from egressd.fleetnft.table import TableConfig
from egressd.kernel.applier import NftError
from egressd.kernel.ops import (
    AddIntervals,
    AddRule,
    DeleteChain,
    DeleteElement,
    DeleteSet,
    FlushSet,
    MatchRule,
    NetlinkBatch,
    RuleAction,
    VerdictRule,
)
from egressd.policy import parse_policy
from egressd.subject.registry import Entry, KernelView, State, plan_data_plane_ready
from tests.unit.fakekernel import Call, FakeKernel, TextKernel, text_kernel

TABLE = "T"
GW = "10.0.0.1"


# --------------------------------------------------------------------------- envelopes


def set_binding(
    uid: str = "u-1",
    policy: object = '{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.8"}]}',
    *,
    ip: str | None = "10.0.0.5",
    gw: str | None = GW,
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
    }
    if ip is not None:
        net: dict[str, str] = {"ip": ip, "hostVeth": "veth0"}
        if gw is not None:
            net["gateway"] = gw
        doc["attachment"] = {"network": net}
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, SetBinding)
    return action


def hook(
    uid: str = "u-1", name: str = "sandbox.data-plane-ready", *, rid: str = "r1", aid: str = "a1"
) -> LifecycleHook:
    doc = {
        "apiVersion": API_VERSION,
        "operation": "LIFECYCLE_HOOK",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": aid},
        "hook": {"name": name, "sequence": 1},
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


POLICY_A = '{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.8"}]}'
POLICY_B = '{"defaultAction":"deny","egress":[{"action":"allow","target":"9.9.9.9"}]}'


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def kernel() -> TextKernel:
    return text_kernel(TABLE)


async def make_control(kernel: TextKernel, *, mitm: bool = False) -> ControlPlane:
    control = ControlPlane(FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353, mitm=mitm), kernel))
    await control.reset_table()
    assert control.enforcement_ready
    return control


@pytest.fixture
async def control(kernel: TextKernel) -> ControlPlane:
    return await make_control(kernel)


def entry(control: ControlPlane, uid: str = "u-1") -> Entry:
    e = control.registry.get(uid)
    assert e is not None, f"{uid} not registered"
    return e


def ok(result: Result) -> None:
    assert result == Result(200), result


def dispatched(kernel: TextKernel, ip: str) -> str | None:
    return kernel.elements("dispatch_v4").get(ip)


async def activate(
    control: ControlPlane, uid: str = "u-1", ip: str = "10.0.0.5", policy: str = POLICY_A
) -> None:
    ok(await control.handle(set_binding(uid, policy, ip=ip)))
    ok(await control.handle(hook(uid)))
    assert entry(control, uid).state is State.ACTIVE


SET_KINDS = (
    "allow_v4",
    "allow_v6",
    "deny_v4",
    "deny_v6",
    "wdeny_v4",
    "wdeny_v6",
    "audit_v4",
    "audit_v6",
    "dyn_v4",
    "dyn_v6",
)


def subj_rules(nid: str = "s_u_1") -> list[str]:
    key = "daddr . meta l4proto . th dport"
    return [
        f"ip daddr @subj_{nid}_deny_v4 goto denied",
        f"ip6 daddr @subj_{nid}_deny_v6 goto denied",
        f"ip {key} @subj_{nid}_denyp_v4 goto denied",
        f"ip6 {key} @subj_{nid}_denyp_v6 goto denied",
    ]


def mark_rules(
    nid: str = "s_u_1", *, audit: bool = False, name_check: bool = False, ranges: bool = False
) -> list[str]:
    """``mark_<id>``'s rules; the audit rules only once an audit policy made them, the range
    rules only once a policy with shared port ranges made them; with the name check (on with
    the MITM), the address-only dyn sets never mark UDP 443."""
    log = f'log prefix "egressd would-deny {nid} "'
    unmarked = "meta mark & 0x00000002 != 0x00000002 "
    key = "daddr . meta l4proto . th dport"
    marks = [
        line
        for kind in ("allow", "dyn")
        for line in (
            *(
                f"{l3} daddr @subj_{nid}_{kind}_{fam} {guard}meta mark set 0x2"
                for l3, fam in (("ip", "v4"), ("ip6", "v6"))
                for guard in (
                    ("meta l4proto != udp ", "udp dport != 443 ") if kind == "dyn" and name_check else ("",)
                )
            ),
            *(
                f"{l3} {key} @subj_{nid}_{kind}p_{fam} meta mark set 0x2"
                for l3, fam in (("ip", "v4"), ("ip6", "v6"))
            ),
            # The leases' single ports: a hash set of their own (docs/concepts/ruleset.md).
            *(
                f"{l3} {key} @subj_{nid}_dynpx_{fam} meta mark set 0x2"
                for l3, fam in (("ip", "v4"), ("ip6", "v6"))
                if kind == "dyn"
            ),
            # The leases' shared ranges: the address in a hash set, the ranges with the policy.
            *(
                f"{l3} daddr @subj_{nid}_dynr_{fam} meta l4proto . th dport @subj_{nid}_dynrports_{fam} "
                "meta mark set 0x2"
                for l3, fam in (("ip", "v4"), ("ip6", "v6"))
                if kind == "dyn" and ranges
            ),
        )
    ]
    return (
        marks
        if not audit
        else [
            *marks,
            *(
                f"{l3} {key if kind == 'wdenyp' else 'daddr'} @subj_{nid}_{kind}_{fam} {l3} daddr != "
                f"@subj_{nid}_deny_{fam} ct state new "
                f"{unmarked if kind == 'audit' else ''}{log} "
                f'counter name "subj_{nid}_audit_{counter}" meta mark set 0x2'
                for kind, counter in (("wdeny", "deny"), ("wdenyp", "deny"), ("audit", "default"))
                for l3, fam in (("ip", "v4"), ("ip6", "v6"))
            ),
        ]
    )


def in_rules(nid: str = "s_u_1", *, audit: bool = False, ranges: bool = False) -> list[str]:
    def key(l3: str, kind: str) -> str:
        if kind == "dynr":
            fam = "v4" if l3 == "ip" else "v6"
            return f"ct original {l3} daddr @subj_{nid}_dynr_{fam} meta l4proto . ct original proto-dst"
        if kind.endswith(("p", "px")):
            return f"ct original {l3} daddr . meta l4proto . ct original proto-dst"
        return f"ct original {l3} daddr"

    return [
        *(
            f"{key(l3, kind)} @subj_{nid}_{'dynrports' if kind == 'dynr' else kind}_{fam} {verdict}"
            for kind, verdict in (
                ("deny", "goto denied"),
                ("denyp", "goto denied"),
                *((("wdeny", "goto denied"), ("wdenyp", "goto denied")) if audit else ()),
                ("dyn", "accept"),
                ("dynp", "accept"),
                ("dynpx", "accept"),
                *((("dynr", "accept"),) if ranges else ()),
                ("allow", "accept"),
                ("allowp", "accept"),
            )
            for l3, fam in (("ip", "v4"), ("ip6", "v6"))
        ),
        "goto denied",
    ]


def assert_fixed_rules(kernel: TextKernel, nid: str = "s_u_1", *, mitm: bool = False) -> None:
    """The subject's rules, exactly once: they never change while it exists."""
    assert kernel.rules(f"subj_{nid}") == subj_rules(nid)
    assert kernel.rules(f"mark_{nid}") == mark_rules(nid, name_check=mitm)
    assert kernel.rules(f"subj_{nid}_in") == (in_rules(nid) if mitm else [])


def assert_deny_first_installed(
    kernel: TextKernel, nid: str = "s_u_1", ip: str = "10.0.0.5", *, mitm: bool = False
) -> None:
    """Deny-first = the fixed rules with all sets empty (nothing marked: all dropped)."""
    assert_fixed_rules(kernel, nid, mitm=mitm)
    for kind in SET_KINDS:
        assert kernel.elements(f"subj_{nid}_{kind}") == {}
    assert dispatched(kernel, ip) == f"jump subj_{nid}"
    assert kernel.elements("marking_v4").get(ip) == f"jump mark_{nid}"


# --------------------------------------------------------------------------- startup


async def test_reset_table_installs_the_header_even_without_an_existing_table() -> None:
    kernel = text_kernel(TABLE)
    control = ControlPlane(FleetPlanKernel(TableConfig(table=TABLE), kernel))
    assert not control.enforcement_ready
    await control.reset_table()
    assert control.enforcement_ready
    assert kernel.rules("dispatch")[-1] == "meta mark & 0x2 != 0x2 goto denied"
    assert kernel.elements("dispatch_v4") == {}


# --------------------------------------------------------------------------- parse before mutate


@pytest.mark.parametrize(
    "bad",
    [
        "not-json",
        "yaml:\n- a",
        '{"defaultAction":"sometimes"}',
        '{"egress":[{"action":"allow","target":""}]}',
        '{"egress":[{"action":"foo","target":"x.com"}]}',
        "[1,2]",
        '{"osbEgressInput":1,"policy":{},"vault":{"v":1,"kid":"k3","alg":"A256GCM","ct":"AAAA"}}',
        '{"osbEgressInput":2,"policy":{}}',
    ],
)
async def test_bad_policy_is_400_and_registers_nothing(
    control: ControlPlane, kernel: TextKernel, bad: str
) -> None:
    before = kernel.mark()
    result = await control.handle(set_binding(policy=bad))
    assert result.status == 400
    assert "\n" not in result.reason
    assert control.registry.get("u-1") is None
    assert len(control.registry) == 0
    assert kernel.since(before) == []


async def test_bad_policy_for_an_active_subject_changes_nothing(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control)
    before_entry = entry(control)
    before = kernel.mark()
    result = await control.handle(set_binding(policy="{nope", gen=2))
    assert result.status == 400
    assert entry(control) == before_entry
    assert kernel.since(before) == []


@pytest.mark.parametrize("deny_all", ["", "null", "{}", "  "])
async def test_deny_all_inputs_are_ordinary_strings(control: ControlPlane, deny_all: str) -> None:
    ok(await control.handle(set_binding(policy=deny_all)))
    assert entry(control).pending == parse_policy(None)


@pytest.mark.parametrize(
    ("ip", "gw"),
    [("127.0.0.1", GW), ("0.0.0.0", GW), ("224.0.0.1", GW), ("169.254.1.1", GW), ("10.0.0.5", "10.0.0.5")],
)
async def test_unusable_dispatch_key_is_400_before_any_mutation(
    control: ControlPlane, kernel: TextKernel, ip: str, gw: str
) -> None:
    before = kernel.mark()
    result = await control.handle(set_binding(ip=ip, gw=gw))
    assert result.status == 400
    assert control.registry.get("u-1") is None
    assert kernel.since(before) == []


class RecordingListener:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def registered(self, entry: Entry) -> None:
        self.events.append(("registered", entry.uid))

    async def unbound(self, uid: str) -> None:
        self.events.append(("unbound", uid))

    async def reset(self, uid: str) -> None:
        self.events.append(("reset", uid))

    async def removed(self, uid: str) -> None:
        self.events.append(("removed", uid))


async def test_listeners_follow_the_subject_lifecycle(control: ControlPlane, kernel: TextKernel) -> None:
    listener = RecordingListener()
    control.listeners.append(listener)
    ok(await control.handle(set_binding()))
    assert listener.events == [("registered", "u-1")]
    assert (await control.handle(set_binding(policy="{bad"))).status == 400
    kernel.fail(op="deny_first")
    assert (await control.handle(set_binding())).status == 500
    assert listener.events == [("registered", "u-1")]  # nothing for refused or failed inputs
    ok(await control.handle(set_binding(policy=None)))
    assert listener.events[-1] == ("unbound", "u-1")
    ok(await control.handle(set_binding(rid="r2")))
    assert listener.events[-2:] == [("reset", "u-1"), ("registered", "u-1")]
    kernel.fail(op="remove")
    assert (await control.handle(remove(rid="r2"))).status == 500
    assert listener.events[-1] != ("removed", "u-1")
    ok(await control.handle(remove(rid="r2")))
    assert listener.events[-1] == ("removed", "u-1")
    ok(await control.handle(remove("never-registered")))
    assert listener.events[-1] == ("removed", "never-registered")


# --------------------------------------------------------------------------- SET_BINDING / activation


async def test_set_binding_installs_deny_first_then_parks_the_policy(
    control: ControlPlane, kernel: TextKernel
) -> None:
    before = kernel.mark()
    ok(await control.handle(set_binding()))
    e = entry(control)
    assert e.state is State.DENYING
    assert e.pending == parse_policy(POLICY_A)
    assert e.policy is None
    assert e.spec_generation == 1
    calls = kernel.since(before)
    # One atomic netlink batch: sets, chains, the fixed rules, then the dispatch keys.
    assert [(c.kind, c.op) for c in calls] == [("batch", "deny_first")]
    text = calls[0].text.splitlines()
    assert "flush" not in calls[0].text
    rules = [ln for ln in text if ln.startswith("add rule")]
    assert rules == [
        *(f"add rule inet T subj_s_u_1 {r}" for r in subj_rules()),
        *(f"add rule inet T mark_s_u_1 {r}" for r in mark_rules()),
    ]
    first_rule = text.index(rules[0])
    assert all(ln.startswith(("add set", "add chain", "add counter")) for ln in text[:first_rule])
    assert all(ln.startswith("add element") for ln in text[first_rule + len(rules) :])
    assert_deny_first_installed(kernel)
    assert kernel.elements("dns_gw_v4") == {GW: ""}
    assert control.registry.resolve(ip_address("10.0.0.5")) == e
    assert control.registry.kernel("u-1") == KernelView(
        True, frozenset({(ip_address("10.0.0.5"), ip_address(GW))}), rules=True
    )


async def test_set_binding_while_denying_replaces_pending_latest_wins(
    control: ControlPlane, kernel: TextKernel
) -> None:
    ok(await control.handle(set_binding(policy=POLICY_A)))
    ok(await control.handle(set_binding(policy=POLICY_B, gen=2)))
    assert entry(control).pending == parse_policy(POLICY_B)
    assert entry(control).state is State.DENYING
    assert_deny_first_installed(kernel)
    ok(await control.handle(hook()))
    assert entry(control).policy == parse_policy(POLICY_B)
    assert kernel.elements("subj_s_u_1_allow_v4") == {"9.9.9.9": ""}


async def test_data_plane_ready_activates(control: ControlPlane, kernel: TextKernel) -> None:
    ok(await control.handle(set_binding()))
    before = kernel.mark()
    ok(await control.handle(hook()))
    e = entry(control)
    assert e.state is State.ACTIVE
    assert e.policy == parse_policy(POLICY_A)
    assert e.pending is None
    calls = kernel.since(before)
    assert [(c.kind, c.op) for c in calls] == [("batch", "static_apply")]
    assert "add rule" not in calls[0].text  # activation is a set-content swap, never a rule change
    assert kernel.elements("subj_s_u_1_allow_v4") == {"8.8.8.8": ""}
    assert_fixed_rules(kernel)
    assert "ip daddr @subj_s_u_1_allow_v4 meta mark set 0x2" in kernel.rules("mark_s_u_1")


async def test_data_plane_ready_twice_is_idempotent(control: ControlPlane, kernel: TextKernel) -> None:
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(hook()))
    assert kernel.since(before) == []
    assert entry(control).state is State.ACTIVE


async def test_data_plane_ready_without_pending_while_denying_is_409(
    control: ControlPlane, kernel: TextKernel
) -> None:
    ok(await control.handle(set_binding(policy=None)))
    assert entry(control).pending is None
    before = kernel.mark()
    result = await control.handle(hook())
    assert result.status == 409
    assert kernel.since(before) == []
    assert entry(control).state is State.DENYING


@pytest.mark.parametrize("name", ["sandbox.runtime-ready", "sandbox.data-plane-ready"])
async def test_hooks_absent_and_stale_are_409(control: ControlPlane, kernel: TextKernel, name: str) -> None:
    assert (await control.handle(hook(name=name))).status == 409
    ok(await control.handle(set_binding()))
    before = kernel.mark()
    assert (await control.handle(hook(name=name, rid="r0"))).status == 409
    assert (await control.handle(hook(name=name, aid="a0"))).status == 409
    assert kernel.since(before) == []
    assert entry(control).state is State.DENYING
    assert entry(control).pending is not None  # a stale hook never consumes the pending policy


async def test_runtime_ready_is_a_noop(control: ControlPlane, kernel: TextKernel) -> None:
    ok(await control.handle(set_binding()))
    before = kernel.mark()
    ok(await control.handle(hook(name="sandbox.runtime-ready")))
    assert kernel.since(before) == []
    assert entry(control).state is State.DENYING


async def test_in_place_update_of_an_active_subject(control: ControlPlane, kernel: TextKernel) -> None:
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=POLICY_B, gen=5)))
    assert [(c.kind, c.op) for c in kernel.since(before)] == [("batch", "static_apply")]
    assert_fixed_rules(kernel)
    e = entry(control)
    assert e.state is State.ACTIVE
    assert e.policy == parse_policy(POLICY_B)
    assert e.spec_generation == 5
    assert kernel.elements("subj_s_u_1_allow_v4") == {"9.9.9.9": ""}


async def test_null_revert_of_an_active_subject(control: ControlPlane, kernel: TextKernel) -> None:
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=None)))
    calls = kernel.since(before)
    assert calls[0].op == "deny_first"
    # One batch: flush the sets, re-point the keys; the rules are already there and stay.
    assert [(c.kind, c.op) for c in calls] == [("batch", "deny_first")]
    assert "add rule" not in calls[0].text
    e = entry(control)
    assert e.state is State.DENYING
    assert e.policy is None
    assert e.pending is None
    assert_deny_first_installed(kernel)
    assert (await control.handle(hook())).status == 409


async def test_null_for_absent_subject_without_attachment_is_a_noop(
    control: ControlPlane, kernel: TextKernel
) -> None:
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=None, ip=None)))
    assert control.registry.get("u-1") is None
    assert kernel.since(before) == []


async def test_null_for_absent_subject_with_attachment_installs_deny_first(
    control: ControlPlane, kernel: TextKernel
) -> None:
    ok(await control.handle(set_binding(policy=None)))
    assert entry(control).state is State.DENYING
    assert entry(control).pending is None
    assert_deny_first_installed(kernel)


# --------------------------------------------------------------------------- failures and retries


async def test_deny_first_failure_is_500_and_retry_converges(
    control: ControlPlane, kernel: TextKernel
) -> None:
    kernel.fail(op="deny_first")
    result = await control.handle(set_binding())
    assert result.status == 500
    assert result.reason.startswith("deny-first install: ")
    e = entry(control)
    assert e.state is State.DENYING
    assert e.policy is None
    assert e.pending is None  # the failed input was never accepted
    assert kernel.subject_objects("s_u_1") == []
    assert dispatched(kernel, "10.0.0.5") is None
    assert (await control.handle(hook())).status == 409  # never activates without deny-first

    ok(await control.handle(set_binding()))
    assert entry(control).pending == parse_policy(POLICY_A)
    assert_deny_first_installed(kernel)
    ok(await control.handle(hook()))
    assert entry(control).state is State.ACTIVE


async def test_failure_on_nth_call_is_500(control: ControlPlane, kernel: TextKernel) -> None:
    kernel.fail(call=kernel.mark() + 1)
    assert (await control.handle(set_binding())).status == 500
    ok(await control.handle(set_binding()))


async def test_data_plane_ready_failure_keeps_pending_and_retry_activates(
    control: ControlPlane, kernel: TextKernel
) -> None:
    ok(await control.handle(set_binding()))
    kernel.fail(op="static_apply")
    result = await control.handle(hook())
    assert result.status == 500
    assert result.reason.startswith("policy apply: ")
    e = entry(control)
    assert e.state is State.DENYING
    assert e.pending == parse_policy(POLICY_A)
    assert e.policy is None
    assert_deny_first_installed(kernel)
    ok(await control.handle(hook()))
    assert entry(control).state is State.ACTIVE
    assert entry(control).pending is None


async def test_in_place_update_failure_keeps_the_old_policy(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control)
    kernel.fail(match="9.9.9.9")
    result = await control.handle(set_binding(policy=POLICY_B, gen=2))
    assert result.status == 500
    e = entry(control)
    assert e.state is State.ACTIVE
    assert e.policy == parse_policy(POLICY_A)
    assert kernel.elements("subj_s_u_1_allow_v4") == {"8.8.8.8": ""}
    ok(await control.handle(set_binding(policy=POLICY_B, gen=2)))
    assert entry(control).policy == parse_policy(POLICY_B)


async def test_revert_failure_is_500_and_never_left_active_by_retry(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control)
    kernel.fail(op="deny_first")
    assert (await control.handle(set_binding(policy=None))).status == 500
    assert entry(control).state is State.DENYING
    ok(await control.handle(set_binding(policy=None)))
    assert_deny_first_installed(kernel)
    assert entry(control).policy is None


async def test_remove(control: ControlPlane, kernel: TextKernel) -> None:
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(remove()))
    assert [c.kind for c in kernel.since(before)] == ["batch"]
    assert control.registry.get("u-1") is None
    assert control.registry.resolve(ip_address("10.0.0.5")) is None
    assert control.registry.kernel("u-1") == KernelView()
    assert kernel.subject_objects("s_u_1") == []
    assert kernel.elements("dispatch_v4") == {}
    assert kernel.elements("marking_v4") == {}
    assert kernel.elements("dns_gw_v4") == {}  # last user of the gateway


async def test_remove_failure_keeps_the_subject_and_retry_removes(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control)
    kernel.fail(op="remove")
    result = await control.handle(remove())
    assert result.status == 500
    assert result.reason.startswith("removal: ")
    assert entry(control).state is State.ACTIVE
    assert dispatched(kernel, "10.0.0.5") == "jump subj_s_u_1"
    assert control.registry.kernel("u-1").objects
    ok(await control.handle(remove()))
    assert control.registry.get("u-1") is None
    assert kernel.subject_objects("s_u_1") == []


async def test_remove_other_fence_is_ignored_and_absent_is_200(
    control: ControlPlane, kernel: TextKernel
) -> None:
    ok(await control.handle(remove("nobody")))
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(remove(rid="r-old")))
    assert kernel.since(before) == []
    assert entry(control).state is State.ACTIVE


async def test_remove_of_a_subject_whose_install_failed(control: ControlPlane, kernel: TextKernel) -> None:
    kernel.fail(op="deny_first")
    assert (await control.handle(set_binding())).status == 500
    before = kernel.mark()
    ok(await control.handle(remove()))
    assert control.registry.get("u-1") is None
    assert kernel.since(before) == []  # nothing was installed, nothing to delete


# --------------------------------------------------------------------------- claims and gateways


async def test_ip_used_by_another_uid_is_409(control: ControlPlane, kernel: TextKernel) -> None:
    ok(await control.handle(set_binding("a", ip="10.0.0.5")))
    before = kernel.mark()
    result = await control.handle(set_binding("b", ip="10.0.0.5"))
    assert result.status == 409
    assert "10.0.0.5" in result.reason
    assert control.registry.get("b") is None
    assert control.registry.resolve(ip_address("10.0.0.5")) == entry(control, "a")
    assert kernel.since(before) == []


async def test_nft_id_collision_is_409(control: ControlPlane, kernel: TextKernel) -> None:
    ok(await control.handle(set_binding("a-b", ip="10.0.0.5")))
    before = kernel.mark()
    result = await control.handle(set_binding("a_b", ip="10.0.0.6"))
    assert result.status == 409
    assert control.registry.get("a_b") is None
    assert kernel.since(before) == []


async def test_missing_gateway_is_500_and_subject_stays_denying(
    control: ControlPlane, kernel: TextKernel
) -> None:
    before = kernel.mark()
    result = await control.handle(set_binding(gw=None))
    assert result.status == 500
    assert "gateway" in result.reason
    assert entry(control).state is State.DENYING
    assert kernel.since(before) == []
    assert (await control.handle(hook())).status == 409


async def test_mitm_other_family_gateway_is_500() -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=True)
    result = await control.handle(set_binding(ip="10.0.0.5", gw="fd00::1"))
    assert result.status == 500
    assert entry(control).state is State.DENYING
    assert kernel.subject_objects("s_u_1") == []


async def test_mitm_lifecycle() -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=True)
    ok(await control.handle(set_binding()))
    assert kernel.rules("subj_s_u_1_in")[-1] == "goto denied"
    assert_deny_first_installed(kernel, mitm=True)
    assert kernel.elements("mitm_src_v4") == {"10.0.0.5": ""}
    assert kernel.elements("mitm_in_v4") == {"10.0.0.5": "jump subj_s_u_1_in"}
    ok(await control.handle(hook()))
    assert_fixed_rules(kernel, mitm=True)  # the IN chain is not rewritten on activation
    assert kernel.elements("subj_s_u_1_allow_v4") == {"8.8.8.8": ""}
    ok(await control.handle(remove()))
    assert kernel.elements("mitm_src_v4") == {}
    assert kernel.elements("mitm_in_v4") == {}
    assert kernel.subject_objects("s_u_1") == []


async def test_mitm_active_gateway_change_rekeys_in_place() -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=True)
    await activate(control)
    ok(await control.handle(set_binding(gw="10.0.0.254", gen=2)))
    e = entry(control)
    assert e.state is State.ACTIVE
    assert e.binding is not None
    assert str(e.binding.gateway) == "10.0.0.254"  # type: ignore[union-attr]
    assert kernel.elements("mitm_src_v4") == {"10.0.0.5": ""}
    assert kernel.elements("dns_gw_v4") == {"10.0.0.254": ""}
    assert dispatched(kernel, "10.0.0.5") == "jump subj_s_u_1"


async def test_rebind_to_new_ip_deletes_the_old_map_entries(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=POLICY_B, ip="10.0.0.6", rid="r2", aid="a2", gen=2)))
    calls = kernel.since(before)
    # flush + new keys in one batch (rules kept), then the stale keys' deletions
    assert [c.op for c in calls] == ["deny_first", "dispatch_update"]
    assert [c.kind for c in calls] == ["batch", "batch"]
    deletes = calls[1]
    assert deletes.kind == "batch"
    assert "delete element inet T dispatch_v4 { 10.0.0.5 }" in deletes.text
    assert "delete element inet T marking_v4 { 10.0.0.5 }" in deletes.text
    assert "dns_gw_v4" not in deletes.text  # the new key uses the same gateway
    e = entry(control)
    assert e.state is State.DENYING
    assert e.pending == parse_policy(POLICY_B)
    assert e.policy is None
    assert all(k[0] != ip_address("10.0.0.5") for k in control.registry.kernel("u-1").keys)
    assert control.registry.resolve(ip_address("10.0.0.5")) is None
    assert control.registry.resolve(ip_address("10.0.0.6")) == e
    assert dispatched(kernel, "10.0.0.5") is None
    assert_deny_first_installed(kernel, ip="10.0.0.6")
    # The old address is free for another sandbox.
    ok(await control.handle(set_binding("other", ip="10.0.0.5")))


async def test_rebind_from_denying_with_new_gateway_releases_the_old_one(
    control: ControlPlane, kernel: TextKernel
) -> None:
    ok(await control.handle(set_binding()))
    ok(await control.handle(set_binding(ip="10.1.0.5", gw="10.1.0.1", rid="r2")))
    assert kernel.elements("dns_gw_v4") == {"10.1.0.1": ""}
    assert control.registry.kernel("u-1").keys == frozenset(
        {(ip_address("10.1.0.5"), ip_address("10.1.0.1"))}
    )


async def test_rebind_clears_learned_leases(control: ControlPlane, kernel: TextKernel) -> None:
    await activate(control)
    kernel.table.sets["subj_s_u_1_dyn_v4"]["93.184.216.34"] = ""  # a DNS-learned lease
    ok(await control.handle(set_binding(rid="r2")))
    assert kernel.elements("subj_s_u_1_dyn_v4") == {}
    assert entry(control).policy is None


async def test_active_rekey_drops_old_keys_before_adding_new(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=POLICY_B, ip="10.0.0.6", gen=2)))
    calls = kernel.since(before)
    assert [(c.kind, c.op) for c in calls] == [
        ("batch", "dispatch_update"),
        ("batch", "dispatch_update"),
        ("batch", "static_apply"),
    ]
    assert "10.0.0.5" in calls[0].text
    assert "10.0.0.6" in calls[1].text
    assert entry(control).state is State.ACTIVE
    assert kernel.elements("subj_s_u_1_allow_v4") == {"9.9.9.9": ""}
    assert dispatched(kernel, "10.0.0.5") is None
    assert dispatched(kernel, "10.0.0.6") == "jump subj_s_u_1"
    assert kernel.elements("dns_gw_v4") == {GW: ""}
    # The same policy on another re-key: nothing of the sets changes, so no swap is sent.
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=POLICY_B, ip="10.0.0.7", gen=3)))
    assert [(c.kind, c.op) for c in kernel.since(before)] == [("batch", "dispatch_update")] * 2


async def test_shared_gateway_released_only_with_the_last_subject(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control, "a", "10.0.0.5")
    await activate(control, "b", "10.0.0.6")
    assert kernel.elements("dns_gw_v4") == {GW: ""}
    before = kernel.mark()
    ok(await control.handle(remove("a")))
    assert "dns_gw_v4" not in "".join(c.text for c in kernel.since(before))
    assert kernel.elements("dns_gw_v4") == {GW: ""}
    assert dispatched(kernel, "10.0.0.6") == "jump subj_s_b"
    before = kernel.mark()
    ok(await control.handle(remove("b")))
    assert "delete element inet T dns_gw_v4 { 10.0.0.1 }" in kernel.since(before)[0].text
    assert kernel.elements("dns_gw_v4") == {}
    assert kernel.elements("dispatch_v4") == {}


async def test_remove_leaves_other_subjects_untouched(control: ControlPlane, kernel: TextKernel) -> None:
    await activate(control, "a", "10.0.0.5")
    await activate(control, "b", "10.0.0.6", POLICY_B)
    ok(await control.handle(remove("a")))
    assert kernel.subject_objects("s_a") == []
    assert kernel.elements("subj_s_b_allow_v4") == {"9.9.9.9": ""}
    assert entry(control, "b").state is State.ACTIVE


# --------------------------------------------------------------------------- concurrency


async def test_fifty_concurrent_set_bindings(control: ControlPlane, kernel: TextKernel) -> None:
    actions = [set_binding(f"u{i}", ip=f"10.0.{i // 200}.{i % 200 + 10}") for i in range(50)]
    results = await asyncio.gather(*(control.handle(a) for a in actions))
    assert all(r == Result(200) for r in results)
    assert len(control.registry) == 50
    assert len(kernel.elements("dispatch_v4")) == 50
    assert all(e.state is State.DENYING and e.pending is not None for e in control.registry)
    results = await asyncio.gather(*(control.handle(hook(f"u{i}")) for i in range(50)))
    assert all(r == Result(200) for r in results)
    assert control.registry.counts()[State.ACTIVE] == 50


def _applies_after_deny_first(calls: Iterable[Call], nid: str) -> int:
    """Count the successful policy applies of ``nid``; each must follow a successful deny-first."""
    installed = False
    applied = 0
    for c in calls:
        if not c.ok:
            continue
        text = c.text.splitlines()
        if (
            c.op == "deny_first"
            and f"add rule inet T subj_{nid} ip daddr @subj_{nid}_deny_v4 goto denied" in text
        ):
            installed = True  # objects and fixed rules are in
        if c.op == "static_apply" and any(f"subj_{nid}_allow_v4" in ln for ln in text):
            assert installed, "policy applied before any deny-first transaction"
            applied += 1
    return applied


@pytest.mark.parametrize("hook_first", [True, False])
async def test_concurrent_set_binding_and_data_plane_ready(
    control: ControlPlane, kernel: TextKernel, hook_first: bool
) -> None:
    for i in range(20):
        uid = f"c{i}"
        coros = [control.handle(set_binding(uid, ip=f"10.0.1.{i + 10}")), control.handle(hook(uid))]
        if hook_first:
            coros.reverse()
        results = await asyncio.gather(*coros)
        codes = sorted(r.status for r in results)
        assert codes in ([200, 200], [200, 409])
        e = entry(control, uid)
        if e.state is State.ACTIVE:
            assert codes == [200, 200]
        else:
            ok(await control.handle(hook(uid)))
        assert entry(control, uid).state is State.ACTIVE
        assert control.registry.kernel(uid).objects
        assert control.registry.kernel(uid).rules
        assert_fixed_rules(kernel, f"s_c{i}")
        assert _applies_after_deny_first(kernel.calls, f"s_c{i}") == 1


@pytest.mark.parametrize("failures", [1, 2, 3])
@pytest.mark.parametrize("hook_first", [True, False])
async def test_concurrent_set_binding_and_data_plane_ready_with_failures(
    control: ControlPlane, kernel: TextKernel, failures: int, hook_first: bool
) -> None:
    kernel.fail(op="deny_first", times=failures)
    coros = [
        control.handle(set_binding()),
        control.handle(hook()),
        control.handle(set_binding()),
        control.handle(hook()),
        control.handle(set_binding()),
        control.handle(hook()),
    ]
    if hook_first:
        coros.reverse()
    results = await asyncio.gather(*coros)
    assert all(r.status in (200, 409, 500) for r in results)
    _applies_after_deny_first(kernel.calls, "s_u_1")
    if entry(control).state is State.ACTIVE:
        assert control.registry.kernel("u-1").objects
        assert control.registry.kernel("u-1").rules
    # Whatever happened, the Fastlet's retries converge on an active subject.
    ok(await control.handle(set_binding()))
    ok(await control.handle(hook()))
    assert entry(control).state is State.ACTIVE
    assert _applies_after_deny_first(kernel.calls, "s_u_1") >= 1
    assert kernel.elements("subj_s_u_1_allow_v4") == {"8.8.8.8": ""}
    assert_fixed_rules(kernel)  # however the failures fell, the rules went in exactly once


# ------------------------------------------------------------- regressions (bugs found and fixed)


async def test_concurrent_claims_of_the_same_ip(control: ControlPlane, kernel: TextKernel) -> None:
    results = await asyncio.gather(
        control.handle(set_binding("a", ip="10.0.0.5")),
        control.handle(set_binding("b", ip="10.0.0.5")),
    )
    assert sorted(r.status for r in results) == [200, 409]
    winner = "a" if results[0].status == 200 else "b"
    loser = "b" if winner == "a" else "a"
    assert control.registry.get(loser) is None
    assert control.registry.resolve(ip_address("10.0.0.5")) == entry(control, winner)


async def test_concurrent_nft_id_collision(control: ControlPlane, kernel: TextKernel) -> None:
    results = await asyncio.gather(
        control.handle(set_binding("a-b", ip="10.0.0.5")),
        control.handle(set_binding("a_b", ip="10.0.0.6")),
    )
    assert sorted(r.status for r in results) == [200, 409]
    assert len(control.registry) == 1


@pytest.mark.parametrize(
    ("new_ip", "new_gw"),
    [("10.0.0.6", GW), ("10.0.0.5", "10.0.0.254")],
    ids=["new-ip-same-gateway", "same-ip-new-gateway"],
)
async def test_remove_after_half_applied_rekey(
    control: ControlPlane, kernel: TextKernel, new_ip: str, new_gw: str
) -> None:
    ok(await control.handle(set_binding()))
    kernel.fail(match="delete element")  # the DropStaleKeys batch of the re-key
    result = await control.handle(set_binding(ip=new_ip, gw=new_gw, gen=2))
    assert result.status == 500
    assert len(control.registry.kernel("u-1").keys) == 2
    ok(await control.handle(remove()))
    assert control.registry.get("u-1") is None
    assert kernel.elements("dispatch_v4") == {}
    assert kernel.elements("dns_gw_v4") == {}


@pytest.mark.parametrize(
    ("rid", "active_first"),
    [("r1", False), ("r2", False), ("r2", True)],
    ids=["same-fence", "rebind", "rebind-active"],
)
async def test_mitm_gateway_change_for_the_same_ip(rid: str, active_first: bool) -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=True)
    ok(await control.handle(set_binding()))
    if active_first:
        ok(await control.handle(hook()))
    ok(await control.handle(set_binding(gw="10.0.0.254", gen=2, rid=rid)))
    assert entry(control).state is State.DENYING
    assert kernel.elements("mitm_src_v4") == {"10.0.0.5": ""}
    assert kernel.elements("dns_gw_v4") == {"10.0.0.254": ""}


# ------------------------------------------------------------- fixed rules, content-only changes


async def test_fake_kernel_refuses_like_the_kernel(kernel: TextKernel) -> None:
    """The model the tests above rely on: references are checked, batches are atomic."""
    await make_control(kernel)
    # A rule naming a set that does not exist is refused, and with it the whole batch.
    bad = NetlinkBatch(
        TABLE,
        (
            AddIntervals("dns_gw_v4", "v4", (ip_network("10.9.9.9/32"),)),
            AddRule("dispatch", MatchRule("v4", "nope", RuleAction.DROP)),
        ),
    )
    with pytest.raises(NftError):
        await kernel.run_batch(bad, op="t")
    assert kernel.elements("dns_gw_v4") == {}
    with pytest.raises(NftError):
        await kernel.run_batch(
            NetlinkBatch(TABLE, (AddRule("nochain", VerdictRule(RuleAction.DROP)),)), op="t"
        )
    with pytest.raises(NftError):
        await kernel.run_batch(NetlinkBatch(TABLE, (FlushSet("nope"),)), op="t")
    with pytest.raises(NftError):
        await kernel.run_batch(NetlinkBatch(TABLE, (DeleteElement("dns_gw_v4", ip_address(GW)),)), op="t")
    # A set still referenced by a rule, a chain still referenced by a map element: busy.
    with pytest.raises(NftError, match="busy"):
        await kernel.run_batch(NetlinkBatch(TABLE, (DeleteSet("dispatch_v4"),)), op="t")
    control = await make_control(text_kernel(TABLE))
    ok(await control.handle(set_binding()))
    assert isinstance(control.kernel, FleetPlanKernel) and isinstance(control.kernel.tx, FakeKernel)
    k = control.kernel.tx
    with pytest.raises(NftError, match="busy"):
        await k.run_batch(NetlinkBatch(TABLE, (DeleteChain("subj_s_u_1"),)), op="t")
    with pytest.raises(NftError, match="busy"):
        await k.run_batch(NetlinkBatch(TABLE, (DeleteSet("subj_s_u_1_deny_v4"),)), op="t")
    # Deleting the chains takes their rules along, after which the set can go.
    keys = (
        DeleteElement("dispatch_v4", ip_address("10.0.0.5")),
        DeleteElement("marking_v4", ip_address("10.0.0.5")),
    )
    chains = (DeleteChain("subj_s_u_1"), DeleteChain("mark_s_u_1"))
    await k.run_batch(NetlinkBatch(TABLE, (*keys, *chains, DeleteSet("subj_s_u_1_deny_v4"))), op="t")
    assert not k.has_chain("subj_s_u_1")
    # Prefixes are keyed by their nft text; a batch applies in order.
    await k.run_batch(
        NetlinkBatch(
            TABLE,
            (
                AddIntervals(
                    "subj_s_u_1_allow_v4", "v4", (ip_network("10.0.0.0/24"), ip_network("8.8.8.8/32"))
                ),
                FlushSet("subj_s_u_1_allow_v6"),
            ),
        ),
        op="t",
    )
    assert k.elements("subj_s_u_1_allow_v4") == {"10.0.0.0/24": "", "8.8.8.8": ""}


async def test_creation_failure_leaves_nothing_and_retry_installs_rules_once(
    control: ControlPlane, kernel: TextKernel
) -> None:
    kernel.fail(match="add rule inet T mark_s_u_1")  # part of the one creation batch
    result = await control.handle(set_binding())
    assert result.status == 500
    assert result.reason.startswith("deny-first install: ")
    # Creation is one transaction: nothing of the subject exists, and the view says so.
    assert control.registry.kernel("u-1") == KernelView()
    assert kernel.subject_objects("s_u_1") == []
    assert dispatched(kernel, "10.0.0.5") is None
    e = entry(control)
    assert e.state is State.DENYING and e.pending is None
    assert (await control.handle(hook())).status == 409
    before = kernel.mark()
    ok(await control.handle(set_binding()))
    assert [(c.kind, c.op) for c in kernel.since(before)] == [("batch", "deny_first")]
    key = (ip_address("10.0.0.5"), ip_address(GW))
    assert control.registry.kernel("u-1") == KernelView(True, frozenset({key}), rules=True)
    assert_deny_first_installed(kernel)
    # Further re-runs never add the rules again.
    before = kernel.mark()
    ok(await control.handle(set_binding(gen=2)))
    assert not any("add rule" in c.text for c in kernel.since(before))
    ok(await control.handle(hook()))
    assert_fixed_rules(kernel)
    assert sum("add rule inet T subj_s_u_1 " in c.text for c in kernel.ok_calls()) == 1


async def test_rules_failure_with_mitm_is_retried_once() -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=True)
    kernel.fail(match="add rule inet T subj_s_u_1_in")
    assert (await control.handle(set_binding())).status == 500
    assert kernel.rules("subj_s_u_1_in") == []
    ok(await control.handle(set_binding()))
    ok(await control.handle(hook()))
    assert_fixed_rules(kernel, mitm=True)


async def test_remove_after_rules_failure_deletes_the_objects(
    control: ControlPlane, kernel: TextKernel
) -> None:
    kernel.fail(match="add rule inet T mark_s_u_1")
    assert (await control.handle(set_binding())).status == 500
    ok(await control.handle(remove()))
    assert control.registry.get("u-1") is None
    assert control.registry.kernel("u-1") == KernelView()
    assert kernel.subject_objects("s_u_1") == []
    assert kernel.elements("dispatch_v4") == {}
    assert kernel.elements("dns_gw_v4") == {}
    # A fresh bind installs everything, rules once.
    ok(await control.handle(set_binding(rid="r2")))
    assert_deny_first_installed(kernel)


def _lose_rules(control: ControlPlane, kernel: TextKernel, uid: str = "u-1", nid: str = "s_u_1") -> None:
    """Objects without their rules (what a failed rules batch leaves), for an existing subject."""
    for chain in (f"subj_{nid}", f"mark_{nid}"):
        kernel.table.chains[chain] = []
    control.registry.set_kernel(uid, replace(control.registry.kernel(uid), rules=False))


async def test_apply_policy_without_rules_is_500_and_keeps_pending(
    control: ControlPlane, kernel: TextKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok(await control.handle(set_binding()))
    _lose_rules(control, kernel)
    # A planner that trusted "objects" alone would go straight to ApplyPolicy: refused.
    monkeypatch.setattr(
        control_mod,
        "plan_data_plane_ready",
        lambda e, fence, *, kernel_objects: plan_data_plane_ready(e, fence, kernel_objects=True),
    )
    before = kernel.mark()
    result = await control.handle(hook())
    assert result.status == 500
    assert result.reason.startswith("policy apply: ")
    assert kernel.since(before) == []  # refused before any transaction
    e = entry(control)
    assert e.state is State.DENYING
    assert e.pending == parse_policy(POLICY_A)
    assert e.policy is None
    monkeypatch.undo()
    # The real planner sees the missing rules and re-runs deny-first (rules included) first.
    before = kernel.mark()
    ok(await control.handle(hook()))
    assert [(c.kind, c.op) for c in kernel.since(before)] == [
        ("batch", "deny_first"),  # flush + the missing rules + keys, one transaction
        ("batch", "static_apply"),
    ]
    assert entry(control).state is State.ACTIVE
    assert_fixed_rules(kernel)
    assert kernel.elements("subj_s_u_1_allow_v4") == {"8.8.8.8": ""}


async def test_in_place_update_without_rules_is_500_and_keeps_the_old_policy(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control)
    _lose_rules(control, kernel)
    before = kernel.mark()
    result = await control.handle(set_binding(policy=POLICY_B, gen=2))
    assert result.status == 500
    assert kernel.since(before) == []
    assert entry(control).policy == parse_policy(POLICY_A)
    assert kernel.elements("subj_s_u_1_allow_v4") == {"8.8.8.8": ""}


async def test_revert_flushes_the_sets_before_any_key_points_at_them(
    control: ControlPlane, kernel: TextKernel
) -> None:
    await activate(control)
    kernel.table.sets["subj_s_u_1_dyn_v4"]["93.184.216.34"] = ""  # a DNS-learned lease
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=None)))
    calls = kernel.since(before)
    assert [(c.kind, c.op) for c in calls] == [("batch", "deny_first")]
    text = calls[0].text.splitlines()
    kinds = subject_sets(audit=False, ranges=False)  # it never audited: no audit sets to flush
    n = len(kinds)
    assert text[:n] == [f"flush set inet T subj_s_u_1_{k}" for k in kinds]
    assert all(ln.startswith("add element") for ln in text[n:])
    assert "add rule" not in calls[0].text
    assert_deny_first_installed(kernel)


async def test_revert_whose_flush_fails_runs_no_script(control: ControlPlane, kernel: TextKernel) -> None:
    await activate(control)
    kernel.fail(match="flush set")
    before = kernel.mark()
    assert (await control.handle(set_binding(policy=None))).status == 500
    calls = kernel.since(before)
    assert [(c.kind, c.ok) for c in calls] == [("batch", False)]
    assert kernel.elements("subj_s_u_1_allow_v4") == {"8.8.8.8": ""}  # atomic: nothing flushed
    ok(await control.handle(set_binding(policy=None)))
    assert_deny_first_installed(kernel)


async def test_default_allow_fills_the_allow_sets(control: ControlPlane, kernel: TextKernel) -> None:
    await activate(
        control, policy='{"defaultAction":"allow","egress":[{"action":"deny","target":"1.2.3.4"}]}'
    )
    assert kernel.elements("subj_s_u_1_allow_v4") == {"0.0.0.0/0": ""}
    assert kernel.elements("subj_s_u_1_allow_v6") == {"::/0": ""}
    assert kernel.elements("subj_s_u_1_deny_v4") == {"1.2.3.4": ""}
    assert_fixed_rules(kernel)
    ok(await control.handle(set_binding(policy=POLICY_B, gen=2)))  # back to default deny
    assert kernel.elements("subj_s_u_1_allow_v4") == {"9.9.9.9": ""}
    assert kernel.elements("subj_s_u_1_allow_v6") == {}
    assert kernel.elements("subj_s_u_1_deny_v4") == {}


async def test_policy_swap_keeps_only_leases_a_still_allowed_name_taught(
    control: ControlPlane, kernel: TextKernel
) -> None:
    # docs/reference/behaviour.md §14.1 wins over §8.3's "dyn sets untouched": a lease survives a swap only if a
    # name that taught it is still allowed; the dyn sets are rewritten from the book in the
    # swap's transaction, so what the book does not keep leaves the kernel too.
    both = '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"},{"action":"allow","target":"cdn.x.io"}]}'
    keep = '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"}]}'
    await activate(control, policy=both)
    fence = entry(control, "u-1").fence
    assert await control.learn("u-1", fence, [(ipaddress.ip_address("93.184.216.34"), 300)], "api.x.io")
    assert await control.learn("u-1", fence, [(ipaddress.ip_address("93.184.216.35"), 300)], "cdn.x.io")
    ok(await control.handle(set_binding(policy=keep, gen=2)))
    assert set(kernel.elements("subj_s_u_1_dyn_v4")) == {"93.184.216.34"}


async def test_a_new_subject_and_a_new_address_cut_flows_a_previous_process_allowed(
    kernel: TextKernel,
) -> None:
    """Found with the kill -9 storm (scripts/storm.py): after a kill -9 the new process's header accepts established
    flows, so flows the dead process allowed ran on after the Fastlet's replay reverted the
    sandbox. A fresh deny-first install (the replay's first step) and a re-key onto a new
    address cut that address's flows before answering; a same-address step does not."""
    cut: list[str] = []

    async def flush(ip: Any) -> None:
        cut.append(str(ip))

    control = ControlPlane(
        FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353), kernel), conntrack_flush=flush
    )
    await control.reset_table()
    ok(await control.handle(set_binding(policy=POLICY_A)))
    assert cut == ["10.0.0.5"], "a fresh deny-first install cuts the address's old flows"
    ok(await control.handle(hook()))
    ok(await control.handle(set_binding(policy=POLICY_B, gen=2)))
    assert cut == ["10.0.0.5"], "an in-place change of the same address cuts nothing more"
    ok(await control.handle(set_binding(policy=POLICY_B, ip="10.0.0.6", gen=3)))
    assert cut[1:] == ["10.0.0.5", "10.0.0.6"], "re-key: the old address and the new one"
    assert entry(control).state is State.ACTIVE


# --------------------------------------------------------------------------- lazy audit objects

AUDITING = '{"defaultAction":"deny","mode":"audit","egress":[{"action":"deny","target":"9.9.9.0/24"}]}'
AUDIT_KINDS = ("wdeny_v4", "wdeny_v6", "audit_v4", "audit_v6", "wdenyp_v4", "wdenyp_v6")


@pytest.mark.parametrize("mitm", [False, True])
async def test_a_subject_that_never_audits_has_no_audit_objects(mitm: bool) -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=mitm)
    await activate(control)
    names = set(kernel.table.set_names())
    assert {f"subj_s_u_1_{k}" for k in subject_sets(audit=False, ranges=False)} <= names
    assert not {f"subj_s_u_1_{k}" for k in AUDIT_KINDS} & names
    assert_fixed_rules(kernel, mitm=mitm)


@pytest.mark.parametrize("mitm", [False, True])
async def test_the_first_audit_policy_adds_the_audit_objects_in_its_own_transaction(mitm: bool) -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=mitm)
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=AUDITING, gen=2)))
    calls = kernel.since(before)
    assert [(c.kind, c.op) for c in calls] == [("batch", "static_apply")]  # atomic with the swap
    assert kernel.elements("subj_s_u_1_audit_v4") == {"0.0.0.0/0": ""}
    assert kernel.elements("subj_s_u_1_wdeny_v4") == {"9.9.9.0/24": ""}
    # The chains were rebuilt, not appended to: every rule exactly once, wdeny before the accepts.
    assert kernel.rules("subj_s_u_1") == subj_rules()
    assert kernel.rules("mark_s_u_1") == mark_rules(audit=True, name_check=mitm)
    assert kernel.rules("subj_s_u_1_in") == (in_rules(audit=True) if mitm else [])
    assert entry(control).state is State.ACTIVE
    # A second audit policy is a content swap only.
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=AUDITING.replace("9.9.9.0", "9.9.8.0"), gen=3)))
    assert "add rule" not in kernel.since(before)[0].text


async def test_leaving_audit_mode_empties_the_audit_sets(control: ControlPlane, kernel: TextKernel) -> None:
    """``audit`` holds 0.0.0.0/0 while auditing: a revert or an enforcing policy that left it
    would let everything through the audit rules."""
    await activate(control, policy=AUDITING)
    ok(await control.handle(set_binding(policy=POLICY_A, gen=2)))  # enforcing again, in place
    assert all(kernel.elements(f"subj_s_u_1_{k}") == {} for k in AUDIT_KINDS)
    ok(await control.handle(set_binding(policy=AUDITING, gen=3)))
    assert kernel.elements("subj_s_u_1_audit_v4") == {"0.0.0.0/0": ""}
    ok(await control.handle(set_binding(policy=None, gen=4)))  # revert to deny-first
    for kind in (*AUDIT_KINDS, "allow_v4", "deny_v4"):
        assert kernel.elements(f"subj_s_u_1_{kind}") == {}, kind
    assert kernel.rules("mark_s_u_1") == mark_rules(audit=True)  # kept until removal


@pytest.mark.parametrize("audited", [False, True])
async def test_removal_deletes_exactly_the_sets_the_subject_has(
    control: ControlPlane, kernel: TextKernel, audited: bool
) -> None:
    await activate(control, policy=AUDITING if audited else POLICY_A)
    ok(await control.handle(remove()))
    assert not [n for n in kernel.table.set_names() if n.startswith("subj_s_u_1")]
    assert not [c for c in kernel.table.chain_names() if "s_u_1" in c]


async def test_the_first_policy_fills_the_empty_sets_without_flushing(
    control: ControlPlane, kernel: TextKernel
) -> None:
    """Every flush is one more set-name lookup in the kernel; deny-first sets are empty."""
    ok(await control.handle(set_binding()))
    before = kernel.mark()
    ok(await control.handle(hook()))
    (first,) = kernel.since(before)
    assert "flush" not in first.text and "subj_s_u_1_allow_v4" in first.text
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=POLICY_B, gen=2)))  # in place: flush and refill
    assert "flush set inet T subj_s_u_1_allow_v4" in kernel.since(before)[0].text


# --------------------------------------------------------------------------- lazy range objects

RANGED = (
    '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io",'
    '"protocol":"tcp","ports":["8000-8100"]}]}'
)
RANGE_KINDS = ("dynr_v4", "dynr_v6", "dynrports_v4", "dynrports_v6")
X = ipaddress.ip_address("93.184.216.34")


@pytest.mark.parametrize("mitm", [False, True])
async def test_a_subject_without_ranges_has_no_range_objects_and_nothing_names_them(mitm: bool) -> None:
    """The kernel walks a table's sets by name: a set a subject does not need slows every
    transaction. Nothing may name them either: a flush of a missing set fails the batch."""
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=mitm)
    await activate(control)
    fence = entry(control).fence
    assert await control.learn("u-1", fence, [(X, 300)], "api.x.io") is not None
    ok(await control.handle(set_binding(policy=POLICY_B, gen=2)))  # narrowing: dyn_replace
    ok(await control.handle(set_binding(policy=None, gen=3)))  # deny-first: flush_subject_sets
    ok(await control.handle(set_binding(policy=POLICY_A, gen=4)))
    names = set(kernel.table.set_names())
    assert not {f"subj_s_u_1_{k}" for k in RANGE_KINDS} & names
    assert all("dynr" not in c.text for c in kernel.since(0))
    assert_fixed_rules(kernel, mitm=mitm)
    ok(await control.handle(remove()))
    assert not [n for n in kernel.table.set_names() if n.startswith("subj_s_u_1")]


@pytest.mark.parametrize("mitm", [False, True])
async def test_the_first_range_policy_adds_the_range_objects_in_its_own_transaction(mitm: bool) -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=mitm)
    await activate(control)
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=RANGED, gen=2)))
    calls = kernel.since(before)
    assert [(c.kind, c.op) for c in calls] == [("batch", "static_apply")]  # atomic with the swap
    text = calls[0].text
    # Declared, then the chains emptied and rebuilt, then the shared ranges written.
    assert text.index("add set inet T subj_s_u_1_dynr_v4") < text.index("flush chain inet T mark_s_u_1")
    assert text.index("flush chain inet T mark_s_u_1") < text.index("subj_s_u_1_dynrports_v4 { tcp . 8000-8100 }")
    assert kernel.elements("subj_s_u_1_dynrports_v4") == {"tcp . 8000-8100": ""}
    assert kernel.rules("subj_s_u_1") == subj_rules()
    assert kernel.rules("mark_s_u_1") == mark_rules(name_check=mitm, ranges=True)
    assert kernel.rules("subj_s_u_1_in") == (in_rules(ranges=True) if mitm else [])
    # A lease learned under it takes the hash path at once.
    fence = entry(control).fence
    assert await control.learn("u-1", fence, [(X, 300)], "api.x.io") is not None
    assert set(kernel.elements("subj_s_u_1_dynr_v4")) == {str(X)}
    # A later range policy is a content swap only: no re-creation.
    before = kernel.mark()
    ok(await control.handle(set_binding(policy=RANGED.replace("8100", "8200"), gen=3)))
    (swap,) = kernel.since(before)
    assert "add rule" not in swap.text and "add set" not in swap.text
    assert kernel.elements("subj_s_u_1_dynrports_v4") == {"tcp . 8000-8200": ""}


@pytest.mark.parametrize("mitm", [False, True])
async def test_a_policy_without_ranges_empties_the_range_sets_and_keeps_the_objects(mitm: bool) -> None:
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=mitm)
    await activate(control, policy=RANGED)
    fence = entry(control).fence
    assert await control.learn("u-1", fence, [(X, 300)], "api.x.io") is not None
    assert set(kernel.elements("subj_s_u_1_dynr_v4")) == {str(X)}
    single = RANGED.replace('"8000-8100"', "443")
    ok(await control.handle(set_binding(policy=single, gen=2)))
    # The shared ranges are gone (dynrports emptied) and the lease moved off the hash path
    # (dynr flushed by the refill): nothing opens 8000-8100 any more.
    assert kernel.elements("subj_s_u_1_dynrports_v4") == {}
    assert kernel.elements("subj_s_u_1_dynr_v4") == {}
    assert kernel.elements("subj_s_u_1_dyn_v4") == {}
    assert kernel.rules("mark_s_u_1") == mark_rules(name_check=mitm, ranges=True)  # kept for life
    ok(await control.handle(set_binding(policy=None, gen=3)))  # deny-first flushes them too
    for kind in RANGE_KINDS:
        assert kernel.elements(f"subj_s_u_1_{kind}") == {}, kind
    ok(await control.handle(set_binding(policy=RANGED, gen=4)))  # back: no re-creation needed
    assert kernel.rules("mark_s_u_1") == mark_rules(name_check=mitm, ranges=True)
    ok(await control.handle(remove()))
    assert not [n for n in kernel.table.set_names() if n.startswith("subj_s_u_1")]


@pytest.mark.parametrize("mitm", [False, True])
@pytest.mark.parametrize("audit_first", [False, True])
async def test_audit_and_range_objects_together(mitm: bool, audit_first: bool) -> None:
    """Either kind first: the chains end with both kinds of rule, each exactly once and in
    the order a subject with both made at once has them."""
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=mitm)
    await activate(control)
    ranged_audit = RANGED.replace('"defaultAction":"deny",', '"defaultAction":"deny","mode":"audit",')
    steps = (AUDITING, ranged_audit) if audit_first else (RANGED, ranged_audit)
    for gen, policy in enumerate(steps, start=2):
        ok(await control.handle(set_binding(policy=policy, gen=gen)))
    assert kernel.rules("subj_s_u_1") == subj_rules()
    assert kernel.rules("mark_s_u_1") == mark_rules(audit=True, name_check=mitm, ranges=True)
    assert kernel.rules("subj_s_u_1_in") == (in_rules(audit=True, ranges=True) if mitm else [])
    assert kernel.elements("subj_s_u_1_dynrports_v4") == {"tcp . 8000-8100": ""}
    assert kernel.elements("subj_s_u_1_audit_v4") == {"0.0.0.0/0": ""}
    ok(await control.handle(remove()))
    assert not [n for n in kernel.table.set_names() if n.startswith("subj_s_u_1")]


@pytest.mark.parametrize("mitm", [False, True])
async def test_a_learn_while_a_policy_step_is_in_doubt_never_takes_the_hash_path(mitm: bool) -> None:
    """Attacker review of the range hash path (finding A): a policy step applied with its
    answer lost leaves the registry on the old policy while the kernel holds the new one's
    shared ranges. An address in dynr opens what the kernel's dynrports holds, so a lease the
    old policy decides must not go there: it is written as its own pipapo elements (open only
    where the old policy opened it) until a step settles the subject."""
    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=mitm)
    await activate(control, policy=RANGED)
    fence = entry(control).fence
    assert await control.learn("u-1", fence, [(X, 300)], "api.x.io") is not None
    assert set(kernel.elements("subj_s_u_1_dynr_v4")) == {str(X)}
    # The new policy: every port of another name first, api.x.io only on 443.
    wide = (
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"b.x.io","protocol":"tcp",'
        '"ports":["1-65535"]},{"action":"allow","target":"api.x.io","protocol":"tcp","ports":[443]}]}'
    )
    kernel.fail(op="static_apply", fault="late_ack")
    assert (await control.handle(set_binding(policy=wide, gen=2))).status >= 500
    assert kernel.elements("subj_s_u_1_dynrports_v4") == {"tcp . 1-65535": ""}  # the kernel took it
    assert control.registry.kernel("u-1").unsure
    # An answer decided under the registry's (old) policy while in doubt.
    assert await control.learn("u-1", fence, [(X, 300)], "api.x.io") is not None
    assert kernel.elements("subj_s_u_1_dynr_v4") == {}, "the address would open 1-65535"
    assert "93.184.216.34 . tcp . 8000-8100" in set(kernel.elements("subj_s_u_1_dynp_v4"))


@pytest.mark.parametrize("mitm", [False, True])
async def test_an_always_reload_while_the_first_range_policy_is_in_doubt_goes_through(mitm: bool) -> None:
    """Attacker review of the range hash path (finding B): a subject's first range policy
    timed out (not taken), so its view says it may have the range objects. The fleet-wide
    reload must not name a set the kernel may lack (ENOENT would refuse it for every subject):
    the objects are declared and the chains rebuilt with their rules in the reload itself."""
    from egressd.policy import AlwaysRules, Verdict, parse_always_text

    kernel = text_kernel(TABLE)
    control = await make_control(kernel, mitm=mitm)
    await activate(control)
    kernel.fail(op="static_apply", fault="timeout")
    assert (await control.handle(set_binding(policy=RANGED, gen=2))).status >= 500
    view = control.registry.kernel("u-1")
    assert view.unsure and view.ranges
    assert "subj_s_u_1_dynrports_v4" not in set(kernel.table.set_names())
    denied = AlwaysRules(deny=parse_always_text("evil.example\n", "deny.always", Verdict.DENY), allow=())
    await control.set_always_rules(denied)  # raises when the kernel refuses the reload
    assert "subj_s_u_1_dynrports_v4" in set(kernel.table.set_names())
    assert kernel.rules("mark_s_u_1") == mark_rules(name_check=mitm, ranges=True)
