"""Text that reaches an operator's terminal, with every control character made visible
(docs/reference/behaviour.md §20.3). Pure.

Names a tenant, a sandbox or an upstream chooses (vault items, subject ids, DNS names, SNI,
paths) end up in ``egressctl`` output and in console-format log lines. Printed raw, an escape
sequence in one of them rewrites the operator's screen or window title, or forges output.
:func:`visible` replaces each such character by a backslash escape; text without one is
returned unchanged, and escaping twice changes nothing more (the escapes are printable).
"""

from __future__ import annotations

import json
import unicodedata
from typing import Final

_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Unicode's own invisible controls: format characters (bidi overrides, zero-width joiners),
# line and paragraph separators, lone surrogates (which would not even encode).
_INVISIBLE: Final = frozenset({"Cf", "Zl", "Zp", "Cs"})


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    if code < 0x20 or 0x7F <= code <= 0x9F:  # C0 (ESC included), DEL, C1 (CSI, OSC, ...)
        return f"\\x{code:02x}"
    if unicodedata.category(ch) in _INVISIBLE:
        return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    return ch


def visible(text: str) -> str:
    """``text`` with C0 and C1 controls, DEL and Unicode's invisible format characters escaped
    (``\\x1b``, ``\\u202e``); printable text, non-ASCII letters included, is left as it is."""
    if text.isprintable():
        return text
    return "".join(_escape(ch) for ch in text)


def json_line(obj: object) -> str:
    """``obj`` as one JSON line whose every control character is an escape: ``json.dumps``
    escapes C0 and (``ensure_ascii``) everything past ASCII, but leaves DEL as it is."""
    return json.dumps(obj, separators=(", ", ": ")).replace("\x7f", "\\u007f")
