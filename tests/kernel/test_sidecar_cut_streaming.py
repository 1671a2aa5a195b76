"""A narrowing's cut holds while the upstream keeps talking (docs/reference/behaviour.md §14.1),
sidecar profile: real TCP and UDP streams from an upstream to the app in the sandbox
namespace, cut by a policy change that refuses their destination.

The sidecar's table hooks output only: the upstream's packets reach the app unfiltered. When
the cut deleted the flow's conntrack entry, the upstream's next packet started a new entry in
reverse (upstream -> app), so the app's own packets were its reply direction, "established",
and accepted: a streamed download, or a channel out, outlived the narrowing. Now the cut marks
the entry (conntrack mark 0x40000000, egressd/sidecarnft/backend.py ``cut_flow``) and the
egress chain judges marked flows' packets like a new flow's.

The upstream runs the "chatter" server of tests/kernel/streaming.py, which streams to every
client and logs what it receives from one; the app keeps one flow to the address the
narrowing refuses and one to an address it keeps (:func:`tests.kernel.streaming.check`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

from tests.kernel.sidecar import Sidecar
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
from tests.kernel.topology import UP_NET, UPSTREAM_IPS, Topology, cleanup_stale

CUT_IP = f"{UP_NET}.6"  # api.example.test: refused by the narrowing
KEPT_IP = f"{UP_NET}.5"  # example.test: still allowed

ALLOWED = {
    "defaultAction": "deny",
    "egress": [
        {"action": "allow", "target": "api.example.test"},
        {"action": "allow", "target": "example.test"},
    ],
}
NARROWED = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "example.test"}]}


@pytest.fixture(scope="module")
def stopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egs{os.getpid()}", sandboxes=1).up_()
    try:
        start_chatter(t, UPSTREAM_IPS)
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(stopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(stopo, sb=1)
    sc.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(ALLOWED)
    try:
        sc.start()
        assert sc.dig("api.example.test") == ("NOERROR", [CUT_IP])
        assert sc.dig("example.test") == ("NOERROR", [KEPT_IP])
        yield sc
    finally:
        sc.cleanup()


def narrow_and_check(sidecar: Sidecar, topo: Topology, proto: str) -> None:
    cut = start_reader(topo, topo.sb(1), proto, CUT_IP)
    kept = start_reader(topo, topo.sb(1), proto, KEPT_IP)
    time.sleep(NARROW_AFTER_S)
    sidecar.set_policy(NARROWED)
    narrowed = time.time()
    time.sleep(MARGIN_S + 1.0)
    ct = conntrack(topo, topo.sb(1), proto)
    # UDP: the upstream's datagrams keep reaching the app (inbound is not filtered); none of
    # the app's may reach the upstream. TCP: with the app's ACKs refused the upstream stalls.
    check(finish(topo, cut), finish(topo, kept), narrowed, ct, inbound_cut=proto == "tcp")


def test_a_cut_tcp_stream_stays_cut_while_the_upstream_keeps_sending(
    sidecar: Sidecar, stopo: Topology
) -> None:
    narrow_and_check(sidecar, stopo, "tcp")


def test_a_cut_udp_flow_carries_nothing_out_while_the_upstream_keeps_sending(
    sidecar: Sidecar, stopo: Topology
) -> None:
    narrow_and_check(sidecar, stopo, "udp")


# A download only: the app reads and never writes (its kernel still ACKs), one verdict a second.
_DOWNLOAD = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0)
print("up", flush=True)
end = time.time() + float(sys.argv[3])
while time.time() < end:
    got, until = 0, time.time() + 1.0
    while time.time() < until:
        try:
            got += len(s.recv(65536))
        except OSError:
            pass
    print("ok" if got else "dead", flush=True)
"""


def test_an_allowed_download_whose_entry_is_gone_goes_on(sidecar: Sidecar, stopo: Topology) -> None:
    """What the inbound chain must not break: the flow's conntrack entry disappears (as after
    ``conntrack -F``, or an expiry) during a download, and the app never writes, so the
    upstream's next packet is picked up in reverse. Marked, the app's ACKs on it are judged by
    the policy: this destination is allowed, so the download goes on (dropping the pickup
    would stall it for good)."""
    reader = stopo.spawn(
        stopo.sb(1), "python3", "-c", _DOWNLOAD, KEPT_IP, str(port_of("tcp")), "8", ready_line="up"
    )
    time.sleep(1.5)
    # Until the upstream's packet is the one conntrack picks up (the app's delayed ACK may come
    # first and start the entry from the app's side, which proves nothing here).
    for _ in range(10):
        stopo.ns(stopo.sb(1), "conntrack", "-D", "-p", "tcp", "--dport", str(port_of("tcp")), check=False)
        time.sleep(0.3)
        ct = conntrack(stopo, stopo.sb(1), "tcp")
        if "mark=536870912" in ct:
            break
    verdicts = reader.communicate(timeout=30)[0].split()
    assert verdicts[:1] == ["ok"] and verdicts[-3:] == ["ok"] * 3, f"{verdicts}\nconntrack:\n{ct}"
    assert "mark=536870912" in ct, f"the flow was not picked up from outside: {ct}"
