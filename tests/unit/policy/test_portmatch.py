"""Port-scoped IP/CIDR rules as the kernel holds them (docs/reference/behaviour.md §18): disjoint elements
covering exactly the rules' union, what the address rules decide per port, the fleet's static
contents (audit mode included), the flow judge and the conntrack fields it judges by."""

from __future__ import annotations

import ipaddress
import random

import pytest

from egressd.engine.subjects import CutOrder, SubjectEngine
from egressd.feed import Feed
from egressd.fleetnft.contents import port_contents, refuses_more, static_contents
from egressd.kernel.conntrack import flow_dests_from, flow_selector, original_flow
from egressd.policy import NetworkPolicy, ip_sets, parse_policy
from egressd.policy.portmatch import ScopedEntry, address_rules_admit, disjoint
from egressd.subject.leases import LeaseBook, admissible

NET = ipaddress.ip_network
IP = ipaddress.ip_address


def pol(*rules: str, default: str = "deny", audit: bool = False) -> NetworkPolicy:
    mode = ',"mode":"audit"' if audit else ""
    return parse_policy(f'{{"defaultAction":"{default}"{mode},"egress":[{",".join(rules)}]}}')


def _covers(entries: list[ScopedEntry] | tuple[ScopedEntry, ...], ip: object, proto: str, port: int) -> bool:
    return any(p == proto and lo <= port <= hi and ip in net for net, p, lo, hi in entries)


def test_disjoint_elements_cover_exactly_the_union() -> None:
    rng = random.Random(7)
    nets = [NET("10.0.0.0/8"), NET("10.1.0.0/16"), NET("10.1.2.0/24"), NET("10.1.2.3/32"), NET("10.2.0.0/16")]
    for _ in range(50):
        entries: list[ScopedEntry] = []
        for _ in range(rng.randrange(1, 8)):
            lo = rng.randrange(0, 60)
            entries.append((rng.choice(nets), rng.choice(["tcp", "udp"]), lo, lo + rng.randrange(0, 20)))
        out = disjoint(entries)
        # Pairwise disjoint (what a pipapo set accepts) ...
        for i, a in enumerate(out):
            for b in out[i + 1 :]:
                assert not (a[1] == b[1] and a[0].overlaps(b[0]) and a[2] <= b[3] and b[2] <= a[3]), (a, b)
        # ... and the same coverage.
        for ip in (IP("10.1.2.3"), IP("10.1.2.4"), IP("10.1.9.9"), IP("10.2.0.1"), IP("10.9.0.1")):
            for proto in ("tcp", "udp"):
                for port in range(0, 82):
                    assert _covers(out, ip, proto, port) == _covers(entries, ip, proto, port)


def test_address_rules_decide_per_port_and_deny_beats_allow() -> None:
    sets = ip_sets(
        pol(
            '{"action":"allow","target":"10.0.0.0/8","protocol":"tcp","ports":["5432-5433"]}',
            '{"action":"deny","target":"10.1.2.3","protocol":"tcp","ports":[5432]}',
            '{"action":"allow","target":"10.9.9.9"}',
            '{"action":"deny","target":"10.9.9.9","protocol":"udp","ports":[53]}',
        )
    )
    assert address_rules_admit(sets, IP("10.1.2.4"), "tcp", 5432) is True
    assert address_rules_admit(sets, IP("10.1.2.4"), "udp", 5432) is None  # no rule says: lease or default
    assert address_rules_admit(sets, IP("10.1.2.4"), "tcp", 22) is None
    assert address_rules_admit(sets, IP("10.1.2.3"), "tcp", 5432) is False
    assert address_rules_admit(sets, IP("10.1.2.3"), "tcp", 5433) is True
    assert address_rules_admit(sets, IP("10.9.9.9"), "udp", 53) is False
    assert address_rules_admit(sets, IP("10.9.9.9"), "icmp", None) is True


