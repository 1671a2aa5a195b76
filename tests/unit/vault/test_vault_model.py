"""§6 credential vault documents: parsing, normalisation, validation, ambiguity, coverage."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from egressd.policy import AlwaysRules, NetworkPolicy, effective_policy, parse_policy_obj, parse_target
from egressd.policy.model import Rule, Verdict
from egressd.vault.ambiguity import check_ambiguity
from egressd.vault.coverage import check_coverage, check_ignore_hosts, host_covered
from egressd.vault.parse import (
    canonical_header_name,
    check_references,
    parse_binding,
    parse_create,
    parse_host,
    parse_match,
    parse_mutation,
    peek_expected_revision,
)
from egressd.vault.types import (
    DEFAULT_METHODS,
    RESERVED_HEADERS,
    Auth,
    AuthType,
    Binding,
    Credential,
    HeaderRef,
    Match,
    Substitution,
    VaultError,
    echo,
)
from egressd.vault.validate import validate_candidate

SECRET = "s3cr3t-VALUE-never-echo"


def cred(name: str = "tok", value: str = SECRET, **source: Any) -> dict[str, Any]:
    return {"name": name, "source": {"type": "inline", "value": value, **source}}


def binding(
    name: str = "b", hosts: list[str] | None = None, auth: dict[str, Any] | None = None, **match: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "match": {"hosts": hosts if hosts is not None else ["api.example.com"], **match},
        "auth": auth if auth is not None else {"type": "bearer", "credential": "tok"},
    }


def body(credentials: list[Any] | None = None, bindings: list[Any] | None = None) -> dict[str, Any]:
    return {
        "credentials": credentials if credentials is not None else [cred()],
        "bindings": bindings if bindings is not None else [binding()],
    }


def bad(obj: object, field: str, *, parse: Any = parse_create) -> VaultError:
    """Parse must fail with 400 naming ``field``; the message is one line without the secret."""
    with pytest.raises(VaultError) as info:
        parse(obj)
    err = info.value
    assert err.status == 400
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: ")
    assert "\n" not in str(err)
    assert SECRET not in str(err) and SECRET not in repr(err)
    assert err.__cause__ is None
    return err


def policy(*rules: tuple[str, str], default: str = "deny") -> NetworkPolicy:
    return parse_policy_obj(
        {"defaultAction": default, "egress": [{"action": a, "target": t} for a, t in rules]}
    )


def make_binding(name: str, hosts: list[str], **match: Any) -> Binding:
    return parse_binding(binding(name, hosts, **match), "b")


# ---------------------------------------------------------------------------------------------
# Happy path and normalisation


def test_parse_create_normalises() -> None:
    content = parse_create(
        {
            "credentials": [{"name": "tok", "source": {"value": SECRET}}],
            "bindings": [
                {
                    "name": "gh",
                    "match": {
                        "hosts": ["API.Example.COM.", "api.example.com", "*.Svc.Example.com"],
                        "schemes": ["HTTPS", " http ", "https"],
                        "methods": [" get", "POST", "Get"],
                        "paths": [" /v1/* ", "/v1/*", "/x"],
                        "ports": [443, 80],
                    },
                    "auth": {"type": "bearer", "credential": "tok"},
                }
            ],
        }
    )
    (c,) = content.credentials
    assert (c.name, c.source_type, c.value, c.revision) == ("tok", "inline", SECRET, 0)
    (b,) = content.bindings
    assert b.name == "gh"
    assert b.match == Match(
        hosts=("api.example.com", "*.svc.example.com"),
        schemes=("https", "http"),
        methods=("GET", "POST"),
        paths=("/v1/*", "/x"),
    )
    assert b.auth == Auth(AuthType.BEARER, credential="tok")
    assert b.substitutions == ()


@pytest.mark.parametrize("empty", [None, []])
def test_match_defaults(empty: Any) -> None:
    m = parse_match({"hosts": ["a.example.com"], "schemes": empty, "methods": empty, "paths": empty}, "m")
    assert m.schemes == ("https",)
    assert m.methods == DEFAULT_METHODS == ("GET", "POST", "PUT", "PATCH", "DELETE")
    assert m.paths == ("/*",)
    assert m.to_json() == {
        "schemes": ["https"],
        "hosts": ["a.example.com"],
        "methods": ["GET", "POST", "PUT", "PATCH", "DELETE"],
        "paths": ["/*"],
    }


def test_source_type_missing_is_inline_and_empty_lists_ok() -> None:
    content = parse_create({"credentials": [{"name": "a", "source": {"value": "v"}}], "bindings": []})
    assert content.credentials[0].source_type == "inline"
    assert parse_create({"credentials": [], "bindings": []}).credentials == ()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("API.Example.com.", "api.example.com"),
        ("*.Example.com", "*.example.com"),
        ("*.a.example.com.", "*.a.example.com"),
        ("a-b.x9.io", "a-b.x9.io"),
        ("  x.example.com ", "x.example.com"),
        ("1.2.3", "1.2.3"),  # dotted digits that are not an IP parse as labels
    ],
)
def test_host_valid(raw: str, expected: str) -> None:
    assert parse_host(raw, "h") == expected


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "   ",
        ".",
        "https://api.example.com",
        "api.example.com/v1",
        "1.2.3.4",
        "::1",
        "[::1]",
        "2001:db8::1",
        "localhost",
        "*.com",
        "*",
        "*.*.example.com",
        "a.*.example.com",
        "*example.com",
        "x*.example.com",
        "-a.example.com",
        "a-.example.com",
        "a_b.example.com",
        "a..example.com",
        "api.example.com..",
        "api.example.com:443",
        "exa mple.com",
        # docs/reference/behaviour.md §14.3: Unicode hosts are converted (see test_unicode_host_becomes_a_labels);
        # only names that are not valid IDNA 2008 are refused.
        "☃.example.com",
        "a\u200db.example.com",
        "ab--ü.example.com",
        ("ü" * 64) + ".example.com",
        ("a" * 64) + ".example.com",
        ".".join(["a" * 63] * 4) + ".com",
    ],
)
def test_host_invalid(raw: str) -> None:
    err = bad(
        body(bindings=[binding(), binding("c", hosts=["ok.example.com", raw])]), "bindings[1].match.hosts[1]"
    )
    assert len(str(err)) < 400


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("bücher.example.com", "xn--bcher-kva.example.com"),
        ("BÜCHER.Example.com.", "xn--bcher-kva.example.com"),
        ("*.évil.com", "*.xn--vil-9la.com"),
        ("évil。com", "xn--vil-9la.com"),  # ideographic full stop is a label separator (UTS-46)
        ("xn--vil-9la.com", "xn--vil-9la.com"),
    ],
)
def test_unicode_host_becomes_a_labels(raw: str, expected: str) -> None:
    assert parse_host(raw, "h") == expected


def test_unicode_host_is_covered_by_the_same_policy_in_either_form() -> None:
    """A vault host in Unicode is covered by the policy's A-label rule and the other way round."""
    for target, host in (
        ("xn--bcher-kva.example.com", "bücher.example.com"),
        ("bücher.example.com", "xn--bcher-kva.example.com"),
    ):
        policy = parse_policy_obj({"egress": [{"action": "allow", "target": target}]})
        assert host_covered(policy, parse_host(host, "h"))


