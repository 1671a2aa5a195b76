"""A host-uid subject (docs/reference/behaviour.md §17) cannot reach the upstream resolver by
riding a conntrack entry the DNS forwarder left behind.

The redirect of port 53 is NAT, decided on a connection's first packet only. The forwarder
sends from egressd's own namespace (the one the uid subjects share) with SO_MARK 0x1, exempt
from the redirect, and closes the UDP sockets it does not pool (over 32 at once, timeouts, a
restart); their un-NATed entries (``<host addr>:P -> resolver:53``) outlive them by 30-120 s.
A sandbox uid that binds P and sends to the resolver matches such an entry, is not redirected,
and reaches ``uid_out`` with port 53 intact, where a policy that opens the resolver's address
(``defaultAction: allow``, or an address rule) would pass it: a query for a denied name
answered by the upstream, i.e. exfiltration by DNS. ``uid_out`` refuses port 53 that was
not NATed (fleetnft/hostuid.py).

Real processes of a sandbox uid in the module's own "host" namespace, as in
tests/kernel/test_uid_subjects.py; the upstream answers the burst's names slowly.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from egressd.fleetnft.header import FWD_ZONE_CHAIN
from egressd.nftsyntax import FORWARDER_MARK, forwarder_zone
from tests.kernel.test_uid_subjects import (
    DNS_BASE,
    MAX_SUBJECTS,
    SYSTEM_PYTHON,
    A,
    B,
    as_uid,
    bind,
    dig,
    remove,
)
from tests.kernel.topology import DNS_UPSTREAM, UP_NET, ZONE, Daemon, Topology, cleanup_stale

EXFIL = "exfil-collide.test"  # denied by both policies: the upstream must never be asked for *.EXFIL
API = "api.example.test"
BURST_N = 64  # the DNS proxy's in-flight cap per client (dnsproxy/server.py)
# Answered after a while, so the burst's questions are all in flight at once (the forwarder
# pools what comes back, up to 32, and closes the rest).
SLOW = [
    {"name": f"n{i}.slow.example.test", "type": "A", "value": f"{UP_NET}.5", "ttl": 30, "delay_s": 0.5}
    for i in range(BURST_N)
]


@pytest.fixture(scope="module")
def ctopo() -> Iterator[Topology]:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    cleanup_stale()
    t = Topology(prefix=f"egc{os.getpid()}", sandboxes=0, zone=[*ZONE, *SLOW]).up_()
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def cdaemon(ctopo: Topology) -> Iterator[Daemon]:
    env = {"EGRESSD_UID_MAX_SUBJECTS": str(MAX_SUBJECTS), "EGRESSD_UID_DNS_PORT_BASE": str(DNS_BASE)}
    d = Daemon(ctopo, table="egt-uidc", port=18190, env=env)
    with d.running(timeout=30):
        try:
            yield d
        finally:
            print(d.log_text()[-4000:])  # shown by pytest when a test of the module failed


_QUERY = r"""
import struct
def query(name, qid):
    labels = b"".join(bytes([len(x)]) + x.encode() for x in name.split("."))
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", 1, 1)
"""

# Many allowed questions at once: more than the forwarder pools (32), so it opens sockets of
# its own for the rest and closes them once answered, leaving their un-NATed entries behind.
BURST = (
    _QUERY
    + r"""
import socket, sys, time
server, n = sys.argv[1], int(sys.argv[2])
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
for i, s in enumerate(socks):
    s.sendto(query(f"n{i}.slow.example.test", i + 1), (server, 53))
end, ok = time.monotonic() + 5, 0
for s in socks:
    s.settimeout(max(0.01, end - time.monotonic()))
    try:
        s.recv(4096)
        ok += 1
    except OSError:
        pass
print(ok)
"""
)

# Every ephemeral source port in turn, to the resolver's port 53: the few that collide with a
# forwarder entry are not redirected. A third argument: each socket carries the forwarder's
# mark (SO_MARK 0x1; the process needs CAP_NET_RAW).
SPRAY = (
    _QUERY
    + r"""
import socket, sys
server, name, marked = sys.argv[1], sys.argv[2], len(sys.argv) > 3
lo, hi = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
q = query(name, 0x4242)
sent = 0
for p in range(lo, hi + 1):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if marked:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 1)
        s.bind(("0.0.0.0", p))
        s.sendto(q, (server, 53))
        sent += 1
    except OSError:
        pass
    finally:
        s.close()
