"""Fault-injection matrix (issue 13 item 2; docs/reference/behaviour.md §2, §3, §8, §9, 14.1, 14.6).

Every plan the control plane executes is run against a MODEL KERNEL (the shared
:class:`~tests.unit.fakekernel.FakeKernel` with the typed :class:`Table` model below, which
interprets each :class:`NetlinkBatch` into an in-memory table, all or nothing like nf_tables),
and each of the plan's kernel transactions is made to fail in turn, in each fault kind:

* ``refused``: NftError before anything applied (the kernel said no);
* ``timeout``: the call hangs (bounded), then asyncio.TimeoutError, nothing applied;
* ``late_ack``: the batch APPLIED, then NftError (the ack read timed out: ETIMEDOUT, ENOBUFS);
* ``late_timeout``: the batch APPLIED, then asyncio.TimeoutError.

After the failure, three properties are checked by an openness evaluator that walks the
modelled table like a packet would (header drops, dispatch map -> subject chain -> deny sets
drop, marking map -> allow/dyn/audit sets mark, unmarked drop; with the MITM also the nat
redirect and ``sandbox_in`` -> ``subj_<id>_in``), for every source and a sample of
destinations (policy prefixes, learned, denied, outside, sibling, IPv6):

1. the kernel is never more open than the before- and the after-policy together (each
   (source, destination) the kernel passes, the before or the after kernel passes too);
2. the registry never claims narrower than the kernel: a (source, destination) the kernel
   passes but egressd's own account (``explain``: entry, effective policy, leases) denies
   belongs to a subject marked revoking (``ControlPlane.revoking()``);
3. the retry (the Fastlet re-sending the action, or egressd's own revocation retry first)
   converges to exactly the fault-free run: same table contents, registry entries, kernel
   views and openness, nothing left revoking.

The matrix (plans x transaction index x fault kind x MITM x retry order) is generated from
a fault-free run of each plan, which counts its transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION, LifecycleHook, RemoveBinding, SetBinding, parse_action
from egressd.addr import IPAddress
from egressd.fleetnft.header import header_script
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.kernel.applier import NftError, NftUncertain
from egressd.kernel.netlink_dump import SetElement
from egressd.kernel.netlink_elements import interval_keys
from egressd.kernel.ops import (
    AddChain,
    AddCounter,
    AddCounterRef,
    AddElements,
    AddIface,
    AddIntervals,
    AddJump,
    AddPort,
    AddRule,
    AddSet,
    AddTimed,
    AuditRule,
    DeleteChain,
    DeleteCounter,
    DeleteElement,
    DeleteIface,
    DeleteSet,
    FlushChain,
    FlushSet,
    MatchRule,
    NetlinkBatch,
    PortRule,
    RangeRule,
    Rule,
    RuleAction,
    VerdictRule,
)
from egressd.policy import AlwaysRules, Verdict, format_element, parse_policy
from egressd.policy.always import parse_always_text
from egressd.subject.model import Fence
from tests.unit.fakekernel import FakeKernel

TABLE = "T"
DNS_PORT = 15353
MITM_PORT = 18081
HANG_S = 0.002  # a hung kernel call is bounded by the applier's socket timeout; modelled short

Net = ipaddress.IPv4Network | ipaddress.IPv6Network


# --------------------------------------------------------------------------- model kernel


class ModelError(NftError):
    """What the modelled kernel refuses (nf_tables aborts the whole transaction)."""


@dataclass
class ModelSet:
    fam: str
    kind: str  # interval | timeout | plain | vmap
    size: int = 0
    nets: set[Net] = field(default_factory=set)  # interval sets
    addrs: set[IPAddress] = field(default_factory=set)  # plain and timeout sets
    jumps: dict[IPAddress, str] = field(default_factory=dict)  # verdict maps: key -> chain
    names: set[str] = field(default_factory=set)  # ifname sets (sandbox_ifaces)

    def has(self, ip: IPAddress) -> bool:
        if self.kind == "interval":
            return any(ip.version == n.version and ip in n for n in self.nets)
        return ip in self.addrs

    def snapshot(self) -> tuple[Any, ...]:
        return (
            self.fam,
            self.kind,
            self.size,
            frozenset(self.nets),
            frozenset(self.addrs),
            frozenset(self.jumps.items()),
            frozenset(self.names),
        )


@dataclass
class Table:
    """The fault matrix's model of the table (a :class:`~tests.unit.fakekernel.KernelModel`).

    Strict where nf_tables is: a missing object (ENOENT), a busy one (a chain a map jumps to,
    a set or counter a rule references: EBUSY), a key re-pointed at another chain or an
    overlapping interval (EEXIST), a full timeout set (ENFILE) abort the transaction.
    Creations without NLM_F_EXCL are no-ops when the object exists (as egressd sends them);
    rules are appended (NLM_F_APPEND), so adding one twice holds it twice.
    """

    sets: dict[str, ModelSet] = field(default_factory=dict)
    chains: dict[str, list[Rule]] = field(default_factory=dict)
    counters: set[str] = field(default_factory=set)
    loaded: bool = False  # the header was loaded (reset_table)

    def copy(self) -> Table:
        return Table(
            {
                n: ModelSet(s.fam, s.kind, s.size, set(s.nets), set(s.addrs), dict(s.jumps), set(s.names))
                for n, s in self.sets.items()
            },
            {n: list(r) for n, r in self.chains.items()},
            set(self.counters),
            self.loaded,
        )

    def reset(self, header_with_delete: str, header: str) -> None:
        del header_with_delete  # the model has no previous table to delete
        fresh = Table(loaded=True)
        for line in header.splitlines():
            m = _DECL.match(line)
            if m is None:
                continue
            kind, name, body = m.groups()
            if kind == "chain":
                fresh.chains.setdefault(name, [])
                continue
            fam = "v6" if "ipv6_addr" in body else "v4"
            sort = "vmap" if kind == "map" else ("interval" if "flags interval" in body else "plain")
            fresh.sets[name] = ModelSet(fam, sort)
            assert "elements" not in body or name.startswith("doh_block"), line
        self.sets, self.chains, self.counters, self.loaded = fresh.sets, fresh.chains, fresh.counters, True

    def apply_script(self, script: str) -> None:
        raise AssertionError(f"the fleet control plane sends netlink batches only: {script!r}")

    def apply_batch(self, batch: NetlinkBatch) -> None:
        assert self.loaded, "a batch before the header"
        _apply(self, batch)  # raises ModelError: the fake drops this copy

    def set_elements(self, name: str) -> list[SetElement]:
        s = _need(self, name)
        width = 4 if s.fam == "v4" else 16
        if s.kind == "interval":
            return [
                SetElement(k.to_bytes(width, "big"), end) for k, end in interval_keys(list(s.nets), s.fam)
            ]
        return [SetElement(ip.packed) for ip in (s.jumps if s.kind == "vmap" else s.addrs)]

    def elements(self, name: str) -> dict[str, str]:
        s = self.sets.get(name)
        if s is None:
            return {}
        out = {format_element(n): "" for n in s.nets} | {str(ip): "" for ip in s.addrs}
        return out | {str(ip): f"jump {chain}" for ip, chain in s.jumps.items()}

    def rules(self, chain: str) -> list[str]:
        return [r.render() for r in self.chains.get(chain, [])]

    def chain_names(self) -> list[str]:
        return list(self.chains)

    def set_names(self) -> list[str]:
        return list(self.sets)

    def snapshot(self) -> tuple[Any, ...]:
        return (
            tuple(sorted((n, s.snapshot()) for n, s in self.sets.items())),
            tuple(sorted((n, tuple(r)) for n, r in self.chains.items())),
            tuple(sorted(self.counters)),
        )


def _rule_refs(rule: Rule) -> tuple[list[str], list[str]]:
    """(sets, counters) a rule references: they must exist, and cannot go while it does."""
    if isinstance(rule, MatchRule):
        return [rule.set_name], []
    if isinstance(rule, AuditRule):
        return [rule.set_name, rule.hard], [rule.counter]
    if isinstance(rule, RangeRule):
        return [rule.set_name, rule.services], []
    return [], []


_DECL = re.compile(r"^add (set|map|chain) inet \S+ (\S+) \{ ?(.*)$")


def _need(table: Table, name: str) -> ModelSet:
    s = table.sets.get(name)
    if s is None:
        raise ModelError(f"No such file or directory: set {name}")
    return s


def _apply(t: Table, batch: NetlinkBatch) -> None:
    for op in batch.ops:
        _APPLY[type(op)](t, op)


def _add_set(t: Table, op: AddSet) -> None:
    old = t.sets.get(op.name)
    if old is None:
        t.sets[op.name] = ModelSet(op.fam, op.kind, op.size)
    elif (old.fam, old.kind, old.size) != (op.fam, op.kind, op.size):
        raise ModelError(f"File exists: set {op.name} with other properties")


def _add_chain(t: Table, op: AddChain) -> None:
    t.chains.setdefault(op.name, [])


def _add_counter(t: Table, op: AddCounter) -> None:
    t.counters.add(op.name)


def _delete_counter(t: Table, op: DeleteCounter) -> None:
    if op.name not in t.counters:
        raise ModelError(f"No such file or directory: counter {op.name}")
    if any(op.name in _rule_refs(r)[1] for rules in t.chains.values() for r in rules):
        raise ModelError(f"Device or resource busy: counter {op.name}")
    if any(f"counter:{op.name}" in s.jumps.values() for s in t.sets.values()):
        raise ModelError(f"Device or resource busy: counter {op.name} (map element)")
    t.counters.discard(op.name)


def _add_counter_ref(t: Table, op: AddCounterRef) -> None:
    # Counter maps are modelled like verdict maps, the data being the counter's name.
    m = _need(t, op.map)
    assert m.kind == "vmap", op
    if op.counter not in t.counters:
        raise ModelError(f"No such file or directory: counter {op.counter}")
    ref = f"counter:{op.counter}"
    if m.jumps.get(op.key, ref) != ref:
        raise ModelError(f"Device or resource busy: {op.key} in {op.map}")
    m.jumps[op.key] = ref


def _add_jump(t: Table, op: AddJump) -> None:
    m = _need(t, op.map)
    assert m.kind == "vmap", op
    if op.chain not in t.chains:
        raise ModelError(f"No such file or directory: chain {op.chain}")
    if m.jumps.get(op.key, op.chain) != op.chain:
        raise ModelError(f"File exists: {op.key} in {op.map}")
    m.jumps[op.key] = op.chain


def _add_elements(t: Table, op: AddElements) -> None:
    s = _need(t, op.name)
    assert s.kind == "plain", op
    s.addrs.update(op.keys)


def _add_rule(t: Table, op: AddRule) -> None:
    if op.chain not in t.chains:
        raise ModelError(f"No such file or directory: chain {op.chain}")
    sets, counters = _rule_refs(op.rule)
    for name in sets:
        _need(t, name)
    for name in counters:
        if name not in t.counters:
            raise ModelError(f"No such file or directory: counter {name}")
    t.chains[op.chain].append(op.rule)


def _flush_set(t: Table, op: FlushSet) -> None:
    s = _need(t, op.name)
    s.nets.clear()
    s.addrs.clear()
    s.jumps.clear()


def _add_intervals(t: Table, op: AddIntervals) -> None:
    s = _need(t, op.name)
    assert s.kind == "interval", op
    for net in op.nets:
        if any(net != n and net.overlaps(n) for n in s.nets if n.version == net.version):
            raise ModelError(f"File exists: {net} overlaps an element of {op.name}")
        s.nets.add(net)


def _add_timed(t: Table, op: AddTimed) -> None:
    s = _need(t, op.name)
    assert s.kind == "timeout", op
    s.addrs.update(ip for ip, _ in op.leases)  # expiry is not modelled: tests run in ms
    if s.size and len(s.addrs) > s.size:
        raise ModelError(f"Too many open files in system: {op.name} is full")


def _delete_element(t: Table, op: DeleteElement) -> None:
    s = _need(t, op.name)
    if s.kind == "vmap":
        if op.key not in s.jumps:
            raise ModelError(f"No such file or directory: {op.key} in {op.name}")
        del s.jumps[op.key]
    else:
        if op.key not in s.addrs:
            raise ModelError(f"No such file or directory: {op.key} in {op.name}")
        s.addrs.discard(op.key)


def _flush_chain(t: Table, op: FlushChain) -> None:
    if op.name not in t.chains:
        raise ModelError(f"No such file or directory: chain {op.name}")
    t.chains[op.name] = []


def _delete_chain(t: Table, op: DeleteChain) -> None:
    if op.name not in t.chains:
        raise ModelError(f"No such file or directory: chain {op.name}")
    if any(op.name in s.jumps.values() for s in t.sets.values()):
        raise ModelError(f"Device or resource busy: chain {op.name}")
    del t.chains[op.name]  # with its rules


def _add_port(t: Table, op: AddPort) -> None:
    # Port maps are modelled like verdict maps too; another value for a key is EBUSY.
    m = _need(t, op.map)
    assert m.kind == "vmap", op
    ref = f"port:{op.to_port}"
    if m.jumps.get(op.key, ref) != ref:
        raise ModelError(f"Device or resource busy: {op.key} in {op.map}")
    m.jumps[op.key] = ref


def _delete_set(t: Table, op: DeleteSet) -> None:
    _need(t, op.name)
    if any(op.name in _rule_refs(r)[0] for rules in t.chains.values() for r in rules):
        raise ModelError(f"Device or resource busy: set {op.name}")
    del t.sets[op.name]


def _add_iface(t: Table, op: AddIface) -> None:
    _need(t, op.name).names.add(op.iface)


def _delete_iface(t: Table, op: DeleteIface) -> None:
    s = _need(t, op.name)
    if op.iface not in s.names:
        raise ModelError(f"No such file or directory: {op.iface} in {op.name}")
    s.names.discard(op.iface)


#: One model function per operation type (a KeyError for an operation the model lacks).
_APPLY: dict[type, Callable[[Table, Any], None]] = {
    AddSet: _add_set,
    AddChain: _add_chain,
    AddCounter: _add_counter,
    DeleteCounter: _delete_counter,
    AddCounterRef: _add_counter_ref,
    AddPort: _add_port,
    AddJump: _add_jump,
    AddElements: _add_elements,
    AddRule: _add_rule,
    FlushSet: _flush_set,
    AddIntervals: _add_intervals,
    AddTimed: _add_timed,
    DeleteElement: _delete_element,
    FlushChain: _flush_chain,
    DeleteChain: _delete_chain,
    DeleteSet: _delete_set,
    AddIface: _add_iface,
    DeleteIface: _delete_iface,
}


# --------------------------------------------------------------------------- openness


def _fam(ip: IPAddress) -> str:
    return "v4" if ip.version == 4 else "v6"


def _in(t: Table, name: str, ip: IPAddress) -> bool:
    s = t.sets.get(name)
    return s is not None and s.has(ip)


def _run_chain(t: Table, chain: str, dst: IPAddress, marked: bool) -> tuple[str | None, bool]:
    """Walk a regular chain: (verdict or None to continue, mark afterwards)."""
    fam = _fam(dst)
    for rule in t.chains.get(chain, []):
        if isinstance(rule, VerdictRule):
            return rule.outcome.value, marked
        if rule.fam != fam or isinstance(rule, PortRule | RangeRule):
            continue  # the model's packets are TCP without ports: no port-scoped element holds them
        if isinstance(rule, MatchRule):
            if _in(t, rule.set_name, dst):
                if rule.outcome is RuleAction.MARK:
                    marked = True
                else:
                    return rule.outcome.value, marked
        elif (
            _in(t, rule.set_name, dst) and not _in(t, rule.hard, dst) and not (rule.unmarked_only and marked)
        ):
            marked = True  # an audit would-deny: logged, counted and passed
    return None, marked


def _vmap_target(t: Table, name: str, ip: IPAddress) -> str | None:
    m = t.sets.get(name)
    return None if m is None else m.jumps.get(ip)


def kernel_allows(t: Table, cfg: TableConfig, src: IPAddress, dst: IPAddress) -> bool:
    """Would a NEW tcp/443 flow src -> dst pass the modelled table? (header.header_script,
    subject_rules: read them side by side; only the rules that decide such a flow.)"""
    fam = _fam(src)
    if _fam(dst) != fam:
        return False
    sandboxish = _in(t, f"sandboxes_{fam}", dst) or _in(t, f"sandbox_nets_{fam}", dst)
    # nat (MITM): gateway, sandbox and sandbox-net destinations return un-intercepted (and
    # meet the forward drop below); anything else is REDIRECTed to the MITM port.
    if cfg.mitm and _in(t, f"mitm_src_{fam}", src) and not (_in(t, f"dns_gw_{fam}", dst) or sandboxish):
        # input: sandbox sources jump to sandbox_in, everything else meets the
        # "tcp dport <mitm> drop"; sandbox_in drops sandbox original destinations and
        # hands the rest to the source's subj_<id>_in via mitm_in (no element: drop).
        if not (_in(t, f"sandboxes_{fam}", src) or _in(t, f"sandbox_nets_{fam}", src)):
            return False
        # No worker port: the nat drop right after the redirect (never the forward path).
        if _vmap_target(t, f"mitm_port_{fam}", src) is None:
            return False
        chain = _vmap_target(t, f"mitm_in_{fam}", src)
        if chain is None:
            return False
        verdict, _ = _run_chain(t, chain, dst, False)
        return verdict == "accept"
    # forward hook: prerouting marking (our bit cleared first), then dispatch.
    marked = False
    mark_chain = _vmap_target(t, f"marking_{fam}", src)
    if mark_chain is not None:
        verdict, marked = _run_chain(t, mark_chain, dst, False)
        assert verdict is None, "mark chains never decide"
    if sandboxish:
        return False
    chain = _vmap_target(t, f"dispatch_{fam}", src)
    if chain is not None:
        verdict, marked = _run_chain(t, chain, dst, marked)
        if verdict == "drop":
            return False
        assert verdict is None, verdict
    return marked  # meta mark & 0x2 != 0x2 drop


def test_the_evaluator_reads_the_header_it_models() -> None:
    """The header rules the evaluator hard-codes are the ones header_script emits."""
    for mitm in (False, True):
        text = header_script(TableConfig(table=TABLE, mitm=mitm), delete_existing=False)
        for rule in (
            "dispatch ip daddr @sandboxes_v4 goto denied",
            "dispatch ip daddr @sandbox_nets_v4 goto denied",
            "dispatch ip saddr vmap @dispatch_v4",
            "dispatch meta mark & 0x2 != 0x2 goto denied",
            "marking ip saddr vmap @marking_v4",
        ):
            assert f"add rule inet {TABLE} {rule}" in text
        if mitm:
            for rule in (
                "input ip saddr @sandboxes_v4 jump sandbox_in",
                f"input tcp dport {MITM_PORT} goto denied",
                f"sandbox_in tcp dport {MITM_PORT} ct status dnat ip saddr vmap @mitm_in_v4",
                "nat ip saddr @mitm_src_v4 tcp dport { 80, 443 } redirect to :ip saddr map @mitm_port_v4",
                "nat ip saddr @mitm_src_v4 tcp dport { 80, 443 } drop",
                "nat ip daddr @sandbox_nets_v4 meta l4proto tcp return",
                "sandbox_in goto denied",
            ):
                assert f"add rule inet {TABLE} {rule}" in text


# --------------------------------------------------------------------------- scenario material

IP1, IP1B, IP2 = "10.0.0.5", "10.0.0.7", "10.0.0.6"
GW, GW_B = "10.0.0.1", "10.0.0.254"
LEARNED = "93.184.216.34"
LEARNED_B = "93.184.216.35"

P_A = {
    "defaultAction": "deny",
    "egress": [
        {"action": "deny", "target": "1.1.1.1"},
        {"action": "allow", "target": "8.8.8.8"},
        {"action": "allow", "target": "1.1.0.0/16"},
        {"action": "allow", "target": "example.com"},
        {"action": "allow", "target": "2001:4860::/32"},
    ],
}
P_NARROW = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "8.8.8.8"}]}
P_WIDE = {
    "defaultAction": "deny",
    "egress": [
        *P_A["egress"],
        {"action": "allow", "target": "9.9.9.0/24"},
        {"action": "allow", "target": "example.org"},
    ],
}
P_OPEN = {"defaultAction": "allow", "egress": [{"action": "deny", "target": "203.0.113.0/28"}]}
P_AUDIT = {**P_A, "mode": "audit"}
P_NEIGHBOUR = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "7.7.7.7"}]}

SOURCES = [ipaddress.ip_address(a) for a in (IP1, IP1B, IP2, "2001:db8::5")]
DESTINATIONS = [
    ipaddress.ip_address(a)
    for a in (
        "8.8.8.8",
        "1.1.2.3",
        "1.1.1.1",
        "9.9.9.9",
        "7.7.7.7",
        LEARNED,
        LEARNED_B,
        "203.0.113.7",
        "198.51.100.1",
        IP2,
        IP1,
        GW,
        "2001:4860::8888",
        "2001:db8::99",
    )
]
# The IPv6 source is registered by no subject: every flow from it must be dropped.

U1, U2 = "u-1", "u-2"


def _set_binding(
    uid: str,
    policy: object,
    *,
    ip: str = IP1,
    gw: str = GW,
    rid: str = "r1",
    gen: int = 1,
    cidr: str | None = "10.0.0.0/24",
) -> SetBinding:
    net: dict[str, str] = {"ip": ip, "hostVeth": "veth0", "gateway": gw}
    if cidr is not None:
        net["privateCidr"] = cidr
    doc = {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"specGeneration": gen, "runtimeInstanceId": rid, "attachmentId": "a1"},
        "binding": {"input": json.dumps(policy) if policy is not None else None},
        "attachment": {"network": net},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, SetBinding)
    return action


def _ready(uid: str, rid: str = "r1") -> LifecycleHook:
    doc = {
        "apiVersion": API_VERSION,
        "operation": "LIFECYCLE_HOOK",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": "a1"},
        "hook": {"name": "sandbox.data-plane-ready", "sequence": 1},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, LifecycleHook)
    return action


def _remove(uid: str, rid: str = "r1") -> RemoveBinding:
    doc = {
        "apiVersion": API_VERSION,
        "operation": "REMOVE_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": "a1"},
    }
    action = parse_action(json.dumps(doc).encode())
    assert isinstance(action, RemoveBinding)
    return action


def _always(*, deny: tuple[str, ...] = (), allow: tuple[str, ...] = ()) -> AlwaysRules:
    return AlwaysRules(
        parse_always_text("\n".join(deny), "deny.always", Verdict.DENY),
        parse_always_text("\n".join(allow), "allow.always", Verdict.ALLOW),
    )


FENCE1 = Fence("r1", "a1")


async def _ok(result: Awaitable[Any]) -> None:
    res = await result
    assert res is None or getattr(res, "status", 200) == 200, res


async def _activate(c: ControlPlane, uid: str, policy: object, *, ip: str = IP1) -> None:
    await _ok(c.handle(_set_binding(uid, policy, ip=ip)))
    await _ok(c.handle(_ready(uid)))


async def _learn(c: ControlPlane, ip: str = LEARNED, name: str = "example.com") -> None:
    got = await c.learn(U1, FENCE1, [(ipaddress.ip_address(ip), 300)], name)
    assert got, "setup learn refused"


Step = Callable[[ControlPlane], Awaitable[Any]]


@dataclass(frozen=True)
class Scenario:
    """``setup`` fault-free, then ``action`` (the one faults hit), whose retry is the same call."""

    name: str
    setup: Step
    action: Step
    # The caller bounds the call and cancels it on a hang (the DNS proxy's learn timeout);
    # actions run to their end (14.10) and the refresh is unbounded: a hang there is the
    # applier's socket timeout, i.e. ``timeout`` / ``late_ack``.
    bounded: bool = False


async def _neighbour(c: ControlPlane) -> None:
    await _activate(c, U2, P_NEIGHBOUR, ip=IP2)


async def _bound(c: ControlPlane) -> None:
    await _neighbour(c)
    await _ok(c.handle(_set_binding(U1, P_A)))


def _active(policy: object, *, learn: bool = True) -> Step:
    async def setup(c: ControlPlane) -> None:
        await _neighbour(c)
        await _activate(c, U1, policy)
        if learn:
            await _learn(c)

    return setup


def _act(action: Any) -> Step:
    async def run(c: ControlPlane) -> Any:
        return await c.handle(action)

    return run


def _set_always(rules: AlwaysRules) -> Step:
    async def run(c: ControlPlane) -> None:
        await c.set_always_rules(rules)

    return run


async def _learn_b(c: ControlPlane) -> None:
    if not await c.learn(U1, FENCE1, [(ipaddress.ip_address(LEARNED_B), 300)], "example.com"):
        raise RuntimeError("learn returned nothing")


async def _renew(c: ControlPlane) -> None:
    await c.renew_leases(U1, [ipaddress.ip_address(LEARNED)], 360)


async def _proxy_policy(c: ControlPlane) -> Any:
    # The proxy route's /policy write: an in-place plan under the subject's lock.
    async with c.locks.hold(U1):
        entry = c.registry.get(U1)
        assert entry is not None
        return await c.apply_user_policy_locked(entry, parse_policy(json.dumps(P_NARROW)))


def _scenarios() -> list[Scenario]:
    return [
        Scenario("deny_first", _neighbour, _act(_set_binding(U1, P_A))),
        Scenario("deny_first_rerun", _bound, _act(_set_binding(U1, P_WIDE, gen=2))),
        Scenario("activation", _bound, _act(_ready(U1))),
        Scenario("update_narrow", _active(P_A), _act(_set_binding(U1, P_NARROW, gen=2))),
        Scenario("update_widen", _active(P_NARROW, learn=False), _act(_set_binding(U1, P_WIDE, gen=2))),
        Scenario("update_open", _active(P_A), _act(_set_binding(U1, P_OPEN, gen=2))),
        Scenario("proxy_policy", _active(P_A), _proxy_policy),
        Scenario("revert", _active(P_A), _act(_set_binding(U1, None, gen=2))),
        Scenario("revert_other_ip", _active(P_A), _act(_set_binding(U1, None, ip=IP1B, gw=GW_B, gen=2))),
        Scenario("rebind_same_ip", _active(P_A), _act(_set_binding(U1, P_WIDE, rid="r2"))),
        Scenario("rebind_other_ip", _active(P_A), _act(_set_binding(U1, P_WIDE, rid="r2", ip=IP1B))),
        Scenario("removal", _active(P_A), _act(_remove(U1))),
        Scenario("removal_denying", _bound, _act(_remove(U1))),
        Scenario("rekey_ip", _active(P_A), _act(_set_binding(U1, P_A, ip=IP1B, gen=2))),
        Scenario("rekey_gateway", _active(P_A), _act(_set_binding(U1, P_A, gw=GW_B, gen=2))),
        Scenario(
            "rekey_ip_widen", _active(P_NARROW, learn=False), _act(_set_binding(U1, P_WIDE, ip=IP1B, gen=2))
        ),
        Scenario(
            "always_deny", _active(P_A), _set_always(_always(deny=("8.8.8.8", "example.com", "7.7.7.7")))
        ),
        Scenario("always_allow", _active(P_NARROW, learn=False), _set_always(_always(allow=("9.9.9.9",)))),
        Scenario("dns_learn", _active(P_A, learn=False), _learn_b, bounded=True),
        Scenario("dns_learn_renew", _active(P_A), _learn_b, bounded=True),
        Scenario("refresh", _active(P_A), _renew),
        Scenario("audit_on", _active(P_A), _act(_set_binding(U1, P_AUDIT, gen=2))),
        Scenario("audit_off", _active(P_AUDIT, learn=False), _act(_set_binding(U1, P_A, gen=2))),
    ]


SCENARIOS = {s.name: s for s in _scenarios()}
FAULTS = ("refused", "timeout", "late_ack", "late_timeout")
# Who retries first: the Fastlet (or DNS, or the reloader) re-sending the same call; egressd's
# own revocation retry; or the Fastlet, whose first retry the kernel refuses once more.
RETRIES = ("fastlet", "egressd_first", "refused_again")


# --------------------------------------------------------------------------- harness


@dataclass
class Run:
    kernel: FakeKernel[Table]
    control: ControlPlane


async def _fresh(mitm: bool) -> Run:
    kernel = FakeKernel(model=Table(), table_name=TABLE, hang_s=HANG_S)
    control = ControlPlane(
        FleetPlanKernel(TableConfig(table=TABLE, dns_port=DNS_PORT, mitm=mitm, mitm_port=MITM_PORT), kernel)
    )
    # egressd's own revocation retry is driven explicitly below, never behind a check's back.
    control.revocations.backoff = (3600.0, 3600.0)
    await control.reset_table()
    return Run(kernel, control)


def _openness(run: Run) -> frozenset[tuple[IPAddress, IPAddress]]:
    t = run.kernel.table
    assert t is not None
    cfg = run.control.table
    assert isinstance(cfg, TableConfig)
    return frozenset((s, d) for s in SOURCES for d in DESTINATIONS if kernel_allows(t, cfg, s, d))


def _claimed(run: Run, src: IPAddress, dst: IPAddress) -> bool:
    """egressd's own account of (src, dst): the registry entry, its effective policy and the
    lease book, through ``explain`` (what egressctl shows and the MITM and DNS rely on)."""
    out = run.control.report.explain(src, str(dst))
    return out.get("decision") == "allow" or bool(out.get("wouldDeny"))


def _owner(run: Run, src: IPAddress) -> str | None:
    """The uid whose chains the kernel dispatches ``src`` to (from kernel truth)."""
    t = run.kernel.table
    assert t is not None
    chains = {_vmap_target(t, f"{m}_{_fam(src)}", src) for m in ("dispatch", "marking", "mitm_in")}
    for entry in run.control.registry:
        if {f"subj_{entry.nft_id}", f"mark_{entry.nft_id}", f"subj_{entry.nft_id}_in"} & chains:
            return entry.uid
    return next(iter(c for c in chains if c), None)


def _registry(run: Run) -> tuple[Any, ...]:
    reg = run.control.registry
    return tuple(
        sorted(
            (e.uid, e.fence, e.state, e.binding, e.spec_generation, e.pending, e.policy, reg.kernel(e.uid))
            for e in reg
        )
    )


@dataclass(frozen=True)
class Reference:
    calls: int  # transactions of the action
    before: frozenset[tuple[IPAddress, IPAddress]]
    after: frozenset[tuple[IPAddress, IPAddress]]
    table: tuple[Any, ...]
    registry: tuple[Any, ...]
    leases: dict[str, frozenset[IPAddress]]


def _leases(run: Run) -> dict[str, frozenset[IPAddress]]:
    return {uid: frozenset(book) for uid, book in run.control.leases.items() if len(book)}


_REFERENCES: dict[tuple[str, bool], Reference] = {}
LATERAL = {ipaddress.ip_address(a) for a in (IP1, IP1B, IP2, GW, GW_B)}


def _agree(run: Run) -> None:
    """Without faults the evaluator and egressd's own account agree on every sample: the
    oracle is faithful. Aside: the header's lateral drops, which ``explain`` does not model,
    and the intercepted path (MITM), which never audits: a would-deny is dropped there."""
    now = _openness(run)
    for src in SOURCES:
        for dst in DESTINATIONS:
            if dst.version != src.version:
                continue  # no such packet
            out = run.control.report.explain(src, str(dst))
            claimed = _claimed(run, src, dst) and dst not in LATERAL
            if run.control.table.mitm and out.get("wouldDeny"):
                claimed = False
            assert ((src, dst) in now) == claimed, f"evaluator and explain disagree on {src} -> {dst}: {out}"


async def _reference(scenario: Scenario, mitm: bool) -> Reference:
    key = (scenario.name, mitm)
    if key not in _REFERENCES:
        run = await _fresh(mitm)
        await scenario.setup(run.control)
        _agree(run)
        before = _openness(run)
        start = run.kernel.mark()
        await _ok(scenario.action(run.control))
        assert not run.control.revoking()
        assert run.kernel.table is not None
        _agree(run)
        _REFERENCES[key] = Reference(
            len(run.kernel.since(start)),
            before,
            _openness(run),
            run.kernel.table.snapshot(),
            _registry(run),
            _leases(run),
        )
        await run.control.close()
    return _REFERENCES[key]


def _calls_of(name: str, mitm: bool) -> int:
    return asyncio.run(_reference(SCENARIOS[name], mitm)).calls


def _cells() -> Iterator[Any]:
    for name in SCENARIOS:
        for mitm in (False, True):
            n = _calls_of(name, mitm)
            assert n >= 1, name
            for index in range(1, n + 1):
                for fault in FAULTS + (("hang",) if SCENARIOS[name].bounded else ()):
                    for retry in RETRIES:
                        cell_id = f"{name}-{'mitm' if mitm else 'plain'}-tx{index}of{n}-{fault}-{retry}"
                        yield pytest.param(name, mitm, index, fault, retry, id=cell_id)


CELLS = list(_cells())


def _check_bounds(run: Run, ref: Reference, when: str) -> None:
    now = _openness(run)
    extra = now - (ref.before | ref.after)
    assert not extra, f"{when}: kernel opens what neither policy opens: {sorted(map(str, extra))}"
    revoking = run.control.revoking()
    for src, dst in now:
        if _claimed(run, src, dst):
            continue
        owner = _owner(run, src)
        assert owner in revoking, (
            f"{when}: kernel passes {src} -> {dst} but the registry claims it closed and "
            f"{owner!r} is not revoking (revoking: {sorted(revoking)})"
        )


async def _drain_revocations(run: Run) -> None:
    """Let egressd's own revocation retry run until nothing is pending (bounded)."""
    c = run.control
    for _ in range(50):
        if not c.revoking():
            return
        tasks = [t for t in c.revocations.tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        c.revocations.backoff = (0.0, 0.0)
        # A retry per pending revocation, exactly as the background task would run it.
        for uid in list(c.revoking()):
            task = asyncio.get_running_loop().create_task(c.revocations.retry(uid))
            c.revocations.tasks[uid] = task
            await asyncio.wait_for(asyncio.shield(task), 1.0)
    raise AssertionError(f"revocations never converged: {c.revoking()}")


@pytest.mark.parametrize(("name", "mitm", "index", "fault", "retry"), CELLS)
async def test_fault_matrix_cell(name: str, mitm: bool, index: int, fault: str, retry: str) -> None:
    scenario = SCENARIOS[name]
    ref = await _reference(scenario, mitm)
    run = await _fresh(mitm)
    await scenario.setup(run.control)
    assert _openness(run) == ref.before
    run.kernel.fail(call=run.kernel.mark() + index, fault=fault)
    try:
        if scenario.bounded:
            # As the DNS proxy does: asyncio.wait_for(learn(...), _LEARN_TIMEOUT_S).
            result = await asyncio.wait_for(scenario.action(run.control), 0.05)
        else:
            result = await scenario.action(run.control)
    except Exception:
        result = None  # the HTTP layer answers 500 ("internal error"); the DNS reply fails
    assert run.kernel.fired, "the fault never fired: the plan took another path"
    assert result is None or getattr(result, "status", 500) != 200, f"a failed transaction answered {result}"
    _check_bounds(run, ref, f"after the {fault} of transaction {index}")

    if retry == "egressd_first":
        await _drain_revocations(run)
        _check_bounds(run, ref, "after egressd's own retry")
    if retry == "refused_again":
        run.kernel.fail(call=run.kernel.mark() + 1)
        run.kernel.fired = False
        try:
            result = await scenario.action(run.control)
        except Exception:
            result = None
        assert result is None or getattr(result, "status", 500) != 200, f"a refused retry answered {result}"
        assert run.kernel.fired
        _check_bounds(run, ref, "after a refused retry")
    try:
        await _ok(scenario.action(run.control))  # the Fastlet (or DNS, or the reloader) retries
    except Exception as exc:
        raise AssertionError(f"the retry failed: {exc!r}") from exc
    await _drain_revocations(run)

    assert not run.control.revoking()
    assert run.kernel.table is not None
    assert _openness(run) == ref.after
    assert run.kernel.table.snapshot() == ref.table, "the table did not converge to the fault-free one"
    assert _registry(run) == ref.registry
    assert _leases(run) == ref.leases
    await run.control.close()


def test_matrix_size() -> None:
    """Recorded in docs/security.md; a plan that grows a transaction grows the matrix."""
    assert len(SCENARIOS) == 23
    cells = {(c.values[0], c.values[2], c.values[3]) for c in CELLS}  # plan x step x fault
    assert len(cells) == 118
    assert len(CELLS) == len(cells) * 2 * len(RETRIES)  # x MITM off/on x retry order


# --------------------------------------------------------------------------- named regressions
# Each is also a matrix cell; spelled out because each failed before the fix (see
# docs/security.md, "Fault-injection matrix").


async def _faulted(scenario: str, index: int, fault: str) -> Run:
    run = await _fresh(False)
    await SCENARIOS[scenario].setup(run.control)
    run.kernel.fail(call=run.kernel.mark() + index, fault=fault)
    with contextlib.suppress(Exception):
        await SCENARIOS[scenario].action(run.control)
    assert run.kernel.fired
    return run


async def test_a_removal_whose_answer_was_lost_is_retried_to_the_end() -> None:
    """Before: the view still listed the deleted objects, so every retry died on ENOENT and
    the subject stayed registered and revoking forever (/healthz 503 for good)."""
    run = await _faulted("removal", 1, "late_ack")
    assert U1 in run.control.revoking()
    view = run.control.registry.kernel(U1)
    assert view.unsure and view.objects
    await _drain_revocations(run)
    assert run.control.registry.get(U1) is None and not run.control.revoking()
    assert run.kernel.table is not None
    assert not any("s_u_1" in name for name in [*run.kernel.table.sets, *run.kernel.table.chains])


async def test_an_activation_whose_answer_was_lost_is_re_synced_to_deny_first() -> None:
    """Before: the kernel enforced the policy while the registry said denying, with nothing
    revoking: an early open nobody reported. Now the subject is revoking (closing: DNS and
    the vault act denying, /healthz names it) until the kernel is deny-first again."""
    run = await _faulted("activation", 1, "late_ack")
    c = run.control
    entry = c.registry.get(U1)
    assert entry is not None and entry.pending is not None and entry.state.value == "denying"
    assert U1 in c.revoking() and "outcome unknown" in c.revoking()[U1]
    assert c.revocations.closing(U1)
    await _drain_revocations(run)
    src = ipaddress.ip_address(IP1)
    assert not any(s == src for s, _ in _openness(run))  # deny-first again
    await _ok(c.handle(_ready(U1)))  # the Fastlet's retry activates, pending kept
    assert (src, ipaddress.ip_address("8.8.8.8")) in _openness(run)


async def test_a_timeout_out_of_the_kernel_shell_is_a_failed_step() -> None:
    """Before: an asyncio.TimeoutError went past the plan's failure handling: no failure
    entry committed, no revocation, and a re-key left its new address dispatched while the
    registry knew only the old one."""
    run = await _faulted("rekey_ip_widen", 3, "timeout")
    assert U1 in run.control.revoking()
    assert run.control.registry.kernel(U1).unsure


async def test_a_lost_lease_answer_is_still_revoked_by_a_narrowing() -> None:
    """Before: a lease whose add went unanswered was missing from the book, and a narrowing
    rewrites the dyn sets only from a non-empty book: the address stayed open after the
    policy that allowed its name was gone."""
    run = await _fresh(False)
    c = run.control
    await _activate(c, U2, P_NEIGHBOUR, ip=IP2)
    await _activate(c, U1, P_A)
    run.kernel.fail(call=run.kernel.mark() + 1, fault="late_ack")
    with pytest.raises(NftError):
        await _learn(c)
    src, dst = ipaddress.ip_address(IP1), ipaddress.ip_address(LEARNED)
    assert (src, dst) in _openness(run) and _claimed(run, src, dst)
    await _ok(c.handle(_set_binding(U1, P_NARROW, gen=2)))
    assert (src, dst) not in _openness(run)


def test_the_shell_reports_an_unanswered_batch_as_uncertain() -> None:
    """The ack read timing out (or the socket failing) says nothing about whether the
    kernel committed the batch; an error answer from the kernel means it did not."""
    import errno

    from egressd.kernel.applier import _Netlink
    from egressd.kernel.netlink_proto import NetlinkError

    class Sock:
        def __init__(self, exc: BaseException) -> None:
            self.exc = exc

        def run(self, batch: NetlinkBatch) -> None:
            raise self.exc

    shell = _Netlink.__new__(_Netlink)
    batch = NetlinkBatch(TABLE, (FlushSet("s"),))
    for exc, uncertain in (
        (NetlinkError(errno.ETIMEDOUT, "waiting for the kernel's answer"), True),
        (OSError(errno.ENOBUFS, "No buffer space available"), True),
        (NetlinkError(errno.ENOENT, "flush set inet T s"), False),
    ):
        shell.sock = Sock(exc)  # type: ignore[assignment]
        with pytest.raises(NftError) as err:
            shell.run(batch)
        assert isinstance(err.value, NftUncertain) is uncertain


async def test_an_always_reload_never_reopens_a_revert_whose_answer_was_lost() -> None:
    """The revert did apply (kernel deny-first) but looked failed; a reload before egressd's
    retry re-applies every recorded policy. Recording the revert's doubt with the old policy
    made the reload write it back: open again, with the new always-allow on top."""
    run = await _faulted("revert", 1, "late_ack")
    src = ipaddress.ip_address(IP1)
    assert not any(s == src for s, _ in _openness(run))
    await run.control.set_always_rules(_always(allow=("9.9.9.9",)))
    assert not any(s == src for s, _ in _openness(run))
    await _drain_revocations(run)
    assert not any(s == src for s, _ in _openness(run))
