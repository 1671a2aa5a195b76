"""The credential vault documents (BEHAVIOUR.md §6, OSEP-0012): parsing, validation, checks.

Everything here is pure: decoded JSON in, frozen dataclasses out. Every rejection is a
:class:`VaultError` carrying the HTTP status (400 unless stated) and a one-line message that
names the offending field (``bindings[1].match.hosts[0]: ...``).

Secrecy rules, enforced throughout:

* a credential *value* never appears in an error message, in ``repr()``/``str()`` of any
  object defined here, or in the sanitized state;
* names (credential, binding, header), hosts, schemes, methods and paths may be echoed,
  ``repr()``'d and truncated to :data:`MAX_ECHO` characters;
* substitution placeholders are treated like values (they are part of the redaction set)
  and are never echoed either.

Wire shapes (see ``egress-api.yaml``)::

    create/replace  {"credentials": [{"name", "source": {"type": "inline", "value"}}],
                     "bindings": [{"name", "match": {...}, "auth": {...}}]}
    match           {"hosts", "schemes"?, "methods"?, "paths"?, "ports"? (deprecated)}
    auth            {"type", "credential"?, "name"?, "headers"?, "substitutions"?}
    substitution    {"credential", "placeholder", "in": ["path"|"query"|"header"|"body", ...]}
    mutation        {"expectedRevision"?, "credentials"?: {"add"?, "replace"?, "delete"?},
                     "bindings"?: {"add"?, "replace"?, "delete"?}}

Substitutions are accepted inside ``auth`` (on every auth type) and stored on
:class:`Binding`; they never appear in the sanitized state (``CredentialAuthMetadata`` is
``{"type", "name"?}``).
"""

from __future__ import annotations

import enum
import ipaddress
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from egressd.policy.evaluate import domain_matches, evaluate_domain
from egressd.policy.idn import IdnaError, to_alabels
from egressd.policy.model import NetworkPolicy, TargetKind, Verdict, json_type

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_METHODS",
    "DEFAULT_PATHS",
    "DEFAULT_SCHEMES",
    "MAX_ECHO",
    "REDACTED",
    "RESERVED_HEADERS",
    "SCHEME_PORTS",
    "SOURCE_INLINE",
    "SUBSTITUTION_TARGETS",
    "Auth",
    "AuthType",
    "Binding",
    "BindingMutations",
    "Credential",
    "CredentialMutations",
    "HeaderRef",
    "Match",
    "Mutation",
    "Substitution",
    "VaultContent",
    "VaultError",
    "VaultLimits",
    "VaultStatus",
    "canonical_header_name",
    "check_ambiguity",
    "check_coverage",
    "check_ignore_hosts",
    "check_references",
    "check_size",
    "echo",
    "host_covered",
    "parse_auth",
    "parse_binding",
    "parse_create",
    "parse_credential",
    "parse_host",
    "parse_match",
    "parse_mutation",
    "peek_expected_revision",
    "validate_candidate",
]

MAX_ECHO: Final = 80
MAX_FQDN_LEN: Final = 253
REDACTED: Final = "<redacted>"

SOURCE_INLINE: Final = "inline"
DEFAULT_SCHEMES: Final[tuple[str, ...]] = ("https",)
DEFAULT_METHODS: Final[tuple[str, ...]] = ("GET", "POST", "PUT", "PATCH", "DELETE")
DEFAULT_PATHS: Final[tuple[str, ...]] = ("/*",)
SCHEME_PORTS: Final[Mapping[str, int]] = {"https": 443, "http": 80}
ALLOWED_PORTS: Final = frozenset(SCHEME_PORTS.values())
SUBSTITUTION_TARGETS: Final = frozenset({"path", "query", "header", "body"})

#: Lower-cased; never injected, never rewritten (§6).
RESERVED_HEADERS: Final = frozenset(
    {
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
    }
)

_TOKEN_RE: Final = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")
_LABEL_RE: Final = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
#: Characters a value placed in a header (or a header substitution) must not contain.
_HEADER_UNSAFE: Final = frozenset("\r\n\x00")

VaultStatus = Literal[400, 404, 409, 412]


