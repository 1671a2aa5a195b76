"""Process hygiene (docs/reference/behaviour.md §14.9) against the real daemon and its real MITM child, both profiles.

Core dumps: ``/proc/<pid>/limits`` shows the core limit 0/0. The dumpable flag has no /proc
field, so it is observed by what it is for: a process with the same uid and gid and at least
the target's capabilities, but without CAP_SYS_PTRACE, can open a dumpable process's
``/proc/<pid>/mem`` and cannot open a non-dumpable one's (the kernel's ptrace access check).
The daemons run under ``setpriv`` without CAP_SYS_PTRACE (they never need it) so that such a
reader can exist; a dumpable ``sleep`` started the same way is the control that the reader can
open memory at all.

Snapshot cache: ``egressd_mitm_snapshot_cache_entries`` (the child's own report) after a
request, then after REMOVE_BINDING, a vault DELETE and a rebind (fleet), a vault DELETE (sidecar).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.kernel.sidecar import Sidecar
from tests.kernel.test_mitm import API, POLICY, SECRET, api, bind, learn, unbind, vault_call
from tests.kernel.test_mitm import VAULT as FLEET_VAULT
from tests.kernel.test_sidecar_mitm import API_IP as SC_API_IP
from tests.kernel.test_sidecar_mitm import POLICY as SC_POLICY
from tests.kernel.test_sidecar_mitm import SECRET as SC_SECRET
from tests.kernel.test_sidecar_mitm import VAULT as SC_VAULT
from tests.kernel.test_sidecar_mitm import https
from tests.kernel.topology import Daemon, Topology, cleanup_stale, envelope

MITM_PORT = 18182
NO_PTRACE = ("setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace")
NO_CAPS = ("setpriv", "--inh-caps=-all", "--bounding-set=-all")
MITM_GID = 18081  # the sidecar's MITM child group


def core_limits(pid: int) -> list[str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max core file size"):
            return line.split()[4:6]
    raise AssertionError("no core limit line")


def opens_memory(reader: tuple[str, ...], pid: int) -> bool:
    """Can a process started with ``reader`` (a setpriv prefix) open ``/proc/<pid>/mem``?"""
    r = subprocess.run(
        [*reader, "python3", "-c", "import sys; open(f'/proc/{sys.argv[1]}/mem', 'rb').close()", str(pid)],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert r.returncode == 0 or "Permission denied" in r.stderr, r.stderr
    return r.returncode == 0


def assert_reader_discriminates(reader: tuple[str, ...], target_prefix: tuple[str, ...]) -> None:
    """The control: the same reader opens a dumpable process's memory started like the target."""
    sleeper = subprocess.Popen([*target_prefix, "sleep", "30"])
    try:
        time.sleep(0.2)
        assert opens_memory(reader, sleeper.pid), "reader cannot open even a dumpable process"
    finally:
        sleeper.kill()
        sleeper.wait(5)


def child_pid(topo: Topology, ns: str, parent: int) -> int:
    out = topo.ns(ns, "ps", "-o", "pid=,args=", "--ppid", str(parent), check=False).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if "egressd.mitmchild.runner" in line]
    assert len(pids) == 1, out
    return pids[0]


def cache_entries(text: str) -> float | None:
    for line in text.splitlines():
        if line.startswith('egressd_mitm_snapshot_cache_entries{worker="0"} '):
            return float(line.split()[1])
    return None


def wait_for(get: Callable[[], float | None], want: float, timeout: float = 5.0) -> float | None:
    deadline = time.monotonic() + timeout
    got = get()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.1)
        got = get()
    return got


# --------------------------------------------------------------------------- fleet


@pytest.fixture(scope="module")
def hd(topo: Topology) -> Iterator[Daemon]:
    env = {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "mitm-conf"),  # the CA test_mitm's curl trusts
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "hyg-run" / "active.sock"),
    }
    d = Daemon(topo, table="egt-hyg", port=18191, env=env, prefix=NO_PTRACE)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            topo.stop(d.proc)
        d.nft("delete", "table", "inet", "egt-hyg", check=False)
        print(d.log_text()[-6000:])