def test_host_too_long_limit() -> None:
    ok = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])  # 253
    assert parse_host(ok, "h") == ok
    with pytest.raises(VaultError):
        parse_host(ok + "e", "h")


@pytest.mark.parametrize(
    ("match", "field"),
    [
        ({"hosts": []}, "bindings[0].match.hosts"),
        ({"hosts": None}, "bindings[0].match.hosts"),
        ({"hosts": "api.example.com"}, "bindings[0].match.hosts"),
        ({"hosts": [1]}, "bindings[0].match.hosts[0]"),
        ({"hosts": ["a.example.com"], "schemes": ["ftp"]}, "bindings[0].match.schemes[0]"),
        ({"hosts": ["a.example.com"], "schemes": ["https", "wss"]}, "bindings[0].match.schemes[1]"),
        ({"hosts": ["a.example.com"], "methods": ["GET", "  "]}, "bindings[0].match.methods[1]"),
        ({"hosts": ["a.example.com"], "paths": ["v1/*"]}, "bindings[0].match.paths[0]"),
        ({"hosts": ["a.example.com"], "paths": ["/", ""]}, "bindings[0].match.paths[1]"),
        ({"hosts": ["a.example.com"], "ports": [8443]}, "bindings[0].match.ports[0]"),
        ({"hosts": ["a.example.com"], "ports": [443, 22]}, "bindings[0].match.ports[1]"),
        ({"hosts": ["a.example.com"], "ports": [True]}, "bindings[0].match.ports[0]"),
        ({"hosts": ["a.example.com"], "ports": ["443"]}, "bindings[0].match.ports[0]"),
        ({"hosts": ["a.example.com"], "port": [443]}, "bindings[0].match"),
        ("api.example.com", "bindings[0].match"),
    ],
)
def test_match_invalid(match: Any, field: str) -> None:
    b = binding()
    b["match"] = match
    bad(body(bindings=[b]), field)


def test_ports_80_443_dropped() -> None:
    m = parse_match({"hosts": ["a.example.com"], "ports": [80, 443, 443]}, "m")
    assert "ports" not in m.to_json()


# ---------------------------------------------------------------------------------------------
# Credentials


@pytest.mark.parametrize(
    ("credential", "field", "reason"),
    [
        (
            {"name": "tok", "source": {"type": "inline", "value": ""}},
            "credentials[0].source.value",
            "must not be empty",
        ),
        ({"name": "tok", "source": {"value": "   "}}, "credentials[0].source.value", "must not be blank"),
        ({"name": "tok", "source": {"value": 5}}, "credentials[0].source.value", "must be a string"),
        ({"name": "tok", "source": {}}, "credentials[0].source.value", "is required"),
        (
            {"name": "tok", "source": {"type": "vault", "value": SECRET}},
            "credentials[0].source.type",
            "unsupported",
        ),
        (
            {"name": "tok", "source": {"type": 1, "value": SECRET}},
            "credentials[0].source.type",
            "must be a string",
        ),
        (
            {"name": "tok", "source": {"value": SECRET, "ref": "x"}},
            "credentials[0].source",
            "unknown field 'ref'",
        ),
        ({"name": "tok", "source": SECRET}, "credentials[0].source", "must be an object"),
        ({"name": "tok"}, "credentials[0].source", "is required"),
        ({"name": "  ", "source": {"value": SECRET}}, "credentials[0].name", "must not be blank"),
        ({"source": {"value": SECRET}}, "credentials[0].name", "is required"),
        ({"name": 7, "source": {"value": SECRET}}, "credentials[0].name", "must be a string"),
        (
            {"name": "tok", "source": {"value": SECRET}, "value": SECRET},
            "credentials[0]",
            "unknown field 'value'",
        ),
    ],
)
def test_credential_invalid(credential: dict[str, Any], field: str, reason: str) -> None:
    err = bad(body(credentials=[credential], bindings=[]), field)
    assert reason in err.reason


def test_value_error_message_matches_brief() -> None:
    err = bad(body(credentials=[cred(value="")], bindings=[]), "credentials[0].source.value")
    assert str(err) == "credentials[0].source.value: must not be empty"


def test_duplicate_names() -> None:
    bad(body(credentials=[cred("a"), cred("a")], bindings=[]), "credentials[1].name")
    bad(body(bindings=[binding("x"), binding("x", hosts=["b.example.com"])]), "bindings[1].name")


# ---------------------------------------------------------------------------------------------
# Auth and substitutions


def test_auth_types() -> None:
    creds = [cred("tok"), cred("k2", "other")]
    content = parse_create(
        body(
            creds,
            [
                binding("bearer", ["a.example.com"], {"type": "bearer", "credential": "tok"}),
                binding("basic", ["b.example.com"], {"type": "basic", "credential": "tok"}),
                binding(
                    "apikey",
                    ["c.example.com"],
                    {"type": "apiKey", "name": " x-api-KEY ", "credential": "tok"},
                ),
                binding(
                    "custom",
                    ["d.example.com"],
                    {
                        "type": "customHeaders",
                        "headers": [
                            {"name": "x-one", "credential": "tok"},
                            {"name": "X-Two", "credential": "k2"},
                        ],
                    },
                ),
                binding(
                    "pass",
                    ["e.example.com"],
                    {
                        "type": "passthrough",
                        "substitutions": [
                            {"credential": "k2", "placeholder": "__K2__", "in": ["Body", "query", "body"]}
                        ],
                    },
                ),
            ],
        )
    )
    by = {b.name: b for b in content.bindings}
    assert by["bearer"].auth == Auth(AuthType.BEARER, credential="tok")
    assert by["basic"].auth == Auth(AuthType.BASIC, credential="tok")
    assert by["apikey"].auth == Auth(AuthType.API_KEY, credential="tok", name="X-Api-Key")
    assert by["custom"].auth.headers == (HeaderRef("X-One", "tok"), HeaderRef("X-Two", "k2"))
    assert by["pass"].auth == Auth(AuthType.PASSTHROUGH)
    assert by["pass"].substitutions == (Substitution("k2", "__K2__", ("body", "query")),)
    assert by["apikey"].auth.metadata() == {"type": "apiKey", "name": "X-Api-Key"}
    assert by["custom"].auth.metadata() == {"type": "customHeaders"}
    assert by["bearer"].auth.metadata() == {"type": "bearer"}


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("x-api-key", "X-Api-Key"),
        ("AUTHORIZATION", "Authorization"),
        ("x_token", "X_token"),
        ("a--b", "A--B"),
    ],
)
def test_canonical_header_name(name: str, canonical: str) -> None:
    assert canonical_header_name(name) == canonical