@dataclass(frozen=True, slots=True)
class VaultLimits:
    """How big one vault may be (BEHAVIOUR 14.7). Every count is checked on the raw JSON array
    before its items are parsed, so an oversized body costs no more than reading its length.
    ``env`` names what the operator can change (the per-binding caps are fixed)."""

    credentials: int = 256  # EGRESSD_VAULT_MAX_CREDENTIALS
    bindings: int = 256  # EGRESSD_VAULT_MAX_BINDINGS
    hosts_per_binding: int = 64
    paths_per_binding: int = 64


DEFAULT_LIMITS: Final = VaultLimits()

_LIMIT_NAMES: Final[Mapping[str, str]] = {
    "credentials": "EGRESSD_VAULT_MAX_CREDENTIALS",
    "bindings": "EGRESSD_VAULT_MAX_BINDINGS",
    "hosts": "hosts per binding",
    "paths": "paths per binding",
}


def _over_limit(kind: str, count: int, limit: int, where: str) -> VaultError:
    """One line naming the limit; only counts, never an item (a value could be anywhere)."""
    return VaultError(f"{count} {kind} exceed the limit of {limit} ({_LIMIT_NAMES[kind]})", where)


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


class VaultError(ValueError):
    """A vault request is refused.

    ``status`` is the HTTP status (400 invalid, 404 absent, 409 conflict, 412 prerequisites);
    ``field`` names where the problem is (``"credentials[0].source.value"``) or is None;
    ``reason`` is the problem alone. ``str()`` is ``"<field>: <reason>"`` on one line and never
    contains a credential value.
    """

    def __init__(self, reason: str, field: str | None = None, status: VaultStatus = 400) -> None:
        self.reason = reason
        self.field = field
        self.status: VaultStatus = status
        super().__init__(f"{field}: {reason}" if field else reason)

    def without_values(self) -> str:
        """``str()`` with every quoted piece of user text (what :func:`echo` inserted) replaced
        by ``…``: for errors about a *sealed* vault, whose whole plaintext is secret (a host
        with userinfo, a mistyped key that is really a credential). Fields are schema paths."""
        reason = _QUOTED.sub("…", self.reason)
        return f"{self.field}: {reason}" if self.field else reason


def echo(value: object) -> str:
    """User text (never a value) quoted for a message: ``repr()``, at most MAX_ECHO characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= MAX_ECHO:
        return repr(text)
    return repr(text[:MAX_ECHO]) + "..."


# --------------------------------------------------------------------------------------------
# Model


class AuthType(enum.StrEnum):
    BEARER = "bearer"
    BASIC = "basic"
    API_KEY = "apiKey"
    CUSTOM_HEADERS = "customHeaders"
    PASSTHROUGH = "passthrough"


@dataclass(frozen=True, slots=True)
class Credential:
    """One stored secret. ``revision`` is 0 until the store assigns one."""

    name: str
    source_type: str
    value: str = field(repr=False)
    revision: int = 0

    def __repr__(self) -> str:
        return (
            f"Credential(name={self.name!r}, source_type={self.source_type!r}, "
            f"value={REDACTED}, revision={self.revision})"
        )

    __str__ = __repr__

    def same_content(self, other: Credential) -> bool:
        """Equal apart from the revision."""
        return (self.name, self.source_type, self.value) == (other.name, other.source_type, other.value)

    def metadata(self) -> dict[str, Any]:
        """``CredentialMetadata``: never the value."""
        return {"name": self.name, "sourceType": self.source_type, "revision": self.revision}


@dataclass(frozen=True, slots=True)
class Match:
    """Normalised request matcher: every tuple non-empty, deduplicated, in the caller's order."""

    hosts: tuple[str, ...]
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    methods: tuple[str, ...] = DEFAULT_METHODS
    paths: tuple[str, ...] = DEFAULT_PATHS

    def to_json(self) -> dict[str, Any]:
        """``CredentialMatch`` as normalised (``ports`` is never emitted)."""
        return {
            "schemes": list(self.schemes),
            "hosts": list(self.hosts),
            "methods": list(self.methods),
            "paths": list(self.paths),
        }


@dataclass(frozen=True, slots=True)
class HeaderRef:
    """One ``customHeaders`` entry: a canonical header name and the credential it carries."""

    name: str
    credential: str


