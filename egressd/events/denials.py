"""The last few DNS denials of each subject, for ``egressctl subjects`` / ``watch`` (docs/reference/behaviour.md §15).

Bounded twice: a handful of entries per subject, and a cap on how many subjects are tracked
(entries go with their subject on removal or rebind; the cap only matters if that bookkeeping
were ever missed). An entry is the denied name, the rule that denied it and when: what the
denial log line already says, never anything the query carried besides its name.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from egressd.events.webhook import normalise_hostname, timestamp

PER_SUBJECT = 32
MAX_SUBJECTS = 65536
MAX_PATH = 512


@dataclass(frozen=True, slots=True)
class Denial:
    """``port``/``method``/``path`` (no query): where known, what ``egressctl suggest`` needs
    (docs/reference/behaviour.md §19): a refused connection's port, a refused request's method and path."""

    name: str
    rule: str
    at: float  # wall clock (seconds since the epoch)
    port: int | None = None
    method: str | None = None
    path: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "rule": self.rule, "at": timestamp(self.at)}
        if self.port is not None:
            out["port"] = self.port
        if self.method is not None:
            out["method"] = self.method
            out["path"] = self.path or "/"
        return out


class RecentDenials:
    def __init__(
        self,
        per_subject: int = PER_SUBJECT,
        max_subjects: int = MAX_SUBJECTS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._per_subject = per_subject
        self._max_subjects = max_subjects
        self._clock = clock
        self._rings: dict[str, deque[Denial]] = {}

    def add(
        self,
        uid: str,
        name: str,
        rule: str,
        *,
        port: int | None = None,
        method: str | None = None,
        path: str | None = None,
    ) -> None:
        ring = self._rings.get(uid)
        if ring is None:
            if len(self._rings) >= self._max_subjects:
                del self._rings[next(iter(self._rings))]  # the longest-tracked subject
            ring = self._rings[uid] = deque(maxlen=self._per_subject)
        if path is not None:
            path = path.split("?", 1)[0][:MAX_PATH]
        method = method[:32] if method is not None else None
        ring.append(Denial(normalise_hostname(name)[:253], rule[:64], self._clock(), port, method, path))

    def of(self, uid: str) -> list[Denial]:
        """Oldest first."""
        return list(self._rings.get(uid, ()))

    def forget(self, uid: str) -> None:
        self._rings.pop(uid, None)

    def __len__(self) -> int:
        return len(self._rings)
