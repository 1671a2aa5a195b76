"""§8 fleet nft blueprint: the builder's scripts compared as text.

The builder deliberately deviates from the reference blueprint (module docstring): dispatch
goes through verdict maps, the DNS redirect through per-family gateway sets, elements are
added by re-declaring sets/maps with inline ``elements`` and deletions are netlink batches.
"""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from egressd.config import parse_doh_blocklist
from egressd.fleetnft.builder import (
    DeleteBatch,
    NetlinkDelete,
    ObjKind,
    SubjectNft,
    TableConfig,
    deny_first_script,
    dispatch_deletes,
    dispatch_entries,
    dyn_add_script,
    header_script,
    policy_script,
    removal_batch,
)
from egressd.policy import parse_policy

T = "T"
CFG = TableConfig(table=T, dns_port=15353)
MITM = TableConfig(table=T, dns_port=15353, mitm=True, mitm_port=18081)
SUBJ = SubjectNft("s_u_1", ip_address("10.0.0.5"), ip_address("10.0.0.1"))
SUBJ6 = SubjectNft("s_u_6", ip_address("fd00::5"), ip_address("fd00::1"))

SETS6 = [f"subj_s_u_1_{k}_{f}" for k in ("allow", "deny", "dyn") for f in ("v4", "v6")]

# BEHAVIOUR §8.3's example (example.com is a domain: DNS only, no set element).
EXAMPLE = parse_policy(
    '{"defaultAction":"deny","egress":['
    '{"action":"allow","target":"example.com"},'
    '{"action":"allow","target":"8.8.8.8"},'
    '{"action":"deny","target":"1.2.3.4"}]}'
)
ALLOW_ALL = parse_policy('{"defaultAction":"allow"}')


def lines(script: str) -> list[str]:
    assert script.endswith("\n")
    out = script.splitlines()
    assert all(ln == ln.strip() and ln for ln in out), "no blank or padded lines"
    return out


def rules_of(script: str, chain: str) -> list[str]:
    prefix = f"add rule inet {T} {chain} "
    return [ln[len(prefix) :] for ln in lines(script) if ln.startswith(prefix)]


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
    # Without MITM there is no input chain and no MITM maps.
    assert not any(" input " in ln or "mitm" in ln for ln in text)
    assert not any("doh_block" in ln or "dport 443" in ln for ln in text)


def test_header_dispatch_rules_in_order_with_unmarked_drop_last() -> None:
    dispatch = rules_of(header_script(CFG, delete_existing=False), "dispatch")
    assert dispatch == [
        "ct state established,related accept",
        "tcp dport 853 drop",
        "udp dport 853 drop",
        "ip saddr vmap @dispatch_v4",
        "ip6 saddr vmap @dispatch_v6",
        "meta mark & 0x2 != 0x2 drop",
    ]