@dataclass(frozen=True, slots=True)
class Auth:
    """``credential`` for bearer/basic/apiKey; ``name`` (canonical) for apiKey; ``headers``
    for customHeaders; passthrough has none of them."""

    type: AuthType
    credential: str | None = None
    name: str | None = None
    headers: tuple[HeaderRef, ...] = ()

    def credential_refs(self) -> Iterable[tuple[str, str]]:
        """``(field suffix, credential name)`` for every credential injected as a header."""
        if self.credential is not None:
            yield "auth.credential", self.credential
        for i, h in enumerate(self.headers):
            yield f"auth.headers[{i}].credential", h.credential

    def metadata(self) -> dict[str, Any]:
        """``CredentialAuthMetadata``: the type, plus the header name for apiKey only."""
        out: dict[str, Any] = {"type": self.type.value}
        if self.type is AuthType.API_KEY and self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True, slots=True)
class Substitution:
    """Replace ``placeholder`` by the credential's value in the listed request parts."""

    credential: str
    placeholder: str = field(repr=False)
    in_: tuple[str, ...]

    def __repr__(self) -> str:
        return f"Substitution(credential={self.credential!r}, placeholder={REDACTED}, in_={self.in_!r})"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class Binding:
    """Where and how credentials are injected. ``revision`` is the vault revision at which the
    binding was last written (0 until stored); the sanitized state reports the vault revision."""

    name: str
    match: Match
    auth: Auth
    substitutions: tuple[Substitution, ...] = ()
    revision: int = 0

    def same_content(self, other: Binding) -> bool:
        """Equal apart from the revision."""
        return (self.name, self.match, self.auth, self.substitutions) == (
            other.name,
            other.match,
            other.auth,
            other.substitutions,
        )

    def referenced_credentials(self) -> Iterable[tuple[str, str, bool]]:
        """``(field suffix, credential name, goes into a header)`` for every reference."""
        for where, name in self.auth.credential_refs():
            yield where, name, True
        for i, s in enumerate(self.substitutions):
            yield f"auth.substitutions[{i}].credential", s.credential, "header" in s.in_

    def metadata(self, vault_revision: int) -> dict[str, Any]:
        """``CredentialBindingMetadata``; ``revision`` is the vault revision (§6)."""
        return {
            "name": self.name,
            "revision": vault_revision,
            "match": self.match.to_json(),
            "auth": self.auth.metadata(),
        }


@dataclass(frozen=True, slots=True)
class VaultContent:
    """A validated create/replace body (credential revisions are 0)."""

    credentials: tuple[Credential, ...]
    bindings: tuple[Binding, ...]


@dataclass(frozen=True, slots=True)
class CredentialMutations:
    add: tuple[Credential, ...] = ()
    replace: tuple[Credential, ...] = ()
    delete: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BindingMutations:
    add: tuple[Binding, ...] = ()
    replace: tuple[Binding, ...] = ()
    delete: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Mutation:
    """A parsed PATCH body; existence checks happen when it is applied (store)."""

    expected_revision: int | None = None
    credentials: CredentialMutations = field(default_factory=CredentialMutations)
    bindings: BindingMutations = field(default_factory=BindingMutations)


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
    """A trimmed, non-blank name (credential, binding, reference)."""
    if value is None:
        raise VaultError("is required", where)
    text = _string(value, where).strip()
    if not text:
        raise VaultError("must not be blank", where)
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

    A Unicode host becomes its A-labels (IDNA 2008 / UTS-46, BEHAVIOUR 14.3), the form the
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
    return host


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
    hosts_where = _join(where, "hosts")
    raw_hosts = _string_list(d, where, "hosts", limits.hosts_per_binding)
    if raw_hosts is None:
        if d.get("hosts") is None:
            raise VaultError("is required", hosts_where)
        raise VaultError("must not be empty", hosts_where)
    hosts = _dedupe(parse_host(text, w) for w, text in raw_hosts)

    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    raw_schemes = _string_list(d, where, "schemes")
    if raw_schemes is not None:
        parsed: list[str] = []
        for w, text in raw_schemes:
            scheme = text.strip().lower()
            if scheme not in SCHEME_PORTS:
                raise VaultError(f"must be 'https' or 'http', got {echo(text)}", w)
            parsed.append(scheme)
        schemes = _dedupe(parsed)

    methods: tuple[str, ...] = DEFAULT_METHODS
    raw_methods = _string_list(d, where, "methods")
    if raw_methods is not None:
        parsed = []
        for w, text in raw_methods:
            method = text.strip()
            if not method:
                raise VaultError("must not be blank", w)
            if not method.isascii():
                raise VaultError(f"must be ASCII, got {echo(text)}", w)
            parsed.append(method.upper())
        methods = _dedupe(parsed)

    paths: tuple[str, ...] = DEFAULT_PATHS
    raw_paths = _string_list(d, where, "paths", limits.paths_per_binding)
    if raw_paths is not None:
        parsed = []
        for w, text in raw_paths:
            path = text.strip()
            if not path.startswith("/"):
                raise VaultError(f"must start with '/', got {echo(text)}", w)
            parsed.append(path)
        paths = _dedupe(parsed)

    _parse_ports(d.get("ports"), _join(where, "ports"))
    return Match(hosts=hosts, schemes=schemes, methods=methods, paths=paths)


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
# Whole-candidate checks


