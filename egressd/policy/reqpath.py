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
    """Undecodable, a backslash or a ``..`` segment at any depth, or (unless ``allow_nested``)
    an escape that survives one decoding (``%252e``)."""
    if layers is None:
        return True
    if any("\\" in layer or has_dot_dot_segment(layer) for layer in layers):
        return True
    return not allow_nested and len(layers) > 2


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
