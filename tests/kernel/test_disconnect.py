"""docs/reference/behaviour.md §14.10 against the real daemon and kernel: a dispatcher that goes away mid-action.

The client is a raw socket (tests/kernel/rawclient.py) run in the pod namespace, talking to
the daemon on 127.0.0.1; it half-closes, closes or resets at chosen points of a request.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.kernel.topology import REPO, UPSTREAM_IPS, VENV_PY, Daemon, Topology, envelope

DPR = "sandbox.data-plane-ready"
RAWCLIENT = REPO / "tests" / "kernel" / "rawclient.py"
POLICY = json.dumps({"defaultAction": "deny", "egress": [{"action": "allow", "target": UPSTREAM_IPS[0]}]})


def raw(topo: Topology, daemon: Daemon, doc: dict[str, Any], mode: str) -> tuple[int, str]:
    body = topo.workdir / f"raw-{mode}.json"
    body.write_text(json.dumps(doc))
    r = topo.ns(
        topo.pod,
        str(VENV_PY),
        str(RAWCLIENT),
        "--port",
        str(daemon.port),
        "--body-file",
        str(body),
        "--mode",
        mode,
        timeout=30,
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return int(out["status"]), str(out["body"])


def subjects(daemon: Daemon) -> dict[str, dict[str, Any]]:
    code, body = daemon.get("/v1/subjects")
    assert code == 200, body
    return {s["uid"]: s for s in json.loads(body)["subjects"]}


def wait_state(daemon: Daemon, uid: str, state: str, timeout: float = 10) -> dict[str, Any]:
    """The subject once it is in ``state`` (the action of a client that left has no reply to
    wait for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = subjects(daemon).get(uid)
        if s is not None and s["state"] == state:
            return s
        time.sleep(0.05)
    raise AssertionError(f"{uid} never reached {state}: {subjects(daemon)}\n{daemon.log_text()[-3000:]}")


def kernel_state(daemon: Daemon) -> list[str]:
    """The table as comparable data: handles (renumbered by a re-run) and counter values
    (traffic) left out; set elements and chain rules kept."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: strip(v)
                for k, v in node.items()
                if k != "handle" and not (k in ("packets", "bytes") and isinstance(v, int))
            }
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    items = [
        json.dumps(strip(item), sort_keys=True) for item in daemon.table_json() if "metainfo" not in item
    ]
    return sorted(items)


def subject_objects(daemon: Daemon, nft_id: str) -> set[str]:
    return {n for n in daemon.object_names() if nft_id in n}


def test_half_close_after_the_body_still_gets_the_200_and_registers_deny_first(
    topo: Topology, daemon: Daemon
) -> None:
    code, body = raw(
        topo, daemon, envelope("SET_BINDING", "hc", ip=topo.sb_ip(1), policy=POLICY), "half-close"
    )
    assert (code, body) == (200, "{}")
    s = subjects(daemon)["hc"]
    assert s["state"] == "denying" and s["pending"]
    # Deny-first is in the kernel: the subject's chain exists and drops its traffic.
    assert "subj_s_hc" in daemon.object_names()
    assert topo.sb_ip(1) in daemon.map_keys("dispatch_v4")
    assert not topo.reaches(1, UPSTREAM_IPS[0])


def test_half_close_before_the_body_is_complete_is_400_and_registers_nothing(
    topo: Topology, daemon: Daemon
) -> None:
    before = kernel_state(daemon)
    doc = envelope("SET_BINDING", "hcp", ip=topo.sb_ip(1), policy=POLICY)
    body = topo.workdir / "partial.json"
    full = json.dumps(doc)
    # Content-Length of the whole body, a FIN after part of it.
    body.write_text(full)
    script = (
        "import socket,sys\n"
        f"s=socket.create_connection(('127.0.0.1',{daemon.port}),timeout=10)\n"
        f"b=open({str(body)!r},'rb').read()\n"
        "s.sendall(b'POST /_fastlet/v1/actions HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: %d\\r\\n\\r\\n'%len(b)+b[:-8])\n"
        "s.shutdown(socket.SHUT_WR)\n"
        "d=b''\n"
        "while (c:=s.recv(65536)): d+=c\n"
        "sys.stdout.write(d.split(b' ',2)[1].decode() if d else '0')\n"
    )
    r = topo.ns(topo.pod, str(VENV_PY), "-c", script, timeout=30)
    assert r.stdout == "400"
    assert "hcp" not in subjects(daemon)
    assert kernel_state(daemon) == before


@pytest.mark.parametrize("mode", ["partial-close", "partial-reset"])
def test_gone_before_the_body_is_complete_registers_nothing(
    topo: Topology, daemon: Daemon, mode: str
) -> None:
    before = kernel_state(daemon)
    code, _ = raw(topo, daemon, envelope("SET_BINDING", "gp", ip=topo.sb_ip(1), policy=POLICY), mode)
    assert code == 0
    time.sleep(0.3)
    # The daemon still serves, and the cut-short action left nothing behind.
    assert "gp" not in subjects(daemon)
    assert kernel_state(daemon) == before
    assert not any("s_gp" in n for n in daemon.object_names())


@pytest.mark.parametrize("mode", ["close", "reset"])
def test_gone_after_the_body_state_committed_and_the_retry_is_idempotent(
    topo: Topology, daemon: Daemon, mode: str
) -> None:
    bind = envelope("SET_BINDING", "gone", ip=topo.sb_ip(1), policy=POLICY)
    ready = envelope("LIFECYCLE_HOOK", "gone", hook=DPR)

    assert raw(topo, daemon, bind, mode)[0] == 0
    wait_state(daemon, "gone", "denying")
    denying = kernel_state(daemon)
    assert subject_objects(daemon, "s_gone")
    assert not topo.reaches(1, UPSTREAM_IPS[0])
    # The dispatcher never saw a reply and retries: 200, same kernel state.
    assert daemon.post(bind) == (200, "{}")
    assert kernel_state(daemon) == denying

    assert raw(topo, daemon, ready, mode)[0] == 0
    wait_state(daemon, "gone", "active")
    active = kernel_state(daemon)
    assert active != denying
    assert topo.reaches(1, UPSTREAM_IPS[0]) and not topo.reaches(1, UPSTREAM_IPS[1])
    assert daemon.post(ready) == (200, "{}")
    assert daemon.post(bind) == (200, "{}")  # the same binding again, applied in place
    assert kernel_state(daemon) == active
    assert subjects(daemon)["gone"]["state"] == "active"


def test_reset_during_a_big_kernel_step_commits_all_of_it(topo: Topology, daemon: Daemon) -> None:
    """A 1000-rule policy makes the activation's kernel step long, so the RST, sent
    right after the body, likely arrives while it runs. All of it is committed, and a retry
    leaves it as it is. (1000, not the 4096 cap: a few thousand set elements overflow one
    netlink attribute today, a separate bug.)"""
    targets = [f"10.{200 + i // 65536}.{(i // 256) % 256}.{i % 256}" for i in range(1, 1001)]
    policy = json.dumps(
        {
            "defaultAction": "deny",
            "egress": [{"action": "allow", "target": UPSTREAM_IPS[0]}]
            + [{"action": "allow", "target": t} for t in targets[:-1]],
        }
    )
    assert daemon.post(envelope("SET_BINDING", "big", ip=topo.sb_ip(1), policy=policy))[0] == 200
    assert raw(topo, daemon, envelope("LIFECYCLE_HOOK", "big", hook=DPR), "reset")[0] == 0
    s = wait_state(daemon, "big", "active", timeout=30)
    assert not s["pending"]
    out = json.loads(daemon.nft("-j", "list", "set", "inet", daemon.table, "subj_s_big_allow_v4"))
    elems = next(i["set"] for i in out["nftables"] if "set" in i).get("elem", [])
    assert len(elems) == 1000  # every rule, not a prefix of them
    assert topo.reaches(1, UPSTREAM_IPS[0])
    state = kernel_state(daemon)
    assert daemon.post(envelope("LIFECYCLE_HOOK", "big", hook=DPR)) == (200, "{}")
    assert kernel_state(daemon) == state
