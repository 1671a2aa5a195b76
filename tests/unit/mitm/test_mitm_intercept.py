"""Selective interception (docs/reference/behaviour.md §16): the pure connection verdicts, and the addon hooks
that apply them to real mitmproxy layer objects (the ``_active`` lookup is a stub)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy import options
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.test import tflow

from egressd.metrics import EgressMetrics
from egressd.mitm.supervisor import MitmSupervisor
from egressd.mitmchild.intercept import (
    REASON_BOUND,
    REASON_IGNORED,
    REASON_LOOKUP_FAILED,
    REASON_NO_BINDING,
    REASON_NO_HTTP_BINDING,
    REASON_NO_SNI,
    REASON_NO_VAULT,
    REASON_PORT,
    http_by_vault,
    http_early,
    ignored,
    sni_name,
    tls_by_vault,
    tls_early,
)
from egressd.mitmchild.interception import Interception
from egressd.mitmchild.lookup import LookupFailed, View
from egressd.mitmchild.names import LOOKUP_FAILED, NameAnswer, NameGate
from egressd.mitmchild.vaults import VaultLookup
from egressd.policy import parse_policy_obj
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore

SECRET = "sk-intercept-unit-31"
API = "api.example.com"
POLICY = parse_policy_obj(
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "*.example.com"},
            {"action": "allow", "target": "plain.test"},
        ],
    }
)


def snapshot(*bindings: dict[str, Any]) -> VaultSnapshot:
    store = VaultStore()
    status, body = store.put(
        {
            "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET}}],
            "bindings": list(bindings),
        },
        POLICY,
    )
    assert status in (200, 201), body
    snap = store.snapshot()
    assert snap is not None
    return snap


def binding(name: str, *hosts: str, schemes: tuple[str, ...] = ("https",)) -> dict[str, Any]:
    return {
        "name": name,
        "match": {"hosts": list(hosts), "schemes": list(schemes)},
        "auth": {"type": "bearer", "credential": "k"},
    }


# ------------------------------------------------------------------------------ pure verdicts


def test_sni_names_are_compared_like_injection_compares_hosts() -> None:
    assert sni_name("API.Example.COM.") == API
    assert sni_name(None) is None and sni_name("") is None
    assert sni_name("api.example.com:443") is None  # an SNI never carries a port
    assert sni_name("[::1]") is None and sni_name("bad name") is None


def test_an_sni_naming_an_https_binding_host_is_decrypted() -> None:
    snap = snapshot(binding("api", API), binding("wild", "*.svc.example.com"))
    assert tls_by_vault(snap, API).decision == "decrypt"
    assert tls_by_vault(snap, "API.EXAMPLE.COM.").binding == "api"
    got = tls_by_vault(snap, "a.b.svc.example.com")
    assert (got.decision, got.reason, got.binding) == ("decrypt", REASON_BOUND, "wild")
    # A wildcard never covers its apex; other hosts of an allowed domain are relayed.
    assert tls_by_vault(snap, "svc.example.com").reason == REASON_NO_BINDING
    assert tls_by_vault(snap, "other.example.com").decision == "passthrough"


def test_no_vault_or_an_http_only_binding_never_decrypts() -> None:
    assert tls_by_vault(None, API).reason == REASON_NO_VAULT
    plain = snapshot(binding("plain", API, schemes=("http",)))
    assert tls_by_vault(plain, API).reason == REASON_NO_BINDING
    assert tls_by_vault(snapshot(binding("api", API)), None).reason == REASON_NO_SNI


def test_tls_verdicts_that_need_no_vault() -> None:
    none: tuple[re.Pattern[str], ...] = ()
    assert tls_early(API, 443, none) is None, "the vault decides"
    early = tls_early(None, 443, none)
    assert early is not None and (early.decision, early.reason) == ("passthrough", REASON_NO_SNI)
    # An IP literal in the SNI goes to the vault, where no binding host can be an address.
    assert tls_early("10.0.0.1", 443, none) is None
    assert tls_by_vault(snapshot(binding("api", API)), "10.0.0.1").reason == REASON_NO_BINDING
    port = tls_early(API, 8443, none)
    assert port is not None and port.reason == REASON_PORT  # injection needs :443
    for pattern in (r"^api\.example\.com$", r"^api\.example\.com:443$", r"EXAMPLE\.com"):
        got = tls_early(API, 443, (re.compile(pattern, re.IGNORECASE),))
        assert got is not None and got.reason == REASON_IGNORED, pattern
    assert tls_early(API, 443, (re.compile(r"^other\.com$"),)) is None


def test_ignored_tries_the_bare_name_and_name_port() -> None:
    rex = (re.compile(r"^a\.test$"), re.compile(r":8443$"))
    assert ignored(rex, "a.test", 443) and ignored(rex, "b.test", 8443)
    assert not ignored(rex, "b.test", 443) and not ignored((), "a.test", 443) and not ignored(rex, None, 443)


def test_plain_http_is_parsed_only_with_an_http_binding_on_port_80() -> None:
    assert http_early(80) is None
    early = http_early(443)
    assert early is not None and early.reason == REASON_PORT
    assert http_by_vault(None).reason == REASON_NO_VAULT
    assert http_by_vault(snapshot(binding("api", API))).reason == REASON_NO_HTTP_BINDING
    got = http_by_vault(snapshot(binding("api", API), binding("plain", "plain.test", schemes=("http",))))
    assert (got.decision, got.binding, got.opens) == ("parse", "plain", True)


# ------------------------------------------------------------------------------ addon hooks


class StubClient:
    def __init__(self, snap: VaultSnapshot | None = None, fail: bool = False) -> None:
        self.snap, self.fail = snap, fail
        self.calls: list[tuple[str | None, str | None, str | None]] = []

    async def lookup(self, client_ip: str | None, host: str | None, dst: str | None) -> View:
        self.calls.append((client_ip, host, dst))
        if self.fail:
            raise LookupFailed("TimeoutError")
        return View(self.snap, False)


def injector(client: StubClient, ignore: tuple[str, ...] = ()) -> Interception:
    vaults = VaultLookup()
    vaults.client = client  # type: ignore[assignment]
    addon = Interception(vaults, NameGate(vaults))
    addon.ignore = tuple(re.compile(p, re.IGNORECASE) for p in ignore)
    return addon


def context(port: int) -> Context:
    ctx = Context(tflow.tclient_conn(), options.Options())
    ctx.client.peername = ("10.203.0.11", 40000)
    ctx.server.address = ("10.204.0.6", port)
    return ctx


def clienthello(sni: str | None, port: int = 443) -> Any:
    return SimpleNamespace(
        context=context(port), client_hello=SimpleNamespace(sni=sni), ignore_connection=False
    )


def events(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_clienthello_relays_unbound_and_opens_bound(capsys: pytest.CaptureFixture[str]) -> None:
    stub = StubClient(snapshot(binding("api", API)))
    addon = injector(stub)
    bound, other = clienthello(API), clienthello("other.example.com")
    asyncio.run(addon.tls_clienthello(bound))
    asyncio.run(addon.tls_clienthello(other))
    assert bound.ignore_connection is False and other.ignore_connection is True
    assert stub.calls == [("10.203.0.11", None, None)] * 2, "one vault lookup per connection, no host/dst"
    got = events(capsys)
    assert [(e["event"], e["decision"], e["reason"], e["sni"]) for e in got] == [
        ("mitm.connection", "decrypt", REASON_BOUND, API),
        ("mitm.connection", "passthrough", REASON_NO_BINDING, "other.example.com"),
    ]
    assert all(e["client"] == "10.203.0.11" and e["dst"] == "10.204.0.6" for e in got)
    assert SECRET not in json.dumps(got)


def test_clienthello_decided_without_a_lookup() -> None:
    stub = StubClient(snapshot(binding("api", API)))
    addon = injector(stub, ignore=(r"^api\.example\.com$",))
    for data in (clienthello(API), clienthello(None), clienthello(API, port=8443)):
        asyncio.run(addon.tls_clienthello(data))
        assert data.ignore_connection is True
    assert stub.calls == []


def test_clienthello_opens_when_the_lookup_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """Fail closed: the request hooks then meet the same failure and refuse (503) before the
    upstream, as without selective interception; a relay would let the request through."""
    data = clienthello("other.example.com")
    asyncio.run(injector(StubClient(fail=True)).tls_clienthello(data))
    assert data.ignore_connection is False
    assert events(capsys)[0]["reason"] == REASON_LOOKUP_FAILED


def test_clienthello_opens_on_an_unexpected_error(capsys: pytest.CaptureFixture[str]) -> None:
    addon = injector(StubClient())
    addon.vaults.client = None  # the lookup cannot even start
    data = clienthello(API)
    asyncio.run(addon.tls_clienthello(data))
    assert data.ignore_connection is False
    assert events(capsys)[0] == {"event": "mitm.error", "hook": "tls_clienthello", "error": "AssertionError"}


def next_layer_at_top(port: int = 80) -> layer.NextLayer:
    """What mitmproxy's NextLayer addon leaves for plain HTTP on a redirected connection."""
    ctx = context(port)
    modes.TransparentProxy(ctx)
    nl = layer.NextLayer(ctx)
    nl.layer = layers.HttpLayer(ctx, HTTPMode.transparent)
    return nl


