"""One nf_tables operation as its netlink messages, a whole batch in one BEGIN/END frame, and the
dump requests (counters, one set's elements). Pure."""

from __future__ import annotations

import itertools

from egressd.kernel import netlink_ports as ports
from egressd.kernel.netlink_elements import _element_op_messages, encode_iface_op, encode_uid_op
from egressd.kernel.netlink_proto import (
    NFNL_MSG_BATCH_BEGIN,
    NFNL_MSG_BATCH_END,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO_INET,
    NFT_DATATYPE_IP6ADDR,
    NFT_DATATYPE_IPADDR,
    NFT_MSG_DELCHAIN,
    NFT_MSG_DELOBJ,
    NFT_MSG_DELRULE,
    NFT_MSG_DELSET,
    NFT_MSG_GETOBJ,
    NFT_MSG_GETSETELEM,
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWOBJ,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSET,
    NFT_OBJECT_COUNTER,
    NFT_SET_CONCAT,
    NFT_SET_INTERVAL,
    NFT_SET_TIMEOUT,
    NFTA_CHAIN_NAME,
    NFTA_CHAIN_TABLE,
    NFTA_COUNTER_BYTES,
    NFTA_COUNTER_PACKETS,
    NFTA_OBJ_DATA,
    NFTA_OBJ_NAME,
    NFTA_OBJ_TABLE,
    NFTA_OBJ_TYPE,
    NFTA_RULE_CHAIN,
    NFTA_RULE_EXPRESSIONS,
    NFTA_RULE_TABLE,
    NFTA_SET_DESC,
    NFTA_SET_DESC_SIZE,
    NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE,
    NFTA_SET_FLAGS,
    NFTA_SET_ID,
    NFTA_SET_KEY_LEN,
    NFTA_SET_KEY_TYPE,
    NFTA_SET_NAME,
    NFTA_SET_TABLE,
    NFTA_SET_TIMEOUT,
    NLM_F_ACK,
    NLM_F_APPEND,
    NLM_F_CREATE,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    _nest,
    _nlmsg,
    _str,
    _u32,
    _u64,
)
from egressd.kernel.netlink_rules import rule_expressions
from egressd.kernel.ops import (
    AddChain,
    AddCounter,
    AddIface,
    AddRule,
    AddSet,
    AddUid,
    AddUidCounterRef,
    AddUidJump,
    AddUidPort,
    DeleteChain,
    DeleteCounter,
    DeleteIface,
    DeleteSet,
    DeleteUid,
    ElementOp,
    FlushChain,
    NetlinkBatch,
    Op,
)


def encode_op(table: str, op: Op, set_id: int = 0) -> list[tuple[int, int, bytes]]:
    """(nf_tables message type, extra nlmsg flags, attributes) of each message of one
    operation: one message, except element lists too long for one attribute (a big policy's
    prefixes, a big DNS answer), which become several messages of the same batch."""
    if isinstance(op, AddUidJump | AddUidPort | AddUidCounterRef | AddUid | DeleteUid):
        return encode_uid_op(table, op)
    if isinstance(op, AddIface | DeleteIface):
        return encode_iface_op(table, op)
    if isinstance(op, ElementOp):
        return _element_op_messages(table, op)
    return [_object_op_message(table, op, set_id)]


def _object_op_message(table: str, op: Op, set_id: int) -> tuple[int, int, bytes]:
    """The one message that creates or deletes a set, chain, counter or rule."""
    if isinstance(op, AddSet):
        return NFT_MSG_NEWSET, NLM_F_CREATE, _new_set(table, op, set_id)
    if isinstance(op, AddChain):
        return NFT_MSG_NEWCHAIN, NLM_F_CREATE, _str(NFTA_CHAIN_TABLE, table) + _str(NFTA_CHAIN_NAME, op.name)
    if isinstance(op, AddCounter | DeleteCounter):
        body = (
            _str(NFTA_OBJ_TABLE, table)
            + _str(NFTA_OBJ_NAME, op.name)
            + _u32(NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER)
        )
        if isinstance(op, DeleteCounter):
            return NFT_MSG_DELOBJ, 0, body
        zero = _u64(NFTA_COUNTER_BYTES, 0) + _u64(NFTA_COUNTER_PACKETS, 0)
        return NFT_MSG_NEWOBJ, NLM_F_CREATE, body + _nest(NFTA_OBJ_DATA, zero)
    if isinstance(op, AddRule):
        body = (
            _str(NFTA_RULE_TABLE, table)
            + _str(NFTA_RULE_CHAIN, op.chain)
            + _nest(NFTA_RULE_EXPRESSIONS, rule_expressions(op.rule))
        )
        return NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, body
    if isinstance(op, FlushChain):
        # DELRULE naming only the chain (no handle) deletes all its rules: ``nft flush chain``.
        return NFT_MSG_DELRULE, 0, _str(NFTA_RULE_TABLE, table) + _str(NFTA_RULE_CHAIN, op.name)
    if isinstance(op, DeleteChain):
        return NFT_MSG_DELCHAIN, 0, _str(NFTA_CHAIN_TABLE, table) + _str(NFTA_CHAIN_NAME, op.name)
    assert isinstance(op, DeleteSet)
    return NFT_MSG_DELSET, 0, _str(NFTA_SET_TABLE, table) + _str(NFTA_SET_NAME, op.name)


