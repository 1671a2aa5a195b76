"""The parts ``ControlPlane`` delegates to (issue 14), each reached through its owner.

The composition (DnsProxy wired with two callables), the kernel protocol without ``getattr``
(inline lease adds, set dumps for explain), the kernel naming the builder owns, the lease
book's shared answers for both profiles, and the parse-before-mutate of a SET_BINDING.
"""

from __future__ import annotations

import ipaddress
import json
import random
from collections.abc import Collection
from ipaddress import IPv4Network, IPv6Network

import pytest

from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION, SetBinding, parse_action
from egressd.actionhandler.inputs import BadRequest, BindingInput, read_set_binding
from egressd.actionhandler.shared import Claims
from egressd.addr import IPAddress
from egressd.dnsproxy.server import DnsProxy
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.subject import rules_per_subject, subject_rules
from egressd.fleetnft.table import TableConfig, subject_set
from egressd.kernel.netlink_dump import SetElement
from egressd.kernel.ops import AddRule, MatchRule, NetlinkBatch
from egressd.policy import EMPTY_ALWAYS, ip_sets, parse_policy
from egressd.policy.ipsets import PrefixIndex
from egressd.subject.leases import LeaseBook, admissible, destination_verified, narrowed_for
from egressd.subject.model import Asker, Fence
from egressd.subject.registry import Binding, SetBindingRequest
from egressd.vault.types import DEFAULT_LIMITS
from tests.unit.actionhandler.test_control_dns import TABLE, activate
from tests.unit.dnsproxy.test_dns_proxy import CLIENT, FENCE, POLICY, FakeForwarder, parse, q, wire
from tests.unit.fakekernel import FakeTx

ONLY_8 = '{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.0/24"},{"action":"allow","target":"*.example.com"}]}'


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


# --------------------------------------------------------------------------- DNS wiring


async def test_the_dns_proxy_is_wired_with_an_asker_and_an_on_resolved_callback() -> None:
    """No control plane object: the composition root hands the proxy two callables."""
    resolved: list[tuple[str, Fence, list[tuple[IPAddress, int]], str | None]] = []

    def asker(source: IPAddress) -> Asker | None:
        return Asker("u-1", FENCE, POLICY) if source == ip(CLIENT) else None

    async def on_resolved(
        uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None
    ) -> Collection[IPAddress]:
        resolved.append((uid, fence, leases, name))
        return [addr for addr, _ in leases]

    proxy = DnsProxy(asker, FakeForwarder(), on_resolved=on_resolved)  # type: ignore[arg-type]
    reply = parse(await proxy.answer(wire(q("www.example.com")), CLIENT, tcp=False))
    assert [str(rr.rdata) for rr in reply.rr] == ["93.184.216.34"]
    # The question as asked (the learner normalises it), the answer's TTL within the bounds.
    assert resolved == [("u-1", FENCE, [(ip("93.184.216.34"), 90)], "www.example.com.")]


# --------------------------------------------------------------------------- Transactions protocol


class InlineTx(FakeTx):
    """A kernel shell with its own inline path and set dumps (the real one has both)."""

    def __init__(self, sets: dict[str, list[SetElement]] | None = None) -> None:
        super().__init__()
        self.inline: list[str] = []
        self.sets = sets or {}
        self.dumped: list[str] = []

    async def run_batch_inline(self, batch: NetlinkBatch, *, op: str) -> None:
        self.inline.append(op)
        await self.run_batch(batch, op=op)

    async def list_set_elements(self, table: str, set_name: str) -> list[SetElement]:
        assert table == TABLE
        self.dumped.append(set_name)
        return self.sets.get(set_name, [])


async def make(tx: FakeTx, *, mitm: bool = False) -> ControlPlane:
    table = TableConfig(table=TABLE, dns_port=15353, mitm=mitm)
    control = ControlPlane(FleetPlanKernel(table, tx), always=EMPTY_ALWAYS)
    await control.reset_table()
    return control


async def test_a_dns_lease_add_leaves_the_inline_choice_to_the_shell() -> None:
    # A group-committed add may be heavy (many answers, a pipapo clone): it goes through
    # run_batch, whose budget keeps it inline only while it is cheap (egressd.kernel.applier).
    tx = InlineTx()
    control = await make(tx)
    await activate(control, policy=ONLY_8)
    assert await control.learning.learn("u-1", FENCE, [(ip("93.184.216.34"), 60)], "www.example.com") == [
        ip("93.184.216.34")
    ]
    assert tx.inline == []
    assert [op for op, _ in tx.batches][-1] == "dynamic_add"