def test_plain_http_without_an_http_binding_is_relayed() -> None:
    nl = next_layer_at_top()
    http_layer = nl.layer
    asyncio.run(injector(StubClient(snapshot(binding("api", API)))).next_layer(nl))
    assert isinstance(nl.layer, layers.TCPLayer) and nl.layer.flow is None, "an ignored (silent) relay"
    assert http_layer not in nl.context.layers and nl.context.layers[-1] is nl.layer


def test_plain_http_with_an_http_binding_or_a_failed_lookup_is_parsed() -> None:
    snap = snapshot(binding("plain", "plain.test", schemes=("http",)))
    for stub in (StubClient(snap), StubClient(fail=True)):
        nl = next_layer_at_top()
        before = nl.layer
        asyncio.run(injector(stub).next_layer(nl))
        assert nl.layer is before


def test_next_layer_leaves_every_other_layer_alone() -> None:
    stub = StubClient()  # no vault: would relay anything it decided on
    # HTTP inside decrypted TLS.
    ctx = context(443)
    modes.TransparentProxy(ctx)
    layers.ServerTLSLayer(ctx)
    layers.ClientTLSLayer(ctx)
    inner = layer.NextLayer(ctx)
    inner.layer = layers.HttpLayer(ctx, HTTPMode.transparent)
    chosen = inner.layer
    asyncio.run(injector(stub).next_layer(inner))
    assert inner.layer is chosen
    # Not decided yet (NextLayer needs more data), or a TLS layer (the ClientHello decides).
    undecided = layer.NextLayer(context(80))
    asyncio.run(injector(stub).next_layer(undecided))
    assert undecided.layer is None
    assert stub.calls == []


