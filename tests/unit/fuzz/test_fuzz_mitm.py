"""Fuzzing HTTP requests into the MITM's decision (docs/reference/behaviour.md §10, §6): ``inject.decide``.

Requests are real mitmproxy ``http.Request`` objects (``mitmproxy.test.tutils.treq``) with
fuzzed scheme, Host (case, trailing dot, port, IDN, IP literals, junk), method, path (percent
encodings at several depths, ``..`` and backslash tricks, placeholders), query, headers, body
and content type, plus a fuzzed SNI and destination check; they are turned into
:class:`inject.Request` the way the addon does. The vault is built per case through the real
§6 validation, with a planted credential value and substitutions on every surface.

Oracles: no exception; decide() is deterministic; nothing is injected unless the destination
was verified, the port is the scheme's canonical one, https carries an SNI inside the chosen
binding's hosts, the Host is inside them too, and no decoding of the path holds ``..`` or a
backslash; a refusal or a pass changes nothing; reserved headers are never set; no reason and
no ``repr`` carries the credential value or a placeholder.
"""

from __future__ import annotations

import dataclasses
import json
from urllib.parse import unquote

from hypothesis import event, given
from hypothesis import strategies as st
from mitmproxy.test import tutils

from egressd.mitmchild.authority import normalise_authority
from egressd.mitmchild.inject import decide
from egressd.mitmchild.injectdata import InjectionDecision, Request, header_reserved
from egressd.policy import domain_matches, parse_policy
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import VaultStore
from tests.unit.fuzz.strategies import domains, mutate_bytes
from tests.unit.fuzz.support import canary, fuzz, hit

POLICY = parse_policy(
    json.dumps(
        {
            "defaultAction": "deny",
            "egress": [
                {"action": "allow", "target": "api.example.com"},
                {"action": "allow", "target": "*.svc.example.org"},
                {"action": "allow", "target": "plain.example.com"},
            ],
        }
    )
)
PLACEHOLDER = "__PH_TOKEN__"


def make_snapshot(secret: str) -> VaultSnapshot:
    store = VaultStore()
    cred = {"name": "tok", "source": {"type": "inline", "value": secret}}
    body = {
        "credentials": [cred, {"name": "k2", "source": {"type": "inline", "value": secret + '/+ %&"\\'}}],
        "bindings": [
            {
                "name": "b-api",
                "match": {"hosts": ["api.example.com"], "paths": ["/v1/*"]},
                "auth": {"type": "bearer", "credential": "tok"},
            },
            {
                "name": "b-svc",
                "match": {"hosts": ["*.svc.example.org"], "methods": ["GET", "POST"]},
                "auth": {
                    "type": "apiKey",
                    "name": "x-api-key",
                    "credential": "tok",
                    "substitutions": [
                        {
                            "credential": "k2",
                            "placeholder": PLACEHOLDER,
                            "in": ["path", "query", "header", "body"],
                        }
                    ],
                },
            },
            {
                "name": "b-plain",
                "match": {"hosts": ["plain.example.com"], "schemes": ["http"], "paths": ["/exact"]},
                "auth": {"type": "customHeaders", "headers": [{"name": "X-Tok", "credential": "tok"}]},
            },
        ],
    }
    status, resp = store.put(body, POLICY)
    assert status == 201, resp
    snap = store.snapshot()
    assert snap is not None
    return snap


HOSTS = [
    "api.example.com",
    "API.Example.COM.",
    "api.example.com:443",
    "api.example.com:8443",
    "a.svc.example.org",
    "svc.example.org",
    "x.y.svc.example.org:443",
    "plain.example.com",
    "plain.example.com:80",
    "évil.svc.example.org",
    "[::1]:443",
    "10.0.0.1",
    "",
    "api.example.com.:",
    "api.example.com:99999",
]
GOOD_PATHS = [
    "/v1/x",
    f"/v1/{PLACEHOLDER}",
    f"/x?k={PLACEHOLDER}&b=1",
    "/exact",
    "/exact?",
    "/v1/%2e%2e/admin",
    "/v1/a%2fb",
    "/v1/..;/x",
    "/v1/a%252fb",
    "/v1/a\\b",
    f"/{PLACEHOLDER}/..",
]
PATH_PIECES = [
    "/v1/",
    "x",
    "..",
    "%2e%2e",
    "%252e",
    "%2f",
    "%5c",
    "\\",
    ";",
    "%",
    "%zz",
    "/exact",
    PLACEHOLDER,
    "?q=",
    "&a=" + PLACEHOLDER,
    "#f",
    "é",
]