async def test_explain_reads_the_kernels_sets_through_the_protocol() -> None:
    nid = "s_u_1"
    tx = InlineTx(
        {
            "dispatch_v4": [SetElement(ip("10.0.0.5").packed)],
            f"subj_{nid}_allow_v4": [
                SetElement(ip("8.8.8.0").packed),
                SetElement(ip("8.8.9.0").packed, interval_end=True),
            ],
            f"subj_{nid}_dyn_v4": [SetElement(ip("8.8.8.8").packed, timeout_ms=360_000, expires_ms=299_600)],
        }
    )
    control = await make(tx)
    await activate(control, policy=ONLY_8)
    view = await control.report.kernel_membership(ip("10.0.0.5"), ip("8.8.8.8"))
    assert view == {
        "available": True,
        "dispatched": True,
        "sets": [
            {"set": f"subj_{nid}_allow_v4", "element": "8.8.8.0/24"},
            {"set": f"subj_{nid}_dyn_v4", "element": "8.8.8.8", "expiresInS": 300},
        ],
    }
    assert tx.dumped == ["dispatch_v4", *(f"subj_{nid}_{k}_v4" for k in ("deny", "allow", "dyn"))]


async def test_explain_says_unavailable_when_the_kernel_cannot_be_read() -> None:
    control = await make(FakeTx())  # its list_set_elements refuses
    await activate(control, policy=ONLY_8)
    view = await control.report.kernel_membership(ip("10.0.0.5"), ip("8.8.8.8"))
    assert view["available"] is False and view["error"]


# --------------------------------------------------------------------------- kernel naming


def test_subject_set_names_one_of_the_subjects_sets() -> None:
    assert subject_set("s_u_1", "dyn", "v6") == "subj_s_u_1_dyn_v6"
    rules = [op.rule for op in subject_rules(TableConfig(), "s_u_1").ops if isinstance(op, AddRule)]
    names = {rule.set_name for rule in rules if isinstance(rule, MatchRule)}
    assert subject_set("s_u_1", "deny", "v4") in names and subject_set("s_u_1", "allow", "v6") in names


@pytest.mark.parametrize(
    ("mitm", "rules", "audit_rules", "range_rules"), [(False, 14, 20, 16), (True, 31, 41, 35)]
)
async def test_the_rules_gauge_counts_each_installed_subjects_fixed_rules(
    mitm: bool, rules: int, audit_rules: int, range_rules: int
) -> None:
    cfg = TableConfig(table=TABLE, dns_port=15353, mitm=mitm)
    assert rules_per_subject(cfg) == len(subject_rules(cfg, "x").ops) == rules
    assert rules_per_subject(cfg, audit=True) == len(subject_rules(cfg, "x", audit=True).ops) == audit_rules
    # The range rules (lazy like the audit ones): two in mark_<id>, two more in subj_<id>_in.
    assert rules_per_subject(cfg, ranges=True) == len(subject_rules(cfg, "x", ranges=True).ops) == range_rules
    assert rules_per_subject(cfg, audit=True, ranges=True) == audit_rules + range_rules - rules
    control = await make(FakeTx(), mitm=mitm)
    assert control.report.rules_count() == {(): 0.0}
    await activate(control, "u-1", "10.0.0.5", ONLY_8)
    await activate(control, "u-2", "10.0.0.6", ONLY_8)
    assert control.report.rules_count() == {(): float(2 * rules)}
    ranged = '{"defaultAction":"deny","egress":[{"action":"allow","target":"a.test","protocol":"tcp","ports":["8000-8099"]}]}'
    await activate(control, "u-3", "10.0.0.7", ranged)
    assert control.report.rules_count() == {(): float(2 * rules + range_rules)}


# --------------------------------------------------------------------------- the lease book's answers

NOW = 1000.0
API, CDN = ip("93.184.216.34"), ip("8.8.4.4")


def test_admissible_decides_an_answer_by_its_name_and_a_refresh_by_the_names_that_taught() -> None:
    effective = parse_policy(
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"*.example.com"}]}'
    )
    book = LeaseBook(cap=2)
    assert admissible(book, effective, [(API, 60)], "evil.test", NOW) == []
    assert [(g.ip, g.seconds) for g in admissible(book, effective, [(API, 60)], "www.example.com", NOW)] == [
        (API, 60)
    ]
    book.record([(API, 60)], "www.example.com", NOW)
    # A refresh renews only what an admitted name taught; CDN was never learned.
    assert [g.ip for g in admissible(book, effective, [(API, 360), (CDN, 360)], None, NOW)] == [API]
    denied = parse_policy('{"defaultAction":"deny"}')
    assert admissible(book, denied, [(API, 360)], None, NOW) == []


def test_narrowed_for_drops_leases_a_deny_prefix_covers() -> None:
    effective = parse_policy(
        '{"defaultAction":"deny","egress":[{"action":"deny","target":"8.8.4.0/24"},'
        '{"action":"allow","target":"*.example.com"}]}'
    )
    book = LeaseBook()
    book.record([(API, 60), (CDN, 60)], "www.example.com", NOW)
    sets = ip_sets(effective)
    narrowed = narrowed_for(book, effective, sets.deny_v4, sets.deny_v6, NOW)
    assert narrowed.revoked == (CDN,) and [g.ip for g in narrowed.kept] == [API]


