"""Names on the wire across subjects (docs/reference/behaviour.md §18 with §10's "answered from
memory"), fleet profile, real packets through the real MITM in the CDN-shaped topology of
tests/kernel/cdn.py: a.cdn.test and b.cdn.test share one upstream address (10.204.0.3).

The name check is per subject: a name admits a connection only when *this* subject's policy
allows it and, on an address open only by DNS learning, the name taught *this* subject the
address. Several subjects in one pod reach the same address here; a subject must never be
admitted on another subject's name, its learning or the MITM workers' memory of another
subject's admissions (warm right before), nor on what a previous subject bound to the same
address learned; a narrowing of one subject changes nothing for another. Run with one MITM
worker (every subject's memory in one process) and with two.

A refused attempt must leave no accept in the upstream's log (tests/kernel/cdn_upstream.py
records every TCP connection at accept).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    SYSTEM_PYTHON,
    accepts,
    allow,
    bind_subject,
    cdn_topology,
    client_argv,
    http,
    learn,
    mark,
    mitm_env,
    mitm_fleet,
    parse_client,
    policy,
    requests,
    tls,
    upstream_ca,
    wait_refusal,
)
from tests.kernel.keepalive import KeepAlive, second_reached
from tests.kernel.topology import Daemon, Topology, envelope

# One plain-HTTP keep-alive connection to port 80: GET /first, wait for the go file, GET
# /second on the same connection; prints the statuses (or the error that ended it).
HTTP_KEEP_ALIVE = r"""
import json, os, socket, sys, time
ip, host, go = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.create_connection((ip, 80), timeout=5)
f = s.makefile("rb")
def get(path):
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    line = f.readline()
    if not line:
        raise ConnectionError("closed")
    length = 0
    while True:
        h = f.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        k, _, v = h.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    f.read(length)
    return int(line.split()[1])
print(json.dumps({"first": get("/first")}), flush=True)
deadline = time.monotonic() + 20
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.0)
try:
    print(json.dumps({"second": get("/second")}), flush=True)
except Exception as exc:
    print(json.dumps({"second": type(exc).__name__}), flush=True)
"""


class HttpKeepAlive(KeepAlive):
    """:class:`~tests.kernel.keepalive.KeepAlive`'s protocol over plain HTTP (port 80)."""

    def __init__(self, t: Topology, sb: int, host: str) -> None:
        self.go = t.workdir / f"go-http-{host}-{time.monotonic_ns()}"
        argv = [sys.executable, "-c", HTTP_KEEP_ALIVE, CDN_IP, host, str(self.go)]
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", t.sb(sb), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


HTTP_PORT = 18640
UID_X = 100021  # a host-uid subject (docs/reference/behaviour.md §17)

ONLY_A = policy(allow("a.cdn.test"))
ONLY_B = policy(allow("b.cdn.test"))
BOTH = policy(allow("a.cdn.test"), allow("b.cdn.test"))


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egx{os.getpid()}", sandboxes=2)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def fleet(cdn: Topology, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    workers = int(request.param)
    env = {
        **mitm_env(cdn, f"xs{workers}"),
        "EGRESSD_MITM_WORKERS": str(workers),
        "EGRESSD_UID_MAX_SUBJECTS": "4",
        "EGRESSD_UID_DNS_PORT_BASE": "16200",
    }
    with mitm_fleet(cdn, f"egt-xs{workers}", HTTP_PORT + workers, env) as d:
        yield d


def unbind(d: Daemon, uid: str) -> None:
    d.post(envelope("REMOVE_BINDING", uid))


def refused(out: dict[str, Any]) -> bool:
    return not out["ok"] and out["error"] in (
        "ConnectionResetError",
        "SSLEOFError",
        "SSLError",
        "ConnectionError",
    )


def host_403(out: dict[str, Any]) -> bool:
    return bool(out["responses"]) and out["responses"][0]["status"] == 403


def served(out: dict[str, Any], name: str) -> bool:
    if not out["ok"]:
        return False
    body = out["responses"][0]["body"]
    return bool(out["responses"][0]["status"] == 200 and name in (body.get("sni"), body.get("host")))


