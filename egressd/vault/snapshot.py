"""The MITM's view of one vault revision (docs/reference/behaviour.md §6, §10): bindings with their
credential values resolved into the headers and substitutions to inject, and the redaction set.
:meth:`egressd.vault.store.VaultStore.snapshot` builds it; the MITM's private ``/_active``
endpoint serves it. **Holds credential values**: never for the HTTP API or logs."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import quote, quote_plus

from egressd.vault.types import REDACTED, AuthType, Binding, Credential, Match

__all__ = ["ActiveBinding", "ActiveSubstitution", "InjectedHeader", "VaultSnapshot", "build_snapshot"]


@dataclass(frozen=True, slots=True)
class InjectedHeader:
    """A header the MITM sets (after deleting same-name headers, case-insensitively)."""

    name: str
    value: str = field(repr=False)

    def __repr__(self) -> str:
        return f"InjectedHeader(name={self.name!r}, value={REDACTED})"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class ActiveSubstitution:
    placeholder: str = field(repr=False)
    value: str = field(repr=False)
    in_: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"ActiveSubstitution(placeholder={REDACTED}, value={REDACTED}, in_={self.in_!r})"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class ActiveBinding:
    name: str
    match: Match
    headers: tuple[InjectedHeader, ...]
    substitutions: tuple[ActiveSubstitution, ...]


@dataclass(frozen=True, slots=True)
class VaultSnapshot:
    """Immutable injection view of one vault revision.

    ``tag`` is ``"<incarnation>-<revision>"`` and changes on every mutation, including
    delete -> recreate. ``bindings`` are sorted by name; ``redactions`` (longest first) are the
    strings to replace by ``[REDACTED]`` in what comes back to the sandbox (response headers,
    trailers, bodies, WebSocket messages): every credential value raw, URL-, form- and
    JSON-escaped, ``Bearer <v>`` / ``Basic <v>``, a basic credential's decoded ``user:password``
    and (from 8 characters) its password in the same encodings, every placeholder.
    """

    tag: str
    incarnation: str
    revision: int
    bindings: tuple[ActiveBinding, ...]
    redactions: tuple[str, ...] = field(repr=False)

    def __repr__(self) -> str:
        return (
            f"VaultSnapshot(tag={self.tag!r}, revision={self.revision}, bindings={self.bindings!r}, "
            f"redactions=<{len(self.redactions)} redacted>)"
        )

    __str__ = __repr__

    def to_json(self) -> dict[str, Any]:
        """The ``/credential-vault/_active`` body (§10). **Contains credential values**: only
        for the private MITM socket, never for the HTTP API or logs."""
        return {
            "revision": self.revision,
            "bindings": [
                {
                    "name": b.name,
                    "match": b.match.to_json(),
                    "headers": [{"name": h.name, "value": h.value} for h in b.headers],
                    "substitutions": [
                        {"placeholder": s.placeholder, "value": s.value, "in": list(s.in_)}
                        for s in b.substitutions
                    ],
                }
                for b in self.bindings
            ],
            "redactions": list(self.redactions),
        }


def _encodings(value: str) -> Iterable[str]:
    yield value
    yield quote(value, safe="")
    yield quote_plus(value, safe="")
    yield json.dumps(value)[1:-1]
    yield json.dumps(value, ensure_ascii=False)[1:-1]


#: A basic credential's password is redacted on its own from this length on: a shorter one
#: would take ordinary words out of every body (and is no secret worth the name).
BASIC_PASSWORD_MIN: Final = 8


def _basic_secrets(value: str) -> Iterable[str]:
    """A basic credential is ``base64(user:password)`` on the wire; an upstream that echoes what
    it decoded shows ``user:password`` or the password: redacted too (a value that is not
    base64 of UTF-8 ``user:password`` has nothing more to give)."""
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return
    _user, sep, password = decoded.partition(":")
    if not sep or not password:
        return
    yield from _encodings(decoded)
    if len(password) >= BASIC_PASSWORD_MIN:
        yield from _encodings(password)


def _headers(binding: Binding, credentials: Mapping[str, Credential]) -> tuple[InjectedHeader, ...]:
    auth = binding.auth
    match auth.type:
        case AuthType.BEARER if auth.credential is not None:
            return (InjectedHeader("Authorization", f"Bearer {credentials[auth.credential].value}"),)
        case AuthType.BASIC if auth.credential is not None:
            return (InjectedHeader("Authorization", f"Basic {credentials[auth.credential].value}"),)
        case AuthType.API_KEY if auth.credential is not None and auth.name is not None:
            return (InjectedHeader(auth.name, credentials[auth.credential].value),)
        case AuthType.CUSTOM_HEADERS:
            return tuple(InjectedHeader(h.name, credentials[h.credential].value) for h in auth.headers)
        case _:
            return ()


def build_snapshot(
    tag: str,
    incarnation: str,
    revision: int,
    credentials: Mapping[str, Credential],
    vault_bindings: Iterable[Binding],
) -> VaultSnapshot:
    """The snapshot of one vault revision: ``credentials`` by name, ``vault_bindings`` sorted by name."""
    bindings: list[ActiveBinding] = []
    # Every credential in every encoding a substitution or an upstream may give it back in
    # (a redirect's Location carries it URL-encoded): the sandbox must never read it back.
    redactions: set[str] = set()
    for credential in credentials.values():
        redactions.update(_encodings(credential.value))
    for binding in vault_bindings:
        headers = _headers(binding, credentials)
        if binding.auth.type in (AuthType.BEARER, AuthType.BASIC):
            redactions.update(h.value for h in headers)
        if binding.auth.type is AuthType.BASIC and binding.auth.credential is not None:
            redactions.update(_basic_secrets(credentials[binding.auth.credential].value))
        subs: list[ActiveSubstitution] = []
        for s in binding.substitutions:
            value = credentials[s.credential].value
            subs.append(ActiveSubstitution(s.placeholder, value, s.in_))
            redactions.add(s.placeholder)
            redactions.update(_encodings(value))
        bindings.append(ActiveBinding(binding.name, binding.match, headers, tuple(subs)))
    redactions.discard("")
    return VaultSnapshot(
        tag=tag,
        incarnation=incarnation,
        revision=revision,
        bindings=tuple(bindings),
        redactions=tuple(sorted(redactions, key=lambda r: (-len(r), r))),
    )