def test_header_marking_clears_the_allow_bit_first() -> None:
    marking = rules_of(header_script(CFG, delete_existing=False), "marking")
    assert marking == [
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
    assert rules_of(script, "input") == [
        "ct state established,related accept",
        "tcp dport 18081 ct status dnat ip saddr vmap @mitm_in_v4",
        "tcp dport 18081 ct status dnat ip6 saddr vmap @mitm_in_v6",
        "tcp dport 18081 drop",
    ]
    nat = rules_of(script, "nat")
    assert "ip daddr @dns_gw_v4 tcp dport { 80, 443 } return" in nat
    assert "ip saddr @mitm_src_v4 tcp dport { 80, 443 } redirect to :18081" in nat
    assert "ip6 daddr @dns_gw_v6 tcp dport { 80, 443 } return" in nat
    assert "ip6 saddr @mitm_src_v6 tcp dport { 80, 443 } redirect to :18081" in nat
    # The gateway exemption precedes the interception of the same family.
    assert nat.index("ip daddr @dns_gw_v4 tcp dport { 80, 443 } return") < nat.index(
        "ip saddr @mitm_src_v4 tcp dport { 80, 443 } redirect to :18081"
    )
    assert rules_of(script, "dispatch")[-1] == "meta mark & 0x2 != 0x2 drop"


@pytest.mark.parametrize("mitm", [False, True])
def test_header_doh_without_blocklist_drops_all_443(mitm: bool) -> None:
    cfg = TableConfig(table=T, mitm=mitm, block_doh_443=True)
    script = header_script(cfg, delete_existing=False)
    dispatch = rules_of(script, "dispatch")
    assert "tcp dport 443 drop" in dispatch
    assert dispatch.index("tcp dport 443 drop") < dispatch.index("ip saddr vmap @dispatch_v4")
    assert dispatch[-1] == "meta mark & 0x2 != 0x2 drop"
    assert "doh_block" not in script
    input_rules = rules_of(script, "input")
    if mitm:
        assert "ct status dnat ct original proto-dst 443 drop" in input_rules
        assert input_rules.index("ct status dnat ct original proto-dst 443 drop") < input_rules.index(
            "tcp dport 18081 ct status dnat ip saddr vmap @mitm_in_v4"
        )
    else:
        assert input_rules == []


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
    assert "ip daddr @doh_block_v4 tcp dport 443 drop" in dispatch
    assert "ip6 daddr @doh_block_v6 tcp dport 443 drop" in dispatch
    assert "tcp dport 443 drop" not in dispatch  # not global with a blocklist
    assert dispatch[-1] == "meta mark & 0x2 != 0x2 drop"
    assert dispatch.index("ip6 daddr @doh_block_v6 tcp dport 443 drop") < dispatch.index(
        "ip saddr vmap @dispatch_v4"
    )
    input_rules = rules_of(script, "input")
    v4_in = "ct status dnat ct original ip daddr @doh_block_v4 ct original proto-dst 443 drop"
    v6_in = "ct status dnat ct original ip6 daddr @doh_block_v6 ct original proto-dst 443 drop"
    if mitm:
        assert v4_in in input_rules
        assert v6_in in input_rules
    else:
        assert input_rules == []


def test_header_doh_blocklist_v6_only_has_no_v4_rule() -> None:
    cfg = TableConfig(table=T, block_doh_443=True, doh_blocklist=(ip_network("2001:db8::1/128"),))
    script = header_script(cfg, delete_existing=False)
    assert "elements = { 2001:db8::1 }" in script  # hosts printed bare
    dispatch = rules_of(script, "dispatch")
    assert "ip6 daddr @doh_block_v6 tcp dport 443 drop" in dispatch
    assert not any("doh_block_v4" in r for r in dispatch)


def test_header_blocklist_ignored_when_blocking_is_off() -> None:
    cfg = TableConfig(table=T, block_doh_443=False, doh_blocklist=(ip_network("1.1.1.1/32"),))
    script = header_script(cfg, delete_existing=False)
    assert "doh_block" not in script
    assert "443 drop" not in script


def test_header_doh_blocklist_is_normalised() -> None:
    nets = parse_doh_blocklist("1.1.1.0/24, 1.1.1.1, 8.8.8.8, 8.8.8.8, 2001:db8::/32, 2001:db8::1")
    script = header_script(
        TableConfig(table=T, block_doh_443=True, doh_blocklist=nets), delete_existing=False
    )
    assert "doh_block_v4 { type ipv4_addr; flags interval; elements = { 1.1.1.0/24, 8.8.8.8 } }" in script
    assert "doh_block_v6 { type ipv6_addr; flags interval; elements = { 2001:db8::/32 } }" in script


# --------------------------------------------------------------------------- §8.2 deny-first


def test_deny_first_declares_the_six_sets_and_the_chains() -> None:
    text = lines(deny_first_script(CFG, SUBJ))
    for kind in ("allow", "deny"):
        assert f"add set inet {T} subj_s_u_1_{kind}_v4 {{ type ipv4_addr; flags interval; }}" in text
        assert f"add set inet {T} subj_s_u_1_{kind}_v6 {{ type ipv6_addr; flags interval; }}" in text
    assert f"add set inet {T} subj_s_u_1_dyn_v4 {{ type ipv4_addr; flags timeout; timeout 360s; }}" in text
    assert f"add set inet {T} subj_s_u_1_dyn_v6 {{ type ipv6_addr; flags timeout; timeout 360s; }}" in text
    assert f"add chain inet {T} subj_s_u_1" in text
    assert f"add chain inet {T} mark_s_u_1" in text
    assert f"add chain inet {T} subj_s_u_1_in" not in text
    declared = [ln for ln in text if ln.startswith(f"add set inet {T} subj_")]
    assert len(declared) == 6


def test_deny_first_flushes_chains_and_all_six_sets_before_content() -> None:
    text = lines(deny_first_script(CFG, SUBJ))
    flushes = [ln for ln in text if ln.startswith("flush ")]
    assert flushes == [
        f"flush chain inet {T} subj_s_u_1",
        f"flush chain inet {T} mark_s_u_1",
        *(f"flush set inet {T} {s}" for s in ("subj_s_u_1_allow_v4", "subj_s_u_1_allow_v6")),
        *(f"flush set inet {T} {s}" for s in ("subj_s_u_1_deny_v4", "subj_s_u_1_deny_v6")),
        *(f"flush set inet {T} {s}" for s in ("subj_s_u_1_dyn_v4", "subj_s_u_1_dyn_v6")),
    ]
    for name in SETS6:
        assert f"flush set inet {T} {name}" in text
    last_decl = max(
        i for i, ln in enumerate(text) if ln.startswith(("add set", "add chain")) and "subj" in ln
    )
    first_flush = min(i for i, ln in enumerate(text) if ln.startswith("flush"))
    last_flush = max(i for i, ln in enumerate(text) if ln.startswith("flush"))
    first_rule = min(i for i, ln in enumerate(text) if ln.startswith("add rule"))
    assert last_decl < first_flush
    assert last_flush < first_rule


def test_deny_first_subject_chain_ends_with_drop_and_mark_chain_stays_empty() -> None:
    script = deny_first_script(CFG, SUBJ)
    assert rules_of(script, "subj_s_u_1") == [
        "ip daddr @subj_s_u_1_deny_v4 drop",
        "ip6 daddr @subj_s_u_1_deny_v6 drop",
        "drop",
    ]
    assert rules_of(script, "mark_s_u_1") == []


def test_deny_first_dispatch_entries_come_last_and_redeclare_the_maps() -> None:
    text = lines(deny_first_script(CFG, SUBJ))
    tail = [
        f"add map inet {T} dispatch_v4 {{ type ipv4_addr : verdict; elements = {{ 10.0.0.5 : jump subj_s_u_1 }} }}",
        f"add map inet {T} marking_v4 {{ type ipv4_addr : verdict; elements = {{ 10.0.0.5 : jump mark_s_u_1 }} }}",
        f"add set inet {T} dns_gw_v4 {{ type ipv4_addr; elements = {{ 10.0.0.1 }} }}",
    ]
    assert text[-3:] == tail
    assert not any(ln.startswith("delete") for ln in text)
    assert dispatch_entries(CFG, SUBJ) == "\n".join(tail) + "\n"


def test_deny_first_v6_subject() -> None:
    script = deny_first_script(CFG, SUBJ6)
    text = lines(script)
    assert (
        f"add map inet {T} dispatch_v6 {{ type ipv6_addr : verdict; elements = {{ fd00::5 : jump subj_s_u_6 }} }}"
        in text
    )
    assert f"add set inet {T} dns_gw_v6 {{ type ipv6_addr; elements = {{ fd00::1 }} }}" in text
    assert "dispatch_v4" not in script


def test_deny_first_mixed_family_gateway_without_mitm_is_fine() -> None:
    subj = SubjectNft("s_x", ip_address("10.0.0.5"), ip_address("fd00::1"))
    script = deny_first_script(CFG, subj)
    assert f"add set inet {T} dns_gw_v6 {{ type ipv6_addr; elements = {{ fd00::1 }} }}" in lines(script)


def test_deny_first_mitm() -> None:
    script = deny_first_script(MITM, SUBJ)
    text = lines(script)
    assert f"add chain inet {T} subj_s_u_1_in" in text
    assert f"flush chain inet {T} subj_s_u_1_in" in text
    assert rules_of(script, "subj_s_u_1_in") == [
        "ct original ip daddr @subj_s_u_1_deny_v4 drop",
        "ct original ip6 daddr @subj_s_u_1_deny_v6 drop",
        "ct original ip daddr @subj_s_u_1_dyn_v4 accept",
        "ct original ip6 daddr @subj_s_u_1_dyn_v6 accept",
        "ct original ip daddr @subj_s_u_1_allow_v4 accept",
        "ct original ip6 daddr @subj_s_u_1_allow_v6 accept",
        "drop",
    ]
    assert (
        f"add map inet {T} mitm_in_v4 {{ type ipv4_addr : verdict; elements = {{ 10.0.0.5 : jump subj_s_u_1_in }} }}"
        in text
    )
    assert f"add set inet {T} mitm_src_v4 {{ type ipv4_addr; elements = {{ 10.0.0.5 }} }}" in text
    assert rules_of(script, "subj_s_u_1")[-1] == "drop"


def test_deny_first_mitm_mismatched_gateway_family_raises() -> None:
    subj = SubjectNft("s_x", ip_address("10.0.0.5"), ip_address("fd00::1"))
    with pytest.raises(ValueError):
        deny_first_script(MITM, subj)


def test_deny_first_is_deterministic() -> None:
    assert deny_first_script(MITM, SUBJ) == deny_first_script(MITM, SUBJ)


# --------------------------------------------------------------------------- §8.3 policy swap


def test_policy_script_for_the_spec_example() -> None:
    script = policy_script(CFG, "s_u_1", EXAMPLE)
    text = lines(script)
    assert text[:6] == [
        f"flush chain inet {T} subj_s_u_1",
        f"flush chain inet {T} mark_s_u_1",
        f"flush set inet {T} subj_s_u_1_allow_v4",
        f"flush set inet {T} subj_s_u_1_allow_v6",
        f"flush set inet {T} subj_s_u_1_deny_v4",
        f"flush set inet {T} subj_s_u_1_deny_v6",
    ]
    assert (
        f"add set inet {T} subj_s_u_1_allow_v4 {{ type ipv4_addr; flags interval; elements = {{ 8.8.8.8 }} }}"
        in text
    )
    assert (
        f"add set inet {T} subj_s_u_1_deny_v4 {{ type ipv4_addr; flags interval; elements = {{ 1.2.3.4 }} }}"
        in text
    )
    assert rules_of(script, "subj_s_u_1") == [
        "ip daddr @subj_s_u_1_deny_v4 drop",
        "ip6 daddr @subj_s_u_1_deny_v6 drop",
    ]
    assert rules_of(script, "mark_s_u_1") == [
        "ip daddr @subj_s_u_1_allow_v4 meta mark set 0x2",
        "ip6 daddr @subj_s_u_1_allow_v6 meta mark set 0x2",
        "ip daddr @subj_s_u_1_dyn_v4 meta mark set 0x2",
        "ip6 daddr @subj_s_u_1_dyn_v6 meta mark set 0x2",
    ]
    assert "example.com" not in script
    assert "subj_s_u_1_in" not in script


def test_policy_script_never_touches_dyn_sets_jumps_or_header() -> None:
    script = policy_script(MITM, "s_u_1", EXAMPLE)
    assert "flush set inet T subj_s_u_1_dyn" not in script
    assert not any(ln.startswith(f"add set inet {T} subj_s_u_1_dyn") for ln in lines(script))
    assert not any(
        name in script for name in ("dispatch_v4", "marking_v4", "dns_gw", "mitm_src", "mitm_in", "add table")
    )
    assert not any(ln.startswith("delete") for ln in lines(script))
    assert "drop" not in rules_of(script, "subj_s_u_1")  # no deny-first tail once active


def test_policy_script_empty_sets_get_no_elements() -> None:
    script = policy_script(CFG, "s_u_1", EXAMPLE)
    assert "elements" not in "\n".join(ln for ln in lines(script) if "allow_v6" in ln or "deny_v6" in ln)
    assert not any(ln.startswith(f"add set inet {T} subj_s_u_1_allow_v6") for ln in lines(script))
    assert not any(ln.startswith(f"add set inet {T} subj_s_u_1_deny_v6") for ln in lines(script))
    deny_all = policy_script(CFG, "s_u_1", parse_policy("{}"))
    assert "elements" not in deny_all
    assert not any(ln.startswith("add set") for ln in lines(deny_all))


def test_policy_script_v6_and_cidr_elements() -> None:
    pol = parse_policy(
        '{"egress":[{"action":"allow","target":"2001:db8::/32"},{"action":"allow","target":"2001:db8::1"},'
        '{"action":"allow","target":"10.99.0.9/24"},{"action":"deny","target":"2001:db8::dead"}]}'
    )
    text = lines(policy_script(CFG, "s_u_1", pol))
    assert (
        f"add set inet {T} subj_s_u_1_allow_v6 {{ type ipv6_addr; flags interval; elements = {{ 2001:db8::/32 }} }}"
        in text
    )
    assert (
        f"add set inet {T} subj_s_u_1_allow_v4 {{ type ipv4_addr; flags interval; elements = {{ 10.99.0.0/24 }} }}"
        in text
    )
    assert (
        f"add set inet {T} subj_s_u_1_deny_v6 {{ type ipv6_addr; flags interval; elements = {{ 2001:db8::dead }} }}"
        in text
    )


def test_policy_script_default_allow_marks_everything() -> None:
    script = policy_script(CFG, "s_u_1", ALLOW_ALL)
    assert rules_of(script, "mark_s_u_1") == ["meta mark set 0x2"]
    assert rules_of(script, "subj_s_u_1") == [
        "ip daddr @subj_s_u_1_deny_v4 drop",
        "ip6 daddr @subj_s_u_1_deny_v6 drop",
    ]


def test_policy_script_default_allow_with_mitm_accepts_in_chain() -> None:
    script = policy_script(MITM, "s_u_1", ALLOW_ALL)
    text = lines(script)
    assert f"flush chain inet {T} subj_s_u_1_in" in text
    in_rules = rules_of(script, "subj_s_u_1_in")
    assert in_rules[0] == "ct original ip daddr @subj_s_u_1_deny_v4 drop"
    assert in_rules[-1] == "accept"
    assert len(in_rules) == 7


def test_policy_script_default_deny_with_mitm_drops_in_chain() -> None:
    in_rules = rules_of(policy_script(MITM, "s_u_1", EXAMPLE), "subj_s_u_1_in")
    assert in_rules[-1] == "drop"
    assert "ct original ip daddr @subj_s_u_1_allow_v4 accept" in in_rules


# --------------------------------------------------------------------------- removal / netlink batches


def test_removal_batch_op_order() -> None:
    batch = removal_batch(CFG, "s_u_1", SUBJ.ip, release_gateway=None)
    assert batch.table == T
    ip = SUBJ.ip
    assert batch.ops == (
        NetlinkDelete(ObjKind.ELEMENT, "marking_v4", ip, "ipv4_addr"),
        NetlinkDelete(ObjKind.ELEMENT, "dispatch_v4", ip, "ipv4_addr"),
        NetlinkDelete(ObjKind.CHAIN, "subj_s_u_1"),
        NetlinkDelete(ObjKind.CHAIN, "mark_s_u_1"),
        *(NetlinkDelete(ObjKind.SET, f"subj_s_u_1_{k}") for k in _set_kinds()),
    )
    kinds = [op.kind for op in batch.ops]
    # map elements, then chains, then sets
    assert kinds == sorted(kinds, key=[ObjKind.ELEMENT, ObjKind.CHAIN, ObjKind.SET].index)
    assert not any(op.name.startswith("dns_gw") for op in batch.ops)


def _set_kinds() -> list[str]:
    return ["allow_v4", "allow_v6", "deny_v4", "deny_v6", "dyn_v4", "dyn_v6"]


def test_removal_batch_releases_the_gateway_with_mitm() -> None:
    batch = removal_batch(MITM, "s_u_1", SUBJ.ip, release_gateway=SUBJ.gateway)
    elements = [(op.name, op.key) for op in batch.ops if op.kind is ObjKind.ELEMENT]
    assert elements == [
        ("marking_v4", SUBJ.ip),
        ("dispatch_v4", SUBJ.ip),
        ("mitm_src_v4", SUBJ.ip),
        ("mitm_in_v4", SUBJ.ip),
        ("dns_gw_v4", SUBJ.gateway),
    ]
    chains = [op.name for op in batch.ops if op.kind is ObjKind.CHAIN]
    assert chains == ["subj_s_u_1", "mark_s_u_1", "subj_s_u_1_in"]
    kinds = [op.kind for op in batch.ops]
    assert kinds.index(ObjKind.CHAIN) > max(i for i, k in enumerate(kinds) if k is ObjKind.ELEMENT)
    assert kinds.index(ObjKind.SET) > max(i for i, k in enumerate(kinds) if k is ObjKind.CHAIN)
    assert batch.describe().splitlines()[4] == "delete element inet T dns_gw_v4 { 10.0.0.1 }"


def test_removal_batch_without_ip_drops_only_objects() -> None:
    batch = removal_batch(CFG, "s_u_1", None, release_gateway=None)
    assert all(op.kind is not ObjKind.ELEMENT for op in batch.ops)
    assert len(batch.ops) == 8


def test_removal_batch_describe() -> None:
    text = removal_batch(CFG, "s_u_1", SUBJ.ip, release_gateway=SUBJ.gateway).describe()
    assert text.splitlines() == [
        "delete element inet T marking_v4 { 10.0.0.5 }",
        "delete element inet T dispatch_v4 { 10.0.0.5 }",
        "delete element inet T dns_gw_v4 { 10.0.0.1 }",
        "delete chain inet T subj_s_u_1",
        "delete chain inet T mark_s_u_1",
        *(f"delete set inet T subj_s_u_1_{k}" for k in _set_kinds()),
    ]
    assert DeleteBatch(T).describe() == ""


def test_dispatch_deletes_v6_and_gateway_of_other_family() -> None:
    ops = dispatch_deletes(CFG, ip_address("fd00::5"), release_gateway=ip_address("10.0.0.1"))
    assert ops == [
        NetlinkDelete(ObjKind.ELEMENT, "marking_v6", ip_address("fd00::5"), "ipv6_addr"),
        NetlinkDelete(ObjKind.ELEMENT, "dispatch_v6", ip_address("fd00::5"), "ipv6_addr"),
        NetlinkDelete(ObjKind.ELEMENT, "dns_gw_v4", ip_address("10.0.0.1"), "ipv4_addr"),
    ]


# --------------------------------------------------------------------------- DNS learning


def test_dyn_add_script_sets_timeout_and_expires() -> None:
    script = dyn_add_script(
        CFG,
        "s_u_1",
        [(ip_address("93.184.216.34"), 90), (ip_address("2001:db8::1"), 61), (ip_address("1.1.1.1"), 360)],
    )
    assert lines(script) == [
        f"add set inet {T} subj_s_u_1_dyn_v4 {{ type ipv4_addr; flags timeout; timeout 360s; "
        "elements = { 93.184.216.34 timeout 90s expires 90s, 1.1.1.1 timeout 360s expires 360s } }",
        f"add set inet {T} subj_s_u_1_dyn_v6 {{ type ipv6_addr; flags timeout; timeout 360s; "
        "elements = { 2001:db8::1 timeout 61s expires 61s } }",
    ]


def test_dyn_add_script_single_family() -> None:
    script = dyn_add_script(CFG, "s_u_1", [(ip_address("93.184.216.34"), 90)])
    assert "dyn_v6" not in script
    assert "93.184.216.34 timeout 90s expires 90s" in script