@pytest.mark.parametrize(
    ("auth", "field", "reason"),
    [
        ({"type": "bearer"}, "bindings[0].auth.credential", "is required"),
        ({"type": "basic", "credential": " "}, "bindings[0].auth.credential", "must not be blank"),
        ({"type": "apiKey", "credential": "tok"}, "bindings[0].auth.name", "is required"),
        ({"type": "apiKey", "name": "X-Key"}, "bindings[0].auth.credential", "is required"),
        (
            {"type": "apiKey", "name": "x key", "credential": "tok"},
            "bindings[0].auth.name",
            "not a valid HTTP header",
        ),
        (
            {"type": "apiKey", "name": "x:key", "credential": "tok"},
            "bindings[0].auth.name",
            "not a valid HTTP header",
        ),
        (
            {"type": "apiKey", "name": "content-TYPE", "credential": "tok"},
            "bindings[0].auth.name",
            "reserved",
        ),
        ({"type": "customHeaders"}, "bindings[0].auth.headers", "is required"),
        ({"type": "customHeaders", "headers": []}, "bindings[0].auth.headers", "at least one"),
        (
            {
                "type": "customHeaders",
                "headers": [{"name": "X-A", "credential": "tok"}, {"name": "x-a", "credential": "tok"}],
            },
            "bindings[0].auth.headers[1].name",
            "duplicate header name",
        ),
        (
            {"type": "customHeaders", "headers": [{"name": "Host", "credential": "tok"}]},
            "bindings[0].auth.headers[0].name",
            "reserved",
        ),
        (
            {"type": "customHeaders", "headers": [{"name": "X-A"}]},
            "bindings[0].auth.headers[0].credential",
            "is required",
        ),
        (
            {"type": "customHeaders", "headers": [{"name": "X-A", "credential": "tok", "value": SECRET}]},
            "bindings[0].auth.headers[0]",
            "unknown field 'value'",
        ),
        ({"type": "oauth", "credential": "tok"}, "bindings[0].auth.type", "unsupported auth type"),
        ({"type": "Bearer", "credential": "tok"}, "bindings[0].auth.type", "unsupported auth type"),
        ({"credential": "tok"}, "bindings[0].auth.type", "is required"),
        (
            {"type": "bearer", "credential": "tok", "name": "X-A"},
            "bindings[0].auth",
            "not allowed for auth type 'bearer'",
        ),
        (
            {"type": "passthrough", "credential": "tok"},
            "bindings[0].auth",
            "not allowed for auth type 'passthrough'",
        ),
        (
            {"type": "bearer", "credential": "tok", "value": SECRET},
            "bindings[0].auth",
            "unknown field 'value'",
        ),
        (
            {"type": "passthrough", "substitutions": [{"credential": "tok", "placeholder": "P", "in": []}]},
            "bindings[0].auth.substitutions[0].in",
            "must not be empty",
        ),
        (
            {
                "type": "passthrough",
                "substitutions": [{"credential": "tok", "placeholder": "P", "in": ["cookie"]}],
            },
            "bindings[0].auth.substitutions[0].in[0]",
            "must be one of",
        ),
        (
            {
                "type": "passthrough",
                "substitutions": [{"credential": "tok", "placeholder": " ", "in": ["body"]}],
            },
            "bindings[0].auth.substitutions[0].placeholder",
            "must not be blank",
        ),
        (
            {"type": "passthrough", "substitutions": [{"placeholder": "P", "in": ["body"]}]},
            "bindings[0].auth.substitutions[0].credential",
            "is required",
        ),
        (
            {"type": "passthrough", "substitutions": [{"credential": "tok", "placeholder": "P"}]},
            "bindings[0].auth.substitutions[0].in",
            "is required",
        ),
        (
            {
                "type": "passthrough",
                "substitutions": [{"credential": "tok", "placeholder": "P", "in": ["body"], "x": 1}],
            },
            "bindings[0].auth.substitutions[0]",
            "unknown field 'x'",
        ),
        (
            {
                "type": "passthrough",
                "substitutions": [
                    {"credential": "tok", "placeholder": "P", "in": ["body"]},
                    {"credential": "tok", "placeholder": "P", "in": ["path"]},
                ],
            },
            "bindings[0].auth.substitutions[1].placeholder",
            "duplicate placeholder",
        ),
        ({"type": "passthrough", "substitutions": {}}, "bindings[0].auth.substitutions", "must be an array"),
    ],
)
def test_auth_invalid(auth: dict[str, Any], field: str, reason: str) -> None:
    err = bad(body(bindings=[binding(auth=auth)]), field)
    assert reason in err.reason


def test_placeholder_never_echoed() -> None:
    auth = {
        "type": "passthrough",
        "substitutions": [
            {"credential": "tok", "placeholder": SECRET, "in": ["body"]},
            {"credential": "tok", "placeholder": SECRET, "in": ["path"]},
        ],
    }
    bad(body(bindings=[binding(auth=auth)]), "bindings[0].auth.substitutions[1].placeholder")
    sub = Substitution("tok", SECRET, ("body",))
    assert SECRET not in repr(sub) and SECRET not in str(sub)


def test_reserved_headers_list() -> None:
    assert {
        "host",
        "content-length",
        "content-type",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-authenticate",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
    } == RESERVED_HEADERS


# ---------------------------------------------------------------------------------------------
# Document shape and references


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"bindings": []}, "credentials"),
        ({"credentials": []}, "bindings"),
        ({"credentials": None, "bindings": []}, "credentials"),
        ({"credentials": {}, "bindings": []}, "credentials"),
        ({"credentials": [], "bindings": [], "revision": 1}, None),
        ({"credentials": [SECRET], "bindings": []}, "credentials[0]"),
        (
            {"credentials": [], "bindings": [{"name": "b", "match": {"hosts": ["a.example.com"]}}]},
            "bindings[0].auth",
        ),
        (
            {"credentials": [], "bindings": [{"name": "b", "auth": {"type": "passthrough"}}]},
            "bindings[0].match",
        ),
        (
            {
                "credentials": [],
                "bindings": [
                    {"name": "b", "match": {"hosts": ["a.b.com"]}, "auth": {"type": "passthrough"}, "x": 1}
                ],
            },
            "bindings[0]",
        ),
    ],
)
def test_document_invalid(obj: Any, field: str | None) -> None:
    with pytest.raises(VaultError) as info:
        parse_create(obj)
    assert info.value.status == 400
    assert info.value.field == field


