"""Source addresses a sandbox gave itself, with real processes and packets (docs/reference/behaviour.md §20.2,
docs/security.md, Known limitations).

IPv6 lets any process send with an address that is not its host's: ``IPV6_FREEBIND`` needs no
capability (IPv4's ``IP_FREEBIND`` binds, but the route lookup refuses a source that is not
local). So a sandbox without ``CAP_NET_RAW``/``CAP_NET_ADMIN`` can still claim another
sandbox's address, an upstream's, or, as a host-uid sandbox in the pod namespace, any address
at all. egressd dispatches by source address and accepts established flows first, so such a
packet was: a host-uid sandbox's lateral channel into a network sandbox (egressd's own DNS
proxy answered the forged source), a conntrack entry that let a deny-all sandbox talk to an
upstream its policy denies, a deny-all sandbox sending with its sibling's policy, and a
sandbox injecting datagrams into a sibling's established flow.

Every attacker here is unprivileged (a sandbox uid in the pod; uid 1000 without capabilities
in a sandbox namespace). Both shapes: bridged (all sandboxes on br0, ``EGRESSD_SANDBOX_IFACES``
names the bridge) and routed (one veth per sandbox; its attachment's hostVeth names it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.test_uid_subjects import SYSTEM_PYTHON, as_uid, uid_env
from tests.kernel.test_uid_subjects import bind as bind_uid
from tests.kernel.topology import GATEWAY, GATEWAY6, UPSTREAM_IPS6, Daemon, Topology, cleanup_stale, envelope

A = 100001  # a host-uid subject whose policy allows the upstream
UP6 = UPSTREAM_IPS6[0]
ECHO_PORT = 9999
DPR = "sandbox.data-plane-ready"
DENY_ALL = {"defaultAction": "deny", "egress": []}
ALLOW_UP6 = {"defaultAction": "deny", "egress": [{"action": "allow", "target": UP6}]}

# A UDP echo server on one upstream address (bound to it: the reply must carry the address
# the flow was opened to), logging every datagram's payload and peer.
ECHO = r"""
import json, socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("echo", flush=True)
while True:
    data, peer = s.recvfrom(4096)
    with open(sys.argv[3], "a") as f:
        f.write(json.dumps([data.decode(errors="replace"), peer[0]]) + "\n")
    s.sendto(b"echo:" + data, peer)
"""

# A receiver: binds ``addr:port`` (UDP), optionally first sends ``hello`` to ``peer`` (its own
# flow), prints "ready", collects what arrives for ``wait`` seconds, then optionally sends
# ``then`` to ``peer`` and collects again. Prints one JSON list of [payload, source].
RECEIVER = r"""
import json, socket, sys, time
addr, port, peer, hello, then, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6])
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind((addr, port))
got = []
def collect(seconds):
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        s.settimeout(left)
        try:
            data, src = s.recvfrom(4096)
        except OSError:
            return
        got.append([data.decode("latin-1"), src[0]])
if hello:
    s.sendto(hello.encode(), (peer, 9999))
    collect(1.0)
print("ready", flush=True)
sys.stdin.readline()
collect(wait)
if then:
    s.sendto(then.encode(), (peer, 9999))
    collect(1.5)
print(json.dumps(got), flush=True)
"""

# Sends one datagram with a source address of its choosing (IPV6_FREEBIND, no capability).
SPOOF = r"""
import socket, sys
src, sport, dst, dport, payload = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
s.bind((src, sport))
if payload.startswith("dns:"):
    name = payload[4:]
    q = bytes.fromhex("4a4a01000001000000000000")
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    q += b"\x00\x00\x01\x00\x01"
    s.sendto(q, (dst, dport))
else:
    s.sendto(payload.encode(), (dst, dport))
