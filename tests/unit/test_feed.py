"""The change feed (egressd.feed, issue 24 item 2): every operation that may narrow what the
MITM's ``_active`` lookup answers publishes its event before it returns (docs/reference/behaviour.md §10,
"answered from memory").

Three parts: the feed itself; a table that enumerates the narrowing operations of both
engines (each must publish its typed event before it returns, and every event type of the feed
has at least one operation); and model-based tests that drive the fleet's control plane
(random sequences of actions, DNS answers, vault changes and always-rules reloads) and the
sidecar engine (policy changes, reloads, DNS answers) and check, after each operation, that
every client whose answer narrowed was covered by an event published before it returned.
Each was checked against a mutant that drops one owner's event (the vault's, the sidecar
engine's): it fails."""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

import egressd.feed as feed_module
from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.inputs import BindingInput, VaultAction
from egressd.addr import IPAddress
from egressd.feed import (
    AlwaysRulesChanged,
    ApiWrite,
    Feed,
    LeasesNarrowed,
    Narrowing,
    PolicyApplied,
    SubjectChanged,
    VaultChanged,
)
from egressd.fleet.server import ACTIONS_PATH, FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from egressd.policy import EMPTY_ALWAYS, AlwaysRules, Verdict, parse_always_text, parse_policy
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.http import SidecarHTTP
from egressd.sidecarnft.backend import SIDECAR_UID
from egressd.sidecarnft.ruleset import SidecarTable
from egressd.subject.model import Fence
from egressd.vault.parse import parse_create
from egressd.web.serving import InFlight
from tests.unit.actionhandler.test_control_dns import hook, ok, remove, set_binding
from tests.unit.fakekernel import FakeTx
from tests.unit.sidecar.test_sidecar_http import ready_prereqs

TABLE = "T"
API, CDN = ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("93.184.216.35")
PAIRS = (("api.x.io", API), ("cdn.x.io", CDN))
ALLOW_API = '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"}]}'
ALLOW_CDN = '{"defaultAction":"deny","egress":[{"action":"allow","target":"cdn.x.io"}]}'
ALLOW_BOTH = (
    '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"},'
    '{"action":"allow","target":"cdn.x.io"}]}'
)
DENY_ALL = '{"defaultAction":"deny"}'
POLICIES = (ALLOW_API, ALLOW_CDN, ALLOW_BOTH, DENY_ALL)
DENY_API = AlwaysRules(deny=parse_always_text("api.x.io\n", "deny.always", Verdict.DENY), allow=())
VAULT = {
    "credentials": [{"name": "key", "source": {"type": "inline", "value": "sk-feed-1"}}],
    "bindings": [{"name": "api", "match": {"hosts": ["api.x.io"]}, "auth": {"type": "bearer", "credential": "key"}}],
}


class Recorder:
    """A subscriber: the events published so far."""

    def __init__(self, feed: Feed) -> None:
        self.events: list[Narrowing] = []
        feed.subscribe(self.events.append)

    def take(self) -> list[Narrowing]:
        out = list(self.events)
        self.events.clear()  # the same list: it is what the feed appends to
        return out


def covers(events: list[Narrowing], client: object) -> bool:
    return any(e.clients is None or str(client) in {str(c) for c in e.clients} for e in events)


# --------------------------------------------------------------------------- the feed


def test_subscribers_are_called_synchronously_in_order_until_they_unsubscribe() -> None:
    feed = Feed()
    seen: list[tuple[str, Narrowing]] = []
    first = feed.subscribe(lambda e: seen.append(("a", e)))
    feed.subscribe(lambda e: seen.append(("b", e)))
    event = VaultChanged((ipaddress.ip_address("10.0.0.5"),))
    feed.publish(event)
    assert seen == [("a", event), ("b", event)]
    first()
    feed.publish(ApiWrite())
    assert seen[2:] == [("b", ApiWrite())]
    first()  # twice: harmless
    Feed().publish(Narrowing())  # nobody listens: a no-op


def test_events_are_typed_and_immutable() -> None:
    event = SubjectChanged()
    assert isinstance(event, Narrowing) and event.clients is None
    with pytest.raises(AttributeError):
        event.clients = ()  # type: ignore[misc]


# --------------------------------------------------------------------------- the operations

FENCE = Fence("r1", "a1")
SRC = ipaddress.ip_address("10.0.0.5")


async def _fleet(feed: Feed) -> ControlPlane:
    kernel = FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353), FakeTx(table_name=TABLE))
    control = ControlPlane(kernel, feed=feed)
    await control.reset_table()
    ok(await control.handle(set_binding("u-1", ALLOW_BOTH)))
    ok(await control.handle(hook("u-1")))
    await control.learn("u-1", FENCE, [(API, 300)], "api.x.io")
    return control