def test_the_fleet_s_static_contents_hold_scoped_rules_in_the_port_sets_only() -> None:
    p = pol(
        '{"action":"allow","target":"10.0.0.0/8","protocol":"tcp","ports":["5432-5433"]}',
        '{"action":"allow","target":"10.1.0.0/16","ports":["5000-6000"]}',
        '{"action":"deny","target":"2001:db8::1","protocol":"udp","ports":[53]}',
        '{"action":"allow","target":"8.8.8.8"}',
    )
    c = dict(static_contents(p))
    assert c["allow_v4"] == (NET("8.8.8.8/32"),)  # the cheap path is unchanged
    assert c["allowp_v4"] == (
        (NET("10.1.0.0/16"), "tcp", 5000, 5431),
        (NET("10.0.0.0/8"), "tcp", 5432, 5433),
        (NET("10.1.0.0/16"), "tcp", 5434, 6000),
        (NET("10.1.0.0/16"), "udp", 5000, 6000),
    )
    assert c["denyp_v6"] == ((NET("2001:db8::1/128"), "udp", 53, 53),)
    # Audit mode passes a would-deny by port like one by address: wdenyp, logged and counted.
    audited = dict(
        static_contents(
            pol('{"action":"deny","target":"10.0.0.1","protocol":"tcp","ports":[22]}', audit=True)
        )
    )
    assert audited["wdenyp_v4"] == ((NET("10.0.0.1/32"), "tcp", 22, 22),) and audited["denyp_v4"] == ()
    assert port_contents(ip_sets(pol()))["allowp_v4"] == ()


def test_a_change_of_the_port_sets_is_a_narrowing_when_it_may_refuse_more() -> None:
    a = static_contents(pol('{"action":"allow","target":"10.0.0.1","protocol":"tcp","ports":[80,443]}'))
    b = static_contents(pol('{"action":"allow","target":"10.0.0.1","protocol":"tcp","ports":[443]}'))
    d = static_contents(pol('{"action":"deny","target":"10.0.0.1","protocol":"tcp","ports":[80]}'))
    assert refuses_more(a, b) and not refuses_more(b, a)
    assert refuses_more(static_contents(pol()), d) and not refuses_more(d, static_contents(pol()))


class _Backend:
    passes_would_deny = True
    name_check = True


def test_the_flow_judge_decides_by_port_and_protocol() -> None:
    p = pol(
        '{"action":"allow","target":"api.x.io","protocol":"tcp","ports":[443]}',
        '{"action":"allow","target":"any.x.io"}',
        '{"action":"allow","target":"10.0.0.0/8","protocol":"udp","ports":[53]}',
        '{"action":"deny","target":"10.0.0.9","protocol":"udp","ports":[53]}',
    )
    e = SubjectEngine(_Backend(), Feed(), clock=lambda: 100.0)  # type: ignore[arg-type]
    book = e.books.setdefault("u", LeaseBook())
    for name, ip in (("api.x.io", "93.184.216.34"), ("any.x.io", "93.184.216.35")):
        book.record(admissible(book, p, [(IP(ip), 60)], name, 100.0, name_check=True), name, 100.0)
    judge = e.judge("u", CutOrder(sources=(), effective=p))
    assert judge(IP("93.184.216.34"), "tcp", 443) and not judge(IP("93.184.216.34"), "tcp", 80)
    assert not judge(IP("93.184.216.34"), "udp", 443)
    assert judge(IP("93.184.216.35"), "tcp", 80) and judge(IP("93.184.216.35"), "icmp", None)
    assert not judge(IP("93.184.216.35"), "udp", 443)  # the name check: no QUIC by name
    assert judge(IP("10.1.1.1"), "udp", 53) and not judge(IP("10.1.1.1"), "tcp", 53)
    assert not judge(IP("10.0.0.9"), "udp", 53)


