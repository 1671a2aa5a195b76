"""docs/reference/behaviour.md §15 in the rulesets: every refusal egressd's rules make goes through one counting
chain, EGRESSD_DENY_REJECT changes only how the refusal looks, and the per-subject counter
lives and dies with the subject. Netlink encodings of the new shapes are checked against
pyroute2, like the rest of the encoder."""

from __future__ import annotations

import re
import struct
from dataclasses import replace
from ipaddress import ip_address, ip_network
from typing import Any

import pytest
from pyroute2.netlink.nfnetlink.nftsocket import (
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSETELEM,
    nft_rule_msg,
    nft_set_elem_list_msg,
)

from egressd.fleetnft.header import header_script
from egressd.fleetnft.subject import (
    dispatch_deletes,
    removal_batch,
    subject_create,
    subject_keys,
    subject_objects,
    subject_rules,
)
from egressd.fleetnft.table import DENIED_CHAIN, DENY_VERDICT_CHAIN, SubjectNft, TableConfig
from egressd.kernel import netlink_batch, netlink_proto, netlink_rules
from egressd.kernel.ops import (
    AddCounter,
    AddCounterRef,
    AddRule,
    DeleteCounter,
    DeleteElement,
    MatchRule,
    RuleAction,
    VerdictRule,
)
from egressd.policy import DENY_ALL, parse_policy
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecarnft.ruleset import SidecarTable, ruleset
from tests.unit.fakekernel import FakeTx

T = "T"
SUBJ = SubjectNft("s_u_1", ip_address("10.0.0.5"), ip_address("10.0.0.1"))
SUBJ6 = SubjectNft("s_u_6", ip_address("fd00::5"), ip_address("fd00::1"))
CONFIGS = [
    TableConfig(table=T),
    TableConfig(table=T, mitm=True),
    TableConfig(table=T, mitm=True, block_doh_443=True),
    TableConfig(
        table=T, block_doh_443=True, doh_blocklist=(ip_network("1.1.1.1/32"), ip_network("2001:db8::/32"))
    ),
    TableConfig(table=T, mitm=True, block_doh_443=True, doh_blocklist=(ip_network("1.1.1.1/32"),)),
]


def rules(script: str) -> list[tuple[str, str]]:
    out = []
    for line in script.splitlines():
        m = re.match(rf"^add rule inet {T} (\S+) (.*)$", line)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


