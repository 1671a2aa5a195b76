"""The MITM side of §10: strict ``_active`` parsing, every lookup-failure row, the cache, and a
real aiohttp ``_active`` server on a unix socket."""

from __future__ import annotations

import asyncio
import json
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from egressd.addr import IPAddress
from egressd.mitm.active import active_app, active_lookup
from egressd.mitm.protocol import DESTINATION_HEADER
from egressd.mitmchild.lookup import ActiveClient, LookupFailed, interpret
from egressd.mitmchild.wire import WireError, snapshot_from_active
from egressd.policy import parse_policy
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore

SECRET = "sk-PLANTED-lookup-77"
POLICY = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"api.example.com"}]}')
VAULT = {
    "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {
            "name": "b",
            "match": {"hosts": ["api.example.com"]},
            "auth": {
                "type": "bearer",
                "credential": "k",
                "substitutions": [{"credential": "k", "placeholder": "PH", "in": ["header"]}],
            },
        }
    ],
}


def snapshot() -> VaultSnapshot:
    store = VaultStore()
    assert store.put(VAULT, POLICY)[0] == 201
    snap = store.snapshot()
    assert snap is not None
    return snap


def body_of(snap: VaultSnapshot) -> bytes:
    return json.dumps(snap.to_json()).encode()


# --------------------------------------------------------------------------- wire


def test_round_trip_keeps_everything_the_engine_uses() -> None:
    snap = snapshot()
    back = snapshot_from_active(snap.to_json(), f'"{snap.tag}"')
    assert back.tag == snap.tag and back.revision == snap.revision
    assert back.bindings == snap.bindings
    assert set(back.redactions) == set(snap.redactions)
    assert SECRET not in repr(back)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("revision"),
        lambda d: d.update(revision=0),
        lambda d: d.update(revision=True),
        lambda d: d.update(revision="1"),
        lambda d: d.pop("bindings"),
        lambda d: d.update(bindings={}),
        lambda d: d.pop("redactions"),
        lambda d: d["bindings"][0].pop("name"),
        lambda d: d["bindings"][0]["match"].update(hosts=[]),
        lambda d: d["bindings"][0]["match"].pop("paths"),
        lambda d: d["bindings"][0]["headers"][0].update(value=5),
        lambda d: d["bindings"][0]["headers"][0].update(value=""),
        lambda d: d["bindings"][0]["substitutions"][0].update({"in": ["cookie"]}),
        lambda d: d["bindings"][0]["substitutions"][0].update({"in": []}),
        lambda d: d["bindings"][0]["substitutions"][0].pop("value"),
    ],
)
def test_any_schema_violation_is_an_error_that_quotes_no_value(mutate: Any) -> None:
    doc = snapshot().to_json()
    mutate(doc)
    with pytest.raises(WireError) as info:
        snapshot_from_active(doc, '"i-1"')
    assert SECRET not in str(info.value)


def test_a_missing_tag_is_an_error() -> None:
    with pytest.raises(WireError):
        snapshot_from_active(snapshot().to_json(), '""')


# --------------------------------------------------------------------------- interpret (§10 rows)


def test_404_means_no_vault() -> None:
    view = interpret(404, None, None, b"", snapshot())
    assert view.snapshot is None and not view.destination_ok


def test_200_gives_a_snapshot_and_the_destination_verdict() -> None:
    snap = snapshot()
    view = interpret(200, f'"{snap.tag}"', "verified", body_of(snap), None)
    assert view.snapshot is not None and view.snapshot.tag == snap.tag and view.destination_ok
    assert not interpret(200, f'"{snap.tag}"', "unverified", body_of(snap), None).destination_ok
    assert not interpret(200, f'"{snap.tag}"', None, body_of(snap), None).destination_ok


def test_304_reuses_the_cached_snapshot_without_copying() -> None:
    snap = snapshot()
    view = interpret(304, f'"{snap.tag}"', "verified", b"", snap)
    assert view.snapshot is snap and view.destination_ok