print(sent)
"""
)

POLICIES: dict[str, dict[str, Any]] = {
    # Everything open but one name: the resolver's address is open like every other.
    "default-allow": {"defaultAction": "allow", "egress": [{"action": "deny", "target": f"*.{EXFIL}"}]},
    # The resolver's address opened by an address rule, names by a wildcard.
    "resolver-address": {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": DNS_UPSTREAM},
            {"action": "allow", "target": "*.example.test"},
        ],
    },
}


def unnated_forwarder_entries(topo: Topology) -> int:
    """UDP conntrack entries to the resolver's port 53 whose reply comes from the resolver
    itself (not redirected): the forwarder's, open or closed."""
    cmd = ("conntrack", "-L", "-p", "udp", "-d", DNS_UPSTREAM, "--dport", "53")
    out = topo.ns(topo.pod, *cmd, check=False).stdout
    return sum(1 for line in out.splitlines() if f"src={DNS_UPSTREAM} " in line.split("dport=53 ", 1)[-1])


def dropped(d: Daemon, uid: str) -> int:
    doc = json.loads(d.nft("-j", "list", "counter", "inet", d.table, f"subj_s_{uid}_dropped"))
    return sum(int(c["counter"]["packets"]) for c in doc["nftables"] if "counter" in c)


@contextmanager
def zone_rule(d: Daemon, *, present: bool) -> Iterator[None]:
    """The fleet's ``fwd_zone`` rule as is, or (``present=False``) taken out for the block:
    the forwarder's flows are then tracked in the subjects' zone, as before it existed, and
    ``uid_out``'s refusal of unredirected port 53 is all that stands."""
    if present:
        yield
        return
    d.nft("flush", "chain", "inet", d.table, FWD_ZONE_CHAIN)
    try:
        yield
    finally:
        d.nft(
            "add",
            "rule",
            "inet",
            d.table,
            FWD_ZONE_CHAIN,
            *forwarder_zone(FORWARDER_MARK, os.getuid()).split(),
        )


@pytest.mark.parametrize("zone", [True, False], ids=["zone", "guard-only"])
@pytest.mark.parametrize("shape", sorted(POLICIES))
def test_a_uid_subject_cannot_ride_a_forwarder_conntrack_entry_to_the_resolver(
    ctopo: Topology, cdaemon: Daemon, shape: str, zone: bool
) -> None:
    """``zone``: the forwarder's entries are in their own conntrack zone, so the spray never
    meets them (redirected like any query). ``guard-only``: the zone rule taken out, the spray
    rides them and ``uid_out`` refuses it (defence in depth)."""
    exfil = f"{shape}.{EXFIL}"
    bind(cdaemon, "ua", A, POLICIES[shape])
    try:
        # The ordinary path: redirected to the subject's DNS port, judged by its policy.
        assert dig(ctopo, A, API)[0] == "NOERROR"
        assert dig(ctopo, A, exfil)[0] == "NXDOMAIN"
        assert exfil not in ctopo.upstream_queries()
        with zone_rule(cdaemon, present=zone):
            # Only this topology's namespace. Twice, a moment apart: an answer still in flight
            # from an earlier case (the guard-only one leaves the forwarder's flows in zone 0)
            # would otherwise make a zone-0 entry the forwarder's next packet rides in reverse.
            ctopo.ns(ctopo.pod, "conntrack", "-F", check=False)  # exits 1 when there was nothing
            time.sleep(1.0)
            ctopo.ns(ctopo.pod, "conntrack", "-F", check=False)
            burst = as_uid(ctopo, A, SYSTEM_PYTHON, "-c", BURST, DNS_UPSTREAM, str(BURST_N), timeout=30)
            assert burst.returncode == 0, burst.stderr
            # Precondition: entries of sockets the forwarder no longer holds (it pools 32 at most).
            left = unnated_forwarder_entries(ctopo)
            assert left > 32, (
                f"the burst did not overflow the forwarder's pool ({left} entries, {burst.stdout})"
            )
            before = dropped(cdaemon, "ua")
            spray = as_uid(ctopo, A, SYSTEM_PYTHON, "-c", SPRAY, DNS_UPSTREAM, exfil, timeout=60)
            assert spray.returncode == 0, spray.stderr
            time.sleep(1)
            reached = [q for q in ctopo.upstream_queries() if q == exfil]
            assert not reached, f"{len(reached)} queries for the denied name reached the upstream resolver"
            if zone:
                # Every spray packet was redirected: none met a forwarder entry.
                after = dropped(cdaemon, "ua")
                assert after == before, (
                    f"{after - before} spray packets refused; conntrack: {ctopo.ns(ctopo.pod, 'conntrack', '-S', check=False).stdout}"
                )
            else:
                # Not vacuous: packets collided and were refused in uid_out (the redirected rest passes).
                assert dropped(cdaemon, "ua") > before
        # Name resolution still works after the spray.
        assert dig(ctopo, A, API)[0] == "NOERROR"
    finally:
        remove(cdaemon, "ua")