def test_destination_verified_needs_the_name_s_lease_or_an_explicit_ip_allow() -> None:
    book = LeaseBook()
    book.record([(API, 60)], "api.example.com", NOW)
    sets = ip_sets(parse_policy(ONLY_8))
    assert destination_verified(book, sets, "api.example.com", API, NOW)
    assert not destination_verified(book, sets, "other.example.com", API, NOW)
    assert not destination_verified(book, sets, "api.example.com", API, NOW + 61)
    assert destination_verified(None, sets, "anything.example.com", ip("8.8.8.8"), NOW)
    assert not destination_verified(None, None, "anything.example.com", ip("8.8.8.8"), NOW)


# --------------------------------------------------------------------------- parse before mutate


def _set_binding(net: dict[str, str], policy: object = ONLY_8) -> SetBinding:
    doc = {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": "u-1"},
        "revision": {"specGeneration": 3, "runtimeInstanceId": "r1", "attachmentId": "a1"},
        "binding": {"input": policy},
        "attachment": {"network": {"hostVeth": "veth0", **net}},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, SetBinding)
    return action


async def read(action: SetBinding) -> tuple[SetBindingRequest, BindingInput | None]:
    return await read_set_binding(action, keys=None, always=EMPTY_ALWAYS, max_rules=0, limits=DEFAULT_LIMITS)


async def test_read_set_binding_gives_the_request_and_the_parsed_input() -> None:
    req, parsed = await read(_set_binding({"ip": "10.0.0.5", "gateway": "10.0.0.1"}))
    assert req.binding == Binding(ip("10.0.0.5"), ip("10.0.0.1"))
    assert req.spec_generation == 3 and req.policy == parse_policy(ONLY_8)
    assert parsed is not None


@pytest.mark.parametrize(
    ("net", "policy", "reason"),
    [
        (
            {"ip": "10.0.0.5", "gateway": "10.0.0.5"},
            ONLY_8,
            "invalid action envelope: attachment.network.gateway equals",
        ),
        (
            {"ip": "127.0.0.1", "gateway": "10.0.0.1"},
            ONLY_8,
            "invalid action envelope: attachment.network.ip 127.0.0.1",
        ),
        ({"ip": "10.0.0.5", "gateway": "10.0.0.1"}, '{"defaultAction":"maybe"}', "invalid binding input: "),
    ],
)
async def test_read_set_binding_refuses_with_the_whole_400_reason(
    net: dict[str, str], policy: str, reason: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        await read(_set_binding(net, policy))
    assert str(refused.value).startswith(reason)


def test_claims_of_set_bindings_in_flight_conflict_until_released() -> None:
    claims = Claims()
    binding = Binding(ip("10.0.0.5"), ip("10.0.0.1"))
    with claims.reserve("u-1", binding):
        assert claims.conflict("u-1", binding) is None
        assert claims.conflict("u-2", binding) == "ip 10.0.0.5 is being bound to another sandbox"
    assert claims.conflict("u-2", binding) is None and claims.ips == {} and claims.nft_ids == {}


# --------------------------------------------------------------------------- one membership index


def test_the_prefix_index_agrees_with_a_linear_scan() -> None:
    rng = random.Random(14)
    nets: list[IPv4Network | IPv6Network] = [
        ipaddress.ip_network((rng.randrange(1 << 32) & ~((1 << (32 - p)) - 1), p))
        for p in rng.choices(range(8, 33), k=300)
    ]
    nets += [
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("10.1.0.0/16"),
        ipaddress.ip_network("fd00::/64"),
    ]
    index = PrefixIndex(nets)
    probes = [ipaddress.ip_address(rng.randrange(1 << 32)) for _ in range(2000)]
    probes += [ip("10.1.2.3"), ip("fd00::1"), ip("fd00:0:0:1::1"), ip("9.255.255.255")]
    for probe in probes:
        holders = [n for n in nets if probe.version == n.version and probe in n]
        hit = index.hit(probe)
        assert (hit is None) == (not holders), probe
        assert hit is None or hit == min(holders, key=lambda n: n.prefixlen), probe  # the widest


def test_ip_sets_answer_from_the_index() -> None:
    sets = ip_sets(
        parse_policy(
            '{"defaultAction":"deny","egress":[{"action":"deny","target":"8.8.8.8"},'
            '{"action":"allow","target":"8.8.8.0/24"},{"action":"allow","target":"2001:db8::/32"}]}'
        )
    )
    assert sets.deny_hit(ip("8.8.8.8")) == ipaddress.ip_network("8.8.8.8/32")
    assert sets.allow_hit(ip("8.8.8.9")) == ipaddress.ip_network("8.8.8.0/24")
    assert sets.allow_hit(ip("2001:db8::1")) == ipaddress.ip_network("2001:db8::/32")
    assert not sets.explicitly_allows(ip("8.8.8.8")) and sets.explicitly_allows(ip("8.8.8.7"))
    assert sets.deny_hit(ip("9.9.9.9")) is None and sets.allow_hit(ip("::1")) is None