@pytest.mark.parametrize("obj", [None, [], SECRET, 3])
def test_document_not_object(obj: Any) -> None:
    with pytest.raises(VaultError) as info:
        parse_create(obj)
    assert info.value.status == 400
    assert "must be an object" in str(info.value)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    ("auth", "field"),
    [
        ({"type": "bearer", "credential": "nope"}, "bindings[0].auth.credential"),
        (
            {
                "type": "customHeaders",
                "headers": [{"name": "X-A", "credential": "tok"}, {"name": "X-B", "credential": "nope"}],
            },
            "bindings[0].auth.headers[1].credential",
        ),
        (
            {
                "type": "bearer",
                "credential": "tok",
                "substitutions": [{"credential": "nope", "placeholder": "P", "in": ["body"]}],
            },
            "bindings[0].auth.substitutions[0].credential",
        ),
    ],
)
def test_references_must_exist(auth: dict[str, Any], field: str) -> None:
    err = bad(body(bindings=[binding(auth=auth)]), field)
    assert "'nope'" in err.reason and "does not exist" in err.reason


@pytest.mark.parametrize("value", ["a\r\nX-Evil: 1", "line\n", "nul\x00"])
def test_header_values_reject_crlf_nul(value: str) -> None:
    bad(body(credentials=[cred("tok", value)]), "bindings[0].auth.credential")
    sub_header = {
        "type": "passthrough",
        "substitutions": [{"credential": "tok", "placeholder": "P", "in": ["header"]}],
    }
    bad(
        body(credentials=[cred("tok", value)], bindings=[binding(auth=sub_header)]),
        "bindings[0].auth.substitutions[0].credential",
    )
    # a body-only substitution may carry multi-line values (a PEM key, say)
    sub_body = {
        "type": "passthrough",
        "substitutions": [{"credential": "tok", "placeholder": "P", "in": ["body"]}],
    }
    parse_create(body(credentials=[cred("tok", value)], bindings=[binding(auth=sub_body)]))


def test_check_references_by_name() -> None:
    b = make_binding("gh", ["a.example.com"])
    with pytest.raises(VaultError) as info:
        check_references({}, [b])
    assert info.value.field == "bindings['gh'].auth.credential"
    check_references({"tok": Credential("tok", "inline", SECRET)}, [b])


def test_long_names_truncated_in_messages() -> None:
    long_host = "a" * 300 + ".example.com"
    err = bad(body(bindings=[binding(hosts=[long_host])]), "bindings[0].match.hosts[0]")
    assert len(str(err)) < 300
    err = bad(
        body(bindings=[binding(auth={"type": "bearer", "credential": "n" * 500})]),
        "bindings[0].auth.credential",
    )
    assert "..." in str(err) and len(str(err)) < 300


# ---------------------------------------------------------------------------------------------
# Mutations


def test_parse_mutation() -> None:
    m = parse_mutation(
        {
            "expectedRevision": 3,
            "credentials": {"add": [cred("new")], "replace": [cred("tok", "v2")], "delete": ["old"]},
            "bindings": {"delete": ["b1"], "add": [binding("b2")], "replace": None},
        }
    )
    assert m.expected_revision == 3
    assert [c.name for c in m.credentials.add] == ["new"]
    assert [c.name for c in m.credentials.replace] == ["tok"]
    assert m.credentials.delete == ("old",)
    assert m.bindings.delete == ("b1",)
    assert [b.name for b in m.bindings.add] == ["b2"]
    assert m.bindings.replace == ()
    empty = parse_mutation({})
    assert empty.expected_revision is None and empty.credentials.add == () and empty.bindings.delete == ()


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"credentials": {"add": [cred("a")], "delete": ["a"]}}, "credentials.add[0]"),
        ({"credentials": {"replace": [cred("a")], "delete": ["a"]}}, "credentials.replace[0]"),
        ({"credentials": {"add": [cred("a")], "replace": [cred("a")]}}, "credentials.add[0]"),
        ({"credentials": {"add": [cred("a"), cred("a")]}}, "credentials.add[1]"),
        ({"credentials": {"delete": ["a", "a"]}}, "credentials.delete[1]"),
        ({"bindings": {"add": [binding("x")], "delete": ["x"]}}, "bindings.add[0]"),
        ({"bindings": {"replace": [binding("x"), binding("x")]}}, "bindings.replace[1]"),
        ({"credentials": {"delete": [" "]}}, "credentials.delete[0]"),
        ({"bindings": {"delete": [""]}}, "bindings.delete[0]"),
        ({"credentials": {"delete": [1]}}, "credentials.delete[0]"),
        ({"credentials": {"add": [{"name": "", "source": {"value": SECRET}}]}}, "credentials.add[0].name"),
        ({"credentials": {"add": [cred("a", "")]}}, "credentials.add[0].source.value"),
        ({"credentials": {"upsert": []}}, "credentials"),
        ({"credentials": []}, "credentials"),
        ({"bindings": {"add": [binding("x", hosts=["*"])]}}, "bindings.add[0].match.hosts[0]"),
        ({"expectedRevision": "1"}, "expectedRevision"),
        ({"expectedRevision": 1.5}, "expectedRevision"),
        ({"expectedRevision": True}, "expectedRevision"),
    ],
)
def test_parse_mutation_invalid(obj: Any, field: str) -> None:
    bad(obj, field, parse=parse_mutation)


def test_parse_mutation_unknown_top_key_and_shape() -> None:
    objs: list[object] = [{"revision": 1}, [], None]
    for obj in objs:
        with pytest.raises(VaultError) as info:
            parse_mutation(obj)
        assert info.value.status == 400 and info.value.field is None


def test_same_name_across_kinds_is_fine() -> None:
    m = parse_mutation({"credentials": {"add": [cred("x")]}, "bindings": {"delete": ["x"]}})
    assert m.credentials.add[0].name == "x" and m.bindings.delete == ("x",)


def test_peek_expected_revision() -> None:
    assert peek_expected_revision({"expectedRevision": 4, "junk": 1}) == 4
    assert peek_expected_revision({"expectedRevision": "4"}) is None
    assert peek_expected_revision({"expectedRevision": True}) is None
    assert peek_expected_revision([]) is None


# ---------------------------------------------------------------------------------------------
# Ambiguity


