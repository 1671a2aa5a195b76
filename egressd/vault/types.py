"""The credential vault's documents as values (docs/reference/behaviour.md §6, OSEP-0012): the frozen
dataclasses every other vault module passes around, the caps, and :class:`VaultError`.

Parsing is in :mod:`egressd.vault.parse`, the whole-vault checks in :mod:`egressd.vault.ambiguity`,
:mod:`egressd.vault.coverage` and :mod:`egressd.vault.validate`.

Everything in these modules is pure: decoded JSON in, frozen dataclasses out. Every rejection is a
:class:`VaultError` carrying the HTTP status (400 unless stated) and a one-line message that
names the offending field (``bindings[1].match.hosts[0]: ...``).

Secrecy rules, enforced throughout:

* a credential *value* never appears in an error message, in ``repr()``/``str()`` of any
  object defined here, or in the sanitized state;
* names (credential, binding, header), hosts, schemes, methods and paths may be echoed,
  ``repr()``'d and truncated to :data:`MAX_ECHO` characters;
* substitution placeholders are treated like values (they are part of the redaction set)
  and are never echoed either.

Substitutions are accepted inside ``auth`` (on every auth type) and stored on
:class:`Binding`; they never appear in the sanitized state (``CredentialAuthMetadata`` is
``{"type", "name"?}``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_METHODS",
    "DEFAULT_PATHS",
    "DEFAULT_SCHEMES",
    "MAX_ECHO",
    "REDACTED",
    "RESERVED_HEADERS",
    "SCHEME_PORTS",
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
    "compile_ignore_hosts",
    "echo",
]

MAX_ECHO: Final = 80
REDACTED: Final = "<redacted>"

DEFAULT_SCHEMES: Final[tuple[str, ...]] = ("https",)
DEFAULT_METHODS: Final[tuple[str, ...]] = ("GET", "POST", "PUT", "PATCH", "DELETE")
DEFAULT_PATHS: Final[tuple[str, ...]] = ("/*",)
SCHEME_PORTS: Final[Mapping[str, int]] = {"https": 443, "http": 80}

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

VaultStatus = Literal[400, 404, 409, 412]


@dataclass(frozen=True, slots=True)
class VaultLimits:
    """How big one vault may be (docs/reference/behaviour.md §14.7). Every count is checked on the raw JSON array
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


def _binding_label(binding: Binding) -> str:
    return f"bindings[{echo(binding.name)}]"


# --------------------------------------------------------------------------------------------
# Host names (an FQDN, or ``*.`` and an FQDN)


def _wildcard_suffix(host: str) -> str | None:
    return host[2:] if host.startswith("*.") else None


def _ancestors(suffix: str) -> Iterable[str]:
    """``a.b.x.com`` -> ``a.b.x.com``, ``b.x.com``, ``x.com``, ``com``."""
    parts = suffix.split(".")
    for i in range(len(parts)):
        yield ".".join(parts[i:])
