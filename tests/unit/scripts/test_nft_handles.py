"""The fleet-levers probe's DELSET-by-handle re-encoding (scripts/bench/nft_handles.py).

Pure: no socket. The probe's verdict rests on the handle variant's removal differing from the
name variant's only in the DELSET messages, so that is what these check.
"""

from __future__ import annotations

import ipaddress
import struct
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import nft_handles as nh  # noqa: E402

from egressd.fleetnft.subject import removal_batch, subject_sets  # noqa: E402
from egressd.fleetnft.table import Names, TableConfig  # noqa: E402
from egressd.kernel.netlink_batch import encode_batch  # noqa: E402
from egressd.kernel.netlink_proto import NFTA_SET_NAME, NFTA_SET_TABLE, NLMSG_DONE  # noqa: E402

CFG = TableConfig(table="t")
IP = ipaddress.ip_address("10.64.0.9")


def removal() -> tuple[bytes, list[str]]:
    batch = removal_batch(CFG, "s1", IP, release_gateway=None, audit=False, ranges=False)
    names = [Names("s1").set(kind) for kind in subject_sets(audit=False, ranges=False)]
    return encode_batch(batch, 100)[0], names


def delsets(data: bytes) -> list[dict[int, bytes]]:
    return [nh.attrs(p[4:]) for t, _f, _s, p in nh.messages(data) if t == nh.DELSET_TYPE]


def test_every_named_delset_becomes_table_plus_handle_and_nothing_else_changes() -> None:
    data, names = removal()
    handles = {n: 1000 + i for i, n in enumerate(names)}
    out = nh.by_handle(data, handles)
    got = delsets(out)
    assert len(got) == len(names)
    for a, name in zip(got, names, strict=True):
        assert set(a) == {NFTA_SET_TABLE, nh.NFTA_SET_HANDLE}  # no name: the handle alone names it
        assert a[NFTA_SET_TABLE] == b"t\0"
        assert struct.unpack(">Q", a[nh.NFTA_SET_HANDLE])[0] == handles[name]
    before = [(t, f, s, p) for t, f, s, p in nh.messages(data) if t != nh.DELSET_TYPE]
    after = [(t, f, s, p) for t, f, s, p in nh.messages(out) if t != nh.DELSET_TYPE]
    assert before == after
    assert [s for _t, _f, s, _p in nh.messages(data)] == [s for _t, _f, s, _p in nh.messages(out)]


def test_an_unknown_handle_leaves_the_delete_by_name_and_no_map_is_a_no_op() -> None:
    data, names = removal()
    assert nh.by_handle(data, {}) == data
    out = delsets(nh.by_handle(data, {names[0]: 7}))
    assert nh.NFTA_SET_HANDLE in out[0]
    assert all(a[NFTA_SET_NAME] == n.encode() + b"\0" for a, n in zip(out[1:], names[1:], strict=True))


def test_the_set_dump_parser_reads_names_and_handles_until_done() -> None:
    def newset(name: str, handle: int) -> bytes:
        body = b"\x01\x00\x00\x00" + nh.attr(NFTA_SET_NAME, name.encode() + b"\0")
        body += nh.attr(nh.NFTA_SET_HANDLE, struct.pack(">Q", handle))
        return struct.pack("=IHHII", 16 + len(body), nh.NEWSET_TYPE, 2, 5, 0) + body

    done = struct.pack("=IHHII", 20, NLMSG_DONE, 2, 5, 0) + b"\0" * 4
    assert nh.parse_set_dump(newset("a", 3) + newset("b", 9)) == ({"a": 3, "b": 9}, False)
    assert nh.parse_set_dump(newset("c", 1) + done) == ({"c": 1}, True)
