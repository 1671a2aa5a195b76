"""docs/reference/behaviour.md §10, "answered from memory": the narrowing sequence map, the worker's memory (pure),
the ``_active`` TTL header, and the client answering from memory over a real unix socket
until egressd signals a narrowing."""

from __future__ import annotations

import asyncio
import json
import math
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import replace
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from egressd.addr import IPAddress
from egressd.config import Config, ConfigError, parse_config
from egressd.feed import Feed, Narrowing, VaultChanged
from egressd.mitm import seqmap
from egressd.mitm.active import MAX_DESTINATION_TTL_S, active_app, active_lookup
from egressd.mitm.protocol import DESTINATION_TTL_HEADER
from egressd.mitm.seqmap import MAP_BYTES, MitmMemory, SeqReader, SeqWriter, seq_path, slot_of
from egressd.mitm.service import start_mitm
from egressd.mitm.supervisor import MitmOptions, MitmSupervisor, mitmdump_argv
from egressd.mitmchild.lookup import ActiveClient, LookupFailed
from egressd.mitmchild.memo import MAX_TTL_S, Memo, parse_ttl
from egressd.policy import parse_policy
from egressd.subject.leases import LeaseBook, destination_verified, destination_verified_until
from egressd.subject.model import Fence
from egressd.subject.registry import Entry, Registry, State
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore
from egressd.web.serving import InFlight
from egressd.web.writes import after_writes

SECRET = "sk-PLANTED-memory-41"
POLICY = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"api.example.com"}]}')
VAULT = {
    "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {"name": "b", "match": {"hosts": ["api.example.com"]}, "auth": {"type": "bearer", "credential": "k"}}
    ],
}
CLIENT, HOST, DST = "10.0.0.5", "api.example.com", "93.184.216.34"


def snap() -> VaultSnapshot:
    store = VaultStore()
    assert store.put(VAULT, POLICY)[0] == 201
    s = store.snapshot()
    assert s is not None
    return s


# The daemon's change feed (egressd.feed) as the tests' owners of state publish to it.
FEED = Feed()


def narrowed(keys: Any = None) -> None:
    """What an owner of state does at a narrowing (None: any client)."""
    FEED.publish(Narrowing(None if keys is None else tuple(keys)))


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[SeqWriter]:
    w = SeqWriter(seq_path(tmp_path / "active.sock"))
    unsubscribe = FEED.subscribe(MitmMemory(w))
    w.beat()
    try:
        yield w
    finally:
        unsubscribe()
        w.close()


# --------------------------------------------------------------------------- the sequence map


def test_slots_are_stable_and_never_the_global_one() -> None:
    assert slot_of(CLIENT) == slot_of(CLIENT)
    assert all(1 <= slot_of(f"10.0.{i // 256}.{i % 256}") < seqmap.SLOTS for i in range(5000))
    assert slot_of("port:40001") != 0


