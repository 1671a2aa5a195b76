"""§8 fleet nft blueprint: the builder's scripts compared as text, its netlink batches as data.

The builder deliberately deviates from the reference blueprint (fleetnft/header.py): dispatch
goes through verdict maps, the DNS redirect through per-family gateway sets, a subject's
rules are fixed for its lifetime (added once, via netlink) and its state lives only in its set
contents; libnftables only gets cache-free declarations, everything else is a netlink batch.
The pure netlink encoders of the applier are tested at the end.
"""

from __future__ import annotations

from dataclasses import replace
from ipaddress import ip_address, ip_network
from typing import Any

import pytest

from egressd.addr import IPAddress
from egressd.fleetnft.audit import audit_counter_subject
from egressd.fleetnft.contents import dyn_add, policy_contents, policy_swap
from egressd.fleetnft.header import header_script
from egressd.fleetnft.subject import (
    audit_objects,
    dispatch_deletes,
    dispatch_entries,
    flush_subject_sets,
    gateway_release,
    removal_batch,
    subject_objects_script,
    subject_rules,
    subject_sets,
)
from egressd.fleetnft.table import SubjectNft, TableConfig
from egressd.kernel.config import parse_doh_blocklist
from egressd.kernel.ops import (
    AddIntervals,
    AddRule,
    AddSet,
    AddTimed,
    AuditRule,
    DeleteChain,
    DeleteCounter,
    DeleteElement,
    DeleteSet,
    FlushChain,
    FlushSet,
    L4Guard,
    MatchRule,
    NetlinkBatch,
    PortRule,
    RangeRule,
    VerdictRule,
)
from egressd.kernel.ops import (
    RuleAction as Outcome,
)
from egressd.policy import AlwaysRules, Verdict, effective_policy, parse_always_text, parse_policy
from egressd.subject.leases import Grant

T = "T"
CFG = TableConfig(table=T, dns_port=15353)
MITM = TableConfig(table=T, dns_port=15353, mitm=True, mitm_port=18081)
SUBJ = SubjectNft("s_u_1", ip_address("10.0.0.5"), ip_address("10.0.0.1"))
SUBJ6 = SubjectNft("s_u_6", ip_address("fd00::5"), ip_address("fd00::1"))

SET_KINDS = (
    "allow_v4",
    "allow_v6",
    "deny_v4",
    "deny_v6",
    "wdeny_v4",
    "wdeny_v6",
    "audit_v4",
    "audit_v6",
    "wdenyp_v4",
    "wdenyp_v6",
    "dyn_v4",
    "dyn_v6",
    "allowp_v4",
    "allowp_v6",
    "denyp_v4",
    "denyp_v6",
    "dynp_v4",
    "dynp_v6",
    "dynpx_v4",
    "dynpx_v6",
    "dynr_v4",
    "dynr_v6",
    "dynrports_v4",
    "dynrports_v6",
)
SETS6 = [f"subj_s_u_1_{k}" for k in SET_KINDS]

# docs/reference/behaviour.md §8.3's example (example.com is a domain: DNS only, no set element).
EXAMPLE = parse_policy(
    '{"defaultAction":"deny","egress":['
    '{"action":"allow","target":"example.com"},'
    '{"action":"allow","target":"8.8.8.8"},'
    '{"action":"deny","target":"1.2.3.4"}]}'
)
ALLOW_ALL = parse_policy('{"defaultAction":"allow"}')
ALLOW_BUT = parse_policy('{"defaultAction":"allow","egress":[{"action":"deny","target":"1.2.3.4"}]}')

# The fixed per-subject rules, in nft syntax.
PORTKEY = "daddr . meta l4proto . th dport"
SUBJ_CHAIN_RULES = [
    "ip daddr @subj_s_u_1_deny_v4 goto denied",
    "ip6 daddr @subj_s_u_1_deny_v6 goto denied",
    f"ip {PORTKEY} @subj_s_u_1_denyp_v4 goto denied",
    f"ip6 {PORTKEY} @subj_s_u_1_denyp_v6 goto denied",
]
MARK_CHAIN_RULES = [
    "ip daddr @subj_s_u_1_allow_v4 meta mark set 0x2",
    "ip6 daddr @subj_s_u_1_allow_v6 meta mark set 0x2",
    f"ip {PORTKEY} @subj_s_u_1_allowp_v4 meta mark set 0x2",
    f"ip6 {PORTKEY} @subj_s_u_1_allowp_v6 meta mark set 0x2",
    "ip daddr @subj_s_u_1_dyn_v4 meta mark set 0x2",
    "ip6 daddr @subj_s_u_1_dyn_v6 meta mark set 0x2",
    f"ip {PORTKEY} @subj_s_u_1_dynp_v4 meta mark set 0x2",
    f"ip6 {PORTKEY} @subj_s_u_1_dynp_v6 meta mark set 0x2",
    f"ip {PORTKEY} @subj_s_u_1_dynpx_v4 meta mark set 0x2",
    f"ip6 {PORTKEY} @subj_s_u_1_dynpx_v6 meta mark set 0x2",
    "ip daddr @subj_s_u_1_dynr_v4 meta l4proto . th dport @subj_s_u_1_dynrports_v4 meta mark set 0x2",
    "ip6 daddr @subj_s_u_1_dynr_v6 meta l4proto . th dport @subj_s_u_1_dynrports_v6 meta mark set 0x2",
    'ip daddr @subj_s_u_1_wdeny_v4 ip daddr != @subj_s_u_1_deny_v4 ct state new log prefix "egressd would-deny s_u_1 " '
    'counter name "subj_s_u_1_audit_deny" meta mark set 0x2',
    'ip6 daddr @subj_s_u_1_wdeny_v6 ip6 daddr != @subj_s_u_1_deny_v6 ct state new log prefix "egressd would-deny s_u_1 " '
    'counter name "subj_s_u_1_audit_deny" meta mark set 0x2',
    f"ip {PORTKEY} @subj_s_u_1_wdenyp_v4 ip daddr != @subj_s_u_1_deny_v4 ct state new "
    'log prefix "egressd would-deny s_u_1 " counter name "subj_s_u_1_audit_deny" meta mark set 0x2',
    f"ip6 {PORTKEY} @subj_s_u_1_wdenyp_v6 ip6 daddr != @subj_s_u_1_deny_v6 ct state new "
    'log prefix "egressd would-deny s_u_1 " counter name "subj_s_u_1_audit_deny" meta mark set 0x2',
    "ip daddr @subj_s_u_1_audit_v4 ip daddr != @subj_s_u_1_deny_v4 ct state new meta mark & 0x00000002 != 0x00000002 "
    'log prefix "egressd would-deny s_u_1 " counter name "subj_s_u_1_audit_default" meta mark set 0x2',
    "ip6 daddr @subj_s_u_1_audit_v6 ip6 daddr != @subj_s_u_1_deny_v6 ct state new meta mark & 0x00000002 != 0x00000002 "
    'log prefix "egressd would-deny s_u_1 " counter name "subj_s_u_1_audit_default" meta mark set 0x2',
]
# With the name check (on with the MITM), the address-only dyn sets never mark UDP 443.
MARK_CHAIN_RULES_CHECKED = [
    *MARK_CHAIN_RULES[:4],
    "ip daddr @subj_s_u_1_dyn_v4 meta l4proto != udp meta mark set 0x2",
    "ip daddr @subj_s_u_1_dyn_v4 udp dport != 443 meta mark set 0x2",
    "ip6 daddr @subj_s_u_1_dyn_v6 meta l4proto != udp meta mark set 0x2",
    "ip6 daddr @subj_s_u_1_dyn_v6 udp dport != 443 meta mark set 0x2",
    *MARK_CHAIN_RULES[6:],
]
CT_PORTKEY = "daddr . meta l4proto . ct original proto-dst"
IN_CHAIN_RULES = [
    "ct original ip daddr @subj_s_u_1_deny_v4 goto denied",
    "ct original ip6 daddr @subj_s_u_1_deny_v6 goto denied",
    f"ct original ip {CT_PORTKEY} @subj_s_u_1_denyp_v4 goto denied",
    f"ct original ip6 {CT_PORTKEY} @subj_s_u_1_denyp_v6 goto denied",
    "ct original ip daddr @subj_s_u_1_wdeny_v4 goto denied",
    "ct original ip6 daddr @subj_s_u_1_wdeny_v6 goto denied",
    f"ct original ip {CT_PORTKEY} @subj_s_u_1_wdenyp_v4 goto denied",
    f"ct original ip6 {CT_PORTKEY} @subj_s_u_1_wdenyp_v6 goto denied",
    "ct original ip daddr @subj_s_u_1_dyn_v4 accept",
    "ct original ip6 daddr @subj_s_u_1_dyn_v6 accept",
    f"ct original ip {CT_PORTKEY} @subj_s_u_1_dynp_v4 accept",
    f"ct original ip6 {CT_PORTKEY} @subj_s_u_1_dynp_v6 accept",
    f"ct original ip {CT_PORTKEY} @subj_s_u_1_dynpx_v4 accept",
    f"ct original ip6 {CT_PORTKEY} @subj_s_u_1_dynpx_v6 accept",
    "ct original ip daddr @subj_s_u_1_dynr_v4 meta l4proto . ct original proto-dst @subj_s_u_1_dynrports_v4 accept",
    "ct original ip6 daddr @subj_s_u_1_dynr_v6 meta l4proto . ct original proto-dst @subj_s_u_1_dynrports_v6 accept",
    "ct original ip daddr @subj_s_u_1_allow_v4 accept",
    "ct original ip6 daddr @subj_s_u_1_allow_v6 accept",
    f"ct original ip {CT_PORTKEY} @subj_s_u_1_allowp_v4 accept",
    f"ct original ip6 {CT_PORTKEY} @subj_s_u_1_allowp_v6 accept",
    "goto denied",
]


