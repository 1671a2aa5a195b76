"""Parsing the credential vault documents (docs/reference/behaviour.md §6, OSEP-0012): decoded JSON in,
the frozen values of :mod:`egressd.vault.types` out, or a :class:`VaultError` naming the field.

Wire shapes (see ``egress-api.yaml``)::

    create/replace  {"credentials": [{"name", "source": {"type": "inline", "value"}}],
                     "bindings": [{"name", "match": {...}, "auth": {...}}]}
    match           {"hosts", "schemes"?, "methods"?, "paths"?, "ports"? (deprecated)}
    auth            {"type", "credential"?, "name"?, "headers"?, "substitutions"?}
    substitution    {"credential", "placeholder", "in": ["path"|"query"|"header"|"body", ...]}
    mutation        {"expectedRevision"?, "credentials"?: {"add"?, "replace"?, "delete"?},
                     "bindings"?: {"add"?, "replace"?, "delete"?}}
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Final

from egressd.policy.idn import IdnaError, to_alabels
from egressd.policy.model import json_type
from egressd.vault.types import (
    DEFAULT_LIMITS,
    DEFAULT_METHODS,
    DEFAULT_PATHS,
    DEFAULT_SCHEMES,
    RESERVED_HEADERS,
    SCHEME_PORTS,
    Auth,
    AuthType,
    Binding,
    BindingMutations,
    Credential,
    CredentialMutations,
    HeaderRef,
    Match,
    Mutation,
    Substitution,
    VaultContent,
    VaultError,
    VaultLimits,
    _binding_label,
    _over_limit,
    echo,
)

__all__ = [
    "SOURCE_INLINE",
    "SUBSTITUTION_TARGETS",
    "canonical_header_name",
    "check_references",
    "parse_auth",
    "parse_binding",
    "parse_create",
    "parse_credential",
    "parse_host",
    "parse_match",
    "parse_mutation",
    "peek_expected_revision",
]

MAX_FQDN_LEN: Final = 253
SOURCE_INLINE: Final = "inline"
ALLOWED_PORTS: Final = frozenset(SCHEME_PORTS.values())
SUBSTITUTION_TARGETS: Final = frozenset({"path", "query", "header", "body"})

_TOKEN_RE: Final = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")
_LABEL_RE: Final = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
#: Characters a value placed in a header (or a header substitution) must not contain.
_HEADER_UNSAFE: Final = frozenset("\r\n\x00")


# --------------------------------------------------------------------------------------------
# JSON helpers


def _object(obj: object, where: str, allowed: Collection[str]) -> Mapping[str, object]:
    if not isinstance(obj, dict):
        raise VaultError(f"must be an object, got {json_type(obj)}", where or None)
    for key in obj:
        if key not in allowed:
            raise VaultError(f"unknown field {echo(key)}", where or None)
    return obj


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _required(d: Mapping[str, object], where: str, key: str) -> object:
    value = d.get(key)
    if value is None:
        raise VaultError("is required", _join(where, key))
    return value


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise VaultError(f"must be a string, got {json_type(value)}", where)
    return value


def _name(value: object, where: str) -> str:
    """A non-blank name (credential, binding, reference) of printable characters only, without
    spaces at its ends (docs/reference/behaviour.md §20.3, which wins over §6's trimming): names are shown
    to operators (egressctl, logs), and a control or format character in one could rewrite
    their terminal; a name is kept exactly as sent, never silently changed (``" tok "`` is
    refused, not stored as ``tok``)."""
    if value is None:
        raise VaultError("is required", where)
    text = _string(value, where)
    if not text.strip():
        raise VaultError("must not be blank", where)
    if not text.isprintable():
        raise VaultError("must be printable characters only (no control or format characters)", where)
    if text != text.strip():
        raise VaultError("must not start or end with a space", where)
    return text


def _array(value: object, where: str) -> list[object]:
    if not isinstance(value, list):
        raise VaultError(f"must be an array, got {json_type(value)}", where)
    return value


def _dedupe(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# --------------------------------------------------------------------------------------------
# Credentials

_CREDENTIAL_KEYS: Final = frozenset({"name", "source"})
_SOURCE_KEYS: Final = frozenset({"type", "value"})


def parse_credential(obj: object, where: str) -> Credential:
    """One ``{"name", "source": {"type"?, "value"}}``; ``where`` prefixes field names."""
    d = _object(obj, where, _CREDENTIAL_KEYS)
    name = _name(d.get("name"), _join(where, "name"))
    src_where = _join(where, "source")
    source = _object(_required(d, where, "source"), src_where, _SOURCE_KEYS)
    raw_type = source.get("type")
    source_type = SOURCE_INLINE
    if raw_type is not None:
        text = _string(raw_type, f"{src_where}.type").strip().lower()
        if text and text != SOURCE_INLINE:
            raise VaultError("unsupported source type (only 'inline' is supported)", f"{src_where}.type")
    value = source.get("value")
    value_where = f"{src_where}.value"
    if value is None:
        raise VaultError("is required", value_where)
    if not isinstance(value, str):
        raise VaultError(f"must be a string, got {json_type(value)}", value_where)
    if not value:
        raise VaultError("must not be empty", value_where)
    if not value.strip():
        raise VaultError("must not be blank", value_where)
    return Credential(name, source_type, value)


# --------------------------------------------------------------------------------------------
# Match

_MATCH_KEYS: Final = frozenset({"hosts", "schemes", "methods", "paths", "ports"})


def parse_host(text: str, where: str) -> str:
    """A binding host: A-labels, lower-cased, one trailing dot dropped; an FQDN or ``*.`` + FQDN.

    A Unicode host becomes its A-labels (IDNA 2008 / UTS-46, docs/reference/behaviour.md §14.3), the form the
    policy's domain targets, DNS queries and TLS SNI all use, so coverage, ambiguity and the
    MITM's match compare like with like; an invalid one is a 400.
    """
    raw = text
    host = text.strip()
    if not host:
        raise VaultError("must not be empty", where)
    try:
        host = to_alabels(host)
    except IdnaError as exc:
        raise VaultError(f"{exc} (got {echo(raw)})", where) from None
    host = host.lower()
    if host.endswith("."):
        host = host[:-1]
    _check_host_shape(host, raw, where)
    return host


def _check_host_shape(host: str, raw: str, where: str) -> None:
    """``host`` (normalised from ``raw``) is an FQDN, or ``*.`` and an FQDN; else a 400."""
    if "://" in host:
        raise VaultError(f"must be a host name, not a URL (got {echo(raw)})", where)
    if "/" in host:
        raise VaultError(f"must not contain '/' (got {echo(raw)})", where)
    wildcard = host.startswith("*.")
    base = host[2:] if wildcard else host
    if "*" in base:
        raise VaultError(f"'*' is only allowed as a leading '*.' (got {echo(raw)})", where)
    try:
        ipaddress.ip_address(base.removeprefix("[").removesuffix("]"))
    except ValueError:
        pass
    else:
        raise VaultError(f"must be a host name, not an IP address (got {echo(raw)})", where)
    if len(base) > MAX_FQDN_LEN:
        raise VaultError(f"host name longer than {MAX_FQDN_LEN} characters (got {echo(raw)})", where)
    labels = base.split(".")
    if len(labels) < 2:
        raise VaultError(f"must be a fully qualified name with at least one dot (got {echo(raw)})", where)
    for label in labels:
        if not _LABEL_RE.fullmatch(label):
            raise VaultError(f"invalid host name label {echo(label)} (got {echo(raw)})", where)


def _string_list(
    d: Mapping[str, object], where: str, key: str, limit: int | None = None
) -> list[tuple[str, str]] | None:
    """``[(field, text)]`` for an optional array of strings; None when absent, null or empty.
    More than ``limit`` items (counted before deduplication, so the work is bounded) -> 400."""
    value = d.get(key)
    if value is None:
        return None
    items = _array(value, _join(where, key))
    if limit is not None and len(items) > limit:
        raise _over_limit(key, len(items), limit, _join(where, key))
    out: list[tuple[str, str]] = []
    for i, item in enumerate(items):
        item_where = f"{_join(where, key)}[{i}]"
        out.append((item_where, _string(item, item_where)))
    return out or None


def _parse_ports(value: object, where: str) -> None:
    if value is None:
        return
    for i, port in enumerate(_array(value, where)):
        if isinstance(port, bool) or not isinstance(port, int):
            raise VaultError(f"must be an integer, got {json_type(port)}", f"{where}[{i}]")
        if port not in ALLOWED_PORTS:
            raise VaultError(
                f"port {port} is not supported: ports are deprecated and follow the scheme (https 443, http 80)",
                f"{where}[{i}]",
            )


def parse_match(obj: object, where: str, limits: VaultLimits = DEFAULT_LIMITS) -> Match:
    """``CredentialMatch``, normalised per §6; ``ports`` validated then dropped."""
    d = _object(obj, where, _MATCH_KEYS)
    hosts = _parse_hosts(d, where, limits)
    schemes = _parse_schemes(d, where)
    methods = _parse_methods(d, where)
    paths = _parse_paths(d, where, limits)
    _parse_ports(d.get("ports"), _join(where, "ports"))
    if limits.require_scoped_match:
        # Validated above: a present value is a list, and an empty one counts as absent.
        _check_scoped(bool(d.get("methods")), bool(d.get("paths")), paths, where)
    return Match(hosts=hosts, schemes=schemes, methods=methods, paths=paths)


def _parse_hosts(d: Mapping[str, object], where: str, limits: VaultLimits) -> tuple[str, ...]:
    hosts_where = _join(where, "hosts")
    raw_hosts = _string_list(d, where, "hosts", limits.hosts_per_binding)
    if raw_hosts is None:
        if d.get("hosts") is None:
            raise VaultError("is required", hosts_where)
        raise VaultError("must not be empty", hosts_where)
    return _dedupe(parse_host(text, w) for w, text in raw_hosts)


def _parse_schemes(d: Mapping[str, object], where: str) -> tuple[str, ...]:
    raw_schemes = _string_list(d, where, "schemes")
    if raw_schemes is None:
        return DEFAULT_SCHEMES
    parsed: list[str] = []
    for w, text in raw_schemes:
        scheme = text.strip().lower()
        if scheme not in SCHEME_PORTS:
            raise VaultError(f"must be 'https' or 'http', got {echo(text)}", w)
        parsed.append(scheme)
    return _dedupe(parsed)


def _parse_methods(d: Mapping[str, object], where: str) -> tuple[str, ...]:
    raw_methods = _string_list(d, where, "methods")
    if raw_methods is None:
        return DEFAULT_METHODS
    parsed: list[str] = []
    for w, text in raw_methods:
        method = text.strip()
        if not method:
            raise VaultError("must not be blank", w)
        if not method.isascii():
            raise VaultError(f"must be ASCII, got {echo(text)}", w)
        parsed.append(method.upper())
    return _dedupe(parsed)


def _parse_paths(d: Mapping[str, object], where: str, limits: VaultLimits) -> tuple[str, ...]:
    raw_paths = _string_list(d, where, "paths", limits.paths_per_binding)
    if raw_paths is None:
        return DEFAULT_PATHS
    parsed: list[str] = []
    for w, text in raw_paths:
        path = text.strip()
        if not path.startswith("/"):
            raise VaultError(f"must start with '/', got {echo(text)}", w)
        parsed.append(path)
    return _dedupe(parsed)


SCOPED_MATCH_ENV: Final = "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH"


def _check_scoped(has_methods: bool, has_paths: bool, paths: Sequence[str], where: str) -> None:
    """The reference's scoped-match guard: no implicit (all-methods, whole-host) binding."""
    if not has_methods:
        raise VaultError(f"must be explicit ({SCOPED_MATCH_ENV})", _join(where, "methods"))
    if not has_paths:
        raise VaultError(f"must be explicit ({SCOPED_MATCH_ENV})", _join(where, "paths"))
    if "/*" in paths:
        raise VaultError(f"must not contain /* ({SCOPED_MATCH_ENV})", _join(where, "paths"))


# --------------------------------------------------------------------------------------------
# Auth and substitutions

_AUTH_KEYS: Final[Mapping[AuthType, frozenset[str]]] = {
    AuthType.BEARER: frozenset({"type", "credential", "substitutions"}),
    AuthType.BASIC: frozenset({"type", "credential", "substitutions"}),
    AuthType.API_KEY: frozenset({"type", "name", "credential", "substitutions"}),
    AuthType.CUSTOM_HEADERS: frozenset({"type", "headers", "substitutions"}),
    AuthType.PASSTHROUGH: frozenset({"type", "substitutions"}),
}
_ALL_AUTH_KEYS: Final = frozenset().union(*_AUTH_KEYS.values())
_HEADER_ENTRY_KEYS: Final = frozenset({"name", "credential"})
_SUBSTITUTION_KEYS: Final = frozenset({"credential", "placeholder", "in"})


def canonical_header_name(name: str) -> str:
    """``x-api-key`` -> ``X-Api-Key``: upper-case the first letter of each ``-`` part."""
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def _header_name(value: object, where: str) -> str:
    if value is None:
        raise VaultError("is required", where)
    text = _string(value, where).strip()
    if not text:
        raise VaultError("must not be blank", where)
    if not _TOKEN_RE.fullmatch(text):
        raise VaultError(f"not a valid HTTP header name (got {echo(text)})", where)
    if text.lower() in RESERVED_HEADERS:
        raise VaultError(f"{echo(text)} is a reserved header and cannot carry a credential", where)
    return canonical_header_name(text)


def _parse_substitutions(value: object, where: str) -> tuple[Substitution, ...]:
    if value is None:
        return ()
    out: list[Substitution] = []
    seen: set[str] = set()
    for i, item in enumerate(_array(value, where)):
        item_where = f"{where}[{i}]"
        d = _object(item, item_where, _SUBSTITUTION_KEYS)
        credential = _name(d.get("credential"), f"{item_where}.credential")
        placeholder_where = f"{item_where}.placeholder"
        placeholder = d.get("placeholder")
        if placeholder is None:
            raise VaultError("is required", placeholder_where)
        if not isinstance(placeholder, str):
            raise VaultError(f"must be a string, got {json_type(placeholder)}", placeholder_where)
        if not placeholder.strip():
            raise VaultError("must not be blank", placeholder_where)
        if placeholder in seen:
            raise VaultError("duplicate placeholder within one binding", placeholder_where)
        seen.add(placeholder)
        in_where = f"{item_where}.in"
        targets = _array(_required(d, item_where, "in"), in_where)
        if not targets:
            raise VaultError("must not be empty", in_where)
        parsed: list[str] = []
        for j, target in enumerate(targets):
            text = _string(target, f"{in_where}[{j}]").strip().lower()
            if text not in SUBSTITUTION_TARGETS:
                raise VaultError(
                    f"must be one of 'path', 'query', 'header', 'body', got {echo(target)}",
                    f"{in_where}[{j}]",
                )
            parsed.append(text)
        out.append(Substitution(credential, placeholder, _dedupe(parsed)))
    return tuple(out)


def parse_auth(obj: object, where: str) -> tuple[Auth, tuple[Substitution, ...]]:
    """``CredentialAuth`` (plus ``passthrough``) and its optional ``substitutions``."""
    d = _object(obj, where, _ALL_AUTH_KEYS)
    type_where = _join(where, "type")
    raw_type = _string(_required(d, where, "type"), type_where).strip()
    try:
        auth_type = AuthType(raw_type)
    except ValueError:
        raise VaultError(
            f"unsupported auth type {echo(raw_type)} "
            "(expected bearer, basic, apiKey, customHeaders or passthrough)",
            type_where,
        ) from None
    for key in d:
        if key not in _AUTH_KEYS[auth_type]:
            raise VaultError(f"field {echo(key)} is not allowed for auth type {echo(auth_type.value)}", where)
    substitutions = _parse_substitutions(d.get("substitutions"), _join(where, "substitutions"))
    match auth_type:
        case AuthType.BEARER | AuthType.BASIC:
            credential = _name(d.get("credential"), _join(where, "credential"))
            return Auth(auth_type, credential=credential), substitutions
        case AuthType.API_KEY:
            name = _header_name(d.get("name"), _join(where, "name"))
            credential = _name(d.get("credential"), _join(where, "credential"))
            return Auth(auth_type, credential=credential, name=name), substitutions
        case AuthType.CUSTOM_HEADERS:
            headers_where = _join(where, "headers")
            entries = _array(_required(d, where, "headers"), headers_where)
            if not entries:
                raise VaultError("must contain at least one header", headers_where)
            headers: list[HeaderRef] = []
            seen: set[str] = set()
            for i, entry in enumerate(entries):
                entry_where = f"{headers_where}[{i}]"
                e = _object(entry, entry_where, _HEADER_ENTRY_KEYS)
                header = _header_name(e.get("name"), f"{entry_where}.name")
                if header.lower() in seen:
                    raise VaultError(f"duplicate header name {echo(header)}", f"{entry_where}.name")
                seen.add(header.lower())
                credential = _name(e.get("credential"), f"{entry_where}.credential")
                headers.append(HeaderRef(header, credential))
            return Auth(auth_type, headers=tuple(headers)), substitutions
        case AuthType.PASSTHROUGH:
            return Auth(auth_type), substitutions


# --------------------------------------------------------------------------------------------
# Bindings and documents

_BINDING_KEYS: Final = frozenset({"name", "match", "auth"})
_CREATE_KEYS: Final = frozenset({"credentials", "bindings"})
_MUTATION_KEYS: Final = frozenset({"expectedRevision", "credentials", "bindings"})
_OPS_KEYS: Final = frozenset({"add", "replace", "delete"})


def parse_binding(obj: object, where: str, limits: VaultLimits = DEFAULT_LIMITS) -> Binding:
    """One ``{"name", "match", "auth"}``; ``where`` prefixes field names."""
    d = _object(obj, where, _BINDING_KEYS)
    name = _name(d.get("name"), _join(where, "name"))
    match = parse_match(_required(d, where, "match"), _join(where, "match"), limits)
    auth, substitutions = parse_auth(_required(d, where, "auth"), _join(where, "auth"))
    return Binding(name, match, auth, substitutions)


def _unique_names(items: Sequence[Credential | Binding], where: str, kind: str) -> None:
    seen: set[str] = set()
    for i, item in enumerate(items):
        if item.name in seen:
            raise VaultError(f"duplicate {kind} name {echo(item.name)}", f"{where}[{i}].name")
        seen.add(item.name)


def parse_create(obj: object, limits: VaultLimits = DEFAULT_LIMITS) -> VaultContent:
    """A create/replace body, validated item by item, for unique names and for references.

    Sizes are checked first (14.7). Ambiguity and policy coverage are not checked here (see
    :func:`validate_candidate`).
    """
    d = _object(obj, "", _CREATE_KEYS)
    raw_credentials = _array(_required(d, "", "credentials"), "credentials")
    raw_bindings = _array(_required(d, "", "bindings"), "bindings")
    if len(raw_credentials) > limits.credentials:
        raise _over_limit("credentials", len(raw_credentials), limits.credentials, "credentials")
    if len(raw_bindings) > limits.bindings:
        raise _over_limit("bindings", len(raw_bindings), limits.bindings, "bindings")
    credentials = tuple(parse_credential(c, f"credentials[{i}]") for i, c in enumerate(raw_credentials))
    bindings = tuple(parse_binding(b, f"bindings[{i}]", limits) for i, b in enumerate(raw_bindings))
    _unique_names(credentials, "credentials", "credential")
    _unique_names(bindings, "bindings", "binding")
    _check_references(
        {c.name: c for c in credentials}, ((f"bindings[{i}]", b) for i, b in enumerate(bindings))
    )
    return VaultContent(credentials, bindings)


def _parse_ops[T](
    value: object, where: str, parse_item: Callable[[object, str], T], limit: int
) -> tuple[tuple[T, ...], tuple[T, ...], tuple[str, ...]]:
    if value is None:
        return (), (), ()
    d = _object(value, where, _OPS_KEYS)
    lists: dict[str, tuple[T, ...]] = {}
    for op in ("add", "replace"):
        raw = d.get(op)
        items = [] if raw is None else _array(raw, f"{where}.{op}")
        # The result holds every added item (added names are new) and replaces only existing
        # ones, so either list over the cap can never succeed: refused before parsing it.
        if len(items) > limit:
            raise _over_limit(where, len(items), limit, f"{where}.{op}")
        lists[op] = tuple(parse_item(item, f"{where}.{op}[{i}]") for i, item in enumerate(items))
    raw_delete = d.get("delete")
    delete_items = [] if raw_delete is None else _array(raw_delete, f"{where}.delete")
    delete = tuple(_name(item, f"{where}.delete[{i}]") for i, item in enumerate(delete_items))
    return lists["add"], lists["replace"], delete


def _check_ops_names(
    where: str, kind: str, add: Sequence[str], replace: Sequence[str], delete: Sequence[str]
) -> None:
    """A name may appear once across add/replace/delete of one kind."""
    first: dict[str, str] = {}
    for op, names in (("delete", delete), ("replace", replace), ("add", add)):
        for i, name in enumerate(names):
            here = f"{where}.{op}[{i}]"
            if name in first:
                raise VaultError(
                    f"{kind} {echo(name)} appears more than once in the mutation (also at {first[name]})",
                    here,
                )
            first[name] = here


def parse_mutation(obj: object, limits: VaultLimits = DEFAULT_LIMITS) -> Mutation:
    """A PATCH body; rejects blank names, a name used by more than one operation and add or
    replace lists longer than the vault may be (the sum is checked on the candidate)."""
    d = _object(obj, "", _MUTATION_KEYS)
    expected = d.get("expectedRevision")
    # Present means an integer: the OpenAPI type is not nullable (the SDK omits it instead).
    if "expectedRevision" in d and (isinstance(expected, bool) or not isinstance(expected, int)):
        raise VaultError(f"must be an integer, got {json_type(expected)}", "expectedRevision")
    assert expected is None or isinstance(expected, int)
    c_add, c_replace, c_delete = _parse_ops(
        d.get("credentials"), "credentials", parse_credential, limits.credentials
    )
    b_add, b_replace, b_delete = _parse_ops(
        d.get("bindings"), "bindings", lambda o, w: parse_binding(o, w, limits), limits.bindings
    )
    _check_ops_names(
        "credentials",
        "credential",
        [c.name for c in c_add],
        [c.name for c in c_replace],
        c_delete,
    )
    _check_ops_names(
        "bindings",
        "binding",
        [b.name for b in b_add],
        [b.name for b in b_replace],
        b_delete,
    )
    return Mutation(
        expected_revision=expected,
        credentials=CredentialMutations(c_add, c_replace, c_delete),
        bindings=BindingMutations(b_add, b_replace, b_delete),
    )


def peek_expected_revision(obj: object) -> int | None:
    """``expectedRevision`` if ``obj`` is an object carrying an integer one, else None.

    Lets the store answer 409 before validating the rest of a PATCH body.
    """
    if not isinstance(obj, dict):
        return None
    value = obj.get("expectedRevision")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


# --------------------------------------------------------------------------------------------
# References


def _check_references(credentials: Mapping[str, Credential], labelled: Iterable[tuple[str, Binding]]) -> None:
    for label, binding in labelled:
        for suffix, name, in_header in binding.referenced_credentials():
            where = f"{label}.{suffix}"
            credential = credentials.get(name)
            if credential is None:
                raise VaultError(f"references credential {echo(name)}, which does not exist", where)
            if in_header and any(c in _HEADER_UNSAFE for c in credential.value):
                raise VaultError(
                    f"credential {echo(name)} is placed in a header but its value contains CR, LF or NUL",
                    where,
                )


def check_references(credentials: Mapping[str, Credential], bindings: Iterable[Binding]) -> None:
    """Every credential a binding (auth or substitution) references exists; values placed in
    headers carry no CR, LF or NUL."""
    _check_references(credentials, ((_binding_label(b), b) for b in bindings))