print("sent", flush=True)
"""

UNPRIVILEGED = (
    "setpriv",
    "--reuid=1000",
    "--regid=1000",
    "--clear-groups",
    "--inh-caps=-all",
    "--bounding-set=-all",
)


@pytest.fixture(scope="module", params=["bridged", "routed"])
def snet(request: pytest.FixtureRequest) -> Iterator[Topology]:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    cleanup_stale()
    t = Topology(
        prefix=f"egs{os.getpid()}{request.param[0]}", sandboxes=2, routed=request.param == "routed"
    ).up_()
    os.chmod(t.workdir, 0o755)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def sd(snet: Topology) -> Iterator[Daemon]:
    env = {**uid_env(snet), "EGRESSD_SANDBOX_IFACES": "br*" if not snet.routed else "vh9"}
    d = Daemon(snet, table="egt-spoof", port=18480, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        echo_log = snet.workdir / "echo.jsonl"
        echo_log.write_text("")
        snet.spawn(snet.up, SYSTEM_PYTHON, "-c", ECHO, UP6, str(ECHO_PORT), str(echo_log), ready_line="echo")
        yield d
    finally:
        if d.proc is not None:
            snet.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        print(d.log_text()[-4000:])


def bind_net(d: Daemon, i: int, uid: str, policy: object, *, v6: bool) -> None:
    ip, gw = (Topology.sb_ip6(i), GATEWAY6) if v6 else (Topology.sb_ip(i), GATEWAY)
    env = envelope("SET_BINDING", uid, ip=ip, gateway=gw, policy=policy)
    env["attachment"]["network"]["hostVeth"] = f"vh{i}"  # type: ignore[index]
    assert d.post(env) == (200, "{}")
    assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")


class Receiver:
    """A UDP socket in sandbox ``i`` (see RECEIVER), started before the attack."""

    def __init__(
        self, topo: Topology, i: int, port: int, *, hello: str = "", then: str = "", wait: float = 2.0
    ):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", topo.sb(i), SYSTEM_PYTHON, "-c", RECEIVER,
             Topology.sb_ip6(i), str(port), UP6, hello, then, str(wait)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def received(self) -> list[list[str]]:
        out, _ = self.proc.communicate("go\n", timeout=30)
        return list(json.loads(out.strip().splitlines()[-1]))


def spoof_as_uid(topo: Topology, uid: int, src: str, sport: int, dst: str, dport: int, payload: str) -> None:
    r = as_uid(topo, uid, SYSTEM_PYTHON, "-c", SPOOF, src, str(sport), dst, str(dport), payload)
    # Sent, or refused at once by the kernel's output path (EPERM): both are fine here.
    assert r.returncode == 0 or "Operation not permitted" in r.stderr, r.stderr


def spoof_from_sandbox(
    topo: Topology, i: int, src: str, sport: int, dst: str, dport: int, payload: str
) -> None:
    r = topo.ns(
        topo.sb(i),
        *UNPRIVILEGED,
        SYSTEM_PYTHON,
        "-c",
        SPOOF,
        src,
        str(sport),
        dst,
        str(dport),
        payload,
        check=False,
    )
    assert r.returncode == 0, r.stderr  # the sandbox's own kernel lets it send: that is the point


def echo_payloads(topo: Topology) -> list[Any]:
    log: Path = topo.workdir / "echo.jsonl"
    return [json.loads(line)[0] for line in log.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------


def test_a_sandbox_uid_sends_only_with_the_pods_own_addresses(snet: Topology, sd: Daemon) -> None:
    """Host-uid A (its policy allows UP6) claims network sandbox 1's IPv6 address. Sandbox 1
    (deny-all) must get neither egressd's DNS answer to A's forged query (a lateral channel:
    the name carries A's data) nor the upstream's answer to A's forged datagram, and its own
    datagram on that flow must stay refused."""
    bind_net(sd, 1, "n1", DENY_ALL, v6=False)
    bind_uid(sd, "ua", A, ALLOW_UP6)
    try:
        rx = Receiver(snet, 1, 40053, then="own-data-of-a-deny-all-sandbox")
        spoof_as_uid(snet, A, Topology.sb_ip6(1), 40053, UP6, 53, "dns:from-uid-a.lateral.test")
        spoof_as_uid(snet, A, Topology.sb_ip6(1), 40053, UP6, ECHO_PORT, "opened-by-uid-a")
        got = rx.received()
        assert got == [], f"deny-all sandbox 1 received what uid A sent as it: {got}"
        assert "own-data-of-a-deny-all-sandbox" not in echo_payloads(snet)
    finally:
        sd.post(envelope("REMOVE_BINDING", "ua"))
        sd.post(envelope("REMOVE_BINDING", "n1"))


def test_a_sandbox_cannot_inject_into_a_siblings_flow_as_its_upstream(snet: Topology, sd: Daemon) -> None:
    """Sandbox 2 (allowed UP6) holds a UDP flow with UP6; deny-all sandbox 1 sends it a
    datagram claiming to be UP6 (the reply direction of that flow): nothing arrives."""
    bind_net(sd, 1, "n1", DENY_ALL, v6=True)
    bind_net(sd, 2, "n2", ALLOW_UP6, v6=True)
    try:
        rx = Receiver(snet, 2, 41000, hello="flow-of-sandbox-2")
        spoof_from_sandbox(snet, 1, UP6, ECHO_PORT, Topology.sb_ip6(2), 41000, "injected-by-sandbox-1")
        got = rx.received()
        assert all("injected" not in payload for payload, _ in got), f"sandbox 2 got: {got}"
    finally:
        sd.post(envelope("REMOVE_BINDING", "n1"))
        sd.post(envelope("REMOVE_BINDING", "n2"))


def test_a_sandbox_cannot_send_with_a_siblings_address(
    snet: Topology, sd: Daemon, request: pytest.FixtureRequest
) -> None:
    """Deny-all sandbox 1 sends as sandbox 2 (allowed UP6): neither its datagram reaches UP6
    under sandbox 2's policy, nor does sandbox 2 get egressd's DNS answer to a query sandbox
    1 forged in its name (a lateral channel). Bridged, egressd cannot tell two ports of one
    bridge apart on the inet hooks: the runtime must filter sources per port there."""
    if not snet.routed:
        reason = "bridged: per-port source filtering is the runtime's (docs/security.md, Known limitations)"
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=reason))
    bind_net(sd, 1, "n1", DENY_ALL, v6=True)
    bind_net(sd, 2, "n2", ALLOW_UP6, v6=True)
    try:
        rx = Receiver(snet, 2, 42000)
        spoof_from_sandbox(snet, 1, Topology.sb_ip6(2), 42001, UP6, ECHO_PORT, "exfil-by-sandbox-1")
        spoof_from_sandbox(
            snet, 1, Topology.sb_ip6(2), 42000, GATEWAY6, 53, "dns:from-sandbox-1.lateral.test"
        )
        got = rx.received()
        assert "exfil-by-sandbox-1" not in echo_payloads(snet), "sandbox 1 sent with sandbox 2's policy"
        assert got == [], f"sandbox 2 received egressd's answer to sandbox 1's forged query: {got}"
    finally:
        sd.post(envelope("REMOVE_BINDING", "n1"))
        sd.post(envelope("REMOVE_BINDING", "n2"))


# A pod service (not egressd's): a dual-stack UDP socket that logs every datagram's payload.
POD_SERVICE = r"""
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::", int(sys.argv[1])))
print("listening", flush=True)
while True:
    data, _ = s.recvfrom(4096)
    with open(sys.argv[2], "a") as f:
        f.write(data.decode(errors="replace") + "\n")
"""


def test_zz_a_restart_forgets_the_sandbox_interfaces_until_the_replay(
    snet: Topology, sd: Daemon, request: pytest.FixtureRequest
) -> None:
    """Known limit (docs/security.md): the reset at start-up is the header alone, so until the
    Fastlet replays, a sandbox whose interface only its attachment named (routed here) is an
    unknown source on the input hook and reaches a pod service; one whose interface
    EGRESSD_SANDBOX_IFACES names (the bridge here) stays fenced. Last: it restarts egressd."""
    if snet.routed:
        reason = "until the replay only EGRESSD_SANDBOX_IFACES recognises a sandbox's interface"
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=reason))
    log = snet.workdir / "pod-service.log"
    log.write_text("")
    snet.spawn(snet.pod, SYSTEM_PYTHON, "-c", POD_SERVICE, "7777", str(log), ready_line="listening")
    bind_net(sd, 1, "n1", DENY_ALL, v6=False)

    def send(payload: str) -> None:
        code = f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto({payload.encode()!r}, ({GATEWAY!r}, 7777))"
        snet.ns(snet.sb(1), *UNPRIVILEGED, SYSTEM_PYTHON, "-c", code)

    send("before-the-restart")
    sd.kill(signal.SIGTERM)
    sd.start(wait=True)
    send("after-the-restart-before-the-replay")
    bind_net(sd, 1, "n1", DENY_ALL, v6=False)
    send("after-the-replay")
    time.sleep(0.5)
    got = log.read_text().splitlines()
    assert got == [], f"the pod service heard the sandbox: {got}"
