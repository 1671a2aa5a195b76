"""Request paths as a server may read them: percent-decoding layers and the path tricks that
make one path mean another (docs/reference/behaviour.md §10, §19). Pure.

Shared by the MITM's credential decision (a binding's paths) and the policy's request rules
(a rule's paths): both must refuse the same tricks.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import unquote

MAX_DECODE_LAYERS: Final = 8


def has_dot_dot_segment(path: str) -> bool:
    """A ``..`` segment, also with ``;params`` (``..;`` is ``..`` to some servers)."""
    return any(segment.split(";", 1)[0] == ".." for segment in path.split("/"))


def decode_layers(path: str) -> list[str] | None:
    """``[path, decoded once, decoded twice, ...]`` until percent-decoding changes nothing;
    None if it still changes after :data:`MAX_DECODE_LAYERS` rounds."""
    layers = [path]
    for _ in range(MAX_DECODE_LAYERS):
        decoded = unquote(layers[-1], errors="surrogateescape")
        if decoded == layers[-1]:
            return layers
        layers.append(decoded)
    return None


def structural_problem(layers: list[str] | None, *, allow_nested: bool) -> bool:
    """Undecodable, a backslash, a NUL (``%00``: the end of the path to a C server) or a ``..``
    segment at any depth, or (unless ``allow_nested``) an escape that survives one decoding
    (``%252e``)."""
    if layers is None:
        return True
    if any("\\" in layer or "\x00" in layer or has_dot_dot_segment(layer) for layer in layers):
        return True
    return not allow_nested and len(layers) > 2


#: What no request-target carries on the wire (RFC 9112 §3.2, RFC 3986): whitespace, control
#: characters, a fragment. HTTP/2 lets a ``:path`` carry spaces and tabs, HTTP/1 a raw ``#``, and
#: mitmproxy writes the target upstream as it came: ``GET /admin x HTTP/1.1`` is ``/admin`` to a
#: server that splits the request line on whitespace, ``/repos/#/../../user`` is ``/user`` to one
#: that keeps ``#`` in the path and removes dot segments.
_UNSAFE_TARGET: Final = re.compile(r"[\x00-\x20\x7f#]")


def target_problem(target: str) -> bool:
    """True when the request-target as sent (path and query) holds whitespace, a control
    character or a ``#``: servers disagree about what it names, so it is refused."""
    return _UNSAFE_TARGET.search(target) is not None


_SLASHES: Final = re.compile(r"/{2,}")


def canonical(path: str) -> str:
    """What a lenient server makes of ``path``: ``;params`` dropped from every segment, runs of
    ``/`` collapsed, ``.`` segments removed (``..`` never gets here: it is refused first)."""
    text = _SLASHES.sub("/", "/".join(segment.split(";", 1)[0] for segment in path.split("/")))
    parts = text.split("/")[1:] if text.startswith("/") else text.split("/")
    kept = [p for p in parts if p not in (".", "")]
    out = "/" + "/".join(kept)
    return out + "/" if kept and parts and parts[-1] in (".", "") else out


def readings(path: str) -> tuple[str, ...] | None:
    """Every way a server may read ``path`` (the query already dropped): as sent, decoded once,
    and each of those :func:`canonical`; None when it is a path trick (refused whatever the
    rules say). A request is admitted only when every reading is."""
    layers = decode_layers(path)
    if structural_problem(layers, allow_nested=False):
        return None
    assert layers is not None
    out: list[str] = []
    for layer in layers:
        for form in (layer, canonical(layer) if layer.startswith("/") else layer):
            if form not in out:
                out.append(form)
    return tuple(out)
