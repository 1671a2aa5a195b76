"""The addon's wiring of one authority (docs/reference/behaviour.md §14.8) on real mitmproxy flow objects: what it
refuses, and that what mitmproxy would forward (request line, Host / ``:authority``,
destination) is the one authority it decided on. The ``_active`` lookup is a stub."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.flow import Error
from mitmproxy.net.http.http1 import assemble_request_head
from mitmproxy.test import tflow

from egressd.mitmchild.injection import Injection, _destination_unchanged, _forward_on_one_authority
from egressd.mitmchild.lookup import View
from egressd.mitmchild.responses import Responses
from egressd.mitmchild.vaults import VaultLookup
from egressd.policy import parse_policy_obj
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore

SECRET = "sk-addon-unit-77"
API = "api.example.com"
DST = ("10.204.0.6", 443)


def snapshot() -> VaultSnapshot:
    policy = parse_policy_obj({"defaultAction": "deny", "egress": [{"action": "allow", "target": API}]})
    store = VaultStore()
    status, body = store.put(
        {
            "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET}}],
            "bindings": [
                {"name": "b", "match": {"hosts": [API]}, "auth": {"type": "bearer", "credential": "k"}}
            ],
        },
        policy,
    )
    assert status in (200, 201), body
    snap = store.snapshot()
    assert snap is not None
    return snap


class StubClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str | None, str | None, str | None]] = []

    async def lookup(self, client_ip: str | None, host: str | None, dst: str | None) -> View:
        self.calls.append((client_ip, host, dst))
        return View(snapshot(), True)


def flow(
    authority: str = "",
    hosts: tuple[str, ...] = (API,),
    *,
    h2: bool = False,
    sni: str | None = API,
    dst: tuple[str, int] = DST,
) -> http.HTTPFlow:
    headers = http.Headers([(b"host", h.encode()) for h in hosts] + [(b"accept", b"*/*")])
    req = http.Request(
        host=dst[0],  # transparent mode: mitmproxy sets these from the original destination
        port=dst[1],
        method=b"GET",
        scheme=b"https",
        authority=authority.encode(),
        path=b"/v1/x",
        http_version=b"HTTP/2.0" if h2 else b"HTTP/1.1",
        headers=headers,
        content=b"",
        trailers=None,
        timestamp_start=0.0,
        timestamp_end=None,
    )
    f = tflow.tflow(req=req)
    f.client_conn.peername = ("10.203.0.11", 40000)
    f.client_conn.sni = sni
    f.server_conn.address = dst
    return f


def run(f: http.HTTPFlow) -> tuple[Injection, StubClient]:
    vaults = VaultLookup()
    stub = StubClient()
    vaults.client = stub  # type: ignore[assignment]
    addon = Injection(vaults)
    asyncio.run(addon.requestheaders(f))
    return addon, stub


def authorization(f: http.HTTPFlow) -> Any:
    return f.request.headers.get("authorization")


@pytest.mark.parametrize(
    ("authority", "hosts", "h2", "sni"),
    [
        ("attacker.example", (API,), False, API),  # the issue: absolute-form vs Host
        (API, ("attacker.example",), False, API),
        ("", (API, "attacker.example"), False, API),
        ("", (API, API), False, API),
        ("", (f"{API}:8443",), False, API),
        ("", (API,), False, "attacker.example"),
        (API, ("attacker.example",), True, API),  # :authority vs Host
        ("attacker.example", (API,), True, API),
        (f"{API}:8443", (), True, API),
        ("", (API,), True, API),  # with :path "https://attacker.example/v1/x" below
    ],
)
def test_disagreeing_names_get_a_400_before_lookup_and_upstream(
    authority: str, hosts: tuple[str, ...], h2: bool, sni: str
) -> None:
    f = flow(authority, hosts, h2=h2, sni=sni)
    if h2 and not authority:
        f.request.path = "https://attacker.example/v1/x"
    _, stub = run(f)
    assert f.response is not None and f.response.status_code == 400
    assert stub.calls == [], "refused before the vault lookup"
    assert authorization(f) is None
    assert SECRET not in bytes(f.request.headers).decode() + f.response.text  # type: ignore[operator]  # text: str | None


def test_http1_absolute_form_forwarded_in_origin_form_with_the_one_host() -> None:
    f = flow(f"{API.upper()}.:443", (API,))
    _, stub = run(f)
    assert f.response is None and authorization(f) == f"Bearer {SECRET}"
    assert stub.calls == [("10.203.0.11", API, DST[0])]
    head = assemble_request_head(f.request).decode()
    assert head.startswith("GET /v1/x HTTP/1.1\r\n"), head
    assert f.request.headers.get_all("host") == [API]
    assert (f.request.host, f.request.port) == DST, "the destination mitmproxy connects to is unchanged"


def test_http1_absolute_form_without_host_gets_its_host() -> None:
    f = flow(API, ())
    run(f)
    assert (
        assemble_request_head(f.request)
        .decode()
        .startswith("GET /v1/x HTTP/1.1\r\nHost: api.example.com\r\n")
    )
    assert authorization(f) == f"Bearer {SECRET}"


def test_an_idn_absolute_form_gets_its_a_label_host_bytes() -> None:
    f = flow("xn--bcher-kva.example", ())
    _forward_on_one_authority(f.request)
    assert f.request.headers.fields[0] == (b"Host", b"xn--bcher-kva.example")


def test_http2_keeps_authority_and_drops_the_duplicate_host() -> None:
    f = flow(API, (API,), h2=True)
    run(f)
    assert f.request.authority == API and "host" not in f.request.headers
    assert authorization(f) == f"Bearer {SECRET}"


def test_a_moved_destination_kills_the_flow() -> None:
    f = flow()
    f.request.data.port = 8443  # what mitmproxy would connect to is not the original destination
    _, stub = run(f)
    assert f.error is not None and f.error.msg == Error.KILLED_MESSAGE
    assert stub.calls == [] and authorization(f) is None


def test_forward_helpers_touch_only_raw_fields() -> None:
    f = flow(API, (API,))
    _forward_on_one_authority(f.request)
    assert f.request.authority == "" and (f.request.host, f.request.port) == DST
    assert _destination_unchanged(f)
    f.server_conn.address = None
    assert not _destination_unchanged(f)


def test_response_trailers_are_redacted_like_headers() -> None:
    """Trailers (chunked HTTP/1, HTTP/2) are sent after the ``response`` hook, streamed or not."""
    f = flow()
    run(f)
    f.response = http.Response.make(200, b"ok", {"X-Echo": f"Bearer {SECRET}"})
    f.response.trailers = http.Headers([(b"x-trailer", f"t={SECRET}".encode()), (b"x-ok", b"1")])
    addon = Responses()
    addon.responseheaders(f)
    addon.response(f)  # trailers go out after this hook
    assert f.response.headers["x-echo"] == "[REDACTED]"
    assert f.response.trailers is not None
    assert list(f.response.trailers.items(multi=True)) == [("x-trailer", "t=[REDACTED]"), ("x-ok", "1")]
