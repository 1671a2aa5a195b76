"""``GET /v1/subjects/{uid}/suggestion`` (``egressctl suggest UID``, docs/reference/behaviour.md §19):
the subject's user policy with allow rules in front that would have admitted its recent
denials. Read-only: it changes nothing; the operator applies it through SET_BINDING.

The ring (:class:`egressd.events.denials.RecentDenials`) carries what the suggestion needs:
the name, and where known the port, the method and the path (no query); this module turns its
entries into :class:`egressd.policy.suggest.Denied` and calls the pure
:func:`egressd.policy.suggest.suggest`.
"""

from __future__ import annotations

from typing import Any

from egressd.events.denials import Denial
from egressd.policy.model import NetworkPolicy
from egressd.policy.suggest import Denied, suggest


def as_denied(d: Denial) -> Denied:
    """A ring entry as the suggestion reads it; an operator always-deny is ``hard`` (no tenant
    rule can admit it)."""
    return Denied(
        host=d.name,
        port=d.port,
        transport="tcp" if d.port is not None else None,
        method=d.method,
        path=d.path,
        hard=d.rule.startswith("always-deny"),
    )


def suggestion(policy: NetworkPolicy, denials: list[Denial]) -> dict[str, Any]:
    return suggest(policy, [as_denied(d) for d in denials])