# The burst again, each answer judged: its rcode and, for NOERROR, whether the one address it
# carries is the zone's. JSON counts by outcome. From source ports below the ephemeral range,
# which the spray does not touch: a subject's socket on a port of another subject's entry would
# meet that entry's redirect (a gap of its own, noticed but not this test's).
BURST_CHECK = (
    _QUERY
    + r"""
import json, socket, sys, time
server, n, want = sys.argv[1], int(sys.argv[2]), socket.inet_aton(sys.argv[3])
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
for i, s in enumerate(socks):
    s.bind(("0.0.0.0", 20000 + i))
    s.sendto(query(f"n{i}.slow.example.test", i + 1), (server, 53))
end, out = time.monotonic() + 8, {}
for s in socks:
    s.settimeout(max(0.01, end - time.monotonic()))
    try:
        r = s.recv(4096)
    except OSError:
        k = "timeout"
    else:
        rcode = r[3] & 0xF
        k = ("ok" if r.endswith(want) else "wrong-address") if rcode == 0 else f"rcode-{rcode}"
    out[k] = out.get(k, 0) + 1
print(json.dumps(out))
"""
)


@pytest.mark.parametrize("marked", [False, True], ids=["plain", "marked"])
def test_a_uid_subjects_spray_cannot_capture_the_forwarders_queries_of_another_subject(
    ctopo: Topology, cdaemon: Daemon, marked: bool
) -> None:
    """The reverse collision: a subject's own (redirected) conntrack entries ``host:P ->
    resolver:53``, one per ephemeral port, must not catch the forwarder's next socket on P (its
    first packet would be NATed to that subject's DNS port and answered under its policy: a
    denial for every other subject). The forwarder's flows are in their own conntrack zone in
    the original direction (nftsyntax.forwarder_zone). ``marked``: the spraying subject has
    CAP_NET_RAW and marks its sockets like the forwarder's, so the zone is chosen by the
    socket's owner (egressd's uid), not by the mark alone."""
    bind(
        cdaemon,
        "ua",
        A,
        {"defaultAction": "deny", "egress": [{"action": "allow", "target": "*.slow.example.test"}]},
    )
    bind(cdaemon, "ub", B, {"defaultAction": "deny", "egress": []})
    try:
        assert dig(ctopo, B, "n0.slow.example.test")[0] == "NXDOMAIN"
        ctopo.ns(ctopo.pod, "conntrack", "-F", check=False)  # only this topology's namespace
        args = (
            SYSTEM_PYTHON,
            "-c",
            SPRAY,
            DNS_UPSTREAM,
            "n0.slow.example.test",
            *(("marked",) if marked else ()),
        )
        caps = ("--inh-caps=+net_raw", "--ambient-caps=+net_raw") if marked else ()
        spray = ctopo.ns(
            ctopo.pod,
            *("setpriv", f"--reuid={B}", f"--regid={B}", "--clear-groups", *caps, *args),
            check=False,
            timeout=60,
        )
        assert spray.returncode == 0, spray.stderr
        assert int(spray.stdout) > 10000, spray.stdout  # most ephemeral ports hold an entry of B's
        burst = as_uid(
            ctopo, A, SYSTEM_PYTHON, "-c", BURST_CHECK, DNS_UPSTREAM, str(BURST_N), f"{UP_NET}.5", timeout=30
        )
        assert burst.returncode == 0, burst.stderr
        assert json.loads(burst.stdout) == {"ok": BURST_N}, (
            f"subject A's answers after B's spray: {burst.stdout}"
        )
    finally:
        remove(cdaemon, "ub")
        remove(cdaemon, "ua")
