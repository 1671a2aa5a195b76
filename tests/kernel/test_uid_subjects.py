"""Host-uid sandboxes (docs/reference/behaviour.md §17) end to end: real egressd, real kernel, real processes.

egressd runs in a throwaway "host" namespace of this module's own topology (the output hook
it installs polices the uid range of the namespace it runs in: never the root namespace).
The sandboxes are processes in that same namespace that differ only by uid, started with
``setpriv --reuid=<uid> --regid=<uid> --clear-groups``; the upstream namespace serves DNS,
HTTP and HTTPS. One daemon with the MITM serves the module; the restart test starts its own.
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

from tests.kernel.topology import UPSTREAM_IPS, Daemon, Topology, cleanup_stale, decode_echo

A, B, C = 100001, 100002, 100003  # two sandboxes and an in-range uid that is none
OUTSIDE = 1000  # a host uid outside EGRESSD_UID_RANGE
NO_DNS = UPSTREAM_IPS[7]  # 10.204.0.9: runs no DNS server, so an answer proves the redirect
A_IP, B_IP = UPSTREAM_IPS[0], UPSTREAM_IPS[1]  # a.test, b.test
API = "api.example.test"
API_IP = UPSTREAM_IPS[4]
SECRET = "sk-uid-subject-5e1d"
DPR = "sandbox.data-plane-ready"
MAX_SUBJECTS = 8  # a small port block: the MITM child binds every subject port at start
DNS_BASE = 16000
# An interpreter another uid may run (a pyenv under /root is not one).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "python3"


def policy(*names: str) -> dict[str, Any]:
    return {"defaultAction": "deny", "egress": [{"action": "allow", "target": n} for n in names]}


def envelope(
    op: str, uid: str, *, host_uid: int | None = None, body: object = "__absent__", **kw: Any
) -> dict[str, Any]:
    env: dict[str, Any] = {
        "apiVersion": "sandbox.fast.io/actions/v1",
        "operation": op,
        "sandbox": {"uid": uid},
        "revision": {
            "runtimeInstanceId": kw.get("rid", "r1"),
            "attachmentId": kw.get("aid", "a1"),
            "specGeneration": 1,
        },
    }
    if host_uid is not None:
        env["attachment"] = {"process": {"uid": host_uid}}
    if body != "__absent__":
        env["binding"] = {"input": body if body is None or isinstance(body, str) else json.dumps(body)}
    if "hook" in kw:
        env["hook"] = {"name": kw["hook"]}
    return env


def bind(d: Daemon, uid: str, host_uid: int, pol: object, *, activate: bool = True) -> None:
    code, text = d.post(envelope("SET_BINDING", uid, host_uid=host_uid, body=pol))
    assert (code, text) == (200, "{}"), text
    if activate:
        code, text = d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))
        assert (code, text) == (200, "{}"), text


def remove(d: Daemon, uid: str) -> None:
    code, text = d.post(envelope("REMOVE_BINDING", uid))
    assert code == 200, text


def as_uid(topo: Topology, uid: int, *cmd: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
    return topo.ns(
        topo.pod,
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        *cmd,
        check=False,
        timeout=timeout,
    )


def dig(topo: Topology, uid: int, name: str, server: str = NO_DNS) -> tuple[str, list[str]]:
    out = as_uid(
        topo, uid, "dig", f"@{server}", name, "A", "+time=2", "+tries=1", "+noall", "+comments", "+answer"
    ).stdout
    status, answers = "TIMEOUT", []
    for line in out.splitlines():
        if "status:" in line:
            status = line.split("status:", 1)[1].split(",", 1)[0].strip()
        elif line and not line.startswith(";"):
            answers.append(line.split()[-1])
    return status, answers


def reaches(topo: Topology, uid: int, ip: str, port: int = 80) -> bool:
    r = as_uid(
        topo,
        uid,
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--connect-timeout",
        "1",
        "-m",
        "2",
        f"http://{ip}:{port}/probe",
    )
    return r.stdout.strip() == "200"


def uid_elements(d: Daemon) -> str:
    return json.dumps([i for i in d.table_json() if "map" in i or "set" in i])


@pytest.fixture(scope="module")
def utopo() -> Iterator[Topology]:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    cleanup_stale()
    t = Topology(prefix=f"egu{os.getpid()}", sandboxes=0).up_()
    os.chmod(t.workdir, 0o755)  # the sandbox uids read the MITM CA certificate from here
    try:
        yield t
    finally:
        t.down()


def uid_env(topo: Topology) -> dict[str, str]:
    return {
        "EGRESSD_UID_MAX_SUBJECTS": str(MAX_SUBJECTS),
        "EGRESSD_UID_DNS_PORT_BASE": str(DNS_BASE),
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        # These tests probe reachability by address (curl http://<ip>/probe: no name); the name
        # check for host-uid subjects is tests/kernel/test_names_on_wire.py's.
        "EGRESSD_NAME_CHECK": "off",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": "18081",
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "mitm-run" / "active.sock"),
    }


@pytest.fixture(scope="module")
def uidd(utopo: Topology) -> Iterator[Daemon]:
    d = Daemon(utopo, table="egt-uid", port=18180, env=uid_env(utopo))
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        ca = utopo.workdir / "ca.pem"
        shutil.copy(utopo.workdir / "mitm-conf" / "mitmproxy-ca-cert.pem", ca)
        os.chmod(ca, 0o644)
        # A subject without a vault is passed through (docs/reference/behaviour.md §16): the upstream's own CA.
        upstream_ca = utopo.workdir / "upstream-ca.pem"
        shutil.copy(utopo.tls_dir / "ca.pem", upstream_ca)
        os.chmod(upstream_ca, 0o644)
        yield d
    finally:
        if d.proc is not None:
            utopo.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        print(d.log_text()[-6000:])  # shown by pytest when a test of the module failed


# ---------------------------------------------------------------------------------------------


def test_two_uids_each_with_its_own_policy_deny_first_until_ready(utopo: Topology, uidd: Daemon) -> None:
    bind(uidd, "ua", A, policy("a.test"), activate=False)
    bind(uidd, "ub", B, policy("b.test"), activate=False)
    try:
        # Deny-first: registered, nothing pending activation reaches anything.
        assert dig(utopo, A, "a.test")[0] == "NXDOMAIN"
        assert not reaches(utopo, A, A_IP)
        assert "a.test" not in utopo.upstream_queries()
        for uid in ("ua", "ub"):
            assert uidd.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR))[0] == 200
        assert dig(utopo, A, "a.test") == ("NOERROR", [A_IP])
        assert reaches(utopo, A, A_IP)
        assert dig(utopo, A, "b.test")[0] == "NXDOMAIN"
        assert not reaches(utopo, A, B_IP)
        assert dig(utopo, B, "b.test") == ("NOERROR", [B_IP])
        assert reaches(utopo, B, B_IP)
        assert dig(utopo, B, "a.test")[0] == "NXDOMAIN"
        assert not reaches(utopo, B, A_IP), "an address A learned is not B's"
        # A refusal on the output path is B's: counted in its own drop counter by the socket's
        # owner (8080: not intercepted, so judged by uid_out itself).
        assert not reaches(utopo, B, A_IP, port=8080)
        counter = json.loads(uidd.nft("-j", "list", "counter", "inet", uidd.table, "subj_s_ub_dropped"))
        [packets] = [c["counter"]["packets"] for c in counter["nftables"] if "counter" in c]
        assert packets > 0
        # Over TCP too, and to any address: the redirect is per uid, not per server.
        tcp = as_uid(
            utopo, A, "dig", "+tcp", "+short", "+time=2", "+tries=1", f"@{UPSTREAM_IPS[3]}", "a.test"
        )
        assert tcp.stdout.split() == [A_IP]
        # A subject's DNS port is its own: A asking B's port directly is dropped.
        direct = as_uid(
            utopo, A, "dig", "+time=1", "+tries=1", "-p", str(DNS_BASE + 1), "@127.0.0.1", "b.test"
        )
        assert "status:" not in direct.stdout
    finally:
        remove(uidd, "ua")
        remove(uidd, "ub")


def test_unregistered_in_range_uid_reaches_nothing_outside_uids_untouched(
    utopo: Topology, uidd: Daemon
) -> None:
    bind(uidd, "ua", A, policy("a.test"))
    try:
        assert dig(utopo, C, "a.test")[0] == "NXDOMAIN", "an unknown uid is an unknown source"
        assert not reaches(utopo, C, A_IP)
        assert reaches(utopo, A, A_IP) or dig(utopo, A, "a.test")[0] == "NOERROR"
        # Root and a uid outside the range: not redirected, not policed.
        assert (
            utopo.ns(utopo.pod, "curl", "-s", "-o", "/dev/null", "-m", "2", f"http://{B_IP}/").returncode == 0
        )
        assert reaches(utopo, OUTSIDE, B_IP)
        assert dig(utopo, OUTSIDE, "a.test")[0] == "TIMEOUT", "10.204.0.9 runs no DNS: not redirected"
        assert dig(utopo, OUTSIDE, "a.test", server=UPSTREAM_IPS[0]) == ("NOERROR", [A_IP])
        # egressd's own listeners are not reachable from a sandbox uid, its loopback is.
        api = as_uid(
            utopo,
            A,
            "curl",
            "-s",
            "-o",
            "/dev/null",
            "--connect-timeout",
            "1",
            f"http://127.0.0.1:{uidd.port}/healthz",
        )
        assert api.returncode != 0
        own = as_uid(
            utopo,
            A,
            SYSTEM_PYTHON,
            "-c",
            "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "socket.create_connection(s.getsockname(), timeout=1)",
        )
        assert own.returncode == 0, own.stderr
    finally:
        remove(uidd, "ua")


def test_validation_of_the_process_attachment(uidd: Daemon) -> None:
    assert uidd.post(envelope("SET_BINDING", "bad", host_uid=OUTSIDE, body="{}"))[0] == 400
    assert uidd.post(envelope("SET_BINDING", "bad", host_uid=0, body="{}"))[0] == 400
    both = envelope("SET_BINDING", "bad", host_uid=A, body="{}")
    both["attachment"]["network"] = {"ip": "10.203.0.11", "hostVeth": "v", "gateway": "10.203.0.1"}
    assert uidd.post(both)[0] == 400
    bind(uidd, "ua", A, policy("a.test"), activate=False)
    try:
        code, text = uidd.post(envelope("SET_BINDING", "other", host_uid=A, body="{}"))
        assert code == 409, text
    finally:
        remove(uidd, "ua")
    assert "other" not in uid_elements(uidd)


def test_remove_binding_leaves_nothing(utopo: Topology, uidd: Daemon) -> None:
    before = uid_elements(uidd)
    bind(uidd, "ua", A, policy("a.test"))
    assert dig(utopo, A, "a.test") == ("NOERROR", [A_IP])
    listening = utopo.ns(utopo.pod, "ss", "-Hlnu").stdout
    assert f"127.0.0.1:{DNS_BASE}" in listening
    remove(uidd, "ua")
    assert str(A) not in uid_elements(uidd)
    assert not any("s_ua" in name for name in uidd.object_names())
    assert uid_elements(uidd) == before
    assert f"127.0.0.1:{DNS_BASE} " not in utopo.ns(utopo.pod, "ss", "-Hlnu").stdout
    assert not reaches(utopo, A, A_IP), "the flow's next packet is judged: nothing of A is left"
    assert dig(utopo, A, "a.test")[0] == "NXDOMAIN"


def test_injection_for_the_bound_uid_only(utopo: Topology, uidd: Daemon) -> None:
    vault = {
        "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET}}],
        "bindings": [{"name": "b", "match": {"hosts": [API]}, "auth": {"type": "bearer", "credential": "k"}}],
    }
    bind(uidd, "ua", A, policy(API))
    bind(uidd, "ub", B, policy(API))
    try:
        path = utopo.workdir / "vault.json"
        path.write_text(json.dumps(vault))
        code, text = uidd._curl(
            "-X",
            "PUT",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            f"@{path}",
            f"http://127.0.0.1:{uidd.port}/v1/sandboxfleets/ua/egress/credential-vault",
        )
        assert code == 201, text
        for uid in (A, B):
            assert dig(utopo, uid, API) == ("NOERROR", [API_IP])

        def https(uid: int, ca: str) -> dict[str, Any]:
            r = as_uid(
                utopo,
                uid,
                "curl",
                "-s",
                "-m",
                "5",
                "--cacert",
                str(utopo.workdir / ca),
                "--resolve",
                f"{API}:443:{API_IP}",
                f"https://{API}/v1/x",
            )
            return decode_echo(r.stdout)  # what the upstream received (the MITM redacts the plain fields)

        got_a = https(A, "ca.pem")  # decrypted by the MITM: its CA
        got_b = https(B, "upstream-ca.pem")  # no vault: passed through, the upstream's own CA
        assert got_a.get("headers", {}).get("Authorization") == f"Bearer {SECRET}", got_a
        assert got_b.get("tls") is True, "B's request reached the upstream"
        assert "Authorization" not in got_b.get("headers", {})
        assert SECRET not in uidd.log_text()
    finally:
        remove(uidd, "ua")
        remove(uidd, "ub")


SQUATTER = r"""
import socket, sys, time
port = int(sys.argv[1])
print("trying", flush=True)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
end = time.monotonic() + 10
while True:
    try:
        s.bind(("0.0.0.0", port))
        break
    except OSError:
        if time.monotonic() > end:
            print("gave up", flush=True)
            sys.exit(1)
        time.sleep(0.002)