def lines(script: str) -> list[str]:
    assert script.endswith("\n")
    out = script.splitlines()
    assert all(ln == ln.strip() and ln for ln in out), "no blank or padded lines"
    return out


def rules_of(script: str, chain: str) -> list[str]:
    prefix = f"add rule inet {T} {chain} "
    return [ln[len(prefix) :] for ln in lines(script) if ln.startswith(prefix)]


def batch_rules(batch: NetlinkBatch, chain: str) -> list[str]:
    return [op.rule.render() for op in batch.ops if isinstance(op, AddRule) and op.chain == chain]


# ----------------------------------------------------------------- a model of the fixed rules
#
# What the header and the subject's fixed rules do with the first packet of a new flow of the
# subject, given the contents of its sets: forward path (marking chain, then dispatch chain,
# then the header's unmarked-drop tail) and, with MITM, the input path (IN chain of §8.2).

Contents = dict[str, tuple[Any, ...]]  # prefixes, or (prefix, proto, lo, hi) for the port sets


def _matches(
    rule: MatchRule | PortRule | AuditRule | RangeRule,
    contents: Contents,
    dst: IPAddress,
    proto: str = "tcp",
    port: int = 443,
) -> bool:
    if rule.fam != ("v4" if dst.version == 4 else "v6"):
        return False
    kind = rule.set_name.removeprefix("subj_s_u_1_")
    if isinstance(rule, PortRule):
        return any(dst in n and p == proto and lo <= port <= hi for n, p, lo, hi in contents.get(kind, ()))
    if isinstance(rule, RangeRule):
        services = contents.get(rule.services.removeprefix("subj_s_u_1_"), ())
        held = any(dst in net for net in contents.get(kind, ()))
        return held and any(p == proto and lo <= port <= hi for p, lo, hi in services)
    if isinstance(rule, MatchRule) and rule.guard is L4Guard.NOT_UDP and proto == "udp":
        return False
    if isinstance(rule, MatchRule) and rule.guard is L4Guard.UDP_NOT_443 and (proto != "udp" or port == 443):
        return False
    return any(dst in net for net in contents.get(kind, ()))


def forward_path(
    cfg: TableConfig, contents: Contents, dst: str, proto: str = "tcp", port: int = 443
) -> tuple[str, list[str]]:
    """(verdict, audit counters that counted the flow) for the first packet of a new flow."""
    addr = ip_address(dst)
    batch = subject_rules(cfg, "s_u_1", audit=True, ranges=True)
    marked = False
    counted: list[str] = []
    for op in batch.ops:
        assert isinstance(op, AddRule)
        if op.chain != "mark_s_u_1":
            continue
        if isinstance(op.rule, AuditRule):
            hard = any(addr in net for net in contents.get(op.rule.hard.removeprefix("subj_s_u_1_"), ()))
            if _matches(op.rule, contents, addr) and not hard and not (op.rule.unmarked_only and marked):
                counted.append(op.rule.counter)
                marked = True
        else:
            assert isinstance(op.rule, MatchRule | PortRule | RangeRule) and op.rule.outcome is Outcome.MARK
            marked = marked or _matches(op.rule, contents, addr, proto, port)
    for op in batch.ops:
        assert isinstance(op, AddRule)
        if op.chain == "subj_s_u_1":
            assert isinstance(op.rule, MatchRule | PortRule)
            if _matches(op.rule, contents, addr, proto, port):
                return op.rule.outcome.value, counted
    return ("accept" if marked else "drop"), counted  # meta mark & 0x2 != 0x2 drop


def forward_verdict(cfg: TableConfig, contents: Contents, dst: str) -> str:
    return forward_path(cfg, contents, dst)[0]


def mitm_in_verdict(contents: Contents, dst: str, port: int = 443) -> str:
    addr = ip_address(dst)
    for op in subject_rules(MITM, "s_u_1", audit=True).ops:
        assert isinstance(op, AddRule)
        if op.chain != "subj_s_u_1_in":
            continue
        if isinstance(op.rule, VerdictRule):
            return op.rule.outcome.value
        assert isinstance(op.rule, MatchRule | PortRule | RangeRule)
        if _matches(op.rule, contents, addr, "tcp", port):
            return op.rule.outcome.value
    return "accept"  # the input chain's policy; never reached (the chain ends with a verdict)


EMPTY: Contents = {}
PROBES = ["8.8.8.8", "1.2.3.4", "9.9.9.9", "0.0.0.1", "255.255.255.255", "2001:db8::1", "::1"]


# --------------------------------------------------------------------------- §8.1 header


def test_header_with_delete_starts_with_delete_table() -> None:
    text = lines(header_script(CFG, delete_existing=True))
    assert text[0] == f"delete table inet {T}"
    assert text[1] == f"add table inet {T}"


def test_header_without_delete() -> None:
    text = lines(header_script(CFG, delete_existing=False))
    assert text[0] == f"add table inet {T}"
    assert not any(ln.startswith("delete") for ln in text)
    assert header_script(CFG, delete_existing=True) == f"delete table inet {T}\n" + "\n".join(text) + "\n"


def test_header_hook_chains_and_maps() -> None:
    text = lines(header_script(CFG, delete_existing=False))
    assert f"add chain inet {T} marking {{ type filter hook prerouting priority 0; policy accept; }}" in text
    assert f"add chain inet {T} dispatch {{ type filter hook forward priority 0; policy accept; }}" in text
    assert f"add chain inet {T} nat {{ type nat hook prerouting priority dstnat; policy accept; }}" in text
    for fam, typ in (("v4", "ipv4_addr"), ("v6", "ipv6_addr")):
        assert f"add map inet {T} dispatch_{fam} {{ type {typ} : verdict; }}" in text
        assert f"add map inet {T} marking_{fam} {{ type {typ} : verdict; }}" in text
        assert f"add set inet {T} dns_gw_{fam} {{ type {typ}; }}" in text
    # Without MITM there are no MITM maps, but the input chain polices sandbox sources (14.2).
    assert f"add chain inet {T} input {{ type filter hook input priority 0; policy accept; }}" in text
    assert not any("mitm" in ln or "18081" in ln for ln in text)
    assert not any("doh_block" in ln or "dport 443" in ln for ln in text)


def test_header_dispatch_rules_in_order_with_unmarked_drop_last() -> None:
    dispatch = rules_of(header_script(CFG, delete_existing=False), "dispatch")
    assert dispatch == [
        "ct state established,related accept",
        "tcp dport 853 goto denied",
        "udp dport 853 goto denied",
        "ip daddr @sandboxes_v4 goto denied",
        "ip6 daddr @sandboxes_v6 goto denied",
        "ip daddr @sandbox_nets_v4 goto denied",
        "ip6 daddr @sandbox_nets_v6 goto denied",
        "ip saddr vmap @dispatch_v4",
        "ip6 saddr vmap @dispatch_v6",
        "meta mark & 0x2 != 0x2 goto denied",
    ]


