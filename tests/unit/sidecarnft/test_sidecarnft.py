"""§8.6 sidecar ruleset: the pure generator's scripts compared as text, with the §5 vectors."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from egressd.policy import DENY_ALL, parse_policy
from egressd.sidecarnft.ruleset import SidecarTable, delete_table, dyn_add, lease_element, ruleset

P1 = (
    '{"defaultAction":"deny","egress":[{"action":"allow","target":"*.example.com"},'
    '{"action":"deny","target":"api.example.com"},{"action":"allow","target":"*.internal.example.com"},'
    '{"action":"deny","target":"10.0.0.1"},{"action":"allow","target":"10.0.0.0/24"}]}'
)

DENY_ALL_SCRIPT = """\
add table inet T
delete table inet T
add table inet T
add set inet T allow_v4 { type ipv4_addr; flags interval; }
add set inet T deny_v4 { type ipv4_addr; flags interval; }
add set inet T dyn_allow_v4 { type ipv4_addr; flags timeout; timeout 360s; size 4096; }
add set inet T allowp_v4 { type ipv4_addr . inet_proto . inet_service; flags interval; }
add set inet T denyp_v4 { type ipv4_addr . inet_proto . inet_service; flags interval; }
add set inet T dyn_allowp_v4 { type ipv4_addr . inet_proto . inet_service; flags interval,timeout; timeout 360s; size 8192; }
add set inet T dyn_allowpx_v4 { type ipv4_addr . inet_proto . inet_service; flags timeout; timeout 360s; size 8192; }
add set inet T allow_v6 { type ipv6_addr; flags interval; }
add set inet T deny_v6 { type ipv6_addr; flags interval; }
add set inet T dyn_allow_v6 { type ipv6_addr; flags timeout; timeout 360s; size 4096; }
add set inet T allowp_v6 { type ipv6_addr . inet_proto . inet_service; flags interval; }
add set inet T denyp_v6 { type ipv6_addr . inet_proto . inet_service; flags interval; }
add set inet T dyn_allowp_v6 { type ipv6_addr . inet_proto . inet_service; flags interval,timeout; timeout 360s; size 8192; }
add set inet T dyn_allowpx_v6 { type ipv6_addr . inet_proto . inet_service; flags timeout; timeout 360s; size 8192; }
add counter inet T dropped { packets 0 bytes 0 }
add chain inet T denied
add rule inet T denied counter name "dropped"
add rule inet T denied drop
add chain inet T dns_redirect { type nat hook output priority -100; policy accept; }
add rule inet T dns_redirect meta mark 0x1 return
add rule inet T dns_redirect udp dport 53 redirect to :15353
add rule inet T dns_redirect tcp dport 53 redirect to :15353
add chain inet T guard { type filter hook output priority 0; policy accept; }
add rule inet T guard ip saddr != 0.0.0.0 meta skuid >= 0 fib saddr type != local goto denied
add rule inet T guard ip6 saddr != :: meta skuid >= 0 fib saddr type != local goto denied
add rule inet T guard meta mark 0x1 return
add rule inet T guard meta l4proto { tcp, udp } th dport 53 ct state invalid,untracked goto denied
add rule inet T guard meta l4proto { tcp, udp } th dport 53 ct status & dnat == 0 goto denied
add rule inet T guard meta l4proto { tcp, udp } ct direction original ct original proto-dst 53 th dport != 15353 goto denied
add chain inet T fwd_zone { type filter hook output priority raw; policy accept; }
add rule inet T fwd_zone meta mark 0x1 ct original zone set 1
add chain inet T inbound { type filter hook input priority 0; policy accept; }
add rule inet T inbound ct state new tcp flags & (fin | syn | rst | ack) != syn ct mark set ct mark | 0x20000000
add chain inet T egress { type filter hook output priority 0; policy drop; }
add rule inet T egress ct direction reply ct status & assured == 0 ct mark & 0x20000000 == 0 tcp flags & (syn | rst) == 0 goto denied
add rule inet T egress ct state established,related ct mark & 0x60000000 == 0 accept
add rule inet T egress meta mark 0x1 accept
add rule inet T egress oifname "lo" accept
add rule inet T egress ip daddr 127.0.0.1 meta l4proto { tcp, udp } th dport 15353 accept
add rule inet T egress ip6 daddr ::1 meta l4proto { tcp, udp } th dport 15353 accept
add rule inet T egress icmpv6 type { nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert } ip6 hoplimit 255 accept
add rule inet T egress tcp dport 853 goto denied
add rule inet T egress udp dport 853 goto denied
add rule inet T egress ip daddr @deny_v4 goto denied
add rule inet T egress ip6 daddr @deny_v6 goto denied
add rule inet T egress ip daddr . meta l4proto . th dport @denyp_v4 goto denied
add rule inet T egress ip6 daddr . meta l4proto . th dport @denyp_v6 goto denied
add rule inet T egress ip daddr @dyn_allow_v4 accept
add rule inet T egress ip6 daddr @dyn_allow_v6 accept
add rule inet T egress ip daddr . meta l4proto . th dport @dyn_allowp_v4 accept
add rule inet T egress ip6 daddr . meta l4proto . th dport @dyn_allowp_v6 accept
add rule inet T egress ip daddr . meta l4proto . th dport @dyn_allowpx_v4 accept
add rule inet T egress ip6 daddr . meta l4proto . th dport @dyn_allowpx_v6 accept
add rule inet T egress ip daddr @allow_v4 accept
add rule inet T egress ip6 daddr @allow_v6 accept
add rule inet T egress ip daddr . meta l4proto . th dport @allowp_v4 accept
add rule inet T egress ip6 daddr . meta l4proto . th dport @allowp_v6 accept
add rule inet T egress goto denied
"""


def _line(script: str, prefix: str) -> str:
    hits = [ln for ln in script.splitlines() if ln.startswith(prefix)]
    assert len(hits) == 1, (prefix, hits)
    return hits[0]


def test_deny_all_is_the_full_blueprint() -> None:
    assert ruleset(SidecarTable(table="T"), DENY_ALL) == DENY_ALL_SCRIPT


def test_rebuild_is_one_transaction_that_cannot_fail_on_a_missing_table() -> None:
    lines = ruleset(SidecarTable(table="T"), DENY_ALL).splitlines()
    # add (idempotent) before delete: the same script works for first install and rebuild.
    assert lines[:3] == ["add table inet T", "delete table inet T", "add table inet T"]


def test_p1_ip_layer_vector() -> None:
    script = ruleset(SidecarTable(table="T"), parse_policy(P1))
    assert _line(script, "add set inet T allow_v4 ") == (
        "add set inet T allow_v4 { type ipv4_addr; flags interval; elements = { 10.0.0.0/24 } }"
    )
    assert _line(script, "add set inet T deny_v4 ") == (
        "add set inet T deny_v4 { type ipv4_addr; flags interval; elements = { 10.0.0.1 } }"
    )
    # deny is checked before allow: 10.0.0.1 is dropped although the /24 allows it.
    lines = script.splitlines()
    assert lines.index("add rule inet T egress ip daddr @deny_v4 goto denied") < lines.index(
        "add rule inet T egress ip daddr @allow_v4 accept"
    )


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (["10.99.0.0/24", "10.99.0.9"], "10.99.0.0/24"),
        (["100.64.0.0/10", "127.0.0.1", "100.100.2.136"], "100.64.0.0/10, 127.0.0.1"),
        (["8.8.8.8", "8.8.8.8"], "8.8.8.8"),
    ],
)
def test_set_normalisation_vectors(targets: list[str], expected: str) -> None:
    rules = ",".join(f'{{"action":"allow","target":"{t}"}}' for t in targets)
    script = ruleset(SidecarTable(table="T"), parse_policy(f'{{"egress":[{rules}]}}'))
    assert f"allow_v4 {{ type ipv4_addr; flags interval; elements = {{ {expected} }} }}" in script


def test_v6_normalisation_vector() -> None:
    pol = parse_policy(
        '{"egress":[{"action":"allow","target":"2001:db8::/32"},{"action":"allow","target":"2001:db8::1"}]}'
    )
    assert "allow_v6 { type ipv6_addr; flags interval; elements = { 2001:db8::/32 } }" in ruleset(
        SidecarTable(table="T"), pol
    )


def test_default_allow_is_policy_accept_without_tail_drop() -> None:
    pol = parse_policy('{"defaultAction":"allow","egress":[{"action":"deny","target":"1.2.3.4"}]}')
    script = ruleset(SidecarTable(table="T"), pol)
    assert "add chain inet T egress { type filter hook output priority 0; policy accept; }" in script
    assert "add rule inet T egress goto denied" not in script
    assert "add rule inet T egress ip daddr @deny_v4 goto denied" in script
    assert "deny_v4 { type ipv4_addr; flags interval; elements = { 1.2.3.4 } }" in script


def test_domain_rules_do_not_touch_the_ip_sets() -> None:
    pol = parse_policy('{"egress":[{"action":"allow","target":"example.com"}]}')
    assert ruleset(SidecarTable(table="T"), pol) == DENY_ALL_SCRIPT


def test_mode_dns_has_no_filter_chain_but_keeps_the_redirect() -> None:
    script = ruleset(SidecarTable(table="T", mode="dns"), parse_policy(P1))
    assert "egress" not in script
    assert "inbound" not in script  # nothing is cut in mode dns, so nothing can come back
    assert "add rule inet T dns_redirect udp dport 53 redirect to :15353" in script
    assert "add rule inet T dns_redirect meta mark 0x1 return" in script


def test_dns_port_is_configurable() -> None:
    script = ruleset(SidecarTable(table="T", dns_port=5353), DENY_ALL)
    assert "add rule inet T dns_redirect tcp dport 53 redirect to :5353" in script


def test_resolvers_join_the_allow_sets_normalised() -> None:
    cfg = SidecarTable(table="T", resolvers=(ip_address("10.0.0.53"), ip_address("fd00::53")))
    pol = parse_policy('{"egress":[{"action":"allow","target":"10.0.0.0/24"}]}')
    script = ruleset(cfg, pol)
    # 10.0.0.53 is inside the allowed /24: one element, or the kernel refuses the overlap.
    assert "allow_v4 { type ipv4_addr; flags interval; elements = { 10.0.0.0/24 } }" in script
    assert "allow_v6 { type ipv6_addr; flags interval; elements = { fd00::53 } }" in script
    # A user deny still beats the resolver's allow (deny is checked first).
    denied = ruleset(cfg, parse_policy('{"egress":[{"action":"deny","target":"10.0.0.53"}]}'))
    assert "deny_v4 { type ipv4_addr; flags interval; elements = { 10.0.0.53 } }" in denied


def test_doh_without_blocklist_drops_all_443() -> None:
    script = ruleset(SidecarTable(table="T", block_doh_443=True), DENY_ALL)
    lines = script.splitlines()
    assert "add rule inet T egress tcp dport 443 goto denied" in lines
    assert lines.index("add rule inet T egress tcp dport 443 goto denied") < lines.index(
        "add rule inet T egress ip daddr @allow_v4 accept"
    )
    assert "doh_block" not in script


def test_doh_blocklist_sets_per_family() -> None:
    cfg = SidecarTable(
        table="T",
        block_doh_443=True,
        doh_blocklist=(ip_network("1.1.1.1/32"), ip_network("1.1.1.0/24"), ip_network("2606:4700::/32")),
    )
    script = ruleset(cfg, DENY_ALL)
    assert (
        "add set inet T doh_block_v4 { type ipv4_addr; flags interval; elements = { 1.1.1.0/24 } }" in script
    )
    assert (
        "add set inet T doh_block_v6 { type ipv6_addr; flags interval; elements = { 2606:4700::/32 } }"
        in script
    )
    assert "add rule inet T egress ip daddr @doh_block_v4 tcp dport 443 goto denied" in script
    assert "add rule inet T egress ip6 daddr @doh_block_v6 tcp dport 443 goto denied" in script
    assert "tcp dport 443 goto denied\n" not in script.replace(
        "@doh_block_v4 tcp dport 443 goto denied\n", ""
    ).replace("@doh_block_v6 tcp dport 443 goto denied\n", "")


def test_blocklist_ignored_when_blocking_is_off() -> None:
    cfg = SidecarTable(table="T", doh_blocklist=(ip_network("1.1.1.1/32"),))
    assert "443" not in ruleset(cfg, DENY_ALL)


def test_rebuild_keeps_leases_with_remaining_lifetime() -> None:
    leases = [(ip_address("10.204.0.2"), 89.2), (ip_address("fd00::2"), 10.0), (ip_address("10.9.9.9"), 0.0)]
    script = ruleset(SidecarTable(table="T"), DENY_ALL, leases)
    assert (
        "add set inet T dyn_allow_v4 { type ipv4_addr; flags timeout; timeout 360s; size 4096; "
        "elements = { 10.204.0.2 timeout 90s expires 90s } }"
    ) in script
    assert "elements = { fd00::2 timeout 10s expires 10s }" in script
    assert "10.9.9.9" not in script


def test_dyn_add_redeclares_only_the_needed_families() -> None:
    cfg = SidecarTable(table="T")
    assert dyn_add(cfg, [(ip_address("93.184.216.34"), 90)]) == (
        "add set inet T dyn_allow_v4 { type ipv4_addr; flags timeout; timeout 360s; size 4096; "
        "elements = { 93.184.216.34 timeout 90s expires 90s } }\n"
    )
    both = dyn_add(cfg, [(ip_address("1.2.3.4"), 60), (ip_address("2001:db8::1"), 61)])
    assert len(both.splitlines()) == 2
    assert dyn_add(cfg, []) == ""


def test_dyn_declaration_matches_the_rebuild_declaration() -> None:
    # The kernel refuses a re-declaration whose properties differ from the existing set.
    cfg = SidecarTable(table="T")
    decl = _line(ruleset(cfg, DENY_ALL), "add set inet T dyn_allow_v4 ")
    added = dyn_add(cfg, [(ip_address("1.2.3.4"), 60)]).strip()
    assert added.startswith(decl[: -len(" }")])


@pytest.mark.parametrize(("seconds", "text"), [(0.1, "1s"), (60, "60s"), (359.5, "360s"), (10_000, "360s")])
def test_lease_element_clamps(seconds: float, text: str) -> None:
    assert lease_element(ip_address("1.2.3.4"), seconds) == f"1.2.3.4 timeout {text} expires {text}"


def test_delete_table_tolerates_a_missing_table() -> None:
    assert delete_table(SidecarTable(table="T")) == "add table inet T\ndelete table inet T\n"


def test_net_admin_from_proc_status() -> None:
    from egressd.sidecarnft.selftest import has_net_admin

    assert has_net_admin("Name:\tx\nCapEff:\t000001ffffffffff\n") is True
    assert has_net_admin("CapEff:\t0000000000000000\n") is False
    assert has_net_admin("CapEff:\t00000000a80425fb\n") is False  # docker default set: no NET_ADMIN
    assert has_net_admin("CapEff:\t0000000000001000\n") is True
    assert has_net_admin("Name:\tx\n") is None