@pytest.mark.parametrize(
    ("a", "b", "ambiguous"),
    [
        ((["api.x.com"], {"paths": ["/v1/*"]}), (["api.x.com"], {"paths": ["/v2/*"]}), False),
        ((["api.x.com"], {"paths": ["/v1/*"]}), (["api.x.com"], {"paths": ["/v1/foo"]}), True),
        ((["api.x.com"], {"paths": ["/v1/foo"]}), (["api.x.com"], {"paths": ["/v1/*"]}), True),
        ((["api.x.com"], {"paths": ["/v1/foo"]}), (["api.x.com"], {"paths": ["/v1/foo"]}), True),
        ((["api.x.com"], {"paths": ["/v1/foo"]}), (["api.x.com"], {"paths": ["/v1/bar"]}), False),
        ((["api.x.com"], {"paths": ["/v1*"]}), (["api.x.com"], {"paths": ["/v1/*"]}), True),
        ((["*.x.com"], {}), (["api.x.com"], {}), False),
        ((["*.x.com"], {}), (["*.a.x.com"], {}), True),
        ((["*.a.x.com"], {}), (["*.x.com"], {}), True),
        ((["*.x.com"], {}), (["*.x.com"], {}), True),
        ((["*.x.com"], {}), (["*.y.com"], {}), False),
        ((["*.ax.com"], {}), (["*.x.com"], {}), False),
        ((["api.x.com"], {"methods": ["GET"]}), (["api.x.com"], {"methods": ["POST"]}), False),
        ((["api.x.com"], {"methods": ["GET", "PUT"]}), (["api.x.com"], {"methods": ["put"]}), True),
        ((["api.x.com"], {"schemes": ["http"]}), (["api.x.com"], {}), False),
        ((["api.x.com"], {"schemes": ["http", "https"]}), (["api.x.com"], {}), True),
        ((["a.x.com", "b.x.com"], {}), (["c.x.com", "b.x.com"], {}), True),
        ((["a.x.com"], {}), (["b.x.com"], {}), False),
    ],
)
def test_ambiguity_vectors(
    a: tuple[list[str], dict[str, Any]], b: tuple[list[str], dict[str, Any]], ambiguous: bool
) -> None:
    ba = make_binding("first", a[0], **a[1])
    bb = make_binding("second", b[0], **b[1])
    if not ambiguous:
        check_ambiguity([ba, bb])
        return
    with pytest.raises(VaultError) as info:
        check_ambiguity([bb, ba])
    err = info.value
    assert err.status == 400
    assert "'first'" in str(err) and "'second'" in str(err)
    assert str(err).index("'first'") < str(err).index("'second'")


def test_ambiguity_single_binding_with_nested_hosts_ok() -> None:
    check_ambiguity([make_binding("one", ["*.x.com", "*.a.x.com", "api.x.com"])])


def test_ambiguity_many_bindings() -> None:
    many = [make_binding(f"b{i:03}", [f"h{i}.example.com", f"*.w{i}.example.com"]) for i in range(300)]
    check_ambiguity(many)
    with pytest.raises(VaultError, match="'b007' and 'zzz'"):
        check_ambiguity([*many, make_binding("zzz", ["*.x.w7.example.com"])])


# ---------------------------------------------------------------------------------------------
# Coverage


def test_coverage_explicit_allow_needed() -> None:
    b = make_binding("gh", ["api.example.com"])
    check_coverage([b], policy(("allow", "api.example.com")))
    check_coverage([b], policy(("allow", "*.example.com")))
    check_coverage([b], policy(("allow", "API.example.com.")))
    with pytest.raises(VaultError) as info:
        check_coverage([b], policy(("allow", "other.example.com")))
    assert info.value.field == "bindings['gh'].match.hosts[0]"
    assert "'api.example.com'" in str(info.value)


def test_coverage_default_allow_alone_never_covers() -> None:
    b = make_binding("gh", ["api.example.com"])
    with pytest.raises(VaultError):
        check_coverage([b], policy(default="allow"))
    with pytest.raises(VaultError):
        check_coverage([b], policy(("deny", "evil.com"), default="allow"))
    check_coverage([b], policy(("allow", "api.example.com"), default="allow"))


def test_coverage_first_match_deny_wins() -> None:
    b = make_binding("gh", ["api.example.com"])
    with pytest.raises(VaultError):
        check_coverage([b], policy(("deny", "api.example.com"), ("allow", "*.example.com")))
    with pytest.raises(VaultError):
        check_coverage([b], policy(("deny", "*.example.com"), ("allow", "api.example.com")))


def test_coverage_deny_always_first() -> None:
    user = policy(("allow", "api.example.com"))
    b = make_binding("gh", ["api.example.com"])
    check_coverage([b], user)
    target, kind, net = parse_target("api.example.com")
    deny_always = AlwaysRules(deny=(Rule(Verdict.DENY, target, kind, net),), allow=())
    with pytest.raises(VaultError):
        check_coverage([b], effective_policy(user, deny_always))
    # an allow.always rule is explicit too
    target, kind, net = parse_target("*.example.com")
    allow_always = AlwaysRules(deny=(), allow=(Rule(Verdict.ALLOW, target, kind, net),))
    check_coverage([b], effective_policy(policy(), allow_always))


def test_coverage_wildcard_probe() -> None:
    w = make_binding("w", ["*.example.com"])
    check_coverage([w], policy(("allow", "*.example.com")))
    check_coverage([w], policy(("allow", "*.com")))
    # the apex is not the wildcard
    with pytest.raises(VaultError):
        check_coverage([w], policy(("allow", "example.com")))
    # a rule naming the probe itself is not an explicit rule for the wildcard
    with pytest.raises(VaultError):
        check_coverage([w], policy(("allow", "probe.example.com")))
    # a narrower wildcard does not cover a wider one
    with pytest.raises(VaultError):
        check_coverage([w], policy(("allow", "*.a.example.com")))
    # a deny on the probe's name decides first
    with pytest.raises(VaultError):
        check_coverage([w], policy(("deny", "*.example.com"), ("allow", "*.example.com")))
    assert host_covered(policy(("allow", "*.example.com")), "*.a.example.com")


def test_coverage_no_policy() -> None:
    check_coverage([], None)
    with pytest.raises(VaultError) as info:
        check_coverage([make_binding("gh", ["api.example.com"])], None)
    assert info.value.status == 400 and "require an egress policy" in str(info.value)


def test_coverage_ip_rules_do_not_cover() -> None:
    with pytest.raises(VaultError):
        check_coverage([make_binding("gh", ["api.example.com"])], policy(("allow", "10.0.0.0/8")))


def test_ignore_hosts() -> None:
    b = make_binding("gh", ["api.example.com", "*.svc.example.com"])
    check_ignore_hosts([b], [])
    check_ignore_hosts([b], [re.compile(r"^other\.com")])
    with pytest.raises(VaultError) as info:
        check_ignore_hosts([b], [re.compile(r"^api\.example\.com:443$")])
    assert info.value.field == "bindings['gh'].match.hosts[0]"
    with pytest.raises(VaultError) as info:
        check_ignore_hosts([b], [re.compile(r"\.svc\.example\.com$")])
    assert info.value.field == "bindings['gh'].match.hosts[1]"


