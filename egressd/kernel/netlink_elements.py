"""Set and map element encoding: address, interval, timeout, uid, interface and verdict-map
elements, and the element operations' messages (long element lists split over several messages
of one batch, a range never cut in two). Pure."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

from egressd.addr import IPAddress
from egressd.kernel.netlink_ports import elem_keys, service_keys, timed_elem
from egressd.kernel.netlink_proto import (
    NFT_JUMP,
    NFT_MSG_DELSETELEM,
    NFT_MSG_NEWSETELEM,
    NFT_SET_ELEM_INTERVAL_END,
    NFTA_DATA_VERDICT,
    NFTA_SET_ELEM_DATA,
    NFTA_SET_ELEM_EXPIRATION,
    NFTA_SET_ELEM_FLAGS,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE,
    NFTA_SET_ELEM_OBJREF,
    NFTA_SET_ELEM_TIMEOUT,
    NFTA_VERDICT_CHAIN,
    NFTA_VERDICT_CODE,
    NLM_F_CREATE,
    _attr,
    _data_value,
    _nest,
    _str,
    _u32,
    _u64,
)
from egressd.kernel.ops import (
    AddCounterRef,
    AddElements,
    AddIntervals,
    AddJump,
    AddPort,
    AddPortElems,
    AddServices,
    AddUid,
    AddUidCounterRef,
    AddUidJump,
    AddUidPort,
    DeleteElement,
    DeleteIface,
    DeletePortElems,
    DeleteUid,
    ElementOp,
    FlushSet,
    IfaceOp,
    IPNetwork,
    UidOp,
)

# Element bytes per NEWSETELEM/DELSETELEM message: well below NLA_MAX_LEN (the elements nest
# plus table and set names must fit), and small enough that an error names a small piece.
ELEMENT_BYTES_PER_MESSAGE = 32 * 1024


def _key(value: IPAddress | int, fam: str) -> bytes:
    return _data_value(NFTA_SET_ELEM_KEY, int(value).to_bytes(4 if fam == "v4" else 16, "big"))


def interval_keys(nets: Sequence[IPNetwork], fam: str) -> list[tuple[int, bool]]:
    """(key, is_end) pairs as nft 1.0.6 sends an interval set: a zero end-marker when the first
    range does not start at 0, then start / end+1 pairs (no end when a range reaches the top)."""
    bits = 32 if fam == "v4" else 128
    ordered = sorted(nets, key=lambda n: int(n.network_address))
    keys: list[tuple[int, bool]] = []
    if ordered and int(ordered[0].network_address) != 0:
        keys.append((0, True))
    for net in ordered:
        keys.append((int(net.network_address), False))
        end = int(net.broadcast_address) + 1
        if end < 1 << bits:
            keys.append((end, True))
    return keys


def _elements(items: Iterable[bytes]) -> bytes:
    # Element nests are numbered 1..n, as libnftnl (and so nft) sends them.
    return _nest(NFTA_SET_ELEM_LIST_ELEMENTS, *(_nest(n, i) for n, i in enumerate(items, 1)))


def _elem_list(table: str, name: str, elements: bytes | None) -> bytes:
    body = _str(NFTA_SET_ELEM_LIST_TABLE, table) + _str(NFTA_SET_ELEM_LIST_SET, name)
    return body + elements if elements is not None else body


def pack_groups(
    groups: Sequence[Sequence[bytes]], budget: int = ELEMENT_BYTES_PER_MESSAGE
) -> list[list[bytes]]:
    """Consecutive element groups packed greedily into chunks of at most ``budget`` bytes of
    element nests (4 header bytes + the element each); a group is never split. Order is kept,
    so the kernel sees the elements in the order one message would have carried them."""
    chunks: list[list[bytes]] = []
    current: list[bytes] = []
    size = 0
    for group in groups:
        need = sum(4 + len(e) for e in group)
        if current and size + need > budget:
            chunks.append(current)
            current, size = [], 0
        current.extend(group)
        size += need
    if current:
        chunks.append(current)
    return chunks


def _interval_groups(nets: Sequence[IPNetwork], fam: str) -> list[list[bytes]]:
    """Interval elements grouped so that a range's start and its end marker always travel in
    the same message (the leading zero end-marker goes with the first range): no message
    carries half a range, so correctness never rests on how the kernel pairs elements that
    arrive in different messages of one transaction."""
    groups: list[list[bytes]] = []
    lead: list[bytes] = []
    for key, is_end in interval_keys(nets, fam):
        e = _key(key, fam)
        if is_end:
            e += _u32(NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END)
        if not is_end:
            groups.append([*lead, e])
            lead = []
        elif groups:
            groups[-1].append(e)
        else:
            lead.append(e)
    if lead:
        groups.append(lead)
    return groups


def _element_messages(
    msg_type: int, flags: int, table: str, name: str, groups: Sequence[Sequence[bytes]]
) -> list[tuple[int, int, bytes]]:
    """One element operation as as many messages as its elements need (at least one)."""
    chunks = pack_groups(groups) or [[]]
    return [(msg_type, flags, _elem_list(table, name, _elements(c))) for c in chunks]


def _uid_key(uid: int, port: int | None = None) -> bytes:
    """``meta skuid`` loads the socket's uid as a host-endian u32; a ``uid . inet_service``
    concatenation appends the port in network byte order, padded to the 4-byte register."""
    key = struct.pack("=I", uid)
    if port is not None:
        key += struct.pack(">H", port) + b"\0\0"
    return _data_value(NFTA_SET_ELEM_KEY, key)


def encode_uid_op(table: str, op: UidOp) -> list[tuple[int, int, bytes]]:
    """The one message of an element operation on a uid-keyed set or map (docs/reference/behaviour.md §17)."""
    if isinstance(op, DeleteUid):
        key = _uid_key(op.uid, op.port)
        return [(NFT_MSG_DELSETELEM, 0, _elem_list(table, op.name, _elements([key])))]
    elem = _uid_key(op.uid, None if isinstance(op, AddUidPort | AddUidCounterRef) else op.port)
    name = op.name if isinstance(op, AddUid) else op.map
    if isinstance(op, AddUidJump):
        verdict = _nest(
            NFTA_DATA_VERDICT,
            _attr(NFTA_VERDICT_CODE, struct.pack(">i", NFT_JUMP)),
            _str(NFTA_VERDICT_CHAIN, op.chain),
        )
        elem += _nest(NFTA_SET_ELEM_DATA, verdict)
    elif isinstance(op, AddUidPort):
        # inet_service is network byte order, as ``th dport`` loads it.
        elem += _data_value(NFTA_SET_ELEM_DATA, struct.pack(">H", op.to_port))
    elif isinstance(op, AddUidCounterRef):
        elem += _str(NFTA_SET_ELEM_OBJREF, op.counter)
    return [(NFT_MSG_NEWSETELEM, NLM_F_CREATE, _elem_list(table, name, _elements([elem])))]


IFNAMSIZ = 16  # an ``ifname`` key: the name, NUL-padded to the kernel's interface name size


def iface_key(iface: str) -> bytes:
    """An interface name as a ``type ifname`` set key (what ``meta iifname`` loads)."""
    raw = iface.encode()
    if not 0 < len(raw) < IFNAMSIZ:
        raise ValueError(f"interface name {iface!r} is not 1..{IFNAMSIZ - 1} bytes")
    return raw.ljust(IFNAMSIZ, b"\0")


def encode_iface_op(table: str, op: IfaceOp) -> list[tuple[int, int, bytes]]:
    """The one message of an element operation on a ``type ifname`` set (docs/reference/behaviour.md §20.2)."""
    elem = _data_value(NFTA_SET_ELEM_KEY, iface_key(op.iface))
    if isinstance(op, DeleteIface):
        return [(NFT_MSG_DELSETELEM, 0, _elem_list(table, op.name, _elements([elem])))]
    return [(NFT_MSG_NEWSETELEM, NLM_F_CREATE, _elem_list(table, op.name, _elements([elem])))]


def _element_op_messages(table: str, op: ElementOp) -> list[tuple[int, int, bytes]]:
    """Element additions (split over messages when long), deletions and flushes."""
    if isinstance(op, AddJump):
        fam = "v4" if op.key.version == 4 else "v6"
        verdict = _nest(
            NFTA_DATA_VERDICT,
            _attr(NFTA_VERDICT_CODE, struct.pack(">i", NFT_JUMP)),
            _str(NFTA_VERDICT_CHAIN, op.chain),
        )
        elem = _key(op.key, fam) + _nest(NFTA_SET_ELEM_DATA, verdict)
        return [(NFT_MSG_NEWSETELEM, NLM_F_CREATE, _elem_list(table, op.map, _elements([elem])))]
    if isinstance(op, AddCounterRef):
        fam = "v4" if op.key.version == 4 else "v6"
        elem = _key(op.key, fam) + _str(NFTA_SET_ELEM_OBJREF, op.counter)
        return [(NFT_MSG_NEWSETELEM, NLM_F_CREATE, _elem_list(table, op.map, _elements([elem])))]
    if isinstance(op, AddPort):
        fam = "v4" if op.key.version == 4 else "v6"
        # inet_service is network byte order, as ``redirect to :<map>`` loads it.
        elem = _key(op.key, fam) + _data_value(NFTA_SET_ELEM_DATA, struct.pack(">H", op.to_port))
        return [(NFT_MSG_NEWSETELEM, NLM_F_CREATE, _elem_list(table, op.map, _elements([elem])))]
    if isinstance(op, FlushSet):
        return [(NFT_MSG_DELSETELEM, 0, _elem_list(table, op.name, None))]  # no element list = flush
    if isinstance(op, AddServices):
        groups = [[service_keys(e)] for e in op.elems]
        return _element_messages(NFT_MSG_NEWSETELEM, NLM_F_CREATE, table, op.name, groups)
    if isinstance(op, DeletePortElems):
        groups = [[elem_keys(e, op.fam, exact=op.exact)] for e in op.elems]
        return _element_messages(NFT_MSG_DELSETELEM, 0, table, op.name, groups)
    if isinstance(op, AddPortElems):
        if op.seconds:
            groups = [
                [timed_elem(e, op.fam, s, exact=op.exact)] for e, s in zip(op.elems, op.seconds, strict=True)
            ]
        else:
            groups = [[elem_keys(e, op.fam, exact=op.exact)] for e in op.elems]
        return _element_messages(NFT_MSG_NEWSETELEM, NLM_F_CREATE, table, op.name, groups)
    if isinstance(op, DeleteElement):
        fam = "v4" if op.key.version == 4 else "v6"
        return [(NFT_MSG_DELSETELEM, 0, _elem_list(table, op.name, _elements([_key(op.key, fam)])))]
    if isinstance(op, AddElements):
        groups = [[_key(k, "v4" if k.version == 4 else "v6")] for k in op.keys]
    elif isinstance(op, AddIntervals):
        groups = _interval_groups(op.nets, op.fam)
    else:
        groups = [
            [
                _key(ip, op.fam)
                + _u64(NFTA_SET_ELEM_TIMEOUT, sec * 1000)
                + _u64(NFTA_SET_ELEM_EXPIRATION, sec * 1000)
            ]
            for ip, sec in op.leases
        ]
    return _element_messages(NFT_MSG_NEWSETELEM, NLM_F_CREATE, table, op.name, groups)