@pytest.fixture
def pair(fleet: Daemon, cdn: Topology) -> Iterator[tuple[str, str]]:
    """Sandbox 1 allowed and taught a.cdn.test, sandbox 2 allowed and taught b.cdn.test."""
    bind_subject(fleet, 1, "xs1", ONLY_A)
    bind_subject(fleet, 2, "xs2", ONLY_B)
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        learn(cdn, 2, "b.cdn.test", CDN_IP)
        yield "xs1", "xs2"
    finally:
        unbind(fleet, "xs1")
        unbind(fleet, "xs2")


# ---- 1. two sandboxes, one address, warm memory, interleaved ---------------------------------


def test_another_subjects_name_is_refused_right_after_its_admission(
    cdn: Topology, fleet: Daemon, pair: tuple[str, str]
) -> None:
    for _ in range(3):
        # The other subject's admission warms the worker's memory for (name, address, port) ...
        assert served(tls(cdn, 2, CDN_IP, "b.cdn.test"), "b.cdn.test")
        since, log_mark = mark(cdn), len(fleet.log_text())
        assert refused(tls(cdn, 1, CDN_IP, "b.cdn.test"))  # ... and must not serve this one
        assert host_403(http(cdn, 1, CDN_IP, "b.cdn.test"))
        assert accepts(cdn, since) == []
        event = wait_refusal(fleet.log_text, log_mark, name="b.cdn.test", port=443)
        assert (event["subject"], event["reason"]) == ("s-xs1", "sni_not_allowed")

        assert served(tls(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
        assert served(http(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
        since, log_mark = mark(cdn), len(fleet.log_text())
        assert refused(tls(cdn, 2, CDN_IP, "a.cdn.test"))
        assert host_403(http(cdn, 2, CDN_IP, "a.cdn.test"))
        assert accepts(cdn, since) == []
        event = wait_refusal(fleet.log_text, log_mark, name="a.cdn.test", port=443)
        assert (event["subject"], event["reason"]) == ("s-xs2", "sni_not_allowed")


def test_interleaved_connections_of_both_subjects(
    cdn: Topology, fleet: Daemon, pair: tuple[str, str]
) -> None:
    # (sandbox, wire, name, admitted?)
    attempts = [
        (1, "tls", "a.cdn.test", True),
        (2, "tls", "a.cdn.test", False),
        (2, "tls", "b.cdn.test", True),
        (1, "tls", "b.cdn.test", False),
        (1, "http", "b.cdn.test", False),
        (2, "http", "b.cdn.test", True),
        (2, "http", "a.cdn.test", False),
        (1, "http", "a.cdn.test", True),
    ] * 4

    def one(attempt: tuple[int, str, str, bool]) -> dict[str, Any]:
        sb, wire, name, _ = attempt
        return tls(cdn, sb, CDN_IP, name) if wire == "tls" else http(cdn, sb, CDN_IP, name)

    since = mark(cdn)
    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(one, attempts))
    wrong = [
        (a, o)
        for a, o in zip(attempts, outs, strict=True)
        if (a[3] and not served(o, a[2])) or (not a[3] and not (refused(o) if a[1] == "tls" else host_403(o)))
    ]
    assert wrong == []
    admitted = sum(1 for a in attempts if a[3])
    # Exactly one upstream connection per admitted attempt: none for the refused ones.
    assert len(accepts(cdn, since)) == admitted
    seen = [str(r.get("sni") or r.get("host")) for r in requests(cdn, since)]
    assert sorted(seen) == sorted(a[2] for a in attempts if a[3])


def test_another_subjects_address_rule_opens_nothing_for_this_one(cdn: Topology, fleet: Daemon) -> None:
    """Sandbox 1's allow CIDR rule admits any SNI and no SNI on the address (remembered without
    an end); sandbox 2, open there only by learning b.cdn.test, gets none of it."""
    bind_subject(fleet, 1, "xs-cidr", policy(allow(f"{CDN_IP}/32")))
    bind_subject(fleet, 2, "xs-lease", ONLY_B)
    try:
        learn(cdn, 2, "b.cdn.test", CDN_IP)
        for _ in range(3):
            assert served(tls(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
            assert tls(cdn, 1, CDN_IP, None, host="a.cdn.test")["ok"]
            assert served(http(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
            since, log_mark = mark(cdn), len(fleet.log_text())
            assert refused(tls(cdn, 2, CDN_IP, "a.cdn.test"))
            assert refused(tls(cdn, 2, CDN_IP, None, host="a.cdn.test"))
            assert host_403(http(cdn, 2, CDN_IP, "a.cdn.test"))
            assert accepts(cdn, since) == []
            event = wait_refusal(fleet.log_text, log_mark, name="a.cdn.test", port=443)
            assert (event["subject"], event["reason"]) == ("s-xs-lease", "sni_not_allowed")
            wait_refusal(fleet.log_text, log_mark, reason="no_sni", subject="s-xs-lease")
            assert served(tls(cdn, 2, CDN_IP, "b.cdn.test"), "b.cdn.test")
    finally:
        unbind(fleet, "xs-cidr")
        unbind(fleet, "xs-lease")


# ---- 2. allowed by both, learned by one ------------------------------------------------------


def test_a_name_another_subject_learned_is_not_learned_for_this_one(cdn: Topology, fleet: Daemon) -> None:
    bind_subject(fleet, 1, "xs1l", ONLY_A)
    bind_subject(fleet, 2, "xs2l", BOTH)
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        learn(cdn, 2, "b.cdn.test", CDN_IP)  # never a.cdn.test
        for _ in range(3):
            assert served(tls(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
            assert served(http(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
            assert served(tls(cdn, 2, CDN_IP, "b.cdn.test"), "b.cdn.test")
            since, log_mark = mark(cdn), len(fleet.log_text())
            assert refused(tls(cdn, 2, CDN_IP, "a.cdn.test"))
            assert host_403(http(cdn, 2, CDN_IP, "a.cdn.test"))
            assert accepts(cdn, since) == []
            event = wait_refusal(fleet.log_text, log_mark, name="a.cdn.test", port=443)
            assert (event["subject"], event["reason"], event["dst"]) == ("s-xs2l", "sni_not_learned", CDN_IP)
        # Learning it admits it: the control.
        learn(cdn, 2, "a.cdn.test", CDN_IP)
        assert served(tls(cdn, 2, CDN_IP, "a.cdn.test"), "a.cdn.test")
    finally:
        unbind(fleet, "xs1l")
        unbind(fleet, "xs2l")


# ---- 3. a new subject on a reused address ----------------------------------------------------


@pytest.mark.parametrize("new_policy", ["not_allowed", "not_learned"])
def test_a_new_subject_on_the_same_address_rides_nothing_of_the_old_one(
    cdn: Topology, fleet: Daemon, new_policy: str
) -> None:
    old, new = f"xs-old-{new_policy}", f"xs-new-{new_policy}"
    bind_subject(fleet, 1, old, ONLY_A)
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        for _ in range(2):  # warm
            assert served(tls(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
            assert served(http(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
    finally:
        unbind(fleet, old)
    bind_subject(fleet, 1, new, ONLY_B if new_policy == "not_allowed" else BOTH)
    try:
        learn(cdn, 1, "b.cdn.test", CDN_IP)  # the address is open again, for b.cdn.test
        reason = "sni_not_allowed" if new_policy == "not_allowed" else "sni_not_learned"
        for delay in (0.0, 3.0):
            time.sleep(delay)
            since, log_mark = mark(cdn), len(fleet.log_text())
            assert refused(tls(cdn, 1, CDN_IP, "a.cdn.test"))
            assert host_403(http(cdn, 1, CDN_IP, "a.cdn.test"))
            assert accepts(cdn, since) == []
            event = wait_refusal(fleet.log_text, log_mark, name="a.cdn.test", port=443)
            assert (event["subject"], event["reason"]) == (f"s-{new}", reason)
            assert served(tls(cdn, 1, CDN_IP, "b.cdn.test"), "b.cdn.test")
    finally:
        unbind(fleet, new)


@pytest.mark.parametrize("wire", ["tls", "http"])
@pytest.mark.parametrize("how", ["remove_then_set", "set_over"])
def test_an_open_connection_of_the_old_subject_does_not_survive_into_the_new_one(
    cdn: Topology, fleet: Daemon, wire: str, how: str
) -> None:
    """The old subject's keep-alive connection (a.cdn.test admitted) stays open across the
    address's rebinding to a subject that does not allow a.cdn.test: its next request must not
    reach the upstream."""
    old, new = f"xs-ko-{wire}-{how}", f"xs-kn-{wire}-{how}"
    bind_subject(fleet, 1, old, ONLY_A)
    client: KeepAlive | None = None
    bound_new = False
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        client = (
            KeepAlive(cdn, 1, "a.cdn.test", upstream_ca(cdn))
            if wire == "tls"
            else HttpKeepAlive(cdn, 1, "a.cdn.test")
        )
        assert client.line() == {"first": 200}
        since = mark(cdn)
        if how == "remove_then_set":
            unbind(fleet, old)
        code, text = fleet.post(envelope("SET_BINDING", new, ip=Topology.sb_ip(1), policy=ONLY_B))
        if code != 200:  # 409: the address is taken (the old binding stays until removed)
            assert how == "set_over", (code, text)
            unbind(fleet, old)
            assert fleet.post(envelope("SET_BINDING", new, ip=Topology.sb_ip(1), policy=ONLY_B)) == (
                200,
                "{}",
            )
        bound_new = True
        assert fleet.post(envelope("LIFECYCLE_HOOK", new, hook="sandbox.data-plane-ready")) == (200, "{}")
        learn(cdn, 1, "b.cdn.test", CDN_IP)
        second = client.second()
        assert second != 200, second
        assert not second_reached(cdn, since, "a.cdn.test")
        since = mark(cdn)
        assert refused(tls(cdn, 1, CDN_IP, "a.cdn.test"))
        assert accepts(cdn, since) == []
    finally:
        if client is not None:
            client.stop()
        unbind(fleet, old)
        if bound_new:
            unbind(fleet, new)


def test_a_new_subject_without_learning_reaches_nothing(cdn: Topology, fleet: Daemon) -> None:
    """The reused address, and the new subject has learned nothing at all: the old subject's
    lease must not open the address for it (kernel or MITM)."""
    bind_subject(fleet, 1, "xs-old-n", ONLY_A)
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        assert served(tls(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
    finally:
        unbind(fleet, "xs-old-n")
    bind_subject(fleet, 1, "xs-new-n", BOTH)
    try:
        for delay in (0.0, 3.0):
            time.sleep(delay)
            since = mark(cdn)
            assert not tls(cdn, 1, CDN_IP, "a.cdn.test")["ok"]
            out = http(cdn, 1, CDN_IP, "a.cdn.test")
            assert not out["ok"] or host_403(out), out
            assert accepts(cdn, since) == []
    finally:
        unbind(fleet, "xs-new-n")


# ---- 4. a host-uid subject and an address subject ---------------------------------------------


def as_uid(t: Topology, uid: int, *cmd: str) -> subprocess.CompletedProcess[str]:
    return t.ns(
        t.pod, "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd, check=False, timeout=30
    )


def uid_client(t: Topology, port: int, sni: str | None, host: str) -> dict[str, Any]:
    r = as_uid(t, UID_X, SYSTEM_PYTHON, *client_argv(t, CDN_IP, port, sni, (host,)))
    return parse_client(r.stdout, r.stderr)


@pytest.mark.parametrize("uid_policy", ["only_a", "both"])
def test_a_host_uid_subject_and_an_address_subject_keep_their_names(
    cdn: Topology, fleet: Daemon, uid_policy: str
) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    body = json.dumps(ONLY_A if uid_policy == "only_a" else BOTH)
    env = envelope("SET_BINDING", "xs-uid", ip=None, policy=body)
    env["attachment"] = {"process": {"uid": UID_X}}
    assert fleet.post(env) == (200, "{}")
    assert fleet.post(envelope("LIFECYCLE_HOOK", "xs-uid", hook="sandbox.data-plane-ready")) == (200, "{}")
    bind_subject(fleet, 1, "xs-addr", ONLY_B if uid_policy == "only_a" else BOTH)
    try:
        r = as_uid(cdn, UID_X, "dig", "@10.204.0.9", "a.cdn.test", "+short", "+time=2", "+tries=1")
        assert CDN_IP in r.stdout, r
        learn(cdn, 1, "b.cdn.test", CDN_IP)
        for _ in range(3):
            # uid subject admitted with a (warm), then the address subject tries a.
            assert served(uid_client(cdn, 443, "a.cdn.test", "a.cdn.test"), "a.cdn.test")
            assert served(uid_client(cdn, 80, None, "a.cdn.test"), "a.cdn.test")
            since, log_mark = mark(cdn), len(fleet.log_text())
            assert refused(tls(cdn, 1, CDN_IP, "a.cdn.test"))
            assert host_403(http(cdn, 1, CDN_IP, "a.cdn.test"))
            assert accepts(cdn, since) == []
            event = wait_refusal(fleet.log_text, log_mark, name="a.cdn.test", port=443)
            assert event["subject"] == "s-xs-addr"
            # address subject admitted with b (warm), then the uid subject tries b.
            assert served(tls(cdn, 1, CDN_IP, "b.cdn.test"), "b.cdn.test")
            assert served(http(cdn, 1, CDN_IP, "b.cdn.test"), "b.cdn.test")
            since, log_mark = mark(cdn), len(fleet.log_text())
            assert refused(uid_client(cdn, 443, "b.cdn.test", "b.cdn.test"))
            assert host_403(uid_client(cdn, 80, None, "b.cdn.test"))
            assert accepts(cdn, since) == []
            event = wait_refusal(fleet.log_text, log_mark, name="b.cdn.test", port=443)
            assert event["subject"] == "s-xs-uid"
            want = "sni_not_allowed" if uid_policy == "only_a" else "sni_not_learned"
            assert event["reason"] == want
    finally:
        unbind(fleet, "xs-uid")
        unbind(fleet, "xs-addr")


def test_the_same_uid_bound_again_starts_without_the_old_leases(cdn: Topology, fleet: Daemon) -> None:
    """REMOVE_BINDING ends a subject: the same sandbox uid bound again (same address) with a
    policy that allows a.cdn.test but has not learned it in this binding is refused it."""
    bind_subject(fleet, 1, "xs-same", ONLY_A)
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        assert served(tls(cdn, 1, CDN_IP, "a.cdn.test"), "a.cdn.test")
    finally:
        unbind(fleet, "xs-same")
    bind_subject(fleet, 1, "xs-same", BOTH)
    try:
        learn(cdn, 1, "b.cdn.test", CDN_IP)
        since, log_mark = mark(cdn), len(fleet.log_text())
        assert refused(tls(cdn, 1, CDN_IP, "a.cdn.test"))
        assert host_403(http(cdn, 1, CDN_IP, "a.cdn.test"))
        assert accepts(cdn, since) == []
        event = wait_refusal(fleet.log_text, log_mark, name="a.cdn.test", port=443)
        assert event["reason"] == "sni_not_learned"
    finally:
        unbind(fleet, "xs-same")


def bind_uid(fleet: Daemon, uid: str, process_uid: int, pol: object) -> None:
    env = envelope("SET_BINDING", uid, ip=None, policy=json.dumps(pol))
    env["attachment"] = {"process": {"uid": process_uid}}
    assert fleet.post(env) == (200, "{}")
    assert fleet.post(envelope("LIFECYCLE_HOOK", uid, hook="sandbox.data-plane-ready")) == (200, "{}")


@pytest.mark.parametrize("new_policy", ["not_allowed", "not_learned"])
def test_a_new_host_uid_subject_rides_nothing_of_the_old_one(
    cdn: Topology, fleet: Daemon, new_policy: str
) -> None:
    """The same host process uid (the same per-subject MITM port, its memory's key) under a new
    subject after REMOVE_BINDING."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    old, new = f"xs-uo-{new_policy}", f"xs-un-{new_policy}"
    bind_uid(fleet, old, UID_X, ONLY_A)
    try:
        r = as_uid(cdn, UID_X, "dig", "@10.204.0.9", "a.cdn.test", "+short", "+time=2", "+tries=1")
        assert CDN_IP in r.stdout, r
        for _ in range(2):
            assert served(uid_client(cdn, 443, "a.cdn.test", "a.cdn.test"), "a.cdn.test")
            assert served(uid_client(cdn, 80, None, "a.cdn.test"), "a.cdn.test")
    finally:
        unbind(fleet, old)
    bind_uid(fleet, new, UID_X, ONLY_B if new_policy == "not_allowed" else BOTH)
    try:
        r = as_uid(cdn, UID_X, "dig", "@10.204.0.9", "b.cdn.test", "+short", "+time=2", "+tries=1")
        assert CDN_IP in r.stdout, r
        reason = "sni_not_allowed" if new_policy == "not_allowed" else "sni_not_learned"
        for delay in (0.0, 3.0):
            time.sleep(delay)
            since, log_mark = mark(cdn), len(fleet.log_text())
            assert refused(uid_client(cdn, 443, "a.cdn.test", "a.cdn.test"))
            assert host_403(uid_client(cdn, 80, None, "a.cdn.test"))
            assert accepts(cdn, since) == []
            event = wait_refusal(fleet.log_text, log_mark, name="a.cdn.test", port=443)
            assert (event["subject"], event["reason"]) == (f"s-{new}", reason)
            assert served(uid_client(cdn, 443, "b.cdn.test", "b.cdn.test"), "b.cdn.test")
    finally:
        unbind(fleet, new)


# ---- 5. a narrowing of one subject leaves the other alone ---------------------------------------


def test_a_narrowing_of_one_subject_changes_nothing_for_the_other(cdn: Topology, fleet: Daemon) -> None:
    bind_subject(fleet, 1, "xs-n1", BOTH)
    bind_subject(fleet, 2, "xs-n2", ONLY_A)
    c1 = c2 = None
    try:
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        learn(cdn, 1, "b.cdn.test", CDN_IP)  # sandbox 1's address stays open for b afterwards
        learn(cdn, 2, "a.cdn.test", CDN_IP)
        ca = upstream_ca(cdn)
        c1 = KeepAlive(cdn, 1, "a.cdn.test", ca, settle=1.5)
        c2 = KeepAlive(cdn, 2, "a.cdn.test", ca, settle=1.5)
        assert c1.line() == {"first": 200}
        assert c2.line() == {"first": 200}
        since = mark(cdn)
        bind_subject(fleet, 1, "xs-n1", ONLY_B)  # sandbox 1 loses a.cdn.test
        second1 = c1.second()
        assert second1 != 200, second1
        second2 = c2.second()
        assert second2 == 200, second2
        reached = [r for r in requests(cdn, since) if r.get("path") == "/second"]
        assert len(reached) == 1, reached  # only sandbox 2's second request
        assert second_reached(cdn, since, "a.cdn.test")

        since = mark(cdn)
        assert refused(tls(cdn, 1, CDN_IP, "a.cdn.test"))
        assert host_403(http(cdn, 1, CDN_IP, "a.cdn.test"))
        assert accepts(cdn, since) == []
        for _ in range(3):
            assert served(tls(cdn, 2, CDN_IP, "a.cdn.test"), "a.cdn.test")
            assert served(http(cdn, 2, CDN_IP, "a.cdn.test"), "a.cdn.test")
            assert refused(tls(cdn, 1, CDN_IP, "a.cdn.test"))
        assert served(tls(cdn, 1, CDN_IP, "b.cdn.test"), "b.cdn.test")
    finally:
        for c in (c1, c2):
            if c is not None:
                c.stop()
        unbind(fleet, "xs-n1")
        unbind(fleet, "xs-n2")