@pytest.mark.parametrize(
    ("line", "dest"),
    [
        (
            "ipv4     2 tcp      6 431999 ESTABLISHED src=10.203.0.11 dst=10.204.0.5 sport=40000 dport=7000 "
            "src=10.204.0.5 dst=10.203.0.11 sport=7000 dport=40000 [ASSURED] mark=0 use=1",
            ("10.204.0.5", "tcp", 7000),
        ),
        (
            "ipv4     2 udp      17 29 src=10.203.0.11 dst=10.204.0.6 sport=49892 dport=443 [UNREPLIED] "
            "src=10.204.0.6 dst=10.203.0.11 sport=443 dport=49892 mark=0 use=1",
            ("10.204.0.6", "udp", 443),
        ),
        (
            "ipv4     2 icmp     1 29 src=10.203.0.11 dst=10.204.0.6 type=8 code=0 id=7 "
            "src=10.204.0.6 dst=10.203.0.11 type=0 code=0 id=7 mark=0 use=1",
            ("10.204.0.6", "icmp", None),
        ),
        (
            # The DNS forwarder's flows carry a directional zone (nftsyntax.forwarder_zone),
            # printed after the original tuple.
            "ipv4     2 udp      17 29 src=10.203.0.11 dst=10.204.0.2 sport=39720 dport=53 zone-orig=1 "
            "[UNREPLIED] src=10.204.0.2 dst=10.203.0.11 sport=53 dport=39720 mark=0 use=2",
            ("10.204.0.2", "udp", 53),
        ),
    ],
)
def test_conntrack_lines_give_protocol_and_destination_port(
    line: str, dest: tuple[str, str, int | None]
) -> None:
    got = original_flow(line)
    assert got is not None and got[1] == (IP(dest[0]), dest[1], dest[2])
    assert flow_dests_from([line], {IP("10.203.0.11")}) == {IP("10.203.0.11"): {got[1]}}
    assert flow_dests_from([line], {IP("10.203.0.12")}) == {}


def test_a_cut_selects_one_protocol_and_port() -> None:
    assert flow_selector("tcp", 7000) == ["-p", "tcp", "--dport", "7000"]
    assert flow_selector("icmp", None) == ["-p", "icmp"]
    assert flow_selector("", None) == []


def test_a_policy_whose_address_rules_need_too_many_port_elements_is_refused_like_one_over_the_cap() -> None:
    from egressd.policy import rule_cap_problem
    from egressd.policy.portmatch import MAX_PORT_ELEMENTS

    def hosts(n: int, ports: int) -> NetworkPolicy:
        rules = [
            f'{{"action":"allow","target":"10.{i // 250}.{i % 250}.1","protocol":"tcp",'
            f'"ports":[{",".join(str(1000 + 3 * j) for j in range(ports))}]}}'
            for i in range(n)
        ]
        return pol(*rules)

    assert rule_cap_problem(hosts(4096, 2), 4096) is None  # 8192: at the bound
    problem = rule_cap_problem(hosts(4096, 3), 4096)
    assert problem is not None and f"more than {MAX_PORT_ELEMENTS}" in problem
    # Nested ranges on distinct hosts cut into many disjoint elements: counted after cutting.
    nested = [
        f'{{"action":"allow","target":"10.0.{i % 250}.{i // 250}","protocol":"tcp","ports":["{i + 1}-{65535 - i}"]}}'
        for i in range(4096)
    ]
    assert rule_cap_problem(pol(*nested), 4096) is not None
    assert rule_cap_problem(pol(*nested[:60]), 4096) is None


def test_the_shortcut_for_apart_rules_returns_what_the_sweep_would(monkeypatch: pytest.MonkeyPatch) -> None:
    from egressd.policy import portmatch

    rng = random.Random(11)
    nets = [NET("10.0.0.0/8"), NET("10.1.0.0/16"), NET("192.0.2.7/32"), NET("2001:db8::/32")]
    for _ in range(200):
        entries: list[ScopedEntry] = []
        for _ in range(rng.randrange(1, 6)):
            lo = rng.randrange(1, 200)
            entries.append((rng.choice(nets), rng.choice(["tcp", "udp"]), lo, lo + rng.randrange(0, 3)))
        fast = disjoint(entries)
        with monkeypatch.context() as m:
            m.setattr(portmatch, "_apart", lambda group: False)
            assert disjoint(entries) == fast, entries
