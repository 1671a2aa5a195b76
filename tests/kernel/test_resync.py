"""The re-sync batch after an unanswered transaction (fleetnft.subject.subject_resync) on the real kernel.

The fault matrix (unit/test_fault_matrix.py) proves the control plane's logic against a model
kernel; this proves the model's one new assumption: that the re-sync batch, followed by the
step's own operations in the same transaction, succeeds on BOTH states the unanswered
transaction may have left, and that both end in the same table. Each case runs in a scratch
namespace of its own (nothing else in it), through egressd's own netlink socket.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

# Runs inside the scratch namespace: builds the two states, applies the same batch to each,
# prints both listings.
_SCRIPT = textwrap.dedent(
    """
    import ipaddress, subprocess, sys
    from egressd.fleetnft.contents import policy_swap
    from egressd.fleetnft.header import header_script
    from egressd.fleetnft.subject import (
        audit_objects, dispatch_deletes, flush_subject_sets, gateway_release, range_objects, removal_batch,
        subject_create, subject_keys, subject_resync,
    )
    from egressd.fleetnft.table import SubjectNft, TableConfig
    from egressd.kernel.netlink import NfTablesSocket
    from egressd.kernel.ops import NetlinkBatch
    from egressd.policy import parse_policy

    mitm = sys.argv[1] == "mitm"
    case = sys.argv[2]
    cfg = TableConfig(table="T", mitm=mitm)
    subj = SubjectNft("s_u_1", ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("10.0.0.1"))
    policy = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.8"}]}')
    sock = NfTablesSocket()

    def reset():
        subprocess.run(["nft", "delete", "table", "inet", "T"], capture_output=True)
        subprocess.run(["nft", "-f", "-"], input=header_script(cfg, delete_existing=False),
                       text=True, check=True)

    def listing():
        out = subprocess.run(["nft", "list", "table", "inet", "T"], capture_output=True, text=True,
                             check=True).stdout
        return out

    def resync(applied, audit=False, ranges=False):
        if applied is None:
            contents = flush_subject_sets("T", "s_u_1", audit=audit, ranges=ranges)
        else:
            contents = policy_swap("T", "s_u_1", applied, audit_objects=audit, range_objects=ranges)
        return subject_resync(cfg, "s_u_1", [subj], contents, audit=audit, ranges=ranges)

    def swap(p, audit=False, ranges=False):
        return policy_swap("T", "s_u_1", p, audit_objects=audit, range_objects=ranges)

    if case == "create":
        # A first install went unanswered: nothing, or the whole deny-first subject.
        states = [NetlinkBatch("T"), subject_create(cfg, subj)]
        step = resync(None) + flush_subject_sets("T", "s_u_1", audit=False, ranges=False) + subject_keys(cfg, subj)
    elif case == "apply":
        # An activation went unanswered: deny-first content, or the policy's.
        states = [subject_create(cfg, subj), subject_create(cfg, subj) + swap(policy)]
        step = resync(None) + swap(policy)
    elif case == "audit":
        # A subject's first audit policy went unanswered: no audit objects, or them and the
        # audit content. The re-sync leaves both with the audit objects.
        audited = parse_policy(
            '{"defaultAction":"deny","mode":"audit","egress":[{"action":"deny","target":"9.9.9.9"}]}'
        )
        before = subject_create(cfg, subj) + swap(policy)
        states = [before, before + audit_objects(cfg, "s_u_1") + swap(audited, True)]
        step = resync(policy, True) + swap(audited, True)
    elif case == "ranges":
        # A subject's first policy with shared port ranges went unanswered: no range objects,
        # or them and the ranges. The re-sync leaves both with the range objects (either
        # state's, like the audit objects), and the ranged policy then applies to both.
        ranged = parse_policy(
            '{"defaultAction":"deny","egress":[{"action":"allow","target":"a.test","protocol":"tcp",'
            '"ports":["8000-8999"]}]}'
        )
        before = subject_create(cfg, subj) + swap(policy)
        states = [before, before + range_objects(cfg, "s_u_1") + swap(ranged, ranges=True)]
        step = resync(policy, ranges=True) + swap(ranged, ranges=True)
    else:
        # A removal went unanswered: the active subject, or nothing.
        states = [subject_create(cfg, subj) + swap(policy), NetlinkBatch("T")]
        removal = dispatch_deletes(cfg, subj.ip, release_gateway=None) + [gateway_release(subj.gateway)]
        removal += removal_batch(cfg, "s_u_1", None, release_gateway=None, audit=False, ranges=False).ops
        step = resync(policy) + NetlinkBatch("T", tuple(removal))
    for state in states:
        reset()
        sock.run(state)
        sock.run(step)
        print(listing())
        print("=====")
    """
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[str]:
    ns = f"egrs{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.mark.parametrize("mitm", ["plain", "mitm"])
@pytest.mark.parametrize("case", ["create", "apply", "audit", "ranges", "remove"])
def test_the_resync_batch_converges_from_both_states(scratch: str, case: str, mitm: str) -> None:
    r = subprocess.run(
        ["ip", "netns", "exec", scratch, sys.executable, "-c", _SCRIPT, mitm, case],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    first, second, _ = r.stdout.split("=====\n")
    assert first == second
    if case == "remove":
        assert "s_u_1" not in first
    else:
        # The fixed rules exactly once, whichever state the batch started from.
        assert first.count("@subj_s_u_1_deny_v4 goto denied") == (2 if mitm == "mitm" else 1)
        assert "10.0.0.5 : jump subj_s_u_1" in first
        # The audit sets and rules only where an audit policy made them, then exactly once.
        assert first.count("log prefix") == (6 if case == "audit" else 0)  # wdeny, wdenyp, audit x v4, v6
        assert ("subj_s_u_1_wdeny_v4" in first) is (case == "audit")
        # Likewise the range sets and rules (one per family, two with the MITM's input chain).
        assert first.count("@subj_s_u_1_dynrports_v4") == ((2 if mitm == "mitm" else 1) if case == "ranges" else 0)
        assert ("subj_s_u_1_dynr_v4" in first) is (case == "ranges")
        if case == "ranges":
            assert "tcp . 8000-8999" in first