def _binding_label(binding: Binding) -> str:
    return f"bindings[{echo(binding.name)}]"


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


def _wildcard_suffix(host: str) -> str | None:
    return host[2:] if host.startswith("*.") else None


def _ancestors(suffix: str) -> Iterable[str]:
    """``a.b.x.com`` -> ``a.b.x.com``, ``b.x.com``, ``x.com``, ``com``."""
    parts = suffix.split(".")
    for i in range(len(parts)):
        yield ".".join(parts[i:])


def _path_pair(a: Sequence[str], b: Sequence[str]) -> tuple[str, str] | None:
    """The first overlapping pattern pair: equal, or ``p*`` whose prefix ``p`` starts the other.

    Only used for the one pair that is reported (at most 64 x 64 patterns, 14.7)."""
    for pa in a:
        for pb in b:
            if pa == pb:
                return pa, pb
            if pa.endswith("*") and pb.startswith(pa[:-1]):
                return pa, pb
            if pb.endswith("*") and pa.startswith(pb[:-1]):
                return pa, pb
    return None


#: A host key: ``("=", host)`` for an exact host, ``("*", suffix)`` for ``*.suffix``.
_HostKey = tuple[str, str]


def _host_groups(bindings: Sequence[Binding]) -> dict[_HostKey, dict[int, tuple[bool, str]]]:
    """Bindings indexed by the host keys they can collide on: ``{key: {index: (owner, host)}}``.

    An exact host is owned by every binding that lists it. ``*.s`` is owned by the bindings
    listing it, and every binding with a wildcard strictly below ``s`` joins the group of
    ``s`` as a non-owner (``owner`` False): a pair collides there when at least one of the two
    owns the key (two non-owners may be siblings, ``*.a.s`` / ``*.b.s``, which never overlap;
    if one is nested in the other, that one's own group catches them). ``host`` is the
    binding's host that put it there (for the message). Exact and wildcard hosts never meet.
    Cost: one entry per host plus one per label of each wildcard (a name has at most 127).
    """
    wild = {host[2:] for b in bindings for host in b.match.hosts if host.startswith("*.")}
    groups: dict[_HostKey, dict[int, tuple[bool, str]]] = {}
    for i, b in enumerate(bindings):
        for host in b.match.hosts:
            suffix = _wildcard_suffix(host)
            if suffix is None:
                groups.setdefault(("=", host), {})[i] = (True, host)
                continue
            groups.setdefault(("*", suffix), {})[i] = (True, host)  # owning beats joining
            for ancestor in list(_ancestors(suffix))[1:]:
                if ancestor in wild:
                    groups.setdefault(("*", ancestor), {}).setdefault(i, (False, host))
    return groups


def _other_binding(owners: Sequence[int], nxt: Sequence[int], lo: int, hi: int, me: int) -> int | None:
    """A position in ``[lo, hi)`` whose binding is not ``me``, in O(1): ``nxt[k]`` is the first
    position after ``k`` holding a different binding than ``k``."""
    if lo >= hi:
        return None
    k = lo if owners[lo] != me else nxt[lo]
    return k if k < hi else None


def _next_different(owners: Sequence[int]) -> list[int]:
    n = len(owners)
    nxt = [n] * n
    for k in range(n - 2, -1, -1):
        nxt[k] = k + 1 if owners[k + 1] != owners[k] else nxt[k + 1]
    return nxt


