"""The MITM's per-subject ports (host-uid subjects, docs/reference/behaviour.md §17): the listener port names the
subject, never the peer address (the host's own, shared by every uid sandbox)."""

from __future__ import annotations

import json
from ipaddress import ip_address
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from egressd.addr import IPAddress
from egressd.feed import port_key
from egressd.mitm.active import PortVaults, active_app, active_lookup
from egressd.mitm.protocol import forget_message, parse_forget
from egressd.mitm.supervisor import MitmOptions, mitmdump_argv
from egressd.mitmchild import shared
from egressd.mitmchild.lookup import ActiveClient
from egressd.policy import parse_policy
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore

POLICY = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"api.example.com"}]}')
VAULT = {
    "credentials": [{"name": "k", "source": {"type": "inline", "value": "sk-uid-port-1"}}],
    "bindings": [
        {"name": "b", "match": {"hosts": ["api.example.com"]}, "auth": {"type": "bearer", "credential": "k"}}
    ],
}
HOST = "10.77.0.1"


def store() -> VaultStore:
    s = VaultStore()
    assert s.put(VAULT, POLICY)[0] == 201
    return s


def test_port_lookup_never_falls_back_to_the_peer_address() -> None:
    vault = store()
    by_ip: list[IPAddress] = []

    def lookup(ip: IPAddress) -> VaultSnapshot | None:
        by_ip.append(ip)
        return vault.snapshot()  # the host's address would have a vault: it must not be asked

    asked: list[tuple[int, str, IPAddress]] = []

    def verify(port: int, host: str, dst: IPAddress) -> bool:
        asked.append((port, host, dst))
        return port == 16257

    ports = PortVaults(lambda p: vault.snapshot() if p == 16257 else None, verify, (16257, 16258))
    hit = active_lookup(
        lookup, HOST, None, port="16257", by_port=ports, host="api.example.com", dst="1.2.3.4"
    )
    assert hit.status == 200 and hit.destination == "verified"
    assert asked == [(16257, "api.example.com", ip_address("1.2.3.4"))]
    assert active_lookup(lookup, HOST, None, port="16258", by_port=ports).status == 404
    assert active_lookup(lookup, HOST, None, port="16257").status == 404, "no port lookups: nobody"
    assert by_ip == []
    # Without a port the peer address decides, as before.
    assert active_lookup(lookup, HOST, None, by_port=ports).status == 200 and by_ip == [ip_address(HOST)]


@pytest.mark.parametrize("bad", ["", "x", "0", "65536", "-1", "1e3", "١٢", "123456"])
def test_a_malformed_port_is_400(bad: str) -> None:
    ports = PortVaults(lambda p: None, lambda p, h, d: False)
    assert active_lookup(lambda ip: None, HOST, None, port=bad, by_port=ports).status == 400


def test_forget_lines_carry_port_keys() -> None:
    assert port_key(16257) == "port:16257"
    line = forget_message(["10.0.0.5", port_key(16257)])
    assert parse_forget(line) == ["10.0.0.5", "port:16257"]
    for bad in ("port:0", "port:70000", "port:x", "port:"):
        assert parse_forget(forget_message([bad])) is None, "unknown: forget every client"


def test_the_child_listens_on_every_subject_port_from_the_start(tmp_path: Path) -> None:
    opts = MitmOptions(18081, tmp_path, tmp_path / "a.sock", None, subject_ports=(16257, 16258))
    argv = mitmdump_argv(opts)
    modes = [argv[i + 1] for i, a in enumerate(argv) if a == "--set" and argv[i + 1].startswith("mode=")]
    assert modes == ["mode=transparent", "mode=transparent@16257", "mode=transparent@16258"]
    assert "listen_port=18081" in argv


async def test_client_caches_per_port_and_forgets_by_port(tmp_path: Path) -> None:
    vaults = {16257: store(), 16258: store()}
    seen: list[dict[str, str]] = []
    ports = PortVaults(
        lambda p: vaults[p].snapshot() if p in vaults else None,
        lambda p, h, d: True,
        tuple(vaults),
    )
    app = active_app(lambda ip: None, None, ports)

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(dict(request.query))
        response: web.StreamResponse = await handler(request)
        return response

    app.middlewares.append(record)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = tmp_path / "active.sock"
    await web.UnixSite(runner, str(sock)).start()
    client = ActiveClient(str(sock))
    try:
        a = await client.lookup(HOST, "api.example.com", "1.2.3.4", 16257)
        b = await client.lookup(HOST, "api.example.com", "1.2.3.4", 16258)
        assert a.snapshot is not None and b.snapshot is not None
        assert a.snapshot.tag != b.snapshot.tag, "two subjects behind one peer address"
        assert set(client.cache) == {"port:16257", "port:16258"}
        assert seen[0] == {"clientIp": HOST, "port": "16257", "host": "api.example.com", "dst": "1.2.3.4"}
        # The shared listener's flows from the same address are another client altogether.
        assert (await client.lookup(HOST, None, None)).snapshot is None
        client.forget(parse_forget(forget_message([port_key(16257)])))
        assert set(client.cache) == {"port:16258"}
    finally:
        await client.close()
        await runner.cleanup()


def test_listen_port_names_the_subject_only_off_the_shared_listener() -> None:
    from mitmproxy.proxy.mode_specs import ProxyMode

    def flow(spec: str | None) -> Any:
        mode = ProxyMode.parse(spec) if spec is not None else None
        # Transparent mode puts the original destination in sockname: never a port source.
        return SimpleNamespace(proxy_mode=mode, sockname=("10.204.0.6", 443))

    assert shared.listen_port(flow("transparent@16257"), 18081) == 16257
    assert shared.listen_port(flow("transparent"), 18081) is None, "the shared listener"
    assert shared.listen_port(flow("transparent@18081"), 18081) is None
    assert shared.listen_port(flow(None), 18081) is None
    assert json.loads(forget_message(None)) == {"op": "forget"}


def test_the_child_raises_its_open_files_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from egressd.kernel import listeners

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    listeners.raise_fd_limit()
    assert calls == [(4096, 4096)]
    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda _: (4096, 4096))
    listeners.raise_fd_limit()
    assert calls == []