def test_header_input_lets_sandbox_sources_reach_only_the_dns_redirect() -> None:
    """14.2 without the MITM: the pod's listeners are closed to sandbox sources, except the
    redirected ``<gateway>:53``; nothing else arriving at the input hook is touched."""
    script = header_script(CFG, delete_existing=False)
    assert rules_of(script, "input") == [
        "udp dport { 15353, 16000-16256 } jump owned_in",
        "tcp dport { 15353, 16000-16256, 18080 } jump owned_in",
        "ct state established,related accept",
        "iifname @sandbox_ifaces jump sandbox_in",
        "ip saddr @sandboxes_v4 jump sandbox_in",
        'iifname != "lo" ip saddr @sandbox_nets_v4 jump sandbox_in',
        "ip6 saddr @sandboxes_v6 jump sandbox_in",
        'iifname != "lo" ip6 saddr @sandbox_nets_v6 jump sandbox_in',
    ]
    assert rules_of(script, "sandbox_in") == [
        "udp dport 15353 ct status dnat ct original proto-dst 53 accept",
        "tcp dport 15353 ct status dnat ct original proto-dst 53 accept",
        "icmpv6 type { nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert } ip6 hoplimit 255 accept",
        "goto denied",
    ]
    assert f"add chain inet {T} sandbox_in" in lines(script)


def test_header_marking_clears_the_allow_bit_first() -> None:
    marking = rules_of(header_script(CFG, delete_existing=False), "marking")
    assert marking == [
        'iifname @sandbox_ifaces fib saddr . iif oif missing counter name "unattributed_dropped" drop',
        "meta mark set meta mark & 0xfffffffd",
        "ip saddr vmap @marking_v4",
        "ip6 saddr vmap @marking_v6",
    ]


@pytest.mark.parametrize("port", [15353, 5300])
def test_header_nat_redirects_gateway_dns_to_the_dns_port(port: int) -> None:
    cfg = TableConfig(table=T, dns_port=port)
    nat = rules_of(header_script(cfg, delete_existing=False), "nat")
    assert nat == [
        f"ip daddr @dns_gw_v4 udp dport 53 redirect to :{port}",
        f"ip daddr @dns_gw_v4 tcp dport 53 redirect to :{port}",
        f"ip6 daddr @dns_gw_v6 udp dport 53 redirect to :{port}",
        f"ip6 daddr @dns_gw_v6 tcp dport 53 redirect to :{port}",
    ]


def test_header_mitm() -> None:
    script = header_script(MITM, delete_existing=False)
    text = lines(script)
    assert f"add chain inet {T} input {{ type filter hook input priority 0; policy accept; }}" in text
    for fam, typ in (("v4", "ipv4_addr"), ("v6", "ipv6_addr")):
        assert f"add map inet {T} mitm_in_{fam} {{ type {typ} : verdict; }}" in text
        assert f"add set inet {T} mitm_src_{fam} {{ type {typ}; }}" in text
        assert f"add map inet {T} mitm_port_{fam} {{ type {typ} : inet_service; }}" in text
    assert rules_of(script, "input") == [
        "udp dport { 15353, 16000-16256 } jump owned_in",
        "tcp dport { 15353, 16000-16512, 18080-18081 } jump owned_in",
        "ct state established,related accept",
        "iifname @sandbox_ifaces jump sandbox_in",
        "ip saddr @sandboxes_v4 jump sandbox_in",
        'iifname != "lo" ip saddr @sandbox_nets_v4 jump sandbox_in',
        "ip6 saddr @sandboxes_v6 jump sandbox_in",
        'iifname != "lo" ip6 saddr @sandbox_nets_v6 jump sandbox_in',
        "tcp dport 18081 goto denied",
    ]
    assert rules_of(script, "sandbox_in") == [
        "udp dport 15353 ct status dnat ct original proto-dst 53 accept",
        "tcp dport 15353 ct status dnat ct original proto-dst 53 accept",
        "icmpv6 type { nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert } ip6 hoplimit 255 accept",
        "ct status dnat ct original ip daddr @sandboxes_v4 goto denied",
        "ct status dnat ct original ip daddr @sandbox_nets_v4 goto denied",
        "ct status dnat ct original ip6 daddr @sandboxes_v6 goto denied",
        "ct status dnat ct original ip6 daddr @sandbox_nets_v6 goto denied",
        "tcp dport 18081 ct status dnat ip saddr vmap @mitm_in_v4",
        "tcp dport 18081 ct status dnat ip6 saddr vmap @mitm_in_v6",
        "goto denied",
    ]
    nat = rules_of(script, "nat")
    # Nothing addressed to the pod itself or to a sandbox is intercepted (14.2).
    assert nat.index("fib daddr type local meta l4proto tcp return") < nat.index(
        "ip saddr @mitm_src_v4 tcp dport { 80, 443 } redirect to :ip saddr map @mitm_port_v4"
    )
    for fam, l3 in (("v4", "ip"), ("v6", "ip6")):
        assert nat.index(f"{l3} daddr @sandboxes_{fam} meta l4proto tcp return") < nat.index(
            f"{l3} saddr @mitm_src_{fam} tcp dport {{ 80, 443 }} redirect to :{l3} saddr map @mitm_port_{fam}"
        )
        # A worker-port miss is dropped right after the redirect, never forwarded.
        redirect = nat.index(
            f"{l3} saddr @mitm_src_{fam} tcp dport {{ 80, 443 }} redirect to :{l3} saddr map @mitm_port_{fam}"
        )
        assert nat[redirect + 1] == f"{l3} saddr @mitm_src_{fam} tcp dport {{ 80, 443 }} drop"
        # The ports a subject's http/https rules name (§18): the same redirect, the same
        # miss-drop, after the same exemptions.
        named = f"{l3} saddr . meta l4proto . tcp dport @mitm_ports_{fam}"
        at = nat.index(f"{named} redirect to :{l3} saddr map @mitm_port_{fam}")
        assert nat[at + 1] == f"{named} drop"
        assert nat.index(f"{l3} daddr @sandbox_nets_{fam} meta l4proto tcp return") < at
    assert "ip daddr @dns_gw_v4 meta l4proto tcp return" in nat
    assert "ip saddr @mitm_src_v4 tcp dport { 80, 443 } redirect to :ip saddr map @mitm_port_v4" in nat
    assert "ip6 daddr @dns_gw_v6 meta l4proto tcp return" in nat
    assert "ip6 saddr @mitm_src_v6 tcp dport { 80, 443 } redirect to :ip6 saddr map @mitm_port_v6" in nat
    # The gateway exemption precedes the interception of the same family.
    assert nat.index("ip daddr @dns_gw_v4 meta l4proto tcp return") < nat.index(
        "ip saddr @mitm_src_v4 tcp dport { 80, 443 } redirect to :ip saddr map @mitm_port_v4"
    )
    assert rules_of(script, "dispatch")[-1] == "meta mark & 0x2 != 0x2 goto denied"


@pytest.mark.parametrize("mitm", [False, True])
def test_header_doh_without_blocklist_drops_all_443(mitm: bool) -> None:
    cfg = TableConfig(table=T, mitm=mitm, block_doh_443=True)
    script = header_script(cfg, delete_existing=False)
    dispatch = rules_of(script, "dispatch")
    assert "tcp dport 443 goto denied" in dispatch
    assert dispatch.index("tcp dport 443 goto denied") < dispatch.index("ip saddr vmap @dispatch_v4")
    assert dispatch[-1] == "meta mark & 0x2 != 0x2 goto denied"
    assert "doh_block" not in script
    input_rules = rules_of(script, "input")
    if mitm:
        assert "meta l4proto tcp ct status dnat ct original proto-dst 443 goto denied" in input_rules
        assert input_rules.index(
            "meta l4proto tcp ct status dnat ct original proto-dst 443 goto denied"
        ) < input_rules.index("ip saddr @sandboxes_v4 jump sandbox_in")
    else:
        assert not any("443" in r for r in input_rules)