async def _vault(control: ControlPlane, action: VaultAction) -> None:
    content = parse_create(VAULT) if action is VaultAction.SET else None
    await control.credentials.activate("u-1", BindingInput(parse_policy(ALLOW_BOTH), action, content))


async def _api_write(feed: Feed, aiohttp_client: Any) -> None:
    control = await _fleet(feed)
    client = await aiohttp_client(FleetHTTP(control, EgressMetrics()).app())
    await client.post(ACTIONS_PATH, data=b"{}")  # refused by the handler: still a write


async def _orphaned_write(feed: Feed) -> None:
    inflight, release = InFlight(feed=feed), asyncio.Event()
    waiter = asyncio.create_task(inflight.run(release.wait()))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    feed.publish(Narrowing())  # marks the start of what is asserted: the late end's own event
    release.set()
    await inflight.drain(1)


def _sidecar(feed: Feed) -> SidecarEngine:
    return SidecarEngine(SidecarTable(table=TABLE), FakeTx(yield_each_call=False), parse_policy(ALLOW_BOTH), feed=feed)


async def _sidecar_vault(feed: Feed, aiohttp_client: Any) -> None:
    engine = _sidecar(feed)
    await engine.install()
    http = SidecarHTTP(engine, EgressMetrics(), token=None, max_rules=4096, prerequisites=ready_prereqs())
    client = await aiohttp_client(http.app())
    # The vault write's own VaultChanged, and the middleware's ApiWrite after it.
    assert (await client.put("/credential-vault", json=VAULT)).status == 201


Operation = Callable[[Feed, Any], Awaitable[Any]]


async def _fleet_op(feed: Feed, op: Callable[[ControlPlane], Awaitable[Any]]) -> None:
    control = await _fleet(feed)
    feed.publish(Narrowing())  # the set-up's events end here
    await op(control)


# Every operation of the two engines (and of the API around them) that may narrow what _active
# answers, and the event it must have published when it returns.
NARROWING_OPERATIONS: dict[str, tuple[Operation, type[Narrowing]]] = {
    "fleet: SET_BINDING narrows the policy": (
        lambda f, _: _fleet_op(f, lambda c: c.handle(set_binding("u-1", ALLOW_CDN))),
        PolicyApplied,
    ),
    "fleet: SET_BINDING commits the entry": (
        lambda f, _: _fleet_op(f, lambda c: c.handle(set_binding("u-1", ALLOW_API))),
        SubjectChanged,
    ),
    "fleet: REMOVE_BINDING": (lambda f, _: _fleet_op(f, lambda c: c.handle(remove("u-1"))), SubjectChanged),
    "fleet: REMOVE_BINDING forgets the leases": (
        lambda f, _: _fleet_op(f, lambda c: c.handle(remove("u-1"))),
        LeasesNarrowed,
    ),
    "fleet: rebind to another address": (
        lambda f, _: _fleet_op(f, lambda c: c.handle(set_binding("u-1", ALLOW_BOTH, ip_="10.0.0.6", rid="r2"))),
        VaultChanged,
    ),
    "fleet: always-rules reload": (lambda f, _: _fleet_op(f, lambda c: c.set_always_rules(DENY_API)), AlwaysRulesChanged),
    "fleet: vault set": (lambda f, _: _fleet_op(f, lambda c: _vault(c, VaultAction.SET)), VaultChanged),
    "fleet: vault removed": (lambda f, _: _fleet_op(f, lambda c: _vault(c, VaultAction.REMOVE)), VaultChanged),
    "fleet: HTTP API write": (_api_write, ApiWrite),
    "both: a write that ends after its client left": (lambda f, _: _orphaned_write(f), ApiWrite),
    "sidecar: policy change": (
        lambda f, _: _sidecar_op(f, lambda e: e.set_policy(parse_policy(ALLOW_CDN))),
        PolicyApplied,
    ),
    "sidecar: always-rules reload": (lambda f, _: _sidecar_op(f, lambda e: e.set_always_rules(DENY_API)), PolicyApplied),
    "sidecar: vault write": (_sidecar_vault, VaultChanged),
}


async def _sidecar_op(feed: Feed, op: Callable[[SidecarEngine], Awaitable[Any]]) -> None:
    engine = _sidecar(feed)
    await engine.install()
    await engine.learn(SIDECAR_UID, engine.fence, [(API, 300)], "api.x.io")
    feed.publish(Narrowing())
    await op(engine)