@pytest.mark.parametrize(
    ("status", "etag", "body", "cached"),
    [
        (500, '"x"', b"", False),
        (503, None, b"", False),
        (400, None, b"", False),
        (304, '"i-1"', b"", False),  # 304 without a cached tag
        (304, '"other"', b"", True),  # 304 for a tag we do not hold
        (304, None, b"", True),
        (200, None, b"{}", False),  # no ETag
        (200, '"x"', b"not json", False),
        (200, '"x"', b'{"revision":1}', False),  # bad schema
        (200, "SAME", b"", True),  # 200 carrying the tag we already hold
    ],
)
def test_lookup_failures(status: int, etag: str | None, body: bytes, cached: bool) -> None:
    snap = snapshot()
    if etag == "SAME":
        etag, body = f'"{snap.tag}"', body_of(snap)
    with pytest.raises(LookupFailed) as info:
        interpret(status, etag, None, body, snap if cached else None)
    assert SECRET not in str(info.value)


# --------------------------------------------------------------------------- server side


def test_active_lookup_destination_header() -> None:
    snap = snapshot()
    calls: list[tuple[IPAddress, str, IPAddress]] = []

    def verify(client: IPAddress, host: str, dst: IPAddress) -> bool:
        calls.append((client, host, dst))
        return dst == ip_address("93.184.216.34")

    def lookup(ip: IPAddress) -> VaultSnapshot | None:
        return snap

    reply = active_lookup(
        lookup, "10.0.0.5", None, verify=verify, host="api.example.com", dst="93.184.216.34"
    )
    assert reply.status == 200 and reply.destination == "verified"
    reply = active_lookup(
        lookup, "10.0.0.5", reply.etag, verify=verify, host="api.example.com", dst="1.2.3.4"
    )
    assert reply.status == 304 and reply.destination == "unverified"
    assert active_lookup(lookup, "10.0.0.5", None, verify=verify, host="x", dst="bad").status == 400
    assert active_lookup(lookup, "10.0.0.5", None).destination is None, "not asked, not answered"
    assert active_lookup(lookup, "10.0.0.5", None, host="h", dst="1.2.3.4").destination == "unverified"
    assert calls[0] == (ip_address("10.0.0.5"), "api.example.com", ip_address("93.184.216.34"))


async def test_client_against_a_real_unix_socket_server(tmp_path: Path) -> None:
    store = VaultStore()
    assert store.put(VAULT, POLICY)[0] == 201
    hits: list[str | None] = []

    def lookup(ip: IPAddress) -> VaultSnapshot | None:
        return store.snapshot() if ip == ip_address("10.0.0.5") else None

    app = active_app(lookup, lambda c, h, d: h == "api.example.com")

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        hits.append(request.headers.get("If-None-Match"))
        response: web.StreamResponse = await handler(request)
        return response

    app.middlewares.append(count)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = tmp_path / "active.sock"
    await web.UnixSite(runner, str(sock)).start()
    client = ActiveClient(str(sock))
    try:
        first = await client.lookup("10.0.0.5", "api.example.com", "93.184.216.34")
        assert first.snapshot is not None and first.destination_ok
        second = await client.lookup("10.0.0.5", "evil.example", "93.184.216.34")
        assert second.snapshot is first.snapshot, "304: same object, nothing copied"
        assert not second.destination_ok
        assert hits == [None, f'"{first.snapshot.tag}"']
        # A mutation changes the tag: the next lookup gets the new snapshot.
        assert store.delete()[0] == 204
        assert (await client.lookup("10.0.0.5", None, None)).snapshot is None
        assert "10.0.0.5" not in client.cache
        assert (await client.lookup("10.0.0.9", None, None)).snapshot is None
        with pytest.raises(LookupFailed):
            await client.lookup(None, None, None)
    finally:
        await client.close()
        await runner.cleanup()
    # Server gone: refused -> failure, and the cache is dropped.
    client = ActiveClient(str(sock))
    client.cache["10.0.0.5"] = snapshot()
    with pytest.raises(LookupFailed):
        await client.lookup("10.0.0.5", None, None)
    assert "10.0.0.5" not in client.cache
    await client.close()


async def test_client_times_out(tmp_path: Path) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/credential-vault/_active", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = tmp_path / "slow.sock"
    await web.UnixSite(runner, str(sock)).start()
    client = ActiveClient(str(sock), timeout=0.1)
    try:
        with pytest.raises(LookupFailed):
            await client.lookup("10.0.0.5", None, None)
    finally:
        await client.close()
        await runner.cleanup()


def test_destination_header_name() -> None:
    assert DESTINATION_HEADER == "X-Egressd-Destination"
