"""Process hygiene (docs/reference/behaviour.md §14.9), the parts that need no kernel: the dumpable flag and core
limit helper, the MITM child's bounded snapshot cache and its forget channel, and egressd
announcing exactly the addresses whose snapshot must go.

The end-to-end proof (real daemon, real child, both profiles) is tests/kernel/test_hygiene.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from egressd import hygiene
from egressd.addr import IPAddress
from egressd.feed import VaultChanged
from egressd.mitm.active import active_app
from egressd.mitm.pool import MitmPool
from egressd.mitm.protocol import CACHE_MAX_ENTRIES, FORGET_BATCH, forget_message, parse_forget
from egressd.mitm.supervisor import FORGET_QUEUE_MAX, MitmSupervisor
from egressd.mitmchild import runner
from egressd.mitmchild.lookup import ActiveClient
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore
from tests.unit.fleet.test_proxy_route import hook, make_env, remove, set_binding, vault_doc
from tests.unit.mitm.test_mitm_lookup import POLICY, VAULT, snapshot

# --------------------------------------------------------------------------- core dumps


def test_disable_core_dumps_in_a_child_process() -> None:
    """Run in a fresh interpreter: the flag and the hard limit cannot be undone in-process."""
    code = (
        "import resource,sys;sys.path.insert(0,sys.argv[1]);from egressd import hygiene;"
        "before=hygiene.dumpable();hygiene.disable_core_dumps();"
        "print(before,hygiene.dumpable(),resource.getrlimit(resource.RLIMIT_CORE))"
    )
    out = (
        subprocess.run(
            [sys.executable, "-c", code, str(Path(hygiene.__file__).parents[1])],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        .stdout.strip()
        .split(maxsplit=2)
    )
    assert out == ["True", "False", "(0, 0)"]


def test_egressd_main_disables_core_dumps_before_parsing_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    from egressd import main as main_mod
    from egressd.config import ConfigError

    calls: list[str] = []
    monkeypatch.setattr(main_mod, "disable_core_dumps", lambda: calls.append("hygiene"))

    def parse(*_a: Any) -> Any:
        calls.append("config")
        raise ConfigError("stop here")

    monkeypatch.setattr(main_mod, "parse_config", parse)
    assert main_mod.main([]) == 2
    assert calls == ["hygiene", "config"]


def test_the_mitm_child_disables_core_dumps_before_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(runner, "disable_core_dumps", lambda: calls.append("hygiene"))
    monkeypatch.setattr(runner, "_main", lambda argv: _record(calls, "options"))
    runner.main([])
    assert calls == ["hygiene", "options"]


async def _record(calls: list[str], what: str) -> int:
    calls.append(what)
    return 0


# --------------------------------------------------------------------------- forget lines


def test_forget_lines_round_trip_and_anything_odd_forgets_everyone() -> None:
    assert parse_forget(forget_message(["10.0.0.5", "fd00::1"])) == ["10.0.0.5", "fd00::1"]
    assert parse_forget(forget_message(None)) is None
    assert parse_forget(forget_message([])) == []
    # Canonical form, as the addon keys its cache (IPv4-mapped unmapped, IPv6 compressed).
    assert parse_forget(b'{"op":"forget","ips":["::ffff:10.0.0.5","FD00:0::1"]}') == ["10.0.0.5", "fd00::1"]
    for odd in (
        b"",
        b"{",
        b"[]",
        b'{"op":"x"}',
        b'{"op":"forget","ips":"10.0.0.5"}',
        b'{"op":"forget","ips":[1]}',
        b'{"op":"forget","ips":["nope"]}',
        b"\xff\xfe",
    ):
        assert parse_forget(odd) is None, odd


# --------------------------------------------------------------------------- bounded cache


def _tagged(n: int) -> VaultSnapshot:
    store = VaultStore(new_incarnation=lambda: f"inc{n}")
    assert store.put(VAULT, POLICY)[0] == 201
    snap = store.snapshot()
    assert snap is not None
    return snap


def test_the_cache_is_bounded_at_4096_oldest_first() -> None:
    client = ActiveClient("/nonexistent")
    snap = snapshot()
    assert client.max_entries == CACHE_MAX_ENTRIES == 4096
    for i in range(5000):
        client._store(f"10.1.{i // 256}.{i % 256}", snap)
    assert len(client.cache) == 4096 and client.evictions == 5000 - 4096
    assert "10.1.0.0" not in client.cache and "10.1.19.135" in client.cache  # 5000-1 = 19*256+135


async def _serve(tmp_path: Path, lookup: Any) -> tuple[web.AppRunner, str]:
    runner_ = web.AppRunner(active_app(lookup))
    await runner_.setup()
    sock = tmp_path / "a.sock"
    await web.UnixSite(runner_, str(sock)).start()
    return runner_, str(sock)


async def test_least_recently_used_is_evicted_and_only_costs_a_full_lookup(tmp_path: Path) -> None:
    snap = snapshot()
    asked: list[str] = []

    def lookup(ip: IPAddress) -> VaultSnapshot | None:
        asked.append(str(ip))
        return snap

    server, sock = await _serve(tmp_path, lookup)
    client = ActiveClient(sock, max_entries=2)
    try:
        for ip in ("10.0.0.1", "10.0.0.2"):
            assert (await client.lookup(ip, None, None)).snapshot is not None
        await client.lookup("10.0.0.1", None, None)  # 304: now the most recently used
        await client.lookup("10.0.0.3", None, None)
        assert list(client.cache) == ["10.0.0.1", "10.0.0.3"] and client.evictions == 1
        # The evicted client is served as before (a 200 instead of a 304), never refused.
        view = await client.lookup("10.0.0.2", None, None)
        assert view.snapshot is not None and view.snapshot.tag == snap.tag
        assert list(client.cache) == ["10.0.0.3", "10.0.0.2"]
    finally:
        await client.close()
        await server.cleanup()


def test_forget_drops_named_clients_or_all() -> None:
    client = ActiveClient("/nonexistent")
    for i in range(3):
        client._store(f"10.0.0.{i}", _tagged(i))
    client.forget(["10.0.0.1", "10.9.9.9"])
    assert list(client.cache) == ["10.0.0.0", "10.0.0.2"]
    client.forget(None)
    assert not client.cache


async def test_a_reply_overtaken_by_a_forget_is_not_cached(tmp_path: Path) -> None:
    """egressd may answer just before the mutation it then announces; the reply and the
    forget travel on different channels, so the reply must not outlive the forget."""
    snap = snapshot()
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.json_response(snap.to_json(), headers={"ETag": f'"{snap.tag}"'})

    app = web.Application()
    app.router.add_get("/credential-vault/_active", slow)
    server = web.AppRunner(app)
    await server.setup()
    sock = tmp_path / "slow.sock"
    await web.UnixSite(server, str(sock)).start()
    client = ActiveClient(str(sock), timeout=5)
    try:
        pending = asyncio.create_task(client.lookup("10.0.0.5", None, None))
        await asyncio.wait_for(arrived.wait(), 5)
        client.forget(["10.0.0.5"])
        release.set()
        view = await pending
        assert view.snapshot is not None, "this one request is still served"
        assert "10.0.0.5" not in client.cache
    finally:
        await client.close()
        await server.cleanup()


# --------------------------------------------------------------------------- child side


class _Injector:
    def __init__(self, client: ActiveClient | None) -> None:
        self.client = client


async def test_the_child_applies_forget_lines_from_stdin_and_reports_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = ActiveClient("/nonexistent")
    for i in range(3):
        client._store(f"10.0.0.{i}", _tagged(i))
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(runner, "emit", lambda event, **kw: events.append({"event": event, **kw}))
    r, w = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(r, "rb", buffering=0))
    injector: Any = _Injector(client)
    report = runner._CacheReport(injector)
    report()
    assert events[-1] == {"event": "mitm.cache", "entries": 3, "evictions": 0}
    report()
    assert len(events) == 1, "no change, no event"
    task = asyncio.create_task(runner._follow_forgets(injector, report))
    try:
        os.write(w, forget_message(["10.0.0.1"]))
        for _ in range(200):
            if len(events) > 1:
                break
            await asyncio.sleep(0.01)
        assert list(client.cache) == ["10.0.0.0", "10.0.0.2"]
        assert events[-1]["entries"] == 2
        os.write(w, b"garbage\n")  # not a forget line: fail closed, everyone goes
        for _ in range(200):
            if events[-1]["entries"] == 0:
                break
            await asyncio.sleep(0.01)
        assert not client.cache and events[-1]["entries"] == 0
        # Over the line limit (written from a thread: the pipe is smaller than the line).
        client._store("10.0.0.1", _tagged(1))
        await asyncio.to_thread(_write_all, w, b"x" * (2 << 20) + b"\n")
        os.close(w)
        await asyncio.wait_for(task, 5)  # EOF ends the reader
        assert not client.cache
    finally:
        task.cancel()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


# --------------------------------------------------------------------------- supervisor side


def test_the_forget_queue_is_bounded_and_collapses_to_forget_all() -> None:
    sup = MitmSupervisor(["true"])
    sup.forget(["10.0.0.1"])
    assert sup._take_forgets() == [], "no child running: nothing to forget"
    sup._proc = object()  # type: ignore[assignment]
    sup.forget([f"10.2.{i // 256}.{i % 256}" for i in range(FORGET_BATCH + 1)])
    lines = sup._take_forgets()
    assert len(lines) == 2 and sum(len(parse_forget(x) or []) for x in lines) == FORGET_BATCH + 1
    sup.forget([f"10.3.{i // 256}.{i % 256}" for i in range(FORGET_QUEUE_MAX + 1)])
    assert sup._take_forgets() == [forget_message(None)] and len(sup._forget) == 0
    sup.forget(None)
    sup.forget(["10.0.0.9"])  # already forgetting everyone
    assert sup._take_forgets() == [forget_message(None)]


async def test_forgets_reach_the_child_and_its_cache_reports_become_the_gauge(tmp_path: Path) -> None:
    from egressd.metrics import EgressMetrics

    got = tmp_path / "stdin.txt"
    script = (
        "import json,sys;"
        "print(json.dumps({'event':'mitm.ready'}),flush=True);"
        f"f=open({str(got)!r},'ab',buffering=0)\n"
        "for n,line in enumerate(sys.stdin.buffer):\n"
        "    f.write(line); print(json.dumps({'event':'mitm.cache','entries':n+7}),flush=True)\n"
    )
    metrics = EgressMetrics()
    sup = MitmSupervisor([sys.executable, "-c", script], metrics=metrics)
    MitmPool([sup], [18081]).watch(metrics)  # the pool registers the per-worker gauges
    task = asyncio.create_task(sup.run())
    try:
        assert await sup.wait_ready(10)
        sup.forget(["10.0.0.5"])
        for _ in range(500):
            if sup.cache_entries == 7:
                break
            await asyncio.sleep(0.01)
        assert sup.cache_entries == 7
        assert json.loads(got.read_bytes()) == {"op": "forget", "ips": ["10.0.0.5"]}
        assert 'egressd_mitm_snapshot_cache_entries{worker="0"} 7' in metrics.render()
    finally:
        await sup.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # the supervisor's own bookkeeping runs as its task ends
    assert sup.cache_entries == 0, "a dead child holds nothing"


# --------------------------------------------------------------------------- egressd side


async def test_egressd_names_the_address_on_vault_delete_rebind_and_removal(aiohttp_client: Any) -> None:
    env = await make_env(aiohttp_client)
    forgotten: list[list[str]] = []
    env.control.feed.subscribe(
        lambda e: forgotten.append([str(ip) for ip in e.clients or ()]) if isinstance(e, VaultChanged) else None
    )

    def taken() -> list[list[str]]:
        out = list(forgotten)
        forgotten.clear()
        return out

    await env.register(ip="10.0.0.5")
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    assert ["10.0.0.5"] in taken(), "a changed vault: the old snapshot goes"
    # An in-place policy change keeps vault and address: nothing to forget.
    await env.ok(
        set_binding(
            input=json.dumps(
                {"defaultAction": "deny", "egress": [{"action": "allow", "target": "api.example.com"}]}
            ),
            ip="10.0.0.5",
        )
    )
    assert taken() == []
    assert (await env.call("DELETE", "/credential-vault")).status == 204
    assert taken() == [["10.0.0.5"]]
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    taken()
    # Rebind (new fence) to another address: the old one is named.
    await env.ok(set_binding(ip="10.0.0.6", rid="r2"))
    assert any("10.0.0.5" in batch for batch in taken())
    await env.ok(hook(rid="r2"))
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    taken()
    await env.ok(remove(rid="r2"))
    assert any("10.0.0.6" in batch for batch in taken())
    assert env.control.vault_for_ip(ipaddress.ip_address("10.0.0.6")) is None
