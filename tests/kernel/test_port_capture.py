"""docs/reference/behaviour.md §20.1: no sandbox uid receives what is meant for egressd, with real processes,
real packets and SYN cookies forced on.

One "host" namespace (the pod) runs egressd with host-uid subjects and the MITM, and one
network sandbox behind the bridge; ``net.ipv4.tcp_syncookies=2`` there, so every handshake is
completed from a cookie (no request socket, the case the old output-side rule could not see).
The attacker is uid C, a sandbox uid with no subject: it binds egressd's ports with
``SO_REUSEADDR``, listens with a backlog of 0 and accepts late, after the victims sent their
first flight, then reads everything it got. The victims are the neighbour uid A (its own DNS
and MITM ports), the network sandbox (the shared DNS proxy on the gateway) and root in the pod
(the Fastlet pushing a credential to the actions API).

Three moments: egressd running, one MITM worker restarting, egressd killed (its table stays).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kernel.test_uid_subjects import (
    API,
    API_IP,
    DPR,
    SYSTEM_PYTHON,
    as_uid,
    bind,
    dig,
    policy,
    remove,
    uid_env,
)
from tests.kernel.topology import (
    GATEWAY,
    UPSTREAM_IPS,
    UPSTREAM_IPS6,
    Daemon,
    Topology,
    cleanup_stale,
    envelope,
)

A, C = 100001, 100003  # the victim subject and the squatter (in range, no subject)
DNS_PORT = 15353
SECRET = "sk-captured-credential-7f3a"

# The squatter: on a first line on stdin binds what it is given (JSON list of [proto, host,
# port]) with SO_REUSEADDR, retrying for a while, listens with backlog 0, says "ready"; on a
# second line (the victims are done) drains its UDP sockets, then accepts and reads whatever its
# TCP sockets queued.
SQUATTER = r"""
import json, socket, sys, time
spec = json.loads(sys.argv[1])
held = []
print("spawned", flush=True)
sys.stdin.readline()
for proto, host, port in spec:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if fam == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    end = time.monotonic() + float(sys.argv[2])
    while True:
        try:
            s.bind((host, port))
            break
        except OSError as exc:
            if time.monotonic() >= end:
                print(json.dumps({"refused": [proto, host, port], "errno": exc.errno}), flush=True)
                s.close()
                s = None
                break
            time.sleep(0.002)
    if s is None:
        continue
    if proto == "tcp":
        s.listen(0)
    s.setblocking(False)
    held.append((proto, host, port, s))
    print(json.dumps({"bound": [proto, host, port]}), flush=True)
print("ready", flush=True)
sys.stdin.readline()
got = []
for proto, host, port, s in held:
    while True:
        try:
            if proto == "udp":
                data = s.recv(65535)
                got.append([proto, host, port, len(data)])
                continue
            c, _ = s.accept()
        except OSError:
            break
        c.settimeout(0.5)
        n = 0
        try:
            while True:
                chunk = c.recv(65535)
                if not chunk:
                    break
                n += len(chunk)
        except OSError:
            pass
        got.append([proto, host, port, n])