def test_writer_file_is_private_and_sized(writer: SeqWriter) -> None:
    st = os.stat(writer.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == MAP_BYTES
    assert SECRET.encode() not in writer.path.read_bytes()


def test_a_bump_changes_exactly_the_stamps_it_concerns(writer: SeqWriter) -> None:
    reader = SeqReader(str(writer.path), max_silence=60)
    other = next(f"10.9.0.{i}" for i in range(256) if slot_of(f"10.9.0.{i}") != slot_of(CLIENT))
    a0, b0 = reader.stamp(CLIENT), reader.stamp(other)
    narrowed([ip_address(CLIENT)])  # egressd's keys are addresses; the worker's strings
    a1, b1 = reader.stamp(CLIENT), reader.stamp(other)
    assert a1 != a0 and b1 == b0
    narrowed()
    assert reader.stamp(CLIENT) != a1 and reader.stamp(other) != b1
    reader.close()
    assert reader.stamp(CLIENT) is None, "a closed map reads as 'pull'"


def test_closing_the_writer_voids_every_memory_and_removes_the_file(tmp_path: Path) -> None:
    w = SeqWriter(tmp_path / "m.seq")
    w.beat()
    reader = SeqReader(str(w.path), max_silence=60)
    before = reader.stamp(CLIENT)
    assert before is not None
    w.close()
    assert not w.path.exists()
    assert reader.stamp(CLIENT) != before
    w.bump(None)  # after close: a no-op, never an error


async def test_a_silent_egressd_means_pull(writer: SeqWriter) -> None:
    """§10's lookup failure still applies to a stopped egressd: its heartbeat goes stale,
    the worker pulls, the pull times out, the client's requests are refused."""
    reader = SeqReader(str(writer.path), max_silence=0.1)
    writer.beat()
    assert reader.stamp(CLIENT) is not None
    time.sleep(0.15)
    assert reader.stamp(CLIENT) is None
    writer.start_heartbeat()
    await asyncio.sleep(0.3)
    assert reader.stamp(CLIENT) is not None, "the loop keeps beating"
    writer.close()


def test_a_map_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.seq"
    bad.write_bytes(b"\0" * 16)
    with pytest.raises(OSError):
        SeqReader(str(bad))
    with pytest.raises(OSError):
        SeqReader(str(tmp_path / "missing.seq"))


def test_a_narrowing_without_a_subscriber_is_a_no_op() -> None:
    Feed().publish(Narrowing())
    Feed().publish(VaultChanged(("10.0.0.1",)))


# --------------------------------------------------------------------------- the memory (pure)

S1, S2 = (1, 1), (1, 2)


def test_memory_needs_a_stamp_and_the_same_stamp() -> None:
    m, s = Memo(), snap()
    m.learn(CLIENT, None, None, s, None, None, 0.0)
    assert m.recall(CLIENT, None, None, None, 0.0) is None, "no map: never from memory"
    m.learn(CLIENT, None, None, s, None, S1, 0.0)
    assert m.recall(CLIENT, None, None, S1, 1.0) == (s, False)
    assert m.recall(CLIENT, None, None, S2, 1.0) is None, "a narrowing since: pull"
    assert m.recall(CLIENT, None, None, None, 1.0) is None


def test_destination_verdicts_only_positive_and_only_until_the_lease_ends() -> None:
    m, s = Memo(), snap()
    m.learn(CLIENT, HOST, DST, s, None, S1, 10.0)
    assert m.recall(CLIENT, HOST, DST, S1, 10.5) is None, "unverified is not kept: DNS may verify it"
    m.learn(CLIENT, HOST, DST, s, 5.0, S1, 10.0)
    assert m.recall(CLIENT, HOST, DST, S1, 14.9) == (s, True)
    assert m.recall(CLIENT, HOST, DST, S1, 15.0) is None, "the lease ended"
    assert m.recall(CLIENT, "other.example", DST, S1, 11.0) is None
    m.learn(CLIENT, HOST, DST, s, 1e9, S1, 0.0)
    assert m.recall(CLIENT, HOST, DST, S1, MAX_TTL_S + 1) is None, "the worker's own cap"


def test_a_pair_learned_under_an_old_stamp_is_not_reused() -> None:
    m, s = Memo(), snap()
    m.learn(CLIENT, HOST, DST, s, 60.0, S1, 0.0)
    m.learn(CLIENT, None, None, s, None, S2, 1.0)  # the client relearned after a narrowing
    assert m.recall(CLIENT, HOST, DST, S2, 2.0) is None


def test_no_vault_is_remembered_and_answers_requests_too() -> None:
    m = Memo()
    m.learn(CLIENT, HOST, DST, None, None, S1, 0.0)
    assert m.recall(CLIENT, HOST, DST, S1, 1.0) == (None, False)


def test_memory_is_bounded_and_forgets() -> None:
    m, s = Memo(max_clients=3, max_pairs=2), snap()
    for i in range(5):
        m.learn(f"10.0.0.{i}", HOST, DST, s, 60.0, S1, 0.0)
    assert list(m.clients) == ["10.0.0.2", "10.0.0.3", "10.0.0.4"] and len(m.pairs) == 2
    m.forget("10.0.0.4")
    assert m.recall("10.0.0.4", None, None, S1, 0.0) is None
    m.forget(None)
    assert not m.clients and not m.pairs


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (None, None),
        ("", None),
        ("x", None),
        ("0", None),
        ("-1", None),
        ("nan", None),
        ("inf", None),
        ("2.5", 2.5),
    ],
)
def test_ttl_header_parsing(text: str | None, want: float | None) -> None:
    assert parse_ttl(text) == want