def test_validate_candidate_order_and_ok() -> None:
    creds = {"tok": Credential("tok", "inline", SECRET)}
    b1 = make_binding("a", ["api.example.com"])
    b2 = make_binding("b", ["api.example.com"])
    pol = policy(("allow", "api.example.com"))
    validate_candidate(creds, [b1], pol)
    with pytest.raises(VaultError, match="ambiguous"):
        validate_candidate(creds, [b1, b2], None)  # ambiguity reported before coverage
    with pytest.raises(VaultError, match="does not exist"):
        validate_candidate({}, [b1, b2], pol)


# ---------------------------------------------------------------------------------------------
# Secrecy


def test_reprs_never_show_values() -> None:
    content = parse_create(
        body(
            bindings=[
                binding(
                    auth={
                        "type": "bearer",
                        "credential": "tok",
                        "substitutions": [
                            {"credential": "tok", "placeholder": "PH-" + SECRET, "in": ["body"]}
                        ],
                    }
                )
            ]
        )
    )
    for text in (repr(content), str(content), repr(content.credentials[0]), str(content.credentials[0])):
        assert SECRET not in text
    assert "<redacted>" in repr(content.credentials[0])


def _plant(obj: Any, path: list[Any], value: Any) -> Any:
    out = copy.deepcopy(obj)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    "path",
    [
        ["bindings", 0, "match", "hosts", 0],
        ["bindings", 0, "match", "schemes"],
        ["bindings", 0, "auth", "type"],
        ["bindings", 0, "auth", "credential"],
        ["bindings", 0, "name"],
        ["credentials", 0, "source", "type"],
        ["credentials", 0, "source", "extra"],
        ["credentials", 0, "name"],
    ],
)
def test_secret_never_echoed_on_failure(path: list[Any]) -> None:
    """The secret value sits in credentials[0]; breaking anything around it never echoes it."""
    valid = body()
    for junk in (12345, ["x"], {"k": 1}):
        with pytest.raises(VaultError) as info:
            parse_create(_plant(valid, path, junk))
        assert SECRET not in str(info.value)
        assert SECRET not in repr(info.value)
        assert SECRET not in repr(info.value.args)


@pytest.mark.parametrize("value", [SECRET, SECRET * 10, "x" + SECRET, SECRET + "\r\n"])
def test_value_itself_never_echoed(value: str) -> None:
    """Problems found with the value (header-unsafe), next to it, or with a secret pasted into
    ``source.type`` never quote it."""
    for obj in (
        body(
            credentials=[cred("tok", value)],
            bindings=[binding(auth={"type": "bearer", "credential": "nope"})],
        ),
        body(credentials=[cred("tok", value), cred("tok", value)]),
        body(credentials=[{"name": "tok", "source": {"type": value, "value": "v"}}], bindings=[]),
    ):
        with pytest.raises(VaultError) as info:
            parse_create(obj)
        assert value not in str(info.value)
        assert value not in repr(info.value)


def test_expected_revision_null_is_refused_not_ignored() -> None:
    # Found by schemathesis against the reference OpenAPI: the type is integer, not nullable.
    import pytest as _pytest

    from egressd.vault.parse import parse_mutation
    from egressd.vault.types import VaultError

    with _pytest.raises(VaultError, match="expectedRevision"):
        parse_mutation({"expectedRevision": None})
    assert parse_mutation({}).expected_revision is None


# ---------------------------------------------------------------------------------------------
# 14.7: the O(n log n) ambiguity check against the old quadratic one (kept here as the oracle)


def _old_ancestors(suffix: str) -> list[str]:
    parts = suffix.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def _old_path_pair(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, str] | None:
    for pa in a:
        for pb in b:
            if pa == pb:
                return pa, pb
            if pa.endswith("*") and pb.startswith(pa[:-1]):
                return pa, pb
            if pb.endswith("*") and pa.startswith(pb[:-1]):
                return pa, pb
    return None