@pytest.mark.parametrize("mitm", [False, True])
def test_header_doh_with_blocklist_v4_and_v6(mitm: bool) -> None:
    cfg = TableConfig(
        table=T,
        mitm=mitm,
        block_doh_443=True,
        doh_blocklist=(ip_network("1.1.1.1/32"), ip_network("9.9.9.0/24"), ip_network("2606:4700::/32")),
    )
    script = header_script(cfg, delete_existing=False)
    text = lines(script)
    assert (
        f"add set inet {T} doh_block_v4 {{ type ipv4_addr; flags interval; elements = {{ 1.1.1.1, 9.9.9.0/24 }} }}"
        in text
    )
    assert (
        f"add set inet {T} doh_block_v6 {{ type ipv6_addr; flags interval; elements = {{ 2606:4700::/32 }} }}"
        in text
    )
    dispatch = rules_of(script, "dispatch")
    assert "ip daddr @doh_block_v4 tcp dport 443 goto denied" in dispatch
    assert "ip6 daddr @doh_block_v6 tcp dport 443 goto denied" in dispatch
    assert "tcp dport 443 goto denied" not in dispatch  # not global with a blocklist
    assert dispatch[-1] == "meta mark & 0x2 != 0x2 goto denied"
    assert dispatch.index("ip6 daddr @doh_block_v6 tcp dport 443 goto denied") < dispatch.index(
        "ip saddr vmap @dispatch_v4"
    )
    input_rules = rules_of(script, "input")
    v4_in = "meta l4proto tcp ct status dnat ct original ip daddr @doh_block_v4 ct original proto-dst 443 goto denied"
    v6_in = "meta l4proto tcp ct status dnat ct original ip6 daddr @doh_block_v6 ct original proto-dst 443 goto denied"
    if mitm:
        assert v4_in in input_rules
        assert v6_in in input_rules
    else:
        assert not any("443" in r for r in input_rules)


def test_header_doh_blocklist_v6_only_has_no_v4_rule() -> None:
    cfg = TableConfig(table=T, block_doh_443=True, doh_blocklist=(ip_network("2001:db8::1/128"),))
    script = header_script(cfg, delete_existing=False)
    assert "elements = { 2001:db8::1 }" in script  # hosts printed bare
    dispatch = rules_of(script, "dispatch")
    assert "ip6 daddr @doh_block_v6 tcp dport 443 goto denied" in dispatch
    assert not any("doh_block_v4" in r for r in dispatch)


def test_header_blocklist_ignored_when_blocking_is_off() -> None:
    cfg = TableConfig(table=T, block_doh_443=False, doh_blocklist=(ip_network("1.1.1.1/32"),))
    script = header_script(cfg, delete_existing=False)
    assert "doh_block" not in script
    assert "443 goto denied" not in script


def test_header_doh_blocklist_is_normalised() -> None:
    nets = parse_doh_blocklist("1.1.1.0/24, 1.1.1.1, 8.8.8.8, 8.8.8.8, 2001:db8::/32, 2001:db8::1")
    script = header_script(
        TableConfig(table=T, block_doh_443=True, doh_blocklist=nets), delete_existing=False
    )
    assert "doh_block_v4 { type ipv4_addr; flags interval; elements = { 1.1.1.0/24, 8.8.8.8 } }" in script
    assert "doh_block_v6 { type ipv6_addr; flags interval; elements = { 2001:db8::/32 } }" in script


# --------------------------------------------------------------------------- §8.2 subject objects


def test_objects_script_declares_the_sets_chains_and_counters() -> None:
    text = lines(subject_objects_script(CFG, SUBJ))
    for kind in ("allow", "deny"):
        assert f"add set inet {T} subj_s_u_1_{kind}_v4 {{ type ipv4_addr; flags interval; }}" in text
        assert f"add set inet {T} subj_s_u_1_{kind}_v6 {{ type ipv6_addr; flags interval; }}" in text
    assert not [ln for ln in text if "wdeny" in ln or "audit_v" in ln]  # made by the first audit policy
    assert (
        f"add set inet {T} subj_s_u_1_dyn_v4 {{ type ipv4_addr; flags timeout; timeout 360s; size 4096; }}"
        in text
    )
    assert (
        f"add set inet {T} subj_s_u_1_dyn_v6 {{ type ipv6_addr; flags timeout; timeout 360s; size 4096; }}"
        in text
    )
    assert f"add chain inet {T} subj_s_u_1" in text
    assert f"add chain inet {T} mark_s_u_1" in text
    assert f"add chain inet {T} subj_s_u_1_in" not in text
    assert f"add counter inet {T} subj_s_u_1_audit_deny" in text
    assert f"add counter inet {T} subj_s_u_1_audit_default" in text
    for kind in ("allowp", "denyp"):
        assert (
            f"add set inet {T} subj_s_u_1_{kind}_v4 {{ type ipv4_addr . inet_proto . inet_service; "
            "flags interval; }" in text
        )
    assert (
        f"add set inet {T} subj_s_u_1_dynp_v6 {{ type ipv6_addr . inet_proto . inet_service; "
        "flags interval,timeout; timeout 360s; size 8192; }" in text
    )
    assert (
        f"add set inet {T} subj_s_u_1_dynpx_v6 {{ type ipv6_addr . inet_proto . inet_service; "
        "flags timeout; timeout 360s; size 8192; }" in text
    )
    declared = [ln for ln in text if ln.startswith(f"add set inet {T} subj_")]
    assert len(declared) == 14  # the range sets are lazy (range_objects), like the audit sets


def test_objects_script_has_no_rules_no_flushes_no_deletes() -> None:
    """Cache-free for libnftables: declarations and inline map elements only."""
    for cfg in (CFG, MITM):
        text = lines(subject_objects_script(cfg, SUBJ))
        assert all(ln.startswith(("add set ", "add chain ", "add map ", "add counter ")) for ln in text), text
        assert not any(ln.startswith(("add rule", "flush", "delete", "add element")) for ln in text)
        # Declarations of the subject's own sets never carry elements: content is netlink's job.
        assert not any("elements" in ln for ln in text if f"inet {T} subj_" in ln)


def test_objects_script_declarations_come_before_the_dispatch_entries() -> None:
    text = lines(subject_objects_script(MITM, SUBJ))
    own = (f"add set inet {T} subj_s_u_1_", f"add chain inet {T} ", f"add counter inet {T} ")
    last_decl = max(i for i, ln in enumerate(text) if ln.startswith(own))
    first_entry = min(i for i, ln in enumerate(text) if "elements" in ln)
    assert last_decl < first_entry


def test_subject_rules_are_the_fixed_rule_list() -> None:
    batch = subject_rules(CFG, "s_u_1", audit=True, ranges=True)
    # Without the audit objects: the same rules less the audit ones; without the range objects
    # (lazy too, range_objects) less the two hash-path rules as well.
    assert subject_rules(CFG, "s_u_1", ranges=True).ops == batch.ops[:16]
    assert subject_rules(CFG, "s_u_1").ops == batch.ops[:14]
    assert subject_rules(CFG, "s_u_1", audit=True).ops == batch.ops[:14] + batch.ops[16:]
    assert batch.table == T
    assert batch.ops == (
        AddRule("subj_s_u_1", MatchRule("v4", "subj_s_u_1_deny_v4", Outcome.DROP, drop_chain="denied")),
        AddRule("subj_s_u_1", MatchRule("v6", "subj_s_u_1_deny_v6", Outcome.DROP, drop_chain="denied")),
        AddRule("subj_s_u_1", PortRule("v4", "subj_s_u_1_denyp_v4", Outcome.DROP, drop_chain="denied")),
        AddRule("subj_s_u_1", PortRule("v6", "subj_s_u_1_denyp_v6", Outcome.DROP, drop_chain="denied")),
        AddRule("mark_s_u_1", MatchRule("v4", "subj_s_u_1_allow_v4", Outcome.MARK)),
        AddRule("mark_s_u_1", MatchRule("v6", "subj_s_u_1_allow_v6", Outcome.MARK)),
        AddRule("mark_s_u_1", PortRule("v4", "subj_s_u_1_allowp_v4", Outcome.MARK)),
        AddRule("mark_s_u_1", PortRule("v6", "subj_s_u_1_allowp_v6", Outcome.MARK)),
        AddRule("mark_s_u_1", MatchRule("v4", "subj_s_u_1_dyn_v4", Outcome.MARK)),
        AddRule("mark_s_u_1", MatchRule("v6", "subj_s_u_1_dyn_v6", Outcome.MARK)),
        AddRule("mark_s_u_1", PortRule("v4", "subj_s_u_1_dynp_v4", Outcome.MARK)),
        AddRule("mark_s_u_1", PortRule("v6", "subj_s_u_1_dynp_v6", Outcome.MARK)),
        AddRule("mark_s_u_1", PortRule("v4", "subj_s_u_1_dynpx_v4", Outcome.MARK, exact=True)),
        AddRule("mark_s_u_1", PortRule("v6", "subj_s_u_1_dynpx_v6", Outcome.MARK, exact=True)),
        *(
            AddRule(
                "mark_s_u_1",
                RangeRule(fam, f"subj_s_u_1_dynr_{fam}", f"subj_s_u_1_dynrports_{fam}", Outcome.MARK),
            )
            for fam in ("v4", "v6")
        ),
        *(
            AddRule(
                "mark_s_u_1",
                AuditRule(
                    fam,
                    f"subj_s_u_1_{kind}_{fam}",
                    f"subj_s_u_1_deny_{fam}",
                    "egressd would-deny s_u_1 ",
                    f"subj_s_u_1_audit_{counter}",
                    unmarked_only=kind == "audit",
                    ports=kind == "wdenyp",
                ),
            )
            for kind, counter in (("wdeny", "deny"), ("wdenyp", "deny"), ("audit", "default"))
            for fam in ("v4", "v6")
        ),
    )
    assert batch_rules(batch, "subj_s_u_1") == SUBJ_CHAIN_RULES
    assert batch_rules(batch, "mark_s_u_1") == MARK_CHAIN_RULES
    assert batch_rules(batch, "subj_s_u_1_in") == []
    # No unconditional verdict or mark: with empty sets the chains do nothing at all.
    assert all(
        isinstance(op, AddRule) and isinstance(op.rule, MatchRule | PortRule | AuditRule | RangeRule) for op in batch.ops
    )
    assert not any(
        op.rule.ct_original
        for op in batch.ops
        if isinstance(op, AddRule) and isinstance(op.rule, MatchRule | PortRule)
    )