# ------------------------------------------------------------------------------ supervisor


async def test_connection_events_are_counted_with_known_labels_only() -> None:
    metrics = EgressMetrics()
    lines = [
        {"event": "mitm.connection", "protocol": "tls", "decision": "passthrough", "reason": "x"},
        {"event": "mitm.connection", "protocol": "tls", "decision": "decrypt"},
        {"event": "mitm.connection", "protocol": "http", "decision": "parse"},
        {"event": "mitm.connection", "protocol": "tls", "decision": "x" * 50},  # not a label value
        {"event": "mitm.connection", "protocol": ["tls"], "decision": "decrypt"},
        {"event": "mitm.ready"},
    ]
    script = "import time\n" + "".join(f"print({json.dumps(json.dumps(x))}, flush=True)\n" for x in lines)
    sup = MitmSupervisor([sys.executable, "-c", script + "time.sleep(30)"], metrics=metrics)
    task = asyncio.create_task(sup.run())
    try:
        assert await sup.wait_ready(10)
    finally:
        await sup.stop()
        task.cancel()
    text = metrics.render()
    assert 'egressd_mitm_connections_total{worker="0",protocol="tls",decision="passthrough"} 1' in text
    assert 'egressd_mitm_connections_total{worker="0",protocol="tls",decision="decrypt"} 1' in text
    assert 'egressd_mitm_connections_total{worker="0",protocol="http",decision="parse"} 1' in text
    assert text.count("egressd_mitm_connections_total{") == 3