def _old_host_owners(bindings: list[Binding]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(exact host -> binding indices, wildcard suffix -> binding indices)."""
    exact: dict[str, list[int]] = {}
    wild: dict[str, list[int]] = {}
    for i, b in enumerate(bindings):
        for host in b.match.hosts:
            if host.startswith("*."):
                wild.setdefault(host[2:], []).append(i)
            else:
                exact.setdefault(host, []).append(i)
    return exact, wild


def _old_host_pairs(bindings: list[Binding]) -> dict[tuple[int, int], tuple[str, str]]:
    """egressd/vault/model.py before 14.7, verbatim apart from names and the index of hosts
    (:func:`_old_host_owners`): every pair sharing a host."""
    exact, wild = _old_host_owners(bindings)
    pairs: dict[tuple[int, int], tuple[str, str]] = {}

    def add(i: int, j: int, hi: str, hj: str) -> None:
        if i == j:
            return
        key, witness = ((i, j), (hi, hj)) if i < j else ((j, i), (hj, hi))
        pairs.setdefault(key, witness)

    for host, owners in exact.items():
        for x, i in enumerate(owners):
            for j in owners[x + 1 :]:
                add(i, j, host, host)
    for suffix, owners in wild.items():
        for ancestor in _old_ancestors(suffix):
            for i in owners:
                for j in wild.get(ancestor, []):
                    add(i, j, f"*.{suffix}", f"*.{ancestor}")
    return pairs


def old_conflicts(bindings: list[Binding]) -> list[tuple[str, str]]:
    """Every ambiguous pair (names, sorted) by the old rule, in the order the old check met them."""
    ordered = sorted(bindings, key=lambda b: b.name)
    out: list[tuple[str, str]] = []
    for i, j in sorted(_old_host_pairs(ordered)):
        a, b = ordered[i], ordered[j]
        if not [s for s in a.match.schemes if s in b.match.schemes]:
            continue
        if not [m for m in a.match.methods if m in b.match.methods]:
            continue
        if _old_path_pair(a.match.paths, b.match.paths) is None:
            continue
        out.append((a.name, b.name))
    return out


def old_check_ambiguity(bindings: list[Binding]) -> None:
    """``check_ambiguity`` before 14.7, verbatim: the oracle (and what the benchmark times)."""
    ordered = sorted(bindings, key=lambda b: b.name)
    for (i, j), (host_a, host_b) in sorted(_old_host_pairs(ordered).items()):
        a, b = ordered[i], ordered[j]
        schemes = [s for s in a.match.schemes if s in b.match.schemes]
        if not schemes:
            continue
        methods = [m for m in a.match.methods if m in b.match.methods]
        if not methods:
            continue
        paths = _old_path_pair(a.match.paths, b.match.paths)
        if paths is None:
            continue
        hosts = echo(host_a) if host_a == host_b else f"{echo(host_a)} / {echo(host_b)}"
        raise VaultError(
            f"{echo(a.name)} and {echo(b.name)} are ambiguous: both match host {hosts}, "
            f"scheme {echo(schemes[0])}, method {echo(methods[0])} and path {echo(paths[0])} / {echo(paths[1])}",
            "bindings",
        )


_NAMED = re.compile(r"^bindings: '([^']*)' and '([^']*)' are ambiguous")


def _random_binding(rng: Any, name: str, pools: dict[str, list[str]]) -> Binding:
    def pick(pool: list[str], most: int) -> tuple[str, ...]:
        return tuple(dict.fromkeys(rng.choice(pool) for _ in range(rng.randint(1, most))))

    return Binding(
        name,
        Match(
            hosts=pick(pools["hosts"], 3),
            schemes=pick(["https", "http"], 2),
            methods=pick(pools["methods"], 3),
            paths=pick(pools["paths"], 3),
        ),
        Auth(AuthType.PASSTHROUGH),
    )


_POOLS: dict[str, dict[str, list[str]]] = {
    # Small pools: most vaults collide, on every kind of overlap.
    "dense": {
        "hosts": [
            "a.x.com",
            "b.x.com",
            "x.com",
            "*.x.com",
            "*.a.x.com",
            "*.b.a.x.com",
            "*.y.com",
            "*.ax.com",
        ],
        "methods": ["GET", "POST", "PUT"],
        "paths": [
            "/*",
            "/v1/*",
            "/v1/foo",
            "/v1",
            "/v1*",
            "/v2/*",
            "/v2/x",
            "/a*",
            "/ab",
            "/ab*",
            "/v1/foo*",
        ],
    },
    # Large pools: most vaults are accepted, so the "no collision" answer is exercised too.
    "sparse": {
        "hosts": [f"h{i}.x.com" for i in range(12)] + [f"*.w{i}.x.com" for i in range(6)] + ["*.a.w1.x.com"],
        "methods": ["GET", "POST", "PUT", "PATCH", "DELETE", "X"],
        "paths": [f"/p{i}" for i in range(20)] + [f"/p{i}*" for i in range(3)] + ["/q/*", "/q/r"],
    },
}


@pytest.mark.parametrize("pool", sorted(_POOLS))
def test_ambiguity_matches_the_quadratic_oracle_on_random_vaults(pool: str) -> None:
    import random

    rng = random.Random(f"14.7-{pool}")
    verdicts = {True: 0, False: 0}
    for _ in range(1500):  # bounded; ~0.3 s
        n = rng.randint(2, 14)
        vault = [_random_binding(rng, f"b{k:02}", _POOLS[pool]) for k in range(n)]
        rng.shuffle(vault)
        expected = old_conflicts(vault)
        try:
            old_check_ambiguity(vault)
        except VaultError as exc:
            old_message: str | None = str(exc)
        else:
            old_message = None
        try:
            check_ambiguity(vault)
        except VaultError as exc:
            # The same pair (the first in name order), with the same witnesses.
            assert str(exc) == old_message
            named = _NAMED.match(str(exc))
            assert named is not None and (named[1], named[2]) == expected[0]
            verdicts[True] += 1
        else:
            assert old_message is None and expected == [], expected
            verdicts[False] += 1
    # Both answers were exercised in earnest.
    assert min(verdicts.values()) >= 150, verdicts


def test_ambiguity_is_not_quadratic_on_one_host() -> None:
    """The shape of the 14.7 report: one host, distinct paths. The old check built every pair
    (2000 bindings: ~5 s); the new one sweeps sorted paths once."""
    import time

    many = [make_binding(f"b{i:05}", ["api.x.com"], paths=[f"/r{i}/*"]) for i in range(4000)]
    started = time.perf_counter()
    check_ambiguity(many)
    assert time.perf_counter() - started < 1.0
    with pytest.raises(VaultError, match="'b01234' and 'zzz'"):
        check_ambiguity([*many, make_binding("zzz", ["api.x.com"], paths=["/r1234/x"])])


def test_ambiguity_is_not_quadratic_on_disjoint_methods() -> None:
    """Same host and path, every binding its own method: no pair may be compared one by one."""
    import time

    many = [make_binding(f"b{i:05}", ["api.x.com"], methods=[f"M{i}"]) for i in range(4000)]
    started = time.perf_counter()
    check_ambiguity(many)
    assert time.perf_counter() - started < 1.0


def test_ambiguity_at_the_caps_has_no_cartesian_cost() -> None:
    """The worst body at the caps for a per-(host, method, path) index: 256 bindings, 64 of 65
    shared hosts each (no two hosts with the same bindings), 64 distinct paths each."""
    import time

    hosts = [f"h{k}.example.com" for k in range(65)]
    many = [
        make_binding(
            f"b{i:03}",
            [h for k, h in enumerate(hosts) if k != i % 65],
            paths=[f"/b{i}/{k}" for k in range(64)],
        )
        for i in range(256)
    ]
    started = time.perf_counter()
    check_ambiguity(many)
    assert time.perf_counter() - started < 0.5


# ---------------------------------------------------------------------------------------------
# 14.7: size limits


def _limit_error(obj: object, **kw: Any) -> str:
    with pytest.raises(VaultError) as info:
        parse_create(obj, **kw)
    assert info.value.status == 400
    text = str(info.value)
    assert "\n" not in text and SECRET not in text
    return text


def test_size_limits_at_and_over_the_caps() -> None:
    creds = [cred("tok"), *(cred(f"c{i}") for i in range(255))]
    parse_create(body(creds, [binding(f"b{i}", [f"h{i}.example.com"]) for i in range(256)]))
    text = _limit_error(body([*creds, cred("one-more")]))
    assert "257 credentials exceed the limit of 256" in text and "EGRESSD_VAULT_MAX_CREDENTIALS" in text
    text = _limit_error(body(None, [binding(f"b{i}", [f"h{i}.example.com"]) for i in range(257)]))
    assert "EGRESSD_VAULT_MAX_BINDINGS" in text and "256" in text


def test_size_limits_per_binding() -> None:
    hosts = [f"h{i}.example.com" for i in range(64)]
    paths = [f"/p{i}" for i in range(64)]
    parse_create(body(None, [binding("b", hosts, paths=paths)]))
    text = _limit_error(body(None, [binding("b", [*hosts, "one.example.com"])]))
    assert text.startswith("bindings[0].match.hosts:") and "limit of 64 (hosts per binding)" in text
    # Counted before duplicates are removed: the work is bounded by what was sent.
    text = _limit_error(body(None, [binding("b", ["h.example.com"] * 65)]))
    assert "65 hosts" in text
    text = _limit_error(body(None, [binding("b", hosts, paths=[*paths, "/x"])]))
    assert "limit of 64 (paths per binding)" in text


def test_size_limits_are_configurable_and_apply_to_mutations() -> None:
    from egressd.vault.types import VaultLimits
    from egressd.vault.validate import check_size

    small = VaultLimits(credentials=2, bindings=1)
    text = _limit_error(body([cred("a"), cred("b"), cred("c")]), limits=small)
    assert "3 credentials exceed the limit of 2" in text
    with pytest.raises(VaultError, match="EGRESSD_VAULT_MAX_BINDINGS"):
        parse_mutation({"bindings": {"add": [binding("x"), binding("y")]}}, small)
    with pytest.raises(VaultError, match="EGRESSD_VAULT_MAX_CREDENTIALS"):
        parse_mutation({"credentials": {"replace": [cred("a"), cred("b"), cred("c")]}}, small)
    with pytest.raises(VaultError, match=r"^bindings: 2 bindings exceed the limit of 1"):
        check_size(1, [make_binding("x", ["a.x.com"]), make_binding("y", ["b.x.com"])], small)


def test_indexed_coverage_matches_the_rule_walk() -> None:
    """check_coverage indexes the policy (14.7); host_covered, the walk over the rules, is the
    oracle: same answer for every host on random policies."""
    import random

    from egressd.vault.coverage import _DomainIndex

    rng = random.Random("14.7-coverage")
    targets = ["x.com", "a.x.com", "b.a.x.com", "*.x.com", "*.a.x.com", "*.b.a.x.com", "y.com", "*.y.com"]
    hosts = ["x.com", "a.x.com", "b.a.x.com", "c.b.a.x.com", "*.x.com", "*.a.x.com", "*.b.a.x.com", "y.com"]
    hosts += ["*.y.com", "z.y.com", "q.com"]
    for _ in range(400):
        rules = [(rng.choice(["allow", "deny"]), rng.choice(targets)) for _ in range(rng.randint(0, 6))]
        pol = policy(*rules, default=rng.choice(["allow", "deny"]))
        index = _DomainIndex(pol)
        for host in hosts:
            assert index.covers(host) == host_covered(pol, host), (rules, host)


def test_coverage_is_not_rules_times_hosts() -> None:
    import time

    pol = policy(*(("allow", f"h{i}.example.com") for i in range(4096)))
    many = [make_binding(f"b{i:03}", [f"h{16 * i + k}.example.com" for k in range(16)]) for i in range(256)]
    started = time.perf_counter()
    check_coverage(many, pol)
    assert time.perf_counter() - started < 1.0


# ---------------------------------------------------------------------------------------------
# docs/reference/behaviour.md §20.3: names an operator sees are printable


@pytest.mark.parametrize(
    "name",
    [
        "tok\x1b]0;owned\x07\x1b[2J",  # OSC window title, then clear screen
        "tok\x9b2J",  # C1 CSI
        "tok\x7f",  # DEL
        "to\nk",  # a line break inside
        "tok\n",  # ... or at an end (never trimmed away: refused)
        "\ttok",
        "tok\x85",  # NEL, a C1 control Python counts as whitespace
        "tok\xa0",  # no-break space: not a printable character (only U+0020 is)
        "\u3000tok",  # ideographic space
        "abc\u202edcba",  # bidi override
        "zero\u200bwidth",  # zero-width space
        "tok\x00",
    ],
)
def test_item_names_must_be_printable(name: str) -> None:
    err = bad(body(credentials=[cred(name)], bindings=[]), "credentials[0].name")
    assert "printable" in err.reason
    assert name not in str(err)  # never echoed raw
    err = bad(body(credentials=[cred()], bindings=[binding(name)]), "bindings[0].name")
    assert "printable" in err.reason
    bad({"credentials": {"delete": [name]}}, "credentials.delete[0]", parse=parse_mutation)


def test_printable_names_are_kept_exactly_as_sent() -> None:
    vault = parse_create(body(credentials=[cred("GitHub token · prod")], bindings=[]))
    assert vault.credentials[0].name == "GitHub token · prod"
    assert parse_create(body(credentials=[cred("名前")], bindings=[])).credentials[0].name == "名前"


@pytest.mark.parametrize("name", [" tok", "tok ", "  tok  ", " ", "tok\u00a0 "])
def test_names_with_spaces_at_the_ends_are_400_never_trimmed(name: str) -> None:
    """docs/reference/behaviour.md §20.3 wins over §6's trimming: a name with spaces at its ends is refused
    (400 naming the field), wherever a name is read: credential and binding names, every
    reference to a credential, a mutation's delete list."""
    where = "credentials[0].name"
    bad(body(credentials=[cred(name)], bindings=[]), where)
    bad(body(credentials=[cred()], bindings=[binding(name)]), "bindings[0].name")
    bad(
        body(credentials=[cred()], bindings=[binding(auth={"type": "bearer", "credential": name})]),
        "bindings[0].auth.credential",
    )
    headers = {"type": "customHeaders", "headers": [{"name": "X-Key", "credential": name}]}
    bad(body(credentials=[cred()], bindings=[binding(auth=headers)]), "bindings[0].auth.headers[0].credential")
    for kind in ("credentials", "bindings"):
        bad({kind: {"delete": [name]}}, f"{kind}.delete[0]", parse=parse_mutation)
        item = cred(name) if kind == "credentials" else binding(name)
        bad({kind: {"add": [item]}}, f"{kind}.add[0].name", parse=parse_mutation)


def test_the_space_refusal_names_the_rule() -> None:
    err = bad(body(credentials=[cred(" tok")], bindings=[]), "credentials[0].name")
    assert err.reason == "must not start or end with a space"
    assert bad(body(credentials=[cred("   ")], bindings=[]), "credentials[0].name").reason == "must not be blank"


def test_request_rules_and_coverage() -> None:
    """§19: an allow rule with methods/paths is an explicit allow of its name; a deny rule with
    methods/paths denies requests, not the name, so it leaves the name covered."""
    b = make_binding("gh", ["api.example.com"])
    check_coverage(
        [b], parse_policy_obj({"defaultAction": "deny", "egress": [
            {"action": "allow", "target": "api.example.com", "methods": ["GET"], "paths": ["/v1/*"]}]}),
    )  # fmt: skip
    pol = parse_policy_obj({"defaultAction": "deny", "egress": [
        {"action": "deny", "target": "api.example.com", "methods": ["DELETE"]},
        {"action": "allow", "target": "api.example.com"}]})  # fmt: skip
    check_coverage([b], pol)
    assert host_covered(pol, "api.example.com")
