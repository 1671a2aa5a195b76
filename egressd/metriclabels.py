"""Constant labels on every sample of a Prometheus/OpenMetrics exposition (issue 15 item 3).

``OPENSANDBOX_EGRESS_SANDBOX_ID`` and ``OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS`` become labels
of every metric, as the reference puts them on every OTel instrument. They are added to the
rendered text, in one place, so the labels do not depend on how the registry is built: any
renderer of the text formats (egressd's own, prometheus_client's ``generate_latest``) can be
passed through :func:`with_constant_labels` unchanged.

Pure: text in, text out. ``# HELP``/``# TYPE``/``# EOF`` lines and exemplars (after `` # ``)
are left alone; a sample that already carries a label of the same name keeps its own value.
"""

from __future__ import annotations

from collections.abc import Sequence


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_block_end(line: str, start: int) -> int:
    """Index of the ``}`` closing the label block opened at ``start`` (quoted values may hold
    ``}``, ``,`` and escaped quotes); -1 when the line is malformed."""
    quoted = False
    i = start + 1
    while i < len(line):
        c = line[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "}":
            return i
        i += 1
    return -1


def _label_names(block: str) -> set[str]:
    """Names of a label block's pairs (``a="x",b="y"``, without the braces)."""
    names: set[str] = set()
    quoted = False
    start = 0
    i = 0
    while i < len(block):
        c = block[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "=":
            names.add(block[start:i].strip().lstrip(","))
        elif c == ",":
            start = i + 1
        i += 1
    return names


def add_to_sample(line: str, labels: Sequence[tuple[str, str]]) -> str:
    """One sample line with ``labels`` first in its label block."""
    cut = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
    if cut <= 0:
        return line
    name = line[:cut]
    if line[cut] == "{":
        end = _label_block_end(line, cut)
        if end < 0:
            return line
        own = line[cut + 1 : end]
        rest = line[end + 1 :]
    else:
        own, rest = "", line[cut:]
    taken = _label_names(own)
    parts = [f'{k}="{escape_label_value(v)}"' for k, v in labels if k not in taken]
    if own:
        parts.append(own)
    if not parts:
        return line
    return f"{name}{{{','.join(parts)}}}{rest}"


def with_constant_labels(text: str, labels: Sequence[tuple[str, str]]) -> str:
    """``text`` (an exposition) with ``labels`` on every sample."""
    if not labels:
        return text
    lines = text.split("\n")
    return "\n".join(ln if not ln or ln.startswith("#") else add_to_sample(ln, labels) for ln in lines)