s.listen(8)
print("bound", flush=True)
s.settimeout(6)
try:
    s.accept()
    print("accepted", flush=True)
except OSError:
    print("none", flush=True)
"""


def _line(proc: subprocess.Popen[str], deadline_s: float) -> str:
    """The squatter's next line (it prints within its own bounded waits)."""
    assert proc.stdout is not None
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        line = proc.stdout.readline().strip()
        if line or proc.poll() is not None:
            return line
    return ""


def test_a_sandbox_uid_cannot_squat_a_dead_workers_port(utopo: Topology, uidd: Daemon) -> None:
    """A restarting MITM worker leaves its ports free for a moment. An in-range uid that binds one
    (here C, the victim A's per-subject MITM port) must not receive A's intercepted connection:
    its replies from egressd's listener ports are refused on output, so nothing connects."""
    bind(uidd, "ua", A, policy(API))
    squatter: subprocess.Popen[str] | None = None
    try:
        assert dig(utopo, A, API) == ("NOERROR", [API_IP])
        code, body = uidd.get("/v1/subjects")
        assert code == 200, body
        doc = json.loads(body)
        subjects = doc["subjects"] if isinstance(doc, dict) else doc
        port = next(int(s["mitmPort"]) for s in subjects if s["uid"] == "ua")
        workers = uidd.status()["mitmWorkers"]
        assert isinstance(workers, list)
        slot = port - (DNS_BASE + MAX_SUBJECTS + 1)  # the per-subject MITM block follows the DNS block
        owner = next(w for w in workers if int(w["worker"]) == slot % len(workers))  # slot % N serves it
        squatter = utopo.spawn(
            utopo.pod,
            "setpriv",
            f"--reuid={C}",
            f"--regid={C}",
            "--clear-groups",
            SYSTEM_PYTHON,
            "-c",
            SQUATTER,
            str(port),
            ready_line="trying",
        )
        os.kill(int(owner["pid"]), signal.SIGKILL)
        assert _line(squatter, 12) == "bound", "the squatter could not take the port"
        r = as_uid(utopo, A, "curl", "-s", "-o", "/dev/null", "-m", "2", f"http://{API_IP}/x")
        assert r.returncode != 0, "A's intercepted connection was answered"
        assert _line(squatter, 10) == "none", "the squatter accepted A's connection"
    finally:
        if squatter is not None:
            utopo.stop(squatter)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and uidd.get("/healthz")[0] != 200:
            time.sleep(0.1)
        remove(uidd, "ua")
    assert uidd.get("/healthz")[0] == 200, "the worker came back once the port was free"


def test_kill_9_and_replay_restore_a_uid_subject(utopo: Topology, uidd: Daemon) -> None:
    """Last in the module: it kills the module's daemon and starts it again (same table)."""
    bind(uidd, "ub", B, policy("b.test"))
    assert dig(utopo, B, "b.test")[0] == "NOERROR" and reaches(utopo, B, B_IP)
    assert uidd.proc is not None
    uidd.proc.send_signal(signal.SIGKILL)
    uidd.proc.wait(5)
    uidd.proc = None
    assert not reaches(utopo, C, B_IP), "with the daemon dead the kernel keeps enforcing"
    uidd.start(wait=False)
    uidd.wait_ready(timeout=30)
    assert not reaches(utopo, B, B_IP), "after the restart the table is reset: B is unknown again"
    assert dig(utopo, B, "b.test")[0] == "NXDOMAIN"
    bind(uidd, "ub", B, policy("b.test"))  # the Fastlet's replay
    try:
        assert dig(utopo, B, "b.test") == ("NOERROR", [B_IP])
        assert reaches(utopo, B, B_IP)
        assert not reaches(utopo, B, A_IP)
    finally:
        remove(uidd, "ub")
