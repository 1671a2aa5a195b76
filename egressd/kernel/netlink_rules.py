"""The NFTA_RULE_EXPRESSIONS of egressd's rule shapes (match, verdict, audit), encoded as nft 1.0.6
encodes them (the audit shape is checked against the kernel's own listing). Pure."""

from __future__ import annotations

import struct

from egressd.kernel.netlink_ports import guard_expressions, port_key_expressions, range_rule_expressions
from egressd.kernel.netlink_proto import (
    LOG_PREFIX_MAX,
    NF_ACCEPT,
    NF_CT_STATE_NEW,
    NF_DROP,
    NFPROTO_IPV4,
    NFPROTO_IPV6,
    NFT_CMP_EQ,
    NFT_CMP_NEQ,
    NFT_CT_DST_IP,
    NFT_CT_DST_IP6,
    NFT_CT_STATE,
    NFT_GOTO,
    NFT_LOOKUP_F_INV,
    NFT_META_MARK,
    NFT_META_NFPROTO,
    NFT_OBJECT_COUNTER,
    NFT_PAYLOAD_NETWORK_HEADER,
    NFT_REG_1,
    NFT_REG_VERDICT,
    NFTA_BITWISE_DREG,
    NFTA_BITWISE_LEN,
    NFTA_BITWISE_MASK,
    NFTA_BITWISE_SREG,
    NFTA_BITWISE_XOR,
    NFTA_CMP_DATA,
    NFTA_CMP_OP,
    NFTA_CMP_SREG,
    NFTA_CT_DIRECTION,
    NFTA_CT_DREG,
    NFTA_CT_KEY,
    NFTA_DATA_VERDICT,
    NFTA_EXPR_DATA,
    NFTA_EXPR_NAME,
    NFTA_IMMEDIATE_DATA,
    NFTA_IMMEDIATE_DREG,
    NFTA_LIST_ELEM,
    NFTA_LOG_PREFIX,
    NFTA_LOOKUP_FLAGS,
    NFTA_LOOKUP_SET,
    NFTA_LOOKUP_SREG,
    NFTA_META_DREG,
    NFTA_META_KEY,
    NFTA_META_SREG,
    NFTA_OBJREF_IMM_NAME,
    NFTA_OBJREF_IMM_TYPE,
    NFTA_PAYLOAD_BASE,
    NFTA_PAYLOAD_DREG,
    NFTA_PAYLOAD_LEN,
    NFTA_PAYLOAD_OFFSET,
    NFTA_VERDICT_CHAIN,
    NFTA_VERDICT_CODE,
    _attr,
    _data_value,
    _nest,
    _str,
    _u32,
)
from egressd.kernel.ops import ALLOW_MARK, AuditRule, MatchRule, PortRule, RangeRule, Rule, RuleAction

_VERDICT = {RuleAction.DROP: NF_DROP, RuleAction.ACCEPT: NF_ACCEPT}


def _expr(name: str, *attrs: bytes) -> bytes:
    return _nest(NFTA_LIST_ELEM, _str(NFTA_EXPR_NAME, name), _nest(NFTA_EXPR_DATA, *attrs))


def _verdict(outcome: RuleAction, drop_chain: str = "") -> bytes:
    if outcome is RuleAction.DROP and drop_chain:
        # goto the chain that counts and refuses (docs/reference/behaviour.md §15), as nft encodes "goto <chain>".
        verdict = _nest(
            NFTA_DATA_VERDICT,
            _attr(NFTA_VERDICT_CODE, struct.pack(">i", NFT_GOTO)),
            _str(NFTA_VERDICT_CHAIN, drop_chain),
        )
    else:
        verdict = _nest(NFTA_DATA_VERDICT, _attr(NFTA_VERDICT_CODE, struct.pack(">i", _VERDICT[outcome])))
    return _expr("immediate", _u32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT), _nest(NFTA_IMMEDIATE_DATA, verdict))


def _masked_neq(load: bytes, mask: int, value: int) -> list[bytes]:
    """``<load into reg 1> & mask != value`` on a host-endian u32 (ct state, meta mark)."""

    def host(v: int) -> bytes:
        return struct.pack("=I", v)

    return [
        load,
        _expr(
            "bitwise",
            _u32(NFTA_BITWISE_SREG, NFT_REG_1),
            _u32(NFTA_BITWISE_DREG, NFT_REG_1),
            _u32(NFTA_BITWISE_LEN, 4),
            _data_value(NFTA_BITWISE_MASK, host(mask)),
            _data_value(NFTA_BITWISE_XOR, host(0)),
        ),
        _expr(
            "cmp",
            _u32(NFTA_CMP_SREG, NFT_REG_1),
            _u32(NFTA_CMP_OP, NFT_CMP_NEQ),
            _data_value(NFTA_CMP_DATA, host(value)),
        ),
    ]


