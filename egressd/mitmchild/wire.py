"""Strict reading of the ``_active`` body (docs/reference/behaviour.md §10) on the MITM side.

The addon must treat any body it cannot fully trust as a lookup failure (and block the
client), never as "no credentials": so every field is checked and anything unexpected raises
:class:`WireError`. Pure: no I/O. Error texts never quote values (they are credentials).
"""

from __future__ import annotations

from typing import Any

from egressd.mitm.protocol import bare_etag
from egressd.vault.snapshot import ActiveBinding, ActiveSubstitution, InjectedHeader, VaultSnapshot
from egressd.vault.types import Match

_SURFACES = frozenset({"path", "query", "header", "body"})


class WireError(ValueError):
    """The ``_active`` body does not have the §10 schema (the message names the field only)."""


def _obj(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{where}: not an object")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise WireError(f"{where}: not an array")
    return value


def _str(value: object, where: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise WireError(f"{where}: not a non-empty string")
    return value


def _strs(value: object, where: str) -> tuple[str, ...]:
    items = tuple(_str(v, where) for v in _list(value, where))
    if not items:
        raise WireError(f"{where}: empty")
    return items


def _match(value: object, where: str) -> Match:
    m = _obj(value, where)
    return Match(
        hosts=tuple(h.lower() for h in _strs(m.get("hosts"), f"{where}.hosts")),
        schemes=tuple(s.lower() for s in _strs(m.get("schemes"), f"{where}.schemes")),
        methods=tuple(x.upper() for x in _strs(m.get("methods"), f"{where}.methods")),
        paths=_strs(m.get("paths"), f"{where}.paths"),
    )


def _binding(value: object, i: int) -> ActiveBinding:
    where = f"bindings[{i}]"
    b = _obj(value, where)
    headers = tuple(
        InjectedHeader(
            _str(_obj(h, f"{where}.headers").get("name"), f"{where}.headers.name"),
            _str(h.get("value"), f"{where}.headers.value"),
        )
        for h in _list(b.get("headers", []), f"{where}.headers")
    )
    subs: list[ActiveSubstitution] = []
    for s in _list(b.get("substitutions", []), f"{where}.substitutions"):
        sub = _obj(s, f"{where}.substitutions")
        surfaces = tuple(_str(x, f"{where}.substitutions.in") for x in _list(sub.get("in"), "in"))
        if not surfaces or not set(surfaces) <= _SURFACES:
            raise WireError(f"{where}.substitutions.in: invalid")
        subs.append(
            ActiveSubstitution(
                _str(sub.get("placeholder"), f"{where}.substitutions.placeholder"),
                _str(sub.get("value"), f"{where}.substitutions.value"),
                surfaces,
            )
        )
    return ActiveBinding(
        _str(b.get("name"), f"{where}.name"), _match(b.get("match"), where), headers, tuple(subs)
    )


def snapshot_from_active(body: object, etag: str) -> VaultSnapshot:
    """The snapshot for a 200 ``_active`` reply; ``etag`` is the quoted or bare ETag value."""
    tag = bare_etag(etag)
    if not tag:
        raise WireError("ETag: missing")
    doc = _obj(body, "body")
    revision = doc.get("revision")
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
        raise WireError("revision: not a positive integer")
    bindings = tuple(_binding(b, i) for i, b in enumerate(_list(doc.get("bindings"), "bindings")))
    redactions = tuple(_str(r, "redactions", empty=True) for r in _list(doc.get("redactions"), "redactions"))
    incarnation = tag.rsplit("-", 1)[0]
    return VaultSnapshot(
        tag=tag,
        incarnation=incarnation,
        revision=revision,
        bindings=bindings,
        redactions=tuple(sorted({r for r in redactions if r}, key=lambda r: (-len(r), r))),
    )
