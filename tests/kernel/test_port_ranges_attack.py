"""Port RANGES of DNS leases, attacked with real DNS and real packets (docs/reference/behaviour.md §18,
§14.1, §9), fleet and sidecar profiles.

The regression net for the lease port-range layout: a lease whose range part equals a
per-policy shared range set may live in a plain hash set of addresses, the others in the
pipapo set of ``address . proto . port range`` elements. Whatever the layout, the behaviour is
the one §18 states and these tests pin down black-box:

* a name's lease opens its address exactly on the name's ports and ranges, per protocol, the
  bounds included and the neighbours excluded, for the subject that resolved it only;
* two names with different ranges on different addresses each get their own range; one
  address taught by both names gets the union, nothing more (also with overlapping ranges,
  a tcp and a udp rule with the same range, a range written as two adjacent halves);
* an in-place policy change recomputes every held lease's ports under the new policy without
  a new DNS answer (narrowing, widening, reordering, a rule added that changes which range is
  the most common one, a name's range moved to another one), and a re-learn under the new
  scope opens the new range only;
* a lease expires with its ranges; the refresh renews an active one with exactly its ranges;
* a deny rule on a range of a name is honoured beside an allow of the name.

Each probe is one TCP connection or one UDP datagram that an echo server in the upstream
namespace must answer (:data:`_ECHO`); many are sent at once (:data:`_PROBES`) so a test
stays fast although every refused probe waits for its 1 s timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

from tests.kernel.sidecar import Sidecar
from tests.kernel.test_hardening_leases import policy_route, wait_until
from tests.kernel.test_uid_subjects import SYSTEM_PYTHON, uidd, utopo  # noqa: F401 (fixtures)
from tests.kernel.test_uid_subjects import A as UID_A
from tests.kernel.test_uid_subjects import B as UID_B
from tests.kernel.test_uid_subjects import as_uid as uid_as
from tests.kernel.test_uid_subjects import bind as uid_bind
from tests.kernel.test_uid_subjects import dig as uid_dig
from tests.kernel.test_uid_subjects import remove as uid_remove
from tests.kernel.topology import (
    GATEWAY6,
    UP_NET,
    UPSTREAM_IPS,
    UPSTREAM_IPS6,
    Daemon,
    Topology,
    cleanup_stale,
    envelope,
)

DPR = "sandbox.data-plane-ready"
A_IP = f"{UP_NET}.2"  # a.test
B_IP = f"{UP_NET}.3"  # b.test (secret-exfil.test, xn--vil-9la.test too)
DEEP_IP = f"{UP_NET}.4"  # deep.test
EX_IP = f"{UP_NET}.5"  # example.test
CDN_IP = f"{UP_NET}.6"  # api.example.test and h2.example.test: one address, two names
XY_IP = f"{UP_NET}.7"  # x.y.example.test
V6_IP = "fd00:204::2"  # v6.test (AAAA)

TCP_PORTS = (22, 7999, 8000, 8050, 8099, 8100, 8499, 8500, 8999, 9000, 9050, 9099, 9100, 9500, 9501)
UDP_PORTS = (8000, 8500, 9050, 9500)

# TCP on every address of both families (one dual-stack listener per port); UDP one socket per
# address so that the reply leaves from the address the datagram was sent to.
_ECHO = """
import socket, sys, threading
def tcp_listener(port):
    s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port)); s.listen(128)
    return s
def tcp(s):
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
def serve(c):
    try:
        while True:
            d = c.recv(4096)
            if not d:
                return
            c.sendall(d)
    except OSError:
        return
def udp_socket(ip, port):
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, port))
    return s
def udp(s):
    while True:
        d, a = s.recvfrom(4096); s.sendto(d, a)
tcps = [tcp_listener(int(p)) for p in sys.argv[1].split(",")]
udps = [udp_socket(ip, int(p)) for p in sys.argv[2].split(",") for ip in sys.argv[3].split(",")]
for s in tcps:
    threading.Thread(target=tcp, args=(s,), daemon=True).start()
