"""In-place policy updates do only the work the change needs (issue 28), and never less than
docs/reference/behaviour.md §14.1 asks: a swap rewrites only the static sets whose content changes, the
dyn sets only when a lease leaves, and the conntrack table is read (and flows cut) only when
the change may take something away. Each shortcut has a test here that fails if it skips a
real narrowing; tests/kernel/test_fleet_enforcement.py tries the same with real flows."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
from collections.abc import Collection
from typing import Any

import pytest

import egressd.actionhandler.flows as flows_mod
import egressd.fleetnft.backend as backend_mod
from egressd.actionhandler.control import ControlPlane
from egressd.addr import IPAddress
from egressd.fleetnft.contents import policy_contents, refuses_more, static_contents
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.kernel import conntrack
from egressd.kernel.ops import FlushSet
from egressd.policy import (
    EMPTY_ALWAYS,
    AlwaysRules,
    Verdict,
    effective_policy,
    format_element,
    names_narrow,
    parse_always_text,
    parse_policy,
)
from tests.unit.actionhandler.test_control_dns import FENCE, hook, mirror, ok, set_binding
from tests.unit.fakekernel import TextKernel, text_kernel

TABLE = "T"
SRC = "10.0.0.5"


def policy(*rules: tuple[str, str], default: str = "deny", audit: bool = False) -> str:
    doc: dict[str, Any] = {"defaultAction": default, "egress": [{"action": a, "target": t} for a, t in rules]}
    if audit:
        doc["mode"] = "audit"
    return json.dumps(doc)


def contents(text: str) -> Any:
    return static_contents(parse_policy(text))


# --------------------------------------------------------------------------- the pure decisions

NARROWING = [
    # (before, after): the kernel refuses under "after" an address it accepted under "before"
    (policy(("allow", "10.1.0.0/16")), policy(("allow", "10.1.0.0/16"), ("deny", "10.1.2.3"))),
    (policy(("allow", "10.1.0.0/16")), policy(("allow", "10.1.0.0/24"))),
    (policy(("allow", "10.1.0.0/24")), policy(("allow", "10.1.0.0/25"), ("allow", "10.1.0.128/25"))),
    (policy(default="allow"), policy(("allow", "0.0.0.0/1"), ("allow", "::/0"))),
    (policy(("deny", "10.1.0.0/16"), default="allow"), policy(("deny", "10.0.0.0/8"), default="allow")),
    (policy(("allow", "2001:db8::/32")), policy(("allow", "2001:db8::/48"))),
    (
        policy(("deny", "10.1.2.3"), default="allow", audit=True),
        policy(("deny", "10.1.2.3"), default="allow"),
    ),
]
WIDENING = [
    (policy(("allow", "10.1.0.0/24")), policy(("allow", "10.1.0.0/16"))),
    (policy(("allow", "10.1.0.0/24"), ("deny", "10.1.0.7")), policy(("allow", "10.1.0.0/24"))),
    (policy(("allow", "10.1.0.0/24")), policy(("allow", "10.1.0.0/24"), ("allow", "192.0.2.1"))),
    (policy(("allow", "10.1.0.0/24")), policy(default="allow")),
    (
        policy(("deny", "10.1.2.3"), default="allow"),
        policy(("deny", "10.1.2.3"), default="allow", audit=True),
    ),
    (policy(("allow", "a.test")), policy(("allow", "b.test"))),  # names: not the IP layer's business
]


@pytest.mark.parametrize(("before", "after"), NARROWING)
def test_refuses_more_sees_every_narrowing_of_the_ip_layer(before: str, after: str) -> None:
    assert refuses_more(contents(before), contents(after))


@pytest.mark.parametrize(("before", "after"), WIDENING)
def test_refuses_more_lets_a_widening_or_an_unchanged_ip_layer_pass(before: str, after: str) -> None:
    assert not refuses_more(contents(before), contents(after))
    assert not refuses_more(contents(after), contents(after))


NAME_NARROWING = [
    (policy(("allow", "a.test")), policy()),
    (policy(("allow", "a.test"), ("allow", "b.test")), policy(("allow", "b.test"))),
    (policy(("allow", "a.test")), policy(("deny", "a.test"), ("allow", "a.test"))),
    (
        policy(("allow", "a.b.test"), ("deny", "*.b.test")),
        policy(("deny", "*.b.test"), ("allow", "a.b.test")),
    ),
    (policy(default="allow"), policy(("allow", "a.test"))),
    (policy(("deny", "x.test"), default="allow", audit=True), policy(("deny", "x.test"), default="allow")),
    (policy(("allow", "*.x.test")), policy(("allow", "a.x.test"))),
]
NAME_WIDENING = [
    (policy(("allow", "a.test")), policy(("allow", "a.test"), ("allow", "b.test"))),
    (policy(("allow", "a.test")), policy(("allow", "b.test"), ("allow", "a.test"))),
    (policy(("deny", "a.test"), ("allow", "*.test")), policy(("allow", "*.test"))),
    (
        policy(("deny", "a.test"), ("allow", "*.test")),
        policy(("allow", "a.test"), ("deny", "a.test"), ("allow", "*.test")),
    ),
    (policy(("allow", "a.test")), policy(("allow", "a.test"), default="allow")),
    (policy(("allow", "a.test")), policy(("allow", "a.test"), ("deny", "10.0.0.0/8"))),  # IPs: not names
]


@pytest.mark.parametrize(("before", "after"), NAME_NARROWING)
def test_names_narrow_sees_every_name_the_change_may_refuse(before: str, after: str) -> None:
    assert names_narrow(parse_policy(before), parse_policy(after))


@pytest.mark.parametrize(("before", "after"), NAME_WIDENING)
def test_names_narrow_lets_a_widening_pass(before: str, after: str) -> None:
    assert not names_narrow(parse_policy(before), parse_policy(after))
    assert not names_narrow(parse_policy(after), parse_policy(after))


# --------------------------------------------------------------------------- the control plane


@pytest.fixture
def kernel() -> TextKernel:
    return text_kernel(TABLE)


async def make(kernel: TextKernel, always: AlwaysRules = EMPTY_ALWAYS, *, cuts: bool = True) -> ControlPlane:
    async def flush(_ip: IPAddress) -> None:
        return None

    control = ControlPlane(FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353), kernel), always=always,
                           conntrack_flush=flush if cuts else None)  # fmt: skip
    await control.reset_table()
    return control


async def start(control: ControlPlane, text: str) -> None:
    ok(await control.handle(set_binding(policy=text)))
    ok(await control.handle(hook()))


def conntrack_with(monkeypatch: pytest.MonkeyPatch, dsts: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """Flows from SRC to each of ``dsts``; returns (reads of the table, destinations cut)."""
    lines = [
        f"ipv4 2 tcp 6 100 ESTABLISHED src={SRC} dst={d} sport=1 dport=443 src={d} dst={SRC}" for d in dsts
    ]
    reads: list[int] = []
    cut: list[str] = []

    async def read(sources: Collection[IPAddress]) -> dict[IPAddress, set[conntrack.Dest]]:
        reads.append(1)
        return conntrack.flow_dests_from(lines, sources)

    async def flush(_src: IPAddress, dst: IPAddress, _proto: str = "", _port: int | None = None) -> None:
        cut.append(str(dst))

    monkeypatch.setattr(backend_mod, "read_flow_dests", read)
    monkeypatch.setattr(backend_mod, "flush_flow", flush)
    monkeypatch.setattr(flows_mod, "CUT_INTERVAL_S", 0.0)
    return reads, cut


async def settle(control: ControlPlane) -> None:
    for _ in range(50):
        await asyncio.sleep(0.01)
        if not control.flows._due and not (control.flows._passes and not control.flows._passes.done()):
            return


@pytest.mark.parametrize(("before", "after"), NARROWING[:5] + NAME_NARROWING[:2])
async def test_a_narrowing_reads_conntrack_and_cuts_what_it_refuses(
    kernel: TextKernel, monkeypatch: pytest.MonkeyPatch, before: str, after: str
) -> None:
    # Fails if a shortcut skips the read: every case refuses 10.1.2.3 or a name's address.
    control = await make(kernel)
    await start(control, before)
    if "a.test" in before:
        assert await control.learn("u-1", FENCE, [(ipaddress.ip_address("10.1.2.3"), 300)], "a.test")
    reads, cut = conntrack_with(monkeypatch, ("10.1.2.3",))
    ok(await control.handle(set_binding(policy=after, gen=2)))
    await settle(control)
    refused = not _allows(control, "10.1.2.3")
    assert reads == [1]
    assert cut == (["10.1.2.3"] if refused else [])


@pytest.mark.parametrize(("before", "after"), WIDENING[:4] + NAME_WIDENING[:3])
async def test_a_change_that_takes_nothing_away_reads_no_conntrack(
    kernel: TextKernel, monkeypatch: pytest.MonkeyPatch, before: str, after: str
) -> None:
    control = await make(kernel)
    await start(control, before)
    reads, cut = conntrack_with(monkeypatch, ("10.1.0.5",))
    ok(await control.handle(set_binding(policy=after, gen=2)))
    ok(await control.handle(set_binding(policy=after, gen=3)))  # and the same policy again
    await settle(control)
    assert reads == [] and cut == []


async def test_a_domain_narrowing_cuts_a_flow_whose_lease_already_ended(
    kernel: TextKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A UDP flow outlives its lease (the refresh never renews UDP): the book has forgotten
    the address, yet denying the name must still cut the flow, as it did before issue 28."""
    control = await make(kernel)
    await start(control, policy(("allow", "a.test")))
    reads, cut = conntrack_with(monkeypatch, ("10.9.9.9",))  # no lease: it ended
    assert mirror(control) == {}
    ok(await control.handle(set_binding(policy=policy(("allow", "b.test")), gen=2)))
    await settle(control)
    assert reads == [1] and cut == ["10.9.9.9"]