# ------------------------------------------------------------------------------ the name check (§18)


class StubGate(NameGate):
    """The name check with egressd's answer given and the connection reset recorded."""

    def __init__(self, vaults: VaultLookup, answer: NameAnswer) -> None:
        super().__init__(vaults)
        self.enabled = True
        self.answer = answer
        self.asked: list[tuple[str, str | None, str, int]] = []
        self.reset: list[str] = []

    async def ask(
        self,
        conn: object,
        client_ip: str | None,
        wire: str,
        name: str | None,
        dst: str,
        dport: int,
        *,
        report: bool = True,
    ) -> NameAnswer:
        self.asked.append((wire, name, dst, dport))
        return self.answer

    def refuse_connection(self, client: Any, reason: str) -> None:
        self.reset.append(reason)


def gated(stub: StubClient, answer: NameAnswer) -> tuple[Interception, StubGate]:
    vaults = VaultLookup()
    vaults.client = stub  # type: ignore[assignment]
    gate = StubGate(vaults, answer)
    return Interception(vaults, gate), gate


def test_a_refused_name_resets_the_connection_before_any_vault_lookup(capsys: pytest.CaptureFixture[str]) -> None:
    stub = StubClient(snapshot(binding("api", API)))
    addon, gate = gated(stub, NameAnswer(False, "sni_not_allowed"))
    data = clienthello(API)
    asyncio.run(addon.tls_clienthello(data))
    assert gate.asked == [("tls", API, "10.204.0.6", 443)]
    assert gate.reset == ["sni_not_allowed"] and stub.calls == []
    assert data.ignore_connection is False  # never relayed
    (event,) = events(capsys)
    assert (event["decision"], event["reason"]) == ("refuse", "sni_not_allowed")


def test_an_admitted_name_goes_on_to_selective_interception() -> None:
    stub = StubClient(snapshot(binding("api", API)))
    addon, gate = gated(stub, NameAnswer(True, None))
    data = clienthello("other.example.com")
    asyncio.run(addon.tls_clienthello(data))
    assert gate.reset == [] and data.ignore_connection is True
    # No SNI and an IP-literal SNI are asked without a name; every port the kernel sends the
    # MITM is asked (the extra ports, the ports a subject's http/https rules name: §18).
    for sni in (None, "10.204.0.6"):
        asyncio.run(addon.tls_clienthello(clienthello(sni)))
    asyncio.run(addon.tls_clienthello(clienthello(API, port=8443)))
    assert [(name, port) for _, name, _, port in gate.asked] == [
        ("other.example.com", 443),
        (None, 443),
        (None, 443),
        (API, 8443),
    ]


def test_an_undecided_name_check_refuses() -> None:
    addon, gate = gated(StubClient(), NameAnswer(True, None))

    async def boom(*args: Any) -> NameAnswer:
        raise RuntimeError("x")

    gate.ask = boom  # type: ignore[method-assign,assignment]
    asyncio.run(addon.tls_clienthello(clienthello(API)))
    assert gate.reset == [LOOKUP_FAILED]