def test_subject_rules_mitm_in_chain() -> None:
    batch = subject_rules(MITM, "s_u_1", audit=True, ranges=True)
    assert batch_rules(batch, "subj_s_u_1") == SUBJ_CHAIN_RULES
    assert batch_rules(batch, "mark_s_u_1") == MARK_CHAIN_RULES_CHECKED
    assert batch_rules(batch, "subj_s_u_1_in") == IN_CHAIN_RULES
    in_ops = [op.rule for op in batch.ops if isinstance(op, AddRule) and op.chain == "subj_s_u_1_in"]
    assert all(r.ct_original for r in in_ops if isinstance(r, MatchRule | PortRule))
    assert in_ops[-1] == VerdictRule(Outcome.DROP, drop_chain="denied")
    unchecked = subject_rules(replace(MITM, name_check=False), "s_u_1", audit=True, ranges=True)
    plain = subject_rules(CFG, "s_u_1", audit=True, ranges=True).ops
    assert unchecked.ops[: len(plain)] == plain
    # Without the audit objects the input path has no wdeny drop, without the range objects
    # no dynr accept, in the same order otherwise.
    bare = batch_rules(subject_rules(MITM, "s_u_1"), "subj_s_u_1_in")
    assert bare == [r for r in IN_CHAIN_RULES if "wdeny" not in r and "dynr" not in r]
    marks = batch_rules(subject_rules(MITM, "s_u_1", audit=True), "mark_s_u_1")
    assert marks == [r for r in MARK_CHAIN_RULES_CHECKED if "dynr" not in r]


def test_subject_rules_do_not_depend_on_anything_but_the_id() -> None:
    assert subject_rules(CFG, "s_u_1") == subject_rules(TableConfig(table=T, dns_port=5300), "s_u_1")
    assert subject_rules(MITM, "s_u_1") == subject_rules(MITM, "s_u_1")
    assert "s_u_6" in subject_rules(CFG, "s_u_6").describe()


def test_flush_subject_sets_empties_every_set() -> None:
    batch = flush_subject_sets(T, "s_u_1", audit=True, ranges=True)
    assert batch == NetlinkBatch(T, tuple(FlushSet(name) for name in SETS6))
    assert batch.describe().splitlines() == [f"flush set inet {T} {name}" for name in SETS6]


@pytest.mark.parametrize("dst", PROBES)
def test_deny_first_drops_everything(dst: str) -> None:
    """Deny-first = fixed rules + all sets empty: nothing marked, the tail drops it (audit rules
    included: they only match with content in ``wdeny``/``audit``)."""
    assert forward_path(CFG, EMPTY, dst) == ("drop", [])
    assert forward_path(MITM, EMPTY, dst) == ("drop", [])
    assert mitm_in_verdict(EMPTY, dst) == "drop"


def test_objects_script_dispatch_entries_come_last_and_redeclare_the_maps() -> None:
    text = lines(subject_objects_script(CFG, SUBJ))
    tail = [
        f"add map inet {T} dispatch_v4 {{ type ipv4_addr : verdict; elements = {{ 10.0.0.5 : jump subj_s_u_1 }} }}",
        f"add set inet {T} sandboxes_v4 {{ type ipv4_addr; elements = {{ 10.0.0.5 }} }}",
        f"add map inet {T} marking_v4 {{ type ipv4_addr : verdict; elements = {{ 10.0.0.5 : jump mark_s_u_1 }} }}",
        f"add set inet {T} dns_gw_v4 {{ type ipv4_addr; elements = {{ 10.0.0.1 }} }}",
    ]
    assert text[-4:] == tail
    assert not any(ln.startswith("delete") for ln in text)
    assert dispatch_entries(CFG, SUBJ) == "\n".join(tail) + "\n"


def test_objects_script_v6_subject() -> None:
    script = subject_objects_script(CFG, SUBJ6)
    text = lines(script)
    assert (
        f"add map inet {T} dispatch_v6 {{ type ipv6_addr : verdict; elements = {{ fd00::5 : jump subj_s_u_6 }} }}"
        in text
    )
    assert f"add set inet {T} dns_gw_v6 {{ type ipv6_addr; elements = {{ fd00::1 }} }}" in text
    assert "dispatch_v4" not in script


def test_objects_script_mixed_family_gateway_without_mitm_is_fine() -> None:
    subj = SubjectNft("s_x", ip_address("10.0.0.5"), ip_address("fd00::1"))
    script = subject_objects_script(CFG, subj)
    assert f"add set inet {T} dns_gw_v6 {{ type ipv6_addr; elements = {{ fd00::1 }} }}" in lines(script)


def test_objects_script_mitm() -> None:
    script = subject_objects_script(MITM, SUBJ)
    text = lines(script)
    assert f"add chain inet {T} subj_s_u_1_in" in text
    assert rules_of(script, "subj_s_u_1_in") == []  # its rules come from subject_rules
    assert (
        f"add map inet {T} mitm_in_v4 {{ type ipv4_addr : verdict; elements = {{ 10.0.0.5 : jump subj_s_u_1_in }} }}"
        in text
    )
    assert f"add set inet {T} mitm_src_v4 {{ type ipv4_addr; elements = {{ 10.0.0.5 }} }}" in text
    assert (
        f"add map inet {T} mitm_port_v4 {{ type ipv4_addr : inet_service; elements = {{ 10.0.0.5 : 18081 }} }}"
        in text
    )
    assert dispatch_entries(MITM, SUBJ) == "\n".join(text[-7:]) + "\n"


def test_objects_script_mitm_mismatched_gateway_family_raises() -> None:
    subj = SubjectNft("s_x", ip_address("10.0.0.5"), ip_address("fd00::1"))
    with pytest.raises(ValueError):
        subject_objects_script(MITM, subj)


def test_objects_script_is_deterministic() -> None:
    assert subject_objects_script(MITM, SUBJ) == subject_objects_script(MITM, SUBJ)
    assert subject_rules(MITM, "s_u_1") == subject_rules(MITM, "s_u_1")


# --------------------------------------------------------------------------- §8.3 policy swap

# An enforcing policy empties the audit sets in every swap (leaving audit is a swap too).
# The static sets past allow/deny: audit's, then the port-scoped ones (empty without ports).
AUDIT_FLUSHES = tuple(
    FlushSet(f"subj_s_u_1_{k}")
    for k in (
        "wdeny_v4",
        "wdeny_v6",
        "audit_v4",
        "audit_v6",
        "allowp_v4",
        "allowp_v6",
        "denyp_v4",
        "denyp_v6",
        "wdenyp_v4",
        "wdenyp_v6",
        # The leases' shared ranges (egressd.subject.ranges) are written with the policy.
        "dynrports_v4",
        "dynrports_v6",
    )
)
AUDIT_FLUSH_TEXT = "".join(f"flush set inet T {op.name}\n" for op in AUDIT_FLUSHES)
NO_AUDIT = {"wdeny_v4": (), "wdeny_v6": (), "audit_v4": (), "audit_v6": ()}