print(json.dumps({"received": got}), flush=True)
"""


class Squatter:
    """uid C holding egressd's ports (see SQUATTER); :meth:`take` makes it bind them."""

    def __init__(self, topo: Topology, spec: list[list[Any]], bind_for_s: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [
                "ip", "netns", "exec", topo.pod,
                "setpriv", f"--reuid={C}", f"--regid={C}", "--clear-groups",
                SYSTEM_PYTHON, "-c", SQUATTER, json.dumps(spec), str(bind_for_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.bound: list[list[Any]] = []
        self.refused: list[list[Any]] = []
        self.bind_for_s = bind_for_s
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "spawned"

    def take(self) -> None:
        """Bind now (retrying for ``bind_for_s``); returns once every bind succeeded or gave up."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("bind\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + 20 + self.bind_for_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().strip()
            if line == "ready":
                return
            if not line and self.proc.poll() is not None:
                break
            doc = json.loads(line)
            (self.bound if "bound" in doc else self.refused).append(doc.get("bound") or doc["refused"])
        raise AssertionError("the squatter never got ready")

    def received(self) -> list[list[Any]]:
        """What reached the squatter (each UDP datagram, each accepted connection's byte count)."""
        out, _ = self.proc.communicate("go\n", timeout=30)
        for line in out.splitlines():
            if line.startswith('{"received"'):
                return list(json.loads(line)["received"])
        raise AssertionError(f"no report from the squatter: {out!r}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def ptopo() -> Iterator[Topology]:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    cleanup_stale()
    t = Topology(prefix=f"egp{os.getpid()}", sandboxes=1).up_()
    os.chmod(t.workdir, 0o755)
    # Every handshake in the pod is completed from a SYN cookie (docs/reference/behaviour.md §20.1).
    t.ns(t.pod, "sysctl", "-qw", "net.ipv4.tcp_syncookies=2")
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def pd(ptopo: Topology) -> Iterator[Daemon]:
    d = Daemon(ptopo, table="egt-capture", port=18380, env=uid_env(ptopo))
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            ptopo.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        print(d.log_text()[-6000:])


def subject_ports(d: Daemon, uid: str) -> tuple[int, int]:
    """(DNS port, MITM port) of host-uid subject ``uid``."""
    code, body = d.get("/v1/subjects")
    assert code == 200, body
    doc = json.loads(body)
    subjects = doc["subjects"] if isinstance(doc, dict) else doc
    s = next(s for s in subjects if s["uid"] == uid)
    return int(s["dnsPort"]), int(s["mitmPort"])


def bind_sandbox(d: Daemon, uid: str, pol: object) -> None:
    code, body = d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(1), gateway=GATEWAY, policy=pol))
    assert (code, body) == (200, "{}"), body
    code, body = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
    assert (code, body) == (200, "{}"), body


def https_as_a(topo: Topology) -> int:
    """uid A's HTTPS request to the bound API host (intercepted: its own MITM port)."""
    r = as_uid(topo, A, "curl", "-sk", "-o", "/dev/null", "-m", "3", "--resolve", f"{API}:443:{API_IP}", f"https://{API}/")
    return r.returncode


def push_credential(topo: Topology, port: int) -> int:
    """Root in the pod (the Fastlet) pushes a vault holding a credential to the actions API."""
    body = json.dumps({"credentials": [{"name": "k", "source": {"value": SECRET}}], "bindings": []})
    r = topo.ns(
        topo.pod,
        "curl", "-s", "-o", "/dev/null", "-m", "3", "-X", "PUT", "-H", "Content-Type: application/json",
        "--data-binary", body, f"http://127.0.0.1:{port}/v1/sandboxfleets/ua/egress/credential-vault",
        check=False,
    )  # fmt: skip
    return r.returncode


# ---------------------------------------------------------------------------------------------


def test_udp_dns_ports_are_never_shared_with_a_sandbox_uid(ptopo: Topology, pd: Daemon) -> None:
    """Every DNS listener of both kinds, egressd running: the squatter's SO_REUSEADDR binds of
    the neighbour's own port (127.0.0.1, ::1), the shared proxy's port on the gateway, loopback
    and the wildcard either fail or receive nothing, and the victims keep their answers."""
    bind(pd, "ua", A, policy("a.test", "v6.test"))
    bind_sandbox(pd, "n1", policy("a.test"))
    dns, _ = subject_ports(pd, "ua")
    squatter = Squatter(
        ptopo,
        [
            ["udp", "127.0.0.1", dns],
            ["udp", "::1", dns],
            ["udp", GATEWAY, DNS_PORT],
            ["udp", "fd00:203::1", DNS_PORT],
            ["udp", "127.0.0.1", DNS_PORT],
            ["udp", "0.0.0.0", DNS_PORT],
        ],
    )
    try:
        squatter.take()
        assert dig(ptopo, A, "a.test") == ("NOERROR", [UPSTREAM_IPS[0]])  # via 127.0.0.1:<dns>
        assert dig(ptopo, A, "a.test", server=UPSTREAM_IPS6[7]) == ("NOERROR", [UPSTREAM_IPS[0]])  # via ::1
        assert ptopo.dig(1, "a.test") == ("NOERROR", [UPSTREAM_IPS[0]])  # via <gateway>:15353
        got = squatter.received()
        assert got == [], f"a sandbox uid received datagrams meant for egressd: {got}"
        # No SO_REUSEADDR sharing: every one of these binds is refused outright.
        assert squatter.bound == [], f"bound beside egressd: {squatter.bound}"
    finally:
        squatter.kill()
        remove(pd, "ua")
        pd.post(envelope("REMOVE_BINDING", "n1"))


def test_a_restarting_workers_port_gives_a_squatter_no_byte(ptopo: Topology, pd: Daemon) -> None:
    """The worker that serves A's MITM port is killed; uid C takes the port in the gap (backlog
    0, SYN cookies, accept late). A's intercepted HTTPS connection must not deliver its
    ClientHello to it."""
    bind(pd, "ua", A, policy(API))
    squatter: Squatter | None = None
    try:
        assert dig(ptopo, A, API) == ("NOERROR", [API_IP])
        _, mitm = subject_ports(pd, "ua")
        workers = pd.status()["mitmWorkers"]
        assert isinstance(workers, list)
        slot = mitm - (pd_uid_ports(pd)[1])
        owner = next(w for w in workers if int(w["worker"]) == slot % len(workers))
        squatter = Squatter(ptopo, [["tcp", "0.0.0.0", mitm]], bind_for_s=5)
        os.kill(int(owner["pid"]), signal.SIGKILL)
        squatter.take()
        assert squatter.bound, "the squatter could not take the worker's port"
        assert https_as_a(ptopo) != 0, "A's intercepted connection was answered"
        got = squatter.received()
        assert all(n == 0 for *_, n in got), f"the squatter read A's first flight: {got}"
    finally:
        if squatter is not None:
            squatter.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pd.get("/healthz")[0] != 200:
            time.sleep(0.1)
        remove(pd, "ua")
    assert pd.get("/healthz")[0] == 200, "the worker came back once the port was free"


def pd_uid_ports(d: Daemon) -> tuple[int, int]:
    """(first DNS port, first MITM port) of the host-uid block of ``uid_env``."""
    base = int(d.env["EGRESSD_UID_DNS_PORT_BASE"])
    return base, base + int(d.env["EGRESSD_UID_MAX_SUBJECTS"]) + 1


def test_zz_nothing_reaches_a_squatter_while_egressd_is_down(ptopo: Topology, pd: Daemon) -> None:
    """egressd killed (its table stays and keeps redirecting): uid C binds the shared DNS port,
    A's DNS and MITM ports and the actions API. The network sandbox's and A's queries, A's
    HTTPS and the Fastlet's credential push reach none of them. Last: it kills the daemon."""
    bind(pd, "ua", A, policy(API, "a.test"))
    bind_sandbox(pd, "n1", policy("a.test"))
    assert dig(ptopo, A, API) == ("NOERROR", [API_IP])
    dns, mitm = subject_ports(pd, "ua")
    assert pd.proc is not None
    pd.proc.send_signal(signal.SIGKILL)
    pd.proc.wait(5)
    pd.proc = None
    time.sleep(0.5)  # the MITM child dies with it (PR_SET_PDEATHSIG)
    squatter = Squatter(
        ptopo,
        [
            ["udp", "0.0.0.0", DNS_PORT],
            ["udp", "127.0.0.1", dns],
            ["udp", "::1", dns],  # the attacker review: the IPv6 half of a per-subject port
            ["tcp", "127.0.0.1", pd.port],
            ["tcp", "0.0.0.0", mitm],
        ],
        bind_for_s=5,
    )
    try:
        squatter.take()
        assert len(squatter.bound) == 5, f"egressd's ports are free while it is down: {squatter.refused}"
        assert ptopo.dig(1, "a.test")[0] == "TIMEOUT"
        assert dig(ptopo, A, "a.test")[0] == "TIMEOUT"
        assert dig(ptopo, A, "a.test", server=UPSTREAM_IPS6[7])[0] == "TIMEOUT"  # via ::1
        assert https_as_a(ptopo) != 0
        assert push_credential(ptopo, pd.port) != 0
        got = squatter.received()
        assert all(proto == "tcp" and n == 0 for proto, _, _, n in got), f"the squatter got: {got}"
    finally:
        squatter.kill()
