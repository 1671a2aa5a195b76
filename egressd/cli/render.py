"""Human renderings for egressctl: aligned tables, key/value blocks, flattened JSON. Pure.

``--json`` output never goes through here: scripts get the daemon's documents unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from egressd.cli.client import one_line

__all__ = ["REDACTED", "flatten", "key_values", "redact_secrets", "table"]

REDACTED = "<redacted>"

#: Keys whose values are credential material in the vault's create shape (§6). The daemon
#: never returns them from the HTTP API; egressctl masks them anyway, so that a daemon bug
#: (or a different server behind ``--addr``) cannot make ``vault get`` print a secret.
_SECRET_KEYS = frozenset({"value", "placeholder"})


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns left-aligned on the widest cell, two spaces apart, no trailing blanks."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (headers, *rows)
    ]


def key_values(rows: Sequence[tuple[str, str]]) -> list[str]:
    """``key  value`` lines with the values aligned."""
    if not rows:
        return []
    width = max(len(k) for k, _ in rows)
    return [f"{key.ljust(width)}  {value}".rstrip() for key, value in rows]


def _cell(value: Any) -> str:
    """One table or ``key  value`` cell: ``-`` for nothing, else one visible line of at most 80 characters."""
    if value is None or value == "":
        return "-"
    return one_line(str(value), limit=80)


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return one_line(value, limit=200) if value else '""'
    if isinstance(value, int | float):
        return str(value)
    return one_line(json.dumps(value, separators=(",", ":")), limit=200)


def _item_key(index: int, item: Any) -> str:
    # Named items (credentials, bindings) are addressed by name: stable and readable.
    if isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"]:
        return str(item["name"])
    return str(index)


def flatten(doc: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``{"a": {"b": [1, 2]}, "c": [{"name": "x", "d": 1}]}`` -> ``a.b = 1, 2``, ``c.x.d = 1``.

    Lists of scalars become one comma-separated value, empty containers ``-``."""
    if isinstance(doc, dict):
        if not doc:
            return [(prefix or ".", "-")]
        out: list[tuple[str, str]] = []
        for key, value in doc.items():
            out.extend(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(doc, list):
        if not doc:
            return [(prefix or ".", "-")]
        if all(not isinstance(item, dict | list) for item in doc):
            return [(prefix or ".", ", ".join(_scalar(item) for item in doc))]
        out = []
        for index, item in enumerate(doc):
            key = _item_key(index, item)
            if isinstance(item, dict) and key == item.get("name"):
                item = {k: v for k, v in item.items() if k != "name"} or {"name": key}
            out.extend(flatten(item, f"{prefix}.{key}" if prefix else key))
        return out
    return [(prefix or ".", _scalar(doc))]


def redact_secrets(doc: Any) -> Any:
    """A copy of ``doc`` with every value under a secret-bearing key replaced."""
    if isinstance(doc, dict):
        return {k: REDACTED if k in _SECRET_KEYS else redact_secrets(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [redact_secrets(item) for item in doc]
    return doc