def test_policy_swap_for_the_spec_example() -> None:
    batch = policy_swap(T, "s_u_1", EXAMPLE, audit_objects=True, range_objects=True)
    assert batch == NetlinkBatch(
        T,
        (
            FlushSet("subj_s_u_1_allow_v4"),
            AddIntervals("subj_s_u_1_allow_v4", "v4", (ip_network("8.8.8.8/32"),)),
            FlushSet("subj_s_u_1_allow_v6"),
            FlushSet("subj_s_u_1_deny_v4"),
            AddIntervals("subj_s_u_1_deny_v4", "v4", (ip_network("1.2.3.4/32"),)),
            FlushSet("subj_s_u_1_deny_v6"),
            *AUDIT_FLUSHES,
        ),
    )
    assert "example.com" not in batch.describe()
    assert "subj_s_u_1_in" not in batch.describe()


def test_policy_swap_describe() -> None:
    assert policy_swap(T, "s_u_1", EXAMPLE, audit_objects=True, range_objects=True).describe() == (
        "flush set inet T subj_s_u_1_allow_v4\n"
        "add element inet T subj_s_u_1_allow_v4 { 8.8.8.8 }\n"
        "flush set inet T subj_s_u_1_allow_v6\n"
        "flush set inet T subj_s_u_1_deny_v4\n"
        "add element inet T subj_s_u_1_deny_v4 { 1.2.3.4 }\n"
        "flush set inet T subj_s_u_1_deny_v6\n" + AUDIT_FLUSH_TEXT
    )


def test_policy_swap_never_touches_dyn_sets_rules_maps_or_header() -> None:
    batch = policy_swap(T, "s_u_1", EXAMPLE, audit_objects=True, range_objects=True)
    touched = {op.name for op in batch.ops if isinstance(op, FlushSet | AddIntervals)}
    assert touched == {f"subj_s_u_1_{k}" for k in SET_KINDS if not k.startswith("dyn") or k.startswith("dynrports")}
    assert all(isinstance(op, FlushSet | AddIntervals) for op in batch.ops)  # no rules, no deletes
    text = batch.describe()
    assert not any(f"{k}_v" in text for k in ("dyn", "dynp", "dynpx", "dynr"))
    assert not any(
        name in text for name in ("dispatch_v4", "marking_v4", "dns_gw", "mitm_src", "mitm_in", "table")
    )
    # Every set is flushed before it is refilled.
    for op in batch.ops:
        if isinstance(op, AddIntervals):
            assert batch.ops.index(FlushSet(op.name)) < batch.ops.index(op)


def test_policy_swap_empty_sets_get_no_elements() -> None:
    batch = policy_swap(T, "s_u_1", EXAMPLE, audit_objects=True, range_objects=True)
    filled = [op.name for op in batch.ops if isinstance(op, AddIntervals)]
    assert filled == ["subj_s_u_1_allow_v4", "subj_s_u_1_deny_v4"]
    deny_all = policy_swap(T, "s_u_1", parse_policy("{}"), audit_objects=True, range_objects=True)
    assert all(isinstance(op, FlushSet) for op in deny_all.ops)
    assert sorted(op.name for op in deny_all.ops) == sorted(  # type: ignore[union-attr]
        f"subj_s_u_1_{k}" for k in SET_KINDS if not k.startswith("dyn") or k.startswith("dynrports")
    )
    assert "add element" not in deny_all.describe()


def test_policy_swap_v6_and_cidr_elements() -> None:
    pol = parse_policy(
        '{"egress":[{"action":"allow","target":"2001:db8::/32"},{"action":"allow","target":"2001:db8::1"},'
        '{"action":"allow","target":"10.99.0.9/24"},{"action":"deny","target":"2001:db8::dead"}]}'
    )
    adds = {
        op.name: op
        for op in policy_swap(T, "s_u_1", pol, audit_objects=True, range_objects=True).ops
        if isinstance(op, AddIntervals)
    }
    assert adds == {
        "subj_s_u_1_allow_v6": AddIntervals("subj_s_u_1_allow_v6", "v6", (ip_network("2001:db8::/32"),)),
        "subj_s_u_1_allow_v4": AddIntervals("subj_s_u_1_allow_v4", "v4", (ip_network("10.99.0.0/24"),)),
        "subj_s_u_1_deny_v6": AddIntervals("subj_s_u_1_deny_v6", "v6", (ip_network("2001:db8::dead/128"),)),
    }
    text = policy_swap(T, "s_u_1", pol, audit_objects=True, range_objects=True).describe().splitlines()
    assert f"add element inet {T} subj_s_u_1_allow_v6 {{ 2001:db8::/32 }}" in text
    assert f"add element inet {T} subj_s_u_1_allow_v4 {{ 10.99.0.0/24 }}" in text
    assert f"add element inet {T} subj_s_u_1_deny_v6 {{ 2001:db8::dead }}" in text


def test_policy_swap_default_allow_fills_the_allow_sets_with_everything() -> None:
    assert policy_contents(ALLOW_ALL) == {
        "allow_v4": (ip_network("0.0.0.0/0"),),
        "allow_v6": (ip_network("::/0"),),
        "deny_v4": (),
        "deny_v6": (),
        **NO_AUDIT,
    }
    batch = policy_swap(T, "s_u_1", ALLOW_ALL, audit_objects=True, range_objects=True)
    assert batch.ops == (
        FlushSet("subj_s_u_1_allow_v4"),
        AddIntervals("subj_s_u_1_allow_v4", "v4", (ip_network("0.0.0.0/0"),)),
        FlushSet("subj_s_u_1_allow_v6"),
        AddIntervals("subj_s_u_1_allow_v6", "v6", (ip_network("::/0"),)),
        FlushSet("subj_s_u_1_deny_v4"),
        FlushSet("subj_s_u_1_deny_v6"),
        *AUDIT_FLUSHES,
    )
    assert f"add element inet {T} subj_s_u_1_allow_v4 {{ 0.0.0.0/0 }}" in batch.describe()
    assert f"add element inet {T} subj_s_u_1_allow_v6 {{ ::/0 }}" in batch.describe()


def test_policy_contents_default_allow_ignores_explicit_allows_but_keeps_denies() -> None:
    pol = parse_policy(
        '{"defaultAction":"allow","egress":[{"action":"allow","target":"8.8.8.8"},'
        '{"action":"deny","target":"1.2.3.4"},{"action":"deny","target":"2001:db8::/48"}]}'
    )
    assert policy_contents(pol) == {
        "allow_v4": (ip_network("0.0.0.0/0"),),
        "allow_v6": (ip_network("::/0"),),
        "deny_v4": (ip_network("1.2.3.4/32"),),
        "deny_v6": (ip_network("2001:db8::/48"),),
        **NO_AUDIT,
    }


@pytest.mark.parametrize(
    ("dst", "expected"),
    [("8.8.8.8", "accept"), ("1.2.3.4", "drop"), ("9.9.9.9", "drop"), ("2001:db8::1", "drop")],
)
def test_example_policy_contents_enforce_the_example(dst: str, expected: str) -> None:
    contents = policy_contents(EXAMPLE)
    assert forward_verdict(CFG, contents, dst) == expected
    assert mitm_in_verdict(contents, dst) == expected  # default deny: the IN chain ends in drop


@pytest.mark.parametrize(
    ("dst", "expected"),
    [("8.8.8.8", "accept"), ("1.2.3.4", "drop"), ("255.255.255.255", "accept"), ("2001:db8::1", "accept")],
)
def test_default_allow_contents_allow_everything_but_denies(dst: str, expected: str) -> None:
    contents = policy_contents(ALLOW_BUT)
    assert forward_verdict(CFG, contents, dst) == expected
    assert mitm_in_verdict(contents, dst) == expected  # allow sets hold everything: IN accepts


