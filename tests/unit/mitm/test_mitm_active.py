"""§10 `_active` lookup: 400/404/200/304 and tags that change on every vault mutation."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

from egressd.addr import IPAddress
from egressd.mitm.active import active_app, active_lookup
from egressd.mitm.protocol import ACTIVE_PATH
from egressd.policy import parse_policy
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore

SECRET = "sk-PLANTED-active-0x1"
POLICY = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"api.example.com"}]}')
VAULT = {
    "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {"name": "b", "match": {"hosts": ["api.example.com"]}, "auth": {"type": "bearer", "credential": "k"}}
    ],
}


def _store() -> VaultStore:
    store = VaultStore()
    assert store.put(VAULT, POLICY)[0] == 201
    return store


def test_lookup_rows() -> None:
    store = _store()

    def lookup(ip: IPAddress) -> VaultSnapshot | None:
        return store.snapshot() if ip == ip_address("10.0.0.5") else None

    assert active_lookup(lookup, None, None).status == 400
    assert active_lookup(lookup, "not-an-ip", None).status == 400
    assert active_lookup(lookup, "10.0.0.9", None).status == 404
    ok = active_lookup(lookup, "::ffff:10.0.0.5", None)  # v4-mapped client addresses are unmapped
    assert ok.status == 200 and ok.etag and ok.body is not None
    assert SECRET not in repr(ok)
    assert active_lookup(lookup, "10.0.0.5", ok.etag).status == 304
    assert active_lookup(lookup, "10.0.0.5", f'W/{ok.etag}, "other"').status == 304
    assert active_lookup(lookup, "10.0.0.5", '"stale"').status == 200


def test_tag_changes_on_every_mutation_including_recreate() -> None:
    store = _store()
    tags = [store.snapshot().tag]  # type: ignore[union-attr]
    changed = {**VAULT, "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET + "2"}}]}
    assert store.put(changed, POLICY)[0] == 200
    tags.append(store.snapshot().tag)  # type: ignore[union-attr]
    assert store.delete()[0] == 204
    assert store.snapshot() is None
    assert store.put(VAULT, POLICY)[0] == 201  # revision restarts at 1
    tags.append(store.snapshot().tag)  # type: ignore[union-attr]
    assert len(set(tags)) == 3


async def test_app(aiohttp_client: Any) -> None:
    store = _store()
    client = await aiohttp_client(active_app(lambda ip: store.snapshot()))
    resp = await client.get(ACTIVE_PATH, params={"clientIp": "10.0.0.5"})
    assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
    etag = resp.headers["ETag"]
    body = await resp.json()
    assert body["bindings"][0]["name"] == "b"
    resp = await client.get(ACTIVE_PATH, params={"clientIp": "10.0.0.5"}, headers={"If-None-Match": etag})
    assert resp.status == 304 and await resp.read() == b""
    assert (await client.get(ACTIVE_PATH)).status == 400
    assert (await client.post(ACTIVE_PATH)).status == 405
