"""The credential vault documents (docs/behaviour.md §6, OSEP-0012): parsing, validation, checks.

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
    "compile_ignore_hosts",
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
    """How big one vault may be (docs/behaviour.md §14.7). Every count is checked on the raw JSON array
    before its items are parsed, so an oversized body costs no more than reading its length.
    ``env`` names what the operator can change (the per-binding caps are fixed).

    ``ignore_hosts`` are the MITM's pass-through patterns (``OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS``):
    a binding host matching one is refused like an oversized vault, since it could never be
    injected (§6). They travel with the caps because every vault write is held to both."""

    credentials: int = 256  # EGRESSD_VAULT_MAX_CREDENTIALS
    bindings: int = 256  # EGRESSD_VAULT_MAX_BINDINGS
    hosts_per_binding: int = 64
    paths_per_binding: int = 64
    # OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH: a binding must name its methods
    # and paths, and no path may cover the whole host. Carried here because every write path
    # (proxy route, pending replay, sealed vault, sidecar) already threads the limits through.
    require_scoped_match: bool = False
    ignore_hosts: tuple[re.Pattern[str], ...] = ()


def compile_ignore_hosts(patterns: Iterable[str]) -> tuple[re.Pattern[str], ...]:
    """mitmproxy's ``ignore_hosts`` semantics: searched (not anchored), case-insensitively.
    Raises :class:`re.error` for a pattern that does not compile."""
    return tuple(re.compile(p, re.IGNORECASE) for p in patterns)


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
    """A non-blank name (credential, binding, reference) of printable characters only, without
    spaces at its ends (docs/behaviour.md §20.3, which wins over §6's trimming): names are shown
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

    A Unicode host becomes its A-labels (IDNA 2008 / UTS-46, docs/behaviour.md §14.3), the form the
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


def _lowest_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _host_neighbours(bindings: Sequence[Binding]) -> list[int]:
    """For each binding, the bitmask of the other bindings it shares a same-kind overlapping
    host with: an equal exact host, or wildcard suffixes equal or nested.

    ``*.s`` of binding i meets the owners of ``*.s``, the bindings with a wildcard strictly
    below ``s`` and the owners of every wildcard above ``s``; siblings (``*.a.s`` /
    ``*.b.s``) never meet. O(hosts + labels) mask operations.
    """
    exact: dict[str, int] = {}
    own: dict[str, int] = {}
    below: dict[str, int] = {}  # suffix -> bindings with a wildcard strictly below it
    for i, b in enumerate(bindings):
        bit = 1 << i
        for host in b.match.hosts:
            suffix = _wildcard_suffix(host)
            if suffix is None:
                exact[host] = exact.get(host, 0) | bit
                continue
            own[suffix] = own.get(suffix, 0) | bit
            for ancestor in list(_ancestors(suffix))[1:]:
                below[ancestor] = below.get(ancestor, 0) | bit
    out: list[int] = []
    for b in bindings:
        mask = 0
        for host in b.match.hosts:
            suffix = _wildcard_suffix(host)
            if suffix is None:
                mask |= exact[host]
                continue
            mask |= own[suffix] | below.get(suffix, 0)
            for ancestor in list(_ancestors(suffix))[1:]:
                mask |= own.get(ancestor, 0)
        out.append(mask)
    return out


def _value_neighbours(values: Sequence[Sequence[str]]) -> list[int]:
    """For each binding, the bitmask of the bindings sharing at least one of its values."""
    holders: dict[str, int] = {}
    for i, items in enumerate(values):
        for v in items:
            holders[v] = holders.get(v, 0) | (1 << i)
    out: list[int] = []
    for items in values:
        mask = 0
        for v in items:
            mask |= holders[v]
        out.append(mask)
    return out


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


def _path_reach(bindings: Sequence[Binding]) -> list[int]:
    """For each binding i, the bitmask of the bindings j with a path that one of i's patterns
    reaches: an equal string, or, for ``p*``, any string starting with ``p``. Overlap is
    "j in reach[i] or i in reach[j]" (a literal inside someone's ``q*`` is seen from there).

    All paths are sorted once; each pattern's partners are one contiguous range of that
    order, whose OR comes from a segment tree: O(m log m) for m paths in all.
    """
    entries = sorted((p, i) for i, b in enumerate(bindings) for p in b.match.paths)
    fulls = [p for p, _ in entries]
    size = 1
    while size < max(1, len(entries)):
        size *= 2
    tree = [0] * (2 * size)
    for k, (_, i) in enumerate(entries):
        tree[size + k] = 1 << i
    for k in range(size - 1, 0, -1):
        tree[k] = tree[2 * k] | tree[2 * k + 1]

    def range_or(lo: int, hi: int) -> int:
        mask = 0
        lo += size
        hi += size
        while lo < hi:
            if lo & 1:
                mask |= tree[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                mask |= tree[hi]
            lo //= 2
            hi //= 2
        return mask

    reach = [0] * len(bindings)
    for path, i in entries:
        if path.endswith("*"):
            lo = bisect_left(fulls, path[:-1])
            hi = _prefix_end(fulls, lo, path[:-1])
        else:
            lo, hi = bisect_left(fulls, path), bisect_right(fulls, path)
        reach[i] |= range_or(lo, hi)
    return reach


def _first_ambiguous(bindings: Sequence[Binding]) -> tuple[int, int] | None:
    """The smallest index pair ``(i, j)``, ``i < j``, of bindings that overlap on all four
    dimensions: the very pair the old all-pairs check reported first.

    Each dimension is a symmetric "shares something" relation held as one bitmask of
    bindings per binding (hosts, schemes, methods), or, for paths, a one-sided reach; their
    AND is the set of colliding partners. Nothing is ever built per pair or per
    (host, method, path) combination: O(N log N) for N hosts, methods and paths in all, in
    operations on n-bit masks (n bindings: at most 256 under the caps, four machine words).
    """
    n = len(bindings)
    hosts = _host_neighbours(bindings)
    schemes = _value_neighbours([b.match.schemes for b in bindings])
    methods = _value_neighbours([b.match.methods for b in bindings])
    reach = _path_reach(bindings)
    common = [hosts[i] & schemes[i] & methods[i] & ~(1 << i) for i in range(n)]
    # j collides with i iff j in common[i] & reach[i], or i in common[j] & reach[j].
    collide = [common[i] & reach[i] for i in range(n)]
    first: int | None = None
    for i, mask in enumerate(collide):
        if mask >> (i + 1):
            first = i if first is None else min(first, i)
        if mask and (low := _lowest_bit(mask)) < i:
            first = low if first is None else min(first, low)
    if first is None:
        return None
    above = collide[first] >> (first + 1)
    best = first + 1 + _lowest_bit(above) if above else n
    for j in range(first + 1, best):
        if collide[j] >> first & 1:
            best = j
            break
    return first, best


def _host_witness(bindings: Sequence[Binding], i: int, j: int) -> tuple[str, str]:
    """The host pair the old check named for ``(i, j)``: the exact host both list that
    appears first in the vault, else the first wildcard pair met in the old loop order."""
    exact_rank: dict[str, int] = {}
    wild_rank: dict[str, int] = {}
    for binding in bindings:
        for host in binding.match.hosts:
            suffix = _wildcard_suffix(host)
            if suffix is None:
                exact_rank.setdefault(host, len(exact_rank))
            else:
                wild_rank.setdefault(suffix, len(wild_rank))
    a, b = bindings[i].match.hosts, bindings[j].match.hosts
    shared = set(a) & {h for h in b if not h.startswith("*.")}
    if shared:
        host = min(shared, key=exact_rank.__getitem__)
        return host, host
    wild = {i: {h[2:] for h in a if h.startswith("*.")}, j: {h[2:] for h in b if h.startswith("*.")}}
    for suffix in sorted(wild[i] | wild[j], key=wild_rank.__getitem__):
        for ancestor in _ancestors(suffix):
            for x, y in ((i, j), (j, i)):
                if suffix in wild[x] and ancestor in wild[y]:
                    return (f"*.{suffix}", f"*.{ancestor}") if x == i else (f"*.{ancestor}", f"*.{suffix}")
    raise AssertionError("no overlapping host pair")  # _first_ambiguous established one


def check_ambiguity(bindings: Iterable[Binding]) -> None:
    """Refuse two bindings that could both claim one request at the same precedence (§6).

    Overlap = schemes overlap ∧ methods overlap ∧ a path pair overlaps ∧ a same-kind host pair
    overlaps. Exact and wildcard hosts never conflict (the exact one wins in the MITM). The
    pair named is the first in name order, with the same witnesses as before 14.7.
    """
    ordered = sorted(bindings, key=lambda b: b.name)
    found = _first_ambiguous(ordered)
    if found is None:
        return
    i, j = found
    a, b = ordered[i], ordered[j]
    host_a, host_b = _host_witness(ordered, i, j)
    b_methods = frozenset(b.match.methods)
    schemes = [s for s in a.match.schemes if s in b.match.schemes]
    methods = [m for m in a.match.methods if m in b_methods]
    paths = _path_pair(a.match.paths, b.match.paths)
    assert schemes and methods and paths is not None  # what _first_ambiguous established
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


class _DomainIndex:
    """A policy's domain rules indexed for :func:`host_covered`'s two questions, O(labels) per
    host instead of a walk over every rule (14.7: a vault of 16 384 hosts against a policy of
    4096 rules would otherwise be 67 M rule matches). Same answers as the walk: the first
    matching rule is the one with the lowest index among the exact target and the ``*.``
    targets of the name's proper ancestors."""

    def __init__(self, policy: NetworkPolicy) -> None:
        self.policy = policy
        self.first: dict[str, int] = {}  # target -> index of its first domain rule
        self.allow: set[str] = set()  # targets of allow domain rules
        for k, rule in enumerate(policy.egress):
            if rule.kind is not TargetKind.DOMAIN:
                continue
            self.first.setdefault(rule.target, k)
            if rule.action is Verdict.ALLOW:
                self.allow.add(rule.target)

    def _wildcards(self, name: str) -> Iterable[str]:
        """``*.`` targets that may match ``name``: one per proper ancestor."""
        for ancestor in list(_ancestors(name))[1:]:
            yield f"*.{ancestor}"

    def verdict(self, name: str) -> Verdict:
        best = self.first.get(name)
        for target in self._wildcards(name):
            k = self.first.get(target)
            if k is not None and (best is None or k < best):
                best = k
        return self.policy.default_action if best is None else self.policy.egress[best].action

    def covers(self, host: str) -> bool:
        probe = _probe_name(host)
        if self.verdict(probe) is not Verdict.ALLOW:
            return False
        return host in self.allow or any(t in self.allow for t in self._wildcards(probe))


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
    index = _DomainIndex(policy)
    seen: dict[str, bool] = {}  # hosts repeat across bindings: each is decided once
    for binding in ordered:
        for k, host in enumerate(binding.match.hosts):
            covered = seen.get(host)
            if covered is None:
                covered = seen[host] = index.covers(host)
            if not covered:
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
    check_ignore_hosts(ordered, (*ignore_hosts, *limits.ignore_hosts))
