"""Every host-uid subject shape (docs/reference/behaviour.md §17) loads into the real kernel through egressd's own
netlink encoder, and its removal leaves nothing of it.

The unit tests pin the batches' nft rendering and bytes; only the kernel says whether it
takes them (key lengths of uid and ``uid . inet_service`` keys, the verdict and port data).
Each case runs in a scratch namespace of its own, with only this test's table in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

_SCRIPT = textwrap.dedent(
    """
    import ipaddress, subprocess, sys
    from egressd.fleetnft.contents import policy_swap
    from egressd.fleetnft.header import header_script
    from egressd.fleetnft.hostuid import (
        UidSubjectNft, uid_audit_ops, uid_key_deletes, uid_subject_create, uid_subject_keys,
    )
    from egressd.fleetnft.subject import audit_objects, flush_subject_sets, removal_batch, subject_create
    from egressd.fleetnft.table import SubjectNft, TableConfig
    from egressd.kernel.netlink import NfTablesSocket
    from egressd.kernel.ops import NetlinkBatch
    from egressd.policy import parse_policy

    mitm = sys.argv[1] == "mitm"
    cfg = TableConfig(table="T", mitm=mitm)
    a = UidSubjectNft("s_a", 100001, 0)
    b = UidSubjectNft("s_b", 165000, 255)
    net = SubjectNft("s_n", ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("10.0.0.1"))
    audit = parse_policy('{"defaultAction":"deny","mode":"audit","egress":[{"action":"allow","target":"8.8.8.8"}]}')
    sock = NfTablesSocket()

    def listing():
        return subprocess.run(["nft", "list", "table", "inet", "T"], capture_output=True, text=True,
                              check=True).stdout

    subprocess.run(["nft", "delete", "table", "inet", "T"], capture_output=True)
    subprocess.run(["nft", "-f", "-"], input=header_script(cfg, delete_existing=False), text=True, check=True)
    empty = listing()
    sock.run(uid_subject_create(cfg, a) + uid_subject_create(cfg, b) + subject_create(cfg, net))
    # Re-running the keys is a no-op (a retried deny-first), so is "not in uid_audit" twice.
    sock.run(uid_subject_keys(cfg, a) + NetlinkBatch("T", tuple(uid_audit_ops(100001, audit=False))))
    # Activation into audit mode: the set swap and the audit membership in one transaction.
    sock.run(
        audit_objects(cfg, "s_a") + policy_swap("T", "s_a", audit, audit_objects=True, known_empty=True)
        + NetlinkBatch("T", tuple(uid_audit_ops(100001, audit=True)))
    )
    print(listing())
    print("=====")
    # Back to deny-first, then removal of both uid subjects (the network one stays).
    sock.run(flush_subject_sets("T", "s_a", audit=True, ranges=False) + NetlinkBatch("T", tuple(uid_audit_ops(100001, audit=False))))
    print(listing())
    print("=====")
    for s in (a, b):
        gone = removal_batch(cfg, s.nft_id, None, release_gateway=None, audit=s is a, ranges=False)
        ops = uid_key_deletes(cfg, s.host_uid, s.slot) + list(gone.ops)
        sock.run(NetlinkBatch("T", tuple(ops)))
    print(listing())
    print("=====")
    print(empty)
    """
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[str]:
    ns = f"egul{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.mark.parametrize("mitm", ["plain", "mitm"])
def test_uid_subjects_load_and_leave_nothing(scratch: str, mitm: str) -> None:
    r = subprocess.run(
        ["ip", "netns", "exec", scratch, sys.executable, "-c", _SCRIPT, mitm],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    active, denying, removed, empty = r.stdout.split("=====\n")
    # The kernel stores what the encoder sent: host-endian uids, network-order ports.
    assert elements(active, "uid_dispatch") == {"100001 : jump subj_s_a", "165000 : jump subj_s_b"}
    assert elements(active, "uid_marking") == {"100001 : jump mark_s_a", "165000 : jump mark_s_b"}
    assert elements(active, "uid_dns") == {"100001 : 16000", "165000 : 16255"}
    assert elements(active, "uid_dns_own") == {"100001 . 16000", "165000 . 16255"}
    assert elements(active, "dispatch_v4") == {"10.0.0.5 : jump subj_s_n"}
    if mitm == "mitm":
        assert elements(active, "uid_mitm") == {"100001 : 16257", "165000 : 16512"}
        assert elements(active, "uid_mitm_in") == {
            "100001 . 16257 : jump subj_s_a_in",
            "165000 . 16512 : jump subj_s_b_in",
        }
    assert elements(active, "uid_audit") == {"100001"}
    assert elements(denying, "uid_audit") == set()
    # Removal leaves no object and no element of either uid subject; the network one stays.
    for gone in ("s_a", "s_b", "100001", "165000"):
        assert gone not in removed
    assert "subj_s_n" in removed
    for name in ("uid_dispatch", "uid_marking", "uid_dns", "uid_dns_own", "uid_audit"):
        assert elements(removed, name) == elements(empty, name) == set()


def elements(listing: str, name: str) -> set[str]:
    """The elements of set or map ``name`` in an ``nft list table`` output."""
    marker = next(m for m in (f"\tset {name} {{", f"\tmap {name} {{") if m in listing)
    block = listing.split(marker, 1)[1].split("\n\t}", 1)[0]
    if "elements = {" not in block:
        return set()
    body = block.split("elements = {", 1)[1].rsplit("}", 1)[0]
    return {" ".join(item.split()) for item in body.split(",") if item.strip()}
