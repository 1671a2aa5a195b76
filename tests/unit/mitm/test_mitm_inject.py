"""§10 transparent-MITM credential injection decisions (egressd.mitmchild.inject), on snapshots
built through the real vault store (§6)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any
from urllib.parse import quote, quote_plus

import pytest

from egressd.mitmchild.authority import OneAuthority, normalise_authority, one_authority
from egressd.mitmchild.inject import (
    TARGET_OVERRIDE_HEADERS,
    decide,
    find_binding,
    path_problem,
    redact_response_headers,
    redact_text,
)
from egressd.mitmchild.injectdata import (
    AMBIGUOUS_AUTHORITY,
    LOOKUP_FAILED,
    REASON_AMBIGUOUS,
    REASON_AUTHORITY,
    REASON_DESTINATION,
    REASON_HOP_BY_HOP,
    REASON_NO_MATCH,
    REASON_NO_SNI,
    REASON_NO_VAULT,
    REASON_PATH,
    REASON_SNI,
    REASON_SUBSTITUTED_PATH,
    REASON_TARGET_OVERRIDE,
    InjectionDecision,
    Request,
    RewriteError,
)
from egressd.mitmchild.substitute import substitute, substitute_body
from egressd.policy import parse_policy_obj
from egressd.vault.snapshot import InjectedHeader, VaultSnapshot
from egressd.vault.store import VaultStore

SECRET = 's3cr3t/V@lue &"q\\ü'
SECRET2 = "second-SECRET-zz"
# Placed in paths: no backslash (an encoded backslash in a path is refused).
SUB_VALUE = 'a b/c+d&e="f'
PLACEHOLDER = "__TOKEN__"

POLICY = parse_policy_obj(
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "api.example.com"},
            {"action": "allow", "target": "*.example.com"},
            {"action": "allow", "target": "example.com"},
        ],
    }
)


def cred(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "source": {"type": "inline", "value": value}}


def bind(
    name: str = "b", hosts: list[str] | None = None, auth: dict[str, Any] | None = None, **match: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "match": {"hosts": hosts or ["api.example.com"], **match},
        "auth": auth or {"type": "bearer", "credential": "tok"},
    }


def snap(*bindings: dict[str, Any], creds: dict[str, str] | None = None) -> VaultSnapshot:
    """A snapshot made by the real store: PUT (validated against POLICY), then snapshot()."""
    values = {"tok": SECRET, "key": SECRET2, "sub": SUB_VALUE} if creds is None else creds
    store = VaultStore()
    status, body = store.put(
        {"credentials": [cred(n, v) for n, v in values.items()], "bindings": list(bindings)}, POLICY
    )
    assert status in (200, 201), body
    snapshot = store.snapshot()
    assert snapshot is not None
    return snapshot


def req(
    path: str = "/v1/items",
    *,
    host: str = "api.example.com",
    scheme: str = "https",
    port: int | None = None,
    method: str = "GET",
    headers: tuple[tuple[str, str], ...] = (),
    body: bytes | None = None,
    content_type: str | None = None,
    content_encoding: str | None = None,
    sni: str | None = "",
    transfer_encoding: str | None = None,
) -> Request:
    """``sni=""`` means "the host" for https and None for http."""
    if sni == "":
        authority = normalise_authority(host)
        sni = None if scheme == "http" else (authority[0] if authority else host)
    return Request(
        scheme=scheme,
        host=host,
        port=port if port is not None else (80 if scheme == "http" else 443),
        method=method,
        path=path,
        headers=headers,
        body=body,
        content_type=content_type,
        content_encoding=content_encoding,
        sni=sni,
        transfer_encoding=transfer_encoding,
    )


def go(snapshot: VaultSnapshot | None, request: Request, destination_ok: bool = True) -> InjectionDecision:
    return decide(snapshot, request, destination_ok=destination_ok)


def injected(outcome: InjectionDecision) -> dict[str, str]:
    assert outcome.kind == "inject", outcome
    return dict(outcome.set_headers)


SUBS = [{"credential": "sub", "placeholder": PLACEHOLDER, "in": ["path", "query", "header", "body"]}]


def passthrough(**match: Any) -> VaultSnapshot:
    return snap(bind("p", auth={"type": "passthrough", "substitutions": SUBS}, **match))


# --------------------------------------------------------------------------------------------
# Auth types


def test_bearer() -> None:
    out = go(snap(bind()), req())
    assert out.binding == "b" and out.status == 0
    assert injected(out) == {"Authorization": f"Bearer {SECRET}"}
    assert out.new_path is None and out.new_body is None and out.header_updates == ()


def test_basic() -> None:
    s = snap(bind(auth={"type": "basic", "credential": "key"}))
    assert injected(go(s, req())) == {"Authorization": f"Basic {SECRET2}"}


def test_api_key_canonical_name() -> None:
    s = snap(bind(auth={"type": "apiKey", "name": "x-api-KEY", "credential": "key"}))
    assert injected(go(s, req())) == {"X-Api-Key": SECRET2}


def test_custom_headers() -> None:
    auth = {
        "type": "customHeaders",
        "headers": [{"name": "x-one", "credential": "tok"}, {"name": "X-Two", "credential": "key"}],
    }
    out = go(snap(bind(auth=auth)), req())
    assert out.set_headers == (("X-One", SECRET), ("X-Two", SECRET2))
    assert out.injected_names == ("X-One", "X-Two")


def test_passthrough_injects_nothing_but_substitutes() -> None:
    out = go(passthrough(), req(f"/v1/{PLACEHOLDER}"))
    assert out.kind == "inject" and out.binding == "p"
    assert out.set_headers == ()
    assert out.new_path == f"/v1/{quote(SUB_VALUE, safe='')}"
    assert out.substituted == ("path",)


def test_no_snapshot_passes() -> None:
    out = go(None, req())
    assert out == InjectionDecision("pass", reason=REASON_NO_VAULT)


def test_lookup_failed_outcome() -> None:
    assert LOOKUP_FAILED.kind == "refuse" and LOOKUP_FAILED.status == 503


# --------------------------------------------------------------------------------------------
# Match


def test_exact_beats_wildcard() -> None:
    s = snap(
        bind("exact", ["api.example.com"], {"type": "bearer", "credential": "tok"}),
        bind("wild", ["*.example.com"], {"type": "bearer", "credential": "key"}),
    )
    out = go(s, req())
    assert out.binding == "exact" and injected(out) == {"Authorization": f"Bearer {SECRET}"}
    out = go(s, req(host="www.example.com"))
    assert out.binding == "wild" and injected(out) == {"Authorization": f"Bearer {SECRET2}"}


def _combined(*snapshots: VaultSnapshot) -> VaultSnapshot:
    """The store refuses ambiguous bindings (§6), so an ambiguous snapshot is assembled from
    store-built ones: the MITM must still defend against one (e.g. an older validator)."""
    return dataclasses.replace(snapshots[0], bindings=tuple(b for s in snapshots for b in s.bindings))


def test_two_exact_matches_are_ambiguous() -> None:
    status, _ = VaultStore().put(
        {"credentials": [cred("tok", SECRET)], "bindings": [bind("one"), bind("two")]}, POLICY
    )
    assert status == 400
    s = _combined(snap(bind("one")), snap(bind("two", auth={"type": "basic", "credential": "key"})))
    out = go(s, req())
    assert (out.kind, out.status, out.reason) == ("refuse", 403, REASON_AMBIGUOUS)
    assert out.set_headers == ()


def test_two_wildcard_matches_are_ambiguous() -> None:
    s = _combined(snap(bind("outer", ["*.example.com"])), snap(bind("inner", ["*.a.example.com"])))
    out = go(s, req(host="h.a.example.com"))
    assert (out.kind, out.status, out.reason) == ("refuse", 403, REASON_AMBIGUOUS)
    # Only the outer one matches elsewhere: no ambiguity.
    assert go(s, req(host="h.b.example.com")).binding == "outer"


def test_ambiguity_only_among_the_top_precedence() -> None:
    s = _combined(
        snap(bind("w1", ["*.example.com"])), snap(bind("w2", ["*.example.com"])), snap(bind("exact"))
    )
    assert go(s, req()).binding == "exact"
    assert go(s, req(host="x.example.com")).reason == REASON_AMBIGUOUS


def test_wildcard_never_matches_apex() -> None:
    s = snap(bind("wild", ["*.example.com"]))
    assert go(s, req(host="example.com")) == InjectionDecision("pass", reason=REASON_NO_MATCH)
    assert go(s, req(host="a.b.example.com")).binding == "wild"
    assert go(s, req(host="badexample.com")).kind == "pass"


def test_host_normalised() -> None:
    s = snap(bind())
    for host in ("API.Example.COM", "api.example.com.", "api.example.com:443", "Api.Example.Com.:443"):
        assert go(s, req(host=host, sni="api.example.com")).kind == "inject", host


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (req(method="OPTIONS"), "method"),
        (req("/v2/items"), "path"),
        (req("/v1"), "path without the slash of the prefix"),
        (req("/V1/items"), "paths are case-sensitive"),
        (req(scheme="http"), "scheme"),
        (req(port=8443), "connection port"),
        (req(host="api.example.com:8443"), "explicit non-canonical Host port"),
        (req(scheme="http", port=443), "http on 443"),
        (req(host="other.example.org"), "host"),
        (req(host="[::1]:443"), "IP literal"),
        (req(host=""), "no host"),
        (req(host="api.example.com:x"), "bad port"),
        (req(scheme="ftp", port=443), "scheme"),
    ],
)
def test_non_matching_requests_pass(request_: Request, why: str) -> None:
    s = snap(bind(paths=["/v1/*"], methods=["GET", "POST"]))
    out = go(s, request_)
    assert out == InjectionDecision("pass", reason=REASON_NO_MATCH), why


def test_method_case_insensitive_and_query_dropped() -> None:
    s = snap(bind(paths=["/v1/items"], methods=["POST"]))
    assert go(s, req("/v1/items?x=1&y=/v2", method="post")).kind == "inject"


def test_http_binding_matches_on_port_80_without_sni() -> None:
    s = snap(bind(schemes=["http"]))
    out = go(s, req(scheme="http"))
    assert injected(out) == {"Authorization": f"Bearer {SECRET}"}
    assert go(s, req()).kind == "pass"  # https not in the binding's schemes


def test_sni_mismatch_refused() -> None:
    s = snap(bind(hosts=["api.example.com", "*.svc.example.com"]))
    out = go(s, req(sni="evil.example.net"))
    assert (out.kind, out.status, out.reason, out.binding) == ("refuse", 403, REASON_SNI, "b")
    assert out.set_headers == ()
    # Any of the binding's hosts is an acceptable TLS identity; trailing dot and case ignored.
    assert go(s, req(sni="x.svc.example.com")).kind == "inject"
    assert go(s, req(sni="API.example.com.")).kind == "inject"
    assert go(s, req(sni="svc.example.com")).kind == "refuse"  # wildcard never the apex


def test_no_sni_on_https_passes() -> None:
    out = go(snap(bind()), req(sni=None))
    assert out == InjectionDecision("pass", reason=REASON_NO_SNI)


def test_destination_not_verified_passes_without_credentials() -> None:
    s = snap(bind())
    out = go(s, req(), destination_ok=False)
    assert out == InjectionDecision("pass", reason=REASON_DESTINATION)
    # Never a refusal either: the request is outside every binding's scope.
    amb = _combined(snap(bind("one")), snap(bind("two")))
    assert go(amb, req(), destination_ok=False).kind == "pass"
    assert go(s, req("/v1/../x"), destination_ok=False).kind == "pass"


# --------------------------------------------------------------------------------------------
# Path tricks


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../admin",
        "/v1/..",
        "/v1/%2e%2e/admin",
        "/v1/%2E%2e/admin",
        "/v1/.%2e/admin",
        "/v1/..;/admin",
        "/v1/x\\..\\admin",
        "/v1/a\\b",
        "/v1/a%5cb",
        "/v1/a%5Cb",
        "/v1/a%252fb",
        "/v1/a%252Fb",
        "/v1/%252e%252e/admin",
        "/v1/a%2541",
        "/v1/a%2f..%2fb",
        "/v1/a%2F%2e%2e%2Fb",
        "/v1/%25252f",
    ],
)
def test_traversal_refused(path: str) -> None:
    assert path_problem(path)
    out = go(snap(bind(paths=["/v1/*"])), req(path))
    assert (out.kind, out.status, out.reason, out.set_headers) == ("refuse", 403, REASON_PATH, ())


@pytest.mark.parametrize(
    "path", ["/v1/a%2fb", "/v1/@scope%2Fname", "/v1/x?next=../y%252f", "/v1/./x", "/v1/100%25", "/v1/a%20b"]
)
def test_allowed_paths(path: str) -> None:
    assert go(snap(bind(paths=["/v1/*"])), req(path)).kind == "inject"


def test_traversal_outside_any_binding_passes() -> None:
    # Nothing matches the raw path: no credential at risk, ordinary traffic.
    assert go(snap(bind(paths=["/v1/*"])), req("/other/../v1/x")).kind == "pass"


def test_encoded_slash_changing_the_binding_refused() -> None:
    s = snap(
        bind("pkg", ["api.example.com"], paths=["/pub*"]),
        bind("admin", ["*.example.com"], {"type": "basic", "credential": "key"}, paths=["/pub/admin/*"]),
    )
    # Decoded, the path would also match "admin": the %2f crosses a binding boundary.
    out = go(s, req("/pub%2fadmin%2fx"))
    assert (out.kind, out.status, out.reason) == ("refuse", 403, REASON_PATH)
    # One %2f layer that does not change the match is fine (npm scoped packages).
    assert go(s, req("/pub/@scope%2fname")).binding == "pkg"


# --------------------------------------------------------------------------------------------
# Headers


def test_same_name_headers_replaced_case_insensitively() -> None:
    headers = (("authorization", "Bearer client"), ("Accept", "*/*"), ("AUTHORIZATION", "Basic x"))
    out = go(snap(bind()), req(headers=headers))
    assert out.rewrite_headers(headers) == [("Accept", "*/*"), ("Authorization", f"Bearer {SECRET}")]


def test_reserved_headers_never_rewritten() -> None:
    headers = (
        ("Host", f"api.example.com{PLACEHOLDER}"),
        ("Content-Type", f"text/plain; x={PLACEHOLDER}"),
        ("X-Forwarded-For", PLACEHOLDER),
        ("proxy-authorization", PLACEHOLDER),
        ("X-Custom", f"k={PLACEHOLDER}"),
        ("X-Custom", "none"),
        ("x-custom", PLACEHOLDER),
    )
    out = go(passthrough(), req(headers=headers))
    assert out.header_updates == ((4, f"k={SUB_VALUE}"), (6, SUB_VALUE))
    assert out.substituted == ("header",)
    rewritten = out.rewrite_headers(headers)
    assert rewritten[:4] == list(headers[:4])
    assert rewritten[4:] == [("X-Custom", f"k={SUB_VALUE}"), ("X-Custom", "none"), ("x-custom", SUB_VALUE)]


def test_reserved_injected_header_skipped() -> None:
    base = snap(bind(auth={"type": "apiKey", "name": "X-Key", "credential": "key"}))
    forged = dataclasses.replace(
        base.bindings[0], headers=(InjectedHeader("Host", "evil.test"), *base.bindings[0].headers)
    )
    out = go(dataclasses.replace(base, bindings=(forged,)), req())
    assert out.set_headers == (("X-Key", SECRET2),)


# --------------------------------------------------------------------------------------------
# Substitutions


def test_path_and_query_substitutions_url_encoded() -> None:
    out = go(passthrough(), req(f"/v1/{PLACEHOLDER}/x?key={PLACEHOLDER}&a=b"))
    enc = quote(SUB_VALUE, safe="")
    assert enc == "a%20b%2Fc%2Bd%26e%3D%22f"
    assert out.new_path == f"/v1/{enc}/x?key={enc}&a=b"
    assert out.substituted == ("path", "query")


def test_only_listed_surfaces() -> None:
    s = snap(
        bind(
            "p",
            auth={
                "type": "passthrough",
                "substitutions": [{"credential": "sub", "placeholder": PLACEHOLDER, "in": ["query"]}],
            },
        )
    )
    out = go(s, req(f"/v1/{PLACEHOLDER}?q={PLACEHOLDER}", headers=(("X-A", PLACEHOLDER),), body=b"__TOKEN__"))
    assert out.new_path == f"/v1/{PLACEHOLDER}?q={quote(SUB_VALUE, safe='')}"
    assert out.header_updates == () and out.new_body is None


def test_substituted_path_rechecked() -> None:
    s = snap(
        bind("p", auth={"type": "passthrough", "substitutions": SUBS}, paths=["/v1/*"]),
        creds={"sub": ".."},
    )
    out = go(s, req(f"/v1/{PLACEHOLDER}/admin"))
    assert (out.kind, out.status, out.reason, out.binding) == ("refuse", 403, REASON_SUBSTITUTED_PATH, "p")
    # A value's own "%" only makes a harmless nested escape.
    s = snap(bind("p", auth={"type": "passthrough", "substitutions": SUBS}), creds={"sub": "a%2e%2eb"})
    out = go(s, req(f"/v1/{PLACEHOLDER}"))
    assert out.new_path == "/v1/a%252e%252eb"
    # ... unless it decodes (twice) to a dot segment.
    s = snap(bind("p", auth={"type": "passthrough", "substitutions": SUBS}), creds={"sub": "%2e%2e"})
    assert go(s, req(f"/v1/{PLACEHOLDER}/x")).reason == REASON_SUBSTITUTED_PATH


def test_json_body_escaped() -> None:
    body = json.dumps({"token": PLACEHOLDER, "n": 1}).encode()
    out = go(passthrough(), req(method="POST", body=body, content_type="application/json; charset=utf-8"))
    assert out.new_body is not None
    assert json.loads(out.new_body) == {"token": SUB_VALUE, "n": 1}
    assert out.new_body == body.replace(PLACEHOLDER.encode(), json.dumps(SUB_VALUE)[1:-1].encode())
    assert out.substituted == ("body",)
    vnd = go(passthrough(), req(method="POST", body=body, content_type="application/vnd.api+json"))
    assert vnd.new_body == out.new_body


def test_form_body_encoded() -> None:
    body = f"user=me&pw={PLACEHOLDER}".encode()
    out = go(passthrough(), req(method="POST", body=body, content_type="application/x-www-form-urlencoded"))
    assert out.new_body == f"user=me&pw={quote_plus(SUB_VALUE, safe='')}".encode()
    assert b"a+b%2Fc%2Bd%26e%3D%22f" in out.new_body


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/xml", "text/plain; charset=UTF-8"])
def test_other_bodies_raw(content_type: str | None) -> None:
    body = f"token: {PLACEHOLDER}\n".encode()
    out = go(passthrough(), req(method="POST", body=body, content_type=content_type))
    assert out.new_body == f"token: {SUB_VALUE}\n".encode()


@pytest.mark.parametrize(
    ("body", "content_type", "content_encoding"),
    [
        (b"__TOKEN__", "text/plain", "gzip"),
        (b"__TOKEN__", "text/plain", "identity, br"),
        (b"--x\r\n__TOKEN__\r\n--x--", "multipart/form-data; boundary=x", None),
        (None, "text/plain", None),
        (b"\xff\xfe__TOKEN__", "text/plain", None),
        (b"__TOKEN__", "text/plain; charset=iso-8859-1", None),
    ],
    ids=["gzip", "br", "multipart", "streamed", "non-utf8", "latin1"],
)
def test_bodies_skipped_but_path_and_headers_done(
    body: bytes | None, content_type: str, content_encoding: str | None
) -> None:
    headers = (("X-A", PLACEHOLDER),)
    out = go(
        passthrough(),
        req(
            f"/v1/{PLACEHOLDER}",
            method="POST",
            headers=headers,
            body=body,
            content_type=content_type,
            content_encoding=content_encoding,
        ),
    )
    assert out.kind == "inject" and out.new_body is None
    assert out.new_path == f"/v1/{quote(SUB_VALUE, safe='')}"
    assert out.header_updates == ((0, SUB_VALUE),)
    assert out.substituted == ("path", "header")


def test_identity_encoding_substituted() -> None:
    out = go(passthrough(), req(method="POST", body=b"__TOKEN__", content_encoding="Identity"))
    assert out.new_body == SUB_VALUE.encode()


def test_body_phase_two() -> None:
    s = passthrough()
    out = go(s, req(method="POST", body=None, content_type="text/plain"))
    assert out.kind == "inject" and out.new_body is None
    binding = find_binding(s, out.binding)
    assert binding is not None
    assert substitute_body(binding, b"x __TOKEN__", "text/plain", None) == f"x {SUB_VALUE}".encode()
    assert substitute_body(binding, b"nothing here", "text/plain", None) is None
    assert find_binding(s, "missing") is None


def test_longest_placeholder_first() -> None:
    subs = [
        {"credential": "short", "placeholder": "{{K}}", "in": ["body", "query"]},
        {"credential": "long", "placeholder": "{{K}}2", "in": ["body", "query"]},
    ]
    s = snap(
        bind("p", auth={"type": "passthrough", "substitutions": subs}),
        creds={"short": "SHORT", "long": "LONG"},
    )
    out = go(s, req("/v1/x?a={{K}}2&b={{K}}", method="POST", body=b"x{{K}}2y{{K}}z"))
    assert out.new_body == b"xLONGySHORTz"
    assert out.new_path == "/v1/x?a=LONG&b=SHORT"
    # Longest first even when a shorter placeholder starts earlier and overlaps it.
    assert substitute("ABCDE", [("AB", "1"), ("BCDE", "2")]) == ("A2", 1)
    assert substitute("ABAB", [("AB", "1")]) == ("11", 2)
    assert substitute("", [("AB", "1")]) == ("", 0)


def test_no_rescan_of_substituted_text() -> None:
    subs = [
        {"credential": "a", "placeholder": "{{A}}", "in": ["body"]},
        {"credential": "b", "placeholder": "{{B}}", "in": ["body"]},
    ]
    s = snap(bind("p", auth={"type": "passthrough", "substitutions": subs}), creds={"a": "{{B}}", "b": "bee"})
    out = go(s, req(method="POST", body=b"{{A}} {{B}}", content_type="text/plain"))
    assert out.new_body == b"{{B}} bee"


def test_substitutions_case_sensitive() -> None:
    out = go(passthrough(), req(method="POST", body=b"__token__", content_type="text/plain"))
    assert out.kind == "inject" and out.new_body is None and out.substituted == ()


# --------------------------------------------------------------------------------------------
# Response redaction


def test_response_header_redaction_from_snapshot() -> None:
    s = snap(bind(auth={"type": "bearer", "credential": "tok", "substitutions": SUBS}))
    headers = [
        ("X-Echo-Auth", f"Bearer {SECRET}"),
        ("X-Raw", f"v={SECRET};"),
        ("Location", f"https://x/?t={quote(SUB_VALUE, safe='')}"),
        ("X-Form", f"t={quote_plus(SUB_VALUE, safe='')}"),
        ("X-Json", json.dumps({"t": SUB_VALUE})),
        ("X-Placeholder", PLACEHOLDER),
        ("Content-Type", "text/plain"),
        (SECRET2, "name untouched"),
    ]
    out = redact_response_headers(headers, s.redactions)
    assert out == [
        ("X-Echo-Auth", "[REDACTED]"),
        ("X-Raw", "v=[REDACTED];"),
        ("Location", "https://x/?t=[REDACTED]"),
        ("X-Form", "t=[REDACTED]"),
        ("X-Json", '{"t": "[REDACTED]"}'),
        ("X-Placeholder", "[REDACTED]"),
        ("Content-Type", "text/plain"),
        (SECRET2, "name untouched"),
    ]
    assert redact_response_headers(headers, []) == headers


def test_redact_text_overlaps_and_marker() -> None:
    assert redact_text("xSECRETy RED", ["RED", "SECRET"]) == "x[REDACTED]y [REDACTED]"
    # Overlapping strings merge: no partial value survives.
    assert redact_text("xABCDEy", ["ABC", "CDE"]) == "x[REDACTED]y"
    assert redact_text("ABAB", ["AB", ""]) == "[REDACTED][REDACTED]"
    assert redact_text("clean", ["AB"]) == "clean"


# --------------------------------------------------------------------------------------------
# Secrecy


def test_values_never_in_repr_or_reason() -> None:
    planted = "PLANTED-Cr3d-Value-42"
    subs = [{"credential": "tok", "placeholder": "{{SECRET_PH}}", "in": ["path", "query", "header", "body"]}]
    creds = {"tok": planted}
    snapshots = [
        snap(bind(auth={"type": "bearer", "credential": "tok", "substitutions": subs}), creds=creds),
        snap(bind(auth={"type": "apiKey", "name": "X-K", "credential": "tok"}), creds=creds),
        snap(
            bind(auth={"type": "customHeaders", "headers": [{"name": "X-C", "credential": "tok"}]}),
            creds=creds,
        ),
    ]
    requests = [
        req("/v1/{{SECRET_PH}}?q={{SECRET_PH}}", headers=(("X-H", "{{SECRET_PH}}"),), body=b"{{SECRET_PH}}"),
        req("/v1/../x"),
        req(sni="evil.test"),
        req(sni=None),
        req(host="nope.test"),
    ]
    outcomes = [LOOKUP_FAILED, go(None, req())]
    for s in snapshots:
        outcomes += [go(s, r) for r in requests] + [go(s, requests[0], destination_ok=False)]
        outcomes.append(go(_combined(s, snap(bind("other"), creds=creds)), req()))
    kinds = {o.kind for o in outcomes}
    assert kinds == {"pass", "inject", "refuse"}
    assert any(o.new_path and o.new_body and o.header_updates and o.set_headers for o in outcomes)
    for o in outcomes:
        for text in (repr(o), str(o), o.reason):
            assert planted not in text and "{{SECRET_PH}}" not in text, text
    for r in requests:
        assert planted not in repr(r) and "{{SECRET_PH}}" not in repr(r)
    assert planted not in repr(snapshots[0])


# --------------------------------------------------------------------------------------------
# One authority (docs/reference/behaviour.md §14.8)

REFUSED = OneAuthority(None, AMBIGUOUS_AUTHORITY)


def test_ambiguous_authority_is_a_400_without_binding() -> None:
    assert (AMBIGUOUS_AUTHORITY.kind, AMBIGUOUS_AUTHORITY.status) == ("refuse", 400)
    assert AMBIGUOUS_AUTHORITY.reason == REASON_AUTHORITY and AMBIGUOUS_AUTHORITY.binding is None


@pytest.mark.parametrize(
    ("target", "hosts", "sni", "port", "value"),
    [
        ("", ["api.example.com"], "api.example.com", 443, "api.example.com"),  # origin-form
        ("api.example.com", ["api.example.com"], "api.example.com", 443, "api.example.com"),
        ("API.Example.COM.", ["api.example.com"], "api.example.com", 443, "api.example.com"),
        ("api.example.com:443", ["api.example.com"], "API.example.com.", 443, "api.example.com"),
        ("api.example.com", [], "api.example.com", 443, "api.example.com"),  # absolute, no Host
        ("api.example.com", [], None, 80, "api.example.com"),
        ("", ["api.example.com:80"], None, 80, "api.example.com:80"),
        ("xn--bcher-kva.example", ["bücher.example"], None, 80, "bücher.example"),  # IDN forms
        ("", [], None, 443, None),  # nothing named: matches no binding
        ("", [], "api.example.com", 443, None),  # SNI alone: "when both are present"
        ("", ["10.0.0.1"], None, 80, "10.0.0.1"),
        ("[fd00::1]:443", ["[FD00::1]"], None, 443, "[FD00::1]"),
        ("", ["not a host"], None, 80, "not a host"),  # alone: matches nothing, not refused
    ],
)
def test_one_authority_accepted(
    target: str, hosts: list[str], sni: str | None, port: int, value: str | None
) -> None:
    assert one_authority(target, hosts, sni, port) == OneAuthority(value)


@pytest.mark.parametrize(
    ("target", "hosts", "sni", "port"),
    [
        # HTTP/1 absolute-form (or HTTP/2 :authority) against Host, either way round.
        ("attacker.example", ["api.example.com"], "api.example.com", 443),
        ("api.example.com", ["attacker.example"], "api.example.com", 443),
        ("attacker.example", ["api.example.com"], None, 80),
        ("api.example.com.evil", ["api.example.com"], None, 80),
        ("api.example.com:8443", ["api.example.com"], None, 443),
        ("api.example.com", [""], None, 80),  # an empty Host beside a named target
        ("[fd00::1]", ["api.example.com"], None, 443),
        ("api.example.com", ["api.example.com, attacker.example"], None, 80),
        # Duplicate Host headers, equal or not (RFC 9112 §3.2).
        ("", ["api.example.com", "attacker.example"], None, 80),
        ("", ["api.example.com", "api.example.com"], "api.example.com", 443),
        ("api.example.com", ["api.example.com", "api.example.com"], None, 443),
        # An explicit port other than the connection's (forwarded to 443 whatever it says).
        ("", ["api.example.com:8443"], "api.example.com", 443),
        ("", ["api.example.com:80"], "api.example.com", 443),
        ("api.example.com:80", ["api.example.com:80"], None, 443),
        ("", ["api.example.com:0443x"], "api.example.com", 443),
        # SNI against the authority.
        ("", ["api.example.com"], "attacker.example", 443),
        ("", ["attacker.example"], "api.example.com", 443),
        ("", ["10.0.0.1"], "api.example.com", 443),
        ("", ["not a host"], "api.example.com", 443),
        ("api.example.com", [], "attacker.example", 443),
    ],
)
def test_one_authority_refused(target: str, hosts: list[str], sni: str | None, port: int) -> None:
    assert one_authority(target, hosts, sni, port) == REFUSED


# --------------------------------------------------------------------------------------------
# An attacker who controls the request (issue 12 item 5)


@pytest.mark.parametrize(
    "connection",
    [
        "content-length",
        "Transfer-Encoding",
        "close, Host",
        "keep-alive,authorization",
        "X-Api-Key",
        "te, x-custom",
    ],
)
def test_connection_options_naming_forwarded_headers_refused(connection: str) -> None:
    """A hop-by-hop listing makes the next hop drop the named header: Content-Length (the
    rest of the body becomes a smuggled request on the upstream connection), Host, or the
    injected header itself. Refused before anything is injected."""
    for name in ("Connection", "connection", "Proxy-Connection"):
        out = go(snap(bind()), req(headers=((name, connection),)))
        assert (out.kind, out.status, out.reason, out.binding) == ("refuse", 400, REASON_HOP_BY_HOP, "b")
        assert out.set_headers == ()
    # A second Connection header cannot hide the option either.
    out = go(snap(bind()), req(headers=(("Connection", "keep-alive"), ("Connection", connection))))
    assert out.status == 400


def test_ordinary_connection_options_inject() -> None:
    for value in ("close", "Keep-Alive", "Upgrade", "keep-alive, Upgrade", "TE", " , close"):
        assert go(snap(bind()), req(headers=(("Connection", value),))).kind == "inject", value


def test_connection_options_outside_any_binding_pass() -> None:
    assert (
        go(snap(bind()), req("/other", headers=(("Connection", "host"),)), destination_ok=False).kind
        == "pass"
    )
    assert go(snap(bind(hosts=["other.example.com"])), req(headers=(("Connection", "host"),))).kind == "pass"


@pytest.mark.parametrize("name", sorted(TARGET_OVERRIDE_HEADERS))
def test_target_override_headers_refused(name: str) -> None:
    """Headers front ends honour as the real host, path or method would carry the credential
    to a target the binding does not name (``X-HTTP-Method-Override: DELETE`` on a GET-only
    binding, ``X-Original-URL: /admin``, ``X-Forwarded-Host: attacker``)."""
    for spelled in (name, name.upper()):
        out = go(snap(bind(methods=["GET"])), req(headers=((spelled, "attacker.example"),)))
        assert (out.kind, out.status, out.reason, out.binding) == ("refuse", 403, REASON_TARGET_OVERRIDE, "b")


@pytest.mark.parametrize("te", ["gzip, chunked", "deflate,chunked", "compress", "gzip", "identity"])
def test_body_under_a_transfer_coding_not_substituted(te: str) -> None:
    out = go(
        passthrough(),
        req(method="POST", body=b"x __TOKEN__", content_type="text/plain", transfer_encoding=te),
    )
    assert out.kind == "inject" and out.new_body is None
    binding = find_binding(passthrough(), "p")
    assert binding is not None
    assert substitute_body(binding, b"x __TOKEN__", "text/plain", None, te) is None
    assert (
        substitute_body(binding, b"x __TOKEN__", "text/plain", None, "Chunked") == f"x {SUB_VALUE}".encode()
    )


def test_placeholder_inside_another_placeholder_or_value() -> None:
    """Longest first, no rescan: a placeholder spelled inside another one, or inside a
    substituted value, is never replaced a second time."""
    text, n = substitute("__TOKEN__X __TOKEN__", [("__TOKEN__", "v1"), ("__TOKEN__X", "__TOKEN__")])
    assert (text, n) == ("__TOKEN__ v1", 2)
    text, n = substitute("A__TOKEN__B", [("__TOKEN__", "A__TOKEN__B"), ("A__TOKEN__B", "z")])
    assert (text, n) == ("z", 1)


def test_pseudo_and_reserved_headers_never_carry_a_substitution() -> None:
    headers = (
        (":authority", PLACEHOLDER),
        ("Host", PLACEHOLDER),
        ("Connection", PLACEHOLDER.lower()),
        ("Transfer-Encoding", PLACEHOLDER),
        ("X-A", PLACEHOLDER),
    )
    # ``Connection: __token__`` names a header: refused before any substitution.
    out = go(passthrough(), req(headers=headers))
    assert out.status == 400 and out.header_updates == ()
    out = go(passthrough(), req(headers=headers[:2] + headers[3:]))
    assert out.header_updates == ((3, SUB_VALUE),)


def test_rewrite_outside_the_list_raises() -> None:
    """The addon applies only what the outcome lists; an outcome pointing at a reserved or
    missing header is a bug and fails closed (the addon kills the flow)."""
    headers = (("Host", "api.example.com"), ("X-A", "a"))
    with pytest.raises(RewriteError):
        InjectionDecision("inject", header_updates=((0, "evil.example"),)).rewrite_headers(headers)
    with pytest.raises(RewriteError):
        InjectionDecision("inject", header_updates=((5, "x"),)).rewrite_headers(headers)
    with pytest.raises(RewriteError):
        InjectionDecision("inject", set_headers=(("host", "evil.example"),)).rewrite_headers(headers)
    with pytest.raises(RewriteError):
        InjectionDecision("inject", set_headers=((":authority", "evil.example"),)).rewrite_headers(headers)
    assert InjectionDecision("inject", header_updates=((1, "b"),)).rewrite_headers(headers) == [
        ("Host", "api.example.com"),
        ("X-A", "b"),
    ]


def test_redirect_location_with_an_injected_value_is_redacted() -> None:
    """mitmproxy does not follow redirects; a Location (or any response header) that
    reflects an injected header value, raw or URL/form/JSON-encoded, is redacted before the
    sandbox sees it, so it cannot replay the credential elsewhere."""
    s = snap(
        bind(),
        bind("k", hosts=["x.example.com"], auth={"type": "apiKey", "name": "X-Key", "credential": "key"}),
    )
    for encoded in (SECRET, quote(SECRET, safe=""), quote_plus(SECRET, safe=""), json.dumps(SECRET)[1:-1]):
        headers = [("Location", f"https://attacker.example/?t={encoded}"), ("Refresh", f"0; url=/?{encoded}")]
        assert all(
            SECRET not in v and encoded not in v for _, v in redact_response_headers(headers, s.redactions)
        )
    headers = [("Location", f"https://attacker.example/?k={quote(SECRET2, safe='')}")]
    assert redact_response_headers(headers, s.redactions) == [
        ("Location", "https://attacker.example/?k=[REDACTED]")
    ]


@pytest.mark.parametrize("path", ["https://attacker.example/v1/x", "attacker.example/v1", "", "x"])
def test_target_not_in_origin_form_refused(path: str) -> None:
    """An HTTP/2 ``:path`` carrying an authority would reach an HTTP/1 upstream as an
    absolute-form request line naming it."""
    assert one_authority("api.example.com", [], "api.example.com", 443, path) == REFUSED
    assert one_authority("api.example.com", [], "api.example.com", 443, "/v1/x") == OneAuthority(
        "api.example.com"
    )
    assert one_authority("api.example.com", [], "api.example.com", 443, "*") == OneAuthority(
        "api.example.com"
    )


@pytest.mark.parametrize(
    "content_type", ["text/plain, application/json", "application/json; charset=utf-8, text/plain"]
)
def test_duplicate_content_type_body_not_substituted(content_type: str) -> None:
    """mitmproxy joins duplicate headers with ", ": a raw value placed in a body the server
    parses as JSON could break out of its string; neither encoding is safe, so none is used."""
    out = go(passthrough(), req(method="POST", body=b'{"k": "__TOKEN__"}', content_type=content_type))
    assert out.kind == "inject" and out.new_body is None