def _prefix_end(fulls: Sequence[str], lo: int, stem: str) -> int:
    """End of the run of ``fulls[lo:]`` starting with ``stem`` (sorted, so it is contiguous)."""
    hi = len(fulls)
    while lo < hi:
        mid = (lo + hi) // 2
        if fulls[mid].startswith(stem):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _path_collision(
    members: Sequence[int], owns: Mapping[int, bool], bindings: Sequence[Binding]
) -> tuple[int, int] | None:
    """Two different bindings among ``members`` (at least one owning the group) with an
    overlapping path pair, in O(m log m) for m paths in all.

    All paths are sorted once. A pattern's partners are one contiguous range of that order:
    the equal strings for a literal path, every string starting with ``p`` for ``p*`` (the
    reverse direction, a literal inside someone else's ``q*``, is found from ``q*``'s side).
    Whether a range holds another binding is O(1) with :func:`_next_different`; a non-owner
    looks only at the owners' entries (the same arrays built over owners only).
    """
    entries = sorted((p, i) for i in members for p in bindings[i].match.paths)
    fulls = [p for p, _ in entries]
    who = [i for _, i in entries]
    nxt = _next_different(who)
    owner_pos = [k for k, i in enumerate(who) if owns[i]]
    owner_who = [who[k] for k in owner_pos]
    owner_nxt = _next_different(owner_who)
    for path, me in entries:
        if path.endswith("*"):
            lo = bisect_left(fulls, path[:-1])
            hi = _prefix_end(fulls, lo, path[:-1])
        else:
            lo, hi = bisect_left(fulls, path), bisect_right(fulls, path)
        if owns[me]:
            other = _other_binding(who, nxt, lo, hi, me)
            if other is not None:
                return me, who[other]
        else:
            olo, ohi = bisect_left(owner_pos, lo), bisect_left(owner_pos, hi)
            other = _other_binding(owner_who, owner_nxt, olo, ohi, me)
            if other is not None:
                return me, owner_who[other]
    return None


def _find_ambiguous(bindings: Sequence[Binding]) -> tuple[int, int, str, str] | None:
    """``(i, j, host_i, host_j)`` for one colliding pair (``i < j``), or None.

    O(N log N) in the number N of (host key, scheme, method, path) entries, where the old
    check built every pair of bindings sharing a host (quadratic, BEHAVIOUR 14.7): bindings
    meet only inside a host group (:func:`_host_groups`), inside that only per (scheme,
    method) that both have, and there :func:`_path_collision` finds a path overlap without
    comparing pairs. A member list already checked (another method, another host with the
    same bindings) is not checked again, so five default methods cost one sweep.
    """
    done: set[tuple[tuple[int, ...], tuple[bool, ...]]] = set()
    for _key, group in sorted(_host_groups(bindings).items()):
        if len(group) < 2 or not any(owner for owner, _ in group.values()):
            continue
        owns = {i: owner for i, (owner, _) in group.items()}
        by_verb: dict[tuple[str, str], list[int]] = {}
        for i in group:  # ascending: groups are filled in binding order
            match = bindings[i].match
            for scheme in match.schemes:
                for method in match.methods:
                    by_verb.setdefault((scheme, method), []).append(i)
        for members in by_verb.values():
            if len(members) < 2:
                continue
            signature = (tuple(members), tuple(owns[i] for i in members))
            if signature in done or not any(signature[1]):
                continue
            done.add(signature)
            found = _path_collision(members, owns, bindings)
            if found is not None:
                i, j = sorted(found)
                return i, j, group[i][1], group[j][1]
    return None


def check_ambiguity(bindings: Iterable[Binding]) -> None:
    """Refuse two bindings that could both claim one request at the same precedence (§6).

    Overlap = schemes overlap ∧ methods overlap ∧ a path pair overlaps ∧ a same-kind host pair
    overlaps. Exact and wildcard hosts never conflict (the exact one wins in the MITM). When
    several pairs collide, one of them is named (the message says which and why).
    """
    ordered = sorted(bindings, key=lambda b: b.name)
    found = _find_ambiguous(ordered)
    if found is None:
        return
    i, j, host_a, host_b = found
    a, b = ordered[i], ordered[j]
    schemes = [s for s in a.match.schemes if s in b.match.schemes]
    methods = [m for m in a.match.methods if m in frozenset(b.match.methods)]
    paths = _path_pair(a.match.paths, b.match.paths)
    assert schemes and methods and paths is not None  # what _find_ambiguous established
    hosts = echo(host_a) if host_a == host_b else f"{echo(host_a)} / {echo(host_b)}"
    raise VaultError(
        f"{echo(a.name)} and {echo(b.name)} are ambiguous: both match host {hosts}, "
        f"scheme {echo(schemes[0])}, method {echo(methods[0])} and path {echo(paths[0])} / {echo(paths[1])}",
        "bindings",
    )