@st.composite
def requests(draw: st.DrawFn) -> tuple[Request, bool]:
    if draw(st.booleans()):
        # An endpoint some binding covers; the other fields still vary around it.
        scheme, host, port = draw(
            st.sampled_from(
                [
                    ("https", "api.example.com", 443),
                    ("https", "API.Example.COM.:443", 443),
                    ("https", "a.svc.example.org", 443),
                    ("https", "x.y.svc.example.org", 443),
                    ("http", "plain.example.com", 80),
                    ("HTTP", "plain.example.com:80", 80),
                ]
            )
        )
    else:
        scheme = draw(st.sampled_from(["https", "https", "http", "HTTPS", "ftp"]))
        host = draw(st.one_of(st.sampled_from(HOSTS), domains))
        port = draw(st.sampled_from([443, 443, 80, 8443]))
    method = draw(
        st.sampled_from(["GET", "GET", "POST", "post", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"])
    )
    if draw(st.booleans()):
        # Paths a binding matches, with and without tricks: the interesting half.
        path = draw(st.sampled_from(GOOD_PATHS))
    else:
        path = "".join(draw(st.lists(st.sampled_from(PATH_PIECES), min_size=1, max_size=7)))
    if not path.startswith("/"):
        path = draw(st.sampled_from(["/", "/v1/", ""])) + path
    if draw(st.integers(0, 4)) == 0:
        path = draw(mutate_bytes(path.encode())).decode("utf-8", "replace")
    headers = [("Host", host)] if host else []
    for name in draw(
        st.lists(
            st.sampled_from(
                ["X-Api-Key", "Authorization", "X-Note", "Content-Type", "Host", ":authority", "x-tok"]
            ),
            max_size=3,
        )
    ):
        headers.append((name, draw(st.sampled_from([PLACEHOLDER, "v", "Bearer " + PLACEHOLDER, ""]))))
    content_type = draw(
        st.sampled_from(
            [
                None,
                "application/json",
                "application/x-www-form-urlencoded",
                "text/plain; charset=latin-1",
                "multipart/form-data",
                "application/vnd+json",
            ]
        )
    )
    if content_type:
        headers.append(("Content-Type", content_type))
    content_encoding = draw(st.sampled_from([None, None, "gzip", "identity", "identity, gzip"]))
    if content_encoding:
        headers.append(("Content-Encoding", content_encoding))
    body = draw(
        st.sampled_from(
            [
                b"",
                b'{"k":"' + PLACEHOLDER.encode() + b'"}',
                b"a=" + PLACEHOLDER.encode(),
                b"\xff\xfe",
                PLACEHOLDER.encode(),
            ]
        )
    )
    # A real mitmproxy request, so header handling (multi-values, encodings) is mitmproxy's own.
    mreq = tutils.treq(
        scheme=scheme.encode(),
        host="198.51.100.7",
        port=port,
        method=method.encode(),
        path=path.encode("utf-8", "surrogateescape"),
        headers=tuple((n.encode("utf-8"), v.encode("utf-8")) for n, v in headers),
        content=body,
    )
    sni = draw(
        st.sampled_from(
            [
                host.rsplit(":", 1)[0],
                None,
                "api.example.com",
                "a.svc.example.org",
                "evil.com",
                "API.EXAMPLE.COM",
                "",
            ]
        )
    )
    streamed = draw(st.integers(0, 5)) == 0
    req = Request(  # as Injection._requestheaders builds it (body given in the second phase)
        scheme=mreq.scheme,
        host=mreq.host_header or "",
        port=port,
        method=mreq.method,
        path=mreq.path,
        headers=tuple(mreq.headers.items(multi=True)),  # type: ignore[no-untyped-call]
        body=None if streamed else mreq.raw_content,
        content_type=mreq.headers.get("content-type"),
        content_encoding=mreq.headers.get("content-encoding"),
        sni=sni if mreq.scheme == "https" else None,
    )
    return req, draw(st.integers(0, 3)) > 0


def _in_scope(host: str, patterns: tuple[str, ...]) -> bool:
    return any(domain_matches(p, host) for p in patterns)


def _check_outcome(
    snapshot: VaultSnapshot, req: Request, ok: bool, out: InjectionDecision, secret: str
) -> None:
    shown = repr(out) + out.reason + str(out)
    assert secret not in shown and PLACEHOLDER not in shown
    assert not any(header_reserved(name) for name, _ in out.set_headers)
    if out.kind != "inject":
        assert (
            not out.set_headers and not out.header_updates and out.new_path is None and out.new_body is None
        )
        if out.kind == "refuse":
            assert out.status == 403
        return
    assert ok, "injected although the destination was not verified"
    scheme = req.scheme.lower()
    assert req.port == {"https": 443, "http": 80}[scheme]
    authority = normalise_authority(req.host)
    assert authority is not None
    host, port = authority
    assert port in (None, req.port)
    binding = next(b for b in snapshot.bindings if b.name == out.binding)
    assert _in_scope(host, binding.match.hosts), "injected for a host outside the binding"
    if scheme == "https":
        assert req.sni, "https without SNI injected"
        sni = normalise_authority(req.sni)
        assert sni is not None and _in_scope(sni[0], binding.match.hosts), "SNI outside the binding"
    path = req.path.partition("?")[0]
    layer = path
    for _ in range(10):
        assert "\\" not in layer and ".." not in layer.split("/"), "path trick injected"
        nxt = unquote(layer)
        if nxt == layer:
            break
        layer = nxt


@fuzz("mitm", ci=500, campaign=80_000)
@given(case=requests(), secret_id=st.integers(0, 2**32 - 1))
def test_mitm_decide_injects_only_in_scope(case: tuple[Request, bool], secret_id: int) -> None:
    hit("mitm")
    req, ok = case
    secret = canary(secret_id)
    snapshot = make_snapshot(secret)
    # Host, method and SNI are shown on purpose (they are what the logs name); everything
    # else a sandbox sends (path, headers, body, content type) must stay hidden.
    hidden = repr(dataclasses.replace(req, host="h", method="GET", sni=None))
    assert secret not in hidden and PLACEHOLDER not in hidden
    out = decide(snapshot, req, destination_ok=ok)
    event(f"{out.kind} {out.reason[:40]}")
    assert decide(snapshot, req, destination_ok=ok) == out
    _check_outcome(snapshot, req, ok, out, secret)
    assert decide(None, req, destination_ok=ok).kind == "pass"