@pytest.mark.parametrize("reject", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_every_header_refusal_goes_through_the_counting_chain(cfg: TableConfig, reject: bool) -> None:
    cfg = replace(cfg, deny_reject=reject)
    script = header_script(cfg, delete_existing=False)
    for chain, body in rules(script):
        if chain == DENY_VERDICT_CHAIN:
            continue
        if chain == "nat" and body.endswith(" drop") and ("@mitm_src_v" in body or "@mitm_ports_v" in body):
            # The worker-port miss of the MITM redirect (EGRESSD_MITM_WORKERS): a state no
            # transaction leaves (the port element comes and goes with mitm_src), dropped
            # where it is met, in the nat hook, whose chains cannot reach the reject rules.
            continue
        if chain == "marking" and body.endswith('fib saddr . iif oif missing counter name "unattributed_dropped" drop'):
            # A forged source (docs/reference/behaviour.md §20.2) is never answered: a reset or an ICMP
            # error would go to the address it claims. Counted as unattributed: that address
            # names nobody it can be trusted to.
            continue
        assert not body.endswith("drop") and "reject" not in body, (chain, body)
    refusals = [body for chain, body in rules(script) if body.endswith(f"goto {DENIED_CHAIN}")]
    # 853 x2, lateral x4, the unmarked tail, sandbox_in's tail at least.
    assert len(refusals) >= 8
    assert [b for c, b in rules(script) if c == DENIED_CHAIN] == [
        "counter name ip saddr map @drop_counter_v4 goto deny_verdict",
        "counter name ip6 saddr map @drop_counter_v6 goto deny_verdict",
        'counter name "unattributed_dropped" goto deny_verdict',
    ]
    verdict = [b for c, b in rules(script) if c == DENY_VERDICT_CHAIN]
    if reject:
        assert verdict == [
            "ct status dnat reject with icmpx admin-prohibited",
            "meta l4proto tcp reject with tcp reset",
            "reject with icmpx admin-prohibited",
            "drop",
        ]
    else:
        assert verdict == ["drop"]
    text = script.splitlines()
    # Declared before the first rule that jumps there.
    first_goto = min(i for i, ln in enumerate(text) if ln.endswith(f"goto {DENIED_CHAIN}"))
    assert text.index(f"add chain inet {T} {DENIED_CHAIN}") < first_goto
    assert f"add map inet {T} drop_counter_v4 {{ type ipv4_addr : counter; }}" in text
    assert f"add map inet {T} drop_counter_v6 {{ type ipv6_addr : counter; }}" in text
    assert f"add counter inet {T} unattributed_dropped" in text


def test_the_reject_knob_changes_nothing_but_the_verdict_chain() -> None:
    for cfg in CONFIGS:
        plain = header_script(cfg, delete_existing=False).splitlines()
        reject = header_script(replace(cfg, deny_reject=True), delete_existing=False).splitlines()
        extra = [ln for ln in reject if ln not in plain]
        assert extra == [
            f"add rule inet {T} deny_verdict ct status dnat reject with icmpx admin-prohibited",
            f"add rule inet {T} deny_verdict meta l4proto tcp reject with tcp reset",
            f"add rule inet {T} deny_verdict reject with icmpx admin-prohibited",
        ]
        assert [ln for ln in plain if ln not in reject] == []
        # A subject's rules never depend on the knob.
        assert subject_rules(cfg, "s_u_1") == subject_rules(
            TableConfig(table=T, mitm=cfg.mitm, deny_reject=True), "s_u_1"
        )


@pytest.mark.parametrize("mitm", [False, True])
def test_every_subject_refusal_goes_through_the_counting_chain(mitm: bool) -> None:
    batch = subject_rules(TableConfig(table=T, mitm=mitm), "s_u_1", audit=True)
    drops = [
        op.rule
        for op in batch.ops
        if isinstance(op, AddRule) and getattr(op.rule, "outcome", None) is RuleAction.DROP
    ]
    assert drops and all(r.drop_chain == DENIED_CHAIN for r in drops)  # type: ignore[union-attr]
    assert all(r.render().endswith("goto denied") for r in drops)
    assert len(drops) == (4 + 9 if mitm else 4)  # address-only and port-scoped denies (§18)


def test_the_subject_counter_lives_and_dies_with_the_subject() -> None:
    cfg = TableConfig(table=T, mitm=True)
    assert AddCounter("subj_s_u_1_dropped") in subject_objects(cfg, "s_u_1").ops
    keys = subject_keys(cfg, SUBJ).ops
    # The counter is in the map before the dispatch key can send a packet to a refusal.
    assert keys[0] == AddCounterRef("drop_counter_v4", SUBJ.ip, "subj_s_u_1_dropped")
    ops = subject_create(cfg, SUBJ).ops
    assert ops.index(AddCounter("subj_s_u_1_dropped")) < ops.index(keys[0])
    assert subject_keys(cfg, SUBJ6).ops[0] == AddCounterRef("drop_counter_v6", SUBJ6.ip, "subj_s_u_6_dropped")
    # Every way a key goes (re-key, rebind, removal) takes the map element with it.
    assert DeleteElement("drop_counter_v4", SUBJ.ip) in dispatch_deletes(cfg, SUBJ.ip, release_gateway=None)
    removal = removal_batch(cfg, "s_u_1", SUBJ.ip, release_gateway=None, audit=True, ranges=False).ops
    assert removal.index(DeleteElement("drop_counter_v4", SUBJ.ip)) < removal.index(
        DeleteCounter("subj_s_u_1_dropped")
    )
    assert removal[-1] == DeleteCounter("subj_s_u_1_dropped")


def test_counter_ref_and_goto_render() -> None:
    assert MatchRule("v4", "s", RuleAction.DROP, drop_chain="denied").render() == "ip daddr @s goto denied"
    assert VerdictRule(RuleAction.DROP, drop_chain="denied").render() == "goto denied"
    assert VerdictRule(RuleAction.DROP).render() == "drop"
    batch = subject_keys(TableConfig(table=T), SUBJ)
    assert (
        batch.describe().splitlines()[0]
        == 'add element inet T drop_counter_v4 { 10.0.0.5 : "subj_s_u_1_dropped" }'
    )


# ---------------------------------------------------------------- netlink, pyroute2 as oracle


def _strip_nested(buf: bytes, start: int) -> bytes:
    out = bytearray(buf)

    def walk(off: int, end: int) -> None:
        while off + 4 <= end:
            length, kind = struct.unpack_from("=HH", out, off)
            if length < 4:
                return
            if kind & netlink_proto.NLA_F_NESTED:
                struct.pack_into("=HH", out, off, length, kind & ~netlink_proto.NLA_F_NESTED)
                walk(off + 4, off + length)
            off += (length + 3) & ~3

    walk(start, len(out))
    return bytes(out)


def _ours(op: Any) -> bytes:
    [(msg_type, extra, body)] = netlink_batch.encode_op(T, op)
    raw = netlink_proto._nlmsg(
        (10 << 8) | msg_type, netlink_proto.NLM_F_REQUEST | netlink_proto.NLM_F_ACK | extra, 7, 1, 0, body
    )
    return _strip_nested(raw, 20)


def _oracle(cls: Any, msg_type: int, attrs: list[tuple[str, Any]], flags: int) -> bytes:
    m = cls()
    m["attrs"] = attrs
    m["header"]["type"] = (10 << 8) | msg_type
    m["header"]["flags"] = flags
    m["header"]["sequence_number"] = 7
    m["header"]["pid"] = 0
    m["nfgen_family"] = 1
    m.encode()
    return bytes(m.data)


def test_counter_map_element_matches_pyroute2() -> None:
    key = {"attrs": [("NFTA_DATA_VALUE", ip_address("10.0.0.5").packed)]}
    elem = {"attrs": [("NFTA_SET_ELEM_KEY", key), ("NFTA_SET_ELEM_OBJREF", "subj_s_u_1_dropped")]}
    attrs = [
        ("NFTA_SET_ELEM_LIST_TABLE", T),
        ("NFTA_SET_ELEM_LIST_SET", "drop_counter_v4"),
        ("NFTA_SET_ELEM_LIST_ELEMENTS", [elem]),
    ]
    expected = _oracle(nft_set_elem_list_msg, NFT_MSG_NEWSETELEM, attrs, 0x1 | 0x4 | 0x400)
    assert _ours(AddCounterRef("drop_counter_v4", ip_address("10.0.0.5"), "subj_s_u_1_dropped")) == expected


def test_goto_verdict_matches_pyroute2() -> None:
    verdict = {
        "attrs": [
            ("NFTA_DATA_VERDICT", {"attrs": [("NFTA_VERDICT_CODE", -4), ("NFTA_VERDICT_CHAIN", "denied")]})
        ]
    }
    expr = {
        "attrs": [
            ("NFTA_EXPR_NAME", "immediate"),
            ("NFTA_EXPR_DATA", {"attrs": [("NFTA_IMMEDIATE_DREG", 0), ("NFTA_IMMEDIATE_DATA", verdict)]}),
        ]
    }
    attrs = [("NFTA_RULE_TABLE", T), ("NFTA_RULE_CHAIN", "subj_s_u_1_in"), ("NFTA_RULE_EXPRESSIONS", [expr])]
    expected = _oracle(nft_rule_msg, NFT_MSG_NEWRULE, attrs, 0x1 | 0x4 | 0x400 | 0x800)
    assert _ours(AddRule("subj_s_u_1_in", VerdictRule(RuleAction.DROP, drop_chain="denied"))) == expected
    # A match rule ends in the same verdict expression.
    raw = netlink_rules.rule_expressions(MatchRule("v4", "s", RuleAction.DROP, drop_chain="denied"))
    assert raw.endswith(netlink_rules.rule_expressions(VerdictRule(RuleAction.DROP, drop_chain="denied")))


# ---------------------------------------------------------------- sidecar


@pytest.mark.parametrize("reject", [False, True])
@pytest.mark.parametrize("mitm", [None, 18081])
def test_sidecar_refusals_are_counted_and_the_count_is_carried(reject: bool, mitm: int | None) -> None:
    cfg = SidecarTable(table="T", mitm_port=mitm, deny_reject=reject, block_doh_443=True)
    script = ruleset(cfg, DENY_ALL, dropped=41)
    for chain, body in rules(script):
        if chain == "denied":
            continue
        if chain == "marking" and body.endswith('fib saddr . iif oif missing counter name "unattributed_dropped" drop'):
            # A forged source (docs/reference/behaviour.md §20.2) is never answered: a reset or an ICMP
            # error would go to the address it claims. Counted as unattributed: that address
            # names nobody it can be trusted to.
            continue
        assert not body.endswith("drop") and "reject" not in body, (chain, body)
    assert "add counter inet T dropped { packets 41 bytes 0 }" in script.splitlines()
    denied = [b for c, b in rules(script) if c == "denied"]
    if reject:
        assert denied == [
            'counter name "dropped"',
            "meta l4proto tcp reject with tcp reset",
            "reject with icmpx admin-prohibited",
            "drop",
        ]
    else:
        assert denied == ['counter name "dropped"', "drop"]
    if mitm:
        assert ("mitm_input", "tcp dport 18081 goto denied") in rules(script)
    assert ("egress", "goto denied") in rules(script)
    assert "packets 0 bytes 0" in ruleset(cfg, DENY_ALL, dropped=-3)


def test_sidecar_dns_mode_without_the_mitm_refuses_only_dns_the_redirect_missed() -> None:
    script = ruleset(SidecarTable(table="T", mode="dns"), DENY_ALL, dropped=5)
    refusing = [(chain, body) for chain, body in rules(script) if "goto denied" in body]
    assert refusing == [
        ("guard", "ip saddr != 0.0.0.0 meta skuid >= 0 fib saddr type != local goto denied"),
        ("guard", "ip6 saddr != :: meta skuid >= 0 fib saddr type != local goto denied"),
        ("guard", "meta l4proto { tcp, udp } th dport 53 ct state invalid,untracked goto denied"),
        ("guard", "meta l4proto { tcp, udp } th dport 53 ct status & dnat == 0 goto denied"),
        (
            "guard",
            "meta l4proto { tcp, udp } ct direction original ct original proto-dst 53 th dport != 15353 goto denied",
        ),
    ]
    assert "add counter inet T dropped { packets 5 bytes 0 }" in script
    assert "egress" not in {chain for chain, _ in rules(script)}


async def test_the_sidecar_engine_carries_the_count_over_every_rebuild() -> None:
    kernel = FakeTx(yield_each_call=False)
    counts = iter([5, 12])

    async def carried() -> int:
        return next(counts)

    engine = SidecarEngine(SidecarTable(table="T"), kernel, DENY_ALL, carry_dropped=carried)
    await engine.install()
    assert (await engine.set_policy(parse_policy('{"defaultAction":"allow"}'))).status == 200
    scripts = [text for _, text in kernel.scripts]
    assert "add counter inet T dropped { packets 5 bytes 0 }" in scripts[0]
    assert "add counter inet T dropped { packets 12 bytes 0 }" in scripts[1]


async def test_sidecar_drops_metric_and_carry_over() -> None:
    from egressd.metrics import EgressMetrics
    from egressd.sidecar.visibility import SidecarDrops

    metrics = EgressMetrics()
    state: dict[str, int] | None = {"dropped": 7, "other": 1}

    async def read() -> dict[str, int]:
        if state is None:
            raise OSError("no table")
        return dict(state)

    drops = SidecarDrops(metrics, read)
    assert await drops.carried() == 7
    await drops.refresh()
    assert 'egressd_subject_dropped_packets_total{subject="s-sidecar"} 7' in metrics.render()
    state = None
    assert await drops.carried() == 0  # no table yet: a new table starts from 0
    await drops.refresh()  # unreadable: the last value stays
    assert 'egressd_subject_dropped_packets_total{subject="s-sidecar"} 7' in metrics.render()