for s in udps:
    threading.Thread(target=udp, args=(s,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

# Probes in parallel: argv[1] is a JSON list of [proto, host, port]; prints a JSON list of booleans.
_PROBES = """
import json, socket, sys, threading
checks = json.loads(sys.argv[1]); out = {}
def one(i, proto, host, port):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    ok = False
    try:
        if proto == "tcp":
            s = socket.create_connection((host, port), timeout=1.0)
            s.sendall(b"ping"); ok = s.recv(16) == b"ping"
        else:
            s = socket.socket(fam, socket.SOCK_DGRAM); s.settimeout(1.0)
            s.sendto(b"ping", (host, port)); ok = s.recvfrom(16)[0] == b"ping"
        s.close()
    except OSError:
        ok = False
    out[i] = ok
ts = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(checks)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(json.dumps([out[i] for i in range(len(checks))]))
"""

# One TCP connection per port, each pinged every 0.2 s; prints "<port> ok|dead" per ping.
_HOLD = """
import socket, sys, time
host, ports, seconds = sys.argv[1], [int(p) for p in sys.argv[2].split(",")], float(sys.argv[3])
socks = {p: socket.create_connection((host, p), timeout=1.0) for p in ports}
print("up", flush=True)
end = time.time() + seconds
dead = set()
while time.time() < end:
    for p, s in socks.items():
        if p in dead:
            continue
        try:
            s.sendall(b"ping"); ok = s.recv(16) == b"ping"
        except OSError:
            ok = False
        if not ok:
            dead.add(p)
        print(p, "ok" if ok else "dead", flush=True)
    time.sleep(0.2)
"""


def _spawn_echo(t: Topology) -> subprocess.Popen[str]:
    return t.spawn(
        t.up,
        "python3",
        "-c",
        _ECHO,
        ",".join(map(str, TCP_PORTS)),
        ",".join(map(str, UDP_PORTS)),
        ",".join(UPSTREAM_IPS + UPSTREAM_IPS6),
        ready_line="ready",
    )


# ---- probing ------------------------------------------------------------------------------------


def _parse(spec: str) -> tuple[str, int]:
    proto, _, port = spec.partition("/")
    return proto, int(port)


def verdicts(topo: Topology, sb: int, checks: Sequence[tuple[str, str, int]]) -> list[bool]:
    out = topo.ns(topo.sb(sb), "python3", "-c", _PROBES, json.dumps(list(checks)), check=False, timeout=20)
    return [bool(v) for v in json.loads(out.stdout)]


def expect(
    topo: Topology,
    sb: int,
    want: Mapping[str, tuple[Sequence[str], Sequence[str]]],
    why: str = "",
) -> None:
    """``want``: address -> (specs that must be open, specs that must be closed); a spec is
    ``"tcp/8500"``. Every probe is sent at once; the failure names every wrong one."""
    checks: list[tuple[str, str, int]] = []
    wanted: list[bool] = []
    for ip, (opened, closed) in want.items():
        for spec, ok in [(s, True) for s in opened] + [(s, False) for s in closed]:
            proto, port = _parse(spec)
            checks.append((proto, ip, port))
            wanted.append(ok)
    got = verdicts(topo, sb, checks)
    wrong = [
        f"{p}/{ip}:{port} {'open' if g else 'closed'} (want {'open' if w else 'closed'})"
        for (p, ip, port), g, w in zip(checks, got, wanted, strict=True)
        if g != w
    ]
    assert not wrong, f"{why}: " + "; ".join(wrong)


# ---- fleet helpers ------------------------------------------------------------------------------


def bind(d: Daemon, policy: object, i: int = 1) -> None:
    code, body = d.post(envelope("SET_BINDING", f"sb{i}", ip=Topology.sb_ip(i), policy=json.dumps(policy)))
    assert (code, body) == (200, "{}"), body


def activate(d: Daemon, policy: object, i: int = 1) -> None:
    bind(d, policy, i)
    assert d.post(envelope("LIFECYCLE_HOOK", f"sb{i}", hook=DPR)) == (200, "{}")


def deny_default(*rules: Mapping[str, object]) -> dict[str, object]:
    return {"defaultAction": "deny", "egress": list(rules)}


def tcp(target: str, *ports: object, action: str = "allow") -> dict[str, object]:
    return {"action": action, "target": target, "protocol": "tcp", "ports": list(ports)}


def udp(target: str, *ports: object, action: str = "allow") -> dict[str, object]:
    return {"action": action, "target": target, "protocol": "udp", "ports": list(ports)}


def queries(topo: Topology, name: str) -> int:
    return sum(1 for q in topo.upstream_queries() if q.rstrip(".").lower() == name)


R8 = "8000-8999"
R9 = "9000-9099"
IN_R8 = ["tcp/8000", "tcp/8500", "tcp/8999"]
OUT_R8 = ["tcp/7999", "tcp/9000"]
IN_R9 = ["tcp/9000", "tcp/9050", "tcp/9099"]
OUT_R9 = ["tcp/8999", "tcp/9100"]


@pytest.fixture(scope="module")
def recho(topo: Topology) -> Iterator[subprocess.Popen[str]]:
    proc = _spawn_echo(topo)
    try:
        yield proc
    finally:
        topo.stop(proc)


def test_control_every_probed_port_answers_where_the_policy_opens_it(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """A "closed" below means refused by egressd, not unserved: every probed port answers when
    an address rule opens it (v4 and v6, TCP and UDP)."""
    activate(daemon, deny_default({"action": "allow", "target": XY_IP}))
    every = [f"tcp/{p}" for p in TCP_PORTS] + [f"udp/{p}" for p in UDP_PORTS]
    expect(topo, 1, {XY_IP: (every, [])}, "control v4")
    env = envelope(
        "SET_BINDING",
        "v6c",
        ip=topo.sb_ip6(1),
        gateway=GATEWAY6,
        policy=json.dumps(deny_default({"action": "allow", "target": V6_IP})),
    )
    assert daemon.post(env) == (200, "{}")
    assert daemon.post(envelope("LIFECYCLE_HOOK", "v6c", hook=DPR)) == (200, "{}")
    expect(topo, 1, {V6_IP: (every, [])}, "control v6")


# ---- 1. one name, a single port and a range ---------------------------------------------------


def test_a_single_port_and_a_range_open_exactly_there_for_the_resolving_subject_only(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    pol = deny_default(
        tcp("a.test", 443, R8),
        {"action": "allow", "target": "b.test", "ports": [443, R8]},  # ports alone: TCP and UDP
    )
    activate(daemon, pol, 1)
    activate(daemon, pol, 2)  # the same policy, never resolves anything
    expect(topo, 1, {A_IP: ([], ["tcp/8500"])}, "not learned yet")
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    expect(
        topo,
        1,
        {A_IP: (IN_R8, ["tcp/7999", "tcp/9000", "tcp/22", "tcp/9500", "udp/8500", "udp/8000"])},
        "a.test under tcp [443, 8000-8999]",
    )
    assert topo.reaches(1, A_IP, 443)
    assert not topo.reaches(1, A_IP, 80)
    # ports without protocol: both protocols, the same range.
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    expect(
        topo,
        1,
        {B_IP: ([*IN_R8, "udp/8000", "udp/8500"], ["tcp/7999", "tcp/9000", "udp/9050", "tcp/22"])},
        "b.test under [443, 8000-8999] (tcp and udp)",
    )
    assert topo.reaches(1, B_IP, 443)
    # The other subject never resolved: nothing is open for it, on any of them.
    expect(topo, 2, {A_IP: ([], ["tcp/8000", "tcp/8500"]), B_IP: ([], ["tcp/8500", "udp/8500"])}, "sb2")
    assert not topo.reaches(2, A_IP, 443)


def test_two_subjects_same_name_different_ranges_never_share(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """A per-subject layout must stay per subject: sb1's range for a.test is not sb2's."""
    activate(daemon, deny_default(tcp("a.test", R8), tcp("b.test", R8)), 1)
    activate(daemon, deny_default(tcp("a.test", R9), tcp("b.test", R9)), 2)
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(2, "a.test") == ("NOERROR", [A_IP])
    expect(topo, 1, {A_IP: (IN_R8, IN_R9)}, "sb1 a.test R8")
    expect(topo, 2, {A_IP: (IN_R9, IN_R8)}, "sb2 a.test R9")
    expect(topo, 2, {B_IP: ([], ["tcp/9050", "tcp/8500"])}, "sb2 never resolved b.test")


def test_a_range_on_an_ipv6_lease(topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]) -> None:
    """A subject bound by its IPv6 address (a subject is its source address): the v6 sets."""

    def bind6(policy: object) -> None:
        env = envelope("SET_BINDING", "v6", ip=topo.sb_ip6(1), gateway=GATEWAY6, policy=json.dumps(policy))
        assert daemon.post(env) == (200, "{}")

    bind6(deny_default(tcp("v6.test", R8), tcp("a.test", R8), tcp("b.test", R9)))
    assert daemon.post(envelope("LIFECYCLE_HOOK", "v6", hook=DPR)) == (200, "{}")
    expect(topo, 1, {V6_IP: ([], ["tcp/8500"])}, "v6 not learned")
    assert topo.dig(1, "v6.test", "AAAA", server=GATEWAY6) == ("NOERROR", [V6_IP])
    expect(topo, 1, {V6_IP: (IN_R8, ["tcp/7999", "tcp/9000", "udp/8500", "tcp/22"])}, "v6.test R8")
    bind6(deny_default(tcp("v6.test", "8000-8099"), tcp("a.test", R8), tcp("b.test", R9)))
    expect(topo, 1, {V6_IP: (["tcp/8000", "tcp/8050", "tcp/8099"], ["tcp/8100", "tcp/8500"])}, "v6 narrowed")
    bind6(deny_default(tcp("v6.test", R9), tcp("a.test", R8), tcp("b.test", R9)))
    expect(topo, 1, {V6_IP: (IN_R9, IN_R8)}, "v6 moved to R9")
    bind6(deny_default(udp("v6.test", R8), tcp("a.test", R8), tcp("b.test", R9)))
    expect(topo, 1, {V6_IP: (["udp/8500", "udp/8000"], ["tcp/8500", "tcp/9050", "udp/9050"])}, "v6 udp R8")


# ---- 2. two names, two ranges; one address, two names ------------------------------------------


def test_two_names_two_ranges_each_address_gets_its_own(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    # R8 is the range of three rules, R9 of one: whatever "shared" means, one of each kind.
    activate(
        daemon,
        deny_default(tcp("a.test", R8), tcp("b.test", R9), tcp("deep.test", R8), tcp("x.y.example.test", R8)),
    )
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    assert topo.dig(1, "x.y.example.test") == ("NOERROR", [XY_IP])
    expect(
        topo,
        1,
        {
            A_IP: (IN_R8, [*IN_R9, "tcp/7999"]),
            B_IP: (IN_R9, [*IN_R8, "tcp/9100"]),
            XY_IP: (IN_R8, IN_R9),
            DEEP_IP: ([], ["tcp/8500"]),  # allowed, never resolved
        },
        "each name its own range",
    )


def test_one_address_taught_by_two_names_opens_the_union_and_nothing_more(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    rules = [tcp("api.example.test", R8), tcp("h2.example.test", R9), tcp("a.test", R8)]
    activate(daemon, deny_default(*rules))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [CDN_IP])
    expect(topo, 1, {CDN_IP: (IN_R8, [*IN_R9, "tcp/7999"])}, "api only")
    assert topo.dig(1, "h2.example.test") == ("NOERROR", [CDN_IP])
    union = IN_R8 + IN_R9
    expect(topo, 1, {CDN_IP: (union, ["tcp/7999", "tcp/9100", "tcp/9500", "udp/8500", "udp/9050"])}, "union")
    # The same lease asked again by the first name: still the union.
    assert topo.dig(1, "api.example.test") == ("NOERROR", [CDN_IP])
    expect(topo, 1, {CDN_IP: (union, ["tcp/7999", "tcp/9100"])}, "union after api again")
    # A narrowing that drops one name: the address keeps the other name's range only.
    bind(daemon, deny_default(tcp("api.example.test", R8), tcp("a.test", R8)))
    expect(topo, 1, {CDN_IP: (IN_R8, IN_R9)}, "h2 dropped: R8 only")
    # And back to two names where each has the other's range: recomputed, no re-resolve.
    bind(daemon, deny_default(tcp("api.example.test", R9), tcp("a.test", R8)))
    expect(topo, 1, {CDN_IP: (IN_R9, IN_R8)}, "api moved to R9")


def test_two_names_same_range_on_one_address_then_one_diverges(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """The union of two equal ranges is that range (a shared-range lease); when one name's
    range changes the union is no longer the shared one and must still be exact."""
    activate(daemon, deny_default(tcp("api.example.test", R8), tcp("h2.example.test", R8)))
    assert topo.dig(1, "api.example.test") == ("NOERROR", [CDN_IP])
    assert topo.dig(1, "h2.example.test") == ("NOERROR", [CDN_IP])
    expect(topo, 1, {CDN_IP: (IN_R8, ["tcp/7999", "tcp/9000"])}, "R8 twice")
    bind(daemon, deny_default(tcp("api.example.test", R8), tcp("h2.example.test", "8000-8099", R9)))
    expect(topo, 1, {CDN_IP: (IN_R8 + IN_R9, ["tcp/7999", "tcp/9100"])}, "R8 + (8000-8099, R9)")
    bind(daemon, deny_default(tcp("api.example.test", "8000-8099"), tcp("h2.example.test", "8000-8099")))
    expect(
        topo, 1, {CDN_IP: (["tcp/8000", "tcp/8099"], ["tcp/8100", "tcp/8500", "tcp/9050"])}, "both narrowed"
    )


# ---- 3. overlapping ranges, tcp and udp with the same range ------------------------------------


def test_overlapping_ranges_and_tcp_udp_with_the_same_range(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    activate(
        daemon,
        deny_default(
            tcp("a.test", R8),
            tcp("a.test", "8500-9500"),  # overlaps: first match per port, the union opens
            tcp("b.test", R8),
            udp("b.test", R8),  # the same range for both protocols
            tcp("x.y.example.test", R8),
            udp("x.y.example.test", R9),  # a different range per protocol
            tcp("api.example.test", R8),
            tcp("h2.example.test", "8500-9500"),  # overlapping ranges from two names, one address
        ),
    )
    for name, ip in (("a.test", A_IP), ("b.test", B_IP), ("x.y.example.test", XY_IP)):
        assert topo.dig(1, name) == ("NOERROR", [ip])
    assert topo.dig(1, "api.example.test") == ("NOERROR", [CDN_IP])
    assert topo.dig(1, "h2.example.test") == ("NOERROR", [CDN_IP])
    over_open = ["tcp/8000", "tcp/8500", "tcp/8999", "tcp/9000", "tcp/9500"]
    over_closed = ["tcp/7999", "tcp/9501", "udp/8500", "udp/9050"]
    expect(
        topo,
        1,
        {
            A_IP: (over_open, over_closed),
            CDN_IP: (over_open, over_closed),
            B_IP: ([*IN_R8, "udp/8000", "udp/8500"], ["tcp/9000", "udp/9050", "udp/9500"]),
            XY_IP: ([*IN_R8, "udp/9050"], ["udp/8500", "udp/8000", "tcp/9050", "udp/9500"]),
        },
        "overlaps and protocols",
    )


def test_a_range_written_in_adjacent_halves_is_the_same_range(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    activate(
        daemon,
        deny_default(
            tcp("a.test", "8000-8499", "8500-8999"), tcp("b.test", R8), tcp("deep.test", 8000, "8001-8999")
        ),
    )
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    assert topo.dig(1, "deep.test") == ("NOERROR", [DEEP_IP])
    same = (["tcp/8000", "tcp/8499", "tcp/8500", "tcp/8999"], ["tcp/7999", "tcp/9000"])
    expect(topo, 1, {A_IP: same, B_IP: same, DEEP_IP: same}, "adjacent halves")


# ---- 4. narrowing and widening of a held lease's range -----------------------------------------


def test_narrowing_a_range_closes_the_cut_part_at_once_and_widening_reopens_it(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """§14.1 / §18 "Narrowing by port": "an in-place change recomputes each lease's ports under
    the new policy in the swap's transaction" (and egressd.subject.leases.narrowed_for: "opening
    the union of those names' scopes under the new policy"): the same recomputation runs on a
    widening, so a still-held lease gets the wider range back without a new DNS answer."""
    others = [tcp("b.test", "8000-8099"), tcp("x.y.example.test", "8000-8099")]
    activate(daemon, deny_default(tcp("a.test", R8), *others))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    asked = queries(topo, "a.test")
    holder = topo.spawn(topo.sb(1), "python3", "-c", _HOLD, A_IP, "8050,8500", "5", ready_line="up")
    try:
        time.sleep(0.6)
        # a.test narrowed to exactly the range the other rules use.
        bind(daemon, deny_default(tcp("a.test", "8000-8099"), *others))
        out, _ = holder.communicate(timeout=30)
    finally:
        topo.stop(holder)
    seen: dict[str, list[str]] = {"8050": [], "8500": []}
    for line in out.splitlines():
        port, verdict = line.split()
        seen[port].append(verdict)
    assert seen["8500"] and seen["8500"][-1] == "dead", "a flow on a cut port survived: " + out
    assert seen["8050"] and "dead" not in seen["8050"], "a flow on a kept port was cut: " + out
    narrowed = (["tcp/8000", "tcp/8050", "tcp/8099"], ["tcp/8100", "tcp/8500", "tcp/8999", "tcp/7999"])
    expect(topo, 1, {A_IP: narrowed, B_IP: narrowed}, "narrowed to 8000-8099")
    # Widening back: re-scoped without re-resolving.
    bind(daemon, deny_default(tcp("a.test", R8), *others))
    expect(topo, 1, {A_IP: (IN_R8, OUT_R8), B_IP: narrowed}, "widened back to 8000-8999")
    # Widening b.test's too (now a.test and b.test share a range again, x.y never resolved).
    bind(daemon, deny_default(tcp("a.test", R8), tcp("b.test", R8), tcp("x.y.example.test", "8000-8099")))
    expect(topo, 1, {A_IP: (IN_R8, OUT_R8), B_IP: (IN_R8, OUT_R8), XY_IP: ([], ["tcp/8000"])}, "b widened")
    assert queries(topo, "a.test") == asked, "the test re-resolved a.test: it must not"


def test_narrowing_away_every_port_of_a_range_lease_closes_the_address(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """The name no longer allowed at all (§14.1): its lease goes, wherever its range lived."""
    activate(daemon, deny_default(tcp("a.test", R8), tcp("b.test", R8), tcp("deep.test", R9)))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    assert topo.dig(1, "deep.test") == ("NOERROR", [DEEP_IP])
    bind(daemon, deny_default(tcp("b.test", R8)))
    expect(
        topo,
        1,
        {A_IP: ([], ["tcp/8000", "tcp/8500"]), B_IP: (IN_R8, OUT_R8), DEEP_IP: ([], ["tcp/9050"])},
        "a.test and deep.test dropped",
    )
    # A deny rule for b.test's address (a prefix) takes its lease too.
    bind(daemon, deny_default({"action": "deny", "target": B_IP + "/32"}, tcp("b.test", R8)))
    expect(topo, 1, {B_IP: ([], ["tcp/8500", "tcp/8000"])}, "b.test's address denied")


# ---- 5. reordering and adding rules changes which range is common ------------------------------


def test_reordering_and_adding_range_rules_keeps_every_lease_exactly_its_own(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    p1 = deny_default(tcp("a.test", R8), tcp("b.test", R9))
    activate(daemon, p1)
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    want = {A_IP: (IN_R8, IN_R9), B_IP: (IN_R9, IN_R8)}
    expect(topo, 1, want, "p1")
    # Swapped order.
    bind(daemon, deny_default(tcp("b.test", R9), tcp("a.test", R8)))
    expect(topo, 1, want, "swapped")
    # R9 made the most common range by rules for names not resolved (and placed first).
    bind(
        daemon,
        deny_default(
            tcp("deep.test", R9),
            tcp("x.y.example.test", R9),
            tcp("api.example.test", R9),
            tcp("b.test", R9),
            tcp("a.test", R8),
        ),
    )
    expect(topo, 1, want, "R9 common")
    # ... then R8.
    bind(
        daemon,
        deny_default(
            tcp("deep.test", R8),
            tcp("x.y.example.test", R8),
            tcp("api.example.test", R8),
            tcp("a.test", R8),
            tcp("b.test", R9),
        ),
    )
    expect(topo, 1, want, "R8 common")
    # New names learned now under the R8-common policy get their own ranges too.
    assert topo.dig(1, "x.y.example.test") == ("NOERROR", [XY_IP])
    assert topo.dig(1, "api.example.test") == ("NOERROR", [CDN_IP])
    expect(topo, 1, {**want, XY_IP: (IN_R8, IN_R9), CDN_IP: (IN_R8, IN_R9)}, "learned under R8 common")
    # The common range changes back to R9; a second range added to a.test's rule.
    bind(
        daemon,
        deny_default(
            tcp("deep.test", R9),
            tcp("h2.example.test", R9),
            tcp("x.y.example.test", R9),
            tcp("a.test", R8, "9500"),
            tcp("b.test", R9),
            tcp("api.example.test", R8),
        ),
    )
    expect(
        topo,
        1,
        {
            A_IP: ([*IN_R8, "tcp/9500"], [*IN_R9, "tcp/9501"]),
            B_IP: (IN_R9, IN_R8),
            XY_IP: (IN_R9, IN_R8),  # its own rule moved to R9: re-scoped in place
            CDN_IP: (IN_R8, IN_R9),  # h2 never taught this subject the address
        },
        "R9 common again",
    )


# ---- 6. re-learn under a changed scope ----------------------------------------------------------


def test_relearning_after_the_range_changed_opens_the_new_range_only(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    activate(daemon, deny_default(tcp("a.test", R8), tcp("b.test", R8)))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    expect(topo, 1, {A_IP: (IN_R8, IN_R9)}, "R8")
    bind(daemon, deny_default(tcp("a.test", R9), tcp("b.test", R8)))
    expect(topo, 1, {A_IP: (IN_R9, IN_R8)}, "re-scoped to R9 in place")
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    expect(topo, 1, {A_IP: (IN_R9, IN_R8)}, "re-learned under R9")
    bind(daemon, deny_default(tcp("a.test", R8), tcp("b.test", R8)))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])  # twice: a renewal of the same scope
    expect(topo, 1, {A_IP: (IN_R8, IN_R9)}, "back to R8, re-learned")
    # A second rule for a.test with another range and udp: the re-learn opens the union.
    bind(daemon, deny_default(tcp("a.test", R8), udp("a.test", R9), tcp("b.test", R8)))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    expect(topo, 1, {A_IP: ([*IN_R8, "udp/9050"], [*IN_R9, "udp/8500"])}, "tcp R8 + udp R9")


# ---- the "shared range" itself: a subset, halves that add up to it, a rebind ------------------


def test_a_lease_whose_ranges_are_a_part_of_the_common_ranges_gets_that_part_only(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """The most common ranges here are tcp AND udp 8000-8999 (rules with ``ports`` and no
    protocol); a lease with the tcp half only, or the udp half only, or the tcp half plus a
    single port, must not get the whole common set."""
    both = [
        {"action": "allow", "target": n, "ports": [R8]}
        for n in ("deep.test", "x.y.example.test", "api.example.test")
    ]
    activate(daemon, deny_default(*both, tcp("a.test", R8), udp("b.test", R8), tcp("example.test", R8, 9050)))
    for name, ip in (("deep.test", DEEP_IP), ("a.test", A_IP), ("b.test", B_IP), ("example.test", EX_IP)):
        assert topo.dig(1, name) == ("NOERROR", [ip]), name
    expect(
        topo,
        1,
        {
            DEEP_IP: ([*IN_R8, "udp/8000", "udp/8500"], ["tcp/7999", "tcp/9000", "udp/9050"]),
            A_IP: (IN_R8, ["udp/8000", "udp/8500", "tcp/9000"]),
            B_IP: (["udp/8000", "udp/8500"], ["tcp/8000", "tcp/8500", "tcp/8999", "udp/9050"]),
            EX_IP: ([*IN_R8, "tcp/9050"], ["udp/8500", "tcp/9000", "tcp/9099", "udp/9050"]),
        },
        "parts of the common ranges",
    )
    # The common ranges become tcp 8000-8999 alone: deep.test (both protocols) keeps its udp.
    bind(
        daemon,
        deny_default(
            {"action": "allow", "target": "deep.test", "ports": [R8]},
            *[tcp(n, R8) for n in ("x.y.example.test", "api.example.test", "h2.example.test", "a.test")],
            udp("b.test", R8),
            tcp("example.test", R8, 9050),
        ),
    )
    expect(
        topo,
        1,
        {
            DEEP_IP: ([*IN_R8, "udp/8000", "udp/8500"], ["tcp/7999", "tcp/9000"]),
            A_IP: (IN_R8, ["udp/8500"]),
            B_IP: (["udp/8500"], ["tcp/8500"]),
            EX_IP: ([*IN_R8, "tcp/9050"], ["udp/8500", "tcp/9000"]),
        },
        "common ranges tcp only",
    )


def test_two_halves_on_one_address_add_up_to_the_common_range_then_one_half_goes(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """api 8000-8499 + h2 8500-8999 on one address: the union is exactly the range three
    other rules share; a narrowing that drops h2 must leave 8000-8499 only."""
    common = [tcp(n, R8) for n in ("a.test", "b.test", "deep.test")]
    activate(
        daemon,
        deny_default(*common, tcp("api.example.test", "8000-8499"), tcp("h2.example.test", "8500-8999")),
    )
    assert topo.dig(1, "api.example.test") == ("NOERROR", [CDN_IP])
    expect(topo, 1, {CDN_IP: (["tcp/8000", "tcp/8499"], ["tcp/8500", "tcp/8999"])}, "api's half")
    assert topo.dig(1, "h2.example.test") == ("NOERROR", [CDN_IP])
    expect(topo, 1, {CDN_IP: (["tcp/8000", "tcp/8499", "tcp/8500", "tcp/8999"], OUT_R8)}, "both halves")
    bind(daemon, deny_default(*common, tcp("api.example.test", "8000-8499")))
    expect(topo, 1, {CDN_IP: (["tcp/8000", "tcp/8499"], ["tcp/8500", "tcp/8999", "tcp/9000"])}, "h2 dropped")
    bind(daemon, deny_default(*common, tcp("api.example.test", "8500-8999")))
    expect(
        topo, 1, {CDN_IP: (["tcp/8500", "tcp/8999"], ["tcp/8000", "tcp/8499", "tcp/7999"])}, "api other half"
    )


def test_revert_remove_and_rebind_forget_range_leases(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """The lease book is emptied by a revert, a removal and a rebind (§9 "Deviation"): the
    kernel forgets the ranges too, wherever they were held."""
    pol = deny_default(tcp("a.test", R8), tcp("b.test", R8), tcp("deep.test", R9))
    activate(daemon, pol)
    for name, ip in (("a.test", A_IP), ("deep.test", DEEP_IP)):
        assert topo.dig(1, name) == ("NOERROR", [ip])
    expect(topo, 1, {A_IP: (IN_R8, IN_R9), DEEP_IP: (IN_R9, IN_R8)}, "learned")
    code, body = daemon.post(envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=None))  # revert
    assert code == 200, body
    activate(daemon, pol)
    forgotten: dict[str, tuple[list[str], list[str]]] = {
        A_IP: ([], ["tcp/8000", "tcp/8500"]),
        DEEP_IP: ([], ["tcp/9050"]),
    }
    expect(topo, 1, forgotten, "after a revert and the same policy again")
    for name, ip in (("a.test", A_IP), ("deep.test", DEEP_IP)):
        assert topo.dig(1, name) == ("NOERROR", [ip])
    code, body = daemon.post(envelope("REMOVE_BINDING", "sb1"))
    assert code == 200, body
    activate(daemon, pol)
    expect(topo, 1, forgotten, "after a removal and a new binding")
    for name, ip in (("a.test", A_IP), ("deep.test", DEEP_IP)):
        assert topo.dig(1, name) == ("NOERROR", [ip])
    # A rebind (a new attachment of the same sandbox).
    code, body = daemon.post(
        envelope("SET_BINDING", "sb1", aid="a2", ip=topo.sb_ip(1), policy=json.dumps(pol))
    )
    assert code == 200, body
    daemon.post(envelope("LIFECYCLE_HOOK", "sb1", aid="a2", hook=DPR))
    expect(topo, 1, forgotten, "after a rebind")
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    expect(topo, 1, {A_IP: (IN_R8, IN_R9), DEEP_IP: ([], ["tcp/9050"])}, "re-learned after the rebind")


def test_the_lease_cap_counts_port_elements_as_today(topo: Topology, recho: subprocess.Popen[str]) -> None:
    """§18: "the port-scoped lease elements of a subject are bounded by twice the lease cap
    (§14.4; an answer whose ports do not fit is trimmed)". With a cap of 2 (4 port elements),
    a name with three ranges fits once; a second such name does not (SERVFAIL, nothing
    opened), even though all three names share the same ranges; a single port still fits.
    (Today's behaviour, asserted: a layout that holds a shared-range lease as one element
    would change it.)"""
    rng = ["8000-8099", "8500-8599", "9000-9099"]
    with Daemon(
        topo, table="egt-prange-cap", port=18396, env={"EGRESSD_MAX_LEASES_PER_SUBJECT": "2"}
    ).running() as d:
        activate(
            d,
            deny_default(
                *[tcp(n, *rng) for n in ("b.test", "deep.test", "example.test")],
                tcp("x.y.example.test", 8050),
            ),
        )
        assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
        status, answers = topo.dig(1, "deep.test")
        assert status == "SERVFAIL" and not answers, (status, answers)
        assert topo.dig(1, "x.y.example.test") == ("NOERROR", [XY_IP])
        expect(
            topo,
            1,
            {
                B_IP: (["tcp/8000", "tcp/8050", "tcp/9050"], ["tcp/8100", "tcp/8999", "tcp/9100"]),
                DEEP_IP: ([], ["tcp/8050", "tcp/9050"]),
                XY_IP: (["tcp/8050"], ["tcp/8000", "tcp/9050"]),
            },
            "cap of 2",
        )


def test_an_always_rules_reload_rescopes_range_leases_like_a_policy_change(
    topo: Topology, recho: subprocess.Popen[str]
) -> None:
    """The always-rules reload is its own path to the dyn sets (§14.1): a name denied there
    loses its lease; the other leases keep exactly their ranges, also when the reload changes
    which rules the effective policy holds (a whole allow.always name, then a removal)."""
    rules_dir = topo.workdir / "always-prange"
    rules_dir.mkdir(exist_ok=True)
    for f in ("deny.always", "allow.always"):
        (rules_dir / f).unlink(missing_ok=True)
    env = {"EGRESSD_ALWAYS_RULES_DIR": str(rules_dir), "EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL": "1"}
    with Daemon(topo, table="egt-prange-always", port=18393, env=env).running() as d:
        activate(d, deny_default(tcp("a.test", R8), tcp("b.test", R8), tcp("deep.test", R9)))
        for name, ip in (("a.test", A_IP), ("b.test", B_IP), ("deep.test", DEEP_IP)):
            assert topo.dig(1, name) == ("NOERROR", [ip])
        (rules_dir / "deny.always").write_text("b.test\n")
        wait_until(lambda: topo.dig(1, "b.test")[0] == "NXDOMAIN", "the deny.always reload", d=d)
        expect(
            topo,
            1,
            {A_IP: (IN_R8, IN_R9), B_IP: ([], ["tcp/8000", "tcp/8500"]), DEEP_IP: (IN_R9, IN_R8)},
            "b.test always-denied",
        )
        (rules_dir / "allow.always").write_text("example.test\n")
        wait_until(lambda: topo.dig(1, "example.test")[0] == "NOERROR", "the allow.always reload", d=d)
        expect(
            topo,
            1,
            {A_IP: (IN_R8, IN_R9), DEEP_IP: (IN_R9, IN_R8), EX_IP: (["tcp/8500", "tcp/9050", "tcp/22"], [])},
            "example.test always-allowed (whole)",
        )
        (rules_dir / "deny.always").unlink()
        wait_until(lambda: topo.dig(1, "b.test")[0] == "NOERROR", "the deny.always removal", d=d)
        expect(
            topo,
            1,
            {A_IP: (IN_R8, IN_R9), B_IP: (IN_R8, IN_R9), DEEP_IP: (IN_R9, IN_R8)},
            "b.test allowed again and re-learned",
        )


def test_the_policy_route_patch_and_delete_rescope_range_leases(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """The fleet ``/policy`` route (docs/reference/policy-language.md: "An existing rule is
    replaced by every patch rule on its target; rules on one target that differ in protocol or
    ports are different rules and all kept"): each change re-scopes the held leases."""
    activate(daemon, deny_default(tcp("a.test", R8), tcp("b.test", R8), tcp("deep.test", R9)))
    for name, ip in (("a.test", A_IP), ("b.test", B_IP), ("deep.test", DEEP_IP)):
        assert topo.dig(1, name) == ("NOERROR", [ip])
    code, body = policy_route(daemon, "PATCH", [tcp("a.test", "8000-8099")])
    assert code == 200, body
    expect(
        topo,
        1,
        {
            A_IP: (["tcp/8000", "tcp/8050", "tcp/8099"], ["tcp/8100", "tcp/8500", "tcp/9050"]),
            B_IP: (IN_R8, IN_R9),
            DEEP_IP: (IN_R9, IN_R8),
        },
        "PATCH narrowed a.test",
    )
    code, body = policy_route(daemon, "PATCH", [tcp("a.test", R8), tcp("a.test", 9050)])
    assert code == 200, body
    expect(
        topo,
        1,
        {A_IP: ([*IN_R8, "tcp/9050"], ["tcp/9000", "tcp/9099", "tcp/7999"]), B_IP: (IN_R8, IN_R9)},
        "PATCH two rules on a.test",
    )
    code, body = policy_route(daemon, "DELETE", ["b.test"])
    assert code == 200, body
    expect(
        topo,
        1,
        {
            A_IP: ([*IN_R8, "tcp/9050"], ["tcp/9000"]),
            B_IP: ([], ["tcp/8000", "tcp/8500"]),
            DEEP_IP: (IN_R9, IN_R8),
        },
        "DELETE b.test",
    )


# TCP connects only, in parallel (the handshake is all that is judged): prints a JSON list.
_CONNECTS = """
import json, socket, sys, threading
checks = json.loads(sys.argv[1]); out = {}
def one(i, host, port):
    try:
        socket.create_connection((host, port), timeout=1.0).close(); out[i] = True
    except OSError:
        out[i] = False
ts = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(checks)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(json.dumps([out[i] for i in range(len(checks))]))
"""


def connects(
    topo: Topology, sb: int, want: Mapping[str, tuple[Sequence[int], Sequence[int]]], why: str
) -> None:
    checks = [(ip, p) for ip, (o, c) in want.items() for p in [*o, *c]]
    wanted = [ok for _, (o, c) in want.items() for ok in [True] * len(o) + [False] * len(c)]
    out = topo.ns(topo.sb(sb), "python3", "-c", _CONNECTS, json.dumps(checks), check=False, timeout=20).stdout
    got = json.loads(out)
    wrong = [
        f"{ip}:{p} {'accepted' if g else 'refused'}"
        for (ip, p), g, w in zip(checks, got, wanted, strict=True)
        if g != w
    ]
    assert not wrong, f"{why}: " + "; ".join(wrong)


def test_named_range_ports_under_the_mitm_are_judged_by_the_lease_on_input(
    topo: Topology, recho: subprocess.Popen[str]
) -> None:
    """With the MITM on, the ports that a domain rule names with ``ports`` and no protocol
    are intercepted (§18 "names on the wire") and refused on input by the original port: the
    handshake with the MITM succeeds only where the subject's lease opens that address and
    port. The range lease must be honoured on that path too."""
    env = {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": "18391",
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "prange-mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "prange-mitm-run" / "active.sock"),
    }
    named = [{"action": "allow", "target": n, "ports": [R8]} for n in ("deep.test", "x.y.example.test")]
    with Daemon(topo, table="egt-prange-mitm", port=18392, env=env).running(timeout=40) as d:
        activate(
            d,
            deny_default(
                {"action": "allow", "target": "b.test", "ports": [R8]}, *named, tcp("example.test", R9)
            ),
        )
        for name, ip in (("b.test", B_IP), ("x.y.example.test", XY_IP), ("example.test", EX_IP)):
            assert topo.dig(1, name) == ("NOERROR", [ip])
        connects(
            topo,
            1,
            {
                B_IP: ([8000, 8500, 8999], [7999, 9000, 9050]),
                XY_IP: ([8500], [9050]),
                DEEP_IP: ([], [8000, 8500]),  # allowed, intercepted, never learned
                EX_IP: ([9000, 9050, 9099], [8000, 8500, 9100]),  # a tcp rule: not intercepted
            },
            "learned",
        )
        bind(
            d,
            deny_default(
                {"action": "allow", "target": "b.test", "ports": ["8000-8099"]},
                *named,
                tcp("example.test", R9),
            ),
        )
        connects(
            topo,
            1,
            {B_IP: ([8000, 8050, 8099], [8100, 8500, 8999]), XY_IP: ([8500], []), EX_IP: ([9050], [8500])},
            "b.test narrowed",
        )


# ---- 7. expiry and the refresh -----------------------------------------------------------------


def test_a_range_lease_expires_and_the_refresh_renews_exactly_its_range(
    topo: Topology, recho: subprocess.Popen[str]
) -> None:
    env = {"EGRESSD_DNS_LEASE_MIN": "3", "EGRESSD_DNS_LEASE_MAX": "3", "EGRESSD_REFRESH_INTERVAL": "1"}
    with Daemon(topo, table="egt-prange-exp", port=18395, env=env).running() as d:
        activate(d, deny_default(tcp("a.test", R8), tcp("b.test", R8), tcp("deep.test", R9)))
        assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
        assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
        assert topo.dig(1, "deep.test") == ("NOERROR", [DEEP_IP])
        # Not probed before the expiry: a finished probe's conntrack entry can linger in an
        # "active" state (CLOSE_WAIT, egressd.kernel.refresh.ACTIVE_TCP_STATES) and the refresh
        # (§9) then renews the lease for 360 s. A live flow keeps a.test's lease (the refresh
        # renews it, with exactly its range); b.test and deep.test stay idle and expire.
        holder = topo.spawn(topo.sb(1), "python3", "-c", _HOLD, A_IP, "8050", "9", ready_line="up")
        try:
            time.sleep(5.0)  # > the 3 s lease, several refresh ticks
            expect(
                topo,
                1,
                {
                    A_IP: (IN_R8, [*IN_R9, "tcp/7999"]),
                    B_IP: ([], ["tcp/8000", "tcp/8500", "tcp/8999"]),
                    DEEP_IP: ([], ["tcp/9050"]),
                },
                "after expiry",
            )
        finally:
            topo.stop(holder)


def _union_renewed_by_the_later_name(
    topo: Topology, dig: Callable[[str], tuple[str, list[str]]], why: str
) -> None:
    """api.example.test (R8, the range b.test shares) learned at t0, h2.example.test (R9) on the
    same address at t0+2.5, leases of 4 s: today the later answer renews the whole union (one
    kernel element 8000-9099, expiry t0+6.5), so at t0+5 both ranges are still open, at t0+8
    both are closed. No probe before t0+5 (nothing that the refresh could see either)."""
    t0 = time.monotonic()
    assert dig("api.example.test") == ("NOERROR", [CDN_IP])
    time.sleep(max(0.0, t0 + 2.5 - time.monotonic()))
    assert dig("h2.example.test") == ("NOERROR", [CDN_IP])
    time.sleep(max(0.0, t0 + 5.0 - time.monotonic()))
    expect(topo, 1, {CDN_IP: (IN_R8 + IN_R9, ["tcp/7999", "tcp/9100"])}, why + ": at t0+5")
    time.sleep(max(0.0, t0 + 8.0 - time.monotonic()))
    expect(topo, 1, {CDN_IP: ([], ["tcp/8000", "tcp/8500", "tcp/9050"])}, why + ": at t0+8")


UNION_POLICY = deny_default(tcp("api.example.test", R8), tcp("h2.example.test", R9), tcp("b.test", R8))


def test_a_later_name_renews_the_whole_union_of_ranges_on_its_address(
    topo: Topology, recho: subprocess.Popen[str]
) -> None:
    env = {"EGRESSD_DNS_LEASE_MIN": "4", "EGRESSD_DNS_LEASE_MAX": "4", "EGRESSD_REFRESH_INTERVAL": "3600"}
    with Daemon(topo, table="egt-prange-union", port=18394, env=env).running() as d:
        activate(d, UNION_POLICY)
        _union_renewed_by_the_later_name(topo, lambda n: topo.dig(1, n), "fleet")


# ---- 8. deny on a range --------------------------------------------------------------------------


def test_a_deny_range_beside_an_allow_of_the_same_name(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """First match per port: a deny rule with a range decides those ports only, a later allow
    of the name the rest."""
    activate(
        daemon,
        deny_default(
            tcp("a.test", "8500-8999", action="deny"),
            tcp("a.test", R8, 9050),
            tcp("b.test", R8),
        ),
    )
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    expect(
        topo,
        1,
        {
            A_IP: (["tcp/8000", "tcp/8499", "tcp/9050"], ["tcp/8500", "tcp/8999", "tcp/9000", "tcp/7999"]),
            B_IP: (IN_R8, OUT_R8),
        },
        "deny 8500-8999 before allow 8000-8999",
    )


def test_a_deny_range_under_default_allow(
    topo: Topology, daemon: Daemon, recho: subprocess.Popen[str]
) -> None:
    """``defaultAction: allow`` with a deny rule on a range of a name, no MITM (so no name check).

    What today's code does, asserted: §18 "a deny rule with ports therefore denies only those
    ports of the name (the name is still answered when another rule opens it)" -- here the
    default opens the other ports, so the name is answered; the kernel keeps the address open
    on every port, the denied range included, since an address is open under
    ``defaultAction: allow`` and a DNS lease only ever opens (§18 "names on the wire": the
    deny is enforced by the name check, "refused on any address, also under defaultAction:
    allow", which needs the MITM). A deny rule without ports refuses the name in DNS instead.
    The layout change must not turn any of this into a refusal (nor a refusal into this)."""
    activate(
        daemon,
        {
            "defaultAction": "allow",
            "egress": [tcp("a.test", R8, action="deny"), {"action": "deny", "target": "b.test"}],
        },
    )
    expect(topo, 1, {A_IP: (["tcp/8500", "tcp/9050"], [])}, "before learning")
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    expect(topo, 1, {A_IP: (["tcp/8500", "tcp/9050", "tcp/7999", "udp/8500"], [])}, "after learning")
    status, answers = topo.dig(1, "b.test")
    assert status != "NOERROR" and B_IP not in answers, (status, answers)
    # Under defaultAction deny the same two rules plus an allow of the name: the range is closed.
    bind(
        daemon,
        deny_default(
            tcp("a.test", R8, action="deny"), {"action": "allow", "target": "a.test", "ports": [R8, R9]}
        ),
    )
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    expect(
        topo,
        1,
        {A_IP: ([*IN_R9, "udp/8500", "udp/9050"], [*IN_R8, "tcp/7999", "tcp/9100"])},
        "deny beats allow per port",
    )


# ---- sidecar ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egr{os.getpid()}", sandboxes=1).up_()
    try:
        _spawn_echo(t)
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(stopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(stopo, sb=1)
    try:
        yield sc
    finally:
        sc.cleanup()


def test_sidecar_ranges_union_and_exactness(sidecar: Sidecar, stopo: Topology) -> None:
    """(Not a.test: its address is the sidecar's upstream resolver, allowed whole, §8.6.)"""
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(
        deny_default(
            tcp("b.test", 443, R8),
            tcp("deep.test", R9),
            {"action": "allow", "target": "example.test", "ports": [R8]},
            tcp("api.example.test", R8),
            tcp("h2.example.test", "8500-9500"),
            tcp("x.y.example.test", R8),
            udp("x.y.example.test", R8),
        )
    )
    sidecar.start()
    expect(stopo, 1, {B_IP: ([], ["tcp/8500"]), EX_IP: ([], ["udp/8500"])}, "not learned")
    for name, ip in (
        ("b.test", B_IP),
        ("deep.test", DEEP_IP),
        ("example.test", EX_IP),
        ("api.example.test", CDN_IP),
        ("x.y.example.test", XY_IP),
    ):
        assert sidecar.dig(name) == ("NOERROR", [ip]), name
    expect(
        stopo,
        1,
        {
            B_IP: (IN_R8, ["tcp/7999", "tcp/9000", "tcp/22", "udp/8500"]),
            DEEP_IP: (IN_R9, IN_R8),
            EX_IP: ([*IN_R8, "udp/8500"], ["tcp/7999", "tcp/9000", "udp/9050"]),
            CDN_IP: (IN_R8, ["tcp/9000", "tcp/9500", "tcp/7999"]),
            XY_IP: ([*IN_R8, "udp/8000", "udp/8500"], ["tcp/9050", "udp/9050"]),
        },
        "sidecar: each its own",
    )
    assert sidecar.reaches(B_IP, 443) and not sidecar.reaches(B_IP, 80)
    assert sidecar.dig("h2.example.test") == ("NOERROR", [CDN_IP])
    expect(
        stopo,
        1,
        {CDN_IP: (["tcp/8000", "tcp/8999", "tcp/9000", "tcp/9500"], ["tcp/7999", "tcp/9501", "udp/8500"])},
        "sidecar: union of overlapping ranges",
    )


def test_sidecar_narrow_widen_reorder_relearn(sidecar: Sidecar, stopo: Topology) -> None:
    base = [tcp("deep.test", "8000-8099"), tcp("x.y.example.test", "8000-8099")]
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(deny_default(tcp("example.test", R8), *base))
    sidecar.start()
    assert sidecar.dig("example.test") == ("NOERROR", [EX_IP])
    assert sidecar.dig("deep.test") == ("NOERROR", [DEEP_IP])
    holder = stopo.spawn(stopo.sb(1), "python3", "-c", _HOLD, EX_IP, "8050,8500", "5", ready_line="up")
    try:
        time.sleep(0.6)
        sidecar.set_policy(deny_default(tcp("example.test", "8000-8099"), *base))
        out, _ = holder.communicate(timeout=30)
    finally:
        stopo.stop(holder)
    seen: dict[str, list[str]] = {"8050": [], "8500": []}
    for line in out.splitlines():
        port, verdict = line.split()
        seen[port].append(verdict)
    assert seen["8500"] and seen["8500"][-1] == "dead", "a flow on a cut port survived: " + out
    assert seen["8050"] and "dead" not in seen["8050"], "a flow on a kept port was cut: " + out
    narrowed = (["tcp/8000", "tcp/8050", "tcp/8099"], ["tcp/8100", "tcp/8500", "tcp/8999"])
    expect(stopo, 1, {EX_IP: narrowed, DEEP_IP: narrowed}, "sidecar narrowed")
    # Widening back: re-scoped in place (§18 "Narrowing by port": recomputed under the new policy).
    sidecar.set_policy(deny_default(tcp("example.test", R8), *base))
    expect(stopo, 1, {EX_IP: (IN_R8, OUT_R8), DEEP_IP: narrowed}, "sidecar widened back")
    # Reordered, R9 made common by unresolved names, example.test moved to R9 in place.
    sidecar.set_policy(
        deny_default(tcp("api.example.test", R9), tcp("h2.example.test", R9), tcp("example.test", R9), *base)
    )
    expect(stopo, 1, {EX_IP: (IN_R9, IN_R8), DEEP_IP: narrowed}, "sidecar example.test to R9")
    assert sidecar.dig("example.test") == ("NOERROR", [EX_IP])
    expect(stopo, 1, {EX_IP: (IN_R9, IN_R8)}, "sidecar re-learned under R9")
    sidecar.set_policy(deny_default(*base))
    expect(
        stopo, 1, {EX_IP: ([], ["tcp/9050", "tcp/8050"]), DEEP_IP: narrowed}, "sidecar example.test dropped"
    )


# ---- host-uid subjects (§17): the same sets, reached through the output hook's uid dispatch ------


@pytest.fixture(scope="module")
def uecho(utopo: Topology) -> Iterator[subprocess.Popen[str]]:  # noqa: F811
    proc = _spawn_echo(utopo)
    try:
        yield proc
    finally:
        utopo.stop(proc)


def uid_expect(
    topo: Topology, uid: int, want: Mapping[str, tuple[Sequence[str], Sequence[str]]], why: str
) -> None:
    checks: list[tuple[str, str, int]] = []
    wanted: list[bool] = []
    for ip, (opened, closed) in want.items():
        for spec, ok in [(s, True) for s in opened] + [(s, False) for s in closed]:
            proto, port = _parse(spec)
            checks.append((proto, ip, port))
            wanted.append(ok)
    out = uid_as(topo, uid, SYSTEM_PYTHON, "-c", _PROBES, json.dumps(checks), timeout=20).stdout
    got = [bool(v) for v in json.loads(out)]
    wrong = [
        f"{p}/{ip}:{port} {'open' if g else 'closed'} (want {'open' if w else 'closed'})"
        for (p, ip, port), g, w in zip(checks, got, wanted, strict=True)
        if g != w
    ]
    assert not wrong, f"{why}: " + "; ".join(wrong)


def test_host_uid_subjects_get_exactly_their_own_ranges(
    utopo: Topology,  # noqa: F811
    uidd: Daemon,  # noqa: F811
    uecho: subprocess.Popen[str],
) -> None:
    uid_bind(uidd, "pra", UID_A, deny_default(tcp("b.test", R8), tcp("deep.test", R9)))
    uid_bind(uidd, "prb", UID_B, deny_default(tcp("b.test", R9), tcp("deep.test", R9)))
    try:
        uid_expect(utopo, UID_A, {B_IP: ([], ["tcp/8500"])}, "uid A: not learned")
        assert uid_dig(utopo, UID_A, "b.test") == ("NOERROR", [B_IP])
        assert uid_dig(utopo, UID_A, "deep.test") == ("NOERROR", [DEEP_IP])
        uid_expect(
            utopo,
            UID_A,
            {B_IP: (IN_R8, [*IN_R9, "tcp/7999", "udp/8500"]), DEEP_IP: (IN_R9, IN_R8)},
            "uid A: each name its own range",
        )
        uid_expect(utopo, UID_B, {B_IP: ([], ["tcp/9050", "tcp/8500"])}, "uid B never resolved")
        assert uid_dig(utopo, UID_B, "b.test") == ("NOERROR", [B_IP])
        uid_expect(utopo, UID_B, {B_IP: (IN_R9, IN_R8)}, "uid B: its own range for the same name")
        # Narrowing A's range in place: A's lease re-scoped, B's untouched.
        uid_bind(
            uidd, "pra", UID_A, deny_default(tcp("b.test", "8000-8099"), tcp("deep.test", R9)), activate=False
        )
        uid_expect(
            utopo,
            UID_A,
            {B_IP: (["tcp/8000", "tcp/8050", "tcp/8099"], ["tcp/8100", "tcp/8500"]), DEEP_IP: (IN_R9, IN_R8)},
            "uid A narrowed",
        )
        uid_expect(utopo, UID_B, {B_IP: (IN_R9, IN_R8)}, "uid B after A's narrowing")
    finally:
        uid_remove(uidd, "pra")
        uid_remove(uidd, "prb")


def test_sidecar_a_range_lease_expires_and_a_later_name_renews_the_union(
    sidecar: Sidecar, stopo: Topology
) -> None:
    sidecar.env.update({"EGRESSD_DNS_LEASE_MIN": "4", "EGRESSD_DNS_LEASE_MAX": "4"})
    sidecar.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(UNION_POLICY)
    sidecar.start()
    _union_renewed_by_the_later_name(stopo, sidecar.dig, "sidecar")
