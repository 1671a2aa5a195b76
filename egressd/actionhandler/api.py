"""What the control plane answers its callers, and whom it tells about a subject's lifecycle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from egressd.subject.registry import Entry


@dataclass(frozen=True, slots=True)
class Result:
    """An action's answer: the HTTP status and, unless 200, the one-line reason."""

    status: int
    reason: str = ""


OK = Result(200)


class SubjectListener(Protocol):
    """Per-subject extras (vault, pending pushes, DNS leases) follow the subject's lifecycle."""

    async def registered(self, entry: Entry) -> None: ...  # after a successful non-null SET_BINDING

    async def unbound(self, uid: str) -> None: ...  # SET_BINDING(null)

    async def reset(self, uid: str) -> None: ...  # rebind or deny-first reinstall: drop learned state

    async def removed(self, uid: str) -> None: ...  # REMOVE_BINDING (also for absent uids)
