"""Several MITM workers (EGRESSD_MITM_WORKERS=2) against the real kernel: each subject's
intercepted connections land on its own worker (the fleet's ``mitm_port_v4`` map), and a dead
worker's subjects are refused by the kernel (nothing listens on its port) while the other
worker's subjects keep getting injection; after the restart the first subject works again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.test_mitm import POLICY, SECRET, VAULT, api, learn
from tests.kernel.topology import GATEWAY, Daemon, Topology, envelope

MITM_PORT = 18281
TABLE = "egt-mitmw"
DPR = "sandbox.data-plane-ready"
API = "api.example.test"


@pytest.fixture(scope="module")
def workers(topo: Topology) -> Iterator[Daemon]:
    env = {
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(topo.tls_dir / "trust"),
        # The same confdir as test_mitm.py: the same CA, which the sandbox clients trust.
        "EGRESSD_MITM_CONFDIR": str(topo.workdir / "mitm-conf"),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(topo.workdir / "mitm-run-w" / "active.sock"),
        "EGRESSD_MITM_WORKERS": "2",
    }
    d = Daemon(topo, table=TABLE, port=18290, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=40)
        yield d
    finally:
        if d.proc is not None:
            topo.stop(d.proc)
        d.nft("delete", "table", "inet", TABLE, check=False)
        print(d.log_text()[-6000:])


def _bind(d: Daemon, i: int, uid: str) -> None:
    for body in (
        envelope("SET_BINDING", uid, ip=Topology.sb_ip(i), policy=POLICY),
        envelope("LIFECYCLE_HOOK", uid, hook=DPR),
    ):
        code, text = d.post(body)
        assert (code, text) == (200, "{}"), text
    path = d.topo.workdir / "vault-w.json"
    path.write_text(json.dumps(VAULT))
    code, _ = d._curl(
        "-X", "PUT", "-H", "Content-Type: application/json", "--data-binary", f"@{path}",
        f"http://127.0.0.1:{d.port}/v1/sandboxfleets/{uid}/egress/credential-vault",
    )  # fmt: skip
    assert code == 201


def _injected(d: Daemon) -> dict[str, float]:
    code, text = d.get("/metrics")
    assert code == 200
    out: dict[str, float] = {}
    for line in text.splitlines():
        for w in ("0", "1"):
            if line.startswith(f'egressd_mitm_requests_total{{worker="{w}",outcome="injected"}} '):
                out[w] = float(line.split()[-1])
    return out


def _subject_workers(d: Daemon) -> dict[str, Any]:
    code, body = d.get("/v1/subjects")
    assert code == 200, body
    doc = json.loads(body)
    subjects = doc["subjects"] if isinstance(doc, dict) else doc
    return {s["uid"]: s.get("mitmWorker") for s in subjects}


def _worker(d: Daemon, i: int) -> dict[str, Any]:
    ws = d.status()["mitmWorkers"]
    assert isinstance(ws, list)
    return next(dict(w) for w in ws if w["worker"] == i)


def _http_requests(topo: Topology) -> int:
    return sum(1 for r in topo.upstream_requests() if "dns" not in r)


def _healthz(d: Daemon) -> tuple[int, str]:
    return d.get("/healthz")


def test_both_worker_ports_listen_and_each_is_policed(topo: Topology, workers: Daemon) -> None:
    status = workers.status()
    ws = status["mitmWorkers"]
    assert isinstance(ws, list) and [w["port"] for w in ws] == [MITM_PORT, MITM_PORT + 1]
    assert all(w["ready"] and isinstance(w["pid"], int) for w in ws)
    table = workers.nft("list", "table", "inet", TABLE)
    assert f"tcp dport {MITM_PORT}-{MITM_PORT + 1}" in table
    assert "redirect to ip saddr map @mitm_port_v4" in table or "redirect to :ip saddr map @mitm_port_v4" in table


def test_each_subject_lands_on_its_own_worker(topo: Topology, workers: Daemon) -> None:
    _bind(workers, 1, "w1")
    _bind(workers, 2, "w2")
    try:
        assert _subject_workers(workers) == {"w1": 0, "w2": 1}, "least loaded, ties to the lowest"
        assert workers.map_keys("mitm_port_v4") == {Topology.sb_ip(1), Topology.sb_ip(2)}
        for i in (1, 2):
            learn(topo, i, API)
        for i, w in ((1, "0"), (2, "1")):
            before = _injected(workers)
            r = api(topo, i)
            assert r.code == 200 and r.upstream_header("Authorization") == f"Bearer {SECRET}"
            after = _injected(workers)
            assert after.get(w, 0) == before.get(w, 0) + 1, (i, before, after)
            other = "1" if w == "0" else "0"
            assert after.get(other, 0) == before.get(other, 0), "the other worker saw nothing"
    finally:
        for uid in ("w1", "w2"):
            workers.post(envelope("REMOVE_BINDING", uid))


def test_a_dead_worker_blocks_its_subjects_only_then_recovers(topo: Topology, workers: Daemon) -> None:
    _bind(workers, 1, "w1")
    _bind(workers, 2, "w2")
    try:
        assert _subject_workers(workers) == {"w1": 0, "w2": 1}
        for i in (1, 2):
            learn(topo, i, API)
            assert api(topo, i).code == 200
        victim = _worker(workers, 1)
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and _healthz(workers)[0] == 200:
            time.sleep(0.02)
        code, text = _healthz(workers)
        assert code == 503 and "mitm worker 1 not ready" in text, (code, text)
        seen = _http_requests(topo)
        # Nothing listens on worker 1's port: the kernel refuses the connection, and the
        # upstream never hears of it (fail closed, never passed through unintercepted).
        assert api(topo, 2, timeout=1.0).code == 0
        assert _http_requests(topo) == seen
        # Worker 0's subject is untouched.
        r = api(topo, 1)
        assert r.code == 200 and r.upstream_header("Authorization") == f"Bearer {SECRET}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _healthz(workers)[0] != 200:
            time.sleep(0.1)
        assert _healthz(workers)[0] == 200
        now = _worker(workers, 1)
        assert now["pid"] != victim["pid"] and now["starts"] == victim["starts"] + 1
        r = api(topo, 2)
        assert r.code == 200 and r.upstream_header("Authorization") == f"Bearer {SECRET}"
    finally:
        for uid in ("w1", "w2"):
            workers.post(envelope("REMOVE_BINDING", uid))


def test_removal_frees_the_worker_port_element(topo: Topology, workers: Daemon) -> None:
    _bind(workers, 3, "w3")
    assert workers.map_keys("mitm_port_v4") == {Topology.sb_ip(3)}
    workers.post(envelope("REMOVE_BINDING", "w3"))
    assert workers.map_keys("mitm_port_v4") == set()
    assert Topology.sb_ip(3) not in workers.nft("list", "set", "inet", TABLE, "mitm_src_v4")


def test_the_host_uid_port_block_is_partitioned_between_the_workers(workers: Daemon) -> None:
    """Every per-subject MITM port (docs/reference/behaviour.md §17) has exactly one worker listening."""
    lo, hi = 16000 + 256 + 1, 16000 + 2 * 256  # the default block's MITM ports
    owners: dict[int, list[int]] = {}
    for w in (_worker(workers, 0), _worker(workers, 1)):
        argv = Path(f"/proc/{w['pid']}/cmdline").read_bytes().decode().split("\0")
        for arg in argv:
            if arg.startswith("mode=transparent@"):
                owners.setdefault(int(arg.split("@", 1)[1]), []).append(int(w["worker"]))
    assert sorted(owners) == list(range(lo, hi + 1))
    assert all(len(v) == 1 for v in owners.values())
    assert owners[lo] == [0] and owners[lo + 1] == [1] and owners[lo + 2] == [0]


def test_an_intercepted_source_without_a_worker_port_never_reaches_the_upstream(
    topo: Topology, workers: Daemon
) -> None:
    """A kernel state no transaction makes (the port element gone, ``mitm_src`` still holding the
    source): the redirect's map lookup misses, and the rule after it drops the packet instead of
    letting it take the forward path to the upstream unintercepted (uninjected, undecrypted)."""
    _bind(workers, 4, "w4")
    try:
        learn(topo, 4, API)
        assert api(topo, 4).code == 200
        ip = Topology.sb_ip(4)
        workers.nft("delete", "element", "inet", TABLE, "mitm_port_v4", f"{{ {ip} }}")
        assert ip in workers.nft("list", "set", "inet", TABLE, "mitm_src_v4")
        seen = _http_requests(topo)
        assert api(topo, 4, timeout=1.0).code == 0
        assert _http_requests(topo) == seen, "the upstream heard from a source that skipped the MITM"
    finally:
        # Put an element back so the removal (which deletes it) goes through.
        ip = Topology.sb_ip(4)
        workers.nft("add", "element", "inet", TABLE, "mitm_port_v4", f"{{ {ip} : {MITM_PORT} }}", check=False)
        code, text = workers.post(envelope("REMOVE_BINDING", "w4"))
        assert code == 200, text


def test_a_direct_connection_to_any_worker_port_is_dropped(topo: Topology, workers: Daemon) -> None:
    """The input hook polices every worker's port, not only the first: a sandbox that connects to
    one directly (no REDIRECT, so no original destination to judge) gets nothing."""
    _bind(workers, 1, "w1")
    try:
        for port in (MITM_PORT, MITM_PORT + 1):
            assert topo.curl(1, f"http://{GATEWAY}:{port}/", timeout=1.0) == 0, port
            assert topo.curl(1, f"https://{GATEWAY}:{port}/", timeout=1.0) == 0, port
    finally:
        workers.post(envelope("REMOVE_BINDING", "w1"))
