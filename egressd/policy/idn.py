"""Internationalised names as A-labels (docs/reference/behaviour.md §14.3), pure.

Queries reach the DNS proxy as A-labels (``xn--vil-9la.com``: that is what resolvers and the
DNS itself carry), so a policy or vault host written in Unicode (``évil.com``) must be turned
into the same A-labels at parse time, or a deny of ``évil.com`` would never match the query
that resolves it. Mapping is UTS-46 non-transitional (case folding, NFC, full-width dots as
label separators, ``ß`` kept: what current browsers do) and each non-ASCII label must then be
a valid IDNA 2008 label, else the name is refused.

ASCII names are left alone: they are already in the form queries use, and IDNA would reject
names that DNS allows and policies use today (``_dmarc.example.com``, underscores in service
labels). In a mixed name only the non-ASCII labels are converted, for the same reason.
"""

from __future__ import annotations

import re

import idna

# A quoted piece of idna's reason ("... of 'label' not allowed"): the label is user input.
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


class IdnaError(ValueError):
    """``str()`` is a short reason, fit for a 400 message after the offending input."""


def to_alabels(name: str) -> str:
    """``name`` with every non-ASCII label replaced by its A-label; ASCII input unchanged.

    A leading ``*.`` stays as it is (wildcards are a policy notion, not a label). Raises
    :class:`IdnaError` when a label is not valid IDNA 2008 after UTS-46 mapping.
    """
    if name.isascii():
        return name
    prefix = ""
    if name.startswith("*."):
        prefix, name = "*.", name[2:]
    try:
        mapped = idna.uts46_remap(name, std3_rules=False, transitional=False)
        labels = [
            label if label.isascii() else idna.alabel(label).decode("ascii") for label in mapped.split(".")
        ]
    except (idna.IDNAError, UnicodeError) as exc:
        # idna's reason can quote the label: that is input, and the caller decides whether input
        # may be echoed (it appends it as "(got ...)" where it may, see PolicyError.without_input),
        # so the quote is cut here; the rest (which codepoint, where) stays. Cut to one short line.
        reason = _QUOTED.sub("…", str(exc))[:100]
        raise IdnaError(f"not a valid internationalised domain name ({reason})") from None
    return prefix + ".".join(labels)