@pytest.mark.parametrize("name", sorted(NARROWING_OPERATIONS))
async def test_a_narrowing_operation_publishes_its_event_before_it_returns(name: str, aiohttp_client: Any) -> None:
    operation, expected = NARROWING_OPERATIONS[name]
    feed = Feed()
    recorder = Recorder(feed)
    await operation(feed, aiohttp_client)
    events = recorder.take()
    marks = [i for i, e in enumerate(events) if type(e) is Narrowing]
    after_setup = events[marks[-1] + 1 :] if marks else events
    assert any(type(e) is expected for e in after_setup), f"{name}: no {expected.__name__} in {after_setup}"


# The operations whose event must name the subject's own client (or every client): a
# VaultChanged that names another address leaves the MITM child answering with the old vault.
MUST_NAME_THE_CLIENT = (
    "fleet: vault set",
    "fleet: vault removed",
    "fleet: rebind to another address",
    "sidecar: vault write",
)


@pytest.mark.parametrize("name", MUST_NAME_THE_CLIENT)
async def test_the_event_names_the_client_whose_answer_narrowed(name: str, aiohttp_client: Any) -> None:
    operation, expected = NARROWING_OPERATIONS[name]
    feed = Feed()
    recorder = Recorder(feed)
    await operation(feed, aiohttp_client)
    events = recorder.take()
    marks = [i for i, e in enumerate(events) if type(e) is Narrowing]
    after_setup = [e for e in (events[marks[-1] + 1 :] if marks else events) if type(e) is expected]
    assert covers(after_setup, SRC), f"{name}: no {expected.__name__} naming {SRC} in {after_setup}"


def test_every_event_type_has_a_narrowing_operation() -> None:
    """A new kind of narrowing gets an operation in the table above (and so a test)."""
    kinds = {
        cls
        for _, cls in inspect.getmembers(feed_module, inspect.isclass)
        if issubclass(cls, Narrowing) and cls is not Narrowing
    }
    assert kinds == {expected for _, expected in NARROWING_OPERATIONS.values()}


# --------------------------------------------------------------------------- model-based (fleet)

CLIENTS = tuple(ipaddress.ip_address(f"10.0.0.{i}") for i in (5, 6, 7))
UIDS = ("u-1", "u-2")

View = tuple[str | None, tuple[float, ...]]