# --------------------------------------------------------------------------- egressd's side


def test_active_ttl_only_from_a_deadline_and_capped() -> None:
    s = snap()
    now = time.monotonic()

    def ask(verdict: bool | float) -> Any:
        return active_lookup(lambda ip: s, CLIENT, None, verify=lambda c, h, d: verdict, host=HOST, dst=DST)

    assert ask(True).destination == "verified" and ask(True).destination_ttl is None
    assert ask(0.0).destination == "unverified" and ask(0.0).destination_ttl is None
    r = ask(now + 30)
    assert r.destination == "verified" and r.destination_ttl is not None and 28 < r.destination_ttl <= 30
    assert ask(math.inf).destination_ttl == MAX_DESTINATION_TTL_S
    assert ask(now - 1).destination_ttl is None


def test_lease_deadlines() -> None:
    book = LeaseBook()
    ip = ip_address(DST)
    book.record([(ip, 30)], HOST, 100.0)
    assert destination_verified_until(book, None, HOST, ip, 110.0) == 130.0
    assert destination_verified_until(book, None, "other.example", ip, 110.0) == 0.0
    assert destination_verified_until(book, None, HOST, ip, 130.0) == 0.0
    for now in (110.0, 129.9, 130.0, 200.0):
        assert (destination_verified_until(book, None, HOST, ip, now) > now) == destination_verified(
            book, None, HOST, ip, now
        )


def test_the_child_gets_the_map_in_one_option(tmp_path: Path) -> None:
    opts = MitmOptions(port=1, confdir=tmp_path, active_socket=tmp_path / "a.sock", upstream_trust_dir=None)
    assert "egressd_vault_push=" in mitmdump_argv(opts)
    argv = mitmdump_argv(replace(opts, vault_push=tmp_path / "a.sock.seq"))
    assert f"egressd_vault_push={tmp_path / 'a.sock.seq'}" in argv


def test_a_vault_change_bumps_even_without_a_child(writer: SeqWriter) -> None:
    reader = SeqReader(str(writer.path), max_silence=60)
    before = reader.stamp(CLIENT)
    forgotten: list[Any] = []
    memory = MitmMemory(None, forgotten.append)  # a second subscriber: the workers' forget
    with_child = FEED.subscribe(memory)
    try:
        FEED.publish(VaultChanged((ip_address(CLIENT),)))
        assert reader.stamp(CLIENT) != before and forgotten == [[ip_address(CLIENT)]]
        MitmMemory(writer, MitmSupervisor(["true"]).forget)(VaultChanged((ip_address(CLIENT),)))
        FEED.publish(Narrowing())
        assert forgotten == [[ip_address(CLIENT)]], "only a vault change tells the child to forget"
    finally:
        with_child()


async def test_every_api_write_bumps_before_its_answer_and_reads_do_not(writer: SeqWriter) -> None:
    reader = SeqReader(str(writer.path), max_silence=60)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("half-way")

    app = web.Application(middlewares=[after_writes(FEED)])
    app.router.add_route("*", "/x", ok)
    app.router.add_route("*", "/boom", boom)
    async with TestClient(TestServer(app)) as http:
        s0 = reader.stamp(CLIENT)
        assert (await http.get("/x")).status == 200
        assert reader.stamp(CLIENT) == s0
        assert (await http.put("/x")).status == 200
        s1 = reader.stamp(CLIENT)
        assert s1 != s0
        assert (await http.post("/boom")).status == 500
        assert reader.stamp(CLIENT) != s1, "a failed write may still have changed something"


# --------------------------------------------------------------------------- over a real socket


async def _serve(sock: Path, store: VaultStore, hits: list[str], verify: Any) -> web.AppRunner:
    def lookup(ip: IPAddress) -> VaultSnapshot | None:
        return store.snapshot() if ip == ip_address(CLIENT) else None

    app = active_app(lookup, verify)

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        hits.append(request.query.get("clientIp", ""))
        response: web.StreamResponse = await handler(request)
        return response

    app.middlewares.append(count)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    return runner