def test_dyn_leases_are_allowed_but_never_beat_a_deny() -> None:
    contents = {
        **policy_contents(EXAMPLE),
        "dyn_v4": (ip_network("93.184.216.34/32"), ip_network("1.2.3.4/32")),
    }
    assert forward_verdict(CFG, contents, "93.184.216.34") == "accept"
    assert mitm_in_verdict(contents, "93.184.216.34") == "accept"
    assert forward_verdict(CFG, contents, "1.2.3.4") == "drop"
    assert mitm_in_verdict(contents, "1.2.3.4") == "drop"


# --------------------------------------------------------------------------- removal / netlink batches


def test_removal_batch_op_order() -> None:
    batch = removal_batch(CFG, "s_u_1", SUBJ.ip, release_gateway=None, audit=True, ranges=True)
    assert batch.table == T
    ip = SUBJ.ip
    assert batch.ops == (
        DeleteElement("marking_v4", ip),
        DeleteElement("dispatch_v4", ip),
        DeleteElement("sandboxes_v4", ip),
        DeleteElement("drop_counter_v4", ip),
        DeleteChain("subj_s_u_1"),
        DeleteChain("mark_s_u_1"),
        *(DeleteSet(f"subj_s_u_1_{k}") for k in SET_KINDS),
        DeleteCounter("subj_s_u_1_audit_deny"),
        DeleteCounter("subj_s_u_1_audit_default"),
        DeleteCounter("subj_s_u_1_dropped"),
    )
    kinds = [type(op) for op in batch.ops]
    # map elements, then chains (their rules reference the sets and counters), then those
    assert kinds == sorted(kinds, key=[DeleteElement, DeleteChain, DeleteSet, DeleteCounter].index)
    # (mypy cannot narrow the ops to those with a name: the kinds assertion above does.)
    assert not any(op.name.startswith("dns_gw") for op in batch.ops)  # type: ignore[union-attr]


def test_removal_batch_releases_the_gateway_with_mitm() -> None:
    batch = removal_batch(MITM, "s_u_1", SUBJ.ip, release_gateway=SUBJ.gateway, audit=True, ranges=True)
    elements = [(op.name, op.key) for op in batch.ops if isinstance(op, DeleteElement)]
    assert elements == [
        ("marking_v4", SUBJ.ip),
        ("dispatch_v4", SUBJ.ip),
        ("sandboxes_v4", SUBJ.ip),
        ("mitm_src_v4", SUBJ.ip),
        ("mitm_in_v4", SUBJ.ip),
        ("mitm_port_v4", SUBJ.ip),
        ("drop_counter_v4", SUBJ.ip),
        ("dns_gw_v4", SUBJ.gateway),
    ]
    chains = [op.name for op in batch.ops if isinstance(op, DeleteChain)]
    assert chains == ["subj_s_u_1", "mark_s_u_1", "subj_s_u_1_in"]
    kinds = [type(op) for op in batch.ops]
    assert kinds.index(DeleteChain) > max(i for i, k in enumerate(kinds) if k is DeleteElement)
    assert kinds.index(DeleteSet) > max(i for i, k in enumerate(kinds) if k is DeleteChain)
    assert batch.describe().splitlines()[7] == "delete element inet T dns_gw_v4 { 10.0.0.1 }"


def test_removal_batch_without_ip_drops_only_objects() -> None:
    batch = removal_batch(CFG, "s_u_1", None, release_gateway=None, audit=True, ranges=True)
    assert all(not isinstance(op, DeleteElement) for op in batch.ops)
    assert len(batch.ops) == 2 + len(SET_KINDS) + 3
    assert (
        len(removal_batch(MITM, "s_u_1", None, release_gateway=None, audit=True, ranges=True).ops)
        == 3 + len(SET_KINDS) + 3
    )


def test_removal_batch_describe() -> None:
    text = removal_batch(CFG, "s_u_1", SUBJ.ip, release_gateway=SUBJ.gateway, audit=True, ranges=True).describe()
    assert text.splitlines() == [
        "delete element inet T marking_v4 { 10.0.0.5 }",
        "delete element inet T dispatch_v4 { 10.0.0.5 }",
        "delete element inet T sandboxes_v4 { 10.0.0.5 }",
        "delete element inet T drop_counter_v4 { 10.0.0.5 }",
        "delete element inet T dns_gw_v4 { 10.0.0.1 }",
        "delete chain inet T subj_s_u_1",
        "delete chain inet T mark_s_u_1",
        *(f"delete set inet T subj_s_u_1_{k}" for k in SET_KINDS),
        "delete counter inet T subj_s_u_1_audit_deny",
        "delete counter inet T subj_s_u_1_audit_default",
        "delete counter inet T subj_s_u_1_dropped",
    ]
    assert text.endswith("\n")
    assert NetlinkBatch(T).describe() == ""


def test_removal_batch_describe_v6_with_mitm() -> None:
    text = removal_batch(MITM, "s_u_6", SUBJ6.ip, release_gateway=SUBJ6.gateway, audit=True, ranges=True).describe()
    assert text.splitlines()[:8] == [
        "delete element inet T marking_v6 { fd00::5 }",
        "delete element inet T dispatch_v6 { fd00::5 }",
        "delete element inet T sandboxes_v6 { fd00::5 }",
        "delete element inet T mitm_src_v6 { fd00::5 }",
        "delete element inet T mitm_in_v6 { fd00::5 }",
        "delete element inet T mitm_port_v6 { fd00::5 }",
        "delete element inet T drop_counter_v6 { fd00::5 }",
        "delete element inet T dns_gw_v6 { fd00::1 }",
    ]
    assert "delete chain inet T subj_s_u_6_in" in text.splitlines()


def test_dispatch_deletes_v6_and_gateway_of_other_family() -> None:
    ops = dispatch_deletes(CFG, ip_address("fd00::5"), release_gateway=ip_address("10.0.0.1"))
    assert ops == [
        DeleteElement("marking_v6", ip_address("fd00::5")),
        DeleteElement("dispatch_v6", ip_address("fd00::5")),
        DeleteElement("sandboxes_v6", ip_address("fd00::5")),
        DeleteElement("drop_counter_v6", ip_address("fd00::5")),
        DeleteElement("dns_gw_v4", ip_address("10.0.0.1")),
    ]
    assert gateway_release(ip_address("fd00::1")) == DeleteElement("dns_gw_v6", ip_address("fd00::1"))


def test_netlink_batch_truthiness_and_concatenation() -> None:
    assert not NetlinkBatch(T)
    flush = flush_subject_sets(T, "s_u_1", audit=True, ranges=True)
    rules = subject_rules(CFG, "s_u_1")
    assert flush
    joined = flush + rules
    assert joined.table == T
    assert joined.ops == flush.ops + rules.ops
    assert joined.describe() == flush.describe() + rules.describe()


def test_rule_render() -> None:
    assert MatchRule("v4", "s", Outcome.DROP).render() == "ip daddr @s drop"
    assert MatchRule("v6", "s", Outcome.ACCEPT).render() == "ip6 daddr @s accept"
    assert MatchRule("v4", "s", Outcome.MARK).render() == "ip daddr @s meta mark set 0x2"
    assert MatchRule("v6", "s", Outcome.DROP, ct_original=True).render() == "ct original ip6 daddr @s drop"
    assert VerdictRule(Outcome.ACCEPT).render() == "accept"


# --------------------------------------------------------------------------- DNS learning


def test_dyn_add_sets_timeout_and_expires() -> None:
    batch = dyn_add(
        T,
        "s_u_1",
        [
            Grant(ip_address("93.184.216.34"), 90),
            Grant(ip_address("2001:db8::1"), 61),
            Grant(ip_address("1.1.1.1"), 360),
        ],
    )
    assert batch.ops == (
        AddTimed(
            "subj_s_u_1_dyn_v4", "v4", ((ip_address("93.184.216.34"), 90), (ip_address("1.1.1.1"), 360))
        ),
        AddTimed("subj_s_u_1_dyn_v6", "v6", ((ip_address("2001:db8::1"), 61),)),
    )
    assert batch.describe().splitlines() == [
        f"add element inet {T} subj_s_u_1_dyn_v4 "
        "{ 93.184.216.34 timeout 90s expires 90s, 1.1.1.1 timeout 360s expires 360s }",
        f"add element inet {T} subj_s_u_1_dyn_v6 {{ 2001:db8::1 timeout 61s expires 61s }}",
    ]


