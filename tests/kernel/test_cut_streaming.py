"""A narrowing's flow cut (docs/reference/behaviour.md §14.1) against an upstream that keeps
sending, in the fleet profile.

Cutting a flow is deleting its conntrack entry. When the upstream sends on, its next packet
is seen by conntrack as the first of a NEW flow, picked up mid-stream in the reverse
orientation (original = upstream -> sandbox): if that packet were let through, the
sandbox's later packets would be the flow's reply direction, "established", and a
streaming download would survive the narrowing for as long as the server keeps sending.

The fleet must refuse the pickup: for a network subject, the forward hook (``dispatch``)
accepts only established flows before its refusals, and a new packet addressed to a
sandbox is refused (``ip daddr @sandboxes_v4``), as is anything its source did not mark
(the unmarked tail). Either alone refuses the pickup; without both, the network-subject
tests here fail with the reversed entry in conntrack (checked by hand on a scratch copy).
A host-uid subject's flows are not cut at all: ``uid_out`` judges every packet of the uid,
established or not, so the narrowing holds from the next packet the sandbox sends; its
tests also delete the entry the way a cut would, forcing the pickup.

The upstream namespace runs the "chatter" server of tests/kernel/streaming.py, which
streams to every client and logs when it receives something from one. Readers in the
sandbox keep one flow to a destination the narrowing refuses and one to a destination it
keeps; each second at most they drain what arrived, send one byte back and print
``ok``/``dead`` with the time. Both shapes of the topology: bridged and routed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator

import pytest

from egressd.fleetnft.table import UNATTRIBUTED_COUNTER
from tests.kernel.streaming import (
    MARGIN_S,
    NARROW_AFTER_S,
    check,
    conntrack,
    finish,
    port_of,
    start_chatter,
    start_reader,
)
from tests.kernel.test_fleet_enforcement import allow_ips
from tests.kernel.test_uid_subjects import SYSTEM_PYTHON
from tests.kernel.test_uid_subjects import A as HOST_UID
from tests.kernel.test_uid_subjects import bind as bind_uid
from tests.kernel.test_uid_subjects import remove as remove_uid
from tests.kernel.topology import UPSTREAM_IPS, Daemon, Topology, cleanup_stale, envelope

CUT_IP, KEPT_IP = UPSTREAM_IPS[0], UPSTREAM_IPS[1]  # refused by the narrowing / still allowed
DPR = "sandbox.data-plane-ready"


@pytest.fixture(scope="module", params=["bridged", "routed"])
def net(request: pytest.FixtureRequest) -> Iterator[Topology]:
    cleanup_stale()
    shape = str(request.param)
    t = Topology(prefix=f"egk{os.getpid()}{shape[0]}", sandboxes=1, routed=shape == "routed").up_()
    try:
        start_chatter(t, UPSTREAM_IPS)
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def fleet(net: Topology) -> Iterator[Daemon]:
    d = Daemon(net, table="egk-cut", port=18380)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            net.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        print(d.log_text()[-4000:])  # shown by pytest when a test of this module failed


# ---- network subjects: the forward path, cut by conntrack on the narrowing ------------------


def unattributed(d: Daemon) -> int:
    """Packets refused for a source that is no subject (the upstream's, picked up as new flows)."""
    out = json.loads(d.nft("-j", "list", "counter", "inet", d.table, UNATTRIBUTED_COUNTER))
    return sum(int(c["counter"]["packets"]) for c in out["nftables"] if "counter" in c)


def bind_net(d: Daemon, topo: Topology, policy: object) -> None:
    env = envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=policy)
    if topo.routed:  # the attachment names the sandbox's real veth (as tests/kernel/test_lateral.py)
        env["attachment"]["network"]["hostVeth"] = "vh1"  # type: ignore[index]
    code, body = d.post(env)
    assert (code, body) == (200, "{}"), body


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_a_cut_flow_stays_cut_while_the_upstream_keeps_sending(
    net: Topology, fleet: Daemon, proto: str
) -> None:
    bind_net(fleet, net, allow_ips(CUT_IP, KEPT_IP))
    code, body = fleet.post(envelope("LIFECYCLE_HOOK", "sb1", hook=DPR))
    assert (code, body) == (200, "{}"), body
    try:
        cut = start_reader(net, net.sb(1), proto, CUT_IP, python=SYSTEM_PYTHON)
        kept = start_reader(net, net.sb(1), proto, KEPT_IP, python=SYSTEM_PYTHON)
        time.sleep(NARROW_AFTER_S)
        refused = unattributed(fleet)
        bind_net(fleet, net, allow_ips(KEPT_IP))  # in place: CUT_IP is no longer allowed
        narrowed = time.time()
        time.sleep(MARGIN_S + 1.0)
        ct = (
            conntrack(net, net.pod, proto) + f"\nunattributed refusals since: {unattributed(fleet) - refused}"
        )
        cut_out, kept_out = finish(net, cut), finish(net, kept)
        check(cut_out, kept_out, narrowed, ct)
    finally:
        code, body = fleet.post(envelope("REMOVE_BINDING", "sb1"))
        assert code == 200, body


# ---- host-uid subjects: every packet of the uid is judged in uid_out --------------------------


@pytest.mark.parametrize("net", ["routed"], indirect=True)  # the pod's own traffic: one shape is enough
@pytest.mark.parametrize("deleted", [False, True], ids=["kept-entry", "deleted-entry"])
@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_a_host_uid_subjects_refused_flow_stays_refused_while_the_upstream_keeps_sending(
    net: Topology, fleet: Daemon, proto: str, deleted: bool
) -> None:
    """A uid subject's flows are not cut (conntrack knows no uid): its conntrack entry stays and
    only what the uid sends is judged, so what the upstream sends keeps arriving. TCP: the
    upstream stalls once its unacknowledged window is full (the uid's ACKs are refused), and
    the reader with it. UDP: the datagrams keep arriving (inbound, not egress); none of the
    uid's reaches the server. ``deleted``: the entry is deleted as a network subject's cut
    would, so the upstream's next packet is picked up as a new flow in the reverse orientation
    and the uid's packets become its reply direction: still refused, every packet is judged."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    as_uid = ("setpriv", f"--reuid={HOST_UID}", f"--regid={HOST_UID}", "--clear-groups")
    port = str(port_of(proto))
    bind_uid(fleet, "ua", HOST_UID, allow_ips(CUT_IP, KEPT_IP))
    try:
        cut = start_reader(net, net.pod, proto, CUT_IP, as_uid, SYSTEM_PYTHON)
        kept = start_reader(net, net.pod, proto, KEPT_IP, as_uid, SYSTEM_PYTHON)
        time.sleep(NARROW_AFTER_S)
        bind_uid(fleet, "ua", HOST_UID, allow_ips(KEPT_IP), activate=False)  # in place
        narrowed = time.time()
        if deleted:
            net.ns(net.pod, "conntrack", "-D", "-p", proto, "-d", CUT_IP, "--dport", port, check=False)
        time.sleep(MARGIN_S + 1.0)
        ct = conntrack(net, net.pod, proto)
        cut_out, kept_out = finish(net, cut), finish(net, kept)
        check(cut_out, kept_out, narrowed, ct, inbound_cut=proto == "tcp")
    finally:
        remove_uid(fleet, "ua")