async def test_answers_from_memory_until_a_narrowing_then_pulls(tmp_path: Path, writer: SeqWriter) -> None:
    store = VaultStore()
    assert store.put(VAULT, POLICY)[0] == 201
    hits: list[str] = []
    lease = {"until": time.monotonic() + 60}
    sock = tmp_path / "active.sock"
    runner = await _serve(sock, store, hits, lambda c, h, d: lease["until"] if h == HOST else 0.0)
    client = ActiveClient(str(sock), seq=SeqReader(str(writer.path), max_silence=60))
    try:
        first = await client.lookup(CLIENT, HOST, DST)
        assert first.snapshot is not None and first.destination_ok and len(hits) == 1
        for _ in range(5):
            again = await client.lookup(CLIENT, HOST, DST)
            assert again.snapshot is first.snapshot and again.destination_ok
        assert (await client.lookup(CLIENT, None, None)).snapshot is first.snapshot
        assert len(hits) == 1 and client.recalled == 6, "no round trip while nothing narrowed"
        assert not (await client.lookup(CLIENT, "evil.example", DST)).destination_ok
        assert not (await client.lookup(CLIENT, "evil.example", DST)).destination_ok
        assert len(hits) == 3, "an unverified pair is asked every time"

        # The credential goes, egressd bumps in the same step (here: by hand, as the hooks
        # do): the very next lookup pulls and sees it gone, nothing stale is answered.
        assert store.delete()[0] == 204
        narrowed([ip_address(CLIENT)])
        gone = await client.lookup(CLIENT, HOST, DST)
        assert gone.snapshot is None and len(hits) == 4
        assert (await client.lookup(CLIENT, HOST, DST)).snapshot is None and len(hits) == 4

        # A new vault is a widening, and it is announced too (activation forgets the client).
        assert store.put(VAULT, POLICY)[0] == 201
        narrowed([ip_address(CLIENT)])
        back = await client.lookup(CLIENT, HOST, DST)
        assert back.snapshot is not None and back.snapshot.tag != first.snapshot.tag and len(hits) == 5

        # A policy narrowing bumps every slot: the destination verdict is asked again.
        lease["until"] = 0.0
        narrowed()
        assert not (await client.lookup(CLIENT, HOST, DST)).destination_ok and len(hits) == 6
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_verdict_dies_with_its_lease_without_any_bump(tmp_path: Path, writer: SeqWriter) -> None:
    store = VaultStore()
    assert store.put(VAULT, POLICY)[0] == 201
    hits: list[str] = []
    lease = {"until": time.monotonic() + 0.3}
    sock = tmp_path / "active.sock"
    runner = await _serve(sock, store, hits, lambda c, h, d: lease["until"])
    client = ActiveClient(str(sock), seq=SeqReader(str(writer.path), max_silence=60))
    try:
        assert (await client.lookup(CLIENT, HOST, DST)).destination_ok
        assert (await client.lookup(CLIENT, HOST, DST)).destination_ok and len(hits) == 1
        time.sleep(0.35)
        assert not (await client.lookup(CLIENT, HOST, DST)).destination_ok and len(hits) == 2
    finally:
        await client.close()
        await runner.cleanup()


async def test_egressd_gone_and_a_narrowing_fails_closed(tmp_path: Path, writer: SeqWriter) -> None:
    """Nobody waits for the worker (a bump is a memory write); a worker whose egressd is
    unreachable answers from memory only while nothing narrowed, then refuses."""
    store = VaultStore()
    assert store.put(VAULT, POLICY)[0] == 201
    sock = tmp_path / "active.sock"
    runner = await _serve(sock, store, [], lambda c, h, d: time.monotonic() + 60)
    client = ActiveClient(str(sock), seq=SeqReader(str(writer.path), max_silence=60))
    try:
        assert (await client.lookup(CLIENT, HOST, DST)).snapshot is not None
        await runner.cleanup()
        started = time.monotonic()
        narrowed([CLIENT])
        assert time.monotonic() - started < 0.05, "the mutation never waits for a worker"
        with pytest.raises(LookupFailed):
            await client.lookup(CLIENT, HOST, DST)
        with pytest.raises(LookupFailed):
            await client.lookup(CLIENT, None, None)
    finally:
        await client.close()


