"""The one subject engine both profiles run (egressd.engine.subjects), over either backend.

The engine's decisions are tried against a recording backend; the two real backends (the
fleet's per-subject netlink objects and the sidecar's whole table) are checked to be what
the engine is built over in each profile, and to agree with the engine's protocol.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytest

from egressd.actionhandler.control import ControlPlane
from egressd.addr import IPAddress
from egressd.engine.backend import Flow, Refusals, RulesetBackend
from egressd.engine.errors import RulesetRefused, RulesetUncertain
from egressd.engine.selftest import Probes
from egressd.engine.subjects import CutOrder, SubjectEngine, unless_refused
from egressd.feed import Feed, LeasesNarrowed
from egressd.fleetnft.backend import FleetBackend
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.policy import NetworkPolicy, ip_sets, parse_policy
from egressd.policy.ipsets import Prefix
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecarnft.backend import SIDECAR_UID, SidecarBackend
from egressd.sidecarnft.ruleset import SidecarTable
from egressd.subject.leases import Grant
from tests.unit.fakekernel import FakeTx


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


API, OTHER, GW, RESOLVER = ip("93.184.216.34"), ip("93.184.216.99"), ip("10.0.0.1"), ip("10.9.9.53")
ALLOW_API = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"}]}')
DENY_API_IP = parse_policy(
    '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"},'
    '{"action":"deny","target":"93.184.216.0/24"}]}'
)
NOW = 1000.0


class Recording:
    """A backend that records what the engine asks of it (the fleet's rules for failures and audit)."""

    passes_would_deny = True
    name_check = False

    def __init__(self, flows: Mapping[IPAddress, list[IPAddress]] | None = None) -> None:
        self.added: list[tuple[str, list[tuple[IPAddress, int]]]] = []
        self.fail: BaseException | None = None
        self.flows = flows or {}
        self.reads = 0
        self.cut: list[Flow] = []

    def may_hold(self, exc: BaseException) -> bool:
        return unless_refused(exc)

    def kernel_denies(self, effective: NetworkPolicy) -> tuple[Sequence[Prefix], Sequence[Prefix]]:
        sets = ip_sets(effective)
        return sets.deny_v4, sets.deny_v6

    async def add_leases(self, uid: str, admitted: list[Grant]) -> None:
        self.added.append((uid, [(g.ip, g.seconds) for g in admitted]))
        if self.fail is not None:
            raise self.fail

    async def tracked_flows(self, sources: Mapping[str, Collection[IPAddress]]) -> Mapping[str, Sequence[Flow]]:
        self.reads += 1
        return {
            uid: [(s, d, "tcp", 443) for s in sorted(ips, key=str) for d in self.flows.get(s, [])]
            for uid, ips in sources.items()
        }

    async def cut_flow(self, flow: Flow) -> None:
        self.cut.append(flow)

    def flow_fields(self, flow: Flow) -> dict[str, str]:
        return {"source_ip": str(flow[0])}

    def refusals(self, counters: Mapping[str, int]) -> Refusals:
        return Refusals({name: n for name, n in counters.items() if name.startswith("s_")})

    def probes(self, scratch_table: str) -> Probes[Any]:
        raise NotImplementedError


def engine(backend: RulesetBackend, feed: Feed | None = None) -> SubjectEngine:
    return SubjectEngine(backend, feed or Feed(), clock=lambda: NOW)


async def test_learning_goes_through_the_backend_and_into_the_subjects_own_book() -> None:
    backend = Recording()
    e = engine(backend)
    assert await e.learn("a", ALLOW_API, [(API, 60)], "API.x.io.") == [API]
    assert await e.learn("b", ALLOW_API, [(OTHER, 60)], "evil.io") == []  # not allowed: no kernel step
    assert backend.added == [("a", [(API, 60)])]
    assert set(e.books) == {"a", "b"} and list(e.books["a"]) == [API] and not len(e.books["b"])


@pytest.mark.parametrize(
    ("failure", "recorded"),
    [(RulesetRefused("no"), False), (RulesetUncertain("unanswered"), True), (TimeoutError(), True)],
)
async def test_a_failed_kernel_step_is_recorded_only_when_the_kernel_may_hold_it(
    failure: BaseException, recorded: bool
) -> None:
    backend = Recording()
    backend.fail = failure
    e = engine(backend)
    with pytest.raises(type(failure)):
        await e.learn("a", ALLOW_API, [(API, 60)], "api.x.io")
    assert (API in e.books["a"]) is recorded  # the book is never narrower than the kernel


async def test_a_narrowing_keeps_only_what_the_new_policy_and_the_backends_deny_sets_allow() -> None:
    e = engine(Recording())
    await e.learn("a", ALLOW_API, [(API, 60)], "api.x.io")
    kept = e.narrowed("a", ALLOW_API)
    assert kept is not None and [g.ip for g in kept.kept] == [API]
    denied = e.narrowed("a", DENY_API_IP)
    assert denied is not None and denied.kept == () and denied.revoked == (API,)
    e.commit("a", denied)
    assert not len(e.books["a"]) and e.narrowed("nobody", ALLOW_API) is None


async def test_forgetting_a_subject_publishes_its_narrowing() -> None:
    feed = Feed()
    seen: list[object] = []
    feed.subscribe(seen.append)
    e = engine(Recording(), feed)
    await e.learn("a", ALLOW_API, [(API, 60)], "api.x.io")
    e.forget("a")
    assert "a" not in e.books and seen == [LeasesNarrowed()]


async def test_verification_needs_the_name_that_taught_the_address() -> None:
    e = engine(Recording())
    await e.learn("a", ALLOW_API, [(API, 60)], "api.x.io")
    sets = ip_sets(ALLOW_API)
    assert e.verified("a", sets, "API.x.io", API) and e.verified_until("a", sets, "api.x.io", API) == NOW + 60
    assert not e.verified("a", sets, "other.io", API) and not e.verified("b", sets, "api.x.io", API)


async def test_the_judge_of_a_cut_honours_leases_gateways_resolvers_and_audit() -> None:
    e = engine(Recording())
    await e.learn("a", ALLOW_API, [(API, 60)], "api.x.io")
    judge = e.judge("a", CutOrder(sources=(), effective=ALLOW_API, reachable={GW}, unless_denied={RESOLVER}))
    assert judge(API) and judge(GW) and judge(RESOLVER) and not judge(OTHER)
    denied = e.judge("a", CutOrder(sources=(), effective=DENY_API_IP, unless_denied={API}))
    assert not denied(API)  # a deny rule beats the lease and the resolver exception
    audit = parse_policy('{"defaultAction":"deny","mode":"audit","egress":[]}')
    assert e.judge("a", CutOrder(sources=(), effective=audit))(OTHER)  # would-deny passes


async def test_one_read_of_the_flow_table_cuts_several_subjects_by_their_own_policies() -> None:
    src_a, src_b = ip("10.0.0.5"), ip("10.0.0.6")
    backend = Recording({src_a: [API, OTHER], src_b: [API, OTHER]})
    e = engine(backend)
    await e.learn("a", ALLOW_API, [(API, 60)], "api.x.io")
    cut = await e.cut(
        {
            "a": CutOrder(sources={src_a}, effective=ALLOW_API),
            "b": CutOrder(sources={src_b}, effective=ALLOW_API),  # b learned nothing
        }
    )
    assert backend.reads == 1 and cut == 3
    assert backend.cut == [(src_a, OTHER, "tcp", 443), (src_b, API, "tcp", 443), (src_b, OTHER, "tcp", 443)]


def test_both_profiles_run_the_same_engine_over_their_own_backend() -> None:
    control = ControlPlane(FleetPlanKernel(TableConfig(table="T"), FakeTx()))
    sidecar = SidecarEngine(SidecarTable(table="T"), FakeTx(), ALLOW_API)
    assert type(control.subjects) is type(sidecar.subjects) is SubjectEngine
    assert isinstance(control.subjects.backend, FleetBackend)
    assert isinstance(sidecar.subjects.backend, SidecarBackend)
    # The fleet's lease books are the engine's; the sidecar's one subject is SIDECAR_UID.
    assert control.leases is control.subjects.books
    backends: list[RulesetBackend] = [control.subjects.backend, sidecar.backend]  # the protocol, checked by mypy
    assert len(backends) == 2 and SIDECAR_UID == "sidecar"


async def test_the_sidecar_group_commits_concurrent_answers_in_one_script() -> None:
    # The fleet's group commit (egressd.engine.groupcommit), for the sidecar's one subject:
    # answers that wait for the kernel lock go in one transaction, each released after it.
    kernel = FakeTx()
    sidecar = SidecarEngine(SidecarTable(table="T"), kernel, ALLOW_API)
    await sidecar.install()
    asker = sidecar.asker(ip("10.0.0.9"))
    kernel.hold(lambda op, batch: op == "dynamic_add")
    first = asyncio.create_task(sidecar.learn(asker.uid, asker.fence, [(API, 60)], "api.x.io"))
    await kernel.entered.wait()
    rest = [asyncio.create_task(sidecar.learn(asker.uid, asker.fence, [(a, 60)], "api.x.io")) for a in (OTHER, GW)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert not any(t.done() for t in [first, *rest])
    kernel.release()
    assert [await first, *[await t for t in rest]] == [[API], [OTHER], [GW]]
    adds = [text for op, text in kernel.scripts if op == "dynamic_add"]
    assert len(adds) == 2 and str(OTHER) in adds[1] and str(GW) in adds[1]


async def test_the_sidecar_learns_into_its_one_subjects_book() -> None:
    kernel = FakeTx(yield_each_call=False)
    sidecar = SidecarEngine(SidecarTable(table="T"), kernel, ALLOW_API)
    await sidecar.install()
    asker = sidecar.asker(ip("10.0.0.9"))
    assert await sidecar.learn(asker.uid, asker.fence, [(API, 60)], "api.x.io") == [API]
    assert list(sidecar.subjects.books) == [SIDECAR_UID] and API in sidecar.leases
    assert "dyn_allow_v4" in kernel.scripts[-1][1]


class FailingScripts(FakeTx):
    """The sidecar's kernel: lease adds fail with ``error``; everything else is taken."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(yield_each_call=False)
        self.error = error

    async def run_script(self, script: str, *, op: str) -> None:
        if op == "dynamic_add":
            raise self.error
        await super().run_script(script, op=op)


@pytest.mark.parametrize("error", [RuntimeError("executor gone"), TimeoutError(), RulesetUncertain("lost")])
async def test_the_sidecar_never_records_a_lease_its_kernel_step_did_not_confirm(error: BaseException) -> None:
    # Its narrowings rebuild the whole table from the book: a failed add is dropped by the next
    # rebuild, and recording it would let the MITM trust the address and the rebuild re-add it.
    kernel = FailingScripts(error)
    sidecar = SidecarEngine(SidecarTable(table="T"), kernel, ALLOW_API)
    await sidecar.install()
    asker = sidecar.asker(ip("10.0.0.9"))
    with pytest.raises(type(error)):
        await sidecar.learn(asker.uid, asker.fence, [(API, 60)], "api.x.io")
    assert not len(sidecar.leases) and not sidecar.destination_verified(ip("10.0.0.9"), "api.x.io", API)
    assert (await sidecar.set_policy(ALLOW_API)).status == 200
    assert str(API) not in kernel.scripts[-1][1]


def test_the_sidecar_judge_never_passes_a_would_deny() -> None:
    # Its table has no audit objects: the kernel refuses what an audit policy would deny, so a
    # flow to it must be cut (the sidecar refuses audit policies at its API anyway).
    audit = parse_policy('{"defaultAction":"deny","mode":"audit","egress":[]}')
    sidecar = SidecarEngine(SidecarTable(table="T"), FakeTx(), audit)
    assert not sidecar.allows_ip(ip("1.2.3.4"))


async def test_both_profiles_export_refusals_through_the_engines_samples() -> None:
    # The backend says whose each counter is; the engine's samples label them for the metric.
    from egressd.engine.refusals import RefusalSamples, samples
    from egressd.fleetnft.backend import fleet_refusals
    from egressd.metrics import EgressMetrics
    from egressd.sidecarnft.backend import SIDECAR_NFT_ID, sidecar_refusals

    fleet = fleet_refusals({"subj_s_a_dropped": 4, "unattributed_dropped": 2, "other": 9})
    assert samples(fleet, {"s_a": "s-a", "s_gone": "s-gone"}) == {("s-a",): 4.0, ("-",): 2.0}
    sidecar = sidecar_refusals({"dropped": 7})
    assert samples(sidecar, {SIDECAR_NFT_ID: "s-sidecar"}) == {("s-sidecar",): 7.0}  # no unattributed

    counters: list[dict[str, int]] = [{"dropped": 3}]

    async def read() -> dict[str, int]:
        if not counters:
            raise OSError("table gone")
        return counters[0]

    metrics = EgressMetrics()
    exported = RefusalSamples(metrics, read, sidecar_refusals, lambda: {SIDECAR_NFT_ID: "s-sidecar"})
    await exported.refresh()
    counters.clear()
    await exported.refresh()  # unreadable: the last samples stay
    assert 'egressd_subject_dropped_packets_total{subject="s-sidecar"} 3' in metrics.render()