def test_fleet_daemon_and_child_dump_no_core_and_refuse_same_uid_memory_readers(
    topo: Topology, hd: Daemon
) -> None:
    assert hd.proc is not None
    daemon = hd.proc.pid
    child = child_pid(topo, topo.pod, daemon)
    # egressd: root, every capability but CAP_SYS_PTRACE; the reader has the same.
    assert_reader_discriminates(NO_PTRACE, NO_PTRACE)
    assert not opens_memory(NO_PTRACE, daemon)
    # The child has no capability at all (supervisor), root uid and gid: so may the reader.
    assert_reader_discriminates(NO_CAPS, NO_CAPS)
    assert not opens_memory(NO_CAPS, child), "set again after the child's exec"
    assert core_limits(daemon) == ["0", "0"]
    assert core_limits(child) == ["0", "0"]


def test_fleet_child_forgets_removed_vault_less_and_rebound_clients(topo: Topology, hd: Daemon) -> None:
    def entries() -> float | None:
        return cache_entries(hd.get("/metrics")[1])

    def injected() -> None:
        r = api(topo, 1)
        assert r.code == 200 and r.upstream_header("Authorization") == f"Bearer {SECRET}", r.text
        assert wait_for(entries, 1) == 1, "the child holds this client's snapshot"

    try:
        # 1. REMOVE_BINDING.
        bind(hd, 1, "h1")
        learn(topo, 1, API)
        injected()
        assert hd.post(envelope("REMOVE_BINDING", "h1"))[0] == 200
        assert wait_for(entries, 0) == 0, "removed: no snapshot left for that address"
        # 2. The vault deleted (the subject stays).
        bind(hd, 1, "h1")
        learn(topo, 1, API)
        injected()
        assert vault_call(hd, "h1", "DELETE")[0] == 204
        assert wait_for(entries, 0) == 0, "vault deleted: no snapshot left"
        # 3. Rebound (new fence): a new fence never inherits credentials (§6).
        assert vault_call(hd, "h1", "PUT", FLEET_VAULT)[0] == 201
        injected()
        code, body = hd.post(envelope("SET_BINDING", "h1", rid="r2", ip=Topology.sb_ip(1), policy=POLICY))
        assert code == 200, body
        assert wait_for(entries, 0) == 0, "rebound: no snapshot left"
    finally:
        unbind(hd, "h1")
        hd.post(envelope("REMOVE_BINDING", "h1", rid="r2"))


# --------------------------------------------------------------------------- sidecar


@pytest.fixture(scope="module")
def htopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egh{os.getpid()}", sandboxes=1).up_()
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(htopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(htopo, sb=1, prefix=NO_PTRACE).with_mitm()
    sc.start()
    try:
        yield sc
    finally:
        print(sc.log_text()[-4000:])
        sc.cleanup()


def test_sidecar_daemon_and_child_dump_no_core_and_forget_a_deleted_vault(sidecar: Sidecar) -> None:
    assert sidecar.proc is not None
    daemon = sidecar.proc.pid
    child = child_pid(sidecar.topo, sidecar.ns, daemon)
    assert_reader_discriminates(NO_PTRACE, NO_PTRACE)
    assert not opens_memory(NO_PTRACE, daemon)
    # The child runs with group 18081: the reader takes the same uid and gid.
    same_ids = ("setpriv", f"--regid={MITM_GID}", "--clear-groups", *NO_CAPS[1:])
    assert_reader_discriminates(same_ids, same_ids)
    assert not opens_memory(same_ids, child)
    assert core_limits(daemon) == ["0", "0"] and core_limits(child) == ["0", "0"]

    def entries() -> float | None:
        return cache_entries(sidecar.api("GET", "/metrics")[1])

    sidecar.set_policy(SC_POLICY)
    assert sidecar.api("PUT", "/credential-vault", SC_VAULT)[0] == 201
    assert sidecar.dig(API)[0] == "NOERROR"
    code, echo = https(sidecar, API, SC_API_IP)
    assert code == 200 and echo["headers"].get("Authorization") == f"Bearer {SC_SECRET}", echo
    assert wait_for(entries, 1) == 1
    assert sidecar.api("DELETE", "/credential-vault")[0] == 204
    assert wait_for(entries, 0) == 0, "vault deleted: the child holds no snapshot"