def _new_set(table: str, op: AddSet, set_id: int) -> bytes:
    if op.services:
        return _new_services_set(table, op, set_id)
    if op.ports:
        return _new_port_set(table, op, set_id)
    v4 = op.fam == "v4"
    flags = {"interval": NFT_SET_INTERVAL, "timeout": NFT_SET_TIMEOUT}.get(op.kind, 0)
    body = (
        _str(NFTA_SET_TABLE, table)
        + _str(NFTA_SET_NAME, op.name)
        + _u32(NFTA_SET_FLAGS, flags)
        + _u32(NFTA_SET_KEY_TYPE, NFT_DATATYPE_IPADDR if v4 else NFT_DATATYPE_IP6ADDR)
        + _u32(NFTA_SET_KEY_LEN, 4 if v4 else 16)
        + _u32(NFTA_SET_ID, set_id)
    )
    if op.kind == "timeout":
        body += _u64(NFTA_SET_TIMEOUT, op.timeout_s * 1000)
    if op.size:
        body += _nest(NFTA_SET_DESC, _u32(NFTA_SET_DESC_SIZE, op.size))
    return body


def _new_services_set(table: str, op: AddSet, set_id: int) -> bytes:
    """An ``inet_proto . inet_service`` interval set, as nft 1.0.6 sends it (the same user
    data as the address-keyed concatenations)."""
    body = (
        _str(NFTA_SET_TABLE, table)
        + _str(NFTA_SET_NAME, op.name)
        + _u32(NFTA_SET_FLAGS, NFT_SET_INTERVAL | NFT_SET_CONCAT)
        + _u32(NFTA_SET_KEY_TYPE, ports.SERVICES_KEY_TYPE)
        + _u32(NFTA_SET_KEY_LEN, ports.SERVICES_KEY_LEN)
        + _u32(NFTA_SET_ID, set_id)
    )
    size = _u32(NFTA_SET_DESC_SIZE, op.size) if op.size else b""
    body += _nest(NFTA_SET_DESC, size, ports.services_desc_concat())
    return body + ports.set_userdata()


def _new_port_set(table: str, op: AddSet, set_id: int) -> bytes:
    """An ``addr . inet_proto . inet_service`` interval set (``timeout``: with per-element
    timeouts), in nft 1.0.6's attribute order: the description (size, field lengths) before
    the timeout, the user data last."""
    timeout = NFT_SET_TIMEOUT if op.kind == "timeout" else 0
    # ``exact``: a hash set; nft 1.0.6 sends no interval or concat flag and no field lengths.
    flags = timeout if op.exact else NFT_SET_INTERVAL | NFT_SET_CONCAT | timeout
    body = (
        _str(NFTA_SET_TABLE, table)
        + _str(NFTA_SET_NAME, op.name)
        + _u32(NFTA_SET_FLAGS, flags)
        + _u32(NFTA_SET_KEY_TYPE, ports.key_type(op.fam))
        + _u32(NFTA_SET_KEY_LEN, ports.key_len(op.fam))
        + _u32(NFTA_SET_ID, set_id)
    )
    size = _u32(NFTA_SET_DESC_SIZE, op.size) if op.size else b""
    if not op.exact:
        body += _nest(NFTA_SET_DESC, size, ports.desc_concat(op.fam))
    elif size:
        body += _nest(NFTA_SET_DESC, size)
    if op.kind == "timeout":
        body += _u64(NFTA_SET_TIMEOUT, op.timeout_s * 1000)
    return body + ports.set_userdata()


def encode_batch(batch: NetlinkBatch, first_seq: int) -> tuple[bytes, dict[int, Op]]:
    """One nfnetlink batch (begin, the operations' messages, end) and the operation of each
    message's seq (an operation split over several messages owns several seqs).

    Whatever the number of messages, there is exactly one BEGIN and one END: the kernel
    commits all of it or nothing, so splitting never exposes a partial state."""
    seq = itertools.count(first_seq)
    parts = [_nlmsg(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, next(seq), 0, NFNL_SUBSYS_NFTABLES, b"")]
    by_seq: dict[int, Op] = {}
    for op in batch.ops:
        set_id = first_seq + len(by_seq) + 1  # the seq of the op's first message
        for msg_type, extra, body in encode_op(batch.table, op, set_id=set_id):
            s = next(seq)
            by_seq[s] = op
            parts.append(
                _nlmsg(
                    (NFNL_SUBSYS_NFTABLES << 8) | msg_type,
                    NLM_F_REQUEST | NLM_F_ACK | extra,
                    s,
                    NFPROTO_INET,
                    0,
                    body,
                )
            )
    parts.append(_nlmsg(NFNL_MSG_BATCH_END, NLM_F_REQUEST, next(seq), 0, NFNL_SUBSYS_NFTABLES, b""))
    return b"".join(parts), by_seq


def encode_counter_dump(table: str, seq: int) -> bytes:
    """A GETOBJ dump request for the counter objects of one table (the kernel filters both)."""
    body = _str(NFTA_OBJ_TABLE, table) + _u32(NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER)
    msg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETOBJ
    return _nlmsg(msg_type, NLM_F_REQUEST | NLM_F_DUMP, seq, NFPROTO_INET, 0, body)


def encode_setelem_dump(table: str, set_name: str, seq: int) -> bytes:
    """A GETSETELEM dump request for one set's elements (no other set is read)."""
    body = _str(NFTA_SET_ELEM_LIST_TABLE, table) + _str(NFTA_SET_ELEM_LIST_SET, set_name)
    msg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM
    return _nlmsg(msg_type, NLM_F_REQUEST | NLM_F_DUMP, seq, NFPROTO_INET, 0, body)