async def test_cuts_of_a_storm_of_narrowings_share_reads(
    kernel: TextKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    control = await make(kernel)
    await start(control, policy(("allow", "10.1.0.0/16")))
    reads, cut = conntrack_with(monkeypatch, ("10.1.2.3", "10.1.0.9"))
    monkeypatch.setattr(flows_mod, "CUT_INTERVAL_S", 0.2)
    for gen in range(2, 12):  # narrower and narrower (/17 .. /25), then 10.1.0.9 alone
        last = policy(("allow", "10.1.0.9")) if gen == 11 else policy(("allow", f"10.1.0.0/{gen + 15}"))
        ok(await control.handle(set_binding(policy=last, gen=gen)))
    await asyncio.sleep(0.5)
    assert 1 <= len(reads) <= 3, "the passes coalesce"
    assert set(cut) == {"10.1.2.3"}, "judged by the newest policy: every flow it refuses is cut"


def _allows(control: ControlPlane, dst: str) -> bool:
    return bool(control.report.explain(ipaddress.ip_address(SRC), dst)["decision"] == "allow")


# --------------------------------------------------------------------------- what the swap sends


async def test_a_swap_rewrites_only_the_sets_whose_content_changes(kernel: TextKernel) -> None:
    control = await make(kernel, cuts=False)
    await start(control, policy(("allow", "10.1.0.0/24"), ("allow", "2001:db8::/48"), ("deny", "10.1.0.7")))
    mark = kernel.mark()
    ok(await control.handle(set_binding(policy=policy(("allow", "10.2.0.0/24"), ("allow", "2001:db8::/48"),
                                                      ("deny", "10.1.0.7")), gen=2)))  # fmt: skip
    (call,) = kernel.since(mark)
    assert call.batch is not None
    assert {o.name for o in call.batch.ops if isinstance(o, FlushSet)} == {"subj_s_u_1_allow_v4"}
    assert kernel.elements("subj_s_u_1_allow_v4") == {"10.2.0.0/24": ""}
    assert kernel.elements("subj_s_u_1_allow_v6") == {"2001:db8::/48": ""}
    mark = kernel.mark()
    ok(await control.handle(set_binding(policy=policy(("allow", "10.2.0.0/24"), ("allow", "2001:db8::/48"),
                                                      ("deny", "10.1.0.7"), ("allow", "c.test")), gen=3)))  # fmt: skip
    assert kernel.since(mark) == [], "a change of names alone sends no swap"


async def test_a_revoked_lease_rewrites_the_dyn_sets_even_when_the_static_ones_stay(
    kernel: TextKernel,
) -> None:
    control = await make(kernel, cuts=False)
    await start(control, policy(("allow", "a.test"), ("allow", "b.test")))
    await control.learn("u-1", FENCE, [(ipaddress.ip_address("192.0.2.1"), 300)], "a.test")
    await control.learn("u-1", FENCE, [(ipaddress.ip_address("192.0.2.2"), 300)], "b.test")
    mark = kernel.mark()
    ok(await control.handle(set_binding(policy=policy(("allow", "b.test"), ("allow", "c.test")), gen=2)))
    (call,) = kernel.since(mark)
    assert call.op == "static_apply"
    assert kernel.elements("subj_s_u_1_dyn_v4") == {"192.0.2.2": ""}
    mark = kernel.mark()
    ok(await control.handle(set_binding(policy=policy(("allow", "b.test")), gen=3)))  # keeps every lease
    assert kernel.since(mark) == []
    assert kernel.elements("subj_s_u_1_dyn_v4") == {"192.0.2.2": ""}


# --------------------------------------------------------------------------- random sequences

POOL = [
    ("allow", "10.1.0.0/16"), ("allow", "10.1.0.0/24"), ("allow", "10.1.2.3"), ("deny", "10.1.2.3"),
    ("deny", "10.1.0.0/24"), ("allow", "192.0.2.0/24"), ("allow", "2001:db8::/32"), ("deny", "2001:db8::1"),
    ("allow", "::ffff:10.1.9.9"), ("allow", "a.test"), ("deny", "a.test"), ("allow", "*.test"),
    ("deny", "10.1.2.0/24"), ("allow", "198.51.100.0/24"),  # what the always-rules below hold too
]  # fmt: skip
ALWAYS = [
    EMPTY_ALWAYS,
    AlwaysRules(deny=parse_always_text("10.1.2.0/24\n", "d", Verdict.DENY), allow=()),
    AlwaysRules(deny=(), allow=parse_always_text("198.51.100.0/24\n", "a", Verdict.ALLOW)),
]


def random_policy(rng: random.Random) -> str:
    rules = rng.sample(POOL, rng.randint(0, 5))
    return policy(*rules, default=rng.choice(["deny", "deny", "allow"]), audit=rng.random() < 0.2)


@pytest.mark.parametrize("seed", range(12))
async def test_after_any_sequence_the_kernel_holds_exactly_the_claimed_policy(
    kernel: TextKernel, seed: int
) -> None:
    """Fails if the swap ever leaves a set it should have rewritten (its record of what the
    sets hold gone stale): in-place changes, always-rules reloads, refusals and lost answers
    in any order; afterwards every static set holds what the registry says is in force."""
    rng = random.Random(seed)
    always = ALWAYS[0]
    control = await make(kernel, always, cuts=False)
    control.revocations.backoff = (0.001, 0.002)
    await start(control, random_policy(rng))
    for gen in range(2, 60):
        roll = rng.random()
        if roll < 0.15:
            always = rng.choice(ALWAYS)
            if rng.random() < 0.3:
                kernel.fail(op="static_apply", fault=rng.choice(["refused", "late_ack"]))
            try:
                await control.set_always_rules(always)
            except Exception:
                always = control.always
        else:
            if roll < 0.35:
                kernel.fail(op="static_apply", fault=rng.choice(["refused", "late_ack", "late_timeout"]))
            await control.handle(set_binding(policy=random_policy(rng), gen=gen))
        kernel.heal()
        for _ in range(200):
            if not control.revoking():
                break
            await asyncio.sleep(0.005)
        assert not control.revoking()
        entry = control.registry.get("u-1")
        assert entry is not None and entry.policy is not None
        _assert_sets(kernel, policy_contents(effective_policy(entry.policy, control.always)))


def _assert_sets(kernel: TextKernel, want: dict[str, Any]) -> None:
    for kind, nets in want.items():
        name = f"subj_s_u_1_{kind}"
        if name not in kernel.table.sets:
            assert not nets, f"{name} missing, should hold {nets}"
            continue
        assert set(kernel.elements(name)) == {format_element(n) for n in nets}, kind