def test_dyn_add_single_family() -> None:
    batch = dyn_add(T, "s_u_1", [Grant(ip_address("93.184.216.34"), 90)])
    assert "dyn_v6" not in batch.describe()
    assert "93.184.216.34 timeout 90s expires 90s" in batch.describe()
    assert not dyn_add(T, "s_u_1", [])


# --------------------------------------------------------------------------- audit (shadow) mode

ALWAYS_DENY_9 = AlwaysRules(parse_always_text("9.9.9.9\n", "deny.always", Verdict.DENY), ())
AUDIT = parse_policy(
    '{"defaultAction":"deny","mode":"audit","egress":['
    '{"action":"deny","target":"1.2.3.4"},'
    '{"action":"allow","target":"1.2.3.0/24"},'
    '{"action":"allow","target":"8.8.8.8"}]}'
)


def test_audit_contents_move_user_denies_out_of_the_deny_set_and_open_the_audit_sets() -> None:
    contents = policy_contents(effective_policy(AUDIT, ALWAYS_DENY_9))
    assert contents == {
        "allow_v4": (ip_network("1.2.3.0/24"), ip_network("8.8.8.8/32")),
        "allow_v6": (),
        "deny_v4": (ip_network("9.9.9.9/32"),),  # operator always-deny: stays hard
        "deny_v6": (),
        "wdeny_v4": (ip_network("1.2.3.4/32"),),
        "wdeny_v6": (),
        "audit_v4": (ip_network("0.0.0.0/0"),),
        "audit_v6": (ip_network("::/0"),),
    }
    # The same policy enforcing: nothing in the audit sets.
    enforcing = policy_contents(effective_policy(replace(AUDIT, audit=False), ALWAYS_DENY_9))
    assert enforcing["deny_v4"] == (ip_network("1.2.3.4/32"), ip_network("9.9.9.9/32"))
    assert all(enforcing[k] == () for k in ("wdeny_v4", "wdeny_v6", "audit_v4", "audit_v6"))


@pytest.mark.parametrize(
    ("dst", "expected"),
    [
        ("8.8.8.8", ("accept", [])),  # allowed: no would-deny
        ("1.2.3.5", ("accept", [])),
        ("1.2.3.4", ("accept", ["subj_s_u_1_audit_deny"])),  # denied inside an allow: counted once
        ("4.4.4.4", ("accept", ["subj_s_u_1_audit_default"])),  # no allow: the defaultAction
        ("2001:db8::1", ("accept", ["subj_s_u_1_audit_default"])),
        ("9.9.9.9", ("drop", [])),  # always-deny: hard, dropped and not a would-deny
    ],
)
def test_audit_passes_and_counts_what_the_policy_would_drop(
    dst: str, expected: tuple[str, list[str]]
) -> None:
    contents = policy_contents(effective_policy(AUDIT, ALWAYS_DENY_9))
    assert forward_path(CFG, contents, dst) == expected
    # The same policy enforcing drops exactly the counted ones.
    enforcing = policy_contents(effective_policy(replace(AUDIT, audit=False), ALWAYS_DENY_9))
    assert forward_path(CFG, enforcing, dst) == ("drop" if expected[1] else expected[0], [])


def test_audit_with_default_allow_only_counts_user_denies() -> None:
    contents = policy_contents(replace(ALLOW_BUT, audit=True))
    assert forward_path(CFG, contents, "4.4.4.4") == ("accept", [])
    assert forward_path(CFG, contents, "1.2.3.4") == ("accept", ["subj_s_u_1_audit_deny"])


@pytest.mark.parametrize("dst", ["1.2.3.4", "4.4.4.4", "9.9.9.9"])
def test_audit_never_applies_to_the_mitm_input_path(dst: str) -> None:
    contents = policy_contents(effective_policy(AUDIT, ALWAYS_DENY_9))
    assert mitm_in_verdict(contents, dst) == "drop"
    assert mitm_in_verdict(contents, "8.8.8.8") == "accept"


def test_audit_rule_log_prefix_fits_the_kernel_limit_for_the_longest_ids() -> None:
    nid = "s_" + "x" * 128
    rules = [op.rule for op in subject_rules(CFG, nid, audit=True).ops if isinstance(op, AddRule)]
    audit = [r for r in rules if isinstance(r, AuditRule)]
    assert len(audit) == 6
    assert all(
        len(r.log_prefix.encode()) <= 127 and r.log_prefix.startswith("egressd would-deny s_x") for r in audit
    )
    assert {r.counter for r in audit} == {f"subj_{nid}_audit_deny", f"subj_{nid}_audit_default"}
    assert audit_counter_subject(f"subj_{nid}_audit_default") == (nid, "default")
    assert audit_counter_subject("subj_s_u_1_audit_deny") == ("s_u_1", "deny")
    assert audit_counter_subject("other") is None


# --------------------------------------------------------------------------- lazy audit objects


def test_audit_objects_declare_the_sets_and_rebuild_the_chains_that_read_them() -> None:
    for cfg in (CFG, MITM):
        batch = audit_objects(cfg, "s_u_1")
        kinds = ("wdeny_v4", "wdeny_v6", "audit_v4", "audit_v6")
        assert [op for op in batch.ops if isinstance(op, AddSet)] == [
            *(AddSet(f"subj_s_u_1_{k}", k[-2:], "interval") for k in kinds),
            *(AddSet(f"subj_s_u_1_wdenyp_{f}", f, "interval", ports=True) for f in ("v4", "v6")),
        ]
        chains = ["mark_s_u_1"] + (["subj_s_u_1_in"] if cfg.mitm else [])
        assert [op for op in batch.ops if isinstance(op, FlushChain)] == [FlushChain(c) for c in chains]
        full = subject_rules(cfg, "s_u_1", audit=True)
        for chain in chains:
            # Flushed first, then exactly the chain's audit-mode rules: never appended twice.
            mine = [op for op in batch.ops if getattr(op, "chain", None) == chain or op == FlushChain(chain)]
            assert mine[0] == FlushChain(chain)
            assert batch_rules(NetlinkBatch(T, tuple(mine[1:])), chain) == batch_rules(full, chain)
        assert not [op for op in batch.ops if getattr(op, "chain", None) == "subj_s_u_1"]


def test_policy_swap_without_audit_objects_never_names_an_audit_set() -> None:
    batch = policy_swap(T, "s_u_1", EXAMPLE, audit_objects=False)
    assert "wdeny" not in batch.describe() and "audit_v" not in batch.describe()
    with pytest.raises(ValueError, match="audit objects"):
        policy_swap(T, "s_u_1", replace(EXAMPLE, audit=True), audit_objects=False)


def test_policy_swap_into_known_empty_sets_only_adds() -> None:
    full = policy_swap(T, "s_u_1", EXAMPLE, audit_objects=True, range_objects=True)
    fill = policy_swap(T, "s_u_1", EXAMPLE, audit_objects=True, known_empty=True)
    assert fill.ops == tuple(op for op in full.ops if not isinstance(op, FlushSet))
    assert fill.ops and not any(isinstance(op, FlushSet) for op in fill.ops)


def test_removal_deletes_the_audit_sets_only_when_they_exist() -> None:
    for audit in (False, True):
        ops = removal_batch(CFG, "s_u_1", None, release_gateway=None, audit=audit, ranges=audit).ops
        deleted = {op.name for op in ops if isinstance(op, DeleteSet)}
        assert deleted == {f"subj_s_u_1_{k}" for k in subject_sets(audit=audit, ranges=audit)}
        assert ("subj_s_u_1_audit_v4" in deleted) is audit


def test_header_marking_drops_forged_sources_from_every_sandbox_interface_first() -> None:
    """docs/reference/behaviour.md §20.2: a packet from a sandbox-facing interface (an attachment's hostVeth, an
    EGRESSD_SANDBOX_IFACES name or prefix) whose source is not routed back through it is dropped
    before anything reads its source (tests/kernel/test_spoofing.py sends them)."""
    cfg = TableConfig(table=T, sandbox_ifaces=("br0", "veth*"))
    marking = rules_of(header_script(cfg, delete_existing=False), "marking")
    drop = 'fib saddr . iif oif missing counter name "unattributed_dropped" drop'
    assert marking[:3] == [
        f"iifname @sandbox_ifaces {drop}",
        f'iifname "br0" {drop}',
        f'iifname "veth*" {drop}',
    ]
    assert marking[3] == "meta mark set meta mark & 0xfffffffd"
