"""The fleet's lease batch (egressd.fleetnft.contents.dyn_add) on the DNS reply path: the same
ops as the three placement questions of egressd.subject.ranges give, asked once per grant
(issue 25 item 5: a port-scoped lease's batch took seven times an address-only one's to
build, on the event loop, before its answer could leave)."""

from __future__ import annotations

import ipaddress
import itertools
import random
from collections.abc import Sequence

import pytest

from egressd.addr import IPAddress, host_network
from egressd.fleetnft.contents import dyn_add
from egressd.kernel.ops import AddPortElems, AddTimed, DeleteElement, DeletePortElems, Op, PortElem
from egressd.policy.scope import Scope
from egressd.subject.leases import Grant
from egressd.subject.ranges import on_hash_path, pipapo_elements, placement, single_elements
from egressd.subject.scopes import LeaseScope

V4 = ipaddress.ip_address("93.184.216.34")
V6 = ipaddress.ip_address("2001:db8::34")

SCOPES = [
    Scope.EMPTY,
    Scope.of(tcp=[(443, 443)]),
    Scope.of(tcp=[(8000, 8999)]),
    Scope.of(tcp=[(443, 443), (8000, 8999)]),
    Scope.of(tcp=[(443, 443), (8000, 8999)], udp=[(8000, 8999)]),
    Scope.of(tcp=[(80, 80), (8000, 8999)]),
    Scope.of(udp=[(53, 53), (7000, 7001)]),
]
SHARED = [Scope.EMPTY, Scope.of(tcp=[(8000, 8999)]), Scope.of(tcp=[(8000, 8999)], udp=[(8000, 8999)])]


@pytest.mark.parametrize(("ports", "shared"), list(itertools.product(SCOPES, SHARED)))
def test_placement_answers_the_three_questions_at_once(ports: Scope, shared: Scope) -> None:
    got = placement(ports, shared)
    assert got.single == single_elements(ports)
    assert got.pipapo == pipapo_elements(ports, shared)
    assert got.hashed == on_hash_path(ports, shared)


def _reference(table: str, nft_id: str, grants: Sequence[Grant], *, replace: bool) -> tuple[Op, ...]:
    """dyn_add as it was written before it asked the placement once per grant (6b12134)."""
    ops: list[Op] = []
    for fam in ("v4", "v6"):
        mine = [g for g in grants if (g.ip.version == 4) == (fam == "v4")]
        whole = tuple((g.ip, g.seconds) for g in mine if g.scope.whole)
        if whole:
            ops.append(AddTimed(f"subj_{nft_id}_dyn_{fam}", fam, whole))
            if replace:
                ops += [DeleteElement(f"subj_{nft_id}_dyn_{fam}", ip) for ip, _ in whole]
                ops.append(AddTimed(f"subj_{nft_id}_dyn_{fam}", fam, whole))
        ops += _ref_port_set(f"subj_{nft_id}_dynpx_{fam}", fam, mine, replace=replace, exact=True)
        ops += _ref_port_set(f"subj_{nft_id}_dynp_{fam}", fam, mine, replace=replace, exact=False)
        ops += _ref_range_addr(f"subj_{nft_id}_dynr_{fam}", fam, mine, replace=replace)
    return tuple(ops)


def _ref_port_set(name: str, fam: str, grants: Sequence[Grant], *, replace: bool, exact: bool) -> list[Op]:
    gone: list[PortElem] = []
    gone_s: list[int] = []
    add: list[PortElem] = []
    add_s: list[int] = []
    for g in grants:
        if g.scope.ports.is_empty():
            continue
        net = ipaddress.ip_network(g.ip)
        if exact:
            new, old = single_elements(g.scope.ports), single_elements(g.held)
        else:
            new, old = pipapo_elements(g.scope.ports, g.shared), pipapo_elements(g.held, g.shared)
        new_e = [(net, *e) for e in new]
        if replace or g.held != g.scope.ports:
            picked = [(net, *e) for e in old] if g.held != g.scope.ports else new_e
            gone += picked
            gone_s += [g.seconds] * len(picked)
        add += new_e
        add_s += [g.seconds] * len(new_e)
    ops: list[Op] = []
    if gone:
        ops += [
            AddPortElems(name, fam, tuple(gone), tuple(gone_s), exact=exact),
            DeletePortElems(name, fam, tuple(gone), exact=exact),
        ]
    if add:
        ops.append(AddPortElems(name, fam, tuple(add), tuple(add_s), exact=exact))
    return ops


def _ref_range_addr(name: str, fam: str, grants: Sequence[Grant], *, replace: bool) -> list[Op]:
    gone: list[tuple[IPAddress, int]] = []
    add: list[tuple[IPAddress, int]] = []
    for g in grants:
        if g.scope.ports.is_empty():
            continue
        new = on_hash_path(g.scope.ports, g.shared)
        changed = g.held != g.scope.ports
        old = on_hash_path(g.held, g.shared) if changed else new
        if old and (changed or replace):
            gone.append((g.ip, g.seconds))
        if new:
            add.append((g.ip, g.seconds))
    ops: list[Op] = []
    if gone:
        ops.append(AddTimed(name, fam, tuple(gone)))
        ops += [DeleteElement(name, ip) for ip, _ in gone]
    if add:
        ops.append(AddTimed(name, fam, tuple(add)))
    return ops


def _grants(rng: random.Random, n: int) -> list[Grant]:
    out = []
    for k in range(n):
        ip: IPAddress = (
            ipaddress.ip_address(int(V4) + k) if rng.random() < 0.7 else ipaddress.ip_address(int(V6) + k)
        )
        whole = rng.random() < 0.3
        ports = rng.choice(SCOPES)
        out.append(
            Grant(ip, rng.randint(1, 360), LeaseScope(whole, ports), rng.choice(SCOPES), rng.choice(SHARED))
        )
    return out


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("replace", [False, True])
def test_dyn_add_writes_what_it_wrote_before(seed: int, replace: bool) -> None:
    grants = _grants(random.Random(seed), 1 + seed % 7)
    assert dyn_add("T", "s", grants, replace=replace).ops == _reference("T", "s", grants, replace=replace)


def test_a_port_scoped_lease_batch_parses_no_address_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generic network constructor formats and parses the address again: 12 µs each, four
    times per port-scoped lease before (a seventh of the reply's learn step)."""

    def boom(*_a: object, **_kw: object) -> None:
        raise AssertionError("ipaddress.ip_network on the DNS reply path")

    grants = [
        Grant(
            V4,
            360,
            LeaseScope(False, Scope.of(tcp=[(443, 443), (8000, 8999)])),
            shared=Scope.of(tcp=[(8000, 8999)]),
        ),
        Grant(
            V6,
            360,
            LeaseScope(False, Scope.of(tcp=[(443, 443), (7000, 7001)])),
            shared=Scope.of(tcp=[(8000, 8999)]),
        ),
    ]
    want = _reference("T", "s", grants, replace=False)
    monkeypatch.setattr(ipaddress, "ip_network", boom)
    assert dyn_add("T", "s", grants).ops == want


@pytest.mark.parametrize(
    "ip", [V4, V6, ipaddress.ip_address("::ffff:1.2.3.4"), ipaddress.ip_address("0.0.0.0")]
)
def test_host_network_is_the_generic_constructors(ip: IPAddress) -> None:
    got = host_network(ip)
    assert got == ipaddress.ip_network(ip)
    assert type(got) is type(ipaddress.ip_network(ip))
    assert str(got) == str(ipaddress.ip_network(ip))