async def test_without_the_map_every_lookup_pulls(tmp_path: Path) -> None:
    store = VaultStore()
    assert store.put(VAULT, POLICY)[0] == 201
    hits: list[str] = []
    sock = tmp_path / "active.sock"
    runner = await _serve(sock, store, hits, lambda c, h, d: time.monotonic() + 60)
    client = ActiveClient(str(sock))
    try:
        for _ in range(3):
            assert (await client.lookup(CLIENT, HOST, DST)).destination_ok
        assert len(hits) == 3 and client.recalled == 0
    finally:
        await client.close()
        await runner.cleanup()


def test_no_secret_in_the_header_or_the_map(writer: SeqWriter) -> None:
    r = active_lookup(
        lambda ip: snap(), CLIENT, None, verify=lambda c, h, d: time.monotonic() + 9, host=HOST, dst=DST
    )
    assert SECRET not in json.dumps({DESTINATION_TTL_HEADER: r.destination_ttl})
    assert SECRET.encode() not in writer.path.read_bytes()


# --------------------------------------------------------------------------- wiring


def _cfg(tmp_path: Path, **extra: str) -> Config:
    return parse_config(
        {
            "OPENSANDBOX_EGRESS_PROFILE": "fleet",
            "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
            "EGRESSD_MITM_CONFDIR": str(tmp_path / "conf"),
            "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(tmp_path),
            "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(tmp_path / "run" / "a.sock"),
            **extra,
        }
    )


def test_the_knob_defaults_on_and_turns_off(tmp_path: Path) -> None:
    assert _cfg(tmp_path).mitm.vault_push is True
    assert _cfg(tmp_path, EGRESSD_MITM_VAULT_PUSH="off").mitm.vault_push is False
    with pytest.raises(ConfigError, match="EGRESSD_MITM_VAULT_PUSH"):
        _cfg(tmp_path, EGRESSD_MITM_VAULT_PUSH="sometimes")


async def test_start_mitm_makes_the_map_beside_the_socket_and_removes_it(tmp_path: Path) -> None:
    feed = Feed()
    mitm = await start_mitm(_cfg(tmp_path).mitm, lambda ip: None, lambda c, h, d: False)
    mitm.subscribe(feed)
    try:
        assert mitm.seq is not None and mitm.seq.path == seq_path(mitm.socket)
        assert stat.S_IMODE(os.stat(mitm.seq.path).st_mode) == 0o600
        assert f"egressd_vault_push={mitm.seq.path}" in mitm.supervisor.argv
        reader = SeqReader(str(mitm.seq.path), max_silence=60)
        before = reader.stamp(CLIENT)
        Registry(feed).put(Entry("u1", Fence("r", "a"), State.DENYING, None))
        assert reader.stamp(CLIENT) != before, "a registry change narrows (policy, state, binding)"
    finally:
        await mitm.close()
    assert mitm.seq is not None and not mitm.seq.path.exists()
    off = await start_mitm(
        _cfg(tmp_path, EGRESSD_MITM_VAULT_PUSH="off").mitm, lambda ip: None, lambda c, h, d: False
    )
    try:
        assert off.seq is None and "egressd_vault_push=" in off.supervisor.argv
    finally:
        await off.close()


async def test_a_write_whose_client_left_bumps_when_it_ends(writer: SeqWriter) -> None:
    """The middleware's bump runs when the handler is cancelled, before the shielded mutation
    has finished: the mutation's own end bumps again."""
    reader = SeqReader(str(writer.path), max_silence=60)
    inflight = InFlight(feed=FEED)
    release = asyncio.Event()

    async def mutation() -> int:
        await release.wait()
        return 1

    waiter = asyncio.create_task(inflight.run(mutation()))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    before = reader.stamp(CLIENT)
    release.set()
    await inflight.drain(1)
    await asyncio.sleep(0)
    assert reader.stamp(CLIENT) != before
    # A mutation whose handler waited for it does not bump on its own (the middleware does).
    release.clear()
    done = asyncio.create_task(inflight.run(mutation()))
    await asyncio.sleep(0)
    release.set()
    await done
    after = reader.stamp(CLIENT)
    await asyncio.sleep(0)
    assert reader.stamp(CLIENT) == after