class FleetNarrowings(RuleBasedStateMachine):
    """Random sequences of the control plane's operations; after each, every client whose
    ``_active`` answer narrowed (its vault snapshot gone or replaced, a destination deadline
    shortened) must be covered by an event already published when the operation returned."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.feed = Feed()
        self.recorder = Recorder(self.feed)
        self.control = ControlPlane(
            FleetPlanKernel(TableConfig(table=TABLE, dns_port=15353), FakeTx(table_name=TABLE)),
            feed=self.feed,
        )
        self.fences: dict[str, tuple[str, str, int]] = {}  # uid -> (rid, ip, generation)
        self.views: dict[IPAddress, View] = {}

    def teardown(self) -> None:
        self.loop.run_until_complete(self.control.close())
        self.loop.close()

    def view(self, client: IPAddress) -> View:
        snapshot = self.control.credentials.vault_for_ip(client)
        deadlines = tuple(
            self.control.learning.destination_verified_until(client, host, dst) for host, dst in PAIRS
        )
        return (snapshot.tag if snapshot is not None else None), deadlines

    def run(self, op: Awaitable[Any]) -> None:
        """One operation, then the check: the events must be there when it has returned."""
        before = {c: self.view(c) for c in CLIENTS}
        self.recorder.take()
        self.loop.run_until_complete(op)
        events = self.recorder.take()  # nothing else runs between the return and this read
        for client in CLIENTS:
            (vault0, until0), (vault1, until1) = before[client], self.view(client)
            vault_narrowed = vault0 is not None and vault1 != vault0
            verdict_narrowed = any(u1 < u0 for u0, u1 in zip(until0, until1, strict=True))
            if vault_narrowed or verdict_narrowed:
                assert covers(events, client), f"{client} narrowed ({before[client]} -> {self.view(client)}): {events}"

    @initialize()
    def reset(self) -> None:
        self.run(self.control.reset_table())

    @rule(uid=st.sampled_from(UIDS), policy=st.sampled_from(POLICIES), last=st.sampled_from((5, 6, 7)))
    def set_binding(self, uid: str, policy: str, last: int) -> None:
        ip_ = f"10.0.0.{last}"
        rid, old_ip, gen = self.fences.get(uid, ("r0", ip_, 0))
        if old_ip != ip_ or uid not in self.fences:
            rid = f"r{gen + 1}"  # another address is another attachment (a new fence)
        self.fences[uid] = (rid, ip_, gen + 1)
        self.run(self.control.handle(set_binding(uid, policy, ip_=ip_, rid=rid, gen=gen + 1)))

    @rule(uid=st.sampled_from(UIDS), policy=st.sampled_from((ALLOW_API, ALLOW_BOTH)))
    def activate(self, uid: str, policy: str) -> None:
        """SET_BINDING then data-plane-ready, at the subject's address (each checked)."""
        self.set_binding(uid, policy, int(self.fences.get(uid, ("", "10.0.0.5", 0))[1].rsplit(".", 1)[1]))
        self.data_plane_ready(uid)

    @rule(uid=st.sampled_from(UIDS))
    def data_plane_ready(self, uid: str) -> None:
        rid = self.fences.get(uid, ("r1", "", 0))[0]
        self.run(self.control.handle(hook(uid, rid=rid)))

    @rule(uid=st.sampled_from(UIDS))
    def remove(self, uid: str) -> None:
        rid = self.fences.get(uid, ("r1", "", 0))[0]
        self.run(self.control.handle(remove(uid, rid=rid)))

    @rule(uid=st.sampled_from(UIDS), pair=st.sampled_from(PAIRS), ttl=st.sampled_from((60, 300)))
    def dns_answer(self, uid: str, pair: tuple[str, IPAddress], ttl: int) -> None:
        rid = self.fences.get(uid, ("r1", "", 0))[0]
        host, dst = pair
        self.run(self.control.learn(uid, Fence(rid, "a1"), [(dst, ttl)], host))

    @rule(always=st.sampled_from((EMPTY_ALWAYS, DENY_API)))
    def always_rules(self, always: AlwaysRules) -> None:
        self.run(self.control.set_always_rules(always))

    @rule(uid=st.sampled_from(UIDS), action=st.sampled_from((VaultAction.SET, VaultAction.REMOVE)))
    def vault(self, uid: str, action: VaultAction) -> None:
        content = parse_create(VAULT) if action is VaultAction.SET else None
        parsed = BindingInput(parse_policy(ALLOW_BOTH), action, content)

        async def activate() -> None:
            async with self.control.locks.hold(uid):
                await self.control.credentials.activate(uid, parsed)

        self.run(activate())


FleetNarrowings.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_fleet_narrowings_publish_before_they_return = FleetNarrowings.TestCase


# --------------------------------------------------------------------------- model-based (sidecar)


class SidecarNarrowings(RuleBasedStateMachine):
    """The sidecar engine (one implicit subject) the same way: policy changes, always-rules
    reloads and DNS answers in any order; a shortened destination deadline needs an event."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.feed = Feed()
        self.recorder = Recorder(self.feed)
        self.engine = SidecarEngine(
            SidecarTable(table=TABLE), FakeTx(yield_each_call=False), parse_policy(ALLOW_BOTH), feed=self.feed
        )

    def teardown(self) -> None:
        self.loop.close()

    def deadlines(self) -> tuple[float, ...]:
        return tuple(self.engine.destination_verified_until(SRC, host, dst) for host, dst in PAIRS)

    def run(self, op: Awaitable[Any]) -> None:
        before = self.deadlines()
        self.recorder.take()
        self.loop.run_until_complete(op)
        events = self.recorder.take()
        if any(u1 < u0 for u0, u1 in zip(before, self.deadlines(), strict=True)):
            assert covers(events, SRC), f"narrowed ({before} -> {self.deadlines()}): {events}"

    @initialize()
    def install(self) -> None:
        self.run(self.engine.install())

    @rule(policy=st.sampled_from(POLICIES))
    def set_policy(self, policy: str) -> None:
        self.run(self.engine.set_policy(parse_policy(policy)))

    @rule(always=st.sampled_from((EMPTY_ALWAYS, DENY_API)))
    def always_rules(self, always: AlwaysRules) -> None:
        self.run(self.engine.set_always_rules(always))

    @rule(pair=st.sampled_from(PAIRS), ttl=st.sampled_from((60, 300)))
    def dns_answer(self, pair: tuple[str, IPAddress], ttl: int) -> None:
        host, dst = pair
        self.run(self.engine.learn(SIDECAR_UID, self.engine.fence, [(dst, ttl)], host))


SidecarNarrowings.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_sidecar_narrowings_publish_before_they_return = SidecarNarrowings.TestCase
