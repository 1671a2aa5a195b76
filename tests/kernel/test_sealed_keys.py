"""Sealed-vault key files added and removed while the real fleet daemon runs (docs/reference/behaviour.md §11).

One daemon with its own ``EGRESSD_VAULT_KEYS_DIR``, table and port; SET_BINDING envelopes with
wrappers sealed by ``egressd.vault.sealed`` (what ``egressctl vault seal`` does). The daemon
rescans the directory at most once a second, so each change is followed by a wait just over
that bound before the one request that checks it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egressd.vault.sealed import build_wrapper, seal
from tests.kernel.topology import Daemon, Topology, envelope

PORT = 18191  # inside the pod namespace; apart from conftest's counter and the other modules
TABLE = "egt-keys"
DPR = "sandbox.data-plane-ready"
SECRET = "sk-sealed-keys-kernel-PLANTED"
POLICY = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "a.test"}]}
VAULT = {
    "credentials": [{"name": "tok", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {"name": "b", "match": {"hosts": ["a.test"]}, "auth": {"type": "bearer", "credential": "tok"}}
    ],
}
RESCAN_S = 1.0  # the daemon's bound: at most one directory scan per second


def key_of(kid: str) -> bytes:
    return (kid.encode() * 32)[:32]


def put_key(keys: Path, kid: str, t: int) -> None:
    """Install ``<kid>.key`` the way docs/reference/vault-format.md says: write aside, then rename."""
    tmp = keys / f".{kid}.tmp"
    tmp.write_bytes(key_of(kid))
    os.chmod(tmp, 0o400)
    tmp.replace(keys / f"{kid}.key")
    os.utime(keys / f"{kid}.key", ns=(t * 10**9, t * 10**9))


def sealed_input(uid: str, kid: str, value: str = SECRET) -> str:
    doc = json.loads(json.dumps(VAULT))
    doc["credentials"][0]["source"]["value"] = value
    return json.dumps(build_wrapper(POLICY, seal(json.dumps(doc).encode(), uid, kid, key_of(kid))))


@pytest.fixture(scope="module")
def keysd(topo: Topology) -> Iterator[tuple[Daemon, Path]]:
    keys = topo.workdir / "sealed-keys"
    keys.mkdir(exist_ok=True)
    put_key(keys, "k1", 1)
    put_key(keys, "k2", 2)
    d = Daemon(topo, table=TABLE, port=PORT, env={"EGRESSD_VAULT_KEYS_DIR": str(keys)})
    try:
        d.start()
        yield d, keys
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", TABLE, check=False)


def set_binding(d: Daemon, uid: str, sb: int, text: str) -> tuple[int, str]:
    return d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(sb), policy=text))


def settle() -> None:
    """Wait out the rescan bound: the first open after this rescans (its last scan is older
    than 1 s), so one request decides; a retry loop could land inside the bound and mutate."""
    time.sleep(RESCAN_S + 0.2)


def vault_revision(d: Daemon, uid: str) -> Any:
    subjects = json.loads(d.get("/v1/subjects")[1])["subjects"]
    return next(s["vaultRevision"] for s in subjects if s["uid"] == uid)


def test_key_files_removed_and_added_while_running(keysd: tuple[Daemon, Path]) -> None:
    d, keys = keysd
    uid = "keys-1"
    try:
        assert set_binding(d, uid, 1, sealed_input(uid, "k1")) == (200, "{}")
        assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")
        assert vault_revision(d, uid) == 1

        # k1.key removed: a wrapper sealed with it is refused as an unknown kid, nothing changes.
        (keys / "k1.key").unlink()
        settle()
        code, body = set_binding(d, uid, 1, sealed_input(uid, "k1", "v2"))
        assert code == 400 and "unknown kid 'k1'" in body, (code, body)
        assert vault_revision(d, uid) == 1

        # k3.key added: a wrapper sealed with it is accepted.
        put_key(keys, "k3", 3)
        settle()
        assert set_binding(d, uid, 1, sealed_input(uid, "k3", "v3")) == (200, "{}")
        assert vault_revision(d, uid) == 2
        assert set_binding(d, uid, 1, sealed_input(uid, "k2", "v4")) == (200, "{}")  # k2 still in

        # k4..k6: k2 is now older than the newest + 3 and refused like a kid never seen.
        for i in (4, 5, 6):
            put_key(keys, f"k{i}", i)
        settle()
        code, body = set_binding(d, uid, 1, sealed_input(uid, "k2", "v5"))
        assert code == 400 and "unknown kid 'k2'" in body, (code, body)
        assert vault_revision(d, uid) == 3
        assert set_binding(d, uid, 1, sealed_input(uid, "k6", "v6")) == (200, "{}")
        assert vault_revision(d, uid) == 4

        # A key file broken while running: ignored with one warning naming the kid only.
        (keys / "k5.key").unlink()
        (keys / "k5.key").write_bytes(b"not-a-key")
        settle()
        code, body = set_binding(d, uid, 1, sealed_input(uid, "k5", "v7"))
        assert code == 400 and "unknown kid 'k5'" in body, (code, body)
        assert set_binding(d, uid, 1, sealed_input(uid, "k4", "v8")) == (200, "{}")
        log = d.log_text()
        assert '"vault.key_ignored"' in log and '"kid": "k5"' in log
        assert '"vault.keys_changed"' in log
        for kid in ("k1", "k2", "k3", "k4", "k5", "k6"):
            assert key_of(kid).hex() not in log
        assert SECRET not in log and "not-a-key" not in log
    finally:
        d.post(envelope("REMOVE_BINDING", uid))
