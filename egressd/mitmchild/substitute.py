"""Placeholder substitution (docs/reference/behaviour.md §10): the values of a binding's ``substitutions``
put in the request's path, query, headers or body, each encoded for where it lands. Pure.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from typing import Final, Literal
from urllib.parse import quote, quote_plus

from egressd.mitmchild.injectdata import Surface
from egressd.vault.snapshot import ActiveBinding, ActiveSubstitution


def substitute(text: str, replacements: Iterable[tuple[str, str]]) -> tuple[str, int]:
    """Replace literal, case-sensitive placeholders: longest placeholder first (ties by
    placeholder text), each occurrence claimed on the **original** text, so a replacement is
    never rescanned for other placeholders. Returns the text and the number of replacements.
    """
    ordered = sorted({p: v for p, v in replacements if p}.items(), key=lambda r: (-len(r[0]), r[0]))
    if not text or not ordered:
        return text, 0
    starts: list[int] = []
    ends: list[int] = []
    chosen: list[tuple[int, int, str]] = []
    for placeholder, value in ordered:
        i = text.find(placeholder)
        while i >= 0:
            j = i + len(placeholder)
            k = bisect.bisect_right(starts, i)
            free = (k == 0 or ends[k - 1] <= i) and (k == len(starts) or starts[k] >= j)
            if free:
                starts.insert(k, i)
                ends.insert(k, j)
                chosen.append((i, j, value))
                i = text.find(placeholder, j)
            else:
                i = text.find(placeholder, i + 1)
    if not chosen:
        return text, 0
    chosen.sort()
    parts: list[str] = []
    pos = 0
    for i, j, value in chosen:
        parts.append(text[pos:i])
        parts.append(value)
        pos = j
    parts.append(text[pos:])
    return "".join(parts), len(chosen)


def encoded_replacements(
    substitutions: Iterable[ActiveSubstitution],
    surface: Surface,
    encode: Literal["url", "json", "form", "raw"],
) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for s in substitutions:
        if surface not in s.in_ or not s.placeholder:
            continue
        match encode:
            case "url":
                value = quote(s.value, safe="")
            case "json":
                value = json.dumps(s.value)[1:-1]
            case "form":
                value = quote_plus(s.value, safe="")
            case "raw":
                value = s.value
        out.append((s.placeholder, value))
    return out


_UTF8_CHARSETS: Final = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})


def _identity_encoding(content_encoding: str | None) -> bool:
    if content_encoding is None:
        return True
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    return all(c == "identity" for c in codings)


def _body_encoding(content_type: str | None) -> Literal["json", "form", "raw", "skip"]:
    """How a body substitution value is encoded for this content type; ``skip`` for
    multipart and for an explicit charset other than UTF-8/ASCII."""
    if content_type is None:
        return "raw"
    if "," in content_type:
        # Two Content-Type headers reach us joined ("text/plain, application/json"): the
        # server may parse the body as either, so no encoding is safe for both.
        return "skip"
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    if media.startswith("multipart/"):
        return "skip"
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in _UTF8_CHARSETS:
            return "skip"
    if media == "application/json" or media.endswith("+json"):
        return "json"
    if media == "application/x-www-form-urlencoded":
        return "form"
    return "raw"


def substitute_body(
    binding: ActiveBinding,
    body: bytes | None,
    content_type: str | None,
    content_encoding: str | None,
    transfer_encoding: str | None = None,
) -> bytes | None:
    """The body with the binding's ``body`` substitutions applied, or None when nothing
    changed or the body is skipped: streamed (None), an ambiguous content type (a comma: two
    ``Content-Type`` headers joined), compressed (a content-encoding other than
    identity, or a transfer-encoding other than plain ``chunked``: the bytes the proxy holds
    are then not the bytes the server decodes), multipart, a non-UTF-8 charset, or bytes that
    are not UTF-8.

    JSON bodies (``application/json``, ``*+json``) get values JSON-escaped for a string
    context (``json.dumps(v)[1:-1]``), ``application/x-www-form-urlencoded`` bodies form-encoded,
    other bodies the raw value."""
    if body is None or not body or not _identity_encoding(content_encoding):
        return None
    if transfer_encoding is not None and transfer_encoding.strip().lower() != "chunked":
        return None
    encoding = _body_encoding(content_type)
    if encoding == "skip":
        return None
    replacements = encoded_replacements(binding.substitutions, "body", encoding)
    if not replacements:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    new_text, count = substitute(text, replacements)
    return new_text.encode("utf-8") if count else None