def _probe_name(host: str) -> str:
    suffix = _wildcard_suffix(host)
    return host if suffix is None else f"probe.{suffix}"


def host_covered(policy: NetworkPolicy, host: str) -> bool:
    """The host (wildcards probed as ``probe.<suffix>``) evaluates to allow **and** an explicit
    allow rule names it: a domain rule equal to the host, or a ``*.`` rule matching the probe.
    defaultAction allow alone never covers."""
    probe = _probe_name(host)
    if evaluate_domain(policy, probe).verdict is not Verdict.ALLOW:
        return False
    for rule in policy.egress:
        if rule.kind is not TargetKind.DOMAIN or rule.action is not Verdict.ALLOW:
            continue
        if rule.target == host:
            return True
        if rule.target.startswith("*.") and domain_matches(rule.target, probe):
            return True
    return False


def check_coverage(bindings: Iterable[Binding], policy: NetworkPolicy | None) -> None:
    """Every binding host is covered by ``policy`` (§6 Coverage); bindings need a policy."""
    ordered = sorted(bindings, key=lambda b: b.name)
    if not ordered:
        return
    if policy is None:
        raise VaultError(
            "credential bindings require an egress policy, and there is none to check them against",
            "bindings",
        )
    for binding in ordered:
        for k, host in enumerate(binding.match.hosts):
            if not host_covered(policy, host):
                raise VaultError(
                    f"host {echo(host)} is not covered by an explicit allow rule of the egress policy",
                    f"{_binding_label(binding)}.match.hosts[{k}]",
                )


def check_ignore_hosts(bindings: Iterable[Binding], ignore_hosts: Sequence[re.Pattern[str]]) -> None:
    """No binding host (wildcards probed as ``probe.<suffix>``) may match a mitmproxy
    ``ignore_hosts`` pattern, tried on ``host`` and ``host:port`` for each of its schemes."""
    if not ignore_hosts:
        return
    for binding in sorted(bindings, key=lambda b: b.name):
        ports = [SCHEME_PORTS[s] for s in binding.match.schemes]
        for k, host in enumerate(binding.match.hosts):
            probe = _probe_name(host)
            candidates = [probe, *(f"{probe}:{p}" for p in ports)]
            if any(rex.search(c) for rex in ignore_hosts for c in candidates):
                raise VaultError(
                    f"host {echo(host)} matches the MITM ignore_hosts list, so it can never be injected",
                    f"{_binding_label(binding)}.match.hosts[{k}]",
                )


def check_size(credentials: int, bindings: Iterable[Binding], limits: VaultLimits = DEFAULT_LIMITS) -> None:
    """A whole candidate within the caps (14.7): what a PATCH adds on top of an existing vault
    counts with what is already there."""
    items = list(bindings)
    if credentials > limits.credentials:
        raise _over_limit("credentials", credentials, limits.credentials, "credentials")
    if len(items) > limits.bindings:
        raise _over_limit("bindings", len(items), limits.bindings, "bindings")
    for b in items:
        if len(b.match.hosts) > limits.hosts_per_binding:
            raise _over_limit(
                "hosts", len(b.match.hosts), limits.hosts_per_binding, f"{_binding_label(b)}.match.hosts"
            )
        if len(b.match.paths) > limits.paths_per_binding:
            raise _over_limit(
                "paths", len(b.match.paths), limits.paths_per_binding, f"{_binding_label(b)}.match.paths"
            )


def validate_candidate(
    credentials: Mapping[str, Credential],
    bindings: Iterable[Binding],
    policy: NetworkPolicy | None,
    ignore_hosts: Sequence[re.Pattern[str]] = (),
    limits: VaultLimits = DEFAULT_LIMITS,
) -> None:
    """The whole-vault checks, in order: size, references, ambiguity, coverage, ignore_hosts."""
    ordered = sorted(bindings, key=lambda b: b.name)
    check_size(len(credentials), ordered, limits)
    check_references(credentials, ordered)
    check_ambiguity(ordered)
    check_coverage(ordered, policy)
    check_ignore_hosts(ordered, ignore_hosts)