def _daddr_lookup(fam: str, set_name: str) -> list[bytes]:
    """``ip|ip6 daddr @set`` in an inet table: nfproto check, payload load, set lookup."""
    proto = NFPROTO_IPV4 if fam == "v4" else NFPROTO_IPV6
    offset, length = (16, 4) if fam == "v4" else (24, 16)
    return [
        _expr("meta", _u32(NFTA_META_DREG, NFT_REG_1), _u32(NFTA_META_KEY, NFT_META_NFPROTO)),
        _expr(
            "cmp",
            _u32(NFTA_CMP_SREG, NFT_REG_1),
            _u32(NFTA_CMP_OP, NFT_CMP_EQ),
            _data_value(NFTA_CMP_DATA, bytes([proto])),
        ),
        _expr(
            "payload",
            _u32(NFTA_PAYLOAD_DREG, NFT_REG_1),
            _u32(NFTA_PAYLOAD_BASE, NFT_PAYLOAD_NETWORK_HEADER),
            _u32(NFTA_PAYLOAD_OFFSET, offset),
            _u32(NFTA_PAYLOAD_LEN, length),
        ),
        _expr("lookup", _str(NFTA_LOOKUP_SET, set_name), _u32(NFTA_LOOKUP_SREG, NFT_REG_1)),
    ]


def _address_lookup(fam: str, set_name: str, *, ct_original: bool) -> list[bytes]:
    """``[ct original] ip|ip6 daddr @set``."""
    if not ct_original:
        return _daddr_lookup(fam, set_name)
    lookup = _expr("lookup", _str(NFTA_LOOKUP_SET, set_name), _u32(NFTA_LOOKUP_SREG, NFT_REG_1))
    key = NFT_CT_DST_IP if fam == "v4" else NFT_CT_DST_IP6
    ct = _expr("ct", _u32(NFTA_CT_DREG, NFT_REG_1), _u32(NFTA_CT_KEY, key), _attr(NFTA_CT_DIRECTION, b"\0"))
    return [ct, lookup]


def _set_mark() -> list[bytes]:
    # meta mark is a host-endian u32 register value.
    return [
        _expr(
            "immediate",
            _u32(NFTA_IMMEDIATE_DREG, NFT_REG_1),
            _data_value(NFTA_IMMEDIATE_DATA, struct.pack("=I", ALLOW_MARK)),
        ),
        _expr("meta", _u32(NFTA_META_KEY, NFT_META_MARK), _u32(NFTA_META_SREG, NFT_REG_1)),
    ]


def _audit_expressions(rule: AuditRule) -> bytes:
    if len(rule.log_prefix.encode()) > LOG_PREFIX_MAX:
        raise ValueError(f"log prefix longer than {LOG_PREFIX_MAX} bytes")
    if rule.ports:
        # nft loads the address again after a concatenation's lookup (as the kernel lists it).
        parts = port_key_expressions(PortRule(rule.fam, rule.set_name, RuleAction.MARK))
        parts.append(_daddr_lookup(rule.fam, rule.set_name)[2])
    else:
        # The address is still in register 1: a lookup only reads it.
        parts = _daddr_lookup(rule.fam, rule.set_name)
    parts.append(
        _expr(
            "lookup",
            _str(NFTA_LOOKUP_SET, rule.hard),
            _u32(NFTA_LOOKUP_SREG, NFT_REG_1),
            _u32(NFTA_LOOKUP_FLAGS, NFT_LOOKUP_F_INV),
        )
    )
    ct_state = _expr("ct", _u32(NFTA_CT_DREG, NFT_REG_1), _u32(NFTA_CT_KEY, NFT_CT_STATE))
    parts += _masked_neq(ct_state, NF_CT_STATE_NEW, 0)
    if rule.unmarked_only:
        mark = _expr("meta", _u32(NFTA_META_DREG, NFT_REG_1), _u32(NFTA_META_KEY, NFT_META_MARK))
        parts += _masked_neq(mark, ALLOW_MARK, ALLOW_MARK)
    parts.append(_expr("log", _str(NFTA_LOG_PREFIX, rule.log_prefix)))
    parts.append(
        _expr(
            "objref",
            _u32(NFTA_OBJREF_IMM_TYPE, NFT_OBJECT_COUNTER),
            _str(NFTA_OBJREF_IMM_NAME, rule.counter),
        )
    )
    return b"".join(parts + _set_mark())


def rule_expressions(rule: Rule) -> bytes:
    """The NFTA_RULE_EXPRESSIONS list: exactly what nft 1.0.6 generates for the match and
    verdict shapes; the audit shape is checked against the kernel's own listing instead."""
    if isinstance(rule, AuditRule):
        return _audit_expressions(rule)
    if isinstance(rule, PortRule):
        parts = port_key_expressions(rule)
        parts += _set_mark() if rule.outcome is RuleAction.MARK else [_verdict(rule.outcome, rule.drop_chain)]
        return b"".join(parts)
    if isinstance(rule, RangeRule):
        parts = range_rule_expressions(rule, _address_lookup(rule.fam, rule.set_name, ct_original=rule.ct_original))
        parts += _set_mark() if rule.outcome is RuleAction.MARK else [_verdict(rule.outcome, rule.drop_chain)]
        return b"".join(parts)
    if not isinstance(rule, MatchRule):
        return _verdict(rule.outcome, rule.drop_chain)
    parts = _address_lookup(rule.fam, rule.set_name, ct_original=rule.ct_original)
    parts += guard_expressions(rule.guard)
    parts += _set_mark() if rule.outcome is RuleAction.MARK else [_verdict(rule.outcome, rule.drop_chain)]
    return b"".join(parts)
